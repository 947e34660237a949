"""The text table behind streamalloc.memory_summary().

It reads a stats dictionary (torch.cuda.memory_stats()'s keys plus
streamalloc's "fragmentation.*" keys) and needs neither torch nor a GPU, so
its layout is tested anywhere.
"""

from __future__ import annotations

from typing import Mapping

_WIDTH = 83  # the width of a metric row
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

# (stats key prefix, row title, whether the values are bytes)
_POOLED_METRICS = (
    ("allocated_bytes", "Allocated memory", True),
    ("active_bytes", "Active memory", True),
    ("requested_bytes", "Requested memory", True),
    ("reserved_bytes", "GPU reserved memory", True),
    ("inactive_split_bytes", "Non-releasable memory", True),
    ("allocation", "Allocations", False),
    ("active", "Active allocs", False),
    ("segment", "GPU reserved segments", False),
    ("inactive_split", "Non-releasable allocs", False),
)
_PLAIN_METRICS = (
    ("oversize_allocations", "Oversize allocations"),
    ("oversize_segments", "Oversize GPU segments"),
)
_COLUMNS = ("current", "peak", "allocated", "freed")


def format_bytes(count: float) -> str:
    """1536 -> "1.50 KiB"; exact below 1 KiB."""
    value = float(count)
    if abs(value) < 1024:
        return f"{int(value)} B"
    unit = 0
    while abs(value) >= 1024 and unit + 1 < len(_UNITS):
        value /= 1024
        unit += 1
    return f"{value:.2f} {_UNITS[unit]}"


def _format_count(count: float) -> str:
    return f"{int(count):,}"


def _row(title: str, cells) -> str:
    return f"| {title:<24}|" + "|".join(f"{cell:>12} " for cell in cells) + "|"


def _rule(char: str) -> str:
    return "|" + char * (_WIDTH - 2) + "|"


def _line(text: str) -> str:
    return f"| {text:<{_WIDTH - 4}} |"


def format_summary(stats: Mapping[str, float], device: int, abbreviated: bool = False) -> str:
    """A table like torch.cuda.memory_summary() for one device's stats, with
    streamalloc's fragmentation metrics at the end."""
    lines = [
        _rule("="),
        _line(f"streamalloc CUDA memory summary, device {device}".center(_WIDTH - 4)),
        _rule("-"),
        _line(
            f"OOMs: {_format_count(stats.get('num_ooms', 0))}   "
            f"allocation retries: {_format_count(stats.get('num_alloc_retries', 0))}   "
            f"segments created: {_format_count(stats.get('num_device_alloc', 0))}   "
            f"released: {_format_count(stats.get('num_device_free', 0))}"
        ),
        _rule("="),
        _row("Metric", ("Current", "Peak", "Total added", "Total freed")),
    ]
    pools = [("all", None)]
    if not abbreviated:
        pools += [("large_pool", "  from large pool"), ("small_pool", "  from small pool")]
    for prefix, title, is_bytes in _POOLED_METRICS:
        lines.append(_rule("-"))
        render = format_bytes if is_bytes else _format_count
        for pool, pool_title in pools:
            values = [stats.get(f"{prefix}.{pool}.{column}", 0) for column in _COLUMNS]
            lines.append(_row(pool_title or title, [render(v) for v in values]))
    lines.append(_rule("-"))
    for prefix, title in _PLAIN_METRICS:
        values = [stats.get(f"{prefix}.{column}", 0) for column in _COLUMNS]
        lines.append(_row(title, [_format_count(v) for v in values]))
    lines.append(_rule("-"))

    largest = stats.get("fragmentation.largest_free_block_bytes", 0)
    free_cached = stats.get("fragmentation.free_cached_bytes", 0)
    external = stats.get("fragmentation.external", 0.0)
    ratio = stats.get("fragmentation.reserved_allocated_ratio", 0.0)
    lines += [
        _line("Fragmentation"),
        _line(f"  Largest free cached block     {format_bytes(largest):>12}"),
        _line(f"  Free cached memory            {format_bytes(free_cached):>12}"),
        _line(f"  External fragmentation        {external:>12.3f}   (1 - largest / free cached)"),
        _line(f"  Reserved / allocated          {ratio:>12.3f}   (0 when nothing is allocated)"),
        _rule("="),
    ]
    return "\n".join(lines) + "\n"
