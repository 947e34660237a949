// torch_allocator: see the header. Every entry point runs through guarded()
// (torch_errors.hpp), so streamalloc's exceptions reach torch and Python as
// torch's own (torch.cuda.OutOfMemoryError, RuntimeError).
#include "torch_allocator.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <c10/util/env.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "cuda_ipc.hpp"
#include "introspection.hpp"
#include "oom_diagnosis.hpp"
#include "pool_segment_source.hpp"
#include "process_allocator.hpp"
#include "streamalloc/core/device_allocator.hpp"
#include "streamalloc/core/device_allocators.hpp"
#include "torch_errors.hpp"
#include "torch_pool_ids.hpp"
#include "torch_settings.hpp"
#include "torch_tags.hpp"

namespace streamalloc {
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using record_context = c10::CachingDeviceAllocator::RecordContext;

// Note [tagged context]
// torch hands a DataPtr's context, and nothing else, to its deleter. The
// context is the block address with the device index in its low bits:
// blocks start at multiples of min_block_bytes (a power of two >= 256) in
// segments aligned to 256 bytes or better, and a c10::DeviceIndex is at
// most 127, so the low seven bits are always free. The deleter reaches the
// owning device_allocator with one atomic load and takes only that
// allocator's lock, where the base class would take a mutex of its own and
// update a pointer map on every allocation and free.
constexpr std::uintptr_t k_device_tag_mask = 127;

stream_handle to_handle(cudaStream_t stream) { return reinterpret_cast<stream_handle>(stream); }
cudaStream_t to_stream(stream_handle handle) { return reinterpret_cast<cudaStream_t>(handle); }

torch_allocator* installed_instance();

void* tag(void* ptr, c10::DeviceIndex device) {
  if (ptr == nullptr) return nullptr;
  const auto address = reinterpret_cast<std::uintptr_t>(ptr);
  TORCH_INTERNAL_ASSERT((address & k_device_tag_mask) == 0, "streamalloc: block ", ptr,
                        " is not aligned for Note [tagged context]");
  return reinterpret_cast<void*>(address | static_cast<std::uintptr_t>(device));
}

// The DataPtr deleter. It runs inside destructors, so it reports a failed
// free on stderr instead of throwing; a failure means a bug, never a normal
// condition.
void delete_tagged(void* context) {
  // Note [fork] in process_allocator.cpp: the parent's blocks are not ours.
  if (in_forked_child()) return;
  const auto bits = reinterpret_cast<std::uintptr_t>(context);
  const int device = static_cast<int>(bits & k_device_tag_mask);
  void* ptr = reinterpret_cast<void*>(bits & ~k_device_tag_mask);
  try {
    device_allocator& allocator = allocator_of(device);
    if (torch_allocator* owner = installed_instance()) {
      owner->free_with_context(allocator, ptr);
    } else {
      allocator.free(ptr);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "streamalloc: could not free %p on device %d: %s\n", ptr, device, e.what());
  }
}

c10::DataPtr tagged_data_ptr(void* ptr, c10::DeviceIndex device) {
  return {ptr, tag(ptr, device), &delete_tagged, c10::Device(c10::DeviceType::CUDA, device)};
}

// The deleter of memory allocated while caching was disabled.
void delete_uncached(void* ptr) {
  if (in_forked_child()) return;
  torch_allocator* owner = installed_instance();
  if (owner == nullptr || !owner->free_uncached(ptr)) {
    std::fprintf(stderr, "streamalloc: %p is not an allocation made with caching disabled\n", ptr);
  }
}

// torch's profiler (profile_memory=True) hears of every allocation and free
// with the device's totals, as from torch's own allocator.
void report_to_profiler(device_allocator& allocator, void* ptr, std::int64_t delta) {
  const device_stats stats = allocator.stats();
  c10::reportMemoryUsageToProfiler(ptr, delta, static_cast<std::size_t>(stats.allocated_bytes[0].current),
                                   static_cast<std::size_t>(stats.reserved_bytes[0].current),
                                   c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(allocator.device())));
}

