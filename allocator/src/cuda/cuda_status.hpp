// cuda_status: a failed CUDA runtime call as a streamalloc status, shared by
// the CUDA targets (device and host backends) and private to them.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "streamalloc/util/status.hpp"

namespace streamalloc {

// The status code a runtime error stands for (no device, out of memory, a
// bad argument, or any other device error).
status_code code_for(cudaError_t error);

// The status of a failed call, "`what` failed: <name>: <text>". It also
// clears the thread's last error, which torch checks after its own
// launches: a failure reported here (an OOM the caching allocator recovers
// from, say) must not surface there. Sticky errors (a faulted context)
// cannot be cleared and keep failing later calls.
status cuda_failure(cudaError_t error, const std::string& what);

}  // namespace streamalloc
