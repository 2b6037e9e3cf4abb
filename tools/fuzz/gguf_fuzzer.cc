// libFuzzer target: a GGUF file on arbitrary bytes (GgufFile::Parse, model/gguf.h), then what
// tqkv builds from one: the tokenizer (Tokenizer::FromGguf) and the Llama weights
// (LlamaModel::FromGguf).
//
// A tqkv::Error is the expected rejection of bad input. Anything else fails: any other
// exception, a crash, a sanitizer report, a leak, a hang (libFuzzer's -timeout: an empty control
// token once made Encode loop forever), or a tokenizer whose Decode does not give back the text
// it encoded without control tokens. Built and run by tools/fuzz/run.sh.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "model/gguf.h"
#include "model/llama.h"
#include "model/tokenizer.h"
#include "runtime/error.h"

namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "gguf_fuzzer: %s\n", what);
  std::abort();
}

void Rejected(const tqkv::Error& e) {
  // TQKV_FUZZ_VERBOSE=1 prints why (to check the seeds).
  if (std::getenv("TQKV_FUZZ_VERBOSE")) std::fprintf(stderr, "rejected: %s\n", e.what());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using tqkv::model::GgufFile;
  std::optional<GgufFile> file;
  try {
    file.emplace(GgufFile::Parse(std::vector<uint8_t>(data, data + size), "fuzz.gguf"));
  } catch (const tqkv::Error& e) {
    Rejected(e);
    return 0;
  }
  for (const tqkv::model::GgufTensor& t : file->tensors()) {
    if (&file->Tensor(t.name) != &t) Fail("Tensor() found another tensor");
  }
  if (file->Find("tokenizer.ggml.model") != nullptr) {
    try {
      const tqkv::model::Tokenizer tokenizer = tqkv::model::Tokenizer::FromGguf(*file);
      // Texts from the vocabulary itself (merges apply), plain ASCII, and bytes past UTF-8.
      std::string text = "Hello, world 2024!\n\n";
      for (int32_t id = 0; id < tokenizer.vocab_size() && id < 16; ++id) text += tokenizer.token(id);
      for (bool special : {false, true}) {
        std::vector<int32_t> ids;
        try {
          ids = tokenizer.Encode(text, special);
        } catch (const tqkv::Error& e) {  // a byte with no token in this vocabulary
          Rejected(e);
          continue;
        }
        bool control = false;
        for (int32_t id : ids) {
          if (id < 0 || id >= tokenizer.vocab_size()) Fail("Encode gave an id outside the vocab");
          control = control || tokenizer.IsControl(id);
        }
        // (A merge may produce a control token's text; Decode gives such a token verbatim.)
        if (!special && !control && tokenizer.Decode(ids) != text) {
          Fail("Decode(Encode(text)) != text");
        }
      }
    } catch (const tqkv::Error& e) {
      Rejected(e);
    }
  }
  if (file->Find("general.architecture") != nullptr) {
    try {
      const tqkv::model::LlamaModel model = tqkv::model::LlamaModel::FromGguf(*file);
      const tqkv::model::LlamaConfig& c = model.config();
      if (c.head_dim * c.num_heads != c.hidden || c.num_heads % c.num_kv_heads != 0) {
        Fail("FromGguf accepted an inconsistent config");
      }
    } catch (const tqkv::Error& e) {
      Rejected(e);
    }
  }
  return 0;
}
