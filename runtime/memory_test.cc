// Host-side tests of the memory owners: argument checks run before any CUDA call, so they are
// exercised on machines without a GPU too. Device round trips are in cuda_runtime_test.cc.
#include "runtime/memory.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "runtime/device.h"
#include "runtime/stream.h"

namespace tqkv {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

TEST(DeviceBufferTest, NegativeSizeThrowsNamingTheArgument) {
  try {
    DeviceBuffer<float> buffer(-5);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("DeviceBuffer"), HasSubstr("num_elements = -5"),
                                HasSubstr("allowed: 0 to")));
  }
}

TEST(DeviceBufferTest, SizeWhoseBytesOverflowThrows) {
  EXPECT_THROW(DeviceBuffer<double>(int64_t{1} << 61), Error);
}

TEST(DeviceAllocationTest, NegativeByteCountThrows) {
  try {
    DeviceAllocation a(-1);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("num_bytes = -1"));
  }
}

TEST(DeviceBufferTest, EmptyBufferNeedsNoDevice) {
  DeviceBuffer<int> buffer;
  EXPECT_EQ(buffer.size(), 0);
  EXPECT_EQ(buffer.size_bytes(), 0);
  EXPECT_TRUE(buffer.empty());
  DeviceBuffer<int> zero(0);
  EXPECT_EQ(zero.data(), nullptr);
}

TEST(DeviceBufferTest, CopyLargerThanBufferThrowsBeforeTouchingTheDevice) {
  DeviceBuffer<float> buffer;  // 0 elements
  const std::vector<float> host(4, 1.0f);
  try {
    buffer.CopyFromHost(host);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("CopyFromHost"), HasSubstr("count = 4"),
                                HasSubstr("buffer of 0 elements")));
  }
  std::vector<float> out(1);
  EXPECT_THROW(buffer.CopyToHost(out), Error);
}

TEST(DeviceBufferTest, WithoutADeviceAllocationIsAClearError) {
  if (CudaDeviceCount() > 0) GTEST_SKIP() << "this machine has a CUDA device";
  try {
    DeviceBuffer<float> buffer(16);
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("DeviceAllocation"));
  }
  EXPECT_THROW(Stream(), Error);
  EXPECT_THROW(Event(), Error);
}

TEST(PinnedHostBufferTest, HoldsElementsAndChecksCopies) {
  PinnedHostBuffer<int32_t> buffer(8);
  EXPECT_EQ(buffer.size(), 8);
  EXPECT_EQ(buffer.size_bytes(), 32);
  const std::vector<int32_t> src = {1, 2, 3};
  buffer.CopyFrom(src, 5);
  EXPECT_EQ(buffer[5], 1);
  EXPECT_EQ(buffer[7], 3);
  try {
    buffer.CopyFrom(src, 6);  // 6 + 3 > 8
    FAIL() << "no throw";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), AllOf(HasSubstr("count = 3"), HasSubstr("offset 6")));
  }
  EXPECT_EQ(buffer[6], 2);  // unchanged by the rejected copy
  EXPECT_THROW(buffer.CopyFrom(src, -1), Error);
  EXPECT_THROW(PinnedHostBuffer<int32_t>(-2), Error);
}

// A size whose rounding up to 64 bytes wrapped int64 is refused as an argument.
TEST(PinnedHostBufferTest, SizesPastTheLimitThrowNamingThem) {
  EXPECT_THAT(
      [] { HostAllocation(std::numeric_limits<int64_t>::max() - 10); },
      ::testing::ThrowsMessage<Error>(::testing::HasSubstr("num_bytes = 9223372036854775797")));
}

TEST(PinnedHostBufferTest, MovesTransferOwnership) {
  PinnedHostBuffer<float> a(4);
  float* data = a.data();
  PinnedHostBuffer<float> b(std::move(a));
  EXPECT_EQ(b.data(), data);
  EXPECT_EQ(b.size(), 4);
  EXPECT_EQ(a.size(), 0);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(a.data(), nullptr);
  PinnedHostBuffer<float> c;
  c = std::move(b);
  EXPECT_EQ(c.data(), data);
  EXPECT_EQ(c.size(), 4);
}

TEST(DeviceQueryTest, CountMatchesQueryAndNeverThrows) {
  const int count = CudaDeviceCount();
  EXPECT_GE(count, 0);
  EXPECT_EQ(static_cast<int>(QueryDevices().size()), count);
  if (!CudaCompiledIn()) {
    EXPECT_EQ(count, 0);
  }
}

}  // namespace
}  // namespace tqkv
