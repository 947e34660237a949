// torch_allocator: see the header. Every entry point turns streamalloc's
// exceptions into torch's own (c10::OutOfMemoryError for out_of_memory, so
// Python sees torch.cuda.OutOfMemoryError; c10::Error for the rest), so no
// streamalloc type ever escapes into torch or Python as an unknown error.
#include "torch_allocator.hpp"

#include <c10/core/Device.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "process_allocator.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/device_allocators.hpp"

namespace streamalloc {
namespace {

using c10::cuda::CUDACachingAllocator::CUDAAllocator;

// Note [tagged context]
// torch hands a DataPtr's context, and nothing else, to its deleter. The
// context is the block address with the device index in its low bits:
// blocks start at multiples of min_block_bytes (a power of two >= 256) in
// cudaMalloc'd segments (256-byte aligned or better), and a
// c10::DeviceIndex is at most 127, so the low seven bits are always free.
// The deleter reaches the owning caching_allocator with one atomic load and
// takes only that allocator's lock, where the base class would take a
// mutex of its own and update a pointer map on every allocation and free.
constexpr std::uintptr_t k_device_tag_mask = 127;

// Note [pool ids]
// torch names a private pool by a pair with exactly one non-zero side:
// .first for a pool made by a capture, .second for graph_pool_handle().
// Both sides are counters, so they fit in 63 bits and the top bit of a
// streamalloc pool_id records the side. The mapping needs no table, and a
// snapshot can name each segment's pool the way torch does.
constexpr pool_id k_user_pool_bit = pool_id{1} << 63;

stream_handle to_handle(cudaStream_t stream) { return reinterpret_cast<stream_handle>(stream); }
cudaStream_t to_stream(stream_handle handle) { return reinterpret_cast<cudaStream_t>(handle); }

caching_allocator* existing_allocator_of(int device) {
  device_allocators* all = find_process_allocators();
  return all == nullptr ? nullptr : all->find(device);
}

caching_allocator& allocator_of(int device) {
  if (caching_allocator* existing = existing_allocator_of(device)) return *existing;
  return process_allocators().at(device);
}

// Rejects negative indices always, and indices past the managed devices once
// streamalloc knows how many there are.
void check_device_index(int device) {
  const int count = managed_device_count();
  if (device < 0 || (count > 0 && device >= count)) {
    throw usage_error("streamalloc: device index " + std::to_string(device) + " does not exist (" +
                      std::to_string(count) + " device(s) managed)");
  }
}

// Called inside a catch block: rethrows the exception being handled as the
// torch exception Python users expect.
[[noreturn]] void rethrow_for_torch() {
  try {
    throw;
  } catch (const c10::Error&) {
    throw;
  } catch (const out_of_memory& e) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
}

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
    allocator_of(device).free(ptr);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "streamalloc: could not free %p on device %d: %s\n", ptr, device, e.what());
  }
}

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

c10::CachingDeviceAllocator::SegmentInfo to_torch(const segment_info& in) {
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
  out.blocks.reserve(in.blocks.size());
  for (const block_info& b : in.blocks) {
    c10::CachingDeviceAllocator::BlockInfo block;
    block.size = b.size;
    block.requested_size = b.requested_size;
    block.allocated = b.state == block_state::active_allocated;
    block.active = b.state != block_state::inactive;
    out.blocks.push_back(block);
  }
  return out;
}

c10::cuda::CUDACachingAllocator::AllocatorConfigInfo config_metadata() {
  const allocator_config config = process_allocator_config();
  c10::cuda::CUDACachingAllocator::AllocatorConfigInfo info{};
  info.garbage_collection_threshold = config.garbage_collection_threshold;
  info.max_split_size = config.max_split_bytes;
  info.last_allocator_settings = "streamalloc " + config.to_string();
  return info;
}

