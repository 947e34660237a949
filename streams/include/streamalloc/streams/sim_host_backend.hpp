// sim_host_backend: a CPU-only host backend for tests. "Pinned" memory is
// real memory (malloc'd or mapped) flagged as pinned so tests can read and
// write it; a "device" is any plain buffer. Copies and event records are
// queued per stream and run in stream order only when the test completes
// them (or at once, if configured), so a copy reads its source when it
// "runs": reusing a staging buffer before its copy's event completes shows
// up as wrong bytes at the destination. Faults can be injected.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "streamalloc/streams/host_backend.hpp"

namespace streamalloc {

enum class sim_host_fault_point {
  allocate_pinned,
  release_pinned,
  create_event,
  record_event,
  query_event,
  synchronize_event,
  copy_to_device,
  synchronize_device,
};
constexpr int k_sim_host_fault_point_count = 8;

struct sim_host_config {
  // true: every queued operation runs when it is enqueued.
  bool complete_immediately = false;
  // Touch parallelism for register_touched allocations.
  int touch_threads = 2;
};

struct sim_host_counters {
  std::size_t host_allocs = 0;      // allocate_pinned with pin_method::host_alloc
  std::size_t register_allocs = 0;  // allocate_pinned with pin_method::register_touched
  std::size_t releases = 0;
  std::size_t events_created = 0;
  std::size_t events_destroyed = 0;
  std::size_t event_records = 0;
  std::size_t event_queries = 0;
  std::size_t event_syncs = 0;
  std::size_t copies = 0;
  std::size_t copied_bytes = 0;  // by copies that have run
  // Copies that were due to run after their source range was released (a
  // caller bug: a real DMA would read freed memory). They are skipped.
  std::size_t stale_copies = 0;
  std::size_t device_syncs = 0;
};

class sim_host_backend final : public host_backend {
 public:
  explicit sim_host_backend(sim_host_config config = {});
  ~sim_host_backend() override;
  sim_host_backend(const sim_host_backend&) = delete;
  sim_host_backend& operator=(const sim_host_backend&) = delete;

  // --- host_backend ---
  status allocate_pinned(std::size_t bytes, pin_method method, void** out) override;
  status release_pinned(void* ptr, std::size_t bytes, pin_method method) override;
  status create_event(int device, event_handle* out) override;
  status destroy_event(event_handle event) override;
  status record_event(event_handle event, stream_handle stream) override;
  status query_event(event_handle event, bool* done) override;
  // Runs the event's stream up to its last record (the host "waits").
  status synchronize_event(event_handle event) override;
  // Rejects a source that is not inside one pinned range: a real async
  // copy from pageable memory would silently turn synchronous.
  status copy_to_device_async(void* device_dst, const void* pinned_src, std::size_t bytes, stream_handle stream,
                              int device) override;
  status synchronize_device(int device) override;  // runs every stream

  // --- test controls ---
  // Events whose last record has not run yet, oldest record first.
  std::vector<event_handle> pending_events() const;
  // Runs the event's stream up to and including its last record; a stream
  // runs in order, so earlier operations on it run too.
  void complete_event(event_handle event);
  void complete_stream(stream_handle stream);
  void complete_all();
  // Operations queued on `stream` and not yet run.
  std::size_t queued_operations(stream_handle stream) const;
  void fail_nth(sim_host_fault_point point, std::size_t nth, status_code code = status_code::out_of_memory);
  void fail_always(sim_host_fault_point point, status_code code = status_code::out_of_memory);
  void clear_faults();

  // --- accounting ---
  // Whether [ptr, ptr + bytes) lies inside one live pinned range.
  bool is_pinned(const void* ptr, std::size_t bytes) const;
  std::size_t pinned_bytes() const;
  std::size_t pinned_ranges() const;
  std::size_t live_events() const;
  int event_device(event_handle event) const;  // -1 for an unknown event
  sim_host_counters counters() const;

 private:
  struct pinned_range {
    std::size_t bytes = 0;
    pin_method method = pin_method::host_alloc;
  };
  struct event_state {
    int device = 0;
    bool pending = false;  // its last record has not run
    stream_handle stream = 0;
    std::uint64_t record_sequence = 0;  // of the last record; global, so it orders records
  };
  struct operation {
    bool is_record = false;
    event_handle event = 0;
    std::uint64_t record_sequence = 0;
    void* dst = nullptr;
    const void* src = nullptr;
    std::size_t bytes = 0;
  };
  struct fault_rule {
    std::size_t countdown = 0;
    status_code nth_code = status_code::out_of_memory;
    bool always = false;
    status_code always_code = status_code::out_of_memory;
  };

  status check_fault_locked(sim_host_fault_point point);
  void enqueue_locked(stream_handle stream, operation op);
  void run_operation_locked(const operation& op);
  // Runs `stream` until the record with `sequence` of `event` has run.
  void run_until_locked(stream_handle stream, event_handle event, std::uint64_t sequence);
  void run_stream_locked(stream_handle stream);
  bool pinned_locked(const void* ptr, std::size_t bytes) const;

  sim_host_config config_;
  mutable std::mutex mutex_;
  std::map<std::uintptr_t, pinned_range> pinned_;  // base -> range
  std::size_t pinned_bytes_ = 0;
  std::unordered_map<event_handle, event_state> events_;
  std::unordered_map<stream_handle, std::deque<operation>> queues_;
  event_handle next_event_;
  std::uint64_t next_sequence_ = 1;
  fault_rule faults_[k_sim_host_fault_point_count];
  sim_host_counters counters_;
};

}  // namespace streamalloc
