// free_block_index: the free blocks of one pool (or the unmapped blocks of
// one kind of expandable range), so that best fit for a common size is a
// bit scan instead of a tree walk (Note [size classes] in
// free_block_index.cpp). Not thread-safe: used under its allocator's lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "streamalloc/backend/device_backend.hpp"
#include "streamalloc/core/block.hpp"
#include "streamalloc/core/node_recycler.hpp"

namespace streamalloc {

class free_block_index {
 public:
  // Sizes below k_classes class widths have a class of their own.
  static constexpr std::size_t k_classes = 65536;

  // `class_bytes`: a power of two that every block size is a multiple of
  // (min_block_bytes). Best fit is exact only for such sizes; any size is
  // kept, and never found for a request larger than it. `recycler` keeps
  // the nodes of the tree of larger blocks and must outlive the index.
  free_block_index(std::size_t class_bytes, node_recycler* recycler);
  free_block_index(const free_block_index&) = delete;
  free_block_index& operator=(const free_block_index&) = delete;

  // A block's stream and size must not change while it is in the index.
  void insert(block* b);
  void erase(block* b);

  // Best fit on `stream`: the smallest block of at least `bytes`, the
  // lowest address among blocks of that size; nullptr if none.
  block* best_fit(stream_handle stream, std::size_t bytes) const;
  // Best fit on `stream` as if `skip`, a block of this index on `stream`,
  // were not here: the next block in (size, address) order when `skip` is
  // the best fit, without a walk.
  block* best_fit_besides(stream_handle stream, std::size_t bytes, const block* skip) const;
  // The first block of `stream` of at least `bytes`, in (size, address)
  // order, that `accept` takes; nullptr if none.
  template <typename fn>
  block* first_fit_if(stream_handle stream, std::size_t bytes, fn&& accept) const;
  // Visits each stream that has a block here, in ascending order. `visit`
  // must not change the index.
  template <typename fn>
  void for_each_stream(fn&& visit) const;
  // visit(stream, best_fit(stream, bytes)) for each stream but `skip` whose
  // best fit exists, in ascending stream order, in one pass that looks no
  // stream up: a search of every stream costs as many best fits, not as
  // many lookups as well. `visit` must not change the index.
  template <typename fn>
  void for_each_best_fit(std::size_t bytes, stream_handle skip, fn&& visit) const;
  // Visits the blocks of at least `min_bytes` in (stream, size, address)
  // order. `visit` must not change the index.
  template <typename fn>
  void for_each(fn&& visit, std::size_t min_bytes = 0) const;
  // Visits the blocks of at least `min_bytes` in no particular order,
  // without the sorting of for_each and without allocating. `visit` must
  // not change the index.
  template <typename fn>
  void for_each_unordered(fn&& visit, std::size_t min_bytes = 0) const;
  // True when the blocks here belong to exactly one stream; without a walk
  // of the tree's streams.
  bool one_stream() const;

  std::size_t size() const { return size_; }
  // The first broken invariant of the index's own structure, or "" if none:
  // bitmaps against classes, heap order and links, streams, sizes, tree
  // positions, counts, and no block held twice.
  std::string first_violation() const;

 private:
  static constexpr std::size_t k_group_classes = 64;  // classes per bitmap word
  static constexpr std::size_t k_groups = k_classes / k_group_classes;
  static_assert(k_groups % 64 == 0 && k_groups / 64 < 64, "the summary word covers every word of group bits");

  // 64 consecutive size classes; allocated when one of them is first used.
  struct class_group {
    std::uint64_t non_empty = 0;  // bit j: heaps[j] != nullptr
    block* heaps[k_group_classes] = {};
  };
  // One stream's size classes. The bitmap has three levels: `summary` bit i
  // says group_bits[i] != 0; bit g % 64 of group_bits[g / 64] says group g
  // has a non-empty class; a group's `non_empty` marks its classes.
  struct stream_bins {
    explicit stream_bins(stream_handle s) : stream(s) {}
    stream_handle stream;
    std::size_t blocks = 0;
    std::uint64_t summary = 0;
    std::uint64_t group_bits[k_groups / 64] = {};
    std::unique_ptr<class_group> groups[k_groups];
  };

