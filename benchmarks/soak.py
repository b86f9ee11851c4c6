"""Soak: many threads, mixed configurations, a graph cache that evicts all the time - GPU, not a test.

16 threads (``--threads``) share 100,000 calls (``--calls``; ``--quick``: 4,000) drawn at random over eight
configurations (causal, padding with GQA, sliding window, bias, dropout, decode, BNTH, packed segments;
fp16 and bf16) and four paths: the CuPy path forward and backward (``cudnn_attn.dot_product_attention`` /
``dot_product_attention_bwd`` on CuPy arrays) and the JAX bridge under ``jit``, forward and ``grad``.
The graph cache is replaced by a new :class:`cudnn_attn.GraphCache` of ``--cache-size`` graphs (4) - far
fewer than the ~20 graphs the mix needs - so that it evicts and rebuilds constantly while other threads
use the same configurations.  With ``--recompile-every N`` (default 0: never) a configuration drops its
jitted functions every N JAX calls and makes new ones, and JAX's caches are cleared at every phase
boundary, so executables are compiled and destroyed throughout: the JAX bridge must release what it held
for dead executables (the plans its FFI handler runs, ``cudnn_target._launches``) as the graph cache's
bound says.  Memory growth in that mode includes what XLA keeps of the executables it compiled.

Every call's results are compared with those of the same inputs computed single-threaded before the soak:
exactly (the backward runs with ``deterministic=True``).  Reported: errors (by type, with the first
messages), mismatches, and memory.  Memory is read by phase: after the warm-up, after a settling tenth of the
calls (every thread has run, the allocators' per-thread arenas and caches exist), every ``--phase-calls``
calls (1,000) and after the final ``gc.collect()``.  Each row has the number of cuDNN graphs still alive
(``GraphCache.live_graphs``: cached, pinned by the JAX bridge, or held elsewhere) and the replay graphs alive
and made / destroyed / updated in place.

Device memory is split (``cudaMemGetInfo`` against the two allocators' own counts): the bytes in use in
CuPy's pool and in XLA's, what each pool reserves (free blocks included), and the rest - the driver's and
cuDNN's memory outside both pools (executable graphs, modules, handles).  Each phase first returns CuPy's free
blocks to the driver (:data:`POOL_KEYS` says why).  The host is read as the RSS, raw
and after glibc's ``malloc_trim(0)``, next to the bytes malloc holds for its callers and the blocks CPython's
allocator holds (:func:`_host_heap`): where an RSS step comes from.

Targets: 0 errors, 0 mismatches, and growth < 1 MiB of :data:`MEMORY_KEYS` (host, memory in use, memory
outside the pools) over the **second half** of the soak, read as the trend of a least-squares line through
every reading of that half (single RSS readings scatter by +-1 MiB, device readings by +-3 MiB); a trend within
two standard errors of zero is scatter, not growth.  A leak grows with the calls; a
high-water mark is reached once.  In a 100k-call soak on the H200 the host and XLA's
pool stepped up until 36k calls, then nothing grew for 64k calls.  Growth from the settled point is printed too, and the
pools' reserves (:data:`POOL_KEYS`) beside them.  A short table is printed last; ``--out FILE`` writes
everything as JSON
(with memory samples every few seconds).  Exit status 1 when a target is missed.

``--dry-run`` runs the same machinery on a CPU: the NumPy reference stands in for the CuPy path and the
JAX bridge runs on its CPU target (``tests/test_soak_dry_run.py`` uses it).

    python benchmarks/soak.py --out soak.json          # on the GPU machine (about 10 minutes)
    python benchmarks/soak.py --quick
    python benchmarks/soak.py --dry-run --calls 200 --threads 4
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import faulthandler
import functools
import gc
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.3")

MIB = 1 << 20
PATHS = ("direct-fwd", "direct-bwd", "jax-fwd", "jax-grad")


@dataclass(frozen=True)
class Config:
    """One configuration of the mix: shapes and the public keyword arguments."""

    name: str
    B: int
    T: int
    S: int
    N: int
    K: int
    H: int
    dtype: str = "float16"
    layout: str = "BTNH"
    kwargs: tuple = ()                  # static keyword arguments, ((name, value), ...)
    padding: bool = False
    packed: bool = False
    bias: bool = False
    backward: bool = True

    def shape(self, length: int, heads: int) -> tuple[int, ...]:
        return (self.B, length, heads, self.H) if self.layout == "BTNH" else (self.B, heads, length, self.H)


def _configs(quick: bool) -> list[Config]:
    from cudnn_attn import MaskType

    small = 64 if quick else 128
    return [
        Config("causal-fp16", 2, 2 * small, 2 * small, 8, 8, 64, kwargs=(("mask_type", MaskType.CAUSAL),)),
        Config("padding-gqa-bf16", 2, small + 64, 2 * small, 8, 2, 128, "bfloat16", padding=True,
               kwargs=(("mask_type", MaskType.PADDING),)),
        Config("window-fp16", 1, 2 * small, 2 * small, 4, 4, 64,
               kwargs=(("mask_type", MaskType.CAUSAL), ("sliding_window_length", 32))),
        Config("bias-fp16", 2, small, small, 4, 4, 64, bias=True),
        Config("dropout-bf16", 1, small, small, 4, 4, 64, "bfloat16", kwargs=(("dropout_rate", 0.1), ("seed", 7))),
        Config("decode-gqa-fp16", 4, 1, 4 * small, 8, 1, 128, backward=False),
        Config("causal-bnth-bf16", 2, small, small, 4, 2, 64, "bfloat16", "BNTH",
               kwargs=(("mask_type", MaskType.CAUSAL),)),
        Config("packed-fp16", 2, 2 * small, 2 * small, 4, 4, 64, packed=True),
    ]


# -- the two backends ----------------------------------------------------------------------------------------
class Backend:
    """Where the direct path runs and how results are compared and memory is read."""

    name = "gpu"

    def __init__(self):
        import cupy

        self.cp = cupy

    def array(self, x: np.ndarray) -> Any:
        return self.cp.asarray(x)

    def direct(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        import cudnn_attn

        return cudnn_attn.dot_product_attention, cudnn_attn.dot_product_attention_bwd

    def equal(self, got: Any, want: Any) -> bool:
        cp = self.cp
        if not isinstance(got, cp.ndarray):          # a JAX array on the GPU: zero-copy into CuPy
            got = cp.from_dlpack(got)
        return bool(cp.array_equal(got, want))

    def keep(self, x: Any) -> Any:
        """A copy of a result to compare later calls with (on the device)."""
        cp = self.cp
        return (cp.from_dlpack(x) if not isinstance(x, cp.ndarray) else x).copy()

    def synchronize(self) -> None:
        self.cp.cuda.runtime.deviceSynchronize()

    def release_pool(self) -> int | None:
        """CuPy's free blocks back to the driver (between phases, no call running); what the pool held before."""
        pool = self.cp.get_default_memory_pool()
        held = pool.total_bytes()
        pool.free_all_blocks()
        return held

    def memory(self) -> dict[str, int]:
        free, total = self.cp.cuda.runtime.memGetInfo()
        pool = self.cp.get_default_memory_pool()
        row = {"host_rss": _rss(), "cupy_pool_used": pool.used_bytes(), "cupy_pool_held": pool.total_bytes(),
               "device_used": total - free, **_jax_memory()}
        if row["jax_pool"] is not None:
            row["device_outside_pools"] = row["device_used"] - row["cupy_pool_held"] - row["jax_pool"]
        return row


