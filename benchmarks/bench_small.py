"""Where the time of a small attention call goes: B1 N8 T=S=256 D64 bf16 forward under ``jax.jit`` (not a test).

    python benchmarks/bench_small.py [--out OUT_DIR] [--quick] [--dry-run]

From the floor up:

* ``kernel, one launch``  - CUDA events around one raw launch of our forward plan
                            (``cudnn_attn.graph_cache.plan(config, "fwd", device)``, launched through
                            ``bench_host.raw_launch``), the GPU idle before it; median of many;
* ``kernel, back to back``- events around ``--launches`` raw launches in a row, per launch (paced by the
                            host when a raw launch costs the host more than the kernel the device: at this
                            shape it does);
* ``kernel busy (trace)`` - the sum of the GPU activities (kernels, memsets, copies) per launch, recorded by
                            CUPTI through ``torch.profiler`` (process-wide, so it sees XLA's kernels too);
* ``host: ...``           - host time per call with the GPU idle (``bench_host.host_us``): the raw launch,
                            ``CallPlan.launch``, the replayed ``CallPlan.run``, the public CuPy call;
* per JAX implementation (ours with XLA's command buffers, ours eager, ``jax.nn`` cuDNN, Tokamax Mosaic
  GPU and Triton): device time per call of a jitted chain of 64 calls (``bench_peers.measure``: CUDA events
  on XLA's stream), the GPU activities per call in that chain (CUPTI trace: how many, their busy time, the
  kernels by name) and the gap (device time - busy time: what the device waits for between activities),
  and the optimized HLO's instructions per call by opcode.

The verdict lines: the floor, a cuDNN call's own GPU work per launch (the trace's busy time: the kernel and
the memset that cuDNN's plan runs before it), which nothing on the host side can close; our custom call's
overhead (our chain's device time per call - the floor), split into other GPU work (our busy time beyond the
floor) and idle device between activities; ``jax.nn``'s cuDNN call in the same chain; the fastest peer.

Writes ``bench_small.json`` and ``bench_small.png`` into OUT_DIR and prints the breakdown table last.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import bench_peers  # noqa: E402
from bench_peers import Shape  # noqa: E402

SHAPE = Shape(1, 8, 256, 64, False)
SCALE = 1.0 / math.sqrt(SHAPE.D)
JAX_IMPLS = ("ours", "ours eager", "jax.nn cudnn", "tokamax mosaic", "tokamax triton")


@dataclass
class Line:
    what: str
    us: float | None = None
    how: str = ""
    error: str | None = None
    detail: dict = field(default_factory=dict)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


# -- the GPU activity trace (CUPTI through torch.profiler) -----------------------------------------------

def activities(fn, per: int) -> dict:
    """GPU activities of one ``fn()`` (synchronised), per ``per`` calls: ``{"count", "busy_us", "kernels"}``
    with ``kernels`` = name -> (count, us) per call, the longest first.  Raises when torch is missing."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names: dict = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if "CUDA" not in str(getattr(event, "device_type", "")):
            continue
        names[event.name][0] += 1
        names[event.name][1] += event.time_range.elapsed_us()
    kernels = {name[:90]: (round(c / per, 2), round(us / per, 2))
               for name, (c, us) in sorted(names.items(), key=lambda kv: -kv[1][1])}
    return {"count": sum(c for c, _ in kernels.values()), "busy_us": sum(us for _, us in kernels.values()),
            "kernels": dict(list(kernels.items())[:8])}


def hlo_ops(fn, inputs, per: int) -> dict:
    """Instructions of the compiled (optimized) program's entry computation, by opcode, per call; a ``call``
    (XLA's command buffers outline their commands into one) counts as the instructions of its body."""
    text = fn.lower(*inputs).compile().as_text()
    bodies = {m.group(2): m.group(3) for m in re.finditer(r"\n(ENTRY )?%?([\w.-]+) [^\n]*\{\n(.*?)\n\}", text, re.S)}
    entry = next(m.group(2) for m in re.finditer(r"\n(ENTRY) %?([\w.-]+)", text))
    ops: collections.Counter = collections.Counter()

    def count(name: str) -> None:
        for line in bodies.get(name, "").splitlines():
            op = re.search(r"=\s*(?:\([^=]*?\)|\S+)\s+([a-z][\w-]*)\(", line)
            called = re.search(r"to_apply=%?([\w.-]+)", line)
            if op and op.group(1) == "call" and called:
                count(called.group(1))
            elif op and op.group(1) != "parameter":
                ops[op.group(1)] += 1

    count(entry)
    return {op: round(n / per, 2) for op, n in ops.most_common()}


# -- the CuPy floor ------------------------------------------------------------------------------------

