// The out-of-memory message, word for word: torch's format_size at its unit
// boundaries, torch's sentences as the caching allocator fills them in on
// the simulated device (the segment size it tried, the device's processes,
// the "allowed" cap, the private-pool clause), and streamalloc's sentence
// after them.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/sim_fixture.hpp"

using namespace streamalloc;
using streamalloc::test::plain_device;
using streamalloc::test::sim_fixture;

namespace {

// torch's advice and documentation link, which end its message.
const std::string k_torch_advice =
    " If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to "
    "avoid fragmentation.  See documentation for Memory Management  "
    "(https://docs.pytorch.org/docs/stable/notes/cuda.html#optimizing-memory-usage-with-pytorch-cuda-alloc-conf)";

std::string oom_text(sim_fixture& f, std::size_t bytes) {
  try {
    f.alloc.allocate(bytes, f.s1);
  } catch (const out_of_memory& e) {
    return e.what();
  }
  return "<no out_of_memory>";
}

}  // namespace

TEST_CASE("oom message: format_size is torch's, unit boundaries included", "[errors]") {
  CHECK(format_size(0) == "0 bytes");
  CHECK(format_size(1) == "1 bytes");
  CHECK(format_size(1024) == "1024 bytes");  // bytes up to and including 1024
  CHECK(format_size(1025) == "1.00 KiB");
  CHECK(format_size(1536) == "1.50 KiB");
  CHECK(format_size(1_MiB - 1) == "1024.00 KiB");
  CHECK(format_size(1_MiB) == "1024.00 KiB");  // KiB up to and including 1 MiB
  CHECK(format_size(1_MiB + 1) == "1.00 MiB");
  CHECK(format_size(20_MiB) == "20.00 MiB");
  CHECK(format_size(1_GiB) == "1024.00 MiB");  // MiB up to and including 1 GiB
  CHECK(format_size(1_GiB + 1) == "1.00 GiB");
  CHECK(format_size(3_GiB + 256_MiB) == "3.25 GiB");
  // GiB is the largest unit.
  CHECK(format_size(std::size_t{5} << 40) == "5120.00 GiB");
  CHECK(format_size(800000000 * 1_GiB) == "800000000.00 GiB");
  CHECK(format_size(SIZE_MAX) == "17179869184.00 GiB");
}

TEST_CASE("oom message: a huge request reads as torch's, GiB and all", "[errors][oom_ladder]") {
  sim_fixture f(plain_device(80_GiB));
  CHECK(oom_text(f, 800000000 * 1_GiB) ==
        "CUDA out of memory. Tried to allocate 800000000.00 GiB. GPU 0 has a total capacity of 80.00 GiB of which "
        "80.00 GiB is free. Of the allocated memory 0 bytes is allocated by PyTorch, and 0 bytes is reserved by "
        "PyTorch but unallocated." +
            k_torch_advice +
            " streamalloc: 0 bytes reserved, 0 bytes of it unallocated; the largest free cached block is 0 bytes.");
}

TEST_CASE("oom message: 'Tried to allocate' names the segment the request needed, as torch does", "[errors]") {
  sim_fixture f(plain_device(64_MiB));
  void* big = f.alloc.allocate(64_MiB, f.s1);  // the whole device
  // A 100-byte request needs a 2 MiB small segment; a 3 MiB one a 20 MiB
  // shared large segment; a 13 MiB one a segment rounded to 14 MiB.
  CHECK(oom_text(f, 100).rfind("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 ", 0) == 0);
  CHECK(oom_text(f, 3_MiB).rfind("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 ", 0) == 0);
  CHECK(oom_text(f, 13_MiB).rfind("CUDA out of memory. Tried to allocate 14.00 MiB. GPU 0 ", 0) == 0);
  try {
    f.alloc.allocate(3_MiB, f.s1);
  } catch (const out_of_memory& e) {
    CHECK(e.context().requested_bytes == 3_MiB);
    CHECK(e.context().allocation_bytes == 20_MiB);
  }
  f.alloc.free(big);
  f.check_consistent();
}

TEST_CASE("oom message: a memory fraction adds torch's 'allowed' clause", "[errors]") {
  sim_fixture f(plain_device(100_MiB));
  f.alloc.set_memory_fraction(0.5);
  void* a = f.alloc.allocate(40_MiB, f.s1);
  CHECK(oom_text(f, 12_MiB) ==
        "CUDA out of memory. Tried to allocate 12.00 MiB. GPU 0 has a total capacity of 100.00 MiB of which "
        "60.00 MiB is free. 50.00 MiB allowed; Of the allocated memory 40.00 MiB is allocated by PyTorch, and "
        "0 bytes is reserved by PyTorch but unallocated." +
            k_torch_advice +
            " streamalloc: 40.00 MiB reserved, 0 bytes of it unallocated; the largest free cached block is 0 bytes.");
  // A fraction of 1 is no cap: the clause goes away, as in torch.
  f.alloc.set_memory_fraction(1.0);
  CHECK(oom_text(f, 70_MiB).find("allowed") == std::string::npos);
  f.alloc.free(a);
}

