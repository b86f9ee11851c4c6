"""Importing the cuDNN frontend and loading cuDNN's engine libraries in the background, while the caller sets up.

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

**cuDNN's engine libraries.**  ``import cudnn`` loads only ``libcudnn.so.9``, a dispatcher.  The libraries an
attention plan runs from (``libcudnn_graph``, ``_heuristic``, ``_engines_precompiled``,
``_engines_runtime_compiled``: 340 MB of code) load at the first handle or plan, and on the first call from the
plan store that was most of the "deserialize" stage (25.9-34.5 ms of a 50-69 ms call on the H200).  On a 2-core CPU, deserializing a stored plan took 46-61 ms without them loaded and 13-18 ms with
them (deviceless, the rest being the device-properties object).  So after the import the thread loads them too
(:func:`load_engine_libraries`), through libc's ``dlopen`` called by ``ctypes``, which releases the GIL: unlike
the import, this part overlaps the caller's setup.  cuDNN's own later ``dlopen`` of the same sonames finds them
loaded.  It is done only where an NVIDIA driver is present (``/dev/nvidiactl``): elsewhere nothing could run
on them.  ``CUDNN_ATTN_PRELOAD_ENGINES=0`` leaves the libraries to cuDNN (the frontend is still imported).

``CUDNN_ATTN_PRELOAD=0`` turns both off (read at import).
"""

from __future__ import annotations

import os
import sys
import threading
import time

from cudnn_attn.core import settings

ENV_VAR = settings.PRELOAD
ENGINES_ENV_VAR = settings.PRELOAD_ENGINES

# The libraries an SDPA plan loads (next to libcudnn.so.*, same suffix), in dependency order: measured with the
# process's memory map around a deserialization (cuDNN 9.19; ops, cnn and adv are not used).
ENGINE_LIBRARIES = ("libcudnn_graph", "libcudnn_heuristic", "libcudnn_engines_precompiled",
                    "libcudnn_engines_runtime_compiled")
_DRIVER_DEVICE = "/dev/nvidiactl"

engines_loaded: tuple[str, ...] = ()     # paths the thread loaded, in order
engines_seconds: float | None = None     # how long loading them took (None: not attempted)

# What cudnn/__init__.py and the modules it imports at load time take from the standard library (frontend
# 1.32.0), imported on the caller's thread before the thread starts.
_STDLIB = ("atexit", "contextlib", "ctypes", "dataclasses", "enum", "functools", "glob", "importlib", "logging",
           "re", "sysconfig", "threading", "typing", "warnings", "weakref")

_thread: threading.Thread | None = None
_lock = threading.Lock()
_registered = False


def start() -> bool:
    """Start importing ``cudnn`` on a background thread, unless it is imported (or being imported) already
    or ``settings.current.preload`` is off.  Returns whether a thread was started."""
    global _thread, _registered
    if not settings.current.preload or "cudnn" in sys.modules:
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
    global engines_loaded, engines_seconds
    try:
        import cudnn  # noqa: F401
    except BaseException:            # the caller's own import raises it again, with its traceback
        return
    if settings.current.preload_engines and os.path.exists(_DRIVER_DEVICE):
        start = time.perf_counter()
        engines_loaded = load_engine_libraries()
        engines_seconds = time.perf_counter() - start


def cudnn_library_path(maps: str = "/proc/self/maps") -> str | None:
    """The file of the ``libcudnn.so.*`` this process has loaded (``None``: none, or no ``/proc``)."""
    try:
        with open(maps) as lines:
            for line in lines:
                fields = line.rstrip("\n").split(maxsplit=5)
                if len(fields) == 6 and os.path.basename(fields[5]).startswith("libcudnn.so."):
                    return fields[5]
    except OSError:
        pass
    return None


def _dlopen():
    """libc's ``dlopen`` as a ``ctypes`` function (called without the GIL), or ``None``."""
    import ctypes

    for library in (None, "libdl.so.2"):
        try:
            function = ctypes.CDLL(library).dlopen
        except (OSError, AttributeError):
            continue
        function.restype, function.argtypes = ctypes.c_void_p, (ctypes.c_char_p, ctypes.c_int)
        return function
    return None


def load_engine_libraries(library: str | None = None) -> tuple[str, ...]:
    """``dlopen`` (lazy binding, local symbols, the GIL released) the :data:`ENGINE_LIBRARIES` next to
    ``library`` (default :func:`cudnn_library_path`), with its suffix (``.so.9``, or ``.so.9.19.0`` for a
    system install).  Returns the paths that loaded; a missing or failing one is skipped (cuDNN reports it
    itself when it needs it).  The handles are never closed: cuDNN keeps the libraries for the process."""
    library = library or cudnn_library_path()
    dlopen = _dlopen() if library is not None else None
    if dlopen is None:
        return ()
    folder, name = os.path.split(library)
    suffix = name[len("libcudnn"):]
    loaded = []
    for stem in ENGINE_LIBRARIES:
        path = os.path.join(folder, stem + suffix)
        if os.path.exists(path) and dlopen(os.fsencode(path), os.RTLD_LAZY | os.RTLD_LOCAL):
            loaded.append(path)
    return tuple(loaded)


def wait() -> None:
    """Wait until the background import (if any) has ended; a no-op on the thread itself."""
    thread = _thread
    if thread is not None and thread is not threading.current_thread() and thread.is_alive():
        thread.join()


def running() -> bool:
    """Whether the background import is still under way."""
    thread = _thread
    return thread is not None and thread.is_alive()
