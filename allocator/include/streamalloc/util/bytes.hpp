// Byte-size literals and rounding helpers shared by every layer.
// Sizes are always std::size_t bytes; the literals keep constants readable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

namespace streamalloc {

constexpr std::size_t operator""_KiB(unsigned long long v) { return static_cast<std::size_t>(v) << 10; }
constexpr std::size_t operator""_MiB(unsigned long long v) { return static_cast<std::size_t>(v) << 20; }
constexpr std::size_t operator""_GiB(unsigned long long v) { return static_cast<std::size_t>(v) << 30; }

// Rounds `bytes` up to a multiple of `multiple` (a power of two or not).
// Returns false instead of wrapping when the result would not fit.
inline bool round_up_checked(std::size_t bytes, std::size_t multiple, std::size_t* out) {
  const std::size_t rem = bytes % multiple;
  if (rem == 0) {
    *out = bytes;
    return true;
  }
  const std::size_t add = multiple - rem;
  if (bytes > std::numeric_limits<std::size_t>::max() - add) return false;
  *out = bytes + add;
  return true;
}

}  // namespace streamalloc
