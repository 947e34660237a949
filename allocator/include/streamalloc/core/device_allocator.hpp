// device_allocator: the allocator of one device, over up to four arenas
// (caching_allocators sharing an arena_ledger; the `arenas` setting caps
// them). One arena serves every thread until a thread keeps finding its
// lock held; that thread moves to a less busy arena (Note [arenas] in
// device_allocator.cpp). The public calls are caching_allocator's, for the
// whole device.
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "streamalloc/backend/device_backend.hpp"
#include "streamalloc/core/arena_ledger.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/config.hpp"

namespace streamalloc {

class device_allocator final : private caching_allocator::contention_observer {
 public:
  using stream_filter = caching_allocator::stream_filter;
  using shareable_range = caching_allocator::shareable_range;
  using usage = caching_allocator::usage;
  static constexpr int k_max_arenas = arena_ledger::k_max_arenas;
  // Note [arenas]: a thread moves after this many calls in a row found
  // the lock held, each within k_contention_gap_ns of the one before.
  static constexpr int k_contended_run = 128;
  static constexpr std::int64_t k_contention_gap_ns = 1'000'000;

  // `backend` must outlive the allocator.
  device_allocator(device_backend& backend, allocator_config config);
  ~device_allocator() override;
  device_allocator(const device_allocator&) = delete;
  device_allocator& operator=(const device_allocator&) = delete;

  // With one arena (no thread has moved yet) these go straight to it.
  void* allocate(std::size_t bytes, stream_handle stream) {
    if (count_.load(std::memory_order_acquire) == 1) return owned_[0]->allocate(bytes, stream);
    return allocate_in_arenas(bytes, stream);
  }
  void free(void* ptr) {
    if (count_.load(std::memory_order_acquire) == 1) {
      owned_[0]->free(ptr);
    } else {
      free_in_arenas(ptr);
    }
  }
  void record_stream(void* ptr, stream_handle stream);
  void empty_cache();
  void empty_cache(pool_id id);
  void allow_peer_access(int peer_device);
  void set_memory_fraction(double fraction);
  double memory_fraction() const;

  // Private pools, captures and MemPools live in arena 0; while an
  // allocation to a pool is underway every thread allocates there.
  void begin_allocate_to_pool(pool_id id, stream_filter filter);
  void end_allocate_to_pool(pool_id id);
  void release_pool(pool_id id);
  void create_or_incref_pool(pool_id id, std::shared_ptr<segment_source> source = nullptr);
  int pool_use_count(pool_id id) const;
  void set_pool_use_on_oom(pool_id id, bool use_on_oom);
  void set_pool_no_split(pool_id id, bool no_split);
  pool_checkpoint checkpoint_pool(pool_id id) const;
  pool_restore_result restore_pool(const pool_checkpoint& state);
  bool pool_allocations_match(pool_id id, const std::vector<const void*>& expected) const;

  // Set on every arena, those made later included.
  void set_trace_listener(trace_listener* listener);
  void update_config(const allocator_config& config);
  allocator_config config() const;
  shareable_range share_range(const void* ptr) const;

  // The device's statistics: current and peak counts of the sum over arenas
  // (exact peaks, Note [peak headroom]), cumulative counts summed.
  device_stats stats() const;
  usage current_usage() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  // Every arena's segments, in address order.
  allocator_snapshot snapshot() const;
  bool owns(const void* ptr) const;
  std::size_t allocation_size(const void* ptr) const;
  void cache_info(std::size_t* largest_free_bytes, std::size_t* total_free_bytes) const;
  // Every arena's invariants, and the device's counts against their sum.
  void validate() const;
  void lock_for_fork();
  void unlock_after_fork();

  int device() const { return backend_.device_index(); }
  device_backend& backend() { return backend_; }

  // Arenas made so far (1 until a thread first moves), and one of them.
  int arena_count() const { return count_.load(std::memory_order_acquire); }
  caching_allocator& arena(int index) const {
    return *arenas_[static_cast<std::size_t>(index)].load(std::memory_order_acquire);
  }
  // The arena this thread allocates from now.
  int arena_of_this_thread() const;
  // The most arenas this device makes (the `arenas` setting).
  int max_arenas() const { return max_arenas_; }
  // Moves this thread to arena `index` (below max_arenas()), making arenas
  // up to it; for tests that need several arenas without contention.
  void move_this_thread(int index);

 private:
  // A thread's arena on one device allocator, and its run of contended
  // calls.
  struct thread_entry {
    std::uint64_t id = 0;  // 0: unused
    int arena = 0;
    int contended_run = 0;
    std::int64_t last_contended_ns = 0;
  };
  struct thread_entries;
  // A thread counted on `arena` has exited (or its entry was overwritten).
  void thread_left(int arena);
  int threads_on(int arena) const;
  void* allocate_in_arenas(std::size_t bytes, stream_handle stream);
  void free_in_arenas(void* ptr);
  thread_entry& this_thread() const {
    if (last_entry_ != nullptr && last_entry_->id == id_) return *last_entry_;
    return this_thread_slow();
  }
  thread_entry& this_thread_slow() const;
  // The entry this thread used last, of any device allocator: a plain
  // pointer needs no guard on each access, unlike thread_entries.
  static thread_local thread_entry* last_entry_;
  caching_allocator& allocating_arena(const thread_entry& mine) const;
  // Counts a contended call of this thread; moves it after a run of them.
  void on_contended_call() override;
  void move_locked(thread_entry& mine, int to);
  void make_arena_locked();
  // The ledger's way to other arenas' caches for arena `arena`, which
  // holds its lock: out of memory, arenas after it are waited for and
  // those before it tried (the lock order is by index); for collection,
  // every one is only tried.
  bool release_elsewhere(int arena, arena_ledger::release_reason why);
  // The arena whose live allocation `ptr` is, or nullptr.
  caching_allocator* owner_of(const void* ptr) const;

  device_backend& backend_;
  const std::uint64_t id_;  // tells this allocator's thread entries from a destroyed one's
  arena_ledger ledger_;
  // Owners of the arenas; owned_[0] is set once, before any call, and read
  // without a lock by the one-arena path.
  std::array<std::unique_ptr<caching_allocator>, k_max_arenas> owned_;
  std::array<std::atomic<caching_allocator*>, k_max_arenas> arenas_{};
  std::atomic<int> count_{1};
  const int max_arenas_;
  // Allocations to a private pool underway (changed under arenas_mutex_):
  // while nonzero, every thread allocates from arena 0.
  std::atomic<int> routed_{0};
  // Guards making arenas, moves, and the settings later arenas start with.
  mutable std::mutex arenas_mutex_;
  // Threads on each arena: changed under arenas_mutex_, or by a thread
  // leaving (under the registry's lock only, so that lock stays a leaf).
  mutable std::array<std::atomic<int>, k_max_arenas> threads_{};
  std::vector<int> peers_;
  trace_listener* listener_ = nullptr;
};

}  // namespace streamalloc
