// Randomized test of expandable segments and stitching on the simulated
// device's virtual-memory model: random sizes and streams, stream uses,
// frees, event completions, empty_cache, injected faults in
// reserve/create/map/unmap, and private pools (one stream's requests routed
// to a pool, its checkpoints restored, the pool released), whose ranges
// grow too on half the seeds (Note [private ranges]). Every queued use of a block is a sim "touch",
// so an unmap before the using streams finished fails the run; after every
// checked step the allocator validates (each mapped chunk lies under a
// mapped block of exactly one range, none mapped twice), the stats match a
// recount and the device holds exactly the mapped chunks.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/sim_fixture.hpp"

using namespace streamalloc;
using streamalloc::test::addr;
using streamalloc::test::all;
using streamalloc::test::consistency_problem;
using streamalloc::test::sim_fixture;

namespace {

struct vmm_coverage {
  std::size_t allocations = 0;
  std::size_t ooms = 0;
  std::size_t device_failures = 0;
  std::size_t faults_injected = 0;
  std::int64_t stitched_blocks = 0;
  std::int64_t chunk_unmaps = 0;
  std::int64_t stitch_syncs = 0;
  std::size_t empty_ranges_released = 0;
  std::size_t pool_allocations = 0;
  std::size_t restores = 0;

  void add(const vmm_coverage& o) {
    pool_allocations += o.pool_allocations;
    restores += o.restores;
    allocations += o.allocations;
    ooms += o.ooms;
    device_failures += o.device_failures;
    faults_injected += o.faults_injected;
    stitched_blocks += o.stitched_blocks;
    chunk_unmaps += o.chunk_unmaps;
    stitch_syncs += o.stitch_syncs;
    empty_ranges_released += o.empty_ranges_released;
  }
};

sim_config device_for(std::uint64_t seed) {
  sim_config c;
  c.capacity_bytes = 256_MiB;
  c.virtual_memory = true;
  c.events_complete_immediately = seed % 2 != 0;
  return c;
}

allocator_config config_for(std::uint64_t seed) {
  allocator_config c;
  c.stitching = seed % 4 != 3;
  c.cross_stream_reuse = seed % 3 != 0;
  c.vmm_chunk_bytes = seed % 5 == 4 ? 4_MiB : 2_MiB;
  if (seed % 3 == 2) c.memory_fraction = 0.75;
  c.expandable_private_pools = seed % 2 == 0;
  return c;
}

class vmm_run {
 public:
  vmm_run(std::uint64_t seed, std::size_t steps, std::size_t check_every)
      : seed_(seed),
        steps_(steps),
        check_every_(check_every),
        rng_(seed),
        f_(device_for(seed), config_for(seed)),
        streams_{f_.s1, f_.s2, f_.s3} {}

  vmm_coverage run() {
    for (step_ = 0; step_ < steps_; ++step_) {
      one_step();
      if (step_ % check_every_ == 0) check();
    }
    const device_stats st = f_.stats();
    coverage_.stitched_blocks = st.num_stitched_blocks;
    coverage_.chunk_unmaps = st.num_chunk_unmaps;
    coverage_.stitch_syncs = st.num_stitch_syncs;
    finish();
    return coverage_;
  }

 private:
  struct live_block {
    std::size_t size;
    stream_handle stream;
  };

  void fail(const std::string& what) {
    std::ostringstream out;
    out << "seed " << seed_ << " (stitching " << f_.alloc.config().stitching << ", fraction "
        << f_.alloc.memory_fraction() << ", chunk "
        << f_.alloc.config().vmm_chunk_bytes << ", manual events " << (seed_ % 2 == 0) << "): step " << step_ << " ("
        << op_ << "): " << what;
    FAIL(out.str());
  }

  void check() {
    const std::string problem = consistency_problem(f_.alloc, f_.sim);
    if (!problem.empty()) fail(problem);
    const double cap = f_.alloc.memory_fraction() * static_cast<double>(f_.sim.capacity_bytes());
    if (static_cast<double>(f_.stats().reserved_bytes[0].peak) > cap) fail("reserved memory went over the memory fraction");
  }

  stream_handle random_stream() { return streams_[rng_() % streams_.size()]; }

