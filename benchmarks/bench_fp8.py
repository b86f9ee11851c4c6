"""FP8 attention against bf16 on one GPU (not a test).

    python benchmarks/bench_fp8.py --out bench_out [--quick] [--dry-run]

Shapes: head dim 128, H=16, BTNH; T=S=4k with B=4 and T=S=16k with B=1 (the same token count), causal
and not; ``--quick`` keeps 4k.  Per shape, ``cudnn_attn`` with bf16 operands and with FP8 E4M3 operands
(``use_fp8=True``, uint8 bytes, power-of-two per-tensor scales):

* forward (inference) through ``cudnn_attn.dot_product_attention``;
* backward through ``cudnn_attn.dot_product_attention_bwd`` (cache hit), from a training forward
  (FP8: the native ``prepared.forward``, since the seed's FP8 form returns no logsumexp) and with the
  backward's output scales set from a first backward's amax values (delayed scaling);
* TFLOP/s with forward ``4 B H T S D`` (halved when causal) and backward 2.5x that, the FP8 / bf16
  speed-up, and the forward against the ~1,000 TFLOP/s NVIDIA publishes for cuDNN FP8 on the H200.

Timing is ``bench_attention.event_ms``: CUDA events around back-to-back calls, median of rounds.
``--dry-run`` needs no GPU: it prints the table of the shapes it would run.  Writes ``bench_fp8.json``
into ``--out`` and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
from bench_attention import Shape, _f, event_ms

PUBLISHED_FP8_FWD_TFLOPS = 1000.0
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
IMPLEMENTATIONS = ("bf16", "fp8-e4m3")


@dataclass
class Row:
    shape: str
    impl: str
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    fwd_tflops: float | None = None
    bwd_tflops: float | None = None
    fwd_speedup: float | None = None      # bf16 time / this time
    bwd_speedup: float | None = None
    error: str | None = None
    notes: dict = field(default_factory=dict)


def shapes(quick: bool) -> list[Shape]:
    lengths = ((4, 4096),) if quick else ((4, 4096), (1, 16384))
    return [Shape(f"T=S={n // 1024}k B={b}{' causal' if causal else ''}", b, 16, n, n, causal=causal)
            for b, n in lengths for causal in (False, True)]


# -- inputs --------------------------------------------------------------------------------------------
class Inputs(NamedTuple):
    """One shape's operands: bf16 CuPy arrays, the FP8 bytes of the same values and their scales."""

    bf16: tuple[Any, Any, Any, Any]           # q, k, v, dO
    fp8: tuple[Any, Any, Any, Any]            # uint8 bytes
    descales: dict[str, float]                # descale_q, descale_k, descale_v, descale_dO


def fp8_scale(amax: float) -> float:
    """The power-of-two scale that maps ``amax`` into E4M3's range."""
    return 2.0 ** math.floor(math.log2(float(ml_dtypes.finfo(FP8).max) / amax))


def make_inputs(shape: Shape, host: dict[str, np.ndarray]) -> Inputs:
    import cupy as cp

    dims = (shape.B, shape.T, shape.H, shape.D)
    bf16, fp8, descales = [], [], {}
    for name in ("q", "k", "v", "dO"):
        x = host[name].reshape(dims)
        scale = fp8_scale(float(np.abs(x).max()))
        bf16.append(cp.asarray(x).astype(BF16))
        fp8.append(cp.asarray((x * scale).astype(FP8).view(np.uint8)))
        descales[f"descale_{name}"] = 1.0 / scale
    return Inputs(tuple(bf16), tuple(fp8), descales)


