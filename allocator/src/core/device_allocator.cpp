// Note [arenas]: one lock per device serves a single thread well, but with
// many threads each call finds the free sets and counters in the cache of
// the core that held the lock before, and 16 threads ran at a fraction of
// one thread's rate (bench/RESULTS.md, forty-first and forty-eighth
// sessions). Independent allocators, one per group of threads, do not
// share that state; four of them held about one allocator's peak memory on
// the threads pattern (forty-ninth session). So a device has up to
// `arenas` arenas (a setting: four, the most, by default), each a
// caching_allocator with its own lock, pools and segments. Every thread
// starts on arena 0, and a program whose threads do not allocate at once
// never leaves it: the device behaves exactly as one caching_allocator,
// and only a call that finds the lock held pays for counting (the
// contention observer). A thread whose calls keep finding the lock held
// (k_contended_run of them, none more than k_contention_gap_ns after the
// one before) moves to the arena with the fewest threads, making one while
// fewer than `arenas` exist, if that evens the load; once there are
// several, a thread that comes later starts on the one with the fewest
// threads, and a thread that exits is counted off. A brief overlap does
// not move a thread: autograd's backward thread takes turns with the main
// thread, and moving it would split one step's memory over arenas that
// cannot reuse each other's blocks.
//
// With more than one arena, the arenas share an arena_ledger:
// - torch's current and peak counts are of the device: each arena
//   publishes how its current counts moved at the end of every critical
//   section, and the ledger keeps the peaks of the sums exact with shares
//   of headroom, so that a publish within its arena's share touches only
//   that arena's lines (Note [peak headroom] in arena_ledger.hpp). The
//   publishes put the calls in one order they could have run in under one
//   lock. Recent frees, which an arena keeps counted as allocated, are
//   left out of what it publishes; a block parked by the lock-free repeat
//   is claimed by whatever would see it counted (a crossing, a reader, a
//   reset of the peaks: Note [claimed repeats] in arena_ledger.hpp), so a
//   thread alone on its arena repeats without the lock as on a device of
//   one arena. Cumulative counts stay per arena and are summed by readers.
// - the memory-fraction cap counts every arena's reserved bytes, and
//   arenas grow one at a time (the ledger's growth lock);
// - an arena out of memory has the others return their unused cached
//   memory before it gives up (waiting for arenas after it, trying those
//   before it: locks are taken in index order).
// Frees go to the arena that owns the pointer, tried first where the thread
// allocates. Private pools, CUDA graph captures and MemPools live in arena
// 0: while an allocation to a pool is underway every thread allocates
// there, and the other arenas defer the events of frees with stream uses
// as a capturing arena does. The blocks other threads take from arena 0
// then are freed back to it, and only an allocation of arena 0 outside a
// capture completes its pending frees; where arena 0's threads allocate
// only inside captures, those frees would stay reserved until an arena ran
// short of memory. So the start of each capture completes arena 0's
// finished frees, as any allocation outside a capture does on a device of
// one arena (and in torch's allocator).
#include "streamalloc/core/device_allocator.hpp"

#include <algorithm>
#include <chrono>
#include <iterator>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include <pthread.h>

#include "streamalloc/util/errors.hpp"

namespace streamalloc {

namespace {
std::atomic<std::uint64_t> g_next_id{1};
}  // namespace

namespace {

// The device allocators alive, by id, so that a thread leaving can take
// itself off the counts of one that may be gone by then. Never destroyed:
// threads may exit after static destruction. Its lock is a leaf (held for
// a lookup and an atomic decrement, or an insert or erase), and it is held
// across fork(), so a forked child finds it unlocked and the map whole.
std::mutex& registry_mutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}
void hold_registry_across_fork() {
  static std::once_flag once;
  std::call_once(once, [] {
    const auto lock = [] { registry_mutex().lock(); };
    const auto unlock = [] { registry_mutex().unlock(); };
    pthread_atfork(lock, unlock, unlock);
  });
}
std::unordered_map<std::uint64_t, device_allocator*>& registry() {
  static auto* allocators = new std::unordered_map<std::uint64_t, device_allocator*>;
  return *allocators;
}

}  // namespace