// torch's GPU trace (the CUDA Stream Sanitizer, torch.cuda._gpu_trace's
// callbacks) hears of every allocation and free, as from torch's own
// allocator: the sanitizer forgets a freed tensor's accesses on the free, so
// a block reused by another tensor is not taken for the old one.
void trace_allocation(void* ptr) {
  if (const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace(); C10_UNLIKELY(interp != nullptr)) {
    (*interp)->trace_gpu_memory_allocation(c10::kCUDA, reinterpret_cast<std::uintptr_t>(ptr));
  }
}

void trace_free(void* ptr) {
  if (const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace(); C10_UNLIKELY(interp != nullptr)) {
    (*interp)->trace_gpu_memory_deallocation(c10::kCUDA, reinterpret_cast<std::uintptr_t>(ptr));
  }
}

// --- streamalloc's statistics and segments in torch's types ---

c10::CachingAllocator::Stat to_torch(const stat_counter& in) {
  c10::CachingAllocator::Stat out;
  out.current = in.current;
  out.peak = in.peak;
  out.allocated = in.allocated;
  out.freed = in.freed;
  return out;
}

// stat_type and torch's StatType share their order: all, small, large.
c10::CachingAllocator::StatArray to_torch(const stat_array& in) {
  c10::CachingAllocator::StatArray out;
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = to_torch(in[i]);
  return out;
}

c10::CachingDeviceAllocator::DeviceStats to_torch(const device_stats& in) {
  c10::CachingDeviceAllocator::DeviceStats out;
  out.allocation = to_torch(in.allocation);
  out.segment = to_torch(in.segment);
  out.active = to_torch(in.active);
  out.inactive_split = to_torch(in.inactive_split);
  out.allocated_bytes = to_torch(in.allocated_bytes);
  out.reserved_bytes = to_torch(in.reserved_bytes);
  out.active_bytes = to_torch(in.active_bytes);
  out.inactive_split_bytes = to_torch(in.inactive_split_bytes);
  out.requested_bytes = to_torch(in.requested_bytes);
  out.num_alloc_retries = in.num_alloc_retries;
  out.num_ooms = in.num_ooms;
  out.oversize_allocations = to_torch(in.oversize_allocations);
  out.oversize_segments = to_torch(in.oversize_segments);
  out.num_sync_all_streams = in.num_sync_all_streams;
  out.num_device_alloc = in.num_device_alloc;
  out.num_device_free = in.num_device_free;
  out.max_split_size = in.max_split_size;
  return out;
}

c10::CachingDeviceAllocator::SegmentInfo to_torch(const segment_info& in, const memory_history& history) {
  c10::CachingDeviceAllocator::SegmentInfo out;
  out.device = static_cast<c10::DeviceIndex>(in.device);
  out.address = in.address;
  out.total_size = in.total_size;
  out.requested_size = in.requested_size;
  out.allocated_size = in.allocated_size;
  out.active_size = in.active_size;
  out.stream = reinterpret_cast<void*>(in.stream);
  out.is_large = !in.is_small;
  out.is_expandable = in.is_expandable;
  out.owner_private_pool_id = to_mempool_id(in.pool);
  if (history.recording()) out.context_when_allocated = history.segment_context(in.address);
  out.blocks.reserve(in.blocks.size());
  for (const block_info& b : in.blocks) {
    c10::CachingDeviceAllocator::BlockInfo block;
    block.size = b.size;
    block.requested_size = b.requested_size;
    block.allocated = b.state == block_state::active_allocated;
    block.active = b.state != block_state::inactive;
    if (block.active && history.recording()) block.context_when_allocated = history.block_context(b.address);
    out.blocks.push_back(std::move(block));
  }
  return out;
}

cca::AllocatorConfigInfo config_metadata() {
  const allocator_config config = process_allocator_config();
  cca::AllocatorConfigInfo info{};
  info.garbage_collection_threshold = config.garbage_collection_threshold;
  info.max_split_size = config.max_split_bytes;
  info.expandable_segments = config.expandable_segments;
  info.last_allocator_settings = "streamalloc " + config.to_string();
  if (config.roundup_power2_divisions != 0) info.roundup_power2_divisions = {config.roundup_power2_divisions};
  return info;
}

