"""streamalloc behind torch on a GPU: statistics and snapshots, record_stream,
out-of-memory, memory fraction, empty_cache, cudnn.benchmark, CUDA graphs,
the plain pluggable path, when install() may run, and exiting with memory
in use. Each area runs in its own process (scripts/); the tests check what
the script measured."""

import json

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20
GiB = 1 << 30


# --- statistics, snapshot, summary ---------------------------------------------


@pytest.fixture(scope="module")
def introspection(scripts):
    return scripts.run_ok("introspection.py")


def test_torch_reports_streamalloc(introspection):
    assert introspection["backend"] == "streamalloc"


def test_torch_memory_stats_equal_streamalloc_stats(introspection):
    for phase in ("with_tensors", "after_free_stats"):
        compared = introspection[phase]
        assert compared["missing_in_streamalloc"] == [], phase
        assert compared["mismatches"] == {}, phase
    keys = introspection["with_tensors"]["torch_keys"]
    for key in ("allocated_bytes.all.current", "reserved_bytes.large_pool.peak", "num_device_alloc", "max_split_size"):
        assert key in keys
    assert set(introspection["with_tensors"]["fragmentation"]) >= {
        "fragmentation.largest_free_block_bytes",
        "fragmentation.free_cached_bytes",
        "fragmentation.external",
        "fragmentation.reserved_allocated_ratio",
    }


def test_allocated_bytes_are_the_live_tensor_bytes(introspection):
    stats = introspection["with_tensors"]["torch"]
    baseline = introspection["baseline"]
    live = introspection["live_bytes"]
    assert stats["requested_bytes.all.current"] - baseline["requested"] == live
    assert stats["allocated_bytes.all.current"] - baseline["allocated"] == live
    assert introspection["memory_allocated"] == stats["allocated_bytes.all.current"]
    assert introspection["memory_reserved"] == stats["reserved_bytes.all.current"]


def test_freeing_lowers_allocated_and_keeps_the_peak(introspection):
    after = introspection["after_free"]
    stats = introspection["with_tensors"]["torch"]
    assert after["allocated"] == stats["allocated_bytes.all.current"] - after["freed_bytes"]
    assert after["peak"] == after["peak_before"] >= stats["allocated_bytes.all.current"]
    reset = introspection["after_reset_peak"]
    assert reset["peak"] == reset["allocated"] == after["allocated"]
    accumulated = introspection["after_reset_accumulated"]
    assert accumulated["torch_allocated_total"] == accumulated["streamalloc_allocated_total"] == 0


def test_raw_pointer_interface(introspection):
    raw = introspection["raw"]
    assert raw["during"] - raw["before"] == MiB
    assert raw["after"] == raw["before"]


def test_empty_tensors_take_no_memory(introspection):
    empty = introspection["empty_tensors"]
    assert empty["data_ptrs"] == [0, 0, 0]
    assert empty["shapes"] == [[0], [0, 5], [0]]
    assert set(empty["devices"]) == {"cuda:0"}
    assert empty["new_allocations"] == 0


def test_snapshot_matches_the_statistics(introspection):
    snapshot = introspection["snapshot"]
    stats = introspection["with_tensors"]["torch"]
    assert snapshot["has_device_traces"]
    assert snapshot["segment_bytes"] == stats["reserved_bytes.all.current"]
    assert snapshot["allocated_block_bytes"] == stats["allocated_bytes.all.current"]
    assert set(snapshot["tensor_states"]) == {"active_allocated"}
    assert set(snapshot["streamalloc_states"]) == {"active_allocated"}
    assert snapshot["torch_segments"] == snapshot["streamalloc_segments"] != []


def test_memory_summaries(introspection):
    summaries = introspection["summary"]
    assert "Allocated memory" in summaries["torch"]
    for line in ("Allocated memory", "Largest free cached block", "External fragmentation", "Reserved / allocated"):
        assert line in summaries["streamalloc"]


# --- record_stream ----------------------------------------------------------------


def test_memory_used_on_a_side_stream_is_not_reused_early(scripts):
    run = scripts.run_ok("streams.py")
    assert run["side_busy_when_reallocated"], f"the side-stream kernel ended too soon for the test to mean anything: {run}"
    assert run["state_while_pending"] == "active_pending_free"
    assert run["next_address"] != run["address"]
    assert run["total"] == run["expected_total"]
    assert run["y_intact"]


