// Status values returned by device backends. Backends never throw; the
// core turns a failed status into an exception with context.
#pragma once

#include <string>
#include <utility>

namespace streamalloc {

enum class status_code {
  ok,
  out_of_memory,     // the device (or its model) has no room
  invalid_argument,  // the call was malformed (unknown handle, bad range)
  not_supported,     // e.g. virtual-memory operations on a backend without them
  device_error,      // any other driver/runtime failure
  no_device,         // no GPU, no driver, or a device index that does not exist
};

const char* to_string(status_code code);

class status {
 public:
  status() = default;
  status(status_code code, std::string message) : code_(code), message_(std::move(message)) {}
  static status success() { return {}; }

  bool ok() const { return code_ == status_code::ok; }
  explicit operator bool() const { return ok(); }
  status_code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  status_code code_ = status_code::ok;
  std::string message_;
};

}  // namespace streamalloc
