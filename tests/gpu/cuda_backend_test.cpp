// [gpu] tests of cuda_backend on a real device, and of the caching
// allocator core running on it. Without a GPU they skip visibly; the
// [nogpu] cases prove the failure path instead.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gpu/gpu_support.hpp"
#include "streamalloc/backend/cuda_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/device_allocators.hpp"
#include "streamalloc/util/bytes.hpp"
#include "streamalloc/util/errors.hpp"

using namespace streamalloc;
using streamalloc::testing::contains;
using streamalloc::testing::queue_work;
using streamalloc::testing::test_buffer;
using streamalloc::testing::test_stream;

namespace {

constexpr int k_work_rounds = 64;
constexpr auto k_all = static_cast<std::size_t>(stat_type::all);

std::unique_ptr<device_backend> backend_for(int device) {
  status error;
  std::unique_ptr<device_backend> backend = make_cuda_backend(device, &error);
  INFO(error.message());
  REQUIRE(backend != nullptr);
  return backend;
}

int device_of(const void* ptr) {
  cudaPointerAttributes attributes{};
  STREAMALLOC_CUDA_REQUIRE(cudaPointerGetAttributes(&attributes, ptr));
  REQUIRE(attributes.type == cudaMemoryTypeDevice);
  return attributes.device;
}

std::size_t device_free_bytes() {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  STREAMALLOC_CUDA_REQUIRE(cudaMemGetInfo(&free_bytes, &total_bytes));
  return free_bytes;
}

std::vector<std::uint32_t> pattern(std::size_t words, std::uint32_t seed) {
  std::vector<std::uint32_t> values(words);
  for (std::size_t i = 0; i < words; ++i) values[i] = seed * 0x9E3779B1u ^ static_cast<std::uint32_t>(i);
  return values;
}

}  // namespace

TEST_CASE("cuda backend: without a GPU the factory fails with no_device", "[gpu][nogpu]") {
  STREAMALLOC_REQUIRE_NO_GPU();
  status error;
  CHECK(cuda_device_count(&error) == 0);
  CHECK(error.code() == status_code::no_device);
  INFO(error.message());
  CHECK(contains(error.message(), "cudaGetDeviceCount"));
  CHECK(contains(error.message(), "cudaError"));

  status factory_error;
  CHECK(make_cuda_backend(0, &factory_error) == nullptr);
  CHECK(factory_error.code() == status_code::no_device);
  CHECK(factory_error.message() == error.message());
  CHECK(make_cuda_backend(0, nullptr) == nullptr);

  device_allocators allocators(1, make_cuda_backend, allocator_config{});
  REQUIRE_THROWS_AS(allocators.at(0), device_failure);
}

TEST_CASE("cuda backend: segments come from and go back to the device", "[gpu]") {
  STREAMALLOC_REQUIRE_GPU();
  auto backend = backend_for(0);
  CHECK(backend->device_index() == 0);

  device_memory_info before;
  REQUIRE(backend->memory_info(&before).ok());
  CHECK(before.total_bytes > 1_GiB);
  CHECK(before.free_bytes <= before.total_bytes);

  const std::size_t bytes = 256_MiB;
  void* ptr = nullptr;
  REQUIRE(backend->allocate_segment(bytes, &ptr).ok());
  REQUIRE(ptr != nullptr);
  CHECK(device_of(ptr) == 0);
  STREAMALLOC_CUDA_REQUIRE(cudaMemset(ptr, 0x5a, bytes));

  device_memory_info held;
  REQUIRE(backend->memory_info(&held).ok());
  CHECK(held.total_bytes == before.total_bytes);
  CHECK(held.free_bytes + bytes <= before.free_bytes);

  REQUIRE(backend->free_segment(ptr, bytes).ok());
  device_memory_info after;
  REQUIRE(backend->memory_info(&after).ok());
  CHECK(after.free_bytes >= held.free_bytes + bytes);
}

TEST_CASE("cuda backend: the device's processes, this one with what it holds", "[gpu]") {
  STREAMALLOC_REQUIRE_GPU();
  auto backend = backend_for(0);
  const std::size_t bytes = 256_MiB;
  void* ptr = nullptr;
  REQUIRE(backend->allocate_segment(bytes, &ptr).ok());
  std::vector<device_process> processes;
  const status listed = backend->device_processes(&processes);
  INFO(listed.message());
  // NVML may be missing; anything else is a bug.
  REQUIRE((listed.ok() || listed.code() == status_code::not_supported));
  if (listed.ok()) {
    const auto self = static_cast<std::uint32_t>(::getpid());
    for (const device_process& p : processes) {
      if (p.pid == self) CHECK(p.used_bytes >= bytes);
    }
  }
  REQUIRE(backend->free_segment(ptr, bytes).ok());
}