// What a new segment could still get: the device's free memory, capped by
// the memory fraction's headroom. torch's own guess is free memory alone;
// under a cap it would send cudnn after workspaces it can never have.
std::size_t growth_headroom(device_allocator& allocator) {
  device_memory_info info;
  if (!allocator.backend().memory_info(&info)) return 0;
  const double fraction = allocator.memory_fraction();
  if (fraction >= 1.0) return info.free_bytes;
  const auto allowed = static_cast<std::size_t>(fraction * static_cast<double>(info.total_bytes));
  const auto reserved = static_cast<std::size_t>(allocator.stats().reserved_bytes[0].current);
  return std::min(info.free_bytes, allowed > reserved ? allowed - reserved : 0);
}

// The device whose allocator owns the live allocation `ptr`: a raw pointer
// carries no device, and the current one is the likely owner.
int owner_of(const void* ptr) {
  c10::DeviceIndex current = -1;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&current));
  const auto owns = [ptr](int device) {
    device_allocator* allocator = existing_allocator_of(device);
    return allocator != nullptr && allocator->owns(ptr);
  };
  if (owns(current)) return current;
  for (int d = 0; d < managed_device_count(); ++d) {
    if (d != current && owns(d)) return d;
  }
  return -1;
}

int checked_owner_of(const void* ptr, const char* operation) {
  const int owner = owner_of(ptr);
  TORCH_CHECK(owner >= 0, "streamalloc: ", operation, "(", ptr, "): not a live streamalloc allocation on any device");
  return owner;
}

// A pool's block layout between getCheckpointState and
// setCheckpointPoolState (CUDA graph trees).
struct pool_checkpoint_state final : cca::AllocatorState {
  pool_checkpoint_state(int device_index, pool_checkpoint layout) : device(device_index), checkpoint(std::move(layout)) {}
  int device;
  pool_checkpoint checkpoint;
};

// --- installation ---

std::mutex& install_mutex() {
  static std::mutex* const mutex = new std::mutex;
  return *mutex;
}

// Never destroyed: torch's own reference is a static that dies at exit,
// while tensors freed later still reach the allocator through torch.
std::shared_ptr<torch_allocator>& installed_allocator() {
  static auto* const holder = new std::shared_ptr<torch_allocator>;
  return *holder;
}

std::atomic<torch_allocator*>& installed_pointer() {
  static std::atomic<torch_allocator*> pointer{nullptr};
  return pointer;
}

torch_allocator* installed_instance() { return installed_pointer().load(std::memory_order_acquire); }

std::string too_late_message(cca::CUDAAllocator& current) {
  std::string held;
  try {
    std::int64_t allocated = 0;
    std::int64_t reserved = 0;
    for (c10::DeviceIndex d = 0; d < c10::cuda::device_count(); ++d) {
      const c10::CachingDeviceAllocator::DeviceStats stats = current.getDeviceStats(d);
      allocated += stats.allocated_bytes[0].current;
      reserved += stats.reserved_bytes[0].current;
    }
    held = " and holds " + format_bytes(static_cast<std::size_t>(allocated)) + " of tensors (" +
           format_bytes(static_cast<std::size_t>(reserved)) + " reserved)";
  } catch (const std::exception&) {
    // An allocator without statistics (a plain pluggable one) gets the
    // message without the numbers.
  }
  return "streamalloc.install() came too late: torch has already initialised CUDA, its '" + current.name() +
         "' allocator is in use" + held +
         ", and torch cannot swap allocators after that. Call streamalloc.install() before any CUDA tensor is "
         "created, e.g. at the top of your script right after `import torch`.";
}

