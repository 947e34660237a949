// size_policy: how a request is rounded, which pool serves it, how large a
// new segment is, and whether a found block may be split or reused.
#pragma once

#include <cstddef>

#include "streamalloc/core/config.hpp"
#include "streamalloc/core/snapshot.hpp"

namespace streamalloc {

class size_policy {
 public:
  // `expandable`: whether the default pool is made of expandable segments
  // (private pools always use plain ones). `config` must outlive the policy,
  // which reads its current values (caching_allocator::update_config).
  size_policy(const allocator_config& config, bool expandable)
      : config_(&config),
        plain_small_bytes_(config.small_request_bytes_for(false)),
        default_pool_small_bytes_(config.small_request_bytes_for(expandable)) {}

  // Rounded block size for a request; false if it would overflow.
  bool round(std::size_t requested, std::size_t* out) const;
  // The pool choice, made here only: whether a request of `rounded` bytes
  // goes to the small or the large free blocks of memory pool `pool` (0: the
  // default pool, which may use expandable segments; private pools use plain
  // ones).
  bool in_small_pool(std::size_t rounded, pool_id pool) const {
    return rounded <= (pool == 0 ? default_pool_small_bytes_ : plain_small_bytes_);
  }
  // Whether a request of `rounded` bytes that in_small_pool sends to the
  // large free blocks is one plain segments would keep small: only the
  // default pool with expandable segments and small_size_kb:auto has such
  // mid-size requests (caching_allocator, Note [mid-size requests]).
  bool is_mid_size(std::size_t rounded, pool_id pool) const {
    return pool == 0 && rounded > default_pool_small_bytes_ && rounded <= plain_small_bytes_;
  }
  // Size of the plain segment to create for a rounded request; false on overflow.
  bool segment_size(std::size_t rounded, std::size_t* out) const;
  // Whether a block of `block_size` serving `rounded` leaves a remainder
  // worth splitting off. In an expandable segment every remainder is: it
  // coalesces with its neighbours instead of being stranded in a segment.
  bool should_split(std::size_t block_size, std::size_t rounded, bool small, bool expandable) const;
  bool is_oversize(std::size_t bytes) const { return bytes >= config_->max_split_bytes; }
  // Whether a cached block of `block_size` (in an expandable segment or
  // not) may serve `rounded` at all.
  bool may_reuse(std::size_t block_size, std::size_t rounded, bool expandable) const;

 private:
  const allocator_config* config_;
  std::size_t plain_small_bytes_;
  std::size_t default_pool_small_bytes_;
};

// Inline: both run on every allocation served by a recent free.
inline bool size_policy::should_split(std::size_t block_size, std::size_t rounded, bool small, bool expandable) const {
  const std::size_t remaining = block_size - rounded;
  if (small || expandable) return remaining >= config_->min_block_bytes;
  // A large remainder is only worth keeping when it could serve a large
  // request; smaller leftovers stay attached (counted as allocated).
  return !is_oversize(rounded) && remaining > plain_small_bytes_;
}

inline bool size_policy::may_reuse(std::size_t block_size, std::size_t rounded, bool expandable) const {
  // Note [max_split in expandable segments] (caching_allocator.cpp): a
  // block of an expandable segment serves any request.
  if (expandable) return true;
  // Oversize blocks are kept whole for oversize requests only, and not for
  // one much smaller than the block (that would strand the difference).
  if (!is_oversize(rounded)) return !is_oversize(block_size);
  return block_size - rounded < config_->max_non_split_rounding_bytes;
}

}  // namespace streamalloc
