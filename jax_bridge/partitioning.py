"""Automatic partitioning of the attention primitives (``custom_partitioning`` with Shardy rules).

Attention is independent across the batch and across heads, so those two dimensions shard freely:
each device runs the kernel on its ``B / pb`` examples and ``N / ph`` query heads (with grouped
K/V heads ``K / ph``: the query heads of one K/V head stay together when ``ph`` divides ``K``).
A query whose sequence dimension is sharded runs context-parallel (:mod:`.context_parallel`, the scheme
of the call's ``CallOptions.context``): K/V are split over the same mesh axes and the bias by its rows
(both resharded as needed), the kernel calls go round the ring or over the gathered keys.  The
sequence split follows the query: sharded keys with replicated queries are gathered.  Head-dim sharding
would need a reduction inside the kernel; it is refused with a ``ValueError`` naming the operand and its
sharding.

The Shardy rule names one factor per dimension role of :func:`~.signature.dimension_roles`: ``b``
batch, ``t``/``s`` query/key length, ``n`` query heads (``k*g`` with grouped K/V heads ``k``),
``h``/``e`` head dims, ``m`` segments per row; size-1 and cache dimensions get factors of their own.

Per shard (:func:`partition`) the kernel runs with the local configuration; afterwards

* the bias gradient is summed (``psum``, in float32) over the batch axes when the bias broadcast over the batch,
  and over the head axes when it broadcast over the heads (every shard holds a partial sum);
* the sink gradient (a sum over the batch and the query rows) is summed over the batch axes, and over the
  sequence axes when the sequence is split;
* FP8 amax values are maxima over every shard (``pmax``), the statistic of the whole batch;
* a dropout seed read from the device (a traced key) is made distinct per batch and head shard
  (:func:`~.dropout.for_part` of the shard's index), so shards draw independent masks, not copies of one.

The per-row ``score_max`` is sharded like the logsumexp; the per-head ``max_logit`` is its maximum, taken by
the caller's program outside the primitive, so XLA reduces it across the shards.

Packed segments with batch sharding: every shard runs its ``B / pb`` rows, and its logsumexp block of
``B / pb * M`` rows numbers *that shard's* present segments, left-aligned from the block's first row
(zeros after them).  The global ``(B*M, N, T)`` logsumexp is the concatenation of those blocks in shard
order, so it equals the unsharded numbering when every row holds all ``M`` segments, and otherwise
differs from it by where the zero rows sit.  The backward of the same sharding reads the blocks back the
same way (``jax.grad`` under ``jit`` always does: the residual keeps the forward's sharding); a
logsumexp returned with ``return_residual=True`` from a batch-sharded packed call is that blocked layout.
With the sequence sharded too, the call runs split and its logsumexp has that split call's layout
(:mod:`.context_parallel`: every row's slots in place, each segment at its own query positions).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import ArrayMapping, CompoundFactor, SdyShardingRule
from jax.sharding import NamedSharding, PartitionSpec

from cudnn_attn.core.config import AttentionConfig, BiasSpec

from . import context_parallel, dropout
from .call_site import CallOptions
from .signature import (
    ATTENTION_TENSORS,
    FP8_BWD_AMAX,
    FP8_FWD_AMAX,
    dimension_roles,
    operand_names,
    result_names,
)

_REFUSED_ROLES = {"h": "head", "e": "value head"}


# -- Shardy rule ------------------------------------------------------------------------------------

def _factor(config: AttentionConfig, role: str | None, unique: str) -> Any:
    grouped = config.q_heads != config.kv_heads
    if role is None:
        return unique
    if role == "n":
        return CompoundFactor("k", "g") if grouped else "n"
    if role == "k":
        return "k" if grouped else "n"
    if role == "bm":
        return CompoundFactor("b", "m")
    return role


def sharding_rule(kind: str, config: AttentionConfig, options: CallOptions, mesh: Any, operand_types: Any,
                  result_types: Any) -> SdyShardingRule:
    """The Shardy rule of one call: a named factor per dimension (see the module doc)."""
    del options, mesh

    def mappings(names: tuple[str, ...], types: Any) -> tuple[ArrayMapping, ...]:
        found = []
        for name, value_type in zip(names, types):
            ndim = len(value_type.shape)
            roles = dimension_roles(config, name, ndim)
            found.append(ArrayMapping(*(_factor(config, role, f"{name}_{i}") for i, role in enumerate(roles))))
        return tuple(found)

    operands = mappings(operand_names(config, kind), operand_types)
    results = mappings(result_names(config, kind), result_types)
    standalone = {f for m in operands + results for f in m if isinstance(f, str)}
    sizes = {}
    if "g" not in standalone and config.q_heads != config.kv_heads:
        sizes["g"] = config.q_heads // config.kv_heads
    if config.packing is not None and "m" not in standalone and any(
            isinstance(f, CompoundFactor) and "m" in f for m in operands + results for f in m):
        sizes["m"] = config.packing.max_segments
    return SdyShardingRule(operands, results, **sizes)


# -- the per-shard plan -----------------------------------------------------------------------------

def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entry(axes: tuple[str, ...]) -> Any:
    return None if not axes else axes[0] if len(axes) == 1 else axes


class ShardPlan:
    """How one call is split over ``mesh``: the batch, head and sequence mesh axes, read from the query;
    ``split`` describes the sequence split (``None`` when the sequence stays whole and in its natural order)."""

    def __init__(self, config: AttentionConfig, kind: str, mesh: Any, specs: Mapping[str, tuple],
                 options: CallOptions):
        self.config, self.kind, self.mesh = config, kind, mesh
        roles = dimension_roles(config, "query", 4)
        query = specs["query"]
        self.batch_axes = _axes(query[roles.index("b")])
        self.head_axes = _axes(query[roles.index("n")])
        self.seq_axes = _axes(query[roles.index("t")])
        self._check(specs)
        self.split = _split(config, options, self.seq_axes, self._size(self.seq_axes))
        if self.split is not None:
            context_parallel.check(config, self.split)
        self.local = self._local_config()

    def _size(self, axes: tuple[str, ...]) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    def _check(self, specs: Mapping[str, tuple]) -> None:
        config = self.config
        for name in ATTENTION_TENSORS:
            if name not in specs:
                continue
            for role, entry in zip(dimension_roles(config, name, 4), specs[name]):
                if role in _REFUSED_ROLES and entry is not None:
                    raise ValueError(
                        f"{name}: sharding on the {_REFUSED_ROLES[role]} dimension is not supported "
                        f"(got PartitionSpec{tuple(specs[name])} in {config.layout.name} layout); attention "
                        "can be sharded over the batch, the heads and the sequence - replicate that dimension")
        pb, ph = self._size(self.batch_axes), self._size(self.head_axes)
        rules = [(config.batch % pb, f"batch {config.batch} over {pb} devices {self.batch_axes}"),
                 (config.q_heads % ph, f"query heads {config.q_heads} over {ph} devices {self.head_axes}"),
                 (config.kv_heads % ph, f"key/value heads {config.kv_heads} over {ph} devices {self.head_axes} "
                                        "(grouped heads must stay together)")]
        for remainder, what in rules:
            if remainder:
                raise ValueError(f"query: cannot split {what} evenly; choose a mesh whose axes divide it")

    def _local_config(self) -> AttentionConfig:
        config = self.config
        pb, ph = self._size(self.batch_axes), self._size(self.head_axes)
        changes: dict[str, Any] = dict(batch=config.batch // pb, q_heads=config.q_heads // ph,
                                       kv_heads=config.kv_heads // ph)
        if config.bias is not None:
            b_role, n_role = dimension_roles(config, "bias", 4)[:2]
            b, n, t, s = config.bias.shape
            changes["bias"] = BiasSpec((b // pb if b_role else b, n // ph if n_role else n, t, s),
                                       config.bias.differentiable)
        return config.replace(**changes)      # sequence lengths stay global: context_parallel's contract

    def sharding(self, name: str, ndim: int) -> NamedSharding:
        """Where operand or result ``name`` lives: batch/head dimensions split, the query sequence (and the
        keys of Q/K/V and their gradients) over the sequence axes, the rest replicated."""
        entries = []
        for role in dimension_roles(self.config, name, ndim):
            axes = self.batch_axes if role in ("b", "bm") else self.head_axes if role in ("n", "k") else ()
            if role == "t" or (role == "s" and name in ATTENTION_TENSORS):
                axes = self.seq_axes
            entries.append(_entry(axes))
        return NamedSharding(self.mesh, PartitionSpec(*entries))

    def reduce(self, name: str, x: Any) -> Any:
        """Combine the shards' partial results (module doc)."""
        if name == "dbias":
            b_role, n_role = dimension_roles(self.config, "bias", 4)[:2]
            axes = (() if b_role else self.batch_axes) + (() if n_role else self.head_axes)
            return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype) if axes else x
        if name == "dsink" and (self.batch_axes or self.split is not None):       # a sum over every query row
            return jax.lax.psum(x, self.batch_axes + (self.seq_axes if self.split is not None else ()))
        if name in FP8_FWD_AMAX + FP8_BWD_AMAX and self.batch_axes + self.head_axes:
            return jax.lax.pmax(x, self.batch_axes + self.head_axes)
        return x