// install() on an installed allocator: options may still change until the
// allocators exist; after that only a request that changes nothing passes.
void reconfigure(const std::string& overrides) {
  if (overrides.empty()) return;
  if (!process_allocators_created()) {
    configure_process_allocators(overrides);
    return;
  }
  const allocator_config current = process_allocator_config();
  if (current.with(overrides).to_string() == current.to_string()) return;
  throw std::runtime_error("streamalloc is already installed and its allocators are in use with {" +
                           current.to_string() + "}; they cannot change to {" + overrides +
                           "} now. Pass every option to the first streamalloc.install() call, or set "
                           "STREAMALLOC_CONF, before CUDA is used.");
}

// torch.accelerator and c10::GetAllocator(kCUDA) ask the allocator
// registered for the device type, which changeCurrentAllocator leaves at
// torch's native one. The highest priority keeps a later static
// registration from taking it back.
constexpr std::uint8_t k_device_allocator_priority = std::numeric_limits<std::uint8_t>::max();

}  // namespace

// ---------------------------------------------------------------------------
// Registration

void install_torch_allocator(const std::string& overrides) {
  std::lock_guard<std::mutex> lock(install_mutex());
  if (torch_allocator_installed()) {
    reconfigure(overrides);
    return;
  }
  // A bad option is reported before the question of timing.
  const allocator_config config = startup_config(overrides, true);
  cca::CUDAAllocator* current = cca::get();
  if (current != nullptr && current->initialized()) throw std::runtime_error(too_late_message(*current));
  if (config.to_string() != process_allocator_config().to_string()) configure_process_allocators(config);
  auto allocator = std::make_shared<torch_allocator>();
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
  c10::SetAllocator(c10::DeviceType::CUDA, allocator.get(), k_device_allocator_priority);
  hook_torch_allocator_settings();
  installed_pointer().store(allocator.get(), std::memory_order_release);
  installed_allocator() = std::move(allocator);
}

bool torch_allocator_installed() {
  const std::shared_ptr<torch_allocator>& ours = installed_allocator();
  return ours != nullptr && cca::get() == ours.get();
}

// ---------------------------------------------------------------------------
// Allocation

namespace {

// torch's own test for PYTORCH_NO_CUDA_MEMORY_CACHING: a true flag value
// ("1", "true", ...), under either of the names torch accepts.
bool caching_forced_off_by_environment() {
  return c10::utils::check_env("PYTORCH_NO_CUDA_MEMORY_CACHING") == true ||
         c10::utils::check_env("PYTORCH_NO_HIP_MEMORY_CACHING") == true;
}

}  // namespace

// The base class keeps these functions for its own malloc path, which no
// override here uses; they still reach streamalloc correctly.
torch_allocator::torch_allocator()
    : CUDAPluggableAllocator(
          [this](std::size_t bytes, int device, cudaStream_t stream) {
            return allocate_on(static_cast<c10::DeviceIndex>(device), bytes, stream);
          },
          [this](void* ptr, std::size_t, int device, cudaStream_t) {
            free_on(static_cast<c10::DeviceIndex>(device), ptr);
          }),
      caching_forced_off_(caching_forced_off_by_environment()) {}

void* torch_allocator::allocate_on(c10::DeviceIndex device, std::size_t bytes, cudaStream_t stream) {
  if (!caches()) return allocate_uncached(device, bytes);
  memory_history::call_scope context(history_, record_context::STATE);
  try {
    device_allocator& allocator = allocator_of(device);
    void* ptr = allocator.allocate(bytes, to_handle(stream));
    if (tagging_on()) record_allocation(allocator, device, ptr, bytes);
    if (ptr != nullptr) {
      if (c10::memoryProfilingEnabled()) {
        report_to_profiler(allocator, ptr, static_cast<std::int64_t>(allocator.allocation_size(ptr)));
      }
      trace_allocation(ptr);
    }
    return ptr;
  } catch (const out_of_memory& e) {
    raise_out_of_memory(e);
  } catch (...) {
    rethrow_for_torch();
  }
}

void torch_allocator::free_on(c10::DeviceIndex device, void* ptr) {
  if (in_forked_child()) return;
  guarded([&] { free_with_context(allocator_of(device), ptr); });
}