// A thread's entries: one per device allocator it uses, the oldest
// overwritten past k_entries (which sends the thread back to the arena
// with the fewest threads there). On the thread's exit its arenas count it
// no more.
struct device_allocator::thread_entries {
  static constexpr int k_entries = 8;
  std::array<thread_entry, k_entries> entries{};
  int next = 0;
  ~thread_entries() {
    last_entry_ = nullptr;
    for (const thread_entry& e : entries) leave(e);
  }
  static void leave(const thread_entry& e) {
    if (e.id == 0) return;
    std::lock_guard<std::mutex> lock(registry_mutex());
    auto it = registry().find(e.id);
    if (it != registry().end()) it->second->thread_left(e.arena);
  }
};

device_allocator::device_allocator(device_backend& backend, allocator_config config)
    : backend_(backend),
      id_(g_next_id.fetch_add(1, std::memory_order_relaxed)),
      max_arenas_(static_cast<int>(config.arenas)) {
  owned_[0] = std::make_unique<caching_allocator>(backend, std::move(config));
  if (max_arenas_ > 1) owned_[0]->set_contention_observer(this);
  arenas_[0].store(owned_[0].get(), std::memory_order_release);
  ledger_.set_release_elsewhere(
      [this](int arena, arena_ledger::release_reason why) { return release_elsewhere(arena, why); });
  hold_registry_across_fork();
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry().emplace(id_, this);
}

device_allocator::~device_allocator() {
  {
    std::lock_guard<std::mutex> lock(registry_mutex());
    registry().erase(id_);
  }
  // Later arenas first: they were made from arena 0's settings and hold
  // nothing arena 0 needs.
  for (int i = k_max_arenas - 1; i >= 0; --i) owned_[static_cast<std::size_t>(i)].reset();
}

thread_local device_allocator::thread_entry* device_allocator::last_entry_ = nullptr;

device_allocator::thread_entry& device_allocator::this_thread_slow() const {
  thread_local thread_entries mine;
  for (thread_entry& e : mine.entries) {
    if (e.id == id_) return *(last_entry_ = &e);
  }
  thread_entry& e = mine.entries[static_cast<std::size_t>(mine.next)];
  mine.next = (mine.next + 1) % thread_entries::k_entries;
  thread_entries::leave(e);
  // A thread that comes once there are several arenas starts on the one
  // with the fewest threads rather than where the contention began.
  std::lock_guard<std::mutex> lock(arenas_mutex_);
  int arena = 0;
  for (int i = 1; i < arena_count(); ++i) {
    if (threads_on(i) < threads_on(arena)) arena = i;
  }
  e = thread_entry{id_, arena, 0, 0};
  threads_[static_cast<std::size_t>(arena)].fetch_add(1, std::memory_order_relaxed);
  last_entry_ = &e;
  return e;
}

void device_allocator::thread_left(int arena) {
  threads_[static_cast<std::size_t>(arena)].fetch_sub(1, std::memory_order_relaxed);
}

int device_allocator::threads_on(int arena) const {
  return threads_[static_cast<std::size_t>(arena)].load(std::memory_order_relaxed);
}

caching_allocator& device_allocator::allocating_arena(const thread_entry& mine) const {
  return arena(routed_.load(std::memory_order_acquire) != 0 ? 0 : mine.arena);
}

void* device_allocator::allocate_in_arenas(std::size_t bytes, stream_handle stream) {
  return allocating_arena(this_thread()).allocate(bytes, stream);
}

void device_allocator::free_in_arenas(void* ptr) {
  if (ptr == nullptr) return;
  const int count = arena_count();
  const int own = this_thread().arena;
  if (arena(own).free_if_owned(ptr)) return;
  for (int i = 0; i < count; ++i) {
    if (i != own && arena(i).free_if_owned(ptr)) return;
  }
  arena(0).free(ptr);  // owned by none: throws usage_error
}

void device_allocator::on_contended_call() {
  thread_entry& mine = this_thread();
  const std::int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::steady_clock::now().time_since_epoch())
                               .count();
  if (now - mine.last_contended_ns > k_contention_gap_ns) mine.contended_run = 0;
  mine.last_contended_ns = now;
  if (++mine.contended_run < k_contended_run) return;
  mine.contended_run = 0;
  std::lock_guard<std::mutex> lock(arenas_mutex_);
  const int count = arena_count();
  // The arena with the fewest threads; a new one has none.
  int to = count < max_arenas_ ? count : 0;
  for (int i = 0; i < count; ++i) {
    if (to != count && threads_on(i) < threads_on(to)) to = i;
  }
  // Only a move that evens the load: one thread fewer there than it leaves.
  if (threads_on(to) + 1 < threads_on(mine.arena)) move_locked(mine, to);
}

