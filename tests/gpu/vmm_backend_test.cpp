// [gpu][vmm] tests of vmm_backend on a real device: reserving address
// ranges, creating, mapping, moving and releasing physical chunks, chunks
// exported and imported again, and the statuses of bad calls. Without a GPU
// (or without VMM support) they skip visibly.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gpu/gpu_support.hpp"
#include "streamalloc/backend/cuda_backend.hpp"
#include "streamalloc/backend/vmm_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/util/bytes.hpp"

using namespace streamalloc;
using streamalloc::testing::contains;

namespace {

// Asks the driver directly (the same entry-point route, but not the
// backend's code) whether `device` supports virtual memory management.
bool driver_reports_vmm(int device) {
  void* address = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  STREAMALLOC_CUDA_REQUIRE(
      cudaGetDriverEntryPointByVersion("cuDeviceGetAttribute", &address, 12000, cudaEnableDefault, &found));
  REQUIRE(found == cudaDriverEntryPointSuccess);
  REQUIRE(address != nullptr);
  const auto get_attribute = reinterpret_cast<PFN_cuDeviceGetAttribute_v2000>(address);
  int supported = 0;
  // The runtime's device index is the driver's ordinal.
  REQUIRE(get_attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device) == CUDA_SUCCESS);
  return supported != 0;
}

// make_cuda_backend(device), or nullptr after a visible skip when the device
// has no VMM support (the first test case checks that this agrees with the
// driver).
std::unique_ptr<device_backend> vmm_backend_for(int device) {
  status error;
  std::unique_ptr<device_backend> backend = make_cuda_backend(device, &error);
  INFO(error.message());
  REQUIRE(backend != nullptr);
  if (!backend->supports_virtual_memory()) {
    WARN("skipped: CUDA device " << device << " does not support virtual memory management");
    return nullptr;
  }
  return backend;
}

std::vector<std::uint32_t> pattern(std::size_t bytes, std::uint32_t seed) {
  std::vector<std::uint32_t> values(bytes / sizeof(std::uint32_t));
  for (std::size_t i = 0; i < values.size(); ++i) values[i] = seed * 0x9E3779B1u ^ static_cast<std::uint32_t>(i);
  return values;
}

std::vector<std::uint32_t> read_back(const void* address, std::size_t bytes) {
  std::vector<std::uint32_t> values(bytes / sizeof(std::uint32_t));
  STREAMALLOC_CUDA_REQUIRE(cudaMemcpy(values.data(), address, bytes, cudaMemcpyDeviceToHost));
  return values;
}

void* at_offset(void* base, std::size_t bytes) { return static_cast<char*>(base) + bytes; }

bool power_of_two(std::size_t value) { return value != 0 && (value & (value - 1)) == 0; }

bool invalid_or_device_error(const status& result) {
  return result.code() == status_code::invalid_argument || result.code() == status_code::device_error;
}

}  // namespace

TEST_CASE("vmm backend: make_cuda_backend offers virtual memory where the driver does", "[gpu][vmm]") {
  STREAMALLOC_REQUIRE_GPU();
  const int count = streamalloc::testing::visible_device_count();
  for (int device = 0; device < count; ++device) {
    CAPTURE(device);
    status error;
    std::unique_ptr<device_backend> backend = make_cuda_backend(device, &error);
    INFO(error.message());
    REQUIRE(backend != nullptr);
    CHECK(backend->device_index() == device);
    const bool supported = driver_reports_vmm(device);
    CHECK(backend->supports_virtual_memory() == supported);
    if (supported) {
      CAPTURE(backend->vm_granularity());
      CHECK(power_of_two(backend->vm_granularity()));
    } else {
      CHECK(backend->vm_granularity() == 0);
      void* range = nullptr;
      CHECK(backend->vm_reserve(2_MiB, &range).code() == status_code::not_supported);
    }
  }
}

