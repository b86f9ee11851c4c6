"""Calling a C function pointer from a thread Python did not start, as XLA calls an FFI handler (a test helper).

XLA runs custom-call handlers on its own execution threads.  A Python handler (a ctypes callback) entered there
finds no Python thread state: ctypes' ``PyGILState_Ensure`` makes one for the call and deletes it on return,
unless the handler keeps it (:mod:`cudnn_attn.jax_bridge.ffi`).  Python cannot start such a thread itself, so
this module compiles a few lines of C (with ``$CC``, ``cc`` or ``gcc``, once per process, into a temporary
folder) that start a POSIX thread and call the pointer from it ``calls`` times in a loop, timing the loop with
the monotonic clock.  Used by ``tests/test_jax_ffi.py``.
"""

from __future__ import annotations

import ctypes as C
import functools
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

_SOURCE = r"""
#include <pthread.h>
#include <time.h>

typedef void *(*entry_t)(void *);
struct job { entry_t fn; void *arg; long calls; long nonzero; double ns; };

static void *run(void *p) {
    struct job *j = p;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < j->calls; i++)
        if (j->fn(j->arg)) j->nonzero++;
    clock_gettime(CLOCK_MONOTONIC, &b);
    j->ns = ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / (j->calls ? j->calls : 1);
    return 0;
}

/* calls fn(arg) `calls` times on a new thread; the number of non-NULL returns, the ns per call */
int call_from_new_thread(entry_t fn, void *arg, long calls, long *nonzero, double *ns) {
    pthread_t thread;
    struct job j = {fn, arg, calls, 0, 0.0};
    int error = pthread_create(&thread, 0, run, &j);
    if (error) return error;
    error = pthread_join(thread, 0);
    *nonzero = j.nonzero;
    *ns = j.ns;
    return error;
}
"""


class Run(NamedTuple):
    nonzero: int          # calls that returned non-NULL (an XLA_FFI_Error*, for a handler)
    ns_per_call: float


class Unavailable(RuntimeError):
    """No C compiler, or building the caller failed."""


@functools.lru_cache(maxsize=None)
def _library() -> C.CDLL:
    from cudnn_attn.graphs.driver_stub import c_compiler

    compiler = c_compiler()
    if compiler is None:
        raise Unavailable("calling from a foreign thread needs a C compiler ($CC, cc or gcc)")
    folder = Path(tempfile.mkdtemp(prefix="cudnn_attn-foreign-thread-"))
    (folder / "caller.c").write_text(_SOURCE)
    try:
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(folder / "caller.so"), str(folder / "caller.c"),
                        "-lpthread"], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise Unavailable(f"building the foreign-thread caller failed: {exc} "
                          f"{getattr(exc, 'stderr', b'').decode(errors='replace')}") from exc
    library = C.CDLL(str(folder / "caller.so"))
    library.call_from_new_thread.argtypes = [C.c_void_p, C.c_void_p, C.c_long, C.POINTER(C.c_long),
                                             C.POINTER(C.c_double)]
    library.call_from_new_thread.restype = C.c_int
    return library


def call_from_new_thread(function: int, argument: int | None, calls: int) -> Run:
    """Call the C function at address ``function`` (``void *(*)(void *)``) with ``argument`` ``calls`` times from
    one new POSIX thread, and wait for it (the GIL is released meanwhile: ctypes' CDLL)."""
    nonzero, ns = C.c_long(), C.c_double()
    error = _library().call_from_new_thread(function, argument, calls, C.byref(nonzero), C.byref(ns))
    if error:
        raise OSError(error, "pthread_create/pthread_join failed")
    return Run(nonzero.value, ns.value)
