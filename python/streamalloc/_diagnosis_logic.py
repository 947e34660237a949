"""The decisions behind streamalloc's diagnosis, as pure functions over
numbers and dictionaries: the memory report's layout, leak detection over a
sequence of per-step samples, call sites from snapshot frames, and the
search for the largest batch that fits. No torch, no GPU: the functions
that run steps take them as callables, so all of this is tested anywhere.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ._summary import format_bytes

UNTAGGED = "untagged"
BEFORE_TAGGING = "before_tagging"  # live bytes allocated before tagging began

# --------------------------------------------------------------------------
# The memory report


def bucket_label(min_bytes: int, max_bytes: Optional[int]) -> str:
    """"< 64.00 KiB", "1.00 MiB - 16.00 MiB", ">= 4.00 GiB"."""
    if min_bytes == 0:
        return f"< {format_bytes(max_bytes)}"
    if max_bytes is None or max_bytes >= (1 << 63):
        return f">= {format_bytes(min_bytes)}"
    return f"{format_bytes(min_bytes)} - {format_bytes(max_bytes)}"


def build_report(device: int, stats: Mapping[str, float], summary: Optional[Mapping[str, Any]],
                 call_sites: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    """The dict streamalloc.report() returns, from a device's stats()
    (torch's keys plus "fragmentation.*") and the tag summary of
    streamalloc._C.tag_summary (None while tagging is off).

    Without sampling, by_tag sums to allocated_bytes: what the records do
    not cover was allocated before tagging began (BEFORE_TAGGING)."""
    allocated = int(stats.get("allocated_bytes.all.current", 0))
    reserved = int(stats.get("reserved_bytes.all.current", 0))
    active = int(stats.get("active_bytes.all.current", 0))
    data: Dict[str, Any] = {
        "device": device,
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "active_bytes": active,
        # Freed by their tensors but still awaited by other streams
        # (record_stream): active, no longer allocated.
        "pending_other_streams_bytes": max(0, active - allocated),
        "fragmentation": {
            "unallocated_bytes": max(0, reserved - allocated),
            "free_cached_bytes": int(stats.get("fragmentation.free_cached_bytes", 0)),
            "largest_free_block_bytes": int(stats.get("fragmentation.largest_free_block_bytes", 0)),
            "external": float(stats.get("fragmentation.external", 0.0)),
            "reserved_allocated_ratio": float(stats.get("fragmentation.reserved_allocated_ratio", 0.0)),
        },
        "tagging": summary is not None,
        "sampled": bool(summary and summary.get("sampled")),
        "sample_every": int(summary.get("sample_every", 1)) if summary else 1,
        "by_tag": [],
        "by_size": [],
        "by_call_site": call_sites,
    }
    if summary is None:
        return data
    by_tag = [{"tag": name, "bytes": int(nbytes), "count": int(count)} for name, nbytes, count in summary["by_tag"]]
    recorded = sum(entry["bytes"] for entry in by_tag)
    if not data["sampled"] and allocated > recorded:
        by_tag.append({"tag": BEFORE_TAGGING, "bytes": allocated - recorded, "count": 0})
    by_tag.sort(key=lambda entry: -entry["bytes"])
    data["by_tag"] = by_tag
    data["by_size"] = [
        {"bucket": bucket_label(lo, hi), "min_bytes": int(lo), "max_bytes": int(hi), "bytes": int(nbytes),
         "count": int(count)}
        for lo, hi, nbytes, count in summary["by_size"]
    ]
    return data


def _table(title: str, rows: Sequence[Tuple[str, int, int]], total: int, top: int, estimate: bool) -> List[str]:
    lines = [f"  {title}" + ("  (estimates)" if estimate else "")]
    width = max([len(name) for name, _, _ in rows[:top]] + [24])
    for name, nbytes, count in rows[:top]:
        share = f"{100.0 * nbytes / total:5.1f}%" if total > 0 else "     -"
        counted = f"{count:>9,}" if count else " " * 9
        lines.append(f"    {name:<{width}}  {format_bytes(nbytes):>12}  {share}  {counted}")
    if len(rows) > top:
        rest = rows[top:]
        rest_bytes = sum(nbytes for _, nbytes, _ in rest)
        lines.append(f"    {'(' + str(len(rest)) + ' more)':<{width}}  {format_bytes(rest_bytes):>12}")
    return lines


def format_report(data: Mapping[str, Any], top: int = 10) -> str:
    """The text streamalloc.report() prints."""
    allocated = data["allocated_bytes"]
    lines = [
        f"streamalloc memory report, GPU {data['device']}: {format_bytes(allocated)} allocated, "
        f"{format_bytes(data['reserved_bytes'])} reserved"
    ]
    estimate = data["sampled"]
    if not data["tagging"]:
        lines.append("  by tag: tagging is off (streamalloc.enable_tagging(), tag(name) or attribute(model))")
    else:
        if estimate:
            lines.append(f"  sampling: 1 in {data['sample_every']} small allocations recorded, scaled up")
        rows = [(e["tag"], e["bytes"], e["count"]) for e in data["by_tag"]]
        lines += _table("by tag", rows, allocated, top, estimate)
        rows = [(e["bucket"], e["bytes"], e["count"]) for e in data["by_size"] if e["bytes"] > 0]
        lines += _table("by tensor size", rows, allocated, len(rows), estimate)
    if data.get("by_call_site"):
        rows = [(e["call_site"], e["bytes"], e["count"]) for e in data["by_call_site"]]
        lines += _table("by call site (memory history)", rows, allocated, top, False)
    f = data["fragmentation"]
    lines.append(
        f"  fragmentation: {format_bytes(f['unallocated_bytes'])} reserved but unallocated, largest free cached "
        f"block {format_bytes(f['largest_free_block_bytes'])} (external {f['external']:.2f}, "
        f"reserved/allocated {f['reserved_allocated_ratio']:.2f})"
    )
    lines.append(f"  pending on other streams: {format_bytes(data['pending_other_streams_bytes'])} "
                 "(freed, awaiting other streams' work)")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------
# Call sites from memory-history frames


def call_site_of(frames: Iterable[Mapping[str, Any]], skip_dirs: Sequence[str]) -> Optional[str]:
    """"file.py:12 (fn)" for the innermost Python frame outside `skip_dirs`
    (torch's and streamalloc's own code); None when there is none."""
    for frame in frames:
        filename = frame.get("filename", "")
        if not filename.endswith(".py"):
            continue  # C++ frames of a "python,cpp" recording
        if any(filename.startswith(d) for d in skip_dirs):
            continue
        return f"{filename}:{frame.get('line', 0)} ({frame.get('name', '?')})"
    return None


def call_sites_from_snapshot(snapshot: Mapping[str, Any], device: int,
                             skip_dirs: Sequence[str]) -> List[Dict[str, Any]]:
    """Live bytes by call site over the allocated blocks of torch's
    _snapshot() for `device`, most bytes first. Blocks recorded without a
    stack count under "(no stack)"."""
    sites: Dict[str, List[int]] = {}
    for segment in snapshot.get("segments", []):
        if segment.get("device", device) != device:
            continue
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            site = call_site_of(block.get("frames", []), skip_dirs) or "(no stack)"
            entry = sites.setdefault(site, [0, 0])
            entry[0] += int(block.get("size", 0))
            entry[1] += 1
    rows = [{"call_site": site, "bytes": b, "count": c} for site, (b, c) in sites.items()]
    rows.sort(key=lambda e: -e["bytes"])
    return rows


# --------------------------------------------------------------------------
# Leak detection


@dataclass
class LeakFinding:
    """A tag or call site whose live bytes grew in every one of the last
    `steps` steps (and in `growing_steps` consecutive steps so far)."""

    kind: str  # "tag" or "call_site"
    name: str
    steps: int
    growing_steps: int
    growth_per_step: List[int]  # the last `steps` increases, oldest first
    growth_bytes: int           # since the growth started
    live_bytes: int

    def message(self) -> str:
        per_step = sum(self.growth_per_step) // max(1, len(self.growth_per_step))
        what = "tag" if self.kind == "tag" else "call site"
        return (
            f"streamalloc.watch: live memory of {what} {self.name!r} grew in each of the last "
            f"{self.growing_steps} steps (about {format_bytes(per_step)} per step, {format_bytes(self.growth_bytes)} "
            f"in total, {format_bytes(self.live_bytes)} live now): something keeps tensors from every step alive "
            "(a list, a cache, a global, a loss kept with its graph)"
        )

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


class LeakDetector:
    """Flags names whose value grows in each of `steps` consecutive
    observations; a steady or fluctuating series is never flagged. A flagged
    name stays flagged, its finding updated while it keeps growing."""

    def __init__(self, steps: int, kind: str = "tag", min_growth_bytes: int = 1):
        if steps < 1:
            raise ValueError(f"steps must be at least 1, got {steps}")
        self.steps = steps
        self.kind = kind
        self.min_growth_bytes = min_growth_bytes
        self._last: Dict[str, int] = {}
        self._run: Dict[str, List[int]] = {}     # consecutive increases so far
        self._findings: Dict[str, LeakFinding] = {}
        self.observations = 0

    @property
    def findings(self) -> List[LeakFinding]:
        return list(self._findings.values())

    def observe(self, sample: Mapping[str, int]) -> List[LeakFinding]:
        """Takes the live bytes per name at the end of a step; returns the
        names flagged for the first time."""
        new: List[LeakFinding] = []
        names = set(self._last) | set(sample)
        for name in names:
            now = int(sample.get(name, 0))
            if self.observations > 0:
                growth = now - self._last.get(name, 0)
                run = self._run.setdefault(name, [])
                if growth >= self.min_growth_bytes:
                    run.append(growth)
                else:
                    run.clear()
                if len(run) >= self.steps:
                    finding = LeakFinding(self.kind, name, self.steps, len(run), run[-self.steps:], sum(run), now)
                    if name not in self._findings:
                        new.append(finding)
                    self._findings[name] = finding
            self._last[name] = now
        self.observations += 1
        new.sort(key=lambda f: -f.growth_bytes)
        return new


# --------------------------------------------------------------------------
# The largest batch that fits


@dataclass
class Trial:
    """One run of the step: whether it fit, and its peaks."""

    batch: int
    ok: bool
    peak_allocated: int
    peak_reserved: int


@dataclass
class BatchSizeResult:
    """What max_batch_size found. `batch` ran; None when even `low` did not."""

    batch: Optional[int]
    predicted_batch: Optional[int]          # the first prediction from the fit
    predicted_peak_allocated: Optional[int]  # the fit's peak at `batch`
    measured_peak_allocated: Optional[int]   # the step's at `batch`
    measured_peak_reserved: Optional[int]
    limit_bytes: int
    fit_bytes: Tuple[float, float]           # peak allocated ~= fit_bytes[0] + fit_bytes[1] * batch
    fragmentation_ratio: float               # peak reserved / peak allocated used for the prediction
    steps: int                               # calls of the step function
    bisection_steps: int                     # what a bisection over [low, high] would take
    method: str
    trials: List[Trial] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def bisection_steps(low: int, high: int, multiple_of: int = 1) -> int:
    """Steps a bisection needs to pin the limit within [low, high]."""
    candidates = (high - low) // multiple_of + 1
    return max(1, math.ceil(math.log2(candidates)))


def fit_line(points: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """Least-squares (a, b) of y = a + b x; with two points, the line through them."""
    n = len(points)
    if n < 2:
        raise ValueError("fit_line needs at least two points")
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    if sxx == 0:
        raise ValueError("fit_line needs two different x values")
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    return mean_y - b * mean_x, b


def predict_batch(a: float, b: float, limit_bytes: float, ratio: float) -> Optional[int]:
    """The largest batch with (a + b * batch) * ratio <= limit_bytes, or
    None when memory does not grow with the batch (b <= 0)."""
    if b <= 0:
        return None
    return int(math.floor((limit_bytes / max(ratio, 1.0) - a) / b))


def search_max_batch(measure: Callable[[int], Trial], low: int, high: int, limit_bytes: int, *,
                     multiple_of: int = 1, warmup: bool = True, max_steps: int = 12,
                     tolerance: float = 0.02, margin: float = 0.1) -> BatchSizeResult:
    """The largest batch in [low, high] whose step fits in limit_bytes.

    `measure(batch)` runs one step and returns its Trial. The search fits
    peak allocated = a + b * batch through two small batches (larger ones
    while the peak does not grow measurably with the batch), predicts the
    largest batch whose peak, times the measured fragmentation ratio (peak
    reserved / peak allocated), stays within the limit, and runs it. When
    it fits, the fit is redone through it and the prediction is taken when
    it moves by less than `tolerance` (at most two refinements); when it
    does not, one step `margin` below the prediction runs (and, when the
    gap to the failure is wider than `tolerance`, at most one more inside
    it). Only when the step below fails too does a bisection between the
    largest batch that ran and the smallest that did not finish the
    search, with at most `max_steps` steps in all."""
    if low < 1 or high < low:
        raise ValueError(f"need 1 <= low <= high, got low={low}, high={high}")
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be at least 1, got {multiple_of}")
    trials: List[Trial] = []

    def align(batch: int) -> int:
        return min(high, max(low, batch - batch % multiple_of))

    def run(batch: int) -> Trial:
        trial = measure(batch)
        trials.append(trial)
        return trial

    def budget_left() -> bool:
        return len(trials) < max_steps

    state: Dict[str, Any] = {"a": 0.0, "b": 0.0, "ratio": 1.0, "predicted": None, "method": "prediction"}

    def result(best: Optional[Trial]) -> BatchSizeResult:
        predicted_peak = None
        if best is not None and state["b"] > 0:
            predicted_peak = int(state["a"] + state["b"] * best.batch)
        return BatchSizeResult(
            batch=best.batch if best else None,
            predicted_batch=state["predicted"],
            predicted_peak_allocated=predicted_peak,
            measured_peak_allocated=best.peak_allocated if best else None,
            measured_peak_reserved=best.peak_reserved if best else None,
            limit_bytes=int(limit_bytes),
            fit_bytes=(float(state["a"]), float(state["b"])),
            fragmentation_ratio=float(state["ratio"]),
            steps=len(trials),
            bisection_steps=bisection_steps(low, high, multiple_of),
            method=state["method"] if best else "none fits",
            trials=trials,
        )

    def bisect(best: Trial, failed_batch: int) -> BatchSizeResult:
        state["method"] = "bisection"
        lo, hi = best, failed_batch
        while hi - lo.batch > multiple_of and budget_left():
            mid = align((lo.batch + hi) // 2)
            if mid <= lo.batch or mid >= hi:
                break
            trial = run(mid)
            if trial.ok:
                lo = trial
            else:
                hi = mid
        return result(lo)

    def one_below(best: Trial, failed_batch: int) -> BatchSizeResult:
        """After the prediction failed: one step `margin` below it, then at
        most one more aimed by the line through the two largest batches
        that ran, inside the gap to the failure."""
        below = predict_batch(state["a"], state["b"], limit_bytes * (1.0 - margin), state["ratio"])
        below = align(min(failed_batch - multiple_of, below if below is not None else failed_batch - multiple_of))
        if below <= best.batch or not budget_left():
            return bisect(best, failed_batch)
        state["method"] = "prediction, one below"
        second = run(below)
        if not second.ok:
            return bisect(best, below)
        if failed_batch - second.batch > max(multiple_of, tolerance * failed_batch) and budget_left():
            a, b = fit_line([(best.batch, best.peak_allocated), (second.batch, second.peak_allocated)])
            guess = predict_batch(a, b, limit_bytes, ratio_of(second))
            if guess is not None:
                guess = align(min(guess, failed_batch - multiple_of))
                if guess > second.batch:
                    third = run(guess)
                    if third.ok:
                        return result(third)
        return result(second)

    def ratio_of(trial: Trial) -> float:
        return max(1.0, trial.peak_reserved / trial.peak_allocated) if trial.peak_allocated > 0 else 1.0

    if warmup:
        first = run(low)  # one-time allocations: optimizer state, workspaces
        if not first.ok:
            return result(None)
    small = run(low)
    if not small.ok:
        return result(None)
    if high == low:
        return result(small)
    larger = run(align(max(2 * low, low + multiple_of)))
    if not larger.ok:
        return bisect(small, larger.batch)

    # A peak that hardly grows with the batch (weights and optimizer state
    # dominate at small batches) gives no usable slope: go further out, as
    # far as the growth seen so far says is needed to see twice the signal.
    def signal(x: Trial) -> float:
        return max(1 << 20, 0.02 * x.peak_allocated)

    def slope_measurable(x: Trial, y: Trial) -> bool:
        return y.peak_allocated - x.peak_allocated >= signal(x)

    def further(x: Trial, y: Trial) -> int:
        growth = y.peak_allocated - x.peak_allocated
        if growth <= 0:
            return align(8 * y.batch)
        target = y.batch + (y.batch - x.batch) * 2.0 * signal(x) / growth
        return align(int(min(max(target, 4.0 * y.batch), 64.0 * y.batch)))

    galloped = False
    while not slope_measurable(small, larger) and larger.batch < high and budget_left():
        candidate = further(small, larger)
        if candidate <= larger.batch:
            break
        trial = run(candidate)
        if not trial.ok:
            return bisect(larger, candidate)
        small, larger = larger, trial
        galloped = True

    state["a"], state["b"] = fit_line([(small.batch, small.peak_allocated), (larger.batch, larger.peak_allocated)])
    state["ratio"] = ratio_of(larger)
    if galloped and budget_left():
        # The smaller point may still sit on the flat part, which makes the
        # slope too shallow: one more point, twice as far, if the fit says
        # it fits with room to spare.
        candidate = align(2 * larger.batch)
        expected = (state["a"] + state["b"] * candidate) * state["ratio"]
        if candidate > larger.batch and expected <= limit_bytes * (1.0 - margin):
            trial = run(candidate)
            if not trial.ok:
                return bisect(larger, candidate)
            small, larger = larger, trial
            state["a"], state["b"] = fit_line([(small.batch, small.peak_allocated),
                                               (larger.batch, larger.peak_allocated)])
            state["ratio"] = ratio_of(larger)

    best = larger
    for _ in range(3):
        guess = predict_batch(state["a"], state["b"], limit_bytes, state["ratio"])
        if guess is None:
            # No growth with the batch at all: the largest batch asked for.
            guess = high
        prediction = align(guess)
        if state["predicted"] is None:
            state["predicted"] = prediction
        if prediction <= best.batch or not budget_left():
            return result(best)
        trial = run(prediction)
        if not trial.ok:
            return one_below(best, prediction)
        previous, best = best, trial
        if best.batch >= high:
            return result(best)
        state["a"], state["b"] = fit_line([(previous.batch, previous.peak_allocated),
                                           (best.batch, best.peak_allocated)])
        state["ratio"] = ratio_of(best)
        again = predict_batch(state["a"], state["b"], limit_bytes, state["ratio"])
        if again is None or align(again) <= best.batch * (1.0 + tolerance):
            return result(best)
        state["method"] = "prediction, refined"
    return result(best)
