// libFuzzer target: ParseSafetensors (runtime/safetensors.h) on arbitrary bytes.
//
// A tqkv::Error from the parser is the expected rejection of bad input. Anything else fails: any
// other exception, a crash, a sanitizer report, a leak, or a file that parses but does not
// serialize and parse back to the same contents. Built and run by tools/fuzz/run.sh.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <vector>

#include "runtime/error.h"
#include "runtime/safetensors.h"

namespace {

[[noreturn]] void Fail(const char* what) {
  std::fprintf(stderr, "safetensors_fuzzer: %s\n", what);
  std::abort();
}

// Reads every element through the typed view of its dtype.
void TouchValues(const tqkv::Tensor& t) {
  size_t count = 0;
  switch (t.dtype) {
    case tqkv::DType::kF32:
      count = t.values<float>().size();
      break;
    case tqkv::DType::kF16:
    case tqkv::DType::kBF16:
      count = t.values<uint16_t>().size();
      break;
    case tqkv::DType::kI32:
      count = t.values<int32_t>().size();
      break;
    case tqkv::DType::kI64:
      count = t.values<int64_t>().size();
      break;
    case tqkv::DType::kU8:
      count = t.values<uint8_t>().size();
      break;
  }
  if (static_cast<int64_t>(count) != t.num_elements()) Fail("values() size != num_elements()");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  tqkv::SafetensorsFile file;
  try {
    file = tqkv::ParseSafetensors(std::span<const uint8_t>(data, size), "fuzz.safetensors");
  } catch (const tqkv::Error& e) {
    // Rejected with a clear error: fine. TQKV_FUZZ_VERBOSE=1 prints why (to check the seeds).
    if (std::getenv("TQKV_FUZZ_VERBOSE")) std::fprintf(stderr, "rejected: %s\n", e.what());
    return 0;
  }
  for (const auto& [name, tensor] : file.tensors) {
    TouchValues(tensor);
    if (&file.at(name) != &tensor) Fail("at() found another tensor");
    try {
      file.Require(name, tensor.dtype == tqkv::DType::kU8 ? tqkv::DType::kF32 : tqkv::DType::kU8,
                   static_cast<int64_t>(tensor.shape.size()));
      Fail("Require() accepted the wrong dtype");
    } catch (const tqkv::Error&) {
    }
  }
  try {
    // Not valid UTF-8, so no parsed file has a tensor of this name.
    (void)file.at("\xff");
    Fail("at() returned a tensor that cannot exist");
  } catch (const tqkv::Error&) {
  }

  // What was accepted must serialize (no tqkv::Error is caught here) and read back unchanged.
  const std::vector<uint8_t> bytes = tqkv::SerializeSafetensors(file);
  const tqkv::SafetensorsFile again = tqkv::ParseSafetensors(bytes, "fuzz (reserialized)");
  if (again.metadata != file.metadata) Fail("metadata changed in a round trip");
  if (again.tensors.size() != file.tensors.size()) Fail("tensor count changed in a round trip");
  for (const auto& [name, tensor] : file.tensors) {
    const tqkv::Tensor& other = again.at(name);
    if (other.dtype != tensor.dtype || other.shape != tensor.shape || other.data != tensor.data) {
      Fail("a tensor changed in a round trip");
    }
  }
  return 0;
}
