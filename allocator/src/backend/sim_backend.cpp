// sim_backend: the CPU-only device model every policy test runs on. It hands
// out fake addresses (never dereferenced), accounts capacity, models events
// whose completion the test controls and the work they order, and injects
// faults on request.
#include "streamalloc/backend/sim_backend.hpp"

#include <algorithm>
#include <cstdio>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>

#include "streamalloc/util/errors.hpp"

namespace streamalloc {

namespace {

static_assert(sizeof(std::uintptr_t) >= 8, "the simulated address space needs 64-bit pointers");
static_assert(static_cast<int>(sim_fault_point::vm_allow_peer) + 1 == k_sim_fault_point_count,
              "k_sim_fault_point_count must match sim_fault_point");

// Each simulated device gets its own 64 TiB of addresses, as GPUs share one
// unified address space: a pointer never belongs to two devices. Addresses
// are never reused, so the span bounds the total ever reserved: about 460
// reservations the size of an H200.
constexpr std::uintptr_t k_device_address_span = std::uintptr_t{1} << 46;
// Addresses start far from 0 so a null or small-integer pointer is never
// mistaken for device memory. Event and chunk handles live in their own
// ranges so a handle passed in the wrong argument is rejected, not accepted.
constexpr std::uintptr_t k_first_address = k_device_address_span;
// Every address stays below 2^53, so it survives tools that read numbers as
// doubles (JSON, Python floats).
constexpr std::uintptr_t k_address_limit = std::uintptr_t{1} << 53;
constexpr int k_max_device_index = static_cast<int>((k_address_limit - k_first_address) / k_device_address_span) - 1;
constexpr event_handle k_first_event = (event_handle{1} << 40) + 1;
constexpr physical_handle k_first_chunk = (physical_handle{1} << 41) + 1;
constexpr std::size_t k_segment_alignment = 2_MiB;

// Pruning retired touches waits for at least this many, so a handful of
// touches is never rescanned on every call.
constexpr std::size_t k_touch_prune_floor = 64;

bool is_power_of_two(std::size_t v) { return v != 0 && (v & (v - 1)) == 0; }

std::uintptr_t first_address_of(int device_index) {
  if (device_index < 0 || device_index > k_max_device_index) {
    throw std::invalid_argument("sim_config.device_index must be in [0, " + std::to_string(k_max_device_index) +
                                "], got " + std::to_string(device_index));
  }
  return k_first_address + k_device_address_span * static_cast<std::uintptr_t>(device_index);
}

// Shrinking the device below what is in use (set_capacity) leaves no room,
// not a negative amount.
std::size_t headroom(std::size_t capacity, std::size_t used) { return capacity > used ? capacity - used : 0; }

std::string hex(std::uintptr_t v) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "0x%llx", static_cast<unsigned long long>(v));
  return buffer;
}

std::uintptr_t address_of(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

const char* point_name(sim_fault_point point) {
  switch (point) {
    case sim_fault_point::allocate_segment:
      return "allocate_segment";
    case sim_fault_point::free_segment:
      return "free_segment";
    case sim_fault_point::create_event:
      return "create_event";
    case sim_fault_point::record_event:
      return "record_event";
    case sim_fault_point::query_event:
      return "query_event";
    case sim_fault_point::synchronize_event:
      return "synchronize_event";
    case sim_fault_point::stream_wait_event:
      return "stream_wait_event";
    case sim_fault_point::synchronize_device:
      return "synchronize_device";
    case sim_fault_point::vm_reserve:
      return "vm_reserve";
    case sim_fault_point::vm_create:
      return "vm_create";
    case sim_fault_point::vm_map:
      return "vm_map";
    case sim_fault_point::vm_unmap:
      return "vm_unmap";
    case sim_fault_point::vm_allow_peer:
      return "vm_allow_peer";
  }
  return "unknown fault point";
}

bool valid_point(sim_fault_point point) {
  const int index = static_cast<int>(point);
  return index >= 0 && index < k_sim_fault_point_count;
}

status invalid(std::string message) { return {status_code::invalid_argument, "sim_backend: " + std::move(message)}; }

// The reserved range holding `address` (const or not), or end().
template <typename range_map_type>
auto range_containing(range_map_type& ranges, std::uintptr_t address) -> decltype(ranges.begin()) {
  auto it = ranges.upper_bound(address);
  if (it == ranges.begin()) return ranges.end();
  --it;
  if (address - it->first >= it->second.bytes) return ranges.end();
  return it;
}

}  // namespace