class DryRunBackend(Backend):
    """The CPU stand-in: the NumPy reference is the direct path; the JAX bridge runs on CPU."""

    name = "dry-run (CPU: NumPy reference, JAX bridge on its CPU target)"

    def __init__(self):
        self.cp = None

    def array(self, x: np.ndarray) -> Any:
        return x

    def direct(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        from cudnn_attn import reference

        return reference.dot_product_attention, reference.dot_product_attention_bwd

    def equal(self, got: Any, want: Any) -> bool:
        return bool(np.array_equal(np.asarray(got), np.asarray(want)))

    def keep(self, x: Any) -> Any:
        return np.array(x)

    def synchronize(self) -> None:
        pass

    def release_pool(self) -> int | None:
        return None

    def memory(self) -> dict[str, int]:
        return {"host_rss": _rss()}


def _jax_memory() -> dict[str, int | None]:
    """What XLA's allocator holds on the GPUs (``memory_stats``): ``jax_in_use`` in live buffers, ``jax_pool``
    reserved from the device in all (its regions grow on demand under ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
    and are never returned); ``None`` before JAX is imported or where it reports no pool."""
    jax = sys.modules.get("jax")
    devices = [d for d in jax.local_devices() if d.platform == "gpu"] if jax is not None else []
    stats = [d.memory_stats() or {} for d in devices]
    if not stats or any("bytes_in_use" not in st for st in stats):
        return {"jax_in_use": None, "jax_pool": None}
    pools = [st.get("pool_bytes", st.get("bytes_reserved")) for st in stats]
    return {"jax_in_use": sum(st["bytes_in_use"] for st in stats),
            "jax_pool": None if None in pools else sum(pools)}


def _rss() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:                     # not Linux: the peak, which can only grow
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextlib.contextmanager
def small_cache(maxsize: int) -> Iterator[Any]:
    """The library's graph cache replaced by a new ``GraphCache(maxsize)`` wherever a module refers to it;
    the old one is put back on exit."""
    import cudnn_attn
    from cudnn_attn.engine.cache import GraphCache

    old, new = cudnn_attn.graph_cache, GraphCache(maxsize)
    modules = [m for name, m in list(sys.modules.items())
               if name.startswith("cudnn_attn") and getattr(m, "graph_cache", None) is old]
    for module in modules:
        module.graph_cache = new
    try:
        yield new
    finally:
        for module in modules:
            module.graph_cache = old


# -- one configuration's fixed inputs and single-threaded results -------------------------------------------------
class Workload:
    """Fixed inputs of one configuration and the results every path must reproduce."""

    def __init__(self, config: Config, backend: Backend, rng: np.random.Generator, recompile_every: int = 0):
        import ml_dtypes

        self.config, self.backend = config, backend
        self.recompile_every, self._jax_calls, self.recompiles = recompile_every, 0, 0
        self._jax_lock = threading.Lock()
        dtype = np.dtype(ml_dtypes.bfloat16) if config.dtype == "bfloat16" else np.dtype(np.float16)
        host = {"query": rng.standard_normal(config.shape(config.T, config.N)).astype(dtype),
                "key": rng.standard_normal(config.shape(config.S, config.K)).astype(dtype),
                "value": rng.standard_normal(config.shape(config.S, config.K)).astype(dtype)}
        if config.padding:
            host.update(q_seqlen=np.array([config.T - 17, config.T], np.int32)[:config.B],
                        kv_seqlen=np.array([config.S, config.S - 40], np.int32)[:config.B])
        if config.packed:
            half_t, half_s = config.T // 2, config.S // 2
            host.update(q_seqlen=np.array([[half_t - 3, half_t], [config.T, -1]], np.int32),
                        kv_seqlen=np.array([[half_s, half_s - 5], [config.S, -1]], np.int32),
                        q_offsets=np.array([[0, half_t, -1], [0, -1, -1]], np.int32),
                        kv_offsets=np.array([[0, half_s, -1], [0, -1, -1]], np.int32))
        if config.bias:
            host["bias"] = rng.standard_normal((1, config.N, config.T, config.S)).astype(dtype)
        self.static = dict(config.kwargs, scale=config.H ** -0.5)
        self.host = host
        self.arrays = {n: backend.array(x) for n, x in host.items()}
        out_shape = config.shape(config.T, config.N)
        self.grad_host = rng.standard_normal(out_shape).astype(dtype)
        self.grad = backend.array(self.grad_host)
        self.expected: dict[str, tuple] = {}
        self._jax: dict[str, Callable[..., Any]] = {}

    def paths(self) -> tuple[str, ...]:
        return PATHS if self.config.backward else ("direct-fwd", "jax-fwd")

    def _jax_functions(self) -> dict[str, Callable[..., Any]]:
        import jax
        import jax.numpy as jnp

        from cudnn_attn import jax_bridge as jb

        static = self.static

        def forward(arrays: dict) -> Any:
            return jb.dot_product_attention(**arrays, **static)

        def loss(q: Any, k: Any, v: Any, rest: dict, grad: Any) -> Any:
            out = jb.dot_product_attention(q, k, v, **rest, **static, deterministic=True)
            return jnp.sum(out.astype(jnp.float32) * grad.astype(jnp.float32))

        return {"jax-fwd": jax.jit(forward), "jax-grad": jax.jit(jax.grad(loss, argnums=(0, 1, 2)))}

    def run(self, path: str) -> tuple:
        """One call of ``path``; its results as a tuple of arrays."""
        forward, backward = self.backend.direct()
        if path == "direct-fwd":
            return (forward(**self.arrays, **self.static),)
        if path == "direct-bwd":
            output, lse = self.residuals
            grads = backward(**self.arrays, output=output, grad_output=self.grad, logsumexp=lse, **self.static,
                             deterministic=True)
            return grads.dq, grads.dk, grads.dv
        import jax.numpy as jnp

        with self._jax_lock:
            self._jax_calls += 1
            if not self._jax or (self.recompile_every and self._jax_calls % self.recompile_every == 0):
                if self._jax:
                    self.recompiles += 1
                self._jax = self._jax_functions()      # the old executables die with the old functions
            functions = self._jax
        arrays = self._jax_arrays
        if path == "jax-fwd":
            return (functions[path](arrays),)
        rest = {n: x for n, x in arrays.items() if n not in ("query", "key", "value")}
        grad = jnp.asarray(self.grad_host)
        return tuple(functions[path](arrays["query"], arrays["key"], arrays["value"], rest, grad))

    def warm_up(self) -> None:
        """Single-threaded: the residuals the backward takes, then the expected results of every path."""
        import jax.numpy as jnp

        forward, _ = self.backend.direct()
        self.residuals = forward(**self.arrays, **self.static, return_residual=True)
        self._jax_arrays = {n: jnp.asarray(x) for n, x in self.host.items()}
        for path in self.paths():
            self.expected[path] = tuple(self.backend.keep(x) for x in self.run(path))
        self.backend.synchronize()

    def check(self, path: str, results: tuple) -> bool:
        return all(self.backend.equal(got, want) for got, want in zip(results, self.expected[path]))


# -- the soak ---------------------------------------------------------------------------------------------------
@dataclass
class Tally:
    calls: collections.Counter = field(default_factory=collections.Counter)
    errors: collections.Counter = field(default_factory=collections.Counter)
    mismatches: collections.Counter = field(default_factory=collections.Counter)
    messages: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, path: str, error: BaseException | None = None, mismatch: str | None = None) -> None:
        with self.lock:
            self.calls[path] += 1
            if error is not None:
                self.errors[f"{path}: {type(error).__name__}"] += 1
                if len(self.messages) < 10:
                    self.messages.append(f"{path}: {type(error).__name__}: {str(error)[:300]}")
            if mismatch is not None:
                self.mismatches[path] += 1
                if len(self.messages) < 10:
                    self.messages.append(f"{path}: mismatch in {mismatch}")


