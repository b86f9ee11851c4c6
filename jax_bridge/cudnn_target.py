"""The GPU target: the library's cuDNN graph, run on XLA's stream, reading and writing XLA's buffers.

Lowering (once per compiled call site): everything a run needs is decided here
    :func:`lower` registers the :class:`~.call_site.AttentionCall`; :func:`plan_devices`, for **every
    GPU of the lowering's device assignment**, makes the device's cuDNN context (handle and lock,
    :mod:`cudnn_attn.engine.runtime`), finds or builds the :class:`~cudnn_attn.engine.plan.CallPlan` in
    :data:`cudnn_attn.graph_cache` (after the support check, so a refused configuration fails at ``jit``
    time with its reasons) and warms it up (one launch on scratch buffers, so that no CUDA module is
    loaded lazily while XLA runs the program - loading may synchronise the device, which deadlocks a
    program whose other GPUs wait in a collective for this one).  The plan is kept for the handler as a
    :class:`SiteLaunch` (host scalars bound, the workspace the last result).  Then :func:`lower` emits one
    FFI call whose operands and results are the plan's (packed segments are converted with
    ``jax.numpy`` around the call, :meth:`cudnn_attn.engine.call.CallSpec.bind`); the workspace is an extra
    ``uint8`` result that XLA allocates.  After the call, the logsumexp gets the after-launch part of the
    plan's fill policy.

Execution (every run): nothing is created, built or allocated
    The handler reads the call site's key, the device ordinal, XLA's stream and the buffer addresses
    (:meth:`ffi.Call.snapshot`: one ``struct`` read of the call frame's fields, one per buffer table),
    finds the call site's launch by ``(key, device)`` and runs :meth:`CallPlan.launch` (under the device
    lock: point the handle at the stream only when it changed, zero what the policy zeroes first, launch;
    or replay it, :mod:`cudnn_attn.engine.replay`, without asking whether the stream is being captured when the
    target is the one XLA never records).  A missing plan - a device the lowering did not plan - is a
    clear error, never a build.

CUDA graphs (XLA command buffers)
    The target is declared command-buffer compatible, so XLA may record the handler's work (memsets
    and the cuDNN launch) into a CUDA graph and replay it without running Python.  XLA records again
    when the buffer addresses change, and the handler reads them on every run, so every recording is
    right.  The host scalars (the dropout seed) are static per call site.  ``cuda_graph=False`` selects
    a target without the trait (XLA then runs the handler on every execution).

Lifetime: the handler's plans are held (:class:`~.call_site.Holds`) by every live executable that calls
the site - its instantiate stage pins them, re-planning any that are gone, and XLA's destruction of the
executable unpins them - and by the most recent lowerings, as many as the graph cache holds graphs.
When neither holds them they are dropped, so the graph cache's bound also holds on the JAX side, beyond
the plans that live programs can still run.  An executable whose instantiate stage did not run (seen by
the handler) stops all releasing, with a warning: its plans must never go.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, NamedTuple

import numpy as np

from cudnn_attn.core.config import AttentionConfig
from cudnn_attn.core.support import check_supported
from cudnn_attn.core.types import Front
from cudnn_attn.engine import runtime
from cudnn_attn.engine.cache import graph_cache
from cudnn_attn.engine.call import CallSpec

from . import ffi
from .call_site import EAGER_TARGET, TARGET, AttentionCall, Holds, registry

logger = logging.getLogger("cudnn_attn")


def _check_expressible(site: AttentionCall) -> None:
    """The support table's verdict for this GPU on the JAX front (score_mod arguments, x64 offsets)."""
    check_supported(site.config, kind=site.kind, front=Front.JAX)


# -- call sites planned for the handler ----------------------------------------------------------------

class SiteLaunch(NamedTuple):
    """One call site on one device, as the handler runs it: the plan, and ``launch(addresses, stream,
    capturable)`` with everything else fixed (host scalars, the workspace as the last result, the stream kept
    bound); ``capturable`` says whether XLA may be recording the stream (the command-buffer target)."""

    plan: Any
    launch: Callable[[list, int, bool], None]


