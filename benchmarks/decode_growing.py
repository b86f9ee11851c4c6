"""Decode through a growing cache: host time per call when every call is a new signature (``bench_decode.py
--part growing``; not a test).

One query token against S cached keys, S one more every call, as a model's decode loop with a dynamic
(concatenated) cache makes it: B=4, 16 query heads over 4 K/V heads, d=64, bf16, S = 128 .. 128 + steps.
Rows left-padded by 0, 3, 7, 11 tokens for the masked variants.  Variants:

* ``ours causal-br``     - ``cudnn_attn.dot_product_attention``, bottom-right causal, contiguous K/V per step;
* ``ours causal-br, slice`` - the same on ``cache[:, :S]`` views of one preallocated cache (strided batch);
* ``ours keep-mask``     - ``cudnn_attn.attention(mask=keep(m))``, ``m`` boolean ``(B, 1, 1, S)`` (left padding);
* ``ours segments``      - ``cudnn_attn.attention(mask=segments(...))``: one segment per row starting at its
                           padding (the same keys as the keep-mask);
* ``ours padding, fixed S`` - a static cache of ``128 + steps`` keys, ``kv_seqlen`` = S: one signature;
* ``ours repeated signature`` - ``ours causal-br`` at S = 128 every call: the floor of a repeated eager call;
* ``..., torch in``      - ``ours causal-br`` / ``ours repeated signature`` on torch tensors of the same memory
                           (results come back as torch tensors), as ``transformers`` passes them;
* ``ours torch front``   - ``cudnn_attn.torch.sdpa`` (bottom-right causal) on the torch SDPA variants' ``(B, N, S, D)``
                           tensors, as its transformers attention calls it; ``..., repeated signature`` at S = 128;
                           ``..., operator`` calls ``torch.ops.cudnn_attn.attention`` with the arguments
                           ``sdpa`` would give it (torch's dispatcher and the direct launch, without ``sdpa``'s
                           own argument handling); ``..., implementation`` calls the operator's Python
                           implementation (``cudnn_attn.torch.ops._forward``) without torch's dispatcher: the
                           operator's row less this one is the dispatcher's cost;
* ``jax eager``          - ``cudnn_attn.jax_bridge.dot_product_attention`` on JAX arrays, not jitted;
* ``torch sdpa`` / ``torch sdpa keep-mask`` / ``torch sdpa repeated signature`` -
                           ``torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)`` on the same
                           values in torch's ``(B, N, S, D)`` layout (the keep-mask as ``attn_mask``).

Each variant runs a *cold* pass over the steps (the first sighting of every S: graphs built); then every variant
runs ``WARM_ROUNDS`` *warm* passes (every graph cached), the variants in a new seeded random order each round, so
that neither a slow spell of the host nor the variant before decides a row (a rotation keeps each variant's
predecessor: behind the CuPy front's DLPack variant the torch front measured 41.6 us per call, against 30.0 in a
pass of its own).  Per call: *host* = host clock of the
call, the GPU idle before it; *latency* = the call and a device synchronisation; a row is the median over rounds
of each warm pass's median.  Every variant's last output is compared with torch SDPA's (the masked ones with
torch's masked SDPA): ``max |diff|``.

Where a new-signature call's time goes, two ways, on a third (warm) pass:

* *stages*, ``time.perf_counter_ns`` around the library's public pieces called alone: ``validate_call`` of
  the new signature (with and without the boolean mask), ``graph_cache.plan`` (a hit), the DLPack exchange of
  Q/K/V from torch, the device and stream queries, a strided copy of the cache slice;
* *profile*, ``cProfile`` of the warm pass of ``ours causal-br`` / ``ours torch front`` / ``ours keep-mask`` /
  ``ours segments`` against the repeated signature: time per call by module (torch front, validation, parameters,
  masks, values, support, graph cache, launch, runtime, front, CuPy, DLPack) and the functions of most own
  time.  cProfile's own cost inflates every figure; the shares between stages are what it shows.
"""

from __future__ import annotations

import cProfile
import collections
import json
import math
import os
import pstats
import random
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import ml_dtypes
import numpy as np