sim_backend::sim_backend(sim_config config)
    : config_(config),
      address_alignment_(k_segment_alignment),
      next_address_(first_address_of(config.device_index)),
      address_end_(next_address_ + k_device_address_span),
      next_event_(k_first_event),
      next_chunk_(k_first_chunk) {
  if (config_.virtual_memory) {
    // Real granularities are powers of two; the alignment arithmetic relies on it.
    if (!is_power_of_two(config_.vm_granularity_bytes)) {
      throw std::invalid_argument("sim_config.vm_granularity_bytes must be a power of two, got " +
                                  std::to_string(config_.vm_granularity_bytes));
    }
    address_alignment_ = std::max(address_alignment_, config_.vm_granularity_bytes);
  }
}

sim_backend::~sim_backend() = default;

// --- helpers (mutex_ held) ---

status sim_backend::check_fault_locked(sim_fault_point point) {
  fault_rule& rule = faults_[static_cast<int>(point)];
  if (rule.countdown == 1) {
    rule.countdown = 0;
    return {rule.nth_code, std::string("sim_backend: injected fault at ") + point_name(point)};
  }
  if (rule.countdown > 1) --rule.countdown;
  if (rule.always) return {rule.always_code, std::string("sim_backend: injected fault at ") + point_name(point)};
  return status::success();
}

std::uintptr_t sim_backend::take_address_locked(std::size_t bytes) {
  std::size_t span = 0;
  if (!round_up_checked(bytes, address_alignment_, &span)) return 0;
  // The gap after every allocation keeps two segments (or ranges) from ever
  // being address-contiguous, so a coalescing bug across segments cannot go
  // unnoticed by accident of placement.
  if (span > std::numeric_limits<std::size_t>::max() - address_alignment_) return 0;
  span += address_alignment_;
  if (span > address_end_ - next_address_) return 0;
  const std::uintptr_t base = next_address_;
  next_address_ += span;
  return base;
}

bool sim_backend::fits_locked(std::size_t bytes) const {
  return bytes <= headroom(config_.capacity_bytes, used_bytes_);
}

bool sim_backend::known_stream_locked(stream_handle stream) const { return stream < next_stream_; }

bool sim_backend::mapped_locked(std::uintptr_t address, std::size_t bytes) const {
  const auto range = range_containing(ranges_, address);
  if (range == ranges_.end()) return false;
  const auto& mappings = range->second.mappings;
  const std::uintptr_t end = address + bytes;
  std::uintptr_t cursor = address;
  while (cursor < end) {
    auto it = mappings.upper_bound(cursor);
    if (it == mappings.begin()) return false;
    --it;
    const auto chunk = chunks_.find(it->second);
    if (chunk == chunks_.end()) return false;
    const std::uintptr_t mapping_end = it->first + chunk->second.bytes;
    if (cursor >= mapping_end) return false;
    cursor = mapping_end;
  }
  return true;
}

bool sim_backend::in_segment_locked(std::uintptr_t address, std::size_t bytes) const {
  auto segment = segments_.upper_bound(address);
  if (segment == segments_.begin()) return false;
  --segment;
  const std::size_t offset = address - segment->first;
  return offset < segment->second && bytes <= segment->second - offset;
}

bool sim_backend::known_memory_locked(std::uintptr_t address, std::size_t bytes) const {
  if (address == 0 || address > std::numeric_limits<std::uintptr_t>::max() - bytes) return false;
  if (in_segment_locked(address, bytes)) return true;
  const auto range = range_containing(ranges_, address);
  return range != ranges_.end() && bytes <= range->second.bytes - (address - range->first);
}

