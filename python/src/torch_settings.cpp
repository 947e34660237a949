// torch's allocator settings at installation and at run time: see the header.
#include "torch_settings.hpp"

#include <pybind11/pybind11.h>

#include <c10/core/AllocatorConfig.h>
#include <c10/util/Exception.h>

#include <iterator>
#include <mutex>
#include <string>
#include <vector>

#include "process_allocator.hpp"
#include "torch_errors.hpp"

namespace streamalloc {
namespace {

// torch's binding of _set_allocator_settings installs no handler that
// turns a TORCH_WARN into a Python warning (it would only reach stderr), so
// the warning is raised in Python directly: `warnings` filters and tests
// see it.
void warn(const std::string& message) {
  if (!Py_IsInitialized()) {
    TORCH_WARN(message);
    return;
  }
  pybind11::gil_scoped_acquire gil;
  if (PyErr_WarnEx(PyExc_UserWarning, message.c_str(), 1) != 0) throw pybind11::error_already_set();
}

// "a, b and c": the shared keys as the warning names them.
std::string shared_key_list() {
  const auto& keys = allocator_config::k_torch_shared_keys;
  const std::size_t n = std::size(keys);
  std::string out;
  for (std::size_t i = 0; i < n; ++i) {
    if (i > 0) out += i + 1 == n ? " and " : ", ";
    out += keys[i];
  }
  return out;
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& name : names) out += (out.empty() ? "" : ", ") + name;
  return out;
}

// What the entries of torch's settings that streamalloc shares set here;
// with `warn_ignored`, a warning names the keys it ignores.
std::string applied_settings_of(const std::string& settings, bool warn_ignored) {
  const allocator_config::torch_settings split = allocator_config::split_torch_settings(settings);
  if (warn_ignored && !split.ignored.empty()) {
    warn("streamalloc ignores these allocator settings of torch's native CUDA allocator: " + joined(split.ignored) +
         ". streamalloc applies " + shared_key_list() + "; its own options are set with STREAMALLOC_CONF.");
  }
  return split.applied;
}

}  // namespace

void apply_torch_allocator_settings(const std::string& settings) {
  const std::string applied = applied_settings_of(settings, true);
  // Like torch, every call starts from the settings before any call: a key
  // it does not name returns to its value at installation.
  static const allocator_config* const installed = new allocator_config(process_allocator_config());
  const allocator_config wanted = installed->with(applied);
  if (process_allocators_created()) {
    process_allocators().update_config(wanted);
  } else {
    configure_process_allocators(wanted);
  }
}

allocator_config startup_config(const std::string& overrides, bool warn_ignored) {
  // Note [torch's settings]: torch parsed its variable when it started.
  const std::string settings = c10::CachingAllocator::getAllocatorSettings();
  try {
    return allocator_config::from_environment(applied_settings_of(settings, warn_ignored)).with(overrides);
  } catch (const config_error& e) {
    if (settings.empty()) throw;
    throw config_error(std::string(e.what()) + " (torch's allocator settings beneath it: " + settings + ")");
  }
}

void hook_torch_allocator_settings() {
  static std::once_flag once;
  std::call_once(once, [] {
    auto& hook = c10::CachingAllocator::AcceleratorAllocatorConfig::getConfigParserHook();
    hook = [previous = hook](const std::string& settings) {
      // A malformed string is a ValueError, as torch raises for it.
      try {
        if (previous) previous(settings);
      } catch (const c10::ValueError&) {
        throw;
      } catch (const c10::Error& e) {
        TORCH_CHECK_VALUE(false, e.what_without_backtrace());
      }
      guarded([&] { apply_torch_allocator_settings(settings); });
    };
  });
}

}  // namespace streamalloc
