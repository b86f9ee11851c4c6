"""The GPU kernel: the library's cuDNN graph, run on XLA's stream, reading and writing XLA's buffers.

Lowering (once per compiled call site and device)
    :func:`lower` registers the :class:`~.kernel.Kernel`, builds (or finds) its cuDNN graph in
    :data:`cudnn_attn.graph_cache` for every GPU of the lowering's device assignment - after the
    support check, so a refused configuration fails at ``jit`` time with its reasons - and emits one
    FFI call.  Its operands are the graph's tensors by :class:`~cudnn_attn.graphs.tensors.TensorId`;
    packed segments are converted to cuDNN's ragged batch with ``jax.numpy`` around the call
    (:mod:`cudnn_attn.graphs.packing`); the workspace is an extra ``uint8`` result that XLA allocates.

Execution (every call)
    The handler reads the kernel key, the device ordinal, XLA's stream and the buffer addresses,
    zero-fills the rows cuDNN does not write (padding; ``cudaMemsetAsync`` on the stream, as the
    CuPy path does), points the thread's cuDNN handle at the stream and launches the prebuilt plan.
    Nothing is built, allocated or synchronised.

CUDA graphs (``cuda_graph=True``)
    The call goes to :data:`~.kernel.CUDA_GRAPH_TARGET`, registered with the command-buffer trait:
    XLA may record the handler's work (memsets and the cuDNN launch) into a CUDA graph and replay it
    without running Python.  XLA keys recorded graphs by the buffer addresses and records again when
    they change; the handler reads the addresses on every run, so a new recording is always correct.
    Host values are captured by value (the dropout seed is static anyway).  Before the first capture
    the plan is executed once at lowering on scratch buffers, so that no lazy initialisation (module
    loading) happens under stream capture, and the cuDNN handle of the lowering thread already exists.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from cudnn_attn.config import AttentionConfig
from cudnn_attn.errors import UnsupportedConfigurationError
from cudnn_attn.graphs.tensors import FP8_AMAX_IDS, FP8_SCALE_IDS, TensorId, ragged_offset_dtype

from . import ffi
from .kernel import CUDA_GRAPH_TARGET, TARGET, Kernel, registry
from .signature import FWD


# -- which tensors a call binds -----------------------------------------------------------------------

_OPERAND_IDS = {"query": TensorId.Q, "key": TensorId.K, "value": TensorId.V, "bias": TensorId.BIAS,
                "sink": TensorId.SINK, "page_table_k": TensorId.PAGE_TABLE_K,
                "page_table_v": TensorId.PAGE_TABLE_V, "output": TensorId.O, "grad_output": TensorId.DO,
                "q_seqlen": TensorId.SEQ_LEN_Q, "kv_seqlen": TensorId.SEQ_LEN_KV, **FP8_SCALE_IDS}
_RESULT_IDS = {"output": TensorId.O, "logsumexp": TensorId.STATS, "dq": TensorId.DQ, "dk": TensorId.DK,
               "dv": TensorId.DV, "dbias": TensorId.DBIAS, "dsink": TensorId.DSINK,
               "amax_s": FP8_AMAX_IDS["amax_s"], "amax_o": FP8_AMAX_IDS["amax_o"],
               "amax_dq": FP8_AMAX_IDS["amax_dQ"], "amax_dk": FP8_AMAX_IDS["amax_dK"],
               "amax_dv": FP8_AMAX_IDS["amax_dV"], "amax_dp": FP8_AMAX_IDS["amax_dP"]}


def _zeroed(config: AttentionConfig, kind: str) -> frozenset[TensorId]:
    """Results cuDNN leaves partly unwritten (the conventions of :mod:`cudnn_attn.execution`)."""
    padded = config.mask.padding
    if kind == FWD:
        ids = {TensorId.O} if padded else set()
        if config.training and (padded or config.packing is not None):
            ids.add(TensorId.STATS)
        return frozenset(ids)
    ids = {TensorId.DQ, TensorId.DK, TensorId.DV} if padded else set()
    return frozenset(ids | {TensorId.DBIAS, TensorId.DSINK})


def _check_expressible(kernel: Kernel) -> None:
    import jax

    config = kernel.config
    reasons = []
    if config.score_mod is not None and config.score_mod.arg_shapes:
        reasons.append("score_mod arguments are traced arrays under JAX, but cuDNN binds them by value on the host; "
                       "close over Python floats in score_mod instead of passing score_mod_args")
    if config.packing is not None and ragged_offset_dtype(config) == "int64" and not jax.config.jax_enable_x64:
        reasons.append("these packed tensors need int64 ragged offsets; enable jax_enable_x64")
    if reasons:
        raise UnsupportedConfigurationError(reasons, config)


# -- the prebuilt state of one kernel -----------------------------------------------------------------

@dataclass(frozen=True)
class _Binding:
    """How the FFI call of one kernel binds the graph's tensors (fixed when it is lowered)."""

    kernel: Kernel
    arg_ids: tuple[TensorId, ...]           # the call's operands, in order
    result_ids: tuple[TensorId, ...]        # its results, in order (the workspace follows them)
    result_bytes: tuple[int, ...]


