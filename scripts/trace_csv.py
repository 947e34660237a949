"""Allocation traces as files (shared/traces/README.md), for the project's
Python tools: a CSV file, gzip'd or plain, whose header names the columns
action, addr, size and stream (in any order; other columns are ignored),
one event a line. Lines of actions the format does not name are skipped
and counted, as streamalloc-replay does. Also the two rules a trace
recorded mid-run needs and the one for a trace without free_completed
lines, the same as streamalloc-replay's (tools/recording_start.cpp,
tools/trace_replay.cpp, tools/requested_frees.cpp).
"""

import csv
import gzip

COLUMNS = ("action", "addr", "size", "stream")
# The actions of torch's TraceEntry.
KNOWN_ACTIONS = frozenset({
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "oom",
    "snapshot",
})
GROWS = ("segment_alloc", "segment_map")
SHRINKS = ("segment_free", "segment_unmap")


class TraceFormatError(ValueError):
    """A file that is not a trace: `path:line: reason`."""


def open_for_reading(path):
    """Text stream of `path`, gzip'd or plain (told by the magic bytes)."""
    with open(path, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    # utf-8-sig: a byte order mark before the header, as spreadsheet programs write, is not part of it.
    if gzipped:
        return gzip.open(path, "rt", newline="", encoding="utf-8-sig")
    return open(path, newline="", encoding="utf-8-sig")


def open_for_writing(path):
    """Text stream to `path`, gzip'd when its name ends in .gz."""
    return gzip.open(path, "wt", newline="") if path.endswith(".gz") else open(path, "w", newline="")


def column_positions(header, path):
    """Where `header` (a list of names) puts action, addr, size and stream;
    names compare without surrounding spaces and letter case."""
    names = [name.strip().lower() for name in header]
    positions = []
    for column in COLUMNS:
        found = [i for i, name in enumerate(names) if name == column]
        if len(found) > 1:
            raise TraceFormatError(f"{path}:1: the header names column '{column}' twice")
        if not found:
            raise TraceFormatError(
                f"{path}:1: expected header '{','.join(COLUMNS)}' (those columns in any order; others are "
                f"ignored), found '{','.join(header)}', which lacks '{column}'")
        positions.append(found[0])
    return tuple(positions)


HEX_DIGITS = frozenset("0123456789abcdefABCDEF")


def whole_number(text):
    """int of `text`: decimal digits, also when written as a float with no
    fraction ("1024.0", as pandas writes an integer column that has an
    empty cell), or hexadecimal digits after 0x (how pointers and stream
    handles are often printed)."""
    if text[:2] in ("0x", "0X") and len(text) > 2:
        if not HEX_DIGITS.issuperset(text[2:]):
            raise ValueError(text)
        return int(text[2:], 16)
    whole, dot, fraction = text.partition(".")
    if not (whole.isascii() and whole.isdigit()) or (dot and (not fraction or fraction.strip("0"))):
        raise ValueError(text)
    return int(whole)


def read_events(path, actions):
    """(events, lines, skipped) of the trace at `path`: the (action, addr,
    size, stream) tuples of its lines whose action is in `actions`, in
    order; how many lines follow the header; {action: lines} of the
    actions the format does not name, which are skipped."""
    events = []
    skipped = {}
    lines = 0
    with open_for_reading(path) as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise TraceFormatError(f"{path}:1: empty trace: expected header '{','.join(COLUMNS)}'")
        a, b, c, d = column_positions(header, path)
        width = len(header)
        for row in reader:
            lines += 1
            if len(row) != width:
                raise TraceFormatError(f"{path}:{lines + 1}: expected {width} columns, found {len(row)}")
            action = row[a]
            if action in actions:
                try:
                    events.append((action, whole_number(row[b]), whole_number(row[c]), whole_number(row[d])))
                except ValueError:
                    raise TraceFormatError(f"{path}:{lines + 1}: addr, size and stream must be numbers") from None
            elif action not in KNOWN_ACTIONS:
                skipped[action] = skipped.get(action, 0) + 1
    return events, lines, skipped


def free_at_requests_without_completions(events):
    """(events, n): when `events` hold free_requested events and no
    free_completed, each free_requested becomes a free_completed (n of
    them); else `events` as they are and 0. torch records a free at the
    request and again when the block can be used again, and replay frees at
    the second; a trace whose writer kept only the first would otherwise
    never free a block (as streamalloc-replay, tools/requested_frees.hpp)."""
    if any(action == "free_completed" for action, *_ in events):
        return events, 0
    converted = [("free_completed", *rest) if action == "free_requested" else (action, *rest)
                 for action, *rest in events]
    return converted, sum(1 for action, *_ in events if action == "free_requested")


def describe_skipped(skipped):
    """'3 lines of actions the trace format does not name: x (2), y (1)'."""
    total = sum(skipped.values())
    names = ", ".join(f"{name} ({count})" for name, count in skipped.items())
    return f"{total} line{'' if total == 1 else 's'} of actions the trace format does not name: {names}"


def allocations_before_recording(events):
    """The alloc events to put before `events` ((action, addr, size, stream)
    tuples) for the blocks freed before any alloc or free_completed of their
    address: they were allocated before recording began. Only an address's
    first appearance counts, so a double free stays a double free."""
    seen = set()
    earlier = []
    for action, addr, size, stream in events:
        if action == "alloc":
            seen.add(addr)
        elif action == "free_completed" and addr not in seen:
            seen.add(addr)
            earlier.append(("alloc", addr, size, stream))
    return earlier


def with_allocations_before_recording(events):
    """`events` with allocations_before_recording put first."""
    earlier = allocations_before_recording(events)
    return earlier + events if earlier else events


def native_figures(events, curve=None):
    """(peak live bytes, native peak reserved, native reserved before
    recording began) of `events`, allocations before recording included.
    Native's figures are 0 without segment events; what it reserved before
    recording is the least that holds every live byte at every event (0
    for a trace recorded from the start), and its peak includes it. When
    `curve` is a list, (live bytes, native reserved) is appended to it at
    every alloc and free_completed."""
    live = {}
    live_bytes = peak_live = reserved = peak_reserved = before = 0
    recorded = False  # any segment event
    start = len(curve) if curve is not None else 0
    for action, addr, size, _ in events:
        if action == "alloc":
            live[addr] = size
            live_bytes += size
            peak_live = max(peak_live, live_bytes)
            if curve is not None:
                curve.append((live_bytes, reserved))
        elif action == "free_completed":
            live_bytes -= live.pop(addr, 0)
            if curve is not None:
                curve.append((live_bytes, reserved))
        elif action in GROWS:
            recorded = True
            reserved += size
            peak_reserved = max(peak_reserved, reserved)
        elif action in SHRINKS:
            recorded = True
            reserved -= size
        before = max(before, live_bytes - reserved)
    if not recorded:
        return peak_live, 0, 0
    if curve is not None and before:
        curve[start:] = [(lb, r + before) for lb, r in curve[start:]]
    return peak_live, before + peak_reserved, before
