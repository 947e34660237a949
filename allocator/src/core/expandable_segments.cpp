// Expandable segments and stitching: the default pool's memory lives in
// large reserved address ranges whose chunks are mapped one at a time, so a
// growing workload extends what it has instead of stranding half-used
// segments, and idle chunks can be moved to where a request needs them.
//
// Note [expandable segments]: a range is reserved (address space only) the
// size of the device; its blocks tile it and are either mapped or unmapped.
// Unmapped blocks are free, chunk-aligned, coalesced with each other, and
// kept in the pool's unmapped set. A request that no mapped free block
// serves maps chunks at the front of an unmapped block, extending backwards
// over the requesting stream's free mapped block just before it (the tail
// of the last chunk mapped), so consecutive growth packs without rounding
// waste. Reserved memory is the mapped chunks; the "segment" stat and the
// snapshot count each contiguous mapped run as one segment.
//
// Note [stitching]: when growth would take reserved memory more than
// stitch_slack above the peak of allocated memory, idle chunks (wholly
// inside free mapped memory: the holes of fragmentation; Note [free runs])
// are unmapped and mapped where the request goes instead of creating new
// ones, so reserved memory stays near the live bytes. Unmapping memory a
// queued kernel may still touch would fault, so the streams of the donor
// blocks are synchronized first (one event each). Only the slow path
// stitches; the result is an ordinary cached block. A stitch that keeps
// coming back in a loop grows instead (Note [stitch cycles]). Chunks go
// back to the device on empty_cache and under memory pressure, after a device
// synchronization. Each mapped run ends in a partly used chunk beside an
// unmapped stretch; no large request fits there, so the large pool of
// expandable segments also takes mid-size requests (above 384 KiB by
// default) to fill them, instead of the small pool growing
// (allocator_config::small_request_bytes_for; the exceptions: Note
// [mid-size requests] in caching_allocator.cpp).
//
// Note [free runs]: stitching takes idle chunks from runs of address-
// adjacent free blocks, not from single blocks. Free neighbours of two
// streams do not coalesce, so with several streams a wholly free chunk is
// often cut between two blocks (a piece of stream A ending where one of
// stream B begins), and no single block holds it: it would stay mapped
// and useless while the range grows. The streams of every block of the run
// are synchronized before its chunks move, as for any donor; the pieces
// left on either side of the hole keep the streams they had. On the
// simulated device this took fsdp2_streams4 from 1.1034 to 1.0291,
// fsdp2_streams2 from 1.0731 to 1.0687, offload_activations from 1.0200
// to 1.0080 and inference_server from 1.0083 to 1.0065; single-stream
// traces are unchanged (their free neighbours always coalesce).
//
// Note [beside the hole]: the free runs touching the unmapped block a
// request maps into (its target) give their idle chunks too, all but the
// chunk touching the target: an unmapped piece beside it would merge into
// it. The prefix the request takes whole keeps every chunk; the free block
// after the target, when the target is mapped whole and the request joins
// the front of that block (placement::after_bytes), gives the idle chunks
// past the part the request takes. Before, both neighbours were kept
// whole, and on bert_serve two stitches found only part of what they
// needed while idle chunks sat in the free blocks beside the hole; then
// the block after stayed whole, and a BERT server with more responses in
// flight than the corpus's (seed 1, 8 in flight) grew by 36 MiB at its
// peak while 22 idle chunks sat in that block: 1.1123, now 1.0230.
//
// Note [the hole's end]: a request that cannot continue a free block of its
// stream before the hole (no such block) may instead end in the free block
// of its stream after the hole: the chunks go at the hole's end, the
// request runs on into that block, and the hole's front stays unmapped.
// It is taken when that maps fewer chunks than the hole's front would --
// the block after is then usually the free head of a partly used chunk (a
// run whose first block was freed, or the piece a stitch left beside the
// hole), which the request fills instead of leaving it stranded. A request
// that can continue the run before the hole always does: ending in the run
// after would leave that run's ragged tail free and cut the hole in two.
// On the simulated device, corpus and twelve traces outside it:
// hf_generate_dynamic_long 1.0479 -> 1.0394, fsdp2_streams4 1.0253 ->
// 1.0228, fsdp2_streams4_long 1.0221 -> 1.0210, a ResNet-50 capture with
// another seed 1.0147 -> 1.0063, fsdp2_streams2_deep 1.0177 -> 1.0193,
// hf_llama_train_varlen_ckpt 1.0053 -> 1.0061, the rest within 0.0002.
// Allowed beside a continuable run too, it made eleven traces worse
// (bert_serve_inflight8 1.0230 -> 1.0271, hf_generate_dynamic 1.0292 ->
// 1.0363, fsdp2_streams4 1.0253 -> 1.0291).
//
// Note [stranded bytes]: which free runs give their chunks first. A run
// whose chunks all go leaves behind the free bytes it had in the chunks
// at its ends, where a block in use sits on the other side: free bytes in
// partly used chunks, which no stitch can take and only a request small
// enough to fit there can use -- the excess of reserved over allocated
// memory at the peak of most traces above the target. A run that ends
// beside unmapped address space, or on a chunk boundary, leaves none. So
// the runs that strand the fewest bytes go first, and among equals the
// small holes (the order before). On the simulated device, the corpus:
// traces above 1.02 13 -> 9 (fsdp2_streams2 1.0203 -> 1.0159,
// fsdp2_streams4 1.0228 -> 1.0178, fsdp2_streams4_long 1.0210 -> 1.0163,
// hf_generate_dynamic 1.0292 -> 1.0152, hf_generate_dynamic_long 1.0394 ->
// 1.0309, sampled_generate 1.0443 -> 1.0387), worst 1.0466 -> 1.0446,
// median 1.0071 -> 1.0073; worse: inference_server 1.0101 -> 1.0156,
// bert_serve_inflight8 1.0230 -> 1.0271, chunked_prefill_serve 1.0209 ->
// 1.0255, hf_generate_static 1.0412 -> 1.0446. With every request size
// scaled by 0.5 to 3.0 (scripts/scale_traces.py; 465 replays with the
// corpus), traces above 1.02 101 -> 92, the mean excess over 1.0 0.01332
// -> 0.01280, the worst 1.0987 -> 1.1049 (x0.5). Counted per idle chunk
// the run gives, stranded bytes did worse (12 traces above 1.02; 101 over
// those replays), and only whether a run strands any worse still (15).
// Taking a run's ends first makes the runs drift through their range
// (Note [address space]).
//
// Note [private ranges]: with expandable_private_pools (torch's
// expandable_segments:True sets it; off by default), a private pool without
// a segment source of its own or no_split grows expandable ranges too, as
// torch's allocator does under that setting: one range per pool, stream and
// small/large kind, the size of the device, mapped by torch's segment sizes
// (2 MiB small, 20 MiB large: a 32 MiB request after 20 free MiB maps 20
// more, as torch does), never stitched, since its graphs replay into its
// memory. Its chunks stay mapped while the pool is in use; once released,
// empty_cache unmaps its idle chunks and gives back ranges with nothing
// mapped. A checkpoint records which blocks were mapped; restoring it after
// the range grew leaves the chunks mapped since as free blocks of the
// range's stream. A range the driver refuses falls back to plain segments.
// Off by default because torch's default private pools are plain, and graph
// trees and torch's tests read their layouts (segment counts and sizes).
//
// Note [stitch cycles]: a stitch synchronizes streams (the host waits for
// the donors' queued work), so a workload that stitches again every
// iteration pays that every iteration: each stitch can leave holes that
// the next iteration's blocks no longer fit around, so the stitches undo
// each other. (On the H200, before mid-size requests went to the large
// pool, a fixed-batch ResNet-50 loop made 157 stitches and stream syncs in
// 25 steps, +12% step time.) Growing breaks such a cycle: the grown chunks
// are in place when the loop comes back. What is measured: a stitch is
// keyed by its request size and the level of allocated memory it serves
// (allocated bytes plus the request), which a loop reproduces exactly at
// the same point of every iteration; consecutive stitches with the same
// key are one run. A key may make two runs; at the third it grows instead,
// if the runs come a loop's period apart (below).
// - A loop's recurrences are whole iterations apart, so the allocations
//   between the starts of a key's runs are multiples of one period: the
//   third run grows only when its distance from the second is a whole
//   number of the distance between the first two, or that one a whole
//   number of it (a fixed-batch ResNet-50 loop: 765 allocations, then
//   765 or 1530). A key that comes back at other distances is a shape
//   drawn again, not a cycle, and it stitches on (within
//   k_stitches_per_key): multi-scale ConvNeXt training grew 72 MiB at its
//   peak for a key whose runs were 7943 and then 2649 allocations apart
//   (1.0231; stitching on, five stitches more in 20 steps: 1.0068).
// - One recurrence is allowed because it happens without a cycle: a
//   batch size drawn again after other shapes changed the layout
//   (fsdp2_streams2/4, vit_b16_train_varbatch and inference_server each
//   have a few stitches that recur once, none twice). Refusing the first
//   recurrence grew vit_b16_train_varbatch from 1.0071 to 1.0341 and
//   fsdp2_streams4 from 1.0291 to 1.0304. A second recurrence after other
//   stitches in between, a period after the first, is a cycle.
// - A run is not counted per stitch: the same stitch repeated with no
//   other in between comes from the workload's own frees, not from other
//   stitches moving chunks -- bert_serve's 12 encoder layers each allocate
//   the same attention block at the same level and find the last layer's
//   block taken by smaller requests. It stitches in bursts of about 12
//   (one per layer), each burst for a new request size, with long
//   stretches of requests between the bursts that stitch nothing.
//   Counting those one by one (the old rule: 16 stitches at levels no
//   higher than the last stitch's, then growth) spent the allowance below
//   the peak and left bert_serve at 1.1855 with idle chunks cached.
// - Growth ends a cycle only if its chunks are still in place when the
//   loop comes back. A key that comes back to stitch after the growth it
//   was refused found them taken (a BERT server's small requests stitch
//   single chunks out of the hole its attention block left, and the block
//   then needs a hole elsewhere), so growing again would only raise
//   reserved memory once more: it stitches, within k_stitches_per_key.
//   With every request size of the corpus scaled (scripts/scale_traces.py),
//   growth repeated at bert_serve's peak: x0.5 1.1770 -> 1.0865, x1.1
//   1.1883 -> 1.1318, bert_serve_inflight8 x1.25 1.1204 -> 1.0815; the
//   corpus itself is unchanged.
// - Growth breaks a cycle only while it is cheap: the growth of every
//   refused stitch together (since the history began) stays within
//   k_cycle_growth_share (2%, the project's target) of the allocation
//   peak; past that the stitch goes ahead, within k_stitches_per_key. A
//   refusal's growth is the whole request's chunks, and on a serving
//   workload that is a large share of the peak: bert_serve with every
//   request size scaled by 1.1 refused a 181 MiB stitch near its peak
//   and mapped 90 MiB anew; at the reserved peak that followed, 134 MiB
//   of idle chunks sat cached (1.1318, now 1.0160). Over the corpus
//   scaled by 0.5 to 3.0 (scripts/scale_traces.py) no trace got worse by
//   more than 0.006 and ten better (bert_serve x2.0 1.0582 -> 1.0115,
//   x0.5 1.0865 -> 1.0412); the corpus is unchanged. A share of 1% made
//   resnet50_fixed_batch with small_size_kb:1024 stitch its loop 149
//   times (1.0306) where 2% keeps 31 (1.0221), as without the share.
// - What it bounds: at most two runs per stitch point of a loop, after
//   which the loop's steady state needs no stitch at that point; and at
//   most k_stitches_per_key (64) stitches per key in all, so a loop whose
//   only stitch is always the same one (one run that never ends) pays 64
//   stream synchronizations, not one per iteration, before it grows. The
//   corpus's most per key is 11 (bert_serve; inference_server 10). What it
//   does not bound: a cycle whose levels drift from one iteration to the
//   next is not recognized.
// On the simulated device with the defaults no corpus trace reaches a
// third run a loop's period after its second; two reach one at other
// distances and stitch on: convnext_train_varsize (above) and
// fsdp2_streams2_deep (1.0193 when those grew, 1.0161). With the old
// small-pool limit (small_size_kb:1024) resnet50_fixed_batch stitches its
// loop every step: unbounded 176 stitches and ratio 1.0267, with the old
// budget 32 and 1.0228, with this rule 31 and 1.0221 (the same with the
// period test, as its runs are 765 allocations apart or multiples).
//
// Note [stitching under contention]: a stitch moves its chunks under the
// allocator's lock, and the driver prices that by the byte: 35-50 us per
// 2 MiB chunk (cuMemUnmap on one side, cuMemMap and cuMemSetAccess on the
// other; bench/RESULTS.md, seventeenth session). One thread allocating
// pays that itself, for memory it would otherwise keep reserved. With
// other threads waiting for the lock (calls listed for its holder, or the
// holder running one), every one of them pays it too, and threads on
// streams of their own trade chunks back and forth: on the H200, 16 such
// threads stitched thousands of chunks a run and held the lock for 30-75%
// of it. So while others wait, growth that stitching would replace maps
// new chunks instead, within the memory-fraction cap, and stitches only
// what the device cannot give; reserved memory may then rise above the
// peak of allocated memory where threads allocate at once. One thread at
// a time never sees a call waiting, so it stitches exactly as before
// (a trace replay, one thread, takes the same path as without the rule).
//
// Note [address space]: a range reserves eight times the device's memory
// of address space (k_address_space_per_device_memory), which costs no
// memory. Sized like the device, as it first was, a range left a program
// that uses most of the device little room between its mapped runs: a
// request found no hole long enough beside the run it would extend, so
// placement went elsewhere, and a workload near the device's size grew
// where the same workload on a larger device stitched. Replayed on the
// simulated device with its capacity at 1.06 times each trace's peak of
// live bytes, the corpus's median was 1.0078 and compile_train reserved
// 1.0579 times its peak (1.0042 on a roomy device); at 1.045 times,
// sampled_generate ran out of memory. Four times was enough until
// stitching took the donors that strand the fewest bytes first (Note
// [stranded bytes]): those are the ends of mapped runs, so the holes grow
// at the runs' ends and the runs drift through the range, and bert_serve
// reached the end of a range four times a device of 1.045, 1.06 and 1.10
// times its peak (1.0214, 1.0186, 1.0186 against 1.0157 on a roomy
// device). With eight times every corpus trace at 1.045, 1.06, 1.10 and
// 1.25 replays at its roomy ratio and none runs out; twice was not enough
// even before (fsdp2_streams4 1.0253 at 1.06 where four times gave
// 1.0228). A driver that refuses that much address space gets ranges the
// size of the device.
//
// Note [expandable segments switched off]: update_config may switch
// expandable segments off (and on) while memory is live, as torch's
// _set_allocator_settings("expandable_segments:False") does. Existing
// ranges keep their kind: their blocks are freed and their chunks released
// (empty_cache, the OOM ladder) as before, but while the setting is off no
// new request is served from them and nothing new is mapped, so every new
// allocation is plain device memory -- torch's rule, which users rely on to
// share tensors between processes through cudaIpcGetMemHandle.
//
// Trace events: a run of chunks mapped for one request is one segment_map
// event; the chunks unmapped out of one free block (a stitch donor, or idle
// memory going back to the device) are one segment_unmap event.
#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "streamalloc/core/block_list.hpp"
#include "streamalloc/core/caching_allocator.hpp"
#include "streamalloc/util/errors.hpp"