void torch_allocator::free_with_context(device_allocator& allocator, void* ptr) {
  memory_history::call_scope context(history_, record_context::ALL);
  // Before the free: afterwards another thread may be handed the address
  // and record it (Note [allocation tags]).
  if (tagging_on()) forget_allocation(ptr);
  trace_free(ptr);
  if (!c10::memoryProfilingEnabled()) {
    allocator.free(ptr);
    return;
  }
  const auto size = static_cast<std::int64_t>(allocator.allocation_size(ptr));
  allocator.free(ptr);
  report_to_profiler(allocator, ptr, -size);
}

void* torch_allocator::allocate_uncached(c10::DeviceIndex device, std::size_t bytes) {
  if (bytes == 0) return nullptr;
  c10::cuda::CUDAGuard guard(device);
  void* ptr = nullptr;
  const cudaError_t error = cudaMalloc(&ptr, bytes);
  if (error == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CUDA out of memory. Tried to allocate ", c10::CachingAllocator::format_size(bytes),
                     " with the caching allocator disabled (",
                     caching_forced_off_ ? "PYTORCH_NO_CUDA_MEMORY_CACHING" : "torch.cuda.caching_allocator_enable(False)",
                     ").");
  }
  C10_CUDA_CHECK(error);
  {
    std::lock_guard<std::mutex> lock(uncached_mutex_);
    uncached_.emplace(ptr, device);
  }
  trace_allocation(ptr);
  return ptr;
}

bool torch_allocator::free_uncached(void* ptr) {
  c10::DeviceIndex device = 0;
  {
    std::lock_guard<std::mutex> lock(uncached_mutex_);
    auto it = uncached_.find(ptr);
    if (it == uncached_.end()) return false;
    device = it->second;
    uncached_.erase(it);
  }
  trace_free(ptr);
  c10::cuda::CUDAGuard guard(device);
  C10_CUDA_CHECK_WARN(cudaFree(ptr));
  return true;
}

void torch_allocator::raise_out_of_memory(const out_of_memory& error) {
  std::vector<cca::OutOfMemoryObserver> observers;
  {
    std::lock_guard<std::mutex> lock(observers_mutex_);
    observers = oom_observers_;
  }
  const oom_context& c = error.context();
  if (c10::memoryProfilingEnabled()) {
    c10::reportOutOfMemoryToProfiler(static_cast<std::int64_t>(c.requested_bytes), c.allocated_bytes, c.reserved_bytes,
                                     c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(c.device)));
  }
  for (const auto& observer : observers) {
    observer(c.device, c.requested_bytes, c.allowed_bytes, c.device_free_bytes);
  }
  // torch's wording first, then who holds the memory and what to change.
  std::string message = error.what();
  const std::string diagnosis = diagnose_out_of_memory(error);
  if (!diagnosis.empty()) message += "\n" + diagnosis;
  TORCH_CHECK_WITH(OutOfMemoryError, false, message);
}

c10::DataPtr torch_allocator::allocate(std::size_t bytes) {
  c10::DeviceIndex device = -1;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  // No memory to find: torch's own allocator skips the stream lookup too.
  if (bytes == 0) return tagged_data_ptr(nullptr, device);
  if (!caches()) {
    void* ptr = allocate_uncached(device, bytes);
    return {ptr, ptr, &delete_uncached, c10::Device(c10::DeviceType::CUDA, device)};
  }
  void* ptr = allocate_on(device, bytes, c10::cuda::getCurrentCUDAStream(device).stream());
  return tagged_data_ptr(ptr, device);
}

c10::DeleterFnPtr torch_allocator::raw_deleter() const { return &delete_tagged; }

void* torch_allocator::raw_alloc(std::size_t bytes) {
  c10::DeviceIndex device = -1;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  return allocate_on(device, bytes, c10::cuda::getCurrentCUDAStream(device).stream());
}

void* torch_allocator::raw_alloc_with_stream(std::size_t bytes, cudaStream_t stream) {
  c10::DeviceIndex device = -1;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  return allocate_on(device, bytes, stream);
}

