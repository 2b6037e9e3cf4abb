#include "model/tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>
#include <queue>

#include "runtime/error.h"

namespace tqkv::model {
namespace {

struct CodeRange {
  uint32_t first, last;
};
#include "model/unicode_ranges.inc"

template <size_t N>
bool InRanges(const CodeRange (&ranges)[N], uint32_t cp) {
  const auto it = std::upper_bound(std::begin(ranges), std::end(ranges), cp,
                                   [](uint32_t c, const CodeRange& r) { return c < r.first; });
  return it != std::begin(ranges) && cp <= (it - 1)->last;
}

enum class Class { kLetter, kNumber, kSpace, kOther };

Class ClassOf(uint32_t cp) {
  if (cp < 0x80) {  // ASCII fast path
    if ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z') return Class::kLetter;
    if (cp >= '0' && cp <= '9') return Class::kNumber;
    if (cp == ' ' || (cp >= 0x09 && cp <= 0x0D)) return Class::kSpace;
    return Class::kOther;
  }
  if (InRanges(kLetterRanges, cp)) return Class::kLetter;
  if (InRanges(kNumberRanges, cp)) return Class::kNumber;
  if (InRanges(kSpaceRanges, cp)) return Class::kSpace;
  return Class::kOther;
}

// One decoded character: its code point and byte length. Bytes that are not valid UTF-8 are
// characters of one byte (class kOther), as a regex over bytes would treat them.
struct Char {
  uint32_t cp;
  int len;
};

Char DecodeAt(std::string_view s, size_t i) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  int len = b0 < 0x80 ? 1 : (b0 >> 5) == 0x6 ? 2 : (b0 >> 4) == 0xE ? 3 : (b0 >> 3) == 0x1E ? 4 : 0;
  if (len == 0 || i + len > s.size()) return {0xFFFFFFFFu, 1};
  uint32_t cp = len == 1 ? b0 : len == 2 ? (b0 & 0x1F) : len == 3 ? (b0 & 0x0F) : (b0 & 0x07);
  for (int k = 1; k < len; ++k) {
    const auto b = static_cast<uint8_t>(s[i + k]);
    if ((b >> 6) != 0x2) return {0xFFFFFFFFu, 1};
    cp = (cp << 6) | (b & 0x3F);
  }
  return {cp, len};
}

std::string EncodeUtf8(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

// GPT-2's split of a fragment (the regex 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
// ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+, tried in that order at each position).
void SplitGpt2(std::string_view s, std::vector<std::string_view>& out) {
  std::vector<Char> chars;
  std::vector<size_t> at;
  for (size_t i = 0; i < s.size();) {
    const Char c = DecodeAt(s, i);
    chars.push_back(c);
    at.push_back(i);
    i += static_cast<size_t>(c.len);
  }
  at.push_back(s.size());
  const size_t n = chars.size();
  auto cls = [&](size_t k) { return ClassOf(chars[k].cp); };
  auto run = [&](size_t k, auto pred) {
    while (k < n && pred(cls(k))) ++k;
    return k;
  };
  size_t i = 0;
  while (i < n) {
    size_t j = i;
    const uint32_t c = chars[i].cp;
    if (c == '\'' && i + 1 < n) {
      const uint32_t a = chars[i + 1].cp, b = i + 2 < n ? chars[i + 2].cp : 0;
      if (a == 's' || a == 't' || a == 'm' || a == 'd') {
        j = i + 2;
      } else if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) {
        j = i + 3;
      }
    }
    if (j == i) {
      const size_t k = c == ' ' && i + 1 < n ? i + 1 : i;  // the optional leading space
      const Class ck = cls(k);
      if (ck == Class::kLetter) {
        j = run(k, [](Class x) { return x == Class::kLetter; });
      } else if (ck == Class::kNumber) {
        j = run(k, [](Class x) { return x == Class::kNumber; });
      } else if (ck == Class::kOther) {
        j = run(k, [](Class x) { return x == Class::kOther; });
      } else {  // whitespace at i (k == i, or a space before whitespace)
        const size_t end = run(i, [](Class x) { return x == Class::kSpace; });
        j = end == n || end - i == 1 ? end : end - 1;  // \s+(?!\S), else \s+
      }
    }
    out.push_back(s.substr(at[i], at[j] - at[i]));
    i = j;
  }
}

}  // namespace

