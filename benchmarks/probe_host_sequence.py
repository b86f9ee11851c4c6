"""Host time of the direct path's calls in sequence, in a fresh process (not a test): the diagnostic of the
2026-12-01 session for bench_host rows that vary between machines and with their place in the run.

    python benchmarks/probe_host_sequence.py

bf16 B1 N8 T=S=256 H64.  Each step is a loop of one call (back-to-back: median of 5 rounds of 2000; idle:
median of 600 calls each after a device synchronisation), in the order bench_host runs them, with the bound
forward timed again after each other kind of call; after each step, the forward plan's replay state
(enabled, captures, replays, graphs) and the live replay graphs.
"""
import time, statistics
import numpy as np, cupy as cp, ml_dtypes, cudnn_attn
from cudnn_attn import replay
rng = np.random.default_rng(0)
bf16 = np.dtype(ml_dtypes.bfloat16)
q, k, v, do = (cp.asarray(rng.standard_normal((1, 256, 8, 64), dtype=np.float32)).astype(bf16) for _ in range(4))
S = 64 ** -0.5
def loop(fn, n=2000, rounds=5):
    for _ in range(20): fn()
    cp.cuda.runtime.deviceSynchronize()
    s = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n): fn()
        s.append((time.perf_counter() - t) / n * 1e6)
        cp.cuda.runtime.deviceSynchronize()
    sync = cp.cuda.runtime.deviceSynchronize
    idle = []
    for _ in range(600):
        sync(); t = time.perf_counter_ns(); fn(); idle.append(time.perf_counter_ns() - t)
    return f"b2b {statistics.median(s):5.1f} idle {statistics.median(idle)/1e3:5.1f}"
o, lse = cudnn_attn.dot_product_attention(q, k, v, scale=S, return_residual=True)
bound = cudnn_attn.bind(q, k, v, scale=S)
out = cp.empty_like(q)
held = [None]
def rebinding(): held[0] = cudnn_attn.dot_product_attention(q, k, v, scale=S)
B = lambda: bound(q, k, v)
steps = [("bound fresh", B), ("out=", lambda: bound(q, k, v, out=out)), ("bound again", B),
         ("public fwd", lambda: cudnn_attn.dot_product_attention(q, k, v, scale=S)), ("bound after public", B),
         ("public bwd", lambda: cudnn_attn.dot_product_attention_bwd(q, k, v, o, do, lse, scale=S)), ("bound after bwd", B),
         ("o=f()", rebinding), ("bound after o=f()", B), ("out= again", lambda: bound(q, k, v, out=out))]
for name, fn in steps:
    r = loop(fn)
    plan = bound._forward.plan()
    print(f"{name:22s} {r}   fwd replays {[(x.enabled, x.captures, x.replays, len(x._graphs)) for x in plan.replays]} live {replay.live_graphs()}", flush=True)