void torch_allocator::raw_delete(void* ptr) {
  if (ptr == nullptr || in_forked_child() || free_uncached(ptr)) return;
  const int owner = guarded([&] { return checked_owner_of(ptr, "raw_delete"); });
  free_on(static_cast<c10::DeviceIndex>(owner), ptr);
}

void torch_allocator::init(int /*device_count*/) {
  guarded([&] {
    // Creating the allocator set here surfaces a missing driver at torch's
    // CUDA initialisation rather than at the first allocation.
    // torch's per_process_memory_fraction setting (its variable's value,
    // or a later _set_allocator_settings call's) caps each device when its
    // allocator is created.
    process_allocators().set_creation_hook([this](int device, device_allocator& allocator) {
      const double torch_fraction = cca::CUDAAllocatorConfig::per_process_memory_fraction();
      if (torch_fraction < 1.0) allocator.set_memory_fraction(torch_fraction);
      history_.connect(device, allocator);
    });
  });
  initialized_ = true;
}

void torch_allocator::recordStream(const c10::DataPtr& data, c10::cuda::CUDAStream stream) {
  // Memory streamalloc did not hand out (e.g. received over IPC) is not
  // its to track, as with torch's own allocator.
  if (data.get() == nullptr || data.get_deleter() != &delete_tagged) return;
  const auto bits = reinterpret_cast<std::uintptr_t>(data.get_context());
  const int device = static_cast<int>(bits & k_device_tag_mask);
  guarded([&] {
    allocator_of(device).record_stream(reinterpret_cast<void*>(bits & ~k_device_tag_mask), to_handle(stream.stream()));
  });
}

// ---------------------------------------------------------------------------
// Limits and caches

double torch_allocator::getMemoryFraction(c10::DeviceIndex device) {
  return guarded([&] { return allocator_of(device).memory_fraction(); });
}

void torch_allocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  guarded([&] { allocator_of(device).set_memory_fraction(fraction); });
}

// {0, 0} empties every pool of every device, as torch's emptyCache();
// another id only that pool's cache (MemPool's destructor asks this).
void torch_allocator::emptyCache(c10::MempoolId_t mempool_id) {
  guarded([&] {
    if (mempool_id == c10::MempoolId_t{0, 0}) {
      empty_caches();
      return;
    }
    const pool_id pool = to_pool_id(mempool_id);
    for (int d = 0; d < managed_device_count(); ++d) {
      if (device_allocator* allocator = existing_allocator_of(d)) allocator->empty_cache(pool);
    }
  });
}

void torch_allocator::cacheInfo(c10::DeviceIndex device, std::size_t* largest_block) {
  guarded([&] {
    device_allocator& allocator = allocator_of(device);
    std::size_t largest_free = 0;
    allocator.cache_info(&largest_free, nullptr);
    // Like torch: a zero *largest_block asks for an initial guess too.
    if (*largest_block == 0) *largest_block = growth_headroom(allocator);
    *largest_block = std::max(*largest_block, largest_free);
  });
}

void* torch_allocator::getBaseAllocation(void* ptr, std::size_t* size) {
  return guarded([&] {
    const int owner = checked_owner_of(ptr, "getBaseAllocation");
    const device_allocator::shareable_range range = allocator_of(owner).share_range(ptr);
    if (size != nullptr) *size = range.size;
    return reinterpret_cast<void*>(range.address);
  });
}

// Per stream and pool kind, the mapped bytes of expandable segments, the
// default pool's and private pools' (Note [private ranges]) alike, as torch
// reports its expandable segments' sizes.
std::vector<cca::StreamSegmentSize> torch_allocator::getExpandableSegmentSizes(c10::DeviceIndex device) {
  return guarded([&] {
    std::map<std::pair<stream_handle, bool>, std::size_t> sizes;
    for (const segment_info& s : collect_segments(device)) {
      if (s.is_expandable) sizes[{s.stream, s.is_small}] += s.total_size;
    }
    std::vector<cca::StreamSegmentSize> out;
    for (const auto& [key, bytes] : sizes) out.emplace_back(to_stream(key.first), key.second, bytes);
    return out;
  });
}

