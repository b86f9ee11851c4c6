"""The call plan: everything one launch of one graph on one device needs, decided once.

A :class:`CallPlan` is made once per (configuration, forward/backward, device, plan choice) next to
the built cuDNN graph and lives in the graph-cache entry (:mod:`cudnn_attn.engine.cache`), so eviction frees
it.  Both fronts consume it - the CuPy path (:mod:`cudnn_attn.fronts.execution`) and the XLA FFI handler
(:mod:`cudnn_attn.jax_bridge.cudnn_target`) - and nothing else binds operands to the graph:

* :attr:`CallPlan.operand_ids` / :attr:`CallPlan.results` - the graph's device inputs and its results
  by :class:`~cudnn_attn.graphs.tensors.TensorId`, in the order every caller passes their addresses
  (the JAX lowering emits its FFI call in this order); :attr:`CallPlan.scalar_ids` the pass-by-value
  host scalars (dropout seed and offset, ``score_mod`` arguments), whose values a call passes;
* :func:`result_specs` - shape, dtype and the **one zero-fill policy** (:class:`Fill`) of every result;
* :func:`graph_inputs` - the arrays of a call as graph tensors (packed segments converted to cuDNN's
  ragged batch), for any array namespace (``cupy`` or ``jax.numpy``);
* :meth:`CallPlan.launch` - under the device lock: point the handle at the stream, take the
  workspace, zero what the policy zeroes before the launch, write the host scalars, launch;
* :meth:`CallPlan.warm_up` - one launch on scratch buffers before any real one (the JAX lowering calls
  it for every device): lazy CUDA module loading then never happens while XLA runs the program.

The zero-fill policy (cuDNN 9.19 on the H200, the library's convention that rows cuDNN does not
compute come back as zeros):

* ``ZERO_BEFORE`` - cuDNN leaves the rows of padded queries (O, dQ) and keys (dK, dV), and the tokens
  outside packed segments, unwritten; it *accumulates* into dbias and dsink.  One
  ``cudaMemsetAsync`` of the buffer before the launch.
* ``ROWS_AFTER`` - cuDNN *writes* non-finite values into the logsumexp rows of padded queries, so
  they are set to 0 after the launch (:func:`zero_rows`).
* ``SEGMENTS`` - the packed statistics are token-major; the conversion to the API's ``(B*M, N, T)``
  logsumexp (:func:`cudnn_attn.graphs.packing.lse_from_tokens`) zeroes everything outside a segment.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import weakref
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np

from cudnn_attn.core.config import AttentionConfig
from cudnn_attn.core.types import FP8_BWD_AMAX, Kind
from cudnn_attn.graphs import packing
from cudnn_attn.graphs import tensors as tt
from cudnn_attn.graphs.tensors import FP8_AMAX_IDS, FP8_SCALE_IDS, HOST_SCALAR_IDS, TensorId

from . import replay
from .launch import Launcher
from .replay import Replays

logger = logging.getLogger("cudnn_attn")

FWD, BWD = Kind.FORWARD, Kind.BACKWARD


class Fill(enum.Enum):
    """How a result's undefined elements become zeros (see the module doc)."""
    NONE = "none"
    ZERO_BEFORE = "zero_before"
    ROWS_AFTER = "rows_after"
    SEGMENTS = "segments"


class ResultSpec(NamedTuple):
    """One result buffer of a graph: its API name, tensor id, physical shape and dtype, fill policy."""
    name: str
    tid: TensorId
    shape: tuple[int, ...]
    dtype: np.dtype
    fill: Fill

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def io_dtype(config: AttentionConfig) -> np.dtype:
    """The NumPy dtype of Q/K/V/O (``ml_dtypes`` for bfloat16 and FP8)."""
    import ml_dtypes

    name = config.dtype
    return np.dtype(getattr(ml_dtypes, name) if name.startswith(("bfloat", "float8")) else name)


_F32 = np.dtype(np.float32)
_AMAX = (1, 1, 1, 1)


