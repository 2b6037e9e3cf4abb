#include "kvcache/step_batch.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "runtime/error.h"

namespace tqkv {
namespace {

constexpr int64_t kAlign = 64;
int64_t AlignUp(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

}  // namespace

void StepBatch::ThrowBadRow(int32_t row) const {
  throw InvalidArgument(
      "StepBatch::block_table", "row", row,
      padded_num_requests_ > 0
          ? fmt::format("0 to padded_num_requests() - 1 = {}", padded_num_requests_ - 1)
          : std::string("none (the batch has no rows)"));
}

void StepBatch::Reshape(int32_t num_requests, int32_t padded_requests, int32_t num_tokens,
                        int32_t padded_tokens, int32_t width) {
  Layout l;
  l.block_tables = 0;
  l.slot_mapping = AlignUp(l.block_tables + int64_t{4} * padded_requests * width);
  l.seq_lens = AlignUp(l.slot_mapping + int64_t{8} * padded_tokens);
  l.query_start_loc = AlignUp(l.seq_lens + int64_t{4} * padded_requests);
  l.total_bytes = l.query_start_loc + 4 * (int64_t{padded_requests} + 1);
  // Every allocation first: one that throws leaves the batch as it was (Schedule promises a
  // failed call changes nothing; a half-reshaped batch kept rows at the old width's stride).
  HostAllocation grown;
  if (arena_.size_bytes() < l.total_bytes) {
    // Grow geometrically so a slowly growing batch reallocates O(log) times.
    grown = HostAllocation(std::max(AlignUp(l.total_bytes), 2 * arena_.size_bytes()));
  }
  rows_.reserve(static_cast<size_t>(padded_requests));
  prefix_hit_tokens_.reserve(static_cast<size_t>(num_requests));

  bool rows_kept = width == block_table_width_;
  if (grown.size_bytes() > 0) {
    arena_ = std::move(grown);
    rows_kept = false;
  }
  num_requests_ = num_requests;
  padded_num_requests_ = padded_requests;
  num_tokens_ = num_tokens;
  padded_num_tokens_ = padded_tokens;
  block_table_width_ = width;
  layout_ = l;
  rows_.resize(static_cast<size_t>(padded_requests));
  if (!rows_kept) std::fill(rows_.begin(), rows_.end(), RowState{});
  prefix_hit_tokens_.resize(static_cast<size_t>(num_requests));
  copies_.clear();
}

StepBatchView ViewStepBatch(const StepBatch& batch, const void* base) {
  const auto* bytes = static_cast<const std::byte*>(base);
  const StepBatch::Layout& l = batch.layout();
  StepBatchView v;
  v.block_tables = reinterpret_cast<const int32_t*>(bytes + l.block_tables);
  v.slot_mapping = reinterpret_cast<const int64_t*>(bytes + l.slot_mapping);
  v.seq_lens = reinterpret_cast<const int32_t*>(bytes + l.seq_lens);
  v.query_start_loc = reinterpret_cast<const int32_t*>(bytes + l.query_start_loc);
  v.num_requests = batch.num_requests();
  v.padded_num_requests = batch.padded_num_requests();
  v.num_tokens = batch.num_tokens();
  v.padded_num_tokens = batch.padded_num_tokens();
  v.block_table_width = batch.block_table_width();
  return v;
}

}  // namespace tqkv
