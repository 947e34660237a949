// free_block_index: size classes with a bitmap for best fit, a tree for
// sizes above them, and the checks validate() runs on both.
//
// Note [size classes]: per stream, every multiple of the class width
// (min_block_bytes, 512 B by default) below k_classes widths -- 32 MiB by
// default -- has a class of its own; larger blocks of every stream share
// one tree ordered by (stream, size, address), as the whole pool was
// before. The limit covers every block of a shared segment with the
// default settings (2 MiB small segments; 20 MiB large ones, which serve
// requests under 10 MiB; the 2 MiB chunks of expandable segments and the
// mid-size blocks packed into them), so the tree holds only blocks of
// requests that got a segment of their own and long free runs of
// expandable segments: few blocks, and the search stays small beside the
// device work that made them.
// - Best fit is a bit scan: a three-level bitmap (a summary word, 16 words
//   of groups, a word per group of 64 classes) marks the non-empty classes,
//   so the smallest one at or above the request's class is found in at most
//   four word scans, whatever the number of cached blocks.
// - Within a class the blocks form a pairing heap ordered by address. Its
//   root is the best fit, so ties go to the lowest address exactly as when a
//   pool was one ordered set, and no placement decision changed (the replay
//   corpus gives the same numbers). Inserting costs O(1); removing costs
//   O(1) from a class of one block (the common case: a same-size pair
//   splits one block and merges it back) and O(log n) amortized from a long
//   class, where an address-sorted list would cost O(n) per insert.
// - Memory: per stream with a block below the limit, 8 KiB of group
//   pointers and 136 bytes of bitmap, plus 520 bytes per group of 64
//   classes ever used. Streams and groups stay once made, so the hot path
//   never allocates, even when cross-stream reuse moves a stream's last
//   block away and back.
// - Walks in (stream, size, address) order (validate, statistics, the OOM
//   report, releasing oversize segments) sort each class's heap by address:
//   slower than a tree walk, and off the hot path. Cross-stream borrowing
//   asks every stream for its best fit in one pass over the streams
//   (for_each_best_fit), with no lookup of each.
//   The stitch's donor search and the placement of new chunks, which run
//   on every stitch or growth and need no order, walk the heaps as they
//   are (for_each_unordered).
#include "streamalloc/core/free_block_index.hpp"

#include <algorithm>
#include <iterator>
#include <limits>