void sim_backend::complete_locked(event_state& event) {
  if (!event.pending) return;
  event.pending = false;
  advance_locked(event.stream, event.record_sequence);
}

void sim_backend::advance_locked(stream_handle stream, std::uint64_t sequence) {
  std::vector<std::pair<stream_handle, std::uint64_t>> work{{stream, sequence}};
  while (!work.empty()) {
    const auto [s, through] = work.back();
    work.pop_back();
    std::uint64_t& done = completed_through_[s];
    if (through <= done) continue;
    done = through;
    const auto waits = open_waits_.find(s);
    if (waits == open_waits_.end()) continue;
    std::deque<wait_edge>& edges = waits->second;
    while (!edges.empty() && edges.front().position <= through) {
      work.emplace_back(edges.front().waited_stream, edges.front().waited_sequence);
      edges.pop_front();
    }
  }
}

bool sim_backend::retired_locked(const touch_state& touch) const {
  const auto it = completed_through_.find(touch.stream);
  return it != completed_through_.end() && it->second >= touch.sequence;
}

sim_backend::touch_map::iterator sim_backend::live_touch_locked(std::uintptr_t begin, std::uintptr_t end) {
  // A touch overlapping [begin, end) starts at most longest_touch_bytes_
  // before it, which keeps the scan to the neighbourhood of the range.
  const std::uintptr_t from = begin > longest_touch_bytes_ ? begin - longest_touch_bytes_ : 0;
  const auto stop = touches_.lower_bound(end);
  for (auto it = touches_.lower_bound(from); it != stop;) {
    if (retired_locked(it->second)) {
      it = touches_.erase(it);
    } else if (it->second.end > begin) {
      return it;
    } else {
      ++it;
    }
  }
  return touches_.end();
}

void sim_backend::drop_touches_locked(std::uintptr_t begin, std::uintptr_t end) {
  touches_.erase(touches_.lower_bound(begin), touches_.lower_bound(end));
}

void sim_backend::prune_touches_locked() {
  longest_touch_bytes_ = 0;
  for (auto it = touches_.begin(); it != touches_.end();) {
    if (retired_locked(it->second)) {
      it = touches_.erase(it);
    } else {
      longest_touch_bytes_ = std::max<std::size_t>(longest_touch_bytes_, it->second.end - it->first);
      ++it;
    }
  }
  touches_after_prune_ = touches_.size();
}

// --- segments ---

void sim_backend::on_next_memory_allocation(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  next_allocation_hook_ = std::move(hook);
}

void sim_backend::run_allocation_hook() {
  std::function<void()> hook;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    hook.swap(next_allocation_hook_);
  }
  if (hook) hook();
}

status sim_backend::allocate_segment(std::size_t bytes, void** out) {
  run_allocation_hook();
  std::lock_guard<std::mutex> lock(mutex_);
  if (status s = check_fault_locked(sim_fault_point::allocate_segment); !s) return s;
  if (out == nullptr) return invalid("allocate_segment: out is null");
  if (bytes == 0) return invalid("allocate_segment: zero bytes");
  if (!fits_locked(bytes)) {
    return {status_code::out_of_memory, "sim_backend: cannot allocate " + format_bytes(bytes) + ": " +
                                            format_bytes(headroom(config_.capacity_bytes, used_bytes_)) + " free of " +
                                            format_bytes(config_.capacity_bytes)};
  }
  const std::uintptr_t base = take_address_locked(bytes);
  if (base == 0) return {status_code::out_of_memory, "sim_backend: simulated address space exhausted"};
  segments_.emplace(base, bytes);
  used_bytes_ += bytes;
  ++counters_.segment_allocs;
  *out = reinterpret_cast<void*>(base);
  return status::success();
}

