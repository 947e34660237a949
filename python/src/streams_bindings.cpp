// Python bindings of the streams layer: pinned pools whose blocks become
// torch tensors, and the staged pageable-to-device copy. The Python side
// (streamalloc/streams.py) wraps these private names in PinnedPool,
// Prefetcher and to_device.
//
// Note [pinned tensor lifetime]: torch's copy kernels only tell torch's own
// host allocator which stream read a pinned buffer, so a pool tensor cannot
// learn it that way. Its deleter therefore records an event on the stream
// current at the tensor's death, plus every stream named through
// _record_pinned_stream, and the block returns to its pool only when those
// events complete. A copy enqueued earlier on one of those streams is
// covered by stream order; a copy on any other stream must be named.
//
// Note [staged copy stream]: _staged_to_device runs its DMAs on a copy
// stream of its own, so they start at once instead of queueing behind the
// work on the current stream (whose length would also stall the host, which
// waits for DMAs to refill staging slots). The result is allocated on the
// copy stream, so its memory is safe to write there; the current stream
// then waits on an event behind the last chunk, and the result is recorded
// on the current stream, as Tensor.record_stream would.
#include "streams_bindings.hpp"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/core/Storage.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "streamalloc/streams/cuda_host_backend.hpp"
#include "streamalloc/streams/host_workers.hpp"
#include "streamalloc/streams/pinned_pool.hpp"
#include "streamalloc/streams/staged_copy.hpp"
#include "streamalloc/util/errors.hpp"

namespace py = pybind11;

namespace streamalloc {
namespace {

// The process's host backend, copy workers, default pool and one staged
// copy engine per device. Created on first use and never destroyed: pinned
// memory and events must not be released from static destructors, which
// may run after the CUDA runtime has shut down.
class streams_runtime {
 public:
  streams_runtime()
      : backend_(default_copy_parallelism()),
        workers_(default_copy_parallelism()),
        default_pool_(std::make_shared<pinned_pool>(backend_)) {}

  host_backend& backend() { return backend_; }
  host_workers& workers() { return workers_; }
  const std::shared_ptr<pinned_pool>& default_pool() const { return default_pool_; }

  // The staging engine of `device` and its copy stream (Note [staged copy stream]).
  struct staged_device {
    std::unique_ptr<staged_copy_engine> engine;
    cudaStream_t copy_stream = nullptr;
  };

  staged_device& staged_for(int device) {
    std::lock_guard<std::mutex> lock(mutex_);
    staged_device& staged = staged_[device];
    if (!staged.engine) {
      const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
      const cudaError_t error = cudaStreamCreateWithFlags(&staged.copy_stream, cudaStreamNonBlocking);
      if (error != cudaSuccess) {
        (void)cudaGetLastError();
        throw device_failure("to_device: creating a copy stream on CUDA device " + std::to_string(device) +
                             " failed: " + cudaGetErrorString(error));
      }
      staged.engine = std::make_unique<staged_copy_engine>(backend_, *default_pool_, workers_, device);
    }
    return staged;
  }

