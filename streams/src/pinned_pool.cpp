// The pinned host-memory pool. Policy in brief:
// - Size classes: a request is rounded up to a multiple of 512 B up to
//   4 KiB; above that to a multiple of 1/8 of its power of two (8 classes
//   per doubling: 4.5, 5, ... 8 KiB, 9, 10, ... 16 KiB, ...), so waste stays
//   under 12.5 % and recurring sizes meet blocks of exactly their class.
// - Slabs are what the host backend pins. Small requests (class <= 1 MiB)
//   share 2 MiB slabs; a large request gets a slab of its class rounded up
//   to 2 MiB. Slabs of at least register_min_bytes are pinned by touching
//   pages in parallel and registering them, smaller ones by host_alloc.
//   When a capacity leaves less room, the slab shrinks to the class itself.
// - Blocks tile their slab in address order. A request takes the best fit
//   (smallest, then lowest address) among the free blocks of its kind (small
//   slabs serve small requests, large slabs large ones) and splits off the
//   rest when that is at least 512 B (small) or 1 MiB (large). A freed block
//   coalesces with its free neighbours.
// - Note [event-safe reuse]: whoever enqueues an async copy that reads or
//   writes a block calls record_event(ptr, stream) after it. A block freed
//   with events is pending: neither reusable nor merged until all of them
//   have completed. Pending blocks are polled (never waited for) when the
//   free lists miss, before a slab is made, so hits never query events and
//   a busy ring of copies reuses blocks as soon as their copies are done.
//   Events are kept per device and reused; they die with the pool.
// - Capacity bounds the slab bytes. A request that needs a slab beyond it
//   first releases idle slabs, then waits (lock released) for the oldest
//   pending block's events, and throws pinned_out_of_memory only when
//   nothing is in flight. A request larger than the capacity throws at once.
// - One mutex. A new slab is pinned with the lock released, its bytes
//   reserved in growing_bytes_ so concurrent requests respect the capacity;
//   releases (trim) happen under the lock, they are rare.
#include "streamalloc/streams/pinned_pool.hpp"

#include <algorithm>
#include <chrono>
#include <sstream>
#include <stdexcept>

#include "streamalloc/core/block_list.hpp"
#include "streamalloc/util/errors.hpp"

namespace streamalloc {
namespace {

constexpr std::size_t k_exact_class_limit_bytes = 4_KiB;
constexpr std::size_t k_classes_per_doubling = 8;
constexpr std::size_t k_largest_request_bytes = std::size_t{1} << 56;

std::size_t highest_power_of_two_at_most(std::size_t v) {
  return std::size_t{1} << (63 - __builtin_clzll(static_cast<unsigned long long>(v)));
}

std::int64_t as_signed(std::size_t v) { return static_cast<std::int64_t>(v); }

std::int64_t microseconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - start).count();
}

void add_counter(std::map<std::string, double>& out, const std::string& name, const stat_counter& c) {
  out[name + ".current"] = static_cast<double>(c.current);
  out[name + ".peak"] = static_cast<double>(c.peak);
  out[name + ".allocated"] = static_cast<double>(c.allocated);
  out[name + ".freed"] = static_cast<double>(c.freed);
}

void add_duration(std::map<std::string, double>& out, const std::string& name, const duration_stat& d) {
  out[name + ".total"] = static_cast<double>(d.total_us);
  out[name + ".max"] = static_cast<double>(d.max_us);
  out[name + ".min"] = static_cast<double>(d.min_us);
  out[name + ".count"] = static_cast<double>(d.count);
  out[name + ".avg"] = d.count == 0 ? 0.0 : static_cast<double>(d.total_us) / static_cast<double>(d.count);
}

std::string hex(std::uintptr_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

}  // namespace

void duration_stat::add(std::int64_t us) {
  total_us += us;
  max_us = std::max(max_us, us);
  min_us = count == 0 ? us : std::min(min_us, us);
  ++count;
}

double pinned_pool_stats::hit_rate() const {
  const std::int64_t requests = hits + misses;
  return requests == 0 ? 0.0 : static_cast<double>(hits) / static_cast<double>(requests);
}