Tokenizer Tokenizer::FromGguf(const GgufFile& file) {
  const std::string model = file.GetString("tokenizer.ggml.model");
  if (model != "gpt2") {
    throw InvalidArgument("Tokenizer::FromGguf", "tokenizer.ggml.model", model, "gpt2");
  }
  const std::string pre = file.Find("tokenizer.ggml.pre") != nullptr
                              ? file.GetString("tokenizer.ggml.pre")
                              : std::string("gpt2");
  if (pre != "gpt2" && pre != "smollm") {
    throw InvalidArgument("Tokenizer::FromGguf", "tokenizer.ggml.pre", pre, "gpt2 or smollm");
  }
  Tokenizer t;
  t.split_digits_ = pre == "smollm";
  t.tokens_ = file.GetStrings("tokenizer.ggml.tokens");
  const int64_t n = static_cast<int64_t>(t.tokens_.size());
  if (n == 0 || n > std::numeric_limits<int32_t>::max()) {
    throw Error(fmt::format("Tokenizer::FromGguf: {} tokens", n));
  }
  t.special_.assign(t.tokens_.size(), false);
  if (file.Find("tokenizer.ggml.token_type") != nullptr) {
    const std::vector<int64_t> types = file.GetInts("tokenizer.ggml.token_type");
    if (static_cast<int64_t>(types.size()) != n) {
      throw Error(
          fmt::format("Tokenizer::FromGguf: {} token types for {} tokens", types.size(), n));
    }
    for (int64_t i = 0; i < n; ++i) t.special_[i] = types[i] == 3;  // LLAMA_TOKEN_TYPE_CONTROL
  }
  for (int32_t i = 0; i < n; ++i) {
    t.ids_.emplace(t.tokens_[i], i);
    // An empty control token would match at every position of the text.
    if (t.special_[i] && !t.tokens_[i].empty()) t.specials_.push_back(i);
  }
  std::sort(t.specials_.begin(), t.specials_.end(),
            [&](int32_t a, int32_t b) { return t.tokens_[a].size() > t.tokens_[b].size(); });
  const std::vector<std::string> merges = file.GetStrings("tokenizer.ggml.merges");
  for (size_t r = 0; r < merges.size(); ++r) {
    if (merges[r].find(' ') == std::string::npos) {
      throw Error(fmt::format("Tokenizer::FromGguf: merge {} '{}' has no space", r, merges[r]));
    }
    t.merge_rank_.emplace(merges[r], static_cast<int32_t>(r));
  }
  auto id_or = [&](const char* key) -> int32_t {
    if (file.Find(key) == nullptr) return -1;
    const int64_t id = file.GetInt(key);
    if (id < 0 || id >= n) throw InvalidArgument("Tokenizer::FromGguf", key, id, "a token id");
    return static_cast<int32_t>(id);
  };
  t.bos_id_ = id_or("tokenizer.ggml.bos_token_id");
  t.eos_id_ = id_or("tokenizer.ggml.eos_token_id");
  // GPT-2's bytes_to_unicode: printable bytes stand for themselves, the others for 256 + k.
  int next = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    t.byte_char_[b] = EncodeUtf8(printable ? static_cast<uint32_t>(b) : 256u + next++);
    t.char_byte_.emplace(t.byte_char_[b], static_cast<uint8_t>(b));
  }
  return t;
}

const std::string& Tokenizer::token(int32_t id) const {
  if (id < 0 || id >= vocab_size()) {
    throw InvalidArgument("Tokenizer::token", "id", id, fmt::format("0 to {}", vocab_size() - 1));
  }
  return tokens_[id];
}

int32_t Tokenizer::Find(std::string_view token) const {
  const auto it = ids_.find(std::string(token));
  return it == ids_.end() ? -1 : it->second;
}

std::vector<std::string_view> Tokenizer::PreTokenize(std::string_view text) const {
  std::vector<std::string_view> out;
  if (!split_digits_) {
    SplitGpt2(text, out);
    return out;
  }
  size_t start = 0;
  for (size_t i = 0; i < text.size();) {
    const Char c = DecodeAt(text, i);
    if (ClassOf(c.cp) == Class::kNumber) {  // every digit its own piece
      if (i > start) SplitGpt2(text.substr(start, i - start), out);
      out.push_back(text.substr(i, static_cast<size_t>(c.len)));
      start = i + static_cast<size_t>(c.len);
    }
    i += static_cast<size_t>(c.len);
  }
  if (start < text.size()) SplitGpt2(text.substr(start), out);
  return out;
}