  std::size_t class_bytes() const { return std::size_t{1} << shift_; }
  std::size_t class_of(std::size_t bytes) const { return bytes >> shift_; }
  // The smallest class whose blocks all hold `bytes` (k_classes: none).
  std::size_t class_for_request(std::size_t bytes) const {
    return bytes <= max_class_request_ ? (bytes + ((std::size_t{1} << shift_) - 1)) >> shift_ : k_classes;
  }
  // The smallest non-empty class >= c of `s`, or k_classes. Always inlined:
  // with a second caller (for_each_best_fit) g++ called it out of line from
  // best_fit, a few instructions more on every allocation.
  [[gnu::always_inline]] static std::size_t next_class(const stream_bins& s, std::size_t c);
  static block* heap_of(const stream_bins& s, std::size_t c) {
    return s.groups[c / k_group_classes]->heaps[c % k_group_classes];
  }
  static void mark_empty(stream_bins& s, std::size_t c) {
    class_group& group = *s.groups[c / k_group_classes];
    group.non_empty &= ~(std::uint64_t{1} << (c % k_group_classes));
    if (group.non_empty != 0) return;
    const std::size_t g = c / k_group_classes;
    s.group_bits[g / 64] &= ~(std::uint64_t{1} << (g % 64));
    if (s.group_bits[g / 64] == 0) s.summary &= ~(std::uint64_t{1} << (g / 64));
  }
  // The slot of `stream` in the cache of stream lookups (Fibonacci hashing,
  // so consecutive handles and pointer-like ones both spread).
  static std::size_t cache_slot(stream_handle stream) {
    return static_cast<std::size_t>((static_cast<std::uint64_t>(stream) * 0x9E3779B97F4A7C15ull) >>
                                    (64 - k_cache_bits));
  }
  stream_bins* bins_of(stream_handle stream) const {
    stream_bins* s = last_;
    if (s != nullptr && s->stream == stream) return s;
    s = cache_[cache_slot(stream)];
    if (s == nullptr || s->stream != stream) return find_bins(stream);
    last_ = s;
    return s;
  }
  // bins_of on a cache miss: a search, whose result takes the slot.
  stream_bins* find_bins(stream_handle stream) const;
  stream_bins& add_stream(stream_handle stream);
  // Pairing heap of one class, ordered by address.
  static block* meld(block* a, block* b);
  static block* merge_pairs(block* first);
  static void cut(block* b);
  // The members of the heap under `root`, by address.
  static void heap_members(block* root, std::vector<block*>* out);
  // Visits the members of the heap under `root` in heap order.
  template <typename fn>
  static void visit_heap(block* root, fn&& visit);
  // The first tree entry of the next stream after `it`'s.
  free_block_tree::const_iterator next_stream(free_block_tree::const_iterator it) const {
    return tree_.upper_bound(tree_entry{it->stream, std::numeric_limits<std::size_t>::max(),
                                        std::numeric_limits<std::uintptr_t>::max(), nullptr});
  }
  // Out of line, so the class path of insert stays short where it is inlined.
  void insert_in_tree(block* b);
  block* best_in_tree(stream_handle stream, std::size_t bytes) const;
  // Walks the blocks of `stream` from `min_bytes` in (size, address) order
  // until `stop` returns true; returns that block, or nullptr.
  template <typename fn>
  block* walk(stream_handle stream, std::size_t min_bytes, fn&& stop) const;

