// Tests of allocator_config: STREAMALLOC_CONF parsing, every error class,
// cross-key consistency, with(), from_environment, keys() and the
// to_string round trip.
#include <cstdlib>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "streamalloc/core/config.hpp"
#include "streamalloc/core/size_policy.hpp"
#include "streamalloc/util/errors.hpp"
#include "support/catch.hpp"
#include "support/contains.hpp"

using namespace streamalloc;

namespace {

// The text of the config_error that parsing `text` throws.
std::string parse_error(const std::string& text) {
  try {
    allocator_config::parse(text);
  } catch (const config_error& e) {
    return e.what();
  }
  return "<parse('" + text + "') threw nothing>";
}

using streamalloc::test::contains;

void check_same(const allocator_config& a, const allocator_config& b) {
  CHECK(a.min_block_bytes == b.min_block_bytes);
  CHECK(a.small_request_bytes == b.small_request_bytes);
  CHECK(a.small_segment_bytes == b.small_segment_bytes);
  CHECK(a.large_segment_bytes == b.large_segment_bytes);
  CHECK(a.min_large_alloc_bytes == b.min_large_alloc_bytes);
  CHECK(a.large_round_bytes == b.large_round_bytes);
  CHECK(a.max_split_bytes == b.max_split_bytes);
  CHECK(a.max_non_split_rounding_bytes == b.max_non_split_rounding_bytes);
  CHECK(a.roundup_power2_divisions == b.roundup_power2_divisions);
  CHECK(a.roundup_power2_intervals == b.roundup_power2_intervals);
  CHECK(a.cross_stream_reuse == b.cross_stream_reuse);
  // Exact: the round trip must not lose a bit.
  CHECK(a.memory_fraction == b.memory_fraction);
  CHECK(a.garbage_collection_threshold == b.garbage_collection_threshold);
  CHECK(a.expandable_segments == b.expandable_segments);
  CHECK(a.expandable_private_pools == b.expandable_private_pools);
  CHECK(a.stitching == b.stitching);
  CHECK(a.stitch_slack == b.stitch_slack);
  CHECK(a.arenas == b.arenas);
  CHECK(a.vmm_chunk_bytes == b.vmm_chunk_bytes);
}

// Sets or unsets STREAMALLOC_CONF for one scope.
class scoped_env {
 public:
  explicit scoped_env(const char* value) {
    const char* old = std::getenv("STREAMALLOC_CONF");
    had_old_ = old != nullptr;
    if (had_old_) old_ = old;
    if (value == nullptr) {
      unsetenv("STREAMALLOC_CONF");
    } else {
      setenv("STREAMALLOC_CONF", value, 1);
    }
  }
  ~scoped_env() {
    if (had_old_) {
      setenv("STREAMALLOC_CONF", old_.c_str(), 1);
    } else {
      unsetenv("STREAMALLOC_CONF");
    }
  }
  scoped_env(const scoped_env&) = delete;
  scoped_env& operator=(const scoped_env&) = delete;

 private:
  bool had_old_ = false;
  std::string old_;
};

}  // namespace

TEST_CASE("config: defaults are PyTorch's constants", "[config]") {
  const allocator_config c;
  CHECK(c.min_block_bytes == 512);
  CHECK(c.small_request_bytes == 0);  // auto
  CHECK(c.small_request_bytes_for(false) == 1_MiB);
  CHECK(c.small_request_bytes_for(true) == 384_KiB);
  CHECK(c.small_segment_bytes == 2_MiB);
  CHECK(c.large_segment_bytes == 20_MiB);
  CHECK(c.min_large_alloc_bytes == 10_MiB);
  CHECK(c.large_round_bytes == 2_MiB);
  CHECK(c.max_split_bytes == std::numeric_limits<std::size_t>::max());
  CHECK(c.max_non_split_rounding_bytes == 20_MiB);
  CHECK(c.roundup_power2_divisions == 0);
  CHECK(c.cross_stream_reuse);
  CHECK(c.memory_fraction == 1.0);
  CHECK(c.garbage_collection_threshold == 0.0);

  check_same(allocator_config::parse(""), c);
  check_same(allocator_config::parse("  \t "), c);
}

