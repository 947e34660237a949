// sim_host_backend: the host-side model the pinned pool and the staged copy
// engine are tested on. Memory is real; copies and records wait in per-stream
// queues until the test (or immediate mode) runs them, in stream order.
#include "streamalloc/streams/sim_host_backend.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <string>
#include <utility>

#include "streamalloc/streams/host_memory.hpp"

namespace streamalloc {
namespace {

static_assert(static_cast<int>(sim_host_fault_point::synchronize_device) + 1 == k_sim_host_fault_point_count,
              "k_sim_host_fault_point_count must match sim_host_fault_point");

// Event handles start far from 0 so a pointer or small integer passed by
// mistake is rejected.
constexpr event_handle k_first_event = (event_handle{1} << 44) + 1;
constexpr std::size_t k_host_alloc_alignment_bytes = 4096;

const char* point_name(sim_host_fault_point point) {
  switch (point) {
    case sim_host_fault_point::allocate_pinned:
      return "allocate_pinned";
    case sim_host_fault_point::release_pinned:
      return "release_pinned";
    case sim_host_fault_point::create_event:
      return "create_event";
    case sim_host_fault_point::record_event:
      return "record_event";
    case sim_host_fault_point::query_event:
      return "query_event";
    case sim_host_fault_point::synchronize_event:
      return "synchronize_event";
    case sim_host_fault_point::copy_to_device:
      return "copy_to_device";
    case sim_host_fault_point::synchronize_device:
      return "synchronize_device";
  }
  return "unknown fault point";
}

status invalid(std::string message) {
  return {status_code::invalid_argument, "sim_host_backend: " + std::move(message)};
}

std::uintptr_t address_of(const void* p) { return reinterpret_cast<std::uintptr_t>(p); }

}  // namespace

sim_host_backend::sim_host_backend(sim_host_config config) : config_(config), next_event_(k_first_event) {}

sim_host_backend::~sim_host_backend() {
  for (const auto& [base, range] : pinned_) {
    void* ptr = reinterpret_cast<void*>(base);
    if (range.method == pin_method::host_alloc) {
      std::free(ptr);
    } else {
      unmap_host_pages(ptr, range.bytes);
    }
  }
}

// --- helpers (mutex_ held) ---

status sim_host_backend::check_fault_locked(sim_host_fault_point point) {
  fault_rule& rule = faults_[static_cast<int>(point)];
  if (rule.countdown == 1) {
    rule.countdown = 0;
    return {rule.nth_code, std::string("sim_host_backend: injected fault at ") + point_name(point)};
  }
  if (rule.countdown > 1) --rule.countdown;
  if (rule.always) return {rule.always_code, std::string("sim_host_backend: injected fault at ") + point_name(point)};
  return status::success();
}

bool sim_host_backend::pinned_locked(const void* ptr, std::size_t bytes) const {
  const std::uintptr_t address = address_of(ptr);
  auto it = pinned_.upper_bound(address);
  if (it == pinned_.begin()) return false;
  --it;
  const std::uintptr_t offset = address - it->first;
  return offset <= it->second.bytes && bytes <= it->second.bytes - offset;
}

void sim_host_backend::run_operation_locked(const operation& op) {
  if (!op.is_record) {
    if (!pinned_locked(op.src, op.bytes)) {
      ++counters_.stale_copies;
      return;
    }
    std::memcpy(op.dst, op.src, op.bytes);
    counters_.copied_bytes += op.bytes;
    return;
  }
  auto it = events_.find(op.event);
  // A later record of the same event supersedes this one; only the last
  // record's completion is observable.
  if (it != events_.end() && it->second.record_sequence == op.record_sequence) it->second.pending = false;
}

void sim_host_backend::enqueue_locked(stream_handle stream, operation op) {
  std::deque<operation>& queue = queues_[stream];
  if (config_.complete_immediately && queue.empty()) {
    run_operation_locked(op);
    return;
  }
  queue.push_back(op);
}

void sim_host_backend::run_until_locked(stream_handle stream, event_handle event, std::uint64_t sequence) {
  auto found = queues_.find(stream);
  if (found == queues_.end()) return;
  std::deque<operation>& queue = found->second;
  while (!queue.empty()) {
    const operation op = queue.front();
    queue.pop_front();
    run_operation_locked(op);
    if (op.is_record && op.event == event && op.record_sequence == sequence) return;
  }
}

void sim_host_backend::run_stream_locked(stream_handle stream) {
  auto found = queues_.find(stream);
  if (found == queues_.end()) return;
  while (!found->second.empty()) {
    const operation op = found->second.front();
    found->second.pop_front();
    run_operation_locked(op);
  }
}

// --- host_backend ---

status sim_host_backend::allocate_pinned(std::size_t bytes, pin_method method, void** out) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (status st = check_fault_locked(sim_host_fault_point::allocate_pinned); !st) return st;
  if (bytes == 0) return invalid("allocate_pinned of zero bytes");
  void* ptr = nullptr;
  if (method == pin_method::host_alloc) {
    const std::size_t rounded =
        (bytes + k_host_alloc_alignment_bytes - 1) / k_host_alloc_alignment_bytes * k_host_alloc_alignment_bytes;
    ptr = std::aligned_alloc(k_host_alloc_alignment_bytes, rounded);
    if (ptr == nullptr) return {status_code::out_of_memory, "sim_host_backend: aligned_alloc failed"};
    ++counters_.host_allocs;
  } else {
    if (status st = map_host_pages(bytes, config_.touch_threads, &ptr); !st) return st;
    ++counters_.register_allocs;
  }
  pinned_[address_of(ptr)] = {bytes, method};
  pinned_bytes_ += bytes;
  *out = ptr;
  return status::success();
}

