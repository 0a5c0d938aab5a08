"""llama.cpp's log routed to nowhere: one callback shared by every user of the library.

Why this file exists: the in-process engine (engines/llama_cpp.py) and the MTP driver
(engines/llama_cpp_mtp.py) both load models through llama-cpp-python and must keep
llama.cpp's log off the terminal the same way, without importing each other.
"""

from __future__ import annotations

import ctypes
from typing import Any

_SILENT_LOG = []  # the ctypes callback must outlive every llama.cpp call that may log


def silence_llama_logs(llama_cpp: Any) -> None:
    """Route llama.cpp's log to nowhere (``verbose=0``).

    llama-cpp-python 0.3.36's own callback filters with the old ggml level numbers
    (WARN = 2) while its bundled llama.cpp uses the new ones (WARN = 3, which it reads as
    ERROR), so every warning reached the terminal even with ``verbose=False`` (e.g. one
    "using full-size SWA cache" per context for gemma3). Failures reach the user through
    return codes and exceptions; ``verbose=1`` shows llama.cpp's whole log.
    """
    if not _SILENT_LOG:
        _SILENT_LOG.append(llama_cpp.llama_log_callback(lambda level, text, user_data: None))
    llama_cpp.llama_log_set(_SILENT_LOG[0], ctypes.c_void_p(0))
