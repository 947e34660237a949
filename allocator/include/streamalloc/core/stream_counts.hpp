// stream_counts: one signed count per stream. A device usually serves a
// handful of streams: a flat vector searched from the front, so an update
// costs a few compares and no hashing. Past k_scanned streams (a program
// with external streams of its own, or all of torch's pools in use) a hash
// index finds the entry, so an update stays O(1) however many streams there
// are. Entries are never removed (a stream whose count returns to zero
// keeps its slot), so the vector's length is the number of streams ever
// counted, and their order is the order in which they were first counted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "streamalloc/backend/device_backend.hpp"

namespace streamalloc {

class stream_counts {
 public:
  // Streams found by a scan of the vector; past them, by the index. A scan
  // of 32 pairs costs about what a hash lookup does; torch's stream pool
  // holds 32 streams of each priority.
  static constexpr std::size_t k_scanned = 32;

  void add(stream_handle stream, std::int64_t delta) {
    if (entries_.size() <= k_scanned) {
      for (auto& [s, count] : entries_) {
        if (s == stream) {
          count += delta;
          return;
        }
      }
    }
    add_past_scan(stream, delta);
  }

  std::int64_t get(stream_handle stream) const {
    const std::size_t i = position(stream);
    return i < entries_.size() ? entries_[i].second : 0;
  }

  // Where `stream` was first counted among the streams (0 for the first);
  // the number of streams counted if it never was.
  std::size_t rank(stream_handle stream) const { return position(stream); }

  template <typename Fn>
  void for_each(Fn&& fn) const {
    for (const auto& [s, count] : entries_) fn(s, count);
  }

 private:
  std::size_t position(stream_handle stream) const {
    if (entries_.size() > k_scanned) return indexed_position(stream);
    std::size_t i = 0;
    while (i < entries_.size() && entries_[i].first != stream) ++i;
    return i;
  }
  // Out of line (stream_counts.cpp), so the scan stays short where inlined:
  // the index's lookup, and a stream's first count.
  std::size_t indexed_position(stream_handle stream) const;
  void add_past_scan(stream_handle stream, std::int64_t delta);

  std::vector<std::pair<stream_handle, std::int64_t>> entries_;
  std::unordered_map<stream_handle, std::size_t> index_;  // stream -> position, past k_scanned streams
};

}  // namespace streamalloc