TEST_CASE("config: every key parses into its field", "[config]") {
  const allocator_config c = allocator_config::parse(
      "min_block_bytes:1024,small_size_kb:512,small_segment_mb:4,large_segment_mb:32,min_large_alloc_mb:16,"
      "large_round_mb:4,max_split_size_mb:256,max_non_split_rounding_mb:64,roundup_power2_divisions:8,"
      "cross_stream_reuse:False,memory_fraction:0.75,garbage_collection_threshold:0.6");
  CHECK(c.min_block_bytes == 1024);
  CHECK(c.small_request_bytes == 512_KiB);
  CHECK(c.small_segment_bytes == 4_MiB);
  CHECK(c.large_segment_bytes == 32_MiB);
  CHECK(c.min_large_alloc_bytes == 16_MiB);
  CHECK(c.large_round_bytes == 4_MiB);
  CHECK(c.max_split_bytes == 256_MiB);
  CHECK(c.max_non_split_rounding_bytes == 64_MiB);
  CHECK(c.roundup_power2_divisions == 8);
  CHECK_FALSE(c.cross_stream_reuse);
  CHECK(c.memory_fraction == 0.75);
  CHECK(c.garbage_collection_threshold == 0.6);
}

TEST_CASE("config: whitespace around tokens and one trailing comma are accepted", "[config]") {
  const allocator_config c =
      allocator_config::parse("  max_split_size_mb : 128 ,\tmemory_fraction:\t0.5 , cross_stream_reuse: false ,");
  CHECK(c.max_split_bytes == 128_MiB);
  CHECK(c.memory_fraction == 0.5);
  CHECK_FALSE(c.cross_stream_reuse);
  CHECK(c.min_block_bytes == 512);  // untouched keys keep their defaults
}

TEST_CASE("config: virtual-memory keys", "[config]") {
  const allocator_config defaults;
  CHECK(defaults.expandable_segments);
  CHECK(defaults.stitching);
  CHECK(defaults.vmm_chunk_bytes == 2_MiB);
  const allocator_config c = allocator_config::parse("expandable_segments:False,stitching:False,vmm_chunk_mb:32");
  CHECK_FALSE(c.expandable_segments);
  CHECK_FALSE(c.stitching);
  CHECK(c.vmm_chunk_bytes == 32_MiB);
  CHECK(contains(parse_error("vmm_chunk_mb:0"), "a positive number of MiB"));
  CHECK(contains(parse_error("vmm_chunk_mb:1.5"), "vmm_chunk_mb"));
  CHECK(contains(parse_error("expandable_segments:maybe"), "True or False"));
  CHECK(allocator_config::parse("stitch_slack:0.02").stitch_slack == 0.02);
  CHECK(contains(parse_error("stitch_slack:1.5"), "in [0, 1]"));
  // Chunks hold whole minimum blocks.
  CHECK(contains(parse_error("min_block_bytes:4194304,small_size_kb:4096,small_segment_mb:8,large_round_mb:4,vmm_chunk_mb:2"),
                 "vmm_chunk_mb (2 MiB) must be a multiple of min_block_bytes"));
}

TEST_CASE("config: boolean spellings", "[config]") {
  CHECK(allocator_config::parse("cross_stream_reuse:True").cross_stream_reuse);
  CHECK(allocator_config::parse("cross_stream_reuse:true").cross_stream_reuse);
  CHECK(allocator_config::parse("cross_stream_reuse:1").cross_stream_reuse);
  CHECK_FALSE(allocator_config::parse("cross_stream_reuse:False").cross_stream_reuse);
  CHECK_FALSE(allocator_config::parse("cross_stream_reuse:false").cross_stream_reuse);
  CHECK_FALSE(allocator_config::parse("cross_stream_reuse:0").cross_stream_reuse);
  const std::string e = parse_error("cross_stream_reuse:yes");
  CHECK(contains(e, "cross_stream_reuse"));
  CHECK(contains(e, "'yes'"));
  CHECK(contains(parse_error("cross_stream_reuse:TRUE"), "True or False"));
}

TEST_CASE("config: unknown keys are named and every valid key is listed", "[config]") {
  for (const char* entry : {"release_lock_on_cudamalloc:True", "max_split_size:20", "MAX_SPLIT_SIZE_MB:20"}) {
    const std::string text = entry;
    INFO(text);
    const std::string e = parse_error(text);
    CHECK(contains(e, "unknown key '" + text.substr(0, text.find(':')) + "'"));
    for (const auto& doc : allocator_config::keys()) CHECK(contains(e, doc.key));
  }
}

