// stream_counts: one signed count per stream, for the handful of streams a
// device serves: a flat vector searched from the front, so an update costs
// a few compares and no hashing. Entries are never removed (a stream whose
// count returns to zero keeps its slot), so the vector's length is the
// number of streams ever counted, and their order is the order in which
// they were first counted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "streamalloc/backend/device_backend.hpp"

namespace streamalloc {

class stream_counts {
 public:
  void add(stream_handle stream, std::int64_t delta) {
    for (auto& [s, count] : entries_) {
      if (s == stream) {
        count += delta;
        return;
      }
    }
    entries_.emplace_back(stream, delta);
  }

  std::int64_t get(stream_handle stream) const {
    for (const auto& [s, count] : entries_) {
      if (s == stream) return count;
    }
    return 0;
  }

  // Where `stream` was first counted among the streams (0 for the first);
  // the number of streams counted if it never was.
  std::size_t rank(stream_handle stream) const {
    std::size_t i = 0;
    while (i < entries_.size() && entries_[i].first != stream) ++i;
    return i;
  }

  template <typename Fn>
  void for_each(Fn&& fn) const {
    for (const auto& [s, count] : entries_) fn(s, count);
  }

 private:
  std::vector<std::pair<stream_handle, std::int64_t>> entries_;
};

}  // namespace streamalloc
