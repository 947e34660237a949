// nvml_processes: the processes holding memory on a GPU, read from the
// driver's management library (NVML). The library is loaded with dlopen at
// the first call, so neither streamalloc nor its users link against it, and
// a machine without it only loses the list.
#pragma once

#include <vector>

#include "streamalloc/util/device_process.hpp"
#include "streamalloc/util/status.hpp"

namespace streamalloc {

// The compute processes on the GPU at `pci_bus_id` ("0000:3b:00.0", as
// cudaDeviceGetPCIBusId writes it), in NVML's order; those whose usage NVML
// cannot read are left out. not_supported when NVML is missing or refuses.
status nvml_device_processes(const char* pci_bus_id, std::vector<device_process>* out);

}  // namespace streamalloc
