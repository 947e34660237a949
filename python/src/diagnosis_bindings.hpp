// The diagnosis part of streamalloc._C: allocation tags, their summaries
// and the newest out-of-memory report (see diagnosis_bindings.cpp).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>

namespace streamalloc {

// Adds enable_tagging, disable_tagging, tagging_options, intern_tag,
// tag_name, thread_tag, set_thread_tag, set_inherited_tag,
// restore_inherited_tag, tag_summary, tag_of and last_oom_report.
void bind_diagnosis(pybind11::module_& m);

// The tag name of the live allocation at `address` for snapshots, or None
// when tagging is off or the allocation was not recorded.
pybind11::object tag_name_of(std::uintptr_t address);

}  // namespace streamalloc
