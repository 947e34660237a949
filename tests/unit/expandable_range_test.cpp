// expandable_range on the simulated device: reserve, map (with peers and
// the undo of a failed map), unmap from the end, peers granted before and
// after mapping, release.
#include "streamalloc/core/expandable_range.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/util/bytes.hpp"
#include "support/catch.hpp"

using namespace streamalloc;

namespace {

std::vector<physical_handle> create_chunks(sim_backend& sim, std::size_t n) {
  std::vector<physical_handle> out(n, 0);
  for (physical_handle& h : out) REQUIRE(sim.vm_create(2_MiB, &h).ok());
  return out;
}

void* at(const expandable_range& range, std::size_t slot) {
  return reinterpret_cast<void*>(range.address() + slot * range.chunk_bytes());
}

}  // namespace

TEST_CASE("expandable_range: map, unmap from the end, release", "[expandable_range]") {
  sim_backend sim;
  status st;
  std::unique_ptr<expandable_range> range = expandable_range::reserve(sim, 8_MiB, 2_MiB, {}, &st);
  REQUIRE(range != nullptr);
  CHECK(range->slots() == 4);
  CHECK(range->size() == 8_MiB);

  const std::vector<physical_handle> handles = create_chunks(sim, 3);
  expandable_range::map_result result;
  REQUIRE(range->map(range->address() + 2_MiB, handles, 1, &result).ok());
  CHECK(result.mapped == 3);
  CHECK(result.undone == 0);
  CHECK(range->mapped_chunks() == 3);
  CHECK(range->chunk(0) == 0);
  CHECK(range->chunk(1) == handles[0]);
  CHECK(range->stitched(1));
  CHECK_FALSE(range->stitched(2));
  CHECK(range->any_stitched(range->address(), range->address() + 4_MiB));
  CHECK_FALSE(range->any_stitched(range->address() + 4_MiB, range->address() + 8_MiB));
  CHECK(range->chunks_of(1, 3) == std::vector<physical_handle>{handles[0], handles[1]});
  CHECK_FALSE(range->release());  // chunks are mapped

  std::vector<physical_handle> taken;
  const std::size_t done =
      range->unmap_backwards(range->address() + 8_MiB, 2, [&](physical_handle h) { taken.push_back(h); });
  CHECK(done == 2);
  CHECK(taken == std::vector<physical_handle>{handles[2], handles[1]});  // the last chunk first
  CHECK(range->mapped_chunks() == 1);
  CHECK(range->chunk(3) == 0);
  CHECK(range->unmap_backwards(range->address() + 4_MiB, 1, [&](physical_handle h) { taken.push_back(h); }) == 1);
  CHECK_FALSE(range->stitched(1));
  for (physical_handle h : taken) CHECK(sim.vm_destroy(h).ok());
  CHECK(range->release());
  CHECK(sim.live_chunks() == 0);
}

TEST_CASE("expandable_range: a failed map undoes what it mapped", "[expandable_range][fault]") {
  sim_backend sim;
  status st;
  std::unique_ptr<expandable_range> range = expandable_range::reserve(sim, 8_MiB, 2_MiB, {}, &st);
  REQUIRE(range != nullptr);
  const std::vector<physical_handle> handles = create_chunks(sim, 3);
  sim.fail_nth(sim_fault_point::vm_map, 3, status_code::device_error);
  expandable_range::map_result result;
  CHECK(range->map(range->address(), handles, 0, &result).code() == status_code::device_error);
  CHECK(result.mapped == 2);
  CHECK(result.undone == 2);
  CHECK(range->mapped_chunks() == 0);
  CHECK(sim.mapped_chunks() == 0);
  for (physical_handle h : handles) CHECK(sim.vm_destroy(h).ok());
  CHECK(range->release());
}

TEST_CASE("expandable_range: peers reach chunks mapped before and after the grant", "[expandable_range]") {
  sim_backend sim;
  status st;
  std::unique_ptr<expandable_range> range = expandable_range::reserve(sim, 8_MiB, 2_MiB, {2}, &st);
  REQUIRE(range != nullptr);
  const std::vector<physical_handle> handles = create_chunks(sim, 2);
  expandable_range::map_result result;
  REQUIRE(range->map(range->address(), {handles[0]}, 0, &result).ok());
  CHECK(sim.peer_allowed(at(*range, 0), 2));  // a peer given at reservation
  CHECK_FALSE(sim.peer_allowed(at(*range, 0), 1));
  REQUIRE(range->allow_peer(1).ok());
  CHECK(sim.peer_allowed(at(*range, 0), 1));
  REQUIRE(range->map(range->address() + 2_MiB, {handles[1]}, 0, &result).ok());
  CHECK(sim.peer_allowed(at(*range, 1), 1));
  CHECK(sim.peer_allowed(at(*range, 1), 2));
  range->release_at_exit();
  CHECK(range->mapped_chunks() == 0);
  CHECK(sim.live_chunks() == 0);
}
