/* The plain C entry points of libstreamalloc.so, for
 * torch.cuda.memory.CUDAPluggableAllocator and any C caller. No C++
 * exception ever leaves them: a failure returns nullptr or -1 and leaves a
 * message readable with streamalloc_last_error() on the same thread. */
#pragma once

#include <cuda_runtime_api.h>
#include <sys/types.h>

#define STREAMALLOC_C_EXPORT __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

/* Device memory of at least `size` bytes for use on `stream` of `device`.
 * Size 0 returns NULL without an error; a negative size, an unknown
 * device, no GPU or out-of-memory return NULL with an error. */
STREAMALLOC_C_EXPORT void* streamalloc_malloc(ssize_t size, int device, cudaStream_t stream);

/* Frees a pointer from streamalloc_malloc. NULL is ignored; a pointer the
 * allocator does not own is reported through streamalloc_last_error(). */
STREAMALLOC_C_EXPORT void streamalloc_free(void* ptr, ssize_t size, int device, cudaStream_t stream);

/* Marks that `stream` uses `ptr`, so its memory is reused only after the
 * work queued on `stream` so far has finished. Returns 0, or -1 on error. */
STREAMALLOC_C_EXPORT int streamalloc_record_stream(void* ptr, int device, cudaStream_t stream);

/* Returns unused cached memory of `device` (-1: every device in use) to
 * the driver. Returns 0, or -1 on error. */
STREAMALLOC_C_EXPORT int streamalloc_empty_cache(int device);

/* The message of the last failing call on this thread, or "" when the
 * thread's last call succeeded. Valid until the thread's next call. */
STREAMALLOC_C_EXPORT const char* streamalloc_last_error(void);

#ifdef __cplusplus
}
#endif