status sim_backend::free_segment(void* ptr, std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (status s = check_fault_locked(sim_fault_point::free_segment); !s) return s;
  const auto it = segments_.find(address_of(ptr));
  if (it == segments_.end()) return invalid("free_segment: " + hex(address_of(ptr)) + " is not a live segment base");
  if (it->second != bytes) {
    return invalid("free_segment: " + hex(it->first) + " was allocated with " + std::to_string(it->second) +
                   " bytes, freed with " + std::to_string(bytes));
  }
  // cudaFree waits for the device, so work touching the segment is over.
  drop_touches_locked(it->first, it->first + bytes);
  used_bytes_ -= bytes;
  segments_.erase(it);
  ++counters_.segment_frees;
  return status::success();
}

status sim_backend::memory_info(device_memory_info* out) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (out == nullptr) return invalid("memory_info: out is null");
  out->total_bytes = config_.capacity_bytes;
  out->free_bytes = headroom(config_.capacity_bytes, used_bytes_);
  return status::success();
}

status sim_backend::device_processes(std::vector<device_process>* out) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (out == nullptr) return invalid("device_processes: out is null");
  if (!processes_) return {status_code::not_supported, "sim_backend: no processes were set"};
  *out = *processes_;
  return status::success();
}

// --- events ---

status sim_backend::create_event(event_handle* out) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (status s = check_fault_locked(sim_fault_point::create_event); !s) return s;
  if (out == nullptr) return invalid("create_event: out is null");
  const event_handle event = next_event_++;
  events_.emplace(event, event_state{});
  ++counters_.events_created;
  *out = event;
  return status::success();
}

status sim_backend::destroy_event(event_handle event) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Like cudaEventDestroy, a still-pending record may be destroyed; its
  // stream waits stay on record because handles are never reused.
  if (events_.erase(event) == 0) return invalid("destroy_event: unknown event " + hex(event));
  ++counters_.events_destroyed;
  return status::success();
}

status sim_backend::record_event(event_handle event, stream_handle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (status s = check_fault_locked(sim_fault_point::record_event); !s) return s;
  const auto it = events_.find(event);
  if (it == events_.end()) return invalid("record_event: unknown event " + hex(event));
  if (!known_stream_locked(stream)) return invalid("record_event: unknown stream " + hex(stream));
  // A new record replaces the previous one, as cudaEventRecord does.
  it->second.pending = true;
  it->second.stream = stream;
  it->second.record_sequence = next_record_sequence_++;
  if (config_.events_complete_immediately) complete_locked(it->second);
  ++counters_.event_records;
  return status::success();
}

status sim_backend::query_event(event_handle event, bool* done) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (status s = check_fault_locked(sim_fault_point::query_event); !s) return s;
  if (done == nullptr) return invalid("query_event: done is null");
  const auto it = events_.find(event);
  if (it == events_.end()) return invalid("query_event: unknown event " + hex(event));
  // A never-recorded event reports done, as cudaEventQuery does.
  *done = !it->second.pending;
  ++counters_.event_queries;
  return status::success();
}

status sim_backend::synchronize_event(event_handle event) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (status s = check_fault_locked(sim_fault_point::synchronize_event); !s) return s;
  const auto it = events_.find(event);
  if (it == events_.end()) return invalid("synchronize_event: unknown event " + hex(event));
  complete_locked(it->second);
  ++counters_.event_syncs;
  return status::success();
}

status sim_backend::stream_wait_event(stream_handle stream, event_handle event) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (status s = check_fault_locked(sim_fault_point::stream_wait_event); !s) return s;
  if (!known_stream_locked(stream)) return invalid("stream_wait_event: unknown stream " + hex(stream));
  const auto it = events_.find(event);
  if (it == events_.end()) return invalid("stream_wait_event: unknown event " + hex(event));
  // Waiting on finished work orders nothing; only a wait on a pending record
  // is a hand-off worth reporting through stream_waited_on.
  if (it->second.pending) {
    waits_.emplace(stream, event);
    open_waits_[stream].push_back({next_record_sequence_, it->second.stream, it->second.record_sequence});
  }
  last_wait_source_ = it->second.stream;
  ++counters_.stream_waits;
  return status::success();
}

