// caching_allocator: the block-caching device allocator, one per device.
// Policy summary is at the top of allocator/src/core/caching_allocator.cpp.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "streamalloc/backend/device_backend.hpp"
#include "streamalloc/core/adaptive_mutex.hpp"
#include "streamalloc/core/address_map.hpp"
#include "streamalloc/core/arena_ledger.hpp"
#include "streamalloc/core/block.hpp"
#include "streamalloc/core/call_combiner.hpp"
#include "streamalloc/core/config.hpp"
#include "streamalloc/core/event_pool.hpp"
#include "streamalloc/core/free_block_index.hpp"
#include "streamalloc/core/pool_checkpoint.hpp"
#include "streamalloc/core/recent_frees.hpp"
#include "streamalloc/core/repeat_slot.hpp"
#include "streamalloc/core/segment_source.hpp"
#include "streamalloc/core/size_policy.hpp"
#include "streamalloc/core/snapshot.hpp"
#include "streamalloc/core/stats.hpp"
#include "streamalloc/core/stream_counts.hpp"
#include "streamalloc/core/trace.hpp"

namespace streamalloc {

class trace_listener;  // streamalloc/core/trace.hpp

class caching_allocator {
 public:
  // Chooses the streams whose allocations go to a private pool (capture).
  using stream_filter = std::function<bool(stream_handle)>;

  // `backend` must outlive the allocator.
  caching_allocator(device_backend& backend, allocator_config config);
  ~caching_allocator();
  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;

  // Returns device memory of at least `bytes` usable on `stream`, or throws
  // out_of_memory. Size 0 returns nullptr, as torch's allocator does.
  void* allocate(std::size_t bytes, stream_handle stream);
  // Frees a pointer returned by allocate. Throws usage_error for a pointer
  // this allocator does not own (never allocated, interior, double free).
  void free(void* ptr);
  // free for a pointer that may be another arena's: false, changing
  // nothing, when `ptr` is not a live allocation of this one.
  bool free_if_owned(void* ptr);
  // Marks that `stream` uses the block at `ptr`; its free waits for `stream`.
  void record_stream(void* ptr, stream_handle stream);
  // Returns every unused cached segment to the device.
  void empty_cache();
  // torch's emptyCache(mempool_id): for a private pool whose uses are all
  // released, waits for its pending frees and returns its unused cached
  // segments; a pool still in use (or unknown) keeps everything. id 0 is
  // empty_cache().
  void empty_cache(pool_id id);
  // Lets `peer_device` read and write this allocator's expandable-segment
  // memory, mapped now or later (plain segments need no grant). Throws
  // device_failure when the driver refuses.
  void allow_peer_access(int peer_device);
  // Caps reserved memory at `fraction` of device memory (0 <= fraction <= 1;
  // 0 lets nothing new be reserved, as in torch).
  void set_memory_fraction(double fraction);
  double memory_fraction() const;

  // --- private pools for CUDA graph capture ---
  // Until end_allocate_to_pool(id), allocations on streams accepted by
  // `filter` come from private pool `id` (created on first use, counted).
  void begin_allocate_to_pool(pool_id id, stream_filter filter);
  void end_allocate_to_pool(pool_id id);
  // Drops one use of pool `id`. At zero the pool serves no new request and
  // its unused cached segments return to the device at the next
  // empty_cache() or empty_cache(id), or when the OOM ladder releases memory
  // (Note [released pools], as torch keeps a destroyed graph's memory).
  void release_pool(pool_id id);

  // --- private pools shared by torch.cuda.MemPool and graph trees ---
  // Creates pool `id` with one use, or adds a use to it (begin_allocate_to_pool
  // adds one too; release_pool drops one). With a `source` (only when the
  // pool is created) the pool's segments come from it instead of the device
  // backend; such a pool, like every private pool, uses plain segments.
  void create_or_incref_pool(pool_id id, std::shared_ptr<segment_source> source = nullptr);
  // Uses of pool `id` still held (0 for a pool that does not exist).
  int pool_use_count(pool_id id) const;
  // A default-pool request that would fail with out_of_memory first tries
  // the free blocks of pools marked use_on_oom (torch's MemPool use_on_oom).
  // Throws usage_error for a pool that does not exist.
  void set_pool_use_on_oom(pool_id id, bool use_on_oom);
  // Blocks of pool `id` are never split: each allocation takes a whole
  // segment of its own (torch's MemPool no_split). Throws usage_error for a
  // pool that does not exist.
  void set_pool_no_split(pool_id id, bool no_split);
  // The block layout of pool `id` (Note [pool checkpoints]); throws
  // usage_error while a block of the pool awaits stream events, and for a
  // pool that is unknown or released.
  pool_checkpoint checkpoint_pool(pool_id id) const;
  // Frees every allocation of the checkpoint's pool, then allocates the
  // blocks the checkpoint records as allocated, at their addresses. Throws
  // usage_error, changing nothing, when the pool is unknown or released, a
  // block of it awaits stream events, or a checkpointed segment is gone.
  pool_restore_result restore_pool(const pool_checkpoint& state);
  // Whether the live allocations of pool `id` are exactly `expected`
  // (usage_error for an unknown pool).
  bool pool_allocations_match(pool_id id, const std::vector<const void*>& expected) const;

