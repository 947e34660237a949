// sim_backend: a CPU-only simulated device. Fake but unique addresses,
// capacity and physical-page accounting, optional virtual memory, events
// whose completion the test controls, and fault injection. All allocator
// policy is tested against it on machines without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <vector>

#include "streamalloc/backend/device_backend.hpp"
#include "streamalloc/util/bytes.hpp"

namespace streamalloc {

// Operations where a fault can be injected.
enum class sim_fault_point {
  allocate_segment,
  free_segment,
  create_event,
  record_event,
  query_event,
  synchronize_event,
  stream_wait_event,
  synchronize_device,
  vm_reserve,
  vm_create,
  vm_map,
  vm_unmap,
};
constexpr int k_sim_fault_point_count = 12;

struct sim_config {
  int device_index = 0;
  std::size_t capacity_bytes = 80_GiB;
  bool events_complete_immediately = true;  // false: the test completes them
  bool virtual_memory = true;
  std::size_t vm_granularity_bytes = 2_MiB;
};

// Counters a test can read to prove what the allocator did to the device.
struct sim_counters {
  std::size_t segment_allocs = 0;
  std::size_t segment_frees = 0;
  std::size_t events_created = 0;
  std::size_t events_destroyed = 0;
  std::size_t event_records = 0;
  std::size_t event_queries = 0;
  std::size_t event_syncs = 0;
  std::size_t stream_waits = 0;
  std::size_t device_syncs = 0;
  std::size_t vm_maps = 0;
  std::size_t vm_unmaps = 0;
};

class sim_backend final : public device_backend {
 public:
  explicit sim_backend(sim_config config = {});
  ~sim_backend() override;

  // --- device_backend ---
  int device_index() const override { return config_.device_index; }
  status allocate_segment(std::size_t bytes, void** out) override;
  status free_segment(void* ptr, std::size_t bytes) override;
  status memory_info(device_memory_info* out) override;
  status create_event(event_handle* out) override;
  status destroy_event(event_handle event) override;
  status record_event(event_handle event, stream_handle stream) override;
  status query_event(event_handle event, bool* done) override;
  status synchronize_event(event_handle event) override;
  status stream_wait_event(stream_handle stream, event_handle event) override;
  status synchronize_device() override;  // completes every pending event
  bool supports_virtual_memory() const override { return config_.virtual_memory; }
  std::size_t vm_granularity() const override { return config_.vm_granularity_bytes; }
  status vm_reserve(std::size_t bytes, void** out_range) override;
  status vm_release(void* range, std::size_t bytes) override;
  status vm_create(std::size_t bytes, physical_handle* out) override;
  status vm_destroy(physical_handle chunk) override;
  status vm_map(void* address, std::size_t bytes, physical_handle chunk) override;
  status vm_unmap(void* address, std::size_t bytes) override;

  // --- test controls ---
  // A fresh stream handle (never 0, never reused).
  stream_handle new_stream();
  // Makes the `nth` future call (1 = the next one) at `point` fail; replaces
  // an earlier one-shot rule there (nth = 0 cancels it). Every call at the
  // point counts, including ones that would fail validation.
  void fail_nth(sim_fault_point point, std::size_t nth, status_code code = status_code::out_of_memory);
  // Makes every future call at `point` fail until clear_faults().
  void fail_always(sim_fault_point point, status_code code = status_code::out_of_memory);
  void clear_faults();
  // Events recorded but not yet completed, oldest record first.
  std::vector<event_handle> pending_events() const;
  void complete_event(event_handle event);
  void complete_all_events();
  // Completes every pending record made on `stream`.
  void complete_stream(stream_handle stream);
  // Whether `stream` was made to wait on a record of `event` that was still
  // pending at the time of the wait (proves a cross-stream hand-off).
  bool stream_waited_on(stream_handle stream, event_handle event) const;
  // Shrinks or grows the device (models other processes taking memory).
  void set_capacity(std::size_t bytes);

  // --- accounting ---
  std::size_t capacity_bytes() const;
  std::size_t used_bytes() const;  // segments + physical chunks
  std::size_t live_segments() const;
  std::size_t live_events() const;
  std::size_t live_ranges() const;
  std::size_t live_chunks() const;
  std::size_t mapped_chunks() const;
  sim_counters counters() const;
  // Whether [ptr, ptr+bytes) lies inside a live segment or a mapped range.
  bool is_device_memory(const void* ptr, std::size_t bytes) const;

 private:
  struct event_state {
    bool pending = false;  // recorded and not yet completed
    stream_handle stream = 0;
    std::uint64_t record_sequence = 0;
  };
  struct chunk_state {
    std::size_t bytes = 0;
    std::uintptr_t mapped_at = 0;  // 0 when unmapped
  };
  struct range_state {
    std::size_t bytes = 0;
    std::map<std::uintptr_t, physical_handle> mappings;  // offset address -> chunk
  };

  using range_map = std::map<std::uintptr_t, range_state>;

  status check_fault_locked(sim_fault_point point);
  // A fresh aligned base for `bytes`, followed by an unused gap; 0 when the
  // simulated address space is exhausted.
  std::uintptr_t take_address_locked(std::size_t bytes);
  bool fits_locked(std::size_t bytes) const;
  bool known_stream_locked(stream_handle stream) const;
  // Whether [address, address+bytes) is covered by contiguous mappings.
  bool mapped_locked(std::uintptr_t address, std::size_t bytes) const;

  sim_config config_;
  mutable std::mutex mutex_;
  std::size_t address_alignment_;  // of every segment and range base
  std::uintptr_t next_address_;
  stream_handle next_stream_ = 1;
  event_handle next_event_ = 1;
  physical_handle next_chunk_ = 1;
  std::uint64_t next_record_sequence_ = 1;
  std::size_t used_bytes_ = 0;
  std::map<std::uintptr_t, std::size_t> segments_;  // base -> bytes
  std::unordered_map<event_handle, event_state> events_;
  range_map ranges_;  // base -> range
  std::unordered_map<physical_handle, chunk_state> chunks_;
  std::set<std::pair<stream_handle, event_handle>> waits_;
  struct fault_rule {
    std::size_t countdown = 0;  // fail when it reaches 1; 0 = no one-shot rule
    status_code nth_code = status_code::out_of_memory;
    bool always = false;
    status_code always_code = status_code::out_of_memory;
  };
  fault_rule faults_[k_sim_fault_point_count];
  sim_counters counters_;
};

}  // namespace streamalloc
