"""One cuDNN graph builder for every attention variant.

``build_graph(config, kind, target)`` turns an :class:`~cudnn_attn.core.config.AttentionConfig` into a
planned cuDNN frontend graph.  Forward and backward (``kind``), FP8 (``config.fp8``: ``sdpa_fp8`` /
``sdpa_fp8_backward``), paged K/V, packed segments, bias, dropout, sink and ``score_mod`` are all
fields of the config read by the same code; the only place the four cuDNN operations differ is the
spelling of a few keyword arguments (:func:`_mask_options`) and the FP8 scale tensors.

Every graph ends with the same finish step (:func:`_plan`): validate -> build the operation graph ->
heuristics ``[A, FALLBACK]`` -> support check -> build plans, restricted to cuDNN's own backend
engines (the frontend's python "FROST" engines are never selected: a library that pins cuDNN's
behaviour must not switch kernel families with an optional pip package).  A refusal by cuDNN is
raised as :class:`~cudnn_attn.core.errors.UnsupportedConfigurationError` carrying cuDNN's message.

Tensors are declared with the caller's strides (BTNH or BNTH, see :mod:`.tensors`) under the stable
uids of :class:`~.tensors.TensorId`; :meth:`BuiltGraph.execute` binds buffers by id.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, NamedTuple

import cudnn
from cudnn.engines.engine_ids import is_python_engine

from cudnn_attn.core.config import AttentionConfig, DiagonalAlignment, ragged_offset_dtype
from cudnn_attn.core.errors import UnsupportedConfigurationError
from cudnn_attn.core.support import check_structure
from cudnn_attn.core.types import FP8_BWD_AMAX, FP8_BWD_KEYS, FP8_FWD_KEYS, Kind

from . import tensors as tt
from .score_mod import score_mod_graph  # lazily: it traces with JAX
from .target import graph_options
from .tensors import TensorId

FWD, BWD = Kind.FORWARD, Kind.BACKWARD
ALL_PLANS = "all"          # ``plan=ALL_PLANS``: build every backend plan (autotuning)

_DT = cudnn.data_type
_IO_TYPES = {
    "float16": _DT.HALF,
    "bfloat16": _DT.BFLOAT16,
    "float8_e4m3fn": _DT.FP8_E4M3,
    "float8_e5m2": _DT.FP8_E5M2,
}
_ALIGNMENT = {
    DiagonalAlignment.TOP_LEFT: cudnn.diagonal_alignment.TOP_LEFT,
    DiagonalAlignment.BOTTOM_RIGHT: cudnn.diagonal_alignment.BOTTOM_RIGHT,
}
_HEURISTICS = [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]


class PlanInfo(NamedTuple):
    """One built execution plan: its index in cuDNN's ranked list, its name and workspace bytes."""
    index: int
    name: str
    workspace_size: int