  // --- memory history ---
  // Events are collected while a listener is set (nullptr: none, the
  // default) and delivered after each call releases the lock; the listener
  // must outlive its registration. Returns once no other thread is still
  // delivering to the listener it replaces (Note [trace delivery]).
  void set_trace_listener(trace_listener* listener);

  // --- settings at run time (torch.cuda.memory._set_allocator_settings) ---
  // Applies the keys that may change while memory is live:
  // max_split_bytes, max_non_split_rounding_bytes, roundup_power2_divisions
  // (either form), garbage_collection_threshold and expandable_segments
  // (for segments created from now on; existing ones keep their kind).
  // Every other field of `config` must equal the current one (usage_error
  // naming the field); config_error if `config` itself is invalid.
  void update_config(const allocator_config& config);
  // The settings in force (a copy: update_config may change them).
  allocator_config config() const;

  // --- CUDA IPC ---
  // The memory torch shares for the live allocation at `ptr`: the whole
  // plain segment holding it, or the mapped chunks under it. Throws
  // usage_error when `ptr` is not the start of a live allocation.
  struct shareable_range {
    std::uintptr_t address = 0;  // start of the shared range
    std::size_t size = 0;
    bool expandable = false;
    std::size_t chunk_bytes = 0;           // expandable only
    std::vector<physical_handle> chunks;   // expandable only, in address order
  };
  shareable_range share_range(const void* ptr) const;

  // Note [stitch cycles]: the stitches one request size at one level of
  // allocated memory may make in all, back to back or not; a bound on the
  // stream synchronizations one repeating stitch costs.
  static constexpr int k_stitches_per_key = 64;
  // Note [stitch cycles]: what the growth that breaks cycles may add to
  // reserved memory in all, as a share of the allocation peak: the
  // project's target (peak reserved / peak allocated <= 1.02).
  static constexpr double k_cycle_growth_share = 0.02;
  // Address space reserved per expandable range, in multiples of the
  // device's memory (Note [address space] in expandable_segments.cpp).
  static constexpr std::size_t k_address_space_per_device_memory = 8;

  // --- introspection ---
  device_stats stats() const;
  // Current counts as stats() reports them, read without returning the
  // recent frees (Note [recent frees]) to their pools as stats() does (they
  // are left out instead), so a caller that polls between allocations
  // leaves the cache as it is.
  struct usage {
    std::int64_t allocations = 0;  // allocation.all.current
    std::int64_t allocated_bytes = 0;
    std::int64_t requested_bytes = 0;
    std::int64_t cross_stream_reuses = 0;
  };
  usage current_usage() const;
  void reset_peak_stats();
  void reset_accumulated_stats();
  allocator_snapshot snapshot() const;
  // Whether `ptr` is the start of a live allocation of this allocator.
  bool owns(const void* ptr) const;
  // Size of the block behind `ptr` (throws usage_error if unknown).
  std::size_t allocation_size(const void* ptr) const;
  // Largest free cached block and total free cached bytes (cudnn cacheInfo).
  void cache_info(std::size_t* largest_free_bytes, std::size_t* total_free_bytes) const;
  // Checks every invariant (see Note [invariants] in the .cpp); throws
  // std::logic_error describing the first violation.
  void validate() const;

  // --- fork support (pthread_atfork handlers of the process allocator) ---
  // Takes the allocator's lock, so no other thread is inside it when the
  // process forks; unlock_after_fork() releases it, in the parent and in
  // the child (whose only thread is the one that forked; the calls other
  // threads left for the lock's holder are dropped there).
  void lock_for_fork();
  void unlock_after_fork();
  // Whether a call waits for the lock's holder to run it (Note [combined
  // calls]); read without the lock, for tests that stage a combined call.
  bool calls_waiting() const { return waiting_calls_.any_listed(); }
  // How many critical sections have begun; read without the lock, for
  // tests of Note [repeats without the lock], whose calls begin none.
  std::uint64_t critical_sections() const { return mutex_.acquisitions(); }
  // Note [combined calls]: a holder takes no more listed calls once it has
  // run this many, so that its own caller is not held up for long.
  static constexpr int k_combined_calls_per_hold = 256;

