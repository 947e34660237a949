// Test-runner entry point of gpu_tests (Catch2 2.x and 3.x alike). ctest
// sets STREAMALLOC_CTEST_NEEDS to "gpu" or "no-gpu" for its two entries;
// when the machine cannot run that half the binary prints the reason and
// exits with k_skip_exit_code, which ctest reports as Skipped (the
// SKIP_RETURN_CODE in tests/CMakeLists.txt) rather than Passed. Run by hand
// or by scripts/gpu-check.sh, without the variable, every test runs (and a
// [gpu] test skips with a WARN of its own where it cannot run).
#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#else
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#endif

#include <cstdio>
#include <cstdlib>
#include <string>

#include "gpu/gpu_support.hpp"

namespace {

constexpr int k_skip_exit_code = 77;  // tests/CMakeLists.txt: SKIP_RETURN_CODE

}  // namespace

int main(int argc, char* argv[]) {
  if (const char* needs = std::getenv("STREAMALLOC_CTEST_NEEDS")) {
    std::string reason;
    const bool gpu = streamalloc::testing::gpu_visible(&reason);
    const std::string wanted = needs;
    if (wanted == "gpu" && !gpu) {
      std::printf("streamalloc-skip: %s\n", reason.c_str());
      return k_skip_exit_code;
    }
    if (wanted == "no-gpu" && gpu) {
      std::printf("streamalloc-skip: a GPU is visible, and these tests prove the failure paths without one\n");
      return k_skip_exit_code;
    }
  }
  return Catch::Session().run(argc, argv);
}
