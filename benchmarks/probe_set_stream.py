"""Probe (GPU): can ``cudnnSetStream`` crash once a stream the handle was bound to has been destroyed?

Why: two soaks died of SIGSEGV inside ``cudnn.set_stream`` (``DeviceContext.bind_stream``), binding the
launch handle to XLA's stream, with every use of the handle under the device lock.  The handle had been
bound to many streams before, some of which no longer existed: the CuPy streams of plan warm-ups (one new
stream per warm-up, destroyed after it) among them.  Each case below runs in its own process, so a crash
is a result (its signal), not the end of the probe:

* ``live``: the control; the handle alternates between the null stream and two live streams.
* ``dead-reset``: bound to a new stream, reset to the null stream, the stream destroyed, then bound to a live
  stream - the library's sequence for a launch on a short-lived stream.
* ``dead-direct``: the same through the public API: attention calls on a fresh CuPy stream each time (made,
  used, destroyed), between calls on a long-lived one.
* ``dead-bound``: bound to a new stream, the stream destroyed while still bound, then bound to a live one.
* ``dead-threads``: ``dead-direct`` from four threads at once, two on fresh streams, two on long-lived ones.
* ``fresh-threads``: every bind from a new thread, which has no CUDA context current.
* ``race``: see :func:`_case_race` (``--race-seconds``).  ``--wrap "cuda-gdb -batch -ex run -ex bt --args"``
  prints the native stack of a crash.

    python benchmarks/probe_set_stream.py [--cases A,B] [--iterations N] [--race-seconds S] [--json PATH]
"""
from __future__ import annotations

import argparse
import functools
import json
import signal
import subprocess
import sys
import threading
import time

CASES = ("live", "dead-reset", "dead-bound", "dead-direct", "dead-threads", "race", "fresh-threads")


def _case_live(iterations: int) -> None:
    import cudnn
    import cupy

    handle = cudnn.create_handle()
    one, two = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    for i in range(iterations):
        cudnn.set_stream(handle, (one if i % 2 else two).ptr)
        cudnn.set_stream(handle, 0)


def _case_dead(iterations: int, reset: bool) -> None:
    """A new stream bound, then destroyed - after the handle went back to the null stream (``reset``, the
    library's sequence) or while still bound - and then a live stream bound."""
    import cudnn
    import cupy

    handle = cudnn.create_handle()
    live = cupy.cuda.Stream(non_blocking=True)
    for _ in range(iterations):
        short = cupy.cuda.Stream(non_blocking=True)
        cudnn.set_stream(handle, short.ptr)
        if reset:
            cudnn.set_stream(handle, 0)
        del short                                   # cudaStreamDestroy
        cudnn.set_stream(handle, live.ptr)
        cudnn.set_stream(handle, 0)


def _case_fresh_threads(iterations: int) -> None:
    """Each ``cudnnSetStream`` from a new thread, which has no CUDA context current (the soak's workers are
    new threads every thousand calls; cuda-gdb showed two CUDA_ERROR_INVALID_CONTEXT per new thread)."""
    import cudnn
    import cupy

    handle, lock = cudnn.create_handle(), threading.Lock()
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(17)]
    without_context = []

    def first_call(index: int) -> None:
        from cuda.bindings import driver

        error, context = driver.cuCtxGetCurrent()
        without_context.append(int(context) == 0)
        with lock:
            cudnn.set_stream(handle, streams[index % len(streams)].ptr)
            cudnn.set_stream(handle, 0)

    for index in range(iterations):
        thread = threading.Thread(target=first_call, args=(index,))
        thread.start()
        thread.join()
    print(f"threads {iterations}, of which without a current CUDA context: {sum(without_context)}", flush=True)