  int device() const { return backend_.device_index(); }
  device_backend& backend() { return backend_; }

  // --- arenas of one device (Note [arenas] in device_allocator.cpp) ---
  // Makes this allocator arena `index` of the device whose shared books
  // `ledger` keeps: from now on each critical section publishes its
  // statistics there (recent frees left out), the memory-fraction cap
  // counts the other arenas' reserved bytes, and the lock-free repeat path
  // is off (a block parked without the lock would count as allocated in
  // the device's sums until the next critical section). Arena 0 seeds the
  // ledger.
  void join_ledger(arena_ledger* ledger, int index);
  // Told, on the calling thread, when an allocate or free finds the lock
  // held. Set before the allocator is shared between threads.
  class contention_observer {
   public:
    virtual ~contention_observer() = default;
    virtual void on_contended_call() = 0;
  };
  void set_contention_observer(contention_observer* observer) { contention_observer_ = observer; }
  // A capture underway on another arena of the device: frees with stream
  // uses defer their events, as during a capture of this arena's own, until
  // every such count ends (delta +1 at its start, -1 at its end).
  void count_capture_elsewhere(int delta);
  // Completes the pending frees whose events have completed, as this
  // arena's next allocation outside a capture would; nothing while a
  // capture is underway, when events may not be queried.
  void complete_finished_frees();
  // Returns this arena's unused cached memory to the device for another
  // arena: with `complete_pending`, after its pending frees complete, as
  // empty_cache(); with `wait` false, only if the lock is free now. True
  // when anything was released.
  bool release_cache_for_other(bool wait, bool complete_pending);

 private:
  struct pool_pair {
    pool_pair(node_recycler* recycler, std::size_t class_bytes)
        : small(class_bytes, recycler), large(class_bytes, recycler) {}
    free_block_index small;
    free_block_index large;
  };
  struct private_pool {
    private_pool(node_recycler* recycler, std::size_t class_bytes)
        : free(recycler, class_bytes), unmapped(recycler, class_bytes) {}
    pool_pair free;
    pool_pair unmapped;  // the unmapped blocks of its ranges (Note [private ranges])
    int use_count = 0;  // captures, graphs and MemPools still holding the pool
    std::size_t segments = 0;
    std::shared_ptr<segment_source> source;  // nullptr: segments come from the backend
    bool use_on_oom = false;
    bool no_split = false;
  };
  struct capture {
    pool_id id;
    stream_filter filter;
  };
  // Holds the lock for one public call and, on leaving, hands the trace
  // events the call recorded to the listener after unlocking (Note [trace
  // delivery]). Without a listener it costs one branch over a lock_guard.
  // Before it unlocks, it runs the calls that wait for the lock (Note
  // [combined calls]).
  class locked_call {
   public:
    explicit locked_call(caching_allocator& owner) : owner_(owner) { owner_.mutex_.lock(); }
    // For a lock this thread has just taken.
    locked_call(caching_allocator& owner, std::adopt_lock_t) : owner_(owner) {}
    ~locked_call() {
      owner_.publish_stats_locked();
      if (owner_.waiting_calls_.maybe_listed()) owner_.run_waiting_locked();
      if (owner_.trace_events_.empty()) {
        owner_.mutex_.unlock();
      } else {
        owner_.deliver_trace_and_unlock();
      }
    }
    locked_call(const locked_call&) = delete;
    locked_call& operator=(const locked_call&) = delete;

