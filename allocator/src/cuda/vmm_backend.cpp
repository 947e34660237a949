// vmm_backend: the CUDA driver's virtual-memory operations behind the
// device_backend interface. Driver functions come from the runtime's entry
// point lookup, resolved once; every failure becomes a status naming the
// driver call, the device and the driver's error text. Nothing here throws.
#include "streamalloc/backend/vmm_backend.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "cuda_device_guard.hpp"
#include "cuda_status.hpp"
#include "nvtx_ranges.hpp"
#include "streamalloc/util/errors.hpp"

namespace streamalloc {
namespace {

using detail::names;
using detail::trace_range;

// Each PFN_*_vNNNN typedef below is the newest ABI of its function as of
// CUDA 12.0, so asking for every symbol at 12.0 returns exactly these ABIs
// from any newer driver.
constexpr unsigned int k_driver_api_version = 12000;

struct driver_api {
  PFN_cuGetErrorName_v6000 get_error_name = nullptr;
  PFN_cuGetErrorString_v6000 get_error_string = nullptr;
  PFN_cuDeviceGet_v2000 device_get = nullptr;
  PFN_cuDeviceGetAttribute_v2000 device_get_attribute = nullptr;
  PFN_cuMemGetAllocationGranularity_v10020 mem_get_allocation_granularity = nullptr;
  PFN_cuMemAddressReserve_v10020 mem_address_reserve = nullptr;
  PFN_cuMemAddressFree_v10020 mem_address_free = nullptr;
  PFN_cuMemCreate_v10020 mem_create = nullptr;
  PFN_cuMemRelease_v10020 mem_release = nullptr;
  PFN_cuMemMap_v10020 mem_map = nullptr;
  PFN_cuMemUnmap_v10020 mem_unmap = nullptr;
  PFN_cuMemSetAccess_v10020 mem_set_access = nullptr;
  bool complete = false;  // every entry point above was found
  // CUDA IPC of chunks; optional (a driver without them still maps chunks).
  PFN_cuMemExportToShareableHandle_v10020 mem_export = nullptr;
  PFN_cuMemImportFromShareableHandle_v10020 mem_import = nullptr;
};

template <typename function>
bool resolve(const char* symbol, function* out) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t error =
      cudaGetDriverEntryPointByVersion(symbol, &address, k_driver_api_version, cudaEnableDefault, &found);
  if (error != cudaSuccess) {
    // Keep a lookup failure out of torch's later cudaGetLastError() checks.
    (void)cudaGetLastError();
    return false;
  }
  if (found != cudaDriverEntryPointSuccess || address == nullptr) return false;
  *out = reinterpret_cast<function>(address);
  return true;
}

// Resolved on first use; a vmm_backend exists only when `complete`.
const driver_api& driver() {
  static const driver_api table = [] {
    driver_api api;
    api.complete = resolve("cuGetErrorName", &api.get_error_name) &&
                   resolve("cuGetErrorString", &api.get_error_string) &&
                   resolve("cuDeviceGet", &api.device_get) &&
                   resolve("cuDeviceGetAttribute", &api.device_get_attribute) &&
                   resolve("cuMemGetAllocationGranularity", &api.mem_get_allocation_granularity) &&
                   resolve("cuMemAddressReserve", &api.mem_address_reserve) &&
                   resolve("cuMemAddressFree", &api.mem_address_free) &&
                   resolve("cuMemCreate", &api.mem_create) &&
                   resolve("cuMemRelease", &api.mem_release) &&
                   resolve("cuMemMap", &api.mem_map) &&
                   resolve("cuMemUnmap", &api.mem_unmap) &&
                   resolve("cuMemSetAccess", &api.mem_set_access);
    resolve("cuMemExportToShareableHandle", &api.mem_export);
    resolve("cuMemImportFromShareableHandle", &api.mem_import);
    return api;
  }();
  return table;
}

std::string describe(CUresult result) {
  const driver_api& api = driver();
  const char* name = nullptr;
  const char* text = nullptr;
  // cuGetError* refuse codes they do not know; the number still helps.
  if (api.get_error_name(result, &name) != CUDA_SUCCESS || name == nullptr) {
    return "unknown CUresult " + std::to_string(static_cast<int>(result));
  }
  if (api.get_error_string(result, &text) != CUDA_SUCCESS || text == nullptr) return name;
  return std::string(name) + ": " + text;
}

status failure(CUresult result, int device, const std::string& what) {
  const status_code code = result == CUDA_ERROR_OUT_OF_MEMORY ? status_code::out_of_memory : status_code::device_error;
  return {code, what + " on CUDA device " + std::to_string(device) + " failed: " + describe(result)};
}

status guard_failure(const cuda_device_guard& guard, int device) {
  (void)cudaGetLastError();
  return {status_code::device_error, "cudaSetDevice on CUDA device " + std::to_string(device) + " failed: " +
                                         cudaGetErrorName(guard.error()) + ": " + cudaGetErrorString(guard.error())};
}

status invalid(const std::string& message) { return {status_code::invalid_argument, "vmm_backend: " + message}; }

std::string hex(std::uintptr_t value) {
  char text[2 + 2 * sizeof value + 1];
  std::snprintf(text, sizeof text, "0x%jx", static_cast<std::uintmax_t>(value));
  return text;
}

std::uintptr_t address_of(const void* address) { return reinterpret_cast<std::uintptr_t>(address); }
CUdeviceptr device_pointer(const void* address) { return static_cast<CUdeviceptr>(address_of(address)); }

CUmemAccessDesc read_write_access(int device) {
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  return access;
}

status check_bytes(const char* operation, std::size_t bytes, std::size_t granularity) {
  if (bytes != 0 && bytes % granularity == 0) return status::success();
  return invalid(std::string(operation) + ": " + std::to_string(bytes) +
                 " bytes is not a positive multiple of the granularity " + std::to_string(granularity));
}

status check_address(const char* operation, const void* address, std::size_t granularity) {
  if (address == nullptr) return invalid(std::string(operation) + ": the address is null");
  if (address_of(address) % granularity != 0) {
    return invalid(std::string(operation) + ": " + hex(address_of(address)) + " is not aligned to the granularity " +
                   std::to_string(granularity));
  }
  return status::success();
}

// Where physical chunks live: pinned memory of `device`, exportable as a
// POSIX file descriptor when `exportable` (CUDA IPC, as torch's own
// expandable segments are).
CUmemAllocationProp chunk_properties(int device, bool exportable) {
  CUmemAllocationProp properties{};
  properties.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  properties.requestedHandleTypes = exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
  properties.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  properties.location.id = device;
  return properties;
}

}  // namespace

