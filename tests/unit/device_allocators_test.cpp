// device_allocators over several simulated devices: one device_allocator
// per device, created on first use, with separate memory and statistics.
#include <memory>
#include <string>
#include <vector>

#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/device_allocators.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"

namespace {

using namespace streamalloc;

// Makes a sim_backend per device and remembers it so the test can look at
// each device's memory.
struct sim_devices {
  std::vector<sim_backend*> made = std::vector<sim_backend*>(4, nullptr);
  int fail_device = -1;

  device_allocators::backend_factory factory() {
    return [this](int device, status* error) -> std::unique_ptr<device_backend> {
      if (device == fail_device) {
        *error = status(status_code::no_device, "device " + std::to_string(device) + " is broken");
        return nullptr;
      }
      sim_config config;
      config.device_index = device;
      config.capacity_bytes = 1_GiB;
      auto backend = std::make_unique<sim_backend>(config);
      made[static_cast<std::size_t>(device)] = backend.get();
      return backend;
    };
  }
};

// The message of the exception `action` throws ("" if none).
template <typename fn>
std::string error_of(fn&& action) {
  try {
    action();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("device_allocators: each device has its own allocator, memory and stats", "[device_allocators]") {
  sim_devices devices;
  device_allocators all(3, devices.factory(), allocator_config{});
  REQUIRE(all.device_count() == 3);
  CHECK(all.find(0) == nullptr);  // nothing is made before first use

  void* a = all.at(0).allocate(4_MiB, 0);
  void* b = all.at(2).allocate(1_MiB, 0);
  CHECK(all.find(1) == nullptr);
  REQUIRE(all.find(0) == &all.at(0));
  REQUIRE(all.find(2) == &all.at(2));
  CHECK(all.at(0).device() == 0);
  CHECK(all.at(2).device() == 2);

  CHECK(all.at(0).stats().allocated_bytes[0].current == static_cast<std::int64_t>(4_MiB));
  CHECK(all.at(2).stats().allocated_bytes[0].current == static_cast<std::int64_t>(1_MiB));
  CHECK(devices.made[0]->is_device_memory(a, 4_MiB));
  CHECK_FALSE(devices.made[2]->is_device_memory(a, 4_MiB));
  CHECK(devices.made[2]->is_device_memory(b, 1_MiB));

  // A pointer of device 0 is unknown to device 2 and freeing it there fails
  // without touching either device's state.
  CHECK_FALSE(all.at(2).owns(a));
  REQUIRE_THROWS_AS(all.at(2).free(a), usage_error);
  CHECK(all.at(0).owns(a));

  all.at(0).free(a);
  all.at(2).free(b);
  all.at(0).empty_cache();
  CHECK(devices.made[0]->used_bytes() == 0);
  CHECK(devices.made[2]->used_bytes() > 0);  // device 2's cache is its own
  all.at(0).validate();
  all.at(2).validate();
}

TEST_CASE("device_allocators: a device index that does not exist is a clear error", "[device_allocators]") {
  sim_devices devices;
  device_allocators all(1, devices.factory(), allocator_config{});
  CHECK(error_of([&] { all.at(1); }).find("device index 1 does not exist (1 device(s) visible)") != std::string::npos);
  REQUIRE_THROWS_AS(all.at(-1), usage_error);
  CHECK(all.find(1) == nullptr);
  CHECK(all.find(-1) == nullptr);
}

TEST_CASE("device_allocators: a backend that cannot be made fails clearly and can be retried", "[device_allocators]") {
  sim_devices devices;
  devices.fail_device = 1;
  device_allocators all(2, devices.factory(), allocator_config{});
  CHECK(error_of([&] { all.at(1); }).find("cannot use device 1: device 1 is broken") != std::string::npos);
  CHECK(all.find(1) == nullptr);
  devices.fail_device = -1;
  CHECK(all.at(1).device() == 1);
}