   private:
    caching_allocator& owner_;
  };
  // Note [combined calls]: an allocate or a free, run under the lock by
  // its caller or by the thread holding the lock when it came.
  struct combined_call : combiner_call {
    bool is_free = false;
    std::size_t bytes = 0;  // allocate
    stream_handle stream = 0;
    pool_id pool = 0;
    bool must_own = true;  // free: false for free_if_owned
    bool owned = true;     // free: whether the pointer was this arena's
    void* ptr = nullptr;  // free: the pointer; allocate: the result
    std::exception_ptr error;
  };
  // The path of an allocate or free that found the lock taken: waits for
  // the holder to run `own`, or runs it on taking the lock; rethrows its
  // exception on the calling thread.
  void run_contended(combined_call& own);
  // Lists `own` for the holder and waits. True: another thread ran it and
  // the lock is not held; false: this thread holds the lock, and `own` is
  // still listed (state waiting) or was left to it (declined).
  bool await_holder(combined_call& own);
  // Runs the listed calls, each a critical section of its own.
  void run_waiting_locked();
  void run_one_locked(combined_call& c);
  // Whether another thread waits for the call under way to finish: calls
  // are listed, or the holder is running a listed call (Note [stitching
  // under contention]).
  bool others_waiting_locked() const { return running_listed_call_ || waiting_calls_.any_listed(); }
  // Frees `ptr`; one this arena does not own throws usage_error, or with
  // `must_own` false returns false.
  bool free_locked(void* ptr, bool must_own = true);
  // free and free_if_owned past the repeat slot: the lock, or a combined
  // call. Inlined into both: one call less on every free.
  [[gnu::always_inline]] inline bool free_through_lock(void* ptr, bool must_own);
  // Note [repeats without the lock]: frees the block parked in repeat_, if
  // any, first thing in a critical section that allocates, frees or reads.
  // Inline: one load on every allocate and free that takes the lock.
  void unpark_locked() {
    if (repeat_.maybe_parked()) free_parked_locked();
  }
  void free_parked_locked();
  // Adds the reuses `b` made without the lock to the cumulative statistics.
  void count_lock_free_reuses_locked(block* b);
  struct pending_event {  // one outstanding event of a pending free
    event_handle event;
    block* owner;
  };
  // Where an expandable segment can serve a request: the front of unmapped
  // block `target`, extended backwards over `prefix` (a free mapped block of
  // the requesting stream just before it) when there is one.
  struct placement {
    block* target = nullptr;
    block* prefix = nullptr;
    std::size_t chunks = 0;  // chunks to map at target's start, or its end with at_end
    // Bytes the request takes from the front of the free block after target
    // (0: none), when the chunks mapped fall short.
    std::size_t after_bytes = 0;
    // Note [the hole's end]: the chunks go at target's end, joining the
    // free block after it.
    bool at_end = false;

    std::uintptr_t map_address(std::size_t chunk_bytes) const {
      return target->address + (at_end ? target->size - chunks * chunk_bytes : 0);
    }
  };

  // --- trace events (trace_buffer.cpp) ---
  void record_trace_locked(trace_action action, std::uintptr_t address, std::size_t size, stream_handle stream,
                           pool_id pool) {
    if (listener_ != nullptr) trace_events_.push_back({action, address, size, stream, pool});
  }
  // Takes the recorded events, unlocks, and delivers them.
  void deliver_trace_and_unlock();

  // --- settings at run time ---
  // Chunk and range sizes of expandable segments, once, when first enabled.
  void init_expandable_locked();
  // The device's memory in whole chunks: a range's size once the driver
  // refused more (Note [address space]).
  std::size_t device_range_bytes() const;
  // Recounts the oversize stats after max_split_bytes changed.
  void recount_oversize_locked();
  // Best fit of `stream` in `set` among the blocks new requests may use
  // (Note [expandable segments switched off]).
  block* usable_fit_locked(const free_block_index& set, std::size_t rounded, stream_handle stream) const {
    if (expandable_ || chunk_bytes_ == 0) return set.best_fit(stream, rounded);
    return set.first_fit_if(stream, rounded, [](const block* b) { return !b->owner->expandable(); });
  }

  void* allocate_locked(std::size_t bytes, stream_handle stream, pool_id pool);
  // allocate_locked past Note [recent frees]: the search, borrowing, growth
  // and the OOM ladder, out of line so the recent-free path stays short.
  void* search_and_grow_locked(std::size_t bytes, std::size_t rounded, stream_handle stream, pool_id pool, bool small,
                               bool mid_size, bool capturing, bool opens_small);
  // search_and_grow_locked after a miss in the stream's own free set (or
  // before looking there, for a request that opens_small): the block to
  // take, found, borrowed or grown; raises out_of_memory when there is none.
  // Out of line, so that a hit does not set up what only a miss uses.
  block* search_further_locked(std::size_t bytes, std::size_t rounded, stream_handle stream, pool_id pool, bool small,
                               bool mid_size, bool capturing, bool opens_small);
  block* find_free_block_locked(free_block_index& pool, std::size_t rounded, stream_handle stream);
  // Note [cross-stream reuse]: the best fit among other streams' cached
  // blocks; handing `b` to `stream` through an event (false when the device
  // refuses), remembered for Note [ping-pong hand-offs].
  block* find_other_stream_block_locked(free_block_index& pool, std::size_t rounded, stream_handle stream);
  bool hand_off_locked(block* b, stream_handle stream, int hand_backs);
  // Note [ping-pong hand-offs]: how many hand-offs straight back in a row
  // handing `b` to `stream` would make (0: it would not go straight back).
  int hand_backs_locked(const block* b, stream_handle stream) const;
  bool garbage_collection_due_locked() const;
  block* grow_locked(std::size_t rounded, stream_handle stream, pool_id pool, bool small);
  // Growth through whichever kind of segment `pool` uses.
  // `small`: the pool (small or large free blocks) the new segment or
  // chunks join.
  block* grow_any_locked(std::size_t rounded, stream_handle stream, pool_id pool, bool small, bool may_stitch);
  // While expandable segments are on: the default pool, and with
  // expandable_private_pools a private pool with neither its own segment
  // source nor no_split (Note [private ranges]).
  bool uses_expandable(pool_id pool) const;

