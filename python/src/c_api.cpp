// The extern "C" entry points of libstreamalloc.so over the process-wide
// allocators. Each one catches everything: an exception unwinding into
// torch's C callback (or any C caller) would be undefined behaviour.
#include "c_api.h"

#include <cstdarg>
#include <cstddef>
#include <cstdio>
#include <exception>

#include "process_allocator.hpp"
#include "streamalloc/backend/device_backend.hpp"

namespace streamalloc {
namespace {

// A fixed buffer rather than a std::string: recording an error must not
// allocate (or throw) and the buffer needs no thread-exit destructor.
constexpr std::size_t k_last_error_capacity = 2048;
thread_local char last_error_text[k_last_error_capacity] = "";

void clear_error() { last_error_text[0] = '\0'; }

__attribute__((format(printf, 1, 2))) void record_error(const char* format, ...) {
  va_list args;
  va_start(args, format);
  std::vsnprintf(last_error_text, sizeof last_error_text, format, args);
  va_end(args);
}

// Runs `body`, turning any exception into the thread's last error.
template <typename Body>
bool run_guarded(const char* function, Body&& body) {
  try {
    body();
    return true;
  } catch (const std::exception& e) {
    record_error("%s: %s", function, e.what());
  } catch (...) {
    record_error("%s: unknown exception", function);
  }
  return false;
}

stream_handle to_handle(cudaStream_t stream) { return reinterpret_cast<stream_handle>(stream); }

// The allocator of `device` if the process allocators and that device's
// allocator already exist; frees and cache calls never create either.
device_allocator* created_allocator(int device) {
  device_allocators* all = find_process_allocators();
  if (all == nullptr || device < 0 || device >= all->device_count()) return nullptr;
  return all->find(device);
}

}  // namespace
}  // namespace streamalloc

using namespace streamalloc;

extern "C" {

void* streamalloc_malloc(ssize_t size, int device, cudaStream_t stream) {
  clear_error();
  if (size < 0) {
    record_error("streamalloc_malloc: negative size %zd", size);
    return nullptr;
  }
  // An empty tensor needs no memory and must not create the allocators.
  if (size == 0) return nullptr;
  void* ptr = nullptr;
  run_guarded("streamalloc_malloc", [&] {
    ptr = process_allocators().at(device).allocate(static_cast<std::size_t>(size), to_handle(stream));
  });
  return ptr;
}

void streamalloc_free(void* ptr, ssize_t size, int device, cudaStream_t stream) {
  // The block remembers its size and stream; torch passes both anyway.
  (void)size, (void)stream;
  clear_error();
  // In a forked child the block belongs to the parent's CUDA context: the
  // free is a no-op (Note [fork] in process_allocator.cpp).
  if (ptr == nullptr || in_forked_child()) return;
  device_allocator* allocator = created_allocator(device);
  if (allocator == nullptr) {
    record_error("streamalloc_free: %p was not allocated by streamalloc on CUDA device %d", ptr, device);
    return;
  }
  run_guarded("streamalloc_free", [&] { allocator->free(ptr); });
}

int streamalloc_record_stream(void* ptr, int device, cudaStream_t stream) {
  clear_error();
  if (ptr == nullptr) return 0;
  device_allocator* allocator = created_allocator(device);
  if (allocator == nullptr) {
    record_error("streamalloc_record_stream: %p was not allocated by streamalloc on CUDA device %d", ptr, device);
    return -1;
  }
  const bool ok = run_guarded("streamalloc_record_stream", [&] { allocator->record_stream(ptr, to_handle(stream)); });
  return ok ? 0 : -1;
}

int streamalloc_empty_cache(int device) {
  clear_error();
  if (device < -1) {
    record_error("streamalloc_empty_cache: invalid device %d (-1 means every device)", device);
    return -1;
  }
  device_allocators* all = find_process_allocators();
  // Nothing was ever allocated, so nothing is cached.
  if (all == nullptr) return 0;
  if (device >= all->device_count()) {
    record_error("streamalloc_empty_cache: CUDA device %d does not exist (%d visible)", device, all->device_count());
    return -1;
  }
  const bool ok = run_guarded("streamalloc_empty_cache", [&] {
    const int first = device == -1 ? 0 : device;
    const int last = device == -1 ? all->device_count() - 1 : device;
    for (int d = first; d <= last; ++d) {
      if (device_allocator* allocator = all->find(d)) allocator->empty_cache();
    }
  });
  return ok ? 0 : -1;
}

const char* streamalloc_last_error(void) { return last_error_text; }

}  // extern "C"
