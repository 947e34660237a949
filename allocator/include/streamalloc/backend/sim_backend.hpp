// sim_backend: a CPU-only simulated device. Fake but unique addresses,
// capacity and physical-page accounting, optional virtual memory, events
// whose completion the test controls, work that may still be running, and
// fault injection. All allocator policy is tested against it without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
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
  vm_allow_peer,
};
constexpr int k_sim_fault_point_count = 13;

struct sim_config {
  int device_index = 0;  // 0..126: each index gets its own 64 TiB of addresses
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
  // vm_unmap calls refused because touched memory may still be in use: each
  // one is a fault a real GPU would have taken.
  std::size_t unsafe_unmaps = 0;
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
  // What set_device_processes gave; not_supported until it is called.
  status device_processes(std::vector<device_process>* out) override;
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
  // Fails with device_error, mapping kept, while an unretired touch
  // overlaps the mapping (see touch()).
  status vm_unmap(void* address, std::size_t bytes) override;
  status vm_allow_peer(void* address, std::size_t bytes, int peer_device) override;
  // The graph model below.
  status capture_frontier(stream_handle stream, bool* capturing, std::vector<graph_node_handle>* frontier) override;
  status capture_dependencies(graph_node_handle node, std::vector<graph_node_handle>* out) override;

  // --- graph capture model: the nodes and edges CUDA would record ---
  // `stream` starts capturing with an empty frontier.
  void capture_begin(stream_handle stream);
  // A kernel captured on `stream`: a node depending on its frontier, which
  // becomes that node alone. Throws std::invalid_argument if not capturing.
  graph_node_handle capture_work(stream_handle stream);
  // `waiter` waits on an event recorded on the capturing `signaler`: it joins
  // the capture if it was not in it, and its frontier gains `signaler`'s.
  void capture_wait(stream_handle waiter, stream_handle signaler);
  // Every stream stops capturing.
  void capture_end();

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
  // Runs `hook` once, at the start of the next allocate_segment or
  // vm_create and outside the sim's lock: the allocator that called holds
  // its own lock meanwhile, so a test can stage calls of other threads that
  // find it taken.
  void on_next_memory_allocation(std::function<void()> hook);
  // Events recorded but not yet completed, oldest record first.
  std::vector<event_handle> pending_events() const;
  void complete_event(event_handle event);
  void complete_all_events();
  // Completes every pending record made on `stream`.
  void complete_stream(stream_handle stream);
  // Whether `stream` was made to wait on a record of `event` that was still
  // pending at the time of the wait (proves a cross-stream hand-off).
  bool stream_waited_on(stream_handle stream, event_handle event) const;
  // The stream whose record the latest stream_wait_event waited on (0:
  // none yet): the lender of a cross-stream hand-off.
  stream_handle last_wait_source() const;
  // Shrinks or grows the device (models other processes taking memory).
  void set_capacity(std::size_t bytes);
  // The processes device_processes reports from now on.
  void set_device_processes(std::vector<device_process> processes);
  // Work queued on `stream` reads or writes [ptr, ptr+bytes) and may still be
  // running. It retires once an event recorded on `stream` after the touch
  // completes (complete_event, complete_stream, complete_all_events,
  // synchronize_event, or at once with events_complete_immediately), on
  // synchronize_device, or when its segment is freed or its range released;
  // until then vm_unmap of memory it overlaps fails, as a GPU would fault.
  // A completed record also vouches for every record its stream waited on
  // before it (stream_wait_event), as device ordering does, so a block
  // handed to another stream is safe once that stream syncs. complete_stream
  // alone does not retire a touch made after the stream's last record:
  // nothing on the host could have observed that work finish.
  // Throws std::invalid_argument for an unknown stream or a span that is not
  // inside one live segment or reserved range.
  void touch(stream_handle stream, const void* ptr, std::size_t bytes);