TEST_CASE("cuda backend: runtime failures become statuses with the CUDA error", "[gpu]") {
  STREAMALLOC_REQUIRE_GPU();
  auto backend = backend_for(0);
  device_memory_info info;
  REQUIRE(backend->memory_info(&info).ok());

  SECTION("a segment larger than the device is out_of_memory") {
    void* ptr = nullptr;
    const status result = backend->allocate_segment(info.total_bytes + 1_GiB, &ptr);
    INFO(result.message());
    CHECK(result.code() == status_code::out_of_memory);
    CHECK(contains(result.message(), "cudaMalloc"));
    CHECK(contains(result.message(), "cudaErrorMemoryAllocation"));
    CHECK(ptr == nullptr);
    // torch checks cudaGetLastError() after its launches: the OOM we
    // reported must not surface there.
    CHECK(cudaGetLastError() == cudaSuccess);
    // The device is still usable.
    REQUIRE(backend->allocate_segment(2_MiB, &ptr).ok());
    REQUIRE(backend->free_segment(ptr, 2_MiB).ok());
  }
  SECTION("freeing memory that is not a segment is an error status") {
    int not_device_memory = 0;
    const status result = backend->free_segment(&not_device_memory, sizeof not_device_memory);
    INFO(result.message());
    CHECK(!result.ok());
    CHECK(contains(result.message(), "cudaFree"));
    CHECK(cudaGetLastError() == cudaSuccess);
  }
  SECTION("malformed calls are invalid_argument") {
    void* ptr = nullptr;
    CHECK(backend->allocate_segment(0, &ptr).code() == status_code::invalid_argument);
    CHECK(backend->free_segment(nullptr, 1_MiB).code() == status_code::invalid_argument);
    CHECK(backend->query_event(0, nullptr).code() == status_code::invalid_argument);
  }
}

TEST_CASE("cuda backend: the caller's current device is left unchanged", "[gpu]") {
  STREAMALLOC_REQUIRE_GPU();
  const int count = streamalloc::testing::visible_device_count();
  if (count < 2) {
    WARN("skipped: needs 2 GPUs to observe a device switch (" << count << " visible)");
    return;
  }
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(count - 1));
  auto backend = backend_for(0);
  void* ptr = nullptr;
  REQUIRE(backend->allocate_segment(2_MiB, &ptr).ok());
  CHECK(device_of(ptr) == 0);
  event_handle event = 0;
  REQUIRE(backend->create_event(&event).ok());
  REQUIRE(backend->record_event(event, 0).ok());
  REQUIRE(backend->synchronize_device().ok());
  REQUIRE(backend->destroy_event(event).ok());
  REQUIRE(backend->free_segment(ptr, 2_MiB).ok());
  int current = -1;
  STREAMALLOC_CUDA_REQUIRE(cudaGetDevice(&current));
  CHECK(current == count - 1);
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
}

TEST_CASE("cuda backend: events track real stream work", "[gpu]") {
  STREAMALLOC_REQUIRE_GPU();
  auto backend = backend_for(0);
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
  test_stream stream;
  REQUIRE(stream.get() != nullptr);
  test_buffer buffer(1_GiB);
  REQUIRE(buffer.get() != nullptr);

  event_handle event = 0;
  REQUIRE(backend->create_event(&event).ok());
  bool done = false;
  REQUIRE(backend->query_event(event, &done).ok());
  CHECK(done);  // never recorded: nothing to wait for

  STREAMALLOC_CUDA_REQUIRE(queue_work(stream.get(), buffer, k_work_rounds));
  REQUIRE(backend->record_event(event, stream.handle()).ok());
  REQUIRE(backend->query_event(event, &done).ok());
  CHECK(!done);
  // cudaErrorNotReady is an answer, not an error, and must not linger.
  CHECK(cudaGetLastError() == cudaSuccess);

  REQUIRE(backend->synchronize_event(event).ok());
  REQUIRE(backend->query_event(event, &done).ok());
  CHECK(done);
  CHECK(cudaStreamQuery(stream.get()) == cudaSuccess);

  // Stream handle 0 is the device's default stream.
  STREAMALLOC_CUDA_REQUIRE(cudaMemsetAsync(buffer.get(), 1, buffer.bytes(), nullptr));
  REQUIRE(backend->record_event(event, 0).ok());
  REQUIRE(backend->synchronize_device().ok());
  REQUIRE(backend->query_event(event, &done).ok());
  CHECK(done);

  REQUIRE(backend->destroy_event(event).ok());
}