status sim_host_backend::release_pinned(void* ptr, std::size_t bytes, pin_method method) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (status st = check_fault_locked(sim_host_fault_point::release_pinned); !st) return st;
  auto it = pinned_.find(address_of(ptr));
  if (it == pinned_.end()) return invalid("release_pinned of an unknown pointer");
  if (it->second.bytes != bytes || it->second.method != method) {
    return invalid(std::string("release_pinned with ") + std::to_string(bytes) + " bytes / " + to_string(method) +
                   " of a range allocated with " + std::to_string(it->second.bytes) + " bytes / " +
                   to_string(it->second.method));
  }
  if (method == pin_method::host_alloc) {
    std::free(ptr);
  } else if (status st = unmap_host_pages(ptr, bytes); !st) {
    return st;
  }
  pinned_bytes_ -= bytes;
  pinned_.erase(it);
  ++counters_.releases;
  return status::success();
}

status sim_host_backend::create_event(int device, event_handle* out) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (status st = check_fault_locked(sim_host_fault_point::create_event); !st) return st;
  if (device < 0) return invalid("create_event on device " + std::to_string(device));
  const event_handle event = next_event_++;
  events_[event].device = device;
  ++counters_.events_created;
  *out = event;
  return status::success();
}

status sim_host_backend::destroy_event(event_handle event) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (events_.erase(event) == 0) return invalid("destroy_event of an unknown event");
  ++counters_.events_destroyed;
  return status::success();
}

status sim_host_backend::record_event(event_handle event, stream_handle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (status st = check_fault_locked(sim_host_fault_point::record_event); !st) return st;
  auto it = events_.find(event);
  if (it == events_.end()) return invalid("record_event of an unknown event");
  event_state& e = it->second;
  e.pending = true;
  e.stream = stream;
  e.record_sequence = next_sequence_++;
  ++counters_.event_records;
  operation op;
  op.is_record = true;
  op.event = event;
  op.record_sequence = e.record_sequence;
  enqueue_locked(stream, op);
  return status::success();
}