// The driver's memory calls act through the calling thread's context; each
// operation makes the backend's device current (its primary context) so the
// caller's current device never decides where a chunk lives or is mapped.

std::unique_ptr<device_backend> vmm_backend::create(int device) {
  const driver_api& api = driver();
  if (!api.complete) return nullptr;
  cuda_device_guard guard(device);
  if (!guard.ok()) {
    (void)cudaGetLastError();
    return nullptr;
  }
  CUdevice handle = 0;
  int supported = 0;
  if (api.device_get(&handle, device) != CUDA_SUCCESS ||
      api.device_get_attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, handle) !=
          CUDA_SUCCESS ||
      supported == 0) {
    return nullptr;
  }
  const CUmemAllocationProp properties = chunk_properties(device, false);
  std::size_t granularity = 0;
  if (api.mem_get_allocation_granularity(&granularity, &properties, CU_MEM_ALLOC_GRANULARITY_MINIMUM) !=
          CUDA_SUCCESS ||
      granularity == 0) {
    return nullptr;
  }
  return std::unique_ptr<device_backend>(new vmm_backend(device, granularity));
}

status vmm_backend::vm_reserve(std::size_t bytes, void** out_range) {
  if (out_range == nullptr) return invalid("vm_reserve: out_range is null");
  if (status s = check_bytes("vm_reserve", bytes, granularity_); !s) return s;
  cuda_device_guard guard(device_index());
  if (!guard.ok()) return guard_failure(guard, device_index());
  CUdeviceptr base = 0;
  const CUresult result = driver().mem_address_reserve(&base, bytes, granularity_, 0, 0);
  if (result != CUDA_SUCCESS) return failure(result, device_index(), "cuMemAddressReserve(" + format_bytes(bytes) + ")");
  *out_range = reinterpret_cast<void*>(static_cast<std::uintptr_t>(base));
  return status::success();
}

