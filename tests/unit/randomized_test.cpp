// Randomized differential test of caching_allocator against a reference
// model of live and pending-free ranges: random sizes, streams, stream uses,
// frees, event completions, empty_cache calls, injected segment failures and
// private pools (captures, MemPools with use_on_oom and no_split, emptying
// one pool, checkpoints and their restore). Every returned range must be
// fresh sim device memory that overlaps nothing live or pending, and the
// stats must match the model.
// The untagged case is a quick smoke run; "[slow]" is the long run.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "streamalloc/core/stream_counts.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/sim_fixture.hpp"

using namespace streamalloc;
using streamalloc::test::addr;
using streamalloc::test::all;
using streamalloc::test::consistency_problem;
using streamalloc::test::expected_rounded_bytes;
using streamalloc::test::expected_segment_bytes;
using streamalloc::test::sim_fixture;

namespace {

// What a run exercised, so a run that silently stops reaching a path fails.
struct run_coverage {
  std::size_t allocations = 0;
  std::size_t ooms = 0;
  std::size_t pending_frees = 0;
  std::size_t full_checks = 0;
  std::int64_t cross_stream_reuses = 0;
  std::int64_t recent_reuses = 0;
  std::int64_t alloc_retries = 0;
  std::int64_t sync_all_streams = 0;
  std::int64_t oversize_segments_peak = 0;
  std::size_t captures = 0;
  std::size_t deferred_frees = 0;
  std::size_t checkpoints = 0;
  std::size_t restores = 0;
  std::size_t restored_frees = 0;  // allocations a restore ended
  std::size_t refused_restores = 0;
  std::size_t use_on_oom_loans = 0;
  std::size_t pool_empties = 0;  // empty_cache(pool) calls that returned segments

  void add(const run_coverage& o) {
    allocations += o.allocations;
    ooms += o.ooms;
    pending_frees += o.pending_frees;
    full_checks += o.full_checks;
    cross_stream_reuses += o.cross_stream_reuses;
    recent_reuses += o.recent_reuses;
    alloc_retries += o.alloc_retries;
    sync_all_streams += o.sync_all_streams;
    oversize_segments_peak = std::max(oversize_segments_peak, o.oversize_segments_peak);
    captures += o.captures;
    deferred_frees += o.deferred_frees;
    checkpoints += o.checkpoints;
    restores += o.restores;
    restored_frees += o.restored_frees;
    refused_restores += o.refused_restores;
    use_on_oom_loans += o.use_on_oom_loans;
    pool_empties += o.pool_empties;
  }
};

struct run_options {
  std::uint64_t seed = 1;
  std::size_t steps = 1000;
  // Full consistency check (validate, snapshot recount, pool of each block)
  // every this many steps; 1 = after every step.
  std::size_t check_every = 1;
  // Streams beside the fixture's three: past stream_counts::k_scanned,
  // counts go through its index and borrowing asks every stream.
  std::size_t extra_streams = 0;
};

std::string describe(const run_options& o) {
  std::ostringstream out;
  out << "seed " << o.seed << ", " << o.steps << " steps, full check every " << o.check_every;
  if (o.extra_streams != 0) out << ", " << 3 + o.extra_streams << " streams";
  return out.str();
}

class random_run {
 public:
  explicit random_run(const run_options& options)
      : options_(options),
        rng_(options.seed),
        manual_events_(options.seed % 2 == 0),
        fixture_(make_sim_config(options.seed), make_allocator_config(options.seed)),
        streams_(make_streams(fixture_, options.extra_streams)) {}

  static std::vector<stream_handle> make_streams(sim_fixture& fixture, std::size_t extra) {
    std::vector<stream_handle> streams{fixture.s1, fixture.s2, fixture.s3};
    for (std::size_t i = 0; i < extra; ++i) streams.push_back(fixture.sim.new_stream());
    return streams;
  }

  run_coverage run() {
    for (step_ = 0; step_ < options_.steps; ++step_) {
      full_check_ = options_.check_every == 1 || step_ % options_.check_every == 0;
      one_step();
      if (full_check_) {
        ++coverage_.full_checks;
        check_consistent();
        prune_owners();
      }
    }
    const device_stats st = fixture_.stats();
    coverage_.cross_stream_reuses = st.num_cross_stream_reuses;
    coverage_.recent_reuses = st.num_recent_reuses;
    coverage_.alloc_retries = st.num_alloc_retries;
    coverage_.sync_all_streams = st.num_sync_all_streams;
    coverage_.oversize_segments_peak = st.oversize_segments.peak;
    finish();
    return coverage_;
  }

 private:
  struct live_allocation {
    std::uintptr_t address;
    std::size_t block_size;
    std::size_t requested;
    stream_handle stream;
    std::vector<stream_handle> uses;  // distinct, never the allocating stream
    pool_id pool;
  };
  struct owned_range {
    std::uintptr_t end;
    stream_handle stream;
    std::uint64_t freed_at = 0;  // model clock at the free
  };
  struct pending_range {
    std::uintptr_t address;
    std::size_t size;
    stream_handle stream;  // the allocating stream, whose pool gets the block back
    // The block's events, or (grouped) the events of every block whose free
    // was deferred by one capture: which event is whose is not observable,
    // so the test completes a group's events together.
    std::vector<event_handle> events;
    bool grouped = false;
    // Model clock at the free request: the owner's uses all precede it.
    std::uint64_t requested_at = 0;
  };

