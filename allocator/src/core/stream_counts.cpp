// stream_counts past its scanned streams: the hash index, and the first
// count of a stream.
#include "streamalloc/core/stream_counts.hpp"

namespace streamalloc {

std::size_t stream_counts::indexed_position(stream_handle stream) const {
  const auto it = index_.find(stream);
  return it != index_.end() ? it->second : entries_.size();
}

void stream_counts::add_past_scan(stream_handle stream, std::int64_t delta) {
  const std::size_t i = position(stream);
  if (i < entries_.size()) {
    entries_[i].second += delta;
    return;
  }
  // A failed allocation (bad_alloc) leaves the counts as they were.
  entries_.reserve(entries_.size() + 1);
  if (entries_.size() >= k_scanned) {
    // The index exists once past k_scanned streams; it is built here, with
    // the stream that passes them.
    const bool building = entries_.size() == k_scanned;
    try {
      if (building) {
        for (std::size_t j = 0; j < entries_.size(); ++j) index_.emplace(entries_[j].first, j);
      }
      index_.emplace(stream, entries_.size());  // on failure the map is as it was
    } catch (...) {
      if (building) index_.clear();  // the scan serves until the next try
      throw;
    }
  }
  entries_.emplace_back(stream, delta);
}

}  // namespace streamalloc
