// The block-caching device allocator. Policy in brief:
// - Requests are rounded (size_policy) and served from a small pool
//   (<= 1 MiB, 2 MiB segments shared by many blocks; <= 384 KiB with
//   expandable segments, Note [mid-size requests]) or a large pool.
// - Free blocks are cached per (memory pool, small/large, stream) and found
//   by best fit; a found block is split when the remainder is worth keeping,
//   and a freed block coalesces with free neighbours of the same stream.
// - A block used on other streams (record_stream) becomes reusable only when
//   an event recorded on each of those streams at free time completes.
// - Note [cross-stream reuse]: before growing, a free block cached for
//   stream A may serve stream B: an event is recorded on A and B waits on
//   it, so B's work starts after A's last use without a host sync. The
//   whole block goes to B, the rest of it too (Note [borrowed remainders]);
//   a block that keeps going back and forth grows a copy instead (Note
//   [ping-pong hand-offs]).
// - Each allocation first reclaims completed pending frees, then tries the
//   free list; when that misses, the OOM ladder runs (allocate_locked) and
//   ends in out_of_memory carrying the numbers a user needs.
// - Private pools serve CUDA graph captures and torch.cuda.MemPool and keep
//   their memory while in use; a released pool's stays cached until
//   empty_cache (private_pools.cpp, Note [released pools]).
#include "streamalloc/core/caching_allocator.hpp"

#include <algorithm>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unordered_set>

#include <unistd.h>

#include "streamalloc/core/block_list.hpp"
#include "streamalloc/util/errors.hpp"