  static sim_config make_sim_config(std::uint64_t seed) {
    sim_config c = streamalloc::test::plain_device(640_MiB);
    c.events_complete_immediately = seed % 2 != 0;
    return c;
  }
  static allocator_config make_allocator_config(std::uint64_t seed) {
    allocator_config c;
    c.cross_stream_reuse = seed % 3 != 0;
    if (seed % 4 == 1) c.max_split_bytes = 32_MiB;
    return c;
  }

  void fail(const std::string& what) {
    std::ostringstream out;
    out << describe(options_) << " (manual events " << manual_events_ << ", cross-stream reuse "
        << fixture_.alloc.config().cross_stream_reuse << ", max_split " << fixture_.stats().max_split_size << "): step "
        << step_ << " (" << op_ << "): " << what;
    FAIL(out.str());
  }

  std::size_t random_size() {
    const std::uint64_t pick = rng_() % 100;
    if (pick == 0) return 0;
    if (pick < 12 && !recent_sizes_.empty()) return recent_sizes_[rng_() % recent_sizes_.size()];
    // Log-uniform over 1 B .. 64 MiB.
    const double exponent = std::uniform_real_distribution<double>(0.0, std::log(static_cast<double>(64_MiB)))(rng_);
    const auto size = static_cast<std::size_t>(std::exp(exponent));
    const std::size_t clamped = std::max<std::size_t>(1, std::min(size, 64_MiB));
    if (recent_sizes_.size() < 16) {
      recent_sizes_.push_back(clamped);
    } else {
      recent_sizes_[rng_() % recent_sizes_.size()] = clamped;
    }
    return clamped;
  }

  void one_step() {
    note_device_syncs();
    const std::uint64_t pick = rng_() % 1000;
    const bool over_budget = live_bytes_ > 320_MiB;
    if (pick < 10) {
      op_ = "empty_cache";
      do_empty_cache();
    } else if (pick < 14) {
      op_ = "set_memory_fraction";
      const double fractions[] = {0.5, 0.75, 1.0};
      // 0 now and then: nothing may grow, the cache still serves.
      fraction_ = rng_() % 8 == 0 ? 0.0 : fractions[rng_() % 3];
      fixture_.alloc.set_memory_fraction(fraction_);
    } else if (pick < 18) {
      op_ = "reset_peak_stats";
      fixture_.alloc.reset_peak_stats();
    } else if (pick < 22) {
      op_ = "misuse";
      do_misuse();
    } else if (pick < 24 && capture_pool_ == 0) {
      // Captures are short (about 50 steps): while one runs the ladder
      // cannot synchronize, so long ones would mostly exercise out_of_memory.
      op_ = "begin_allocate_to_pool";
      do_begin_capture();
    } else if (pick < 44 && capture_pool_ != 0) {
      op_ = "end_allocate_to_pool";
      do_end_capture();
    } else if (pick < 46) {
      op_ = "release_pool";
      do_release_pool();
    } else if (pick < 54) {
      do_allocate(true);
    } else if (pick < 58) {
      op_ = "create_or_incref_pool";
      do_create_mem_pool();
    } else if (pick < 62) {
      op_ = "checkpoint_pool";
      do_checkpoint();
    } else if (pick < 66) {
      op_ = "restore_pool";
      do_restore();
    } else if (pick < 68) {
      op_ = "empty_cache(pool)";
      do_empty_cache_pool();
    } else if (pick < 120) {
      op_ = "complete events";
      do_complete();
    } else if (pick < 200) {
      op_ = "record_stream";
      do_record_stream();
    } else if (pick < 600 && !over_budget) {
      do_allocate(false);
    } else {
      op_ = "free";
      do_free();
    }
  }

  // Whether [address, address+size) overlaps a live or pending range.
  bool overlaps_busy(std::uintptr_t address, std::size_t size) const {
    auto it = busy_.lower_bound(address);
    if (it != busy_.end() && it->first < address + size) return true;
    if (it != busy_.begin()) {
      --it;
      if (it->first + it->second > address) return true;
    }
    return false;
  }