@dataclass(frozen=True)
class _Launch:
    """Everything the handler needs for one kernel on one device."""

    binding: _Binding
    graph: Any                              # the cache entry: the BuiltGraph and its fast launcher
    zeroed: tuple[tuple[int, int], ...]     # (result position, bytes) to zero before the launch
    host_scalars: Mapping[TensorId, int]    # host addresses of the by-value scalars
    keep_alive: tuple[Any, ...]             # the arrays behind ``host_scalars``


_bindings: dict[int, _Binding] = {}                  # kernel key -> binding
_launches: dict[tuple[int, int], _Launch] = {}       # (kernel key, device) -> launch
_warmed: set[tuple[int, int]] = set()
_lock = threading.Lock()


def host_scalars(kernel: Kernel) -> dict[TensorId, np.ndarray]:
    """The by-value scalars of ``kernel``'s graph: the dropout seed (static) and offset (0)."""
    if not kernel.config.has_dropout:
        return {}
    return {TensorId.SEED: np.full((1,), kernel.seed, np.int64), TensorId.OFFSET: np.zeros((1,), np.int64)}


def _build(graph_key: Any) -> Any:
    """Cache builder: the support check first (no GPU work for a refused configuration), then cuDNN."""
    from cudnn_attn import cache, runtime
    from cudnn_attn.support import check_supported

    check_supported(graph_key.config, runtime.context(graph_key.device).environment, kind=graph_key.kind)
    return cache.build_on_device(graph_key)


def _prepare(key: int, device: int) -> _Launch:
    """The launch of kernel ``key`` on ``device``: its graph built (or found in the cache), the fast
    launcher and this thread's cuDNN handle created, the host scalars allocated."""
    from cudnn_attn import runtime
    from cudnn_attn.cache import graph_cache

    with _lock:
        launch = _launches.get((key, device))
        binding = _bindings[key]
    if launch is not None:
        return launch
    kernel = binding.kernel
    runtime.context(device)
    entry = graph_cache.entry(graph_cache.key(kernel.config, kernel.kind, device), _build)
    entry.launcher                                                   # noqa: B018  (created now, not in a call)
    host = host_scalars(kernel)
    bound = set(binding.arg_ids) | set(binding.result_ids) | set(host)
    if bound != set(entry.graph.uids):
        raise RuntimeError(f"the JAX bridge binds {sorted(t.name for t in bound)} but the cuDNN {kernel.kind} graph "
                           f"of {kernel.config.describe()} has {sorted(t.name for t in entry.graph.uids)}")
    zero = _zeroed(kernel.config, kernel.kind)
    launch = _Launch(
        binding=binding, graph=entry,
        zeroed=tuple((i, n) for i, (t, n) in enumerate(zip(binding.result_ids, binding.result_bytes)) if t in zero),
        host_scalars={t: a.ctypes.data for t, a in host.items()}, keep_alive=tuple(host.values()),
    )
    with _lock:
        return _launches.setdefault((key, device), launch)