namespace streamalloc {
namespace {

constexpr std::size_t k_max_size = std::numeric_limits<std::size_t>::max();
// Note [combined calls].
constexpr int k_waiting_spins = 2000;

std::uintptr_t to_address(const void* ptr) { return reinterpret_cast<std::uintptr_t>(ptr); }

}  // namespace

const char* to_string(block_state state) {
  switch (state) {
    case block_state::active_allocated:
      return "active_allocated";
    case block_state::active_pending_free:
      return "active_pending_free";
    case block_state::inactive:
      return "inactive";
  }
  return "unknown";
}

caching_allocator::caching_allocator(device_backend& backend, allocator_config config)
    : backend_(backend),
      config_(std::move(config)),
      policy_(config_, config_.expandable_segments && backend.supports_virtual_memory()),
      events_(backend) {
  config_.validate();
  device_memory_info info;
  const status st = backend_.memory_info(&info);
  if (!st) {
    throw device_failure("streamalloc: cannot read memory info of device " + std::to_string(backend_.device_index()) +
                         ": " + st.message());
  }
  device_total_bytes_ = info.total_bytes;
  set_fraction_locked(config_.memory_fraction);
  expandable_ = config_.expandable_segments && backend_.supports_virtual_memory();
  if (expandable_) init_expandable_locked();
  stats_.max_split_size = config_.max_split_bytes == k_max_size ? -1 : static_cast<std::int64_t>(config_.max_split_bytes);
}

caching_allocator::~caching_allocator() {
  flush_recent_locked();
  // Outstanding work is finished before its memory goes back to the device.
  for (auto& [stream, queue] : pending_) {
    for (const pending_event& entry : queue) {
      backend_.synchronize_event(entry.event);
      backend_.destroy_event(entry.event);
    }
  }
  release_ranges_at_exit();
  for (auto& [address, s] : segments_) {
    if (!s->expandable()) free_segment_locked(s);
    block* b = s->first;
    while (b != nullptr) {
      block* next = b->next;
      delete b;
      b = next;
    }
    delete s;
  }
  for (block* b : spare_blocks_) delete b;
}

// ---------------------------------------------------------------------------
// Allocation

void* caching_allocator::allocate(std::size_t bytes, stream_handle stream) {
  if (bytes == 0) return nullptr;
  const bool capturing = capture_count_.load(std::memory_order_acquire) != 0;
  if (!capturing) {
    block* orphan = nullptr;
    if (void* p = repeat_.take(bytes, stream, mutex_.acquisitions(), &orphan)) return p;
    if (orphan != nullptr) {
      locked_call call(*this);
      free_locked(reinterpret_cast<void*>(orphan->address));
    }
  }
  const pool_id pool = capturing ? route_capture(stream) : 0;
  if (!mutex_.try_lock()) {
    if (contention_observer_ != nullptr) contention_observer_->on_contended_call();
    combined_call* call = waiting_calls_.own_call();
    if (call == nullptr) {
      locked_call queued(*this);
      return allocate_locked(bytes, stream, pool);
    }
    call->is_free = false;
    call->bytes = bytes;
    call->stream = stream;
    call->pool = pool;
    run_contended(*call);
    return call->ptr;
  }
  locked_call call(*this, std::adopt_lock);
  return allocate_locked(bytes, stream, pool);
}

// ---------------------------------------------------------------------------
// Note [combined calls]: every allocate and free takes the device's one
// lock, and with many threads the time a call holds it grows several-fold
// (bench/RESULTS.md, the threads pattern): each holder finds the free
// sets, blocks and statistics in the cache of the core that held the lock
// before. So an allocate or free that finds the lock taken does not queue
// for it: it writes the call into its thread's slot (call_combiner), lists
// it and waits on the slot's state, and the holder (any locked_call),
// before it unlocks, scans the slots and runs the listed calls one after
// another with that state already in its cache and marks each done, its
// result or exception in the slot. Slots rather than one shared list:
// with 16 threads the list's head, which every caller wrote, and the walk
// along its links through the callers' caches took about a quarter of the
// holder's time (bench/RESULTS.md, thirty-third session). A thread
// without a slot (more than k_combiner_slots at once) queues on the lock,
// as does one whose slot went back at its exit. One thread at a time still
// changes the state, so nothing else changes: each call is a critical
// section of its own (the lock's section count, Note [repeated reuse],
// counts it) and sees what it would have seen had it taken the lock
// itself. The holder declines (its caller then takes the lock) while a
// trace listener is set, whose events must reach the listener on the
// calling thread (Note [trace delivery]), and while a graph capture is
// underway, when device calls made on the capturing thread for another
// thread's request could join the capture or be refused. Each change of
// holder moves that state to another core, so a holder keeps scanning
// until it has run k_combined_calls_per_hold calls (plus those of its last
// scan), which bounds how long its own caller is held up: 0.16-0.21 ms
// with 16 threads on the H200's host (bench/RESULTS.md, fourteenth
// session). The holder scans while a hint says a call was listed since its
// last scan; the hint may miss a call listed during a scan, so a waiter
// does not count on it: it takes the lock itself once the lock is free, or
// after k_waiting_spins polls, sleeping if it must.
void caching_allocator::run_contended(combined_call& own) {
  own.error = nullptr;
  if (!await_holder(own)) {
    locked_call call(*this, std::adopt_lock);
    // Listed or declined, it is this thread's to run now.
    own.state.store(combiner_call::idle, std::memory_order_relaxed);
    run_one_locked(own);
  }
  if (own.error) {
    std::exception_ptr error = std::move(own.error);
    own.error = nullptr;
    std::rethrow_exception(error);
  }
}

bool caching_allocator::await_holder(combined_call& own) {
  waiting_calls_.list(own);
  for (int spin = 0;; ++spin) {
    const int state = own.poll();
    if (state == combiner_call::done) return true;
    if (state == combiner_call::declined) {
      mutex_.lock();
      return false;
    }
    if (spin >= k_waiting_spins) {
      mutex_.lock();
    } else if (!mutex_.looks_free() || !mutex_.try_lock()) {
      adaptive_mutex::pause();
      continue;
    }
    // A holder finishes every call it took before it unlocks: `own` is done
    // or still listed.
    if (own.poll() != combiner_call::done) return false;
    mutex_.unlock();
    return true;
  }
}

void caching_allocator::run_waiting_locked() {
  int taken[k_combiner_slots];
  int ran = 0;
  while (ran < k_combined_calls_per_hold && waiting_calls_.maybe_listed()) {
    const int n = waiting_calls_.take(taken);
    for (int i = 0; i < n; ++i) {
      combined_call& c = waiting_calls_.at(taken[i]);
      ++ran;
      if (listener_ == nullptr && capture_count_.load(std::memory_order_relaxed) == 0) {
        mutex_.count_section();
        running_listed_call_ = true;
        run_one_locked(c);
        running_listed_call_ = false;
        ++stats_.num_combined_calls;
        publish_stats_locked();
        waiting_calls_.finish(taken[i], combiner_call::done);
      } else {
        waiting_calls_.finish(taken[i], combiner_call::declined);
      }
    }
  }
}

void caching_allocator::run_one_locked(combined_call& c) {
  try {
    if (c.is_free) {
      c.owned = free_locked(c.ptr, c.must_own);
    } else {
      c.ptr = allocate_locked(c.bytes, c.stream, c.pool);
    }
  } catch (...) {
    c.error = std::current_exception();
  }
}

void* caching_allocator::allocate_locked(std::size_t bytes, stream_handle stream, pool_id pool) {
  unpark_locked();
  // A pool released between routing and locking (or while its capture is
  // still underway) serves nothing new: the request goes to the default pool.
  if (pool != 0 && !pool_in_use_locked(pool)) pool = 0;
  ++allocation_clock_;
  std::size_t rounded = 0;
  if (!policy_.round(bytes, &rounded)) raise_oom_locked(bytes, stream, pool);
  const bool small = policy_.in_small_pool(rounded, pool);
  // Note [mid-size requests]: the small free blocks are searched after the
  // large ones, and growth may go to the small pool.
  const bool mid_size = !small && policy_.is_mid_size(rounded, pool);
  const bool capturing = capture_count_.load(std::memory_order_relaxed) != 0;
  // Note [mid-size requests]: a stream holding no memory may open a small
  // chunk before any large cached block is looked at. Its recent frees
  // count as active there but hold none.
  const bool opens_small =
      mid_size && active_by_stream_.get(stream) == static_cast<std::int64_t>(recent_.count_on(stream));

  // Note [recent frees]: a block of this size freed lately on this stream
  // is taken back whole; on a miss they all return to their pools first,
  // so the search sees what it would have seen without them.
  if (!recent_.empty()) {
    if (pool == 0 && !capturing && !opens_small) {
      block* b = pending_.empty() ? repeated_reuse_locked(rounded, stream, small) : nullptr;
      if (b == nullptr) {
        if (!pending_.empty()) process_events_locked();
        b = take_recent_locked(rounded, stream, small);
      }
      if (b != nullptr) {
        ++stats_.num_recent_reuses;
        recent_.count_hit();
        b->reuse_chain = mutex_.acquisitions();
        reuse_recent_locked(b, bytes);
        // Note [repeats without the lock]: the chain of Note [repeated
        // reuse] may go on without the lock.
        if (recent_.empty() && pending_.empty() && listener_ == nullptr) {
          count_lock_free_reuses_locked(repeat_.armed());
          repeat_.arm(b, bytes, b->reuse_chain);
        }
        return reinterpret_cast<void*>(b->address);
      }
    }
    flush_recent_locked();
  }
  return search_and_grow_locked(bytes, rounded, stream, pool, small, mid_size, capturing, opens_small);
}

void* caching_allocator::search_and_grow_locked(std::size_t bytes, std::size_t rounded, stream_handle stream,
                                                pool_id pool, bool small, bool mid_size, bool capturing,
                                                bool opens_small) {
  // Stage 1: reclaim pending frees whose events have completed, so they are
  // coalesced and counted inactive before the search (as PyTorch does).
  // Costs nothing when no free is pending; event queries are not allowed
  // while a capture is underway.
  if (!pending_.empty() && !capturing) process_events_locked();
  if (capturing && !capture_frees_.empty()) reclaim_reachable_frees_locked(stream, pool);

  // Stage 2: best fit among this stream's cached blocks; the common hit
  // takes no more.
  block* found = nullptr;
  if (!opens_small) {
    free_block_index& free_set =
        pool != 0 ? pool_for_locked(pool, small) : small ? default_pool_.small : default_pool_.large;
    found = find_free_block_locked(free_set, rounded, stream);
  }
  if (found == nullptr) {
    found = search_further_locked(bytes, rounded, stream, pool, small, mid_size, capturing, opens_small);
  }
  found = take_block_locked(found, rounded, bytes);
  return reinterpret_cast<void*>(found->address);
}

block* caching_allocator::search_further_locked(std::size_t bytes, std::size_t rounded, stream_handle stream,
                                                pool_id pool, bool small, bool mid_size, bool capturing,
                                                bool opens_small) {
  free_block_index& free_set = pool_for_locked(pool, small);
  free_block_index* second_set = mid_size ? &pool_for_locked(pool, true) : nullptr;
  int grow_small = small ? 1 : -1;  // -1: not decided yet
  const auto grow = [&](bool may_stitch) {
    if (grow_small < 0) grow_small = mid_size && second_set->best_fit(stream, 1) == nullptr ? 1 : 0;
    return grow_any_locked(rounded, stream, pool, grow_small == 1, may_stitch);
  };

  // The rest of stage 2: the stream's own free set when search_and_grow_locked
  // has not looked there yet, then the small free set of a mid-size request.
  block* found = nullptr;
  if (opens_small) {
    if (second_set->best_fit(stream, 1) == nullptr && !garbage_collection_due_locked()) {
      grow_small = 1;
      found = grow(/*may_stitch=*/!capturing);
    }
    if (found == nullptr) found = find_free_block_locked(free_set, rounded, stream);
  }
  if (found == nullptr && second_set != nullptr) found = find_free_block_locked(*second_set, rounded, stream);

  // Stage 3: Note [cross-stream reuse] -- borrow a block cached for another
  // stream; the borrowing stream waits on an event instead of the host.
  // Note [ping-pong hand-offs]: a block that keeps coming back grows a copy
  // instead, unless growing would fail or collect garbage.
  const auto borrow = [&](free_block_index& set) -> block* {
    block* other = find_other_stream_block_locked(set, rounded, stream);
    if (other == nullptr) return nullptr;
    block* result = nullptr;
    const int hand_backs = hand_backs_locked(other, stream);
    if (hand_backs >= k_refused_hand_back && !garbage_collection_due_locked()) {
      // Stitching would take the refused block's chunks after a stream
      // synchronization, which costs more than the hand-off.
      result = grow(/*may_stitch=*/false);
    }
    if (result == nullptr && hand_off_locked(other, stream, hand_backs)) {
      other->stream = stream;
      result = other;
    }
    return result;
  };
  if (found == nullptr && config_.cross_stream_reuse && !capturing) {
    found = borrow(free_set);
    if (found == nullptr && second_set != nullptr) found = borrow(*second_set);
  }

  // Stage 4: grow by a new segment, after an optional garbage collection of
  // unused cached segments when reserved memory nears the cap.
  if (found == nullptr) {
    if (!capturing && garbage_collection_due_locked()) {
      release_unused_segments_locked();
      // Note [arenas]: the threshold counts every arena's reserved bytes,
      // so the others' unused cached memory is collected too.
      if (ledger_ != nullptr && garbage_collection_due_locked()) {
        ledger_->release_elsewhere(arena_, arena_ledger::release_reason::collection);
      }
    }
    // Stitching synchronizes streams, which a capture forbids.
    found = grow(/*may_stitch=*/!capturing);
    // Before anything is released, a default-pool request may take a cached
    // block of a pool marked use_on_oom (Note [use_on_oom pools]).
    if (found == nullptr && pool == 0) found = take_from_use_on_oom_pools_locked(rounded, stream);
  }

  // Stage 5: release cached oversize blocks (whole segments) and grow again.
  // No memory is returned during a capture: the graph may still use it.
  if (found == nullptr) {
    ++stats_.num_alloc_retries;
    if (!capturing && release_available_oversize_locked(rounded, pool)) {
      found = grow(/*may_stitch=*/true);
    }
  }

  // Stage 6: wait for every pending free, return every unused cached
  // segment to the device, then retry the free list and growth. Skipped
  // during a capture, which must not synchronize.
  if (found == nullptr && !capturing) {
    synchronize_pending_locked();
    found = find_free_block_locked(free_set, rounded, stream);
    if (found == nullptr && second_set != nullptr) found = find_free_block_locked(*second_set, rounded, stream);
    if (found == nullptr) {
      release_unused_segments_locked();
      found = grow(/*may_stitch=*/true);
    }
  }

  // Note [arenas]: before giving up, the other arenas of the device return
  // their unused cached memory, and growth is tried once more.
  if (found == nullptr && !capturing && ledger_ != nullptr &&
      ledger_->release_elsewhere(arena_, arena_ledger::release_reason::out_of_memory)) {
    found = grow(/*may_stitch=*/true);
  }

  // Stage 7: give up with the numbers the user needs.
  if (found == nullptr) raise_oom_locked(bytes, stream, pool);
  return found;
}

// Note [mid-size requests]: with expandable segments and small_size_kb:auto
// the default pool's small pool ends at 384 KiB, where plain segments (and
// torch) end at 1 MiB; the requests between, mid-size ones, go to the large
// range, whose partly used last chunks they fill (Note [expandable
// segments]). Two exceptions bring them nearer torch's small pool:
// - When no large cached block of its stream fits, a mid-size request
//   takes a small cached block of its stream before it borrows or grows:
//   memory already mapped serves instead of a new chunk. On the simulated
//   device: hf_generate_dynamic 1.0433 -> 1.0292, inference_server 1.0083
//   -> 1.0065, unet_diffusion 1.0069 -> 1.0059, the rest unchanged.
// - A mid-size request that fits nowhere, of a stream without a free
//   small block, grows the small pool: the rest of the new small chunk
//   serves the stream's next small requests, which would otherwise map a
//   small chunk of their own, as torch's small segment would. A stream with
//   a free small block still has room for its small requests, so the
//   request goes to the large range.
// - A mid-size request of a stream that holds no memory at all (no active
//   block in the default pool) and has no free small block grows the small
//   pool before it looks at the large cached blocks: the stream starts
//   afresh (a new stream, or one whose memory went back with empty_cache),
//   its next small request would map a small chunk anyway, and this one
//   shares it, as in torch. Only when that growth fails (or a garbage
//   collection is due) does it search as above. A stream that holds memory
//   has its layout, and fills large tails as before: applying the rule to
//   every stream without small memory put bert_serve's first mid-size block
//   (its second request) in a small chunk, and its replay went from 1.0157
//   to 1.1827 (a later stitch was refused as a cycle and the range grew by
//   118 MiB). As it is, no corpus trace takes this path.
//   PyTorch's test_graph_memory_stats_and_use_result_after_destroy_graph
//   needs both rules: after empty_cache, a 1 MiB input on a side stream and
//   the two RNG holders a CUDA graph allocates in the default pool must
//   share one small segment (tests/unit/graph_memory_stats_test.cpp). After
//   the other TestCuda tests in one process the side stream held nothing,
//   but a free block of it of 1 MiB or more had outlived empty_cache beside
//   another tensor in the same chunk; the input went there and the holders
//   opened a small chunk of their own (3 new small segments where torch
//   counts 2).
// Broader rules cost ratio because the corpus is sensitive to where its
// first mid-size blocks (weights) go: growing the small pool whenever no
// large cached block fits took resnet50_fixed_batch from 1.0044 to 1.0214,
// hf_generate_static from 1.0412 to 1.0479 and the median from 1.0071 to
// 1.0091; growing it only while the large range maps nothing, or when large
// growth would not extend a mapped run, still took resnet50_fixed_batch to
// 1.0214 (three to six weights of 512-576 KiB, early in the trace, placed in
// small chunks).
//
// Note [max_split in expandable segments]: torch's max_split_size keeps
// cached blocks at or above it whole, for requests about their size: in a
// plain segment a split would strand the remainder there. An expandable
// segment splits every block anyway (size_policy::should_split), its free
// neighbours coalesce and its idle chunks can be unmapped or stitched, so
// the rule guards nothing there. Kept, it refused each free run that had
// coalesced past the limit to every smaller request, which grew the range
// instead, and the new memory joined the refused run once freed. With
// max_split_size_mb set (a key PyTorch users know, taken from
// STREAMALLOC_CONF, install() and torch.cuda.memory._set_allocator_settings)
// the corpus replayed with medians 1.1542, 1.0244, 1.0207 and 1.0130 at
// 20, 64, 128 and 512 MiB, its worst trace reserving 174.95, 95.24, 34.03
// and 13.47 times its live peak (bert_serve; resnet50_fixed_batch at 512).
// So a block of an expandable segment serves any request, and each of
// those settings replays as the defaults do. Plain segments
// (expandable_segments:False, private pools) keep torch's rules; the
// oversize statistics count as torch counts.
block* caching_allocator::find_free_block_locked(free_block_index& free_set, std::size_t rounded, stream_handle stream) {
  block* b = usable_fit_locked(free_set, rounded, stream);
  if (b == nullptr || !policy_.may_reuse(b->size, rounded, b->owner->expandable())) return nullptr;
  erase_free_locked(b);
  return b;
}

block* caching_allocator::find_other_stream_block_locked(free_block_index& free_set, std::size_t rounded,
                                                         stream_handle stream) {
  block* best = nullptr;
  std::size_t best_rank = 0;
  // The best fit of each other stream; the smallest wins, and among equals
  // the stream this allocator served first: an order of the program's, not
  // of the handles' values, which the runtime picks and which may differ
  // from one run of the same program to the next.
  const auto consider = [&](stream_handle other, block* candidate) {
    if (candidate == nullptr) return;
    if (!policy_.may_reuse(candidate->size, rounded, candidate->owner->expandable())) return;
    if (best != nullptr && candidate->size > best->size) return;
    const std::size_t rank = active_by_stream_.rank(other);
    if (best == nullptr || candidate->size < best->size || rank < best_rank) {
      best = candidate;
      best_rank = rank;
    }
  };
  // usable_fit_locked's two cases: every block usable (one pass over the
  // streams), or only blocks of plain segments (a filtered walk of each).
  if (expandable_ || chunk_bytes_ == 0) {
    free_set.for_each_best_fit(rounded, stream, consider);
  } else {
    free_set.for_each_stream([&](stream_handle other) {
      if (other != stream) consider(other, usable_fit_locked(free_set, rounded, other));
    });
  }
  return best;
}

bool caching_allocator::hand_off_locked(block* b, stream_handle stream, int hand_backs) {
  event_handle event = 0;
  if (!events_.acquire(&event)) return false;
  // A failed record or wait leaves the block where it was; growth follows.
  const bool handed_off = backend_.record_event(event, b->stream).ok() && backend_.stream_wait_event(stream, event).ok();
  // The wait captured the record, so the event may be re-recorded at once.
  events_.release(event);
  if (!handed_off) return false;
  erase_free_locked(b);
  ++stats_.num_cross_stream_reuses;

  hand_off* slot = nullptr;
  for (hand_off& h : recent_hand_offs_) {
    if (h.address == b->address) {
      slot = &h;
      break;
    }
  }
  if (slot == nullptr) {
    slot = &recent_hand_offs_[next_hand_off_slot_];
    next_hand_off_slot_ = (next_hand_off_slot_ + 1) % recent_hand_offs_.size();
  }
  *slot = hand_off{b->address, b->stream, stream, allocation_clock_, hand_backs};
  return true;
}

// Note [ping-pong hand-offs]: a block that goes from stream A to B and
// straight back to A, with at most k_ping_pong_window_allocations
// allocations between the moves, is ping-ponging: a program that frees it
// on one stream and asks again on the other pays an event record and a
// stream wait (two driver calls) on every allocation. The first hand-off
// straight back is made; the second in a row is refused while the
// requesting stream can grow without stitching or collecting garbage, so
// each stream keeps a block of its own and later requests are cache hits,
// as in PyTorch (which never hands blocks between streams). When growth
// fails (memory fraction, device full) the block is handed over as before,
// and the OOM ladder is unchanged.
// Why not refuse the first hand-back, or look further back: the copy costs
// a block of reserved memory that may outlive the ping-pong. In the trace
// corpus blocks do come straight back once, and some ping-pong every few
// hundred allocations (where the hand-offs' cost is spread thin); refusing
// those raised the multi-stream traces' peak reserved memory by up to a
// quarter of their peak allocated memory. Since whole blocks move (Note
// [borrowed remainders]) the rule also acts on the corpus: without it
// fsdp2_streams2 replays at 1.2124 instead of 1.0731 on the simulated
// device, offload_activations at 1.0220 instead of 1.0200.
int caching_allocator::hand_backs_locked(const block* b, stream_handle stream) const {
  for (const hand_off& h : recent_hand_offs_) {
    if (h.address != b->address) continue;
    const bool straight_back = h.from == stream && h.to == b->stream;
    return straight_back && allocation_clock_ - h.at <= k_ping_pong_window_allocations ? h.hand_backs + 1 : 0;
  }
  return 0;
}

bool caching_allocator::garbage_collection_due_locked() const {
  if (config_.garbage_collection_threshold <= 0.0) return false;
  const double reserved = static_cast<double>(capped_reserved_locked());
  return reserved > config_.garbage_collection_threshold * static_cast<double>(allowed_bytes_);
}

block* caching_allocator::grow_any_locked(std::size_t rounded, stream_handle stream, pool_id pool, bool small,
                                          bool may_stitch) {
  if (ledger_ == nullptr) {
    return uses_expandable(pool) ? grow_expandable_locked(rounded, stream, pool, small, may_stitch)
                                 : grow_locked(rounded, stream, pool, small);
  }
  // Note [arenas]: the cap counts every arena's reserved bytes, so arenas
  // grow one at a time and write theirs back before the next checks.
  std::lock_guard<std::mutex> growth(ledger_->growth_mutex());
  block* b = uses_expandable(pool) ? grow_expandable_locked(rounded, stream, pool, small, may_stitch)
                                   : grow_locked(rounded, stream, pool, small);
  ledger_->set_reserved(arena_, at(stats_.reserved_bytes, stat_type::all).current);
  return b;
}

block* caching_allocator::grow_locked(std::size_t rounded, stream_handle stream, pool_id pool, bool small) {
  std::size_t segment_bytes = 0;
  if (!policy_.segment_size(rounded, &segment_bytes)) return nullptr;
  const std::size_t reserved = capped_reserved_locked();
  if (segment_bytes > allowed_bytes_ || reserved > allowed_bytes_ - segment_bytes) return nullptr;

  void* ptr = nullptr;
  const status st = allocate_segment_locked(segment_bytes, stream, pool, &ptr);
  if (!st) {
    if (st.code() == status_code::out_of_memory) return nullptr;
    throw device_failure("streamalloc: device " + std::to_string(backend_.device_index()) +
                         " failed to allocate a segment: " + st.message());
  }

  auto* s = new segment;
  s->address = to_address(ptr);
  s->size = segment_bytes;
  s->stream = stream;
  s->is_small = small;
  s->pool = pool;
  s->free_set = &pool_for_locked(pool, s->is_small);
  block* b = new_block_locked();
  b->address = s->address;
  b->size = segment_bytes;
  b->stream = stream;
  b->owner = s;
  s->first = b;
  segments_.emplace(s->address, s);
  if (pool != 0) ++private_pools_.try_emplace(pool, &set_nodes_, config_.min_block_bytes).first->second.segments;

  update_stat(stats_.segment, s, 1);
  update_stat(stats_.reserved_bytes, s, static_cast<std::int64_t>(segment_bytes));
  if (policy_.is_oversize(segment_bytes)) stats_.oversize_segments.increase(1);
  ++stats_.num_device_alloc;
  record_trace_locked(trace_action::segment_alloc, s->address, s->size, stream, pool);
  return b;
}

// Note [borrowed remainders]: when stream B borrows a free block of stream
// A and needs only its front, the rest goes to B too. The event B waited on
// covers A's last use of the whole block, so the rest is as safe for B as
// the front. Left with A, the rest would sit beside B's block: once B frees
// it, the two pieces could never merge (they belong to two streams), and
// every hand-off would cut one more boundary into the free memory. Moving
// the whole block keeps it whole. A's next request borrows back or grows,
// as it would have done for the front. On the simulated device this took
// the corpus's multi-stream traces from 1.2573 to 1.0083
// (inference_server), 1.2093 to 1.1034 (fsdp2_streams4) and 1.1347 to
// 1.0731 (fsdp2_streams2), and left every other trace where it was.
//
// Note [chunk-aligned starts]: a block cut from the front of a free block
// in a large expandable range whose left neighbour belongs to another
// stream starts at the next chunk boundary instead, when that makes it
// touch one chunk fewer and it still fits; the piece in front (less than a
// chunk) stays free, of the same stream. Blocks of two streams live on
// different schedules (an all-gather buffer of a side stream beside the
// compute stream's activations): once the neighbour goes and its chunks
// are stitched away, a block sharing its first chunk with it is left alone
// in one chunk more than it needs, which no stitch can take back. Beside a
// block of its own stream the front placement packs tighter and is kept
// (aligning there too made fsdp2_streams4 1.0316), as is every block of
// the small range and of private pools. On the simulated device:
// fsdp2_streams2 1.0277 -> 1.0218, fsdp2_streams4 1.0291 -> 1.0203,
// offload_activations 1.0073 -> 1.0062; the other traces unchanged;
// stitches over the corpus 1114 -> 1094, stitch syncs 1707 -> 1665.
inline std::size_t caching_allocator::chunk_start_gap(const block* b, std::size_t run, std::size_t rounded) const {
  const segment* s = b->owner;
  if (!s->expandable() || s->is_small || s->pool != 0) return 0;
  const block* prev = b->prev;
  if (prev == nullptr || !prev->mapped || prev->stream == b->stream) return 0;
  const std::size_t chunk = s->range->chunk_bytes();
  const std::size_t start = b->address - s->address;
  const std::size_t gap = (start + chunk - 1) / chunk * chunk - start;
  if (gap < config_.min_block_bytes || gap + rounded > run) return 0;
  const std::size_t chunks_at_front = (start + rounded - 1) / chunk - start / chunk + 1;
  const std::size_t chunks_aligned = (rounded + chunk - 1) / chunk;
  return chunks_aligned < chunks_at_front ? gap : 0;
}

block* caching_allocator::take_block_locked(block* b, std::size_t rounded, std::size_t requested) {
  segment* s = b->owner;
  if (const std::size_t gap = chunk_start_gap(b, b->size, rounded); gap != 0) {
    block* head = b;
    b = split_at(head, gap, new_block_locked());
    b->stream = head->stream;
    insert_free_locked(head);
  }
  // A no_split pool hands out whole segments (torch's MemPool no_split).
  const bool may_split = s->pool == 0 || !pool_no_split_locked(s->pool);
  if (may_split && policy_.should_split(b->size, rounded, s->is_small, s->expandable())) {
    block* rest = split_at(b, rounded, new_block_locked());
    rest->stream = b->stream;
    // A block handed to another stream may now touch a free block of its
    // new stream (Note [borrowed remainders]).
    if (block* next = rest->next; next != nullptr && next->is_free_mapped() && next->stream == rest->stream) {
      erase_free_locked(next);
      delete_block_locked(absorb_next(rest));
    }
    insert_free_locked(rest);
  }
  allocated_.insert(b->address, b);
  mark_allocated_locked(b, requested);
  return b;
}

// Note [recent frees]: a recent free is still counted allocated and
// active, so taking it back changes no current count; the free and the
// allocation it makes are owed to the cumulative counters (reuse_tally_).
// Its requested bytes may differ: that stat is updated in full. Its
// pointer map entry stayed.
inline void caching_allocator::reuse_recent_locked(block* b, std::size_t requested) {
  reuse_tally& tally = reuse_tally_[b->owner->is_small ? 1 : 0];
  ++tally.reuses;
  tally.bytes += static_cast<std::int64_t>(b->size);
  hand_out_locked(b, requested);
}

// ---------------------------------------------------------------------------
// Free and stream uses

inline bool caching_allocator::free_through_lock(void* ptr, bool must_own) {
  if (!mutex_.try_lock()) {
    if (contention_observer_ != nullptr) contention_observer_->on_contended_call();
    combined_call* call = waiting_calls_.own_call();
    if (call == nullptr) {
      locked_call queued(*this);
      return free_locked(ptr, must_own);
    }
    call->is_free = true;
    call->must_own = must_own;
    call->ptr = ptr;
    run_contended(*call);
    return call->owned;
  }
  locked_call call(*this, std::adopt_lock);
  return free_locked(ptr, must_own);
}

void caching_allocator::free(void* ptr) {
  if (ptr == nullptr) return;
  if (repeat_.park(ptr, mutex_.acquisitions())) return;
  free_through_lock(ptr, /*must_own=*/true);
}

bool caching_allocator::free_if_owned(void* ptr) {
  if (ptr == nullptr) return true;
  if (repeat_.park(ptr, mutex_.acquisitions())) return true;
  return free_through_lock(ptr, /*must_own=*/false);
}

bool caching_allocator::free_locked(void* ptr, bool must_own) {
  unpark_locked();
  const std::size_t slot = allocated_.slot_of(to_address(ptr));
  block* b = allocated_.at(slot);
  if (__builtin_expect(b == nullptr || !b->allocated, 0)) {
    if (!must_own) return false;
    throw usage_error(describe_unknown_pointer_locked(ptr));
  }
  if (b->lock_free_reuses_counted != repeat_slot::reuses_of(b)) count_lock_free_reuses_locked(b);
  if (b == repeat_.armed()) repeat_.disarm();
  unmark_allocated_locked(b);

  if (b->stream_uses.empty() && b->owner->pool == 0 && capture_count_.load(std::memory_order_relaxed) == 0 &&
      recent_.keep_next()) {
    keep_recent_locked(b);  // its pointer map entry and its counts stay
    return true;
  }
  uncount_allocation_locked(b);
  allocated_.erase_at(slot);
  if (b->stream_uses.empty()) {
    return_to_pool_locked(b);
  } else if (capture_count_.load(std::memory_order_relaxed) != 0) {
    b->pending_events = 1;  // stands for the events recorded when captures end
    deferred_frees_.push_back(b);
    // Note [capture reuse]: it may return during the capture; else at its end.
    if (config_.graph_capture_record_stream_reuse) watch_capture_uses_locked(b);
  } else {
    insert_events_locked(b);
  }
  return true;
}

void caching_allocator::record_stream(void* ptr, stream_handle stream) {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  block* b = allocated_block_locked(ptr);
  if (b == nullptr) throw usage_error("record_stream: " + describe_unknown_pointer_locked(ptr));
  if (stream == b->stream) return;
  if (std::find(b->stream_uses.begin(), b->stream_uses.end(), stream) == b->stream_uses.end()) {
    b->stream_uses.push_back(stream);
  }
}

void caching_allocator::insert_events_locked(block* b) {
  bool needs_device_sync = false;
  for (stream_handle use : b->stream_uses) {
    event_handle event = 0;
    if (!events_.acquire(&event)) {
      needs_device_sync = true;
      continue;
    }
    if (!backend_.record_event(event, use)) {
      events_.release(event);
      needs_device_sync = true;
      continue;
    }
    pending_[use].push_back({event, b});
    ++b->pending_events;
  }
  b->stream_uses.clear();
  if (needs_device_sync) {
    // Without an event the only proof that the stream is done is a full
    // device synchronization; until one succeeds the block stays pending.
    ++b->pending_events;
    awaiting_device_sync_.push_back(b);
  }
  if (b->pending_events == 0) return_to_pool_locked(b);
}

void caching_allocator::process_events_locked() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    std::deque<pending_event>& queue = it->second;
    while (!queue.empty()) {
      bool done = false;
      if (!backend_.query_event(queue.front().event, &done) || !done) break;
      const pending_event entry = queue.front();
      queue.pop_front();
      complete_event_locked(entry);
    }
    it = queue.empty() ? pending_.erase(it) : std::next(it);
  }
}