def _site_launch(plan: Any, scalars: tuple) -> SiteLaunch:
    launch, uses_workspace = plan.sequence(scalars, keep_stream=True), bool(plan.workspace_size)

    def run(addresses: list, stream: int, capturable: bool) -> None:
        workspace = addresses.pop()                   # XLA's uint8 result, last
        launch(addresses, stream, workspace if uses_workspace else 0, capturable)

    return SiteLaunch(plan, run)


def _graph_cache_size() -> int:
    return graph_cache.maxsize


_launches: dict[tuple[int, int], SiteLaunch] = {}      # (call-site key, device) -> what the handler runs
_planned: dict[int, tuple[int, ...]] = {}              # call-site key -> the devices its lowering planned
_lock = threading.Lock()


def _drop_plans(key: int) -> None:
    with _lock:
        for device in _planned.get(key, ()):
            _launches.pop((key, device), None)


def _forget_site(key: int) -> None:
    with _lock:
        _planned.pop(key, None)


plan_holds = Holds(_graph_cache_size, _drop_plans)
"""Holds the handler's plans (see the module doc)."""
_pins = plan_holds.pins
registry.on_release(_forget_site)
graph_cache.add_holder(lambda: [(f.plan, f"JAX call site {key} on device {d}: {_pins.get(key, 0)} live executable(s)")
                                for (key, d), f in list(_launches.items())])


def plan_devices(site: AttentionCall, key: int, devices: list[int]) -> list[Any]:
    """At lowering (and at an executable's instantiation): the plans of call site ``site`` on ``devices`` -
    each device's context made, the graph built or found, warmed up and kept for the handler under ``key``."""

    plans = []
    for device in devices:
        found = _launches.get((key, device))
        if found is None:
            runtime.device_context(device)
            plan = graph_cache.plan(site.config, site.kind, device)
            plan.warm_up()
            with _lock:
                found = _launches.setdefault((key, device), _site_launch(
                    plan, CallSpec.of(site.config, site.kind).host_scalars(site.seed)))
        plans.append(found.plan)
    with _lock:
        _planned[key] = tuple(sorted(set(_planned.get(key, ())) | set(devices)))
    plan_holds.touch(key)
    return plans


def _instantiate(call: ffi.Call) -> Callable[[], None]:
    """XLA builds an executable that calls a site: hold its entry and plans (re-planned if dropped since the
    lowering) until XLA destroys the executable."""
    key = call.int64_attribute("key")
    site = registry.call(key)
    unpin_site, unpin_plans = registry.holds.pin(key), plan_holds.pin(key)
    try:
        plan_devices(site, key, list(_planned.get(key, ())))
    except BaseException:
        unpin_plans()
        unpin_site()
        raise

    def unpin() -> None:
        unpin_plans()
        unpin_site()

    return unpin


def pinned_plan(key: int, device: int) -> Any:
    """The plan the handler runs for call site ``key`` on ``device`` (``None`` when not planned)."""
    found = _launches.get((key, device))
    return None if found is None else found.plan


def held_plans() -> dict[str, int]:
    """Counts for soaks and notebooks: plans kept for the handler, and what holds them (the executables XLA
    destroyed since the last compilation are released first)."""
    executables = ffi.live_states()
    return {"plans": len(_launches), **plan_holds.counts(), "executables": executables}


def _handler(capturable: bool) -> Callable[[ffi.Call], None]:
    """The handler of one target: XLA's buffers and stream into the call site's launch (see the module doc).
    ``capturable``: whether XLA may record the target into a command buffer (else the stream is never
    being captured, and the replay of the launch does not ask, :mod:`cudnn_attn.engine.replay`)."""

    def run(call: ffi.Call) -> None:
        key, addresses, stream, device = call.snapshot(only_device)
        found = _launches.get((key, device))
        if found is None:
            found = _missing_site(key, device)
        if key not in _pins and plan_holds.releasing:
            _not_instantiated(key)
        found.launch(addresses, stream, capturable)

    return run


_run = _handler(capturable=True)            # TARGET: XLA may record it into its command buffers
_run_eager = _handler(capturable=False)     # EAGER_TARGET: XLA runs it on every execution, never recorded


def _not_instantiated(key: int) -> None:
    """The handler runs an executable whose instantiate stage did not pin its site: stop all releasing."""
    if plan_holds.releasing:
        plan_holds.releasing = registry.holds.releasing = False
        logger.warning("cudnn_attn: XLA ran call site %d without its instantiate stage; the JAX bridge keeps "
                       "every plan from now on (the graph cache's bound no longer applies to them)", key)