  void do_allocate(bool inject_fault) {
    const std::size_t size = random_size();
    const stream_handle stream = streams_[rng_() % streams_.size()];
    const bool fail_always = inject_fault && rng_() % 2 == 0;
    op_ = inject_fault ? (fail_always ? "allocate, every segment allocation failing"
                                      : "allocate, next segment "
                                        "allocation failing")
                       : "allocate";
    if (inject_fault) {
      if (fail_always) {
        fixture_.sim.fail_always(sim_fault_point::allocate_segment);
      } else {
        fixture_.sim.fail_nth(sim_fault_point::allocate_segment, 1);
      }
    }
    const std::size_t segments_before = fixture_.sim.live_segments();
    const std::int64_t reuses_before = fixture_.alloc.current_usage().cross_stream_reuses;
    const std::size_t waits_before = fixture_.sim.counters().stream_waits;
    void* p = nullptr;
    try {
      p = fixture_.alloc.allocate(size, stream);
    } catch (const out_of_memory& e) {
      fixture_.sim.clear_faults();
      // After the ladder released everything it could, the device must
      // really lack room for the segment this request needs. An injected
      // fault may have hit the last growth attempt (the earlier one is
      // skipped when the cache fills the device), so then anything goes.
      const oom_context& c = e.context();
      const std::size_t capacity = fixture_.sim.capacity_bytes();
      const auto allowed =
          fraction_ >= 1.0 ? capacity : static_cast<std::size_t>(fraction_ * static_cast<double>(capacity));
      if (c.allowed_bytes != allowed) fail("oom context allowed_bytes " + std::to_string(c.allowed_bytes));
      if (c.reserved_bytes != fixture_.sim.used_bytes()) fail("oom context reserved_bytes differs from the device");
      if (c.requested_bytes != size) fail("oom context requested_bytes " + std::to_string(c.requested_bytes));
      const std::size_t device_room = capacity - fixture_.sim.used_bytes();
      const std::size_t cap_room = allowed > c.reserved_bytes ? allowed - c.reserved_bytes : 0;
      const std::size_t headroom = std::min(device_room, cap_room);
      // During a capture the ladder may not synchronize or release.
      if (!inject_fault && capture_pool_ == 0 && size > 0 && headroom >= expected_segment_bytes(size)) {
        fail("out_of_memory for " + std::to_string(size) + " B with " + std::to_string(headroom) +
             " B of device headroom: " + e.what());
      }
      ++coverage_.ooms;
      refresh_pending();
      check_model_stats();
      return;
    }
    fixture_.sim.clear_faults();
    // Stage 6 may have synchronized pending frees, making them reusable by
    // this very request.
    refresh_pending();
    if (size == 0) {
      if (p != nullptr) fail("allocate(0) returned non-null");
      return;
    }
    if (p == nullptr) fail("allocate returned nullptr for " + std::to_string(size) + " B");
    const std::size_t block_size = fixture_.alloc.allocation_size(p);
    if (block_size < expected_rounded_bytes(size)) {
      fail("block of " + std::to_string(block_size) + " B for a request of " + std::to_string(size));
    }
    if (!fixture_.sim.is_device_memory(p, block_size)) fail("returned range is not sim device memory");
    if (overlaps_busy(addr(p), block_size)) fail("returned range overlaps a live or pending-free range");
    if (fail_always && fixture_.sim.live_segments() > segments_before) fail("grew while segment allocation fails");
    check_stream_owner(addr(p), block_size, stream, reuses_before, waits_before);
    const pool_id expected = capture_pool_ != 0 && stream == capture_stream_ ? capture_pool_ : 0;
    // A default-pool request may have taken a use_on_oom pool's block.
    pool_id pool = expected;
    if (full_check_ || (expected == 0 && !use_on_oom_pools_.empty())) pool = check_pool(addr(p), expected, block_size);
    if (pool != expected) ++coverage_.use_on_oom_loans;

    ++coverage_.allocations;
    busy_.emplace(addr(p), block_size);
    live_.push_back({addr(p), block_size, size, stream, {}, pool});
    live_bytes_ += block_size;
    live_requested_ += size;
    check_model_stats();
  }

  // Memory last used by stream u may go to stream t != u only through Note
  // [cross-stream reuse]: counted, with t waiting on an event of u. That
  // event orders t after everything u did before it, so a range u freed
  // before a hand-off from u to t is t's to reuse from then on (Note
  // [borrowed remainders]: the rest of a borrowed block goes to t). The
  // model's record of who freed each range and when is kept independently
  // of the allocator's block streams.
  void check_stream_owner(std::uintptr_t address, std::size_t size, stream_handle stream, std::int64_t reuses_before,
                          std::size_t waits_before) {
    note_device_syncs();
    std::vector<owned_range> foreign;
    const std::uintptr_t end = address + size;
    auto it = free_owner_.upper_bound(address);
    if (it != free_owner_.begin() && std::prev(it)->second.end > address) --it;
    while (it != free_owner_.end() && it->first < end) {
      const std::uintptr_t start = it->first;
      const owned_range r = it->second;
      if (r.stream != stream) foreign.push_back(r);
      it = free_owner_.erase(it);
      // Keep the parts of the free range outside the new block.
      if (start < address) free_owner_[start] = {address, r.stream, r.freed_at};
      if (r.end > end) free_owner_[end] = {r.end, r.stream, r.freed_at};
    }
    ++clock_;
    const bool handed_off_now = fixture_.alloc.current_usage().cross_stream_reuses > reuses_before &&
                                fixture_.sim.counters().stream_waits > waits_before;
    for (const owned_range& r : foreign) {
      if (r.freed_at < last_device_sync_) continue;  // every stream is past it
      const auto earlier = last_hand_off_.find({r.stream, stream});
      if (earlier != last_hand_off_.end() && earlier->second > r.freed_at) continue;
      if (!fixture_.alloc.config().cross_stream_reuse)
        fail("memory freed by another stream reused with cross_stream_reuse off");
      if (fixture_.alloc.current_usage().cross_stream_reuses <= reuses_before)
        fail("memory freed by another stream reused uncounted");
      if (fixture_.sim.counters().stream_waits <= waits_before)
        fail("memory freed by another stream reused without a wait");
    }
    if (!handed_off_now) return;
    // The lender is the stream whose record the hand-off waited on; what it
    // had waited for, `stream` has now waited for too.
    const stream_handle lender = fixture_.sim.last_wait_source();
    last_hand_off_[{lender, stream}] = clock_;
    for (const auto& [pair, at] : std::map(last_hand_off_)) {
      if (pair.second != lender || pair.first == stream) continue;
      std::uint64_t& inherited = last_hand_off_[{pair.first, stream}];
      inherited = std::max(inherited, at);
    }
  }

  // A device synchronization (stitching, the OOM ladder, empty_cache) puts
  // every stream past everything freed before it.
  void note_device_syncs() {
    const std::size_t now = fixture_.sim.counters().device_syncs;
    if (now == device_syncs_seen_) return;
    device_syncs_seen_ = now;
    last_device_sync_ = clock_ + 1;
  }

