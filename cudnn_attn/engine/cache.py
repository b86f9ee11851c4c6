"""The graph cache: call plans of built cuDNN graphs, keyed by everything that defines them.

A cuDNN graph costs 0.05-1.5 s to build (NVRTC compiles the kernels of a new engine configuration),
and executing one costs microseconds, so every graph is built once per process and reused.

* :class:`GraphKey` is a frozen dataclass: the :class:`~cudnn_attn.core.config.AttentionConfig` (shapes,
  dtypes, layout, mask fields, scale, ...), the graph kind (``"fwd"``/``"bwd"``), the CUDA device,
  the cuDNN version, the plan choice (cuDNN's heuristic or autotuned) and the debug ``rng_dump``
  output.  Strides are implied by the layout and the scale is in the config, so two calls share a
  graph exactly when cuDNN would build the same one.
* An entry holds the :class:`~cudnn_attn.engine.plan.CallPlan` of the graph: the built graph and everything a
  launch needs on its device.  Evicting the entry frees them (a caller holding the plan keeps it alive).
* :class:`GraphCache` is a bounded, thread-safe LRU with statistics.  Two threads missing the same
  key build it once (the second waits).  Failed builds are not cached.  The default builder checks
  support (:func:`cudnn_attn.core.support.check_supported`) before any GPU work.
* :meth:`GraphCache.live_graphs` counts the graphs the cache built that are still alive anywhere (in the
  cache, pinned by the JAX bridge, held by a caller): evicted graphs must not stay alive behind it.
* ``entries()`` lists what is cached - a table in Jupyter (``_repr_html_``) and in a terminal
  (``repr``; views in :mod:`.cache_view`).  Every entry has a number (``#``, build order), which
  ``dump(key_or_number)`` (its cuDNN graph, JSON text) and ``entry_detail(key_or_number)`` (plan, engine,
  workspace, build time and origin, hits, the JAX programs holding it, the graph) take.
* Every miss records why it missed (``misses()``, the last :data:`MISSES_KEPT`): the fields in which its key
  differs from the nearest cached entry (:mod:`.miss_reason`), or that the key was cached and evicted.  The
  work is done on the miss path only; a hit is one dictionary lookup, as before.
* What holds plans outside the cache registers itself (:meth:`GraphCache.add_holder`): the JAX bridge, a
  higher layer, names the compiled programs' call sites that run each plan.
* Each build is logged on the ``cudnn_attn`` logger at INFO with its duration.
* The cache's builder runs on one thread per device (:class:`BuildThreads`), whichever thread asks.  Builds
  are serialised per device anyway (the planning handle), and cuDNN's host allocations then come from one
  glibc arena: measured deviceless with 16 threads rebuilding through a 4-graph cache, the trimmed RSS grew
  by 3-8 MiB over 12,800 lookups when every thread built, and stayed within 0.4 MiB on one build thread
  (DESIGN.md, "Measured facts").  A ``build=`` given to one lookup (autotuning, which times on
  the caller's stream) runs on the caller's thread.

``graph_cache`` is the process-wide instance used by :mod:`cudnn_attn.fronts.cupy` and the JAX bridge
(``graph_cache.plan(config, kind, device) -> CallPlan``).
"""

from __future__ import annotations

import collections
import enum
import functools
import html
import logging
import os
import re
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple

from cudnn_attn.core.config import AttentionConfig
from cudnn_attn.core.environment import Environment, cudnn_version
from cudnn_attn.core.errors import NoGPUError
from cudnn_attn.core.support import check_supported
from cudnn_attn.core.types import Kind
from cudnn_attn.persist.store import default_store

from . import miss_reason, preload, runtime
from .cache_view import CacheListing, CacheRow, EntryDetail, MissListing, MissRow, block, size
from .plan import CallPlan

__all__ = ["CacheListing", "CacheRow", "EntryDetail", "GraphCache", "GraphKey", "MissListing", "MissRow",
           "PlanChoice", "build_plan", "graph_cache"]

logger = logging.getLogger("cudnn_attn")

KINDS = tuple(Kind)


class PlanChoice(enum.Enum):
    """How the execution plan of a graph is chosen."""

    HEURISTIC = "heuristic"   # cuDNN's heuristic ranking (mode A, then FALLBACK): first plan that builds
    AUTOTUNED = "autotuned"   # every plan built and timed once on the device; the fastest is kept