B, N, K, D, S0 = 4, 16, 4, 64, 128
PADS = (0, 3, 7, 11)                 # left padding of each row (masked variants)
SCALE = 1.0 / math.sqrt(D)
BF16 = np.dtype(ml_dtypes.bfloat16)
VARIANTS = ("ours causal-br", "ours causal-br, slice", "ours causal-br, torch in", "ours torch front",
            "ours torch front, operator", "ours torch front, implementation", "ours keep-mask", "ours segments",
            "ours padding, fixed S",
            "ours repeated signature", "ours repeated signature, torch in", "ours torch front, repeated signature",
            "jax eager",
            "torch sdpa", "torch sdpa keep-mask", "torch sdpa repeated signature")
MASKED = {"ours keep-mask", "ours segments", "torch sdpa keep-mask"}
WARM_ROUNDS = 5                      # warm passes of every variant, each round in a new order
PROFILED = ("ours causal-br", "ours torch front", "ours keep-mask", "ours segments", "ours repeated signature")


@dataclass
class Row:
    variant: str
    cold_ms_total: float | None = None       # the cold pass, host clock, every call synchronised
    host_us: float | None = None             # warm pass, median
    latency_us: float | None = None          # warm pass, median, call + synchronisation
    max_abs_diff: float | None = None        # last output vs torch SDPA (masked: torch's masked SDPA)
    error: str | None = None
    notes: dict = field(default_factory=dict)


# -- inputs --------------------------------------------------------------------------------------------

class Steps:
    """Every step's arrays, made before anything is timed (CuPy BTNH; torch views of the same memory)."""

    def __init__(self, steps: int):
        import cupy as cp

        rng = np.random.default_rng(0)
        self.steps, smax = steps, S0 + steps
        normal = lambda *dims: cp.asarray(rng.standard_normal(dims, dtype=np.float32)).astype(BF16)  # noqa: E731
        self.cache_k, self.cache_v = normal(B, smax, K, D), normal(B, smax, K, D)
        self.q = [normal(B, 1, N, D) for _ in range(steps)]
        self.lengths = [S0 + i for i in range(steps)]
        self.k = [cp.ascontiguousarray(self.cache_k[:, :s]) for s in self.lengths]
        self.v = [cp.ascontiguousarray(self.cache_v[:, :s]) for s in self.lengths]
        pads = cp.asarray(PADS, cp.int32)
        self.keep = [(cp.arange(s)[None, :] >= pads[:, None]).reshape(B, 1, 1, s) for s in self.lengths]
        self.q_lengths = cp.ones((B, 1), cp.int32)
        self.q_offsets = cp.asarray([[0, -1]] * B, cp.int32)          # segment starts, -1 after the last
        self.kv_lengths = [(s - pads).reshape(B, 1).astype(cp.int32) for s in self.lengths]
        self.kv_offsets = cp.stack([pads, cp.full(B, -1, cp.int32)], axis=1).astype(cp.int32)
        self.kv_seqlen = [cp.full(B, s, cp.int32) for s in self.lengths]
        self.ones = cp.ones(B, cp.int32)


