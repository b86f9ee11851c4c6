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
* ``dead-threads``: ``dead-direct`` from four threads at once, two on fresh streams, two on long-lived ones.

    python benchmarks/probe_set_stream.py [--iterations N] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time

CASES = ("live", "dead-reset", "dead-direct", "dead-threads")


def _case_live(iterations: int) -> None:
    import cudnn
    import cupy

    handle = cudnn.create_handle()
    one, two = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    for i in range(iterations):
        cudnn.set_stream(handle, (one if i % 2 else two).ptr)
        cudnn.set_stream(handle, 0)


def _case_dead_reset(iterations: int) -> None:
    import cudnn
    import cupy

    handle = cudnn.create_handle()
    live = cupy.cuda.Stream(non_blocking=True)
    for _ in range(iterations):
        short = cupy.cuda.Stream(non_blocking=True)
        cudnn.set_stream(handle, short.ptr)
        cudnn.set_stream(handle, 0)
        del short                                   # cudaStreamDestroy
        cudnn.set_stream(handle, live.ptr)
        cudnn.set_stream(handle, 0)


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
    {"live": _case_live, "dead-reset": _case_dead_reset, "dead-direct": _case_dead_direct,
     "dead-threads": _case_dead_threads}[name](iterations)
    import cupy

    cupy.cuda.Device().synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20000)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--json")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)   # the child process
    args = parser.parse_args()
    if args.case:
        _run_case(args.case, args.iterations)
        return 0
    rows = []
    for name in CASES:
        start = time.perf_counter()
        try:
            child = subprocess.run([sys.executable, __file__, "--case", name, "--iterations", str(args.iterations)],
                                   capture_output=True, text=True, timeout=args.timeout)
            code, tail = child.returncode, (child.stdout + child.stderr)[-3000:]
        except subprocess.TimeoutExpired:
            code, tail = "timeout", ""
        seconds = time.perf_counter() - start
        verdict = ("ok" if code == 0 else f"killed by {signal.Signals(-code).name}" if isinstance(code, int)
                   and code < 0 else f"exit {code}")
        rows.append({"case": name, "iterations": args.iterations, "seconds": round(seconds, 1),
                     "returncode": code, "verdict": verdict, "tail": tail if code != 0 else ""})
        print(f"{name:14s} {verdict:24s} {seconds:6.1f} s", flush=True)
        if code != 0:
            print(tail, flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump(rows, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
