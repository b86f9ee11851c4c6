"""``vmap`` of the attention primitives: the mapped axis is folded into the batch dimension.

A vmapped call over ``V`` instances of a batch-``B`` problem becomes one call of a batch-``V*B``
problem (one kernel launch, nested ``vmap`` folds level by level).  By operand:

* batch-leading arrays (Q/K/V, O, dO, sequence lengths, offsets, page tables): the mapped axis is moved
  to the front (any ``in_axes``) and merged with ``B``; unbatched ones are broadcast first;
* the bias ``(1|B, 1|N, T, S)``: an unbatched size-1 batch dimension keeps broadcasting; otherwise it is
  tiled to ``V*B``.  In the backward with a bias gradient it is always tiled, so that the kernel
  returns one dbias row per instance and example, which is then summed back over the ``B`` examples
  when the bias broadcast over them - each instance gets its own gradient;
* paged K/V caches: batched caches are concatenated and the page tables shifted by ``v * num_blocks``;
* the packed logsumexp ``(B*M, N, T)``: its rows are the *present* segments of the whole batch,
  left-aligned, so rows are regrouped per instance by each instance's segment count;
* FP8 amax results are statistics of the whole folded batch (as in JAX's cuDNN attention): they are
  returned unbatched;
* an empty mapped axis (size 0) gives empty results of the instance's shapes, and nothing is called.

Operands that are per-head or per-call rather than per-example - a batched attention sink, batched
``score_mod`` arguments, batched FP8 scale factors (the kernel takes one scale per tensor; JAX's own
cuDNN attention refuses them) - and the sink gradient (a sum over the batch that every instance needs
separately) cannot be folded; those calls run the instances one after another with ``lax.map``, one
kernel call per instance and so per scale group (every result, FP8 amax included, is then per instance).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from cudnn_attn.core.config import AttentionConfig, BiasSpec, PagingSpec
from cudnn_attn.core.support import check_everywhere
from cudnn_attn.core.types import FP8_PARAM_KEYS

from .call_site import CallOptions
from .signature import BWD, FP8_BWD_AMAX, FP8_FWD_AMAX, operand_names, result_names, result_shapes

_BATCH_LEADING = ("query", "output", "grad_output", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets",
                  "page_table_k", "page_table_v")
# Per head or per call, shared by the batch: cannot take a vmapped axis.  A batched dropout seed (a vmap over
# keys) runs one call per instance, each with its own seed; a shared one folds, and the folded call's one mask
# differs between the instances' rows (jax_bridge.dropout).
_PER_CALL = ("sink", "dropout_seed", "dropout_offset")


def batch(primitive: Any, args: list[Any], dims: list[int | None], *, config: AttentionConfig,
          options: CallOptions) -> tuple[list[Any], list[int | None]]:
    """The batching rule of ``primitive`` (an :class:`~.primitives.AttentionPrimitive`)."""
    kind = primitive.kind
    names = operand_names(config, kind)
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    operands = {n: a if d is None else jnp.moveaxis(a, d, 0) for n, a, d in zip(names, args, dims)}
    batched = {n for n, d in zip(names, dims) if d is not None}

    check_everywhere(config, kind=kind)                    # e.g. a paged backward: the support table's verdict
    if size == 0:           # vmap over an empty axis: empty results of the instance's shapes; nothing runs
        shapes = result_shapes(config, kind).values()
        return [jnp.zeros((0, *shape), dtype) for shape, dtype in shapes], [0] * len(shapes)
    per_call = (batched & set(_PER_CALL + FP8_PARAM_KEYS)) or any(n.startswith("score_mod_arg_") for n in batched)
    if per_call or (kind == BWD and config.sink):          # the sink gradient sums over the batch
        return _one_by_one(primitive, config, options, operands, batched, size)

    folding = _Fold(config, size, operands, batched, kind)
    results = primitive(folding.config, options, folding.operands)
    return folding.unfold(results)


def _one_by_one(primitive: Any, config: AttentionConfig, options: CallOptions, operands: Mapping[str, Any],
                batched: set[str], size: int) -> tuple[list[Any], list[int]]:
    """The instances in sequence (``lax.map``): every result gets the mapped axis in front."""
    fixed = {n: a for n, a in operands.items() if n not in batched}

    def one(instance: dict[str, Any]) -> dict[str, Any]:
        return primitive(config, options, {**fixed, **instance})

    results = jax.lax.map(one, {n: operands[n] for n in batched})
    names = result_names(config, primitive.kind)          # (a mapped dict comes back in sorted key order)
    return [results[name] for name in names], [0] * len(names)


class _Fold:
    """The folded (batch ``V*B``) call of a vmapped one, and the way back for its results."""

    def __init__(self, config: AttentionConfig, size: int, operands: Mapping[str, Any], batched: set[str],
                 kind: str):
        self.size, self.kind, self.batched, self.instance = size, kind, batched, config
        self.operands = dict(operands)
        changes: dict[str, Any] = {"batch": size * config.batch}
        for name in _BATCH_LEADING + (() if config.paging else ("key", "value")):
            if name in operands:
                self.operands[name] = self._merge(operands[name], name in batched)
        if config.paging is not None:
            changes["paging"] = self._fold_pages(config.paging)
        if config.bias is not None:
            changes["bias"] = self._fold_bias(config.bias)
        if "logsumexp" in operands:
            lse = operands["logsumexp"] if "logsumexp" in batched else self._repeat(operands["logsumexp"])
            self.operands["logsumexp"] = (self._segments_to_batch(lse) if config.packing is not None
                                          else lse.reshape((-1,) + lse.shape[2:]))
        self.config = config.replace(**changes)

    # -- operands ---------------------------------------------------------------------------------
    def _repeat(self, x: Any) -> Any:
        return jnp.broadcast_to(x, (self.size,) + x.shape)

    def _merge(self, x: Any, batched: bool) -> Any:
        x = x if batched else self._repeat(x)
        return x.reshape((-1,) + x.shape[2:])

    def _fold_pages(self, paging: PagingSpec) -> PagingSpec:
        shifts = {}
        for cache, table, field in (("key", "page_table_k", "num_blocks_k"), ("value", "page_table_v", "num_blocks_v")):
            if cache in self.batched:
                blocks = getattr(paging, field)
                self.operands[cache] = self._merge(self.operands[cache], True)
                offsets = (jnp.arange(self.size, dtype=jnp.int32) * blocks)[:, None, None, None, None]
                per_instance = self.operands[table].reshape((self.size, -1) + self.operands[table].shape[1:])
                self.operands[table] = (per_instance + offsets).reshape(self.operands[table].shape)
                shifts[field] = self.size * blocks
        return dataclasses.replace(paging, **shifts)

    def _fold_bias(self, bias: BiasSpec) -> BiasSpec:
        x = self.operands["bias"]
        b, n, t, s = bias.shape
        if "bias" not in self.batched and b == 1 and not (self.kind == BWD and bias.differentiable):
            return bias
        per_instance = x if "bias" in self.batched else self._repeat(x)
        full = jnp.broadcast_to(per_instance, (self.size, self.instance.batch, n, t, s))
        self.operands["bias"] = full.reshape((-1, n, t, s))
        return BiasSpec((self.size * self.instance.batch, n, t, s), bias.differentiable)

    # -- packed logsumexp rows ----------------------------------------------------------------------
    def _segment_counts(self) -> tuple[Any, Any]:
        """Per instance: the number of present segments and the first folded row of its segments."""
        m = self.instance.packing.max_segments
        q, kv = (self.operands[n].reshape(self.size, self.instance.batch, m + 1) for n in ("q_offsets", "kv_offsets"))
        counts = jnp.sum((q[..., :m] >= 0) & (kv[..., :m] >= 0), axis=(1, 2), dtype=jnp.int32)
        return counts, jnp.cumsum(counts) - counts

    def _segments_to_batch(self, lse: Any) -> Any:
        """``(V, B*M, N, T)`` per-instance rows -> ``(V*B*M, N, T)`` rows of the folded call."""
        counts, starts = self._segment_counts()
        rows = lse.shape[1]
        total = self.size * rows
        g = jnp.arange(total, dtype=jnp.int32)
        owner = jnp.clip(jnp.searchsorted(starts + counts, g, side="right"), 0, self.size - 1)
        r = g - starts[owner]
        inside = (g < jnp.sum(counts)) & (r < rows)
        gathered = jnp.take(lse.reshape((total,) + lse.shape[2:]), owner * rows + jnp.clip(r, 0, rows - 1), axis=0)
        return jnp.where(inside[:, None, None], gathered, 0).astype(lse.dtype)

    def _batch_to_segments(self, lse: Any) -> Any:
        """``(V*B*M, N, T)`` rows of the folded call -> ``(V, B*M, N, T)`` per-instance rows."""
        counts, starts = self._segment_counts()
        rows = lse.shape[0] // self.size
        r = jnp.arange(rows, dtype=jnp.int32)[None, :]
        index = jnp.clip(starts[:, None] + r, 0, lse.shape[0] - 1)
        gathered = jnp.take(lse, index.reshape(-1), axis=0).reshape((self.size, rows) + lse.shape[1:])
        return jnp.where((r < counts[:, None])[..., None, None], gathered, 0).astype(lse.dtype)

    # -- results ----------------------------------------------------------------------------------
    def unfold(self, results: Mapping[str, Any]) -> tuple[list[Any], list[int | None]]:
        values, dims = [], []
        for name, x in results.items():
            if name in FP8_FWD_AMAX + FP8_BWD_AMAX:
                values.append(x)
                dims.append(None)                  # a statistic of the whole folded batch
                continue
            if name == "logsumexp" and self.instance.packing is not None:
                x = self._batch_to_segments(x)
            elif name == "dbias":
                x = x.reshape((self.size, -1) + x.shape[1:])
                if self.instance.bias.shape[0] == 1:
                    x = jnp.sum(x, axis=1, keepdims=True, dtype=jnp.float32).astype(x.dtype)
            else:
                x = x.reshape((self.size, -1) + x.shape[1:])
            values.append(x)
            dims.append(0)
        return values, dims
