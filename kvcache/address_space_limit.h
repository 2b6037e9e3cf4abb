// Tests only: a scope in which large allocations fail, as they would on a full machine.
#pragma once

#include <sys/resource.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>

namespace tqkv::testing {

// The address space below the current use plus `headroom` bytes while alive, so that a large
// allocation fails instead of being overcommitted. Only allocations that map new memory fail:
// glibc serves requests below its mmap threshold (up to 32 MB) from free heap memory first.
class AddressSpaceLimit {
 public:
  explicit AddressSpaceLimit(int64_t headroom) {
    getrlimit(RLIMIT_AS, &old_);
    std::ifstream statm("/proc/self/statm");
    int64_t pages = 0;
    statm >> pages;
    rlimit lim = old_;
    lim.rlim_cur = static_cast<rlim_t>(pages * sysconf(_SC_PAGESIZE) + headroom);
    setrlimit(RLIMIT_AS, &lim);
  }
  ~AddressSpaceLimit() { setrlimit(RLIMIT_AS, &old_); }
  AddressSpaceLimit(const AddressSpaceLimit&) = delete;
  AddressSpaceLimit& operator=(const AddressSpaceLimit&) = delete;

 private:
  rlimit old_{};
};

}  // namespace tqkv::testing