TEST_CASE("config: malformed structure", "[config]") {
  CHECK(contains(parse_error("max_split_size_mb:40,max_split_size_mb:40"), "more than once"));
  CHECK(contains(parse_error("memory_fraction:0.5 , memory_fraction : 0.6"), "memory_fraction appears more than once"));
  CHECK(contains(parse_error("max_split_size_mb"), "not of the form key:value"));
  CHECK(contains(parse_error("max_split_size_mb 40"), "not of the form key:value"));
  CHECK(contains(parse_error(":40"), "has no key"));
  CHECK(contains(parse_error("max_split_size_mb:"), "max_split_size_mb has no value"));
  CHECK(contains(parse_error("max_split_size_mb: ,memory_fraction:0.5"), "has no value"));
  CHECK(contains(parse_error(",memory_fraction:0.5"), "empty entry"));
  CHECK(contains(parse_error("memory_fraction:0.5,,max_split_size_mb:40"), "empty entry"));
  CHECK(contains(parse_error("memory_fraction:0.5,,"), "empty entry"));
  CHECK(contains(parse_error(","), "empty entry"));
  CHECK(contains(parse_error("max split size mb:40"), "unknown key 'max split size mb'"));
  // A second colon leaves junk in the value.
  CHECK(contains(parse_error("max_split_size_mb:40:50"), "invalid value '40:50' for max_split_size_mb"));
}

TEST_CASE("config: integer values must be plain non-negative integers", "[config]") {
  const char* keys[] = {"min_block_bytes",  "small_size_kb",     "small_segment_mb",          "large_segment_mb",
                        "min_large_alloc_mb", "large_round_mb", "max_split_size_mb", "max_non_split_rounding_mb",
                        "roundup_power2_divisions"};
  const char* bad_values[] = {"-1", "-0", "+4", "abc", "12abc", "1.5", "1e3", "0x10", "4 4", "inf"};
  for (const char* key : keys) {
    for (const char* value : bad_values) {
      const std::string text = std::string(key) + ":" + value;
      INFO(text);
      const std::string e = parse_error(text);
      CHECK(contains(e, "invalid value '" + std::string(value) + "' for " + key));
      CHECK(contains(e, "non-negative integer"));
    }
  }
}

TEST_CASE("config: overflow is an error, not a wrap", "[config]") {
  CHECK(contains(parse_error("min_block_bytes:99999999999999999999999"), "fits in 64 bits"));
  CHECK(contains(parse_error("roundup_power2_divisions:18446744073709551616"), "fits in 64 bits"));
  // Fits as a count but not once scaled to bytes.
  CHECK(contains(parse_error("max_split_size_mb:18446744073709551615"), "fits in 64 bits"));
  CHECK(contains(parse_error("small_size_kb:18014398509481984"), "fits in 64 bits"));
  CHECK(contains(parse_error("large_segment_mb:17592186044416"), "fits in 64 bits"));
  // The largest whole number of MiB that fits is fine for max_split_size_mb.
  const allocator_config c = allocator_config::parse("max_split_size_mb:17592186044415");
  CHECK(c.max_split_bytes == std::size_t{17592186044415} * 1_MiB);
}

