"""Plans that survive the process: building through the plan store, and cuDNN's kernel cache.

:func:`build_or_load` is :func:`~.builder.build_graph` with a memory across processes: it returns
the plan saved in a :class:`~cudnn_attn.plan_store.PlanStore` when there is one, else builds and
saves it.  Deserializing costs about 4 ms on the H200 (research notes §5) against 0.4-1.1 s to build;
deviceless on this project's 2-core CPU 1.5 ms, except the first one of a process (9 ms: cuDNN loads
its engine libraries) - a whole warm first plan in a new process measured 24-52 ms there, including
``import cudnn`` (24 ms) and the device-properties object (15 ms, deviceless only).
A loaded graph is checked against what was saved: its variant-pack uids, its workspace size and,
where cuDNN's blob names them, its engine and SM version.  Anything unexpected is one
:class:`~cudnn_attn.plan_store.PlanStoreWarning` and a rebuild that overwrites the entry.

A loaded graph holds exactly one backend plan and no ranked plan list (``graph._plans == []``,
``get_plan_name_at_index`` refuses), so it runs with ``plan_index=None`` only; its plan name comes
from the store.  The frontend executes it through ``_lowered_graph._execute_with_raw_ptrs(...,
plan_index=-1)`` (the path ``pygraph.execute`` itself takes for a deserialized graph), which is the
launch path of :class:`cudnn_attn.launch.Launcher` once it treats an empty plan list as "the one
plan" (see the module's tests).

Autotuning remembers its winner: :func:`remember_autotuned` records the winning plan's name and
:func:`autotuned_plan` reads it back, so another process rebuilds (or loads) that plan by name
without timing anything.

:class:`KernelCache` holds cuDNN's kernel cache for dynamic-shape forward graphs; see its doc for
what was measured and when it is used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import threading
import time
from typing import Any, Mapping

import cudnn

from cudnn_attn.errors import UnsupportedConfigurationError
from cudnn_attn.plan_store import (
    AUTOTUNED, HEURISTIC, KernelCacheKey, NotPersistable, PlanEnvironment, PlanKey, PlanStore, config_fields,
)

from .builder import ALL_PLANS, FWD, BuiltGraph, PlanInfo, build_graph
from .target import DevicelessTarget, graph_options
from .tensors import TensorId

logger = logging.getLogger("cudnn_attn")

_ENGINE = re.compile(rb'"engine":\{"engineId":(\d+),"smVersion":(\d+)')
_PLAN_ENGINE = re.compile(r"eng(\d+)")


def environment_for(target: Any) -> PlanEnvironment:
    """The :class:`PlanEnvironment` of a planning target: a :class:`DevicelessTarget`'s described GPU,
    or for a ``cudnn.Handle`` the *current* CUDA device (build with the handle's device current)."""
    if isinstance(target, DevicelessTarget):
        return PlanEnvironment.for_deviceless(target)
    return PlanEnvironment.for_device()


def plan_key(config: Any, kind: str, environment: PlanEnvironment, *, plan: str | None = None,
             rng_dump: bool = False) -> PlanKey | None:
    """The store key of a plan, or ``None`` when the configuration cannot be keyed stably (a
    ``score_mod`` without a program fingerprint: then its graph lives in this process only)."""
    key = PlanKey(config, kind, plan or HEURISTIC, environment, rng_dump)
    try:
        key.to_json()
    except NotPersistable as exc:
        logger.debug("not persisting the %s graph of %s: %s", kind, config.describe(), exc)
        return None
    return key


def build_or_load(config: Any, kind: str, target: Any, *, store: PlanStore | None, plan: str | None = None,
                  rng_dump: bool = False, environment: PlanEnvironment | None = None,
                  kernels: "KernelCache | None" = None) -> BuiltGraph:
    """The planned graph of ``config``'s ``kind``, from ``store`` when saved there, else built and saved.

    Arguments as :func:`~.builder.build_graph`, plus ``store`` (``None``: just build),
    ``environment`` (default :func:`environment_for` ``(target)``) and ``kernels`` (build forward
    graphs of known families with dynamic shapes, see :class:`KernelCache`).  ``plan=ALL_PLANS``
    (autotuning candidates) is never stored.  Raises what :func:`~.builder.build_graph` raises.
    """
    key = None
    if store is not None and plan != ALL_PLANS:
        key = plan_key(config, kind, environment or environment_for(target), plan=plan, rng_dump=rng_dump)
    if key is not None:
        entry = store.load(key)
        if entry is not None:
            loaded = _load(store, entry, key, target)
            if loaded is not None:
                return loaded
    if kernels is not None:
        built = kernels.build(config, kind, target, plan=plan, rng_dump=rng_dump)
    else:
        built = build_graph(config, kind, target, rng_dump=rng_dump, plan=plan)
    if key is not None:
        save(store, key, built)
    return built


def save(store: PlanStore, key: PlanKey, built: BuiltGraph) -> None:
    """Serialize ``built`` into ``store`` under ``key`` (a graph cuDNN cannot serialize is logged and skipped)."""
    try:
        blob = built.graph.serialize(as_bytes=True)
    except Exception as exc:  # noqa: BLE001 -- any refusal only means "not persisted"
        logger.info("cannot serialize the %s plan of %s (%s): not persisted", key.kind, key.config.describe(), exc)
        return
    store.save(key, blob, {
        "description": f"{key.kind} {key.config.describe()}" + (" rng_dump" if key.rng_dump else ""),
        "plan_name": built.plan_name, "plan_index": built.plans[0].index, "workspace_size": built.workspace_size,
        "uids": {tid.name: uid for tid, uid in built.uids.items()}, "num_plans": built.num_plans,
        "build_seconds": built.build_seconds, "origin": built.origin,
    })


def _load(store: PlanStore, entry: Any, key: PlanKey, target: Any) -> BuiltGraph | None:
    """Deserialize and verify a stored plan; ``None`` (after one warning) when it does not fit."""
    start = time.perf_counter()
    meta = entry.meta
    try:
        uids = {TensorId[name]: int(uid) for name, uid in meta["uids"].items()}
        plan_name, workspace = str(meta["plan_name"]), int(meta["workspace_size"])
        graph = cudnn.pygraph(name=f"cudnn_attn_{key.kind}", **graph_options(target))
        if isinstance(target, cudnn.Handle):
            graph.deserialize(target, entry.payload)
        else:
            graph.deserialize(entry.payload)
        problem = _mismatch(graph, entry.payload, key, uids, plan_name, workspace)
    except Exception as exc:  # noqa: BLE001 -- whatever cuDNN or the metadata raise, the entry is unusable
        problem = f"cannot be deserialized ({type(exc).__name__}: {exc})"
    if problem:
        store.reject(entry.path, problem)
        return None
    seconds = time.perf_counter() - start
    logger.info("loaded cuDNN %s plan %s in %.1f ms from %s: %s", key.kind, plan_name, seconds * 1e3,
                entry.path, key.config.describe())
    return BuiltGraph(graph=graph, config=key.config, kind=key.kind, uids=dict(sorted(uids.items())),
                      workspace_size=workspace, plan_name=plan_name, build_seconds=seconds,
                      num_plans=int(meta.get("num_plans", 1)),
                      plans=(PlanInfo(int(meta.get("plan_index", 0)), plan_name, workspace),), origin="loaded")


def _mismatch(graph: Any, blob: bytes, key: PlanKey, uids: Mapping[TensorId, int], plan_name: str,
              workspace: int) -> str | None:
    """What is wrong with a deserialized graph (``None`` when it is what was saved)."""
    if key.choice not in (HEURISTIC, AUTOTUNED) and plan_name != key.choice:
        return f"holds plan {plan_name!r}, not the requested {key.choice!r}"
    order = list(graph._variant_pack_uids() or ())
    if order != sorted(uids.values()):
        return f"binds tensor uids {order}, expected {sorted(uids.values())}"
    found = int(graph.get_workspace_size())
    if found != workspace:
        return f"needs {found} workspace bytes, {workspace} were recorded"
    engine = _ENGINE.search(blob)          # cuDNN's plan JSON inside the blob (best effort: format not public)
    named = _PLAN_ENGINE.match(plan_name)
    if engine is not None and named is not None and engine.group(1).decode() != named.group(1):
        return f"holds engine {engine.group(1).decode()}, but plan {plan_name!r} was recorded"
    cc = key.environment.compute_capability
    if engine is not None and int(engine.group(2)) != cc[0] * 100 + cc[1] * 10:
        return f"was built for smVersion {engine.group(2).decode()}, not sm{cc[0]}{cc[1]}"
    return None


# ---------------------------------------------------------------------------------------------------
# Autotuning winners
# ---------------------------------------------------------------------------------------------------
def autotuned_plan(store: PlanStore | None, config: Any, kind: str, *, environment: PlanEnvironment,
                   rng_dump: bool = False) -> str | None:
    """The plan name an earlier autotuning chose for ``(config, kind)`` in ``environment``, or ``None``."""
    key = plan_key(config, kind, environment, plan=AUTOTUNED, rng_dump=rng_dump) if store is not None else None
    entry = store.load(key) if key is not None else None
    name = entry.meta.get("plan_name") if entry is not None else None
    return name if isinstance(name, str) and name else None


def remember_autotuned(store: PlanStore | None, config: Any, kind: str, plan_name: str, *,
                       environment: PlanEnvironment, rng_dump: bool = False,
                       timings: Mapping[str, float] | None = None) -> None:
    """Record ``plan_name`` as the autotuning winner (``timings``: plan name -> milliseconds, for the listing)."""
    key = plan_key(config, kind, environment, plan=AUTOTUNED, rng_dump=rng_dump) if store is not None else None
    if key is not None:
        store.save(key, b"", {"description": f"{kind} {config.describe()} (autotuned)", "plan_name": plan_name,
                              "timings_ms": dict(timings or {})})


# ---------------------------------------------------------------------------------------------------
# cuDNN's kernel cache (dynamic shapes)
# ---------------------------------------------------------------------------------------------------
_DIFFERS = ""      # family memo: cuDNN planned the dynamic-shape graph differently from the static one


def shape_family(config: Any, rng_dump: bool = False) -> tuple:
    """``config`` without its batch size and sequence lengths (and the sizes that follow them: bias
    T/S, paged block counts), plus whether it decodes (T = 1) and whether T <= S: the graphs a
    dynamic-shape kernel is shared by."""
    bias = config.bias and dataclasses.replace(
        config.bias, shape=tuple(int(n == 1) for n in config.bias.shape[:2]) + (0, 0))   # broadcast pattern only
    paging = config.paging and dataclasses.replace(config.paging, num_blocks_k=0, num_blocks_v=0, blocks_per_seq=0)
    # every member of the family gets the same sizes; 1 (not 0: the configuration of no call is refused)
    shape_free = config.replace(batch=1, q_len=1, kv_len=1, bias=bias, paging=paging)
    return shape_free, config.q_len == 1, config.q_len <= config.kv_len, rng_dump


def _family_digest(family: tuple) -> str | None:
    try:
        fields = [config_fields(family[0]), *family[1:]]
    except NotPersistable:
        return None
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


class KernelCache:
    """cuDNN's kernel cache for the dynamic-shape forward graphs of one device (or deviceless target).

    Measured deviceless (cuDNN 9.19.0, frontend 1.32, sm90; ``tests/deviceless/test_persist_deviceless.py``):

    * A dynamic-shape forward graph builds for every feature tried (masks, bias, dropout, packed,
      paged, GQA, MLA, d=256, sink, score_mod, FP8).  Its plan is the static graph's
      (``eng2_k24=7``, paged decode ``eng1_k24=3``, FP8 ``eng2_k24=32``) except where the static
      heuristic picks ``eng9_k24=7`` (no causal mask: plain, inference, d=256): the dynamic graph
      then gets ``eng2_k24=7``.
    * A dynamic-shape **backward** graph has no engine on sm90 ("no engine"): never attempted.
    * With the kernel cache a new sequence length of a built family costs 6 ms instead of
      0.4-0.7 s, and the plan serializes like any other.
    * The cache serializes with its kernels (80 KB for one engine), but a cache deserialized into a
      new process gave no hit deviceless; it is persisted anyway so that the H200 can tell
      (``benchmarks/bench_first_call.py``).

    Policy (so that a dynamic-shape plan is never one cuDNN would not have chosen): the first graph
    of a :func:`shape_family` is built static and its plan name remembered; later lengths of that
    family are built with dynamic shapes and kept only when cuDNN picks the same plan name, else the
    family is built static from then on.  Only heuristic forward plans take part.  With a ``store``,
    the cache and the family memo persist (one ``kernels`` entry per environment).
    """

    def __init__(self, store: PlanStore | None = None, environment: PlanEnvironment | None = None):
        self._store = store
        self._environment = environment
        self._lock = threading.Lock()
        self._cache: Any = None
        self._families: dict[tuple, str] = {}
        self._persisted: dict[str, str] = {}

    def build(self, config: Any, kind: str, target: Any, *, plan: str | None = None,
              rng_dump: bool = False) -> BuiltGraph:
        """:func:`~.builder.build_graph` under the policy of the class doc."""
        if kind != FWD or plan is not None:
            return build_graph(config, kind, target, rng_dump=rng_dump, plan=plan)
        family = shape_family(config, rng_dump)
        with self._lock:
            self._open(target)
            static_plan = self._plan_of(family)
            if static_plan:
                try:
                    built = build_graph(config, kind, target, rng_dump=rng_dump, kernel_cache=self._cache)
                except (UnsupportedConfigurationError, RuntimeError) as exc:
                    logger.info("dynamic-shape build refused (%s); building static: %s", exc, config.describe())
                    built = None
                if built is not None and built.plan_name == static_plan:
                    if built.build_seconds > 0.05:          # new kernels compiled: keep them
                        self._persist()
                    return built
                logger.info("dynamic-shape plan %s differs from the static %s: building this family static: %s",
                            getattr(built, "plan_name", None), static_plan, config.describe())
                self._remember(family, _DIFFERS)
        built = build_graph(config, kind, target, rng_dump=rng_dump)
        with self._lock:
            if self._plan_of(family) is None:
                self._remember(family, built.plan_name)
        return built

    def _open(self, target: Any) -> None:
        if self._cache is not None:
            return
        self._cache = cudnn.create_kernel_cache()
        if self._store is None:
            return
        self._environment = self._environment or environment_for(target)
        entry = self._store.load(KernelCacheKey(self._environment))
        if entry is None:
            return
        families = entry.meta.get("families")
        try:
            if not isinstance(families, dict):
                raise ValueError("no family memo")
            if entry.payload:
                self._cache.deserialize(entry.payload.decode())
        except (ValueError, RuntimeError, UnicodeDecodeError) as exc:
            self._store.reject(entry.path, f"kernel cache unusable ({exc})")
            self._cache = cudnn.create_kernel_cache()
            return
        self._persisted = {str(k): str(v) for k, v in families.items()}

    def _plan_of(self, family: tuple) -> str | None:
        if family in self._families:
            return self._families[family]
        digest = _family_digest(family)
        return self._persisted.get(digest) if digest else None

    def _remember(self, family: tuple, plan_name: str) -> None:
        self._families[family] = plan_name
        digest = _family_digest(family)
        if digest is not None:
            self._persisted[digest] = plan_name
            self._persist()

    def _persist(self) -> None:
        if self._store is None or self._environment is None:
            return
        try:
            text = self._cache.serialize()
        except RuntimeError:            # an empty cache has nothing to serialize (CUDNN_STATUS_NOT_INITIALIZED)
            text = ""
        self._store.save(KernelCacheKey(self._environment), text.encode(),
                         {"description": "cuDNN kernel cache (dynamic shapes)", "families": dict(self._persisted)})


_kernel_caches: dict[tuple, KernelCache] = {}
_kernel_caches_lock = threading.Lock()


def _release_kernel_caches() -> None:
    """At exit (:func:`cudnn_attn.runtime.release`): drop cuDNN's kernel-cache objects."""
    with _kernel_caches_lock:
        _kernel_caches.clear()


def kernel_cache_for(device: int, store: PlanStore | None) -> KernelCache:
    """The process's :class:`KernelCache` of a CUDA ``device`` (one per device and store folder)."""
    key = (device, None if store is None else str(store.directory))
    with _kernel_caches_lock:
        cache = _kernel_caches.get(key)
        if cache is None:
            cache = _kernel_caches[key] = KernelCache(store)
        return cache


def _register_release() -> None:
    from cudnn_attn import runtime

    runtime.on_release(_release_kernel_caches)


_register_release()
