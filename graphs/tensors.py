"""Stable tensor ids and the logical dims/strides cuDNN sees for every attention tensor.

Every tensor of every attention graph has one :class:`TensorId`; its integer value *is* the cuDNN
uid, the same in the forward, backward, FP8 and paged graphs.  Callers bind buffers by id, so no
layer ever depends on the order in which the builder declared the tensors.

cuDNN always sees logical ``(batch, heads, length, head_dim)`` tensors; the layout only changes the
strides (no transposes are ever materialised):

* BTNH buffer ``(B, T, N, H)`` -> strides ``(T*N*H, H, N*H, 1)``
* BNTH buffer ``(B, N, T, H)`` -> strides ``(N*T*H, T*H, H, 1)``

Softmax statistics (the logsumexp) are ``(B, N, T, 1)`` float32 with stride ``(N*T, T, 1, 1)``, the
same bytes as the ``(B, N, T)`` logsumexp the API returns.  Packed (ragged) statistics are token-major
``(B*M, N, T, 1)`` with stride ``(T*N, 1, N, 1)`` plus a ragged offset: the buffer is indexed by the
packed token position, ``(B, T, N)`` (see :mod:`cudnn_attn.graphs.packing` for the conversion to the
``(B*M, N, T)`` logsumexp of the API).
"""

from __future__ import annotations

import enum

from cudnn_attn.core.config import AttentionConfig
from cudnn_attn.core.types import AttentionLayout

Dims = tuple[int, int, int, int]


class TensorId(enum.IntEnum):
    """One id per attention tensor; the value is the cuDNN uid.  Values never change."""

    # Operands and results of the forward.
    Q = 1
    K = 2
    V = 3
    O = 4
    STATS = 5
    BIAS = 6
    SINK = 7
    RNG_DUMP = 8
    # Backward.
    DO = 10
    DQ = 11
    DK = 12
    DV = 13
    DBIAS = 14
    DSINK = 15
    # Sequence lengths and packed-segment (ragged) element offsets.  The backward's dO/dQ/dK/dV
    # share the offsets of O/Q/K/V: they have the same shapes.
    SEQ_LEN_Q = 20
    SEQ_LEN_KV = 21
    RAGGED_Q = 22
    RAGGED_K = 23
    RAGGED_V = 24
    RAGGED_O = 25
    RAGGED_STATS = 26
    # Paged K/V.
    PAGE_TABLE_K = 30
    PAGE_TABLE_V = 31
    # Dropout: pass-by-value host scalars (a static seed), or int64 (1, 1, 1, 1) device tensors (a traced key).
    SEED = 40
    OFFSET = 41
    DEVICE_SEED = 42
    DEVICE_OFFSET = 43
    # FP8 scaling factors (float32 (1, 1, 1, 1) device tensors) and amax outputs.
    DESCALE_Q = 50
    DESCALE_K = 51
    DESCALE_V = 52
    DESCALE_S = 53
    SCALE_S = 54
    SCALE_O = 55
    DESCALE_O = 56
    DESCALE_DO = 57
    DESCALE_DP = 58
    SCALE_DQ = 59
    SCALE_DK = 60
    SCALE_DV = 61
    SCALE_DP = 62
    AMAX_S = 70
    AMAX_O = 71
    AMAX_DQ = 72
    AMAX_DK = 73
    AMAX_DV = 74
    AMAX_DP = 75
    # score_mod arguments (pass-by-value float32 host scalars), in the order of the call.
    SCORE_MOD_ARG_0 = 80
    SCORE_MOD_ARG_1 = 81
    SCORE_MOD_ARG_2 = 82
    SCORE_MOD_ARG_3 = 83
    SCORE_MOD_ARG_4 = 84
    SCORE_MOD_ARG_5 = 85
    SCORE_MOD_ARG_6 = 86
    SCORE_MOD_ARG_7 = 87
    # The softmax's row statistics as two outputs (cuDNN writes either these or STATS, never both): the max of
    # each row's scaled scores and the sum of exp(score - max).
    SCORE_MAX = 90
    SCORE_SUM_EXP = 91


SCORE_MOD_ARG_IDS = tuple(TensorId(TensorId.SCORE_MOD_ARG_0 + i) for i in range(8))

# FP8Params key -> the tensor that receives it (scales in) and the amax outputs (out).
FP8_SCALE_IDS = {
    "descale_q": TensorId.DESCALE_Q,
    "descale_k": TensorId.DESCALE_K,
    "descale_v": TensorId.DESCALE_V,
    "descale_s": TensorId.DESCALE_S,
    "scale_s": TensorId.SCALE_S,
    "scale_o": TensorId.SCALE_O,
    "descale_o": TensorId.DESCALE_O,
    "descale_dO": TensorId.DESCALE_DO,
    "descale_dP": TensorId.DESCALE_DP,
    "scale_dQ": TensorId.SCALE_DQ,
    "scale_dK": TensorId.SCALE_DK,
    "scale_dV": TensorId.SCALE_DV,
    "scale_dP": TensorId.SCALE_DP,
}
FP8_AMAX_IDS = {
    "amax_s": TensorId.AMAX_S,
    "amax_o": TensorId.AMAX_O,
    "amax_dQ": TensorId.AMAX_DQ,
    "amax_dK": TensorId.AMAX_DK,
    "amax_dV": TensorId.AMAX_DV,
    "amax_dP": TensorId.AMAX_DP,
}

