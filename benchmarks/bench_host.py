"""Host time per attention call at a cache hit, every layer side by side (not a test).

    python benchmarks/bench_host.py [--out OUT_DIR] [--quick]

Shape: bf16 B=1 N=8 T=S=256 H=64 (small enough that the host, not the GPU, sets the pace), forward in
inference mode and backward.  Rows, from the whole public call down to the floor:

* ``public``          - ``cudnn_attn.dot_product_attention`` / ``dot_product_attention_bwd`` (CuPy arrays);
* ``bound``           - a pre-bound call, ``cudnn_attn.bind(...)`` then ``bound(q, k, v)`` / ``bound.backward``;
* ``... (no replay)`` - the same with the plans' CUDA-graph replay switched off (:mod:`cudnn_attn.engine.replay`): the
                        loop passes the same addresses every call, so by default the launches are replays;
* ``plan.launch (replayed)`` / ``cudaGraphLaunch`` / ``stream capture query`` - the replayed launch alone, the
                        CUDA call it ends in, and the capture-status query it makes first;
* ``  public stage``, ``  bound stage``, ``  stage`` - the parts of the public and bound calls, each timed
                        alone: the signature key and its lookup, the bound call's array check, the device
                        and stream queries, the results' allocation (one pool allocation for several
                        results) against one ``cupy.empty`` per result;
* ``plan.launch``     - the call plan's launch alone (results preallocated): lock, stream, pointers, launch;
* ``raw launch``      - the frontend's private ``_execute_with_raw_ptrs`` with a prefilled pointer array:
                        the floor of any launch through cuDNN's backend (variant pack + ``cudnnBackendExecute``);
* ``frontend execute``- the public ``pygraph.execute(pointers, workspace, handle=, tensor_uids=)``;
* ``cupy elementwise``- ``cupy.multiply(x, 2.0, out=o)`` (float32, as many elements as Q): one CuPy kernel launch, the host's speed in CuPy's terms;
* ``torch``           - ``torch.nn.functional.scaled_dot_product_attention`` with the cuDNN backend
                        (backward: autograd's fwd+bwd minus the fwd);
* ``jax handler``     - our XLA FFI handler per run, timed from outside with the host clock: a jitted chain
                        with ``cuda_graph=False`` (the eager target, which XLA runs at every call) is called
                        without waiting for its results, and the empty jitted program's dispatch (its own
                        row) is subtracted, per call; XLA's cost per custom call is included.  The training
                        forward (``fwd, training``: a chain of ``jax.vjp`` primals) is timed alone, and the
                        backward is the fwd+bwd chain's time less it;
* ``jax jit call``    - wall time per call of a jitted chain of 16 calls, XLA's command buffers on (default)
                        and off, and ``jax.nn.dot_product_attention(implementation="cudnn")`` for comparison;
* ``(one call, GPU idle)`` - the handler in a program of one call (fwd, or fwd then bwd), each run after the GPU
                        drained: its idle-GPU column compares with the CuPy rows' (in the chains every launch
                        goes into a busy stream, where even ``cudaGraphLaunch`` takes twice as long).

Host time, two ways, host clock, median of ``rounds``:

* **idle GPU** (the targets' measure): each call timed alone, the device synchronised before it (not timed),
  so the launch queue is empty - what the call itself costs the host;
* **back-to-back**: ``calls`` calls in a loop without synchronisation.  At this shape the forward kernel runs
  about 8 us, so anything cheaper is paced by the GPU here (a replayed launch waits for the previous
  replay of the same graph): this column is throughput, not host cost.

Writes ``bench_host.json`` into ``--out`` and prints the table last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import Any, NamedTuple

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import bench_attention  # noqa: E402  (the shared host timer; run from benchmarks/ or with it on sys.path)
import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

import cudnn_attn  # noqa: E402
from cudnn_attn.engine.cache import graph_cache  # noqa: E402

B, N, T, H = 1, 8, 256, 64
SCALE = H ** -0.5
TARGETS = {("public", "fwd"): 15.0, ("public", "bwd"): 20.0, ("bound", "fwd"): 8.0, ("jax handler", "fwd"): 10.0,
           ("jax handler", "bwd"): 10.0}


class Timing(NamedTuple):
    idle: float | None          # us per call with the GPU idle before it (None: not measured that way)
    back_to_back: float | None  # us per call in a loop without synchronisation (None: not measured that way)


def host_us(fn, *, calls: int, rounds: int) -> Timing:
    back_to_back = bench_attention.host_us(fn, calls=calls, rounds=rounds, warmup=20)
    synchronize, now = cp.cuda.runtime.deviceSynchronize, time.perf_counter_ns
    per_call = []
    for _ in range(min(calls, 300) * rounds):
        synchronize()
        start = now()
        fn()
        per_call.append(now() - start)
    synchronize()
    return Timing(statistics.median(per_call) / 1e3, back_to_back)


def measured(us: float, idle: bool = False) -> Timing:
    """A time measured elsewhere (a jitted chain, a dispatch): back to back, or with the GPU idle."""
    return Timing(us, None) if idle else Timing(None, us)


class replay_switched_off:
    """Switch the CUDA-graph replay of every cached plan off inside the block (graphs are kept)."""

    def __enter__(self):
        self.replays = [r for entry in graph_cache._entries.values() for r in entry.plan.replays if r.enabled]
        for r in self.replays:
            r.enabled = False

    def __exit__(self, *exc):
        for r in self.replays:
            r.enabled = True


def direct_calls(q, k, v, do) -> tuple[dict, Any, Any, Any]:
    """The eager call kinds the host table times, by row name -> ``(forward, backward or None)``, with the bound
    call and the forward's ``o, lse`` they use."""
    o, lse = cudnn_attn.dot_product_attention(q, k, v, scale=SCALE, return_residual=True)
    bound = cudnn_attn.bind(q, k, v, scale=SCALE)
    out = cp.empty_like(q)
    held = [None]

    def rebinding():                # `o = f(q, k, v)` in a loop: the previous result is alive during the call
        held[0] = cudnn_attn.dot_product_attention(q, k, v, scale=SCALE)

    calls_of = {
        "public": (lambda: cudnn_attn.dot_product_attention(q, k, v, scale=SCALE),
                   lambda: cudnn_attn.dot_product_attention_bwd(q, k, v, o, do, lse, scale=SCALE)),
        "public, o = f()": (rebinding, None),
        "bound": (lambda: bound(q, k, v), lambda: bound.backward(q, k, v, o, do, lse)),
        "bound, out=": (lambda: bound(q, k, v, out=out), None),
    }
    return calls_of, bound, o, lse


