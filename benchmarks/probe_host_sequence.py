"""Host time of the direct path's calls in sequence, in a fresh process (not a test): the diagnostic of the
2026-12-01 session for bench_host rows that vary between machines and with their place in the run.

    python benchmarks/probe_host_sequence.py

bf16 B1 N8 T=S=256 H64.  Each step is a loop of one kind of call, timed by ``bench_host.host_us`` (back-to-back
and with the GPU idle before each call), in the order bench_host runs them, with the bound forward timed again
after each other kind of call.  After each step it prints the forward plan's replay state (enabled, captures,
replays, graphs) and the live replay graphs.
"""

from __future__ import annotations

import cupy as cp
import ml_dtypes
import numpy as np
from bench_host import direct_calls, host_us  # benchmarks/ is on sys.path when run as a script

from cudnn_attn.engine import replay


def main() -> None:
    rng = np.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    q, k, v, do = (cp.asarray(rng.standard_normal((1, 256, 8, 64), dtype=np.float32)).astype(bf16) for _ in range(4))
    calls_of, bound, _, _ = direct_calls(q, k, v, do)
    bound_forward, out_forward = calls_of["bound"][0], calls_of["bound, out="][0]
    steps = [
        ("bound fresh", bound_forward),
        ("out=", out_forward),
        ("bound again", bound_forward),
        ("public fwd", calls_of["public"][0]),
        ("bound after public", bound_forward),
        ("public bwd", calls_of["public"][1]),
        ("bound after bwd", bound_forward),
        ("o=f()", calls_of["public, o = f()"][0]),
        ("bound after o=f()", bound_forward),
        ("out= again", out_forward),
    ]
    for name, fn in steps:
        t = host_us(fn, calls=2000, rounds=5)
        plan = bound._forward.plan()
        state = [(r.enabled, r.captures, r.replays, len(r._graphs)) for r in plan.replays]
        print(f"{name:22s} b2b {t.back_to_back:5.1f} idle {t.idle:5.1f}   fwd replays {state} "
              f"live {replay.live_graphs()}", flush=True)


if __name__ == "__main__":
    main()
