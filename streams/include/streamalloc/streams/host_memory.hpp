// Plain host pages for pinning: anonymous mappings aligned for transparent
// huge pages and pre-faulted by several threads, so that locking them
// (cudaHostRegister) finds every page present. Shared by the CUDA and the
// simulated host backends.
#pragma once

#include <cstddef>

#include "streamalloc/util/status.hpp"

namespace streamalloc {

// Maps at least `bytes` (> 0) of zeroed, read/write anonymous memory,
// 2 MiB-aligned when it is that large, and touches every page with up to
// `touch_threads` threads. unmap_host_pages takes the same `bytes`.
status map_host_pages(std::size_t bytes, int touch_threads, void** out);
status unmap_host_pages(void* ptr, std::size_t bytes);

// Writes one byte of every page of [ptr, ptr + bytes) in parallel so the
// kernel commits the pages now; the bytes written are zero, so freshly
// mapped memory keeps its contents.
void touch_pages(void* ptr, std::size_t bytes, int threads);

}  // namespace streamalloc