@dataclass(frozen=True)
class BuiltGraph:
    """A planned cuDNN graph, ready to execute.

    ``uids`` maps every tensor present in the graph to its cuDNN uid; :meth:`execute` needs exactly
    these ids bound.  ``plans`` lists the built plans (one, or every backend plan that built when
    asked for :data:`ALL_PLANS`); ``plan_name`` / ``workspace_size`` describe the selected one and
    ``num_plans`` counts cuDNN's backend candidates.  ``origin`` is ``"built"`` or ``"loaded"``
    (deserialized from the plan store: the graph then holds only its selected plan).
    """

    graph: Any = field(repr=False)
    config: AttentionConfig
    kind: str
    uids: Mapping[TensorId, int] = field(repr=False)
    workspace_size: int
    plan_name: str
    build_seconds: float
    num_plans: int
    plans: tuple[PlanInfo, ...] = field(repr=False)
    origin: str = "built"

    @property
    def host_scalar_ids(self) -> frozenset[TensorId]:
        """Ids bound with the *host* address of a scalar (dropout seed/offset, score_mod arguments)."""
        return frozenset(tid for tid in self.uids if tid in tt.HOST_SCALAR_IDS)

    def execute(self, buffers: Mapping[TensorId, int], workspace: int, handle: Any, *,
                plan_index: int | None = None) -> None:
        """Run the graph on ``handle``'s stream (the frontend's ordered fast path).

        ``buffers`` maps every id of :attr:`uids` to a device pointer, except the ids of
        :attr:`host_scalar_ids`, which take the host address of an int64 (seed, offset) or float32
        (score_mod argument) value kept alive by the caller until the call returns.  ``workspace``
        is a device pointer to at least :attr:`workspace_size` bytes.  ``plan_index`` runs another
        built plan instead of the selected one: the ``index`` of an entry of :attr:`plans` (then
        the workspace must hold that entry's ``workspace_size``).
        """
        if buffers.keys() != self.uids.keys():
            missing = sorted(t.name for t in self.uids.keys() - buffers.keys())
            extra = sorted(getattr(t, "name", str(t)) for t in buffers.keys() - self.uids.keys())
            raise ValueError(
                f"buffers: the {self.kind} graph of {self.config.describe()} binds exactly "
                f"{sorted(t.name for t in self.uids)}; missing {missing}, not in the graph {extra}"
            )
        ids, uids = self._binding_order
        pointers = tuple(int(buffers[t]) for t in ids)
        if plan_index is None:
            self.graph.execute(pointers, workspace, handle=handle, tensor_uids=uids)
        else:
            self.graph.execute_plan_at_index(pointers, workspace, plan_index, handle, tensor_uids=uids)

    @functools.cached_property
    def _binding_order(self) -> tuple[tuple[TensorId, ...], tuple[int, ...]]:
        return tuple(self.uids), tuple(self.uids.values())

    def describe(self) -> str:
        """cuDNN's own JSON description of the graph (for cache dumps and bug reports)."""
        return f"# {self.kind} {self.config.describe()} plan={self.plan_name}\n{self.graph!r}"


# ---------------------------------------------------------------------------------------------------
# Tensor declaration
# ---------------------------------------------------------------------------------------------------
class _Declared:
    """Declares tensors on one pygraph under their :class:`TensorId` uids and records them."""
    def __init__(self, graph: Any):
        self.graph = graph
        self.uids: dict[TensorId, int] = {}

    def input(self, tid: TensorId, layout: tuple, dtype: Any, *, ragged: Any = None) -> Any:
        dims, strides = layout
        self.uids[tid] = int(tid)
        return self.graph.tensor(name=tid.name.lower(), dim=dims, stride=strides, data_type=dtype,
                                 uid=int(tid), ragged_offset=ragged)

    def host_scalar(self, tid: TensorId, dtype: Any) -> Any:
        self.uids[tid] = int(tid)
        return self.graph.tensor(name=tid.name.lower(), dim=tt.SCALAR_DIMS, stride=tt.SCALAR_STRIDES,
                                 data_type=dtype, uid=int(tid), is_pass_by_value=True)

    def output(self, tid: TensorId, tensor: Any, layout: tuple, dtype: Any, *, ragged: Any = None) -> Any:
        dims, strides = layout
        self.uids[tid] = int(tid)
        tensor.set_output(True).set_dim(list(dims)).set_stride(list(strides)).set_data_type(dtype)
        tensor.set_uid(int(tid)).set_name(tid.name.lower())
        if ragged is not None:
            tensor.set_ragged_offset(ragged)
        return tensor

    def scalar_output(self, tid: TensorId, tensor: Any) -> Any:
        return self.output(tid, tensor, (tt.SCALAR_DIMS, tt.SCALAR_STRIDES), _DT.FLOAT)


class _Ragged(NamedTuple):
    """Ragged-offset tensors of a packed graph (all ``None`` when not packed)."""
    q: Any = None
    k: Any = None
    v: Any = None
    o: Any = None
    stats: Any = None


