// How streamalloc's C++ errors reach torch: every entry point of the torch
// allocator runs its body through guarded(), so out_of_memory arrives as
// c10::OutOfMemoryError (Python: torch.cuda.OutOfMemoryError) and every
// other exception as c10::Error (RuntimeError), never as an unknown type.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <utility>

#include "streamalloc/util/errors.hpp"

namespace streamalloc {

// Called inside a catch block: rethrows the exception being handled as the
// torch exception Python users expect.
[[noreturn]] inline void rethrow_for_torch() {
  try {
    throw;
  } catch (const c10::Error&) {
    throw;
  } catch (const out_of_memory& e) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, e.what());
  }
}

template <typename body_type>
decltype(auto) guarded(body_type&& body) {
  try {
    return std::forward<body_type>(body)();
  } catch (...) {
    rethrow_for_torch();
  }
}

}  // namespace streamalloc