status sim_backend::synchronize_device() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (status s = check_fault_locked(sim_fault_point::synchronize_device); !s) return s;
  for (auto& entry : events_) complete_locked(entry.second);
  // Including work after a stream's last record, which no event covers.
  touches_.clear();
  longest_touch_bytes_ = 0;
  touches_after_prune_ = 0;
  ++counters_.device_syncs;
  return status::success();
}

// --- virtual memory ---

status sim_backend::vm_reserve(std::size_t bytes, void** out_range) {
  if (!config_.virtual_memory) return unsupported();
  std::lock_guard<std::mutex> lock(mutex_);
  if (status s = check_fault_locked(sim_fault_point::vm_reserve); !s) return s;
  if (out_range == nullptr) return invalid("vm_reserve: out_range is null");
  if (bytes == 0 || bytes % config_.vm_granularity_bytes != 0) {
    return invalid("vm_reserve: " + std::to_string(bytes) + " bytes is not a positive multiple of the granularity " +
                   std::to_string(config_.vm_granularity_bytes));
  }
  // Reserving address space takes no device memory, so capacity is not checked.
  const std::uintptr_t base = take_address_locked(bytes);
  if (base == 0) return {status_code::out_of_memory, "sim_backend: simulated address space exhausted"};
  ranges_[base].bytes = bytes;
  *out_range = reinterpret_cast<void*>(base);
  return status::success();
}

status sim_backend::vm_release(void* range, std::size_t bytes) {
  if (!config_.virtual_memory) return unsupported();
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = ranges_.find(address_of(range));
  if (it == ranges_.end()) return invalid("vm_release: " + hex(address_of(range)) + " is not a reserved range base");
  if (it->second.bytes != bytes) {
    return invalid("vm_release: range " + hex(it->first) + " was reserved with " + std::to_string(it->second.bytes) +
                   " bytes, released with " + std::to_string(bytes));
  }
  if (!it->second.mappings.empty()) {
    return invalid("vm_release: range " + hex(it->first) + " still has " +
                   std::to_string(it->second.mappings.size()) + " mapping(s)");
  }
  drop_touches_locked(it->first, it->first + bytes);
  ranges_.erase(it);
  return status::success();
}

status sim_backend::vm_create(std::size_t bytes, physical_handle* out) {
  if (!config_.virtual_memory) return unsupported();
  run_allocation_hook();
  std::lock_guard<std::mutex> lock(mutex_);
  if (status s = check_fault_locked(sim_fault_point::vm_create); !s) return s;
  if (out == nullptr) return invalid("vm_create: out is null");
  if (bytes == 0 || bytes % config_.vm_granularity_bytes != 0) {
    return invalid("vm_create: " + std::to_string(bytes) + " bytes is not a positive multiple of the granularity " +
                   std::to_string(config_.vm_granularity_bytes));
  }
  if (!fits_locked(bytes)) {
    return {status_code::out_of_memory, "sim_backend: cannot create a physical chunk of " + format_bytes(bytes) + ": " +
                                            format_bytes(headroom(config_.capacity_bytes, used_bytes_)) + " free of " +
                                            format_bytes(config_.capacity_bytes)};
  }
  const physical_handle chunk = next_chunk_++;
  chunks_[chunk].bytes = bytes;
  used_bytes_ += bytes;
  *out = chunk;
  return status::success();
}

status sim_backend::vm_destroy(physical_handle chunk) {
  if (!config_.virtual_memory) return unsupported();
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = chunks_.find(chunk);
  if (it == chunks_.end()) return invalid("vm_destroy: unknown chunk " + hex(chunk));
  if (it->second.mapped_at != 0) {
    return invalid("vm_destroy: chunk " + hex(chunk) + " is still mapped at " + hex(it->second.mapped_at));
  }
  used_bytes_ -= it->second.bytes;
  chunks_.erase(it);
  return status::success();
}

