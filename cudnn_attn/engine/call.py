"""What one call of a configuration binds and returns, decided once per (configuration, forward/backward).

:meth:`CallSpec.of` is the one derivation of a call's operands and results, read by every front: the CuPy
front (:mod:`cudnn_attn.engine.prepared`), the JAX primitives (abstract evaluation, batching, partitioning,
lowering) and the JAX GPU target.  It depends on the configuration and the kind alone - no device, no array
library - so it is cached per ``(config, kind)``.

* :attr:`CallSpec.operands` - the call's arrays by name, in binding order: the fields of
  :class:`~cudnn_attn.core.config.AttentionOperands` that the configuration uses (``query``, ``bias``,
  ``q_seqlen``, ...), ``score_mod_arg_<i>``, the :class:`~cudnn_attn.core.types.FP8Params` keys a graph
  reads, and for the backward the residuals ``output``, ``grad_output``, ``logsumexp``;
* :attr:`CallSpec.results` - the call's results by name (the fields of
  :class:`~cudnn_attn.core.types.AttentionOutput` / :class:`~cudnn_attn.core.types.AttentionGrads`) with
  their shapes and dtypes, as the caller receives them;
* :attr:`CallSpec.graph_results` - the buffers the cuDNN graph writes (:class:`ResultSpec`: tensor id,
  physical shape, dtype and the **one zero-fill policy**, :class:`Fill`);
* :meth:`CallSpec.bind` - the named arrays as graph tensors (packed segments become cuDNN's ragged batch,
  :mod:`cudnn_attn.graphs.packing`), for any array namespace (``cupy`` or ``jax.numpy``), and
  :meth:`CallSpec.finish`, the after-launch part of the fill policy, from graph buffers to the results.

The zero-fill policy (cuDNN 9.19 on the H200; the library's convention that rows cuDNN does not compute come
back as zeros):

* ``ZERO_BEFORE`` - cuDNN leaves the rows of padded queries (O, dQ) and keys (dK, dV), and the tokens
  outside packed segments, unwritten; it *accumulates* into dbias and dsink.  One ``cudaMemsetAsync`` of
  the buffer before the launch (:class:`~cudnn_attn.engine.plan.CallPlan`).
* ``ROWS_AFTER`` - cuDNN *writes* non-finite values into the logsumexp rows of padded queries, so they are
  set to 0 after the launch (:func:`zero_rows`).
* ``SEGMENTS`` - the packed statistics are token-major; the conversion to the API's ``(B*M, N, T)``
  logsumexp (:func:`cudnn_attn.graphs.packing.lse_from_tokens`) zeroes everything outside a segment.

With ``config.score_max`` the forward graph writes each row's max and sum of exponentials instead of the
logsumexp (cuDNN writes one or the other); :meth:`CallSpec.finish` makes the logsumexp ``max + log(sum_exp)``
and sets ``score_max`` to ``-inf`` on the rows without keys (:func:`~cudnn_attn.core.masked_rows.keyless_score_max`).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Sequence

import ml_dtypes
import numpy as np

from cudnn_attn.core import masked_rows
from cudnn_attn.core.config import AttentionConfig
from cudnn_attn.core.types import FP8_BWD_AMAX, FP8_BWD_KEYS, FP8_FWD_KEYS, Kind
from cudnn_attn.graphs import packing
from cudnn_attn.graphs.tensors import FP8_AMAX_IDS, FP8_SCALE_IDS, TensorId

FWD, BWD = Kind.FORWARD, Kind.BACKWARD
KINDS = tuple(Kind)
RESIDUALS = ("output", "grad_output", "logsumexp")
FP8_FWD_AMAX = ("amax_s", "amax_o")
AMAX_SHAPE = (1, 1, 1, 1)
_F32 = np.dtype(np.float32)


class Fill(enum.Enum):
    """How a graph result's undefined elements become zeros (see the module doc)."""

    NONE = "none"
    ZERO_BEFORE = "zero_before"
    ROWS_AFTER = "rows_after"
    SEGMENTS = "segments"


class ResultSpec(NamedTuple):
    """One buffer a graph writes: its API name, tensor id, physical shape and dtype, fill policy."""

    name: str
    tid: TensorId
    shape: tuple[int, ...]
    dtype: np.dtype
    fill: Fill

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


