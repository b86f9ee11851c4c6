"""The JAX FFI handler's Python, stage by stage, on a call frame built in host memory (issue #9; not a test).

    python benchmarks/bench_handler_cpu.py [--calls N] [--args 3] [--rets 2]

No GPU and no XLA: the call frame, its buffers, its one int64 ``key`` attribute and the XLA API table
are built in host memory (:class:`ffi.HostCallFrame`, the layout XLA passes), so the handler's Python
runs exactly as under XLA, minus the launch.  ``Stream_Get`` and ``DeviceOrdinal_Get`` point at a C
function that returns 0, so their cost is the cost of a ctypes call, as under XLA.

Stages (ns per call: the best of 7 rounds of ``--calls`` calls; the machine may be shared):

* ``frame read``     - :meth:`ffi.Call.snapshot`: key, buffer addresses, stream, device ordinal; and with the
                       ordinal known (a process with one GPU, ``cudnn_target.only_device``), without its query;
* ``site lookup``    - finding the launch of the call site on the device;
* ``launch Python``  - the call site's launch up to (not including) cuDNN: the device lock, the stream
                       check, the pointer array filled in the graph's order;
* ``launch Python, replayed`` - the same call site when its addresses repeat (:mod:`cudnn_attn.engine.replay`):
                       the lock, the replay key and lookup, with the capture query and ``cudaGraphLaunch``
                       replaced by no-ops (their cost on the H200: ``bench_host.py``);
* ``handler``        - the whole registered handler (metadata check, stage check, all of the above) with
                       cuDNN's ``_execute_with_raw_ptrs`` replaced by a no-op;
* ``from a foreign thread`` - the same handler, and an empty callback, called in a C loop on a thread Python did
                       not start, as XLA's execution threads call it (``foreign_thread.py``; needs a C compiler):
                       each call with a fresh Python thread state (``ffi.keep_thread_states`` off, what ctypes
                       does by itself), and with the thread's state kept (the default, :mod:`.ffi`).

On the GPU, ``benchmarks/bench_host.py`` records the same stages inside XLA (``cudnn_target.stages``) next
to the total; the difference between this file's ``handler`` and that total is XLA's entry into Python
(the GIL and a fresh thread state per call on XLA's threads) plus the real launch.
"""

from __future__ import annotations

import argparse
import ctypes as C
import sys
import time
import types

from cudnn_attn.jax_bridge import cudnn_target, ffi


class _StubLauncher:
    """The launch's cuDNN call replaced by a no-op (the pointer array is still filled)."""

    @staticmethod
    def raw_execute(pointers: int, count: int, workspace: int, handle: int, plan_index: int) -> None:
        return None


def _plan(n_operands: int, n_results: int) -> object:
    """A :class:`cudnn_attn.engine.plan.CallPlan`-shaped object whose launch runs the real Python with a no-op cuDNN."""
    import threading
    import weakref

    from cudnn_attn.engine.launch import Launcher

    launcher = Launcher.__new__(Launcher)
    count = n_operands + n_results
    launcher._setup_fast_path(tuple(range(count))[::-1], -1, _StubLauncher.raw_execute)
    context = types.SimpleNamespace(lock=threading.Lock(), handle=types.SimpleNamespace(backend_handle=1),
                                    bind_stream=lambda stream: None, device=0,
                                    workspace=lambda stream, size: 0, capture_stream=lambda: 0,
                                    _get_current=lambda: 1, _set_current=lambda value: None, cuda_context=1)
    from cudnn_attn.engine.runtime import DeviceContext

    # the real checks, with the driver's query answered by a no-op (XLA's threads mostly have a context current)
    context.adopt_thread = DeviceContext.adopt_thread.__get__(context)
    context.release_thread = DeviceContext.release_thread.__get__(context)
    from cudnn_attn.engine.plan import CallPlan

    plan = CallPlan.__new__(CallPlan)
    plan.context, plan.launcher, plan.workspace_size = context, launcher, 256
    plan._zeroed, plan._scalars, plan._scalar_addresses = (), [], []
    plan.replays = weakref.WeakSet()
    return plan