void caching_allocator::complete_event_locked(const pending_event& entry) {
  events_.release(entry.event);
  if (--entry.owner->pending_events == 0) return_to_pool_locked(entry.owner);
}

void caching_allocator::synchronize_pending_locked() {
  ++stats_.num_sync_all_streams;
  bool device_synced = false;
  for (auto it = pending_.begin(); it != pending_.end();) {
    std::deque<pending_event>& queue = it->second;
    while (!queue.empty()) {
      if (!backend_.synchronize_event(queue.front().event)) {
        if (!device_synced && !backend_.synchronize_device()) break;
        device_synced = true;
      }
      const pending_event entry = queue.front();
      queue.pop_front();
      complete_event_locked(entry);
    }
    it = queue.empty() ? pending_.erase(it) : std::next(it);
  }
  if (!awaiting_device_sync_.empty() && (device_synced || backend_.synchronize_device())) {
    std::vector<block*> ready;
    ready.swap(awaiting_device_sync_);
    for (block* b : ready) {
      if (--b->pending_events == 0) return_to_pool_locked(b);
    }
  }
}

void caching_allocator::return_to_pool_locked(block* b) {
  complete_free_locked(b);
  uncount_active_locked(b);
  if (b->owner->pool == 0) active_by_stream_.add(b->stream, -1);
  release_to_pool_locked(b);
}