void device_allocator::move_locked(thread_entry& mine, int to) {
  while (arena_count() <= to) make_arena_locked();
  threads_[static_cast<std::size_t>(mine.arena)].fetch_sub(1, std::memory_order_relaxed);
  threads_[static_cast<std::size_t>(to)].fetch_add(1, std::memory_order_relaxed);
  mine.arena = to;
}

void device_allocator::make_arena_locked() {
  const int index = arena_count();
  caching_allocator& first = arena(0);
  auto made = std::make_unique<caching_allocator>(backend_, first.config());
  made->set_contention_observer(this);
  made->set_memory_fraction(first.memory_fraction());
  for (const int peer : peers_) made->allow_peer_access(peer);
  if (listener_ != nullptr) made->set_trace_listener(listener_);
  if (const int captures = routed_.load(std::memory_order_relaxed)) made->count_capture_elsewhere(captures);
  if (index == 1) first.join_ledger(&ledger_, 0);
  made->join_ledger(&ledger_, index);
  arenas_[static_cast<std::size_t>(index)].store(made.get(), std::memory_order_release);
  owned_[static_cast<std::size_t>(index)] = std::move(made);
  count_.store(index + 1, std::memory_order_release);
}

int device_allocator::arena_of_this_thread() const { return this_thread().arena; }

void device_allocator::move_this_thread(int index) {
  if (index < 0 || index >= max_arenas_) {
    throw usage_error("streamalloc: arena index must be in [0, " + std::to_string(max_arenas_) + "), got " +
                      std::to_string(index));
  }
  thread_entry& mine = this_thread();
  std::lock_guard<std::mutex> lock(arenas_mutex_);
  move_locked(mine, index);
}

bool device_allocator::release_elsewhere(int from, arena_ledger::release_reason why) {
  const bool out_of_memory = why == arena_ledger::release_reason::out_of_memory;
  bool released = false;
  const int count = arena_count();
  for (int i = 0; i < count; ++i) {
    if (i != from && arena(i).release_cache_for_other(/*wait=*/out_of_memory && i > from, out_of_memory)) {
      released = true;
    }
  }
  return released;
}

caching_allocator* device_allocator::owner_of(const void* ptr) const {
  const int count = arena_count();
  for (int i = 0; i < count; ++i) {
    if (arena(i).owns(ptr)) return &arena(i);
  }
  return nullptr;
}

void device_allocator::record_stream(void* ptr, stream_handle stream) {
  caching_allocator* owner = arena_count() == 1 ? &arena(0) : owner_of(ptr);
  (owner != nullptr ? *owner : arena(0)).record_stream(ptr, stream);  // arena 0 names an unknown pointer
}

void device_allocator::empty_cache() {
  const int count = arena_count();
  for (int i = 0; i < count; ++i) arena(i).empty_cache();
}

void device_allocator::empty_cache(pool_id id) {
  if (id == 0) {
    empty_cache();
  } else {
    arena(0).empty_cache(id);
  }
}

void device_allocator::allow_peer_access(int peer_device) {
  std::lock_guard<std::mutex> lock(arenas_mutex_);
  const int count = arena_count();
  for (int i = 0; i < count; ++i) arena(i).allow_peer_access(peer_device);
  if (std::find(peers_.begin(), peers_.end(), peer_device) == peers_.end()) peers_.push_back(peer_device);
}

void device_allocator::set_memory_fraction(double fraction) {
  std::lock_guard<std::mutex> lock(arenas_mutex_);
  const int count = arena_count();
  for (int i = 0; i < count; ++i) arena(i).set_memory_fraction(fraction);
}

double device_allocator::memory_fraction() const { return arena(0).memory_fraction(); }

void device_allocator::begin_allocate_to_pool(pool_id id, stream_filter filter) {
  std::lock_guard<std::mutex> lock(arenas_mutex_);
  // Note [arenas]: arena 0's frees from other threads' blocks.
  if (arena_count() > 1 && routed_.load(std::memory_order_relaxed) == 0) arena(0).complete_finished_frees();
  arena(0).begin_allocate_to_pool(id, std::move(filter));
  routed_.fetch_add(1, std::memory_order_acq_rel);
  const int count = arena_count();
  for (int i = 1; i < count; ++i) arena(i).count_capture_elsewhere(1);
}

