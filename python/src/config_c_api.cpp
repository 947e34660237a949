// libstreamalloc_config.so: the configuration parser and key table of the
// core behind a C interface that needs neither CUDA nor torch, so that
// streamalloc.config() and config_keys() work anywhere and the README's
// configuration table is generated from the same table the parser uses.
#include "config_c_api.h"

#include <exception>
#include <string>

#include "streamalloc/core/config.hpp"
#include "streamalloc/version.hpp"

namespace {

using streamalloc::allocator_config;

// "key:value" entries of the defaults, in key-table order (to_string()
// renders every key in that order).
std::string default_value(const std::string& rendered, const std::string& key) {
  std::size_t start = 0;
  while (start < rendered.size()) {
    std::size_t end = rendered.find(',', start);
    if (end == std::string::npos) end = rendered.size();
    const std::string entry = rendered.substr(start, end - start);
    if (entry.compare(0, key.size() + 1, key + ":") == 0) return entry.substr(key.size() + 1);
    start = end + 1;
  }
  return "";
}

std::string key_table() {
  const std::string defaults = allocator_config{}.to_string();
  std::string text;
  for (const allocator_config::key_doc& doc : allocator_config::keys()) {
    text += doc.key;
    text += '\t';
    text += default_value(defaults, doc.key);
    text += '\t';
    text += doc.description;
    text += '\n';
  }
  return text;
}

}  // namespace

extern "C" {

const char* streamalloc_config_version(void) { return STREAMALLOC_VERSION; }

const char* streamalloc_config_keys(void) {
  try {
    static const std::string table = key_table();
    return table.c_str();
  } catch (...) {
    return "";
  }
}

int streamalloc_config_resolve(const char* torch_settings, const char* text, const char** result) {
  thread_local std::string answer;
  const auto string_of = [](const char* c) { return c == nullptr ? std::string() : std::string(c); };
  try {
    const std::string from_torch = allocator_config::split_torch_settings(string_of(torch_settings)).applied;
    answer = allocator_config::parse(from_torch).with(string_of(text)).to_string();
    *result = answer.c_str();
    return 0;
  } catch (const std::exception& e) {
    try {
      answer = e.what();
    } catch (...) {
      answer.clear();
    }
  } catch (...) {
    answer = "streamalloc_config_resolve: unknown exception";
  }
  *result = answer.c_str();
  return -1;
}

}  // extern "C"
