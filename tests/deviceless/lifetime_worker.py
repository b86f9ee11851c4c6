"""One deviceless process of the lifetime tests: ``python lifetime_worker.py STORE ACTION``.

Started by ``test_lifetime_deviceless.py`` with the stub ``libcuda.so.1`` on ``LD_LIBRARY_PATH`` (where
there is no driver).  It builds real cuDNN 9.19 sm90 graphs through the library's graph cache and plan
store, as the GPU path does (only the planning target differs), prints one JSON object on its last
stdout line (cuDNN's console output goes to stderr) and exits normally, so that the test can read what
nanobind reports at interpreter exit on stderr.

* ``exit``  -- graphs of every kind that holds frontend objects (score_mod forward and backward, FP8,
  bias, dropout, packed, paged; built, saved and loaded back from the store) stay in the process-wide
  ``cudnn_attn.graph_cache`` until exit: :func:`cudnn_attn.engine.runtime.release` must drop them.
* ``evict N`` -- N distinct configurations (sequence lengths; every fourth one with a score_mod) through
  a 4-graph :class:`~cudnn_attn.engine.cache.GraphCache`; reports how many built graphs are still alive
  (weak references to the ``BuiltGraph`` and to the frontend's Python graph) after the last build and
  after ``gc.collect()``, and the resident set size along the way.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))      # tests/: the matrix configurations

from deviceless.matrix import (  # noqa: E402
    BR_PADDING_CAUSAL,
    CAUSAL,
    PADDING_CAUSAL,
    SOFTCAP,
    N,
    S,
    T,
    bias,
    config,
    fp8,
    packed,
    paged,
)

EXIT_CASES = [
    (config(score_mod=SOFTCAP), "fwd"),
    (config(score_mod=SOFTCAP), "bwd"),
    (config(score_mod=SOFTCAP, mask=CAUSAL, bias=bias((1, N, T, S), differentiable=False)), "bwd"),
    (config(bias=bias((1, N, T, S))), "bwd"),
    (config(dropout_rate=0.1, mask=CAUSAL), "fwd"),
    (config(packing=packed(), mask=PADDING_CAUSAL), "bwd"),
    (config(q_len=1, training=False, paging=paged(), mask=BR_PADDING_CAUSAL), "fwd"),
    (fp8(mask=CAUSAL), "fwd"),
]


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _Context:
    """What a :class:`~cudnn_attn.engine.plan.CallPlan` keeps of its device context (nothing launches here)."""

    device = 0
    lock = threading.Lock()


def _builder(store, target):
    """The GPU path's builder with a deviceless target: the graph (built or loaded) in its call plan and
    launcher, so that everything the library holds per graph is exercised."""
    from cudnn_attn.engine.plan import CallPlan
    from cudnn_attn.persist.build import build_or_load

    def build(key):
        return CallPlan(build_or_load(key.config, key.kind, target, store=store), _Context())
    return build


def exit_case(store_dir: str) -> dict:
    from cudnn_attn.engine.cache import graph_cache
    from cudnn_attn.graphs import DevicelessTarget
    from cudnn_attn.persist.build import build_or_load
    from cudnn_attn.persist.store import PlanStore

    store, target = PlanStore(store_dir), DevicelessTarget.h200()
    build = _builder(store, target)
    origins, paths = [], []
    for cfg, kind in EXIT_CASES:
        plan = graph_cache.entry(graph_cache.key(cfg, kind, 0), build).plan
        origins.append(plan.built.origin)
        paths.append(plan.launcher.path)
    # the same forward graphs again from the store: loaded (deserialized) graphs hold frontend objects too
    loaded = [build_or_load(cfg, kind, target, store=store) for cfg, kind in EXIT_CASES if kind == "fwd"]
    globals()["_HELD"] = loaded                              # held by the module until exit
    return {"origins": origins, "launch_paths": paths, "loaded": [g.origin for g in loaded],
            "cached": len(graph_cache)}


def evict_case(store_dir: str, count: int) -> dict:
    from cudnn_attn.engine.cache import GraphCache
    from cudnn_attn.graphs import DevicelessTarget

    cache = GraphCache(maxsize=4, builder=_builder(None, DevicelessTarget.h200()))
    refs: list[tuple[weakref.ref, weakref.ref]] = []
    rss = [_rss_mib()]
    for i in range(count):
        cfg = config(q_len=64 + 8 * i, kv_len=64 + 8 * i, score_mod=SOFTCAP if i % 4 == 3 else None)
        built = cache.entry(cache.key(cfg, "fwd", 0)).graph
        refs.append((weakref.ref(built), weakref.ref(built.graph)))
        del built
        rss.append(_rss_mib())

    def alive() -> tuple[int, int]:
        return sum(r() is not None for r, _ in refs), sum(g() is not None for _, g in refs)

    before_gc = alive()
    gc.collect()
    after_gc = alive()
    return {"built": count, "cached": len(cache), "evictions": cache.stats().evictions,
            "alive_before_gc": before_gc, "alive_after_gc": after_gc, "live_graphs": cache.live_graphs(),
            "rss_mib": rss}


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)                                   # cuDNN's printf output must not corrupt the reply
    store_dir, action, *args = sys.argv[1:]
    reply = exit_case(store_dir) if action == "exit" else evict_case(store_dir, int(args[0]))
    replies.write(json.dumps(reply) + "\n")
    replies.flush()


if __name__ == "__main__":
    main()