void device_allocator::end_allocate_to_pool(pool_id id) {
  std::lock_guard<std::mutex> lock(arenas_mutex_);
  arena(0).end_allocate_to_pool(id);
  const int count = arena_count();
  for (int i = 1; i < count; ++i) arena(i).count_capture_elsewhere(-1);
  routed_.fetch_sub(1, std::memory_order_acq_rel);
}

void device_allocator::release_pool(pool_id id) { arena(0).release_pool(id); }

void device_allocator::create_or_incref_pool(pool_id id, std::shared_ptr<segment_source> source) {
  arena(0).create_or_incref_pool(id, std::move(source));
}

int device_allocator::pool_use_count(pool_id id) const { return arena(0).pool_use_count(id); }

void device_allocator::set_pool_use_on_oom(pool_id id, bool use_on_oom) {
  arena(0).set_pool_use_on_oom(id, use_on_oom);
}

void device_allocator::set_pool_no_split(pool_id id, bool no_split) { arena(0).set_pool_no_split(id, no_split); }

pool_checkpoint device_allocator::checkpoint_pool(pool_id id) const { return arena(0).checkpoint_pool(id); }

pool_restore_result device_allocator::restore_pool(const pool_checkpoint& state) {
  return arena(0).restore_pool(state);
}

bool device_allocator::pool_allocations_match(pool_id id, const std::vector<const void*>& expected) const {
  return arena(0).pool_allocations_match(id, expected);
}

void device_allocator::set_trace_listener(trace_listener* listener) {
  std::lock_guard<std::mutex> lock(arenas_mutex_);
  listener_ = listener;
  const int count = arena_count();
  for (int i = 0; i < count; ++i) arena(i).set_trace_listener(listener);
}

void device_allocator::update_config(const allocator_config& config) {
  std::lock_guard<std::mutex> lock(arenas_mutex_);
  // All or nothing: an arena that refuses undoes those already changed.
  const allocator_config before = arena(0).config();
  const int count = arena_count();
  int changed = 0;
  try {
    for (; changed < count; ++changed) arena(changed).update_config(config);
  } catch (...) {
    for (int i = 0; i < changed; ++i) arena(i).update_config(before);
    throw;
  }
}

allocator_config device_allocator::config() const { return arena(0).config(); }

device_allocator::shareable_range device_allocator::share_range(const void* ptr) const {
  const caching_allocator* owner = arena_count() == 1 ? &arena(0) : owner_of(ptr);
  return (owner != nullptr ? *owner : arena(0)).share_range(ptr);
}

device_stats device_allocator::stats() const {
  const int count = arena_count();
  if (count == 1) return arena(0).stats();
  // The arenas first: reading one returns its recent frees to the free
  // sets, which reaches the ledger before the device's counts are read.
  std::vector<device_stats> parts;
  parts.reserve(static_cast<std::size_t>(count));
  for (int i = 0; i < count; ++i) parts.push_back(arena(i).stats());
  device_stats out = ledger_.totals();  // current and peak of the device
  std::int64_t largest = 0;
  std::int64_t free_cached = 0;
  for (stat_array device_stats::*array : device_stats::k_arrays) {
    for (stat_counter& c : out.*array) c.allocated = c.freed = 0;
  }
  for (stat_counter device_stats::*counter : device_stats::k_counters) {
    (out.*counter).allocated = (out.*counter).freed = 0;
  }
  for (std::int64_t device_stats::*total : device_stats::k_totals) out.*total = 0;
  for (int i = 0; i < count; ++i) {
    const device_stats& s = parts[static_cast<std::size_t>(i)];
    for (stat_array device_stats::*array : device_stats::k_arrays) {
      for (int t = 0; t < k_stat_type_count; ++t) {
        (out.*array)[t].allocated += (s.*array)[t].allocated;
        (out.*array)[t].freed += (s.*array)[t].freed;
      }
    }
    for (stat_counter device_stats::*counter : device_stats::k_counters) {
      (out.*counter).allocated += (s.*counter).allocated;
      (out.*counter).freed += (s.*counter).freed;
    }
    for (std::int64_t device_stats::*total : device_stats::k_totals) out.*total += s.*total;
    if (i == 0) out.max_split_size = s.max_split_size;
    largest = std::max(largest, s.largest_free_block_bytes);
    free_cached += s.free_cached_bytes;
  }
  out.largest_free_block_bytes = largest;
  out.free_cached_bytes = free_cached;
  out.external_fragmentation =
      free_cached == 0 ? 0.0 : 1.0 - static_cast<double>(largest) / static_cast<double>(free_cached);
  const std::int64_t allocated = at(out.allocated_bytes, stat_type::all).current;
  const std::int64_t reserved = at(out.reserved_bytes, stat_type::all).current;
  out.reserved_allocated_ratio =
      allocated == 0 ? 0.0 : static_cast<double>(reserved) / static_cast<double>(allocated);
  return out;
}

