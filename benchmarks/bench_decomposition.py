"""Causal attention as one cuDNN call against the same problem cut into blocks (not a test).

    python benchmarks/bench_decomposition.py --out bench_out [--quick] [--dry-run]

A causal ``T x T`` problem cut into ``n`` row blocks of ``b = T / n`` queries is:

* the ``n`` diagonal blocks, each a causal ``b x b`` problem: one call, the batch ``B * n`` (BTNH rows of
  consecutive blocks are a free reshape of the sequence);
* for every row block ``i >= 1``, its off-diagonal keys ``[0, i b)``: one non-causal ``b x i b`` call;
* merges: each row block ``i >= 1`` has two partial outputs, merged through their logsumexps (one fused
  pass over the block: the bytes of one ``a += b``); the backward adds two dQ partials per row block and,
  per key block ``j``, ``n - 1 - j`` extra dK and dV partials.

Per shape and dtype (bf16; FP8 E4M3 as ``bench_fp8``: power-of-two scales, delayed backward scales) the
device time of the single causal call and of every block call (CUDA events, ``bench_attention.event_ms``),
forward and backward apart, and the merge time (``cupy.add(a, b, out=a)`` on float16 arrays of a block's
size, times the number of merges: the bytes a fused merge moves).  ``blocks`` is the sum of the block calls,
``total`` adds the merges.  A decomposition pays where ``total`` is below the single call.  Writes
``bench_decomposition.json`` and ``bench_decomposition.png`` into ``--out`` and prints the table last.

Shapes: head dim 128, H=16; T=S=4k B=4 and T=S=16k B=1 (``--quick``: 4k); ``n`` = 2 and 4.
"""

from __future__ import annotations

import argparse
import json
import os
import traceback
from dataclasses import asdict, dataclass, field

import numpy as np
from bench_attention import Shape, _f, event_ms
from bench_fp8 import BENCHES, FP8, Inputs, Row, fp8_scale

DTYPES = ("bf16", "fp8-e4m3")
SPLITS = (2, 4)


@dataclass(frozen=True)
class Block:
    """One call of a decomposition: ``batch`` x ``T`` queries against ``S`` keys."""

    name: str
    batch: int
    T: int
    S: int
    causal: bool


def blocks(B: int, T: int, n: int) -> list[Block]:
    """The calls of a causal ``T x T`` problem cut into ``n`` row blocks (module doc)."""
    if T % n:
        raise ValueError(f"n: {n} does not divide T={T}")
    b = T // n
    return [Block(f"diagonal {n}x causal {b}", B * n, b, b, True)] + [
        Block(f"row {i}: {b} x {i * b}", B, b, i * b, False) for i in range(1, n)]


def merges(n: int) -> tuple[int, int]:
    """Block-sized merge passes of the forward and of the backward (module doc)."""
    return n - 1, (n - 1) + 2 * sum(n - 1 - j for j in range(n))


@dataclass
class Result:
    shape: str
    dtype: str
    n: int                                  # 1: the single causal call
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    merge_fwd_ms: float = 0.0
    merge_bwd_ms: float = 0.0
    calls: list = field(default_factory=list)
    error: str | None = None

    @property
    def total_fwd_ms(self) -> float | None:
        return None if self.fwd_ms is None else self.fwd_ms + self.merge_fwd_ms

    @property
    def total_bwd_ms(self) -> float | None:
        return None if self.bwd_ms is None else self.bwd_ms + self.merge_bwd_ms


def inputs(batch: int, T: int, S: int, heads: int, dim: int, rng) -> Inputs:
    import cupy as cp
    import ml_dtypes

    bf16, fp8, descales = [], [], {}
    for name, length in (("q", T), ("k", S), ("v", S), ("dO", T)):
        x = rng.standard_normal((batch, length, heads, dim), dtype=np.float32)
        scale = fp8_scale(float(np.abs(x).max()))
        bf16.append(cp.asarray(x).astype(ml_dtypes.bfloat16))
        fp8.append(cp.asarray((x * scale).astype(FP8).view(np.uint8)))
        descales[f"descale_{name}"] = 1.0 / scale
    return Inputs(tuple(bf16), tuple(fp8), descales)


def time_block(block: Block, dtype: str, heads: int, dim: int, rng) -> tuple[float, float]:
    """Device ms of one block call's forward and backward."""
    import cupy as cp

    shape = Shape(block.name, block.batch, heads, block.T, block.S, dim, causal=block.causal)
    row = Row(block.name, dtype)
    BENCHES[dtype](shape, inputs(block.batch, block.T, block.S, heads, dim, rng), row)
    cp.get_default_memory_pool().free_all_blocks()
    return row.fwd_ms, row.bwd_ms


def add_ms(B: int, rows: int, heads: int, dim: int) -> float:
    import cupy as cp

    a = cp.ones((B, rows, heads, dim), cp.float16)
    b = cp.ones_like(a)
    return event_ms(lambda: cp.add(a, b, out=a))


