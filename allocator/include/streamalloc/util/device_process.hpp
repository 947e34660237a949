// A process holding memory on a device, as the driver reports it: what
// backends list and torch's out-of-memory message names.
#pragma once

#include <cstddef>
#include <cstdint>

namespace streamalloc {

struct device_process {
  std::uint32_t pid = 0;
  std::size_t used_bytes = 0;
};

}  // namespace streamalloc