_deadline = [float("inf")]        # time.monotonic() after which workers stop (--max-seconds)


def _worker(index: int, calls: int, workloads: list[Workload], tally: Tally, seed: int) -> None:
    rng = np.random.default_rng(seed + index)
    for _ in range(calls):
        if time.monotonic() > _deadline[0]:
            return
        workload = workloads[int(rng.integers(len(workloads)))]
        paths = workload.paths()
        path = paths[int(rng.integers(len(paths)))]
        try:
            results = workload.run(path)
            same = workload.check(path, results)
        except Exception as error:  # noqa: BLE001 -- counted and reported: the soak is about exactly this
            tally.record(path, error=error)
            continue
        tally.record(path, mismatch=None if same else workload.config.name)


def _sampler(backend: Backend, stop: threading.Event, samples: list, period: float) -> None:
    start = time.perf_counter()
    while not stop.wait(period):
        samples.append({"seconds": round(time.perf_counter() - start, 1), **backend.memory()})


def _run_threads(calls: int, threads: int, workloads: list[Workload], tally: Tally, seed: int) -> None:
    per_thread = [calls // threads + (1 if i < calls % threads else 0) for i in range(threads)]
    workers = [threading.Thread(target=_worker, args=(i, n, workloads, tally, seed)) for i, n in enumerate(per_thread)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def soak(*, calls: int, threads: int, cache_size: int, quick: bool, dry_run: bool, seed: int,
         phase_calls: int = 1000, recompile_every: int = 0) -> dict:
    with small_cache(cache_size) as cache:
        return _soak(cache, calls=calls, threads=threads, cache_size=cache_size, quick=quick, dry_run=dry_run,
                     seed=seed, phase_calls=phase_calls, recompile_every=recompile_every)


def _soak(cache: Any, *, calls: int, threads: int, cache_size: int, quick: bool, dry_run: bool, seed: int,
          phase_calls: int = 1000, recompile_every: int = 0) -> dict:
    from cudnn_attn.engine import replay

    backend = DryRunBackend() if dry_run else Backend()
    rebinds = Rebinds() if dry_run else _count_rebinds()
    rng = np.random.default_rng(seed)
    workloads = [Workload(config, backend, rng, recompile_every) for config in _configs(quick or dry_run)]
    tally, samples, stop = Tally(), [], threading.Event()
    phases: list[dict] = []

    def phase(name: str) -> dict:
        backend.synchronize()
        if recompile_every:
            _clear_jax_caches()
        gc.collect()
        high_water = backend.release_pool()
        row = {"phase": name, "calls": sum(tally.calls.values()), **backend.memory(),
               "cupy_pool_high_water": high_water,
               "live_graphs": cache.live_graphs(), "cached_graphs": len(cache), **_jax_side(),
               "replay_graphs": sum(replay.live_graphs().values()), "replay_churn": replay.churn(),
               "handle_streams": len(rebinds.streams), "handle_rebinds": sum(rebinds.streams.values()),
               "rebinds_without_context": rebinds.without_context}
        row["host_rss_trimmed"] = _trimmed_rss()
        row.update(_host_heap())
        phases.append(row)
        print(_phase_line(row), flush=True)
        return row

    started = time.perf_counter()
    for workload in workloads:
        workload.warm_up()
    warm_up_seconds = time.perf_counter() - started
    phase("warm-up")
    settle = min(calls - 1, max(threads, calls // 10))
    _run_threads(settle, threads, workloads, tally, seed)
    before = phase("settled")
    sampler = threading.Thread(target=_sampler, args=(backend, stop, samples, 5.0), daemon=True)
    sampler.start()
    started = time.perf_counter()
    remaining, chunk = calls - settle, 0
    while remaining > 0 and time.monotonic() < _deadline[0]:
        n = min(phase_calls, remaining)
        _run_threads(n, threads, workloads, tally, seed + 1000 * (chunk + 1))
        remaining -= n
        chunk += 1
        if remaining > 0:
            phase(f"after {sum(tally.calls.values())} calls")
    seconds = time.perf_counter() - started
    stop.set()
    sampler.join()
    after = phase("final (after gc)")
    stats = cache.stats()
    measured = [k for k in before if k in MEMORY_KEYS + ATTRIBUTION_KEYS + POOL_KEYS + ("python_blocks",)
                and before[k] is not None and after.get(k) is not None]
    halfway = next(row for row in phases if row["calls"] >= (before["calls"] + after["calls"]) // 2)
    if sum(row["calls"] >= halfway["calls"] for row in phases) < 3:     # too few readings: the whole soak
        halfway = before
    trends, trend_errors = _trends([row for row in phases if row["calls"] >= halfway["calls"]], measured)
    return {
        "backend": backend.name, "threads": threads, "calls": sum(tally.calls.values()), "settling_calls": settle,
        "seconds": round(seconds, 1), "warm_up_seconds": round(warm_up_seconds, 1),
        "configurations": [w.config.name for w in workloads],
        "planned_calls": calls, "stopped_at_deadline": sum(tally.calls.values()) < calls,
        "calls_by_path": dict(tally.calls), "errors": dict(tally.errors), "mismatches": dict(tally.mismatches),
        "messages": tally.messages, "memory_before": before, "memory_after": after,
        "growth": {k: after[k] - before[k] for k in measured}, "halfway_calls": halfway["calls"],
        "growth_second_half": {k: after[k] - halfway[k] for k in measured if halfway.get(k) is not None},
        "trend_second_half": trends, "trend_error_second_half": trend_errors,
        "phases": phases, "samples": samples,
        "graph_cache": {"maxsize": cache_size, "hits": stats.hits, "misses": stats.misses,
                        "evictions": stats.evictions, "entries": stats.entries, "live_graphs": after["live_graphs"],
                        "pinned_plans": after["pinned_plans"]},
        "jax_recompiles": sum(w.recompiles for w in workloads),
        "jax_side_at_end": {k: after[k] for k in ("pinned_plans", "call_sites", "live_executable_sites")},
    }


MEMORY_KEYS = ("host_rss", "host_rss_trimmed", "cupy_pool_used", "jax_in_use", "device_outside_pools")
"""What the growth target applies to: the host, the bytes of CuPy's pool and of XLA's allocator that are in use,
and device memory outside both pools (the driver's and cuDNN's: executable graphs, modules, handles); the pools'
reserves (:data:`POOL_KEYS`) are reported next to them.  ``host_rss_trimmed`` is the RSS right after glibc's
``malloc_trim(0)``: freed heap memory that glibc's per-thread arenas keep (fragmentation, not live memory) is
returned first.  Measured deviceless on a CPU (16 threads building and evicting sm90 graphs through a 4-graph
cache): the raw RSS swung by 80-180 MiB between phases while the trimmed RSS stayed within 515-535 MiB over 172
rebuilds; single-threaded, 96-120 rebuilds (built, deserialized, backward) moved the RSS by < 2 MiB."""
ATTRIBUTION_KEYS = ("malloc_in_use",)
"""Reported beside the RSS: the bytes malloc holds for its callers (:func:`_host_heap`)."""


def _trends(rows: list[dict], keys: list[str]) -> tuple[dict[str, float], dict[str, float]]:
    """Growth of each of ``keys`` over ``rows`` as a least-squares line through all of them (slope times the calls
    spanned): what accumulates with the calls, without the +-1 MiB by which single RSS readings scatter; and the
    standard error of each (from the scatter of the readings about the line): a trend within two of them is what
    the scatter alone makes (0 with fewer than three readings)."""
    calls = np.array([row["calls"] for row in rows], dtype=float)
    if len(rows) < 3 or np.ptp(calls) == 0:
        return {k: float(rows[-1][k] - rows[0][k]) for k in keys}, {k: 0.0 for k in keys}
    trends, errors, spread = {}, {}, np.sum((calls - calls.mean()) ** 2)
    for k in keys:
        if all(row.get(k) is not None for row in rows):
            values = np.array([row[k] for row in rows], dtype=float)
            slope, offset = np.polyfit(calls, values, 1)
            residual = values - (slope * calls + offset)
            trends[k] = float(slope * np.ptp(calls))
            errors[k] = float(np.sqrt(np.sum(residual ** 2) / (len(rows) - 2) / spread) * np.ptp(calls))
    return trends, errors


POOL_KEYS = ("cupy_pool_high_water", "jax_pool", "device_used")
"""Reported, not held to the target: what CuPy's pool held before each phase returned its free blocks to the
driver, what XLA's allocator reserves (free blocks included), and the device total.  Both allocators keep freed
memory for later allocations, and 16 threads of mixed sizes fragment them up to a high-water mark (on the H200:
+68 MiB of device memory in steps of ~32 MiB, XLA's pool growing on demand).  CuPy's free blocks
are returned at every phase because the driver maps device memory in 2 MiB pages: a pool that grows by a few
MiB moved "outside the pools" by up to 2 MiB."""


def _clear_jax_caches() -> None:
    """With recompilation: JAX's own caches (compiled executables, lowerings, traces) are cleared at every phase
    boundary, so every executable dies there and the JAX bridge must then hold nothing for it."""
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.clear_caches()


def _jax_side() -> dict:
    """What the JAX bridge holds (:func:`cudnn_target.held_plans`): the plans its FFI handler can run (held by
    live executables or recent lowerings), the call-site entries, and the live executables' call sites."""
    target = sys.modules.get("cudnn_attn.jax_bridge.cudnn_target")
    call_site = sys.modules.get("cudnn_attn.jax_bridge.call_site")
    held = None if target is None else target.held_plans()
    return {"pinned_plans": None if held is None else held["plans"],
            "call_sites": None if call_site is None else len(call_site.registry),
            "live_executable_sites": None if held is None else held["executables"]}


def _host_heap() -> dict[str, int | None]:
    """Where the host's memory is: ``malloc_in_use`` - bytes glibc's malloc has handed out and not had back, over
    all arenas, mmapped blocks included (``mallinfo2``: the native heap of cuDNN, CUDA, XLA and CPython's large
    objects) - and ``python_blocks``, the blocks CPython's own allocator has handed out (a count).  When both
    stay flat while the RSS steps up, the step is fragmentation of freed memory, not memory still held."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        mallinfo2 = _libc().mallinfo2
        mallinfo2.restype = MallInfo2
        info = mallinfo2()
        in_use = int(info.uordblks + info.hblkhd)
    except (OSError, AttributeError):        # not glibc, or glibc < 2.33
        in_use = None
    return {"malloc_in_use": in_use, "python_blocks": sys.getallocatedblocks()}


def _trimmed_rss() -> int | None:
    """The RSS after glibc's ``malloc_trim(0)`` (``None`` where there is no glibc)."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        return None
    return _rss()


@functools.lru_cache(maxsize=None)
def _libc() -> Any:
    """The C library (its malloc's statistics and trimming); ``OSError`` where it cannot be loaded."""
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


@dataclass
class Rebinds:
    """The launch handle's rebinds (``cudnnSetStream``): a count per stream, and how many were made on a
    thread with no CUDA context current."""

    streams: collections.Counter = field(default_factory=collections.Counter)
    without_context: int = 0


def _count_rebinds() -> Rebinds:
    """Count every time a device's launch handle is pointed at a stream: how many distinct streams the handle
    has known shows whether short-lived streams pass through it, and the calls made with no CUDA context
    current are the ones cuDNN's driver queries fail on (``cudnn_attn.engine.runtime``).  Patches the process's
    ``DeviceContext`` (a GPU soak only)."""
    from cuda.bindings import driver

    from cudnn_attn.engine import runtime

    bind = runtime.DeviceContext.bind_stream
    if getattr(bind, "counted", None) is not None:
        return bind.counted
    rebinds = Rebinds()

    def counted_bind(self: Any, stream_ptr: int) -> None:
        if stream_ptr != self._stream:
            rebinds.streams[stream_ptr] += 1
            if not int(driver.cuCtxGetCurrent()[1]):
                rebinds.without_context += 1
        bind(self, stream_ptr)

    counted_bind.counted = rebinds
    runtime.DeviceContext.bind_stream = counted_bind
    return rebinds


def _phase_line(row: dict) -> str:
    memory = "  ".join(f"{k} {row[k] / MIB:.1f}" for k in MEMORY_KEYS + ATTRIBUTION_KEYS + POOL_KEYS
                       if row.get(k) is not None)
    return (f"[{row['phase']}] calls {row['calls']}  {memory} MiB  python blocks {row.get('python_blocks')}  "
            f"graphs alive {row['live_graphs']} "
            f"(cached {row['cached_graphs']}, held by the JAX bridge {row['pinned_plans']}; call sites "
            f"{row['call_sites']}, in live executables {row['live_executable_sites']}); replay graphs "
            f"{row.get('replay_graphs', '-')} (made, destroyed so far: {row.get('replay_churn', '-')}); the launch "
            f"handle pointed at {row.get('handle_streams', '-')} distinct streams, {row.get('handle_rebinds', '-')} "
            f"times, {row.get('rebinds_without_context', '-')} of them with no CUDA context current")


def verdict(report: dict, growth_limit: int = MIB) -> tuple[bool, list[str]]:
    failures = []
    if report["errors"]:
        failures.append(f"{sum(report['errors'].values())} errors")
    if report["mismatches"]:
        failures.append(f"{sum(report['mismatches'].values())} mismatches")
    growth = {k: v for k, v in report["trend_second_half"].items() if k in MEMORY_KEYS}   # raw RSS too
    errors = report.get("trend_error_second_half", {})
    # A failure is growth of at least the limit that the scatter cannot explain (more than two standard errors):
    # device readings move in the driver's 2 MiB pages and scatter by +-3 MiB, so a flat line drawn through them
    # can tilt by a MiB (1.11 +- 0.6 MiB over 67k calls on the H200, every reading within 614-622 MiB).
    failures += [f"{name} grew {value / MIB:.2f} +- {errors.get(name, 0.0) / MIB:.2f} MiB"
                 for name, value in growth.items() if value >= growth_limit and value > 2 * errors.get(name, 0.0)]
    return not failures, failures


def table(report: dict) -> str:
    errors = collections.Counter()
    for key, count in report["errors"].items():
        errors[key.split(":")[0]] += count
    stopped = f" (stopped at --max-seconds; {report['planned_calls']} planned)" if report.get("stopped_at_deadline") else ""
    lines = [f"soak: {report['calls']} calls{stopped} ({report['settling_calls']} settling), {report['threads']} threads, "
             f"{report['seconds']} s, {report['backend']}",
             f"{'path':12s} {'calls':>8s} {'errors':>7s} {'mismatches':>10s}"]
    for path in PATHS:
        lines.append(f"{path:12s} {report['calls_by_path'].get(path, 0):8d} {errors.get(path, 0):7d} "
                     f"{report['mismatches'].get(path, 0):10d}")
    keys = [k for k in MEMORY_KEYS + ATTRIBUTION_KEYS + POOL_KEYS
            if any(row.get(k) is not None for row in report["phases"])]
    names = {"host_rss_trimmed": "rss_trimmed", "device_outside_pools": "dev_outside", "cupy_pool_used": "cupy_used",
             "malloc_in_use": "malloc_use*", "cupy_pool_high_water": "cupy_hw*", "jax_pool": "jax_pool*",
             "device_used": "dev_used*"}
    lines.append(f"{'phase (MiB)':24s} {'calls':>6s} " + " ".join(f"{names.get(k, k):>11s}" for k in keys)
                 + f" {'py_blocks':>9s} {'graphs':>6s} {'pinned':>6s} {'replays':>7s}")
    for row in report["phases"]:
        memory = " ".join(f"{row[k] / MIB:11.1f}" if row.get(k) is not None else f"{'-':>11s}" for k in keys)
        lines.append(f"{row['phase'][:24]:24s} {row['calls']:6d} {memory} {row.get('python_blocks', '-'):>9} "
                     f"{row['live_graphs']:6d} "
                     f"{row['pinned_plans'] if row['pinned_plans'] is not None else '-':>6} "
                     f"{row.get('replay_graphs', '-'):>7}")
    for label, growth in (("growth settled->final", report["growth"]),
                          (f"growth {report['halfway_calls']}->final", report["growth_second_half"]),
                          (f"trend {report['halfway_calls']}->final", report["trend_second_half"]),
                          ("  its standard error", report.get("trend_error_second_half", {}))):
        lines.append(f"{label[:31]:31s} " + " ".join(
            f"{growth[k] / MIB:11.2f}" if k in growth else f"{'-':>11s}" for k in keys)
            + (f" {growth['python_blocks']:9.0f}" if "python_blocks" in growth else ""))
    if any(k in POOL_KEYS for k in keys):
        lines.append("* reported, not held to the target: malloc's bytes in use (where the RSS is), the pools' "
                     "reserves and the device total")
    churn = report["phases"][-1].get("replay_churn")
    if churn is not None:
        lines.append(f"replay graphs made, destroyed, updated in place: {tuple(churn)}")
    cache = report["graph_cache"]
    lines.append(f"graph cache: maxsize {cache['maxsize']}, {cache['hits']} hits, {cache['misses']} misses, "
                 f"{cache['evictions']} evictions; graphs alive at the end {cache['live_graphs']} "
                 f"(held by the JAX bridge: {cache['pinned_plans']}); {report.get('jax_recompiles', 0)} JAX "
                 f"recompilations")
    ok, failures = verdict(report)
    lines.append(f"PASS (0 errors, 0 mismatches, trend from {report['halfway_calls']} calls on < 1 MiB: host RSS "
                 "raw and after malloc_trim, memory in use in CuPy's and XLA's pools, device memory outside them)" if ok
                 else "FAIL: " + "; ".join(failures) + f" (trend from {report['halfway_calls']} calls on)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=None, help="total calls (default 100000; --quick 4000)")
    parser.add_argument("--threads", type=int, default=16)
    parser.add_argument("--cache-size", type=int, default=4, help="graphs the cache keeps (the mix needs ~20)")
    parser.add_argument("--quick", action="store_true", help="4000 calls on smaller shapes")
    parser.add_argument("--dry-run", action="store_true", help="CPU: the NumPy reference and JAX on CPU")
    parser.add_argument("--seed", type=int, default=2026)
    parser.add_argument("--phase-calls", type=int, default=1000, help="calls between two memory reports")
    parser.add_argument("--recompile-every", type=int, default=0,
                        help="JAX calls of a configuration between two recompilations (0: never)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop issuing calls after this long (the report says how many ran)")
    parser.add_argument("--out", help="write the report as JSON")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.phase_calls < 1 or (args.calls is not None and args.calls < 1):
        parser.error("--threads, --calls and --phase-calls must be >= 1")
    calls = args.calls or (4000 if args.quick else 100_000)
    if args.max_seconds is not None:
        _deadline[0] = time.monotonic() + args.max_seconds
    report = soak(calls=calls, threads=args.threads, cache_size=args.cache_size, quick=args.quick,
                  dry_run=args.dry_run, seed=args.seed, phase_calls=args.phase_calls,
                  recompile_every=args.recompile_every)
    report["passed"], report["failures"] = verdict(report)
    if args.out:
        with open(args.out, "w") as out:
            json.dump(report, out, indent=1, default=str)
    for message in report["messages"]:
        print(message)
    print(table(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    faulthandler.enable(all_threads=True)     # a crash in native code prints every thread's Python stack
    sys.exit(main())
