// libFuzzer harness for the STREAMALLOC_CONF parser: any input either fails
// with config_error or gives a config that validates, renders back to text
// that parses to the same config, and drives a working allocator. The same
// input as torch's allocator settings either fails with config_error or
// splits into shared entries that split again to themselves.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/core/config.hpp"
#include "streamalloc/util/bytes.hpp"
#include "streamalloc/util/errors.hpp"

namespace {

using namespace streamalloc;

void require(bool ok, const char* what, const std::string& text) {
  if (ok) return;
  std::fprintf(stderr, "fuzz_config: %s for input '%s'\n", what, text.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const allocator_config::torch_settings split = allocator_config::split_torch_settings(text);
    if (!split.shared.empty()) {
      const allocator_config::torch_settings again = allocator_config::split_torch_settings(split.shared);
      require(again.shared == split.shared && again.ignored.empty(), "shared torch settings do not split to themselves",
              text);
    }
  } catch (const config_error&) {
  }
  allocator_config config;
  try {
    config = allocator_config::parse(text);
  } catch (const config_error&) {
    return 0;
  }
  config.validate();
  const std::string rendered = config.to_string();
  require(allocator_config::parse(rendered).to_string() == rendered, "to_string does not round-trip", text);

  // Whatever parses must make an allocator that serves requests (or runs
  // out of memory cleanly: segment sizes and the fraction are configurable)
  // and gives everything back.
  sim_config device;
  device.capacity_bytes = 4_GiB;
  sim_backend sim(device);
  // The one device-dependent rule: chunks are whole granules (2 MiB here),
  // checked only where chunks are used, so with expandable segments on.
  const bool chunk_off_granularity =
      config.expandable_segments && config.vmm_chunk_bytes % device.vm_granularity_bytes != 0;
  std::unique_ptr<caching_allocator> made;
  try {
    made = std::make_unique<caching_allocator>(sim, config);
  } catch (const config_error&) {
    require(chunk_off_granularity, "allocator refused a valid config", text);
    return 0;
  }
  require(!chunk_off_granularity, "allocator accepted a chunk size off the granularity", text);
  caching_allocator& alloc = *made;
  const stream_handle stream = sim.new_stream();
  for (std::size_t bytes : {std::size_t{1}, 3_MiB, 30_MiB}) {
    void* p = nullptr;
    try {
      p = alloc.allocate(bytes, stream);
    } catch (const out_of_memory&) {
      continue;
    }
    require(alloc.allocation_size(p) >= bytes, "allocation smaller than requested", text);
    alloc.free(p);
  }
  alloc.empty_cache();
  alloc.validate();
  require(sim.used_bytes() == 0, "empty_cache left device memory", text);
  return 0;
}
