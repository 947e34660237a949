// recent_frees: the last few blocks freed in the default pool, kept whole
// and out of the free sets so the next request of the same size and stream
// takes one back without a search, a split or a merge (Note [recent
// frees] in caching_allocator.cpp). A fixed array, newest last: a lookup
// scans at most k_capacity entries and never allocates.
#pragma once

#include <array>
#include <cstddef>

#include "streamalloc/core/block.hpp"

namespace streamalloc {

class recent_frees {
 public:
  static constexpr std::size_t k_capacity = 8;
  // Keeping costs a little on every free and pays only when requests of
  // the same size follow; a workload whose requests rarely repeat a size
  // gets the plain path: after every k_sample_keeps frees kept, fewer than
  // one in k_min_hit_share taken back pauses keeping for k_pause_frees
  // frees, after which it is sampled again.
  static constexpr std::size_t k_sample_keeps = 64;
  static constexpr std::size_t k_min_hit_share = 8;
  static constexpr std::size_t k_pause_frees = 1024;

  // Whether this free should be kept; counts it when so.
  bool keep_next() {
    if (paused_ != 0) {
      --paused_;
      return false;
    }
    if (++kept_ == k_sample_keeps) {
      if (hits_ * k_min_hit_share < kept_) paused_ = k_pause_frees;
      kept_ = 0;
      hits_ = 0;
    }
    return true;
  }
  void count_hit() { ++hits_; }

  bool empty() const { return count_ == 0; }
  std::size_t count_on(stream_handle stream) const {
    std::size_t n = 0;
    for (std::size_t i = 0; i < count_; ++i) n += blocks_[i]->stream == stream ? 1 : 0;
    return n;
  }
  std::size_t size() const { return count_; }
  block* at(std::size_t i) const { return blocks_[i]; }

  // Adds b as the newest entry. When full, the oldest entry leaves to make
  // room and is returned (for the caller to put in its free set); else
  // nullptr.
  block* push(block* b) {
    block* evicted = nullptr;
    if (count_ == k_capacity) {
      evicted = blocks_[0];
      for (std::size_t i = 1; i < count_; ++i) blocks_[i - 1] = blocks_[i];
      --count_;
    }
    blocks_[count_++] = b;
    return evicted;
  }

  // The newest entry with exactly this size and stream whose segment is in
  // the small pool or not as `small` says; nullptr when none.
  block* newest(std::size_t size, stream_handle stream, bool small) const {
    for (std::size_t i = count_; i-- > 0;) {
      block* b = blocks_[i];
      if (b->size == size && b->stream == stream && b->owner->is_small == small) return b;
    }
    return nullptr;
  }

  // Removes b, which must be an entry.
  void remove(const block* b) {
    std::size_t i = count_;
    while (blocks_[--i] != b) {
    }
    for (std::size_t j = i + 1; j < count_; ++j) blocks_[j - 1] = blocks_[j];
    --count_;
  }

  // Removes the only entry (size() must be 1).
  void remove_only() { count_ = 0; }

  // Removes every entry, oldest first, handing each to `release`.
  template <typename fn>
  void drain(fn&& release) {
    const std::size_t n = count_;
    count_ = 0;
    for (std::size_t i = 0; i < n; ++i) release(blocks_[i]);
  }

 private:
  std::array<block*, k_capacity> blocks_{};
  std::size_t count_ = 0;
  std::size_t kept_ = 0;    // frees kept in this sample
  std::size_t hits_ = 0;    // of them (or earlier ones) taken back
  std::size_t paused_ = 0;  // frees left to pass by
};

}  // namespace streamalloc