def _run(call: ffi.Call) -> None:
    """The handler: bind XLA's buffers and stream, zero the unwritten rows, launch."""
    from cudnn_attn import runtime

    key = call.int64_attribute("key")
    device = call.device_ordinal()
    if device is None:
        import cupy

        device = cupy.cuda.runtime.getDevice()
    launch = _launches.get((key, device))
    if launch is None:
        if key not in _bindings:
            registry.kernel(key)                 # raises the "lowered in another process" error
        launch = _prepare(key, device)           # a device the lowering did not list: prepared once, now
    binding = launch.binding
    stream = call.stream()
    results = call.ret_addresses()
    buffers = dict(zip(binding.arg_ids, call.arg_addresses()))
    buffers.update(zip(binding.result_ids, results))
    buffers.update(launch.host_scalars)
    if launch.zeroed:
        import cupy

        for position, nbytes in launch.zeroed:
            cupy.cuda.runtime.memsetAsync(results[position], 0, nbytes, stream)
    context = runtime.context(device)
    context.bind_stream(stream)
    workspace = results[-1] if launch.graph.graph.workspace_size else 0
    launch.graph.launcher(buffers, workspace, context.handle)


HANDLERS = (ffi.make_handler(TARGET, _run), ffi.make_handler(CUDA_GRAPH_TARGET, _run, command_buffer_compatible=True))


# -- lowering ---------------------------------------------------------------------------------------

def _lowering_devices(ctx: Any) -> list[int]:
    """CUDA ordinals of this process's GPUs in the lowering's device assignment (all local GPUs when the
    lowering context names none, e.g. an abstract mesh)."""
    import jax

    context = ctx.module_context.axis_context
    devices = getattr(context, "device_assignment", None)
    if devices is None:
        mesh_devices = getattr(getattr(context, "mesh", None), "devices", None)
        devices = None if mesh_devices is None else tuple(np.asarray(mesh_devices).flat)
    if not devices:
        devices = jax.local_devices(backend="gpu")
    here = jax.process_index()
    return sorted({d.local_hardware_id for d in devices if d.process_index == here and d.platform == "gpu"})


def graph_operands(kernel: Kernel, named: Mapping[str, Any]) -> tuple[dict[TensorId, Any], Any]:
    """The graph's input tensors by id (packed segments converted with jax.numpy) and the segments."""
    import jax.numpy as jnp

    from cudnn_attn.graphs import packing

    config = kernel.config
    bound = {_OPERAND_IDS[name]: x for name, x in named.items() if name in _OPERAND_IDS
             and not (config.packing is not None and name in ("q_seqlen", "kv_seqlen"))}
    segments = None
    if config.packing is not None:
        segments = packing.segments(jnp, named["q_seqlen"], named["kv_seqlen"], named["q_offsets"],
                                    named["kv_offsets"], config.q_len, config.kv_len)
        bound.update(packing.cudnn_buffers(jnp, config, segments))
        if kernel.kind == FWD and not config.training:
            del bound[TensorId.RAGGED_STATS]                 # an inference graph has no statistics
    if "logsumexp" in named:
        lse = named["logsumexp"]
        if segments is not None:
            lse = packing.lse_to_tokens(jnp, lse, segments, config.batch * config.q_len)
        bound[TensorId.STATS] = lse
    return bound, segments


def graph_results(kernel: Kernel) -> dict[TensorId, tuple[tuple[int, ...], Any]]:
    """The graph's output tensors by id: ``(shape, dtype)`` of the FFI call's results (packed statistics
    are token-major, as the graph writes them)."""
    from .signature import result_shapes

    config = kernel.config
    types = {}
    for name, (shape, dtype) in result_shapes(config, kernel.kind).items():
        if name == "logsumexp" and config.packing is not None:
            shape = (config.batch * config.q_len, config.q_heads)        # token-major statistics
        types[_RESULT_IDS[name]] = (shape, dtype)
    return types