TEST_CASE("config: per-key ranges", "[config]") {
  SECTION("min_block_bytes is a power of two >= 256") {
    CHECK(allocator_config::parse("min_block_bytes:256").min_block_bytes == 256);
    CHECK(allocator_config::parse("min_block_bytes:4096").min_block_bytes == 4096);
    for (const char* v : {"0", "128", "255", "384", "1000"}) {
      INFO(v);
      CHECK(contains(parse_error(std::string("min_block_bytes:") + v), "power of two >= 256"));
    }
  }
  SECTION("sizes are positive") {
    for (const char* key : {"small_size_kb", "small_segment_mb", "large_segment_mb", "min_large_alloc_mb",
                            "large_round_mb"}) {
      INFO(key);
      CHECK(contains(parse_error(std::string(key) + ":0"), "positive"));
    }
    CHECK(allocator_config::parse("max_non_split_rounding_mb:0").max_non_split_rounding_bytes == 0);
  }
  SECTION("roundup_power2_divisions is 0 or a power of two up to 64") {
    for (unsigned n : {0u, 1u, 2u, 4u, 8u, 16u, 32u, 64u}) {
      CHECK(allocator_config::parse("roundup_power2_divisions:" + std::to_string(n)).roundup_power2_divisions == n);
    }
    for (const char* v : {"3", "6", "65", "128"}) {
      INFO(v);
      CHECK(contains(parse_error(std::string("roundup_power2_divisions:") + v), "power of two from 1 to 64"));
    }
  }
  SECTION("max_split_size_mb: 'unlimited' or at least large_segment_mb, as torch's >= 20") {
    CHECK(allocator_config::parse("max_split_size_mb:20").max_split_bytes == 20_MiB);
    CHECK(allocator_config::parse("max_split_size_mb:unlimited").max_split_bytes ==
          std::numeric_limits<std::size_t>::max());
    const std::string e = parse_error("max_split_size_mb:19");
    CHECK(contains(e, "max_split_size_mb (19 MiB) must be at least large_segment_mb (20 MiB)"));
    CHECK(contains(parse_error("max_split_size_mb:0"), "must be at least large_segment_mb"));
    CHECK(contains(parse_error("max_split_size_mb:Unlimited"), "invalid value 'Unlimited'"));
    // The rule follows large_segment_mb, in either order of the keys.
    CHECK(allocator_config::parse("max_split_size_mb:8,large_segment_mb:8,min_large_alloc_mb:4").max_split_bytes ==
          8_MiB);
    CHECK(contains(parse_error("max_split_size_mb:40,large_segment_mb:64"), "must be at least large_segment_mb"));
  }
  SECTION("memory_fraction is in [0, 1], as torch's") {
    CHECK(allocator_config::parse("memory_fraction:1").memory_fraction == 1.0);
    CHECK(allocator_config::parse("memory_fraction:1.0").memory_fraction == 1.0);
    CHECK(allocator_config::parse("memory_fraction:0.001").memory_fraction == 0.001);
    CHECK(allocator_config::parse("memory_fraction:5e-1").memory_fraction == 0.5);
    CHECK(allocator_config::parse("memory_fraction:0").memory_fraction == 0.0);
    CHECK(allocator_config::parse("memory_fraction:0.0").memory_fraction == 0.0);
    for (const char* v : {"-0.5", "1.01", "2", "nan", "inf", "0.5x", "abc", "+0.5", "."}) {
      INFO(v);
      const std::string e = parse_error(std::string("memory_fraction:") + v);
      CHECK(contains(e, "memory_fraction"));
      CHECK(contains(e, "[0, 1]"));
    }
  }
  SECTION("garbage_collection_threshold is in (0, 1), 0 = off") {
    CHECK(allocator_config::parse("garbage_collection_threshold:0.8").garbage_collection_threshold == 0.8);
    CHECK(allocator_config::parse("garbage_collection_threshold:0").garbage_collection_threshold == 0.0);
    for (const char* v : {"1", "1.0", "-0.1", "1.5", "nan", "off"}) {
      INFO(v);
      const std::string e = parse_error(std::string("garbage_collection_threshold:") + v);
      CHECK(contains(e, "garbage_collection_threshold"));
      CHECK(contains(e, "[0, 1)"));
    }
  }
}

TEST_CASE("config: small_size_kb auto depends on the kind of segments", "[config]") {
  const allocator_config automatic = allocator_config::parse("small_size_kb:auto");
  CHECK(automatic.small_request_bytes == 0);
  CHECK(automatic.small_request_bytes_for(false) == 1_MiB);
  CHECK(automatic.small_request_bytes_for(true) == 384_KiB);
  // Never below the smallest block.
  const allocator_config big_blocks = allocator_config::parse("min_block_bytes:524288");
  CHECK(big_blocks.small_request_bytes_for(true) == 512_KiB);
  CHECK(big_blocks.small_request_bytes_for(false) == 1_MiB);
  // An explicit value holds for both kinds.
  const allocator_config fixed = allocator_config::parse("small_size_kb:1024");
  CHECK(fixed.small_request_bytes_for(true) == 1_MiB);
  CHECK(fixed.small_request_bytes_for(false) == 1_MiB);
  CHECK(fixed.to_string().find("small_size_kb:1024,") != std::string::npos);
  CHECK(contains(parse_error("small_size_kb:Auto"), "invalid value 'Auto' for small_size_kb"));
  CHECK(contains(parse_error("small_size_kb:0"), "a positive number of KiB"));
}