def best_ns(fn, calls: int, rounds: int = 7) -> float:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter_ns() - start) / calls)
    return min(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--args", type=int, default=3, help="operands (forward: Q, K, V)")
    parser.add_argument("--rets", type=int, default=2, help="results incl. the workspace (forward: O, workspace)")
    options = parser.parse_args()
    from cudnn_attn.engine import replay

    key = 7
    fake = ffi.HostCallFrame(key, options.args, options.rets)
    replay.ENABLED = False                                  # the first site launches through (stub) cuDNN
    site = cudnn_target._launches[(key, 0)] = cudnn_target._site_launch(_plan(options.args, options.rets - 1), ())
    launch = site.launch
    cudnn_target.plan_holds.pin(key)                        # as XLA's instantiate stage does
    replay.ENABLED = True                                   # the second replays: CUDA calls are no-ops here
    replay._graph_launch = lambda executable, stream: None
    replay._capturing = lambda stream: False
    replay._runtime = lambda: types.SimpleNamespace(
        streamCaptureModeThreadLocal=1, streamBeginCapture=lambda s, m: None, streamEndCapture=lambda s: 1,
        graphInstantiate=lambda g: 2, graphDestroy=lambda g: None, graphExecDestroy=lambda e: None)
    replayed = cudnn_target._site_launch(_plan(options.args, options.rets - 1), ()).launch
    call = ffi.Call(fake.address)
    snapshot = call.snapshot()
    assert snapshot.key == key and snapshot.device == 0, snapshot
    handler = ffi.make_handler("bench", cudnn_target._run_eager)
    handler_fn = C.CFUNCTYPE(C.c_void_p, C.c_void_p)(handler.address)
    rows = {
        "frame read (Call.snapshot)": best_ns(call.snapshot, options.calls),
        "frame read, one GPU (snapshot(0))": best_ns(lambda: call.snapshot(0), options.calls),
        "site lookup": best_ns(lambda: cudnn_target._launches.get((key, 0)), options.calls),
        "launch Python (no cuDNN)": best_ns(lambda: launch(list(snapshot.addresses), 0, False), options.calls),
        "launch Python, replayed (no CUDA)": best_ns(lambda: replayed(list(snapshot.addresses), 0, False), options.calls),
        "handler through ctypes (no cuDNN)": best_ns(lambda: handler_fn(fake.address), options.calls),
        "empty ctypes callback": best_ns(
            lambda: _EMPTY(0), options.calls),
    }
    rows.update(foreign_thread_rows(handler.address, fake.address, options.calls))
    print(f"== handler Python per call, {options.args} args + {options.rets} results (best of 7 rounds, ns)")
    for name, ns in rows.items():
        print(f"{name:46s} {ns:8.0f}")
    return 0


_EMPTY = C.CFUNCTYPE(C.c_void_p, C.c_void_p)(lambda frame: None)


def foreign_thread_rows(handler: int, frame: int, calls: int, rounds: int = 7) -> dict:
    """The handler and an empty handler entered from new POSIX threads, thread states fresh per call and kept
    (each round a new thread: its first call is never kept, so it is not timed)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("foreign_thread", Path(__file__).with_name("foreign_thread.py"))
    caller = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(caller)
    empty = ffi.make_handler("bench_empty", lambda call: None)
    rows = {}
    try:
        for keep in (False, True):
            ffi.keep_thread_states = keep
            state = "state kept" if keep else "fresh state"
            for name, address in (("handler", handler), ("empty handler", empty.address)):
                best = min(caller.call_from_new_thread(address, frame, calls).ns_per_call for _ in range(rounds))
                rows[f"foreign thread, {state}: {name}"] = best
    except caller.Unavailable as exc:
        print(f"(no foreign-thread rows: {exc})")
    finally:
        ffi.keep_thread_states = True
    return rows

if __name__ == "__main__":
    sys.exit(main())
