// Parses and renders STREAMALLOC_CONF (`key:value,key:value`, the syntax of
// PYTORCH_CUDA_ALLOC_CONF). Every key lives in one table that drives parsing,
// rendering and the documentation, so the three cannot drift apart.
#include "streamalloc/core/config.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <set>
#include <string_view>
#include <system_error>
#include <utility>

#include "streamalloc/util/errors.hpp"

namespace streamalloc {

namespace {

constexpr std::size_t k_min_block_floor_bytes = 256;
constexpr unsigned k_max_roundup_divisions = 64;
constexpr std::size_t k_unlimited = std::numeric_limits<std::size_t>::max();
constexpr const char* k_unlimited_text = "unlimited";
constexpr const char* k_auto_text = "auto";

[[noreturn]] void fail(const std::string& message) { throw config_error("STREAMALLOC_CONF: " + message); }

[[noreturn]] void fail_value(std::string_view key, std::string_view value, const std::string& expected) {
  fail("invalid value '" + std::string(value) + "' for " + std::string(key) + ": expected " + expected);
}

bool is_space(char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; }

std::string_view trim(std::string_view text) {
  while (!text.empty() && is_space(text.front())) text.remove_prefix(1);
  while (!text.empty() && is_space(text.back())) text.remove_suffix(1);
  return text;
}

bool is_power_of_two(std::size_t v) { return v != 0 && (v & (v - 1)) == 0; }

// Digits only: a sign, a fraction or trailing characters make it an error
// rather than being silently dropped as std::stoul would.
std::size_t parse_count(std::string_view key, std::string_view value, const char* what) {
  if (value.empty() || value.find_first_not_of("0123456789") != std::string_view::npos) {
    fail_value(key, value, std::string("a non-negative integer (") + what + ")");
  }
  std::size_t result = 0;
  if (std::from_chars(value.data(), value.data() + value.size(), result).ec != std::errc()) {
    fail_value(key, value, std::string("a number of ") + what + " that fits in 64 bits");
  }
  return result;
}

std::size_t parse_scaled(std::string_view key, std::string_view value, std::size_t unit, const char* unit_name) {
  const std::size_t count = parse_count(key, value, unit_name);
  if (count > k_unlimited / unit) fail_value(key, value, std::string("a size that fits in 64 bits of bytes"));
  return count * unit;
}

// A size key that must be positive: "0" is an error naming the key.
std::size_t parse_positive_size(std::string_view key, std::string_view value, std::size_t unit, const char* unit_name) {
  const std::size_t bytes = parse_scaled(key, value, unit, unit_name);
  if (bytes == 0) fail_value(key, value, std::string("a positive number of ") + unit_name);
  return bytes;
}

double parse_real(std::string_view key, std::string_view value, const char* range) {
  double result = 0.0;
  const char* last = value.data() + value.size();
  const auto [end, error] = std::from_chars(value.data(), last, result);
  if (error != std::errc() || end != last || !std::isfinite(result)) {
    fail_value(key, value, std::string("a decimal number ") + range);
  }
  return result;
}

bool parse_bool(std::string_view key, std::string_view value) {
  if (value == "True" || value == "true" || value == "1") return true;
  if (value == "False" || value == "false" || value == "0") return false;
  fail_value(key, value, "True or False (also true/false/1/0)");
}

// Rendering must be exact for parse(to_string()) to give the same config, so
// a byte count that the key's unit cannot express is an error, not rounded.
std::string render_scaled(std::size_t bytes, std::size_t unit, const char* field, const char* key, const char* unit_name) {
  if (bytes % unit != 0) {
    throw config_error("allocator_config::to_string: " + std::string(field) + " = " + std::to_string(bytes) +
                       " is not a whole number of " + unit_name + ", so " + key + " cannot express it");
  }
  return std::to_string(bytes / unit);
}

// The shortest text that reads back as the same double.
std::string render_real(double value) {
  char buffer[64];
  const auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
  return std::string(buffer, result.ptr);
}

std::string mib_text(std::size_t bytes) {
  return bytes % 1_MiB == 0 ? std::to_string(bytes / 1_MiB) + " MiB" : std::to_string(bytes) + " bytes";
}

unsigned parse_divisions(std::string_view key, std::string_view value, std::string_view text) {
  const std::size_t n = parse_count(key, text, "divisions");
  if (n > k_max_roundup_divisions || (n != 0 && !is_power_of_two(n))) {
    fail_value(key, value, "0 (off) or a power of two from 1 to 64");
  }
  return static_cast<unsigned>(n);
}

// Note [roundup intervals]: torch's list form, with torch's semantics
// (AcceleratorAllocatorConfig::parseRoundUpPower2Divisions): each
// `MiB:divisions` entry sets the interval starting at that power of two
// (clamped to the table); the first one also covers every interval below
// it; `>:divisions` covers every interval after the last entry before it;
// intervals named by no rule do not round (0).
std::vector<unsigned> parse_roundup_intervals(std::string_view value) {
  constexpr const char* key = "roundup_power2_divisions";
  const char* expected = "a list [MiB:divisions,...,>:divisions] with MiB a power of two and divisions 0 or a power "
                         "of two up to 64";
  if (value.size() < 2 || value.back() != ']') fail_value(key, value, expected);
  std::vector<unsigned> table(allocator_config::k_roundup_intervals, 0);
  std::string_view rest = trim(value.substr(1, value.size() - 2));
  bool first = true;
  std::size_t last_index = 0;
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    const std::string_view entry = trim(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    const std::size_t colon = entry.find(':');
    if (colon == std::string_view::npos) fail_value(key, value, expected);
    const std::string_view boundary = trim(entry.substr(0, colon));
    const unsigned divisions = parse_divisions(key, value, trim(entry.substr(colon + 1)));
    if (boundary == ">") {
      std::fill(table.begin() + static_cast<std::ptrdiff_t>(last_index + 1), table.end(), divisions);
      continue;
    }
    const std::size_t mib = parse_count(key, boundary, "MiB");
    if (!is_power_of_two(mib)) fail_value(key, value, expected);
    std::size_t index = 0;
    for (std::size_t m = mib; m > 1; m >>= 1) ++index;
    index = std::min(index, table.size() - 1);
    if (first) std::fill(table.begin(), table.begin() + static_cast<std::ptrdiff_t>(index), divisions);
    first = false;
    table[index] = divisions;
    last_index = index;
  }
  return table;
}

// Every interval written out, so that parsing the text gives the same table.
std::string render_roundup_intervals(const std::vector<unsigned>& table) {
  if (table.size() != allocator_config::k_roundup_intervals) {
    throw config_error("allocator_config::to_string: roundup_power2_intervals has " + std::to_string(table.size()) +
                       " entries; it needs " + std::to_string(allocator_config::k_roundup_intervals) +
                       " (or none), so roundup_power2_divisions cannot express it");
  }
  std::string text = "[";
  for (std::size_t i = 0; i < table.size(); ++i) {
    if (i != 0) text += ',';
    text += std::to_string(std::size_t{1} << i) + ':' + std::to_string(table[i]);
  }
  return text + "]";
}

struct key_handler {
  const char* key;
  const char* description;
  void (*apply)(allocator_config& config, std::string_view value);
  std::string (*render)(const allocator_config& config);
  // A key that is a positive whole number of `unit` bytes stored in
  // `size_field` (named `field_name` in errors) needs no apply or render.
  std::size_t allocator_config::*size_field = nullptr;
  std::size_t unit = 0;
  const char* unit_name = nullptr;
  const char* field_name = nullptr;
  // A True/False key stored in `bool_field` needs no apply or render either.
  bool allocator_config::*bool_field = nullptr;
};

constexpr key_handler size_key(const char* key, const char* description, std::size_t allocator_config::*field,
                               const char* field_name, std::size_t unit, const char* unit_name) {
  return {key, description, nullptr, nullptr, field, unit, unit_name, field_name};
}

constexpr key_handler bool_key(const char* key, const char* description, bool allocator_config::*field) {
  return {key, description, nullptr, nullptr, nullptr, 0, nullptr, nullptr, field};
}

void apply_key(const key_handler& h, allocator_config& config, std::string_view value) {
  if (h.bool_field != nullptr) {
    config.*h.bool_field = parse_bool(h.key, value);
  } else if (h.size_field != nullptr) {
    config.*h.size_field = parse_positive_size(h.key, value, h.unit, h.unit_name);
  } else {
    h.apply(config, value);
  }
}

std::string render_key(const key_handler& h, const allocator_config& config) {
  if (h.bool_field != nullptr) return config.*h.bool_field ? "True" : "False";
  if (h.size_field != nullptr) return render_scaled(config.*h.size_field, h.unit, h.field_name, h.key, h.unit_name);
  return h.render(config);
}

constexpr key_handler k_handlers[] = {
    {"min_block_bytes",
     "Smallest block size and rounding unit for every request, in bytes; a power of two >= 256 (default 512).",
     [](allocator_config& c, std::string_view v) {
       const std::size_t bytes = parse_count("min_block_bytes", v, "bytes");
       if (bytes < k_min_block_floor_bytes || !is_power_of_two(bytes)) {
         fail_value("min_block_bytes", v, "a power of two >= 256");
       }
       c.min_block_bytes = bytes;
     },
     [](const allocator_config& c) { return std::to_string(c.min_block_bytes); }},
    {"small_size_kb",
     "Requests up to this many KiB are served from the small pool; 'auto' = 1024 (PyTorch's value) for plain "
     "segments and 384 for expandable segments, whose large pool packs mid-size blocks into partly used chunks; "
     "with auto, a mid-size request up to 1024 KiB may still take a small free block when no large one fits, "
     "or open a small chunk for a stream without a free small block (default auto).",
     [](allocator_config& c, std::string_view v) {
       c.small_request_bytes = v == k_auto_text ? 0 : parse_positive_size("small_size_kb", v, 1_KiB, "KiB");
     },
     [](const allocator_config& c) {
       return c.small_request_bytes == 0 ? std::string(k_auto_text)
                                         : render_scaled(c.small_request_bytes, 1_KiB, "small_request_bytes",
                                                         "small_size_kb", "KiB");
     }},
    size_key("small_segment_mb", "Size in MiB of the segments the small pool carves its blocks from (default 2).",
             &allocator_config::small_segment_bytes, "small_segment_bytes", 1_MiB, "MiB"),
    size_key("large_segment_mb",
             "Size in MiB of the shared segments that serve large requests below min_large_alloc_mb (default 20).",
             &allocator_config::large_segment_bytes, "large_segment_bytes", 1_MiB, "MiB"),
    size_key("min_large_alloc_mb",
             "Large requests of at least this many MiB get a segment of their own, rounded up to large_round_mb "
             "(default 10).",
             &allocator_config::min_large_alloc_bytes, "min_large_alloc_bytes", 1_MiB, "MiB"),
    size_key("large_round_mb", "Segments of their own are rounded up to a multiple of this many MiB (default 2).",
             &allocator_config::large_round_bytes, "large_round_bytes", 1_MiB, "MiB"),
    {"max_split_size_mb",
     "PyTorch's key: cached blocks of plain segments of at least this many MiB are never split (those of "
     "expandable segments serve any request); at least large_segment_mb, or 'unlimited' (default unlimited).",
     [](allocator_config& c, std::string_view v) {
       c.max_split_bytes = v == k_unlimited_text ? k_unlimited : parse_scaled("max_split_size_mb", v, 1_MiB, "MiB");
     },
     [](const allocator_config& c) {
       return c.max_split_bytes == k_unlimited
                  ? std::string(k_unlimited_text)
                  : render_scaled(c.max_split_bytes, 1_MiB, "max_split_bytes", "max_split_size_mb", "MiB");
     }},
    {"max_non_split_rounding_mb",
     "PyTorch's key: a never-split block may serve a request at most this many MiB smaller than itself "
     "(default 20).",
     [](allocator_config& c, std::string_view v) {
       c.max_non_split_rounding_bytes = parse_scaled("max_non_split_rounding_mb", v, 1_MiB, "MiB");
     },
     [](const allocator_config& c) {
       return render_scaled(c.max_non_split_rounding_bytes, 1_MiB, "max_non_split_rounding_bytes",
                            "max_non_split_rounding_mb", "MiB");
     }},
    {"roundup_power2_divisions",
     "PyTorch's key: round requests up to one of N steps between powers of two; N a power of two up to 64, "
     "0 = off (default 0). PyTorch's list form [256:1,512:2,>:8] sets N per size interval (MiB).",
     [](allocator_config& c, std::string_view v) {
       if (!v.empty() && v.front() == '[') {
         c.roundup_power2_intervals = parse_roundup_intervals(v);
         c.roundup_power2_divisions = 0;
         return;
       }
       c.roundup_power2_divisions = parse_divisions("roundup_power2_divisions", v, v);
       c.roundup_power2_intervals.clear();
     },
     [](const allocator_config& c) {
       return c.roundup_power2_intervals.empty() ? std::to_string(c.roundup_power2_divisions)
                                                 : render_roundup_intervals(c.roundup_power2_intervals);
     }},
    bool_key("cross_stream_reuse",
             "True lets a free block cached for one stream serve another stream after an event wait, instead of "
             "growing (default True).",
             &allocator_config::cross_stream_reuse),
    bool_key("graph_capture_record_stream_reuse",
             "PyTorch's key: True lets a block freed during a CUDA graph capture while other captured streams use it "
             "(record_stream) be reused in the same capture once the graph orders those uses first, instead of after "
             "the capture (default False).",
             &allocator_config::graph_capture_record_stream_reuse),
    {"memory_fraction", "Caps reserved memory at this fraction of device memory, 0 <= x <= 1 (default 1; 0 reserves nothing).",
     [](allocator_config& c, std::string_view v) {
       const double x = parse_real("memory_fraction", v, "in [0, 1]");
       if (!(x >= 0.0 && x <= 1.0)) fail_value("memory_fraction", v, "a decimal number in [0, 1]");
       c.memory_fraction = x;
     },
     [](const allocator_config& c) { return render_real(c.memory_fraction); }},
    {"garbage_collection_threshold",
     "PyTorch's key: before growing, free cached blocks once reserved memory exceeds this fraction of the "
     "allowed memory; 0 < x < 1, 0 = off (default 0).",
     [](allocator_config& c, std::string_view v) {
       const double x = parse_real("garbage_collection_threshold", v, "in [0, 1)");
       if (!(x >= 0.0 && x < 1.0)) fail_value("garbage_collection_threshold", v, "a decimal number in [0, 1), 0 = off");
       c.garbage_collection_threshold = x;
     },
     [](const allocator_config& c) { return render_real(c.garbage_collection_threshold); }},
    bool_key("expandable_segments",
             "PyTorch's key: the default pool maps physical chunks into large reserved address ranges that grow in "
             "place, where the device supports virtual memory; False = one cudaMalloc per segment (default True).",
             &allocator_config::expandable_segments),
    bool_key("expandable_private_pools",
             "With expandable segments: private pools (CUDA graphs, MemPool) grow expandable ranges too, one per "
             "stream, by torch's segment sizes; torch's expandable_segments key sets it with expandable_segments "
             "(default False: plain segments, torch's default layouts).",
             &allocator_config::expandable_private_pools),
    bool_key("stitching",
             "With expandable segments: when no mapped free block fits, move idle chunks out of free holes to serve "
             "the request instead of mapping new memory; while other threads wait for the allocator, only what the "
             "device cannot give (default True).",
             &allocator_config::stitching),
    {"stitch_slack",
     "With stitching: expandable segments simply grow while reserved memory stays within this fraction "
     "above the peak of allocated memory; beyond it idle chunks are stitched. 0 <= x <= 1 (default 0.005).",
     [](allocator_config& c, std::string_view v) {
       const double x = parse_real("stitch_slack", v, "in [0, 1]");
       if (!(x >= 0.0 && x <= 1.0)) fail_value("stitch_slack", v, "a decimal number in [0, 1]");
       c.stitch_slack = x;
     },
     [](const allocator_config& c) { return render_real(c.stitch_slack); }},
    {"arenas",
     "Most arenas per device, 1 to 4: a thread whose calls keep finding the allocator's lock held moves to an arena "
     "of its own pools and lock; 1 = one lock for every thread (default 4).",
     [](allocator_config& c, std::string_view v) {
       const std::size_t n = parse_count("arenas", v, "arenas");
       if (n < 1 || n > allocator_config::k_max_arenas) fail_value("arenas", v, "a whole number from 1 to 4");
       c.arenas = n;
     },
     [](const allocator_config& c) { return std::to_string(c.arenas); }},
    size_key("vmm_chunk_mb",
             "Size in MiB of the physical chunks expandable segments map; a multiple of the device's granularity "
             "(2 MiB on current GPUs), checked when expandable segments are on (default 2).",
             &allocator_config::vmm_chunk_bytes, "vmm_chunk_bytes", 1_MiB, "MiB"),
};

std::string valid_key_list() {
  std::string list;
  for (const key_handler& h : k_handlers) {
    if (!list.empty()) list += ", ";
    list += h.key;
  }
  return list;
}

const key_handler* find_handler(std::string_view key) {
  for (const key_handler& h : k_handlers) {
    if (key == h.key) return &h;
  }
  return nullptr;
}

// Splits on commas into trimmed (key, value) pairs. One trailing comma is
// accepted because PyTorch accepts it.
std::vector<std::pair<std::string_view, std::string_view>> split_entries(std::string_view text) {
  std::vector<std::pair<std::string_view, std::string_view>> entries;
  if (trim(text).empty()) return entries;
  // A comma inside brackets belongs to a list value (torch's
  // roundup_power2_divisions:[256:1,512:2]).
  const auto next_comma = [&](std::size_t from) {
    int depth = 0;
    for (std::size_t i = from; i < text.size(); ++i) {
      if (text[i] == '[') ++depth;
      if (text[i] == ']' && depth > 0) --depth;
      if (text[i] == ',' && depth == 0) return i;
    }
    return std::string_view::npos;
  };
  std::size_t start = 0;
  while (true) {
    const std::size_t comma = next_comma(start);
    const bool last = comma == std::string_view::npos;
    const std::string_view entry = trim(text.substr(start, last ? std::string_view::npos : comma - start));
    if (entry.empty()) {
      if (last && !entries.empty()) break;
      fail("empty entry in '" + std::string(text) + "' (a leading comma or two commas in a row)");
    }
    const std::size_t colon = entry.find(':');
    if (colon == std::string_view::npos) {
      fail("entry '" + std::string(entry) + "' is not of the form key:value; valid keys: " + valid_key_list());
    }
    const std::string_view key = trim(entry.substr(0, colon));
    const std::string_view value = trim(entry.substr(colon + 1));
    if (key.empty()) fail("entry '" + std::string(entry) + "' has no key; valid keys: " + valid_key_list());
    if (value.empty()) fail("key " + std::string(key) + " has no value");
    entries.emplace_back(key, value);
    if (last) break;
    start = comma + 1;
  }
  return entries;
}

// Cross-key rules, checked once every key has been applied so the order of
// keys in the string does not matter.
void check_consistency(const allocator_config& c) {
  // Auto's larger value is the plain one; its expandable one follows
  // min_block_bytes, so checking the plain one covers both.
  const std::size_t small = c.small_request_bytes_for(false);
  const std::string small_text = c.small_request_bytes == 0 ? "small_size_kb (auto: " : "small_size_kb (";
  if (small < c.min_block_bytes) {
    fail(small_text + std::to_string(small) + " bytes) must be at least min_block_bytes (" +
         std::to_string(c.min_block_bytes) + ")");
  }
  if (c.small_segment_bytes < small) {
    fail("small_segment_mb (" + mib_text(c.small_segment_bytes) + ") must be at least " + small_text +
         std::to_string(small / 1_KiB) + " KiB): a small segment must hold the largest small block");
  }
  if (c.large_segment_bytes < c.min_large_alloc_bytes) {
    fail("large_segment_mb (" + mib_text(c.large_segment_bytes) + ") must be at least min_large_alloc_mb (" +
         mib_text(c.min_large_alloc_bytes) + "): a shared large segment must hold any request below it");
  }
  if (c.max_split_bytes < c.large_segment_bytes) {
    fail("max_split_size_mb (" + mib_text(c.max_split_bytes) + ") must be at least large_segment_mb (" +
         mib_text(c.large_segment_bytes) + "), as PyTorch requires max_split_size_mb >= 20");
  }
  // Block sizes are multiples of min_block_bytes; segments must be too, or
  // their tail could never become a block.
  const std::pair<const char*, std::size_t> segment_sizes[] = {{"small_segment_mb", c.small_segment_bytes},
                                                               {"large_segment_mb", c.large_segment_bytes},
                                                               {"large_round_mb", c.large_round_bytes},
                                                               {"vmm_chunk_mb", c.vmm_chunk_bytes}};
  for (const auto& [key, bytes] : segment_sizes) {
    if (bytes % c.min_block_bytes != 0) {
      fail(std::string(key) + " (" + mib_text(bytes) + ") must be a multiple of min_block_bytes (" +
           std::to_string(c.min_block_bytes) + ")");
    }
  }
}

}  // namespace

allocator_config allocator_config::parse(const std::string& text) { return allocator_config{}.with(text); }

allocator_config allocator_config::from_environment(const std::string& beneath) {
  const char* text = std::getenv("STREAMALLOC_CONF");
  return parse(beneath).with(text == nullptr ? std::string() : std::string(text));
}

allocator_config allocator_config::with(const std::string& text) const {
  allocator_config result = *this;
  std::set<std::string_view> seen;
  for (const auto& [key, value] : split_entries(text)) {
    const key_handler* handler = find_handler(key);
    if (handler == nullptr) fail("unknown key '" + std::string(key) + "'; valid keys: " + valid_key_list());
    if (!seen.insert(key).second) fail("key " + std::string(key) + " appears more than once");
    apply_key(*handler, result, value);
  }
  check_consistency(result);
  return result;
}

unsigned allocator_config::roundup_divisions_for(std::size_t bytes) const {
  if (roundup_power2_intervals.empty()) return roundup_power2_divisions;
  std::size_t index = 0;
  for (std::size_t mib = bytes >> 20; mib > 1 && index + 1 < roundup_power2_intervals.size(); mib >>= 1) ++index;
  return roundup_power2_intervals[index];
}

std::size_t allocator_config::small_request_bytes_for(bool expandable) const {
  if (small_request_bytes != 0) return small_request_bytes;
  return expandable ? std::max(k_expandable_small_request_bytes, min_block_bytes) : k_plain_small_request_bytes;
}

void allocator_config::validate() const {
  // Re-applying every key through its parser checks each field's range and
  // the cross-key rules for configs built in code, without a second copy of
  // the rules.
  (void)allocator_config{}.with(to_string());
}

void allocator_config::check_run_time_update(const allocator_config& next) const {
  // These fields shape segments and blocks that already exist (or, for
  // memory_fraction, have their own setter), so they stay as they are.
  const auto keep = [](bool same, const char* field, const char* key) {
    if (same) return;
    throw usage_error(std::string("streamalloc: ") + field + " (STREAMALLOC_CONF key " + key +
                      ") cannot change at run time; only max_split_size_mb, max_non_split_rounding_mb, "
                      "roundup_power2_divisions, garbage_collection_threshold, expandable_segments, "
                      "expandable_private_pools and graph_capture_record_stream_reuse can");
  };
  keep(next.min_block_bytes == min_block_bytes, "min_block_bytes", "min_block_bytes");
  keep(next.small_request_bytes == small_request_bytes, "small_request_bytes", "small_size_kb");
  keep(next.small_segment_bytes == small_segment_bytes, "small_segment_bytes", "small_segment_mb");
  keep(next.large_segment_bytes == large_segment_bytes, "large_segment_bytes", "large_segment_mb");
  keep(next.min_large_alloc_bytes == min_large_alloc_bytes, "min_large_alloc_bytes", "min_large_alloc_mb");
  keep(next.large_round_bytes == large_round_bytes, "large_round_bytes", "large_round_mb");
  keep(next.cross_stream_reuse == cross_stream_reuse, "cross_stream_reuse", "cross_stream_reuse");
  keep(next.memory_fraction == memory_fraction, "memory_fraction",
       "memory_fraction; set_memory_fraction changes the cap");
  keep(next.stitching == stitching, "stitching", "stitching");
  keep(next.stitch_slack == stitch_slack, "stitch_slack", "stitch_slack");
  keep(next.vmm_chunk_bytes == vmm_chunk_bytes, "vmm_chunk_bytes", "vmm_chunk_mb");
  keep(next.arenas == arenas, "arenas", "arenas");
}

const std::vector<allocator_config::key_doc>& allocator_config::keys() {
  static const std::vector<key_doc> docs = [] {
    std::vector<key_doc> result;
    for (const key_handler& h : k_handlers) result.push_back({h.key, h.description});
    return result;
  }();
  return docs;
}

// Note [torch's settings]: users keep torch's variable when they install
// streamalloc, so the keys that mean the same in both take effect: at
// installation, torch's settings go beneath STREAMALLOC_CONF (the variable
// that names streamalloc wins where both set a key) and install()'s options
// on top; at run time, _set_allocator_settings changes them as it does
// torch's. Keys only torch's allocator has are named in a warning rather
// than dropped in silence.
allocator_config::torch_settings allocator_config::split_torch_settings(const std::string& text) {
  torch_settings out;
  for (const auto& [key, value] : split_entries(text)) {
    const bool shared = std::any_of(std::begin(k_torch_shared_keys), std::end(k_torch_shared_keys),
                                    [key = key](const char* k) { return key == k; });
    if (shared) {
      const std::string entry = std::string(key) + ":" + std::string(value);
      out.shared += (out.shared.empty() ? "" : ",") + entry;
      out.applied += (out.applied.empty() ? "" : ",") + entry;
      // torch's expandable segments cover its private pools too (Note
      // [private ranges]).
      if (key == "expandable_segments") out.applied += ",expandable_private_pools:" + std::string(value);
    } else if (key.rfind("pinned_", 0) != 0 && key != "per_process_memory_fraction") {
      out.ignored.emplace_back(key);
    }
  }
  return out;
}

std::string allocator_config::to_string() const {
  std::string text;
  for (const key_handler& h : k_handlers) {
    if (!text.empty()) text += ',';
    text += h.key;
    text += ':';
    text += render_key(h, *this);
  }
  return text;
}

}  // namespace streamalloc
