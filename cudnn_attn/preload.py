"""Importing the cuDNN frontend in the background, while the caller sets up its arrays.

``import cudnn`` (the frontend's Python package, its compiled module and ``libcudnn``) costs 44-50 ms on
the H200's host.  ``import cudnn_attn`` leaves it out (its own import stays well under 250 ms), so the
first call of a new process would pay it.  Almost every program does something slow between the two:
import CuPy or JAX, create the CUDA context, fill its inputs.  :func:`start` (called at the end of
``import cudnn_attn``) imports ``cudnn`` on a thread meanwhile; the first call's own ``import cudnn`` then
finds it done, or waits for the rest of it.

Safety:

* **Imports.**  The thread imports ``cudnn`` and nothing else of ours.  The standard-library modules
  the frontend's package imports at module level are imported first, on the caller's thread, so the two
  threads never wait for each other's module locks.  A failed import on the thread is dropped: the
  first call imports ``cudnn`` again and raises the error there, with its own traceback.
* **fork().**  A ``fork()`` while the thread holds an import lock or the dynamic loader's lock would leave
  the child waiting for a thread that does not exist there.  :func:`wait` runs before every ``fork()``
  (``os.register_at_fork``) and waits for the import to end first (it takes tens of milliseconds, once).
* **Exit.**  The thread is not a daemon: a process that exits right after ``import cudnn_attn`` waits for
  the import to end rather than unloading libraries under it.

What it buys (``benchmarks/bench_first_call.py``, H200, two runs): the first call from a plan in the store
took 55.6 / 68.5 ms with it against 76.9 / 87.0 ms without, and ``import cudnn_attn`` 5-24 ms longer.  The
import holds the GIL for most of its length (the caller's thread was stalled for 34 of its 37 ms on a 2-core
CPU), so it overlaps only what the caller does outside the GIL: import + setup + first call came to 747 / 840 ms
with it and 766 / 825 ms without, no difference beyond the noise.  It moves the cost out of the first call; it
does not remove it.

``CUDNN_ATTN_PRELOAD=0`` turns it off (read at import).
"""

from __future__ import annotations

import os
import sys
import threading

from .env import flag

ENV_VAR = "CUDNN_ATTN_PRELOAD"
ENABLED = flag(ENV_VAR, default=True)

# What cudnn/__init__.py and the modules it imports at load time take from the standard library (frontend
# 1.32.0), imported on the caller's thread before the thread starts.
_STDLIB = ("atexit", "contextlib", "ctypes", "dataclasses", "enum", "functools", "glob", "importlib", "logging",
           "re", "sysconfig", "threading", "typing", "warnings", "weakref")

_thread: threading.Thread | None = None
_lock = threading.Lock()
_registered = False


def start() -> bool:
    """Start importing ``cudnn`` on a background thread, unless it is imported (or being imported) already
    or :data:`ENABLED` is off.  Returns whether a thread was started."""
    global _thread, _registered
    if not ENABLED or "cudnn" in sys.modules:
        return False
    with _lock:
        if _thread is not None:
            return False
        import importlib

        for name in _STDLIB:
            importlib.import_module(name)
        if not _registered and hasattr(os, "register_at_fork"):
            os.register_at_fork(before=wait)
            _registered = True
        _thread = threading.Thread(target=_import, name="cudnn_attn-preload")
        _thread.start()
    return True


def _import() -> None:
    try:
        import cudnn  # noqa: F401
    except BaseException:            # the caller's own import raises it again, with its traceback
        pass


def wait() -> None:
    """Wait until the background import (if any) has ended; a no-op on the thread itself."""
    thread = _thread
    if thread is not None and thread is not threading.current_thread() and thread.is_alive():
        thread.join()


def running() -> bool:
    """Whether the background import is still under way."""
    thread = _thread
    return thread is not None and thread.is_alive()