def result_specs(config: AttentionConfig, kind: str, *, rng_dump: bool = False) -> tuple[ResultSpec, ...]:
    """The results of ``config``'s ``kind`` graph, sorted by tensor id (the policy is the module doc's)."""
    io = io_dtype(config)
    padded = config.mask.padding
    zero_if_padded = Fill.ZERO_BEFORE if padded else Fill.NONE
    specs = []
    if kind == FWD:
        specs.append(ResultSpec("output", TensorId.O, config.o_shape, io, zero_if_padded))
        if config.training:
            if config.packing is not None:
                specs.append(ResultSpec("logsumexp", TensorId.STATS, (config.batch * config.q_len, config.q_heads),
                                        _F32, Fill.SEGMENTS))
            else:
                specs.append(ResultSpec("logsumexp", TensorId.STATS, config.lse_shape, _F32,
                                        Fill.ROWS_AFTER if padded else Fill.NONE))
        if config.fp8:
            specs += [ResultSpec(name, FP8_AMAX_IDS[name], _AMAX, _F32, Fill.NONE) for name in ("amax_s", "amax_o")]
    else:
        specs += [ResultSpec("dq", TensorId.DQ, config.q_shape, io, zero_if_padded),
                  ResultSpec("dk", TensorId.DK, config.k_shape, io, zero_if_padded),
                  ResultSpec("dv", TensorId.DV, config.v_shape, io, zero_if_padded)]
        if config.has_dbias:
            specs.append(ResultSpec("dbias", TensorId.DBIAS, tuple(config.bias.shape), io, Fill.ZERO_BEFORE))
        if config.sink:
            specs.append(ResultSpec("dsink", TensorId.DSINK, (config.q_heads,), _F32, Fill.ZERO_BEFORE))
        if config.fp8:
            specs += [ResultSpec(name, FP8_AMAX_IDS[name], _AMAX, _F32, Fill.NONE) for name in FP8_BWD_AMAX]
    if rng_dump:
        shape = (config.segments, config.q_heads, config.q_len, config.kv_len)
        specs.append(ResultSpec("rng_dump", TensorId.RNG_DUMP, shape, _F32, Fill.NONE))
    return tuple(sorted(specs, key=lambda spec: spec.tid))


# -- operands -------------------------------------------------------------------------------------------

OPERAND_IDS = {"query": TensorId.Q, "key": TensorId.K, "value": TensorId.V, "bias": TensorId.BIAS,
               "sink": TensorId.SINK, "page_table_k": TensorId.PAGE_TABLE_K, "page_table_v": TensorId.PAGE_TABLE_V,
               "q_seqlen": TensorId.SEQ_LEN_Q, "kv_seqlen": TensorId.SEQ_LEN_KV,
               "output": TensorId.O, "grad_output": TensorId.DO, **FP8_SCALE_IDS}
# Where each array of a call without packed segments goes (the backward's logsumexp is the statistics).
DIRECT_IDS = {**OPERAND_IDS, "logsumexp": TensorId.STATS}


def graph_inputs(xp: Any, config: AttentionConfig, kind: str, named: Mapping[str, Any]) -> tuple[dict, Any]:
    """The graph's device inputs by :class:`TensorId` from a call's named arrays, and the packed
    segments (``None`` unless packed).

    ``named`` holds the operand names of :mod:`cudnn_attn.jax_bridge.signature` (``query``, ``bias``,
    ``q_offsets``, the FP8Params keys, and for the backward ``output``, ``grad_output`` and
    ``logsumexp``); names the graph does not read (``score_mod`` arguments, bound by value) are
    ignored.  Packed segments become cuDNN's ragged batch (:mod:`cudnn_attn.graphs.packing`) with
    ``xp``, and the backward's logsumexp its token-major statistics.
    """

    packed = config.packing is not None
    bound = {OPERAND_IDS[name]: x for name, x in named.items()
             if name in OPERAND_IDS and x is not None and not (packed and name in ("q_seqlen", "kv_seqlen"))}
    segments = None
    if packed:
        segments = packing.segments(xp, named["q_seqlen"], named["kv_seqlen"], named["q_offsets"],
                                    named["kv_offsets"], config.q_len, config.kv_len)
        bound.update(packing.cudnn_buffers(xp, config, segments))
        if kind == FWD and not config.training:
            del bound[TensorId.RAGGED_STATS]                 # an inference graph has no statistics
    if kind == BWD:
        lse = named["logsumexp"]
        if packed:
            lse = packing.lse_to_tokens(xp, lse, segments, config.batch * config.q_len)
        bound[TensorId.STATS] = lse
    return bound, segments


def zero_rows(xp: Any, lse: Any, q_seqlen: Any) -> Any:
    """The ``(B, N, T)`` logsumexp with the rows of padded queries (``t >= q_seqlen[b]``) set to 0."""
    rows = xp.arange(lse.shape[-1], dtype=xp.int32)[None, None, :]
    return xp.where(rows < q_seqlen.reshape(-1, 1, 1), lse, xp.zeros((), lse.dtype))


