"""Side-by-side attention benchmark on one GPU (not a test).

    python benchmarks/bench_attention.py --out bench_out [--quick]

Implementations, all bf16, head dim 128, BTNH (torch: its native (B, H, T, D)):

* ``ours``      - ``cudnn_attn.dot_product_attention`` / ``dot_product_attention_bwd`` (cache hit);
* ``floor``     - a cuDNN frontend graph built by hand here (``pygraph`` + ``sdpa``/``sdpa_backward``),
                  executed with the frontend's ordered ``execute``: what cuDNN itself costs;
* ``jax``       - ``jax.nn.dot_product_attention(implementation="cudnn")`` under ``jax.jit``;
* ``torch-cudnn`` / ``torch-flash`` - ``torch.nn.functional.scaled_dot_product_attention`` restricted
                  to one backend with ``torch.nn.attention.sdpa_kernel``.

Measured per shape (B=4, H=16 at T=S=1k/4k/16k; causal and not; plus a decode-like shape B=1, H=16,
T=1, S=4096 for host overhead):

* device time: CUDA events around 5 back-to-back calls on the stream, per call, median of 3 rounds
  (JAX: host clock of a pipelined loop divided by its length, since XLA owns its stream); forward in
  inference mode.
  Backward: ours and the floor time the backward graph alone; JAX and torch time forward+backward
  and subtract their forward (column ``bwd``);
* TFLOP/s: forward ``4 B H T S D`` (halved when causal), backward 2.5x that;
* ratio of ours (and the peers) to the floor;
* host microseconds per cache-hit public call (host clock, no synchronisation inside the loop; the
  full host-overhead table is ``bench_host.py``);
* peak device memory per call: bytes allocated during the call including the workspace (ours:
  CuPy allocation hook + workspace size; torch: ``max_memory_allocated``; JAX: compiled
  ``memory_analysis`` temp + output bytes);
* cold first call: the first call of a configuration, graph build (or jit compile) included.

Writes ``bench_attention.json`` and ``bench_attention.png`` into ``--out`` and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
import traceback
from dataclasses import asdict, dataclass, field

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import cupy as cp  # noqa: E402
import ml_dtypes  # noqa: E402

import cudnn_attn  # noqa: E402
from cudnn_attn import MaskType  # noqa: E402
from cudnn_attn.core.validation import validate_call  # noqa: E402
from cudnn_attn.engine.cache import graph_cache  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)


@dataclass
class Shape:
    name: str
    B: int
    H: int
    T: int
    S: int
    D: int = 128
    causal: bool = False
    backward: bool = True

    @property
    def fwd_flops(self) -> float:
        return 4.0 * self.B * self.H * self.T * self.S * self.D * (0.5 if self.causal else 1.0)


@dataclass
class Result:
    shape: str
    impl: str
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    fwd_tflops: float | None = None
    bwd_tflops: float | None = None
    fwd_vs_floor: float | None = None
    bwd_vs_floor: float | None = None
    peak_mib: float | None = None
    cold_s: float | None = None
    error: str | None = None
    notes: dict = field(default_factory=dict)


def event_ms(fn, stream_ptr: int = 0, *, warmup: int = 2, repeats: int = 5, rounds: int = 3) -> float:
    """Device time per call of ``fn()`` on ``stream_ptr``: CUDA events around ``repeats`` back-to-back
    calls (so host launch gaps between calls are hidden when the device is the bottleneck), median of
    ``rounds``."""
    stream = cp.cuda.ExternalStream(stream_ptr)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(rounds):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(repeats):
            fn()
        end.record(stream)
        end.synchronize()
        samples.append(cp.cuda.get_elapsed_time(start, end) / repeats)
    return statistics.median(samples)


def host_us(fn, *, calls: int = 300, rounds: int = 5, warmup: int = 1) -> float:
    """Median over rounds of the host time per call of ``calls`` back-to-back calls (no sync inside)."""
    for _ in range(warmup):
        fn()
    cp.cuda.runtime.deviceSynchronize()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        cp.cuda.runtime.deviceSynchronize()
    return statistics.median(samples)


class AllocationPeak(cp.cuda.MemoryHook):
    """Peak bytes held by CuPy allocations made while the hook is active."""

    name = "AllocationPeak"

    def __init__(self):
        self.current = self.peak = 0
        self.sizes = {}

    def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
        self.sizes[mem_ptr] = mem_size
        self.current += mem_size
        self.peak = max(self.peak, self.current)

    def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
        self.current -= self.sizes.pop(mem_ptr, 0)


def inputs(shape: Shape, rng):
    def draw(*dims):
        return cp.asarray(rng.standard_normal(dims, dtype=np.float32)).astype(BF16)
    q = draw(shape.B, shape.T, shape.H, shape.D)
    k = draw(shape.B, shape.S, shape.H, shape.D)
    v = draw(shape.B, shape.S, shape.H, shape.D)
    do = draw(shape.B, shape.T, shape.H, shape.D)
    return q, k, v, do


# -- implementations ---------------------------------------------------------------------------------

def bench_ours(shape: Shape, q, k, v, do, result: Result, notes: dict) -> None:
    scale = 1.0 / math.sqrt(shape.D)
    mask = MaskType.CAUSAL if shape.causal else MaskType.NO_MASK
    kwargs = dict(scale=scale, mask_type=mask)
    start = time.perf_counter()
    cudnn_attn.dot_product_attention(q, k, v, **kwargs)
    cp.cuda.runtime.deviceSynchronize()
    result.cold_s = time.perf_counter() - start
    result.fwd_ms = event_ms(lambda: cudnn_attn.dot_product_attention(q, k, v, **kwargs))
    PAIRED.setdefault(shape.name, {})["ours fwd"] = lambda: cudnn_attn.dot_product_attention(q, k, v, **kwargs)
    hook = AllocationPeak()
    with hook:
        cudnn_attn.dot_product_attention(q, k, v, **kwargs)
    config, operands = validate_call(q, k, v, scale=scale, mask_type=mask, xp=cp)
    workspace = graph_cache.plan(config, "fwd").workspace_size
    result.peak_mib = (hook.peak + workspace) / 2**20
    if shape.backward:
        o, lse = cudnn_attn.dot_product_attention(q, k, v, return_residual=True, **kwargs)
        cudnn_attn.dot_product_attention_bwd(q, k, v, o, do, lse, **kwargs)
        result.bwd_ms = event_ms(lambda: cudnn_attn.dot_product_attention_bwd(q, k, v, o, do, lse, **kwargs))
        PAIRED[shape.name]["ours bwd"] = lambda: cudnn_attn.dot_product_attention_bwd(q, k, v, o, do, lse, **kwargs)
        train_config, _ = validate_call(q, k, v, scale=scale, mask_type=mask, training=True, xp=cp)
        bwd_plan = graph_cache.plan(train_config, "bwd")
        notes["bwd_workspace_mib"] = bwd_plan.workspace_size / 2**20
        notes["bwd_plan"] = bwd_plan.built.plan_name
    notes["plan"] = graph_cache.plan(config, "fwd").built.plan_name
    notes["host_us_api"] = host_us(lambda: cudnn_attn.dot_product_attention(q, k, v, **kwargs))


def _floor_graph(shape: Shape, kind: str, handle):
    import cudnn

    DT = cudnn.data_type
    B, H, T, S, D = shape.B, shape.H, shape.T, shape.S, shape.D
    bshd = lambda L: (L * H * D, D, H * D, 1)  # noqa: E731
    g = cudnn.pygraph(io_data_type=DT.BFLOAT16, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT,
                      handle=handle)
    q = g.tensor(name="q", dim=(B, H, T, D), stride=bshd(T), data_type=DT.BFLOAT16, uid=1)
    k = g.tensor(name="k", dim=(B, H, S, D), stride=bshd(S), data_type=DT.BFLOAT16, uid=2)
    v = g.tensor(name="v", dim=(B, H, S, D), stride=bshd(S), data_type=DT.BFLOAT16, uid=3)
    mask = dict(diagonal_band_right_bound=0) if shape.causal else {}
    if kind == "fwd":
        o, _ = g.sdpa(name="sdpa", q=q, k=k, v=v, attn_scale=1 / math.sqrt(D), generate_stats=False, **mask)
        o.set_output(True).set_dim((B, H, T, D)).set_stride(bshd(T)).set_uid(4)
        uids = (1, 2, 3, 4)
    else:
        o = g.tensor(name="o", dim=(B, H, T, D), stride=bshd(T), data_type=DT.BFLOAT16, uid=4)
        do = g.tensor(name="do", dim=(B, H, T, D), stride=bshd(T), data_type=DT.BFLOAT16, uid=5)
        st = g.tensor(name="st", dim=(B, H, T, 1), stride=(H * T, T, 1, 1), data_type=DT.FLOAT, uid=6)
        dq, dk, dv = g.sdpa_backward(name="sdpa_bwd", q=q, k=k, v=v, o=o, dO=do, stats=st,
                                     attn_scale=1 / math.sqrt(D), **mask)
        for t, uid, L in ((dq, 7, T), (dk, 8, S), (dv, 9, S)):
            t.set_output(True).set_dim((B, H, L, D)).set_stride(bshd(L)).set_uid(uid)
        uids = (1, 2, 3, 4, 5, 6, 7, 8, 9)
    g.build([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    return g, uids


def bench_floor(shape: Shape, q, k, v, do, result: Result, notes: dict) -> None:
    import cudnn

    handle = cudnn.create_handle()
    stream = cp.cuda.get_current_stream().ptr
    cudnn.set_stream(handle, stream)
    start = time.perf_counter()
    g, uids = _floor_graph(shape, "fwd", handle)
    out = cp.empty_like(q)
    ws = cp.empty(max(1, g.get_workspace_size()), cp.uint8)
    ptrs = (q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr)
    g.execute(ptrs, ws.data.ptr, handle=handle, tensor_uids=uids)
    cp.cuda.runtime.deviceSynchronize()
    result.cold_s = time.perf_counter() - start
    result.fwd_ms = event_ms(lambda: g.execute(ptrs, ws.data.ptr, handle=handle, tensor_uids=uids), stream)
    PAIRED.setdefault(shape.name, {})["floor fwd"] = lambda: g.execute(ptrs, ws.data.ptr, handle=handle, tensor_uids=uids)
    result.peak_mib = (out.nbytes + g.get_workspace_size()) / 2**20
    notes["plan"] = g.get_plan_name_at_index(g._plan_index)
    notes["host_us_frontend_execute"] = host_us(lambda: g.execute(ptrs, ws.data.ptr, handle=handle, tensor_uids=uids))
    if shape.backward:
        o, lse = cudnn_attn.dot_product_attention(q, k, v, return_residual=True, scale=1 / math.sqrt(shape.D),
                                                  mask_type=MaskType.CAUSAL if shape.causal else MaskType.NO_MASK)
        gb, uids_b = _floor_graph(shape, "bwd", handle)
        grads = [cp.empty_like(x) for x in (q, k, v)]
        wsb = cp.empty(max(1, gb.get_workspace_size()), cp.uint8)
        ptrs_b = (q.data.ptr, k.data.ptr, v.data.ptr, o.data.ptr, do.data.ptr, lse.data.ptr,
                  *(x.data.ptr for x in grads))
        result.bwd_ms = event_ms(lambda: gb.execute(ptrs_b, wsb.data.ptr, handle=handle, tensor_uids=uids_b), stream)
        PAIRED[shape.name]["floor bwd"] = lambda: gb.execute(ptrs_b, wsb.data.ptr, handle=handle, tensor_uids=uids_b)
        notes["bwd_workspace_mib"] = gb.get_workspace_size() / 2**20
        notes["bwd_plan"] = gb.get_plan_name_at_index(gb._plan_index)


def bench_jax(shape: Shape, q, k, v, do, result: Result, notes: dict) -> None:
    import jax
    import jax.numpy as jnp

    jq, jk, jv, jdo = (jax.dlpack.from_dlpack(x) for x in (q, k, v, do))
    scale = 1 / math.sqrt(shape.D)

    def attention(a, b, c):
        return jax.nn.dot_product_attention(a, b, c, scale=scale, is_causal=shape.causal, implementation="cudnn")

    fwd = jax.jit(attention)
    start = time.perf_counter()
    fwd(jq, jk, jv).block_until_ready()
    result.cold_s = time.perf_counter() - start
    result.fwd_ms = _jax_ms(lambda: fwd(jq, jk, jv))
    analysis = fwd.lower(jq, jk, jv).compile().memory_analysis()
    if analysis is not None:
        result.peak_mib = (analysis.temp_size_in_bytes + analysis.output_size_in_bytes) / 2**20
    notes["host_us_call"] = host_us(lambda: fwd(jq, jk, jv), calls=100)
    if shape.backward:
        train = jax.jit(lambda a, b, c, g: jax.vjp(attention, a, b, c)[1](g))
        jax.block_until_ready(train(jq, jk, jv, jdo))
        both = _jax_ms(lambda: train(jq, jk, jv, jdo))
        notes["fwd_plus_bwd_ms"] = both
        result.bwd_ms = both - result.fwd_ms if both > result.fwd_ms else None   # else: timing noise
    del jnp


def _jax_ms(fn, *, repeats: int = 10, rounds: int = 5) -> float:
    import jax

    for _ in range(3):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        outs = [fn() for _ in range(repeats)]
        jax.block_until_ready(outs)
        samples.append((time.perf_counter() - start) / repeats * 1e3)
    return statistics.median(samples)


def _bench_torch(backend_name: str):
    def bench(shape: Shape, q, k, v, do, result: Result, notes: dict) -> None:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        tq, tk, tv, tdo = (torch.from_dlpack(x).transpose(1, 2).contiguous() for x in (q, k, v, do))  # (B, H, T, D)
        stream = torch.cuda.current_stream().cuda_stream

        def forward():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=shape.causal)

        with torch.no_grad():
            start = time.perf_counter()
            forward()
            torch.cuda.synchronize()
            result.cold_s = time.perf_counter() - start
            result.fwd_ms = event_ms(forward, stream)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            forward()
            torch.cuda.synchronize()
            result.peak_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
            notes["host_us_call"] = host_us(forward, calls=100)
        if shape.backward:
            lq, lk, lv = (x.detach().requires_grad_() for x in (tq, tk, tv))

            def train():
                lq.grad = lk.grad = lv.grad = None
                with sdpa_kernel(backend):
                    out = torch.nn.functional.scaled_dot_product_attention(lq, lk, lv, is_causal=shape.causal)
                out.backward(tdo)

            result.bwd_ms = event_ms(train, stream) - result.fwd_ms
    return bench


PAIRED: dict[str, dict] = {}    # shape -> {"ours fwd": fn, "floor fwd": fn, ...}: the paired measurement


def paired(name: str, rounds: int = 8) -> dict:
    """Ours and the floor alternately, ``rounds`` times each (one call stream, same inputs), in the order
    ours-floor, floor-ours, ... (ABBA), so that clock drift and which one runs second (a long kernel right
    after another heats the GPU) cannot tell them apart: median ours / floor per kind."""
    fns, ratios = PAIRED.pop(name, {}), {}
    for kind in ("fwd", "bwd"):
        ours, floor = fns.get(f"ours {kind}"), fns.get(f"floor {kind}")
        if ours is None or floor is None:
            continue
        samples = {"ours": [], "floor": []}
        for round_ in range(rounds):
            for impl in ("ours", "floor") if round_ % 2 == 0 else ("floor", "ours"):
                samples[impl].append(event_ms(ours if impl == "ours" else floor, rounds=1))
        ratios[kind] = statistics.median(samples["ours"]) / statistics.median(samples["floor"])
    return ratios


IMPLEMENTATIONS = {
    "floor": bench_floor,
    "ours": bench_ours,
    "jax": bench_jax,
    "torch-cudnn": _bench_torch("CUDNN_ATTENTION"),
    "torch-flash": _bench_torch("FLASH_ATTENTION"),
}


def shapes(quick: bool, lengths: tuple[int, ...] | None = None) -> list[Shape]:
    """The decode-like shape first (host overhead), then the long ones; ``quick``: only T=S=4k;
    ``lengths``: only these T=S (no decode shape)."""
    out = [] if lengths else [Shape("decode B1 T1 S4k", 1, 16, 1, 4096, backward=False)]
    lengths = lengths or ((4096,) if quick else (1024, 4096, 16384))
    out += [Shape(f"T=S={n // 1024}k{' causal' if c else ''}", 4, 16, n, n, causal=c) for n in lengths for c in (False, True)]
    return out


def run(quick: bool, lengths: tuple[int, ...] | None = None) -> list[Result]:
    rng = np.random.default_rng(0)
    results = []
    for shape in shapes(quick, lengths):
        q, k, v, do = inputs(shape, rng)
        for impl, bench in IMPLEMENTATIONS.items():
            result = Result(shape.name, impl)
            try:
                bench(shape, q, k, v, do, result, result.notes)
            except Exception as exc:  # one implementation failing must not hide the others
                result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                result.notes["traceback"] = traceback.format_exc()[-2000:]
            if result.fwd_ms:
                result.fwd_tflops = shape.fwd_flops / result.fwd_ms / 1e9
            if result.bwd_ms:
                result.bwd_tflops = 2.5 * shape.fwd_flops / result.bwd_ms / 1e9
            results.append(result)
            print(f"  {shape.name:18s} {impl:12s} fwd {_f(result.fwd_ms)} ms  bwd {_f(result.bwd_ms)} ms"
                  + (f"  ERROR {result.error}" if result.error else ""), flush=True)
        ratios = paired(shape.name)
        floor = next(r for r in results if r.shape == shape.name and r.impl == "floor")
        ours = next((r for r in results if r.shape == shape.name and r.impl == "ours"), None)
        if ours is not None:
            ours.notes.update({f"paired_{kind}_vs_floor": round(ratio, 4) for kind, ratio in ratios.items()})
        for r in results:
            if r.shape == shape.name:
                if r.fwd_ms and floor.fwd_ms:
                    r.fwd_vs_floor = r.fwd_ms / floor.fwd_ms
                if r.bwd_ms and floor.bwd_ms:
                    r.bwd_vs_floor = r.bwd_ms / floor.bwd_ms
        del q, k, v, do
        cp.get_default_memory_pool().free_all_blocks()
    return results


def _f(x, digits=3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def plot(results: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.shape for r in results if "decode" not in r.shape))
    impls = list(IMPLEMENTATIONS)
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, attr, title in ((axes[0], "fwd_tflops", "forward"), (axes[1], "bwd_tflops", "backward")):
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            values = [next((getattr(r, attr) or 0 for r in results if r.shape == n and r.impl == impl), 0) for n in names]
            ax.bar(np.arange(len(names)) + i * width, values, width, label=impl)
        ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=20)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"bf16 attention {title}, B=4 H=16 D=128 (H200)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summary(results: list[Result]) -> str:
    lines = [f"{'shape':18s} {'impl':12s} {'fwd ms':>8s} {'TF/s':>6s} {'/floor':>7s} {'bwd ms':>8s} {'TF/s':>6s} "
             f"{'/floor':>7s} {'peak MiB':>9s} {'cold s':>7s}"]
    for r in results:
        lines.append(f"{r.shape:18s} {r.impl:12s} {_f(r.fwd_ms):>8s} {_f(r.fwd_tflops, 0):>6s} {_f(r.fwd_vs_floor):>7s} "
                     f"{_f(r.bwd_ms):>8s} {_f(r.bwd_tflops, 0):>6s} {_f(r.bwd_vs_floor):>7s} {_f(r.peak_mib, 1):>9s} "
                     f"{_f(r.cold_s, 2):>7s}" + (f"  {r.error}" if r.error else ""))
    decode = [r for r in results if "decode" in r.shape]
    lines.append("host us per cache-hit call (decode shape): " + ", ".join(
        f"{r.impl}: " + " ".join(f"{k[8:]}={v:.1f}" for k, v in r.notes.items() if k.startswith("host_us"))
        for r in decode if not r.error))
    lines.append("paired (ABBA order) ours/floor: " + "; ".join(
        f"{r.shape} " + " ".join(f"{k[7:10]} {v:.3f}" for k, v in r.notes.items() if k.startswith("paired"))
        + f" plans ours {r.notes.get('plan')}/{r.notes.get('bwd_plan', '-')}"
        for r in results if r.impl == "ours" and any(k.startswith("paired") for k in r.notes)))
    lines.append("floor plans: " + "; ".join(f"{r.shape} {r.notes.get('plan')}" for r in results if r.impl == "floor"))
    four_k = [r for r in results if r.impl == "ours" and r.shape.startswith("T=S=4k")]
    checks = []
    for r in four_k:
        for kind in ("fwd", "bwd"):
            ratio = getattr(r, f"{kind}_vs_floor")
            if ratio is not None:
                checks.append(f"{r.shape} {kind} {ratio:.3f} ({'OK' if ratio <= 1.03 else 'MISS'})")
    lines.append("target 4k within 3% of floor: " + "; ".join(checks))
    ours_decode = next((r for r in decode if r.impl == "ours" and not r.error), None)
    if ours_decode:
        api = ours_decode.notes["host_us_api"]
        lines.append(f"host us per cache-hit public call (decode shape): {api:.1f} (full table: bench_host.py)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="only the decode shape and T=S=4k")
    parser.add_argument("--only", nargs="*", choices=list(IMPLEMENTATIONS), help="run these implementations")
    parser.add_argument("--lengths", type=int, nargs="*", help="only these T=S (e.g. 16384), no decode shape")
    args = parser.parse_args()
    if args.only:
        for name in list(IMPLEMENTATIONS):
            if name not in args.only and name != "floor":
                del IMPLEMENTATIONS[name]
    os.makedirs(args.out, exist_ok=True)
    device = cp.cuda.runtime.getDeviceProperties(0)["name"]
    results = run(args.quick, tuple(args.lengths or ()))
    with open(os.path.join(args.out, "bench_attention.json"), "w") as f:
        json.dump({"device": device.decode() if isinstance(device, bytes) else str(device),
                   "cudnn": cudnn_attn.core.environment.cudnn_version(), "results": [asdict(r) for r in results]}, f, indent=1)
    try:
        plot(results, os.path.join(args.out, "bench_attention.png"))
    except Exception as exc:  # matplotlib missing: the JSON and the table still stand
        print(f"plot skipped: {exc}")
    print(summary(results))


if __name__ == "__main__":
    main()
