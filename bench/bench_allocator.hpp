// The small interface streamalloc-bench measures every allocator through,
// and the device the allocators run on (a CUDA GPU or the simulated device).
// One adaptor file per allocator implements bench_allocator.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "streamalloc/backend/device_backend.hpp"
#include "streamalloc/core/config.hpp"

namespace streamalloc::bench {

// Streams cross the benchmark as the core's opaque handles: a cudaStream_t
// on a GPU, a sim_backend stream on the simulated device. 0 is the default
// stream.
using bench_stream = stream_handle;

class bench_allocator {
 public:
  virtual ~bench_allocator() = default;

  // The column name in the table and the JSON ("streamalloc", "torch_native", ...).
  virtual const char* name() const = 0;
  // cudaMalloc costs ~100 us a call: patterns give slow allocators fewer
  // iterations so the whole run stays short.
  virtual bool slow() const { return false; }
  // Settings that shape the numbers (a config string), for the report.
  virtual std::string settings() const { return {}; }

  // Both throw (std::bad_alloc, std::runtime_error) instead of returning an
  // error, so the timed loops hold nothing but the two calls.
  virtual void* allocate(std::size_t bytes, bench_stream stream) = 0;
  // `stream` is the stream `ptr` was allocated on: cudaFreeAsync orders the
  // free on it; the caching allocators know it already and ignore it.
  virtual void free(void* ptr, bench_stream stream) = 0;

  // Called after each pattern, outside any timing: hands cached memory back
  // to the device (so every pattern starts from the same device state) and
  // throws std::runtime_error if the allocator still counts live memory or
  // its own consistency checks fail.
  virtual void end_pattern() = 0;
  // Called before a pattern's first timed repetition (after its warm-up).
  virtual void timing_starts() {}
  // Makes `count` arenas, as threads that contended would, so that one
  // thread times a device of several; true when it made any. Allocators
  // without arenas make none.
  virtual bool premake_arenas(int /*count*/) { return false; }
  // What the allocator asked of the device during the last pattern's timed
  // repetitions (device allocations, chunk maps, stream synchronizations,
  // cross-stream hand-offs), and any state left by earlier patterns that
  // changes its speed, as of end_pattern; "" when none or when it cannot
  // tell. Such work costs far more than the allocator's own bookkeeping,
  // so the report names it.
  virtual std::string device_work() const { return {}; }
};

class bench_device {
 public:
  virtual ~bench_device() = default;

  virtual std::string description() const = 0;
  virtual bool simulated() const = 0;
  // A new stream, owned by the device and destroyed with it.
  virtual bench_stream create_stream() = 0;
  // Waits for all work on the device (stream-ordered frees included).
  virtual void synchronize() = 0;
  // The backend streamalloc's caching allocator runs over.
  virtual device_backend& backend() = 0;
};

// The simulated device: sim_backend with events that complete at once.
std::unique_ptr<bench_device> make_sim_device();
// streamalloc's device_allocator over `device`'s backend, through its
// direct C++ API.
std::unique_ptr<bench_allocator> make_streamalloc_adaptor(bench_device& device, const allocator_config& config);

#ifdef STREAMALLOC_BENCH_HAVE_CUDA
// CUDA device 0, or nullptr with *error set when there is no usable GPU.
std::unique_ptr<bench_device> make_cuda_device(std::string* error);
// cudaMallocAsync/cudaFreeAsync on the device's default pool with its
// release threshold at UINT64_MAX (nothing is given back on synchronize).
std::unique_ptr<bench_allocator> make_cuda_async_adaptor(bench_device& device);
// Plain cudaMalloc/cudaFree.
std::unique_ptr<bench_allocator> make_cuda_malloc_adaptor(bench_device& device);
#endif

#ifdef STREAMALLOC_BENCH_HAVE_TORCH
// PyTorch's native caching allocator through c10's raw_alloc_with_stream /
// raw_delete. Throws std::runtime_error when torch's allocator is not the
// native one or PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF is set.
std::unique_ptr<bench_allocator> make_torch_native_adaptor(bench_device& device);
#endif

}  // namespace streamalloc::bench