TEST_CASE("config: cross-key consistency", "[config]") {
  CHECK(contains(parse_error("small_size_kb:4096"),
                 "small_segment_mb (2 MiB) must be at least small_size_kb (4096 KiB)"));
  CHECK_NOTHROW(allocator_config::parse("small_size_kb:4096,small_segment_mb:4"));
  CHECK(contains(parse_error("small_segment_mb:1,small_size_kb:2048"), "small_segment_mb"));

  CHECK(contains(parse_error("min_large_alloc_mb:32"),
                 "large_segment_mb (20 MiB) must be at least min_large_alloc_mb (32 MiB)"));
  CHECK(contains(parse_error("large_segment_mb:8"), "must be at least min_large_alloc_mb"));
  CHECK_NOTHROW(allocator_config::parse("min_large_alloc_mb:32,large_segment_mb:32,max_split_size_mb:32"));

  CHECK(contains(parse_error("small_size_kb:1,min_block_bytes:2048"),
                 "small_size_kb (1024 bytes) must be at least min_block_bytes (2048)"));
  CHECK_NOTHROW(allocator_config::parse("small_size_kb:1,min_block_bytes:1024"));
  // Auto is checked at its plain value, the larger one.
  CHECK_NOTHROW(allocator_config::parse("small_segment_mb:1"));
  CHECK(contains(parse_error("min_block_bytes:2097152,small_segment_mb:2,large_round_mb:2"),
                 "small_size_kb (auto: 1048576 bytes) must be at least min_block_bytes (2097152)"));

  // Segments must be whole numbers of minimum blocks.
  CHECK(contains(parse_error("min_block_bytes:4194304,small_size_kb:4096,small_segment_mb:6"),
                 "small_segment_mb (6 MiB) must be a multiple of min_block_bytes (4194304)"));
  CHECK(contains(parse_error("min_block_bytes:4194304,small_size_kb:4096,small_segment_mb:8,large_round_mb:2"),
                 "large_round_mb (2 MiB) must be a multiple of min_block_bytes"));
  CHECK_NOTHROW(
      allocator_config::parse("min_block_bytes:4194304,small_size_kb:4096,small_segment_mb:8,large_round_mb:4,vmm_chunk_mb:4"));
}

TEST_CASE("config: with() applies pairs on top of an existing config", "[config]") {
  const allocator_config base = allocator_config::parse("max_split_size_mb:64,memory_fraction:0.5");
  const allocator_config changed = base.with("memory_fraction:0.25, cross_stream_reuse:False");
  CHECK(changed.max_split_bytes == 64_MiB);  // kept
  CHECK(changed.memory_fraction == 0.25);    // overridden
  CHECK_FALSE(changed.cross_stream_reuse);   // added
  CHECK(base.memory_fraction == 0.5);        // the original is untouched
  check_same(base.with(""), base);

  // Same rules as parse: duplicates and inconsistency are errors.
  REQUIRE_THROWS_AS(base.with("memory_fraction:0.1,memory_fraction:0.2"), config_error);
  REQUIRE_THROWS_AS(base.with("large_segment_mb:128"), config_error);  // above max_split_size_mb:64
  REQUIRE_THROWS_AS(base.with("bogus:1"), config_error);

  // A config built in code is checked for consistency when text is applied.
  allocator_config in_code;
  in_code.small_segment_bytes = 512_KiB;
  REQUIRE_THROWS_AS(in_code.with(""), config_error);
}

TEST_CASE("config: from_environment reads STREAMALLOC_CONF", "[config]") {
  {
    const scoped_env env(nullptr);
    check_same(allocator_config::from_environment(), allocator_config{});
  }
  {
    const scoped_env env("max_split_size_mb:100, garbage_collection_threshold:0.7");
    const allocator_config c = allocator_config::from_environment();
    CHECK(c.max_split_bytes == 100_MiB);
    CHECK(c.garbage_collection_threshold == 0.7);
  }
  {
    const scoped_env env("max_split_size_mb:lots");
    REQUIRE_THROWS_AS(allocator_config::from_environment(), config_error);
    try {
      allocator_config::from_environment();
    } catch (const config_error& e) {
      CHECK(contains(e.what(), "STREAMALLOC_CONF"));
      CHECK(contains(e.what(), "'lots'"));
    }
  }
}

