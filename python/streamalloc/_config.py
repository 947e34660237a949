"""streamalloc's configuration without torch or CUDA: the key table and the
STREAMALLOC_CONF parser of the C++ core, reached through ctypes in
libstreamalloc_config.so (python/src/config_c_api.h). There is no second
copy of the rules in Python, so the two cannot disagree.

STREAMALLOC_CONFIG_LIBRARY, when set, names the library to load (the tests
point it at a particular build)."""

import ctypes
import os
import threading
from typing import List, Optional, Tuple

from . import _libraries

LIBRARY_NAME = "libstreamalloc_config.so"

_lock = threading.Lock()
_library: Optional[ctypes.CDLL] = None


def _load() -> ctypes.CDLL:
    global _library
    with _lock:
        if _library is None:
            path = os.environ.get("STREAMALLOC_CONFIG_LIBRARY") or _libraries.find(LIBRARY_NAME)
            if path is None:
                raise RuntimeError(_libraries.missing_message(LIBRARY_NAME, "streamalloc's configuration"))
            library = ctypes.CDLL(path)
            library.streamalloc_config_version.restype = ctypes.c_char_p
            library.streamalloc_config_version.argtypes = []
            library.streamalloc_config_keys.restype = ctypes.c_char_p
            library.streamalloc_config_keys.argtypes = []
            library.streamalloc_config_resolve.restype = ctypes.c_int
            library.streamalloc_config_resolve.argtypes = [
                ctypes.c_char_p,
                ctypes.c_char_p,
                ctypes.POINTER(ctypes.c_char_p),
            ]
            _library = library
        return _library


def key_table() -> List[Tuple[str, str, str]]:
    """(key, default, description) for every key, in the key table's order."""
    text = _load().streamalloc_config_keys().decode()
    return [tuple(line.split("\t", 2)) for line in text.splitlines()]


def resolve(text: str, torch_settings: str = "") -> str:
    """Every key with its value once `text` (STREAMALLOC_CONF syntax) is
    applied over the keys `torch_settings` (torch's allocator variable)
    shares with streamalloc, over the defaults; ValueError names a bad key
    or value."""
    result = ctypes.c_char_p()
    status = _load().streamalloc_config_resolve(torch_settings.encode(), text.encode(), ctypes.byref(result))
    message = (result.value or b"").decode()
    if status != 0:
        raise ValueError(message)
    return message


def library_version() -> str:
    return _load().streamalloc_config_version().decode()
