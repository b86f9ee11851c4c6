"""The graph cache without a GPU: a fake builder stands in for cuDNN."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from cudnn_attn.core.config import AttentionConfig, StaticMask
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
    pytest.param(key(config(mask=StaticMask(right_bound=0))), id="causal"),
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


def test_resize_evicts_the_least_recently_used_and_keeps_the_new_bound():
    builder = CountingBuilder()
    cache = GraphCache(maxsize=4, builder=builder)
    a, b, c, d = (key(config(q_len=n)) for n in (64, 128, 192, 256))
    for k in (a, b, c, d, a):             # a is the most recent: b and c go first
        cache.entry(k)
    cache.resize(2)
    assert cache.maxsize == 2 and len(cache) == 2 and a in cache and d in cache
    assert cache.stats().evictions == 2 and cache.stats().maxsize == 2
    cache.resize(3)                       # a larger bound evicts nothing and holds one more
    cache.entry(b)
    assert len(cache) == 3 and all(k in cache for k in (a, b, d)) and cache.stats().evictions == 2
    assert len(builder.calls) == 5        # b built twice: evicted by the smaller bound


@pytest.mark.parametrize("maxsize", [0, -1, 2.5, None, True])
def test_resize_must_be_positive_int(maxsize):
    cache = GraphCache(maxsize=2, builder=CountingBuilder())
    with pytest.raises(ValueError, match="maxsize: must be a positive int"):
        cache.resize(maxsize)
    assert cache.maxsize == 2


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
    causal = config(mask=StaticMask(right_bound=0))
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
    assert page.startswith("<style>") and page.count("<tr>") == 3 and "mask=causal" in page
    assert '<div class="cudnn-attn-cache">' in page and "<caption>cached graphs" in page


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
    assert cache.dump(1).startswith("graph of bwd")
    with pytest.raises(KeyError, match=r"no cached graph #2 \(cached: #0, #1\)"):
        cache.dump(2)
    with pytest.raises(KeyError, match="no cached graph"):
        cache.dump(key(device=3))
    with pytest.raises(TypeError, match="GraphKey or an entry number"):
        cache.dump("fwd")


def test_entry_numbers_follow_the_build_order_and_survive_reordering():
    """``#`` is given at build time and kept: a hit moves the row (LRU order), not the number."""
    cache = GraphCache(maxsize=2, builder=CountingBuilder())
    a, b, c = (key(config(q_len=n)) for n in (64, 128, 192))
    cache.entry(a)
    cache.entry(b)
    cache.entry(a)
    assert [r.index for r in cache.entries()] == [1, 0]
    cache.entry(c)                                  # evicts b (#1)
    assert [r.index for r in cache.entries()] == [0, 2]
    assert "T=192" in cache.dump(2) and "T=64" in cache.dump(0)
    cache.clear()
    cache.entry(c)
    assert [r.index for r in cache.entries()] == [0]


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
    assert "1 hits, 1 misses" in page and page.count("<tr>") == 4      # the entries and the misses, headed
    assert "recent misses:" in text and "nothing cached; built" in text and "nothing cached" in page


# -- why a lookup missed -------------------------------------------------------------------------------------------

class OriginGraph(FakeGraph):
    def __init__(self, key: GraphKey, origin: str):
        super().__init__(key)
        self.origin = origin


@pytest.mark.parametrize("other,changes", [
    pytest.param(key(config(q_len=129)), ("T 128→129",), id="T"),
    pytest.param(key(config(q_len=129, kv_len=257)), ("T 128→129", "S 256→257"), id="T-and-S"),
    pytest.param(key(config(batch=3)), ("B 2→3",), id="B"),
    pytest.param(key(config(q_heads=4)), ("N 8→4",), id="N"),
    pytest.param(key(config(kv_heads=8)), ("K 2→8",), id="K"),
    pytest.param(key(config(qk_dim=128, v_dim=128)), ("H 64→128", "Hv 64→128"), id="H"),
    pytest.param(key(config(dtype="bfloat16")), ("dtype float16→bfloat16",), id="dtype"),
    pytest.param(key(config(scale=0.1)), ("scale 0.125→0.1",), id="scale"),
    pytest.param(key(config(mask=StaticMask(right_bound=0))), ("mask none→causal",), id="mask"),
    pytest.param(key(config(training=True)), ("training False→True",), id="training"),
    pytest.param(key(kind="bwd"), ("kind fwd→bwd",), id="kind"),
    pytest.param(key(device=1), ("device 0→1",), id="device"),
    pytest.param(key(plan=PlanChoice.AUTOTUNED), ("plan heuristic→autotuned",), id="plan"),
    pytest.param(GraphKey(config(), "fwd", 0, 92800), ("cuDNN 91900→92800",), id="cudnn"),
])
def test_a_miss_names_the_fields_that_differ_from_the_nearest_entry(other, changes):
    cache = GraphCache(builder=CountingBuilder())
    cache.entry(key(config(q_len=4096, kv_len=4096, batch=7)))     # further away: never the nearest
    cache.entry(key())
    cache.entry(other)
    miss = cache.misses()[-1]
    assert miss.changes == changes and miss.nearest == 1 and miss.number == 2 and not miss.evicted
    assert miss.reason.startswith(f"{', '.join(changes)} differs from entry #1; built ")
    assert miss.outcome == "built" and miss.seconds >= 0.0