status vmm_backend::vm_release(void* range, std::size_t bytes) {
  if (status s = check_address("vm_release", range, granularity_); !s) return s;
  if (status s = check_bytes("vm_release", bytes, granularity_); !s) return s;
  cuda_device_guard guard(device_index());
  if (!guard.ok()) return guard_failure(guard, device_index());
  const CUresult result = driver().mem_address_free(device_pointer(range), bytes);
  if (result != CUDA_SUCCESS) {
    return failure(result, device_index(),
                   "cuMemAddressFree(" + hex(address_of(range)) + ", " + format_bytes(bytes) + ")");
  }
  return status::success();
}

status vmm_backend::vm_create(std::size_t bytes, physical_handle* out) {
  if (out == nullptr) return invalid("vm_create: out is null");
  if (status s = check_bytes("vm_create", bytes, granularity_); !s) return s;
  cuda_device_guard guard(device_index());
  if (!guard.ok()) return guard_failure(guard, device_index());
  CUmemGenericAllocationHandle chunk = 0;
  // Exportable chunks first; a driver or platform that refuses exportable
  // memory (anything but out-of-memory) gets plain chunks from then on,
  // and vm_export reports that sharing is unsupported.
  CUresult result = CUDA_ERROR_NOT_SUPPORTED;
  if (exportable_.load(std::memory_order_relaxed)) {
    const CUmemAllocationProp properties = chunk_properties(device_index(), true);
    result = driver().mem_create(&chunk, bytes, &properties, 0);
    if (result != CUDA_SUCCESS && result != CUDA_ERROR_OUT_OF_MEMORY) exportable_.store(false, std::memory_order_relaxed);
  }
  if (result != CUDA_SUCCESS && result != CUDA_ERROR_OUT_OF_MEMORY) {
    const CUmemAllocationProp properties = chunk_properties(device_index(), false);
    result = driver().mem_create(&chunk, bytes, &properties, 0);
  }
  if (result != CUDA_SUCCESS) return failure(result, device_index(), "cuMemCreate(" + format_bytes(bytes) + ")");
  *out = chunk;
  return status::success();
}

status vmm_backend::vm_destroy(physical_handle chunk) {
  cuda_device_guard guard(device_index());
  if (!guard.ok()) return guard_failure(guard, device_index());
  {
    std::lock_guard<std::mutex> lock(exported_mutex_);
    auto it = exported_.find(chunk);
    if (it != exported_.end()) {
      ::close(it->second);
      exported_.erase(it);
    }
  }
  const CUresult result = driver().mem_release(chunk);
  if (result != CUDA_SUCCESS) return failure(result, device_index(), "cuMemRelease(chunk " + hex(chunk) + ")");
  return status::success();
}

status vmm_backend::vm_map(void* address, std::size_t bytes, physical_handle chunk) {
  if (status s = check_address("vm_map", address, granularity_); !s) return s;
  if (status s = check_bytes("vm_map", bytes, granularity_); !s) return s;
  trace_range range(names().map, bytes);
  cuda_device_guard guard(device_index());
  if (!guard.ok()) return guard_failure(guard, device_index());
  const driver_api& api = driver();
  const CUdeviceptr at = device_pointer(address);
  const std::string where = format_bytes(bytes) + " at " + hex(address_of(address));
  CUresult result = api.mem_map(at, bytes, 0, chunk, 0);
  if (result != CUDA_SUCCESS) return failure(result, device_index(), "cuMemMap(chunk " + hex(chunk) + ", " + where + ")");
  const CUmemAccessDesc access = read_write_access(device_index());
  result = api.mem_set_access(at, bytes, &access, 1);
  if (result != CUDA_SUCCESS) {
    // A mapping nobody may touch is useless; undo it so the caller sees
    // the range exactly as before the call.
    (void)api.mem_unmap(at, bytes);
    return failure(result, device_index(), "cuMemSetAccess(" + where + ")");
  }
  return status::success();
}

