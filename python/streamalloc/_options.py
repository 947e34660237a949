"""Turns install()'s keyword options into STREAMALLOC_CONF syntax.

Only the spelling happens here; which keys exist and what values they take
is checked once, by the C++ parser, so the two can never disagree.
"""

from __future__ import annotations

from typing import Any, Mapping


def _format_value(key: str, value: Any) -> str:
    # bool first: it is also an int, and the parser wants True/False.
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return value
    raise TypeError(
        f"streamalloc option {key}={value!r}: expected a bool, a number or a string, "
        f"got {type(value).__name__}"
    )


def to_conf_string(options: Mapping[str, Any]) -> str:
    """Renders ``{"max_split_size_mb": 256, "cross_stream_reuse": False}`` as
    ``"max_split_size_mb:256,cross_stream_reuse:False"``, keeping the order."""
    parts = []
    for key, value in options.items():
        if not key or any(separator in key for separator in ",: "):
            raise ValueError(f"streamalloc option name {key!r} is not a valid STREAMALLOC_CONF key")
        parts.append(f"{key}:{_format_value(key, value)}")
    return ",".join(parts)