std::map<std::string, double> pinned_pool_stats::to_map() const {
  std::map<std::string, double> out;
  add_counter(out, "allocations", allocations);
  add_counter(out, "allocated_bytes", allocated_bytes);
  add_counter(out, "active_requests", active_requests);
  add_counter(out, "active_bytes", active_bytes);
  add_counter(out, "requested_bytes", requested_bytes);
  // torch derives these two from the allocation counter, and so do we.
  out["num_host_alloc"] = static_cast<double>(allocations.allocated);
  out["num_host_free"] = static_cast<double>(allocations.freed);
  add_duration(out, "host_alloc_time", host_alloc_time);
  add_duration(out, "host_free_time", host_free_time);
  out["cached_bytes"] = static_cast<double>(cached_bytes);
  out["pending_blocks"] = static_cast<double>(pending_blocks);
  out["hits"] = static_cast<double>(hits);
  out["misses"] = static_cast<double>(misses);
  out["hit_rate"] = hit_rate();
  out["capacity_waits"] = static_cast<double>(capacity_waits);
  out["event_errors"] = static_cast<double>(event_errors);
  out["capacity_bytes"] = static_cast<double>(capacity_bytes);
  return out;
}

pinned_pool::pinned_pool(host_backend& backend, pinned_pool_config config) : backend_(backend), config_(config) {
  stats_.capacity_bytes = as_signed(config_.capacity_bytes);
}

pinned_pool::~pinned_pool() {
  // Copies may still read or write blocks (pending or never freed): wait
  // for every recorded event before the memory goes away. Failures are
  // ignored; a device that cannot synchronize runs nothing any more.
  for (auto& [address, s] : slabs_) {
    for (block* b = s->first; b != nullptr; b = b->next) {
      for (const recorded_event& r : b->events) {
        backend_.synchronize_event(r.event);
        backend_.destroy_event(r.event);
      }
    }
  }
  for (auto& [device, events] : idle_events_) {
    for (event_handle e : events) backend_.destroy_event(e);
  }
  for (auto& [address, s] : slabs_) {
    backend_.release_pinned(reinterpret_cast<void*>(s->address), s->size, s->method);
    block* b = s->first;
    while (b != nullptr) {
      block* next = b->next;
      delete b;
      b = next;
    }
  }
}

std::size_t pinned_pool::round_size(std::size_t bytes) {
  if (bytes > k_largest_request_bytes) {
    throw usage_error("streamalloc pinned pool: a request of " + std::to_string(bytes) + " bytes is too large");
  }
  if (bytes <= k_exact_class_limit_bytes) {
    const std::size_t at_least_one = std::max<std::size_t>(bytes, 1);
    return (at_least_one + k_block_alignment_bytes - 1) / k_block_alignment_bytes * k_block_alignment_bytes;
  }
  const std::size_t step = highest_power_of_two_at_most(bytes) / k_classes_per_doubling;
  std::size_t rounded = 0;
  round_up_checked(bytes, step, &rounded);  // cannot overflow below k_largest_request_bytes
  return rounded;
}

// --- allocation ---

