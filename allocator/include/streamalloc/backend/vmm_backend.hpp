// vmm_backend: cuda_backend plus the CUDA driver's virtual-memory API
// (cuMemAddressReserve / cuMemCreate / cuMemMap / cuMemSetAccess), so the
// allocator can grow a segment in place and move physical chunks between
// addresses. make_cuda_backend returns one where the driver supports it.
#pragma once

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "streamalloc/backend/cuda_backend.hpp"

namespace streamalloc {

// Driver functions are looked up at run time through the CUDA runtime
// (cudaGetDriverEntryPointByVersion), never linked: libstreamalloc.so must
// load on machines without a driver. Physical chunks travel as the driver's
// CUmemGenericAllocationHandle in a physical_handle. Sizes and addresses of
// every operation must be multiples of vm_granularity().
class vmm_backend final : public cuda_backend {
 public:
  bool supports_virtual_memory() const override { return true; }
  std::size_t vm_granularity() const override { return granularity_; }
  status vm_reserve(std::size_t bytes, void** out_range) override;
  status vm_release(void* range, std::size_t bytes) override;
  status vm_create(std::size_t bytes, physical_handle* out) override;
  status vm_destroy(physical_handle chunk) override;
  status vm_map(void* address, std::size_t bytes, physical_handle chunk) override;
  status vm_unmap(void* address, std::size_t bytes) override;
  status vm_allow_peer(void* address, std::size_t bytes, int peer_device) override;
  status vm_export(physical_handle chunk, int* out_fd) override;

 private:
  vmm_backend(int device, std::size_t granularity) : cuda_backend(device), granularity_(granularity) {}
  // A vmm_backend for `device` (an index make_cuda_backend has checked), or
  // nullptr when the driver lacks an entry point, the device does not
  // support virtual memory management, or its granularity cannot be read.
  static std::unique_ptr<device_backend> create(int device);
  friend std::unique_ptr<device_backend> make_cuda_backend(int device, status* error);

  status unsupported_export(const std::string& why) const;

  std::size_t granularity_;  // CU_MEM_ALLOC_GRANULARITY_MINIMUM of pinned device memory
  // Whether new chunks are created exportable (cleared once the driver
  // refuses exportable memory), and the descriptors exported so far.
  std::atomic<bool> exportable_{true};
  std::mutex exported_mutex_;
  std::unordered_map<physical_handle, int> exported_;
};

// Chunks another process exported (vm_export), imported and mapped
// read/write for `device` in a fresh address range of this process.
struct imported_chunks {
  int device = 0;
  void* address = nullptr;
  std::size_t bytes = 0;
  std::vector<physical_handle> chunks;
};
// Duplicates the sender's descriptors (pidfd_getfd: the receiver needs the
// sender alive and the same user), imports and maps them in order.
status import_chunks(int device, int sender_pid, const std::vector<int>& sender_fds, std::size_t chunk_bytes,
                     imported_chunks* out);
status release_imported_chunks(const imported_chunks& range);

}  // namespace streamalloc
