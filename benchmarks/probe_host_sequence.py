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

import cudnn_attn
from bench_host import host_us            # benchmarks/ is on sys.path when run as a script
from cudnn_attn import replay

SCALE = 64 ** -0.5


def main() -> None:
    rng = np.random.default_rng(0)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    q, k, v, do = (cp.asarray(rng.standard_normal((1, 256, 8, 64), dtype=np.float32)).astype(bf16) for _ in range(4))
    o, lse = cudnn_attn.dot_product_attention(q, k, v, scale=SCALE, return_residual=True)
    bound = cudnn_attn.bind(q, k, v, scale=SCALE)
    out = cp.empty_like(q)
    held = [None]

    def rebinding():                      # `o = f(q, k, v)` in a loop: the previous result is alive during the call
        held[0] = cudnn_attn.dot_product_attention(q, k, v, scale=SCALE)

    def bound_forward():
        return bound(q, k, v)

    steps = [
        ("bound fresh", bound_forward),
        ("out=", lambda: bound(q, k, v, out=out)),
        ("bound again", bound_forward),
        ("public fwd", lambda: cudnn_attn.dot_product_attention(q, k, v, scale=SCALE)),
        ("bound after public", bound_forward),
        ("public bwd", lambda: cudnn_attn.dot_product_attention_bwd(q, k, v, o, do, lse, scale=SCALE)),
        ("bound after bwd", bound_forward),
        ("o=f()", rebinding),
        ("bound after o=f()", bound_forward),
        ("out= again", lambda: bound(q, k, v, out=out)),
    ]
    for name, fn in steps:
        t = host_us(fn, calls=2000, rounds=5)
        plan = bound._forward.plan()
        state = [(r.enabled, r.captures, r.replays, len(r._graphs)) for r in plan.replays]
        print(f"{name:22s} b2b {t.back_to_back:5.1f} idle {t.idle:5.1f}   fwd replays {state} "
              f"live {replay.live_graphs()}", flush=True)


if __name__ == "__main__":
    main()