  std::size_t random_size() {
    const std::uint64_t pick = rng_() % 100;
    if (pick < 30) return 1 + rng_() % (256 * 1024);  // small pool
    // Log-uniform 256 KiB .. 32 MiB, some exact chunk multiples.
    const double exponent = 18.0 + 7.0 * static_cast<double>(rng_() % 1000) / 1000.0;
    std::size_t size = static_cast<std::size_t>(std::exp2(exponent));
    if (pick < 45) size = (size + 2_MiB - 1) / 2_MiB * 2_MiB;
    return size;
  }

  void one_step() {
    const std::uint64_t pick = rng_() % 100;
    if (pick < 45 || live_.empty()) {
      allocate();
    } else if (pick < 55) {
      op_ = "record_stream";
      auto it = random_live();
      stream_handle other = random_stream();
      f_.alloc.record_stream(reinterpret_cast<void*>(it->first), other);
      f_.sim.touch(other, reinterpret_cast<void*>(it->first), it->second.size);
    } else if (pick < 90) {
      op_ = "free";
      auto it = random_live();
      f_.alloc.free(reinterpret_cast<void*>(it->first));
      live_.erase(it);
    } else if (pick < 93) {
      private_pool_step();
    } else if (pick < 98) {
      op_ = "complete events";
      const std::uint64_t how = rng_() % 3;
      if (how == 0) {
        f_.sim.complete_stream(random_stream());
      } else if (how == 1) {
        const std::vector<event_handle> pending = f_.sim.pending_events();
        if (!pending.empty()) f_.sim.complete_event(pending[rng_() % pending.size()]);
      } else {
        f_.sim.complete_all_events();
      }
    } else {
      op_ = "empty_cache";
      const std::size_t ranges_before = f_.sim.live_ranges();
      f_.alloc.empty_cache();
      if (f_.sim.live_ranges() < ranges_before) ++coverage_.empty_ranges_released;
    }
  }

  // Starts or ends routing one stream's requests to a new private pool, or,
  // while routed, checkpoints the pool or restores its checkpoint.
  void private_pool_step() {
    const std::uint64_t pick = rng_() % 4;
    if (pool_ == 0) {
      op_ = "route a stream to a private pool";
      pool_ = next_pool_++;
      routed_ = random_stream();
      checkpoint_.reset();
      f_.alloc.begin_allocate_to_pool(pool_, [routed = routed_](stream_handle s) { return s == routed; });
    } else if (pick == 0) {
      op_ = "end routing and release the pool";
      f_.alloc.end_allocate_to_pool(pool_);
      f_.alloc.release_pool(pool_);
      pool_ = 0;
    } else if (pick == 1) {
      op_ = "checkpoint_pool";
      try {
        checkpoint_ = f_.alloc.checkpoint_pool(pool_);
      } catch (const usage_error&) {
        // a block of the pool awaits stream events
      }
    } else if (checkpoint_) {
      op_ = "restore_pool";
      pool_restore_result result;
      try {
        result = f_.alloc.restore_pool(*checkpoint_);
      } catch (const usage_error&) {
        return;
      }
      ++coverage_.restores;
      for (void* p : result.freed) live_.erase(addr(p));
      for (void* p : result.allocated) {
        const std::size_t size = f_.alloc.allocation_size(p);
        if (!f_.sim.is_device_memory(p, size)) fail("a restored allocation is not mapped device memory");
        live_[addr(p)] = live_block{size, routed_};
      }
    }
  }

  std::map<std::uintptr_t, live_block>::iterator random_live() {
    auto it = live_.begin();
    std::advance(it, static_cast<std::ptrdiff_t>(rng_() % live_.size()));
    return it;
  }