  // --- expandable segments and stitching (expandable_segments.cpp) ---
  block* grow_expandable_locked(std::size_t rounded, stream_handle stream, pool_id pool, bool small, bool may_stitch);
  bool stitching_wanted_locked(std::size_t chunks, std::size_t rounded) const;
  double allocation_peak_with_locked(std::size_t rounded) const;
  bool stitch_cycle_allows_locked(std::size_t chunks, std::size_t rounded);
  std::pair<std::int64_t, std::size_t> stitch_key_locked(std::size_t rounded) const;
  void count_stitch_locked(std::size_t rounded);
  placement place_locked(const free_block_index& unmapped, std::size_t rounded, stream_handle stream,
                         pool_id pool) const;
  segment* reserve_range_locked(std::size_t rounded, stream_handle stream, pool_id pool, bool small);
  // The set of `pool`'s unmapped blocks of one kind (Note [private ranges]).
  free_block_index& unmapped_set_locked(pool_id pool, bool small);
  const free_block_index& unmapped_set_locked(pool_id pool, bool small) const;
  std::size_t steal_idle_chunks_locked(std::size_t wanted, const placement& where, std::vector<physical_handle>* out);
  std::size_t idle_chunks(const block* b) const;
  std::size_t idle_chunks_in(const segment* s, std::uintptr_t from, std::uintptr_t to) const;
  // Unmaps up to `max_chunks` idle chunks lying in [from, to), from its end
  // backwards, out of the run of free blocks that starts at `first` and
  // covers that stretch (Note [free runs]).
  std::size_t unmap_idle_chunks_locked(block* first, std::uintptr_t from, std::uintptr_t to, std::size_t max_chunks,
                                       std::vector<physical_handle>* keep);
  status map_chunks_locked(const placement& where, const std::vector<physical_handle>& handles, std::size_t stolen);
  // The statistics of `chunks` chunks just mapped into, or unmapped from, `s`.
  void count_maps_locked(const segment* s, std::size_t chunks);
  void count_unmaps_locked(const segment* s, std::size_t chunks);
  void destroy_chunks_locked(const std::vector<physical_handle>& handles);
  block* take_mapped_front_locked(const placement& where, stream_handle stream);
  void insert_unmapped_locked(block* b);
  void refresh_split_count_locked(block* b);
  block* absorb_following_free_locked(block* b);
  // Unmaps the idle chunks of free blocks, after a device synchronization:
  // those of `only`'s ranges, or without it those of the default pool and of
  // every released private pool (a pool in use keeps its memory).
  void release_idle_chunks_locked(std::optional<pool_id> only = std::nullopt);
  bool release_range_locked(segment* s);
  void release_ranges_at_exit();
  void snapshot_expandable_locked(const segment* s, allocator_snapshot* out) const;
  // A snapshot segment for `s` (or a mapped run of it): all but its
  // address, size and blocks.
  segment_info snapshot_entry(const segment* s) const;
  // Adds `b` to a snapshot segment and to its allocated/active/requested sums.
  static void append_block_info(const block* b, segment_info* info);
  void validate_expandable_locked(const segment* s, std::vector<physical_handle>* seen) const;
  std::int64_t mapped_neighbours(const block* left, const block* right) const {
    return (left != nullptr && left->mapped ? 1 : 0) + (right != nullptr && right->mapped ? 1 : 0);
  }
  block* take_block_locked(block* b, std::size_t rounded, std::size_t requested);
  // Inline (defined in caching_allocator.cpp, their only user): on the path
  // of a same-size free and reuse.
  inline std::size_t chunk_start_gap(const block* b, std::size_t run, std::size_t rounded) const;
  void return_to_pool_locked(block* b);
  void release_to_pool_locked(block* b);
  // A free's trace entry and requested size, once its block is no longer
  // in use (at the free, or when its stream uses end).
  inline void complete_free_locked(block* b);
  inline void keep_recent_locked(block* b);
  inline block* repeated_reuse_locked(std::size_t rounded, stream_handle stream, bool small);
  block* take_recent_locked(std::size_t rounded, stream_handle stream, bool small);
  void flush_recent_locked() const;
  // A recent free leaves the pointer map and goes to its pool.
  void return_recent_locked(block* b);
  // Inline: a split's remainder and a freed block go through it on most
  // pairs. erase_free_locked stays out of line: inline too, it took GCC
  // past its inlining budget, and free() called the lock's release.
  void insert_free_locked(block* b) {
    b->owner->free_set->insert(b);
    if (b->is_split()) {
      b->counted_inactive_split = true;
      increase_stat(stats_.inactive_split, b->owner, 1);
      increase_stat(stats_.inactive_split_bytes, b->owner, static_cast<std::int64_t>(b->size));
    }
  }
  void erase_free_locked(block* b);
  void process_events_locked();
  void complete_event_locked(const pending_event& entry);
  void synchronize_pending_locked();
  void insert_events_locked(block* b);
  bool release_available_oversize_locked(std::size_t rounded, pool_id pool);
  void release_unused_segments_locked();
  bool release_segment_locked(segment* s);
  bool segment_unused(const segment* s) const;
  bool pool_releasable_locked(pool_id pool) const;
  // One segment (or range) of `pool` is gone; a released pool's books go
  // with its last.
  void forget_pool_segment_locked(pool_id pool);
  free_block_index& pool_for_locked(pool_id pool, bool small);
  const free_block_index& pool_for_locked(pool_id pool, bool small) const;
  template <typename self_type>
  static auto& pool_of(self_type& self, pool_id pool, bool small);
  pool_id route_capture(stream_handle stream);
  // Note [capture reuse].
  void watch_capture_uses_locked(block* b);
  void reclaim_reachable_frees_locked(stream_handle stream, pool_id pool);
  bool reaches_all_locked(const std::vector<graph_node_handle>& from, const std::vector<graph_node_handle>& targets);
  void finish_deferred_frees_locked();
  void set_fraction_locked(double fraction);