# --- memory fraction, out of memory, empty_cache ------------------------------------


@pytest.fixture(scope="module")
def limits(scripts):
    return scripts.run_ok("limits.py")


def test_memory_fraction_is_enforced(limits):
    fraction = limits["fraction"]
    assert fraction["reported"] == fraction["fraction"]
    assert fraction["first_error"] is None
    assert fraction["second_error"] is not None and fraction["second_error"]["type"] == "OutOfMemoryError"
    assert " allowed; " in fraction["second_error"]["message"]  # torch's words for the cap
    assert fraction["third_error"] is None
    assert fraction["reserved_with_third"] <= fraction["fraction"] * limits["total"]


def test_out_of_memory_raises_torchs_error_with_the_numbers(limits):
    for error in (limits["oom"]["huge_error"], limits["oom"]["fill_error"]):
        assert error is not None
        assert error["type"] == "OutOfMemoryError" and error["is_runtime_error"]
        assert "Tried to allocate" in error["message"]
        assert "largest free cached block" in error["message"]
    assert limits["oom"]["num_ooms"] >= 2


def test_memory_is_reusable_after_out_of_memory(limits):
    oom = limits["oom"]
    assert oom["filled_chunks"] >= limits["total"] // GiB // 2
    assert oom["reallocated_from_cache"]
    assert oom["computed_after"] == 2000.0


def test_empty_cache_returns_memory_to_the_device(limits):
    empty = limits["empty_cache"]
    released = empty["reserved_before"] - empty["reserved_after"]
    assert empty["reserved_after"] == 0
    assert released >= GiB
    # Other users of device memory may move a little meanwhile.
    assert empty["free_after"] - empty["free_before"] >= 0.95 * released
    assert empty["streamalloc_reserved_cached"] >= 2 * GiB
    assert empty["streamalloc_reserved_after"] == 0


# --- cudnn.benchmark, CUDA graphs -------------------------------------------------------


@pytest.fixture(scope="module")
def kernels(scripts):
    return scripts.run_ok("allocator_kernels.py")


def test_cudnn_benchmark_convolutions_are_correct(kernels):
    bench = kernels["cudnn_benchmark"]
    assert bench["enabled"]
    for conv in bench["convolutions"]:
        # float32 with TF32 off against float64: a few ulps of float32.
        assert conv["forward_error"] < 1e-5
        assert conv["input_grad_error"] < 1e-5


def test_cuda_graph_replays_correctly_and_frees_its_pool(kernels):
    graph = kernels["graph"]
    assert graph["pools_with_graph"], "the capture allocated nothing in a private pool"
    assert max(graph["replay_errors"]) < 1e-6
    assert graph["pools_after_delete"] == {}


def test_make_graphed_callables(kernels):
    graphed = kernels["graphed_callables"]
    assert graphed["pools_while_alive"]
    assert max(graphed["errors"]) < 1e-5
    assert graphed["pools_after_delete"] == {}


# --- the plain pluggable path -------------------------------------------------------------


def test_plain_pluggable_allocator(scripts, environment):
    if environment.get("library") is None:
        pytest.skip(f"libstreamalloc.so is not in the package: {environment.get('library_error')}")
    run = scripts.run_ok("pluggable.py")
    assert run["backend"] == "pluggable"
    assert run["relative_error"] < 1e-12
    assert run["empty_cache_status"] == 0
    # The freed gigabyte stayed cached in streamalloc until its empty_cache.
    assert run["released_bytes"] >= 0.95 * GiB


# --- when install() may run -------------------------------------------------------------


def test_install_after_cuda_is_in_use_explains_the_fix(scripts):
    run = scripts.run_ok("install_order.py", "too_late")
    error = run["install"]
    assert error is not None and error["type"] == "RuntimeError"
    assert "before any CUDA tensor is created" in error["message"]
    assert "at the top of your script" in error["message"]
    assert not run["is_installed"] and run["backend"] == "native"
    assert run["computed_after"] == 4.0