def run(quick: bool, dry_run: bool) -> list[Result]:
    heads, dim = 16, 128
    lengths = ((4, 4096),) if quick else ((4, 4096), (1, 16384))
    results = []
    rng = np.random.default_rng(0)
    for B, T in lengths:
        shape = f"B{B} N{heads} T=S={T // 1024}k causal"
        for dtype in DTYPES:
            for n in (1, *SPLITS):
                result = Result(shape, dtype, n)
                results.append(result)
                plan = [Block("single causal", B, T, T, True)] if n == 1 else blocks(B, T, n)
                if dry_run:
                    result.calls = [asdict(b) for b in plan]
                    continue
                try:
                    result.fwd_ms = result.bwd_ms = 0.0
                    for block in plan:
                        fwd, bwd = time_block(block, dtype, heads, dim, rng)
                        result.calls.append({**asdict(block), "fwd_ms": fwd, "bwd_ms": bwd})
                        result.fwd_ms += fwd
                        result.bwd_ms += bwd
                    if n > 1:
                        one = add_ms(B, T // n, heads, dim)
                        forward, backward = merges(n)
                        result.merge_fwd_ms, result.merge_bwd_ms = forward * one, backward * one
                except Exception as exc:  # one failing row must not hide the others
                    result.fwd_ms = result.bwd_ms = None
                    result.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                    result.calls.append({"traceback": traceback.format_exc()[-2000:]})
                print(f"  {shape} {dtype:9s} n={n}  fwd {_f(result.total_fwd_ms)} ms  bwd {_f(result.total_bwd_ms)} ms"
                      + (f"  ERROR {result.error}" if result.error else ""), flush=True)
    return results


def table(results: list[Result]) -> str:
    lines = ["== causal attention: one call against n row blocks (device ms; x = single / total, > 1 pays)",
             f"{'shape':24s} {'dtype':9s} {'n':>2s} {'fwd blocks':>10s} {'+merge':>7s} {'x':>5s} "
             f"{'bwd blocks':>10s} {'+merge':>7s} {'x':>5s}"]
    single = {(r.shape, r.dtype): r for r in results if r.n == 1}
    for r in results:
        one = single[(r.shape, r.dtype)]

        def ratio(mine, theirs):
            return _f(theirs / mine, 2) if mine and theirs else "-"

        lines.append(f"{r.shape:24s} {r.dtype:9s} {r.n:2d} {_f(r.fwd_ms):>10s} {_f(r.merge_fwd_ms):>7s} "
                     f"{ratio(r.total_fwd_ms, one.fwd_ms):>5s} {_f(r.bwd_ms):>10s} {_f(r.merge_bwd_ms):>7s} "
                     f"{ratio(r.total_bwd_ms, one.bwd_ms):>5s}" + (f"  {r.error}" if r.error else ""))
    return "\n".join(lines)


def plot(results: list[Result], path: str) -> None:
    """Bars of total / single per shape and dtype, forward and backward (1.0: the single causal call)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    single = {(r.shape, r.dtype): r for r in results if r.n == 1}
    groups = list(single)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, kind in zip(axes, ("fwd", "bwd")):
        for k, n in enumerate(SPLITS):
            values = []
            for key in groups:
                r = next((r for r in results if (r.shape, r.dtype) == key and r.n == n), None)
                mine, theirs = getattr(r, f"total_{kind}_ms", None), getattr(single[key], f"{kind}_ms")
                values.append(mine / theirs if mine and theirs else 0.0)
            ax.bar([i + 0.4 * k for i in range(len(groups))], values, width=0.4, label=f"n={n}")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.2 for i in range(len(groups))])
        ax.set_xticklabels([f"{s.split(' causal')[0]}\n{d}" for s, d in groups], fontsize=7)
        ax.set_title(f"{kind}: blocks + merges / single causal call (< 1 pays)")
        ax.legend()
    axes[0].set_ylabel("time relative to the single call")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="only T=S=4k")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: the block plans and the table's rows")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results = run(args.quick, args.dry_run)
    report = {"dry_run": args.dry_run, "results": [{**asdict(r), "total_fwd_ms": r.total_fwd_ms,
                                                    "total_bwd_ms": r.total_bwd_ms} for r in results]}
    if not args.dry_run:
        import cupy as cp

        from cudnn_attn.core.environment import cudnn_version

        name = cp.cuda.runtime.getDeviceProperties(0)["name"]
        report.update(device=name.decode() if isinstance(name, bytes) else str(name), cudnn=cudnn_version())
    with open(os.path.join(args.out, "bench_decomposition.json"), "w") as f:
        json.dump(report, f, indent=1)
    if not args.dry_run:
        try:
            plot(results, os.path.join(args.out, "bench_decomposition.png"))
        except Exception as exc:            # matplotlib missing: the JSON and the table still stand
            print(f"no plot: {type(exc).__name__}: {exc}")
    print(table(results))


if __name__ == "__main__":
    main()