TEST_CASE("vmm backend: chunks mapped into a range hold data and keep it when moved", "[gpu][vmm]") {
  STREAMALLOC_REQUIRE_GPU();
  const std::unique_ptr<device_backend> backend = vmm_backend_for(0);
  if (backend == nullptr) return;
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
  const std::size_t chunk_bytes = backend->vm_granularity();

  void* range = nullptr;
  REQUIRE(backend->vm_reserve(4 * chunk_bytes, &range).ok());
  REQUIRE(range != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(range) % chunk_bytes == 0);
  physical_handle chunk_a = 0;
  physical_handle chunk_b = 0;
  REQUIRE(backend->vm_create(chunk_bytes, &chunk_a).ok());
  REQUIRE(backend->vm_create(chunk_bytes, &chunk_b).ok());
  CHECK(chunk_a != chunk_b);

  REQUIRE(backend->vm_map(range, chunk_bytes, chunk_a).ok());
  REQUIRE(backend->vm_map(at_offset(range, 2 * chunk_bytes), chunk_bytes, chunk_b).ok());

  const std::vector<std::uint32_t> a_values = pattern(chunk_bytes, 1);
  STREAMALLOC_CUDA_REQUIRE(cudaMemcpy(range, a_values.data(), chunk_bytes, cudaMemcpyHostToDevice));
  STREAMALLOC_CUDA_REQUIRE(cudaMemset(at_offset(range, 2 * chunk_bytes), 0x5a, chunk_bytes));
  CHECK(read_back(range, chunk_bytes) == a_values);
  const std::vector<std::uint32_t> b_values(chunk_bytes / sizeof(std::uint32_t), 0x5a5a5a5au);
  CHECK(read_back(at_offset(range, 2 * chunk_bytes), chunk_bytes) == b_values);

  // Chunk A moves from offset 0 to offset 1: its physical content moves
  // with it, and it now sits right before chunk B.
  REQUIRE(backend->synchronize_device().ok());
  REQUIRE(backend->vm_unmap(range, chunk_bytes).ok());
  REQUIRE(backend->vm_map(at_offset(range, chunk_bytes), chunk_bytes, chunk_a).ok());
  CHECK(read_back(at_offset(range, chunk_bytes), chunk_bytes) == a_values);

  // One copy across the seam proves the two chunks form one contiguous run.
  std::vector<std::uint32_t> both = a_values;
  both.insert(both.end(), b_values.begin(), b_values.end());
  CHECK(read_back(at_offset(range, chunk_bytes), 2 * chunk_bytes) == both);

  // Device-to-device through the remapped address works too.
  STREAMALLOC_CUDA_REQUIRE(cudaMemcpy(at_offset(range, 2 * chunk_bytes), at_offset(range, chunk_bytes), chunk_bytes,
                                      cudaMemcpyDeviceToDevice));
  CHECK(read_back(at_offset(range, 2 * chunk_bytes), chunk_bytes) == a_values);
  CHECK(cudaGetLastError() == cudaSuccess);

  REQUIRE(backend->synchronize_device().ok());
  REQUIRE(backend->vm_unmap(at_offset(range, chunk_bytes), chunk_bytes).ok());
  REQUIRE(backend->vm_unmap(at_offset(range, 2 * chunk_bytes), chunk_bytes).ok());
  REQUIRE(backend->vm_destroy(chunk_a).ok());
  REQUIRE(backend->vm_destroy(chunk_b).ok());
  REQUIRE(backend->vm_release(range, 4 * chunk_bytes).ok());
}

TEST_CASE("vmm backend: created chunks take device memory until destroyed", "[gpu][vmm]") {
  STREAMALLOC_REQUIRE_GPU();
  const std::unique_ptr<device_backend> backend = vmm_backend_for(0);
  if (backend == nullptr) return;
  // Large enough to stand out from the driver's own page-sized noise.
  const std::size_t bytes = 64 * backend->vm_granularity();

  device_memory_info before;
  REQUIRE(backend->memory_info(&before).ok());

  // Reserving address space takes no memory; creating the chunk does.
  void* range = nullptr;
  REQUIRE(backend->vm_reserve(bytes, &range).ok());
  physical_handle chunk = 0;
  REQUIRE(backend->vm_create(bytes, &chunk).ok());
  device_memory_info held;
  REQUIRE(backend->memory_info(&held).ok());
  CAPTURE(before.free_bytes, held.free_bytes, bytes);
  CHECK(held.total_bytes == before.total_bytes);
  CHECK(held.free_bytes + bytes <= before.free_bytes);

  REQUIRE(backend->vm_map(range, bytes, chunk).ok());
  STREAMALLOC_CUDA_REQUIRE(cudaMemset(range, 0, bytes));
  REQUIRE(backend->synchronize_device().ok());
  REQUIRE(backend->vm_unmap(range, bytes).ok());
  REQUIRE(backend->vm_destroy(chunk).ok());

  device_memory_info after;
  REQUIRE(backend->memory_info(&after).ok());
  CAPTURE(after.free_bytes);
  CHECK(after.free_bytes >= held.free_bytes + bytes);
  REQUIRE(backend->vm_release(range, bytes).ok());
}