def test_install_twice_is_harmless(scripts):
    run = scripts.run_ok("install_order.py", "twice")
    for step in ("first", "second", "option_before_use", "again_after_use", "same_option_after_use"):
        assert run[step] is None, step
    changed = run["changed_option_after_use"]
    assert changed is not None and changed["type"] == "RuntimeError"
    assert "first streamalloc.install()" in changed["message"]
    assert run["max_split_size"] == 256 * MiB
    assert run["is_installed"] and run["backend"] == "streamalloc"
    assert run["computed_after"] == float(MiB)


def test_bad_options_and_early_calls_are_explained(scripts):
    run = scripts.run_ok("install_order.py", "bad_option")
    assert run["stats_before_install"]["type"] == "RuntimeError"
    assert "streamalloc.install()" in run["stats_before_install"]["message"]
    for key in ("bad_option", "bad_value"):
        assert run[key] is not None and run[key]["type"] == "ValueError", key
    assert "no_such_option" in run["bad_option"]["message"]
    assert "max_split_size_mb" in run["bad_option"]["message"], "the error should list the valid keys"
    assert "max_split_size_mb" in run["keys"]
    assert run["install"] is None and run["is_installed"]
    assert run["computed_after"] == 8.0


TORCH_VARIABLE = {
    "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,garbage_collection_threshold:0.6,"
    "release_lock_on_cudamalloc:True,pinned_use_cuda_host_register:True",
    "STREAMALLOC_CONF": "garbage_collection_threshold:0.7",
}


@pytest.mark.parametrize("options", [None, {"max_split_size_mb": 256}])
def test_install_takes_the_shared_keys_of_torchs_variable(scripts, options):
    args = ("torch_variable",) + ((json.dumps(options),) if options else ())
    run = scripts.run("install_order.py", *args, env=TORCH_VARIABLE)
    assert run.returncode == 0 and run.result is not None, run.describe()
    result = run.result
    assert result["install"] is None
    # torch's variable beneath STREAMALLOC_CONF beneath install()'s options.
    split_mb = 256 if options else 128
    assert f"max_split_size_mb:{split_mb}," in result["config"]
    assert "garbage_collection_threshold:0.7," in result["config"]
    assert result["max_split_size"] == result["torch_stats_max_split_size"] == split_mb * MiB
    # Only the key streamalloc ignores is named; torch keeps its pinned ones.
    named = [w for w in result["warnings"] if "ignores these allocator settings" in w]
    assert len(named) == 1 and "release_lock_on_cudamalloc" in named[0]
    assert "pinned_use_cuda_host_register" not in named[0]
    assert result["computed_after"] == float(MiB)


# --- caching off for debugging (PYTORCH_NO_CUDA_MEMORY_CACHING) --------------


@pytest.fixture(scope="module")
def uncached(scripts):
    runs = {}
    for mode, flag in (("native", "1"), ("streamalloc", "1"), ("streamalloc", "0"), ("native", "disable"),
                       ("streamalloc", "disable")):
        if flag == "disable":
            run = scripts.run("uncached.py", mode, "disable", env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "0"})
        else:
            run = scripts.run("uncached.py", mode, env={"PYTORCH_NO_CUDA_MEMORY_CACHING": flag})
        assert run.returncode == 0 and run.result is not None, run.describe()
        runs[mode, flag] = run.result
    return runs


@pytest.mark.parametrize("how", ["1", "disable"])
def test_caching_off_gives_each_tensor_its_own_memory_like_native(uncached, how):
    size = 256 * MiB
    for mode in ("native", "streamalloc"):
        run = uncached[mode, how]
        assert run["backend"] == mode, mode
        # Outside the cache: its statistics see nothing, the driver all.
        assert run["allocated_bytes"] == run["reserved_bytes"] == 0, mode
        assert run["taken_while_live"] >= size and run["back_after_free"] >= size, mode
        assert run["sum"] == 2 * size, mode


def test_no_cuda_memory_caching_0_keeps_the_cache(uncached):
    run = uncached["streamalloc", "0"]
    assert run["allocated_bytes"] >= 256 * MiB
    # Freed into the cache, not to the driver.
    assert run["back_after_free"] < 256 * MiB

