// Substring check for error-message assertions (Catch2 2.13 and 3 spell
// their string matchers differently).
#pragma once

#include <string>

namespace streamalloc::test {

inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace streamalloc::test
