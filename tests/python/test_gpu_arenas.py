"""torch's memory API over several arenas (Note [arenas] in
device_allocator.cpp): helper threads moved to arenas 1 and 2 allocate,
the main thread on arena 0 frees; statistics, snapshot, peaks,
record_stream, CUDA graphs, MemPool, the memory fraction, out of memory,
the memory history and empty_cache must read as for one allocator.
scripts/arenas.py measures; these tests check."""

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture(scope="module")
def arenas(scripts):
    return scripts.run_ok("arenas.py")


def test_statistics_and_snapshot_count_every_arena(arenas):
    stats = arenas["stats"]
    assert stats["arenas"] == 3
    assert stats["values_ok"] == [True] * 5
    assert stats["allocated"] == stats["live_bytes"]
    assert stats["mismatched_keys"] == []
    assert stats["snapshot_reserved"] == stats["reserved"], (stats["segments"], stats["reserved_by_pool"])
    assert stats["snapshot_allocated"] == stats["allocated_total"]
    assert stats["tensors_in_snapshot"] == [True] * 5


def test_the_peak_is_the_peak_of_the_sum(arenas):
    peak = arenas["peak"]
    assert peak["peak"] == peak["expected_peak"]
    assert peak["after"] == peak["expected_after"]
    assert peak["allocated_after_frees"] == 0


def test_a_free_with_a_stream_use_waits_for_that_stream(arenas):
    record = arenas["record_stream"]
    assert record["sum"] == record["expected"]


def test_a_graph_captured_on_another_arena_replays(arenas):
    graph = arenas["graph"]
    assert (graph["first"], graph["second"], graph["all_equal"]) == (3.0, 11.0, True)
    assert any(pool != [0, 0] for pool in graph["pool_ids"])


def test_a_mempool_used_on_another_arena_holds_its_tensors(arenas):
    pool = arenas["mempool"]
    assert pool["block_pool"] == pool["pool_id"]
    assert pool["pool_segments"] >= 1
    assert pool["value_ok"]


def test_the_fraction_caps_the_device_and_out_of_memory_takes_other_arenas_cache(arenas):
    fraction = arenas["fraction"]
    fits = fraction["fits_after_release"]
    assert fits["ok"], fits
    assert fits["reserved"] <= 0.05 * fraction["total"]
    too_large = fraction["too_large"]
    assert not too_large["ok"]
    assert "Tried to allocate" in too_large["message"]
    assert fraction["num_ooms"] == 1


def test_the_memory_history_records_other_arenas(arenas):
    assert arenas["history"] == ["alloc", "free_requested", "free_completed"]


def test_empty_cache_empties_every_arena(arenas):
    assert arenas["after_graph_and_pool"]["allocated"] == 0
    end = arenas["end"]
    assert end["allocated"] == 0
    assert end["reserved"] == arenas["reserved_at_start"]
    assert end["segments"] == 0 or arenas["reserved_at_start"] > 0
