"""Run one attention call on the GPU: the configuration and CuPy operands in, CuPy results out.

This is the native API under :mod:`cudnn_attn.api` (which adds the seed-compatible signatures and
array import).  :func:`forward` and :func:`backward` take what :func:`cudnn_attn.validation.prepare`
returns, plus where to run (``stream``), how to pick the plan (``autotune``) and, optionally,
preallocated results (``out=``-style keywords, e.g. for CUDA-graph capture or tests).

Flow of a call: graph-cache lookup (a miss checks :func:`cudnn_attn.support.check_supported` before
any GPU work, then builds) -> results allocated on the call's stream -> rows cuDNN leaves unwritten
zeroed -> pointers bound by :class:`~cudnn_attn.graphs.tensors.TensorId` -> one launch.

Conventions (the same as :mod:`cudnn_attn.reference`):

* With a padding mask, packed segments or paged K/V, cuDNN does not define the rows outside the
  sequences: query rows ``t >= q_seqlen[b]`` (output, logsumexp, dq), key rows ``s >= kv_seqlen[b]``
  (dk, dv) and tokens outside every packed segment.  On the H200 (cuDNN 9.19) it leaves some
  unwritten and writes non-finite values into the padded logsumexp rows, so they are set to 0 here
  after the launch (one masked copy per result, on the call's stream).
* cuDNN reads Q/K/V positions past the sequence lengths inside its tiles and masks their
  contribution: their values must be finite.  NaN or Inf there (e.g. an uninitialised buffer)
  propagates into valid rows - measured on the H200 with cuDNN 9.19 for padded and paged-prefill K/V.
* Dropout uses cuDNN's Philox generator with ``seed`` (a runtime value: a new seed does not build a
  new graph) and offset 0; the backward regenerates the same keep-mask from the same seed.
* Packed segments: cuDNN sees ``B*M`` ragged sequences (:mod:`cudnn_attn.graphs.packing`); the
  logsumexp comes back as ``(B*M, N, T)``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import numpy as np

from . import runtime
from .cache import GraphKey, PlanChoice, graph_cache
from .config import AttentionConfig, AttentionOperands
from .graphs.tensors import FP8_AMAX_IDS, FP8_SCALE_IDS, SCORE_MOD_ARG_IDS, TensorId
from .types import FP8_BWD_KEYS, FP8_FWD_KEYS, AttentionGrads, AttentionLayout, AttentionOutput

FWD, BWD = "fwd", "bwd"

_autotune_default = False


def set_autotune(enabled: bool) -> None:
    """Make ``autotune=None`` (the default of every call) mean ``enabled``."""
    global _autotune_default
    _autotune_default = bool(enabled)


def _plan_choice(autotune: bool | None) -> PlanChoice:
    tune = _autotune_default if autotune is None else autotune
    return PlanChoice.AUTOTUNED if tune else PlanChoice.HEURISTIC


class _Call:
    """Device, stream, handle and the buffers of one launch."""

    def __init__(self, config: AttentionConfig, operands: AttentionOperands, stream: Any):
        import cupy

        self.cupy = cupy
        self.config = config
        self.device = operands.query.device.id
        self.context = runtime.context(self.device)
        self.stream_ptr = runtime.stream_pointer(stream, self.device)
        # ``None``: the current CuPy stream, where allocations and kernels already go.
        self.stream = None if stream is None else self.context.stream(self.stream_ptr)
        self.buffers: dict[TensorId, int] = {}
        self.keep_alive: list[Any] = []               # host scalars and temporaries bound by address
        self.zeroed: list[Any] = []

    # -- binding -------------------------------------------------------------------------------
    def bind(self, tid: TensorId, array: Any) -> Any:
        self.buffers[tid] = array.data.ptr
        return array

    def bind_host_scalar(self, tid: TensorId, value: Any, dtype: Any) -> None:
        scalar = np.full((1,), value, dtype)
        self.keep_alive.append(scalar)
        self.buffers[tid] = scalar.ctypes.data

    def result(self, tid: TensorId | None, shape: tuple[int, ...], dtype: Any, given: Any = None, *,
               zero: bool = False) -> Any:
        """A result buffer (``given`` or a new one), bound to ``tid`` and zeroed before the launch if asked."""
        if given is None:
            if self.stream is None:
                given = self.cupy.empty(shape, dtype)
            else:
                with self.stream:
                    given = self.cupy.empty(shape, dtype)
        elif tuple(given.shape) != tuple(shape) or given.dtype != np.dtype(dtype) or not given.flags.c_contiguous:
            name = tid.name.lower() if tid is not None else "result"
            raise ValueError(f"{name}: a preallocated result must be a C-contiguous {np.dtype(dtype).name}"
                             f"{list(shape)}, got {given.dtype}{list(given.shape)}")
        if tid is not None:
            self.bind(tid, given)
        if zero:
            self.zeroed.append(given)
        return given

    def bind_common(self, kind: str, operands: AttentionOperands, seed: int, rng_dump: Any) -> Any:
        """Everything forward and backward share; returns the packed segments (or ``None``)."""
        config = self.config
        self.bind(TensorId.Q, operands.query)
        self.bind(TensorId.K, operands.key)
        self.bind(TensorId.V, operands.value)
        if operands.bias is not None:
            self.bind(TensorId.BIAS, operands.bias)
        if operands.sink is not None:
            self.bind(TensorId.SINK, operands.sink)
        if operands.page_table_k is not None:
            self.bind(TensorId.PAGE_TABLE_K, operands.page_table_k)
            self.bind(TensorId.PAGE_TABLE_V, operands.page_table_v)
        if config.has_dropout:
            self.bind_host_scalar(TensorId.SEED, seed, np.int64)
            self.bind_host_scalar(TensorId.OFFSET, 0, np.int64)
        for tid, arg in zip(SCORE_MOD_ARG_IDS, operands.score_mod_args):
            self.bind_host_scalar(tid, _host_float(arg), np.float32)
        if config.fp8:
            for name in FP8_FWD_KEYS if kind == FWD else FP8_BWD_KEYS:
                self.bind(FP8_SCALE_IDS[name], operands.fp8_scales[name])
        if rng_dump is not None:
            shape = (config.segments, config.q_heads, config.q_len, config.kv_len)
            self.result(TensorId.RNG_DUMP, shape, np.float32, rng_dump)
        segments = None
        if config.packing is not None:
            from .graphs import packing

            with self.on_stream():
                segments = packing.segments(self.cupy, operands.q_seqlen, operands.kv_seqlen, operands.q_offsets,
                                            operands.kv_offsets, config.q_len, config.kv_len)
                for tid, array in packing.cudnn_buffers(self.cupy, config, segments).items():
                    if tid is TensorId.RAGGED_STATS and kind == FWD and not config.training:
                        continue                          # an inference forward writes no statistics
                    self.bind(tid, self.cupy.ascontiguousarray(array))
                    self.keep_alive.append(array)
        elif operands.q_seqlen is not None:
            self.bind(TensorId.SEQ_LEN_Q, operands.q_seqlen)
            self.bind(TensorId.SEQ_LEN_KV, operands.kv_seqlen)
        return segments

    # -- rows cuDNN does not define ------------------------------------------------------------
    def valid_tokens(self, operands: AttentionOperands, segments: Any) -> tuple[Any, Any]:
        """Boolean ``(B, T)`` / ``(B, S)`` masks of the query / key tokens inside a sequence."""
        cupy, config = self.cupy, self.config
        with self.on_stream():
            if segments is None:
                q = cupy.arange(config.q_len, dtype=cupy.int32)[None, :] < operands.q_seqlen[:, None]
                kv = cupy.arange(config.kv_len, dtype=cupy.int32)[None, :] < operands.kv_seqlen[:, None]
                return q, kv
            return (_inside(cupy, segments.q_start, segments.q_seqlen, config.batch, config.q_len),
                    _inside(cupy, segments.kv_start, segments.kv_seqlen, config.batch, config.kv_len))

    def zero_outside(self, x: Any, valid: Any, *, lse: bool = False) -> None:
        """Set the tokens of ``x`` outside ``valid`` to 0: ``x`` is Q/O-like (or K/V-like) in the
        config's layout, or the ``(B, N, T)`` logsumexp with ``lse``."""
        batch, length = valid.shape
        if lse:
            shape = (batch, 1, length)
        elif self.config.layout is AttentionLayout.BTNH:
            shape = (batch, length, 1, 1)
        else:
            shape = (batch, 1, length, 1)
        with self.on_stream():
            self.cupy.copyto(x, 0, where=~valid.reshape(shape))

    def on_stream(self) -> Any:
        """Context manager making the call's stream current (a no-op for the current stream)."""
        return contextlib.nullcontext() if self.stream is None else self.stream

    # -- launch --------------------------------------------------------------------------------
    def launch(self, kind: str, autotune: bool | None, rng_dump: bool) -> None:
        key = graph_cache.key(self.config, kind, self.device, plan=_plan_choice(autotune), rng_dump=rng_dump)
        entry = graph_cache.entry(key, self._builder(key))
        for array in self.zeroed:
            runtime.zero_fill(array, self.stream_ptr)
        workspace = self.context.workspace(self.stream_ptr, entry.graph.workspace_size)
        self.context.bind_stream(self.stream_ptr)
        entry.launcher(self.buffers, workspace, self.context.handle)

    def _builder(self, key: GraphKey) -> Callable[[GraphKey], Any]:
        """Support check first (no GPU work for a refused configuration), then the build."""
        def build(key: GraphKey) -> Any:
            from .graphs import build_graph
            from .support import check_supported

            check_supported(key.config, self.context.environment, kind=key.kind)

            def build_with(plan: str | None = None) -> Any:
                with self.cupy.cuda.Device(self.device):
                    return build_graph(key.config, key.kind, self.context.handle, rng_dump=key.rng_dump, plan=plan)

            if key.plan is PlanChoice.HEURISTIC:
                return build_with()
            from .autotune import tuned_graph

            self.context.bind_stream(self.stream_ptr)
            return tuned_graph(build_with, self.buffers, lambda n: self.context.workspace(self.stream_ptr, n),
                               self.context.handle, self.context.stream(self.stream_ptr))
        return build


