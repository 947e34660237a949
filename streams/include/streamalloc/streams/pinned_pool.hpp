// pinned_pool: a thread-safe caching allocator for page-locked host memory,
// with size classes, splitting and coalescing inside slabs, reuse that waits
// for the events of in-flight copies, an optional capacity, and statistics
// named like torch.cuda.host_memory_stats(). The policy is described at the
// top of pinned_pool.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "streamalloc/core/stats.hpp"
#include "streamalloc/streams/host_backend.hpp"
#include "streamalloc/util/bytes.hpp"

namespace streamalloc {

struct pinned_pool_config {
  std::size_t capacity_bytes = 0;  // most pinned bytes held at once; 0: no limit
  // Slabs at least this large are made with pin_method::register_touched,
  // smaller ones with host_alloc (0: always register; SIZE_MAX: never).
  std::size_t register_min_bytes = 16_MiB;
};

// A stream (of a device) that used a block: an event recorded on it tells
// when that use has finished.
struct stream_use {
  stream_handle stream = 0;
  int device = 0;
};

// Time spent in the backend, like torch's DurationStat (microseconds).
struct duration_stat {
  std::int64_t total_us = 0;
  std::int64_t max_us = 0;
  std::int64_t min_us = 0;
  std::int64_t count = 0;

  void add(std::int64_t us);
  void reset_peak() { max_us = 0, min_us = 0; }
  void reset_accumulated() { *this = duration_stat{}; }
};

struct pinned_pool_stats {
  // torch.cuda.host_memory_stats() names. A torch "allocation" is one
  // driver allocation; here that is a slab.
  stat_counter allocations;      // slabs held (in use + cached)
  stat_counter allocated_bytes;  // their bytes
  stat_counter active_requests;  // blocks handed out until reusable again
  stat_counter active_bytes;     // their (rounded) bytes
  duration_stat host_alloc_time;
  duration_stat host_free_time;
  // streamalloc additions.
  stat_counter requested_bytes;     // bytes callers asked for, of blocks they still hold
  std::int64_t cached_bytes = 0;    // free bytes in slabs, ready for reuse
  std::int64_t pending_blocks = 0;  // freed, waiting for their events
  std::int64_t hits = 0;            // requests served without a new slab
  std::int64_t misses = 0;          // requests that made a slab
  std::int64_t capacity_waits = 0;  // times a request at capacity waited for an event
  std::int64_t event_errors = 0;    // failed event queries (the block stays pending)
  std::int64_t capacity_bytes = 0;  // 0: no limit

  // hits / (hits + misses); 0 before the first request.
  double hit_rate() const;
  // Flattened: "allocations.current", "host_alloc_time.avg", "num_host_alloc",
  // ..., "cached_bytes", "hit_rate".
  std::map<std::string, double> to_map() const;
};

// A request the pool cannot serve: it is larger than the capacity, the
// capacity is reached with nothing in flight to wait for, or the system
// refused to pin more memory.
class pinned_out_of_memory : public std::bad_alloc {
 public:
  pinned_out_of_memory(std::string message, std::size_t requested_bytes)
      : message_(std::move(message)), requested_bytes_(requested_bytes) {}
  const char* what() const noexcept override { return message_.c_str(); }
  std::size_t requested_bytes() const noexcept { return requested_bytes_; }

 private:
  std::string message_;
  std::size_t requested_bytes_;
};

class pinned_pool {
 public:
  static constexpr std::size_t k_block_alignment_bytes = 512;
  static constexpr std::size_t k_small_request_max_bytes = 1_MiB;
  static constexpr std::size_t k_small_slab_bytes = 2_MiB;
  static constexpr std::size_t k_large_slab_alignment_bytes = 2_MiB;
  static constexpr std::size_t k_large_min_remainder_bytes = 1_MiB;

  pinned_pool(host_backend& backend, pinned_pool_config config = {});
  // Waits for every pending event, then releases every slab.
  ~pinned_pool();
  pinned_pool(const pinned_pool&) = delete;
  pinned_pool& operator=(const pinned_pool&) = delete;

  // The size class of a request (what a block of it really holds).
  // Throws usage_error when it cannot be represented.
  static std::size_t round_size(std::size_t bytes);

