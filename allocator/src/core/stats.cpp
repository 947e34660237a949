// Flattening of device_stats into torch.cuda.memory_stats()'s key names.
#include "streamalloc/core/stats.hpp"

namespace streamalloc {
namespace {

const char* const k_stat_type_names[k_stat_type_count] = {"all", "small_pool", "large_pool"};

void put_counter(std::map<std::string, double>& out, const std::string& prefix, const stat_counter& c) {
  out[prefix + ".current"] = static_cast<double>(c.current);
  out[prefix + ".peak"] = static_cast<double>(c.peak);
  out[prefix + ".allocated"] = static_cast<double>(c.allocated);
  out[prefix + ".freed"] = static_cast<double>(c.freed);
}

void put_array(std::map<std::string, double>& out, const char* name, const stat_array& array) {
  for (int i = 0; i < k_stat_type_count; ++i) {
    put_counter(out, std::string(name) + "." + k_stat_type_names[i], array[i]);
  }
}

}  // namespace

std::map<std::string, double> device_stats::to_map() const {
  std::map<std::string, double> out;
  put_array(out, "allocation", allocation);
  put_array(out, "segment", segment);
  put_array(out, "active", active);
  put_array(out, "inactive_split", inactive_split);
  put_array(out, "allocated_bytes", allocated_bytes);
  put_array(out, "reserved_bytes", reserved_bytes);
  put_array(out, "active_bytes", active_bytes);
  put_array(out, "inactive_split_bytes", inactive_split_bytes);
  put_array(out, "requested_bytes", requested_bytes);
  put_counter(out, "oversize_allocations", oversize_allocations);
  put_counter(out, "oversize_segments", oversize_segments);
  out["num_alloc_retries"] = static_cast<double>(num_alloc_retries);
  out["num_ooms"] = static_cast<double>(num_ooms);
  out["num_sync_all_streams"] = static_cast<double>(num_sync_all_streams);
  out["num_device_alloc"] = static_cast<double>(num_device_alloc);
  out["num_device_free"] = static_cast<double>(num_device_free);
  out["num_cross_stream_reuses"] = static_cast<double>(num_cross_stream_reuses);
  out["num_recent_reuses"] = static_cast<double>(num_recent_reuses);
  out["num_combined_calls"] = static_cast<double>(num_combined_calls);
  out["max_split_size"] = static_cast<double>(max_split_size);
  put_counter(out, "vmm.mapped_chunks", mapped_chunks);
  out["vmm.num_chunk_maps"] = static_cast<double>(num_chunk_maps);
  out["vmm.num_chunk_unmaps"] = static_cast<double>(num_chunk_unmaps);
  out["vmm.num_stitched_blocks"] = static_cast<double>(num_stitched_blocks);
  out["vmm.num_stitch_syncs"] = static_cast<double>(num_stitch_syncs);
  out["fragmentation.largest_free_block_bytes"] = static_cast<double>(largest_free_block_bytes);
  out["fragmentation.free_cached_bytes"] = static_cast<double>(free_cached_bytes);
  out["fragmentation.external"] = external_fragmentation;
  out["fragmentation.reserved_allocated_ratio"] = reserved_allocated_ratio;
  return out;
}

}  // namespace streamalloc