def _host_float(x: Any) -> float:
    """A score_mod argument's value for by-value binding (a device scalar is read back: one sync)."""
    return float(x.get() if hasattr(x, "get") else x)


def _amax(call: _Call, tid: TensorId) -> Any:
    return call.result(tid, (1, 1, 1, 1), np.float32)


def forward(config: AttentionConfig, operands: AttentionOperands, *, seed: int = 42, stream: Any = None,
            autotune: bool | None = None, output: Any = None, logsumexp: Any = None,
            rng_dump: Any = None) -> AttentionOutput:
    """cuDNN attention forward on CuPy ``operands`` (see the module doc).

    ``output`` / ``logsumexp`` are optional preallocated results (``config.o_shape`` in the io dtype;
    float32 ``config.lse_shape``, only with ``config.training``).  ``rng_dump`` (debug/tests) is a
    float32 ``(B*M, N, T, S)`` buffer that receives cuDNN's dropout keep-mask.
    """
    with runtime.on_device(operands.query.device.id):
        return _forward(config, operands, seed, stream, autotune, output, logsumexp, rng_dump)


def _forward(config: AttentionConfig, operands: AttentionOperands, seed: int, stream: Any, autotune: bool | None,
             output: Any, logsumexp: Any, rng_dump: Any) -> AttentionOutput:
    call = _Call(config, operands, stream)
    segments = call.bind_common(FWD, operands, seed, rng_dump)
    out = call.result(TensorId.O, config.o_shape, operands.query.dtype, output)
    lse = stats = None
    if config.training:
        if segments is None:
            lse = stats = call.result(TensorId.STATS, config.lse_shape, np.float32, logsumexp)
        else:
            stats = call.result(TensorId.STATS, (config.batch * config.q_len, config.q_heads), np.float32)
    elif logsumexp is not None:
        raise ValueError("logsumexp: only produced when training (return_residual=True)")
    amax_s = _amax(call, TensorId.AMAX_S) if config.fp8 else None
    amax_o = _amax(call, TensorId.AMAX_O) if config.fp8 else None
    call.launch(FWD, autotune, rng_dump is not None)
    if config.mask.padding:
        q_valid, _ = call.valid_tokens(operands, segments)
        call.zero_outside(out, q_valid)
        if segments is None and lse is not None:
            call.zero_outside(lse, q_valid, lse=True)
    if segments is not None and stats is not None:
        from .graphs import packing

        with call.on_stream():
            lse = packing.lse_from_tokens(call.cupy, stats, segments, config.q_len)   # 0 outside segments
            if logsumexp is not None:
                _copy_into("logsumexp", logsumexp, lse)
                lse = logsumexp
    return AttentionOutput(out, lse, amax_s, amax_o)