// What a new segment could still get: the device's free memory, capped by
// the memory fraction's headroom. torch's own guess is free memory alone;
// under a cap it would send cudnn after workspaces it can never have.
std::size_t growth_headroom(caching_allocator& allocator) {
  device_memory_info info;
  if (!allocator.backend().memory_info(&info)) return 0;
  const double fraction = allocator.memory_fraction();
  if (fraction >= 1.0) return info.free_bytes;
  const auto allowed = static_cast<std::size_t>(fraction * static_cast<double>(info.total_bytes));
  const auto reserved = static_cast<std::size_t>(allocator.stats().reserved_bytes[0].current);
  return std::min(info.free_bytes, allowed > reserved ? allowed - reserved : 0);
}

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

std::string too_late_message(CUDAAllocator& current) {
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

}  // namespace

// ---------------------------------------------------------------------------
// Pool ids

pool_id to_pool_id(c10::MempoolId_t id) {
  const bool one_side = (id.first == 0) != (id.second == 0);
  const pool_id value = id.first != 0 ? id.first : id.second;
  TORCH_CHECK(one_side && (value & k_user_pool_bit) == 0, "streamalloc: unsupported memory pool id (", id.first, ", ",
              id.second, ")");
  return id.first != 0 ? value : (value | k_user_pool_bit);
}

c10::MempoolId_t to_mempool_id(pool_id id) {
  if (id == 0) return {0, 0};
  if ((id & k_user_pool_bit) != 0) return {0, id & ~k_user_pool_bit};
  return {id, 0};
}

// ---------------------------------------------------------------------------
// Introspection shared with the Python module

int managed_device_count() {
  device_allocators* all = find_process_allocators();
  return all == nullptr ? 0 : all->device_count();
}

device_stats device_stats_of(int device) {
  check_device_index(device);
  if (caching_allocator* allocator = existing_allocator_of(device)) return allocator->stats();
  device_stats unused;
  const allocator_config config = process_allocator_config();
  unused.max_split_size = config.max_split_bytes == std::numeric_limits<std::size_t>::max()
                              ? -1
                              : static_cast<std::int64_t>(config.max_split_bytes);
  return unused;
}

void reset_peak_stats_of(int device) {
  check_device_index(device);
  if (caching_allocator* allocator = existing_allocator_of(device)) allocator->reset_peak_stats();
}

void reset_accumulated_stats_of(int device) {
  check_device_index(device);
  if (caching_allocator* allocator = existing_allocator_of(device)) allocator->reset_accumulated_stats();
}

void empty_caches() {
  for (int d = 0; d < managed_device_count(); ++d) {
    if (caching_allocator* allocator = existing_allocator_of(d)) allocator->empty_cache();
  }
}

std::vector<segment_info> collect_segments(int device) {
  if (device != k_all_devices) check_device_index(device);
  std::vector<segment_info> out;
  const int count = managed_device_count();
  for (int d = 0; d < count; ++d) {
    if (device != k_all_devices && d != device) continue;
    caching_allocator* allocator = existing_allocator_of(d);
    if (allocator == nullptr) continue;
    allocator_snapshot snapshot = allocator->snapshot();
    std::move(snapshot.segments.begin(), snapshot.segments.end(), std::back_inserter(out));
  }
  return out;
}

// ---------------------------------------------------------------------------
// Registration

void install_torch_allocator(const std::string& overrides) {
  std::lock_guard<std::mutex> lock(install_mutex());
  if (torch_allocator_installed()) {
    reconfigure(overrides);
    return;
  }
  // A bad option is reported before the question of timing.
  process_allocator_config().with(overrides);
  CUDAAllocator* current = c10::cuda::CUDACachingAllocator::get();
  if (current != nullptr && current->initialized()) throw std::runtime_error(too_late_message(*current));
  if (!overrides.empty()) configure_process_allocators(overrides);
  auto allocator = std::make_shared<torch_allocator>();
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(allocator);
  installed_allocator() = std::move(allocator);
}

bool torch_allocator_installed() {
  const std::shared_ptr<torch_allocator>& ours = installed_allocator();
  return ours != nullptr && c10::cuda::CUDACachingAllocator::get() == ours.get();
}

// ---------------------------------------------------------------------------
// The allocator