  // `requested_at`: the model clock of the free request when the range
  // waited for stream uses (0: now).
  void mark_freed(std::uintptr_t address, std::size_t size, stream_handle stream, std::uint64_t requested_at = 0) {
    free_owner_[address] = {address + size, stream, requested_at != 0 ? requested_at : ++clock_};
  }

  // Forgets ranges of released segments (addresses are never reused).
  void prune_owners() {
    for (auto it = free_owner_.begin(); it != free_owner_.end();) {
      const bool live =
          fixture_.sim.is_device_memory(reinterpret_cast<const void*>(it->first), it->second.end - it->first);
      it = live ? std::next(it) : free_owner_.erase(it);
    }
  }

  // Private pools and the default pool never share segments, except that a
  // default-pool request may borrow from a use_on_oom pool; a no_split pool
  // hands out whole segments. Returns the pool of the block.
  pool_id check_pool(std::uintptr_t address, pool_id expected, std::size_t block_size) {
    const allocator_snapshot snap = fixture_.alloc.snapshot();
    const segment_info* seg = streamalloc::test::find_segment(snap, address);
    if (seg == nullptr) fail("no snapshot segment holds the new block");
    if (seg->pool != expected && !(expected == 0 && use_on_oom_pools_.count(seg->pool) != 0)) {
      fail("block from pool " + std::to_string(seg->pool) + ", expected pool " + std::to_string(expected));
    }
    if (no_split_pools_.count(seg->pool) != 0 && seg->total_size != block_size) {
      fail("a no_split pool split a segment");
    }
    return seg->pool;
  }

  bool held(pool_id id) const { return std::find(held_pools_.begin(), held_pools_.end(), id) != held_pools_.end(); }

  // A held pool no capture is routing to, or 0.
  pool_id quiet_held_pool() {
    std::vector<pool_id> quiet;
    for (pool_id id : held_pools_) {
      if (id != capture_pool_) quiet.push_back(id);
    }
    return quiet.empty() ? 0 : quiet[rng_() % quiet.size()];
  }

  // MemPool(use_on_oom=?, no_split=?): one use, held until do_release_pool.
  void do_create_mem_pool() {
    const pool_id id = next_pool_++;
    fixture_.alloc.create_or_incref_pool(id);
    if (rng_() % 2 == 0) {
      fixture_.alloc.set_pool_use_on_oom(id, true);
      use_on_oom_pools_.insert(id);
    }
    if (rng_() % 3 == 0) {
      fixture_.alloc.set_pool_no_split(id, true);
      no_split_pools_.insert(id);
    }
    held_pools_.push_back(id);
    mem_pools_.push_back(id);
    if (fixture_.alloc.pool_use_count(id) != 1) fail("a new pool's use count is not 1");
    // Often used at once: `with use_mem_pool(pool):` around a few
    // allocations on one stream (begin, end, then release its use).
    if (capture_pool_ != 0 || rng_() % 2 != 0) return;
    capture_pool_ = id;
    capture_stream_ = streams_[rng_() % streams_.size()];
    const stream_handle captured = capture_stream_;
    fixture_.alloc.begin_allocate_to_pool(id, [captured](stream_handle s) { return s == captured; });
    held_pools_.push_back(id);
    ++coverage_.captures;
    for (std::uint64_t n = 1 + rng_() % 4; n > 0; --n) {
      const std::size_t before = live_.size();
      do_allocate(false);
      // Temporaries die inside the block, leaving cached memory in the pool.
      if (live_.size() > before && rng_() % 2 == 0) {
        op_ = "free in a use_mem_pool block";
        free_at(live_.size() - 1);
      }
    }
    do_end_capture();
    release_one_use(id);
    op_ = "create_or_incref_pool";
  }

  void release_one_use(pool_id id) {
    auto it = std::find(held_pools_.begin(), held_pools_.end(), id);
    const int uses = fixture_.alloc.pool_use_count(id);
    fixture_.alloc.release_pool(id);
    held_pools_.erase(it);
    if (fixture_.alloc.pool_use_count(id) != uses - 1) fail("release_pool did not drop one use");
  }

  static bool has_pending_block(const allocator_snapshot& snap, pool_id id) {
    for (const segment_info& seg : snap.segments) {
      if (seg.pool != id) continue;
      for (const block_info& b : seg.blocks) {
        if (b.state == block_state::active_pending_free) return true;
      }
    }
    return false;
  }

  void do_checkpoint() {
    const pool_id id = quiet_held_pool();
    if (id != 0) checkpoint(id);
  }

  void checkpoint(pool_id id) {
    const allocator_snapshot snap = fixture_.alloc.snapshot();
    if (has_pending_block(snap, id)) {
      try {
        fixture_.alloc.checkpoint_pool(id);
        fail("checkpoint_pool accepted a pool with a pending free");
      } catch (const usage_error&) {
      }
      return;
    }
    pool_checkpoint cp = fixture_.alloc.checkpoint_pool(id);
    // The checkpoint is the snapshot's view of the pool.
    std::size_t i = 0;
    for (const segment_info& seg : snap.segments) {
      if (seg.pool != id) continue;
      if (i >= cp.segments.size()) fail("checkpoint misses a segment of the pool");
      const pool_checkpoint::segment_state& c = cp.segments[i++];
      if (c.address != seg.address || c.size != seg.total_size || c.blocks.size() != seg.blocks.size()) {
        fail("checkpoint segment differs from the snapshot");
      }
      for (std::size_t j = 0; j < c.blocks.size(); ++j) {
        const block_info& b = seg.blocks[j];
        const pool_checkpoint::block_state& cb = c.blocks[j];
        if (cb.address != b.address || cb.size != b.size || cb.requested_size != b.requested_size ||
            cb.stream != b.stream || cb.allocated != (b.state == block_state::active_allocated)) {
          fail("checkpoint block differs from the snapshot");
        }
      }
    }
    if (i != cp.segments.size()) fail("checkpoint has segments the pool does not");
    checkpoints_[id] = std::move(cp);
    ++coverage_.checkpoints;
  }