  void allocate() {
    const std::size_t size = random_size();
    const stream_handle stream = random_stream();
    bool device_error_injected = false;
    op_ = "allocate";
    if (rng_() % 100 < 6) {
      static const sim_fault_point points[] = {sim_fault_point::vm_create, sim_fault_point::vm_map,
                                               sim_fault_point::vm_unmap, sim_fault_point::vm_reserve};
      const sim_fault_point point = points[rng_() % 4];
      const bool device_error = rng_() % 3 == 0;
      device_error_injected = device_error;
      f_.sim.fail_nth(point, 1 + rng_() % 3, device_error ? status_code::device_error : status_code::out_of_memory);
      ++coverage_.faults_injected;
      op_ = "allocate with a fault injected";
    }
    void* p = nullptr;
    try {
      p = f_.alloc.allocate(size, stream);
    } catch (const out_of_memory&) {
      ++coverage_.ooms;
    } catch (const device_failure& e) {
      if (!device_error_injected) fail(std::string("device_failure without an injected device error: ") + e.what());
      ++coverage_.device_failures;
    }
    f_.sim.clear_faults();
    if (p == nullptr) return;
    ++coverage_.allocations;
    const std::size_t block_size = f_.alloc.allocation_size(p);
    if (block_size < size) fail("block smaller than the request");
    if (!f_.sim.is_device_memory(p, block_size)) fail("returned range is not mapped device memory");
    const std::uintptr_t start = addr(p);
    auto next = live_.lower_bound(start);
    if (next != live_.end() && next->first < start + block_size) fail("returned range overlaps a live block");
    if (next != live_.begin() && std::prev(next)->first + std::prev(next)->second.size > start) {
      fail("returned range overlaps the live block before it");
    }
    live_.emplace(start, live_block{block_size, stream});
    if (pool_ != 0 && stream == routed_) ++coverage_.pool_allocations;
    f_.sim.touch(stream, p, block_size);  // kernels queued on the block's stream
  }

  void finish() {
    op_ = "free everything and empty_cache";
    if (pool_ != 0) {
      f_.alloc.end_allocate_to_pool(pool_);
      f_.alloc.release_pool(pool_);
    }
    for (const auto& [address, b] : live_) f_.alloc.free(reinterpret_cast<void*>(address));
    live_.clear();
    f_.sim.complete_all_events();
    f_.alloc.empty_cache();
    check();
    if (f_.sim.used_bytes() != 0) fail("device memory left after freeing everything and empty_cache");
    if (f_.sim.live_ranges() != 0) fail("address ranges left after freeing everything and empty_cache");
    if (f_.sim.live_chunks() != 0) fail("chunks left after freeing everything and empty_cache");
    if (all(f_.stats().segment) != 0) fail("segments counted after everything was released");
  }

  std::uint64_t seed_;
  std::size_t steps_;
  std::size_t check_every_;
  std::size_t step_ = 0;
  std::string op_;
  std::mt19937_64 rng_;
  sim_fixture f_;
  std::vector<stream_handle> streams_;
  std::map<std::uintptr_t, live_block> live_;
  pool_id pool_ = 0;  // the pool requests of routed_ go to, 0: none
  pool_id next_pool_ = 1;
  stream_handle routed_ = 0;
  std::optional<pool_checkpoint> checkpoint_;
  vmm_coverage coverage_;
};

vmm_coverage run_seeds(std::uint64_t first_seed, std::size_t seeds, std::size_t steps, std::size_t check_every) {
  vmm_coverage total;
  for (std::uint64_t seed = first_seed; seed < first_seed + seeds; ++seed) {
    total.add(vmm_run(seed, steps, check_every).run());
  }
  return total;
}

void check_coverage(const vmm_coverage& c) {
  INFO("allocations " << c.allocations << ", ooms " << c.ooms << ", device failures " << c.device_failures
                      << ", faults " << c.faults_injected << ", stitched blocks " << c.stitched_blocks
                      << ", chunk unmaps " << c.chunk_unmaps << ", stitch syncs " << c.stitch_syncs
                      << ", empty_cache range releases " << c.empty_ranges_released << ", pool allocations "
                      << c.pool_allocations << ", restores " << c.restores);
  CHECK(c.allocations > 0);
  CHECK(c.ooms > 0);
  CHECK(c.device_failures > 0);
  CHECK(c.stitched_blocks > 0);
  CHECK(c.chunk_unmaps > c.stitched_blocks);
  CHECK(c.stitch_syncs > 0);
  CHECK(c.empty_ranges_released > 0);
  CHECK(c.pool_allocations > 0);
  CHECK(c.restores > 0);
}

}  // namespace

TEST_CASE("expandable randomized: every step checked", "[expandable][randomized]") {
  check_coverage(run_seeds(1, 8, 2500, 1));
}

TEST_CASE("expandable randomized: long runs", "[expandable][randomized][slow]") {
  check_coverage(run_seeds(100, 48, 25000, 64));
}