def test_layout_and_nested_specs_are_named_in_user_terms():
    from cudnn_attn.core.config import AttentionLayout, BiasSpec

    cache = GraphCache(builder=CountingBuilder())
    cache.entry(key())
    cache.entry(key(config(layout=AttentionLayout.BNTH, bias=BiasSpec((1, 8, 128, 256), True))))
    assert cache.misses()[-1].changes == ("layout BTNH→BNTH", "bias none→1x8x128x256+dbias")


def test_the_first_miss_has_nothing_to_compare_with():
    cache = GraphCache(builder=CountingBuilder())
    cache.entry(key())
    (miss,) = cache.misses()
    assert (miss.nearest, miss.changes, miss.number) == (None, (), 0)
    assert miss.reason.startswith("nothing cached; built ")


def test_a_miss_after_an_eviction_says_so():
    """The question a graph cache is asked: why did my loop rebuild every step?  Here: a cache too small."""
    cache = GraphCache(maxsize=2, builder=CountingBuilder())
    steps = [key(config(q_len=n)) for n in (64, 128, 192)]
    for _ in range(2):
        for k in steps:
            cache.entry(k)
    misses = cache.misses()
    assert len(misses) == 6 and [m.evicted for m in misses] == [False] * 3 + [True] * 3
    assert misses[-1].reason.startswith("was cached, evicted earlier (least recently used); built ")
    assert "evicted earlier" in repr(cache) and "evicted earlier" in cache._repr_html_()


def test_a_failed_build_is_a_miss_with_its_error():
    def failing(k):
        raise RuntimeError("cuDNN said no\nsecond line")

    cache = GraphCache(builder=failing)
    with pytest.raises(RuntimeError):
        cache.entry(key())
    (miss,) = cache.misses()
    assert miss.number is None and miss.outcome == "failed" and miss.error == "RuntimeError: cuDNN said no"
    assert miss.reason.startswith("nothing cached; failed ") and miss.reason.endswith("RuntimeError: cuDNN said no")
    assert "failed: RuntimeError: cuDNN said no" in repr(cache.misses())


def test_a_store_load_is_a_miss_with_origin_loaded():
    cache = GraphCache(builder=lambda k: OriginGraph(k, "loaded"))
    cache.entry(key())
    assert cache.misses()[-1].outcome == "loaded" and cache.entry_detail(0).origin == "loaded"


def test_misses_are_bounded_and_cleared():
    from cudnn_attn.engine.cache import MISSES_KEPT

    cache = GraphCache(maxsize=4, builder=CountingBuilder())
    for n in range(MISSES_KEPT + 5):
        cache.entry(key(config(q_len=n + 1)))
    misses = cache.misses()
    assert len(misses) == MISSES_KEPT and misses[0].number == 5 and misses[-1].number == MISSES_KEPT + 4
    assert len(repr(cache).split("recent misses:")[1].strip().splitlines()) == GraphCache.RECENT_SHOWN
    cache.clear()
    assert not cache.misses() and repr(cache.misses()) == "no misses"