// ---------------------------------------------------------------------------
// Statistics and snapshots

c10::CachingDeviceAllocator::DeviceStats torch_allocator::getDeviceStats(c10::DeviceIndex device) {
  return guarded([&] { return to_torch(device_stats_of(device)); });
}

void torch_allocator::resetAccumulatedStats(c10::DeviceIndex device) {
  guarded([&] { reset_accumulated_stats_of(device); });
}

void torch_allocator::resetPeakStats(c10::DeviceIndex device) {
  guarded([&] { reset_peak_stats_of(device); });
}

cca::SnapshotInfo torch_allocator::snapshot(c10::MempoolId_t mempool_id, bool include_traces) {
  return guarded([&] {
    cca::SnapshotInfo out;
    const bool one_pool = mempool_id != c10::MempoolId_t{0, 0};
    const pool_id wanted = to_pool_id(mempool_id);
    for (const segment_info& segment : collect_segments(k_all_devices)) {
      if (!one_pool || segment.pool == wanted) out.segments.push_back(to_torch(segment, history_));
    }
    const int devices = managed_device_count();
    if (include_traces) {
      out.device_traces = history_.traces(devices);
      out.external_annotations = history_.annotations();
    } else {
      out.device_traces.resize(static_cast<std::size_t>(devices));
    }
    out.config_metadata = config_metadata();
    return out;
  });
}

// ---------------------------------------------------------------------------
// Memory history and observers

void torch_allocator::recordHistory(bool enabled, c10::CachingDeviceAllocator::CreateContextFn context_recorder,
                                    std::size_t alloc_trace_max_entries, record_context when, bool clear_history,
                                    const std::vector<std::string>& skip_actions) {
  guarded([&] {
    history_.record(enabled, context_recorder, alloc_trace_max_entries, when, clear_history, skip_actions);
  });
}

bool torch_allocator::isHistoryEnabled() { return history_.recording(); }

void torch_allocator::setUserMetadata(const std::string& metadata) { history_.set_user_metadata(metadata); }

std::string torch_allocator::getUserMetadata() { return history_.user_metadata(); }

void torch_allocator::pushCompileContext(std::string& md) { history_.push_compile_context(md); }

void torch_allocator::popCompileContext() { history_.pop_compile_context(); }

void torch_allocator::recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) {
  guarded([&] { history_.record_annotation(md); });
}

void torch_allocator::attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) {
  std::lock_guard<std::mutex> lock(observers_mutex_);
  oom_observers_.push_back(std::move(observer));
}

void torch_allocator::attachAllocatorTraceTracker(c10::CachingDeviceAllocator::AllocatorTraceTracker tracker) {
  guarded([&] { history_.attach_tracker(std::move(tracker)); });
}

// ---------------------------------------------------------------------------
// Private pools

void torch_allocator::beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                          std::function<bool(cudaStream_t)> filter) {
  guarded([&] {
    allocator_of(device).begin_allocate_to_pool(
        to_pool_id(mempool_id), [filter = std::move(filter)](stream_handle stream) { return filter(to_stream(stream)); });
  });
}

void torch_allocator::endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  guarded([&] { allocator_of(device).end_allocate_to_pool(to_pool_id(mempool_id)); });
}

// torch calls this from CUDAGraph's and MemPool's destructors, where an
// exception would terminate the process: a failure becomes a warning.
void torch_allocator::releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  try {
    allocator_of(device).release_pool(to_pool_id(mempool_id));
  } catch (const std::exception& e) {
    TORCH_WARN("streamalloc: releasing memory pool (", mempool_id.first, ", ", mempool_id.second,
               ") failed: ", e.what());
  }
}

void torch_allocator::createOrIncrefPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                         std::shared_ptr<c10_allocator> allocator) {
  guarded([&] {
    std::shared_ptr<segment_source> source;
    if (allocator != nullptr) source = std::make_shared<pool_segment_source>(device, std::move(allocator));
    allocator_of(device).create_or_incref_pool(to_pool_id(mempool_id), std::move(source));
  });
}