def cupy_rows(q, k, v, do, calls, rounds) -> dict:
    rows = {}
    calls_of, bound, o, lse = direct_calls(q, k, v, do)
    for suffix, switch in (("", None), (" (no replay)", replay_switched_off)):
        for name, (forward, backward) in calls_of.items():
            for kind, fn in (("fwd", forward), ("bwd", backward)):
                if fn is None:
                    continue
                fn()                                      # plans (and the bound backward) exist before switching
                with switch() if switch else contextlib.nullcontext():
                    rows[(name + suffix, kind)] = host_us(fn, calls=calls, rounds=rounds)
    rows.update(cupy_stages(bound, (q, k, v), (q, k, v, o, do, lse), calls, rounds))
    config = bound.config
    stream = cp.cuda.get_current_stream().ptr
    for kind, inputs in (("fwd", {"query": q, "key": k, "value": v}),
                         ("bwd", {"query": q, "key": k, "value": v, "output": o, "grad_output": do, "logsumexp": lse})):
        from cudnn_attn.core import settings
        from cudnn_attn.engine.call import OPERAND_IDS

        cfg = config if kind == "fwd" else config.replace(training=True)
        plan = graph_cache.plan(cfg, kind, q.device.id)
        by_id = {OPERAND_IDS[name]: x for name, x in inputs.items()}
        results = [cp.empty(spec.shape, spec.dtype) for spec in plan.results]
        pointers = [by_id[t].data.ptr for t in plan.operand_ids] + [r.data.ptr for r in results]
        with settings.override(replay=False):
            unreplayed = plan.sequence()                  # the launch sequence without CUDA-graph replay
        rows[("plan.launch", kind)] = host_us(lambda: unreplayed(pointers, stream), calls=calls, rounds=rounds)
        rows[("plan.launch (replayed)", kind)] = host_us(lambda: plan.launch(pointers, stream), calls=calls,
                                                         rounds=rounds)
        graphs = [g for r in plan.replays for g in r._graphs.values()]
        if graphs:
            from cudnn_attn.engine import replay

            launch_graph = cp.cuda.runtime.graphLaunch
            rows[("cudaGraphLaunch", kind)] = host_us(lambda: launch_graph(graphs[-1], stream), calls=calls,
                                                      rounds=rounds)
            rows[("stream capture query", kind)] = host_us(lambda: replay._capturing(stream), calls=calls,
                                                           rounds=rounds)
        context, launcher = plan.context, plan.launcher
        workspace = context.workspace(stream, plan.workspace_size)
        raw = raw_launch(plan, pointers, stream)
        if raw is not None:
            rows[("raw launch", kind)] = host_us(raw, calls=calls, rounds=rounds)
        uids = tuple(int(plan.built.uids[t]) for t in launcher.ids)
        graph, handle, ordered = plan.built.graph, context.handle, tuple(pointers)
        rows[("frontend execute", kind)] = host_us(
            lambda: graph.execute(ordered, workspace, handle=handle, tensor_uids=uids), calls=calls, rounds=rounds)
    # The host's speed, in CuPy's own terms: one elementwise kernel into a preallocated array (the same
    # Python-to-launch path any CuPy user pays, so the rows above compare across machines by it).
    x = cp.ones(q.size, cp.float32)
    out = cp.empty_like(x)
    rows[("cupy elementwise (multiply, out=)", "-")] = host_us(lambda: cp.multiply(x, 2.0, out=out), calls=calls,
                                                            rounds=rounds)
    return rows