// The base class keeps these functions for its own malloc path, which no
// override here uses; they still reach streamalloc correctly.
torch_allocator::torch_allocator()
    : CUDAPluggableAllocator(
          [this](std::size_t bytes, int device, cudaStream_t stream) {
            return allocate_on(static_cast<c10::DeviceIndex>(device), bytes, stream);
          },
          [this](void* ptr, std::size_t, int device, cudaStream_t) {
            free_on(static_cast<c10::DeviceIndex>(device), ptr);
          }) {}

void* torch_allocator::allocate_on(c10::DeviceIndex device, std::size_t bytes, cudaStream_t stream) {
  try {
    return allocator_of(device).allocate(bytes, to_handle(stream));
  } catch (const out_of_memory& e) {
    raise_out_of_memory(e);
  } catch (...) {
    rethrow_for_torch();
  }
}

void torch_allocator::free_on(c10::DeviceIndex device, void* ptr) {
  if (in_forked_child()) return;
  try {
    allocator_of(device).free(ptr);
  } catch (...) {
    rethrow_for_torch();
  }
}

void torch_allocator::raise_out_of_memory(const out_of_memory& error) {
  std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> observers;
  {
    std::lock_guard<std::mutex> lock(observers_mutex_);
    observers = oom_observers_;
  }
  const oom_context& c = error.context();
  for (const auto& observer : observers) {
    observer(c.device, c.requested_bytes, c.allowed_bytes, c.device_free_bytes);
  }
  TORCH_CHECK_WITH(OutOfMemoryError, false, error.what());
}

c10::DataPtr torch_allocator::allocate(std::size_t bytes) {
  c10::DeviceIndex device = -1;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&device));
  void* ptr = allocate_on(device, bytes, c10::cuda::getCurrentCUDAStream(device).stream());
  return {ptr, tag(ptr, device), &delete_tagged, c10::Device(c10::DeviceType::CUDA, device)};
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
  if (ptr == nullptr || in_forked_child()) return;
  // A raw pointer carries no device: the current one is the likely owner.
  c10::DeviceIndex current = -1;
  C10_CUDA_CHECK(c10::cuda::GetDevice(&current));
  const auto owns = [ptr](int device) {
    caching_allocator* allocator = existing_allocator_of(device);
    return allocator != nullptr && allocator->owns(ptr);
  };
  int owner = owns(current) ? current : -1;
  for (int d = 0; owner < 0 && d < managed_device_count(); ++d) {
    if (d != current && owns(d)) owner = d;
  }
  TORCH_CHECK(owner >= 0, "streamalloc: raw_delete(", ptr, "): not a live streamalloc allocation on any device");
  free_on(static_cast<c10::DeviceIndex>(owner), ptr);
}

void torch_allocator::init(int /*device_count*/) {
  // Creating the allocator set here surfaces a missing driver at torch's
  // CUDA initialisation rather than at the first allocation.
  try {
    process_allocators();
  } catch (...) {
    rethrow_for_torch();
  }
  initialized_ = true;
}

double torch_allocator::getMemoryFraction(c10::DeviceIndex device) {
  try {
    return allocator_of(device).memory_fraction();
  } catch (...) {
    rethrow_for_torch();
  }
}

void torch_allocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  try {
    allocator_of(device).set_memory_fraction(fraction);
  } catch (...) {
    rethrow_for_torch();
  }
}

// streamalloc's segments are plain cudaMalloc ranges, never expandable.
std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> torch_allocator::getExpandableSegmentSizes(
    c10::DeviceIndex /*device*/) {
  return {};
}

void torch_allocator::enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
  try {
    // The runtime's peer access covers plain segments; chunks mapped into
    // expandable segments are reachable only by the devices their mapping
    // names, so dev_to_access's allocator opens them to dev as well.
    CUDAPluggableAllocator::enablePeerAccess(dev, dev_to_access);
    allocator_of(dev_to_access).allow_peer_access(dev);
  } catch (...) {
    rethrow_for_torch();
  }
}

// A request for one pool's cache returns every pool's unused segments:
// streamalloc releases per allocator, and that is a superset.
void torch_allocator::emptyCache(c10::MempoolId_t /*mempool_id*/) {
  try {
    empty_caches();
  } catch (...) {
    rethrow_for_torch();
  }
}