device_allocator::usage device_allocator::current_usage() const {
  usage out;
  const int count = arena_count();
  for (int i = 0; i < count; ++i) {
    const usage u = arena(i).current_usage();
    out.allocations += u.allocations;
    out.allocated_bytes += u.allocated_bytes;
    out.requested_bytes += u.requested_bytes;
    out.cross_stream_reuses += u.cross_stream_reuses;
  }
  return out;
}

void device_allocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(arenas_mutex_);
  const int count = arena_count();
  for (int i = 0; i < count; ++i) arena(i).reset_peak_stats();
  if (count > 1) ledger_.reset_peaks();
}

void device_allocator::reset_accumulated_stats() {
  const int count = arena_count();
  for (int i = 0; i < count; ++i) arena(i).reset_accumulated_stats();
}

allocator_snapshot device_allocator::snapshot() const {
  const int count = arena_count();
  if (count == 1) return arena(0).snapshot();
  allocator_snapshot out;
  for (int i = 0; i < count; ++i) {
    allocator_snapshot part = arena(i).snapshot();
    std::move(part.segments.begin(), part.segments.end(), std::back_inserter(out.segments));
  }
  std::sort(out.segments.begin(), out.segments.end(),
            [](const segment_info& a, const segment_info& b) { return a.address < b.address; });
  return out;
}

bool device_allocator::owns(const void* ptr) const { return owner_of(ptr) != nullptr; }

std::size_t device_allocator::allocation_size(const void* ptr) const {
  const caching_allocator* owner = arena_count() == 1 ? &arena(0) : owner_of(ptr);
  return (owner != nullptr ? *owner : arena(0)).allocation_size(ptr);
}

void device_allocator::cache_info(std::size_t* largest_free_bytes, std::size_t* total_free_bytes) const {
  std::size_t largest = 0;
  std::size_t total = 0;
  const int count = arena_count();
  for (int i = 0; i < count; ++i) {
    std::size_t l = 0;
    std::size_t t = 0;
    arena(i).cache_info(&l, &t);
    largest = std::max(largest, l);
    total += t;
  }
  if (largest_free_bytes != nullptr) *largest_free_bytes = largest;
  if (total_free_bytes != nullptr) *total_free_bytes = total;
}

void device_allocator::validate() const {
  const int count = arena_count();
  for (int i = 0; i < count; ++i) arena(i).validate();
  if (count == 1) return;
  // Quiescent callers only (tests): the device's counts are the sums. The
  // arenas are read first: a reader returns their recent frees to the free
  // sets, and that reaches the ledger (Note [arenas]).
  arena_ledger::counts sums{};
  for (int i = 0; i < count; ++i) {
    const arena_ledger::counts part = arena_ledger::current_counts(arena(i).stats(), {});
    for (std::size_t k = 0; k < sums.size(); ++k) sums[k] += part[k];
  }
  ledger_.validate(sums);
}

void device_allocator::lock_for_fork() {
  arenas_mutex_.lock();
  const int count = arena_count();
  for (int i = 0; i < count; ++i) arena(i).lock_for_fork();
  ledger_.lock_for_fork();
}

void device_allocator::unlock_after_fork() {
  ledger_.unlock_after_fork();
  const int count = arena_count();
  for (int i = count - 1; i >= 0; --i) arena(i).unlock_after_fork();
  arenas_mutex_.unlock();
}

}  // namespace streamalloc
