// NVTX ranges of the CUDA backends, in domain "streamalloc": the slow paths
// (segment growth and release, chunk map and unmap, device-wide synchronize)
// show up by name in Nsight traces. Internal to streamalloc_cuda.
#pragma once

#include <nvtx3/nvToolsExt.h>

#include <cstdint>

namespace streamalloc::detail {

// NVTX names are registered once; without an attached tool every NVTX call
// is a cheap no-op.
struct trace_names {
  nvtxDomainHandle_t domain;
  nvtxStringHandle_t grow;
  nvtxStringHandle_t release;
  nvtxStringHandle_t synchronize;
  nvtxStringHandle_t map;
  nvtxStringHandle_t unmap;
};

inline const trace_names& names() {
  static const trace_names registered = [] {
    trace_names n{};
    n.domain = nvtxDomainCreateA("streamalloc");
    n.grow = nvtxDomainRegisterStringA(n.domain, "streamalloc::grow");
    n.release = nvtxDomainRegisterStringA(n.domain, "streamalloc::release");
    n.synchronize = nvtxDomainRegisterStringA(n.domain, "streamalloc::synchronize");
    n.map = nvtxDomainRegisterStringA(n.domain, "streamalloc::map");
    n.unmap = nvtxDomainRegisterStringA(n.domain, "streamalloc::unmap");
    return n;
  }();
  return registered;
}

// One NVTX range for the lifetime of the object; the payload is the byte
// count involved (0 where none applies).
class trace_range {
 public:
  trace_range(nvtxStringHandle_t name, std::uint64_t bytes) {
    nvtxEventAttributes_t attributes{};
    attributes.version = NVTX_VERSION;
    attributes.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
    attributes.messageType = NVTX_MESSAGE_TYPE_REGISTERED;
    attributes.message.registered = name;
    attributes.payloadType = NVTX_PAYLOAD_TYPE_UNSIGNED_INT64;
    attributes.payload.ullValue = bytes;
    nvtxDomainRangePushEx(names().domain, &attributes);
  }
  ~trace_range() { nvtxDomainRangePop(names().domain); }
  trace_range(const trace_range&) = delete;
  trace_range& operator=(const trace_range&) = delete;
};

}  // namespace streamalloc::detail
