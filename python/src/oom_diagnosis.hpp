// oom_diagnosis: the torch layer's side of oom_report.hpp. Builds the
// report for an out_of_memory on its way to torch, keeps the newest one
// for streamalloc.last_oom_report(), and returns the lines torch's message
// ends with.
#pragma once

#include <optional>
#include <string>

#include "streamalloc/core/oom_report.hpp"
#include "streamalloc/util/errors.hpp"

namespace streamalloc {

// The text to append to `error`'s message ("" if the report could not be
// built). Reads the failing device's stats and tags; calls no Python.
std::string diagnose_out_of_memory(const out_of_memory& error) noexcept;

// The report of the newest out-of-memory error, if any.
std::optional<oom_report> last_oom_report();

}  // namespace streamalloc