@dataclass(frozen=True)
class GraphKey:
    config: AttentionConfig
    kind: str
    device: int
    cudnn_version: int
    plan: PlanChoice = PlanChoice.HEURISTIC
    rng_dump: bool = False   # debug output of the dropout keep-mask (tests only)

    def __post_init__(self):
        # Hashing a config walks every nested field (microseconds): do it once per key.
        object.__setattr__(self, "_hash", hash((self.config, self.kind, self.device, self.cudnn_version,
                                                self.plan, self.rng_dump)))

    def __hash__(self) -> int:
        return self._hash


class CacheStats(NamedTuple):
    hits: int
    misses: int
    evictions: int
    build_seconds: float
    entries: int
    maxsize: int
    copies: int = 0          # input arrays the fronts copied because cuDNN cannot read them as they are


_bytes = size          # one spelling of sizes (the command line's too)


def _shapes(config: AttentionConfig) -> str:
    return " ".join("x".join(map(str, s)) for s in (config.q_shape, config.k_shape, config.v_shape, config.o_shape))


class CacheEntry:
    """A cached :class:`~cudnn_attn.engine.plan.CallPlan` (what the builder returned) with its key and bookkeeping;
    ``number`` is the entry's ``#`` (build order within its cache)."""

    __slots__ = ("key", "plan", "build_seconds", "hits", "number")

    def __init__(self, key: GraphKey, plan: Any, build_seconds: float, number: int = 0):
        self.key = key
        self.plan = plan
        self.build_seconds = build_seconds
        self.hits = 0
        self.number = number

    @property
    def graph(self) -> Any:
        """The built graph (``BuiltGraph``) of the plan."""
        return getattr(self.plan, "built", self.plan)


class _Pending:
    """A build in progress, awaited by the threads that missed the same key meanwhile."""

    def __init__(self):
        self.done = threading.Event()
        self.entry: CacheEntry | None = None
        self.error: BaseException | None = None


Builder = Callable[[GraphKey], Any]
Holder = Callable[[], Iterable[tuple[Any, str]]]
"""What holds plans outside the cache: ``holder() -> [(plan, who holds it), ...]`` (the JAX bridge registers one
for the call sites of compiled programs, :meth:`GraphCache.add_holder`)."""

MISSES_KEPT = 32
"""How many recent misses :meth:`GraphCache.misses` keeps."""
EVICTED_KEPT = 1024
"""How many evicted keys the cache remembers, to say that a miss was an eviction."""


def build_plan(key: GraphKey, *, plan_name: str | None = None) -> Any:
    """Default builder: the support check for ``key.device`` first (no GPU work for a refused
    configuration), then the cuDNN graph and its :class:`~cudnn_attn.engine.plan.CallPlan`.

    ``plan_name`` pins cuDNN's plan (an autotuned winner).  ``PlanChoice.AUTOTUNED`` needs real
    buffers to time the plans, so it is built by :mod:`cudnn_attn.engine.autotune` through the ``build=``
    argument of :meth:`GraphCache.entry`.
    """
    import cupy

    from cudnn_attn.persist.build import build_or_load  # imports the cuDNN frontend

    if key.plan is not PlanChoice.HEURISTIC and plan_name is None:
        raise ValueError(f"plan: {key.plan.value} graphs are built by cudnn_attn.engine.autotune, not by the default builder")
    context = runtime.device_context(key.device)
    check_supported(key.config, context.environment, kind=key.kind)
    store = default_store() if key.kind in PERSIST_KINDS else None
    with cupy.cuda.Device(key.device), context.planning() as handle:
        built = build_or_load(key.config, key.kind, handle, store=store, rng_dump=key.rng_dump,
                              plan=plan_name)
    return CallPlan(built, context, rng_dump=key.rng_dump)


PERSIST_KINDS = (Kind.FORWARD, Kind.BACKWARD)
"""Graphs the persistent store keeps (:mod:`cudnn_attn.persist.store`): forward and backward plans.  A loaded
backward is verified on the H200 like a loaded forward: bit-identical results to the built graph, through the
frontend and the fast launch, and for a plan built deviceless (``tests/gpu/test_plan_store_gpu.py``)."""