# ---------------------------------------------------------------------------------------------------
# Config -> cuDNN keyword arguments
# ---------------------------------------------------------------------------------------------------
def _check_request(config: AttentionConfig, kind: str) -> None:
    """Argument checks, then the support table's structural rows (:func:`~cudnn_attn.core.support.check_structure`:
    what cuDNN's API cannot express, e.g. a paged backward) - the builder itself refuses nothing."""
    if kind not in (FWD, BWD):
        raise ValueError(f"kind: expected {FWD!r} or {BWD!r}, got {kind!r}")
    if config.dtype not in _IO_TYPES:
        raise ValueError(f"config.dtype: expected one of {sorted(_IO_TYPES)}, got {config.dtype!r}")
    check_structure(config, kind=kind)


def _mask_options(config: AttentionConfig, t: _Declared) -> dict[str, Any]:
    """Masking, lengths, paging, dropout and sink keywords (shared by forward and backward)."""
    mask, fp8 = config.mask, config.fp8
    options: dict[str, Any] = {}
    if config.score_mod is None:        # with score_mod the masks are part of the modification (.score_mod)
        options["diagonal_alignment"] = _ALIGNMENT[mask.alignment]
        if mask.right_bound is not None:
            options["right_bound" if fp8 else "diagonal_band_right_bound"] = mask.right_bound
        if mask.left_bound is not None:
            options["left_bound" if fp8 else "diagonal_band_left_bound"] = mask.left_bound
        if mask.alibi:
            options["use_alibi_mask"] = True
    if mask.padding:                    # packing and paging imply it (AttentionConfig)
        if config.score_mod is None:
            options["use_padding_mask"] = True
        options["seq_len_q"] = t.input(TensorId.SEQ_LEN_Q, tt.seq_len_tensor(config), _DT.INT32)
        options["seq_len_kv"] = t.input(TensorId.SEQ_LEN_KV, tt.seq_len_tensor(config), _DT.INT32)
    if config.paging is not None:
        options["paged_attention_k_table"] = t.input(TensorId.PAGE_TABLE_K, tt.page_table_tensor(config), _DT.INT32)
        options["paged_attention_v_table"] = t.input(TensorId.PAGE_TABLE_V, tt.page_table_tensor(config), _DT.INT32)
        options["paged_attention_max_seq_len_kv"] = config.kv_len
    if config.device_seed:              # read from device memory at launch: a traced key, no new graph per seed
        scalar = (tt.SCALAR_DIMS, tt.SCALAR_STRIDES)
        seed = t.input(TensorId.DEVICE_SEED, scalar, _DT.INT64)
        offset = t.input(TensorId.DEVICE_OFFSET, scalar, _DT.INT64)
        options["dropout"] = (config.dropout_rate, seed, offset)
    elif config.has_dropout:
        seed = t.host_scalar(TensorId.SEED, _DT.INT64)
        offset = t.host_scalar(TensorId.OFFSET, _DT.INT64)
        options["dropout"] = (config.dropout_rate, seed, offset)
    if config.sink:
        options["sink_token"] = t.input(TensorId.SINK, tt.sink_tensor(config), _DT.FLOAT)
    return options


def _score_mod_callbacks(config: AttentionConfig, kind: str, t: _Declared,
                         options: dict[str, Any]) -> tuple[Any, Any]:
    """``(forward, bprop)`` callbacks from ``cudnn_attn.graphs.score_mod`` over by-value argument tensors.

    The translation may take the bias out of ``options`` (it adds it inside the modification) and reads
    the sequence lengths ``_mask_options`` declared (for padding inside the modification).
    """

    wiring = score_mod_graph(config, kind)
    args = tuple(t.host_scalar(tid, _DT.FLOAT) for tid in tt.SCORE_MOD_ARG_IDS[:wiring.num_args])
    bias = options.pop("bias") if wiring.takes_bias else None
    return wiring.callbacks(args, bias=bias, seq_len_q=options.get("seq_len_q"),
                            seq_len_kv=options.get("seq_len_kv"))


def _ragged(config: AttentionConfig, t: _Declared, *, stats: bool) -> _Ragged:
    """The ragged-offset tensors of a packed graph (the statistics' one only where they are present)."""
    if config.packing is None:
        return _Ragged()
    dtype = _DT.INT64 if ragged_offset_dtype(config) == "int64" else _DT.INT32
    layout = tt.ragged_offset_tensor(config)
    ids = [TensorId.RAGGED_Q, TensorId.RAGGED_K, TensorId.RAGGED_V, TensorId.RAGGED_O]
    return _Ragged(*(t.input(tid, layout, dtype) for tid in ids + [TensorId.RAGGED_STATS] * stats))