void Tokenizer::EncodePiece(std::string_view piece, std::vector<int32_t>& out) const {
  // Merges the adjacent pair of lowest rank, leftmost first, until none is in the merge list. The
  // symbols form a linked list and the candidate pairs a heap ordered by (rank, position of the
  // left symbol), which applies the merges in that same order in O(n log n): a piece of 16k
  // letters took seconds with a rescan of every pair per merge.
  struct Symbol {
    std::string text;  // empty once merged into its left neighbour
    int32_t prev = -1, next = -1;
  };
  struct Pair {
    int32_t rank, left;
    size_t size;  // the two symbols' text length when pushed: a pair that changed since is stale
  };
  auto later = [](const Pair& a, const Pair& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.left > b.left;
  };
  const int32_t n = static_cast<int32_t>(piece.size());
  std::vector<Symbol> sym(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    sym[i].text = byte_char_[static_cast<uint8_t>(piece[static_cast<size_t>(i)])];
    sym[i].prev = i - 1;
    sym[i].next = i + 1 < n ? i + 1 : -1;
  }
  std::priority_queue<Pair, std::vector<Pair>, decltype(later)> heap(later);
  std::string key;
  auto push = [&](int32_t left) {
    if (left < 0 || sym[left].next < 0) return;
    const Symbol& l = sym[left];
    const Symbol& r = sym[l.next];
    key.assign(l.text).append(" ").append(r.text);
    const auto it = merge_rank_.find(key);
    if (it != merge_rank_.end()) heap.push({it->second, left, l.text.size() + r.text.size()});
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const Pair p = heap.top();
    heap.pop();
    Symbol& l = sym[p.left];
    if (l.text.empty() || l.next < 0) continue;
    Symbol& r = sym[l.next];
    if (l.text.size() + r.text.size() != p.size) continue;
    l.text += r.text;
    r.text.clear();
    l.next = r.next;
    if (l.next >= 0) sym[l.next].prev = p.left;
    push(l.prev);
    push(p.left);
  }
  std::vector<std::string> symbols;
  for (int32_t i = n > 0 ? 0 : -1; i >= 0; i = sym[i].next)
    symbols.push_back(std::move(sym[i].text));
  for (const std::string& s : symbols) {
    const int32_t id = Find(s);
    if (id >= 0) {
      out.push_back(id);
      continue;
    }
    // Not in the vocabulary (a vocabulary without some merge result): its bytes one by one.
    for (size_t i = 0; i < s.size();) {
      const Char c = DecodeAt(s, i);
      const std::string ch = s.substr(i, static_cast<size_t>(c.len));
      const int32_t b = Find(ch);
      if (b < 0) {
        const auto byte = char_byte_.find(ch);
        throw Error(fmt::format(
            "Tokenizer: the vocabulary has no token for byte {:#04x} of the text, so the text "
            "cannot be encoded with this model",
            byte == char_byte_.end() ? 0 : byte->second));
      }
      out.push_back(b);
      i += static_cast<size_t>(c.len);
    }
  }
}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool parse_special) const {
  std::vector<int32_t> out;
  auto plain = [&](std::string_view s) {
    for (std::string_view piece : PreTokenize(s)) EncodePiece(piece, out);
  };
  if (!parse_special || specials_.empty()) {
    plain(text);
    return out;
  }
  size_t start = 0;
  for (size_t i = 0; i < text.size();) {
    int32_t match = -1;
    for (int32_t id : specials_) {  // longest first
      if (text.substr(i).starts_with(tokens_[id])) {
        match = id;
        break;
      }
    }
    if (match < 0) {
      ++i;
      continue;
    }
    if (i > start) plain(text.substr(start, i - start));
    out.push_back(match);
    i += tokens_[match].size();
    start = i;
  }
  if (start < text.size()) plain(text.substr(start));
  return out;
}

std::string Tokenizer::Decode(std::span<const int32_t> ids) const {
  std::string out;
  for (int32_t id : ids) {
    const std::string& t = token(id);
    if (special_[id]) {
      out += t;
      continue;
    }
    for (size_t i = 0; i < t.size();) {
      const Char c = DecodeAt(t, i);
      const auto it = char_byte_.find(t.substr(i, static_cast<size_t>(c.len)));
      if (it != char_byte_.end()) {
        out += static_cast<char>(it->second);
      } else {
        out += t.substr(i, static_cast<size_t>(c.len));  // not a byte character: as is
      }
      i += static_cast<size_t>(c.len);
    }
  }
  return out;
}

}  // namespace tqkv::model