TEST_CASE("vmm backend: malformed and impossible calls return statuses", "[gpu][vmm]") {
  STREAMALLOC_REQUIRE_GPU();
  const std::unique_ptr<device_backend> backend = vmm_backend_for(0);
  if (backend == nullptr) return;
  const std::size_t chunk_bytes = backend->vm_granularity();

  void* range = nullptr;
  REQUIRE(backend->vm_reserve(4 * chunk_bytes, &range).ok());
  physical_handle chunk = 0;
  REQUIRE(backend->vm_create(chunk_bytes, &chunk).ok());

  SECTION("sizes and addresses off the granularity are invalid_argument") {
    void* other = nullptr;
    CHECK(backend->vm_reserve(0, &other).code() == status_code::invalid_argument);
    CHECK(backend->vm_reserve(chunk_bytes + 1, &other).code() == status_code::invalid_argument);
    CHECK(backend->vm_reserve(chunk_bytes, nullptr).code() == status_code::invalid_argument);
    CHECK(other == nullptr);
    physical_handle other_chunk = 0;
    CHECK(backend->vm_create(0, &other_chunk).code() == status_code::invalid_argument);
    CHECK(backend->vm_create(chunk_bytes / 2, &other_chunk).code() == status_code::invalid_argument);
    CHECK(backend->vm_create(chunk_bytes, nullptr).code() == status_code::invalid_argument);
    CHECK(other_chunk == 0);

    const status unaligned = backend->vm_map(at_offset(range, chunk_bytes / 2), chunk_bytes, chunk);
    INFO(unaligned.message());
    CHECK(unaligned.code() == status_code::invalid_argument);
    CHECK(contains(unaligned.message(), "vm_map"));
    CHECK(contains(unaligned.message(), "aligned"));
    CHECK(backend->vm_map(nullptr, chunk_bytes, chunk).code() == status_code::invalid_argument);
    CHECK(backend->vm_map(range, chunk_bytes + chunk_bytes / 2, chunk).code() == status_code::invalid_argument);
    CHECK(backend->vm_unmap(at_offset(range, chunk_bytes / 2), chunk_bytes).code() == status_code::invalid_argument);
    CHECK(backend->vm_unmap(range, 0).code() == status_code::invalid_argument);
    CHECK(backend->vm_release(nullptr, 4 * chunk_bytes).code() == status_code::invalid_argument);
    CHECK(backend->vm_release(range, chunk_bytes - 1).code() == status_code::invalid_argument);
  }
  SECTION("the driver's refusals name the call, the device and the CUDA error") {
    // Handle 0 is never one cuMemCreate hands out.
    const status unknown_map = backend->vm_map(range, chunk_bytes, 0);
    INFO(unknown_map.message());
    CHECK(invalid_or_device_error(unknown_map));
    CHECK(contains(unknown_map.message(), "cuMemMap"));
    CHECK(contains(unknown_map.message(), "CUDA device 0"));
    CHECK(contains(unknown_map.message(), "CUDA_ERROR_"));
    const status unknown_destroy = backend->vm_destroy(0);
    INFO(unknown_destroy.message());
    CHECK(invalid_or_device_error(unknown_destroy));
    CHECK(contains(unknown_destroy.message(), "cuMemRelease"));

    // A range given back is no longer reserved: mapping into it fails.
    void* released = nullptr;
    REQUIRE(backend->vm_reserve(2 * chunk_bytes, &released).ok());
    REQUIRE(backend->vm_release(released, 2 * chunk_bytes).ok());
    const status outside = backend->vm_map(released, chunk_bytes, chunk);
    INFO(outside.message());
    CHECK(invalid_or_device_error(outside));
    CHECK(contains(outside.message(), "cuMemMap"));
    const status unmap_outside = backend->vm_unmap(released, chunk_bytes);
    INFO(unmap_outside.message());
    CHECK(invalid_or_device_error(unmap_outside));
    CHECK(contains(unmap_outside.message(), "cuMemUnmap"));

    // None of it leaks into the runtime's error state or breaks the chunk.
    CHECK(cudaGetLastError() == cudaSuccess);
    REQUIRE(backend->vm_map(range, chunk_bytes, chunk).ok());
    STREAMALLOC_CUDA_REQUIRE(cudaMemset(range, 1, chunk_bytes));
    REQUIRE(backend->synchronize_device().ok());
    REQUIRE(backend->vm_unmap(range, chunk_bytes).ok());
  }
  SECTION("a chunk larger than the device is out_of_memory") {
    device_memory_info info;
    REQUIRE(backend->memory_info(&info).ok());
    std::size_t too_big = 0;
    REQUIRE(round_up_checked(info.total_bytes + 1_GiB, chunk_bytes, &too_big));
    physical_handle huge = 0;
    const status result = backend->vm_create(too_big, &huge);
    INFO(result.message());
    CHECK(result.code() == status_code::out_of_memory);
    CHECK(contains(result.message(), "cuMemCreate"));
    CHECK(contains(result.message(), "CUDA_ERROR_OUT_OF_MEMORY"));
    CHECK(huge == 0);
    CHECK(cudaGetLastError() == cudaSuccess);
    // The device is still usable.
    physical_handle small = 0;
    REQUIRE(backend->vm_create(chunk_bytes, &small).ok());
    REQUIRE(backend->vm_destroy(small).ok());
  }

  REQUIRE(backend->vm_destroy(chunk).ok());
  REQUIRE(backend->vm_release(range, 4 * chunk_bytes).ok());
}