def host_scalar_values(config: AttentionConfig, seed: int, score_mod_args: Sequence[float] = ()) -> tuple:
    """The values of a plan's :attr:`~CallPlan.scalar_ids`, in order: dropout seed and offset (0),
    then the ``score_mod`` arguments."""
    values: tuple = (int(seed), 0) if config.has_dropout else ()
    return values + tuple(float(a) for a in score_mod_args)


# -- the plan -------------------------------------------------------------------------------------------

_INT_INPUTS = frozenset({TensorId.SEQ_LEN_Q, TensorId.SEQ_LEN_KV, TensorId.RAGGED_Q, TensorId.RAGGED_K,
                         TensorId.RAGGED_V, TensorId.RAGGED_O, TensorId.RAGGED_STATS, TensorId.PAGE_TABLE_K,
                         TensorId.PAGE_TABLE_V})


class CallPlan:
    """A built graph bound for launches on one device (see the module doc).

    Args:
        built: the :class:`~cudnn_attn.graphs.builder.BuiltGraph`.
        context: the device's :class:`~cudnn_attn.engine.runtime.DeviceContext`.
        rng_dump: the graph also writes cuDNN's dropout keep-mask (a result; tests only).
        plan_index: run this entry of ``built.plans`` instead of the selected plan (autotuning).
    """

    def __init__(self, built: Any, context: Any, *, rng_dump: bool = False, plan_index: int | None = None):
        self.built = built
        self.config: AttentionConfig = built.config
        self.kind: str = built.kind
        self.context = context
        self.device: int = context.device
        self.results = result_specs(self.config, self.kind, rng_dump=rng_dump)
        result_ids = {spec.tid for spec in self.results}
        self.scalar_ids = tuple(sorted(t for t in built.uids if t in HOST_SCALAR_IDS))
        self.operand_ids = tuple(sorted(t for t in built.uids if t not in result_ids and t not in HOST_SCALAR_IDS))
        missing = result_ids - set(built.uids)
        if missing:
            raise RuntimeError(f"the {self.kind} graph of {self.config.describe()} lacks the results "
                               f"{sorted(t.name for t in missing)}")
        self.workspace_size: int = built.workspace_size if plan_index is None else \
            next(info.workspace_size for info in built.plans if info.index == plan_index)
        count = len(self.operand_ids)
        self._zeroed = tuple((count + i, spec.nbytes) for i, spec in enumerate(self.results)
                             if spec.fill is Fill.ZERO_BEFORE and spec.nbytes)
        # Host scalars live in buffers of the plan; launches write them under the device lock (cuDNN copies
        # pass-by-value scalars when the launch is enqueued).
        self._scalars = [np.zeros((1,), np.int64 if t in (TensorId.SEED, TensorId.OFFSET) else np.float32)
                         for t in self.scalar_ids]
        self._scalar_addresses = [int(a.ctypes.data) for a in self._scalars]
        ids = self.operand_ids + tuple(spec.tid for spec in self.results) + self.scalar_ids
        self.launcher = Launcher(built, ids, plan_index=plan_index)
        self._warm = False
        self._warm_lock = threading.Lock()
        self._fast: Any = None                # :meth:`run`'s launch sequence, made by its first call
        # The CUDA graphs of each live launch sequence (cudnn_attn.engine.replay), weakly: a sequence (the direct path's,
        # or a JAX call site's) owns its graphs, and they go when it goes, even while the plan stays cached.
        self.replays: weakref.WeakSet[Any] = weakref.WeakSet()

    # -- launching ----------------------------------------------------------------------------------
    def launch(self, pointers: list[int], stream: int, workspace: int | None = None,
               scalars: Sequence[Any] = (), keep_stream: bool = False) -> None:
        """Launch on ``stream`` (a ``cudaStream_t``).

        ``pointers`` are the device addresses of :attr:`operand_ids` then :attr:`results`, in order;
        ``workspace`` a device buffer of at least :attr:`workspace_size` bytes ordered on ``stream``
        (``None``: the device context's workspace for that stream); ``scalars`` the values of
        :attr:`scalar_ids` (:func:`host_scalar_values`).  Results with ``Fill.ZERO_BEFORE`` are zeroed
        first, on the same stream.  Nothing is allocated except a grown context workspace.  Afterwards the
        handle goes back to the default stream unless ``keep_stream`` (XLA's streams, which live as long as
        the process; see :mod:`cudnn_attn.engine.runtime` on streams a handle may not outlive).
        """
        context = self.context
        with context.lock:
            adopted = context.adopt_thread()           # a thread with no CUDA context (runtime module doc)
            try:
                context.bind_stream(stream)
                if workspace is None:
                    workspace = context.workspace(stream, self.workspace_size) if self.workspace_size else 0
                if self._zeroed:
                    _memset_zero(pointers, self._zeroed, stream)
                if self._scalars:
                    for buffer, value in zip(self._scalars, scalars):
                        buffer[0] = value
                    pointers = pointers + self._scalar_addresses
                self.launcher(pointers, workspace, context.handle)
                if stream and not keep_stream:
                    context.bind_stream(0)
            finally:
                if adopted:
                    context.release_thread()

    def specialized(self, scalars: Sequence[Any] = (), keep_stream: bool = False) -> Callable[..., None]:
        """:meth:`launch` with ``scalars`` and ``keep_stream`` fixed: ``run(pointers, stream, workspace=None,
        capturable=True)`` (``capturable=False``: ``stream`` is never being captured, :class:`~.replay.Replays`).

        A plan that zeroes results or passes host scalars runs :meth:`launch` itself; the others run the
        same sequence (device lock, handle stream, workspace, the raw cuDNN call) with every attribute
        looked up once, here.  The JAX handler launches through this.
        """
        fast = self._raw_sequence(keep_stream)
        if fast is not None:
            return fast
        launch = self.launch
        return lambda pointers, stream, workspace=None, capturable=True: launch(
            pointers, stream, workspace, scalars, keep_stream)

    def run(self, pointers: Sequence[int], stream: int, workspace: int | None = None) -> None:
        """:meth:`launch` of a plan without host scalars, through :meth:`specialized`'s sequence (the CuPy
        direct path)."""
        fast = self._fast
        if fast is None:
            fast = self._fast = self._raw_sequence(keep_stream=False) or False
        if fast:
            fast(pointers, stream, workspace)
        else:
            self.launch(pointers, stream, workspace)

    def _raw_sequence(self, keep_stream: bool) -> Callable[..., None] | None:
        """The launch sequence as a closure over the context and the launcher's raw call - never over the
        plan, so that keeping it on the plan makes no reference cycle (evicted graphs are freed at once).
        Repeated addresses replay a CUDA graph of the launch (:mod:`cudnn_attn.engine.replay`)."""
        raw = None if self._zeroed or self._scalars else self.launcher.bound(self.context)
        if raw is None:
            return None
        context, size = self.context, self.workspace_size
        lock, bind_stream, workspace_for = context.lock, context.bind_stream, context.workspace
        adopt_thread, release_thread = context.adopt_thread, context.release_thread
        replays = Replays(raw, bind_stream, context.capture_stream, context.device) if replay.ENABLED else None
        if replays is not None:
            self.replays.add(replays)

        def run(pointers: Sequence[int], stream: int, workspace: int | None = None, capturable: bool = True) -> None:
            with lock:
                adopted = adopt_thread()               # a thread with no CUDA context (runtime module doc)
                try:
                    if workspace is None:
                        workspace = workspace_for(stream, size) if size else 0
                    if replays is not None and replays.launch(pointers, workspace, stream, capturable):
                        return
                    bind_stream(stream)
                    raw(pointers, workspace)
                    if stream and not keep_stream:
                        bind_stream(0)
                finally:
                    if adopted:
                        release_thread()

        return run

    def warm_up(self) -> None:
        """Launch once on scratch buffers and wait (see the module doc); at most once per plan.

        Inputs alias one zero-filled float buffer (outputs may write into it: the values are never read),
        integer inputs get valid values (full sequence lengths, zero offsets and page ids) so that no
        address cuDNN derives from them leaves the buffers.  Skipped with a warning when the scratch does
        not fit on the device.
        """
        if self._warm:
            return
        with self._warm_lock:
            if self._warm:
                return
            try:
                self._launch_on_scratch()
            except Exception as error:   # noqa: BLE001 - the CuPy allocator's OutOfMemoryError among them
                if type(error).__name__ != "OutOfMemoryError":
                    raise
                logger.warning("cudnn_attn: no scratch memory to warm up the %s graph of %s on GPU %d (%s); "
                               "its first launch loads its kernels", self.kind, self.config.describe(),
                               self.device, error)
            self._warm = True

    def _launch_on_scratch(self) -> None:
        with self.scratch() as (pointers, stream, workspace):          # waits for the launch on leaving
            self.launch(pointers, stream.ptr, workspace=workspace, scalars=(0,) * len(self.scalar_ids))

    @contextlib.contextmanager
    def scratch(self) -> Iterator[tuple[list[int], Any, int]]:
        """Buffers for a launch that reads nothing meaningful: ``(pointers, stream, workspace pointer)``, on
        a new non-blocking stream of the plan's device, valid inside the ``with`` block.  Float inputs and
        all results alias one zero-filled buffer (the values are never read); integer inputs hold valid
        values (full sequence lengths, zero offsets and page ids), so no address cuDNN derives from them
        leaves the buffers.  Used to warm a plan up and to autotune a call that brings no buffers."""
        import cupy

        config = self.config
        sizes = {}
        for tid, nbytes in zip(self.operand_ids + tuple(s.tid for s in self.results), self._byte_sizes()):
            sizes[tid] = max(nbytes, 1)
        with cupy.cuda.Device(self.device):
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                shared = cupy.zeros(max(n for t, n in sizes.items() if t not in _INT_INPUTS), cupy.uint8)
                held = [shared]
                pointers = []
                for tid in self.operand_ids + tuple(s.tid for s in self.results):
                    if tid not in _INT_INPUTS:
                        pointers.append(shared.data.ptr)
                        continue
                    values = cupy.zeros(sizes[tid] // 4, cupy.int32)
                    if tid in (TensorId.SEQ_LEN_Q, TensorId.SEQ_LEN_KV):
                        values[...] = config.q_len if tid == TensorId.SEQ_LEN_Q else config.kv_len
                    held.append(values)
                    pointers.append(values.data.ptr)
                workspace = cupy.empty(max(self.workspace_size, 1), cupy.uint8)
                held.append(workspace)
                try:
                    yield pointers, stream, workspace.data.ptr
                finally:
                    stream.synchronize()

    def _byte_sizes(self) -> list[int]:
        """Bytes of every operand and result buffer, in launch order (from the declared tensors)."""
        sizes = []
        for tid in self.operand_ids:
            sizes.append(_declared_bytes(self.config, self.kind, tid))
        sizes += [spec.nbytes for spec in self.results]
        return sizes

    def describe(self) -> str:
        return f"{self.kind} {self.config.describe()} on GPU {self.device} plan={self.built.plan_name}"

    def __repr__(self) -> str:
        return f"CallPlan({self.describe()})"


def _declared_bytes(config: AttentionConfig, kind: str, tid: TensorId) -> int:
    """Bytes of input ``tid`` as the graph declares it (covers every element cuDNN may read)."""
    layouts = {TensorId.Q: tt.q_tensor, TensorId.K: tt.k_tensor, TensorId.V: tt.v_tensor,
               TensorId.O: tt.o_tensor, TensorId.DO: tt.o_tensor, TensorId.BIAS: tt.bias_tensor,
               TensorId.SINK: tt.sink_tensor, TensorId.SEQ_LEN_Q: tt.seq_len_tensor,
               TensorId.SEQ_LEN_KV: tt.seq_len_tensor, TensorId.PAGE_TABLE_K: tt.page_table_tensor,
               TensorId.PAGE_TABLE_V: tt.page_table_tensor}
    if tid in layouts:
        dims, strides = layouts[tid](config)
        itemsize = 4 if tid in _INT_INPUTS or tid == TensorId.SINK else io_dtype(config).itemsize
        return (1 + sum((d - 1) * s for d, s in zip(dims, strides))) * itemsize
    if tid == TensorId.STATS:
        return config.segments * config.q_heads * config.q_len * 4
    if tid in (TensorId.RAGGED_Q, TensorId.RAGGED_K, TensorId.RAGGED_V, TensorId.RAGGED_O, TensorId.RAGGED_STATS):
        return (config.segments + 1) * (8 if tt.ragged_offset_dtype(config) == "int64" else 4)
    return 4                                            # FP8 scale factors: one float32


def _memset_zero(pointers: list[int], zeroed: tuple[tuple[int, int], ...], stream: int) -> None:
    import cupy

    memset = cupy.cuda.runtime.memsetAsync
    for position, nbytes in zeroed:
        memset(pointers[position], 0, nbytes, stream)
