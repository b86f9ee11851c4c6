"""Plans that survive the process: building through the plan store.

:func:`build_or_load` is :func:`~.builder.build_graph` with a memory across processes: it returns
the plan saved in a :class:`~cudnn_attn.persist.store.PlanStore` when there is one, else builds and
saves it.  Deserializing costs about 4 ms on the H200 (research notes §5) against 0.4-1.1 s to build;
deviceless on this project's 2-core CPU 1.5 ms, except the first one of a process (9 ms: cuDNN loads
its engine libraries) - a whole warm first plan in a new process measured 24-52 ms there, including
``import cudnn`` (24 ms) and the device-properties object (15 ms, deviceless only).
A loaded graph is checked against what was saved: its variant-pack uids, its workspace size and,
where cuDNN's blob names them, its engine and SM version.  Anything unexpected is one
:class:`~cudnn_attn.persist.store.PlanStoreWarning` and a rebuild that overwrites the entry.

A loaded graph holds exactly one backend plan and no ranked plan list (``graph._plans == []``,
``get_plan_name_at_index`` refuses), so it runs with ``plan_index=None`` only; its plan name comes
from the store.  The frontend executes it through ``_lowered_graph._execute_with_raw_ptrs(...,
plan_index=-1)`` (the path ``pygraph.execute`` itself takes for a deserialized graph), which is the
launch path of :class:`cudnn_attn.engine.launch.Launcher` once it treats an empty plan list as "the one
plan" (see the module's tests).

Autotuning remembers its winner: :func:`remember_autotuned` records the winning engine plan's name and
:func:`autotuned_engine_plan` reads it back, so another process rebuilds (or loads) that engine plan by name
without timing anything.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Mapping

import cudnn

from cudnn_attn.core.environment import Environment
from cudnn_attn.graphs.builder import ALL_PLANS, BuiltGraph, PlanInfo, build_graph
from cudnn_attn.graphs.target import DevicelessTarget, graph_options
from cudnn_attn.graphs.tensors import TensorId
from cudnn_attn.persist.store import AUTOTUNED, HEURISTIC, NotPersistable, PlanKey, PlanStore

logger = logging.getLogger("cudnn_attn")

_ENGINE = re.compile(rb'"engine":\{"engineId":(\d+),"smVersion":(\d+)')
_PLAN_ENGINE = re.compile(r"eng(\d+)")


def environment_for(target: Any) -> Environment:
    """The :class:`~cudnn_attn.core.environment.Environment` of a planning target: a :class:`DevicelessTarget`'s
    described GPU, or for a ``cudnn.Handle`` the *current* CUDA device (build with the handle's device current)."""
    if isinstance(target, DevicelessTarget):
        return Environment.for_deviceless(target)
    return Environment.detect()


def plan_key(config: Any, kind: str, environment: Environment, *, plan: str | None = None,
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
                  rng_dump: bool = False, environment: Environment | None = None) -> BuiltGraph:
    """The planned graph of ``config``'s ``kind``, from ``store`` when saved there, else built and saved.

    Arguments as :func:`~cudnn_attn.graphs.builder.build_graph`, plus ``store`` (``None``: just build) and
    ``environment`` (default :func:`environment_for` ``(target)``).  ``plan=ALL_PLANS``
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
def autotuned_engine_plan(store: PlanStore | None, config: Any, kind: str, *, environment: Environment,
                          rng_dump: bool = False) -> str | None:
    """The name of the engine plan (``eng9_k24=7``) an earlier autotuning chose for ``(config, kind)`` in
    ``environment``, or ``None``."""
    key = plan_key(config, kind, environment, plan=AUTOTUNED, rng_dump=rng_dump) if store is not None else None
    entry = store.load(key) if key is not None else None
    name = entry.meta.get("plan_name") if entry is not None else None
    return name if isinstance(name, str) and name else None


def remember_autotuned(store: PlanStore | None, config: Any, kind: str, engine_plan: str, *,
                       environment: Environment, rng_dump: bool = False,
                       timings: Mapping[str, float] | None = None) -> None:
    """Record the engine plan named ``engine_plan`` as the autotuning winner (``timings``: engine plan name ->
    milliseconds, for the listing)."""
    key = plan_key(config, kind, environment, plan=AUTOTUNED, rng_dump=rng_dump) if store is not None else None
    if key is not None:
        store.save(key, b"", {"description": f"{kind} {config.describe()} (autotuned)", "plan_name": engine_plan,
                              "timings_ms": dict(timings or {})})
