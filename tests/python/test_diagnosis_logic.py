"""The pure-Python side of streamalloc's diagnosis, on any machine and
without torch: the report's sums and layout, call sites from snapshot
frames, leak detection over sequences of per-step samples, and the search
for the largest batch that fits, run against simulated memory models."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

import streamalloc
from streamalloc._diagnosis_logic import (
    BEFORE_TAGGING,
    LeakDetector,
    Trial,
    bisection_steps,
    bucket_label,
    build_report,
    call_site_of,
    call_sites_from_snapshot,
    fit_line,
    format_report,
    predict_batch,
    search_max_batch,
)

MiB = 1 << 20
GiB = 1 << 30


def test_logic_module_imports_without_torch():
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(streamalloc.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")])))
    code = "import sys, streamalloc._diagnosis_logic, streamalloc.diagnosis; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- report


def _stats(allocated, reserved, active=None, largest=0, free_cached=0, external=0.0):
    return {
        "allocated_bytes.all.current": allocated,
        "reserved_bytes.all.current": reserved,
        "active_bytes.all.current": allocated if active is None else active,
        "fragmentation.largest_free_block_bytes": largest,
        "fragmentation.free_cached_bytes": free_cached,
        "fragmentation.external": external,
        "fragmentation.reserved_allocated_ratio": reserved / allocated if allocated else 0.0,
    }


def _summary(by_tag, sampled=False, sample_every=1):
    buckets = [(0, 64 << 10), (64 << 10, MiB), (MiB, 16 * MiB), (16 * MiB, 256 * MiB), (256 * MiB, 4 * GiB),
               (4 * GiB, (1 << 64) - 1)]
    total = sum(b for _, b, _ in by_tag)
    return {
        "by_tag": by_tag,
        "by_size": [(lo, hi, total if lo == 16 * MiB else 0, 1 if lo == 16 * MiB else 0) for lo, hi in buckets],
        "recorded_bytes": total,
        "recorded_count": sum(c for _, _, c in by_tag),
        "sampled": sampled,
        "sample_every": sample_every,
    }


def test_report_sums_to_allocated_with_memory_from_before_tagging():
    summary = _summary([("blocks.0.mlp", 300 * MiB, 4), ("optimizer", 100 * MiB, 2), ("untagged", 20 * MiB, 9)])
    data = build_report(0, _stats(500 * MiB, 600 * MiB, active=530 * MiB, largest=60 * MiB, free_cached=100 * MiB,
                                  external=0.4), summary)
    assert data["tagging"] and not data["sampled"]
    assert [e["tag"] for e in data["by_tag"]] == ["blocks.0.mlp", "optimizer", BEFORE_TAGGING, "untagged"]
    assert sum(e["bytes"] for e in data["by_tag"]) == data["allocated_bytes"] == 500 * MiB
    assert data["pending_other_streams_bytes"] == 30 * MiB
    assert data["fragmentation"]["unallocated_bytes"] == 100 * MiB
    assert data["fragmentation"]["largest_free_block_bytes"] == 60 * MiB
    assert len(data["by_size"]) == 6 and data["by_size"][3]["bucket"] == "16.00 MiB - 256.00 MiB"

    text = format_report(data, top=2)
    assert text.startswith("streamalloc memory report, GPU 0: 500.00 MiB allocated, 600.00 MiB reserved")
    assert "blocks.0.mlp" in text and "60.0%" in text
    assert "(2 more)" in text  # top=2 of four rows
    assert "pending on other streams: 30.00 MiB" in text
    assert "largest free cached block 60.00 MiB" in text


def test_report_under_sampling_is_marked_and_not_topped_up():
    summary = _summary([("a", 64 * MiB, 16)], sampled=True, sample_every=16)
    data = build_report(1, _stats(100 * MiB, 128 * MiB), summary)
    assert data["sampled"] and data["sample_every"] == 16
    assert [e["tag"] for e in data["by_tag"]] == ["a"]
    assert "1 in 16" in format_report(data)
    assert "(estimates)" in format_report(data)


def test_report_with_tagging_off_says_how_to_turn_it_on():
    data = build_report(0, _stats(10 * MiB, 20 * MiB), None)
    assert not data["tagging"] and data["by_tag"] == []
    assert "tagging is off" in format_report(data)


def test_bucket_labels():
    assert bucket_label(0, 64 << 10) == "< 64.00 KiB"
    assert bucket_label(MiB, 16 * MiB) == "1.00 MiB - 16.00 MiB"
    assert bucket_label(4 * GiB, (1 << 64) - 1) == ">= 4.00 GiB"


# ---------------------------------------------------------------- call sites


TORCH_DIR = "/site-packages/torch/"
PACKAGE_DIR = "/site-packages/streamalloc/"


def test_call_site_is_the_innermost_user_frame():
    frames = [
        {"filename": "/src/aten/native/Empty.cpp", "line": 40, "name": "empty"},
        {"filename": TORCH_DIR + "nn/modules/linear.py", "line": 125, "name": "forward"},
        {"filename": PACKAGE_DIR + "diagnosis.py", "line": 10, "name": "hook"},
        {"filename": "/home/me/train.py", "line": 42, "name": "step"},
        {"filename": "/home/me/train.py", "line": 90, "name": "main"},
    ]
    assert call_site_of(frames, [TORCH_DIR, PACKAGE_DIR]) == "/home/me/train.py:42 (step)"
    assert call_site_of(frames[:3], [TORCH_DIR, PACKAGE_DIR]) is None


def test_call_sites_sum_the_allocated_blocks_of_one_device():
    here = [{"filename": "/home/me/train.py", "line": 7, "name": "leaky"}]
    there = [{"filename": "/home/me/train.py", "line": 9, "name": "fine"}]
    snapshot = {"segments": [
        {"device": 0, "blocks": [
            {"size": 4 * MiB, "state": "active_allocated", "frames": here},
            {"size": 2 * MiB, "state": "inactive", "frames": here},
            {"size": 1 * MiB, "state": "active_allocated", "frames": there},
            {"size": 3 * MiB, "state": "active_allocated", "frames": here},
            {"size": MiB, "state": "active_allocated", "frames": []},
        ]},
        {"device": 1, "blocks": [{"size": 64 * MiB, "state": "active_allocated", "frames": here}]},
    ]}
    rows = call_sites_from_snapshot(snapshot, 0, [TORCH_DIR])
    assert rows[0] == {"call_site": "/home/me/train.py:7 (leaky)", "bytes": 7 * MiB, "count": 2}
    assert {r["call_site"] for r in rows} == {"/home/me/train.py:7 (leaky)", "/home/me/train.py:9 (fine)", "(no stack)"}


# ---------------------------------------------------------------- leaks


def _feed(detector, series):
    """series: name -> list of values, one per step; returns the step at
    which each name was first flagged."""
    flagged = {}
    steps = len(next(iter(series.values())))
    for i in range(steps):
        for finding in detector.observe({name: values[i] for name, values in series.items()}):
            flagged[finding.name] = i
    return flagged


def test_a_tag_growing_every_step_is_flagged_after_n_steps():
    detector = LeakDetector(steps=5)
    series = {
        "leaky": [MiB * i for i in range(10)],            # +1 MiB every step
        "steady": [50 * MiB] * 10,                        # the model's weights
        "warmup": [0, 30 * MiB] + [30 * MiB] * 8,          # optimizer state, created once
        "noisy": [10, 20, 15, 25, 20, 30, 25, 35, 30, 40],  # grows overall, not every step
    }
    flagged = _feed(detector, series)
    assert flagged == {"leaky": 5}  # observation 0 is the baseline; five increases later
    (finding,) = detector.findings
    assert finding.growth_per_step == [MiB] * 5
    assert finding.growing_steps == 9 and finding.growth_bytes == 9 * MiB and finding.live_bytes == 9 * MiB
    assert "grew in each of the last 9 steps" in finding.message()
    assert "1.00 MiB per step" in finding.message()


def test_steady_loops_stay_silent():
    detector = LeakDetector(steps=3)
    # A training loop whose live memory at the end of each step repeats,
    # with a pattern of period 2 (gradient accumulation) and a one-off.
    series = {
        "model": [100 * MiB] * 20,
        "accumulate": [0, 8 * MiB] * 10,
        "cache": [0, 4 * MiB, 8 * MiB] + [8 * MiB] * 17,  # two increases < steps
    }
    assert _feed(detector, series) == {}
    assert detector.findings == []


def test_a_new_tag_appearing_and_growing_is_flagged():
    detector = LeakDetector(steps=3)
    detector.observe({"model": 10})
    for i in range(1, 4):
        new = detector.observe({"model": 10, "kept": i * 100})
    assert [f.name for f in new] == ["kept"]


def test_growth_below_the_threshold_is_ignored():
    detector = LeakDetector(steps=3, min_growth_bytes=MiB)
    assert _feed(detector, {"small": [512 * i for i in range(10)]}) == {}
    with pytest.raises(ValueError):
        LeakDetector(steps=0)


# ---------------------------------------------------------------- max batch


def test_fit_and_predict():
    a, b = fit_line([(2, 1000.0), (4, 1600.0)])
    assert (a, b) == pytest.approx((400.0, 300.0))
    assert predict_batch(a, b, 10000, 1.0) == 32
    assert predict_batch(a, b, 10000, 2.0) == 15
    assert predict_batch(a, 0.0, 10000, 1.0) is None
    with pytest.raises(ValueError):
        fit_line([(2, 1.0), (2, 3.0)])


class simulated_step:
    """A step whose peak allocated is base + per * b + quad * b^2 and whose
    peak reserved is that times `ratio` plus `slack`; it fits when the
    reserved peak is within the limit."""

    def __init__(self, limit, base, per, quad=0.0, ratio=1.0, slack=0, flat=0):
        self.limit, self.base, self.per, self.quad, self.ratio, self.slack, self.flat = (
            limit, base, per, quad, ratio, slack, flat)
        self.calls = []

    def allocated(self, b):
        return max(self.flat, self.base + self.per * b + self.quad * b * b)

    def reserved(self, b):
        return self.allocated(b) * self.ratio + self.slack

    def fits(self, b):
        return self.reserved(b) <= self.limit

    def __call__(self, b):
        self.calls.append(b)
        ok = self.fits(b)
        # A failed step reports the peak it reached before failing.
        allocated = self.allocated(b) if ok else min(self.allocated(b), self.limit)
        return Trial(b, ok, int(allocated), int(min(self.reserved(b), self.limit)))

    def true_max(self, high):
        return max(b for b in range(1, high + 1) if self.fits(b))


def _check_result(step, result, high):
    truth = step.true_max(high)
    assert result.batch is not None and step.fits(result.batch)
    next_power = 1 << math.ceil(math.log2(result.batch + 1))
    assert not step.fits(next_power) or result.batch >= 0.95 * truth, (result.batch, truth)
    assert result.steps == len(step.calls) == len(result.trials)
    assert result.steps < result.bisection_steps
    return truth


def test_linear_memory_is_predicted_exactly_in_four_steps():
    step = simulated_step(limit=8 * GiB, base=600 * MiB, per=7 * MiB, ratio=1.04)
    result = search_max_batch(step, 2, 4096, 8 * GiB)
    truth = _check_result(step, result, 4096)
    assert result.batch == truth == result.predicted_batch
    assert result.steps == 4  # warm-up, two small batches, the check
    assert result.method == "prediction"
    assert result.fragmentation_ratio == pytest.approx(1.04, rel=1e-3)
    assert result.measured_peak_allocated == step.allocated(truth)
    assert result.predicted_peak_allocated == pytest.approx(step.allocated(truth), rel=1e-6)
    assert result.bisection_steps == 12


def test_fragmentation_that_shrinks_with_size_is_refined():
    # Fixed rounding slack inflates the ratio at small batches: the first
    # prediction is low, the step at it measures a better ratio.
    step = simulated_step(limit=4 * GiB, base=100 * MiB, per=3 * MiB, ratio=1.02, slack=200 * MiB)
    result = search_max_batch(step, 1, 8192, 4 * GiB)
    truth = _check_result(step, result, 8192)
    assert result.batch >= 0.95 * truth
    assert result.steps <= 6


def test_peak_flat_at_small_batches_gallops_to_a_measurable_slope():
    # Optimizer state dominates the peak until activations overtake it.
    step = simulated_step(limit=6 * GiB, base=200 * MiB, per=4 * MiB, flat=1 * GiB)
    result = search_max_batch(step, 1, 4096, 6 * GiB)
    _check_result(step, result, 4096)


def test_mildly_convex_memory_is_found_by_the_refinement_or_one_step_below():
    # Peak memory grows a little faster than the batch (workspaces, rounding).
    step = simulated_step(limit=8 * GiB, base=500 * MiB, per=5 * MiB, quad=256.0)
    result = search_max_batch(step, 2, 4096, 8 * GiB)
    _check_result(step, result, 4096)
    assert result.method in ("prediction", "prediction, refined", "prediction, one below")
    assert sum(1 for t in result.trials if not t.ok) <= 2


def test_strongly_superlinear_memory_ends_in_a_capped_bisection():
    # Far from linear in the batch: the fit overshoots twice, then bisection.
    step = simulated_step(limit=4 * GiB, base=300 * MiB, per=2 * MiB, quad=4096.0)
    result = search_max_batch(step, 4, 4096, 4 * GiB, max_steps=12)
    assert step.fits(result.batch) and result.steps <= 12
    assert result.method == "bisection"
    assert result.batch >= 0.9 * step.true_max(4096)


def test_edges():
    step = simulated_step(limit=GiB, base=2 * GiB, per=MiB)
    result = search_max_batch(step, 1, 64, GiB)
    assert result.batch is None and result.method == "none fits"

    roomy = simulated_step(limit=80 * GiB, base=GiB, per=MiB)
    result = search_max_batch(roomy, 1, 256, 80 * GiB)
    assert result.batch == 256

    aligned = simulated_step(limit=3 * GiB, base=GiB, per=5 * MiB)
    result = search_max_batch(aligned, 8, 4096, 3 * GiB, multiple_of=8)
    assert result.batch % 8 == 0 and aligned.fits(result.batch) and not aligned.fits(result.batch + 8)

    capped = simulated_step(limit=4 * GiB, base=300 * MiB, per=2 * MiB, quad=4096.0)
    result = search_max_batch(capped, 4, 4096, 4 * GiB, max_steps=5)
    assert result.steps <= 5 and capped.fits(result.batch)

    with pytest.raises(ValueError):
        search_max_batch(step, 0, 10, GiB)
    with pytest.raises(ValueError):
        search_max_batch(step, 10, 5, GiB)
    assert bisection_steps(1, 4096) == 12
    assert bisection_steps(8, 4096, 8) == 9