  void do_restore() {
    if (checkpoints_.empty()) return;
    // Mostly a pool still held (graph trees restore live pools); else any,
    // which is refused once its pool is released.
    std::vector<pool_id> candidates;
    for (const auto& [id, cp] : checkpoints_) {
      if (held(id) && id != capture_pool_) candidates.push_back(id);
    }
    if (candidates.empty() || rng_() % 4 == 0) {
      for (const auto& [id, cp] : checkpoints_) candidates.push_back(id);
    }
    auto it = checkpoints_.find(candidates[rng_() % candidates.size()]);
    const pool_id id = it->first;
    if (id == capture_pool_) return;
    refresh_pending();
    const auto stats_before = fixture_.stats().to_map();
    const bool pending = has_pending_block(fixture_.alloc.snapshot(), id);
    if (!held(id) || pending) {
      // Released (its segments may be gone) or waiting on events: refused.
      try {
        fixture_.alloc.restore_pool(it->second);
        fail("restore_pool accepted a released pool or one with a pending free");
      } catch (const usage_error&) {
      }
      if (fixture_.stats().to_map() != stats_before) fail("a refused restore changed the stats");
      if (!held(id)) checkpoints_.erase(it);
      ++coverage_.refused_restores;
      return;
    }
    const pool_checkpoint& cp = it->second;
    const pool_restore_result result = fixture_.alloc.restore_pool(cp);
    ++coverage_.restores;

    // Every live allocation of the pool ended; the model forgets them.
    std::set<std::uintptr_t> freed;
    for (void* p : result.freed) freed.insert(addr(p));
    if (freed.size() != result.freed.size()) fail("restore reported a freed pointer twice");
    std::size_t in_pool = 0;
    for (std::size_t k = 0; k < live_.size();) {
      const live_allocation a = live_[k];
      if (a.pool != id) {
        ++k;
        continue;
      }
      ++in_pool;
      if (freed.count(a.address) == 0) fail("restore did not end a live allocation of the pool");
      live_[k] = live_.back();
      live_.pop_back();
      live_bytes_ -= a.block_size;
      live_requested_ -= a.requested;
      busy_.erase(a.address);
      mark_freed(a.address, a.block_size, a.stream);
    }
    if (in_pool != freed.size()) fail("restore ended allocations the model does not know in the pool");
    coverage_.restored_frees += in_pool;

    // The checkpointed segments are as recorded: their owners follow it.
    std::set<std::uintptr_t> made;
    for (void* p : result.allocated) made.insert(addr(p));
    const allocator_snapshot snap = fixture_.alloc.snapshot();
    std::vector<const void*> expected_live;
    for (const pool_checkpoint::segment_state& seg : cp.segments) {
      free_owner_.erase(free_owner_.lower_bound(seg.address), free_owner_.lower_bound(seg.address + seg.size));
      for (const pool_checkpoint::block_state& b : seg.blocks) {
        const block_info* now = streamalloc::test::find_block(snap, b.address);
        // The checkpoint recorded a valid layout, so each block is back exactly.
        if (now == nullptr || now->size != b.size || (now->state == block_state::active_allocated) != b.allocated) {
          fail("restore did not recreate a checkpointed block");
        }
        if (!b.allocated) {
          free_owner_[b.address] = {b.address + b.size, b.stream, ++clock_};
          continue;
        }
        if (made.erase(b.address) != 1) fail("restore did not report a recreated allocation");
        if (now->requested_size != b.requested_size || now->stream != b.stream) fail("restored block's details");
        busy_.emplace(b.address, b.size);
        live_.push_back({b.address, b.size, b.requested_size, b.stream, {}, id});
        live_bytes_ += b.size;
        live_requested_ += b.requested_size;
        expected_live.push_back(reinterpret_cast<const void*>(b.address));
      }
    }
    if (!made.empty()) fail("restore reported allocations the checkpoint does not have");
    if (!fixture_.alloc.pool_allocations_match(id, expected_live)) fail("pool_allocations_match after restore");
    check_model_stats();
  }

  void do_empty_cache_pool() {
    // Mostly a released pool that still has segments (MemPool.__del__),
    // else one in use or one that may be gone.
    pool_id id = 0;
    const std::uint64_t pick = rng_() % 4;
    if (pick < 2) {
      std::vector<pool_id> released;
      for (const segment_info& seg : fixture_.alloc.snapshot().segments) {
        if (seg.pool != 0 && !held(seg.pool)) released.push_back(seg.pool);
      }
      if (!released.empty()) id = released[rng_() % released.size()];
    } else if (pick == 2) {
      id = quiet_held_pool();
    } else if (next_pool_ > 1) {
      id = 1 + rng_() % (next_pool_ - 1);
    }
    if (id == 0) return;
    const auto count_segments = [&](bool of_pool) {
      std::size_t n = 0;
      for (const segment_info& seg : fixture_.alloc.snapshot().segments) n += (seg.pool == id) == of_pool ? 1 : 0;
      return n;
    };
    const std::size_t pool_before = count_segments(true);
    const std::size_t others_before = count_segments(false);
    fixture_.alloc.empty_cache(id);
    // It waited for the pool's events only; a capture's group of events
    // completes together (complete_partial_groups).
    complete_partial_groups();
    refresh_pending();
    if (count_segments(false) != others_before) fail("empty_cache(pool) changed another pool");
    if (capture_pool_ != 0 || fixture_.alloc.pool_use_count(id) > 0) {
      if (count_segments(true) != pool_before) fail("empty_cache(pool) changed a pool still in use");
      return;
    }
    for (const segment_info& seg : fixture_.alloc.snapshot().segments) {
      if (seg.pool == id && seg.allocated_size == 0) fail("empty_cache(pool) kept an unused segment of the pool");
    }
    if (count_segments(true) < pool_before) ++coverage_.pool_empties;
  }

