// Names of backend status codes, used in exception messages and logs.
// The spelling matches the enumerators so a message maps back to the code.
#include "streamalloc/util/status.hpp"

namespace streamalloc {

const char* to_string(status_code code) {
  switch (code) {
    case status_code::ok:
      return "ok";
    case status_code::out_of_memory:
      return "out_of_memory";
    case status_code::invalid_argument:
      return "invalid_argument";
    case status_code::not_supported:
      return "not_supported";
    case status_code::device_error:
      return "device_error";
    case status_code::no_device:
      return "no_device";
  }
  // Only reachable through a cast of an out-of-range integer.
  return "unknown_status";
}

}  // namespace streamalloc