 private:
  cuda_host_backend backend_;
  host_workers workers_;
  std::shared_ptr<pinned_pool> default_pool_;
  std::mutex mutex_;
  std::map<int, staged_device> staged_;
};

streams_runtime& runtime() {
  static streams_runtime* const instance = new streams_runtime();
  return *instance;
}

// What a pool tensor's DataPtr carries: the pool (kept alive by it) and the
// streams named for Note [pinned tensor lifetime].
struct pool_tensor_context {
  std::shared_ptr<pinned_pool> pool;
  void* ptr = nullptr;
  std::mutex mutex;
  std::vector<stream_use> uses;
};

void delete_pool_tensor(void* raw) {
  auto* context = static_cast<pool_tensor_context*>(raw);
  std::vector<stream_use> uses;
  {
    std::lock_guard<std::mutex> lock(context->mutex);
    uses = context->uses;
  }
  // A deleter must not throw. Without a usable CUDA device no copy can
  // have used the block, so there is no stream to record on.
  try {
    const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream();
    uses.push_back({reinterpret_cast<stream_handle>(current.stream()), current.device_index()});
  } catch (const std::exception&) {
  }
  try {
    context->pool->free(context->ptr, uses);
  } catch (const std::exception&) {
  }
  delete context;
}

std::size_t checked_bytes(c10::IntArrayRef shape, at::ScalarType dtype) {
  std::size_t bytes = c10::elementSize(dtype);
  for (const std::int64_t dim : shape) {
    if (dim < 0) throw usage_error("PinnedPool.empty: negative dimension " + std::to_string(dim));
    const auto extent = static_cast<std::size_t>(dim);
    if (extent != 0 && bytes > std::numeric_limits<std::size_t>::max() / extent) {
      throw usage_error("PinnedPool.empty: the shape is too large");
    }
    bytes *= extent;
  }
  return bytes;
}

// A contiguous CPU tensor of `shape` whose storage is a block of `pool`.
at::Tensor pool_tensor(const std::shared_ptr<pinned_pool>& pool, c10::IntArrayRef shape, at::ScalarType dtype) {
  const std::size_t bytes = checked_bytes(shape, dtype);
  void* ptr = nullptr;
  {
    py::gil_scoped_release no_gil;  // at capacity the pool may wait for a copy
    ptr = pool->allocate(bytes);
  }
  auto context = std::make_unique<pool_tensor_context>();
  context->pool = pool;
  context->ptr = ptr;
  c10::DataPtr data(ptr, context.release(), &delete_pool_tensor, c10::Device(c10::kCPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), bytes, std::move(data), nullptr, false);
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(std::move(storage), 0, shape);
}

// Conjugate and negative views are lazy bits over unchanged bytes; a raw
// byte copy must see the values they stand for.
at::Tensor plain_cpu_source(const at::Tensor& tensor, const char* what) {
  if (tensor.device().type() != c10::kCPU || tensor.layout() != c10::kStrided) {
    throw usage_error(std::string(what) + " takes a dense CPU tensor, got one on " + tensor.device().str());
  }
  return tensor.resolve_conj().resolve_neg().contiguous();
}

at::Tensor pin_copy(const std::shared_ptr<pinned_pool>& pool, const at::Tensor& tensor) {
  const at::Tensor source = plain_cpu_source(tensor, "PinnedPool.pin");
  at::Tensor out = pool_tensor(pool, source.sizes(), source.scalar_type());
  py::gil_scoped_release no_gil;
  runtime().workers().copy(out.data_ptr(), source.data_ptr(), source.nbytes());
  return out;
}

// False when the tensor's memory is not a pool block (nothing to do).
bool record_pinned_stream(const at::Tensor& tensor, c10::Stream stream) {
  if (!tensor.has_storage()) return false;
  const c10::DataPtr& data = tensor.storage().data_ptr();
  auto* context = data.cast_context<pool_tensor_context>(&delete_pool_tensor);
  if (context == nullptr) return false;
  const c10::cuda::CUDAStream cuda_stream(stream);
  const stream_use use{reinterpret_cast<stream_handle>(cuda_stream.stream()), cuda_stream.device_index()};
  std::lock_guard<std::mutex> lock(context->mutex);
  for (const stream_use& known : context->uses) {
    if (known.stream == use.stream && known.device == use.device) return true;
  }
  context->uses.push_back(use);
  return true;
}

// Copies a pageable CPU tensor to `device` through the staging ring (see
// Note [staged copy stream]). Returns once the source may be reused; with
// non_blocking false, once the copy has finished.
at::Tensor staged_to_device(const at::Tensor& tensor, int device, bool non_blocking) {
  const at::Tensor source = plain_cpu_source(tensor, "to_device");
  const auto index = static_cast<c10::DeviceIndex>(device);
  const c10::cuda::CUDAGuard guard(index);
  const c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(index);
  streams_runtime::staged_device& staged = runtime().staged_for(device);
  const c10::cuda::CUDAStream copy_stream = c10::cuda::getStreamFromExternal(staged.copy_stream, index);
  at::Tensor out;
  {
    const c10::cuda::CUDAStreamGuard on_copy_stream(copy_stream);
    out = at::empty(source.sizes(), at::TensorOptions().dtype(source.scalar_type()).device(c10::kCUDA, index));
  }
  if (source.nbytes() == 0) return out;
  {
    py::gil_scoped_release no_gil;
    staged.engine->copy_to_device(out.data_ptr(), source.data_ptr(), source.nbytes(),
                                  reinterpret_cast<stream_handle>(staged.copy_stream));
    at::cuda::CUDAEvent copied;
    copied.record(copy_stream);
    copied.block(current);
    if (!non_blocking) copied.synchronize();
  }
  out.record_stream(current.unwrap());
  return out;
}

// The copy stream of `device`'s staging engine, as an integer (for tests
// that need to delay it).
std::uintptr_t staged_copy_stream(int device) {
  return reinterpret_cast<std::uintptr_t>(runtime().staged_for(device).copy_stream);
}

// Ratios and averages are floats; every other counter is an integer.
py::dict stats_dict(const pinned_pool& pool) {
  py::dict out;
  for (const auto& [key, value] : pool.stats().to_map()) {
    const bool is_float = key == "hit_rate" || (key.size() > 4 && key.compare(key.size() - 4, 4, ".avg") == 0);
    if (is_float) {
      out[py::str(key)] = value;
    } else {
      out[py::str(key)] = static_cast<std::int64_t>(value);
    }
  }
  return out;
}

pinned_pool_config pool_config(std::size_t capacity, const std::string& method) {
  pinned_pool_config config;
  config.capacity_bytes = capacity;
  if (method == "register") {
    config.register_min_bytes = 0;
  } else if (method == "host_alloc") {
    config.register_min_bytes = std::numeric_limits<std::size_t>::max();
  } else if (method != "auto") {
    throw usage_error("pin_method must be 'auto', 'register' or 'host_alloc', got '" + method + "'");
  }
  return config;
}

// Measured in C++ so the figure is the pool's, not the interpreter's.
double time_cached_allocations(pinned_pool& pool, std::size_t bytes, int iterations) {
  pool.free(pool.allocate(bytes));  // the block is cached from here on
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) pool.free(pool.allocate(bytes));
  const std::chrono::duration<double, std::nano> elapsed = std::chrono::steady_clock::now() - start;
  return iterations > 0 ? elapsed.count() / iterations : 0.0;
}

// The Python-visible pool: a shared reference, so pool tensors keep the
// pool alive after the Python object is gone.
struct py_pinned_pool {
  std::shared_ptr<pinned_pool> pool;
};

}  // namespace