void* pinned_pool::allocate(std::size_t bytes) {
  const std::size_t rounded = round_size(bytes);
  const std::size_t requested = std::max<std::size_t>(bytes, 1);
  const bool small = rounded <= k_small_request_max_bytes;
  std::unique_lock<std::mutex> lock(mutex_);
  if (config_.capacity_bytes != 0 && rounded > config_.capacity_bytes) {
    throw pinned_out_of_memory("streamalloc pinned pool: a request of " + format_bytes(requested) + " (size class " +
                                   format_bytes(rounded) + ") exceeds the pool's capacity of " +
                                   format_bytes(config_.capacity_bytes),
                               requested);
  }
  bool released_for_backend = false;
  for (;;) {
    if (void* p = take_cached_locked(rounded, requested, small)) {
      ++stats_.hits;
      return p;
    }
    if (!pending_.empty() && process_events_locked() > 0) continue;
    std::size_t slab_bytes = slab_bytes_for_locked(rounded, small);
    if (slab_bytes == 0 && release_idle_slabs_locked(0, nullptr) > 0) {
      slab_bytes = slab_bytes_for_locked(rounded, small);
    }
    if (slab_bytes != 0) {
      status error;
      if (slab* s = grow(lock, slab_bytes, small, &error)) {
        ++stats_.misses;
        block* b = s->first;
        hand_out_locked(b, rounded, requested);
        return reinterpret_cast<void*>(b->address);
      }
      // The system is short of lockable memory: give back what is idle
      // and try once more before failing.
      if (!released_for_backend && release_idle_slabs_locked(0, nullptr) > 0) {
        released_for_backend = true;
        continue;
      }
      throw pinned_out_of_memory("streamalloc pinned pool: pinning a slab of " + format_bytes(slab_bytes) + " for " +
                                     format_bytes(requested) + " failed: " + error.message(),
                                 requested);
    }
    // At capacity: the oldest in-flight block is the likeliest to finish.
    event_handle wait_on = 0;
    for (const block* b : pending_) {
      if (!b->events.empty()) {
        wait_on = b->events.front().event;
        break;
      }
    }
    if (wait_on == 0) throw_exhausted_locked(requested, rounded);
    ++stats_.capacity_waits;
    // Events are never destroyed while the pool lives, so the handle stays
    // valid with the lock released; if another thread recycles and
    // re-records it meanwhile, this only waits longer.
    lock.unlock();
    const status waited = backend_.synchronize_event(wait_on);
    lock.lock();
    if (!waited) {
      throw device_failure("streamalloc pinned pool: waiting for a copy to finish failed: " + waited.message());
    }
    process_events_locked();
  }
}

void* pinned_pool::take_cached_locked(std::size_t rounded, std::size_t requested, bool small) {
  free_set& set = free_set_for(small);
  auto it = set.lower_bound(rounded);
  if (it == set.end()) return nullptr;
  block* b = *it;
  set.erase(it);
  hand_out_locked(b, rounded, requested);
  return reinterpret_cast<void*>(b->address);
}

void pinned_pool::hand_out_locked(block* b, std::size_t rounded, std::size_t requested) {
  const std::size_t min_remainder = b->owner->small ? k_block_alignment_bytes : k_large_min_remainder_bytes;
  if (b->size - rounded >= min_remainder) {
    // b->next is not free (it would have merged with b), so the remainder
    // has no free neighbour.
    block* rest = split_at(b, rounded, new block);
    free_set_for(rest->owner->small).insert(rest);
  }
  b->state = block_state::allocated;
  b->requested = requested;
  live_[b->address] = b;
  stats_.active_requests.increase(1);
  stats_.active_bytes.increase(as_signed(b->size));
  stats_.requested_bytes.increase(as_signed(requested));
}

std::size_t pinned_pool::slab_bytes_for_locked(std::size_t rounded, bool small) const {
  std::size_t wanted = rounded;
  if (small) {
    wanted = k_small_slab_bytes;
  } else if (!round_up_checked(rounded, k_large_slab_alignment_bytes, &wanted)) {
    wanted = rounded;
  }
  if (config_.capacity_bytes == 0) return wanted;
  const std::size_t held = static_cast<std::size_t>(stats_.allocated_bytes.current) + growing_bytes_;
  const std::size_t room = config_.capacity_bytes > held ? config_.capacity_bytes - held : 0;
  if (wanted <= room) return wanted;
  return rounded <= room ? rounded : 0;
}

pinned_pool::slab* pinned_pool::grow(std::unique_lock<std::mutex>& lock, std::size_t bytes, bool small, status* error) {
  const pin_method method = bytes >= config_.register_min_bytes ? pin_method::register_touched : pin_method::host_alloc;
  auto s = std::make_unique<slab>();
  auto first = std::make_unique<block>();
  growing_bytes_ += bytes;
  lock.unlock();
  const auto start = std::chrono::steady_clock::now();
  void* ptr = nullptr;
  const status st = backend_.allocate_pinned(bytes, method, &ptr);
  const std::int64_t us = microseconds_since(start);
  lock.lock();
  growing_bytes_ -= bytes;
  if (!st) {
    *error = st;
    return nullptr;
  }
  stats_.host_alloc_time.add(us);
  s->address = reinterpret_cast<std::uintptr_t>(ptr);
  s->size = bytes;
  s->method = method;
  s->small = small;
  first->address = s->address;
  first->size = bytes;
  first->owner = s.get();
  s->first = first.release();
  stats_.allocations.increase(1);
  stats_.allocated_bytes.increase(as_signed(bytes));
  slab* raw = s.get();
  slabs_.emplace(raw->address, std::move(s));
  return raw;
}