  // --- accounting ---
  std::size_t capacity_bytes() const;
  std::size_t used_bytes() const;  // segments + physical chunks
  std::size_t live_segments() const;
  std::size_t live_events() const;
  std::size_t live_ranges() const;
  std::size_t reserved_address_bytes() const;  // of the live ranges
  std::size_t live_chunks() const;
  std::size_t mapped_chunks() const;
  std::size_t live_touches() const;  // touches not yet retired
  sim_counters counters() const;
  // Whether `peer_device` was allowed (vm_allow_peer) into the mapping that
  // holds `ptr`; false when nothing is mapped there.
  bool peer_allowed(const void* ptr, int peer_device) const;
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
    std::vector<int> peers;        // devices allowed into the current mapping
  };
  struct range_state {
    std::size_t bytes = 0;
    std::map<std::uintptr_t, physical_handle> mappings;  // offset address -> chunk
  };
  // `waiter` waited (stream_wait_event) on a pending record: once work on
  // `waiter` at or after `position` is done, so is that record.
  struct wait_edge {
    std::uint64_t position = 0;
    stream_handle waited_stream = 0;
    std::uint64_t waited_sequence = 0;
  };
  struct touch_state {
    std::uintptr_t end = 0;
    stream_handle stream = 0;
    // The record sequence current at touch time: records at or after it on
    // `stream` follow the touched work in stream order.
    std::uint64_t sequence = 0;
  };

  using range_map = std::map<std::uintptr_t, range_state>;
  using touch_map = std::multimap<std::uintptr_t, touch_state>;  // start -> touch

  status check_fault_locked(sim_fault_point point);
  // Runs and clears the on_next_memory_allocation hook, if any.
  void run_allocation_hook();
  // A fresh aligned base for `bytes`, followed by an unused gap; 0 when the
  // simulated address space is exhausted.
  std::uintptr_t take_address_locked(std::size_t bytes);
  bool fits_locked(std::size_t bytes) const;
  bool known_stream_locked(stream_handle stream) const;
  // Whether [address, address+bytes) is covered by contiguous mappings.
  bool mapped_locked(std::uintptr_t address, std::size_t bytes) const;
  // Whether [address, address+bytes) lies inside one live segment.
  bool in_segment_locked(std::uintptr_t address, std::size_t bytes) const;
  // Whether it lies inside one live segment or one reserved range, mapped or not.
  bool known_memory_locked(std::uintptr_t address, std::size_t bytes) const;
  // Marks a pending record complete; work before it on its stream is done.
  void complete_locked(event_state& event);
  // Work on `stream` through record `sequence` is done, and with it every
  // record that work waited on, transitively.
  void advance_locked(stream_handle stream, std::uint64_t sequence);
  bool retired_locked(const touch_state& touch) const;
  // The lowest unretired touch overlapping [begin, end), or end(); retired
  // touches met on the way are dropped.
  touch_map::iterator live_touch_locked(std::uintptr_t begin, std::uintptr_t end);
  // Drops every touch that starts in [begin, end).
  void drop_touches_locked(std::uintptr_t begin, std::uintptr_t end);
  void prune_touches_locked();

  sim_config config_;
  mutable std::mutex mutex_;
  std::function<void()> next_allocation_hook_;  // guarded by mutex_
  std::size_t address_alignment_;  // of every segment and range base
  std::uintptr_t next_address_;
  std::uintptr_t address_end_;  // of this device's span
  stream_handle next_stream_ = 1;
  event_handle next_event_ = 1;
  physical_handle next_chunk_ = 1;
  std::uint64_t next_record_sequence_ = 1;
  std::size_t used_bytes_ = 0;
  std::optional<std::vector<device_process>> processes_;  // none until set_device_processes
  std::map<std::uintptr_t, std::size_t> segments_;  // base -> bytes
  std::unordered_map<event_handle, event_state> events_;
  std::map<stream_handle, std::vector<graph_node_handle>> capture_frontiers_;  // capturing streams
  std::unordered_map<graph_node_handle, std::vector<graph_node_handle>> capture_nodes_;  // node -> dependencies
  graph_node_handle next_node_ = 1;
  range_map ranges_;  // base -> range
  std::unordered_map<physical_handle, chunk_state> chunks_;
  std::set<std::pair<stream_handle, event_handle>> waits_;
  stream_handle last_wait_source_ = 0;
  // Per stream, the newest record sequence known complete. Streams run in
  // order, so every touch on the stream at or before it is retired.
  std::unordered_map<stream_handle, std::uint64_t> completed_through_;
  // Per waiting stream, its waits on pending records not yet known done,
  // oldest first.
  std::unordered_map<stream_handle, std::deque<wait_edge>> open_waits_;
  touch_map touches_;
  // Bounds how far before an unmapped address an overlapping touch can start.
  std::size_t longest_touch_bytes_ = 0;
  std::size_t touches_after_prune_ = 0;  // pruning waits until the count doubles
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