  // A block of at least `bytes` (0 counts as 1), 512-byte aligned. Throws
  // pinned_out_of_memory (see the class) or usage_error.
  void* allocate(std::size_t bytes);
  // Returns a block. With events recorded on it, it becomes reusable only
  // when they have all completed. nullptr is ignored; a pointer that is not
  // a live block start throws usage_error.
  void free(void* ptr);
  // Records an event on each of `uses`, then frees. If a record fails, the
  // device is synchronized instead, so the block is never reused early.
  void free(void* ptr, const std::vector<stream_use>& uses);
  // Records an event on `use.stream` now, after the caller enqueued work
  // that reads or writes the block. False when `ptr` is not a live block
  // start of this pool; throws device_failure when the record fails.
  bool record_event(void* ptr, stream_use use);

  // The rounded size of the live block at `ptr`, 0 when there is none.
  std::size_t block_size(const void* ptr) const;
  // Makes pending blocks whose events have completed reusable; returns how
  // many. Allocation does this by itself when the cache misses.
  std::size_t process_events();
  // Releases idle slabs (no block in use or pending), largest first, until
  // at most `keep_bytes` of idle slabs remain; returns the bytes released.
  // Throws device_failure if the backend refuses a release (that slab stays).
  std::size_t trim(std::size_t keep_bytes = 0);
  void empty_cache() { trim(0); }

  pinned_pool_stats stats() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  const pinned_pool_config& config() const { return config_; }

  // Checks every structural invariant and recounts the stats; throws
  // std::logic_error describing the first violation (as
  // caching_allocator::validate does).
  void validate() const;

 private:
  enum class block_state { free, allocated, pending };
  struct slab;
  struct recorded_event {
    event_handle event = 0;
    stream_use use;
  };
  struct block {
    std::uintptr_t address = 0;
    std::size_t size = 0;
    std::size_t requested = 0;  // 0 unless handed out
    slab* owner = nullptr;
    block* prev = nullptr;  // address neighbours in the slab
    block* next = nullptr;
    block_state state = block_state::free;
    std::vector<recorded_event> events;
  };
  struct slab {
    std::uintptr_t address = 0;
    std::size_t size = 0;
    pin_method method = pin_method::host_alloc;
    bool small = false;
    block* first = nullptr;
  };
  struct by_size {
    using is_transparent = void;
    bool operator()(const block* a, const block* b) const {
      return a->size != b->size ? a->size < b->size : a->address < b->address;
    }
    bool operator()(const block* a, std::size_t size) const { return a->size < size; }
    bool operator()(std::size_t size, const block* b) const { return size < b->size; }
  };
  using free_set = std::set<block*, by_size>;

  free_set& free_set_for(bool small) { return small ? free_small_ : free_large_; }
  // Takes the best-fitting free block, splits it, hands it out.
  void* take_cached_locked(std::size_t rounded, std::size_t requested, bool small);
  void hand_out_locked(block* b, std::size_t rounded, std::size_t requested);
  void free_block_locked(block* b);
  std::size_t process_events_locked();
  // validate()'s checks: the first violation, or an empty string.
  std::string first_violation_locked() const;
  std::size_t slab_bytes_for_locked(std::size_t rounded, bool small) const;
  std::size_t release_idle_slabs_locked(std::size_t keep_bytes, std::string* first_error);
  bool slab_idle(const slab& s) const { return s.first->state == block_state::free && s.first->size == s.size; }
  status acquire_event_locked(int device, event_handle* out);
  // Pins a new slab of `bytes` with the lock released; nullptr (and the
  // status) on failure.
  slab* grow(std::unique_lock<std::mutex>& lock, std::size_t bytes, bool small, status* error);
  [[noreturn]] void throw_exhausted_locked(std::size_t requested, std::size_t rounded) const;

  host_backend& backend_;
  const pinned_pool_config config_;
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, std::unique_ptr<slab>> slabs_;
  free_set free_small_;
  free_set free_large_;
  std::unordered_map<std::uintptr_t, block*> live_;                 // allocated blocks by address
  std::vector<block*> pending_;                                     // oldest free first
  std::unordered_map<int, std::vector<event_handle>> idle_events_;  // per device
  std::size_t growing_bytes_ = 0;                                   // slabs being pinned with the lock released
  pinned_pool_stats stats_;
};

}  // namespace streamalloc