def _fp8_scales(t: _Declared, names: tuple[str, ...]) -> dict[str, Any]:
    layout = (tt.SCALAR_DIMS, tt.SCALAR_STRIDES)
    return {name: t.input(tt.FP8_SCALE_IDS[name], layout, _DT.FLOAT) for name in names}


# ---------------------------------------------------------------------------------------------------
# Forward and backward operations
# ---------------------------------------------------------------------------------------------------
def _forward(config: AttentionConfig, t: _Declared, io: Any, rng_dump: bool) -> None:
    ragged = _ragged(config, t, stats=config.training)
    q = t.input(TensorId.Q, tt.q_tensor(config), io, ragged=ragged.q)
    k = t.input(TensorId.K, tt.k_tensor(config), io, ragged=ragged.k)
    v = t.input(TensorId.V, tt.v_tensor(config), io, ragged=ragged.v)
    options = _mask_options(config, t)
    options.update(attn_scale=config.scale, generate_stats=config.training, name="attention")
    if config.bias is not None:
        options["bias"] = t.input(TensorId.BIAS, tt.bias_tensor(config), io)
    if rng_dump:
        options["rng_dump"] = t.input(TensorId.RNG_DUMP, tt.rng_dump_tensor(config), _DT.FLOAT)
    if config.score_max:
        # Outputs cuDNN takes as keywords, like rng_dump.  Its softmax writes the row max with the row sum of
        # exponentials, or the logsumexp, never both (CompositeSoftmaxNode): the logsumexp of a training call is
        # then max + log(sum_exp), computed after the launch (engine.call.CallSpec.finish).
        layout = tt.stats_tensor(config.segments, config.q_heads, config.q_len, ragged=False)
        options["score_max"] = t.input(TensorId.SCORE_MAX, layout, _DT.FLOAT)
        options["score_sum_exp"] = t.input(TensorId.SCORE_SUM_EXP, layout, _DT.FLOAT)
        options["generate_stats"] = False
    if config.score_mod is not None:
        options["fn" if config.fp8 else "score_mod"] = _score_mod_callbacks(config, FWD, t, options)[0]

    if config.fp8:
        o, stats, amax_s, amax_o = t.graph.sdpa_fp8(q=q, k=k, v=v, **_fp8_scales(t, FP8_FWD_KEYS), **options)
        t.scalar_output(TensorId.AMAX_S, amax_s)
        t.scalar_output(TensorId.AMAX_O, amax_o)
    else:
        o, stats = t.graph.sdpa(q=q, k=k, v=v, **options)
    t.output(TensorId.O, o, tt.o_tensor(config), io, ragged=ragged.o)
    if config.training and not config.score_max:
        stats_layout = tt.stats_tensor(config.segments, config.q_heads, config.q_len, ragged=ragged.stats is not None)
        t.output(TensorId.STATS, stats, stats_layout, _DT.FLOAT, ragged=ragged.stats)