TEST_CASE("config: torch's settings go beneath STREAMALLOC_CONF", "[config]") {
  const std::string torch_shared = "max_split_size_mb:128,garbage_collection_threshold:0.6";
  {
    const scoped_env env(nullptr);
    const allocator_config c = allocator_config::from_environment(torch_shared);
    CHECK(c.max_split_bytes == 128_MiB);
    CHECK(c.garbage_collection_threshold == 0.6);
  }
  {
    // The variable that names streamalloc wins where both set a key.
    const scoped_env env("garbage_collection_threshold:0.7");
    const allocator_config c = allocator_config::from_environment(torch_shared);
    CHECK(c.max_split_bytes == 128_MiB);
    CHECK(c.garbage_collection_threshold == 0.7);
  }
}

TEST_CASE("config: torch's settings split into shared entries and ignored keys", "[config]") {
  SECTION("nothing set") {
    const auto split = allocator_config::split_torch_settings("");
    CHECK(split.shared.empty());
    CHECK(split.ignored.empty());
  }
  SECTION("each kind of key") {
    const auto split = allocator_config::split_torch_settings(
        "backend:native, max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:4],"
        "pinned_use_cuda_host_register:True,per_process_memory_fraction:0.5,expandable_segments:True,"
        "release_lock_on_cudamalloc:True,garbage_collection_threshold:0.6,max_non_split_rounding_mb:40,"
        "graph_capture_record_stream_reuse:True");
    CHECK(split.shared ==
          "max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:True,"
          "garbage_collection_threshold:0.6,max_non_split_rounding_mb:40,graph_capture_record_stream_reuse:True");
    // torch's expandable_segments covers its private pools too.
    CHECK(split.applied ==
          "max_split_size_mb:128,roundup_power2_divisions:[256:1,512:2,>:4],expandable_segments:True,"
          "expandable_private_pools:True,garbage_collection_threshold:0.6,max_non_split_rounding_mb:40,"
          "graph_capture_record_stream_reuse:True");
    CHECK(split.ignored == std::vector<std::string>{"backend", "release_lock_on_cudamalloc"});
    // Every shared key is one of streamalloc's own, so the entries apply.
    const allocator_config c = allocator_config::parse(split.applied);
    CHECK(c.max_split_bytes == 128_MiB);
    CHECK(c.roundup_divisions_for(300_MiB) == 1);
    CHECK(c.max_non_split_rounding_bytes == 40_MiB);
    CHECK(c.graph_capture_record_stream_reuse);
    CHECK(c.expandable_private_pools);
    CHECK_FALSE(allocator_config::parse(allocator_config::split_torch_settings("expandable_segments:False").applied)
                    .expandable_private_pools);
  }
  SECTION("malformed text is a config error") {
    REQUIRE_THROWS_AS(allocator_config::split_torch_settings("max_split_size_mb"), config_error);
  }
}

TEST_CASE("config: keys() documents every key exactly once", "[config]") {
  const auto& keys = allocator_config::keys();
  CHECK(keys.size() == 19);
  std::set<std::string> names;
  const std::string rendered = allocator_config{}.to_string();
  for (const auto& doc : keys) {
    INFO(doc.key);
    CHECK(names.insert(doc.key).second);
    CHECK(std::string(doc.description).size() > 20);
    CHECK(contains(rendered, std::string(doc.key) + ":"));
  }
  for (const char* torch_key :
       {"max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions", "garbage_collection_threshold",
        "expandable_segments"}) {
    CHECK(names.count(torch_key) == 1);
  }
}

