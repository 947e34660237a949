// Exception types thrown by the core. `out_of_memory` derives from
// std::bad_alloc so generic C++ handlers catch it; the Python layer maps it
// to torch.cuda.OutOfMemoryError, `usage_error` to ValueError/RuntimeError.
#pragma once

#include <cstddef>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "streamalloc/util/device_process.hpp"

namespace streamalloc {

struct oom_context {
  std::size_t requested_bytes = 0;
  // What torch's message calls the size it tried to allocate: the segment
  // the rounded request needs (0: unknown, the requested bytes are shown).
  std::size_t allocation_bytes = 0;
  std::size_t device_total_bytes = 0;
  std::size_t device_free_bytes = 0;
  std::size_t allocated_bytes = 0;
  std::size_t reserved_bytes = 0;
  std::size_t largest_free_block_bytes = 0;
  std::size_t allowed_bytes = 0;  // memory-fraction cap (device total when no cap)
  // Free cached bytes of private pools (CUDA graphs, MemPools), which
  // torch's message counts as allocated.
  std::size_t private_pool_cached_bytes = 0;
  int device = 0;
  // Whether the request's pool grows expandable segments: its fragmentation
  // advice then leaves out max_split_size_mb, which does not bind there
  // (Note [max_split in expandable segments] in caching_allocator.cpp).
  bool expandable_segments = false;
  // The processes holding memory on the device (empty: unknown), in the
  // driver's order; the message names each and "this process".
  std::vector<device_process> processes;
};

class out_of_memory : public std::bad_alloc {
 public:
  explicit out_of_memory(const oom_context& context);
  const char* what() const noexcept override { return message_.c_str(); }
  const oom_context& context() const noexcept { return context_; }

 private:
  oom_context context_;
  std::string message_;
};

// A misuse by the caller: unknown pointer, double free, bad argument.
class usage_error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// A malformed STREAMALLOC_CONF string or option value.
class config_error : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The device itself failed (driver error, no device). Carries the status text.
class device_failure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Human-readable byte count ("1.50 GiB") used in error messages and summaries.
std::string format_bytes(std::size_t bytes);

// torch's format_size, which the out-of-memory message uses so that scripts
// parsing torch's message read ours: up to 1024 "N bytes", then KiB up to
// 1 MiB, MiB up to 1 GiB, and GiB beyond (never a larger unit), with two
// decimals ("1024.00 KiB" for exactly 1 MiB).
std::string format_size(std::size_t bytes);

}  // namespace streamalloc