  void do_begin_capture() {
    // A new graph pool, a MemPool still held (use_mem_pool), or any held
    // pool (graphs sharing a pool).
    pool_id shared = 0;
    const std::uint64_t pick = rng_() % 4;
    if (pick == 1 || pick == 2) {
      std::vector<pool_id> held_mem_pools;
      for (pool_id id : mem_pools_) {
        if (held(id)) held_mem_pools.push_back(id);
      }
      if (!held_mem_pools.empty()) shared = held_mem_pools[rng_() % held_mem_pools.size()];
    } else if (pick == 3) {
      shared = quiet_held_pool();
    }
    capture_pool_ = shared != 0 ? shared : next_pool_++;
    const stream_handle captured = streams_[rng_() % streams_.size()];
    capture_stream_ = captured;
    fixture_.alloc.begin_allocate_to_pool(capture_pool_, [captured](stream_handle s) { return s == captured; });
    held_pools_.push_back(capture_pool_);
    ++coverage_.captures;
  }

  void do_end_capture() {
    const pool_id id = capture_pool_;
    capture_pool_ = 0;
    const std::size_t records_before = fixture_.sim.counters().event_records;
    std::vector<event_handle> recorded =
        streamalloc::test::new_pending_events(fixture_.sim, [&] { fixture_.alloc.end_allocate_to_pool(id); });
    const std::size_t records = fixture_.sim.counters().event_records - records_before;
    if (records != deferred_uses_) {
      fail("ending the capture recorded " + std::to_string(records) + " events for " + std::to_string(deferred_uses_) +
           " deferred stream uses");
    }
    for (const pending_range& r : deferred_) {
      if (recorded.empty()) {
        busy_.erase(r.address);  // the events completed on record
        mark_freed(r.address, r.size, r.stream, r.requested_at);
      } else {
        pending_.push_back({r.address, r.size, r.stream, recorded, deferred_.size() > 1, r.requested_at});
      }
    }
    deferred_.clear();
    deferred_uses_ = 0;
    // Graph trees checkpoint the pool after each recording.
    if (rng_() % 2 == 0) {
      op_ = "checkpoint_pool after the capture";
      checkpoint(id);
    }
  }

  void do_release_pool() {
    for (pool_id id : held_pools_) {
      if (id == capture_pool_) continue;
      release_one_use(id);
      return;
    }
  }

  void do_free() {
    if (live_.empty()) return;
    free_at(rng_() % live_.size());
  }

  void free_at(std::size_t k) {
    const live_allocation a = live_[k];
    live_[k] = live_.back();
    live_.pop_back();
    live_bytes_ -= a.block_size;
    live_requested_ -= a.requested;
    busy_.erase(a.address);

    const std::size_t records_before = fixture_.sim.counters().event_records;
    std::vector<event_handle> recorded = streamalloc::test::new_pending_events(
        fixture_.sim, [&] { fixture_.alloc.free(reinterpret_cast<void*>(a.address)); });
    const std::size_t records = fixture_.sim.counters().event_records - records_before;
    if (capture_pool_ != 0 && records == 0 && !a.uses.empty()) {
      // Events may not be recorded during a capture: the free waits for the
      // capture to end, and the block stays unavailable until then.
      busy_.emplace(a.address, a.block_size);
      deferred_.push_back({a.address, a.block_size, a.stream, {}, false, ++clock_});
      deferred_uses_ += a.uses.size();
      ++coverage_.deferred_frees;
      check_model_stats();
      return;
    }
    const std::size_t expected = manual_events_ ? a.uses.size() : 0;
    if (records != a.uses.size() || recorded.size() != expected) {
      fail("free recorded " + std::to_string(recorded.size()) + " pending events for " + std::to_string(a.uses.size()) +
           " stream uses");
    }
    if (!recorded.empty()) {
      ++coverage_.pending_frees;
      busy_.emplace(a.address, a.block_size);
      pending_.push_back({a.address, a.block_size, a.stream, std::move(recorded), false, ++clock_});
    } else {
      mark_freed(a.address, a.block_size, a.stream);
    }
    check_model_stats();
  }

  // An interior pointer of a live block: usage_error, and nothing changes.
  void do_misuse() {
    if (live_.empty()) return;
    const live_allocation& a = live_[rng_() % live_.size()];
    if (a.block_size < 1024) return;
    const std::size_t units = a.block_size / 512;
    void* interior = reinterpret_cast<void*>(a.address + 512 * (1 + rng_() % (units - 1)));
    const auto before = fixture_.stats().to_map();
    const std::uint64_t pick = rng_() % 3;
    try {
      if (pick == 0) {
        fixture_.alloc.free(interior);
      } else if (pick == 1) {
        fixture_.alloc.record_stream(interior, streams_[0]);
      } else {
        fixture_.alloc.allocation_size(interior);
      }
      fail("a call with an interior pointer did not throw usage_error");
    } catch (const usage_error&) {
    }
    if (fixture_.stats().to_map() != before) fail("a refused call changed the stats");
  }