TEST_CASE("config: to_string renders every key and round-trips", "[config]") {
  SECTION("defaults") {
    const allocator_config c;
    const std::string text = c.to_string();
    INFO(text);
    CHECK(text ==
          "min_block_bytes:512,small_size_kb:auto,small_segment_mb:2,large_segment_mb:20,min_large_alloc_mb:10,"
          "large_round_mb:2,max_split_size_mb:unlimited,max_non_split_rounding_mb:20,roundup_power2_divisions:0,"
          "cross_stream_reuse:True,graph_capture_record_stream_reuse:False,memory_fraction:1,garbage_collection_threshold:0,"
          "expandable_segments:True,expandable_private_pools:False,"
          "stitching:True,stitch_slack:0.005,arenas:4,vmm_chunk_mb:2");
    check_same(allocator_config::parse(text), c);
  }
  SECTION("every key changed") {
    const allocator_config c = allocator_config::parse(
        "min_block_bytes:256,small_size_kb:768,small_segment_mb:1,large_segment_mb:12,min_large_alloc_mb:12,"
        "large_round_mb:1,max_split_size_mb:1024,max_non_split_rounding_mb:0,roundup_power2_divisions:64,"
        "cross_stream_reuse:0,memory_fraction:0.1,garbage_collection_threshold:0.95,expandable_segments:false,"
        "expandable_private_pools:1,stitching:0,stitch_slack:0.25,arenas:2,vmm_chunk_mb:64");
    const std::string text = c.to_string();
    INFO(text);
    check_same(allocator_config::parse(text), c);
    CHECK(contains(text, "cross_stream_reuse:False"));
    CHECK(contains(text,
                   "expandable_segments:False,expandable_private_pools:True,stitching:False,stitch_slack:0.25,"
                   "arenas:2,vmm_chunk_mb:64"));
    CHECK(contains(text, "memory_fraction:0.1,"));
  }
  SECTION("doubles round-trip bit for bit") {
    allocator_config c;
    c.memory_fraction = 0.1 + 0.2;  // not 0.3: needs 17 significant digits
    c.garbage_collection_threshold = 1.0 / 3.0;
    check_same(allocator_config::parse(c.to_string()), c);
  }
  SECTION("a size the key's unit cannot express is an error, not rounded") {
    allocator_config c;
    c.small_request_bytes = 1000;
    CHECK_THROWS_AS(c.to_string(), config_error);
    c = allocator_config{};
    c.max_split_bytes = 64_MiB + 1;
    try {
      (void)c.to_string();
      FAIL("to_string accepted a max_split_bytes that is not a whole MiB");
    } catch (const config_error& e) {
      CHECK(contains(e.what(), "max_split_bytes"));
      CHECK(contains(e.what(), "max_split_size_mb"));
    }
  }
}

namespace {

std::vector<unsigned> intervals(const std::string& list) {
  return allocator_config::parse("roundup_power2_divisions:" + list).roundup_power2_intervals;
}

}  // namespace

TEST_CASE("config: torch's list form of roundup_power2_divisions", "[config]") {
  // Entry i covers requests in [2^i, 2^(i+1)) MiB.
  SECTION("torch's example: the first entry also covers every smaller size, '>' every larger one") {
    CHECK(intervals("[256:1,512:2,1024:4,>:8]") ==
          std::vector<unsigned>{1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 4, 8, 8, 8, 8, 8});
    const allocator_config c = allocator_config::parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]");
    CHECK(c.roundup_power2_divisions == 0);
    CHECK(c.roundup_divisions_for(100) == 1);
    CHECK(c.roundup_divisions_for(300_MiB) == 1);
    CHECK(c.roundup_divisions_for(512_MiB - 1) == 1);
    CHECK(c.roundup_divisions_for(512_MiB) == 2);
    CHECK(c.roundup_divisions_for(1_GiB + 512_MiB) == 4);
    CHECK(c.roundup_divisions_for(2_GiB) == 8);
    CHECK(c.roundup_divisions_for(std::size_t{1} << 40) == 8);  // beyond 64 GiB: the last interval
  }
  SECTION("intervals no entry names do not round, as in torch") {
    CHECK(intervals("[64:8,1024:4]") == std::vector<unsigned>{8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 4, 0, 0, 0, 0, 0});
    CHECK(intervals("[>:2]") == std::vector<unsigned>{0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2});
    CHECK(intervals("[]") == std::vector<unsigned>(16, 0));
    // Boundaries beyond the table clamp to its last interval.
    CHECK(intervals("[65536:2]") == std::vector<unsigned>(16, 2));
    CHECK(intervals("[ 1 : 4 , > : 16 ]") == std::vector<unsigned>{4, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16, 16,
                                                                   16, 16, 16, 16});
  }
  SECTION("commas inside the list do not end the key") {
    const allocator_config c =
        allocator_config::parse("roundup_power2_divisions:[256:1,>:4],max_split_size_mb:64,expandable_segments:False");
    CHECK(c.roundup_divisions_for(1_GiB) == 4);
    CHECK(c.max_split_bytes == 64_MiB);
    CHECK_FALSE(c.expandable_segments);
  }
  SECTION("malformed lists name the key") {
    for (const char* v : {"[3:2]", "[256:3]", "[256:128]", "[256]", "[256:2", "[x:2]", "[256:2,,>:4]",
                          "[256:2,512:4,max_split_size_mb:40"}) {
      INFO(v);
      CHECK(contains(parse_error(std::string("roundup_power2_divisions:") + v), "roundup_power2_divisions"));
    }
  }
  SECTION("round trip, and either form replaces the other") {
    const allocator_config c = allocator_config::parse("roundup_power2_divisions:[64:8,1024:4,>:2]");
    const std::string text = c.to_string();
    INFO(text);
    CHECK(contains(text, "roundup_power2_divisions:[1:8,2:8,4:8,8:8,16:8,32:8,64:8,128:0,256:0,512:0,1024:4,2048:2,"
                         "4096:2,8192:2,16384:2,32768:2],"));
    check_same(allocator_config::parse(text), c);
    const allocator_config single = c.with("roundup_power2_divisions:4");
    CHECK(single.roundup_power2_intervals.empty());
    CHECK(single.roundup_divisions_for(4_GiB) == 4);
    CHECK(allocator_config::parse("roundup_power2_divisions:4").with("roundup_power2_divisions:[>:2]")
              .roundup_power2_divisions == 0);
    allocator_config broken;
    broken.roundup_power2_intervals = {4, 4};
    CHECK_THROWS_AS(broken.to_string(), config_error);
    CHECK_THROWS_AS(broken.validate(), config_error);
  }
  SECTION("the size policy rounds by the interval of the request") {
    const allocator_config c = allocator_config::parse("roundup_power2_divisions:[1:4,>:8]");
    const size_policy policy(c, false);
    std::size_t rounded = 0;
    REQUIRE(policy.round(1_MiB + 512_KiB + 1, &rounded));
    CHECK(rounded == 1_MiB + 768_KiB);  // quarters of [1, 2) MiB
    REQUIRE(policy.round(3_MiB + 1, &rounded));
    CHECK(rounded == 3_MiB + 256_KiB);  // eighths of [2, 4) MiB
    REQUIRE(policy.round(700_KiB + 1, &rounded));
    CHECK(rounded == 768_KiB);  // below 1 MiB: the first interval's quarters
  }
}

