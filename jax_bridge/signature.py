"""The named operands and results of the two attention primitives, and the role of each of their dimensions.

A primitive binds a flat list of arrays; which arrays, in which order, follows from the
:class:`~cudnn_attn.core.config.AttentionConfig` and the kind (``"fwd"``/``"bwd"``) alone: the call's
:class:`~cudnn_attn.engine.call.CallSpec`, the one derivation every front reads.  This module adds what the
JAX rules need on top: the role of every dimension (batching, partitioning), which result is which operand's
gradient.  The conversion between :class:`~cudnn_attn.core.config.AttentionOperands` and named arrays is
:mod:`cudnn_attn.engine.call_steps`' (one for every front).

Names are the fields of :class:`~cudnn_attn.core.config.AttentionOperands` (``query``, ``bias``, ``q_seqlen``, ...), the FP8Params
keys (``descale_q``, ...), ``score_mod_arg_<i>``, and for the backward the residuals ``output``,
``grad_output``, ``logsumexp``.  Result names are the fields of
:class:`~cudnn_attn.core.types.AttentionOutput` / :class:`~cudnn_attn.core.types.AttentionGrads`.
"""

from __future__ import annotations

import numpy as np

from cudnn_attn.core.config import AttentionConfig
from cudnn_attn.core.types import FP8_BWD_AMAX
from cudnn_attn.engine.call import (  # noqa: F401 (names the bridge's modules import from here)
    AMAX_SHAPE,
    BWD,
    FP8_FWD_AMAX,
    FWD,
    KINDS,
    RESIDUALS,
    CallSpec,
    score_mod_arg_name,
)


def operand_names(config: AttentionConfig, kind: str) -> tuple[str, ...]:
    """The operands of the ``kind`` primitive of ``config``, in binding order (:attr:`CallSpec.operands`)."""
    return CallSpec.of(config, kind).operands


def result_names(config: AttentionConfig, kind: str) -> tuple[str, ...]:
    """The results of the ``kind`` primitive of ``config``, in order (:attr:`CallSpec.results`)."""
    return CallSpec.of(config, kind).result_names


def result_shapes(config: AttentionConfig, kind: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """``name -> (shape, dtype)`` of every result."""
    return CallSpec.of(config, kind).result_shapes()


# -- what each dimension is ---------------------------------------------------------------------------
# Roles: "b" batch, "t" query length, "s" key length, "n" query heads, "k" key/value heads, "h" Q/K head
# dim, "e" V head dim, "m" segments per row, "bm" batch x segments (packed logsumexp rows), None for a
# dimension that is never split (size-1 broadcast dimensions, cache blocks, page-table columns, ...).

Q_LIKE = ("query", "output", "grad_output", "dq")
ATTENTION_TENSORS = Q_LIKE + ("key", "value", "dk", "dv")


def dimension_roles(config: AttentionConfig, name: str, ndim: int) -> tuple[str | None, ...]:
    """The role of every dimension of the operand or result ``name`` (rank ``ndim``)."""
    btnh = config.layout.name == "BTNH"
    if name in Q_LIKE or name in ("key", "value", "dk", "dv"):
        q_like = name in Q_LIKE
        length = "t" if q_like else "s"
        heads = "n" if q_like else "k"
        dim = "e" if name in ("output", "grad_output", "value", "dv") else "h"
        first = "b"
        if not q_like and config.paging is not None:
            first, length = None, None               # a cache of blocks: only its heads split
        return (first, length, heads, dim) if btnh else (first, heads, length, dim)
    if name == "logsumexp":
        return ("bm" if config.packing is not None else "b", "n", "t")
    if name == "score_max":
        return ("b", "n", "t")
    if name in ("bias", "dbias"):
        b, n = config.bias.shape[:2]
        return ("b" if b == config.batch and b > 1 else None, "n" if n == config.q_heads and n > 1 else None,
                "t", "s")
    if name in ("q_seqlen", "kv_seqlen"):
        return ("b", "m") if config.packing is not None else ("b",)
    if name in ("q_offsets", "kv_offsets", "page_table_k", "page_table_v"):
        return ("b",) + (None,) * (ndim - 1)
    if name in ("sink", "dsink"):
        return ("n",)
    return (None,) * ndim                            # FP8 scales and amax, score_mod arguments


# The backward results that are gradients, by the operand they differentiate.
GRADIENT_OF = {"query": "dq", "key": "dk", "value": "dv", "bias": "dbias", "sink": "dsink"}
# The backward result that is each input's cotangent: its gradient, or for an FP8 amax placeholder the
# backward's amax of the same name (JAX's convention).
COTANGENT_OF = {**GRADIENT_OF, **{name: name for name in FP8_BWD_AMAX}}
# Which operand a result takes its shard_map axes and sharding from.
RESULT_FOLLOWS = {"output": "query", "logsumexp": "query", "score_max": "query", **{grad: x for x, grad in GRADIENT_OF.items()}}
