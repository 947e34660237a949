// [gpu] tests of the process-wide allocator set (python/src/process_allocator):
// configuration before first use, creation over every visible device, and
// the clear failure without a GPU. Only this file touches this binary's
// process allocators, so "not yet created" holds at each test's start.
#include <string>

#include "gpu/gpu_support.hpp"
#include "process_allocator.hpp"
#include "streamalloc/util/bytes.hpp"
#include "streamalloc/util/errors.hpp"

using namespace streamalloc;
using streamalloc::testing::contains;

TEST_CASE("process allocators: without a GPU creation fails clearly and can be retried", "[gpu][nogpu]") {
  STREAMALLOC_REQUIRE_NO_GPU();
  REQUIRE(!process_allocators_created());
  for (int attempt = 0; attempt < 2; ++attempt) {
    CAPTURE(attempt);
    try {
      process_allocators();
      FAIL("process_allocators() succeeded without a GPU");
    } catch (const device_failure& e) {
      INFO(e.what());
      CHECK(contains(e.what(), "streamalloc"));
      CHECK(contains(e.what(), "cudaGetDeviceCount"));
    }
    CHECK(!process_allocators_created());
    CHECK(find_process_allocators() == nullptr);
  }

  // Configuration still works before any successful creation.
  allocator_config config;
  config.max_split_bytes = 256_MiB;
  REQUIRE_NOTHROW(configure_process_allocators(config));
  CHECK(process_allocator_config().max_split_bytes == 256_MiB);
  REQUIRE_THROWS_AS(configure_process_allocators(std::string("no_such_key:1")), config_error);
  CHECK(process_allocator_config().max_split_bytes == 256_MiB);
}

TEST_CASE("process allocators: configured before first use, fixed afterwards", "[gpu]") {
  STREAMALLOC_REQUIRE_GPU();
  REQUIRE(!process_allocators_created());
  allocator_config config = process_allocator_config();
  config.max_split_bytes = 512_MiB;
  config.cross_stream_reuse = false;
  REQUIRE_NOTHROW(configure_process_allocators(config));

  device_allocators& allocators = process_allocators();
  CHECK(process_allocators_created());
  CHECK(find_process_allocators() == &allocators);
  CHECK(&process_allocators() == &allocators);
  CHECK(allocators.device_count() == streamalloc::testing::visible_device_count());
  CHECK(allocators.config().max_split_bytes == 512_MiB);
  CHECK(!allocators.config().cross_stream_reuse);
  CHECK(process_allocator_config().max_split_bytes == 512_MiB);

  device_allocator& device0 = allocators.at(0);
  CHECK(device0.config().max_split_bytes == 512_MiB);
  void* ptr = device0.allocate(4_MiB, 0);
  REQUIRE(ptr != nullptr);
  device0.free(ptr);

  REQUIRE_THROWS_AS(configure_process_allocators(allocator_config{}), usage_error);
  REQUIRE_THROWS_AS(configure_process_allocators(std::string("")), usage_error);
  CHECK(allocators.config().max_split_bytes == 512_MiB);
}