def _missing_site(key: int, device: int | None) -> SiteLaunch:
    """The call site on ``device`` when the fast lookup missed: a runtime without the device query (XLA made
    the device current), else the error of a device the lowering did not plan."""
    if device is None:
        import cupy

        device = cupy.cuda.runtime.getDevice()
        found = _launches.get((key, device))
        if found is not None:
            return found
    site = registry.call(key)                       # raises the "lowered in another process" error
    raise RuntimeError(
        f"cudnn_attn: the {site.kind} call of {site.config.describe()} was not planned for GPU {device} "
        f"when it was lowered (planned: {sorted(d for k, d in _launches if k == key)}); nothing is built while "
        f"XLA runs a program. Lower the computation for this device (jax.jit with its sharding).")


only_device: int | None = None
"""The ordinal of the process's only GPU, when it has exactly one (set at the first lowering): the handler then
skips XLA's device query - no execution can run on another device."""

HANDLERS = (ffi.make_handler(TARGET, _run, command_buffer_compatible=True, instantiate=_instantiate),
            ffi.make_handler(EAGER_TARGET, _run_eager, instantiate=_instantiate))


def _release() -> None:
    """At exit (:func:`cudnn_attn.engine.runtime.release`): wait for computations in flight, then unpin the plans."""
    ffi.finish_pending_calls()
    with _lock:
        _launches.clear()
        _planned.clear()


def _register_release() -> None:
    runtime.on_release(_release)


_register_release()


# -- lowering ---------------------------------------------------------------------------------------

def _lowering_devices(ctx: Any) -> list[int]:
    """CUDA ordinals of this process's GPUs in the lowering's device assignment (all local GPUs when the
    lowering context names none, e.g. an abstract mesh or the per-shard lowering of a partitioned call)."""
    import jax

    global only_device
    local = jax.local_devices(backend="gpu")
    only_device = local[0].local_hardware_id if len(local) == 1 else None

    context = ctx.module_context.axis_context
    devices = getattr(context, "device_assignment", None)
    if devices is None:
        mesh_devices = getattr(getattr(context, "mesh", None), "devices", None)
        devices = None if mesh_devices is None else tuple(np.asarray(mesh_devices).flat)
    if not devices:
        devices = local
    here = jax.process_index()
    return sorted({d.local_hardware_id for d in devices if d.process_index == here and d.platform == "gpu"})


def lower(ctx: Any, *args: Any, kind: str, config: AttentionConfig, options: Any) -> Any:
    """Lowering of the inner primitive on CUDA (see the module doc)."""
    import jax
    import jax.numpy as jnp
    from jax.interpreters import mlir


    site = AttentionCall(config, kind, options.seed)
    _check_expressible(site)
    key = registry.key(site)
    # Plain data only, never the plans: whatever JAX keeps of a lowering must not keep cuDNN graphs alive (the
    # handler finds the pinned plan by key and device).
    workspace = max(plan.workspace_size for plan in plan_devices(site, key, _lowering_devices(ctx)))
    spec = CallSpec.of(config, kind)
    target = TARGET if options.cuda_graph else EAGER_TARGET

    def call(*arrays: Any) -> list[Any]:
        named = dict(zip(spec.operands, arrays))
        bound, segments = spec.bind(jnp, named)
        buffers = jax.ffi.ffi_call(
            target, [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in spec.graph_results]
            + [jax.ShapeDtypeStruct((max(workspace, 1),), jnp.uint8)],
        )(*(bound[t] for t in spec.graph_operands), key=np.int64(key))
        results = spec.finish(jnp, {r.name: x for r, x in zip(spec.graph_results, buffers)}, named, segments)
        return [results[name] for name in spec.result_names]

    # The conversions above are traced on plain avals: the call is per device, so the operands' mesh
    # shardings and shard_map axes (which sharding-in-types checks would apply to them) do not matter here.
    plain = [jax.core.ShapedArray(a.shape, a.dtype) for a in ctx.avals_in]
    ctx = ctx.replace(avals_in=plain, avals_out=[jax.core.ShapedArray(a.shape, a.dtype) for a in ctx.avals_out])
    return mlir.lower_fun(call, multiple_results=True)(ctx, *args)