def _case_race(seconds: float) -> None:
    """``cudnnSetStream`` hammered on a handle of its own across 17 streams and the null stream, while the
    library builds, evicts and launches graphs (a 2-graph cache, 8 shapes, 3 threads) and XLA runs the JAX
    bridge (2 threads): the soak's concurrency, with the call it died in made ten thousand times likelier."""
    import cudnn
    import cupy
    import jax
    import jax.numpy as jnp

    import cudnn_attn
    from cudnn_attn import jax_bridge as jb
    from cudnn_attn.engine.cache import GraphCache

    old = cudnn_attn.graph_cache
    small = GraphCache(2)
    for module in [m for n, m in list(sys.modules.items()) if n.startswith("cudnn_attn")]:
        if getattr(module, "graph_cache", None) is old:
            module.graph_cache = small
    stop, counts, errors = threading.Event(), {}, []
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(17)]

    def hammer() -> None:
        handle, n = cudnn.create_handle(), 0
        pointers = [p for s in streams for p in (s.ptr, 0)]
        while not stop.is_set():
            for pointer in pointers:
                cudnn.set_stream(handle, pointer)
            n += len(pointers)
        counts["set_stream"] = n

    def direct(index: int) -> None:
        rng, n = cupy.random.default_rng(index), 0
        while not stop.is_set():
            t = 64 * (1 + (n + index) % 8)
            q, k, v = (rng.standard_normal((1, t, 4, 64), dtype=cupy.float32).astype(cupy.float16) for _ in range(3))
            cudnn_attn.dot_product_attention(q, k, v, mask_type=cudnn_attn.MaskType.CAUSAL)
            n += 1
        counts[f"direct{index}"] = n

    def bridge(index: int) -> None:
        t, n = 128 * (index + 1), 0
        q = jax.random.normal(jax.random.key(index), (2, t, 4, 64), jnp.bfloat16)
        function = jax.jit(lambda q: jb.dot_product_attention(q, q, q, mask_type=cudnn_attn.MaskType.CAUSAL if index else cudnn_attn.MaskType.NO_MASK))
        while not stop.is_set():
            function(q).block_until_ready()
            n += 1
        counts[f"jax{index}"] = n

    def guarded(target, *args):
        try:
            target(*args)
        except BaseException as error:  # noqa: BLE001 -- reported by the parent
            errors.append(error)
            stop.set()

    workers = [threading.Thread(target=guarded, args=(hammer,))]
    workers += [threading.Thread(target=guarded, args=(direct, i)) for i in range(3)]
    workers += [threading.Thread(target=guarded, args=(bridge, i)) for i in range(2)]
    for worker in workers:
        worker.start()
    stop.wait(seconds)
    stop.set()
    for worker in workers:
        worker.join()
    print("calls:", counts, flush=True)
    if errors:
        raise errors[0]


def _attention_inputs(seed: int):
    import cupy

    rng = cupy.random.default_rng(seed)
    return [rng.standard_normal((1, 256, 8, 64), dtype=cupy.float32).astype(cupy.float16) for _ in range(3)]


def _direct_loop(iterations: int, fresh: bool, seed: int) -> None:
    import cupy

    import cudnn_attn

    q, k, v = _attention_inputs(seed)
    live = cupy.cuda.Stream(non_blocking=True)
    for _ in range(iterations):
        stream = cupy.cuda.Stream(non_blocking=True) if fresh else live
        with stream:
            cudnn_attn.dot_product_attention(q, k, v, mask_type=cudnn_attn.MaskType.CAUSAL)
        stream.synchronize()
        del stream


def _case_dead_direct(iterations: int) -> None:
    for _ in range(iterations // 100):
        _direct_loop(50, fresh=True, seed=0)
        _direct_loop(50, fresh=False, seed=1)


def _case_dead_threads(iterations: int) -> None:
    errors: list[BaseException] = []

    def work(index: int) -> None:
        try:
            _direct_loop(iterations // 4, fresh=index % 2 == 0, seed=index)
        except BaseException as error:  # noqa: BLE001 -- reported by the parent
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


def _run_case(name: str, iterations: int) -> None:
    import faulthandler

    faulthandler.enable()
    if name == "race":
        _case_race(float(iterations))
    else:
        {"live": _case_live, "dead-reset": functools.partial(_case_dead, reset=True),
         "dead-bound": functools.partial(_case_dead, reset=False),
         "fresh-threads": _case_fresh_threads,
         "dead-direct": _case_dead_direct, "dead-threads": _case_dead_threads}[name](iterations)
    import cupy

    cupy.cuda.Device().synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20000)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    parser.add_argument("--race-seconds", type=float, default=60.0)
    parser.add_argument("--wrap", default="", help="a command the child runs under (a debugger), split on spaces")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)   # the child process
    args = parser.parse_args()
    if args.case:
        _run_case(args.case, args.iterations)
        return 0
    rows = []
    for name in args.cases.split(","):
        start = time.perf_counter()
        amount = args.race_seconds if name == "race" else args.iterations
        try:
            child = subprocess.run([*args.wrap.split(), sys.executable, __file__, "--case", name, "--iterations",
                                    str(int(amount))],
                                   capture_output=True, text=True, timeout=args.timeout)
            code, tail = child.returncode, (child.stdout + child.stderr)[-6000:]
        except subprocess.TimeoutExpired:
            code, tail = "timeout", ""
        seconds = time.perf_counter() - start
        verdict = ("ok" if code == 0 else f"killed by {signal.Signals(-code).name}" if isinstance(code, int)
                   and code < 0 else f"exit {code}")
        rows.append({"case": name, "iterations": args.iterations, "seconds": round(seconds, 1),
                     "returncode": code, "verdict": verdict, "tail": tail})
        print(f"{name:14s} {verdict:24s} {seconds:6.1f} s", flush=True)
        if code != 0 or args.wrap or name in ("race", "fresh-threads"):
            print(tail, flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