TEST_CASE("oom message: free memory of private pools is torch's 'allocated in private pools'", "[errors]") {
  sim_fixture f(plain_device(64_MiB));
  f.alloc.begin_allocate_to_pool(1, [](stream_handle) { return true; });
  void* graph = f.alloc.allocate(10_MiB, f.s1);
  f.alloc.free(graph);  // cached in pool 1, which is still in use
  f.alloc.end_allocate_to_pool(1);
  CHECK(oom_text(f, 60_MiB) ==
        "CUDA out of memory. Tried to allocate 60.00 MiB. GPU 0 has a total capacity of 64.00 MiB of which "
        "54.00 MiB is free. Of the allocated memory 10.00 MiB is allocated by PyTorch, with 10.00 MiB allocated in "
        "private pools (e.g., CUDA Graphs), and 0 bytes is reserved by PyTorch but unallocated." +
            k_torch_advice +
            " streamalloc: 10.00 MiB reserved, 10.00 MiB of it unallocated; the largest free cached block is "
            "10.00 MiB.");
  f.alloc.release_pool(1);
  f.check_consistent();
}

TEST_CASE("oom message: the device's processes, this one in torch's words", "[errors]") {
  sim_fixture f(plain_device(64_MiB));
  void* a = f.alloc.allocate(40_MiB, f.s1);
  const std::string torch_start =
      "CUDA out of memory. Tried to allocate 30.00 MiB. GPU 0 has a total capacity of 64.00 MiB of which 24.00 MiB "
      "is free. ";
  const std::string torch_rest = "Of the allocated memory 40.00 MiB is allocated by PyTorch, and 0 bytes";
  // A backend that cannot list them (the sim's default, a machine without
  // NVML): no sentence, as in torch.
  CHECK(oom_text(f, 30_MiB).rfind(torch_start + torch_rest, 0) == 0);
  // In the driver's order; this process by its pid, the others by theirs.
  const auto self = static_cast<std::uint32_t>(::getpid());
  const std::uint32_t other = self == 4242 ? 4243 : 4242;
  f.sim.set_device_processes({{other, 1_GiB + 1_GiB / 2}, {self, 42_MiB}});
  std::string text;
  try {
    f.alloc.allocate(30_MiB, f.s1);
  } catch (const out_of_memory& e) {
    text = e.what();
    REQUIRE(e.context().processes.size() == 2);
    CHECK(e.context().processes[1].pid == self);
    CHECK(e.context().processes[1].used_bytes == 42_MiB);
  }
  CHECK(text.rfind(torch_start + "Process " + std::to_string(other) +
                       " has 1.50 GiB memory in use. Including non-PyTorch memory, this process has 42.00 MiB "
                       "memory in use. " + torch_rest,
                   0) == 0);
  f.alloc.free(a);
  f.check_consistent();
}

TEST_CASE("oom message: a request of 1 EiB or more is refused in torch's words", "[oom]") {
  oom_context c;
  c.device_total_bytes = 80ull << 30;
  c.requested_bytes = std::size_t{1} << 60;
  CHECK(out_of_memory(c).what() == std::string("CUDA out of memory. Tried to allocate more than 1EB memory."));
  c.requested_bytes = (std::size_t{1} << 60) - 1;
  CHECK(std::string(out_of_memory(c).what()).rfind("CUDA out of memory. Tried to allocate 1073741824.00 GiB.", 0) == 0);
}

TEST_CASE("oom message: a block just freed is free memory in the report", "[errors][recent_frees]") {
  // The 4 MiB block stays whole as a recent free (Note [recent frees]); a
  // request too large even to round fails before any search, and what the
  // report is made of still counts that block as free, merged with the
  // rest of its 20 MiB segment.
  sim_fixture f(plain_device(80_GiB));
  f.alloc.free(f.alloc.allocate(4_MiB, f.s1));
  try {
    f.alloc.allocate(SIZE_MAX, f.s1);
    FAIL("no out_of_memory");
  } catch (const out_of_memory& e) {
    CHECK(std::string(e.what()) == "CUDA out of memory. Tried to allocate more than 1EB memory.");
    CHECK(e.context().allocated_bytes == 0);
    CHECK(e.context().reserved_bytes == 20_MiB);
    CHECK(e.context().largest_free_block_bytes == 20_MiB);
  }
  f.check_consistent();
}
