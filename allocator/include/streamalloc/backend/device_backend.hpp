// The device-backend interface: everything the allocator core asks of a
// device. Implementations: sim_backend (CPU model, tests), cuda_backend
// (cudaMalloc + events), vmm_backend (driver virtual-memory API).
// Streams, events and physical chunks cross this interface as opaque
// integer handles so the core never sees a CUDA type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "streamalloc/util/device_process.hpp"
#include "streamalloc/util/status.hpp"

namespace streamalloc {

using stream_handle = std::uintptr_t;  // 0 is the device's default stream
using event_handle = std::uintptr_t;
using physical_handle = std::uint64_t;
using graph_node_handle = std::uintptr_t;  // a node of a graph being captured

struct device_memory_info {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

class device_backend {
 public:
  virtual ~device_backend() = default;

  virtual int device_index() const = 0;

  // --- Segments: one contiguous device allocation each ---
  virtual status allocate_segment(std::size_t bytes, void** out) = 0;
  virtual status free_segment(void* ptr, std::size_t bytes) = 0;
  virtual status memory_info(device_memory_info* out) = 0;
  // Optional: the processes holding memory on the device, in the driver's
  // order, for torch's out-of-memory message (Note [torch's OOM message]).
  virtual status device_processes(std::vector<device_process>* out) {
    (void)out;
    return {status_code::not_supported, "this backend cannot list the device's processes"};
  }

  // --- Events: created once and reused by the core's event pool ---
  virtual status create_event(event_handle* out) = 0;
  virtual status destroy_event(event_handle event) = 0;
  virtual status record_event(event_handle event, stream_handle stream) = 0;
  // Sets *done to whether all work captured by the last record has finished.
  virtual status query_event(event_handle event, bool* done) = 0;
  virtual status synchronize_event(event_handle event) = 0;
  // Makes future work on `stream` wait for `event` without blocking the host.
  virtual status stream_wait_event(stream_handle stream, event_handle event) = 0;
  // Blocks the host until all work on the device has finished.
  virtual status synchronize_device() = 0;

  // --- Optional: the graph a stream is capturing (Note [capture reuse]) ---
  // Sets *capturing to whether `stream` is capturing a CUDA graph and, if
  // so, *frontier to the nodes the next work captured on it will depend on.
  virtual status capture_frontier(stream_handle stream, bool* capturing, std::vector<graph_node_handle>* frontier) {
    (void)stream, (void)capturing, (void)frontier;
    return unsupported_capture();
  }
  // Sets *out to the nodes `node` depends on directly.
  virtual status capture_dependencies(graph_node_handle node, std::vector<graph_node_handle>* out) {
    (void)node, (void)out;
    return unsupported_capture();
  }

  // --- Optional virtual memory (see supports_virtual_memory) ---
  virtual bool supports_virtual_memory() const { return false; }
  // Size and alignment unit of physical chunks and mappings.
  virtual std::size_t vm_granularity() const { return 0; }
  virtual status vm_reserve(std::size_t bytes, void** out_range) {
    (void)bytes, (void)out_range;
    return unsupported();
  }
  virtual status vm_release(void* range, std::size_t bytes) {
    (void)range, (void)bytes;
    return unsupported();
  }
  virtual status vm_create(std::size_t bytes, physical_handle* out) {
    (void)bytes, (void)out;
    return unsupported();
  }
  virtual status vm_destroy(physical_handle chunk) {
    (void)chunk;
    return unsupported();
  }
  // Maps `chunk` (of exactly `bytes`) at `address` and makes it read/write.
  virtual status vm_map(void* address, std::size_t bytes, physical_handle chunk) {
    (void)address, (void)bytes, (void)chunk;
    return unsupported();
  }
  virtual status vm_unmap(void* address, std::size_t bytes) {
    (void)address, (void)bytes;
    return unsupported();
  }
  // Lets `peer_device` read and write the mapping of exactly `bytes` at
  // `address` too (vm_map grants only this backend's own device); the grant
  // ends with the mapping.
  virtual status vm_allow_peer(void* address, std::size_t bytes, int peer_device) {
    (void)address, (void)bytes, (void)peer_device;
    return unsupported();
  }
  // A POSIX file descriptor another process can import `chunk` from (CUDA
  // IPC of expandable segments). The descriptor stays open, owned by the
  // backend, until the chunk is destroyed, so a receiver can still duplicate
  // it after the sender has serialized it.
  virtual status vm_export(physical_handle chunk, int* out_fd) {
    (void)chunk, (void)out_fd;
    return unsupported();
  }

 protected:
  static status unsupported() { return {status_code::not_supported, "virtual memory is not supported by this backend"}; }
  static status unsupported_capture() {
    return {status_code::not_supported, "graph capture queries are not supported by this backend"};
  }
};

}  // namespace streamalloc