inline void caching_allocator::complete_free_locked(block* b) {
  record_trace_locked(trace_action::free_completed, b->address, b->requested_size, b->stream, b->owner->pool);
  b->requested_size = 0;
}

// Note [recent frees]: a program that frees a block and asks again for
// the same size on the same stream (a training step's activations, a
// loop's temporaries) would otherwise pay for a merge with the block's
// free neighbours at the free and for a best-fit search and a split at the
// allocation, and get the same memory back. The last k_capacity such
// frees of the default pool stay whole instead, outside the free sets and
// apart from coalescing (no neighbour merges with them), and keep their
// pointer map entries (a free of one finds it not allocated); a request of
// their size and stream takes the newest one back when the search would
// have handed out exactly that block (take_recent_locked), so placement is
// the same as without them. Anything else returns them all to their pools
// first: an allocation that misses, a capture, empty_cache, restore_pool,
// and every reader of stats, snapshots or free memory. So every search,
// stitch and release sees the merged free memory it would see without
// them. Their free_completed trace entries are written at the free, as
// without them, but their counts wait for the return: allocation,
// allocated bytes, active, active bytes and inactive split, current and
// cumulative. Every reader of those flushes first and sees what it would
// have seen without them (current_usage, which does not, leaves the recent
// frees out). So a reuse changes no current count and passes no peak;
// what it owes the cumulative counts (a free and an allocation) waits in
// reuse_tally_ until the flush. The cumulative inactive-split counters
// miss the merge and split a reuse skips, and so may the inactive-split
// peak (the merged free block counted until the reuse splits it again).
// Their streams' active blocks for mid-size requests (active_by_stream_)
// also count them until the return, and a request leaves them out. Blocks
// with stream uses, and blocks of private pools, return as before. A
// workload whose requests rarely repeat a size would pay a little for
// keeping and gain nothing, so keeping pauses while few kept blocks come
// back (recent_frees::keep_next).
inline void caching_allocator::keep_recent_locked(block* b) {
  complete_free_locked(b);
  b->recent = true;
  // Note [repeated reuse]: the chain goes on only straight after a reuse.
  const std::uint64_t now = mutex_.acquisitions();
  b->reuse_chain = b->reuse_chain + 1 == now ? now : 0;
  if (block* evicted = recent_.push(b)) return_recent_locked(evicted);
}

void caching_allocator::return_recent_locked(block* b) {
  b->recent = false;
  uncount_allocation_locked(b);
  uncount_active_locked(b);
  active_by_stream_.add(b->stream, -1);
  allocated_.erase(b->address);
  release_to_pool_locked(b);
}

void caching_allocator::flush_recent_locked() const {
  // Logically const: the blocks return to the pools they are counted in.
  auto* self = const_cast<caching_allocator*>(this);
  self->unpark_locked();
  self->count_lock_free_reuses_locked(repeat_.armed());
  recent_.drain([self](block* b) { self->return_recent_locked(b); });
  for (const bool small : {false, true}) {
    reuse_tally& tally = self->reuse_tally_[small ? 1 : 0];
    if (tally.reuses == 0) continue;
    for (const stat_type type : {stat_type::all, pool_stat(small)}) {
      at(self->stats_.allocation, type).count_cycles(tally.reuses);
      at(self->stats_.active, type).count_cycles(tally.reuses);
      at(self->stats_.allocated_bytes, type).count_cycles(tally.bytes);
      at(self->stats_.active_bytes, type).count_cycles(tally.bytes);
    }
    tally = reuse_tally{};
  }
  // Note [arenas]: a reader flushes under a plain lock; what returned to
  // the free sets reaches the device's counts now.
  self->publish_stats_locked();
}

