// make_oom_report: the case and suggestion chosen from the figures, the
// holders (with the memory allocated before tagging began), and the text;
// then on the simulated device, a real out_of_memory turned into a report.
#include <cstddef>
#include <string>
#include <vector>

#include "streamalloc/core/allocation_tags.hpp"
#include "streamalloc/core/oom_report.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/contains.hpp"
#include "support/sim_fixture.hpp"

using namespace streamalloc;
using streamalloc::test::contains;
using streamalloc::test::plain_device;
using streamalloc::test::sim_fixture;

namespace {

// A 80 GiB device with nothing outside streamalloc, `allocated` live and
// `reserved` reserved; `largest` is the largest free cached block.
struct figures {
  oom_context context;
  device_stats stats;
};

figures make_figures(std::size_t requested, std::size_t allocated, std::size_t reserved, std::size_t largest,
                     std::size_t allowed = 80_GiB) {
  figures f;
  oom_context& c = f.context;
  c.device = 0;
  c.requested_bytes = requested;
  c.device_total_bytes = 80_GiB;
  c.allowed_bytes = allowed;
  c.reserved_bytes = reserved;
  c.allocated_bytes = allocated;
  c.device_free_bytes = 80_GiB - reserved;
  c.largest_free_block_bytes = largest;
  f.stats.allocated_bytes[0].current = static_cast<std::int64_t>(allocated);
  f.stats.active_bytes[0].current = static_cast<std::int64_t>(allocated);
  f.stats.reserved_bytes[0].current = static_cast<std::int64_t>(reserved);
  f.stats.free_cached_bytes = static_cast<std::int64_t>(reserved - allocated);
  return f;
}

}  // namespace

TEST_CASE("oom_report: a request larger than the limit says so", "[oom_report]") {
  figures f = make_figures(100_GiB, 1_GiB, 2_GiB, 1_GiB);
  const oom_report r = make_oom_report(f.context, f.stats, nullptr, false);
  CHECK(r.kind == oom_case::request_exceeds_limit);
  CHECK(contains(r.suggestion, "request alone"));
  CHECK_FALSE(contains(r.suggestion, "set_per_process_memory_fraction"));

  figures capped = make_figures(5_GiB, 1_GiB, 2_GiB, 1_GiB, 4_GiB);
  const oom_report rc = make_oom_report(capped.context, capped.stats, nullptr, false);
  CHECK(rc.kind == oom_case::request_exceeds_limit);
  CHECK(rc.limit_bytes == 4_GiB);
  CHECK(contains(rc.suggestion, "set_per_process_memory_fraction"));
}

TEST_CASE("oom_report: memory awaited by other streams comes before fragmentation", "[oom_report]") {
  figures f = make_figures(1_GiB, 3_GiB, 4_GiB, 100_MiB, 4_GiB);
  f.stats.active_bytes[0].current = static_cast<std::int64_t>(3_GiB + 2_GiB);
  const oom_report r = make_oom_report(f.context, f.stats, nullptr, false);
  CHECK(r.kind == oom_case::pending_streams);
  CHECK(r.pending_other_streams_bytes == 2_GiB);
  CHECK(contains(r.suggestion, "synchronize"));
}

TEST_CASE("oom_report: fragmentation suggests expandable segments, or empty_cache when they are on", "[oom_report]") {
  // 1.5 GiB unallocated, but no block of 1 GiB.
  figures f = make_figures(1_GiB, 2560_MiB, 4_GiB, 200_MiB, 4_GiB);
  const oom_report plain = make_oom_report(f.context, f.stats, nullptr, false);
  CHECK(plain.kind == oom_case::fragmentation);
  CHECK(plain.unallocated_bytes == 1536_MiB);
  CHECK(contains(plain.suggestion, "expandable_segments:True"));
  const oom_report expandable = make_oom_report(f.context, f.stats, nullptr, true);
  CHECK(expandable.kind == oom_case::fragmentation);
  CHECK(contains(expandable.suggestion, "empty_cache"));
}