[[noreturn]] void pinned_pool::throw_exhausted_locked(std::size_t requested, std::size_t rounded) const {
  const std::size_t cached = static_cast<std::size_t>(stats_.allocated_bytes.current - stats_.active_bytes.current);
  throw pinned_out_of_memory(
      "streamalloc pinned pool: cannot allocate " + format_bytes(requested) + " (size class " + format_bytes(rounded) +
          "): the capacity of " + format_bytes(config_.capacity_bytes) + " is reached (" +
          format_bytes(static_cast<std::size_t>(stats_.allocated_bytes.current)) + " pinned in " +
          std::to_string(slabs_.size()) + " slabs, " +
          format_bytes(static_cast<std::size_t>(stats_.active_bytes.current)) + " in " +
          std::to_string(stats_.active_requests.current) + " blocks in use, " + format_bytes(cached) +
          " cached but unusable for this request) and no copy is in flight to wait for; free pinned tensors or "
          "raise the capacity",
      requested);
}

// --- free and events ---

void pinned_pool::free(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == live_.end()) {
    throw usage_error("streamalloc pinned pool: free of " + hex(reinterpret_cast<std::uintptr_t>(ptr)) +
                      ", which is not a live block of this pool (a double free or a foreign pointer)");
  }
  block* b = it->second;
  live_.erase(it);
  stats_.requested_bytes.decrease(as_signed(b->requested));
  b->requested = 0;
  if (b->events.empty()) {
    free_block_locked(b);
  } else {
    b->state = block_state::pending;
    pending_.push_back(b);
  }
}

void pinned_pool::free(void* ptr, const std::vector<stream_use>& uses) {
  if (ptr == nullptr) return;
  std::vector<int> unrecorded_devices;
  for (const stream_use& use : uses) {
    try {
      record_event(ptr, use);
    } catch (const device_failure&) {
      unrecorded_devices.push_back(use.device);
    }
  }
  // Without an event nothing tells when that stream is done with the block;
  // waiting for the whole device does. If that fails too, the device's
  // context is broken and can no longer run a copy.
  for (int device : unrecorded_devices) backend_.synchronize_device(device);
  free(ptr);
}

bool pinned_pool::record_event(void* ptr, stream_use use) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == live_.end()) return false;
  block* b = it->second;
  // A later record on the same stream covers everything the earlier one
  // did, so one event per stream suffices.
  for (recorded_event& r : b->events) {
    if (r.use.stream == use.stream && r.use.device == use.device) {
      const status st = backend_.record_event(r.event, use.stream);
      if (!st) throw device_failure("streamalloc pinned pool: recording an event failed: " + st.message());
      return true;
    }
  }
  event_handle event = 0;
  status st = acquire_event_locked(use.device, &event);
  if (!st) throw device_failure("streamalloc pinned pool: creating an event failed: " + st.message());
  st = backend_.record_event(event, use.stream);
  if (!st) {
    idle_events_[use.device].push_back(event);
    throw device_failure("streamalloc pinned pool: recording an event failed: " + st.message());
  }
  b->events.push_back({event, use});
  return true;
}

status pinned_pool::acquire_event_locked(int device, event_handle* out) {
  std::vector<event_handle>& idle = idle_events_[device];
  if (!idle.empty()) {
    *out = idle.back();
    idle.pop_back();
    return status::success();
  }
  return backend_.create_event(device, out);
}

void pinned_pool::free_block_locked(block* b) {
  stats_.active_requests.decrease(1);
  stats_.active_bytes.decrease(as_signed(b->size));
  b->state = block_state::free;
  free_set& set = free_set_for(b->owner->small);
  if (block* prev = b->prev; prev != nullptr && prev->state == block_state::free) {
    set.erase(prev);
    delete absorb_next(prev);
    b = prev;
  }
  if (block* next = b->next; next != nullptr && next->state == block_state::free) {
    set.erase(next);
    delete absorb_next(b);
  }
  set.insert(b);
}