int torch_allocator::getPoolUseCount(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  return guarded([&] { return allocator_of(device).pool_use_count(to_pool_id(mempool_id)); });
}

void torch_allocator::setUseOnOOM(c10::DeviceIndex device, c10::MempoolId_t mempool_id, bool use_on_oom) {
  guarded([&] { allocator_of(device).set_pool_use_on_oom(to_pool_id(mempool_id), use_on_oom); });
}

void torch_allocator::setNoSplit(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  guarded([&] { allocator_of(device).set_pool_no_split(to_pool_id(mempool_id), true); });
}

std::shared_ptr<cca::AllocatorState> torch_allocator::getCheckpointState(c10::DeviceIndex device, c10::MempoolId_t id) {
  return guarded([&] {
    return std::make_shared<pool_checkpoint_state>(device, allocator_of(device).checkpoint_pool(to_pool_id(id)));
  });
}

cca::CheckpointDelta torch_allocator::setCheckpointPoolState(c10::DeviceIndex device,
                                                             std::shared_ptr<cca::AllocatorState> state) {
  return guarded([&] {
    const auto* checkpoint = dynamic_cast<const pool_checkpoint_state*>(state.get());
    TORCH_CHECK(checkpoint != nullptr, "streamalloc: setCheckpointPoolState needs a state from getCheckpointState");
    TORCH_CHECK(checkpoint->device == device, "streamalloc: a checkpoint of device ", checkpoint->device,
                " cannot restore a pool of device ", static_cast<int>(device));
    device_allocator& allocator = allocator_of(device);
    pool_restore_result restored = allocator.restore_pool(checkpoint->checkpoint);
    // The restore frees and allocates behind allocate_on's back.
    if (tagging_on()) {
      for (void* ptr : restored.freed) forget_allocation(ptr);
      for (void* ptr : restored.allocated) record_allocation(allocator, device, ptr, allocator.allocation_size(ptr));
    }
    cca::CheckpointDelta delta;
    delta.ptrs_freed = std::move(restored.freed);
    delta.dataptrs_allocd.reserve(restored.allocated.size());
    for (void* ptr : restored.allocated) delta.dataptrs_allocd.push_back(tagged_data_ptr(ptr, device));
    return delta;
  });
}

bool torch_allocator::checkPoolLiveAllocations(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                               const std::unordered_set<void*>& expected_live_allocations) {
  return guarded([&] {
    const std::vector<const void*> expected(expected_live_allocations.begin(), expected_live_allocations.end());
    return allocator_of(device).pool_allocations_match(to_pool_id(mempool_id), expected);
  });
}

// ---------------------------------------------------------------------------
// Several devices and processes

void torch_allocator::enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
  guarded([&] {
    // The runtime's peer access covers plain segments; chunks mapped into
    // expandable segments are reachable only by the devices their mapping
    // names, so dev_to_access's allocator opens them to dev as well.
    CUDAPluggableAllocator::enablePeerAccess(dev, dev_to_access);
    allocator_of(dev_to_access).allow_peer_access(dev);
  });
}

// Without peer access only cudaMemcpyPeerAsync copies between devices out
// of memory that cudaMalloc did not make (mapped chunks).
cudaError_t torch_allocator::memcpyAsync(void* dst, int dst_device, const void* src, int src_device,
                                         std::size_t count, cudaStream_t stream, bool p2p_enabled) {
  if (p2p_enabled || dst_device == src_device) {
    return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  }
  return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, count, stream);
}

cca::ShareableHandle torch_allocator::shareIpcHandle(void* ptr) {
  return guarded([&] { return share_ipc_handle(allocator_of(checked_owner_of(ptr, "shareIpcHandle")), ptr); });
}

std::shared_ptr<void> torch_allocator::getIpcDevPtr(std::string handle) {
  return guarded([&] { return open_ipc_handle(handle); });
}

std::string torch_allocator::name() { return "streamalloc"; }

}  // namespace streamalloc