def cupy_lines(launches: int, calls: int) -> list[Line]:
    import bench_host
    import cupy as cp
    import ml_dtypes

    import cudnn_attn
    from cudnn_attn.core.validation import validate_call
    from cudnn_attn.engine.call import OPERAND_IDS

    rng = np.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    dims = (SHAPE.B, SHAPE.T, SHAPE.N, SHAPE.D)
    q, k, v = (cp.asarray(rng.standard_normal(dims, dtype=np.float32)).astype(bf16) for _ in range(3))
    config, _ = validate_call(q, k, v, scale=SCALE, xp=cp)
    plan = cudnn_attn.graph_cache.plan(config, "fwd", q.device.id)
    stream = cp.cuda.get_current_stream().ptr
    by_id = {OPERAND_IDS[name]: x for name, x in (("query", q), ("key", k), ("value", v))}
    results = [cp.full(spec.shape, np.nan, spec.dtype) for spec in plan.results]
    pointers = [by_id[t].data.ptr for t in plan.operand_ids] + [r.data.ptr for r in results]
    lines = []
    raw = bench_host.raw_launch(plan, pointers, stream)
    if raw is None:
        return [Line("kernel", error="the frontend has no raw launch entry point")]
    raw()
    cp.cuda.runtime.deviceSynchronize()
    want = cudnn_attn.dot_product_attention(q, k, v, scale=SCALE)
    diff = float(cp.abs(results[0].astype(cp.float32) - want.astype(cp.float32)).max())
    external = cp.cuda.ExternalStream(stream)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    alone = []
    for _ in range(200):
        cp.cuda.runtime.deviceSynchronize()
        start.record(external)
        raw()
        end.record(external)
        end.synchronize()
        alone.append(cp.cuda.get_elapsed_time(start, end) * 1e3)
    lines.append(Line("kernel, one launch (GPU idle)", statistics.median(alone), "CUDA events around one raw launch",
                      detail={"max_abs_diff_vs_public_call": diff, "plan": getattr(plan.built, "plan_name", None)}))
    rows = []
    for _ in range(5):
        start.record(external)
        for _ in range(launches):
            raw()
        end.record(external)
        end.synchronize()
        rows.append(cp.cuda.get_elapsed_time(start, end) * 1e3 / launches)
    lines.append(Line("kernel, back to back", statistics.median(rows), f"CUDA events around {launches} raw launches"))
    try:
        trace = activities(lambda: [raw() for _ in range(launches)], launches)
        lines.append(Line("kernel busy (trace)", trace["busy_us"], f"CUPTI, {trace['count']:g} activities per launch",
                          detail=trace))
    except Exception as exc:
        lines.append(Line("kernel busy (trace)", error=_error(exc)))
    public = lambda: cudnn_attn.dot_product_attention(q, k, v, scale=SCALE)  # noqa: E731
    for what, fn in (("host: raw launch", raw), ("host: CallPlan.launch", lambda: plan.launch(pointers, stream)),
                     ("host: CallPlan.launch (replayed)", lambda: plan.launch(pointers, stream)),
                     ("host: public CuPy call", public)):
        try:
            lines.append(Line(what, bench_host.host_us(fn, calls=calls, rounds=3).idle, "host clock, GPU idle"))
        except Exception as exc:
            lines.append(Line(what, error=_error(exc)))
    return lines


# -- the JAX chains ------------------------------------------------------------------------------------

def jax_lines(chain: int, rounds: int) -> list[Line]:
    events = bench_peers.StreamEvents()
    inputs = bench_peers.inputs_for(SHAPE, np.random.default_rng(1))
    lines = []
    for impl in JAX_IMPLS:
        row = bench_peers.Row(SHAPE.name, "fwd", impl, chain=chain)
        bench_peers.measure(row, SHAPE, inputs, rounds, events)
        line = Line(f"{impl}: device per call in the chain", row.device_us,
                    f"jitted chain of {chain}, {row.notes.get('timer')}", row.error,
                    {"wall_us": row.wall_us, "compile_and_first_call_s": row.notes.get("compile_and_first_call_s")})
        lines.append(line)
        if row.error:
            continue
        try:
            fn = bench_peers.program(bench_peers.attention(impl, SHAPE), "fwd", chain, None)
            jax.block_until_ready(fn(*inputs))
            trace = activities(lambda: jax.block_until_ready(fn(*inputs)), chain)
            lines.append(Line(f"{impl}: GPU busy per call (trace)", trace["busy_us"],
                              f"CUPTI, {trace['count']:g} activities per call", detail=trace))
            lines.append(Line(f"{impl}: gap per call", row.device_us - trace["busy_us"], "device - busy"))
            line.detail["hlo_ops_per_call"] = hlo_ops(fn, inputs, chain)
        except Exception as exc:
            lines.append(Line(f"{impl}: trace", error=_error(exc)))
            line.detail["traceback"] = traceback.format_exc()[-2000:]
    return lines


# -- report --------------------------------------------------------------------------------------------