namespace streamalloc {

namespace {

template <typename list>
auto stream_position(list& streams, stream_handle stream) {
  return std::lower_bound(streams.begin(), streams.end(), stream,
                          [](const auto& s, stream_handle h) { return s->stream < h; });
}

}  // namespace

free_block_index::free_block_index(std::size_t class_bytes, node_recycler* recycler)
    : shift_(class_bytes <= 1 ? 0u : 63u - static_cast<unsigned>(__builtin_clzll(class_bytes))),
      // (k_classes - 1) << shift_ unless that overflows; then any size
      // that rounding up to the class width does not overflow.
      max_class_request_(((k_classes - 1) << shift_) >> shift_ == k_classes - 1
                             ? (k_classes - 1) << shift_
                             : std::numeric_limits<std::size_t>::max() - ((std::size_t{1} << shift_) - 1)),
      tree_(tree_order{}, recycling_allocator<tree_entry>(recycler)) {}

free_block_index::stream_bins* free_block_index::find_bins(stream_handle stream) const {
  auto it = stream_position(streams_, stream);
  if (it == streams_.end() || (*it)->stream != stream) return nullptr;
  last_ = cache_[cache_slot(stream)] = it->get();
  return last_;
}

free_block_index::stream_bins& free_block_index::add_stream(stream_handle stream) {
  auto it = streams_.insert(stream_position(streams_, stream), std::make_unique<stream_bins>(stream));
  last_ = cache_[cache_slot(stream)] = it->get();
  return *last_;
}

block* free_block_index::merge_pairs(block* first) {
  // Two passes: meld neighbours pairwise left to right, stacking the
  // results through `next`; then meld the stack into one heap right to left.
  block* stack = nullptr;
  while (first != nullptr) {
    block* a = first;
    block* b = a->free_links.next;
    first = b != nullptr ? b->free_links.next : nullptr;
    block* pair = b != nullptr ? meld(a, b) : a;
    pair->free_links.next = stack;
    stack = pair;
  }
  block* root = stack;
  stack = stack->free_links.next;
  while (stack != nullptr) {
    block* next = stack->free_links.next;
    root = meld(root, stack);
    stack = next;
  }
  root->free_links.prev = nullptr;
  root->free_links.next = nullptr;
  return root;
}

void free_block_index::cut(block* b) {
  block* prev = b->free_links.prev;
  if (prev->free_links.child == b) {
    prev->free_links.child = b->free_links.next;
  } else {
    prev->free_links.next = b->free_links.next;
  }
  if (b->free_links.next != nullptr) b->free_links.next->free_links.prev = prev;
}

void free_block_index::heap_members(block* root, std::vector<block*>* out) {
  const std::size_t start = out->size();
  out->push_back(root);
  for (std::size_t i = start; i < out->size(); ++i) {
    for (block* child = (*out)[i]->free_links.child; child != nullptr; child = child->free_links.next) {
      out->push_back(child);
    }
  }
  std::sort(out->begin() + static_cast<std::ptrdiff_t>(start), out->end(),
            [](const block* a, const block* b) { return a->address < b->address; });
}

void free_block_index::insert_in_tree(block* b) {
  b->tree_position = tree_.insert(tree_entry{b->stream, b->size, b->address, b}).first;
}

block* free_block_index::best_in_tree(stream_handle stream, std::size_t bytes) const {
  auto it = tree_.lower_bound(tree_entry{stream, bytes, 0, nullptr});
  return it != tree_.end() && it->stream == stream ? it->b : nullptr;
}

bool free_block_index::one_stream() const {
  bool any = false;
  stream_handle only = 0;
  if (!tree_.empty()) {
    // Ordered by stream first: one stream when the first and last agree.
    if (tree_.begin()->stream != std::prev(tree_.end())->stream) return false;
    only = tree_.begin()->stream;
    any = true;
  }
  for (const auto& s : streams_) {
    if (s->blocks == 0) continue;
    if (any && s->stream != only) return false;
    only = s->stream;
    any = true;
  }
  return any;
}

std::string free_block_index::first_violation() const {
  std::vector<const block*> seen;
  std::vector<const block*> todo;
  for (std::size_t i = 0; i < streams_.size(); ++i) {
    const stream_bins& s = *streams_[i];
    if (i > 0 && streams_[i - 1]->stream >= s.stream) return "streams out of order";
    const std::size_t before = seen.size();
    // Walked by the bitmap: a class or group holding blocks its bit does
    // not mark hides them, which the count below reveals.
    for (std::size_t word = 0; word < k_groups / 64; ++word) {
      if (((s.summary >> word) & 1) != (s.group_bits[word] != 0 ? 1u : 0u)) return "a summary bit disagrees with its groups";
      for (std::uint64_t groups = s.group_bits[word]; groups != 0; groups &= groups - 1) {
        const std::size_t g = word * 64 + static_cast<std::size_t>(__builtin_ctzll(groups));
        const class_group* group = s.groups[g].get();
        if (group == nullptr || group->non_empty == 0) return "a group bit marks an empty group";
        for (std::uint64_t classes = group->non_empty; classes != 0; classes &= classes - 1) {
          const std::size_t j = static_cast<std::size_t>(__builtin_ctzll(classes));
          const block* root = group->heaps[j];
          if (root == nullptr) return "a class bit marks an empty class";
          if (root->free_links.prev != nullptr || root->free_links.next != nullptr) return "a class's root has a parent or siblings";
          const std::size_t c = g * k_group_classes + j;
          todo.assign(1, root);
          while (!todo.empty()) {
            const block* node = todo.back();
            todo.pop_back();
            seen.push_back(node);
            if (seen.size() > size_) return "the heaps hold more blocks than the index counts (a cycle?)";
            if (node->stream != s.stream) return "a block is kept under another stream";
            if (class_of(node->size) != c) return "a block is in another size's class";
            const block* prev = node;
            for (const block* child = node->free_links.child; child != nullptr; child = child->free_links.next) {
              if (child->free_links.prev != prev) return "broken heap links";
              if (child->address <= node->address) return "a class's heap is out of address order";
              todo.push_back(child);
              prev = child;
            }
          }
        }
      }
    }
    if (seen.size() - before != s.blocks) return "a stream's block count is off";
  }
  for (auto it = tree_.begin(); it != tree_.end(); ++it) {
    const tree_entry& entry = *it;
    seen.push_back(entry.b);
    if (entry.stream != entry.b->stream || entry.size != entry.b->size || entry.address != entry.b->address) {
      return "a tree's copy of a block's key is out of date";
    }
    if (class_of(entry.size) < k_classes) return "a block with a size class is in the tree";
    if (entry.b->tree_position != it) return "a block's tree position is stale";
  }
  if (seen.size() != size_) return "the index's block count is off";
  if (last_ != nullptr && cache_[cache_slot(last_->stream)] != last_) return "the last stream looked up is not cached";
  for (std::size_t slot = 0; slot < std::size(cache_); ++slot) {
    const stream_bins* cached = cache_[slot];
    if (cached == nullptr) continue;
    if (cache_slot(cached->stream) != slot) return "a stream is cached in another stream's slot";
    auto it = stream_position(streams_, cached->stream);
    if (it == streams_.end() || it->get() != cached) return "a cached stream is not among the index's streams";
  }
  for (const block* b : seen) {
    if ((b->size & (class_bytes() - 1)) != 0) return "a block size is not a multiple of the class width";
  }
  std::sort(seen.begin(), seen.end());
  if (std::adjacent_find(seen.begin(), seen.end()) != seen.end()) return "a block is kept twice";
  return std::string();
}

}  // namespace streamalloc
