"""The torch features a drop-in allocator must keep, each run once under
torch's native allocator and once under streamalloc in fresh processes
(scripts/), with streamalloc's results held to native's: torch.compile
"reduce-overhead" (CUDA graph trees), torch.cuda.MemPool, memory history
and memory_viz, the torch.accelerator API, run-time allocator settings,
torch's out-of-memory wording, memory fraction 0, raw allocations, CUDA
IPC between processes, and torch's GPU trace with the CUDA Stream
Sanitizer."""

import os
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20


EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@pytest.fixture(scope="module")
def graph_trees(scripts):
    runs = {mode: scripts.run_ok("graph_trees.py", mode, timeout=900) for mode in ("native", "streamalloc")}
    # torch's expandable segments, which streamalloc extends to the graph
    # trees' private pool (expandable_private_pools).
    for mode in ("native", "streamalloc"):
        run = scripts.run("graph_trees.py", mode, timeout=900, env=EXPANDABLE)
        if run.returncode != 0 or run.result is None:
            pytest.fail(f"scripts/graph_trees.py {mode} with {EXPANDABLE} failed: {run.describe()}", pytrace=False)
        runs[mode + "_expandable"] = run.result
    return runs


@pytest.mark.parametrize("mode", ["streamalloc", "streamalloc_expandable"])
def test_compile_reduce_overhead_results_equal_native(graph_trees, mode):
    native, ours = graph_trees["native"], graph_trees[mode]
    for key in ("train_losses", "infer_sums", "branch_sums"):
        assert ours[key] == pytest.approx(native[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("mode", ["streamalloc", "streamalloc_expandable"])
def test_graph_trees_checkpoint_and_check_pools_through_streamalloc(graph_trees, mode):
    calls = graph_trees[mode]["calls"]
    # The same calls native needed, made to streamalloc without an error.
    assert calls == graph_trees["native"]["calls"]
    assert calls["checkPoolLiveAllocations"] > 0
    assert calls["getCheckpointState"] > 0


def test_graph_trees_pool_is_expandable_as_native_under_torchs_setting(graph_trees):
    # Plain segments by default, expandable ones under torch's setting: as
    # torch's own allocator lays out the pool.
    for mode in ("native", "streamalloc"):
        assert graph_trees[mode]["private_segments"] > 0, mode
        assert not any(graph_trees[mode]["private_expandable"]), mode
        assert graph_trees[mode + "_expandable"]["private_segments"] > 0, mode
        assert all(graph_trees[mode + "_expandable"]["private_expandable"]), mode


@pytest.mark.parametrize("reuse", ["True", "False"])
def test_record_stream_reuse_during_capture_like_native(scripts, reuse):
    native = scripts.run_ok("capture_reuse.py", "native", reuse)
    ours = scripts.run_ok("capture_reuse.py", "streamalloc", reuse)
    assert not ours["reused_before_join"] and not native["reused_before_join"]
    assert ours["reused_after_join"] == native["reused_after_join"] == (reuse == "True")
    assert ours["out_sum"] == native["out_sum"] == 64 * 7.0


def counting_allocator_library():
    path = os.environ.get("STREAMALLOC_COUNTING_ALLOCATOR", "")
    return path if path and Path(path).is_file() else ""


@pytest.fixture(scope="module")
def mem_pools(scripts):
    library = counting_allocator_library()
    return {mode: scripts.run_ok("mem_pools.py", mode, library) for mode in ("native", "streamalloc")}


def test_mempool_use_counts_and_routing_equal_native(mem_pools):
    native, ours = mem_pools["native"], mem_pools["streamalloc"]
    for key in ("use_count_new", "use_count_inside", "use_count_after", "tensor_in_pool", "outside_in_pool",
                "pool_snapshot_only_pool", "survivor_ok", "pool_segments_after_free_and_empty_cache"):
        assert ours[key] == native[key], key
    assert ours["tensor_in_pool"] and not ours["outside_in_pool"] and ours["survivor_ok"]
    assert ours["id"][0] == 0 and ours["id"][1] > 0  # a user-created pool, numbered like torch's


def test_mempool_with_user_allocator(mem_pools):
    if not counting_allocator_library():
        pytest.skip("STREAMALLOC_COUNTING_ALLOCATOR does not name the built libcounting_allocator.so")
    ours = mem_pools["streamalloc"]
    assert ours["user_allocations"] >= 1
    assert ours["user_values_ok"]
    assert ours["user_frees"] == ours["user_allocations"] == mem_pools["native"]["user_allocations"]
    assert ours["user_live_bytes"] == 0


def test_mempool_use_on_oom_equals_native(mem_pools):
    assert mem_pools["streamalloc"]["use_on_oom_served"] == mem_pools["native"]["use_on_oom_served"]


@pytest.fixture(scope="module")
def history(scripts, tmp_path_factory):
    return {
        mode: scripts.run_ok("memory_history.py", mode, str(tmp_path_factory.mktemp(mode)))
        for mode in ("native", "streamalloc")
    }


def test_history_records_torch_actions_with_frames(history):
    ours, native = history["streamalloc"], history["native"]
    assert {"alloc", "free_requested", "free_completed"} <= set(ours["actions"])
    assert ours["has_segment_event"]
    assert ours["kept_alloc_entries"] == 1 and ours["kept_alloc_size"] == 3 * MiB
    assert ours["kept_alloc_has_this_file"] and ours["kept_block_has_this_file"]
    assert ours["freed_sequence"][-2:] == ["free_requested", "free_completed"]
    assert ours["pending_sequence"][-2:] == native["pending_sequence"][-2:] == ["free_requested", "free_completed"]
    assert ours["time_us_present"]


def test_history_renders_with_memory_viz_and_stops(history):
    ours = history["streamalloc"]
    assert ours["dump_has_traces"]
    assert ours["trace_plot_bytes"] > 1000 and ours["segment_plot_bytes"] > 1000
    assert ours["traces_after_stop"] == history["native"]["traces_after_stop"] == 0


def test_record_function_annotations_reach_the_snapshot_like_native(history):
    ours, native = history["streamalloc"], history["native"]
    assert native["annotations_key"] and ours["annotations_key"]
    assert native["region_annotations"], "native recorded no annotation for the region"
    assert ours["region_annotations"] == native["region_annotations"]
    assert ours["region_annotations_timed"]
    assert ours["annotations_after_stop"] == native["annotations_after_stop"]


def test_oom_observer_and_wording(history):
    ours, native = history["streamalloc"], history["native"]
    assert ours["oom_raised"] and ours["observer_calls"] == native["observer_calls"] == 1
    first_sentence = re.compile(r"CUDA out of memory\. Tried to allocate [0-9.]+ [KMG]iB\.")
    assert first_sentence.search(native["oom_message"])
    assert first_sentence.search(ours["oom_message"])


@pytest.fixture(scope="module")
def torch_api(scripts):
    return {mode: scripts.run_ok("torch_api.py", mode) for mode in ("native", "streamalloc")}


def test_accelerator_api_reports_streamalloc(torch_api):
    ours = torch_api["streamalloc"]
    assert ours["accelerator_allocated"] == ours["cuda_allocated"] >= 15 * MiB
    assert ours["accelerator_active_bytes"] == ours["cuda_active_bytes"]
    assert ours["accelerator_reserved"] == ours["cuda_reserved"]
    assert ours["accelerator_peak_after_reset"] == ours["cuda_peak_after_reset"]


def test_accelerator_cumulative_counters_like_torch(torch_api):
    # The sequence of torch's test_accelerator.py test_memory_stats: after
    # reset_accumulated_memory_stats, one 1 KiB tensor is 1024 active bytes
    # and, freed and the cache emptied, 1024 freed ones.
    for mode in ("native", "streamalloc"):
        run = torch_api[mode]
        assert run["kib_active_rise"] == 1024, mode
        assert run["kib_active_freed_while_live"] == 0, mode
        assert run["kib_active_rise_after_free"] == 0, mode
        assert run["kib_active_freed"] == run["kib_allocated_freed"] == 1024, mode
        assert run["kib_reserved_back"], mode


def test_settings_at_run_time(torch_api):
    ours, native = torch_api["streamalloc"], torch_api["native"]
    # streamalloc reports the limit in force; torch's native allocator keeps
    # reporting the one it started with (-1, unlimited).
    assert ours["max_split_size"] == 64 * MiB
    assert ours["rounded_bytes"] == native["rounded_bytes"]
    warning = next(w for w in ours["ignored_key_warnings"] if "release_lock_on_cudamalloc" in w)
    # The warning names every key streamalloc does apply.
    for key in ("max_split_size_mb", "max_non_split_rounding_mb", "roundup_power2_divisions",
                "garbage_collection_threshold", "expandable_segments", "graph_capture_record_stream_reuse"):
        assert key in warning, key


def test_torch_errors_keep_their_python_types(torch_api):
    ours, native = torch_api["streamalloc"], torch_api["native"]
    for key in ("unknown_key_error", "bad_fraction_error", "bad_index_error"):
        assert native[key] is not None, key
        assert ours[key] == native[key], key
    assert native["unknown_key_error"] == "ValueError"


def test_oom_wording_and_fraction_zero_like_torch(torch_api):
    ours, native = torch_api["streamalloc"], torch_api["native"]
    assert "Tried to allocate 800000000.00 GiB" in native["huge_oom"]
    assert "Tried to allocate 800000000.00 GiB" in ours["huge_oom"]
    # The driver's process list (NVML), where torch can read it, so can we.
    own_use = re.compile(r"Including non-PyTorch memory, this process has \d+\.\d\d [KMG]iB memory in use\. ")
    assert bool(own_use.search(ours["huge_oom"])) == bool(own_use.search(native["huge_oom"])), (ours, native)
    assert ours["fraction0_raised"] and native["fraction0_raised"]
    assert ours["after_fraction_restore_ok"]


def test_raw_alloc_and_delete(torch_api):
    ours, native = torch_api["streamalloc"], torch_api["native"]
    assert ours["raw_alloc_delta"] == native["raw_alloc_delta"] == 3 * MiB
    assert ours["raw_delete_delta"] == native["raw_delete_delta"] == 0


@pytest.mark.parametrize(
    "parent,child",
    [
        ("streamalloc", "native"),
        ("streamalloc", "streamalloc"),
        ("streamalloc_plain", "native"),
        ("streamalloc_plain", "streamalloc"),
        ("native", "streamalloc"),
    ],
)
def test_cuda_ipc_round_trip(scripts, parent, child):
    result = scripts.run_ok("cuda_ipc.py", parent, child, timeout=300)
    assert result["child_read_ok"], result
    assert result["parent_sees_writes"], result
    assert result["child_exit"] == 0


@pytest.mark.parametrize("mode", ["native", "streamalloc", "streamalloc_plain"])
def test_cuda_ipc_through_a_relay_process(scripts, mode):
    # A process that imports tensors and exports copies of its own at once
    # (PyTorch's test_cuda_send_many, with fewer tensors).
    result = scripts.run_ok("cuda_ipc_relay.py", mode, "5000", timeout=420)
    assert result["sum"] == result["expected"], result
    assert result["exit_codes"] == [0, 0, 0], result


@pytest.fixture(scope="module")
def stream_sanitizer(scripts):
    return {mode: scripts.run_ok("stream_sanitizer.py", mode) for mode in ("native", "streamalloc")}


def test_gpu_trace_hears_every_allocation_and_free_like_native(stream_sanitizer):
    ours, native = stream_sanitizer["streamalloc"], stream_sanitizer["native"]
    assert all(ours["allocations_heard"]) and all(ours["frees_heard"]), ours
    assert (ours["allocation_count"], ours["free_count"]) == (native["allocation_count"], native["free_count"])


def test_stream_sanitizer_passes_reuse_after_record_stream_and_reports_a_race(stream_sanitizer):
    for mode, result in stream_sanitizer.items():
        # The block came back to the default stream, so the check below ran
        # on a reused block, which the sanitizer must not take for the old tensor.
        assert result["reused"], mode
        assert result["reuse_reported"] is None, (mode, result["reuse_reported"])
        assert result["race_reported"], mode
