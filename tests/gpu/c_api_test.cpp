// [gpu] tests of libstreamalloc.so's extern "C" entry points, reached as
// torch's CUDAPluggableAllocator reaches them: dlopen of the built library
// and dlsym by name. The library holds its own process-wide allocators.
#include <dlfcn.h>

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "c_api.h"
#include "gpu/gpu_support.hpp"
#include "streamalloc/util/bytes.hpp"

using namespace streamalloc;
using streamalloc::testing::contains;
using streamalloc::testing::test_stream;

namespace {

struct c_api {
  void* library = nullptr;
  std::string load_error;
  decltype(&streamalloc_malloc) malloc_fn = nullptr;
  decltype(&streamalloc_free) free_fn = nullptr;
  decltype(&streamalloc_record_stream) record_stream_fn = nullptr;
  decltype(&streamalloc_empty_cache) empty_cache_fn = nullptr;
  decltype(&streamalloc_last_error) last_error_fn = nullptr;

  std::string last_error() const { return last_error_fn(); }
};

template <typename Function>
Function lookup(void* library, const char* name) {
  return reinterpret_cast<Function>(dlsym(library, name));
}

// Loaded once and never closed: its allocators must outlive every test.
const c_api& api() {
  static const c_api loaded = [] {
    c_api a;
    a.library = dlopen(STREAMALLOC_LIBRARY_PATH, RTLD_NOW | RTLD_LOCAL);
    if (a.library == nullptr) {
      a.load_error = dlerror();
      return a;
    }
    a.malloc_fn = lookup<decltype(a.malloc_fn)>(a.library, "streamalloc_malloc");
    a.free_fn = lookup<decltype(a.free_fn)>(a.library, "streamalloc_free");
    a.record_stream_fn = lookup<decltype(a.record_stream_fn)>(a.library, "streamalloc_record_stream");
    a.empty_cache_fn = lookup<decltype(a.empty_cache_fn)>(a.library, "streamalloc_empty_cache");
    a.last_error_fn = lookup<decltype(a.last_error_fn)>(a.library, "streamalloc_last_error");
    return a;
  }();
  INFO("dlopen(" STREAMALLOC_LIBRARY_PATH "): " << loaded.load_error);
  REQUIRE(loaded.library != nullptr);
  REQUIRE(loaded.malloc_fn != nullptr);
  REQUIRE(loaded.free_fn != nullptr);
  REQUIRE(loaded.record_stream_fn != nullptr);
  REQUIRE(loaded.empty_cache_fn != nullptr);
  REQUIRE(loaded.last_error_fn != nullptr);
  return loaded;
}

std::size_t device_free_bytes() {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  STREAMALLOC_CUDA_REQUIRE(cudaMemGetInfo(&free_bytes, &total_bytes));
  return free_bytes;
}

}  // namespace

TEST_CASE("c api: exports exactly the C entry points", "[gpu][c_api]") {
  const c_api& a = api();
  // The C++ inside (core, backend, process allocators) stays hidden so it
  // cannot collide with another copy of streamalloc in the process.
  CHECK(dlsym(a.library, "_ZN11streamalloc18process_allocatorsEv") == nullptr);
  CHECK(dlsym(a.library, "_ZN11streamalloc17cuda_device_countEPNS_6statusE") == nullptr);
}

TEST_CASE("c api: argument errors never need a device", "[gpu][c_api]") {
  const c_api& a = api();
  CHECK(a.malloc_fn(-1, 0, nullptr) == nullptr);
  CHECK(contains(a.last_error(), "streamalloc_malloc: negative size -1"));

  CHECK(a.malloc_fn(0, 0, nullptr) == nullptr);
  CHECK(a.last_error().empty());  // an empty request is not an error

  a.free_fn(nullptr, 0, 0, nullptr);
  CHECK(a.last_error().empty());
  CHECK(a.record_stream_fn(nullptr, 0, nullptr) == 0);

  CHECK(a.empty_cache_fn(-2) == -1);
  CHECK(contains(a.last_error(), "invalid device -2"));

  // The message belongs to the thread that failed.
  std::string other_thread_error = "unset";
  std::thread([&] { other_thread_error = a.last_error(); }).join();
  CHECK(other_thread_error.empty());
  CHECK(!a.last_error().empty());
}

TEST_CASE("c api: without a GPU every call fails softly with a readable error", "[gpu][nogpu][c_api]") {
  STREAMALLOC_REQUIRE_NO_GPU();
  const c_api& a = api();
  CHECK(a.malloc_fn(1 << 20, 0, nullptr) == nullptr);
  const std::string error = a.last_error();
  INFO(error);
  CHECK(contains(error, "streamalloc_malloc"));
  CHECK(contains(error, "cudaGetDeviceCount"));

  int not_ours = 0;
  a.free_fn(&not_ours, sizeof not_ours, 0, nullptr);
  CHECK(contains(a.last_error(), "not allocated by streamalloc"));
  CHECK(a.record_stream_fn(&not_ours, 0, nullptr) == -1);
  CHECK(contains(a.last_error(), "not allocated by streamalloc"));
  CHECK(a.empty_cache_fn(-1) == 0);
  CHECK(a.empty_cache_fn(0) == 0);
}