namespace streamalloc {
namespace {

// Note [stitch cycles]: the separate runs a stitch may make; the next one
// grows instead when it comes a loop's period after the last.
constexpr int k_stitch_cycle_runs = 2;
// Stitches remembered for Note [stitch cycles] before the history starts
// over (a bound on memory, not a tuning knob: each entry costs a stitch).
constexpr std::size_t k_stitch_history = 4096;

std::size_t chunks_for(std::size_t bytes, std::size_t chunk) { return bytes / chunk + (bytes % chunk != 0 ? 1 : 0); }

}  // namespace

void caching_allocator::init_expandable_locked() {
  if (chunk_bytes_ != 0) return;  // ranges keep the chunk size they were made with
  const std::size_t granularity = backend_.vm_granularity();
  if (granularity == 0 || config_.vmm_chunk_bytes % granularity != 0) {
    throw config_error("STREAMALLOC_CONF: vmm_chunk_mb (" + std::to_string(config_.vmm_chunk_bytes) +
                       " bytes) must be a multiple of device " + std::to_string(backend_.device_index()) +
                       "'s virtual-memory granularity (" + std::to_string(granularity) + " bytes)");
  }
  chunk_bytes_ = config_.vmm_chunk_bytes;
  // Note [address space]
  const std::size_t device_sized = device_range_bytes();
  range_bytes_ = device_sized <= std::numeric_limits<std::size_t>::max() / k_address_space_per_device_memory
                     ? device_sized * k_address_space_per_device_memory
                     : device_sized;
}

std::size_t caching_allocator::device_range_bytes() const {
  std::size_t bytes = 0;
  return round_up_checked(std::max(device_total_bytes_, chunk_bytes_), chunk_bytes_, &bytes) ? bytes : chunk_bytes_;
}

bool caching_allocator::uses_expandable(pool_id pool) const {
  if (!expandable_) return false;
  if (pool == 0) return true;
  // Note [private ranges]
  if (!config_.expandable_private_pools) return false;
  const auto it = private_pools_.find(pool);
  return it != private_pools_.end() && it->second.source == nullptr && !it->second.no_split;
}

const free_block_index& caching_allocator::unmapped_set_locked(pool_id pool, bool small) const {
  const pool_pair& sets = pool == 0 ? unmapped_ : private_pools_.find(pool)->second.unmapped;
  return small ? sets.small : sets.large;
}

free_block_index& caching_allocator::unmapped_set_locked(pool_id pool, bool small) {
  return const_cast<free_block_index&>(std::as_const(*this).unmapped_set_locked(pool, small));
}

block* caching_allocator::grow_expandable_locked(std::size_t rounded, stream_handle stream, pool_id pool, bool small,
                                                 bool may_stitch) {
  // Beyond the cap nothing can serve it (and chunk arithmetic stays far
  // from overflow).
  if (rounded > allowed_bytes_) return nullptr;
  const free_block_index& unmapped = unmapped_set_locked(pool, small);
  placement where = place_locked(unmapped, rounded, stream, pool);
  if (where.target == nullptr) {
    if (reserve_range_locked(rounded, stream, pool, small) == nullptr) {
      // Note [private ranges]: address space refused, plain segments serve.
      return pool != 0 ? grow_locked(rounded, stream, pool, small) : nullptr;
    }
    where = place_locked(unmapped, rounded, stream, pool);
    if (where.target == nullptr) return nullptr;
  }

  std::vector<physical_handle> handles;
  handles.reserve(where.chunks);
  std::size_t stolen = 0;
  // A private pool's chunks stay where its graphs replay into them.
  const bool stitch = pool == 0 && may_stitch && stitching_wanted_locked(where.chunks, rounded) &&
                      stitch_cycle_allows_locked(where.chunks, rounded);
  // Note [stitching under contention]: with other threads waiting, new
  // chunks first; stitching only for what the device cannot give.
  const bool stitch_last = stitch && others_waiting_locked();
  if (stitch && !stitch_last) {
    stolen = steal_idle_chunks_locked(where.chunks, where, &handles);
    if (stolen > 0) count_stitch_locked(rounded);
  }

  // New chunks for the rest, within the memory-fraction cap (which counts
  // the stolen chunks too: they are about to be mapped again).
  const std::size_t reserved = capped_reserved_locked() + stolen * chunk_bytes_;
  std::size_t created_bytes = 0;
  while (handles.size() < where.chunks) {
    if (reserved + created_bytes > allowed_bytes_ || allowed_bytes_ - reserved - created_bytes < chunk_bytes_) break;
    physical_handle chunk = 0;
    const status st = backend_.vm_create(chunk_bytes_, &chunk);
    if (!st) {
      if (st.code() == status_code::out_of_memory) break;
      destroy_chunks_locked(handles);
      throw device_failure("streamalloc: device " + std::to_string(backend_.device_index()) +
                           " failed to create a memory chunk: " + st.message());
    }
    ++stats_.num_device_alloc;
    handles.push_back(chunk);
    created_bytes += chunk_bytes_;
  }
  if (stitch_last && handles.size() < where.chunks) {
    const std::size_t created = handles.size();
    stolen = steal_idle_chunks_locked(where.chunks - created, where, &handles);
    if (stolen > 0) {
      count_stitch_locked(rounded);
      // The range marks the first `stolen` handles stitched.
      std::rotate(handles.begin(), handles.begin() + static_cast<std::ptrdiff_t>(created), handles.end());
    }
  }
  if (handles.size() < where.chunks) {
    // Chunks already unmapped from holes go back to the device: the ladder's
    // next stage frees memory anyway.
    destroy_chunks_locked(handles);
    return nullptr;
  }
  if (const status st = map_chunks_locked(where, handles, stolen); !st) {
    destroy_chunks_locked(handles);
    if (st.code() == status_code::out_of_memory) return nullptr;
    throw device_failure("streamalloc: device " + std::to_string(backend_.device_index()) +
                         " failed to map a memory chunk: " + st.message());
  }
  if (stolen > 0) ++stats_.num_stitched_blocks;
  record_trace_locked(trace_action::segment_map, where.map_address(chunk_bytes_), where.chunks * chunk_bytes_, stream,
                      pool);
  return take_mapped_front_locked(where, stream);
}

bool caching_allocator::stitching_wanted_locked(std::size_t chunks, std::size_t rounded) const {
  if (!config_.stitching) return false;
  // The ratio that matters is peak reserved over peak allocated: growth
  // that keeps reserved within the slack of the allocation peak costs
  // nothing there, so only growth beyond it is replaced by stitching.
  const double after = static_cast<double>(at(stats_.reserved_bytes, stat_type::all).current) + static_cast<double>(chunks * chunk_bytes_);
  return after > (1.0 + config_.stitch_slack) * allocation_peak_with_locked(rounded);
}

double caching_allocator::allocation_peak_with_locked(std::size_t rounded) const {
  const std::int64_t level = at(stats_.allocated_bytes, stat_type::all).current + static_cast<std::int64_t>(rounded);
  return static_cast<double>(std::max(at(stats_.allocated_bytes, stat_type::all).peak, level));
}

bool caching_allocator::stitch_cycle_allows_locked(std::size_t chunks, std::size_t rounded) {
  // Note [stitch cycles]: a stitch that keeps coming back after other
  // stitches grows instead, once, while the cycles' growth stays within
  // its share of the allocation peak; that growth ends the run of the last
  // stitch.
  const std::pair<std::int64_t, std::size_t> key = stitch_key_locked(rounded);
  const auto it = stitch_runs_.find(key);
  if (it == stitch_runs_.end()) return true;
  stitch_count& count = it->second;
  const std::size_t growth = chunks * chunk_bytes_;
  const bool affordable = static_cast<double>(cycle_grown_bytes_ + growth) <=
                          k_cycle_growth_share * allocation_peak_with_locked(rounded);
  if (count.stitches < k_stitches_per_key && (key == last_stitch_ || count.runs < k_stitch_cycle_runs || count.grew ||
                                               !affordable || !recurs_periodically_locked(count))) {
    return true;
  }
  count.grew = true;
  cycle_grown_bytes_ += growth;
  last_stitch_ = {-1, 0};
  return false;
}

bool caching_allocator::recurs_periodically_locked(const stitch_count& count) const {
  const std::uint64_t gap = allocation_clock_ - count.last_run_at;
  if (gap == 0 || count.last_gap == 0) return false;
  return gap % count.last_gap == 0 || count.last_gap % gap == 0;
}

std::pair<std::int64_t, std::size_t> caching_allocator::stitch_key_locked(std::size_t rounded) const {
  return {at(stats_.allocated_bytes, stat_type::all).current + static_cast<std::int64_t>(rounded), rounded};
}

void caching_allocator::count_stitch_locked(std::size_t rounded) {
  const std::pair<std::int64_t, std::size_t> key = stitch_key_locked(rounded);
  if (key == last_stitch_) {  // the same run
    ++stitch_runs_[key].stitches;
    return;
  }
  // The history is forgotten rather than allowed to grow without bound.
  if (stitch_runs_.size() >= k_stitch_history) {
    stitch_runs_.clear();
    cycle_grown_bytes_ = 0;
  }
  stitch_count& count = stitch_runs_[key];
  ++count.runs;
  if (count.runs > 1) count.last_gap = allocation_clock_ - count.last_run_at;
  count.last_run_at = allocation_clock_;
  ++count.stitches;
  last_stitch_ = key;
}

caching_allocator::placement caching_allocator::place_locked(const free_block_index& unmapped, std::size_t rounded,
                                                             stream_handle stream, pool_id pool) const {
  placement best;
  // The fewest new chunks wins, then the first block in the set's
  // (stream, size, address) order. A hole mapped whole also joins the free
  // block of the stream after it, so mapping it can reunite free space
  // that stitching cut apart; a hole's end may join it too (Note [the
  // hole's end]). The set holds every hole stitching cut, so it is visited
  // unsorted.
  const auto set_order = [](const block* a, const block* b) {
    return tree_order{}(tree_entry{a->stream, a->size, a->address, nullptr},
                        tree_entry{b->stream, b->size, b->address, nullptr});
  };
  unmapped.for_each_unordered([&](block* target) {
    // Note [private ranges]: a private pool's ranges belong to one stream each.
    if (pool != 0 && target->owner->stream != stream) return;
    block* before = target->prev;
    block* after = target->next;
    const auto stream_free = [stream](const block* b) {
      return b != nullptr && b->is_free_mapped() && b->stream == stream;
    };
    const bool extend = stream_free(before) && before->size < rounded;
    const std::size_t missing = rounded - (extend ? before->size : 0);
    std::size_t chunks = chunks_for(missing, chunk_bytes_);
    if (pool != 0) {
      // Note [private ranges]: growth by whole segment sizes, as torch's.
      const segment* s = target->owner;
      const std::size_t unit = chunks_for(s->is_small ? config_.small_segment_bytes : config_.large_segment_bytes,
                                          chunk_bytes_);
      chunks = std::max(chunks, std::min((chunks + unit - 1) / unit * unit, target->size / chunk_bytes_));
    }
    if (chunks * chunk_bytes_ > target->size) {
      const bool joins = stream_free(after) && target->size + after->size >= missing;
      if (!joins) return;
      chunks = target->size / chunk_bytes_;
    }
    const auto consider = [&](const placement& candidate) {
      if (best.target == nullptr || candidate.chunks < best.chunks ||
          (candidate.chunks == best.chunks && set_order(target, best.target))) {
        best = candidate;
      }
    };
    const std::size_t mapped = chunks * chunk_bytes_;
    consider({target, extend ? before : nullptr, chunks, missing > mapped ? missing - mapped : 0, false});
    // Note [the hole's end]
    if (pool == 0 && !extend && stream_free(after) && after->size < rounded) {
      const std::size_t end_chunks = chunks_for(rounded - after->size, chunk_bytes_);
      if (end_chunks < chunks && end_chunks * chunk_bytes_ < target->size) {
        consider({target, nullptr, end_chunks, rounded - end_chunks * chunk_bytes_, true});
      }
    }
  });
  return best;
}

segment* caching_allocator::reserve_range_locked(std::size_t rounded, stream_handle stream, pool_id pool, bool small) {
  // Note [private ranges]: a private pool's ranges are the device's size.
  std::size_t bytes = pool == 0 ? range_bytes_ : device_range_bytes();
  if (rounded > bytes && !round_up_checked(rounded, chunk_bytes_, &bytes)) return nullptr;
  status st;
  std::unique_ptr<expandable_range> range = expandable_range::reserve(backend_, bytes, chunk_bytes_, peers_, &st);
  if (range == nullptr && pool == 0 && range_bytes_ > device_range_bytes()) {
    // Note [address space]: a driver that refuses that much address space,
    // for want of it or otherwise, gets ranges the size of the device from
    // now on; should that fail too, the failure is handled as before.
    range_bytes_ = device_range_bytes();
    bytes = range_bytes_;
    if (rounded > bytes && !round_up_checked(rounded, chunk_bytes_, &bytes)) return nullptr;
    range = expandable_range::reserve(backend_, bytes, chunk_bytes_, peers_, &st);
  }
  if (range == nullptr) {
    if (st.code() == status_code::out_of_memory) return nullptr;
    throw device_failure("streamalloc: device " + std::to_string(backend_.device_index()) +
                         " failed to reserve an address range: " + st.message());
  }
  auto* s = new segment;
  s->address = range->address();
  s->size = bytes;
  s->is_small = small;
  s->pool = pool;
  s->free_set = &pool_for_locked(pool, small);
  s->range = std::move(range);
  s->unmapped_set = &unmapped_set_locked(pool, small);
  if (pool != 0) {
    s->stream = stream;
    ++private_pools_.find(pool)->second.segments;
  }
  block* b = new_block_locked();
  b->address = s->address;
  b->size = bytes;
  b->owner = s;
  b->mapped = false;
  s->first = b;
  segments_.emplace(s->address, s);
  s->unmapped_set->insert(b);
  return s;
}

std::size_t caching_allocator::idle_chunks(const block* b) const {
  return idle_chunks_in(b->owner, b->address, b->address + b->size);
}

std::size_t caching_allocator::idle_chunks_in(const segment* s, std::uintptr_t from, std::uintptr_t to) const {
  // Chunk boundaries are offsets from the range's base, which is only
  // aligned to the device granularity.
  const std::size_t chunk = s->range->chunk_bytes();
  const std::uintptr_t first = (from - s->address + chunk - 1) / chunk * chunk;
  const std::uintptr_t last = (to - s->address) / chunk * chunk;
  return last > first ? (last - first) / chunk : 0;
}

std::size_t caching_allocator::steal_idle_chunks_locked(std::size_t wanted, const placement& where,
                                                        std::vector<physical_handle>* out) {
  // The prefix the request takes keeps its shape; the runs touching the
  // target keep the chunk beside it, or the front the request takes of the
  // free block after it (Note [beside the hole]).
  const block* keep = where.prefix;
  const block* after = where.after_bytes != 0 ? where.target->next : nullptr;
  const auto donor = [keep](const block* b) { return b != nullptr && b->is_free_mapped() && b != keep; };
  // Donors are runs of adjacent free blocks, whatever their streams (Note
  // [free runs]).
  struct free_run {
    block* first;
    block* last;
    std::size_t bytes;
    std::size_t idle;
    std::uintptr_t from;
    std::uintptr_t to;
    std::size_t stranded;  // Note [stranded bytes]
  };
  // Every free mapped block of a range is in the default pool's free sets
  // (recent frees went back to them before the request looked for growth),
  // so only those are visited, and each run is walked from its first block.
  std::vector<free_run> donors;
  const auto add_runs = [&](block* b) {
    // Most free blocks are runs of their own, smaller than a chunk: the
    // cheap tests go first.
    if (b == keep || donor(b->prev)) return;
    const segment* s = b->owner;
    if (!s->expandable()) return;
    block* last = b;
    while (donor(last->next)) last = last->next;
    const std::uintptr_t end = last->address + last->size;
    // A run shorter than a chunk cannot hold one; one touching the target
    // keeps the chunk that touches it (Note [beside the hole]).
    const std::size_t chunk = s->range->chunk_bytes();
    if (end - b->address < chunk) return;
    const std::uintptr_t from =
        b->address + (b == after ? where.after_bytes : b->prev == where.target ? chunk : 0);
    const std::uintptr_t to = end - (last->next == where.target ? chunk : 0);
    if (from < to && to - from >= chunk) {
      if (const std::size_t idle = idle_chunks_in(s, from, to); idle != 0) {
        // Note [stranded bytes]: the free bytes beside a block in use, in
        // the chunks at either end of the run, which no stitch can take.
        const auto live = [](const block* n) { return n != nullptr && n->mapped; };
        const std::size_t start = b->address - s->address;
        const std::size_t left = live(b->prev) ? (chunk - start % chunk) % chunk : 0;
        const std::size_t right = live(last->next) ? (end - s->address) % chunk : 0;
        donors.push_back({b, last, end - b->address, idle, from, to, left + right});
      }
    }
  };
  for (const free_block_index* set : {&default_pool_.small, &default_pool_.large}) {
    // Free blocks of one stream never touch (they coalesce), so in a set
    // of one stream every run is one block, and only blocks of a chunk or
    // more can hold one.
    set->for_each_unordered(add_runs, set->one_stream() ? chunk_bytes_ : 0);
  }
  if (donors.empty()) return 0;
  // Note [stranded bytes]: the runs that strand the fewest free bytes
  // first, then small holes: they are the fragmentation; large free blocks
  // are the ones later requests can still use whole. The order is total (no
  // two runs start at one address), so the visiting order does not matter.
  std::sort(donors.begin(), donors.end(), [](const free_run& a, const free_run& b) {
    if (a.stranded != b.stranded) return a.stranded < b.stranded;
    return a.bytes != b.bytes ? a.bytes < b.bytes : a.first->address < b.first->address;
  });
  std::size_t covered = 0;
  std::size_t used = 0;
  while (used < donors.size() && covered < wanted) covered += donors[used++].idle;
  donors.resize(used);

  // Every stream that last used a donor finishes before its chunks move.
  std::vector<stream_handle> streams;
  for (const free_run& d : donors) {
    for (const block* b = d.first;; b = b->next) {
      if (std::find(streams.begin(), streams.end(), b->stream) == streams.end()) streams.push_back(b->stream);
      if (b == d.last) break;
    }
  }
  std::vector<stream_handle> finished;
  for (stream_handle s : streams) {
    event_handle event = 0;
    if (!events_.acquire(&event)) continue;
    const bool done = backend_.record_event(event, s).ok() && backend_.synchronize_event(event).ok();
    events_.release(event);
    if (done) finished.push_back(s), ++stats_.num_stitch_syncs;
  }
  const auto all_finished = [&](const free_run& d) {
    for (const block* b = d.first;; b = b->next) {
      if (std::find(finished.begin(), finished.end(), b->stream) == finished.end()) return false;
      if (b == d.last) return true;
    }
  };

  std::size_t taken = 0;
  for (const free_run& d : donors) {
    if (taken == wanted) break;
    if (!all_finished(d)) continue;
    taken += unmap_idle_chunks_locked(d.first, d.from, d.to, wanted - taken, out);
  }
  return taken;
}

std::size_t caching_allocator::unmap_idle_chunks_locked(block* first, std::uintptr_t from, std::uintptr_t to,
                                                        std::size_t max_chunks, std::vector<physical_handle>* keep) {
  segment* s = first->owner;
  const std::size_t chunk = s->range->chunk_bytes();
  const std::uintptr_t hole_end = s->address + (to - s->address) / chunk * chunk;
  const std::size_t wanted = std::min(idle_chunks_in(s, from, to), max_chunks);
  const std::size_t done = s->range->unmap_backwards(hole_end, wanted, [&](physical_handle handle) {
    count_unmaps_locked(s, 1);
    if (keep != nullptr) {
      keep->push_back(handle);
    } else {
      destroy_chunks_locked({handle});
    }
  });
  if (done == 0) return 0;

  // Cut the run into [head][hole][tail]; head and tail stay free and
  // mapped, each with the stream of the block it was part of, so no two
  // free neighbours of one stream are left apart.
  const std::uintptr_t hole_start = hole_end - done * chunk;
  record_trace_locked(trace_action::segment_unmap, hole_start, done * chunk, first->stream, s->pool);
  block* hole = first;
  while (hole->address + hole->size <= hole_start) hole = hole->next;
  erase_free_locked(hole);
  block* head = nullptr;
  if (hole->address < hole_start) {
    head = hole;
    hole = split_at(head, hole_start - head->address, new_block_locked());
    hole->stream = head->stream;
  }
  stream_handle tail_stream = hole->stream;
  while (hole->address + hole->size < hole_end) {
    block* next = hole->next;
    erase_free_locked(next);
    tail_stream = next->stream;
    delete_block_locked(absorb_next(hole));
  }
  block* tail = nullptr;
  if (hole->address + hole->size > hole_end) {
    tail = split_at(hole, hole_end - hole->address, new_block_locked());
    tail->stream = tail_stream;
  }
  hole->mapped = false;
  hole->stream = 0;
  block* outer_left = head == nullptr ? hole->prev : nullptr;
  block* outer_right = tail == nullptr ? hole->next : nullptr;
  update_stat(stats_.segment, s, mapped_neighbours(hole->prev, hole->next) - 1);
  if (head != nullptr) insert_free_locked(head);
  if (tail != nullptr) insert_free_locked(tail);
  insert_unmapped_locked(hole);
  refresh_split_count_locked(outer_left);
  refresh_split_count_locked(outer_right);
  return done;
}

status caching_allocator::map_chunks_locked(const placement& where, const std::vector<physical_handle>& handles,
                                            std::size_t stolen) {
  // On a failure the range unmaps what it mapped; the caller destroys every
  // handle.
  segment* s = where.target->owner;
  expandable_range::map_result result;
  const status st = s->range->map(where.map_address(chunk_bytes_), handles, stolen, &result);
  count_maps_locked(s, result.mapped);
  count_unmaps_locked(s, result.undone);
  return st;
}

void caching_allocator::count_maps_locked(const segment* s, std::size_t chunks) {
  update_stat(stats_.reserved_bytes, s, static_cast<std::int64_t>(chunks * s->range->chunk_bytes()));
  stats_.mapped_chunks.increase(static_cast<std::int64_t>(chunks));
  stats_.num_chunk_maps += static_cast<std::int64_t>(chunks);
}

void caching_allocator::count_unmaps_locked(const segment* s, std::size_t chunks) {
  update_stat(stats_.reserved_bytes, s, -static_cast<std::int64_t>(chunks * s->range->chunk_bytes()));
  stats_.mapped_chunks.decrease(static_cast<std::int64_t>(chunks));
  stats_.num_chunk_unmaps += static_cast<std::int64_t>(chunks);
}

void caching_allocator::destroy_chunks_locked(const std::vector<physical_handle>& handles) {
  for (physical_handle h : handles) {
    // A chunk the device refuses to destroy is lost to this process; the
    // allocator's accounting no longer includes it either way.
    if (backend_.vm_destroy(h)) ++stats_.num_device_free;
  }
}

block* caching_allocator::take_mapped_front_locked(const placement& where, stream_handle stream) {
  block* target = where.target;
  segment* s = target->owner;
  const std::size_t bytes = where.chunks * chunk_bytes_;
  s->unmapped_set->erase(target);
  if (bytes < target->size && where.at_end) {
    block* rest = target;
    target = split_at(rest, rest->size - bytes, new_block_locked());
    s->unmapped_set->insert(rest);
  } else if (bytes < target->size) {
    block* rest = split_at(target, bytes, new_block_locked());
    rest->mapped = false;
    s->unmapped_set->insert(rest);
  }
  target->mapped = true;
  target->stream = stream;
  update_stat(stats_.segment, s, 1 - mapped_neighbours(target->prev, target->next));

  // A hole mapped whole may touch a free block of the stream after it.
  if (block* after = target->next; after != nullptr && after->is_free_mapped() && after->stream == stream) {
    erase_free_locked(after);
    delete_block_locked(absorb_next(target));
  }
  block* result = target;
  if (where.prefix != nullptr) {
    block* prefix = where.prefix;
    erase_free_locked(prefix);
    delete_block_locked(absorb_next(prefix));
    result = prefix;
  }
  refresh_split_count_locked(result->prev);
  refresh_split_count_locked(result->next);
  return result;
}

void caching_allocator::insert_unmapped_locked(block* b) {
  segment* s = b->owner;
  if (block* prev = b->prev; prev != nullptr && !prev->mapped) {
    s->unmapped_set->erase(prev);
    delete_block_locked(absorb_next(prev));
    b = prev;
  }
  if (block* next = b->next; next != nullptr && !next->mapped) {
    s->unmapped_set->erase(next);
    delete_block_locked(absorb_next(b));
  }
  s->unmapped_set->insert(b);
}

void caching_allocator::refresh_split_count_locked(block* b) {
  // A free block's inactive_split status follows its neighbours' mapping.
  if (b == nullptr || !b->is_free_mapped() || b->counted_inactive_split == b->is_split()) return;
  const auto size = static_cast<std::int64_t>(b->size);
  if (b->is_split()) {
    update_stat(stats_.inactive_split, b->owner, 1);
    update_stat(stats_.inactive_split_bytes, b->owner, size);
  } else {
    update_stat(stats_.inactive_split, b->owner, -1);
    update_stat(stats_.inactive_split_bytes, b->owner, -size);
  }
  b->counted_inactive_split = b->is_split();
}

block* caching_allocator::absorb_following_free_locked(block* b) {
  // Only after a device synchronization: then no stream can still be using
  // these blocks, so their stream tags no longer matter.
  erase_free_locked(b);
  while (b->next != nullptr && b->next->is_free_mapped()) {
    erase_free_locked(b->next);
    delete_block_locked(absorb_next(b));
  }
  insert_free_locked(b);
  return b;
}

void caching_allocator::release_idle_chunks_locked(std::optional<pool_id> only) {
  if (chunk_bytes_ == 0) return;  // expandable segments never used: no range exists
  // A pool in use keeps its chunks: its graphs replay into them.
  const auto releasable = [&](pool_id pool) { return only ? pool == *only : pool_releasable_locked(pool); };
  std::vector<const free_block_index*> sets;
  if (releasable(0)) sets = {&default_pool_.small, &default_pool_.large};
  for (const auto& [id, p] : private_pools_) {
    if (releasable(id)) sets.insert(sets.end(), {&p.free.small, &p.free.large});
  }
  const auto has_idle = [&](const block* b) { return b->owner->expandable() && idle_chunks(b) > 0; };
  const auto any_idle = [&] {
    for (const free_block_index* set : sets) {
      bool found = false;
      set->for_each([&](const block* b) { found = found || has_idle(b); }, chunk_bytes_);
      if (found) return true;
    }
    // Adjacent free blocks of different streams may share an idle chunk.
    for (const auto& [address, s] : segments_) {
      if (!s->expandable() || !releasable(s->pool)) continue;
      for (const block* b = s->first; b != nullptr; b = b->next) {
        if (b->is_free_mapped() && b->next != nullptr && b->next->is_free_mapped()) return true;
      }
    }
    return false;
  };
  if (!any_idle()) return;
  if (!backend_.synchronize_device()) return;  // no proof that the chunks are unused
  ++stats_.num_sync_all_streams;
  for (const auto& [address, s] : segments_) {
    if (!s->expandable() || !releasable(s->pool)) continue;
    for (block* b = s->first; b != nullptr; b = b->next) {
      if (b->is_free_mapped() && b->next != nullptr && b->next->is_free_mapped()) b = absorb_following_free_locked(b);
    }
  }
  std::vector<block*> donors;
  for (const free_block_index* set : sets) {
    set->for_each([&](block* b) {
      if (has_idle(b)) donors.push_back(b);
    });
  }
  for (block* d : donors) {
    unmap_idle_chunks_locked(d, d->address, d->address + d->size, std::numeric_limits<std::size_t>::max(), nullptr);
  }
}

bool caching_allocator::release_range_locked(segment* s) {
  // Only a range with nothing mapped: a single unmapped block.
  if (!s->range->release()) return false;
  block* b = s->first;
  s->unmapped_set->erase(b);
  delete_block_locked(b);
  segments_.erase(s->address);
  if (s->pool != 0) forget_pool_segment_locked(s->pool);
  delete s;
  return true;
}

void caching_allocator::release_ranges_at_exit() {
  bool synchronized = false;
  for (auto& [address, s] : segments_) {
    if (!s->expandable()) continue;
    if (!synchronized && s->range->mapped_chunks() > 0) backend_.synchronize_device(), synchronized = true;
    s->range->release_at_exit();
  }
}

void caching_allocator::snapshot_expandable_locked(const segment* s, allocator_snapshot* out) const {
  // One segment per contiguous mapped run, as torch reports expandable segments.
  const block* b = s->first;
  while (b != nullptr) {
    if (!b->mapped) {
      b = b->next;
      continue;
    }
    segment_info info = snapshot_entry(s);
    info.address = b->address;
    // A run of the default pool may hold blocks of several streams; it is
    // reported under its first block's. A private pool's range has a
    // stream of its own (Note [private ranges]).
    if (s->pool == 0) info.stream = b->stream;
    for (; b != nullptr && b->mapped; b = b->next) {
      append_block_info(b, &info);
      info.total_size += b->size;
    }
    info.is_stitched = s->range->any_stitched(info.address, info.address + info.total_size);
    out->segments.push_back(std::move(info));
  }
}

// Note [invariants], expandable segments: a mapped chunk lies under every
// byte of a mapped block and none under an unmapped block; every mapped
// chunk is touched by a mapped block; unmapped blocks are free,
// chunk-aligned, coalesced and in their pool's unmapped set; no chunk is
// mapped twice anywhere.
void caching_allocator::validate_expandable_locked(const segment* s, std::vector<physical_handle>* seen) const {
  auto fail = [](const std::string& what) { throw std::logic_error("streamalloc invariant violated: " + what); };
  const expandable_range& range = *s->range;
  const std::size_t chunk = range.chunk_bytes();
  if (range.address() != s->address || range.size() != s->size) fail("a range and its segment disagree on their bounds");
  if (s->unmapped_set != &unmapped_set_locked(s->pool, s->is_small)) fail("a range points at another pool's unmapped set");
  std::vector<bool> touched(range.slots(), false);
  std::size_t unmapped_blocks = 0;
  for (const block* b = s->first; b != nullptr; b = b->next) {
    const std::size_t first = range.slot_of(b->address);
    const std::size_t last = range.slot_of(b->address + b->size - 1);
    if (b->mapped) {
      for (std::size_t slot = first; slot <= last; ++slot) {
        if (range.chunk(slot) == 0) fail("a mapped block covers an unmapped chunk");
        touched[slot] = true;
      }
      continue;
    }
    ++unmapped_blocks;
    if (!b->is_free() || b->stream != 0) fail("an unmapped block is in use or keeps a stream");
    if ((b->address - s->address) % chunk != 0 || b->size % chunk != 0) fail("an unmapped block is not chunk-aligned");
    if (b->next != nullptr && !b->next->mapped) fail("adjacent unmapped blocks not coalesced");
    for (std::size_t slot = first; slot <= last; ++slot) {
      if (range.chunk(slot) != 0) fail("an unmapped block has a chunk mapped under it");
    }
  }
  std::size_t mapped = 0;
  for (std::size_t slot = 0; slot < range.slots(); ++slot) {
    if (range.chunk(slot) == 0) {
      if (range.stitched(slot)) fail("an unmapped chunk slot is marked stitched");
      continue;
    }
    ++mapped;
    if (!touched[slot]) fail("a mapped chunk lies under no mapped block");
    seen->push_back(range.chunk(slot));
  }
  if (mapped != range.mapped_chunks()) fail("a range's mapped-chunk count is out of date");
  if (unmapped_blocks == 0 && range.mapped_chunks() * chunk != s->size) fail("a range's blocks and chunks disagree");
}

}  // namespace streamalloc