  void do_record_stream() {
    if (live_.empty()) return;
    live_allocation& a = live_[rng_() % live_.size()];
    const stream_handle s = streams_[rng_() % streams_.size()];
    fixture_.alloc.record_stream(reinterpret_cast<void*>(a.address), s);
    if (s != a.stream && std::find(a.uses.begin(), a.uses.end(), s) == a.uses.end()) a.uses.push_back(s);
  }

  void do_complete() {
    const std::vector<event_handle> pending = fixture_.sim.pending_events();
    if (pending.empty()) return;
    const std::uint64_t pick = rng_() % 10;
    if (pick < 6) {
      fixture_.sim.complete_event(pending[rng_() % pending.size()]);
    } else if (pick < 9) {
      fixture_.sim.complete_stream(streams_[rng_() % streams_.size()]);
    } else {
      fixture_.sim.complete_all_events();
    }
    complete_partial_groups();
    refresh_pending();
  }

  void complete_partial_groups() {
    std::vector<event_handle> still = fixture_.sim.pending_events();
    std::sort(still.begin(), still.end());
    for (const pending_range& r : pending_) {
      if (!r.grouped) continue;
      const auto done = std::count_if(r.events.begin(), r.events.end(), [&](event_handle e) {
        return !std::binary_search(still.begin(), still.end(), e);
      });
      if (done == 0) continue;
      for (event_handle e : r.events) fixture_.sim.complete_event(e);
    }
  }

  void do_empty_cache() {
    fixture_.alloc.empty_cache();
    refresh_pending();
    // A capture forbids synchronizing; pools still held keep their cache.
    if (capture_pool_ != 0) return;
    if (!pending_.empty()) fail("empty_cache left pending frees unsynchronized");
    const allocator_snapshot snap = fixture_.alloc.snapshot();
    std::set<pool_id> with_segments;
    for (const segment_info& seg : snap.segments) {
      if (seg.allocated_size == 0 && !held(seg.pool)) fail("empty_cache kept a segment without allocated blocks");
      with_segments.insert(seg.pool);
    }
    // A released pool without segments is gone for good: it lends nothing
    // (and do_allocate need not look for loans from it).
    for (auto it = use_on_oom_pools_.begin(); it != use_on_oom_pools_.end();) {
      it = !held(*it) && with_segments.count(*it) == 0 ? use_on_oom_pools_.erase(it) : std::next(it);
    }
  }

  // Drops from the model every event the sim no longer has pending; a range
  // whose events all completed is free for reuse.
  void refresh_pending() {
    if (pending_.empty()) return;
    std::vector<event_handle> still = fixture_.sim.pending_events();
    std::sort(still.begin(), still.end());
    for (std::size_t i = 0; i < pending_.size();) {
      std::vector<event_handle>& events = pending_[i].events;
      events.erase(std::remove_if(events.begin(), events.end(),
                                  [&](event_handle e) { return !std::binary_search(still.begin(), still.end(), e); }),
                   events.end());
      if (events.empty()) {
        busy_.erase(pending_[i].address);
        mark_freed(pending_[i].address, pending_[i].size, pending_[i].stream, pending_[i].requested_at);
        pending_[i] = pending_.back();
        pending_.pop_back();
      } else {
        ++i;
      }
    }
  }

  // Read through current_usage(), which leaves the recent frees in place
  // (stats() would return them to their pools after every step, and the
  // path that takes them back would never run here).
  void check_model_stats() {
    const caching_allocator::usage u = fixture_.alloc.current_usage();
    if (u.allocations != static_cast<std::int64_t>(live_.size())) {
      fail("allocation.all.current " + std::to_string(u.allocations) + ", model " + std::to_string(live_.size()));
    }
    if (u.requested_bytes != static_cast<std::int64_t>(live_requested_)) {
      fail("requested_bytes.all.current " + std::to_string(u.requested_bytes) + ", model " +
           std::to_string(live_requested_));
    }
    if (u.allocated_bytes != static_cast<std::int64_t>(live_bytes_)) {
      fail("allocated_bytes.all.current " + std::to_string(u.allocated_bytes) + ", model " +
           std::to_string(live_bytes_));
    }
  }

  void check_consistent() {
    const std::string problem = consistency_problem(fixture_.alloc, fixture_.sim);
    if (!problem.empty()) fail(problem);
    check_model_stats();
  }

  void finish() {
    op_ = "final cleanup";
    if (capture_pool_ != 0) do_end_capture();
    for (pool_id id : held_pools_) fixture_.alloc.release_pool(id);
    held_pools_.clear();
    for (const live_allocation& a : live_) fixture_.alloc.free(reinterpret_cast<void*>(a.address));
    live_.clear();
    live_bytes_ = 0;
    live_requested_ = 0;
    fixture_.sim.complete_all_events();
    fixture_.alloc.empty_cache();
    check_consistent();
    if (fixture_.sim.used_bytes() != 0) fail("device memory left after freeing everything and empty_cache");
    if (fixture_.sim.live_segments() != 0) fail("segments left after freeing everything and empty_cache");
  }