  // --- private pools shared with MemPool and graph trees (private_pools.cpp) ---
  bool pool_in_use_locked(pool_id pool) const;
  bool pool_no_split_locked(pool_id pool) const;
  // A plain segment from the pool's segment_source, or else the backend.
  status allocate_segment_locked(std::size_t bytes, stream_handle stream, pool_id pool, void** out);
  bool free_segment_locked(const segment* s);
  block* take_from_use_on_oom_pools_locked(std::size_t rounded, stream_handle stream);
  void synchronize_pool_events_locked(pool_id pool);
  // The existing segments `state` names, after checking it can be restored.
  std::vector<segment*> restorable_segments_locked(const pool_checkpoint& state) const;
  // Ends an allocation that restore_pool declares dead: no events, no uses.
  void end_allocation_locked(block* b);
  // The bookkeeping of handing out a block already cut to size (the caller
  // puts it in the pointer map unless it is a recent free, whose entry
  // stayed), and of taking it back (before its memory is reusable).
  // Inline: mark_allocated_locked ends every allocation but a recent free's.
  void mark_allocated_locked(block* b, std::size_t requested) {
    segment* s = b->owner;
    const auto size = static_cast<std::int64_t>(b->size);
    increase_stat(stats_.allocation, s, 1);
    increase_stat(stats_.allocated_bytes, s, size);
    increase_stat(stats_.active, s, 1);
    increase_stat(stats_.active_bytes, s, size);
    if (s->pool == 0) active_by_stream_.add(b->stream, 1);
    hand_out_locked(b, requested);
  }
  // What every hand-out records, a recent free's too: the block's state,
  // the requested bytes, the oversize count and the trace entry.
  void hand_out_locked(block* b, std::size_t requested) {
    b->allocated = true;
    b->requested_size = requested;
    segment* s = b->owner;
    increase_stat(stats_.requested_bytes, s, static_cast<std::int64_t>(requested));
    if (policy_.is_oversize(b->size)) stats_.oversize_allocations.increase(1);
    // torch's history reports the bytes the caller asked for.
    record_trace_locked(trace_action::alloc, b->address, requested, b->stream, s->pool);
  }
  // Inline: most of a free's work. The allocation and active counts fall
  // separately (uncount_allocation_locked, uncount_active_locked): a
  // recent free keeps them until it returns (Note [recent frees]).
  void unmark_allocated_locked(block* b) {
    b->allocated = false;
    segment* s = b->owner;
    // free_completed follows, now or once the block's stream uses end
    // (return_to_pool_locked), as in torch's history.
    record_trace_locked(trace_action::free_requested, b->address, b->requested_size, b->stream, s->pool);
    decrease_stat(stats_.requested_bytes, s, static_cast<std::int64_t>(b->requested_size));
    if (policy_.is_oversize(b->size)) stats_.oversize_allocations.decrease(1);
  }
  void uncount_allocation_locked(const block* b) {
    decrease_stat(stats_.allocation, b->owner, 1);
    decrease_stat(stats_.allocated_bytes, b->owner, static_cast<std::int64_t>(b->size));
  }
  void uncount_active_locked(const block* b) {
    decrease_stat(stats_.active, b->owner, 1);
    decrease_stat(stats_.active_bytes, b->owner, static_cast<std::int64_t>(b->size));
  }
  // mark_allocated_locked for a recent free taken back (Note [recent frees]).
  inline void reuse_recent_locked(block* b, std::size_t requested);
  void rebuild_segment_locked(segment* s, const pool_checkpoint::segment_state& state, pool_restore_result* out);
  // Adds to (or, negative, takes from) the "all" entry and the segment's pool entry.
  static void update_stat(stat_array& array, const segment* s, std::int64_t delta) {
    if (delta >= 0) {
      increase_stat(array, s, delta);
    } else {
      decrease_stat(array, s, -delta);
    }
  }
  // update_stat where the sign is known, for the frequent callers: no branch on it.
  static void increase_stat(stat_array& array, const segment* s, std::int64_t amount) {
    at(array, stat_type::all).increase(amount);
    at(array, pool_stat(s->is_small)).increase(amount);
  }
  static void decrease_stat(stat_array& array, const segment* s, std::int64_t amount) {
    at(array, stat_type::all).decrease(amount);
    at(array, pool_stat(s->is_small)).decrease(amount);
  }
  [[noreturn]] void raise_oom_locked(std::size_t requested, stream_handle stream = 0, pool_id pool = 0);
  std::string describe_unknown_pointer_locked(const void* ptr) const;
  block* new_block_locked();
  void delete_block_locked(block* b);
  void fill_fragmentation_locked(device_stats* out) const;
  template <typename fn>
  void for_each_free_set_locked(fn&& visit) const;