void bind_streams(py::module_& m) {
  // Module-local, like the module's own translator (module.cpp).
  py::register_local_exception_translator([](std::exception_ptr pending) {
    try {
      if (pending) std::rethrow_exception(pending);
    } catch (const pinned_out_of_memory& e) {
      PyErr_SetString(PyExc_MemoryError, e.what());
    }
  });

  py::class_<py_pinned_pool>(m, "_PinnedPool",
                             "A pinned host-memory pool; use streamalloc.PinnedPool rather than this class.")
      .def(py::init([](std::size_t capacity, const std::string& pin_method) {
             return py_pinned_pool{
                 std::make_shared<pinned_pool>(runtime().backend(), pool_config(capacity, pin_method))};
           }),
           py::arg("capacity") = 0, py::arg("pin_method") = "auto")
      .def(
          "empty",
          [](const py_pinned_pool& self, const std::vector<std::int64_t>& shape, at::ScalarType dtype) {
            return pool_tensor(self.pool, shape, dtype);
          },
          py::arg("shape"), py::arg("dtype"))
      .def(
          "pin", [](const py_pinned_pool& self, const at::Tensor& tensor) { return pin_copy(self.pool, tensor); },
          py::arg("tensor"))
      .def("stats", [](const py_pinned_pool& self) { return stats_dict(*self.pool); })
      .def(
          "trim", [](const py_pinned_pool& self, std::size_t keep_bytes) { return self.pool->trim(keep_bytes); },
          py::arg("keep_bytes") = 0, py::call_guard<py::gil_scoped_release>())
      .def(
          "process_events", [](const py_pinned_pool& self) { return self.pool->process_events(); },
          py::call_guard<py::gil_scoped_release>())
      .def("reset_peak_stats", [](const py_pinned_pool& self) { self.pool->reset_peak_stats(); })
      .def("reset_accumulated_stats", [](const py_pinned_pool& self) { self.pool->reset_accumulated_stats(); })
      .def("validate", [](const py_pinned_pool& self) { self.pool->validate(); })
      .def_property_readonly("capacity", [](const py_pinned_pool& self) { return self.pool->config().capacity_bytes; })
      .def(
          "_time_cached_allocations",
          [](const py_pinned_pool& self, std::size_t bytes, int iterations) {
            return time_cached_allocations(*self.pool, bytes, iterations);
          },
          py::arg("bytes"), py::arg("iterations"), py::call_guard<py::gil_scoped_release>(),
          "Mean nanoseconds of one allocate + free of `bytes` served from the cache (for benchmarks).");

  m.def(
      "_default_pinned_pool", [] { return py_pinned_pool{runtime().default_pool()}; },
      "The process-wide pinned pool (no capacity) that to_device and Prefetcher stage through.");
  m.def("_record_pinned_stream", &record_pinned_stream, py::arg("tensor"), py::arg("stream"),
        "Makes a PinnedPool tensor's block wait, once the tensor dies, for the work on `stream` enqueued by then. "
        "False (and nothing done) when the tensor's memory is not from a PinnedPool.");
  m.def("_staged_to_device", &staged_to_device, py::arg("tensor"), py::arg("device"), py::arg("non_blocking") = true,
        "Copies a pageable CPU tensor to CUDA device `device` through pinned staging buffers.");
  m.def("_staged_copy_stream", &staged_copy_stream, py::arg("device"),
        "The cudaStream_t (as an int) on which _staged_to_device copies to `device`.");
}

}  // namespace streamalloc
