"""The call plan: a built cuDNN graph bound for launches on one device, and its one launch sequence.

A :class:`CallPlan` is made once per (configuration, forward/backward, device, plan choice) next to the built
cuDNN graph and lives in the graph-cache entry (:mod:`cudnn_attn.engine.cache`), so eviction frees it.  What a
call binds and returns is :class:`~cudnn_attn.engine.call.CallSpec`'s; the plan adds what the built graph and
the device decide:

* :attr:`CallPlan.operand_ids` / :attr:`CallPlan.results` - the graph's device inputs and the buffers it writes,
  by :class:`~cudnn_attn.graphs.tensors.TensorId`, in the order every caller passes their addresses (checked
  once against the built graph); :attr:`CallPlan.scalar_ids` the pass-by-value host scalars (dropout seed and
  offset, ``score_mod`` arguments);
* :meth:`CallPlan.sequence` - **the one launch sequence**, a closure made once per caller: under the device
  lock, make the device's CUDA context current on a thread without one, take the workspace, replay a CUDA
  graph of the launch when its addresses repeat (:mod:`cudnn_attn.engine.replay`), else point the handle at
  the stream, zero what the fill policy zeroes before the launch, write the host scalars and launch;
  :meth:`CallPlan.launch` runs it;
* :meth:`CallPlan.warm_up` - one launch on scratch buffers before any real one (the JAX lowering calls it for
  every device): lazy CUDA module loading then never happens while XLA runs the program.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from cudnn_attn.core import settings
from cudnn_attn.core.config import AttentionConfig, ragged_offset_dtype
from cudnn_attn.graphs import tensors as tt
from cudnn_attn.graphs.tensors import HOST_SCALAR_IDS, TensorId

from .call import BWD, FWD, CallSpec, Fill, ResultSpec, io_dtype, result_specs  # noqa: F401 (FWD/BWD, ResultSpec)
from .launch import Launcher
from .replay import Replays

logger = logging.getLogger("cudnn_attn")

Launch = Callable[..., None]
"""``run(pointers, stream, workspace=None, capturable=True, scalars=<fixed>)``: :meth:`CallPlan.sequence`."""


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
        self.spec = CallSpec.of(self.config, self.kind)
        self.context = context
        self.device: int = context.device
        self.results = result_specs(self.config, self.kind, rng_dump=rng_dump)
        result_ids = {spec.tid for spec in self.results}
        self.scalar_ids = tuple(sorted(t for t in built.uids if t in HOST_SCALAR_IDS))
        self.operand_ids = tuple(sorted(t for t in built.uids if t not in result_ids and t not in HOST_SCALAR_IDS))
        missing = result_ids - set(built.uids)
        if missing or self.operand_ids != self.spec.graph_operands:
            raise RuntimeError(f"the {self.kind} graph of {self.config.describe()} reads "
                               f"{[t.name for t in self.operand_ids]} and lacks the results "
                               f"{sorted(t.name for t in missing)}; its call binds "
                               f"{[t.name for t in self.spec.graph_operands]}")
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
        self._launches: dict[tuple, Launch] = {}    # :meth:`launch`'s sequences, by (keep_stream, replay)
        # The CUDA graphs of each live launch sequence (cudnn_attn.engine.replay), weakly: a sequence owns its
        # graphs, and they go when it goes, even while the plan stays cached.
        self.replays: weakref.WeakSet[Any] = weakref.WeakSet()

    # -- launching ----------------------------------------------------------------------------------
    def sequence(self, scalars: Sequence[Any] = (), keep_stream: bool = False, replay: bool = True) -> Launch:
        """The launch sequence of this plan, for one caller: ``run(pointers, stream, workspace=None,
        capturable=True, scalars=scalars)``.

        ``pointers`` are the device addresses of :attr:`operand_ids` then :attr:`results`, in order;
        ``workspace`` a device buffer of at least :attr:`workspace_size` bytes ordered on ``stream`` (``None``:
        the device context's workspace for that stream); ``scalars`` the values of :attr:`scalar_ids`
        (:meth:`~cudnn_attn.engine.call.CallSpec.host_scalars`).  Results with ``Fill.ZERO_BEFORE`` are zeroed
        first, on the same stream.  Nothing is allocated except a grown context workspace.  Afterwards the handle
        goes back to the default stream unless ``keep_stream`` (XLA's streams, which live as long as the process;
        see :mod:`cudnn_attn.engine.runtime` on streams a handle may not outlive).  ``capturable=False``:
        ``stream`` is never being captured, so a replay does not ask (:class:`~cudnn_attn.engine.replay.Replays`).

        A plan without zero-fills and host scalars replays repeated addresses unless ``replay`` is False (a
        caller whose address sets come back too rarely to repay a capture); the replay graphs belong to the
        sequence.  The closure holds the context and the launcher, never the plan, so that keeping it on the
        plan makes no reference cycle (evicted graphs are freed at once).
        """
        context, size, launcher = self.context, self.workspace_size, self.launcher
        lock, bind_stream, workspace_for = context.lock, context.bind_stream, context.workspace
        adopt_thread, release_thread = context.adopt_thread, context.release_thread
        zeroed, buffers, addresses = self._zeroed, self._scalars, self._scalar_addresses
        raw = launcher.bound(context)
        if raw is None:                                   # the frontend's execute (Launcher.path == FRONTEND)
            def raw(pointers: Sequence[int], workspace: int) -> None:
                launcher(pointers, workspace, context.handle)
        replays = None
        if replay and settings.current.replay and not zeroed and not buffers:
            replays = Replays(raw, bind_stream, context.capture_stream, context.device)
            self.replays.add(replays)
        fixed = tuple(scalars)

        def run(pointers: Sequence[int], stream: int, workspace: int | None = None, capturable: bool = True,
                scalars: Sequence[Any] = fixed) -> None:
            with lock:
                adopted = adopt_thread()               # a thread with no CUDA context (runtime module doc)
                try:
                    if workspace is None:
                        workspace = workspace_for(stream, size) if size else 0
                    if replays is not None and replays.launch(pointers, workspace, stream, capturable):
                        return
                    bind_stream(stream)
                    if zeroed:
                        _memset_zero(pointers, zeroed, stream)
                    if buffers:
                        for buffer, value in zip(buffers, scalars):
                            buffer[0] = value
                        pointers = [*pointers, *addresses]
                    raw(pointers, workspace)
                    if stream and not keep_stream:
                        bind_stream(0)
                finally:
                    if adopted:
                        release_thread()

        return run

    def own_sequence(self, keep_stream: bool = False, replay: bool = True) -> Launch:
        """This plan's own :meth:`sequence` for ``keep_stream`` and ``replay``, made once and held by the plan (a
        caller may keep a weak reference: it lives as long as the plan)."""
        run = self._launches.get((keep_stream, replay))
        if run is None:
            run = self._launches.setdefault((keep_stream, replay),
                                            self.sequence(keep_stream=keep_stream, replay=replay))
        return run

    def launch(self, pointers: Sequence[int], stream: int, workspace: int | None = None,
               scalars: Sequence[Any] = (), keep_stream: bool = False, replay: bool = True) -> None:
        """One launch through this plan's :meth:`own_sequence` (see :meth:`sequence`)."""
        self.own_sequence(keep_stream, replay)(pointers, stream, workspace, True, scalars)

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
        return (config.segments + 1) * (8 if ragged_offset_dtype(config) == "int64" else 4)
    return 4                                            # FP8 scale factors: one float32


def _memset_zero(pointers: list[int], zeroed: tuple[tuple[int, int], ...], stream: int) -> None:
    import cupy

    memset = cupy.cuda.runtime.memsetAsync
    for position, nbytes in zeroed:
        memset(pointers[position], 0, nbytes, stream)