def _backward(config: AttentionConfig, t: _Declared, io: Any, rng_dump: bool) -> None:
    ragged = _ragged(config, t, stats=True)
    q = t.input(TensorId.Q, tt.q_tensor(config), io, ragged=ragged.q)
    k = t.input(TensorId.K, tt.k_tensor(config), io, ragged=ragged.k)
    v = t.input(TensorId.V, tt.v_tensor(config), io, ragged=ragged.v)
    o = t.input(TensorId.O, tt.o_tensor(config), io, ragged=ragged.o)
    d_o = t.input(TensorId.DO, tt.o_tensor(config), io, ragged=ragged.o)
    stats_layout = tt.stats_tensor(config.segments, config.q_heads, config.q_len, ragged=ragged.stats is not None)
    stats = t.input(TensorId.STATS, stats_layout, _DT.FLOAT, ragged=ragged.stats)
    options = _mask_options(config, t)
    options.update(attn_scale=config.scale, use_deterministic_algorithm=config.deterministic, name="attention_bwd")
    if config.packing is not None:         # bounds cuDNN's fp32 dQ accumulator to the packed token count
        options.update(max_total_seq_len_q=config.batch * config.q_len,
                       max_total_seq_len_kv=config.batch * config.kv_len)
    if config.sink:
        options["dSink_token"] = t.input(TensorId.DSINK, tt.sink_tensor(config), _DT.FLOAT)
    if config.bias is not None:
        options["bias"] = t.input(TensorId.BIAS, tt.bias_tensor(config), io)
        if config.has_dbias:
            options["dBias"] = t.input(TensorId.DBIAS, tt.bias_tensor(config), io)
    if rng_dump:
        options["rng_dump"] = t.input(TensorId.RNG_DUMP, tt.rng_dump_tensor(config), _DT.FLOAT)
    if config.score_mod is not None:
        options["score_mod"], options["score_mod_bprop"] = _score_mod_callbacks(config, BWD, t, options)

    if config.fp8:
        dq, dk, dv, *amaxes = t.graph.sdpa_fp8_backward(
            q=q, k=k, v=v, o=o, dO=d_o, stats=stats, **_fp8_scales(t, FP8_BWD_KEYS), **options)
        for name, amax in zip(FP8_BWD_AMAX, amaxes, strict=True):       # cuDNN returns them in this order
            t.scalar_output(tt.FP8_AMAX_IDS[name], amax)
    else:
        dq, dk, dv = t.graph.sdpa_backward(q=q, k=k, v=v, o=o, dO=d_o, stats=stats, **options)
    dense = config.replace(strides=None)              # results are dense, whatever the inputs' strides
    t.output(TensorId.DQ, dq, tt.q_tensor(dense), io, ragged=ragged.q)
    t.output(TensorId.DK, dk, tt.k_tensor(dense), io, ragged=ragged.k)
    t.output(TensorId.DV, dv, tt.v_tensor(dense), io, ragged=ragged.v)


# ---------------------------------------------------------------------------------------------------
# The shared finish step
# ---------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _cudnn_refusals(config: AttentionConfig) -> Iterator[None]:
    """cuDNN's "not supported" -> UnsupportedConfigurationError; its ill-formed-graph -> ValueError.

    Anything else cuDNN raises (``RuntimeError``: a CUDA or handle failure) is a real error and propagates.
    """
    try:
        yield
    except UnsupportedConfigurationError:
        raise
    except (cudnn.cudnnGraphNotSupportedError, NotImplementedError) as e:
        raise UnsupportedConfigurationError(
            ["cuDNN does not support this attention graph on this GPU"], config, cudnn_message=str(e)) from e
    except ValueError as e:
        raise ValueError(f"config: cuDNN rejected the graph of {config.describe()}: {e}") from e


def _plan(graph: Any, config: AttentionConfig, plan: str | None) -> tuple[list[PlanInfo], int]:
    """validate -> operation graph -> heuristics -> support check -> build plan(s), backend engines only.

    The ranked list may hold the frontend's python (FROST) engines next to cuDNN's backend plans; only
    backend entries are ever selected or built (``build_plan_at_index`` walks them in rank order, which
    is also how :data:`ALL_PLANS` builds every one of them for autotuning).  Returns the built plans
    (rank order; the first one is selected) and the number of backend candidates.
    """
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans(_HEURISTICS)
    candidates = [i for i, entry in enumerate(graph.plans) if not is_python_engine(entry.engine_id)]
    count = len(candidates)
    if not candidates:
        raise UnsupportedConfigurationError(
            ["cuDNN's backend proposed no execution plan"], config,
            cudnn_message="only python (FROST) engines are candidates: "
                          + ", ".join(graph.get_plan_name_at_index(i) for i in range(len(graph.plans))))
    if plan not in (None, ALL_PLANS):
        named = [i for i in candidates if graph.get_plan_name_at_index(i) == plan]
        if not named:
            names = [graph.get_plan_name_at_index(i) for i in candidates]
            raise UnsupportedConfigurationError([f"plan {plan!r} is not among cuDNN's candidates {names}"], config)
        candidates = named
    graph.select_plan(candidates[0])
    graph.check_support()
    built, failures = [], []
    for index in candidates:
        try:
            graph.build_plan_at_index(index)
        except (cudnn.cudnnGraphNotSupportedError, NotImplementedError) as e:
            failures.append(f"{graph.get_plan_name_at_index(index)}: {e}")
            continue
        built.append(PlanInfo(index, graph.get_plan_name_at_index(index), graph.get_workspace_size()))
        if plan != ALL_PLANS:
            break
    if not built:
        raise UnsupportedConfigurationError(
            ["no cuDNN execution plan could be built"], config, cudnn_message="\n".join(failures))
    if built[-1].index != built[0].index:
        graph.build_plan_at_index(built[0].index)      # re-select the best-ranked plan that built
    if graph.selected_engine is not None:
        raise RuntimeError(f"cuDNN selected the python engine {graph.selected_engine.name}; expected a backend plan")
    return built, count