  device_backend& backend_;
  allocator_config config_;  // update_config changes some fields
  size_policy policy_;       // reads config_
  mutable adaptive_mutex mutex_;
  call_combiner<combined_call> waiting_calls_;
  // Set while the holder runs a call whose caller waits for it
  // (others_waiting_locked).
  bool running_listed_call_ = false;
  int fork_parent_pid_ = 0;  // the process that called lock_for_fork
  // Note [trace delivery]: the listener and the events of the call under
  // way, both guarded by mutex_; and the deliveries running outside it, one
  // entry (its listener) each, guarded by delivery_mutex_.
  trace_listener* listener_ = nullptr;
  std::vector<trace_event> trace_events_;
  std::mutex delivery_mutex_;
  std::condition_variable delivery_done_;
  std::vector<trace_listener*> delivering_;
  event_pool events_;
  node_recycler set_nodes_;  // before the pools: their trees return nodes to it
  std::size_t device_total_bytes_ = 0;
  std::size_t allowed_bytes_ = 0;  // memory-fraction cap
  double fraction_ = 1.0;
  pool_pair default_pool_{&set_nodes_, config_.min_block_bytes};
  // Expandable segments: whether the default pool uses them, their chunk
  // size, the size of a fresh range, the devices every range is opened to
  // (allow_peer_access; a range reserved later starts with them), and the
  // unmapped blocks per pool kind. Each range's chunks are its
  // expandable_range's (segment::range).
  bool expandable_ = false;
  std::size_t chunk_bytes_ = 0;
  std::size_t range_bytes_ = 0;  // address space reserved per range (Note [address space])
  std::vector<int> peers_;
  pool_pair unmapped_{&set_nodes_, config_.min_block_bytes};  // the default pool's ranges' unmapped blocks
  // Note [stitch cycles]: how many separate runs each stitch (a request
  // size at a level of allocated memory) has made, and the last stitch's.
  struct stitch_count {
    int runs = 0;
    int stitches = 0;
    bool grew = false;  // refused once, grown instead (Note [stitch cycles])
    std::uint64_t last_run_at = 0;  // allocation_clock_ when its last run began
    std::uint64_t last_gap = 0;     // allocations between its last two runs' starts (0: one run so far)
  };
  // Note [stitch cycles]: whether a run of `count`'s stitch beginning now
  // comes a whole number of its last gaps after the last run began, or its
  // last gap a whole number of these: recurrences a loop's period apart.
  bool recurs_periodically_locked(const stitch_count& count) const;
  std::map<std::pair<std::int64_t, std::size_t>, stitch_count> stitch_runs_;
  std::pair<std::int64_t, std::size_t> last_stitch_{-1, 0};
  std::size_t cycle_grown_bytes_ = 0;  // grown instead of stitching, since the history began
  std::map<pool_id, private_pool> private_pools_;
  std::vector<capture> captures_;
  std::atomic<int> capture_count_{0};
  // Pending frees whose events wait for every capture to end (events
  // recorded during a capture would become part of the graph).
  std::vector<block*> deferred_frees_;
  // Note [capture reuse]: of the deferred frees, those that may return to
  // their pool during the capture, with the capture frontiers of their use
  // streams at the free: reachable from the block stream's frontier, every
  // captured use is ordered before new work on that stream.
  struct capture_free {
    block* b = nullptr;
    std::vector<graph_node_handle> uses;
  };
  std::vector<capture_free> capture_frees_;
  // Pending frees whose event could not be recorded: they wait for a
  // successful device synchronization.
  std::vector<block*> awaiting_device_sync_;
  // The pointer map: the allocated blocks, and the recent frees, whose
  // entries stay so that taking one back inserts nothing (Note [recent
  // frees]).
  address_map allocated_;
  // The allocated block at `ptr`, or nullptr.
  block* allocated_block_locked(const void* ptr) const {
    block* b = allocated_.find(reinterpret_cast<std::uintptr_t>(ptr));
    return b != nullptr && b->allocated ? b : nullptr;
  }
  // Note [recent frees]: default-pool blocks freed last, kept whole for a
  // request of the same size and stream. Mutable: a const reader (stats,
  // snapshot) returns them to their pools first, which changes nothing a
  // caller can observe.
  mutable recent_frees recent_;
  // Note [repeats without the lock]: a block a loop frees and takes back
  // without the lock. Mutable for the readers, as recent_.
  mutable repeat_slot repeat_;
  // Note [recent frees]: reuses of recent frees that the cumulative
  // allocation and active counters have yet to count, by pool kind
  // (index: is_small), added when the recent frees are flushed.
  struct reuse_tally {
    std::int64_t reuses = 0;
    std::int64_t bytes = 0;
  };
  std::array<reuse_tally, 2> reuse_tally_{};
  // Note [mid-size requests]: the default pool's active blocks per stream,
  // so a mid-size request can tell a stream that holds no memory. A recent
  // free stays counted until it returns to its pool, so a reuse leaves the
  // count alone (Note [recent frees]).
  stream_counts active_by_stream_;
  std::map<std::uintptr_t, segment*> segments_;
  // Outstanding events per stream, in record order: a stream's events
  // complete in order, so polling stops at the first unfinished one.
  std::unordered_map<stream_handle, std::deque<pending_event>> pending_;
  std::vector<block*> spare_blocks_;
  // Note [ping-pong hand-offs]: allocations so far, and the latest
  // hand-offs, one slot per block with slots reused in turn: as many as
  // the window can hold (one hand-off per allocation at most).
  struct hand_off {
    std::uintptr_t address = 0;  // of the block handed over; 0: slot unused
    stream_handle from = 0;
    stream_handle to = 0;
    std::uint64_t at = 0;  // allocation_clock_ then
    int hand_backs = 0;    // hand-offs straight back in a row it ended
  };
  static constexpr std::size_t k_ping_pong_window_allocations = 16;
  // The hand-off straight back, counted in a row, from which growth is tried.
  static constexpr int k_refused_hand_back = 2;
  std::uint64_t allocation_clock_ = 0;
  std::array<hand_off, k_ping_pong_window_allocations> recent_hand_offs_{};
  std::size_t next_hand_off_slot_ = 0;
  device_stats stats_;
  // Note [arenas]: the device's shared books when this is one of several
  // arenas, and its index there.
  arena_ledger* ledger_ = nullptr;
  int arena_ = 0;
  int captures_elsewhere_ = 0;  // guarded by mutex_
  contention_observer* contention_observer_ = nullptr;
  // Publishes the statistics of the critical section ending (no-op with
  // one arena).
  void publish_stats_locked() {
    if (ledger_ != nullptr) publish_to_ledger_locked();
  }
  void publish_to_ledger_locked();
  // Reserved bytes as the memory-fraction cap counts them: this arena's,
  // plus the other arenas' of the device.
  std::size_t capped_reserved_locked() const {
    const std::int64_t own = at(stats_.reserved_bytes, stat_type::all).current;
    return static_cast<std::size_t>(ledger_ != nullptr ? own + ledger_->reserved_elsewhere(arena_) : own);
  }
};

}  // namespace streamalloc
