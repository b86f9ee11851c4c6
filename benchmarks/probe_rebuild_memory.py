"""Host memory of the library's rebuild path, without a GPU (issue #11.8's soak, one suspect at a time).

    python benchmarks/probe_rebuild_memory.py [--rebuilds 1600] [--threads 16] [--out FILE]

A 4-graph :class:`cudnn_attn.GraphCache` cycles through eight forward configurations (four lengths, causal
or not), so nearly every lookup evicts and rebuilds; builds go through the plan store, as on the GPU, so
after the first round every rebuild deserializes.  Plans are real cuDNN sm90 plans built deviceless (the
stub ``libcuda.so.1`` of :mod:`cudnn_attn.graphs.driver_stub` where there is no driver), wrapped in their
:class:`~cudnn_attn.engine.plan.CallPlan` with a stand-in device context: everything the library keeps per graph
except the CUDA launch itself.  The resident set after ``gc.collect()`` and glibc's ``malloc_trim(0)`` is
sampled every 100 lookups, single-threaded and then on ``--threads`` threads: once as the library builds
(on one build thread per device, :class:`cudnn_attn.engine.cache.BuildThreads`) and once with every build on the
thread that missed (a per-lookup ``build=``, as before the build threads).  Not a test; prints a table.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import random
import sys
import tempfile
import threading
from pathlib import Path


def _trimmed_rss_mib() -> float:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Context:
    """What a CallPlan keeps of its device context (nothing launches here)."""

    device = 0
    lock = threading.Lock()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rebuilds", type=int, default=1600, help="single-threaded lookups")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--per-thread", type=int, default=800, help="lookups per thread")
    parser.add_argument("--mode", choices=("build thread", "caller threads"), action="append",
                        help="which way to build (default: both, each in its own process)")
    parser.add_argument("--out")
    args = parser.parse_args(argv)

    from cudnn_attn.graphs import driver_stub

    driver_stub.preload(Path(tempfile.gettempdir()) / "cudnn_attn_stub")
    from cudnn_attn.core.config import AttentionConfig, MaskSpec
    from cudnn_attn.engine.cache import GraphCache
    from cudnn_attn.engine.plan import CallPlan
    from cudnn_attn.graphs import DevicelessTarget
    from cudnn_attn.persist.build import build_or_load
    from cudnn_attn.persist.store import PlanStore

    store, target = PlanStore(tempfile.mkdtemp(prefix="plans-")), DevicelessTarget.h200()

    def build(key):
        return CallPlan(build_or_load(key.config, key.kind, target, store=store), _Context())

    configs = [AttentionConfig(batch=2, q_heads=4, kv_heads=4, q_len=64 * (1 + i % 4), kv_len=64 * (1 + i % 4),
                               qk_dim=64, v_dim=64, dtype="bfloat16",
                               **({"mask": MaskSpec(right_bound=0)} if i >= 4 else {})) for i in range(8)]

    modes = args.mode or ["build thread", "caller threads"]
    if len(modes) > 1:                    # each mode in a fresh process: the first would shape the second's heap
        import subprocess

        report = {}
        for mode in modes:
            with tempfile.NamedTemporaryFile(suffix=".json") as part:
                subprocess.run([sys.executable, __file__, "--mode", mode, "--rebuilds", str(args.rebuilds),
                                "--threads", str(args.threads), "--per-thread", str(args.per_thread),
                                "--out", part.name], check=True, stdout=subprocess.DEVNULL)
                report.update(json.loads(Path(part.name).read_text()))
        return _finish(report, args.out)
    report = {}
    for mode in modes:
        cache = GraphCache(maxsize=4, builder=build)
        given = (lambda key: build(key)) if mode == "caller threads" else None     # not the cache's builder: inline

        def lookup(config: AttentionConfig) -> None:
            cache.entry(cache.key(config, "fwd", 0), given)

        single = []
        for step in range(args.rebuilds):
            lookup(configs[step % len(configs)])
            if step % 100 == 99:
                single.append((step + 1, round(_trimmed_rss_mib(), 1)))
        evictions_single = cache.stats().evictions
        threaded = []
        chunk = max(1, args.per_thread // 8)
        for round_ in range(8):
            def work(seed: int) -> None:
                rng = random.Random(seed)
                for _ in range(chunk):
                    lookup(configs[rng.randrange(len(configs))])
            workers = [threading.Thread(target=work, args=(1000 * round_ + i,)) for i in range(args.threads)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            threaded.append(((round_ + 1) * chunk * args.threads, round(_trimmed_rss_mib(), 1)))
        report[f"{mode}: one thread"] = {"lookups": args.rebuilds, "evictions": evictions_single, "rss_mib": single}
        report[f"{mode}: {args.threads} threads"] = {"lookups": 8 * chunk * args.threads,
                                                     "evictions": cache.stats().evictions - evictions_single,
                                                     "rss_mib": threaded}
        cache.clear()
    return _finish(report, args.out)


def _finish(report: dict, out: str | None) -> int:
    if out:
        Path(out).write_text(json.dumps(report, indent=1))
    for name, part in report.items():
        values = [mib for _, mib in part["rss_mib"]]
        print(f"{name:32s} lookups {part['lookups']:6d}  evictions {part['evictions']:6d}  trimmed RSS MiB "
              f"first {values[0]:.1f}  min {min(values):.1f}  max {max(values):.1f}  last {values[-1]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