  unsigned shift_;
  std::size_t max_class_request_;  // the largest request a class can serve
  std::size_t size_ = 0;
  std::vector<std::unique_ptr<stream_bins>> streams_;  // ascending by stream
  // The stream looked up last, checked first: one stream at a time skips
  // the hashing. Then a direct-mapped cache of streams_ by cache_slot: the
  // streams of a device (a handful, used round-robin or handing blocks to
  // each other) each keep a slot, so a lookup is a load and a compare
  // instead of a search. Both stay valid because stream_bins live as long
  // as the index.
  static constexpr unsigned k_cache_bits = 6;
  mutable stream_bins* last_ = nullptr;
  mutable stream_bins* cache_[std::size_t{1} << k_cache_bits] = {};
  free_block_tree tree_;  // blocks without a class, all streams
};

[[gnu::always_inline]] inline std::size_t free_block_index::next_class(const stream_bins& s, std::size_t c) {
  if (c >= k_classes) return k_classes;
  std::size_t g = c / k_group_classes;
  if (const class_group* group = s.groups[g].get()) {
    const std::uint64_t here = group->non_empty & (~std::uint64_t{0} << (c % k_group_classes));
    if (here != 0) return g * k_group_classes + static_cast<std::size_t>(__builtin_ctzll(here));
  }
  ++g;
  std::size_t word = g / 64;  // at most k_groups / 64, so the shifts below stay under 64
  std::uint64_t groups = g < k_groups ? s.group_bits[word] & (~std::uint64_t{0} << (g % 64)) : 0;
  if (groups == 0) {
    const std::uint64_t words = s.summary & (~std::uint64_t{0} << (word + 1));
    if (words == 0) return k_classes;
    word = static_cast<std::size_t>(__builtin_ctzll(words));
    groups = s.group_bits[word];
  }
  g = word * 64 + static_cast<std::size_t>(__builtin_ctzll(groups));
  return g * k_group_classes + static_cast<std::size_t>(__builtin_ctzll(s.groups[g]->non_empty));
}

inline block* free_block_index::meld(block* a, block* b) {
  if (b->address < a->address) std::swap(a, b);
  b->free_links.prev = a;
  b->free_links.next = a->free_links.child;
  if (a->free_links.child != nullptr) a->free_links.child->free_links.prev = b;
  a->free_links.child = b;
  return a;
}

inline void free_block_index::insert(block* b) {
  // Counted once nothing can throw (bad_alloc), so a failure changes nothing.
  const std::size_t c = class_of(b->size);
  if (c >= k_classes) {
    insert_in_tree(b);
    ++size_;
    return;
  }
  stream_bins* s = bins_of(b->stream);
  if (s == nullptr) s = &add_stream(b->stream);
  std::unique_ptr<class_group>& group = s->groups[c / k_group_classes];
  if (group == nullptr) group = std::make_unique<class_group>();
  ++s->blocks;
  ++size_;
  block*& root = group->heaps[c % k_group_classes];
  b->free_links = heap_links{};
  if (root != nullptr) {
    root = meld(root, b);
    return;
  }
  root = b;
  group->non_empty |= std::uint64_t{1} << (c % k_group_classes);
  const std::size_t g = c / k_group_classes;
  s->group_bits[g / 64] |= std::uint64_t{1} << (g % 64);
  s->summary |= std::uint64_t{1} << (g / 64);
}

inline void free_block_index::erase(block* b) {
  --size_;
  const std::size_t c = class_of(b->size);
  if (c >= k_classes) {
    tree_.erase(b->tree_position);
    return;
  }
  stream_bins& s = *bins_of(b->stream);
  --s.blocks;
  block*& root = s.groups[c / k_group_classes]->heaps[c % k_group_classes];
  block* children = b->free_links.child;
  if (root == b) {
    root = children == nullptr ? nullptr : merge_pairs(children);
    if (root == nullptr) mark_empty(s, c);
    return;
  }
  cut(b);
  if (children != nullptr) root = meld(root, merge_pairs(children));
}

inline block* free_block_index::best_fit(stream_handle stream, std::size_t bytes) const {
  const std::size_t request_class = class_for_request(bytes);
  if (request_class < k_classes) {
    const stream_bins* s = bins_of(stream);
    if (s != nullptr && s->blocks != 0) {
      const std::size_t c = next_class(*s, request_class);
      if (c < k_classes) return heap_of(*s, c);
    }
  }
  return tree_.empty() ? nullptr : best_in_tree(stream, bytes);
}

inline block* free_block_index::best_fit_besides(stream_handle stream, std::size_t bytes, const block* skip) const {
  // skip alone here (a segment's remainder behind a repeated request): no search.
  if (size_ == 1) return nullptr;
  block* best = best_fit(stream, bytes);
  if (best != skip) return best;
  const std::size_t c = class_of(skip->size);
  if (c >= k_classes) {
    auto it = std::next(skip->tree_position);
    return it != tree_.end() && it->stream == stream ? it->b : nullptr;
  }
  // skip is its class's root, the lowest address there; the next lowest is
  // the lowest of its children.
  block* next = nullptr;
  for (block* child = skip->free_links.child; child != nullptr; child = child->free_links.next) {
    if (next == nullptr || child->address < next->address) next = child;
  }
  if (next != nullptr) return next;
  const std::size_t after = next_class(*bins_of(stream), c + 1);
  if (after < k_classes) return heap_of(*bins_of(stream), after);
  return tree_.empty() ? nullptr : best_in_tree(stream, bytes);
}

template <typename fn>
block* free_block_index::walk(stream_handle stream, std::size_t min_bytes, fn&& stop) const {
  if (const stream_bins* s = bins_of(stream); s != nullptr && s->blocks != 0) {
    std::vector<block*> members;
    for (std::size_t c = next_class(*s, class_for_request(min_bytes)); c < k_classes; c = next_class(*s, c + 1)) {
      members.clear();
      heap_members(heap_of(*s, c), &members);
      for (block* b : members) {
        if (stop(b)) return b;
      }
    }
  }
  for (auto it = tree_.lower_bound(tree_entry{stream, min_bytes, 0, nullptr}); it != tree_.end() && it->stream == stream;
       ++it) {
    if (stop(it->b)) return it->b;
  }
  return nullptr;
}

template <typename fn>
block* free_block_index::first_fit_if(stream_handle stream, std::size_t bytes, fn&& accept) const {
  block* best = best_fit(stream, bytes);
  if (best == nullptr || accept(best)) return best;
  return walk(stream, bytes, accept);
}

template <typename fn>
void free_block_index::for_each_stream(fn&& visit) const {
  // The union of the streams with classes in use and those in the tree.
  auto t = tree_.begin();
  for (const auto& s : streams_) {
    for (; t != tree_.end() && t->stream < s->stream; t = next_stream(t)) visit(t->stream);
    const bool in_tree = t != tree_.end() && t->stream == s->stream;
    if (in_tree) t = next_stream(t);
    if (in_tree || s->blocks != 0) visit(s->stream);
  }
  for (; t != tree_.end(); t = next_stream(t)) visit(t->stream);
}

template <typename fn>
void free_block_index::for_each_best_fit(std::size_t bytes, stream_handle skip, fn&& visit) const {
  const std::size_t request_class = class_for_request(bytes);
  auto t = tree_.begin();
  // The best fit among the tree entries of t's stream, whose first entry t
  // is (nullptr for `skip`); t moves on to the next stream's.
  const auto tree_best = [&]() -> block* {
    const stream_handle stream = t->stream;
    if (stream == skip) {
      t = next_stream(t);
      return nullptr;
    }
    t = next_stream(t);
    return best_in_tree(stream, bytes);
  };
  const auto tree_streams_before = [&](stream_handle limit, bool all) {
    while (t != tree_.end() && (all || t->stream < limit)) {
      const stream_handle stream = t->stream;
      if (block* b = tree_best()) visit(stream, b);
    }
  };
  for (const auto& s : streams_) {
    tree_streams_before(s->stream, false);
    const bool in_tree = t != tree_.end() && t->stream == s->stream;
    if (s->stream == skip) {
      if (in_tree) t = next_stream(t);
      continue;
    }
    block* b = nullptr;
    if (request_class < k_classes && s->blocks != 0) {
      // A class block is smaller than any tree block: the tree is not asked.
      const std::size_t c = next_class(*s, request_class);
      if (c < k_classes) b = heap_of(*s, c);
    }
    if (in_tree) {
      if (b == nullptr) {
        b = tree_best();
      } else {
        t = next_stream(t);
      }
    }
    if (b != nullptr) visit(s->stream, b);
  }
  tree_streams_before(0, true);
}

template <typename fn>
void free_block_index::for_each(fn&& visit, std::size_t min_bytes) const {
  for_each_stream([&](stream_handle stream) {
    walk(stream, min_bytes, [&](block* b) {
      visit(b);
      return false;
    });
  });
}

template <typename fn>
void free_block_index::visit_heap(block* root, fn&& visit) {
  // Depth first over the child and sibling links; climbing from a last
  // sibling goes back through its older siblings to the parent (the prev
  // link of a first child), so no stack is needed.
  block* b = root;
  while (true) {
    visit(b);
    if (b->free_links.child != nullptr) {
      b = b->free_links.child;
      continue;
    }
    while (b != root && b->free_links.next == nullptr) {
      block* up = b->free_links.prev;
      while (up->free_links.child != b) {
        b = up;
        up = up->free_links.prev;
      }
      b = up;
    }
    if (b == root) return;
    b = b->free_links.next;
  }
}

template <typename fn>
void free_block_index::for_each_unordered(fn&& visit, std::size_t min_bytes) const {
  for (const auto& s : streams_) {
    if (s->blocks == 0) continue;
    for (std::size_t c = next_class(*s, class_for_request(min_bytes)); c < k_classes; c = next_class(*s, c + 1)) {
      visit_heap(heap_of(*s, c), visit);
    }
  }
  for (const tree_entry& entry : tree_) {
    if (entry.size >= min_bytes) visit(entry.b);
  }
}

}  // namespace streamalloc
