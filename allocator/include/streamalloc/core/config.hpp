// allocator_config: every tunable of the caching allocator, parsed once from
// STREAMALLOC_CONF (PyTorch's `key:value,key:value` syntax) into a value
// object that is passed to constructors. Defaults are PyTorch's constants.
#pragma once

#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "streamalloc/util/bytes.hpp"

namespace streamalloc {

struct allocator_config {
  // Requests are rounded up to a multiple of this (and never below it).
  std::size_t min_block_bytes = 512;
  // Requests up to this size are served from the small pool; 0 (auto)
  // means small_request_bytes_for() picks by the kind of segments.
  std::size_t small_request_bytes = 0;
  // Segment size for the small pool: many small blocks share one segment.
  std::size_t small_segment_bytes = 2_MiB;
  // Large requests below min_large_alloc_bytes share segments of this size.
  std::size_t large_segment_bytes = 20_MiB;
  std::size_t min_large_alloc_bytes = 10_MiB;
  // Larger segments are rounded up to a multiple of this.
  std::size_t large_round_bytes = 2_MiB;
  // Blocks larger than this are never split ("oversize"); max = no limit.
  std::size_t max_split_bytes = std::numeric_limits<std::size_t>::max();
  // An oversize cached block is reused for a request at most this much smaller.
  std::size_t max_non_split_rounding_bytes = 20_MiB;
  // Round requests to 1/N power-of-two steps above min (0 = off), as torch.
  unsigned roundup_power2_divisions = 0;
  // torch's list form of roundup_power2_divisions ("[256:1,512:2,>:8]"):
  // k_roundup_intervals entries, entry i for requests in [2^i, 2^(i+1)) MiB
  // (the first also below 1 MiB, the last also beyond). Empty: every
  // request uses roundup_power2_divisions.
  std::vector<unsigned> roundup_power2_intervals;
  static constexpr std::size_t k_roundup_intervals = 16;
  // The divisions that apply to a request of `bytes`.
  unsigned roundup_divisions_for(std::size_t bytes) const;
  // Note [cross-stream reuse]: hand a free block cached for stream A to
  // stream B by making B wait on A's event, instead of growing (unless the
  // block ping-pongs: Note [ping-pong hand-offs]).
  bool cross_stream_reuse = true;
  // Note [capture reuse]: a block freed during a CUDA graph capture while
  // other captured streams use it returns to its pool once the graph orders
  // those uses before new work on its stream (torch's key of the same name).
  bool graph_capture_record_stream_reuse = false;
  // Cap on reserved bytes as a fraction of device memory (1.0 = no cap).
  double memory_fraction = 1.0;
  // Free cached memory when reserved exceeds this fraction of the cap before
  // growing (0 = off), as torch's garbage_collection_threshold.
  double garbage_collection_threshold = 0.0;
  // Note [expandable segments]: the default pool grows by mapping physical
  // chunks at the end of reserved address ranges (when the backend supports
  // virtual memory) instead of allocating separate segments.
  bool expandable_segments = true;
  // Note [private ranges]: with expandable segments on, private pools (CUDA
  // graphs, MemPool) grow expandable ranges too, as torch's do under its
  // expandable_segments:True, which sets this key as well. Off by default:
  // their layouts are torch's default ones.
  bool expandable_private_pools = false;
  // Note [stitching]: when no mapped free block fits, idle chunks are moved
  // out of free holes to where the request goes instead of creating more.
  bool stitching = true;
  // Growth that keeps reserved memory within this fraction above the peak
  // of allocated memory maps new chunks; only beyond it does stitching move
  // idle chunks (which costs stream synchronizations and remapping).
  double stitch_slack = 0.005;
  // Size of the physical chunks expandable segments map; a multiple of the
  // device's virtual-memory granularity.
  std::size_t vmm_chunk_bytes = 2_MiB;
  // Note [arenas] (device_allocator.cpp): the most arenas a device's
  // allocator makes for threads that contend for its lock.
  static constexpr std::size_t k_max_arenas = 4;
  std::size_t arenas = k_max_arenas;

  // The small-pool limit in force for a pool made of expandable or of plain
  // segments. Auto: PyTorch's 1 MiB for plain segments; with expandable
  // segments, k_expandable_small_request_bytes (or min_block_bytes if that is
  // larger), so that mid-size blocks go to the large pool, where they fill
  // the partly used chunks at the ends of mapped runs (Note [stitching]);
  // the default pool's exceptions: Note [mid-size requests].
  std::size_t small_request_bytes_for(bool expandable) const;
  static constexpr std::size_t k_plain_small_request_bytes = 1_MiB;
  static constexpr std::size_t k_expandable_small_request_bytes = 384_KiB;

  // Parses `text`; throws config_error naming the key and listing valid keys.
  // Keys not mentioned keep the defaults above. A key may appear once.
  static allocator_config parse(const std::string& text);
  // Parses the STREAMALLOC_CONF environment variable (empty when unset)
  // on top of `beneath` (`key:value,...`; torch's shared settings at
  // installation, Note [torch's settings] in config.cpp).
  static allocator_config from_environment(const std::string& beneath = std::string());
  // Applies `key:value` pairs on top of this config (same rules as parse).
  allocator_config with(const std::string& text) const;

  // Throws config_error if a field is out of range or fields disagree
  // (for configs built in code; parse() and with() already check).
  void validate() const;

  // Throws usage_error naming the first field that `next` changes and that
  // cannot change while memory is live (caching_allocator::update_config).
  // Only max_split_bytes, max_non_split_rounding_bytes, the roundup
  // divisions, garbage_collection_threshold, expandable_segments and
  // expandable_private_pools can.
  void check_run_time_update(const allocator_config& next) const;

  // The valid keys with a one-line description each (README and errors).
  struct key_doc {
    const char* key;
    const char* description;
  };
  static const std::vector<key_doc>& keys();

  // Renders the config back in STREAMALLOC_CONF syntax (every key).
  std::string to_string() const;

  // torch's allocator settings (PYTORCH_ALLOC_CONF or
  // PYTORCH_CUDA_ALLOC_CONF, torch.cuda.memory._set_allocator_settings) as
  // streamalloc takes them (Note [torch's settings] in config.cpp).
  // `shared`: the entries whose keys mean the same here
  // (k_torch_shared_keys), in this syntax. `ignored`: torch's other
  // device-allocator keys, by name, for a warning. Neither: pinned_* keys
  // (torch's pinned host allocator stays torch's) and
  // per_process_memory_fraction (applied as each device's memory fraction
  // when its allocator is created). Throws config_error for malformed text.
  // `applied`: what `shared` sets here, in this syntax: its entries, and
  // expandable_private_pools beside torch's expandable_segments (Note
  // [private ranges]).
  struct torch_settings {
    std::string shared;
    std::string applied;
    std::vector<std::string> ignored;
  };
  static torch_settings split_torch_settings(const std::string& text);
  static constexpr const char* k_torch_shared_keys[] = {"max_split_size_mb",
                                                        "max_non_split_rounding_mb",
                                                        "roundup_power2_divisions",
                                                        "garbage_collection_threshold",
                                                        "expandable_segments",
                                                        "graph_capture_record_stream_reuse"};
};

}  // namespace streamalloc
