"""CPU-only compatibility shims for running SGLang 0.5.23 on a machine without ``sgl_kernel``.

SGLang's CPU engine imports two bookkeeping helpers from ``sgl_kernel`` at module import time.
:func:`stand_in_path` returns a directory holding a pure-torch ``sgl_kernel`` stand-in with just
those two functions; prepend it to ``PYTHONPATH`` of a server process, and only when the real
``sgl_kernel`` is absent (:func:`needs_stand_in`).
"""

from __future__ import annotations

import importlib.util
import os


def needs_stand_in() -> bool:
    return importlib.util.find_spec("sgl_kernel") is None


def stand_in_path() -> str:
    return os.path.dirname(os.path.abspath(__file__))
