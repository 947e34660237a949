// Human-readable byte counts and the out-of-memory message. The message is
// PyTorch's, word for word (Note [torch's OOM message]), followed by what
// streamalloc adds: the largest free cached block and which knobs
// (STREAMALLOC_CONF, empty_cache) help against fragmentation.
#include "streamalloc/util/errors.hpp"

#include <unistd.h>

#include <charconv>
#include <cstdint>
#include <cstdio>
#include <string>

namespace streamalloc {

namespace {

constexpr const char* k_units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
constexpr int k_unit_count = sizeof(k_units) / sizeof(k_units[0]);

std::string format_scaled(long double value, int unit) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.2Lf %s", value, k_units[unit]);
  return buffer;
}

}  // namespace

std::string format_bytes(std::size_t bytes) {
  if (bytes < 1024) return std::to_string(bytes) + " B";
  long double value = static_cast<long double>(bytes) / 1024.0L;
  int unit = 0;
  while (value >= 1024.0L && unit + 1 < k_unit_count) {
    value /= 1024.0L;
    ++unit;
  }
  std::string text = format_scaled(value, unit);
  // 1023.999 KiB prints as "1024.00 KiB"; say "1.00 MiB" instead.
  if (text.compare(0, 4, "1024") == 0 && unit + 1 < k_unit_count) text = format_scaled(value / 1024.0L, unit + 1);
  return text;
}

std::string format_size(std::size_t bytes) {
  if (bytes <= 1024) return std::to_string(bytes) + " bytes";
  double value = static_cast<double>(bytes) / 1073741824.0;
  const char* unit = " GiB";
  if (bytes <= 1048576) {
    value = static_cast<double>(bytes) / 1024.0;
    unit = " KiB";
  } else if (bytes <= 1073741824) {
    value = static_cast<double>(bytes) / 1048576.0;
    unit = " MiB";
  }
  // to_chars is locale-independent: a process that set a comma decimal
  // locale still prints what torch prints.
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value, std::chars_format::fixed, 2);
  return std::string(buffer, result.ptr) + unit;
}

namespace {

// Note [torch's OOM message]: the message repeats torch's sentences word for
// word (torch 2.11, CUDACachingAllocator.cpp), numbers in torch's
// format_size, because users and tools parse them ("Tried to allocate
// 20.00 MiB" is the segment the request needed, as torch reports it). Where
// torch leaves a part out, so do we: the per-process sentences need the
// driver's list of processes (NVML), skipped when it cannot be read, as
// torch skips them, and "... allowed; " only appears under a memory
// fraction below 1. streamalloc's own figures follow
// torch's text, after its final parenthesis.
// torch refuses 1 EiB or more before looking at the device, in these words.
constexpr std::size_t k_one_exabyte = std::size_t{1} << 60;

std::string oom_message(const oom_context& c) {
  if (c.requested_bytes >= k_one_exabyte) return "CUDA out of memory. Tried to allocate more than 1EB memory.";
  const std::size_t tried = c.allocation_bytes != 0 ? c.allocation_bytes : c.requested_bytes;
  const std::size_t counted_allocated = c.allocated_bytes + c.private_pool_cached_bytes;
  const std::size_t torch_unallocated = c.reserved_bytes > counted_allocated ? c.reserved_bytes - counted_allocated : 0;
  std::string m = "CUDA out of memory. Tried to allocate " + format_size(tried) + ". GPU " + std::to_string(c.device) +
                  " has a total capacity of " + format_size(c.device_total_bytes) + " of which " +
                  format_size(c.device_free_bytes) + " is free. ";
  const auto self = static_cast<std::uint32_t>(::getpid());
  for (const device_process& p : c.processes) {
    m += p.pid == self ? std::string("Including non-PyTorch memory, this process") : "Process " + std::to_string(p.pid);
    m += " has " + format_size(p.used_bytes) + " memory in use. ";
  }
  if (c.allowed_bytes < c.device_total_bytes) m += format_size(c.allowed_bytes) + " allowed; ";
  m += "Of the allocated memory " + format_size(counted_allocated) + " is allocated by PyTorch, ";
  if (c.private_pool_cached_bytes > 0) {
    m += "with " + format_size(c.private_pool_cached_bytes) + " allocated in private pools (e.g., CUDA Graphs), ";
  }
  m += "and " + format_size(torch_unallocated) +
       " is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
       "Management  (https://docs.pytorch.org/docs/stable/notes/cuda.html"
       "#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)";

  const std::size_t unallocated = c.reserved_bytes > c.allocated_bytes ? c.reserved_bytes - c.allocated_bytes : 0;
  m += " streamalloc: " + format_size(c.reserved_bytes) + " reserved, " + format_size(unallocated) +
       " of it unallocated; the largest free cached block is " + format_size(c.largest_free_block_bytes) + ".";
  // Enough bytes are cached in total but no single block holds the request:
  // the cache is fragmented rather than the device being full.
  if (unallocated >= c.requested_bytes && c.largest_free_block_bytes < c.requested_bytes) {
    m += " The reserved but unallocated memory is fragmented: ";
    if (!c.expandable_segments) {
      m += "set STREAMALLOC_CONF=max_split_size_mb:<MB> so large cached blocks are not split, or ";
    }
    m += "call empty_cache() to return cached segments to the device.";
  }
  return m;
}

}  // namespace

out_of_memory::out_of_memory(const oom_context& context) : context_(context), message_(oom_message(context)) {}

}  // namespace streamalloc
