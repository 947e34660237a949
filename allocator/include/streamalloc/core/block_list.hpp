// block_list: the surgery on an address-ordered list of blocks -- where a
// block is split, where it absorbs its neighbour, where one is unlinked.
// Every list of blocks in the project goes through these: the device
// allocator's segments and expandable ranges (streamalloc::block) and the
// pinned pool's slabs (pinned_pool's block).
//
// A block type fits when it has `address`, `size`, `owner`, `prev` and
// `next` (a block tiles its owner with its neighbours, linked both ways in
// address order). The functions move bytes and links only: free sets,
// statistics and the other fields of a block stay the caller's business,
// and so does the memory of a block a function hands back.
#pragma once

#include <cstddef>

namespace streamalloc {

// Split: `b` keeps its first `offset` bytes; `rest` (a fresh block) takes
// the others and is linked right after `b`, in the same owner. Returns
// `rest`. Requires 0 < offset < b->size.
template <typename block_type>
block_type* split_at(block_type* b, std::size_t offset, block_type* rest) {
  rest->address = b->address + offset;
  rest->size = b->size - offset;
  rest->owner = b->owner;
  rest->prev = b;
  rest->next = b->next;
  if (b->next != nullptr) b->next->prev = rest;
  b->next = rest;
  b->size = offset;
  return rest;
}

// Takes `b` out of its list: its neighbours are linked to each other. `b`'s
// own links are left as they were. The owner's first block is not updated:
// `b` must not be it.
template <typename block_type>
void unlink(block_type* b) {
  if (b->prev != nullptr) b->prev->next = b->next;
  if (b->next != nullptr) b->next->prev = b->prev;
}

// Merge: `b` grows over the block after it, which leaves the list and is
// returned for the caller to recycle. Requires b->next != nullptr.
template <typename block_type>
block_type* absorb_next(block_type* b) {
  block_type* next = b->next;
  b->size += next->size;
  unlink(next);
  return next;
}

}  // namespace streamalloc
