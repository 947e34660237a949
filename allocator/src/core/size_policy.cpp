// Size policy: rounding, pool choice, segment sizes and split/reuse rules.
// The defaults reproduce PyTorch's caching allocator so fragmentation
// comparisons against it are like for like.
#include "streamalloc/core/size_policy.hpp"

#include <cstdint>

#include "streamalloc/util/bytes.hpp"

namespace streamalloc {
namespace {

std::size_t power_of_two_floor(std::size_t v) {
  return std::size_t{1} << (63 - __builtin_clzll(static_cast<unsigned long long>(v)));
}

}  // namespace

bool size_policy::round(std::size_t requested, std::size_t* out) const {
  const std::size_t min = config_->min_block_bytes;
  if (requested <= min) {
    *out = min;
    return true;
  }
  const std::size_t divisions = config_->roundup_divisions_for(requested);
  // Power-of-two divisions bucket sizes coarsely so differently sized
  // requests share blocks; below min * divisions a step would be < min.
  if (divisions > 1 && requested / divisions > min) {
    const std::size_t floor = power_of_two_floor(requested);
    if (floor == requested) {
      *out = requested;
      return true;
    }
    return round_up_checked(requested, floor / divisions, out);
  }
  return round_up_checked(requested, min, out);
}

bool size_policy::segment_size(std::size_t rounded, std::size_t* out) const {
  if (rounded <= plain_small_bytes_) {
    *out = config_->small_segment_bytes;
    return true;
  }
  if (rounded < config_->min_large_alloc_bytes) {
    *out = config_->large_segment_bytes;
    return true;
  }
  return round_up_checked(rounded, config_->large_round_bytes, out);
}

}  // namespace streamalloc