class Result(NamedTuple):
    """One result as the caller receives it."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


def io_dtype(config: AttentionConfig) -> np.dtype:
    """The NumPy dtype of Q/K/V/O (``ml_dtypes`` for bfloat16 and FP8)."""
    name = config.dtype
    return np.dtype(getattr(ml_dtypes, name) if name.startswith(("bfloat", "float8")) else name)


def score_mod_arg_name(index: int) -> str:
    return f"score_mod_arg_{index}"


# Where each named array goes in the graph (a packed call's lengths and offsets become ragged offsets).
OPERAND_IDS = {"query": TensorId.Q, "key": TensorId.K, "value": TensorId.V, "bias": TensorId.BIAS,
               "sink": TensorId.SINK, "page_table_k": TensorId.PAGE_TABLE_K, "page_table_v": TensorId.PAGE_TABLE_V,
               "q_seqlen": TensorId.SEQ_LEN_Q, "kv_seqlen": TensorId.SEQ_LEN_KV,
               "output": TensorId.O, "grad_output": TensorId.DO, "logsumexp": TensorId.STATS,
               "dropout_seed": TensorId.DEVICE_SEED, "dropout_offset": TensorId.DEVICE_OFFSET, **FP8_SCALE_IDS}
DROPOUT_OPERANDS = ("dropout_seed", "dropout_offset")
"""The operands of a dropout seed read from device memory (``config.device_seed``): 8 bytes each, the int64 seed
and offset of cuDNN's Philox generator (int64 ``(1,)`` CuPy/torch arrays; uint32 ``(2,)`` JAX arrays, the int64's
two words, low first)."""


@dataclass(frozen=True)
class CallSpec:
    """The operands and results of ``config``'s ``kind`` call (see the module doc).  Made by :meth:`of`."""

    config: AttentionConfig
    kind: Kind
    operands: tuple[str, ...]
    results: tuple[Result, ...]
    graph_results: tuple[ResultSpec, ...]
    graph_operands: tuple[TensorId, ...]

    @staticmethod
    @functools.lru_cache(maxsize=1024)
    def of(config: AttentionConfig, kind: str) -> "CallSpec":
        """The spec of ``config``'s ``kind`` call (cached)."""
        if kind not in KINDS:
            raise ValueError(f"kind: must be one of {[str(k) for k in KINDS]}, got {kind!r}")
        kind = Kind(kind)
        graph_results = result_specs(config, kind)
        return CallSpec(config, kind, _operand_names(config, kind), _results(config, kind), graph_results,
                        _graph_operands(config, kind))

    @property
    def result_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.results)

    def result_shapes(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``name -> (shape, dtype)`` of every result."""
        return {r.name: (r.shape, r.dtype) for r in self.results}

    # -- binding and finishing ---------------------------------------------------------------------------
    def bind(self, xp: Any, named: Mapping[str, Any]) -> tuple[dict[TensorId, Any], Any]:
        """The graph's inputs by :class:`TensorId` from the call's named arrays, and the packed segments
        (``None`` unless packed).  Names the graph does not read (``score_mod`` arguments, bound by value on
        the host) are ignored."""
        config, kind = self.config, self.kind
        packed = config.packing is not None
        bound = {OPERAND_IDS[name]: x for name, x in named.items()
                 if name in OPERAND_IDS and x is not None
                 and not (packed and name in ("q_seqlen", "kv_seqlen", "logsumexp"))}
        segments = None
        if packed:
            segments = packing.segments(xp, named["q_seqlen"], named["kv_seqlen"], named["q_offsets"],
                                        named["kv_offsets"], config.q_len, config.kv_len)
            bound.update(packing.cudnn_buffers(xp, config, segments))
            if kind == FWD and not config.training:
                del bound[TensorId.RAGGED_STATS]                 # an inference graph has no statistics
            if kind == BWD:
                bound[TensorId.STATS] = packing.lse_to_tokens(xp, _no_probability(xp, named["logsumexp"]), segments,
                                                              config.batch * config.q_len)
        elif kind == BWD and masked_rows.may_leave_rows_without_keys(config):
            bound[TensorId.STATS] = _no_probability(xp, named["logsumexp"])
        return bound, segments

    def finish(self, xp: Any, buffers: Mapping[str, Any], named: Mapping[str, Any], segments: Any) -> dict[str, Any]:
        """The results by name from the graph's buffers by name, with the after-launch part of the fill policy, and
        the logsumexp of a row without any admissible key set to ``-inf`` (:mod:`cudnn_attn.core.masked_rows`)."""
        results = dict(buffers)
        if self.config.score_max:            # cuDNN wrote the row max and sum of exponentials instead of Stats
            score_max, sum_exp = results.pop("score_max"), results.pop("score_sum_exp")
            if self.config.training:
                results["logsumexp"] = zero_rows(xp, score_max + xp.log(sum_exp), named["q_seqlen"]) \
                    if self.config.mask.padding else score_max + xp.log(sum_exp)
            results["score_max"] = masked_rows.keyless_score_max(xp, self.config, score_max, named.get("q_seqlen"),
                                                                 named.get("kv_seqlen"))
        for spec in self.graph_results:
            if spec.fill is Fill.ROWS_AFTER:
                results[spec.name] = zero_rows(xp, buffers[spec.name], named["q_seqlen"])
            elif spec.fill is Fill.SEGMENTS:
                results[spec.name] = packing.lse_from_tokens(xp, buffers[spec.name], segments, self.config.q_len)
        if "logsumexp" in results and masked_rows.may_leave_rows_without_keys(self.config):
            results["logsumexp"] = masked_rows.keyless_logsumexp(xp, self.config, results["logsumexp"],
                                                                 named.get("q_seqlen"), named.get("kv_seqlen"), segments)
        return results

    def host_scalars(self, seed: int, score_mod_args: Sequence[float] = ()) -> tuple:
        """The pass-by-value host scalars of a launch, in tensor-id order: the dropout seed and offset (0) of a
        static seed (a device seed is an operand: :data:`DROPOUT_OPERANDS`), then the ``score_mod`` arguments."""
        values: tuple = (int(seed), 0) if self.config.has_dropout and not self.config.device_seed else ()
        return values + tuple(float(a) for a in score_mod_args)


def _operand_names(config: AttentionConfig, kind: Kind) -> tuple[str, ...]:
    names = ["query", "key", "value"]
    if config.bias is not None:
        names.append("bias")
    if config.mask.padding:
        names += ["q_seqlen", "kv_seqlen"]
    if config.packing is not None:
        names += ["q_offsets", "kv_offsets"]
    if config.paging is not None:
        names += ["page_table_k", "page_table_v"]
    if config.sink:
        names.append("sink")
    if config.score_mod is not None:
        names += [score_mod_arg_name(i) for i in range(len(config.score_mod.arg_shapes))]
    if config.fp8:
        names += FP8_FWD_KEYS if kind == FWD else FP8_BWD_KEYS
    if config.device_seed:
        names += DROPOUT_OPERANDS
    if kind == BWD:
        names += RESIDUALS
    return tuple(names)


def _results(config: AttentionConfig, kind: Kind) -> tuple[Result, ...]:
    io = io_dtype(config)
    if kind == FWD:
        found = [Result("output", config.o_shape, io)]
        if config.training:
            found.append(Result("logsumexp", config.lse_shape, _F32))
        if config.fp8:
            found += [Result(name, AMAX_SHAPE, _F32) for name in FP8_FWD_AMAX]
        if config.score_max:
            found.append(Result("score_max", config.lse_shape, _F32))
        return tuple(found)
    found = [Result("dq", config.q_shape, io), Result("dk", config.k_shape, io), Result("dv", config.v_shape, io)]
    if config.has_dbias:
        found.append(Result("dbias", tuple(config.bias.shape), io))
    if config.sink:
        found.append(Result("dsink", (config.q_heads,), _F32))
    if config.fp8:
        found += [Result(name, AMAX_SHAPE, _F32) for name in FP8_BWD_AMAX]
    return tuple(found)


def result_specs(config: AttentionConfig, kind: str, *, rng_dump: bool = False) -> tuple[ResultSpec, ...]:
    """The buffers ``config``'s ``kind`` graph writes, sorted by tensor id (the policy is the module doc's)."""
    io = io_dtype(config)
    padded = config.mask.padding
    zero_if_padded = Fill.ZERO_BEFORE if padded else Fill.NONE
    specs = []
    if kind == FWD:
        specs.append(ResultSpec("output", TensorId.O, config.o_shape, io, zero_if_padded))
        if config.score_max:                 # the row statistics as max and sum of exponentials (graphs.builder)
            specs += [ResultSpec("score_max", TensorId.SCORE_MAX, config.lse_shape, _F32, Fill.NONE),
                      ResultSpec("score_sum_exp", TensorId.SCORE_SUM_EXP, config.lse_shape, _F32, Fill.NONE)]
        elif config.training:
            if config.packing is not None:
                specs.append(ResultSpec("logsumexp", TensorId.STATS, (config.batch * config.q_len, config.q_heads),
                                        _F32, Fill.SEGMENTS))
            else:
                specs.append(ResultSpec("logsumexp", TensorId.STATS, config.lse_shape, _F32,
                                        Fill.ROWS_AFTER if padded else Fill.NONE))
        if config.fp8:
            specs += [ResultSpec(name, FP8_AMAX_IDS[name], AMAX_SHAPE, _F32, Fill.NONE) for name in FP8_FWD_AMAX]
    else:
        specs += [ResultSpec("dq", TensorId.DQ, config.q_shape, io, zero_if_padded),
                  ResultSpec("dk", TensorId.DK, config.k_shape, io, zero_if_padded),
                  ResultSpec("dv", TensorId.DV, config.v_shape, io, zero_if_padded)]
        if config.has_dbias:
            specs.append(ResultSpec("dbias", TensorId.DBIAS, tuple(config.bias.shape), io, Fill.ZERO_BEFORE))
        if config.sink:
            specs.append(ResultSpec("dsink", TensorId.DSINK, (config.q_heads,), _F32, Fill.ZERO_BEFORE))
        if config.fp8:
            specs += [ResultSpec(name, FP8_AMAX_IDS[name], AMAX_SHAPE, _F32, Fill.NONE) for name in FP8_BWD_AMAX]
    if rng_dump:
        shape = (config.segments, config.q_heads, config.q_len, config.kv_len)
        specs.append(ResultSpec("rng_dump", TensorId.RNG_DUMP, shape, _F32, Fill.NONE))
    return tuple(sorted(specs, key=lambda spec: spec.tid))


def _graph_operands(config: AttentionConfig, kind: Kind) -> tuple[TensorId, ...]:
    """The device inputs :meth:`CallSpec.bind` gives the graph, sorted (a built graph must read exactly these:
    :class:`~cudnn_attn.engine.plan.CallPlan` checks it once, when it is made)."""
    ids = {OPERAND_IDS[name] for name in _operand_names(config, kind) if name in OPERAND_IDS}
    if config.packing is not None:
        ids |= {TensorId.RAGGED_Q, TensorId.RAGGED_K, TensorId.RAGGED_V, TensorId.RAGGED_O}
        if kind == BWD or config.training:
            ids.add(TensorId.RAGGED_STATS)
    return tuple(sorted(ids))


def _no_probability(xp: Any, lse: Any) -> Any:
    """The backward's logsumexp with the ``-inf`` of a row without keys replaced by
    :data:`~cudnn_attn.core.masked_rows.NO_PROBABILITY_LSE`: ``exp(score - lse)`` is then 0 there, not inf, so the row
    adds nothing to the gradients."""
    return xp.where(lse == -np.inf, xp.full((), masked_rows.NO_PROBABILITY_LSE, dtype=lse.dtype), lse)


def zero_rows(xp: Any, lse: Any, q_seqlen: Any) -> Any:
    """The ``(B, N, T)`` logsumexp with the rows of padded queries (``t >= q_seqlen[b]``) set to 0."""
    rows = xp.arange(lse.shape[-1], dtype=xp.int32)[None, None, :]
    return xp.where(rows < q_seqlen.reshape(-1, 1, 1), lse, xp.zeros((), lse.dtype))
