"""Device memory of the rebuild path on the GPU: does an evicted and rebuilt cuDNN graph leave memory behind?

    python benchmarks/probe_rebuild_device.py [--seconds 90] [--sample-every 200] [--out FILE]

The 200k-call soak of 2026-12-01's fifth session read device memory outside CuPy's and XLA's pools rising
about 3 MiB over its second half (readings in 2 MiB pages, scattered by +-3 MiB), while 6,000 graphs were
evicted and rebuilt there.  This probe isolates that path: one thread, no JAX, a 4-graph cache
(``soak.small_cache``) cycling through eight configurations forward and backward (16 graphs: every call
misses, evicts and rebuilds through the plan store, as in the soak), then the same calls with a 32-graph cache
(no rebuild at all) as the control.  Every ``--sample-every`` rebuilds it synchronises, returns CuPy's free
blocks and reads ``cudaMemGetInfo`` minus CuPy's pool.  Each stage reports its trend as a least-squares line
through batch means of 10 readings (readings next to each other are correlated), in MiB per 10,000 rebuilds.
Not a test: prints one line per stage, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from soak import _trends, small_cache  # noqa: E402

MIB = 1 << 20


def trend(calls: list[int], mib: list[float], per: float = 10_000, batch: int = 10) -> tuple[float, float]:
    """Slope (MiB per ``per`` lookups) and its standard error: the soak's least-squares line through batch means
    of ``batch`` readings (neighbouring readings are correlated)."""
    n = len(mib) // batch
    if n < 3:
        return float("nan"), float("nan")
    rows = [{"calls": float(np.mean(calls[i * batch:(i + 1) * batch])),
             "mib": float(np.mean(mib[i * batch:(i + 1) * batch]))} for i in range(n)]
    span = rows[-1]["calls"] - rows[0]["calls"]
    trends, errors = _trends(rows, ["mib"])                 # growth and its error over the span
    return trends["mib"] * per / span, errors["mib"] * per / span


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=90, help="time for each of the two stages")
    parser.add_argument("--sample-every", type=int, default=200, help="graph lookups between two readings")
    parser.add_argument("--out", default="probe_rebuild_device.json")
    args = parser.parse_args()
    import cupy as cp
    import ml_dtypes

    import cudnn_attn

    rng = np.random.default_rng(11)
    cases = []
    for length in (256, 384, 512, 640):
        for mask in (cudnn_attn.MaskType.NO_MASK, cudnn_attn.MaskType.CAUSAL):
            q, k, v, do = (cp.asarray(rng.standard_normal((2, length, 8, 64)).astype(ml_dtypes.bfloat16))
                           for _ in range(4))
            cases.append((q, k, v, do, mask))
    pool = cp.get_default_memory_pool()

    def outside_pools_mib() -> float:
        cp.cuda.runtime.deviceSynchronize()
        pool.free_all_blocks()
        free, total = cp.cuda.runtime.memGetInfo()
        return (total - free - pool.total_bytes()) / MIB

    def step(i: int) -> None:
        q, k, v, do, mask = cases[i % len(cases)]
        o, lse = cudnn_attn.dot_product_attention(q, k, v, scale=0.125, mask_type=mask, return_residual=True)
        cudnn_attn.dot_product_attention_bwd(q, k, v, o, do, lse, scale=0.125, mask_type=mask)

    report = {}
    for label, maxsize in (("rebuilds (4-graph cache)", 4), ("control (32-graph cache, no rebuild)", 32)):
        with small_cache(maxsize) as cache:
            for i in range(2 * len(cases)):          # every graph built (or in the plan store) before reading
                step(i)
            calls, mib, i = [], [], 0
            start = time.monotonic()
            misses0 = cache.stats().misses
            while time.monotonic() - start < args.seconds:
                for _ in range(args.sample_every // 2):
                    step(i)
                    i += 1
                calls.append(2 * i)
                mib.append(outside_pools_mib())
            stats = cache.stats()
            slope, error = trend(calls, mib)
            stride = -(-len(mib) // 500)             # at most 500 readings kept (the control makes thousands)
            row = {"lookups": 2 * i, "rebuilds": stats.misses - misses0, "live_graphs": cache.live_graphs(),
                   "readings": len(mib), "stored_every": stride, "outside_pools_mib": mib[::stride],
                   "lookups_at": calls[::stride], "first": mib[0], "last": mib[-1],
                   "min": min(mib), "max": max(mib), "trend_mib_per_10k_lookups": slope, "trend_error": error}
            report[label] = row
            print(f"{label}: {row['lookups']} lookups, {row['rebuilds']} rebuilds, graphs alive "
                  f"{row['live_graphs']}; outside the pools {row['first']:.1f} -> {row['last']:.1f} MiB (range "
                  f"{row['min']:.1f}-{row['max']:.1f}), trend {slope:+.2f} +- {error:.2f} MiB per 10k lookups",
                  flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
