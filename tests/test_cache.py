"""The graph cache without a GPU: a fake builder stands in for cuDNN."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from cudnn_attn.core.config import AttentionConfig, MaskSpec
from cudnn_attn.engine.cache import CacheListing, GraphCache, GraphKey, PlanChoice, build_plan

CUDNN = 91900


class FakeGraph:
    def __init__(self, key: GraphKey, workspace_size: int = 4096):
        self.key = key
        self.workspace_size = workspace_size
        self.plan_name = "eng2_k24=7"

    def describe(self) -> str:
        return f"graph of {self.key.kind} {self.key.config.describe()}"


class CountingBuilder:
    def __init__(self, delay: float = 0.0):
        self.calls: list[GraphKey] = []
        self.delay = delay
        self._lock = threading.Lock()

    def __call__(self, key: GraphKey) -> FakeGraph:
        with self._lock:
            self.calls.append(key)
        time.sleep(self.delay)
        return FakeGraph(key)


def config(**changes) -> AttentionConfig:
    base = AttentionConfig(batch=2, q_heads=8, kv_heads=2, q_len=128, kv_len=256, qk_dim=64, v_dim=64,
                           dtype="float16", scale=0.125)
    return base.replace(**changes)


def key(cfg: AttentionConfig | None = None, kind: str = "fwd", device: int = 0, **fields) -> GraphKey:
    return GraphKey(cfg or config(), kind, device, CUDNN, **fields)


def test_miss_then_hit_builds_once():
    builder = CountingBuilder()
    cache = GraphCache(builder=builder)
    first = cache.entry(key())
    second = cache.entry(key())
    assert first is second and len(builder.calls) == 1
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.evictions, stats.entries) == (1, 1, 0, 1)
    assert stats.build_seconds >= 0.0 and first.hits == 1


@pytest.mark.parametrize("other", [
    pytest.param(key(kind="bwd"), id="kind"),
    pytest.param(key(device=1), id="device"),
    pytest.param(key(plan=PlanChoice.AUTOTUNED), id="plan"),
    pytest.param(key(rng_dump=True), id="rng_dump"),
    pytest.param(key(config(scale=0.1)), id="scale"),
    pytest.param(key(config(mask=MaskSpec(right_bound=0))), id="causal"),
    pytest.param(key(config(dtype="bfloat16")), id="dtype"),
    pytest.param(GraphKey(config(), "fwd", 0, 92800), id="cudnn-version"),
])
def test_every_key_field_separates_graphs(other):
    builder = CountingBuilder()
    cache = GraphCache(builder=builder)
    cache.entry(key())
    cache.entry(other)
    assert len(builder.calls) == 2 and builder.calls[1] == other


def test_least_recently_used_is_evicted():
    builder = CountingBuilder()
    cache = GraphCache(maxsize=2, builder=builder)
    a, b, c = (key(config(q_len=n)) for n in (64, 128, 192))
    cache.entry(a)
    cache.entry(b)
    cache.entry(a)            # a is now the most recent: b goes first
    cache.entry(c)
    assert a in cache and c in cache and b not in cache
    assert cache.stats().evictions == 1 and len(cache) == 2
    cache.entry(b)
    assert len(builder.calls) == 4


def test_failed_build_is_not_cached_and_propagates():
    calls = []

    def failing(k):
        calls.append(k)
        raise RuntimeError("cuDNN said no")

    cache = GraphCache(builder=failing)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="cuDNN said no"):
            cache.entry(key())
    assert len(calls) == 2 and len(cache) == 0 and cache.stats().misses == 2


def test_concurrent_misses_build_once():
    builder = CountingBuilder(delay=0.2)
    cache = GraphCache(builder=builder)
    start = threading.Barrier(8)
    results = []

    def worker():
        start.wait()
        results.append(cache.entry(key()))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builder.calls) == 1
    assert len({id(r) for r in results}) == 1
    stats = cache.stats()
    assert (stats.misses, stats.hits) == (1, 7)


def test_per_call_builder_overrides_the_default():
    default, special = CountingBuilder(), CountingBuilder()
    cache = GraphCache(builder=default)
    cache.entry(key(plan=PlanChoice.AUTOTUNED), special)
    assert not default.calls and len(special.calls) == 1


def test_clear_drops_entries_and_statistics():
    cache = GraphCache(builder=CountingBuilder())
    cache.entry(key())
    cache.entry(key())
    cache.clear()
    assert len(cache) == 0 and cache.stats()[:5] == (0, 0, 0, 0.0, 0)


def test_listing_shows_features_shapes_and_hits():
    cache = GraphCache(builder=CountingBuilder())
    causal = config(mask=MaskSpec(right_bound=0))
    cache.entry(key(causal))
    cache.entry(key(causal))
    cache.entry(key(kind="bwd", plan=PlanChoice.AUTOTUNED))
    rows = cache.entries()
    assert isinstance(rows, CacheListing) and len(rows) == 2
    first = rows[0]
    assert first.kind == "fwd" and first.hits == 1 and first.workspace_bytes == 4096
    assert "mask=causal" in first.features
    assert first.shapes == "2x128x8x64 2x256x2x64 2x256x2x64 2x128x8x64"
    assert rows[1].plan.endswith("(autotuned)")
    text = repr(rows)
    assert "mask=causal" in text and "4.0 KiB" in text and text.splitlines()[0].startswith("#")
    page = rows._repr_html_()
    assert page.startswith("<table>") and page.count("<tr>") == 3 and "mask=causal" in page


def test_listing_escapes_html():
    cache = GraphCache(builder=CountingBuilder())
    cache.entry(key())
    assert "<script>" not in CacheListing([r._replace(features="<script>") for r in cache.entries()])._repr_html_()


def test_empty_listing():
    assert repr(GraphCache(builder=CountingBuilder()).entries()) == "graph cache: empty"


def test_dump_by_key_and_index():
    cache = GraphCache(builder=CountingBuilder())
    cache.entry(key())
    cache.entry(key(kind="bwd"))
    assert cache.dump(key(kind="bwd")).startswith("graph of bwd")
    assert cache.dump(0).startswith("graph of fwd")
    assert cache.dump(-1).startswith("graph of bwd")
    with pytest.raises(IndexError, match="out of range for 2"):
        cache.dump(2)
    with pytest.raises(KeyError, match="no cached graph"):
        cache.dump(key(device=3))
    with pytest.raises(TypeError, match="GraphKey or an int"):
        cache.dump("fwd")


def test_build_is_logged_with_its_duration(caplog):
    cache = GraphCache(builder=CountingBuilder())
    with caplog.at_level(logging.INFO, logger="cudnn_attn"):
        cache.entry(key())
        cache.entry(key())
    built = [r for r in caplog.records if r.name == "cudnn_attn" and "built cuDNN fwd graph" in r.getMessage()]
    assert len(built) == 1
    assert " s (plan eng2_k24=7" in built[0].getMessage() and "B=2" in built[0].getMessage()


@pytest.mark.parametrize("maxsize", [0, -1, 2.5, None, True])
def test_maxsize_must_be_positive_int(maxsize):
    with pytest.raises(ValueError, match="maxsize"):
        GraphCache(maxsize=maxsize)


def test_key_rejects_unknown_kind():
    with pytest.raises(ValueError, match="kind: must be one of"):
        GraphCache(builder=CountingBuilder()).key(config(), "forward", 0)


def test_key_reads_the_cudnn_version():
    import cudnn

    try:
        version = cudnn.backend_version()
    except Exception as exc:  # no libcudnn in this environment
        pytest.skip(f"cuDNN library not loadable: {exc}")
    assert GraphCache(builder=CountingBuilder()).key(config(), "fwd", 0).cudnn_version == version


def test_default_builder_leaves_autotuned_graphs_to_autotune():
    with pytest.raises(ValueError, match="autotune"):
        build_plan(key(plan=PlanChoice.AUTOTUNED))


def test_module_instance_is_exported():
    import cudnn_attn

    assert isinstance(cudnn_attn.graph_cache, GraphCache)
    assert cudnn_attn.graph_cache is cudnn_attn.engine.cache.graph_cache


def test_the_cache_itself_shows_its_statistics_and_listing():
    cache = GraphCache(builder=CountingBuilder())
    cache.entry(key())
    cache.entry(key())
    text = repr(cache)
    assert text.splitlines()[0].startswith("GraphCache: 1/") and "1 hits, 1 misses" in text
    assert "mask=none" in text
    page = cache._repr_html_()
    assert "1 hits, 1 misses" in page and page.count("<tr>") == 2


def test_live_graphs_counts_what_is_still_alive_anywhere():
    """Evicted graphs die with their entry unless someone else holds them; ``live_graphs`` sees both."""
    cache = GraphCache(maxsize=2, builder=CountingBuilder())
    held = cache.entry(key(config(q_len=64))).plan            # a caller (e.g. the JAX bridge) keeps this one
    for n in (128, 192, 256, 320):
        cache.entry(key(config(q_len=n)))
    assert len(cache) == 2 and cache.stats().evictions == 3
    assert cache.live_graphs() == 3                            # the two cached and the held one
    del held
    assert cache.live_graphs() == 2
    cache.clear()
    assert cache.live_graphs() == 0


# -- one build thread per device -------------------------------------------------------------------------------

def test_the_caches_builder_runs_on_one_thread_per_device():
    """Whichever thread misses, the cache's builder runs on its device's build thread (one glibc arena for
    cuDNN's host allocations; module doc); a ``build=`` given to one lookup runs on the caller's thread."""
    threads = []

    def builder(key):
        threads.append((key.device, threading.current_thread().name))
        return f"plan {key.device}"

    cache = GraphCache(maxsize=8, builder=builder)
    config = AttentionConfig(batch=1, q_heads=2, kv_heads=2, q_len=8, kv_len=8, qk_dim=16, v_dim=16, dtype="float16")
    workers = [threading.Thread(target=lambda d=d, s=s: cache.entry(cache.key(config.replace(scale=s), "fwd", d)))
               for d in (0, 1) for s in (0.1, 0.2, 0.3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    by_device = {d: {name for device, name in threads if device == d} for d in (0, 1)}
    assert len(threads) == 6 and all(len(names) == 1 for names in by_device.values()), by_device
    assert by_device[0] != by_device[1] and all(n.startswith("cudnn_attn-build-") for s in by_device.values() for n in s)
    cache.entry(cache.key(config.replace(scale=0.4), "fwd", 0), lambda key: builder(key))
    assert threads[-1][1] == threading.current_thread().name


def test_build_threads_raise_the_builds_error_and_nest_in_place():
    from cudnn_attn.engine.cache import BuildThreads

    threads = BuildThreads()

    def fail():
        raise ValueError("query: bad")

    with pytest.raises(ValueError, match="query: bad"):
        threads.run(3, fail)
    outer = threads.run(3, lambda: (threading.current_thread().name,
                                    threads.run(3, lambda: threading.current_thread().name)))
    assert outer[0] == outer[1] and outer[0].startswith("cudnn_attn-build-3")


_FORK_CHECK = """
import os, signal
from cudnn_attn.engine.cache import build_threads

build_threads.run(7, lambda: None)                 # the parent has a build thread for device 7
child = os.fork()
if child == 0:                                     # the child: its parent's threads do not exist here
    signal.alarm(20)
    os._exit(0 if build_threads.run(7, lambda: 41) == 41 else 1)
_, status = os.waitpid(child, 0)
raise SystemExit(0 if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else f"child status {status:#x}")
"""


def test_a_forked_child_builds_on_its_own_threads():
    """Without the at-fork reset the child would hand its build to the parent's thread, which does not exist in
    the child, and wait forever (the alarm turns that into a failure).  In a fresh process: this one runs JAX's
    threads, which make a fork here unsafe."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _FORK_CHECK], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