// Note [repeats without the lock]: the chain of Note [repeated reuse]
// needs no critical section at all while nothing else runs. A reuse from
// the recent frees that leaves none behind, with no event pending and no
// trace listener, arms repeat_ with its block in its section n. Until
// another section begins (the lock's count moves past n), a free of that
// block parks it in repeat_ without the lock, and a request for the same
// bytes on the same stream takes it back without the lock: exactly what
// the chain would do, and nothing else has changed. The parked block
// stays allocated in every count, in the pointer map and to its
// neighbours, so whatever a section sees is consistent; each section that
// allocates, frees or reads unparks it first thing (unpark_locked) and
// frees it as its free would have, so readers see what they would have
// seen. A take that loses the race with that unpark finds nothing; one
// that wins it happened before the section. A take claims only the armed
// block, and hands it out only if the same arming still holds after the
// claim; otherwise the block it claimed (freed by its owner) goes back
// through the lock, so none is lost. A reuse changes no current
// count; what it owes the cumulative counts (a free and an allocation,
// with their bytes and requested bytes) is counted in the block and added
// when it is freed, unparked or re-armed, or when a reader flushes.
// Captures never use it (a capture's first section ends the arming, and
// allocate checks for one); a second free of a parked block fails to park
// and reaches free_locked, which reports it. With several arenas the
// device's ledger may claim a parked block without the lock (Note
// [claimed repeats] in arena_ledger.hpp): no take hands it out again, and
// the next section frees it as it would any parked block.
void caching_allocator::free_parked_locked() {
  // Its free, done now: free_locked finds nothing parked any more, or a
  // block that a free which read the arming before this section parked
  // since, and frees that first.
  if (block* b = repeat_.unpark()) free_locked(reinterpret_cast<void*>(b->address));
}

void caching_allocator::count_lock_free_reuses_locked(block* b) {
  if (b == nullptr) return;
  const std::uint64_t reuses = repeat_slot::reuses_of(b);
  const auto n = static_cast<std::int64_t>(reuses - b->lock_free_reuses_counted);
  if (n == 0) return;
  b->lock_free_reuses_counted = reuses;
  const bool small = b->owner->is_small;
  reuse_tally& tally = reuse_tally_[small ? 1 : 0];
  tally.reuses += n;
  tally.bytes += n * static_cast<std::int64_t>(b->size);
  stats_.num_recent_reuses += n;
  allocation_clock_ += static_cast<std::uint64_t>(n);
  const std::int64_t requested = n * static_cast<std::int64_t>(b->requested_size);
  for (const stat_type type : {stat_type::all, pool_stat(small)}) {
    at(stats_.requested_bytes, type).count_cycles(requested);
  }
  if (policy_.is_oversize(b->size)) stats_.oversize_allocations.count_cycles(n);
}

// Note [repeated reuse]: a loop that frees a block and asks for its size
// again, with nothing else between, from any thread, takes it back without
// take_recent_locked's checks. The chain: a reuse that passed them at lock
// acquisition n, the free that kept the block at n + 1 (the only recent
// free), this request at n + 2. Nothing ran between them (the lock counts
// every acquisition) and no stream event was pending (it could have
// completed since), so the free sets, the recent frees and every
// neighbour are as the checks saw them, and they would answer the same.
inline block* caching_allocator::repeated_reuse_locked(std::size_t rounded, stream_handle stream, bool small) {
  if (recent_.size() != 1) return nullptr;
  block* b = recent_.at(0);
  if (b->reuse_chain + 1 != mutex_.acquisitions() || b->size != rounded || b->stream != stream ||
      b->owner->is_small != small) {
    return nullptr;
  }
  recent_.remove_only();
  b->recent = false;
  return b;
}

// The newest recent free of this size and stream, if the search and split
// of an allocation without recent frees would hand out exactly this block.
// Without them, every recent free would have returned to its pool and
// merged with its free neighbours (and other recent frees) of its stream.
// So this block's run -- it and the free or recent blocks of its stream
// after it -- must start at its own address, must be what best fit picks
// (no free block of the stream that fits is smaller than the run, or as
// large at a lower address; any other recent free of the stream that might
// grow into one counts as one), and must be split, or be the block itself.
// When any of that is in doubt the answer is nullptr: the caller then
// returns every recent free and searches as usual.
block* caching_allocator::take_recent_locked(std::size_t rounded, stream_handle stream, bool small) {
  block* b = recent_.newest(rounded, stream, small);
  if (b == nullptr) return nullptr;
  const auto joins = [stream](const block* n) {
    return n != nullptr && n->stream == stream && (n->is_free_mapped() || n->recent);
  };
  if (joins(b->prev) || !(expandable_ || chunk_bytes_ == 0)) return nullptr;
  // The run: this block and at most one free block after it (more, or a
  // recent free in it, is rare enough to leave to the search).
  const block* rest = joins(b->next) ? b->next : nullptr;
  if (rest != nullptr && (rest->recent || joins(rest->next))) return nullptr;
  const std::size_t run = b->size + (rest != nullptr ? rest->size : 0);
  for (std::size_t i = 0; i < recent_.size(); ++i) {
    const block* other = recent_.at(i);
    if (other != b && other->stream == stream && other->owner->is_small == small && other->size <= run) return nullptr;
  }
  if (!policy_.may_reuse(run, rounded, b->owner->expandable())) return nullptr;
  if (chunk_start_gap(b, run, rounded) != 0) return nullptr;  // the search would place it elsewhere
  if (run != rounded && !policy_.should_split(run, rounded, small, b->owner->expandable())) return nullptr;
  const free_block_index& free_set = small ? default_pool_.small : default_pool_.large;
  const block* best = rest != nullptr ? free_set.best_fit_besides(stream, rounded, rest) : free_set.best_fit(stream, rounded);
  if (best != nullptr && (best->size < run || (best->size == run && best->address < b->address))) return nullptr;
  recent_.remove(b);
  b->recent = false;
  return b;
}

void caching_allocator::release_to_pool_locked(block* b) {
  block* merged = b;
  if (block* prev = b->prev; prev != nullptr && prev->is_free_mapped() && prev->stream == b->stream) {
    erase_free_locked(prev);
    delete_block_locked(absorb_next(prev));
    merged = prev;
  }
  if (block* next = merged->next; next != nullptr && next->is_free_mapped() && next->stream == merged->stream) {
    erase_free_locked(next);
    delete_block_locked(absorb_next(merged));
  }
  insert_free_locked(merged);
}

void caching_allocator::erase_free_locked(block* b) {
  b->owner->free_set->erase(b);
  if (b->counted_inactive_split) {
    b->counted_inactive_split = false;
    decrease_stat(stats_.inactive_split, b->owner, 1);
    decrease_stat(stats_.inactive_split_bytes, b->owner, static_cast<std::int64_t>(b->size));
  }
}

void caching_allocator::allow_peer_access(int peer_device) {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  // Remembered even while expandable segments are off: update_config may
  // switch them on, and every chunk mapped then must be open to the peer.
  if (peer_device == backend_.device_index() || std::find(peers_.begin(), peers_.end(), peer_device) != peers_.end()) {
    return;
  }
  std::vector<expandable_range*> opened;
  for (const auto& [address, s] : segments_) {
    if (!s->expandable()) continue;
    if (const status st = s->range->allow_peer(peer_device); !st) {
      // Not remembered anywhere, so a retry opens every range again.
      for (expandable_range* range : opened) range->forget_peer(peer_device);
      throw device_failure("streamalloc: device " + std::to_string(backend_.device_index()) +
                           " could not open its memory to device " + std::to_string(peer_device) + ": " + st.message());
    }
    opened.push_back(s->range.get());
  }
  peers_.push_back(peer_device);
}

// ---------------------------------------------------------------------------
// Giving memory back

void caching_allocator::empty_cache() {
  locked_call call(*this);
  flush_recent_locked();
  // A capture may neither synchronize nor free device memory; the cache is
  // kept until it ends.
  if (capture_count_.load(std::memory_order_relaxed) != 0) return;
  if (!pending_.empty() || !awaiting_device_sync_.empty()) synchronize_pending_locked();
  release_unused_segments_locked();
}

bool caching_allocator::release_available_oversize_locked(std::size_t rounded, pool_id pool) {
  if (config_.max_split_bytes == k_max_size) return false;
  if (pool != 0 && !pool_releasable_locked(pool)) return false;
  std::vector<block*> whole;  // unsplit oversize blocks, i.e. whole unused segments
  pool_for_locked(pool, false).for_each([&](block* b) {
    if (policy_.is_oversize(b->size) && !b->is_split() && !b->owner->expandable()) whole.push_back(b);
  });
  if (whole.empty()) return false;
  std::sort(whole.begin(), whole.end(), [](const block* a, const block* b) { return a->size < b->size; });
  // The smallest one that alone makes room, else the largest ones until the
  // released bytes cover the request.
  auto enough = std::find_if(whole.begin(), whole.end(), [&](const block* b) { return b->size >= rounded; });
  if (enough != whole.end()) return release_segment_locked((*enough)->owner);
  std::size_t released = 0;
  bool any = false;
  for (auto it = whole.rbegin(); it != whole.rend() && released < rounded; ++it) {
    const std::size_t size = (*it)->size;
    if (release_segment_locked((*it)->owner)) released += size, any = true;
  }
  return any;
}

void caching_allocator::release_unused_segments_locked() {
  release_idle_chunks_locked();
  for (auto it = segments_.begin(); it != segments_.end();) {
    segment* s = it->second;
    ++it;  // releasing erases s from the map
    if (s->expandable()) {
      release_range_locked(s);
    } else if (pool_releasable_locked(s->pool) && segment_unused(s)) {
      release_segment_locked(s);
    }
  }
}