TEST_CASE("oom_report: memory held outside streamalloc", "[oom_report]") {
  figures f = make_figures(2_GiB, 1_GiB, 1_GiB, 0);
  f.context.device_free_bytes = 1_GiB;  // 78 GiB used by someone else
  const oom_report r = make_oom_report(f.context, f.stats, nullptr, false);
  CHECK(r.kind == oom_case::outside_memory);
  CHECK(r.outside_bytes == 78_GiB);
  CHECK(contains(r.suggestion, "outside streamalloc"));
}

TEST_CASE("oom_report: near the limit, a smaller batch with the numbers", "[oom_report]") {
  // 3.8 GiB live under a 4 GiB cap; 1 GiB more needed: 0.8 GiB too much,
  // 21.05% of the live bytes, rounded up.
  figures f = make_figures(1_GiB, 3891_MiB, 4_GiB, 0, 4_GiB);
  const oom_report r = make_oom_report(f.context, f.stats, nullptr, false);
  CHECK(r.kind == oom_case::near_limit);
  CHECK(r.available_bytes == 4_GiB);
  CHECK(contains(r.suggestion, "reduce the batch size by at least 22%"));
  CHECK(contains(r.suggestion, "max_batch_size"));
}

TEST_CASE("oom_report: holders, the bytes allocated before tagging, and the text", "[oom_report]") {
  figures f = make_figures(1_GiB, 3891_MiB, 4_GiB, 0, 4_GiB);
  tag_summary tags;
  tags.by_tag = {{1, "blocks.0.mlp", 2_GiB, 10}, {2, "optimizer", 1_GiB, 4}, {0, "untagged", 500_MiB, 3},
                 {3, "small", 1_MiB, 1}};
  tags.recorded_bytes = 2_GiB + 1_GiB + 500_MiB + 1_MiB;
  const oom_report r = make_oom_report(f.context, f.stats, &tags, false, 3);
  REQUIRE(r.holders.size() == 3);
  CHECK(r.holders[0].tag == "blocks.0.mlp");
  CHECK(r.holders[2].tag == "untagged");
  // 3891 - 3573 MiB = 318 MiB allocated before tagging began, and "small".
  CHECK(r.other_holders == 2);
  CHECK(r.other_holders_bytes == 318_MiB + 1_MiB);
  const std::string text = describe(r);
  CHECK(contains(text, "Top holders by tag on GPU 0: blocks.0.mlp 2.00 GiB (10 allocations), optimizer 1.00 GiB"));
  CHECK(contains(text, "2 more 319.00 MiB"));
  CHECK(contains(text, "Fragmentation: "));
  CHECK(contains(text, "\nSuggestion: Live tensors take"));

  tags.sampled = true;
  tags.sample_every = 8;
  const oom_report sampled = make_oom_report(f.context, f.stats, &tags, false, 10);
  CHECK(sampled.holders.size() == 4);  // no before-tagging estimate under sampling
  CHECK(contains(describe(sampled), "1 in 8"));

  CHECK(contains(describe(make_oom_report(f.context, f.stats, nullptr, false)), "tagging is off"));
}

TEST_CASE("oom_report: from a real out_of_memory on the simulated device", "[oom_report]") {
  sim_fixture f(plain_device(1_GiB));
  allocation_tags tags;
  tags.enable({});
  const tag_id model = tags.intern("model");
  std::vector<void*> live;
  {
    allocation_tags::scope scope(model);
    for (int i = 0; i < 3; ++i) {
      void* p = f.alloc.allocate(300_MiB, f.s1);
      tags.record(reinterpret_cast<std::uintptr_t>(p), f.alloc.allocation_size(p), 0, 1);
      live.push_back(p);
    }
  }
  bool raised = false;
  try {
    f.alloc.allocate(300_MiB, f.s1);
  } catch (const out_of_memory& e) {
    raised = true;
    const tag_summary summary = tags.summary(0);
    const oom_report r = make_oom_report(e.context(), f.alloc.stats(), &summary, false);
    CHECK(r.kind == oom_case::near_limit);
    REQUIRE(r.holders.size() == 1);
    CHECK(r.holders[0].tag == "model");
    CHECK(r.holders[0].bytes == 900_MiB);
    CHECK(r.holders[0].count == 3);
    CHECK(contains(describe(r), "model 900.00 MiB (3 allocations)"));
  }
  CHECK(raised);
  for (void* p : live) f.alloc.free(p);
}
