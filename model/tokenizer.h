// The byte-level BPE tokenizer of a GGUF file (tokenizer.ggml.model "gpt2"): GPT-2's byte-to-
// character map, the file's vocabulary and ranked merges, and its pre-tokenizer — "gpt2" (GPT-2's
// split of letters, numbers, other symbols and whitespace) or "smollm" (every digit its own piece,
// then GPT-2's split). Special tokens (control tokens such as <|im_start|>) are matched in the text
// only when asked.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "model/gguf.h"

namespace tqkv::model {

class Tokenizer {
 public:
  // From tokenizer.ggml.{model, pre, tokens, token_type, merges, bos_token_id, eos_token_id}.
  // Throws tqkv::Error for another model or pre-tokenizer, or inconsistent metadata.
  static Tokenizer FromGguf(const GgufFile& file);

  // Token ids of `text` (UTF-8). With parse_special, the text of a control token becomes that
  // token; otherwise it is tokenized as plain text.
  std::vector<int32_t> Encode(std::string_view text, bool parse_special = false) const;
  // The bytes the ids stand for (control tokens as their text).
  std::string Decode(std::span<const int32_t> ids) const;

  int32_t vocab_size() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t bos_id() const { return bos_id_; }
  int32_t eos_id() const { return eos_id_; }
  const std::string& token(int32_t id) const;  // the vocabulary entry (byte-mapped characters)
  // The id of a vocabulary entry, or -1.
  int32_t Find(std::string_view token) const;
  // Whether `id` (a valid id) is a control token, which Decode gives as its text.
  bool IsControl(int32_t id) const { return special_.at(static_cast<size_t>(id)); }

  // Pre-tokenization alone (pieces of `text`, before the byte map and BPE). Exposed for tests.
  std::vector<std::string_view> PreTokenize(std::string_view text) const;

 private:
  void EncodePiece(std::string_view piece, std::vector<int32_t>& out) const;

  std::vector<std::string> tokens_;
  std::vector<bool> special_;  // control tokens
  std::unordered_map<std::string, int32_t> ids_;
  std::unordered_map<std::string, int32_t> merge_rank_;  // "left right" -> rank
  std::vector<int32_t> specials_;                        // ids of control tokens, longest first
  bool split_digits_ = false;
  int32_t bos_id_ = -1, eos_id_ = -1;
  std::string byte_char_[256];  // GPT-2's map: byte -> UTF-8 of its character
  std::unordered_map<std::string, uint8_t> char_byte_;
};

}  // namespace tqkv::model