TEST_CASE("config: check_run_time_update names the field that cannot change", "[config]") {
  const allocator_config now;
  allocator_config next = now;
  next.max_split_bytes = 64_MiB;
  next.max_non_split_rounding_bytes = 40_MiB;
  next.roundup_power2_divisions = 4;
  next.garbage_collection_threshold = 0.5;
  next.expandable_segments = false;
  CHECK_NOTHROW(now.check_run_time_update(next));
  next.roundup_power2_intervals = std::vector<unsigned>(16, 2);
  CHECK_NOTHROW(now.check_run_time_update(next));

  struct change {
    const char* field;
    const char* key;
    void (*apply)(allocator_config&);
  };
  const change changes[] = {
      {"min_block_bytes", "min_block_bytes", [](allocator_config& c) { c.min_block_bytes = 1024; }},
      {"small_request_bytes", "small_size_kb", [](allocator_config& c) { c.small_request_bytes = 512_KiB; }},
      {"small_segment_bytes", "small_segment_mb", [](allocator_config& c) { c.small_segment_bytes = 4_MiB; }},
      {"large_segment_bytes", "large_segment_mb", [](allocator_config& c) { c.large_segment_bytes = 40_MiB; }},
      {"min_large_alloc_bytes", "min_large_alloc_mb", [](allocator_config& c) { c.min_large_alloc_bytes = 8_MiB; }},
      {"large_round_bytes", "large_round_mb", [](allocator_config& c) { c.large_round_bytes = 4_MiB; }},
      {"cross_stream_reuse", "cross_stream_reuse", [](allocator_config& c) { c.cross_stream_reuse = false; }},
      {"memory_fraction", "memory_fraction", [](allocator_config& c) { c.memory_fraction = 0.5; }},
      {"stitching", "stitching", [](allocator_config& c) { c.stitching = false; }},
      {"stitch_slack", "stitch_slack", [](allocator_config& c) { c.stitch_slack = 0.1; }},
      {"vmm_chunk_bytes", "vmm_chunk_mb", [](allocator_config& c) { c.vmm_chunk_bytes = 4_MiB; }},
  };
  for (const change& ch : changes) {
    INFO(ch.field);
    allocator_config changed = now;
    ch.apply(changed);
    try {
      now.check_run_time_update(changed);
      FAIL("a change of " << ch.field << " was accepted");
    } catch (const usage_error& e) {
      CHECK(contains(e.what(), std::string(ch.field) + " (STREAMALLOC_CONF key " + ch.key));
      CHECK(contains(e.what(), "cannot change at run time"));
    }
  }
}