TEST_CASE("cuda backend: stream_wait_event orders a second stream after the first", "[gpu]") {
  STREAMALLOC_REQUIRE_GPU();
  auto backend = backend_for(0);
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
  test_stream producer;
  test_stream consumer;
  REQUIRE(producer.get() != nullptr);
  REQUIRE(consumer.get() != nullptr);
  test_buffer buffer(1_GiB);
  REQUIRE(buffer.get() != nullptr);

  event_handle produced = 0;
  event_handle consumed = 0;
  REQUIRE(backend->create_event(&produced).ok());
  REQUIRE(backend->create_event(&consumed).ok());

  STREAMALLOC_CUDA_REQUIRE(queue_work(producer.get(), buffer, k_work_rounds));
  REQUIRE(backend->record_event(produced, producer.handle()).ok());
  REQUIRE(backend->stream_wait_event(consumer.handle(), produced).ok());
  // The consumer has no work of its own: only the wait can hold it back.
  REQUIRE(backend->record_event(consumed, consumer.handle()).ok());
  bool done = true;
  REQUIRE(backend->query_event(consumed, &done).ok());
  CHECK(!done);

  REQUIRE(backend->synchronize_event(consumed).ok());
  REQUIRE(backend->query_event(produced, &done).ok());
  CHECK(done);

  REQUIRE(backend->destroy_event(produced).ok());
  REQUIRE(backend->destroy_event(consumed).ok());
}

TEST_CASE("cuda backend: one instance per visible device", "[gpu]") {
  STREAMALLOC_REQUIRE_GPU();
  status error;
  const int count = cuda_device_count(&error);
  REQUIRE(count == streamalloc::testing::visible_device_count());
  for (int device = 0; device < count; ++device) {
    CAPTURE(device);
    auto backend = backend_for(device);
    CHECK(backend->device_index() == device);
    device_memory_info info;
    REQUIRE(backend->memory_info(&info).ok());
    CHECK(info.total_bytes > 0);
    void* ptr = nullptr;
    REQUIRE(backend->allocate_segment(2_MiB, &ptr).ok());
    CHECK(device_of(ptr) == device);
    REQUIRE(backend->free_segment(ptr, 2_MiB).ok());
  }

  status missing;
  CHECK(make_cuda_backend(count, &missing) == nullptr);
  CHECK(missing.code() == status_code::no_device);
  INFO(missing.message());
  CHECK(contains(missing.message(), "does not exist"));
  CHECK(make_cuda_backend(-1, &missing) == nullptr);
  CHECK(missing.code() == status_code::no_device);

  device_allocators allocators(count, make_cuda_backend, allocator_config{});
  for (int device = 0; device < count; ++device) {
    CAPTURE(device);
    device_allocator& allocator = allocators.at(device);
    CHECK(allocator.device() == device);
    CHECK(allocators.find(device) == &allocator);
    void* ptr = allocator.allocate(1_MiB, 0);
    REQUIRE(ptr != nullptr);
    CHECK(device_of(ptr) == device);
    allocator.free(ptr);
  }
  REQUIRE_THROWS_AS(allocators.at(count), usage_error);
}

TEST_CASE("caching allocator on CUDA: blocks never overlap and keep their data", "[gpu]") {
  STREAMALLOC_REQUIRE_GPU();
  auto backend = backend_for(0);
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
  test_stream stream;
  REQUIRE(stream.get() != nullptr);
  caching_allocator allocator(*backend, allocator_config{});

  struct live_block {
    void* ptr;
    std::size_t bytes;
    std::uint32_t seed;
  };
  std::vector<live_block> blocks;
  std::uint32_t next_seed = 1;
  // Sizes from 512 B to 16 MiB hit both pools, splits and large segments.
  const auto fill = [&](std::size_t count) {
    for (std::size_t i = 0; i < count; ++i) {
      const std::size_t bytes = (std::size_t{512} << (next_seed % 16)) + 4 * (next_seed % 97);
      void* ptr = allocator.allocate(bytes, stream.handle());
      REQUIRE(ptr != nullptr);
      const std::vector<std::uint32_t> values = pattern(bytes / 4, next_seed);
      STREAMALLOC_CUDA_REQUIRE(cudaMemcpy(ptr, values.data(), bytes, cudaMemcpyHostToDevice));
      blocks.push_back({ptr, bytes, next_seed++});
    }
  };
  const auto verify = [&] {
    for (const live_block& b : blocks) {
      std::vector<std::uint32_t> read(b.bytes / 4);
      STREAMALLOC_CUDA_REQUIRE(cudaMemcpy(read.data(), b.ptr, b.bytes, cudaMemcpyDeviceToHost));
      CAPTURE(b.seed, b.bytes);
      REQUIRE(read == pattern(b.bytes / 4, b.seed));
    }
  };

  fill(96);
  verify();
  allocator.validate();
  // Free every other block, then reuse the holes: survivors must be intact.
  std::vector<live_block> kept;
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    if (i % 2 == 0) {
      allocator.free(blocks[i].ptr);
    } else {
      kept.push_back(blocks[i]);
    }
  }
  blocks = kept;
  allocator.validate();
  fill(64);
  verify();
  allocator.validate();
  for (const live_block& b : blocks) allocator.free(b.ptr);
  allocator.validate();
  CHECK(allocator.stats().allocated_bytes[k_all].current == 0);
}