bool caching_allocator::release_segment_locked(segment* s) {
  if (!free_segment_locked(s)) return false;
  record_trace_locked(trace_action::segment_free, s->address, s->size, s->stream, s->pool);
  for (block* b = s->first; b != nullptr;) {
    block* next = b->next;
    erase_free_locked(b);
    delete_block_locked(b);
    b = next;
  }
  update_stat(stats_.segment, s, -1);
  update_stat(stats_.reserved_bytes, s, -static_cast<std::int64_t>(s->size));
  if (policy_.is_oversize(s->size)) stats_.oversize_segments.decrease(1);
  ++stats_.num_device_free;
  segments_.erase(s->address);
  if (s->pool != 0) forget_pool_segment_locked(s->pool);
  delete s;
  return true;
}

bool caching_allocator::segment_unused(const segment* s) const {
  for (const block* b = s->first; b != nullptr; b = b->next) {
    if (!b->is_free()) return false;
  }
  return true;
}

bool caching_allocator::pool_releasable_locked(pool_id pool) const {
  if (pool == 0) return true;
  auto it = private_pools_.find(pool);
  return it == private_pools_.end() || it->second.use_count == 0;
}

void caching_allocator::set_memory_fraction(double fraction) {
  // 0 is allowed, as in torch: nothing new may be reserved, cached memory
  // still serves.
  if (!(fraction >= 0.0 && fraction <= 1.0)) {
    throw usage_error("streamalloc: memory fraction must be in [0, 1], got " + std::to_string(fraction));
  }
  std::lock_guard<adaptive_mutex> lock(mutex_);
  set_fraction_locked(fraction);
}

double caching_allocator::memory_fraction() const {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  return fraction_;
}

void caching_allocator::set_fraction_locked(double fraction) {
  fraction_ = fraction;
  allowed_bytes_ = fraction >= 1.0 ? device_total_bytes_
                                   : static_cast<std::size_t>(fraction * static_cast<double>(device_total_bytes_));
}

// ---------------------------------------------------------------------------
// Settings at run time (torch.cuda.memory._set_allocator_settings)

void caching_allocator::update_config(const allocator_config& config) {
  config.validate();
  allocator_config next = config;  // copied before the lock: nothing below throws once state changes
  std::lock_guard<adaptive_mutex> lock(mutex_);
  flush_recent_locked();
  config_.check_run_time_update(next);

  // As at construction, a device without virtual memory keeps plain
  // segments whatever the setting says.
  const bool expandable = next.expandable_segments && backend_.supports_virtual_memory();
  if (expandable) init_expandable_locked();  // may refuse the chunk size; nothing has changed yet
  const bool split_changed = next.max_split_bytes != config_.max_split_bytes;
  config_ = std::move(next);
  expandable_ = expandable;
  policy_ = size_policy(config_, expandable_);
  if (split_changed) {
    const std::size_t limit = config_.max_split_bytes;
    stats_.max_split_size = limit == k_max_size ? -1 : static_cast<std::int64_t>(limit);
    recount_oversize_locked();
  }
}

void caching_allocator::recount_oversize_locked() {
  // Blocks and segments live across the change, so the counts follow the
  // new limit from now on: each later allocation and free is judged by it.
  std::int64_t allocations = 0;
  std::int64_t segments = 0;
  for (const auto& [address, s] : segments_) {
    if (!s->expandable() && policy_.is_oversize(s->size)) ++segments;
    for (const block* b = s->first; b != nullptr; b = b->next) {
      if (b->allocated && policy_.is_oversize(b->size)) ++allocations;
    }
  }
  const auto set = [](stat_counter& counter, std::int64_t value) {
    if (value > counter.current) counter.increase(value - counter.current);
    if (value < counter.current) counter.decrease(counter.current - value);
  };
  set(stats_.oversize_allocations, allocations);
  set(stats_.oversize_segments, segments);
}

// ---------------------------------------------------------------------------
// Private pools (CUDA graph capture)

void caching_allocator::begin_allocate_to_pool(pool_id id, stream_filter filter) {
  if (id == 0) throw usage_error("streamalloc: private pool id 0 is reserved for the default pool");
  std::lock_guard<adaptive_mutex> lock(mutex_);
  flush_recent_locked();
  ++private_pools_.try_emplace(id, &set_nodes_, config_.min_block_bytes).first->second.use_count;
  captures_.push_back({id, std::move(filter)});
  capture_count_.store(static_cast<int>(captures_.size()) + captures_elsewhere_, std::memory_order_release);
}

void caching_allocator::end_allocate_to_pool(pool_id id) {
  locked_call call(*this);
  flush_recent_locked();
  auto it = std::find_if(captures_.begin(), captures_.end(), [&](const capture& c) { return c.id == id; });
  if (it == captures_.end()) throw usage_error("streamalloc: no allocation to private pool " + std::to_string(id) + " is underway");
  captures_.erase(it);
  capture_count_.store(static_cast<int>(captures_.size()) + captures_elsewhere_, std::memory_order_release);
  if (captures_.empty() && captures_elsewhere_ == 0) finish_deferred_frees_locked();
}

void caching_allocator::release_pool(pool_id id) {
  locked_call call(*this);
  flush_recent_locked();
  auto it = private_pools_.find(id);
  if (it == private_pools_.end() || it->second.use_count == 0) {
    throw usage_error("streamalloc: private pool " + std::to_string(id) + " is not in use");
  }
  // Note [released pools]: the cached segments stay until empty_cache.
  if (--it->second.use_count == 0 && it->second.segments == 0) private_pools_.erase(it);
}

// Note [capture reuse]: with graph_capture_record_stream_reuse, a block
// freed during a capture while other streams still use it (record_stream)
// need not wait for the capture's end. Its use streams' capture frontiers
// at the free mark where their uses end in the graph; once every marked node
// is an ancestor of (or is) a node of the block stream's own frontier, all
// captured work that uses the block is ordered before anything captured next
// on that stream, so the block returns to its pool for that stream.
void caching_allocator::watch_capture_uses_locked(block* b) {
  capture_free entry{b, {}};
  std::vector<graph_node_handle> frontier;
  for (stream_handle use : b->stream_uses) {
    bool capturing = false;
    // A use outside any capture cannot be located in the graph.
    if (!backend_.capture_frontier(use, &capturing, &frontier) || !capturing) return;
    entry.uses.insert(entry.uses.end(), frontier.begin(), frontier.end());
  }
  capture_frees_.push_back(std::move(entry));
}

void caching_allocator::reclaim_reachable_frees_locked(stream_handle stream, pool_id pool) {
  const auto serves_here = [&](const capture_free& f) { return f.b->stream == stream && f.b->owner->pool == pool; };
  // The graph is queried only when a waiting block could serve this request.
  if (std::none_of(capture_frees_.begin(), capture_frees_.end(), serves_here)) return;
  std::vector<graph_node_handle> frontier;
  bool capturing = false;
  if (!backend_.capture_frontier(stream, &capturing, &frontier) || !capturing) return;
  for (auto it = capture_frees_.begin(); it != capture_frees_.end();) {
    block* b = it->b;
    if (!serves_here(*it) || !reaches_all_locked(frontier, it->uses)) {
      ++it;
      continue;
    }
    it = capture_frees_.erase(it);
    deferred_frees_.erase(std::find(deferred_frees_.begin(), deferred_frees_.end(), b));
    b->stream_uses.clear();
    b->pending_events = 0;
    return_to_pool_locked(b);
  }
}

bool caching_allocator::reaches_all_locked(const std::vector<graph_node_handle>& from,
                                           const std::vector<graph_node_handle>& targets) {
  std::unordered_set<graph_node_handle> missing(targets.begin(), targets.end());
  std::unordered_set<graph_node_handle> seen;
  std::vector<graph_node_handle> todo(from.begin(), from.end());
  std::vector<graph_node_handle> dependencies;
  while (!todo.empty() && !missing.empty()) {
    const graph_node_handle node = todo.back();
    todo.pop_back();
    if (!seen.insert(node).second) continue;
    missing.erase(node);
    if (!backend_.capture_dependencies(node, &dependencies)) return false;
    todo.insert(todo.end(), dependencies.begin(), dependencies.end());
  }
  return missing.empty();
}

void caching_allocator::finish_deferred_frees_locked() {
  capture_frees_.clear();
  std::vector<block*> deferred;
  deferred.swap(deferred_frees_);
  for (block* b : deferred) {
    b->pending_events = 0;
    insert_events_locked(b);
  }
}

pool_id caching_allocator::route_capture(stream_handle stream) {
  std::vector<capture> active;
  {
    std::lock_guard<adaptive_mutex> lock(mutex_);
    active = captures_;
  }
  // The filters are evaluated without the lock: they query the runtime.
  for (const capture& c : active) {
    if (c.filter(stream)) return c.id;
  }
  return 0;
}

template <typename self_type>
auto& caching_allocator::pool_of(self_type& self, pool_id pool, bool small) {
  auto* pair = &self.default_pool_;
  if (pool != 0) {
    auto it = self.private_pools_.find(pool);
    // A pool released between routing and locking serves nothing new.
    if (it != self.private_pools_.end()) pair = &it->second.free;
  }
  return small ? pair->small : pair->large;
}

free_block_index& caching_allocator::pool_for_locked(pool_id pool, bool small) { return pool_of(*this, pool, small); }

const free_block_index& caching_allocator::pool_for_locked(pool_id pool, bool small) const {
  return pool_of(*this, pool, small);
}

// ---------------------------------------------------------------------------
// Introspection

device_stats caching_allocator::stats() const {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  flush_recent_locked();
  device_stats out = stats_;
  fill_fragmentation_locked(&out);
  return out;
}

caching_allocator::usage caching_allocator::current_usage() const {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  usage out{at(stats_.allocation, stat_type::all).current, at(stats_.allocated_bytes, stat_type::all).current,
            at(stats_.requested_bytes, stat_type::all).current, stats_.num_cross_stream_reuses};
  // Recent frees and a parked block are still counted allocated (Notes
  // [recent frees] and [repeats without the lock]).
  for (std::size_t i = 0; i < recent_.size(); ++i) {
    --out.allocations;
    out.allocated_bytes -= static_cast<std::int64_t>(recent_.at(i)->size);
  }
  if (const block* parked = repeat_.parked()) {
    --out.allocations;
    out.allocated_bytes -= static_cast<std::int64_t>(parked->size);
    out.requested_bytes -= static_cast<std::int64_t>(parked->requested_size);
  }
  return out;
}