def calls(variant: str, st: Steps):
    """``call(i)`` of one variant at step ``i`` (returns its output, any framework)."""
    import cupy as cp

    import cudnn_attn
    from cudnn_attn import MaskType, keep, segments

    causal = dict(scale=SCALE, mask_type=MaskType.CAUSAL, diagonal_alignment="bottom_right")
    if variant == "ours causal-br":
        return lambda i: cudnn_attn.dot_product_attention(st.q[i], st.k[i], st.v[i], **causal)
    if variant == "ours causal-br, slice":
        return lambda i: cudnn_attn.dot_product_attention(st.q[i], st.cache_k[:, :st.lengths[i]],
                                                          st.cache_v[:, :st.lengths[i]], **causal)
    if variant.endswith(", torch in"):          # torch tensors in (and out), as transformers passes them
        import torch

        tq, tk, tv = ([torch.from_dlpack(x) for x in xs] for xs in (st.q, st.k, st.v))
        j = (lambda i: 0) if "repeated" in variant else (lambda i: i)
        return lambda i: cudnn_attn.dot_product_attention(tq[i], tk[j(i)], tv[j(i)], **causal)
    if variant.startswith("ours torch front"):
        import torch

        import cudnn_attn.torch as ct
        import cudnn_attn.torch.ops  # noqa: F401  (ct.ops)

        tq = [torch.from_dlpack(x).transpose(1, 2) for x in st.q]
        tk, tv = ([torch.from_dlpack(x).transpose(1, 2).contiguous() for x in xs] for xs in (st.k, st.v))
        j = (lambda i: 0) if "repeated" in variant else (lambda i: i)

        def front(i):
            with torch.no_grad():
                return ct.sdpa(tq[i], tk[j(i)], tv[j(i)], causal=True, bottom_right=True, scale=SCALE,
                               layout="BNTH")[0].transpose(1, 2)

        def operator(i):
            with torch.no_grad():
                return torch.ops.cudnn_attn.attention(tq[i], tk[i], tv[i], None, None, None, SCALE, True, True, 0,
                                                      0.0, 42, "BNTH", False)[0].transpose(1, 2)
        def implementation(i):
            with torch.no_grad():
                return ct.ops._forward(tq[i], tk[i], tv[i], None, None, None, (SCALE, True, True, 0, 0.0, 42, "BNTH"),
                                       False)[0].transpose(1, 2)
        return {"operator": operator, "implementation": implementation}.get(variant.rpartition(", ")[2], front)
    if variant == "ours keep-mask":
        return lambda i: cudnn_attn.attention(st.q[i], st.k[i], st.v[i], mask=keep(st.keep[i]), scale=SCALE).output
    if variant == "ours segments":
        return lambda i: cudnn_attn.attention(st.q[i], st.k[i], st.v[i], scale=SCALE, mask=segments(
            st.q_lengths, st.kv_lengths[i], st.q_offsets, st.kv_offsets)).output
    if variant == "ours padding, fixed S":
        return lambda i: cudnn_attn.dot_product_attention(st.q[i], st.cache_k, st.cache_v, q_seqlen=st.ones,
                                                          kv_seqlen=st.kv_seqlen[i], scale=SCALE,
                                                          mask_type=MaskType.PADDING)
    if variant == "ours repeated signature":
        return lambda i: cudnn_attn.dot_product_attention(st.q[i], st.k[0], st.v[0], **causal)
    if variant == "jax eager":
        import jax

        from cudnn_attn import jax_bridge as jb

        jq = [jax.dlpack.from_dlpack(x) for x in st.q]
        jk, jv = ([jax.dlpack.from_dlpack(x) for x in xs] for xs in (st.k, st.v))
        return lambda i: jb.dot_product_attention(jq[i], jk[i], jv[i], **causal)
    if variant.startswith("torch"):
        import torch

        sdpa = torch.nn.functional.scaled_dot_product_attention
        tq = [torch.from_dlpack(x).transpose(1, 2) for x in st.q]
        tk, tv = ([torch.from_dlpack(x).transpose(1, 2).contiguous() for x in xs] for xs in (st.k, st.v))
        masks = [torch.from_dlpack(m) for m in st.keep]

        def attend(i, k, v, mask=None):
            with torch.no_grad():
                return sdpa(tq[i], k, v, attn_mask=mask, scale=SCALE, enable_gqa=True).transpose(1, 2)
        if variant == "torch sdpa keep-mask":
            return lambda i: attend(i, tk[i], tv[i], masks[i])
        if variant == "torch sdpa repeated signature":
            return lambda i: attend(i, tk[0], tv[0])
        return lambda i: attend(i, tk[i], tv[i])
    del cp
    raise ValueError(variant)


# -- timing --------------------------------------------------------------------------------------------

def one_pass(call, steps: int) -> tuple[list[float], list[float], object]:
    import cupy as cp

    sync, now = cp.cuda.runtime.deviceSynchronize, time.perf_counter_ns
    host, latency, out = [], [], None
    for i in range(steps):
        sync()
        start = now()
        out = call(i)
        middle = now()
        sync()
        host.append((middle - start) / 1e3)
        latency.append((now() - start) / 1e3)
    return host, latency, out


def as_cupy(x):
    import cupy as cp

    return cp.from_dlpack(x).astype(cp.float32)


def cold(variant: str, st: Steps) -> tuple[Row, Callable[[int], Any] | None]:
    """The variant's row after its cold pass (its graphs built), and its call (``None`` when it failed)."""
    import cudnn_attn

    row = Row(variant)
    try:
        call = calls(variant, st)
        before = cudnn_attn.graph_cache.stats()
        cold_host, cold_latency, _ = one_pass(call, st.steps)
        after = cudnn_attn.graph_cache.stats()
        row.cold_ms_total = sum(cold_latency) / 1e3
        misses = after.misses - before.misses          # the graphs the cold pass built (CuPy front's cache)
        row.notes["cold_graph_misses"] = misses
        if misses:
            row.notes["build_ms_per_miss"] = round((after.build_seconds - before.build_seconds) * 1e3 / misses, 2)
        row.notes["cold_host_us_median"] = statistics.median(cold_host)
        return row, call
    except Exception as exc:               # one variant failing must not hide the others
        fail(row, exc)
        return row, None