std::size_t pinned_pool::process_events() {
  std::lock_guard<std::mutex> lock(mutex_);
  return process_events_locked();
}

std::size_t pinned_pool::process_events_locked() {
  std::size_t reusable = 0;
  auto keep = pending_.begin();
  for (block* b : pending_) {
    std::vector<recorded_event>& events = b->events;
    for (std::size_t i = 0; i < events.size();) {
      bool done = false;
      const status st = backend_.query_event(events[i].event, &done);
      if (!st) {
        ++stats_.event_errors;
        ++i;
      } else if (done) {
        idle_events_[events[i].use.device].push_back(events[i].event);
        events[i] = events.back();
        events.pop_back();
      } else {
        ++i;
      }
    }
    if (events.empty()) {
      free_block_locked(b);
      ++reusable;
    } else {
      *keep++ = b;
    }
  }
  pending_.erase(keep, pending_.end());
  return reusable;
}

// --- release ---

std::size_t pinned_pool::trim(std::size_t keep_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  process_events_locked();
  std::string first_error;
  const std::size_t released = release_idle_slabs_locked(keep_bytes, &first_error);
  if (!first_error.empty()) throw device_failure(first_error);
  return released;
}

std::size_t pinned_pool::release_idle_slabs_locked(std::size_t keep_bytes, std::string* first_error) {
  std::vector<slab*> idle;
  std::size_t idle_bytes = 0;
  for (auto& [address, s] : slabs_) {
    if (slab_idle(*s)) {
      idle.push_back(s.get());
      idle_bytes += s->size;
    }
  }
  std::sort(idle.begin(), idle.end(), [](const slab* a, const slab* b) {
    return a->size != b->size ? a->size > b->size : a->address < b->address;
  });
  std::size_t released = 0;
  for (slab* s : idle) {
    if (idle_bytes <= keep_bytes) break;
    const auto start = std::chrono::steady_clock::now();
    const status st = backend_.release_pinned(reinterpret_cast<void*>(s->address), s->size, s->method);
    if (!st) {
      if (first_error != nullptr && first_error->empty()) {
        *first_error =
            "streamalloc pinned pool: releasing a slab of " + format_bytes(s->size) + " failed: " + st.message();
      }
      continue;
    }
    stats_.host_free_time.add(microseconds_since(start));
    free_set_for(s->small).erase(s->first);
    stats_.allocations.decrease(1);
    stats_.allocated_bytes.decrease(as_signed(s->size));
    idle_bytes -= s->size;
    released += s->size;
    delete s->first;
    slabs_.erase(s->address);
  }
  return released;
}

// --- introspection ---

std::size_t pinned_pool::block_size(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(reinterpret_cast<std::uintptr_t>(ptr));
  return it == live_.end() ? 0 : it->second->size;
}

pinned_pool_stats pinned_pool::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  pinned_pool_stats out = stats_;
  out.cached_bytes = stats_.allocated_bytes.current - stats_.active_bytes.current;
  out.pending_blocks = as_signed(pending_.size());
  return out;
}

void pinned_pool::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (stat_counter* c : {&stats_.allocations, &stats_.allocated_bytes, &stats_.active_requests, &stats_.active_bytes,
                          &stats_.requested_bytes}) {
    c->reset_peak();
  }
  stats_.host_alloc_time.reset_peak();
  stats_.host_free_time.reset_peak();
}

void pinned_pool::reset_accumulated_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (stat_counter* c : {&stats_.allocations, &stats_.allocated_bytes, &stats_.active_requests, &stats_.active_bytes,
                          &stats_.requested_bytes}) {
    c->reset_accumulated();
  }
  stats_.host_alloc_time.reset_accumulated();
  stats_.host_free_time.reset_accumulated();
  stats_.hits = 0;
  stats_.misses = 0;
  stats_.capacity_waits = 0;
  stats_.event_errors = 0;
}

void pinned_pool::validate() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::string problem = first_violation_locked();
  if (!problem.empty()) throw std::logic_error("streamalloc pinned pool invariant violated: " + problem);
}