status vmm_backend::vm_unmap(void* address, std::size_t bytes) {
  if (status s = check_address("vm_unmap", address, granularity_); !s) return s;
  if (status s = check_bytes("vm_unmap", bytes, granularity_); !s) return s;
  trace_range range(names().unmap, bytes);
  cuda_device_guard guard(device_index());
  if (!guard.ok()) return guard_failure(guard, device_index());
  const CUresult result = driver().mem_unmap(device_pointer(address), bytes);
  if (result != CUDA_SUCCESS) {
    return failure(result, device_index(), "cuMemUnmap(" + format_bytes(bytes) + " at " + hex(address_of(address)) + ")");
  }
  return status::success();
}

status vmm_backend::vm_allow_peer(void* address, std::size_t bytes, int peer_device) {
  if (status s = check_address("vm_allow_peer", address, granularity_); !s) return s;
  if (status s = check_bytes("vm_allow_peer", bytes, granularity_); !s) return s;
  cuda_device_guard guard(device_index());
  if (!guard.ok()) return guard_failure(guard, device_index());
  const CUmemAccessDesc access = read_write_access(peer_device);
  const CUresult result = driver().mem_set_access(device_pointer(address), bytes, &access, 1);
  if (result != CUDA_SUCCESS) {
    return failure(result, device_index(),
                   "cuMemSetAccess(" + format_bytes(bytes) + " at " + hex(address_of(address)) + " for device " +
                       std::to_string(peer_device) + ")");
  }
  return status::success();
}