status sim_backend::vm_map(void* address, std::size_t bytes, physical_handle chunk) {
  if (!config_.virtual_memory) return unsupported();
  std::lock_guard<std::mutex> lock(mutex_);
  if (status s = check_fault_locked(sim_fault_point::vm_map); !s) return s;
  const std::uintptr_t at = address_of(address);
  if (at % config_.vm_granularity_bytes != 0) return invalid("vm_map: " + hex(at) + " is not granularity-aligned");
  const auto range = range_containing(ranges_, at);
  if (range == ranges_.end()) return invalid("vm_map: " + hex(at) + " is not inside a reserved range");
  const auto c = chunks_.find(chunk);
  if (c == chunks_.end()) return invalid("vm_map: unknown chunk " + hex(chunk));
  if (c->second.bytes != bytes) {
    return invalid("vm_map: chunk " + hex(chunk) + " has " + std::to_string(c->second.bytes) + " bytes, mapping asks " +
                   std::to_string(bytes));
  }
  if (c->second.mapped_at != 0) return invalid("vm_map: chunk " + hex(chunk) + " is already mapped");
  if (bytes > range->second.bytes - (at - range->first)) {
    return invalid("vm_map: [" + hex(at) + ", +" + std::to_string(bytes) + ") runs past its reserved range");
  }
  auto& mappings = range->second.mappings;
  const auto next = mappings.lower_bound(at);
  if (next != mappings.end() && next->first - at < bytes) {
    return invalid("vm_map: " + hex(at) + " overlaps the mapping at " + hex(next->first));
  }
  if (next != mappings.begin()) {
    const auto previous = std::prev(next);
    if (previous->first + chunks_.at(previous->second).bytes > at) {
      return invalid("vm_map: " + hex(at) + " overlaps the mapping at " + hex(previous->first));
    }
  }
  mappings.emplace(at, chunk);
  c->second.mapped_at = at;
  ++counters_.vm_maps;
  return status::success();
}

status sim_backend::vm_unmap(void* address, std::size_t bytes) {
  if (!config_.virtual_memory) return unsupported();
  std::lock_guard<std::mutex> lock(mutex_);
  if (status s = check_fault_locked(sim_fault_point::vm_unmap); !s) return s;
  const std::uintptr_t at = address_of(address);
  const auto range = range_containing(ranges_, at);
  if (range == ranges_.end()) return invalid("vm_unmap: " + hex(at) + " is not inside a reserved range");
  auto& mappings = range->second.mappings;
  const auto mapping = mappings.find(at);
  if (mapping == mappings.end()) return invalid("vm_unmap: nothing is mapped at " + hex(at));
  chunk_state& c = chunks_.at(mapping->second);
  if (c.bytes != bytes) {
    return invalid("vm_unmap: the mapping at " + hex(at) + " has " + std::to_string(c.bytes) + " bytes, unmap asks " +
                   std::to_string(bytes));
  }
  const auto in_use = live_touch_locked(at, at + bytes);
  if (in_use != touches_.end()) {
    ++counters_.unsafe_unmaps;
    return {status_code::device_error, "sim_backend: vm_unmap: [" + hex(at) + ", +" + std::to_string(bytes) +
                                           ") may still be in use by stream " + std::to_string(in_use->second.stream) +
                                           " (touched, no completed event recorded since)"};
  }
  c.mapped_at = 0;
  c.peers.clear();
  mappings.erase(mapping);
  ++counters_.vm_unmaps;
  return status::success();
}

status sim_backend::vm_allow_peer(void* address, std::size_t bytes, int peer_device) {
  if (!config_.virtual_memory) return unsupported();
  std::lock_guard<std::mutex> lock(mutex_);
  if (status s = check_fault_locked(sim_fault_point::vm_allow_peer); !s) return s;
  const std::uintptr_t at = address_of(address);
  if (peer_device < 0 || peer_device == config_.device_index) {
    return invalid("vm_allow_peer: device " + std::to_string(peer_device) + " is not a peer of device " +
                   std::to_string(config_.device_index));
  }
  const auto range = range_containing(ranges_, at);
  if (range == ranges_.end()) return invalid("vm_allow_peer: " + hex(at) + " is not inside a reserved range");
  const auto mapping = range->second.mappings.find(at);
  if (mapping == range->second.mappings.end()) return invalid("vm_allow_peer: nothing is mapped at " + hex(at));
  chunk_state& c = chunks_.at(mapping->second);
  if (c.bytes != bytes) {
    return invalid("vm_allow_peer: the mapping at " + hex(at) + " has " + std::to_string(c.bytes) + " bytes, not " +
                   std::to_string(bytes));
  }
  if (std::find(c.peers.begin(), c.peers.end(), peer_device) == c.peers.end()) c.peers.push_back(peer_device);
  return status::success();
}

