// libFuzzer harness driving a device_allocator on the simulated device with
// a sequence of operations decoded from the input: allocations of every
// size class on several streams, frees (valid and invalid), stream uses,
// event completion, empty_cache, memory fractions, private pools (captures,
// MemPools with use_on_oom and no_split, emptying one pool, checkpoints and
// their restore, in plain segments or expandable ranges), injected device
// faults, and moves of the calling thread between arenas (Note [arenas]:
// frees of another arena's blocks, the device's peaks over arenas, the cap
// and the out-of-memory ladder across them). After every operation the
// invariant validators run (every arena's and the ledger's) and the stats
// must equal an independent recount from the snapshot.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "streamalloc/backend/sim_backend.hpp"
#include "streamalloc/core/device_allocator.hpp"
#include "streamalloc/core/config.hpp"
#include "streamalloc/util/bytes.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/recount.hpp"

namespace {

using namespace streamalloc;

constexpr std::size_t k_max_live = 64;
constexpr std::size_t k_max_ops = 512;
constexpr std::size_t k_stream_count = 3;

[[noreturn]] void die(const std::string& what, std::size_t op_index) {
  std::fprintf(stderr, "fuzz_allocator_ops: after op %zu: %s\n", op_index, what.c_str());
  std::abort();
}

// Reads the input a byte at a time; zeros once it is used up.
class byte_reader {
 public:
  byte_reader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  bool done() const { return pos_ >= size_; }
  std::uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  std::uint16_t word() { return static_cast<std::uint16_t>(byte() | (byte() << 8)); }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

// A request size from every class: tiny, small pool, large shared
// segments, oversize, beyond the device, near SIZE_MAX.
std::size_t decode_size(byte_reader& in) {
  const std::uint8_t kind = in.byte();
  const std::size_t v = in.word();
  switch (kind % 6) {
    case 0:
      return v % 2048;  // includes 0
    case 1:
      return (v + 1) * 16;  // up to ~1 MiB: small pool
    case 2:
      return (v % 64 + 1) * 256_KiB;  // up to 16 MiB
    case 3:
      return (v % 256 + 1) * 1_MiB;  // up to 256 MiB
    case 4:
      return 2_GiB + v;  // more than the device has
    default:
      return static_cast<std::size_t>(-1) - v;
  }
}

allocator_config decode_config(byte_reader& in) {
  allocator_config config;
  const std::uint8_t flags = in.byte();
  if (flags & 1) config.max_split_bytes = 40_MiB;
  config.cross_stream_reuse = (flags & 2) == 0;
  if (flags & 4) config.garbage_collection_threshold = 0.6;
  if (flags & 8) config.roundup_power2_divisions = 4;
  if (flags & 16) config.memory_fraction = 0.5;
  if (flags & 32) config.expandable_segments = false;  // the device has virtual memory: default on
  if (flags & 64) config.stitching = false;
  if (flags & 128) config.expandable_private_pools = true;  // Note [private ranges]
  return config;
}

// The allocator's stats against a recount, and the device against both.
void check_consistent(const device_allocator& alloc, const sim_backend& sim, std::size_t op_index) {
  try {
    alloc.validate();
  } catch (const std::logic_error& e) {
    die(e.what(), op_index);
  }
  const allocator_snapshot snap = alloc.snapshot();
  std::string problem = test::check_snapshot_shape(snap, alloc.config().min_block_bytes);
  if (!problem.empty()) die("snapshot: " + problem, op_index);
  const device_stats stats = alloc.stats();
  problem = test::compare_stats(stats, test::recount(snap, alloc.config().max_split_bytes));
  if (!problem.empty()) die("stats: " + problem, op_index);
  if (static_cast<std::int64_t>(sim.used_bytes()) != stats.reserved_bytes[0].current) {
    die("sim used_bytes " + std::to_string(sim.used_bytes()) + " != reserved " +
            std::to_string(stats.reserved_bytes[0].current),
        op_index);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  byte_reader in(data, size);
  sim_config device;
  device.capacity_bytes = 1_GiB;
  device.events_complete_immediately = (in.byte() & 1) != 0;
  sim_backend sim(device);
  device_allocator alloc(sim, decode_config(in));
  stream_handle streams[k_stream_count];
  for (stream_handle& s : streams) s = sim.new_stream();
  const auto pick_stream = [&](std::uint8_t b) { return streams[b % k_stream_count]; };

  std::map<void*, std::size_t> live;  // pointer -> requested bytes
  std::vector<pool_id> capturing;
  std::map<pool_id, int> pool_uses;
  std::map<pool_id, pool_checkpoint> checkpoints;
  const auto nth_live = [&](std::uint8_t b) {
    auto it = live.begin();
    std::advance(it, b % live.size());
    return it;
  };

  for (std::size_t op = 0; op < k_max_ops && !in.done(); ++op) {
    const std::uint8_t code = in.byte();
    try {
      switch (code % 15) {
        case 0:
        case 1:
        case 2: {
          const std::size_t bytes = decode_size(in);
          const stream_handle stream = pick_stream(in.byte());
          if (live.size() >= k_max_live) break;
          void* p = alloc.allocate(bytes, stream);
          if (bytes == 0) {
            if (p != nullptr) die("size 0 returned memory", op);
            break;
          }
          if (p == nullptr) die("allocate returned nullptr", op);
          if (live.count(p) != 0) die("allocate returned a live pointer", op);
          if (alloc.allocation_size(p) < bytes) die("block smaller than the request", op);
          if (!sim.is_device_memory(p, bytes)) die("block is not device memory", op);
          live[p] = bytes;
          break;
        }
        case 3:
        case 4: {
          if (live.empty()) break;
          auto it = nth_live(in.byte());
          void* p = it->first;
          live.erase(it);
          alloc.free(p);
          break;
        }
        case 5: {
          if (live.empty()) break;
          alloc.record_stream(nth_live(in.byte())->first, pick_stream(in.byte()));
          break;
        }
        case 6: {
          // A misuse must throw usage_error and change nothing.
          const std::uint8_t how = in.byte();
          void* bad = reinterpret_cast<void*>(static_cast<std::uintptr_t>(in.word()) * 512 + 512);
          if (!live.empty() && how % 2 == 0) bad = static_cast<char*>(nth_live(in.byte())->first) + 512;
          if (live.count(bad) != 0) break;
          bool threw = false;
          try {
            if (how % 4 < 2) {
              alloc.free(bad);
            } else {
              alloc.record_stream(bad, pick_stream(how));
            }
          } catch (const usage_error&) {
            threw = true;
          }
          if (!threw) die("a bad pointer was accepted", op);
          break;
        }
        case 7: {
          const std::uint8_t what = in.byte();
          if (what % 2 == 0) {
            sim.complete_all_events();
          } else {
            sim.complete_stream(pick_stream(what / 2));
          }
          break;
        }
        case 8:
          alloc.empty_cache();
          break;
        case 9: {
          const std::uint8_t b = in.byte();
          alloc.set_memory_fraction(b == 0 ? 1.0 : static_cast<double>(b - 1) / 254.0);  // b == 1: 0
          break;
        }
        case 10: {
          const std::uint8_t b = in.byte();
          const auto point = static_cast<sim_fault_point>(b % 8);  // the non-VM points
          const status_code fault = b & 0x80 ? status_code::device_error : status_code::out_of_memory;
          if (b & 0x40) {
            sim.clear_faults();
          } else if (b & 0x20) {
            sim.fail_always(point, fault);
          } else {
            sim.fail_nth(point, in.byte() % 8 + 1, fault);
          }
          break;
        }
        case 12: {
          // MemPools 1..3: create (or add a use) with options, or empty one
          // pool's cache.
          const std::uint8_t b = in.byte();
          const pool_id id = b % 3 + 1;
          if (b & 0x80) {
            alloc.empty_cache(id);
          } else {
            alloc.create_or_incref_pool(id);
            ++pool_uses[id];
            if (b & 0x40) alloc.set_pool_use_on_oom(id, (b & 0x10) != 0);
            if (b & 0x20) alloc.set_pool_no_split(id, (b & 0x08) != 0);
          }
          break;
        }
        case 14:
          // The calling thread moves to another arena (made on first use).
          alloc.move_this_thread(in.byte() % device_allocator::k_max_arenas);
          break;
        case 13: {
          // Checkpoint a pool, or restore its last checkpoint; a refused call
          // is a usage_error that changes nothing.
          const std::uint8_t b = in.byte();
          const pool_id id = b % 3 + 1;
          if (b & 0x80) {
            checkpoints[id] = alloc.checkpoint_pool(id);
            break;
          }
          auto cp = checkpoints.find(id);
          if (cp == checkpoints.end()) break;
          const auto before = alloc.stats().to_map();
          pool_restore_result result;
          try {
            result = alloc.restore_pool(cp->second);
          } catch (const usage_error&) {
            if (alloc.stats().to_map() != before) die("a refused restore changed the stats", op);
            throw;
          }
          for (void* p : result.freed) {
            if (live.erase(p) != 1) die("restore freed a pointer that was not live", op);
          }
          std::vector<const void*> recorded;
          for (const pool_checkpoint::segment_state& seg : cp->second.segments) {
            for (const pool_checkpoint::block_state& blk : seg.blocks) {
              if (!blk.allocated) continue;
              live[reinterpret_cast<void*>(blk.address)] = blk.requested_size;
              recorded.push_back(reinterpret_cast<const void*>(blk.address));
            }
          }
          if (result.allocated.size() != recorded.size()) die("restore allocated other blocks than recorded", op);
          if (!alloc.pool_allocations_match(id, recorded)) die("pool_allocations_match after restore", op);
          break;
        }
        default: {
          // Private pools: begin or end a capture into pool 1..3, or release
          // a pool; a wrong call is a usage_error.
          const std::uint8_t b = in.byte();
          const pool_id id = b % 3 + 1;
          const stream_handle captured = pick_stream(b / 3);
          if (b & 0x80) {
            alloc.begin_allocate_to_pool(id, [captured](stream_handle s) { return s == captured; });
            capturing.push_back(id);
            ++pool_uses[id];
          } else if (b & 0x40) {
            alloc.end_allocate_to_pool(id);
            for (auto it = capturing.begin(); it != capturing.end(); ++it) {
              if (*it == id) {
                capturing.erase(it);
                break;
              }
            }
          } else {
            alloc.release_pool(id);
            --pool_uses[id];
          }
          break;
        }
      }
    } catch (const out_of_memory&) {
    } catch (const device_failure&) {
    } catch (const usage_error&) {
    }
    check_consistent(alloc, sim, op);
  }

  // Tear down: every capture ends, every pool is released, every block is
  // freed; with faults cleared and events complete the device is empty.
  sim.clear_faults();
  for (pool_id id : capturing) alloc.end_allocate_to_pool(id);
  for (auto& [id, uses] : pool_uses) {
    for (; uses > 0; --uses) alloc.release_pool(id);
  }
  for (const auto& [p, bytes] : live) alloc.free(p);
  sim.complete_all_events();
  alloc.empty_cache();
  check_consistent(alloc, sim, k_max_ops);
  if (sim.used_bytes() != 0) die("device memory left after freeing everything and empty_cache", k_max_ops);
  return 0;
}