def lower(ctx: Any, *args: Any, kind: str, config: AttentionConfig, options: Any) -> Any:
    """Lowering of the kernel primitive on CUDA (see the module doc)."""
    import jax
    import jax.numpy as jnp
    from jax.interpreters import mlir

    from cudnn_attn.graphs import packing

    kernel = Kernel(config, kind, options.seed)
    _check_expressible(kernel)
    key = registry.key(kernel)
    devices = _lowering_devices(ctx)
    target = CUDA_GRAPH_TARGET if options.cuda_graph else TARGET
    result_types = graph_results(kernel)
    result_ids = tuple(sorted(result_types))
    by_name = {name: _RESULT_IDS[name] for name in kernel.results}

    def call(*arrays: Any) -> list[Any]:
        operands = dict(zip(kernel.operands, arrays))
        bound, segments = graph_operands(kernel, operands)
        sizes = tuple(int(np.prod(result_types[t][0], dtype=np.int64)) * np.dtype(result_types[t][1]).itemsize
                      for t in result_ids)
        binding = _Binding(kernel, tuple(sorted(bound)), result_ids, sizes)
        with _lock:
            _bindings.setdefault(key, binding)
        launches = [_prepare(key, device) for device in devices]
        workspace = max(launch.graph.graph.workspace_size for launch in launches)
        if options.cuda_graph:
            for device, launch in zip(devices, launches):
                _warm_up(key, device, launch, {t: (x.shape, x.dtype) for t, x in bound.items()}, result_types,
                         workspace)
        outs = jax.ffi.ffi_call(
            target, [jax.ShapeDtypeStruct(*result_types[t]) for t in result_ids]
            + [jax.ShapeDtypeStruct((max(workspace, 1),), jnp.uint8)],
        )(*(bound[t] for t in binding.arg_ids), key=np.int64(key))
        found = dict(zip(result_ids, outs))
        results = []
        for name in kernel.results:
            value = found[by_name[name]]
            if name == "logsumexp" and segments is not None:
                value = packing.lse_from_tokens(jnp, value, segments, config.q_len)
            elif name == "logsumexp" and config.mask.padding:
                # cuDNN writes non-finite values into the rows of padded queries (measured on the H200
                # with cuDNN 9.19): zero them after the call, as the CuPy path does.
                rows = jnp.arange(config.q_len, dtype=jnp.int32)[None, None, :]
                value = jnp.where(rows < operands["q_seqlen"].reshape(-1, 1, 1), value, 0.0)
            results.append(value)
        return results

    # The conversions above are traced on plain avals: the call is per device, so the operands' mesh
    # shardings and shard_map axes (which sharding-in-types checks would apply to them) do not matter here.
    plain = [jax.core.ShapedArray(a.shape, a.dtype) for a in ctx.avals_in]
    ctx = ctx.replace(avals_in=plain, avals_out=[jax.core.ShapedArray(a.shape, a.dtype) for a in ctx.avals_out])
    return mlir.lower_fun(call, multiple_results=True)(ctx, *args)


def _warm_up(key: int, device: int, launch: _Launch, args: Mapping[TensorId, tuple],
             results: Mapping[TensorId, tuple], workspace: int) -> None:
    """Execute the plan once on zero-filled scratch buffers (see the module doc), then synchronise."""
    import cupy

    from cudnn_attn import runtime

    if (key, device) in _warmed:
        return
    with cupy.cuda.Device(device):
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            scratch = {t: cupy.zeros(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize, cupy.uint8)
                       for t, (shape, dtype) in {**args, **results}.items()}
            space = cupy.zeros((max(workspace, 1),), cupy.uint8)
        buffers = {t: a.data.ptr for t, a in scratch.items()}
        buffers.update(launch.host_scalars)
        context = runtime.context(device)
        context.bind_stream(stream.ptr)
        launch.graph.launcher(buffers, space.data.ptr if workspace else 0, context.handle)
        stream.synchronize()
    _warmed.add((key, device))
