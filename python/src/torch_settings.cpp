// Run-time allocator settings: see the header.
#include "torch_settings.hpp"

#include <pybind11/pybind11.h>

#include <c10/core/AllocatorConfig.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <iterator>
#include <mutex>
#include <string>
#include <vector>

#include "process_allocator.hpp"
#include "torch_errors.hpp"

namespace streamalloc {
namespace {

// torch's device-allocator keys that mean the same in streamalloc.
constexpr const char* k_shared_keys[] = {"max_split_size_mb",           "max_non_split_rounding_mb",
                                         "roundup_power2_divisions",    "garbage_collection_threshold",
                                         "expandable_segments",         "graph_capture_record_stream_reuse"};

std::string trimmed(const std::string& text) {
  const auto begin = std::find_if_not(text.begin(), text.end(), [](unsigned char c) { return std::isspace(c); });
  const auto end = std::find_if_not(text.rbegin(), text.rend(), [](unsigned char c) { return std::isspace(c); }).base();
  return begin < end ? std::string(begin, end) : std::string();
}

// Splits `key:value,key:[a,b],...` at the commas outside brackets.
std::vector<std::string> entries_of(const std::string& settings) {
  std::vector<std::string> out;
  std::string current;
  int depth = 0;
  for (char c : settings) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) {
      out.push_back(trimmed(current));
      current.clear();
    } else {
      current += c;
    }
  }
  out.push_back(trimmed(current));
  return out;
}

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
  const std::size_t n = std::size(k_shared_keys);
  std::string out;
  for (std::size_t i = 0; i < n; ++i) {
    if (i > 0) out += i + 1 == n ? " and " : ", ";
    out += k_shared_keys[i];
  }
  return out;
}

bool is_shared(const std::string& key) {
  return std::any_of(std::begin(k_shared_keys), std::end(k_shared_keys), [&](const char* k) { return key == k; });
}

}  // namespace

void apply_torch_allocator_settings(const std::string& settings) {
  std::string shared;
  std::string ignored;
  for (const std::string& entry : entries_of(settings)) {
    if (entry.empty()) continue;
    const std::string key = trimmed(entry.substr(0, entry.find(':')));
    if (is_shared(key)) {
      shared += (shared.empty() ? "" : ",") + entry;
    } else if (key.rfind("pinned_", 0) != 0) {
      ignored += (ignored.empty() ? "" : ", ") + key;
    }
  }
  if (!ignored.empty()) {
    warn("streamalloc ignores these allocator settings of torch's native CUDA allocator: " + ignored +
         ". streamalloc applies " + shared_key_list() + "; its own options are set with STREAMALLOC_CONF.");
  }
  // Like torch, every call starts from the settings before any call: a key
  // it does not name returns to its value at installation.
  static const allocator_config* const installed = new allocator_config(process_allocator_config());
  const allocator_config wanted = installed->with(shared);
  if (process_allocators_created()) {
    process_allocators().update_config(wanted);
  } else {
    configure_process_allocators(wanted);
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