def _split(config: AttentionConfig, options: CallOptions, axes: tuple[str, ...],
           shards: int) -> context_parallel.Split | None:
    """The sequence split of a call sharded over ``axes`` (``shards`` devices): ``None`` for a whole
    sequence in its natural order."""
    context = options.context or context_parallel.ContextParallel()
    if shards == 1 and not context.load_balance:
        return None
    return context_parallel.Split(axes if shards > 1 else (), shards, context.load_balance or 0, context.scheme,
                                  context.pieces)


def unsharded_split(config: AttentionConfig, options: CallOptions) -> context_parallel.Split | None:
    """The split of a call that is not partitioned (one device): only a load-balanced order matters."""
    return _split(config, options, (), 1)


def any_sharded(arrays: Any) -> bool:
    """Whether any of ``arrays`` (tracers) has a sharded dimension in its type (Explicit mesh axes)."""
    return any(entry is not None for x in arrays for entry in jax.typeof(x).sharding.spec)


def check_types(config: AttentionConfig, kind: str, avals: Mapping[str, Any],
                options: CallOptions = CallOptions()) -> None:
    """With Explicit mesh axes the operands' shardings are part of their types: check them when the call
    is traced, so that a refused sharding is a ``ValueError`` at the call site (with Auto axes it is
    only known, and refused, when XLA partitions the program)."""
    query = avals["query"]
    mesh = query.sharding.mesh
    if mesh.empty or all(entry is None for aval in avals.values() for entry in aval.sharding.spec):
        return
    specs = {name: tuple(aval.sharding.spec) + (None,) * (aval.ndim - len(aval.sharding.spec))
             for name, aval in avals.items()}
    ShardPlan(config, kind, mesh, specs, options)


