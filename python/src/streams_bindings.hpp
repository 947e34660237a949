// The streams layer's part of streamalloc._C: PinnedPool, pinned tensors
// and the staged pageable copy (see streams_bindings.cpp).
#pragma once

#include <pybind11/pybind11.h>

namespace streamalloc {

// Adds _PinnedPool, _default_pinned_pool, _record_pinned_stream,
// _staged_to_device and _staged_copy_stream to the module.
void bind_streams(pybind11::module_& m);

}  // namespace streamalloc