TEST_CASE("vmm backend: the caller's current device is left unchanged", "[gpu][vmm]") {
  STREAMALLOC_REQUIRE_GPU();
  const int count = streamalloc::testing::visible_device_count();
  if (count < 2) {
    WARN("skipped: needs 2 GPUs to observe a device switch (" << count << " visible)");
    return;
  }
  const std::unique_ptr<device_backend> backend = vmm_backend_for(0);
  if (backend == nullptr) return;
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(count - 1));
  const std::size_t chunk_bytes = backend->vm_granularity();
  void* range = nullptr;
  REQUIRE(backend->vm_reserve(chunk_bytes, &range).ok());
  physical_handle chunk = 0;
  REQUIRE(backend->vm_create(chunk_bytes, &chunk).ok());
  REQUIRE(backend->vm_map(range, chunk_bytes, chunk).ok());
  cudaPointerAttributes attributes{};
  STREAMALLOC_CUDA_REQUIRE(cudaPointerGetAttributes(&attributes, range));
  CHECK(attributes.device == 0);
  REQUIRE(backend->vm_unmap(range, chunk_bytes).ok());
  REQUIRE(backend->vm_destroy(chunk).ok());
  REQUIRE(backend->vm_release(range, chunk_bytes).ok());
  int current = -1;
  STREAMALLOC_CUDA_REQUIRE(cudaGetDevice(&current));
  CHECK(current == count - 1);
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
}