  const run_options options_;
  std::mt19937_64 rng_;
  const bool manual_events_;
  sim_fixture fixture_;
  const std::vector<stream_handle> streams_;
  std::size_t step_ = 0;
  const char* op_ = "";
  bool full_check_ = true;
  std::vector<live_allocation> live_;
  std::vector<pending_range> pending_;
  std::map<std::uintptr_t, std::size_t> busy_;  // live and pending ranges: address -> size
  std::size_t live_bytes_ = 0;
  std::size_t live_requested_ = 0;
  std::vector<std::size_t> recent_sizes_;
  std::map<std::uintptr_t, owned_range> free_owner_;  // freed, non-pending ranges: start -> end, last user
  std::uint64_t clock_ = 0;                            // orders frees and hand-offs
  std::size_t device_syncs_seen_ = 0;
  std::uint64_t last_device_sync_ = 0;  // ranges freed before it are every stream's
  // (from, to) -> model clock of the last counted hand-off between them.
  std::map<std::pair<stream_handle, stream_handle>, std::uint64_t> last_hand_off_;
  run_coverage coverage_;
  double fraction_ = 1.0;
  pool_id capture_pool_ = 0;  // 0: no capture underway
  stream_handle capture_stream_ = 0;
  pool_id next_pool_ = 1;
  std::vector<pool_id> held_pools_;      // one entry per use not yet released
  std::vector<pending_range> deferred_;  // frees waiting for the capture to end
  std::size_t deferred_uses_ = 0;
  std::vector<pool_id> mem_pools_;  // made by create_or_incref_pool
  std::set<pool_id> use_on_oom_pools_;
  std::set<pool_id> no_split_pools_;
  std::map<pool_id, pool_checkpoint> checkpoints_;  // the latest of each pool
};

run_coverage run_seeds(std::uint64_t first_seed, std::uint64_t seed_count, std::size_t steps, std::size_t check_every,
                       std::size_t extra_streams = 0) {
  run_coverage total;
  for (std::uint64_t seed = first_seed; seed < first_seed + seed_count; ++seed) {
    run_options o;
    o.seed = seed;
    o.steps = steps;
    o.check_every = check_every;
    o.extra_streams = extra_streams;
    INFO(describe(o));
    total.add(random_run(o).run());
  }
  return total;
}

// Every seed set must reach each path the model checks, or it proves little.
void check_coverage(const run_coverage& c, std::size_t steps) {
  INFO("allocations " << c.allocations << ", out_of_memory " << c.ooms << ", pending frees " << c.pending_frees
                      << ", cross-stream reuses " << c.cross_stream_reuses << ", recent reuses " << c.recent_reuses
                      << ", alloc retries " << c.alloc_retries
                      << ", sync-all " << c.sync_all_streams << ", oversize segments peak " << c.oversize_segments_peak
                      << ", full checks " << c.full_checks << ", captures " << c.captures << ", deferred frees "
                      << c.deferred_frees << ", checkpoints " << c.checkpoints << ", restores " << c.restores
                      << " (ending " << c.restored_frees << " allocations, " << c.refused_restores
                      << " refused), use_on_oom loans " << c.use_on_oom_loans << ", released pools emptied "
                      << c.pool_empties);
  CHECK(c.allocations > steps / 4);
  CHECK(c.ooms > 0);
  CHECK(c.pending_frees > 0);
  CHECK(c.cross_stream_reuses > 0);
  CHECK(c.alloc_retries > 0);
  CHECK(c.sync_all_streams > 0);
  CHECK(c.oversize_segments_peak > 0);
  CHECK(c.captures > 0);
  CHECK(c.deferred_frees > 0);
  CHECK(c.checkpoints > 0);
  CHECK(c.restores > 0);
  CHECK(c.restored_frees > 0);
  CHECK(c.refused_restores > 0);
  CHECK(c.use_on_oom_loans > 0);
  CHECK(c.pool_empties > 0);
}

}  // namespace

TEST_CASE("randomized: short differential run against the reference model", "[randomized]") {
  const run_coverage c = run_seeds(1, 16, 12000, 1);
  check_coverage(c, 16 * 12000);
  CHECK(c.full_checks == 16 * 12000);
  // A full check reads snapshots and stats, which return the recent frees
  // to their pools; with fewer checks allocations take them back (Note
  // [recent frees]) and the model checks those too.
  const run_coverage sparse = run_seeds(50, 8, 12000, 16);
  check_coverage(sparse, 8 * 12000);
  CHECK(sparse.recent_reuses > 0);
}

TEST_CASE("randomized: forty streams against the reference model", "[randomized]") {
  // Past stream_counts::k_scanned streams: the counts' index, and borrowing
  // that asks every stream for its best fit in one pass.
  static_assert(3 + 37 > stream_counts::k_scanned, "the run must pass the scanned streams");
  const run_coverage c = run_seeds(200, 6, 12000, 1, 37);
  INFO("allocations " << c.allocations << ", cross-stream reuses " << c.cross_stream_reuses << ", pending frees "
                      << c.pending_frees << ", out_of_memory " << c.ooms);
  CHECK(c.allocations > 6 * 12000 / 4);
  CHECK(c.cross_stream_reuses > 0);
  CHECK(c.pending_frees > 0);
}

TEST_CASE("randomized: long differential run against the reference model", "[randomized][slow]") {
  // Every step fully checked on one seed set, then long runs fully checked
  // every 256 steps (the model's own checks run after every step anyway).
  const run_coverage every_step = run_seeds(100, 64, 25000, 1);
  check_coverage(every_step, 64 * 25000);
  const run_coverage long_runs = run_seeds(1000, 100, 100000, 256);
  check_coverage(long_runs, 100 * 100000);
  CHECK(long_runs.recent_reuses > 0);
}