def warm(measured: list[tuple[Row, Any]], st: Steps, rounds: int) -> None:
    """``rounds`` warm passes of every variant, in a new order each round (seeded: a slow spell of the host falls on
    all of them, and no variant always follows the same one); a row's host and latency are the medians over rounds
    of each pass's median.  Every variant's last output is compared with torch SDPA's of the same kind."""
    import cudnn_attn

    live = [(row, call) for row, call in measured if call is not None]
    host: dict = collections.defaultdict(list)
    latency: dict = collections.defaultdict(list)
    outputs: dict = {}
    order = random.Random(0)
    for r in range(rounds):
        for row, call in order.sample(live, len(live)):
            if row.error:
                continue
            try:
                before = cudnn_attn.graph_cache.stats().misses
                h, lat, outputs[row.variant] = one_pass(call, st.steps)
                rebuilt = cudnn_attn.graph_cache.stats().misses - before     # 0 unless a graph was evicted
                row.notes["warm_graph_misses"] = row.notes.get("warm_graph_misses", 0) + rebuilt
                host[row.variant].append(statistics.median(h))
                latency[row.variant].append(statistics.median(lat))
            except Exception as exc:
                fail(row, exc)
    reference = {}
    for row, _ in live:
        if row.variant.startswith("torch") and row.variant in outputs:
            reference[_kind(row.variant)] = as_cupy(outputs[row.variant])
    for row, _ in live:
        if row.error or not host[row.variant]:
            continue
        row.host_us, row.latency_us = statistics.median(host[row.variant]), statistics.median(latency[row.variant])
        row.notes["warm_host_us_rounds"] = [round(x, 1) for x in host[row.variant]]
        if not row.variant.startswith("torch") and _kind(row.variant) in reference:
            row.max_abs_diff = float(abs(as_cupy(outputs[row.variant]) - reference[_kind(row.variant)]).max())


def _kind(variant: str) -> str:
    return "masked" if variant in MASKED else "repeated" if "repeated" in variant else "plain"


def fail(row: Row, exc: Exception) -> None:
    row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    row.notes["traceback"] = traceback.format_exc()[-2500:]


# -- where a new-signature call's time goes ------------------------------------------------------------

def stage_us(fn, steps: int) -> float:
    now, samples = time.perf_counter_ns, []
    for i in range(steps):
        start = now()
        fn(i)
        samples.append((now() - start) / 1e3)
    return statistics.median(samples)


def stages(st: Steps) -> dict:
    import cupy as cp
    import torch

    import cudnn_attn
    from cudnn_attn import MaskType
    from cudnn_attn.core.validation import validate_call

    causal = dict(scale=SCALE, mask_type=MaskType.CAUSAL, diagonal_alignment="bottom_right", xp=cp)
    configs = [validate_call(st.q[i], st.k[i], st.v[i], **causal)[0] for i in range(st.steps)]
    tq = [torch.from_dlpack(x) for x in st.q]
    tk, tv = [torch.from_dlpack(x) for x in st.k], [torch.from_dlpack(x) for x in st.v]
    device = st.q[0].device.id
    out = {
        "validate_call (causal-br, new S)": stage_us(lambda i: validate_call(st.q[i], st.k[i], st.v[i], **causal),
                                                     st.steps),
        "validate_call (boolean mask, new S)": stage_us(
            lambda i: validate_call(st.q[i], st.k[i], st.v[i], mask=st.keep[i], scale=SCALE, xp=cp), st.steps),
        "validate_call (segments, new S)": stage_us(
            lambda i: validate_call(st.q[i], st.k[i], st.v[i], q_seqlen=st.q_lengths, kv_seqlen=st.kv_lengths[i],
                                    q_offsets=st.q_offsets, kv_offsets=st.kv_offsets, scale=SCALE,
                                    mask_type=MaskType.PADDING, xp=cp), st.steps),
        "graph_cache.plan (hit)": stage_us(lambda i: cudnn_attn.graph_cache.plan(configs[i], "fwd", device), st.steps),
        "DLPack torch -> CuPy, Q/K/V": stage_us(lambda i: (cp.from_dlpack(tq[i]), cp.from_dlpack(tk[i]),
                                                           cp.from_dlpack(tv[i])), st.steps),
        "device + stream query": stage_us(lambda i: (cp.cuda.runtime.getDevice(), cp.cuda.get_current_stream().ptr),
                                          st.steps),
        "strided copy of the cache slice (K and V)": stage_us(
            lambda i: (cp.ascontiguousarray(st.cache_k[:, :st.lengths[i]]),
                       cp.ascontiguousarray(st.cache_v[:, :st.lengths[i]])), st.steps),
    }
    return {name: round(us, 2) for name, us in out.items()}


