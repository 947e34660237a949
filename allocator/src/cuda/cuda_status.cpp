// cuda_status: see the header.
#include "cuda_status.hpp"

namespace streamalloc {

status_code code_for(cudaError_t error) {
  switch (error) {
    case cudaErrorMemoryAllocation:
      return status_code::out_of_memory;
    case cudaErrorNoDevice:
    case cudaErrorInvalidDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorStubLibrary:
    case cudaErrorDevicesUnavailable:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
    case cudaErrorInitializationError:
      return status_code::no_device;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorHostMemoryAlreadyRegistered:
    case cudaErrorHostMemoryNotRegistered:
      return status_code::invalid_argument;
    default:
      return status_code::device_error;
  }
}

status cuda_failure(cudaError_t error, const std::string& what) {
  (void)cudaGetLastError();
  return {code_for(error), what + " failed: " + cudaGetErrorName(error) + ": " + cudaGetErrorString(error)};
}

}  // namespace streamalloc