def test_hits_and_waiters_record_no_miss():
    builder = CountingBuilder(delay=0.2)
    cache = GraphCache(builder=builder)
    threads = [threading.Thread(target=cache.entry, args=(key(),)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cache.entry(key())
    assert len(cache.misses()) == 1 and cache.stats().hits == 4


def test_the_hit_path_does_not_compare_keys(monkeypatch):
    """Only a miss looks for the nearest entry; a hit stays one dictionary lookup."""
    from cudnn_attn.engine import miss_reason

    cache = GraphCache(builder=CountingBuilder())
    for n in (64, 128):
        cache.entry(key(config(q_len=n)))
    monkeypatch.setattr(miss_reason, "nearest", lambda *a: pytest.fail("a hit compared keys"))
    for _ in range(3):
        cache.entry(key(config(q_len=64)))
    assert cache.stats().hits == 3


# -- one entry in detail -------------------------------------------------------------------------------------------

def test_entry_detail_has_plan_engine_workspace_origin_hits_and_graph():
    cache = GraphCache(builder=CountingBuilder())
    cache.entry(key(config(mask=StaticMask(right_bound=0))))
    cache.entry(key(config(mask=StaticMask(right_bound=0))))
    detail = cache.entry_detail(0)
    assert detail is not None and detail == cache.entry_detail(key(config(mask=StaticMask(right_bound=0))))
    assert (detail.number, detail.kind, detail.device, detail.hits) == (0, "fwd", 0, 1)
    assert (detail.plan, detail.engine, detail.workspace_bytes, detail.origin) == ("eng2_k24=7", "engine 2", 4096,
                                                                                     "built")
    assert detail.graph == cache.dump(0) and detail.held_by == ()
    text = repr(detail)
    assert "engine 2" in text and "4.0 KiB" in text and "no compiled JAX program" in text
    assert text.endswith(cache.dump(0))
    page = detail._repr_html_()
    assert "<caption>graph cache entry #0</caption>" in page and "<pre>graph of fwd" in page


def test_entry_detail_escapes_html():
    cache = GraphCache(builder=CountingBuilder())
    cache.entry(key())
    page = cache.entry_detail(0)._replace(graph="<script>alert(1)</script>")._repr_html_()
    assert "<script>" not in page and "&lt;script&gt;" in page


def test_holders_name_what_holds_each_plan():
    """The JAX bridge (a higher layer) registers what its compiled call sites hold; the cache names them."""
    cache = GraphCache(builder=CountingBuilder())
    a = cache.entry(key(config(q_len=64))).plan
    cache.entry(key(config(q_len=128)))
    other = FakeGraph(key())                                  # a plan the cache does not hold: named nowhere
    cache.add_holder(lambda: [(a, "JAX call site 3 on device 0"), (other, "elsewhere")])
    cache.add_holder(lambda: [(a, "JAX call site 5 on device 0")])
    assert cache.entry_detail(0).held_by == ("JAX call site 3 on device 0", "JAX call site 5 on device 0")
    assert cache.entry_detail(1).held_by == ()
    assert [r.held for r in cache.entries()] == [2, 0]
    assert "JAX call site 3 on device 0; JAX call site 5" in repr(cache.entry_detail(0))


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


def test_the_jax_bridge_names_the_call_sites_that_hold_a_plan(monkeypatch):
    """``cudnn_target`` registers its handler's plans with the process's cache: each (call site, device) it keeps,
    with the number of live executables pinning the site (here two fake sites; the H200 test compiles real ones,
    ``tests/gpu/test_cache_gpu.py``)."""
    pytest.importorskip("jax")
    from cudnn_attn.engine.cache import graph_cache
    from cudnn_attn.jax_bridge import cudnn_target

    plan, other = object(), object()
    monkeypatch.setattr(cudnn_target, "_launches", {(7, 0): cudnn_target.SiteLaunch(plan, None),
                                                    (8, 1): cudnn_target.SiteLaunch(other, None)})
    monkeypatch.setitem(cudnn_target._pins, 7, 2)
    held = graph_cache._held()
    assert held[id(plan)] == ["JAX call site 7 on device 0: 2 live executable(s)"]
    assert held[id(other)] == ["JAX call site 8 on device 1: 0 live executable(s)"]


def test_a_deviceless_cache_needs_a_plan_store_folder(monkeypatch):
    from cudnn_attn import NoGPUError

    monkeypatch.setenv("CUDNN_ATTN_CACHE_DIR", "off")
    with pytest.raises(NoGPUError, match="CUDNN_ATTN_CACHE_DIR=off"):
        GraphCache.deviceless(maxsize=2)