# Ids bound with the HOST address of a scalar (pass-by-value), not a device pointer.
HOST_SCALAR_IDS = frozenset({TensorId.SEED, TensorId.OFFSET, *SCORE_MOD_ARG_IDS})

SCALAR_DIMS: Dims = (1, 1, 1, 1)
SCALAR_STRIDES: Dims = (1, 1, 1, 1)


def contiguous_strides(dims: Dims) -> Dims:
    """Row-major strides of ``dims``."""
    strides, step = [], 1
    for d in reversed(dims):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def attention_tensor(layout: AttentionLayout, batch: int, heads: int, length: int, dim: int) -> tuple[Dims, Dims]:
    """Logical ``(batch, heads, length, dim)`` dims and the strides of a buffer in ``layout``."""
    dims = (batch, heads, length, dim)
    if layout is AttentionLayout.BTNH:
        return dims, (length * heads * dim, dim, heads * dim, 1)
    return dims, (heads * length * dim, length * dim, dim, 1)


def stats_tensor(batch: int, heads: int, q_len: int, *, ragged: bool) -> tuple[Dims, Dims]:
    """Softmax statistics: head-major when dense, token-major when ragged (see the module doc)."""
    dims = (batch, heads, q_len, 1)
    if ragged:
        return dims, (q_len * heads, 1, heads, 1)
    return dims, (heads * q_len, q_len, 1, 1)


def _given(config: AttentionConfig, name: str, dense: tuple[Dims, Dims]) -> tuple[Dims, Dims]:
    """``dense`` (logical dims and the layout's strides), or the caller's strides of ``name`` where the configuration
    has them (:class:`~cudnn_attn.core.config.InputStrides`, physical order), in logical ``(b, h, s, d)`` order."""
    given = getattr(config.strides, name, None) if config.strides is not None else None
    if given is None:
        return dense
    if config.layout is AttentionLayout.BTNH:
        return dense[0], (given[0], given[2], given[1], given[3])
    return dense[0], tuple(given)


def q_tensor(config: AttentionConfig) -> tuple[Dims, Dims]:
    return _given(config, "query", attention_tensor(config.layout, config.segments, config.q_heads, config.q_len,
                                                    config.qk_dim))


def o_tensor(config: AttentionConfig) -> tuple[Dims, Dims]:
    return attention_tensor(config.layout, config.segments, config.q_heads, config.q_len, config.v_dim)


def k_tensor(config: AttentionConfig) -> tuple[Dims, Dims]:
    """K; a paged cache is a container of ``num_blocks_k`` blocks of ``block_size`` tokens."""
    if config.paging is not None:
        p = config.paging
        return attention_tensor(config.layout, p.num_blocks_k, config.kv_heads, p.block_size, config.qk_dim)
    return _given(config, "key", attention_tensor(config.layout, config.segments, config.kv_heads, config.kv_len,
                                                  config.qk_dim))


def v_tensor(config: AttentionConfig) -> tuple[Dims, Dims]:
    """V; a paged cache is a container of ``num_blocks_v`` blocks of ``block_size`` tokens."""
    if config.paging is not None:
        p = config.paging
        return attention_tensor(config.layout, p.num_blocks_v, config.kv_heads, p.block_size, config.v_dim)
    return _given(config, "value", attention_tensor(config.layout, config.segments, config.kv_heads, config.kv_len,
                                                    config.v_dim))


def bias_tensor(config: AttentionConfig) -> tuple[Dims, Dims]:
    dims = tuple(config.bias.shape)
    return dims, contiguous_strides(dims)


def sink_tensor(config: AttentionConfig) -> tuple[Dims, Dims]:
    return (1, config.q_heads, 1, 1), (config.q_heads, 1, 1, 1)


def seq_len_tensor(config: AttentionConfig) -> tuple[Dims, Dims]:
    return (config.segments, 1, 1, 1), SCALAR_STRIDES


def ragged_offset_tensor(config: AttentionConfig) -> tuple[Dims, Dims]:
    return (config.segments + 1, 1, 1, 1), SCALAR_STRIDES


def page_table_tensor(config: AttentionConfig) -> tuple[Dims, Dims]:
    n = config.paging.blocks_per_seq
    return (config.batch, 1, n, 1), (n, n, 1, 1)


def rng_dump_tensor(config: AttentionConfig) -> tuple[Dims, Dims]:
    dims = (config.segments, config.q_heads, config.q_len, config.kv_len)
    return dims, contiguous_strides(dims)
