"""Autotuning against cuDNN's heuristic plan choice (not a test).

    python benchmarks/bench_autotune.py [--out OUT_DIR] [--quick]

For bf16 (and FP8 E4M3) attention, B=1 (16k) or B=4 (4k), H=16, D=128, causal and not, forward and
backward: the device time of the heuristic's plan (``autotune=False``) and of the autotuned plan
(``autotune=True``: every backend plan built and timed once on the call's buffers, the fastest kept and
remembered in the persistent plan store), both through the public CuPy API, CUDA events around 5
back-to-back calls, median of 5 rounds, interleaved.  Prints the plan names and the speed-up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import bench_attention  # the shared device timer (the script's folder is on sys.path)
import cupy as cp
import ml_dtypes
import numpy as np

import cudnn_attn
from cudnn_attn import MaskType
from cudnn_attn.core.validation import validate_call
from cudnn_attn.engine.cache import PlanChoice, graph_cache


def event_ms(fn) -> float:
    """Device ms per call of 5 back-to-back calls (one round, no warm-up: the caller warmed up)."""
    return bench_attention.event_ms(fn, cp.cuda.get_current_stream().ptr, warmup=0, repeats=5, rounds=1)


def case(name: str, B: int, T: int, causal: bool, fp8: bool, rng) -> dict:
    H, D = 16, 128
    mask = MaskType.CAUSAL if causal else MaskType.NO_MASK
    scale = 1 / math.sqrt(D)
    if fp8:
        data = [cp.asarray((rng.standard_normal((B, T, H, D), dtype=np.float32) * 0.5).astype(ml_dtypes.float8_e4m3fn)
                           .view(np.uint8)) for _ in range(3)]
        one = cp.ones((1, 1, 1, 1), cp.float32)
        params = {k: one for k in ("amax_dQ", "amax_dK", "amax_dV", "amax_dP", "descale_q", "descale_k", "descale_v",
                                   "descale_s", "scale_s", "scale_o", "descale_o", "descale_dO", "descale_dP",
                                   "scale_dQ", "scale_dK", "scale_dV", "scale_dP")}
        params["scale_s"] = cp.full((1, 1, 1, 1), 448.0, cp.float32)
        params["descale_s"] = cp.full((1, 1, 1, 1), 1 / 448.0, cp.float32)
        kwargs = dict(scale=scale, mask_type=mask, use_fp8=True, fp8_params=params)
        fwd = lambda tune: cudnn_attn.dot_product_attention(*data, **kwargs, autotune=tune)  # noqa: E731
        config, _ = validate_call(*data, scale=scale, mask_type=mask, use_fp8=True, fp8_params=params,
                                  fp8_dtype="float8_e4m3fn")
        return dict(name=name, fwd=fwd, bwd=None, config=config, flops=4.0 * B * H * T * T * D * (0.5 if causal else 1))
    bf16 = np.dtype(ml_dtypes.bfloat16)
    q, k, v, do = (cp.asarray(rng.standard_normal((B, T, H, D), dtype=np.float32)).astype(bf16) for _ in range(4))
    kwargs = dict(scale=scale, mask_type=mask)
    o, lse = cudnn_attn.dot_product_attention(q, k, v, return_residual=True, **kwargs)
    config, _ = validate_call(q, k, v, **kwargs)
    return dict(name=name, fwd=lambda tune: cudnn_attn.dot_product_attention(q, k, v, **kwargs, autotune=tune),
                bwd=lambda tune: cudnn_attn.dot_product_attention_bwd(q, k, v, o, do, lse, **kwargs, autotune=tune),
                config=config, flops=4.0 * B * H * T * T * D * (0.5 if causal else 1))


def plan_name(config, kind: str, choice: PlanChoice) -> str:
    config = config if kind == "fwd" else config.replace(training=True)
    key = graph_cache.key(config, kind, 0, plan=choice)
    return graph_cache.entry(key).graph.plan_name if key in graph_cache else "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--quick", action="store_true", help="4k only")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(0)
    shapes = [(f"{'16k' if T > 4096 else '4k'}{' causal' if c else ''}{' fp8' if f else ''}", B, T, c, f)
              for (B, T) in ((4, 4096),) + (() if args.quick else ((1, 16384),))
              for c in (False, True) for f in (False, True)]
    rows = []
    for name, B, T, causal, fp8 in shapes:
        c = case(name, B, T, causal, fp8, rng)
        for kind in ("fwd", "bwd"):
            fn = c[kind]
            if fn is None:
                continue
            start = time.perf_counter()
            fn(True)                                      # tunes once (or loads the remembered winner)
            cp.cuda.runtime.deviceSynchronize()
            tune_s = time.perf_counter() - start
            fn(False)
            samples = {False: [], True: []}
            for _ in range(5):
                for tune in (False, True):
                    samples[tune].append(event_ms(lambda: fn(tune)))
            heuristic, tuned = (statistics.median(samples[t]) for t in (False, True))
            flops = c["flops"] * (2.5 if kind == "bwd" else 1.0)
            rows.append(dict(shape=name, kind=kind, heuristic_ms=heuristic, autotuned_ms=tuned,
                             speedup=heuristic / tuned, heuristic_tflops=flops / heuristic / 1e9,
                             autotuned_tflops=flops / tuned / 1e9, tune_s=tune_s,
                             heuristic_plan=plan_name(c["config"], kind, PlanChoice.HEURISTIC),
                             autotuned_plan=plan_name(c["config"], kind, PlanChoice.AUTOTUNED)))
            print(rows[-1], flush=True)
        del c
        cp.get_default_memory_pool().free_all_blocks()
    with open(os.path.join(args.out, "bench_autotune.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n== autotune vs cuDNN's heuristic plan (H200, public CuPy API, device ms)")
    print(f"{'shape':16s} {'kind':4s} {'heuristic':>10s} {'autotuned':>10s} {'speed-up':>8s} {'TF/s':>6s}  plans "
          f"(heuristic / autotuned)  tuning s")
    for r in rows:
        print(f"{r['shape']:16s} {r['kind']:4s} {r['heuristic_ms']:10.3f} {r['autotuned_ms']:10.3f} "
              f"{r['speedup']:8.3f} {r['autotuned_tflops']:6.0f}  {r['heuristic_plan']} / {r['autotuned_plan']}  "
              f"{r['tune_s']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