status vmm_backend::vm_export(physical_handle chunk, int* out_fd) {
  if (out_fd == nullptr) return invalid("vm_export: out_fd is null");
  const driver_api& api = driver();
  if (api.mem_export == nullptr) return unsupported_export("the driver has no cuMemExportToShareableHandle");
  std::lock_guard<std::mutex> lock(exported_mutex_);
  if (auto it = exported_.find(chunk); it != exported_.end()) {
    *out_fd = it->second;
    return status::success();
  }
  cuda_device_guard guard(device_index());
  if (!guard.ok()) return guard_failure(guard, device_index());
  int fd = -1;
  const CUresult result = api.mem_export(&fd, chunk, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (result != CUDA_SUCCESS) {
    if (!exportable_.load(std::memory_order_relaxed)) {
      return unsupported_export("this device or driver refused exportable chunks (" + describe(result) + ")");
    }
    return failure(result, device_index(), "cuMemExportToShareableHandle(chunk " + hex(chunk) + ")");
  }
  exported_.emplace(chunk, fd);
  *out_fd = fd;
  return status::success();
}

status vmm_backend::unsupported_export(const std::string& why) const {
  return {status_code::not_supported, "CUDA IPC of expandable-segment memory on device " +
                                          std::to_string(device_index()) + " is not available: " + why +
                                          ". Set STREAMALLOC_CONF=expandable_segments:False in the sending process."};
}

// ---------------------------------------------------------------------------
// Chunks exported by another process

namespace {

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif

status os_failure(const std::string& what, int error) {
  return {status_code::device_error, what + " failed: " + std::strerror(error)};
}

}  // namespace

status import_chunks(int device, int sender_pid, const std::vector<int>& sender_fds, std::size_t chunk_bytes,
                     imported_chunks* out) {
  if (out == nullptr) return invalid("import_chunks: out is null");
  const driver_api& api = driver();
  if (!api.complete || api.mem_import == nullptr) {
    return {status_code::not_supported, "the CUDA driver cannot import shared virtual memory"};
  }
  if (sender_fds.empty() || chunk_bytes == 0) return invalid("import_chunks: nothing to import");
  cuda_device_guard guard(device);
  if (!guard.ok()) return guard_failure(guard, device);

  const long pidfd = ::syscall(SYS_pidfd_open, sender_pid, 0);
  if (pidfd < 0) {
    const int error = errno;
    if (error == ENOSYS) {
      return {status_code::not_supported,
              "this kernel lacks pidfd_open, which CUDA IPC of expandable-segment memory needs; set "
              "STREAMALLOC_CONF=expandable_segments:False in the sending process"};
    }
    return os_failure("pidfd_open(" + std::to_string(sender_pid) + ")", error);
  }
  imported_chunks range;
  range.bytes = chunk_bytes * sender_fds.size();
  status result = status::success();
  for (int sender_fd : sender_fds) {
    const long fd = ::syscall(SYS_pidfd_getfd, static_cast<int>(pidfd), sender_fd, 0);
    if (fd < 0) {
      result = os_failure("pidfd_getfd(" + std::to_string(sender_fd) + ")", errno);
      break;
    }
    CUmemGenericAllocationHandle chunk = 0;
    const CUresult imported = api.mem_import(&chunk, reinterpret_cast<void*>(static_cast<std::uintptr_t>(fd)),
                                             CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    ::close(static_cast<int>(fd));
    if (imported != CUDA_SUCCESS) {
      result = failure(imported, device, "cuMemImportFromShareableHandle");
      break;
    }
    range.chunks.push_back(chunk);
  }
  ::close(static_cast<int>(pidfd));
  CUdeviceptr base = 0;
  if (result.ok()) {
    const CUresult reserved = api.mem_address_reserve(&base, range.bytes, 0, 0, 0);
    if (reserved != CUDA_SUCCESS) result = failure(reserved, device, "cuMemAddressReserve(" + format_bytes(range.bytes) + ")");
  }
  std::size_t mapped = 0;
  const CUmemAccessDesc access = read_write_access(device);
  for (; result.ok() && mapped < range.chunks.size(); ++mapped) {
    const CUdeviceptr at = base + mapped * chunk_bytes;
    CUresult step = api.mem_map(at, chunk_bytes, 0, range.chunks[mapped], 0);
    if (step == CUDA_SUCCESS) {
      step = api.mem_set_access(at, chunk_bytes, &access, 1);
      if (step != CUDA_SUCCESS) (void)api.mem_unmap(at, chunk_bytes);
    }
    if (step != CUDA_SUCCESS) {
      result = failure(step, device, "mapping an imported chunk");
      break;
    }
  }
  if (!result.ok()) {
    for (std::size_t i = 0; i < mapped; ++i) (void)api.mem_unmap(base + i * chunk_bytes, chunk_bytes);
    if (base != 0) (void)api.mem_address_free(base, range.bytes);
    for (physical_handle chunk : range.chunks) (void)api.mem_release(chunk);
    return result;
  }
  range.device = device;
  range.address = reinterpret_cast<void*>(static_cast<std::uintptr_t>(base));
  *out = std::move(range);
  return status::success();
}

status release_imported_chunks(const imported_chunks& range) {
  const driver_api& api = driver();
  if (range.address == nullptr) return status::success();
  cuda_device_guard guard(range.device);
  if (!guard.ok()) return guard_failure(guard, range.device);
  const std::size_t chunk_bytes = range.bytes / range.chunks.size();
  const CUdeviceptr base = device_pointer(range.address);
  // cuMemUnmap does not wait for work that still reads the range, and its
  // last reader may have run on any stream of this process: wait for all.
  status result = status::success();
  if (const cudaError_t synced = cudaDeviceSynchronize(); synced != cudaSuccess) {
    result = cuda_failure(synced, "cudaDeviceSynchronize before unmapping imported memory on CUDA device " +
                                      std::to_string(range.device));
  }
  for (std::size_t i = 0; i < range.chunks.size(); ++i) {
    const CUresult step = api.mem_unmap(base + i * chunk_bytes, chunk_bytes);
    if (step != CUDA_SUCCESS && result.ok()) result = failure(step, range.device, "cuMemUnmap of an imported chunk");
  }
  for (physical_handle chunk : range.chunks) {
    const CUresult step = api.mem_release(chunk);
    if (step != CUDA_SUCCESS && result.ok()) result = failure(step, range.device, "cuMemRelease of an imported chunk");
  }
  const CUresult freed = api.mem_address_free(base, range.bytes);
  if (freed != CUDA_SUCCESS && result.ok()) result = failure(freed, range.device, "cuMemAddressFree of an imported range");
  return result;
}

}  // namespace streamalloc