TEST_CASE("c api: malloc, record_stream and free on a real stream", "[gpu][c_api]") {
  STREAMALLOC_REQUIRE_GPU();
  const c_api& a = api();
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
  test_stream stream;
  test_stream other;
  REQUIRE(stream.get() != nullptr);
  REQUIRE(other.get() != nullptr);

  const std::size_t bytes = 3_MiB + 256;
  void* ptr = a.malloc_fn(static_cast<ssize_t>(bytes), 0, stream.get());
  INFO(a.last_error());
  REQUIRE(ptr != nullptr);
  CHECK(a.last_error().empty());
  cudaPointerAttributes attributes{};
  STREAMALLOC_CUDA_REQUIRE(cudaPointerGetAttributes(&attributes, ptr));
  CHECK(attributes.type == cudaMemoryTypeDevice);
  CHECK(attributes.device == 0);

  std::vector<std::uint8_t> written(bytes);
  for (std::size_t i = 0; i < bytes; ++i) written[i] = static_cast<std::uint8_t>(i * 31 + 7);
  std::vector<std::uint8_t> read(bytes);
  STREAMALLOC_CUDA_REQUIRE(cudaMemcpyAsync(ptr, written.data(), bytes, cudaMemcpyHostToDevice, stream.get()));
  STREAMALLOC_CUDA_REQUIRE(cudaMemcpyAsync(read.data(), ptr, bytes, cudaMemcpyDeviceToHost, stream.get()));
  STREAMALLOC_CUDA_REQUIRE(cudaStreamSynchronize(stream.get()));
  CHECK(read == written);

  CHECK(a.record_stream_fn(ptr, 0, other.get()) == 0);
  a.free_fn(ptr, static_cast<ssize_t>(bytes), 0, stream.get());
  CHECK(a.last_error().empty());

  // Freeing it again is a double free: reported, not a crash.
  a.free_fn(ptr, static_cast<ssize_t>(bytes), 0, stream.get());
  CHECK(contains(a.last_error(), "streamalloc_free"));
}

TEST_CASE("c api: out of memory and bad devices return nullptr with an error", "[gpu][c_api]") {
  STREAMALLOC_REQUIRE_GPU();
  const c_api& a = api();
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  STREAMALLOC_CUDA_REQUIRE(cudaMemGetInfo(&free_bytes, &total_bytes));

  CHECK(a.malloc_fn(static_cast<ssize_t>(total_bytes + 1_GiB), 0, nullptr) == nullptr);
  const std::string error = a.last_error();
  INFO(error);
  CHECK(error.rfind("streamalloc_malloc: ", 0) == 0);
  CHECK(error.size() > std::string("streamalloc_malloc: ").size());
  // torch checks cudaGetLastError() after launches; our OOM must not leak.
  CHECK(cudaGetLastError() == cudaSuccess);

  void* ptr = a.malloc_fn(1 << 20, 0, nullptr);
  CHECK(ptr != nullptr);
  a.free_fn(ptr, 1 << 20, 0, nullptr);

  const int count = streamalloc::testing::visible_device_count();
  CHECK(a.malloc_fn(1 << 20, count, nullptr) == nullptr);
  CHECK(!a.last_error().empty());
  CHECK(a.empty_cache_fn(count) == -1);
  CHECK(contains(a.last_error(), "does not exist"));

  // A real device pointer that streamalloc did not hand out.
  void* foreign = nullptr;
  STREAMALLOC_CUDA_REQUIRE(cudaMalloc(&foreign, 1 << 20));
  a.free_fn(foreign, 1 << 20, 0, nullptr);
  CHECK(contains(a.last_error(), "streamalloc_free"));
  STREAMALLOC_CUDA_REQUIRE(cudaFree(foreign));
}

TEST_CASE("c api: empty_cache returns freed memory to the device", "[gpu][c_api]") {
  STREAMALLOC_REQUIRE_GPU();
  const c_api& a = api();
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
  const std::size_t bytes = 512_MiB;
  void* ptr = a.malloc_fn(static_cast<ssize_t>(bytes), 0, nullptr);
  INFO(a.last_error());
  REQUIRE(ptr != nullptr);
  a.free_fn(ptr, static_cast<ssize_t>(bytes), 0, nullptr);
  const std::size_t cached_free = device_free_bytes();

  CHECK(a.empty_cache_fn(0) == 0);
  CHECK(a.last_error().empty());
  CHECK(device_free_bytes() >= cached_free + bytes);
  CHECK(a.empty_cache_fn(-1) == 0);
}