void caching_allocator::reset_peak_stats() {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  flush_recent_locked();
  for (stat_array device_stats::*array : device_stats::k_arrays) {
    for (stat_counter& c : stats_.*array) c.reset_peak();
  }
  stats_.oversize_allocations.reset_peak();
  stats_.oversize_segments.reset_peak();
}

void caching_allocator::reset_accumulated_stats() {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  flush_recent_locked();
  for (stat_array device_stats::*array : device_stats::k_arrays) {
    for (stat_counter& c : stats_.*array) c.reset_accumulated();
  }
  stats_.oversize_allocations.reset_accumulated();
  stats_.oversize_segments.reset_accumulated();
  stats_.num_alloc_retries = 0;
  stats_.num_ooms = 0;
  stats_.num_sync_all_streams = 0;
  stats_.num_device_alloc = 0;
  stats_.num_device_free = 0;
  stats_.num_cross_stream_reuses = 0;
  stats_.num_recent_reuses = 0;
  stats_.num_combined_calls = 0;
}

// ---------------------------------------------------------------------------
// Arenas (Note [arenas] in device_allocator.cpp)

void caching_allocator::join_ledger(arena_ledger* ledger, int index) {
  locked_call call(*this);
  // A parked block goes back first: the ledger starts from counts that
  // hold none.
  flush_recent_locked();
  repeat_.disarm();
  if (index == 0) {
    ledger->seed(stats_, &repeat_);
  } else {
    ledger->join(index, &repeat_);
    ledger->publish(index, arena_ledger::current_counts(stats_, {}));  // a fresh arena: zero
  }
  ledger->set_reserved(index, at(stats_.reserved_bytes, stat_type::all).current);
  ledger_ = ledger;
  arena_ = index;
}

void caching_allocator::publish_to_ledger_locked() {
  arena_ledger::held_back held;
  for (std::size_t i = 0; i < recent_.size(); ++i) {
    const block* b = recent_.at(i);
    const std::size_t kind = b->owner->is_small ? 1 : 0;
    ++held.blocks[kind];
    held.bytes[kind] += static_cast<std::int64_t>(b->size);
  }
  ledger_->publish(arena_, stats_, held);
  ledger_->set_reserved(arena_, at(stats_.reserved_bytes, stat_type::all).current);
}

void caching_allocator::count_capture_elsewhere(int delta) {
  locked_call call(*this);
  captures_elsewhere_ += delta;
  capture_count_.store(static_cast<int>(captures_.size()) + captures_elsewhere_, std::memory_order_release);
  if (captures_.empty() && captures_elsewhere_ == 0) finish_deferred_frees_locked();
}

void caching_allocator::complete_finished_frees() {
  locked_call call(*this);
  if (capture_count_.load(std::memory_order_relaxed) == 0 && !pending_.empty()) process_events_locked();
}

bool caching_allocator::release_cache_for_other(bool wait, bool complete_pending) {
  if (wait) {
    mutex_.lock();
  } else if (!mutex_.try_lock()) {
    return false;
  }
  // Plain unlock, not locked_call: the calls waiting here are left to their
  // own threads rather than run inside another arena's critical section.
  // The recent frees go back to the free sets first, or the memory of a
  // block freed just before would stay cached.
  flush_recent_locked();
  const std::int64_t before = at(stats_.reserved_bytes, stat_type::all).current;
  if (capture_count_.load(std::memory_order_relaxed) == 0) {
    if (complete_pending && (!pending_.empty() || !awaiting_device_sync_.empty())) synchronize_pending_locked();
    release_unused_segments_locked();
  }
  const bool released = at(stats_.reserved_bytes, stat_type::all).current < before;
  publish_stats_locked();
  mutex_.unlock();
  return released;
}

template <typename fn>
void caching_allocator::for_each_free_set_locked(fn&& visit) const {
  visit(default_pool_.small);
  visit(default_pool_.large);
  for (const auto& [id, p] : private_pools_) {
    visit(p.free.small);
    visit(p.free.large);
  }
}

void caching_allocator::fill_fragmentation_locked(device_stats* out) const {
  std::size_t largest = 0;
  std::size_t total = 0;
  for_each_free_set_locked([&](const free_block_index& set) {
    set.for_each([&](const block* b) {
      largest = std::max(largest, b->size);
      total += b->size;
    });
  });
  out->largest_free_block_bytes = static_cast<std::int64_t>(largest);
  out->free_cached_bytes = static_cast<std::int64_t>(total);
  out->external_fragmentation = total == 0 ? 0.0 : 1.0 - static_cast<double>(largest) / static_cast<double>(total);
  const std::int64_t allocated = at(stats_.allocated_bytes, stat_type::all).current;
  out->reserved_allocated_ratio =
      allocated == 0 ? 0.0 : static_cast<double>(at(stats_.reserved_bytes, stat_type::all).current) / static_cast<double>(allocated);
}

void caching_allocator::cache_info(std::size_t* largest_free_bytes, std::size_t* total_free_bytes) const {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  flush_recent_locked();
  device_stats scratch;
  fill_fragmentation_locked(&scratch);
  if (largest_free_bytes != nullptr) *largest_free_bytes = static_cast<std::size_t>(scratch.largest_free_block_bytes);
  if (total_free_bytes != nullptr) *total_free_bytes = static_cast<std::size_t>(scratch.free_cached_bytes);
}

allocator_snapshot caching_allocator::snapshot() const {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  flush_recent_locked();
  allocator_snapshot out;
  out.segments.reserve(segments_.size());
  for (const auto& [address, s] : segments_) {
    if (s->expandable()) {
      snapshot_expandable_locked(s, &out);
      continue;
    }
    segment_info info = snapshot_entry(s);
    info.address = s->address;
    info.total_size = s->size;
    for (const block* b = s->first; b != nullptr; b = b->next) append_block_info(b, &info);
    out.segments.push_back(std::move(info));
  }
  return out;
}

segment_info caching_allocator::snapshot_entry(const segment* s) const {
  segment_info info;
  info.device = backend_.device_index();
  info.stream = s->stream;
  info.is_small = s->is_small;
  info.pool = s->pool;
  info.is_expandable = s->expandable();
  return info;
}

void caching_allocator::append_block_info(const block* b, segment_info* info) {
  block_info bi;
  bi.address = b->address;
  bi.size = b->size;
  bi.requested_size = b->requested_size;
  bi.stream = b->stream;
  bi.state = b->allocated ? block_state::active_allocated
                          : (b->pending_events > 0 ? block_state::active_pending_free : block_state::inactive);
  if (b->allocated) info->allocated_size += b->size;
  if (bi.state != block_state::inactive) {
    info->active_size += b->size;
    info->requested_size += b->requested_size;
  }
  info->blocks.push_back(bi);
}

allocator_config caching_allocator::config() const {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  return config_;
}

bool caching_allocator::owns(const void* ptr) const {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  return allocated_block_locked(ptr) != nullptr;
}

std::size_t caching_allocator::allocation_size(const void* ptr) const {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  const block* b = allocated_block_locked(ptr);
  if (b == nullptr) throw usage_error(describe_unknown_pointer_locked(ptr));
  return b->size;
}

void caching_allocator::lock_for_fork() {
  mutex_.lock();
  fork_parent_pid_ = static_cast<int>(getpid());
}

void caching_allocator::unlock_after_fork() {
  if (static_cast<int>(getpid()) != fork_parent_pid_) waiting_calls_.forget_all();
  mutex_.unlock();
}

std::string caching_allocator::describe_unknown_pointer_locked(const void* ptr) const {
  const std::uintptr_t address = to_address(ptr);
  std::ostringstream out;
  out << "streamalloc: pointer " << ptr << " on device " << backend_.device_index() << " ";
  auto it = segments_.upper_bound(address);
  if (it != segments_.begin()) {
    const segment* s = std::prev(it)->second;
    if (address < s->address + s->size) {
      for (const block* b = s->first; b != nullptr; b = b->next) {
        if (address < b->address || address >= b->address + b->size) continue;
        if (address != b->address) {
          out << "points inside a block (offset " << (address - b->address) << " of a " << b->size
              << "-byte block); only the pointer returned by allocate can be freed";
        } else {
          out << "is not allocated (double free?)";
        }
        return out.str();
      }
    }
  }
  out << "was never allocated by this allocator";
  return out.str();
}

void caching_allocator::raise_oom_locked(std::size_t requested, stream_handle stream, pool_id pool) {
  flush_recent_locked();  // the report reads statistics and free blocks
  ++stats_.num_ooms;
  oom_context context;
  context.device = backend_.device_index();
  context.requested_bytes = requested;
  // Note [torch's OOM message]: torch names the segment the request needed.
  std::size_t rounded = 0;
  if (!policy_.round(requested, &rounded) || !policy_.segment_size(rounded, &context.allocation_bytes)) {
    context.allocation_bytes = requested;
  }
  context.device_total_bytes = device_total_bytes_;
  device_memory_info info;
  if (backend_.memory_info(&info)) context.device_free_bytes = info.free_bytes;
  if (!backend_.device_processes(&context.processes)) context.processes.clear();
  std::int64_t allocated = at(stats_.allocated_bytes, stat_type::all).current;
  // Note [arenas]: the device's, this arena's latest included.
  if (ledger_ != nullptr) {
    constexpr std::size_t index = arena_ledger::index_of(&device_stats::allocated_bytes, stat_type::all);
    const std::int64_t published = ledger_->published(arena_)[index];
    allocated += at(ledger_->totals().allocated_bytes, stat_type::all).current - published;
  }
  context.allocated_bytes = static_cast<std::size_t>(allocated);
  context.reserved_bytes = capped_reserved_locked();
  context.allowed_bytes = allowed_bytes_;
  context.expandable_segments = uses_expandable(pool);
  for (const auto& [id, p] : private_pools_) {
    for (const free_block_index* set : {&p.free.small, &p.free.large}) {
      set->for_each([&](const block* b) { context.private_pool_cached_bytes += b->size; });
    }
  }
  device_stats scratch;
  fill_fragmentation_locked(&scratch);
  context.largest_free_block_bytes = static_cast<std::size_t>(scratch.largest_free_block_bytes);
  // torch's convention: an oom event's address is the device's free bytes.
  record_trace_locked(trace_action::oom, context.device_free_bytes, requested, stream, pool);
  throw out_of_memory(context);
}