class DeclaredGraph(NamedTuple):
    """An attention graph declared but not planned: the pygraph and the uids of its tensors."""
    graph: Any
    uids: dict[TensorId, int]


def declare_graph(config: AttentionConfig, kind: str, target: Any = None, *,
                  rng_dump: bool = False) -> DeclaredGraph:
    """Declare (without planning) the cuDNN graph of ``config``'s forward or backward.

    With ``target=None`` the graph has no planning target: only its frontend-side ``validate()``
    can run, which needs neither a GPU nor the cuDNN library.  Arguments and errors as
    :func:`build_graph`.
    """
    _check_request(config, kind)
    options = graph_options(target) if target is not None else {}
    io = _IO_TYPES[config.dtype]
    graph = cudnn.pygraph(name=f"cudnn_attn_{kind}", io_data_type=io, intermediate_data_type=_DT.FLOAT,
                          compute_data_type=_DT.FLOAT, **options)
    declared = _Declared(graph)
    with _cudnn_refusals(config):
        (_forward if kind == FWD else _backward)(config, declared, io, rng_dump)
    return DeclaredGraph(graph, dict(sorted(declared.uids.items())))


def build_graph(config: AttentionConfig, kind: str, target: Any, *, rng_dump: bool = False,
                plan: str | None = None) -> BuiltGraph:
    """Build and plan the cuDNN graph of ``config``'s forward (``kind="fwd"``) or backward (``"bwd"``).

    Args:
        config: the static description of the call.
        kind: ``"fwd"`` or ``"bwd"``.
        target: a ``cudnn.Handle`` (plans for its GPU) or a :class:`~.target.DevicelessTarget`.
        rng_dump: also write cuDNN's dropout keep-mask, float32 ``(B, N, T, S)``, to ``RNG_DUMP``.
        plan: ``None`` (cuDNN's best-ranked backend plan that builds), :data:`ALL_PLANS` (build every
            backend plan, for autotuning) or a plan name from an earlier build (``"eng2_k24=7"``).

    Raises:
        ValueError: ``kind``/``plan``/``target`` are malformed, or cuDNN finds the graph ill-formed.
        UnsupportedConfigurationError: cuDNN (or a structural rule of its API) refuses the graph.
    """
    if plan is not None and not isinstance(plan, str):
        raise ValueError(f"plan: expected None, ALL_PLANS or a plan name such as 'eng2_k24=7', got {plan!r}")
    if target is None:
        raise ValueError("target: building plans needs a cudnn.Handle or a DevicelessTarget, got None")
    start = time.perf_counter()
    graph, uids = declare_graph(config, kind, target, rng_dump=rng_dump)
    with _cudnn_refusals(config):
        built, candidates = _plan(graph, config, plan)
    return BuiltGraph(
        graph=graph, config=config, kind=kind, uids=uids, workspace_size=built[0].workspace_size,
        plan_name=built[0].name, build_seconds=time.perf_counter() - start, num_plans=candidates,
        plans=tuple(built), origin="built",
    )
