"""Attention configurations for the deviceless tier, by readable name.

``config(**changes)`` starts from a small fp16 BTNH training call (B=2, N=4, T=S=128, d=64) so each row
states only what it is about.
"""

from __future__ import annotations

import math
from typing import Any

from cudnn_attn.core.config import (
    AttentionConfig,
    BiasSpec,
    DiagonalAlignment,
    PackingSpec,
    PagingSpec,
    StaticMask,
)
from cudnn_attn.core.score_mod_spec import score_mod_spec
from cudnn_attn.core.types import AttentionLayout

B, N, T, S, D = 2, 4, 128, 128, 64

BTNH, BNTH = AttentionLayout.BTNH, AttentionLayout.BNTH
BOTTOM_RIGHT = DiagonalAlignment.BOTTOM_RIGHT
CAUSAL = StaticMask(right_bound=0)
PADDING = StaticMask(padding=True)
PADDING_CAUSAL = StaticMask(right_bound=0, padding=True)
BR_PADDING_CAUSAL = StaticMask(right_bound=0, padding=True, alignment=BOTTOM_RIGHT)   # what paged decoding uses


def config(**changes: Any) -> AttentionConfig:
    """The base call with ``changes``; ``d`` sets both head dims, ``heads`` both head counts."""
    d = changes.pop("d", D)
    heads = changes.pop("heads", N)
    fields = dict(batch=B, q_heads=heads, kv_heads=heads, q_len=T, kv_len=S, qk_dim=d, v_dim=d,
                  dtype="float16", scale=1 / math.sqrt(d), training=True)
    fields.update(changes)
    return AttentionConfig(**fields)


def fp8(**changes: Any) -> AttentionConfig:
    """An FP8 (E4M3 unless ``dtype`` says otherwise) call with head dim 128 unless ``d`` says otherwise."""
    changes.setdefault("d", 128)
    changes.setdefault("dtype", "float8_e4m3fn")
    return config(**changes)


def bias(shape: tuple[int, int, int, int], differentiable: bool = True) -> BiasSpec:
    return BiasSpec(shape=shape, differentiable=differentiable)


def packed(segments: int = 3) -> PackingSpec:
    return PackingSpec(max_segments=segments)


def paged(block_size: int = 32, kv_len: int = S) -> PagingSpec:
    blocks_per_seq = kv_len // block_size
    return PagingSpec(num_blocks_k=B * blocks_per_seq, num_blocks_v=B * blocks_per_seq,
                      block_size=block_size, blocks_per_seq=blocks_per_seq)



def softcap(score, cap):
    """A ``score_mod``: ``cap * tanh(score / cap)`` (jax.numpy; module level so the worker can unpickle it)."""
    import jax.numpy as jnp
    return cap * jnp.tanh(score / cap)


SOFTCAP = score_mod_spec(softcap, (B, N, T, S), (((), "float32"),))