std::string pinned_pool::first_violation_locked() const {
  std::size_t slab_bytes = 0, active_blocks = 0, active_bytes = 0, requested = 0;
  std::size_t free_small = 0, free_large = 0, allocated = 0, pending = 0;
  for (const auto& [address, s] : slabs_) {
    const std::string where = "slab " + hex(address);
    if (s->address != address) return where + ": keyed at the wrong address";
    if (s->size == 0 || s->first == nullptr) return where + ": empty";
    const pin_method expected =
        s->size >= config_.register_min_bytes ? pin_method::register_touched : pin_method::host_alloc;
    if (s->method != expected) return where + ": pinned with the wrong method";
    slab_bytes += s->size;
    std::uintptr_t expected_address = s->address;
    const block* prev = nullptr;
    for (const block* b = s->first; b != nullptr; b = b->next) {
      const std::string at = where + ", block " + hex(b->address);
      if (b->owner != s.get()) return at + ": wrong owner";
      if (b->prev != prev) return at + ": broken prev link";
      if (b->address != expected_address) return at + ": not contiguous with its predecessor";
      if (b->size == 0 || b->size % k_block_alignment_bytes != 0) return at + ": size not a multiple of 512";
      if (b->size > s->address + s->size - b->address) return at + ": runs past the slab";
      const bool is_free = b->state == block_state::free;
      if (is_free && prev != nullptr && prev->state == block_state::free) return at + ": two adjacent free blocks";
      const free_set& set = s->small ? free_small_ : free_large_;
      const bool in_set = set.count(const_cast<block*>(b)) != 0;
      if (is_free && !in_set) return at + ": free but not in its free list";
      if (!is_free && in_set) return at + ": in a free list but not free";
      const auto live = live_.find(b->address);
      const bool is_live = live != live_.end() && live->second == b;
      if ((b->state == block_state::allocated) != is_live) return at + ": live-map entry disagrees with its state";
      const bool in_pending = std::find(pending_.begin(), pending_.end(), b) != pending_.end();
      if ((b->state == block_state::pending) != in_pending) return at + ": pending list disagrees with its state";
      if (b->state == block_state::pending && b->events.empty()) return at + ": pending without events";
      if (is_free && !b->events.empty()) return at + ": free with events";
      if (b->state != block_state::allocated && b->requested != 0) return at + ": requested bytes while not allocated";
      if (is_free) {
        (s->small ? free_small : free_large) += 1;
      } else {
        ++active_blocks;
        active_bytes += b->size;
        if (b->state == block_state::pending) ++pending;
        if (b->state == block_state::allocated) ++allocated, requested += b->requested;
      }
      expected_address = b->address + b->size;
      prev = b;
    }
    if (expected_address != s->address + s->size) return where + ": blocks do not tile the slab";
  }
  if (free_small != free_small_.size()) return "small free list holds blocks of no slab";
  if (free_large != free_large_.size()) return "large free list holds blocks of no slab";
  if (allocated != live_.size()) return "live map holds blocks of no slab";
  if (pending != pending_.size()) return "pending list holds blocks of no slab";
  auto check = [](const char* name, const stat_counter& c, std::size_t recount) -> std::string {
    if (c.current != as_signed(recount)) {
      return std::string(name) + ".current is " + std::to_string(c.current) + ", recount " + std::to_string(recount);
    }
    if (c.peak < c.current) return std::string(name) + ".peak is below current";
    return {};
  };
  for (const std::string& problem : {check("allocations", stats_.allocations, slabs_.size()),
                                     check("allocated_bytes", stats_.allocated_bytes, slab_bytes),
                                     check("active_requests", stats_.active_requests, active_blocks),
                                     check("active_bytes", stats_.active_bytes, active_bytes),
                                     check("requested_bytes", stats_.requested_bytes, requested)}) {
    if (!problem.empty()) return problem;
  }
  if (config_.capacity_bytes != 0 && slab_bytes + growing_bytes_ > config_.capacity_bytes) {
    return "pinned bytes exceed the capacity";
  }
  return {};
}

}  // namespace streamalloc