def raw_launch(plan, pointers: list[int], stream: int):
    """``fn()`` that launches ``plan`` through the frontend's private ``_execute_with_raw_ptrs`` with a prefilled
    pointer array (the floor of any launch through cuDNN's backend), bound to ``stream``; ``None`` when the
    frontend has no raw entry point."""
    context, launcher = plan.context, plan.launcher
    workspace = context.workspace(stream, plan.workspace_size)
    context.bind_stream(stream)
    if launcher._raw_execute is None:
        return None
    launcher._pointers[:] = launcher._order(pointers)
    raw = launcher._raw_execute
    args = (launcher._pointers_address, launcher._count, workspace, context.handle_address, launcher._cpp_index)
    return lambda: raw(*args)


def cupy_stages(bound, forward_arrays, backward_arrays, calls, rounds) -> dict:
    """The public and bound calls' parts, each timed alone in a loop (so the table explains the totals):
    the signature key and its lookup, the bound call's check, the device and stream queries, and the
    results' allocation.  ``plan.launch`` and the raw floor are rows of their own."""
    from cudnn_attn.engine.prepared import call_key
    from cudnn_attn.engine.prepared import calls as known_calls
    from cudnn_attn.engine.result_blocks import result_blocks

    rows = {}
    stream = cp.cuda.get_current_stream().ptr
    for kind, arrays, bound_kind in (("fwd", forward_arrays, bound._forward), ("bwd", backward_arrays, bound._backward)):
        key = next(k for k in known_calls._known                           # the public call's entry (made above)
                   if k[0] == kind and k[1] is not None and k[1][0] is cp.ndarray)
        static = key[-1]
        rows[("  public stage: signature + lookup", kind)] = host_us(
            lambda: known_calls.get(call_key(kind, arrays, static)), calls=calls, rounds=rounds)
        rows[("  bound stage: check arrays", kind)] = host_us(lambda: bound._check(bound_kind, arrays), calls=calls,
                                                              rounds=rounds)
        direct = bound_kind.call
        rows[("  stage: device + stream query", kind)] = host_us(
            lambda: (cp.cuda.runtime.getDevice(), cp.cuda.get_current_stream().ptr), calls=calls, rounds=rounds)
        rows[(f"  stage: allocate {len(direct._layout)} result(s), reused", kind)] = host_us(
            lambda: result_blocks.results(direct, stream, direct._nbytes, direct._new_results), calls=calls,
            rounds=rounds)
        rows[("  stage: cupy.empty per result", kind)] = host_us(
            lambda: [cp.empty(shape, dtype) for shape, dtype, _ in direct._layout], calls=calls, rounds=rounds)
    return rows