// --- graph capture queries and their model ---

status sim_backend::capture_frontier(stream_handle stream, bool* capturing, std::vector<graph_node_handle>* frontier) {
  if (capturing == nullptr || frontier == nullptr) return {status_code::invalid_argument, "capture_frontier needs outputs"};
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = capture_frontiers_.find(stream);
  *capturing = it != capture_frontiers_.end();
  frontier->clear();
  if (*capturing) *frontier = it->second;
  return status::success();
}

status sim_backend::capture_dependencies(graph_node_handle node, std::vector<graph_node_handle>* out) {
  if (out == nullptr) return {status_code::invalid_argument, "capture_dependencies needs an output"};
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = capture_nodes_.find(node);
  if (it == capture_nodes_.end()) return {status_code::invalid_argument, "capture_dependencies: unknown node"};
  *out = it->second;
  return status::success();
}

void sim_backend::capture_begin(stream_handle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  capture_frontiers_[stream].clear();
}

graph_node_handle sim_backend::capture_work(stream_handle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = capture_frontiers_.find(stream);
  if (it == capture_frontiers_.end()) throw std::invalid_argument("capture_work: the stream is not capturing");
  const graph_node_handle node = next_node_++;
  capture_nodes_[node] = it->second;
  it->second = {node};
  return node;
}

void sim_backend::capture_wait(stream_handle waiter, stream_handle signaler) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto from = capture_frontiers_.find(signaler);
  if (from == capture_frontiers_.end()) throw std::invalid_argument("capture_wait: the signaling stream is not capturing");
  const std::vector<graph_node_handle> added = from->second;
  std::vector<graph_node_handle>& frontier = capture_frontiers_[waiter];
  for (graph_node_handle node : added) {
    if (std::find(frontier.begin(), frontier.end(), node) == frontier.end()) frontier.push_back(node);
  }
}

void sim_backend::capture_end() {
  std::lock_guard<std::mutex> lock(mutex_);
  capture_frontiers_.clear();
  capture_nodes_.clear();
}

// --- test controls ---

stream_handle sim_backend::new_stream() {
  std::lock_guard<std::mutex> lock(mutex_);
  return next_stream_++;
}

void sim_backend::fail_nth(sim_fault_point point, std::size_t nth, status_code code) {
  // `ok` is no failure; accepting it would make a call report success while
  // doing nothing.
  if (!valid_point(point) || code == status_code::ok) return;
  std::lock_guard<std::mutex> lock(mutex_);
  fault_rule& rule = faults_[static_cast<int>(point)];
  rule.countdown = nth;
  rule.nth_code = code;
}

void sim_backend::fail_always(sim_fault_point point, status_code code) {
  if (!valid_point(point) || code == status_code::ok) return;
  std::lock_guard<std::mutex> lock(mutex_);
  fault_rule& rule = faults_[static_cast<int>(point)];
  rule.always = true;
  rule.always_code = code;
}

void sim_backend::clear_faults() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (fault_rule& rule : faults_) rule = fault_rule{};
}

std::vector<event_handle> sim_backend::pending_events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<std::uint64_t, event_handle>> pending;
  for (const auto& entry : events_) {
    if (entry.second.pending) pending.emplace_back(entry.second.record_sequence, entry.first);
  }
  std::sort(pending.begin(), pending.end());
  std::vector<event_handle> result;
  result.reserve(pending.size());
  for (const auto& p : pending) result.push_back(p.second);
  return result;
}