status sim_host_backend::query_event(event_handle event, bool* done) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (status st = check_fault_locked(sim_host_fault_point::query_event); !st) return st;
  auto it = events_.find(event);
  if (it == events_.end()) return invalid("query_event of an unknown event");
  ++counters_.event_queries;
  *done = !it->second.pending;
  return status::success();
}

status sim_host_backend::synchronize_event(event_handle event) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (status st = check_fault_locked(sim_host_fault_point::synchronize_event); !st) return st;
  auto it = events_.find(event);
  if (it == events_.end()) return invalid("synchronize_event of an unknown event");
  ++counters_.event_syncs;
  if (it->second.pending) run_until_locked(it->second.stream, event, it->second.record_sequence);
  return status::success();
}

status sim_host_backend::copy_to_device_async(void* device_dst, const void* pinned_src, std::size_t bytes,
                                              stream_handle stream, int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (status st = check_fault_locked(sim_host_fault_point::copy_to_device); !st) return st;
  if (device < 0) return invalid("copy_to_device_async to device " + std::to_string(device));
  if (bytes == 0) return status::success();
  if (device_dst == nullptr) return invalid("copy_to_device_async to a null destination");
  if (!pinned_locked(pinned_src, bytes)) return invalid("copy_to_device_async from memory that is not pinned");
  ++counters_.copies;
  operation op;
  op.dst = device_dst;
  op.src = pinned_src;
  op.bytes = bytes;
  enqueue_locked(stream, op);
  return status::success();
}

status sim_host_backend::synchronize_device(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (status st = check_fault_locked(sim_host_fault_point::synchronize_device); !st) return st;
  if (device < 0) return invalid("synchronize_device of device " + std::to_string(device));
  ++counters_.device_syncs;
  for (auto& [stream, queue] : queues_) run_stream_locked(stream);
  return status::success();
}

// --- test controls ---

std::vector<event_handle> sim_host_backend::pending_events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<std::uint64_t, event_handle>> ordered;
  for (const auto& [event, state] : events_) {
    if (state.pending) ordered.emplace_back(state.record_sequence, event);
  }
  std::sort(ordered.begin(), ordered.end());
  std::vector<event_handle> out;
  out.reserve(ordered.size());
  for (const auto& entry : ordered) out.push_back(entry.second);
  return out;
}

void sim_host_backend::complete_event(event_handle event) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = events_.find(event);
  if (it == events_.end() || !it->second.pending) return;
  run_until_locked(it->second.stream, event, it->second.record_sequence);
}

void sim_host_backend::complete_stream(stream_handle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  run_stream_locked(stream);
}

void sim_host_backend::complete_all() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [stream, queue] : queues_) run_stream_locked(stream);
}

std::size_t sim_host_backend::queued_operations(stream_handle stream) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = queues_.find(stream);
  return it == queues_.end() ? 0 : it->second.size();
}

void sim_host_backend::fail_nth(sim_host_fault_point point, std::size_t nth, status_code code) {
  std::lock_guard<std::mutex> lock(mutex_);
  fault_rule& rule = faults_[static_cast<int>(point)];
  rule.countdown = nth;
  rule.nth_code = code;
}

void sim_host_backend::fail_always(sim_host_fault_point point, status_code code) {
  std::lock_guard<std::mutex> lock(mutex_);
  fault_rule& rule = faults_[static_cast<int>(point)];
  rule.always = true;
  rule.always_code = code;
}

void sim_host_backend::clear_faults() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (fault_rule& rule : faults_) rule = fault_rule{};
}

// --- accounting ---

bool sim_host_backend::is_pinned(const void* ptr, std::size_t bytes) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pinned_locked(ptr, bytes);
}

std::size_t sim_host_backend::pinned_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pinned_bytes_;
}

std::size_t sim_host_backend::pinned_ranges() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return pinned_.size();
}

std::size_t sim_host_backend::live_events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_.size();
}

int sim_host_backend::event_device(event_handle event) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = events_.find(event);
  return it == events_.end() ? -1 : it->second.device;
}

sim_host_counters sim_host_backend::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counters_;
}

}  // namespace streamalloc
