// block_list: split, absorb and unlink on a list of blocks, with the
// allocator's block type and with a minimal one (the pinned pool's shape).
#include "streamalloc/core/block_list.hpp"

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "streamalloc/core/block.hpp"
#include "support/catch.hpp"

using namespace streamalloc;

namespace {

struct tiny_owner {};
struct tiny_block {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  tiny_owner* owner = nullptr;
  tiny_block* prev = nullptr;
  tiny_block* next = nullptr;
};

template <typename block_type>
void check_links(const block_type* first, std::uintptr_t address, std::size_t size) {
  std::uintptr_t expected = address;
  const block_type* prev = nullptr;
  for (const block_type* b = first; b != nullptr; b = b->next) {
    CHECK(b->prev == prev);
    CHECK(b->address == expected);
    CHECK(b->owner == first->owner);
    expected += b->size;
    prev = b;
  }
  CHECK(expected == address + size);
}

}  // namespace

TEMPLATE_TEST_CASE("block_list: split, absorb and unlink keep the list tiling its owner", "[block_list]", block,
                   tiny_block) {
  using owner_type = std::remove_pointer_t<decltype(TestType::owner)>;
  owner_type owner;
  TestType a, b, c;
  a.address = 0x1000;
  a.size = 0x3000;
  a.owner = &owner;

  TestType* rest = split_at(&a, 0x1000, &b);
  CHECK(rest == &b);
  CHECK(a.size == 0x1000);
  CHECK(b.address == 0x2000);
  CHECK(b.size == 0x2000);
  split_at(&b, 0x800, &c);  // in the middle of the list: a, b, c
  CHECK(a.next == &b);
  CHECK(b.next == &c);
  CHECK(c.prev == &b);
  check_links(&a, 0x1000, 0x3000);

  CHECK(absorb_next(&a) == &b);  // a, c
  CHECK(a.size == 0x1800);
  CHECK(a.next == &c);
  CHECK(c.prev == &a);
  check_links(&a, 0x1000, 0x3000);

  CHECK(absorb_next(&a) == &c);  // a alone
  CHECK(a.size == 0x3000);
  CHECK(a.next == nullptr);
  check_links(&a, 0x1000, 0x3000);

  split_at(&a, 0x1000, &b);
  split_at(&b, 0x1000, &c);
  unlink(&b);
  CHECK(a.next == &c);
  CHECK(c.prev == &a);
  CHECK(b.prev == &a);  // the unlinked block's own links are left alone
  CHECK(b.next == &c);
}