void sim_backend::complete_event(event_handle event) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = events_.find(event);
  if (it != events_.end()) complete_locked(it->second);
}

void sim_backend::complete_all_events() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& entry : events_) complete_locked(entry.second);
}

void sim_backend::complete_stream(stream_handle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& entry : events_) {
    if (entry.second.stream == stream) complete_locked(entry.second);
  }
}

bool sim_backend::stream_waited_on(stream_handle stream, event_handle event) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return waits_.count({stream, event}) != 0;
}

stream_handle sim_backend::last_wait_source() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_wait_source_;
}

void sim_backend::set_capacity(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  config_.capacity_bytes = bytes;
}

void sim_backend::set_device_processes(std::vector<device_process> processes) {
  std::lock_guard<std::mutex> lock(mutex_);
  processes_ = std::move(processes);
}

void sim_backend::touch(stream_handle stream, const void* ptr, std::size_t bytes) {
  const std::uintptr_t at = address_of(ptr);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!known_stream_locked(stream)) throw std::invalid_argument("sim_backend: touch: unknown stream " + hex(stream));
  if (bytes == 0) return;
  // Work on memory the device never handed out would fault on its own; a
  // touch of it is a test bug that would otherwise block nothing, silently.
  if (!known_memory_locked(at, bytes)) {
    throw std::invalid_argument("sim_backend: touch: [" + hex(at) + ", +" + std::to_string(bytes) +
                                ") is not inside one live segment or reserved range");
  }
  touches_.emplace(at, touch_state{at + bytes, stream, next_record_sequence_});
  longest_touch_bytes_ = std::max(longest_touch_bytes_, bytes);
  // Amortized: a full pass only after the count has doubled since the last.
  if (touches_.size() > std::max(2 * touches_after_prune_, k_touch_prune_floor)) prune_touches_locked();
}

// --- accounting ---

std::size_t sim_backend::capacity_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return config_.capacity_bytes;
}

std::size_t sim_backend::used_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return used_bytes_;
}

std::size_t sim_backend::live_segments() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return segments_.size();
}

std::size_t sim_backend::live_events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_.size();
}

std::size_t sim_backend::live_ranges() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ranges_.size();
}

std::size_t sim_backend::reserved_address_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t bytes = 0;
  for (const auto& [base, range] : ranges_) bytes += range.bytes;
  return bytes;
}

std::size_t sim_backend::live_chunks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return chunks_.size();
}

std::size_t sim_backend::live_touches() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<std::size_t>(std::count_if(touches_.begin(), touches_.end(),
                                                [this](const auto& entry) { return !retired_locked(entry.second); }));
}

std::size_t sim_backend::mapped_chunks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<std::size_t>(
      std::count_if(chunks_.begin(), chunks_.end(), [](const auto& entry) { return entry.second.mapped_at != 0; }));
}

sim_counters sim_backend::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counters_;
}

bool sim_backend::is_device_memory(const void* ptr, std::size_t bytes) const {
  const std::uintptr_t at = address_of(ptr);
  // An empty span asks about the one address it starts at.
  const std::size_t span = bytes == 0 ? 1 : bytes;
  if (at == 0 || at > std::numeric_limits<std::uintptr_t>::max() - span) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  return in_segment_locked(at, span) || mapped_locked(at, span);
}

bool sim_backend::peer_allowed(const void* ptr, int peer_device) const {
  const std::uintptr_t at = address_of(ptr);
  std::lock_guard<std::mutex> lock(mutex_);
  const auto range = range_containing(ranges_, at);
  if (range == ranges_.end()) return false;
  const auto& mappings = range->second.mappings;
  auto mapping = mappings.upper_bound(at);
  if (mapping == mappings.begin()) return false;
  --mapping;
  const chunk_state& c = chunks_.at(mapping->second);
  if (at - mapping->first >= c.bytes) return false;
  return std::find(c.peers.begin(), c.peers.end(), peer_device) != c.peers.end();
}

}  // namespace streamalloc