BUCKETS = (("cudnn_attn/torch", "torch front"), ("cudnn_attn/core/validation", "validation"),
           ("cudnn_attn/core/parameters", "parameters"),
           ("cudnn_attn/core/masks", "masks"), ("cudnn_attn/core/values", "values"),
           ("cudnn_attn/core/support", "support"), ("cudnn_attn/core/config", "config"), ("cudnn_attn/core", "core"),
           ("cudnn_attn/engine/cache", "graph cache"), ("cudnn_attn/engine/plan", "launch"),
           ("cudnn_attn/engine/launch", "launch"), ("cudnn_attn/engine/replay", "launch"),
           ("cudnn_attn/engine/runtime", "runtime (device, stream)"), ("cudnn_attn/engine", "engine"),
           ("cudnn_attn/fronts", "front"), ("dlpack", "DLPack"), ("cupy", "CuPy"), ("torch", "torch"))


def bucket(path: str, name: str) -> str:
    where = f"{path}:{name}".replace("\\", "/")
    for key, label in BUCKETS:
        if key in where:
            return label
    return "other"


def profile(variant: str, st: Steps) -> dict:
    """cProfile of one warm pass: own time per call by bucket, and the functions of most own time."""
    call = calls(variant, st)
    one_pass(call, st.steps)                       # warm (cold pass already done by measure, or here)
    profiler = cProfile.Profile()
    profiler.enable()
    one_pass(call, st.steps)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    by_bucket: collections.Counter = collections.Counter()
    functions = []
    for (path, line, name), (_, calls_, own, _, _) in stats.items():
        if name in ("deviceSynchronize",) or "one_pass" in name:
            continue
        by_bucket[bucket(path, name)] += own
        functions.append((own, f"{os.path.basename(path)}:{line}:{name}", calls_))
    per = 1e6 / st.steps
    return {"us_per_call_by_bucket": {k: round(v * per, 1) for k, v in by_bucket.most_common()},
            "profiled_us_per_call": round(sum(by_bucket.values()) * per, 1),
            "top_functions": [(f, round(own * per, 1), round(n / st.steps, 1))
                              for own, f, n in sorted(functions, reverse=True)[:12]]}


# -- report --------------------------------------------------------------------------------------------

