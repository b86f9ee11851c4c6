"""Host time of the bound forward in a loop of its own, in a fresh process (not a test): the diagnostic of
the 2026-12-01 session for bench_host rows that vary between machines and with their place in the run.

    python benchmarks/probe_host_isolated.py

bf16 B1 N8 T=S=256 H64; back-to-back calls (median of 5 rounds of 3000), once with the garbage collector on and
once off: the bound call, the bound call with out=, the kept-results lookup, the replayed plan.run, the
direct call and the bound check.
"""
import time, statistics, gc
import numpy as np, cupy as cp, ml_dtypes, cudnn_attn
from cudnn_attn import api
rng = np.random.default_rng(0)
bf16 = np.dtype(ml_dtypes.bfloat16)
q, k, v = (cp.asarray(rng.standard_normal((1, 256, 8, 64), dtype=np.float32)).astype(bf16) for _ in range(3))
bound = cudnn_attn.bind(q, k, v, scale=0.125)
out = cp.empty_like(q)
def loop(fn, n=3000, rounds=5):
    for _ in range(50): fn()
    cp.cuda.runtime.deviceSynchronize()
    s = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n): fn()
        s.append((time.perf_counter() - t) / n * 1e6)
        cp.cuda.runtime.deviceSynchronize()
    return statistics.median(s)
d = bound._forward
plan = d.plan()
stream = cp.cuda.get_current_stream().ptr
res = d._allocate(cp, stream); ptrs = [x.data.ptr for x in (q, k, v)] + [res[0].data.ptr]; del res
rows = {
 "bound": lambda: bound(q, k, v),
 "bound out=": lambda: bound(q, k, v, out=out),
 "_allocate": lambda: d._allocate(cp, stream),
 "plan.run same ptrs": lambda: plan.run(ptrs, stream),
 "direct call": lambda: d((q, k, v), 0),
 "check": lambda: bound._check(d, (q, k, v)),
}
for gcon in (True, False):
    if not gcon: gc.disable()
    for name, fn in rows.items():
        print(f"gc={'on ' if gcon else 'off'} {name:22s} {loop(fn):6.2f} us", flush=True)
    for name, fn in rows.items():
        print(f"gc={'on ' if gcon else 'off'} {name:22s} {loop(fn):6.2f} us (again)", flush=True)
gc.enable()
print([(r.enabled, r.captures, r.replays, len(r._graphs)) for r in plan.replays])