block* caching_allocator::new_block_locked() {
  if (spare_blocks_.empty()) return new block;
  block* b = spare_blocks_.back();
  spare_blocks_.pop_back();
  return b;
}

void caching_allocator::delete_block_locked(block* b) {
  std::vector<stream_handle> uses = std::move(b->stream_uses);
  uses.clear();
  *b = block{};
  b->stream_uses = std::move(uses);  // keeps its capacity for the next user
  spare_blocks_.push_back(b);
}

// ---------------------------------------------------------------------------
// Note [invariants]: checked by validate() after every step of the
// randomized tests.
// - The blocks of a segment tile it: address-contiguous, linked both ways,
//   owned by it, sizes summing to the segment size.
// - No two address-adjacent free blocks share a stream (they coalesce).
// - Free blocks are exactly the members of the free sets, each in the set
//   of its segment's pool; the allocated blocks and the recent frees are
//   exactly the pointer map's entries.
// - Each free set's free_block_index is sound (Note [size classes]): bitmap
//   bits match the non-empty classes, heaps are in address order with
//   intact links, each block is kept under its own stream and size, counts
//   add up, and no block is kept twice.
// - Pending-event counts match the outstanding events.
// - The blocks marked recent are exactly the recent frees: freed, with no
//   pending events or stream uses, in the default pool, inactive, in the
//   pointer map, outside the free sets and apart from coalescing (Note
//   [recent frees]).
// - Every stat's current value equals a recount from the blocks, and so
//   do the default pool's active blocks per stream (with the recent frees).

void caching_allocator::validate() const {
  std::lock_guard<adaptive_mutex> lock(mutex_);
  auto fail = [](const std::string& what) { throw std::logic_error("streamalloc invariant violated: " + what); };

  device_stats recount;
  std::size_t free_blocks = 0;
  std::size_t allocated_blocks = 0;
  std::int64_t pending_from_blocks = 0;
  auto bump = [](stat_array& array, const segment* s, std::int64_t delta) {
    at(array, stat_type::all).current += delta;
    at(array, pool_stat(s->is_small)).current += delta;
  };
  std::vector<physical_handle> mapped_chunks;
  std::size_t unmapped_blocks = 0;
  std::size_t recent_blocks = 0;
  stream_counts active_recount;
  for (const auto& [address, s] : segments_) {
    if (address != s->address) fail("segment map key differs from segment address");
    if (s->first == nullptr || s->first->prev != nullptr) fail("segment does not start with a first block");
    if (s->expandable()) {
      validate_expandable_locked(s, &mapped_chunks);
      bump(recount.reserved_bytes, s, static_cast<std::int64_t>(s->range->mapped_chunks() * s->range->chunk_bytes()));
      for (const block* b = s->first; b != nullptr; b = b->next) {
        if (b->mapped && (b->prev == nullptr || !b->prev->mapped)) bump(recount.segment, s, 1);  // a run starts
        if (!b->mapped) ++unmapped_blocks;
      }
    } else {
      bump(recount.segment, s, 1);
      bump(recount.reserved_bytes, s, static_cast<std::int64_t>(s->size));
      if (policy_.is_oversize(s->size)) ++recount.oversize_segments.current;
    }
    std::uintptr_t expected = s->address;
    for (const block* b = s->first; b != nullptr; b = b->next) {
      if (b->owner != s) fail("block owned by another segment");
      if (b->address != expected) fail("blocks are not address-contiguous");
      if (b->size == 0) fail("empty block");
      if (b->next != nullptr && b->next->prev != b) fail("broken neighbour links");
      expected += b->size;
      if (!b->mapped) {
        if (!s->expandable()) fail("an unmapped block in a plain segment");
        continue;  // checked by validate_expandable_locked
      }
      const auto size = static_cast<std::int64_t>(b->size);
      if (b->allocated) {
        ++allocated_blocks;
        if (b->pending_events != 0) fail("allocated block with pending events");
        if (allocated_.find(b->address) != b) fail("allocated block missing from the pointer map");
        bump(recount.requested_bytes, s, static_cast<std::int64_t>(b->requested_size));
        if (policy_.is_oversize(b->size)) ++recount.oversize_allocations.current;
      }
      if (b->allocated || b->recent) {  // a recent free stays counted (Note [recent frees])
        bump(recount.allocation, s, 1);
        bump(recount.allocated_bytes, s, size);
      }
      if (!b->is_free()) {
        bump(recount.active, s, 1);
        bump(recount.active_bytes, s, size);
        if (s->pool == 0) active_recount.add(b->stream, 1);
      }
      if (b->pending_events > 0) pending_from_blocks += b->pending_events;
      if (b->recent) {
        ++recent_blocks;
        if (b->allocated || b->pending_events != 0 || !b->stream_uses.empty() || s->pool != 0) {
          fail("a recent free is allocated, pending, used by other streams or outside the default pool");
        }
        if (allocated_.find(b->address) != b) fail("recent free missing from the pointer map");
      }
      if (b->is_free()) {
        ++free_blocks;
        if (s->free_set != &pool_for_locked(s->pool, s->is_small)) fail("segment points at another pool's free set");
        if (b->next != nullptr && b->next->is_free_mapped() && b->next->stream == b->stream) {
          fail("adjacent free blocks of one stream not coalesced");
        }
        if (b->counted_inactive_split != b->is_split()) fail("inactive-split bookkeeping out of date");
        if (b->is_split()) {
          bump(recount.inactive_split, s, 1);
          bump(recount.inactive_split_bytes, s, size);
        }
        if (!b->stream_uses.empty()) fail("free block keeps stream uses");
      }
    }
    if (expected != s->address + s->size) fail("blocks do not cover their segment");
  }
  // Each index holds distinct blocks (its own check), each a free block
  // whose segment names that index; so with the counts equal, every free
  // block is in exactly one place, its own pool's.
  const auto check_index = [&](const free_block_index& set) {
    if (const std::string broken = set.first_violation(); !broken.empty()) fail("free block index: " + broken);
  };
  std::size_t set_members = 0;
  for_each_free_set_locked([&](const free_block_index& set) {
    check_index(set);
    set_members += set.size();
    set.for_each([&](const block* b) {
      if (!b->is_free_mapped()) fail("a block in a free set is not free and mapped");
      if (b->owner->free_set != &set) fail("a free block is in another pool's free set");
    });
  });
  if (set_members != free_blocks) fail("free sets and free blocks differ in number");
  std::size_t unmapped_members = 0;
  const auto check_unmapped = [&](const pool_pair& sets) {
    for (const free_block_index* set : {&sets.small, &sets.large}) {
      check_index(*set);
      unmapped_members += set->size();
      set->for_each([&](const block* b) {
        if (b->mapped || b->owner->unmapped_set != set) fail("a block in an unmapped set is mapped or another pool's");
      });
    }
  };
  check_unmapped(unmapped_);
  for (const auto& [id, p] : private_pools_) check_unmapped(p.unmapped);
  if (unmapped_members != unmapped_blocks) fail("unmapped sets hold stray blocks");
  std::sort(mapped_chunks.begin(), mapped_chunks.end());
  if (std::adjacent_find(mapped_chunks.begin(), mapped_chunks.end()) != mapped_chunks.end()) fail("a chunk is mapped twice");
  if (static_cast<std::int64_t>(mapped_chunks.size()) != stats_.mapped_chunks.current) fail("mapped_chunks stat");
  if (allocated_.size() != allocated_blocks + recent_blocks) {
    fail("pointer map holds blocks that are neither allocated nor recent frees");
  }
  if (recent_.size() != recent_blocks) fail("recent frees and blocks marked recent differ in number");
  for (const block* b : {static_cast<const block*>(repeat_.armed()), repeat_.parked()}) {
    if (b != nullptr && (!b->allocated || allocated_.find(b->address) != b)) {
      fail("the block armed or parked for repeats is not allocated");
    }
  }
  for (std::size_t i = 0; i < recent_.size(); ++i) {
    if (!recent_.at(i)->recent) fail("a recent free is not marked recent");
  }

  std::int64_t outstanding = static_cast<std::int64_t>(deferred_frees_.size() + awaiting_device_sync_.size());
  for (const auto& [stream, queue] : pending_) outstanding += static_cast<std::int64_t>(queue.size());
  if (outstanding != pending_from_blocks) fail("pending-event counts differ from outstanding events");

  auto compare = [&](const char* name, const stat_array& have, const stat_array& want) {
    for (int i = 0; i < k_stat_type_count; ++i) {
      if (have[i].current != want[i].current) {
        fail(std::string("stat ") + name + "[" + std::to_string(i) + "] is " + std::to_string(have[i].current) +
             ", recount " + std::to_string(want[i].current));
      }
    }
  };
  compare("allocation", stats_.allocation, recount.allocation);
  compare("segment", stats_.segment, recount.segment);
  compare("active", stats_.active, recount.active);
  compare("inactive_split", stats_.inactive_split, recount.inactive_split);
  compare("allocated_bytes", stats_.allocated_bytes, recount.allocated_bytes);
  compare("reserved_bytes", stats_.reserved_bytes, recount.reserved_bytes);
  compare("active_bytes", stats_.active_bytes, recount.active_bytes);
  compare("inactive_split_bytes", stats_.inactive_split_bytes, recount.inactive_split_bytes);
  compare("requested_bytes", stats_.requested_bytes, recount.requested_bytes);
  if (stats_.oversize_allocations.current != recount.oversize_allocations.current) fail("oversize_allocations stat");
  if (stats_.oversize_segments.current != recount.oversize_segments.current) fail("oversize_segments stat");
  active_by_stream_.for_each([&](stream_handle stream, std::int64_t count) {
    if (count != active_recount.get(stream)) fail("a stream's active blocks differ from a recount");
  });
  active_recount.for_each([&](stream_handle stream, std::int64_t count) {
    if (count != active_by_stream_.get(stream)) fail("a stream's active blocks were not counted");
  });
}

}  // namespace streamalloc