def host_values(tokens: int, heads: int, dim: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Standard normal float32 values for q, k, v and dO, generated once for every shape of this
    many tokens (4k x 4 and 16k x 1 share them)."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal((tokens, heads, dim), dtype=np.float32) for name in ("q", "k", "v", "dO")}


# -- implementations -----------------------------------------------------------------------------------
def bench_bf16(shape: Shape, inputs: Inputs, row: Row) -> None:
    import cudnn_attn
    from cudnn_attn import MaskType

    q, k, v, d_out = inputs.bf16
    kwargs = dict(scale=1 / math.sqrt(shape.D), mask_type=MaskType.CAUSAL if shape.causal else MaskType.NO_MASK)
    row.fwd_ms = event_ms(lambda: cudnn_attn.dot_product_attention(q, k, v, **kwargs))
    output, lse = cudnn_attn.dot_product_attention(q, k, v, return_residual=True, **kwargs)
    row.bwd_ms = event_ms(lambda: cudnn_attn.dot_product_attention_bwd(q, k, v, output, d_out, lse, **kwargs))


def bench_fp8(shape: Shape, inputs: Inputs, row: Row) -> None:
    import cupy as cp

    import cudnn_attn
    from cudnn_attn import MaskType
    from cudnn_attn.core.types import FP8_PARAM_KEYS
    from cudnn_attn.core.validation import validate_call
    from cudnn_attn.engine import prepared

    q, k, v, d_out = inputs.fp8
    values = {name: 1.0 for name in FP8_PARAM_KEYS}
    values.update(inputs.descales, scale_s=fp8_scale(1.0), descale_s=1 / fp8_scale(1.0), scale_o=fp8_scale(4.0),
                  descale_o=1 / fp8_scale(4.0))

    def params():
        return {name: cp.full((1, 1, 1, 1), value, cp.float32) for name, value in values.items()}

    mask = MaskType.CAUSAL if shape.causal else MaskType.NO_MASK
    kwargs = dict(use_fp8=True, scale=1 / math.sqrt(shape.D), mask_type=mask)
    fp8_params = params()
    row.fwd_ms = event_ms(lambda: cudnn_attn.dot_product_attention(q, k, v, fp8_params=fp8_params, **kwargs))

    config, operands = validate_call(q, k, v, fp8_params=fp8_params, training=True, fp8_dtype=FP8.name, xp=cp, **kwargs)
    forward = prepared.forward(config, operands)
    first = cudnn_attn.dot_product_attention_bwd(q, k, v, forward.output, d_out, forward.logsumexp,
                                                 fp8_params=fp8_params, **kwargs)
    for name, amax in (("dQ", first.amax_dQ), ("dK", first.amax_dK), ("dV", first.amax_dV), ("dP", first.amax_dP)):
        values[f"scale_{name}"] = fp8_scale(max(float(cp.asnumpy(amax).reshape(())), 1e-30))
    values["descale_dP"] = 1 / values["scale_dP"]
    fp8_params = params()
    row.bwd_ms = event_ms(lambda: cudnn_attn.dot_product_attention_bwd(
        q, k, v, forward.output, d_out, forward.logsumexp, fp8_params=fp8_params, **kwargs))
    row.notes["amax_o"] = float(cp.asnumpy(forward.amax_o).reshape(()))


BENCHES = {"bf16": bench_bf16, "fp8-e4m3": bench_fp8}


# -- run, table ----------------------------------------------------------------------------------------
def finish(shape: Shape, rows: list[Row]) -> None:
    """TFLOP/s and the speed-up over bf16 of one shape's rows."""
    bf16 = next(r for r in rows if r.impl == "bf16")
    for r in rows:
        if r.fwd_ms:
            r.fwd_tflops = shape.fwd_flops / r.fwd_ms / 1e9
            r.fwd_speedup = bf16.fwd_ms / r.fwd_ms if bf16.fwd_ms else None
        if r.bwd_ms:
            r.bwd_tflops = 2.5 * shape.fwd_flops / r.bwd_ms / 1e9
            r.bwd_speedup = bf16.bwd_ms / r.bwd_ms if bf16.bwd_ms else None


def run(quick: bool, dry_run: bool) -> list[Row]:
    rows: list[Row] = []
    host = None
    for shape in shapes(quick):
        shape_rows = [Row(shape.name, impl) for impl in IMPLEMENTATIONS]
        rows += shape_rows
        if dry_run:
            continue
        import cupy as cp

        if host is None:
            host = host_values(shape.B * shape.T, shape.H, shape.D)
        inputs = make_inputs(shape, host)
        for row in shape_rows:
            try:
                BENCHES[row.impl](shape, inputs, row)
            except Exception as exc:  # one implementation failing must not hide the other
                row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                row.notes["traceback"] = traceback.format_exc()[-2000:]
            print(f"  {shape.name:22s} {row.impl:9s} fwd {_f(row.fwd_ms)} ms  bwd {_f(row.bwd_ms)} ms"
                  + (f"  ERROR {row.error}" if row.error else ""), flush=True)
        finish(shape, shape_rows)
        del inputs
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def table(rows: list[Row]) -> str:
    lines = ["== FP8 vs bf16 (cudnn_attn, d=128 H=16; published cuDNN FP8 forward on H200: ~1000 TFLOP/s)",
             f"{'shape':22s} {'impl':9s} {'fwd ms':>8s} {'TF/s':>6s} {'x bf16':>6s} {'bwd ms':>8s} {'TF/s':>6s} "
             f"{'x bf16':>6s}"]
    for r in rows:
        forward = f"{_f(r.fwd_ms):>8s} {_f(r.fwd_tflops, 0):>6s} {_f(r.fwd_speedup, 2):>6s}"
        backward = f"{_f(r.bwd_ms):>8s} {_f(r.bwd_tflops, 0):>6s} {_f(r.bwd_speedup, 2):>6s}"
        lines.append(f"{r.shape:22s} {r.impl:9s} {forward} {backward}" + (f"  {r.error}" if r.error else ""))
    best = max((r.fwd_tflops for r in rows if r.impl != "bf16" and r.fwd_tflops), default=None)
    if best is not None:
        lines.append(f"best FP8 forward: {best:.0f} TFLOP/s = {best / PUBLISHED_FP8_FWD_TFLOPS:.0%} of the published "
                     f"{PUBLISHED_FP8_FWD_TFLOPS:.0f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="only T=S=4k")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: print the table of the shapes")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = run(args.quick, args.dry_run)
    device = cudnn = None
    if not args.dry_run:
        import cupy as cp

        from cudnn_attn.core.environment import cudnn_version as _cudnn_version

        name = cp.cuda.runtime.getDeviceProperties(0)["name"]
        device, cudnn = name.decode() if isinstance(name, bytes) else str(name), _cudnn_version()
    with open(os.path.join(args.out, "bench_fp8.json"), "w") as f:
        json.dump({"device": device, "cudnn": cudnn, "dry_run": args.dry_run, "rows": [asdict(r) for r in rows]},
                  f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    main()