def verdict(lines: list[Line]) -> list[str]:
    us = {line.what: line.us for line in lines if line.us is not None}
    detail = {line.what: line.detail for line in lines}
    floor = us.get("kernel busy (trace)")
    ours = us.get("ours: device per call in the chain")
    if floor is None or ours is None:
        return ["verdict: not enough rows measured"]
    kernels = detail["kernel busy (trace)"].get("kernels", {})
    parts = ", ".join(f"{name[:40]} {t:.2f}" for name, (_, t) in kernels.items())
    out = [f"the floor of a cuDNN call (its GPU work per launch, nothing on the host closes it): {floor:.1f} us "
           f"({parts})"]
    busy = us.get("ours: GPU busy per call (trace)")
    out.append(f"our custom call's overhead on the device: {ours - floor:.1f} us per call ({ours:.1f} in the chain "
               f"- {floor:.1f} floor)" + (f"; of it other GPU work {busy - floor:.1f} us, idle device between "
                                          f"activities {ours - busy:.1f} us" if busy is not None else ""))
    if "jax.nn cudnn: device per call in the chain" in us:
        out.append(f"jax.nn's cuDNN call in the same chain: {us['jax.nn cudnn: device per call in the chain']:.1f} us")
    peers = [(us[f"{p}: device per call in the chain"], p) for p in JAX_IMPLS[2:]
             if f"{p}: device per call in the chain" in us]
    if peers:
        best, name = min(peers)
        out.append(f"fastest peer: {name} {best:.1f} us; ours is {ours / best:.2f}x it, the floor {floor / best:.2f}x")
    return out


def table(lines: list[Line]) -> str:
    out = [f"== small-shape breakdown, {SHAPE.name} bf16 forward (us per call)",
           f"{'what':44s} {'us':>8s}  how"]
    for line in lines:
        value = f"{line.us:8.2f}" if line.us is not None else f"{'-':>8s}"
        out.append(f"{line.what:44s} {value}  {line.how}" + (f"  FAILED {line.error}" if line.error else ""))
    return "\n".join(out + verdict(lines))


def plot(lines: list[Line], path: str) -> None:
    """Per implementation, the device time per call in the chain split into GPU busy time and idle device, beside
    cuDNN's own GPU work per launch (the floor)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    us = {line.what: line.us for line in lines if line.us is not None}
    names = [impl for impl in JAX_IMPLS if f"{impl}: device per call in the chain" in us]
    busy = [us.get(f"{impl}: GPU busy per call (trace)", 0.0) for impl in names]
    total = [us[f"{impl}: device per call in the chain"] for impl in names]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(names, busy, label="GPU busy (CUPTI)")
    ax.bar(names, [t - b for t, b in zip(total, busy)], bottom=busy, label="idle device (gap)")
    if "kernel busy (trace)" in us:
        ax.axhline(us["kernel busy (trace)"], color="black", linewidth=0.8, label="cuDNN's GPU work per launch")
    ax.set_ylabel("us per call in a jitted chain")
    ax.set_title(f"{SHAPE.name} bf16 forward")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="fewer launches and rounds")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: the table's rows, not measured")
    parser.add_argument("--chain", type=int, default=64, help="calls per jitted chain")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    launches, calls, rounds = (100, 200, 3) if args.quick else (400, 1000, 5)
    started = time.monotonic()
    lines: list[Line] = []
    if args.dry_run:
        lines = [Line(what, error="not run (--dry-run)") for what in
                 ("kernel, one launch (GPU idle)", "kernel, back to back", "kernel busy (trace)")]
        lines += [Line(f"{impl}: device per call in the chain", error="not run (--dry-run)") for impl in JAX_IMPLS]
    else:
        for part in (lambda: cupy_lines(launches, calls), lambda: jax_lines(args.chain, rounds)):
            try:
                lines += part()
            except Exception as exc:                  # one side failing must not hide the other
                lines.append(Line("part failed", error=_error(exc), detail={"traceback": traceback.format_exc()}))
    with open(os.path.join(args.out, "bench_small.json"), "w") as f:
        json.dump({"shape": SHAPE.name, "dry_run": args.dry_run, "seconds": round(time.monotonic() - started, 1),
                   "lines": [asdict(line) for line in lines]}, f, indent=1)
    if not args.dry_run:
        try:
            plot(lines, os.path.join(args.out, "bench_small.png"))
        except Exception as exc:            # matplotlib missing: the JSON and the table still stand
            print(f"no plot: {type(exc).__name__}: {exc}")
    for line in lines:                      # the kernels behind each busy time, before the table
        if "kernels" in line.detail:
            print(f"{line.what}: " + "; ".join(f"{n} x{c:g} {us:.2f} us" for n, (c, us) in line.detail["kernels"].items()))
        if "hlo_ops_per_call" in line.detail:
            print(f"{line.what.split(':')[0]}: HLO ops per call {line.detail['hlo_ops_per_call']}")
    print()
    print(table(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