TEST_CASE("vmm backend: an exported chunk imports as a second view of the same memory", "[gpu][vmm]") {
  STREAMALLOC_REQUIRE_GPU();
  const std::unique_ptr<device_backend> backend = vmm_backend_for(0);
  if (backend == nullptr) return;
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
  const std::size_t chunk_bytes = backend->vm_granularity();
  void* range = nullptr;
  REQUIRE(backend->vm_reserve(2 * chunk_bytes, &range).ok());
  physical_handle chunks[2] = {0, 0};
  for (std::size_t i = 0; i < 2; ++i) {
    REQUIRE(backend->vm_create(chunk_bytes, &chunks[i]).ok());
    REQUIRE(backend->vm_map(at_offset(range, i * chunk_bytes), chunk_bytes, chunks[i]).ok());
  }
  const std::vector<std::uint32_t> values = pattern(2 * chunk_bytes, 7);
  STREAMALLOC_CUDA_REQUIRE(cudaMemcpy(range, values.data(), 2 * chunk_bytes, cudaMemcpyHostToDevice));

  std::vector<int> fds;
  for (physical_handle chunk : chunks) {
    int fd = -1;
    const status exported = backend->vm_export(chunk, &fd);
    INFO(exported.message());
    REQUIRE(exported.ok());
    CHECK(fd >= 0);
    int again = -1;
    REQUIRE(backend->vm_export(chunk, &again).ok());
    CHECK(again == fd);  // one descriptor per chunk, kept by the backend
    fds.push_back(fd);
  }
  // This process stands in for the receiver: the import duplicates the
  // descriptors through pidfd_getfd and maps them at a new address.
  imported_chunks view;
  const status imported = import_chunks(0, static_cast<int>(::getpid()), fds, chunk_bytes, &view);
  INFO(imported.message());
  REQUIRE(imported.ok());
  CHECK(view.address != range);
  CHECK(view.bytes == 2 * chunk_bytes);
  CHECK(read_back(view.address, 2 * chunk_bytes) == values);
  STREAMALLOC_CUDA_REQUIRE(cudaMemset(view.address, 0x11, chunk_bytes));
  const std::vector<std::uint32_t> ones(chunk_bytes / sizeof(std::uint32_t), 0x11111111u);
  CHECK(read_back(range, chunk_bytes) == ones);  // written through the view, read through the original
  REQUIRE(release_imported_chunks(view).ok());

  REQUIRE(backend->synchronize_device().ok());
  for (std::size_t i = 0; i < 2; ++i) {
    REQUIRE(backend->vm_unmap(at_offset(range, i * chunk_bytes), chunk_bytes).ok());
    REQUIRE(backend->vm_destroy(chunks[i]).ok());
  }
  REQUIRE(backend->vm_release(range, 2 * chunk_bytes).ok());
  // Destroying the chunks closed the exported descriptors.
  for (int fd : fds) CHECK(::fcntl(fd, F_GETFD) == -1);
}

TEST_CASE("vmm backend: a relay's blocks imported while older imports live and chunks come and go",
          "[gpu][vmm]") {
  // What a process that receives and re-sends CUDA tensors does to one
  // allocator: each block is exported and imported (here, by this process)
  // while the imports of the three blocks before it are still mapped, and
  // freed only after its own import is released; every hundred steps
  // empty_cache destroys the idle chunks, so descriptors and chunk handles
  // are reused.
  STREAMALLOC_REQUIRE_GPU();
  const std::unique_ptr<device_backend> backend = vmm_backend_for(0);
  if (backend == nullptr) return;
  STREAMALLOC_CUDA_REQUIRE(cudaSetDevice(0));
  caching_allocator allocator(*backend, allocator_config{});
  struct sent {
    void* block;
    imported_chunks view;
  };
  std::deque<sent> live;
  const auto release_oldest = [&] {
    REQUIRE(release_imported_chunks(live.front().view).ok());
    allocator.free(live.front().block);
    live.pop_front();
  };
  constexpr int k_steps = 3000;
  for (int step = 0; step < k_steps; ++step) {
    // Mostly small blocks in shared chunks; every tenth spans chunks.
    const std::size_t bytes = step % 10 == 9 ? 3_MiB : 64;
    void* block = allocator.allocate(bytes, 0);
    const std::vector<std::uint32_t> values = pattern(64, static_cast<std::uint32_t>(step));
    STREAMALLOC_CUDA_REQUIRE(cudaMemcpy(block, values.data(), 64, cudaMemcpyHostToDevice));

    const caching_allocator::shareable_range range = allocator.share_range(block);
    REQUIRE(range.expandable);
    std::vector<int> fds;
    for (physical_handle chunk : range.chunks) {
      int fd = -1;
      const status exported = backend->vm_export(chunk, &fd);
      INFO(exported.message());
      REQUIRE(exported.ok());
      fds.push_back(fd);
    }
    sent s{block, {}};
    const status imported = import_chunks(0, static_cast<int>(::getpid()), fds, range.chunk_bytes, &s.view);
    INFO("step " << step << ": " << imported.message());
    REQUIRE(imported.ok());
    const std::uintptr_t offset = reinterpret_cast<std::uintptr_t>(block) - range.address;
    REQUIRE(read_back(at_offset(s.view.address, offset), 64) == values);
    live.push_back(std::move(s));
    if (live.size() > 3) release_oldest();
    if (step % 100 == 99) allocator.empty_cache();
  }
  while (!live.empty()) release_oldest();
  allocator.empty_cache();
  CHECK(allocator.stats().reserved_bytes[static_cast<int>(stat_type::all)].current == 0);
}
