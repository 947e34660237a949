// CUDA IPC handles: see the header.
#include "cuda_ipc.hpp"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <sstream>
#include <string_view>
#include <vector>

#include "streamalloc/backend/vmm_backend.hpp"
#include "streamalloc/util/shared_chunks.hpp"

namespace streamalloc {
namespace {

// torch's handle layout (the versioned form; a bare cudaIpcMemHandle_t of
// CUDA_IPC_HANDLE_SIZE bytes is the legacy form).
constexpr char k_handle_version = 2;
constexpr char k_plain_segment = 'c';
constexpr char k_expandable_segment = 'e';

std::mutex& open_handles_mutex() {
  static auto* const mutex = new std::mutex;
  return *mutex;
}

// Handles opened in this process: the runtime refuses to open one handle
// twice, so a second request shares the first mapping.
std::map<std::string, std::weak_ptr<void>>& open_handles() {
  static auto* const handles = new std::map<std::string, std::weak_ptr<void>>;
  return *handles;
}

std::shared_ptr<void> open_plain(const char* bytes, c10::DeviceIndex device) {
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, bytes, sizeof handle);
  void* ptr = nullptr;
  C10_CUDA_CHECK(cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess));
  return std::shared_ptr<void>(ptr, [device](void* opened) {
    c10::cuda::CUDAGuard guard(device);
    // Closing in a destructor: a failure is reported, never thrown.
    C10_CUDA_CHECK_WARN(cudaIpcCloseMemHandle(opened));
  });
}

std::shared_ptr<void> open_expandable(std::string_view bytes, c10::DeviceIndex device) {
  shared_chunks chunks;
  TORCH_CHECK(decode_shared_chunks(bytes, &chunks), "streamalloc: malformed CUDA IPC handle of an expandable segment");
  imported_chunks range;
  const status st = import_chunks(device, chunks.pid, chunks.fds, chunks.chunk_bytes, &range);
  TORCH_CHECK(st.ok(), "streamalloc: cannot open the CUDA IPC handle of an expandable segment: ", st.message());
  auto* owned = new imported_chunks(std::move(range));
  return std::shared_ptr<void>(owned->address, [owned](void*) {
    const status released = release_imported_chunks(*owned);
    if (!released.ok()) TORCH_WARN("streamalloc: releasing imported CUDA IPC memory: ", released.message());
    delete owned;
  });
}

}  // namespace

c10::cuda::CUDACachingAllocator::ShareableHandle share_ipc_handle(device_allocator& allocator, void* ptr) {
  const device_allocator::shareable_range range = allocator.share_range(ptr);
  std::ostringstream out;
  out.put(k_handle_version);
  if (!range.expandable) {
    out.put(k_plain_segment);
    cudaIpcMemHandle_t handle;
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(allocator.device()));
    C10_CUDA_CHECK(cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(range.address)));
    out.write(reinterpret_cast<const char*>(&handle), sizeof handle);
  } else {
    out.put(k_expandable_segment);
    shared_chunks chunks{static_cast<int>(::getpid()), range.chunk_bytes, {}};
    for (physical_handle chunk : range.chunks) {
      int fd = -1;
      const status st = allocator.backend().vm_export(chunk, &fd);
      TORCH_CHECK(st.ok(), "streamalloc: cannot share this tensor with another process: ", st.message());
      chunks.fds.push_back(fd);
    }
    out << encode_shared_chunks(chunks);
  }
  return {static_cast<ptrdiff_t>(reinterpret_cast<std::uintptr_t>(ptr) - range.address), out.str()};
}

std::shared_ptr<void> open_ipc_handle(const std::string& handle) {
  const c10::DeviceIndex device = c10::cuda::current_device();
  std::lock_guard<std::mutex> lock(open_handles_mutex());
  auto& opened = open_handles();
  if (auto it = opened.find(handle); it != opened.end()) {
    if (std::shared_ptr<void> existing = it->second.lock()) return existing;
  }
  std::shared_ptr<void> result;
  if (handle.size() == CUDA_IPC_HANDLE_SIZE) {
    result = open_plain(handle.data(), device);
  } else {
    TORCH_CHECK(handle.size() >= 2 && handle[0] == k_handle_version,
                "streamalloc: unknown CUDA IPC handle format (version ", handle.empty() ? -1 : int(handle[0]), ")");
    if (handle[1] == k_plain_segment) {
      TORCH_CHECK(handle.size() == 2 + CUDA_IPC_HANDLE_SIZE, "streamalloc: malformed CUDA IPC handle");
      result = open_plain(handle.data() + 2, device);
    } else {
      TORCH_CHECK(handle[1] == k_expandable_segment, "streamalloc: unknown CUDA IPC handle type '", handle[1], "'");
      result = open_expandable(std::string_view(handle).substr(2), device);
    }
  }
  for (auto it = opened.begin(); it != opened.end();) {
    it = it->second.expired() ? opened.erase(it) : std::next(it);
  }
  opened[handle] = result;
  return result;
}

}  // namespace streamalloc
