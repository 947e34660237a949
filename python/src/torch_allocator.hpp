// torch_allocator: the process-wide streamalloc allocators behind torch's
// CUDA allocator interface, so tensors, torch.cuda.memory_* introspection,
// record_stream, memory fractions, cudnn's cacheInfo and CUDA graph private
// pools all run on streamalloc once install_torch_allocator() registered it.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cstddef>
#include <mutex>
#include <string>
#include <vector>

#include "streamalloc/core/snapshot.hpp"
#include "streamalloc/core/stats.hpp"
#include "streamalloc/util/errors.hpp"

namespace streamalloc {

// Built on torch's CUDAPluggableAllocator so torch accepts it through
// changeCurrentAllocator, but every call goes straight to streamalloc: the
// base class's mutex and per-pointer metadata map are never used (see
// Note [tagged context] in the .cpp).
class torch_allocator final : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  torch_allocator();

  c10::DataPtr allocate(std::size_t bytes) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void* raw_alloc(std::size_t bytes) override;
  void* raw_alloc_with_stream(std::size_t bytes, cudaStream_t stream) override;
  void raw_delete(void* ptr) override;

  void init(int device_count) override;
  double getMemoryFraction(c10::DeviceIndex device) override;
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override;
  std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex device) override;
  void emptyCache(c10::MempoolId_t mempool_id = {0, 0}) override;
  void cacheInfo(c10::DeviceIndex device, std::size_t* largest_block) override;
  // torch calls it before `dev` first reads or writes `dev_to_access`'s
  // memory directly (a peer copy runs on the source device).
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override;

  using CUDAPluggableAllocator::recordStream;  // the c10::Stream overload forwards here
  void recordStream(const c10::DataPtr& data, c10::cuda::CUDAStream stream) override;

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(c10::MempoolId_t mempool_id = {0, 0},
                                                         bool include_traces = true) override;

  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override;
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;

  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override;
  std::string name() override;

 private:
  void* allocate_on(c10::DeviceIndex device, std::size_t bytes, cudaStream_t stream);
  void free_on(c10::DeviceIndex device, void* ptr);
  [[noreturn]] void raise_out_of_memory(const out_of_memory& error);

  std::mutex observers_mutex_;
  std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> oom_observers_;
};

// Registers a torch_allocator as torch's CUDA allocator after layering
// `overrides` (`key:value,...`) on STREAMALLOC_CONF. Throws config_error
// for a bad string, and std::runtime_error naming the fix when torch has
// already initialised CUDA. A second call is harmless: its options still
// apply before the allocators exist, and afterwards it must change none of
// them (std::runtime_error otherwise).
void install_torch_allocator(const std::string& overrides);
// Whether torch's current CUDA allocator is the one install registered.
bool torch_allocator_installed();

// Torch names a memory pool by a pair, streamalloc by one integer; see
// Note [pool ids].
pool_id to_pool_id(c10::MempoolId_t id);
c10::MempoolId_t to_mempool_id(pool_id id);

// Device selector for collect_segments: every device streamalloc uses.
constexpr int k_all_devices = -1;

// Counters of `device`; all zero while streamalloc has not used it.
// These throw usage_error for a device index that does not exist.
device_stats device_stats_of(int device);
void reset_peak_stats_of(int device);
void reset_accumulated_stats_of(int device);
// Returns every unused cached segment of every device to the driver.
void empty_caches();
// Segments of `device` (or of every device), in device then address order.
std::vector<segment_info> collect_segments(int device);
// Number of devices streamalloc manages (0 before CUDA is initialised).
int managed_device_count();

}  // namespace streamalloc