def _plan(config: AttentionConfig, kind: str, mesh: Any, arg_infos: Any, options: CallOptions) -> ShardPlan:
    specs = {}
    for name, info in zip(operand_names(config, kind), arg_infos):
        spec = tuple(info.sharding.spec) if isinstance(info.sharding, NamedSharding) else ()
        specs[name] = spec + (None,) * (len(info.shape) - len(spec))
    return ShardPlan(config, kind, mesh, specs, options)


def infer_result_shardings(kind: str, config: AttentionConfig, options: CallOptions, mesh: Any,
                           arg_infos: Any, result_infos: Any) -> list[NamedSharding]:
    """Result shardings from the operands' (GSPMD propagation; Shardy uses :func:`sharding_rule`)."""
    plan = _plan(config, kind, mesh, arg_infos, options)
    return [plan.sharding(name, len(info.shape)) for name, info in zip(result_names(config, kind), result_infos)]


def partition(primitive: Any, config: AttentionConfig, options: CallOptions, mesh: Any, arg_infos: Any,
              result_infos: Any) -> tuple[Any, Any, list[NamedSharding], tuple[NamedSharding, ...]]:
    """The per-shard computation: the kernel on the local configuration, then :meth:`ShardPlan.reduce`."""
    kind = primitive.kind
    plan = _plan(config, kind, mesh, arg_infos, options)
    names, results = operand_names(config, kind), result_names(config, kind)
    arg_shardings = tuple(plan.sharding(name, len(info.shape)) for name, info in zip(names, arg_infos))
    result_shardings = [plan.sharding(name, len(info.shape)) for name, info in zip(results, result_infos)]

    def shard(*arrays: Any) -> list[Any]:
        operands = dict(zip(names, arrays))
        parts = plan.batch_axes + plan.head_axes
        if plan.local.device_seed and parts:        # every shard its own Philox stream (jax_bridge.dropout)
            operands["dropout_seed"] = dropout.for_part(operands["dropout_seed"], jax.lax.axis_index(parts))
        if plan.split is None:
            found = primitive.call_inner(plan.local, options, operands)
        else:
            found = context_parallel.run(kind, plan.local, plan.split, operands,
                                         lambda block, ops: primitive.call_inner(block, options, ops))
        return [plan.reduce(name, x) for name, x in found.items()]

    return mesh, shard, result_shardings, arg_shardings