void torch_allocator::cacheInfo(c10::DeviceIndex device, std::size_t* largest_block) {
  try {
    caching_allocator& allocator = allocator_of(device);
    std::size_t largest_free = 0;
    allocator.cache_info(&largest_free, nullptr);
    // Like torch: a zero *largest_block asks for an initial guess too.
    if (*largest_block == 0) *largest_block = growth_headroom(allocator);
    *largest_block = std::max(*largest_block, largest_free);
  } catch (...) {
    rethrow_for_torch();
  }
}

void torch_allocator::recordStream(const c10::DataPtr& data, c10::cuda::CUDAStream stream) {
  // Memory streamalloc did not hand out (e.g. received over IPC) is not
  // its to track, as with torch's own allocator.
  if (data.get() == nullptr || data.get_deleter() != &delete_tagged) return;
  const auto bits = reinterpret_cast<std::uintptr_t>(data.get_context());
  const int device = static_cast<int>(bits & k_device_tag_mask);
  try {
    allocator_of(device).record_stream(reinterpret_cast<void*>(bits & ~k_device_tag_mask), to_handle(stream.stream()));
  } catch (...) {
    rethrow_for_torch();
  }
}

c10::CachingDeviceAllocator::DeviceStats torch_allocator::getDeviceStats(c10::DeviceIndex device) {
  try {
    return to_torch(device_stats_of(device));
  } catch (...) {
    rethrow_for_torch();
  }
}

void torch_allocator::resetAccumulatedStats(c10::DeviceIndex device) {
  try {
    reset_accumulated_stats_of(device);
  } catch (...) {
    rethrow_for_torch();
  }
}

void torch_allocator::resetPeakStats(c10::DeviceIndex device) {
  try {
    reset_peak_stats_of(device);
  } catch (...) {
    rethrow_for_torch();
  }
}

// streamalloc records no allocation history, so device_traces stay empty
// whatever `include_traces` asks.
c10::cuda::CUDACachingAllocator::SnapshotInfo torch_allocator::snapshot(c10::MempoolId_t mempool_id,
                                                                        bool /*include_traces*/) {
  try {
    c10::cuda::CUDACachingAllocator::SnapshotInfo out;
    const bool one_pool = mempool_id != c10::MempoolId_t{0, 0};
    const pool_id wanted = one_pool ? to_pool_id(mempool_id) : 0;
    for (const segment_info& segment : collect_segments(k_all_devices)) {
      if (!one_pool || segment.pool == wanted) out.segments.push_back(to_torch(segment));
    }
    out.device_traces.resize(static_cast<std::size_t>(managed_device_count()));
    out.config_metadata = config_metadata();
    return out;
  } catch (...) {
    rethrow_for_torch();
  }
}

void torch_allocator::beginAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id,
                                          std::function<bool(cudaStream_t)> filter) {
  try {
    allocator_of(device).begin_allocate_to_pool(
        to_pool_id(mempool_id), [filter = std::move(filter)](stream_handle stream) { return filter(to_stream(stream)); });
  } catch (...) {
    rethrow_for_torch();
  }
}

void torch_allocator::endAllocateToPool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  try {
    allocator_of(device).end_allocate_to_pool(to_pool_id(mempool_id));
  } catch (...) {
    rethrow_for_torch();
  }
}

// torch calls this from CUDAGraph's destructor, where an exception would
// terminate the process: a failure becomes a warning.
void torch_allocator::releasePool(c10::DeviceIndex device, c10::MempoolId_t mempool_id) {
  try {
    allocator_of(device).release_pool(to_pool_id(mempool_id));
  } catch (const std::exception& e) {
    TORCH_WARN("streamalloc: releasing CUDA graph pool (", mempool_id.first, ", ", mempool_id.second,
               ") failed: ", e.what());
  }
}

void torch_allocator::attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) {
  std::lock_guard<std::mutex> lock(observers_mutex_);
  oom_observers_.push_back(std::move(observer));
}

std::string torch_allocator::name() { return "streamalloc"; }

}  // namespace streamalloc