def torch_rows(q, k, v, do, calls, rounds) -> dict:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv, tdo = (torch.from_dlpack(x).transpose(1, 2).contiguous() for x in (q, k, v, do))
    lq, lk, lv = (x.detach().requires_grad_() for x in (tq, tk, tv))

    sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward():
        return sdpa(tq, tk, tv, scale=SCALE)

    def train():
        lq.grad = lk.grad = lv.grad = None
        sdpa(lq, lk, lv, scale=SCALE).backward(tdo)

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):      # entered once: the context manager is not part of a call
        with torch.no_grad():
            fwd = host_us(forward, calls=calls, rounds=rounds)
        both = host_us(train, calls=calls, rounds=rounds)
    return {("torch", "fwd"): fwd, ("torch", "bwd"): Timing(both.idle - fwd.idle, both.back_to_back - fwd.back_to_back),
            ("torch fwd+bwd", "both"): both}


def jax_rows(q, k, v, do, rounds) -> dict:
    import jax

    from cudnn_attn import jax_bridge as jb

    jq, jk, jv, jdo = (jax.dlpack.from_dlpack(x) for x in (q, k, v, do))
    rows = {}
    chain = 16

    def program(attend, mode, length):
        def step(q):
            if mode == "fwd":
                return attend(q, jk, jv)
            if mode == "fwd, training":                 # the forward a gradient needs (O and the logsumexp)
                return jax.vjp(lambda q: attend(q, jk, jv), q)[0]
            return jax.vjp(lambda q: attend(q, jk, jv), q)[1](jdo)[0]

        def run(q):
            for _ in range(length):
                q = step(q)
            return q
        return jax.jit(run)

    samples = rounds * 4 * chain
    empty = jax.jit(lambda q: q)
    for _ in range(3):
        jax.block_until_ready(empty(jq))
    empty_us = dispatch_us(empty, jq, samples)
    eager = lambda q, k, v: jb.dot_product_attention(q, k, v, scale=SCALE, cuda_graph=False)  # noqa: E731
    impls = {
        "ours": lambda q, k, v: jb.dot_product_attention(q, k, v, scale=SCALE),
        "ours-eager": eager,
        "ours-eager, no replay": eager,
        "jax.nn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=SCALE, implementation="cudnn"),
    }
    # The chains launch back to back into a busy stream (as a model does); "one call, GPU idle" runs a program of
    # a single call after the GPU has drained: the handler as the CuPy rows' idle column.
    impls["ours-eager, one call, GPU idle"] = eager
    runs = [(mode, name, attend) for mode in ("fwd", "fwd+bwd") for name, attend in impls.items()]
    tag = {"ours-eager, no replay": " (no replay)", "ours-eager, one call, GPU idle": " (one call, GPU idle)"}
    for mode, name, attend in runs:
        length = 1 if name.endswith("GPU idle") else chain
        fn = program(attend, mode, length)
        with replay_switched_off() if name.endswith("no replay") else contextlib.nullcontext():
            for _ in range(3):
                jax.block_until_ready(fn(jq))
            wall = []
            for _ in range(samples // length):
                start = time.perf_counter_ns()
                jax.block_until_ready(fn(jq))
                wall.append((time.perf_counter_ns() - start) / length / 1e3)
            rows[(f"jax jit call ({name})", mode)] = measured(statistics.median(wall))
            if not name.startswith("ours-eager"):
                continue
            # The eager target runs the handler at every call: the program's dispatch (the host's part of an
            # execution, which enqueues every launch) less the empty program's, per call.
            per_call = {"fwd": handler_us(fn, jq, samples // length, empty_us, length)}
            if mode == "fwd+bwd":
                training = program(attend, "fwd, training", length)
                for _ in range(3):
                    jax.block_until_ready(training(jq))
                both = per_call.pop("fwd")
                per_call["fwd, training"] = handler_us(training, jq, samples // length, empty_us, length)
                per_call["bwd"] = both - per_call["fwd, training"]
            for label, us in per_call.items():
                rows[(f"jax handler [cudnn_attn_eager]{tag.get(name, '')}", label)] = measured(us, length == 1)
    rows[("  empty jitted program, dispatch", "-")] = measured(empty_us, True)
    return rows


def dispatch_us(fn, x, samples: int) -> float:
    """Median host µs from calling the jitted ``fn`` to its return, the device drained before each call (not
    timed): what the host spends to start the execution, its launches enqueued but not waited for."""
    import jax

    times = []
    for _ in range(samples):
        start = time.perf_counter_ns()
        out = fn(x)
        times.append(time.perf_counter_ns() - start)
        jax.block_until_ready(out)
    return statistics.median(times) / 1e3


def handler_us(fn, x, samples: int, empty_us: float, length: int) -> float:
    """Host µs per handler run of a program of ``length`` eager-target calls: its dispatch less the empty
    program's, divided by ``length`` (XLA's own cost per custom call included)."""
    return (dispatch_us(fn, x, samples) - empty_us) / length


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="fewer calls per round")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    calls, rounds = (200, 3) if args.quick else (1000, 7)
    rng = np.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    q, k, v, do = (cp.asarray(rng.standard_normal((B, T, N, H), dtype=np.float32)).astype(bf16) for _ in range(4))
    rows = {}
    for name, fn in (("cupy", lambda: cupy_rows(q, k, v, do, calls, rounds)),
                     ("torch", lambda: torch_rows(q, k, v, do, calls // 2, rounds)),
                     ("jax", lambda: jax_rows(q, k, v, do, rounds))):
        try:
            rows.update(fn())
        except Exception as exc:             # one framework missing must not hide the others
            print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
    from cudnn_attn.engine.result_blocks import result_blocks

    blocks = result_blocks.stats()._asdict()
    with open(os.path.join(args.out, "bench_host.json"), "w") as f:
        json.dump({"shape": f"bf16 B{B} N{N} T=S={T} H{H}", "calls": calls, "rounds": rounds, "result_blocks": blocks,
                   "rows": [{"what": w, "kind": kind, "host_us_idle_gpu": t.idle, "host_us_back_to_back": t.back_to_back}
                            for (w, kind), t in rows.items()]}, f, indent=1)
    print(f"\n== host us per call at a cache hit, bf16 B{B} N{N} T=S={T} H{H} (median; idle GPU = the call alone, "
          "target column; back-to-back = paced by the GPU when cheaper than the kernel)")
    print(f"{'what':44s} {'kind':8s} {'idle GPU':>8s} {'b2b':>7s}  target")
    for (what, kind), t in rows.items():
        us = t.idle if t.idle is not None else t.back_to_back
        target = TARGETS.get((what.split(" [")[0], kind.split("+")[0].split(",")[0]))
        verdict = "" if target is None else f"<= {target:g} {'OK' if us <= target else 'MISS'}"
        idle = f"{t.idle:8.1f}" if t.idle is not None else f"{'-':>8s}"
        b2b = f"{t.back_to_back:7.1f}" if t.back_to_back is not None else f"{'-':>7s}"
        print(f"{what:44s} {kind:8s} {idle} {b2b}  {verdict}")
    print(f"result blocks of the direct path: {blocks}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
