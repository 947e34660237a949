// CUDA IPC for torch.multiprocessing: the handle a sending process gives
// for a streamalloc allocation, and the memory a receiving process opens
// from a handle. Handles use torch's own layout (a version byte, then 'c'
// with a cudaIpcMemHandle_t for plain segments, or 'e' with the sender's
// pid, chunk size and one file descriptor per chunk for expandable
// segments), so streamalloc and torch's native allocator exchange tensors
// in both directions.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>

#include <memory>
#include <string>

#include "streamalloc/core/device_allocator.hpp"

namespace streamalloc {

// The handle and offset for the live allocation `ptr` of `allocator`.
// Throws c10::Error naming the reason when the platform cannot share it.
c10::cuda::CUDACachingAllocator::ShareableHandle share_ipc_handle(device_allocator& allocator, void* ptr);

// Opens a handle from another process on the current device; the memory
// stays mapped until the last copy of the returned pointer is dropped. A
// handle opened twice returns the same mapping.
std::shared_ptr<void> open_ipc_handle(const std::string& handle);

}  // namespace streamalloc
