// torch_allocator: the process-wide streamalloc allocators behind torch's
// CUDA allocator interface, so tensors, torch.cuda.memory_* introspection,
// the device-generic torch.accelerator API, record_stream, memory
// fractions, cudnn's cacheInfo, CUDA graphs and graph trees, MemPool,
// memory history, run-time settings and CUDA IPC all run on streamalloc
// once install_torch_allocator() registered it.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <cstddef>
#include <atomic>
#include <mutex>
#include <unordered_map>
#include <string>
#include <unordered_set>
#include <vector>

#include "memory_history.hpp"
#include "streamalloc/util/errors.hpp"

namespace streamalloc {

// Built on torch's CUDAPluggableAllocator so torch accepts it through
// changeCurrentAllocator, but every call goes straight to streamalloc: the
// base class's mutex and per-pointer metadata map are never used (see
// Note [tagged context] in the .cpp).
class torch_allocator final : public torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator {
 public:
  using c10_allocator = c10::cuda::CUDACachingAllocator::CUDAAllocator;

  torch_allocator();

  // --- allocation ---
  c10::DataPtr allocate(std::size_t bytes) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void* raw_alloc(std::size_t bytes) override;
  void* raw_alloc_with_stream(std::size_t bytes, cudaStream_t stream) override;
  void raw_delete(void* ptr) override;
  void init(int device_count) override;
  // torch.cuda.caching_allocator_enable(False): allocations bypass the
  // cache (cudaMalloc/cudaFree each time) and the statistics, as in torch.
  void enable(bool value) override { caching_enabled_.store(value, std::memory_order_relaxed); }
  bool isEnabled() const override { return caching_enabled_.load(std::memory_order_relaxed); }
  using CUDAPluggableAllocator::recordStream;  // the c10::Stream overload forwards here
  void recordStream(const c10::DataPtr& data, c10::cuda::CUDAStream stream) override;

  // --- limits and caches ---
  double getMemoryFraction(c10::DeviceIndex device) override;
  void setMemoryFraction(double fraction, c10::DeviceIndex device) override;
  void emptyCache(c10::MempoolId_t mempool_id = {0, 0}) override;
  void cacheInfo(c10::DeviceIndex device, std::size_t* largest_block) override;
  void* getBaseAllocation(void* ptr, std::size_t* size) override;
  std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex device) override;

  // --- statistics and snapshots ---
  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
  void resetAccumulatedStats(c10::DeviceIndex device) override;
  void resetPeakStats(c10::DeviceIndex device) override;
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(c10::MempoolId_t mempool_id = {0, 0},
                                                         bool include_traces = true) override;

  // --- memory history and observers ---
  void recordHistory(bool enabled, c10::CachingDeviceAllocator::CreateContextFn context_recorder,
                     std::size_t alloc_trace_max_entries, c10::CachingDeviceAllocator::RecordContext when,
                     bool clear_history, const std::vector<std::string>& skip_actions) override;
  bool isHistoryEnabled() override;
  void setUserMetadata(const std::string& metadata) override;
  std::string getUserMetadata() override;
  void pushCompileContext(std::string& md) override;
  void popCompileContext() override;
  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override;
  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override;
  void attachAllocatorTraceTracker(c10::CachingDeviceAllocator::AllocatorTraceTracker tracker) override;

  // --- private pools: CUDA graphs, graph trees, MemPool ---
  void beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override;
  void endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                          std::shared_ptr<c10_allocator> allocator = nullptr) override;
  int getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  void setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t mempool_id, bool use_on_oom) override;
  void setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) override;
  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
      c10::DeviceIndex device, c10::MempoolId_t id) override;
  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device, std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> state) override;
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected_live_allocations) override;

  // --- several devices and processes ---
  // torch calls it before `dev` first reads or writes `dev_to_access`'s
  // memory directly (a peer copy runs on the source device).
  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override;
  cudaError_t memcpyAsync(void* dst, int dst_device, const void* src, int src_device, std::size_t count,
                          cudaStream_t stream, bool p2p_enabled) override;
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* ptr) override;
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;

  std::string name() override;

  // The DataPtr deleter's path: frees `ptr`, with the freeing call's stack
  // when memory history records stacks of frees.
  void free_with_context(device_allocator& allocator, void* ptr);
  // Frees `ptr` if it was allocated while caching was disabled; false
  // otherwise.
  bool free_uncached(void* ptr);

 private:
  void* allocate_on(c10::DeviceIndex device, std::size_t bytes, cudaStream_t stream);
  void* allocate_uncached(c10::DeviceIndex device, std::size_t bytes);
  void free_on(c10::DeviceIndex device, void* ptr);
  [[noreturn]] void raise_out_of_memory(const out_of_memory& error);

  // Whether allocations go through the cache: not while caching is
  // disabled (enable(false)) or forced off for the process.
  bool caches() const { return caching_enabled_.load(std::memory_order_relaxed) && !caching_forced_off_; }

  memory_history history_;
  std::atomic<bool> caching_enabled_{true};
  // PYTORCH_NO_CUDA_MEMORY_CACHING=1 (or torch's HIP spelling), read once
  // as torch reads it: every allocation is a cudaMalloc of its own, freed
  // at once, so compute-sanitizer sees each tensor's bounds. isEnabled()
  // does not report it, as in torch.
  const bool caching_forced_off_;
  std::mutex uncached_mutex_;
  std::unordered_map<void*, c10::DeviceIndex> uncached_;
  std::mutex observers_mutex_;
  std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> oom_observers_;
};

// Registers a torch_allocator as torch's CUDA allocator (and as the
// device-generic allocator of CUDA, which torch.accelerator asks) after
// layering `overrides` (`key:value,...`) on STREAMALLOC_CONF. Throws
// config_error for a bad string, and std::runtime_error naming the fix
// when torch has already initialised CUDA. A second call is harmless: its
// options still apply before the allocators exist, and afterwards it must
// change none of them (std::runtime_error otherwise).
void install_torch_allocator(const std::string& overrides);
// Whether torch's current CUDA allocator is the one install registered.
bool torch_allocator_installed();

}  // namespace streamalloc