def _f(x, digits=1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(rows: list[Row], stage_rows: dict, profiles: dict, steps: int) -> str:
    latency = {r.variant: r.latency_us for r in rows}
    lines = [f"== decode through a growing cache: B={B}, {N} q / {K} kv heads, d={D}, bf16, S = {S0}..{S0 + steps - 1} "
             "(us per call, warm pass, GPU idle before each call)",
             f"{'variant':30s} {'host us':>8s} {'latency':>8s} {'x sdpa':>6s} {'cold ms':>8s} {'|diff|':>8s}"]
    for r in rows:
        base = latency.get("torch sdpa keep-mask" if r.variant in MASKED else "torch sdpa repeated signature"
                           if "repeated" in r.variant else "torch sdpa")
        ratio = r.latency_us / base if base and r.latency_us else None
        lines.append(f"{r.variant:30s} {_f(r.host_us):>8s} {_f(r.latency_us):>8s} {_f(ratio, 2):>6s} "
                     f"{_f(r.cold_ms_total):>8s} {_f(r.max_abs_diff, 4):>8s}" + (f"  FAILED {r.error}" if r.error else ""))
    lines.append("x sdpa: latency / torch SDPA's (masked: its masked SDPA; repeated: its repeated call); target <= 1")
    lines.append("graph builds in the cold pass (misses, ms each): " + "; ".join(
        f"{r.variant} {r.notes['cold_graph_misses']} x {r.notes.get('build_ms_per_miss', '-')}" for r in rows
        if "cold_graph_misses" in r.notes))
    rebuilt = [f"{r.variant} {r.notes['warm_graph_misses']}" for r in rows if r.notes.get("warm_graph_misses")]
    lines.append("graph builds in the warm passes (evicted graphs; their rows are not warm): "
                 + ("; ".join(rebuilt) if rebuilt else "none"))
    lines.append("stages of a new-signature call, each alone (us): " + "; ".join(f"{k} {v}" for k, v in
                                                                                stage_rows.items()))
    for variant, p in profiles.items():
        if "error" in p:
            lines.append(f"profile {variant}: FAILED {p['error']}")
            continue
        top = ", ".join(f"{k} {v}" for k, v in list(p["us_per_call_by_bucket"].items())[:7])
        lines.append(f"profile {variant} ({p['profiled_us_per_call']} us/call under cProfile): {top}")
    return "\n".join(lines)


def main(out_dir: str, steps: int, dry_run: bool) -> list[Row]:
    rows = [Row(v) for v in VARIANTS]
    stage_rows: dict = {}
    profiles: dict = {}
    if dry_run:
        for r in rows:
            r.error = "not run (--dry-run)"
    else:
        import cudnn_attn

        # The warm passes must find every variant's graphs: the full set (48 lengths) builds about 290, more than
        # the shared cache's default 128, and a warm call that rebuilds an evicted graph took 10-15 ms.
        cudnn_attn.graph_cache.resize(max(cudnn_attn.graph_cache.maxsize, len(VARIANTS) * (steps + 1)))
        st = Steps(steps)
        measured = [cold(variant, st) for variant in VARIANTS]
        warm(measured, st, WARM_ROUNDS)
        rows = [row for row, _ in measured]
        for r in rows:
            print(f"  {r.variant:36s} host {_f(r.host_us)} us  latency {_f(r.latency_us)} us"
                  + (f"  ERROR {r.error}" if r.error else ""), flush=True)
        try:
            stage_rows = stages(st)
        except Exception as exc:
            stage_rows = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        for variant in PROFILED:
            try:
                profiles[variant] = profile(variant, st)
            except Exception as exc:
                profiles[variant] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
        for variant, p in profiles.items():
            for function, us, n in p.get("top_functions", []):
                print(f"  profile {variant}: {function} {us} us/call ({n} calls/call)")
    with open(os.path.join(out_dir, "bench_decode_growing.json"), "w") as f:
        json.dump({"dry_run": dry_run, "steps": steps, "shape": {"B": B, "N": N, "K": K, "D": D, "S0": S0},
                   "pads": PADS, "rows": [asdict(r) for r in rows], "stages_us": stage_rows, "profiles": profiles},
                  f, indent=1)
    if not dry_run:
        plot(os.path.join(out_dir, "bench_decode_growing.json"), os.path.join(out_dir, "bench_decode_growing.png"))
    print(table(rows, stage_rows, profiles, steps))
    return rows


def plot(report: str, path: str) -> None:
    """Host time per call of each variant (bars), from a ``bench_decode_growing.json``; nothing without matplotlib.

    ``python benchmarks/decode_growing.py --plot REPORT.json OUT.png`` draws it again from a saved report."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    data = json.load(open(report))
    rows = [r for r in data["rows"] if r.get("host_us")]
    fig, ax = plt.subplots(figsize=(10, 0.32 * len(rows) + 1.2))
    colors = ["tab:orange" if r["variant"].startswith("torch") else "tab:blue" for r in rows]
    ax.barh([r["variant"] for r in rows], [r["host_us"] for r in rows], color=colors)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.set_xlabel("host us per call (warm pass, log scale)")
    s0 = data["shape"]["S0"]
    ax.set_title(f"decode through a growing cache: one query against S = {s0}..{s0 + data['steps'] - 1} keys")
    for i, r in enumerate(rows):
        ax.text(r["host_us"], i, f" {r['host_us']:.0f}", va="center", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--plot"] and len(sys.argv) == 4:
        plot(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: decode_growing.py --plot REPORT.json OUT.png (the benchmark itself: bench_decode.py)")
