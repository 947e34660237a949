// Human-readable byte counts and the out-of-memory message. The message
// follows PyTorch's wording so users recognise it and know which knobs
// (STREAMALLOC_CONF, empty_cache) to reach for.
#include "streamalloc/util/errors.hpp"

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

std::string format_fraction(double fraction) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%.3g", fraction);
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

namespace {

std::string oom_message(const oom_context& c) {
  const std::size_t unallocated = c.reserved_bytes > c.allocated_bytes ? c.reserved_bytes - c.allocated_bytes : 0;
  std::string m = "CUDA out of memory. Tried to allocate " + format_bytes(c.requested_bytes) + ". GPU " +
                  std::to_string(c.device) + " has a total capacity of " + format_bytes(c.device_total_bytes) +
                  " of which " + format_bytes(c.device_free_bytes) + " is free.";
  const std::size_t in_use = c.device_total_bytes > c.device_free_bytes ? c.device_total_bytes - c.device_free_bytes : 0;
  if (in_use > c.reserved_bytes) {
    m += " Including memory outside streamalloc (other allocators, other processes, the CUDA context), " +
         format_bytes(in_use) + " is in use.";
  }
  m += " Of the allocated memory " + format_bytes(c.allocated_bytes) + " is allocated by streamalloc, and " +
       format_bytes(unallocated) + " is reserved by streamalloc but unallocated (" + format_bytes(c.reserved_bytes) +
       " reserved in total; largest free cached block " + format_bytes(c.largest_free_block_bytes) + ").";
  if (c.allowed_bytes > 0 && c.allowed_bytes < c.device_total_bytes) {
    const double fraction = c.device_total_bytes == 0
                                ? 0.0
                                : static_cast<double>(c.allowed_bytes) / static_cast<double>(c.device_total_bytes);
    m += " The memory fraction caps what streamalloc may reserve at " + format_bytes(c.allowed_bytes) + " (" +
         format_fraction(fraction) + " of the device).";
  }
  // Enough bytes are cached in total but no single block holds the request:
  // the cache is fragmented rather than the device being full.
  if (unallocated >= c.requested_bytes && c.largest_free_block_bytes < c.requested_bytes) {
    m += " The reserved but unallocated memory is fragmented: set STREAMALLOC_CONF=max_split_size_mb:<MB> so large "
         "cached blocks are not split, or call empty_cache() to return cached segments to the device.";
  }
  return m;
}

}  // namespace

out_of_memory::out_of_memory(const oom_context& context) : context_(context), message_(oom_message(context)) {}

}  // namespace streamalloc
