// NVML through dlopen (see nvml_processes.hpp). The few declarations below
// follow NVML's documented C interface: opaque device handles, 0 for
// success, 7 for a buffer too small, and process records of a pid and its
// used bytes (v1), followed by two instance ids in the records of the _v3
// function.
#include "nvml_processes.hpp"

#include <dlfcn.h>

#include <cstdint>
#include <string>

namespace streamalloc {
namespace {

using nvml_return = int;
using nvml_device = void*;
constexpr nvml_return k_nvml_success = 0;
constexpr nvml_return k_nvml_insufficient_size = 7;
constexpr unsigned long long k_nvml_value_not_available = ~0ULL;

struct nvml_process_v1 {
  unsigned int pid;
  unsigned long long used_gpu_memory;
};
struct nvml_process_v3 {
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
};

struct nvml_library {
  nvml_return (*handle_by_pci_bus_id)(const char*, nvml_device*) = nullptr;
  nvml_return (*processes_v3)(nvml_device, unsigned int*, nvml_process_v3*) = nullptr;
  nvml_return (*processes_v1)(nvml_device, unsigned int*, nvml_process_v1*) = nullptr;
  bool ready = false;
};

template <typename fn>
fn symbol(void* library, const char* name) {
  return reinterpret_cast<fn>(dlsym(library, name));
}

// Loaded and initialised once per process and never unloaded: torch and
// others may hold NVML open too, and its initialisation is counted.
const nvml_library& nvml() {
  static const nvml_library library = [] {
    nvml_library l;
    void* handle = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) return l;
    const auto init = symbol<nvml_return (*)()>(handle, "nvmlInit_v2");
    l.handle_by_pci_bus_id = symbol<decltype(l.handle_by_pci_bus_id)>(handle, "nvmlDeviceGetHandleByPciBusId_v2");
    l.processes_v3 = symbol<decltype(l.processes_v3)>(handle, "nvmlDeviceGetComputeRunningProcesses_v3");
    l.processes_v1 = symbol<decltype(l.processes_v1)>(handle, "nvmlDeviceGetComputeRunningProcesses");
    l.ready = init != nullptr && l.handle_by_pci_bus_id != nullptr &&
              (l.processes_v3 != nullptr || l.processes_v1 != nullptr) && init() == k_nvml_success;
    return l;
  }();
  return library;
}

status nvml_failure(const std::string& what, nvml_return code) {
  return {status_code::not_supported, "NVML: " + what + " returned " + std::to_string(code)};
}

// Asks `query` with a buffer that grows while the list does not fit.
template <typename record, typename query_fn>
status list_processes(query_fn query, nvml_device device, std::vector<device_process>* out) {
  std::vector<record> records(16);
  for (int attempt = 0; attempt < 4; ++attempt) {
    auto count = static_cast<unsigned int>(records.size());
    const nvml_return code = query(device, &count, records.data());
    if (code == k_nvml_insufficient_size) {
      records.resize(static_cast<std::size_t>(count) + 8);
      continue;
    }
    if (code != k_nvml_success) return nvml_failure("nvmlDeviceGetComputeRunningProcesses", code);
    out->clear();
    for (std::size_t i = 0; i < count && i < records.size(); ++i) {
      if (records[i].used_gpu_memory == k_nvml_value_not_available) continue;
      out->push_back({static_cast<std::uint32_t>(records[i].pid), static_cast<std::size_t>(records[i].used_gpu_memory)});
    }
    return status::success();
  }
  return {status_code::not_supported, "NVML: the process list kept growing"};
}

}  // namespace

status nvml_device_processes(const char* pci_bus_id, std::vector<device_process>* out) {
  if (pci_bus_id == nullptr || out == nullptr) return {status_code::invalid_argument, "nvml_device_processes: null"};
  const nvml_library& l = nvml();
  if (!l.ready) return {status_code::not_supported, "NVML is not available"};
  nvml_device device = nullptr;
  if (const nvml_return code = l.handle_by_pci_bus_id(pci_bus_id, &device); code != k_nvml_success) {
    return nvml_failure("nvmlDeviceGetHandleByPciBusId_v2", code);
  }
  if (l.processes_v3 != nullptr) return list_processes<nvml_process_v3>(l.processes_v3, device, out);
  return list_processes<nvml_process_v1>(l.processes_v1, device, out);
}

}  // namespace streamalloc
