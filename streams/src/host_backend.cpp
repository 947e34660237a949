// Names of the host_backend enums, for messages and statistics.
#include "streamalloc/streams/host_backend.hpp"

namespace streamalloc {

const char* to_string(pin_method method) {
  switch (method) {
    case pin_method::host_alloc:
      return "host_alloc";
    case pin_method::register_touched:
      return "register_touched";
  }
  return "unknown";
}

}  // namespace streamalloc