TEST_CASE("caching allocator on CUDA: empty_cache gives memory back to the device", "[gpu]") {
  STREAMALLOC_REQUIRE_GPU();
  auto backend = backend_for(0);
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
  caching_allocator allocator(*backend, allocator_config{});

  const std::size_t bytes = 1_GiB;
  void* ptr = allocator.allocate(bytes, 0);
  REQUIRE(ptr != nullptr);
  allocator.free(ptr);
  // Freed but cached: the device still counts it as used.
  const std::size_t cached_free = device_free_bytes();
  CHECK(allocator.stats().reserved_bytes[k_all].current >= static_cast<std::int64_t>(bytes));

  allocator.empty_cache();
  CHECK(allocator.stats().reserved_bytes[k_all].current == 0);
  CHECK(device_free_bytes() >= cached_free + bytes);
  allocator.validate();
}

TEST_CASE("caching allocator on CUDA: record_stream holds a block until that stream's work ends", "[gpu]") {
  STREAMALLOC_REQUIRE_GPU();
  auto backend = backend_for(0);
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
  test_stream owner;
  test_stream user;
  REQUIRE(owner.get() != nullptr);
  REQUIRE(user.get() != nullptr);
  test_buffer work(1_GiB);
  REQUIRE(work.get() != nullptr);
  caching_allocator allocator(*backend, allocator_config{});
  // 64 MiB is a whole large segment: no split remainder can serve a
  // second request, so reuse is visible as the same pointer.
  const std::size_t bytes = 64_MiB;

  void* first = allocator.allocate(bytes, owner.handle());
  allocator.free(first);
  void* reused = allocator.allocate(bytes, owner.handle());
  CHECK(reused == first);  // without record_stream the block is reused at once

  STREAMALLOC_CUDA_REQUIRE(queue_work(user.get(), work, k_work_rounds));
  allocator.record_stream(reused, user.handle());
  allocator.free(reused);
  void* while_pending = allocator.allocate(bytes, owner.handle());
  CHECK(while_pending != first);  // the user stream may still touch `first`
  const std::int64_t device_allocs = allocator.stats().num_device_alloc;

  STREAMALLOC_CUDA_REQUIRE(cudaStreamSynchronize(user.get()));
  allocator.free(while_pending);
  void* after = allocator.allocate(bytes, owner.handle());
  CHECK((after == first || after == while_pending));
  CHECK(allocator.stats().num_device_alloc == device_allocs);
  allocator.free(after);
  allocator.validate();
}

TEST_CASE("caching allocator on CUDA: a request beyond the device throws out_of_memory", "[gpu]") {
  STREAMALLOC_REQUIRE_GPU();
  auto backend = backend_for(0);
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
  caching_allocator allocator(*backend, allocator_config{});
  device_memory_info info;
  REQUIRE(backend->memory_info(&info).ok());
  void* held = allocator.allocate(8_MiB, 0);

  const std::size_t request = info.total_bytes + 1_GiB;
  REQUIRE_THROWS_AS(allocator.allocate(request, 0), out_of_memory);
  try {
    allocator.allocate(request, 0);
    FAIL("allocate beyond the device did not throw");
  } catch (const out_of_memory& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).size() > 0);
    CHECK(e.context().requested_bytes == request);
    CHECK(e.context().device_total_bytes == info.total_bytes);
    CHECK(e.context().device == 0);
  }
  CHECK(cudaGetLastError() == cudaSuccess);
  // The allocator and the device recover: earlier blocks stay valid and
  // ordinary requests succeed.
  STREAMALLOC_CUDA_REQUIRE(cudaMemset(held, 0, 8_MiB));
  void* ptr = allocator.allocate(64_MiB, 0);
  REQUIRE(ptr != nullptr);
  allocator.free(ptr);
  allocator.free(held);
  allocator.validate();
}