class BuildThreads:
    """One thread per device that runs every build handed to :meth:`run` (see the module doc).  A build that
    asks for another build from a build thread runs it in place; a forked child starts with no threads."""

    def __init__(self):
        self._forget()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._executors: dict[int, ThreadPoolExecutor] = {}
        self._idents: set[int] = set()

    def run(self, device: int, build: Callable[..., Any], *args: Any) -> Any:
        """``build(*args)`` on ``device``'s build thread; its result, or its exception raised here."""
        if threading.get_ident() in self._idents:
            return build(*args)
        with self._lock:
            executor = self._executors.get(device)
            if executor is None:
                executor = self._executors[device] = ThreadPoolExecutor(
                    1, thread_name_prefix=f"cudnn_attn-build-{device}", initializer=self._enter)
        try:
            future = executor.submit(build, *args)
        except RuntimeError:               # the interpreter is shutting down: no new threads
            return build(*args)
        return future.result()

    def _enter(self) -> None:
        self._idents.add(threading.get_ident())


build_threads = BuildThreads()


def _check_maxsize(maxsize: object) -> None:
    if not isinstance(maxsize, int) or isinstance(maxsize, bool) or maxsize < 1:
        raise ValueError(f"maxsize: must be a positive int, got {maxsize!r}")


class GraphCache:
    """Bounded, thread-safe LRU of built graphs (see the module doc).

    Args:
        maxsize: the most graphs kept; the least recently used is dropped beyond it.
        builder: ``builder(key) -> BuiltGraph``; the default builds with cuDNN on ``key.device``.
    """

    def __init__(self, maxsize: int = 128, builder: Builder | None = None):
        _check_maxsize(maxsize)
        self._maxsize = maxsize
        self._builder = builder or build_plan
        self._lock = threading.Lock()
        self._entries: OrderedDict[GraphKey, CacheEntry] = OrderedDict()
        self._pending: dict[GraphKey, _Pending] = {}
        self._hits = self._misses = self._evictions = 0
        self._build_seconds = 0.0
        self._built: dict[int, weakref.ref] = {}       # id -> weak reference of every graph built here
        self._numbers = 0                               # the next entry's number
        self._misses_kept: collections.deque[MissRow] = collections.deque(maxlen=MISSES_KEPT)
        self._evicted: OrderedDict[GraphKey, None] = OrderedDict()
        self._holders: list[Holder] = []

    @classmethod
    def deviceless(cls, maxsize: int = 128, target: Any = None) -> "GraphCache":
        """A cache whose builder plans for a GPU without using one (cuDNN's deviceless planning): for ``target``, a
        :class:`cudnn_attn.graphs.DevicelessTarget` (default ``DevicelessTarget.h200()``), the support check for
        that GPU, then the plan from the plan store or built and saved there (as the default builder does on a
        GPU).  Where no NVIDIA driver exists, a stub ``libcuda.so.1`` is built once into the plan store's folder
        (a C compiler is needed) and loaded first.  Its entries hold plans no GPU runs: a machine without one can
        watch builds, hits, misses and evictions, and fill a store for the GPU machine.

        Raises:
            NoGPUError: neither a driver nor a stub can load cuDNN here (the message says what is missing), or the
                plan store is off (``CUDNN_ATTN_CACHE_DIR=off``: the stub has no folder).
        """
        from cudnn_attn.graphs import driver_stub   # 10 ms of imports (subprocess, ctypes.util) import cudnn_attn skips

        store = default_store()
        if store is None:
            raise NoGPUError("deviceless planning keeps its stub driver in the plan store's folder, and the store "
                             "is off (CUDNN_ATTN_CACHE_DIR=off): point CUDNN_ATTN_CACHE_DIR at a folder")
        try:
            driver_stub.preload(store.directory)
        except driver_stub.StubUnavailable as exc:
            raise NoGPUError(f"deviceless planning: {exc}") from None
        from cudnn_attn.graphs.target import DevicelessTarget  # imports the cuDNN frontend
        from cudnn_attn.persist.build import build_or_load

        target = DevicelessTarget.h200() if target is None else target
        environment = Environment.for_deviceless(target)

        def build(key: GraphKey) -> Any:
            check_supported(key.config, environment, kind=key.kind)
            return build_or_load(key.config, key.kind, target, store=default_store() if key.kind in PERSIST_KINDS
                                 else None)
        return cls(maxsize=maxsize, builder=build)

    # -- lookup -----------------------------------------------------------------------------------
    def plan(self, config: AttentionConfig, kind: str, device: int | None = None, *,
             plan: PlanChoice = PlanChoice.HEURISTIC, rng_dump: bool = False, build: Builder | None = None) -> Any:
        """The :class:`~cudnn_attn.engine.plan.CallPlan` for ``(config, kind, device)``, built on a miss.

        ``device`` defaults to the current CuPy device; ``plan`` and ``rng_dump`` are the other
        :class:`GraphKey` fields; ``build`` replaces the cache's builder for this key.
        """
        return self.entry(self.key(config, kind, device, plan=plan, rng_dump=rng_dump), build).plan

    def key(self, config: AttentionConfig, kind: str, device: int | None = None, *,
            plan: PlanChoice = PlanChoice.HEURISTIC, rng_dump: bool = False) -> GraphKey:
        """The :class:`GraphKey` of a graph (``device=None``: the current CuPy device)."""
        if device is None:
            import cupy

            device = cupy.cuda.Device().id
        if kind not in KINDS:
            raise ValueError(f"kind: must be one of {[str(k) for k in KINDS]}, got {kind!r}")
        return GraphKey(config, Kind(kind), device, _cudnn_version_or_fail(), plan, rng_dump)

    def entry(self, key: GraphKey, build: Builder | None = None) -> CacheEntry:
        """The :class:`CacheEntry` of ``key``, built with ``build`` (default: the cache's builder) on a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                entry.hits += 1
                self._hits += 1
                return entry
            pending = self._pending.get(key)
            owner = pending is None
            if owner:
                pending = self._pending[key] = _Pending()
                cached = [(e.number, e.key) for e in self._entries.values()]
                evicted = key in self._evicted
        if not owner:
            return self._await(pending)
        return self._build(key, pending, build or self._builder, cached, evicted)

    def _await(self, pending: _Pending) -> CacheEntry:
        pending.done.wait()
        if pending.error is not None:
            raise pending.error
        with self._lock:
            pending.entry.hits += 1
            self._hits += 1
        return pending.entry

    def _build(self, key: GraphKey, pending: _Pending, build: Builder, cached: list[tuple[int, GraphKey]],
               was_evicted: bool) -> CacheEntry:
        found = miss_reason.nearest(key, cached)
        nearest, changes = (None, ()) if found is None else (found[0], tuple(found[1]))
        miss = MissRow(None, str(key.kind), _features(key), changes, nearest, was_evicted, "failed", 0.0)
        start = time.perf_counter()
        try:
            plan = build_threads.run(key.device, build, key) if build is self._builder else build(key)
        except BaseException as exc:
            with self._lock:
                self._misses += 1
                self._misses_kept.append(miss._replace(seconds=time.perf_counter() - start, error=_first_line(exc)))
                del self._pending[key]
            pending.error = exc
            pending.done.set()
            raise
        seconds = time.perf_counter() - start
        entry = CacheEntry(key, plan, seconds)
        _track(self._built, entry.graph)
        with self._lock:
            self._misses += 1
            self._build_seconds += seconds
            entry.number = self._numbers
            self._numbers += 1
            self._misses_kept.append(miss._replace(number=entry.number, outcome=_origin(entry), seconds=seconds))
            self._entries[key] = entry
            self._evicted.pop(key, None)
            evicted = self._evict_beyond_bound()
            del self._pending[key]
        pending.entry = entry
        pending.done.set()
        _free(evicted)
        logger.info("built cuDNN %s graph in %.3f s (plan %s, workspace %s): %s", key.kind, seconds,
                    _plan_label(entry), _bytes(_workspace(entry.graph)), key.config.describe())
        return entry

    def _evict_beyond_bound(self) -> list[CacheEntry]:
        """Drop the least recently used entries beyond ``maxsize`` (the lock held); the caller frees them outside
        the lock (:func:`_free`)."""
        evicted = []
        while len(self._entries) > self._maxsize:
            gone = self._entries.popitem(last=False)
            evicted.append(gone[1])
            self._evictions += 1
            self._evicted[gone[0]] = None
        while len(self._evicted) > EVICTED_KEPT:
            self._evicted.popitem(last=False)
        return evicted

    def resize(self, maxsize: int) -> None:
        """Keep at most ``maxsize`` graphs from now on; a smaller bound evicts the least recently used at once.

        The fronts share :data:`graph_cache`: a program whose calls cycle through more signatures than it holds
        (misses that say "evicted earlier") gives it room with ``cudnn_attn.graph_cache.resize(n)``."""
        _check_maxsize(maxsize)
        with self._lock:
            self._maxsize = maxsize
            evicted = self._evict_beyond_bound()
        _free(evicted)

    # -- inspection -------------------------------------------------------------------------------
    @property
    def maxsize(self) -> int:
        return self._maxsize

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def live_graphs(self) -> int:
        """How many graphs this cache built are still alive (cached, pinned or held by a caller)."""
        return sum(ref() is not None for ref in list(self._built.values()))

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, self._evictions, self._build_seconds,
                              len(self._entries), self._maxsize, sum(runtime.copies.values()))

    def clear(self) -> None:
        """Drop every graph and reset the statistics, the entry numbers and the record of misses."""
        with self._lock:
            self._entries.clear()
            self._hits = self._misses = self._evictions = 0
            self._build_seconds = 0.0
            self._numbers = 0
            self._misses_kept.clear()
            self._evicted.clear()

    def add_holder(self, holder: Holder) -> None:
        """Register ``holder() -> [(plan, who), ...]``: plans held outside the cache (the JAX bridge's compiled
        call sites), named in :meth:`entries` (column ``JAX``) and :meth:`entry_detail` (``held_by``)."""
        self._holders.append(holder)

    def _held(self) -> dict[int, list[str]]:
        """``id(plan) -> [who holds it]`` over every registered holder."""
        held: dict[int, list[str]] = {}
        for holder in self._holders:
            for plan, who in holder():
                held.setdefault(id(plan), []).append(who)
        return held

    def entries(self) -> CacheListing:
        """What is cached, least recently used first."""
        with self._lock:
            items = list(self._entries.values())
        held = self._held()
        return CacheListing(
            CacheRow(e.number, e.key.kind, _features(e.key), _shapes(e.key.config), e.key.device, _plan_label(e),
                     _workspace(e.graph), e.build_seconds, e.hits, len(held.get(id(e.plan), ())))
            for e in items)

    def misses(self) -> MissListing:
        """The most recent lookups that missed (at most :data:`MISSES_KEPT`, oldest first), each with why: the
        fields in which its key differs from the nearest cached entry, or that it was evicted earlier."""
        with self._lock:
            return MissListing(self._misses_kept)

    def _summary(self) -> str:
        st = self.stats()
        return (f"GraphCache: {st.entries}/{st.maxsize} graphs, {st.hits} hits, {st.misses} misses, "
                f"{st.evictions} evictions, {st.build_seconds:.2f} s building")

    RECENT_SHOWN = 5
    """How many recent misses the text and HTML views of the cache show (``misses()`` lists them all)."""

    def __repr__(self) -> str:
        """The statistics line, the listing and the most recent misses with their reasons."""
        misses = self.misses()[-self.RECENT_SHOWN:]
        text = f"{self._summary()}\n{self.entries()!r}"
        if misses:
            text += "\nrecent misses:\n" + "\n".join(
                f"  {'-' if m.number is None else '#' + str(m.number)} {m.kind} {m.features}: {m.reason}" for m in misses)
        return text

    def _repr_html_(self) -> str:
        misses = MissListing(self.misses()[-self.RECENT_SHOWN:])
        parts = [f'<p class="summary">{html.escape(self._summary())}</p>', self.entries().html_table()]
        if misses:
            parts.append(misses.html_table())
        return block("".join(parts))

    def _find(self, which: GraphKey | int) -> CacheEntry:
        """The entry of a :class:`GraphKey`, or of an entry number (the ``#`` of :meth:`entries`)."""
        with self._lock:
            if isinstance(which, GraphKey):
                entry = self._entries.get(which)
                if entry is None:
                    raise KeyError(f"no cached graph for {which.kind} {which.config.describe()}")
                return entry
            if isinstance(which, int) and not isinstance(which, bool):
                for entry in self._entries.values():
                    if entry.number == which:
                        return entry
                numbers = sorted(e.number for e in self._entries.values())
                raise KeyError(f"which: no cached graph #{which} (cached: {', '.join(f'#{n}' for n in numbers) or 'none'})")
        raise TypeError(f"which: expected a GraphKey or an entry number (int), got {type(which).__name__}")

    def dump(self, which: GraphKey | int) -> str:
        """The cuDNN graph (JSON text) of one entry, by :class:`GraphKey` or by its number (the ``#`` of
        :meth:`entries`)."""
        return _graph_text(self._find(which))

    def entry_detail(self, which: GraphKey | int) -> EntryDetail:
        """Everything about one entry (by :class:`GraphKey` or number): its graph's JSON, plan and engine,
        workspace, build time and origin (built, or loaded from the plan store), hits, and which compiled JAX
        programs' call sites hold its plan.  Prints as text, renders as HTML in Jupyter."""
        entry = self._find(which)
        graph = entry.graph
        return EntryDetail(entry.number, str(entry.key.kind), _features(entry.key), _shapes(entry.key.config),
                           entry.key.device, _plan_label(entry), _engine(graph), _workspace(graph),
                           entry.build_seconds, _origin(entry), entry.hits,
                           tuple(self._held().get(id(entry.plan), ())), _graph_text(entry))


def _free(evicted: list) -> None:
    """Free evicted entries (the last references to their graphs, held by the list) and give their host memory
    back; nothing when none were evicted."""
    if evicted:
        evicted.clear()
        trim_host_memory()


def trim_host_memory() -> None:
    """Give freed heap memory back to the system after an eviction (glibc's ``malloc_trim(0)``; nothing
    elsewhere).  A cuDNN graph build allocates from the building thread's malloc arena; graphs built on
    many threads and then freed leave those arenas holding the pages: measured with 16 threads and 172
    rebuilds through a 4-graph cache, RSS 609-707 MiB untrimmed against 515-535 MiB trimmed, with the same
    live graphs.  An eviction follows a build (tens to hundreds of ms), so the trim's cost is noise."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):            # not glibc
        return None


def _track(built: dict[int, weakref.ref], graph: Any) -> None:
    """Remember ``graph`` weakly in ``built`` until it dies (graphs that cannot be weakly referenced are not
    counted).  The callback holds the dict, not the cache, so it keeps nothing alive."""
    key = id(graph)
    try:
        built[key] = weakref.ref(graph, lambda _, key=key: built.pop(key, None))
    except TypeError:
        pass


def _features(key: GraphKey) -> str:
    return key.config.describe() + (" rng_dump" if key.rng_dump else "")


def _origin(entry: CacheEntry) -> str:
    return str(getattr(entry.graph, "origin", "built"))


def _graph_text(entry: CacheEntry) -> str:
    describe = getattr(entry.graph, "describe", None)
    return describe() if callable(describe) else repr(getattr(entry.graph, "graph", entry.graph))


_ENGINE = re.compile(r"eng(\d+)")


def _engine(graph: Any) -> str:
    """The cuDNN engine of the selected plan, from its name (``eng2_k24=7 ...`` is engine 2)."""
    found = _ENGINE.match(str(getattr(graph, "plan_name", "")))
    return f"engine {found.group(1)}" if found else "?"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def _workspace(graph: Any) -> int:
    return int(getattr(graph, "workspace_size", 0))


def _plan_label(entry: CacheEntry) -> str:
    name = str(getattr(entry.graph, "plan_name", "?"))
    origin = getattr(entry.graph, "origin", "built")
    name = name if origin == "built" else f"{name} ({origin})"
    return f"{name} (autotuned)" if entry.key.plan is PlanChoice.AUTOTUNED else name


graph_cache = GraphCache()
"""The process's :class:`GraphCache` (128 graphs): what every public call builds into and looks up."""


runtime.on_release(graph_cache.clear)


def _cudnn_version_or_fail() -> int:
    version = cudnn_version()
    if version is None:
        preload.wait()                  # the frontend may be half imported on the preload thread: read it after
        version = cudnn_version()
    if version is None:
        raise NoGPUError("no cuDNN library loads here; the graph cache builds cuDNN graphs")
    return version