def backward(config: AttentionConfig, operands: AttentionOperands, output: Any, grad_output: Any,
             logsumexp: Any, *, seed: int = 42, stream: Any = None, autotune: bool | None = None,
             dq: Any = None, dk: Any = None, dv: Any = None, dbias: Any = None, dsink: Any = None,
             rng_dump: Any = None) -> AttentionGrads:
    """cuDNN attention backward on CuPy arrays; ``seed`` must be the forward's (same dropout mask).

    ``output``/``logsumexp`` are the forward's results, ``grad_output`` the gradient of ``output``.
    ``dq``/``dk``/``dv``/``dbias``/``dsink`` are optional preallocated results.  ``dbias`` is returned
    when the bias is differentiable, ``dsink`` with a sink.
    """
    with runtime.on_device(operands.query.device.id):
        return _backward(config, operands, output, grad_output, logsumexp, seed, stream, autotune,
                         dict(dq=dq, dk=dk, dv=dv, dbias=dbias, dsink=dsink), rng_dump)


def _backward(config: AttentionConfig, operands: AttentionOperands, output: Any, grad_output: Any, logsumexp: Any,
              seed: int, stream: Any, autotune: bool | None, given: dict, rng_dump: Any) -> AttentionGrads:
    call = _Call(config, operands, stream)
    segments = call.bind_common(BWD, operands, seed, rng_dump)
    call.bind(TensorId.O, output)
    call.bind(TensorId.DO, grad_output)
    if segments is None:
        call.bind(TensorId.STATS, logsumexp)
    else:
        from .graphs import packing

        with call.on_stream():
            tokens = packing.lse_to_tokens(call.cupy, logsumexp, segments, config.batch * config.q_len)
        call.keep_alive.append(call.bind(TensorId.STATS, call.cupy.ascontiguousarray(tokens)))
    io = operands.query.dtype
    grads = dict(
        dq=call.result(TensorId.DQ, config.q_shape, io, given["dq"]),
        dk=call.result(TensorId.DK, config.k_shape, io, given["dk"]),
        dv=call.result(TensorId.DV, config.v_shape, io, given["dv"]),
    )
    if config.has_dbias:
        grads["dbias"] = call.result(TensorId.DBIAS, config.bias.shape, io, given["dbias"], zero=True)
    if config.sink:
        grads["dsink"] = call.result(TensorId.DSINK, (config.q_heads,), np.float32, given["dsink"], zero=True)
    if config.fp8:
        for name in ("amax_dQ", "amax_dK", "amax_dV", "amax_dP"):
            grads[name.lower()] = _amax(call, FP8_AMAX_IDS[name])
    call.launch(BWD, autotune, rng_dump is not None)
    if config.mask.padding:
        q_valid, kv_valid = call.valid_tokens(operands, segments)
        call.zero_outside(grads["dq"], q_valid)
        call.zero_outside(grads["dk"], kv_valid)
        call.zero_outside(grads["dv"], kv_valid)
    return AttentionGrads(**grads)


def _inside(cupy: Any, starts: Any, lengths: Any, batch: int, length: int) -> Any:
    """``(batch, length)`` mask of the tokens covered by the packed segments ``[start, start + length)``."""
    tokens = cupy.arange(batch * length, dtype=cupy.int32)
    count = lengths.shape[0]
    segment = cupy.maximum(cupy.searchsorted(starts[:count], tokens, side="right").astype(cupy.int32) - 1, 0)
    position = tokens - starts[segment]
    return ((position >= 0) & (position < lengths[segment])).reshape(batch, length)


def _copy_into(name: str, target: Any, value: Any) -> None:
    if tuple(target.shape) != tuple(value.shape) or target.dtype != value.dtype:
        raise ValueError(f"{name}: a preallocated result must be {value.dtype}{list(value.shape)}, "
                         f"got {target.dtype}{list(target.shape)}")
    target[...] = value
