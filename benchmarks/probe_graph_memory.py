"""What one replayed launch's CUDA graph costs in memory, on the GPU (issue #11.8's soak: replay on grew the
device by 90 MiB and the host by 16 MiB where replay off grew 4 and 0.3).

    python benchmarks/probe_graph_memory.py [--graphs 200] [--churn 20000] [--out FILE]

A bound forward and a bound backward (bf16 B1 N8 T=S=256 H64, causal) launch with ``--graphs`` different
result buffers, each twice, so :mod:`cudnn_attn.engine.replay` captures one executable graph per buffer (its
per-plan and per-device bounds raised for the probe).  Device memory in use (``cudaMemGetInfo``, which moves
in 2 MiB steps) and the host's resident set after ``malloc_trim`` are read before the captures, after them,
and after the graphs are destroyed.  Then :func:`churn`: graphs replaced on every call, destroyed and
instantiated against updated in place (does the driver keep memory under churn?).  Not a test; prints one
line per measurement and writes JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os

import numpy as np

from cudnn_attn.engine import replay

MIB = 2 ** 20


def _host_mib() -> float:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=int, default=200)
    parser.add_argument("--churn", type=int, default=20000, help="calls of each churn experiment")
    parser.add_argument("--out", default="probe_graph_memory.json")
    args = parser.parse_args()
    replay.CAPACITY = replay.DEVICE_CAPACITY = 10 * args.graphs
    replay.PATIENCE = 10 ** 9                  # every address here is captured once and never replayed
    import cupy as cp
    import ml_dtypes

    import cudnn_attn

    rng = np.random.default_rng(5)
    q, k, v, do = (cp.asarray(rng.standard_normal((1, 256, 8, 64)).astype(ml_dtypes.bfloat16)) for _ in range(4))
    causal = cudnn_attn.MaskType.CAUSAL
    inference = cudnn_attn.bind(q, k, v, scale=0.125, mask_type=causal)
    training = cudnn_attn.bind(q, k, v, scale=0.125, mask_type=causal, return_residual=True)
    o, lse = training(q, k, v)
    training.backward(q, k, v, o, do, lse)

    def device_mib() -> float:
        cp.cuda.runtime.deviceSynchronize()
        free, total = cp.cuda.runtime.memGetInfo()
        return (total - free) / MIB

    results = {}
    for kind in ("fwd", "bwd"):
        # a different address per graph: the forward's output (out=), the backward's dO; results dropped at
        # once come back at the same block (result_blocks), so each address set repeats and is captured
        if kind == "fwd":
            direct, buffers = inference._forward, [cp.empty_like(q) for _ in range(args.graphs)]
            call = lambda i: inference(q, k, v, out=buffers[i])                 # noqa: E731
        else:
            direct, buffers = training._backward, [do.copy() for _ in range(args.graphs)]
            call = lambda i: training.backward(q, k, v, o, buffers[i], lse)     # noqa: E731
        plan = direct.plan()
        before_graphs = sum(len(r) for r in plan.replays)
        before = (device_mib(), _host_mib())
        for i in range(args.graphs):
            for _ in range(2):
                call(i)
        captured = sum(len(r) for r in plan.replays) - before_graphs
        after = (device_mib(), _host_mib())
        for r in plan.replays:
            r.clear()
        cleared = (device_mib(), _host_mib())
        results[kind] = {"graphs": captured, "device_mib": [before[0], after[0], cleared[0]],
                         "host_mib": [before[1], after[1], cleared[1]],
                         "device_kib_per_graph": 1024 * (after[0] - before[0]) / max(captured, 1),
                         "host_kib_per_graph": 1024 * (after[1] - before[1]) / max(captured, 1)}
        r = results[kind]
        print(f"{kind}: {captured} graphs: device {r['device_mib'][0]:.0f} -> {r['device_mib'][1]:.0f} -> "
              f"{r['device_mib'][2]:.0f} MiB ({r['device_kib_per_graph']:.0f} KiB/graph), host "
              f"{r['host_mib'][0]:.1f} -> {r['host_mib'][1]:.1f} -> {r['host_mib'][2]:.1f} MiB "
              f"({r['host_kib_per_graph']:.1f} KiB/graph); destroyed: back to within "
              f"{r['device_mib'][2] - r['device_mib'][0]:+.0f} / {r['host_mib'][2] - r['host_mib'][0]:+.1f} MiB",
              flush=True)
    results["churn"] = churn(args.churn, device_mib, inference, training, q, k, v, o, do, lse)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


def churn(calls: int, device_mib, inference, training, q, k, v, o, do, lse) -> dict:
    """Graphs replaced all the time: 16 address sets in a cycle through a plan bound of 8 graphs, so that every
    call past the first sweeps captures for addresses whose graph was given away.  Once with the replaced graph
    destroyed and a new one instantiated, once with it updated in place (``replay.RECYCLE``): device and host
    memory every tenth of ``calls``, and the host time of a call (a capture each)."""
    import time

    import cupy as cp

    replay.CAPACITY, replay.PATIENCE = 8, 10 ** 9
    out = {}
    for kind in ("fwd", "bwd"):
        if kind == "fwd":
            direct, buffers = inference._forward, [cp.empty_like(q) for _ in range(16)]
            call = lambda i: inference(q, k, v, out=buffers[i])                 # noqa: E731
        else:
            direct, buffers = training._backward, [do.copy() for _ in range(16)]
            call = lambda i: training.backward(q, k, v, o, buffers[i], lse)     # noqa: E731
        plan = direct.plan()
        for recycle in (False, True):
            replay.RECYCLE = recycle
            for r in plan.replays:
                r.clear()
                r._seen.clear()
            made0 = replay.churn()
            device, host = [device_mib()], [_host_mib()]
            started = time.perf_counter()
            for step in range(10):
                for i in range(calls // 10):
                    call(i % 16)
                device.append(device_mib())
                host.append(_host_mib())
            seconds = time.perf_counter() - started
            made = [a - b for a, b in zip(replay.churn(), made0)]
            label = f"{kind}, {'updated in place' if recycle else 'destroyed + instantiated'}"
            out[label] = {"calls": calls, "device_mib": device, "host_mib": host, "made_destroyed_updated": made,
                          "us_per_call": 1e6 * seconds / calls}
            print(f"churn {label}: {calls} calls, graphs made/destroyed/updated {made}, device MiB "
                  f"{device[0]:.0f} -> {max(device):.0f} (max) -> {device[-1]:.0f}, host MiB {host[0]:.1f} -> "
                  f"{host[-1]:.1f}, {1e6 * seconds / calls:.1f} us/call (incl. memory reads)", flush=True)
    replay.RECYCLE = True
    return out


if __name__ == "__main__":
    main()
