"""Which scores survive, and the built-in additive terms: mask, ALiBi and dropout.

All positions are counted inside a segment (see :mod:`.segments`): query ``i`` and key ``j`` of the
same segment, with the diagonal offset ``delta = 0`` (TOP_LEFT) or ``kv_len - q_len`` of the segment
(BOTTOM_RIGHT).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cudnn_attn.core.config import AttentionConfig, DiagonalAlignment

from .segments import SegmentTable


def allowed(config: AttentionConfig, segments: SegmentTable) -> np.ndarray:
    """``(B, 1, T, S)`` bool: key ``j`` is admissible for query ``i``.

    With ``d = j - i - delta``: both tokens lie in the same segment, and ``d <= right_bound`` (when
    set; 0 is causal) and ``-d < left_bound`` (when set: a window of ``left_bound`` keys ending at the
    diagonal), exactly the :class:`~cudnn_attn.core.config.StaticMask` rule.
    """
    mask = config.mask
    same = (segments.q_segment[:, :, None] == segments.kv_segment[:, None, :]) & segments.valid_q[:, :, None]
    if mask.alignment is DiagonalAlignment.BOTTOM_RIGHT:
        delta = (segments.kv_len - segments.q_len)[np.maximum(segments.q_segment, 0)]       # (B, T)
    else:
        delta = np.zeros_like(segments.q_pos)
    d = segments.kv_pos[:, None, :] - segments.q_pos[:, :, None] - delta[:, :, None]   # (B, T, S)
    keep = same
    if mask.right_bound is not None:
        keep = keep & (d <= mask.right_bound)
    if mask.left_bound is not None:
        keep = keep & (-d < mask.left_bound)
    return keep[:, None]


def alibi_slopes(num_heads: int) -> np.ndarray:
    """cuDNN's ALiBi slopes, float64 ``(num_heads,)``.

    With ``n`` the largest power of two ``<= num_heads``: ``m_h = 2^(-8h/n)`` for ``h = 1..n``; the
    remaining ``num_heads - n`` heads take the odd-numbered slopes of ``2n`` heads,
    ``2^(-4h/n)`` for ``h = 1, 3, 5, ...`` (appended after the first ``n``), as in the ALiBi paper's
    code and cuDNN's ``fp16_ref.py``.
    """
    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = 2.0 ** (-8.0 * np.arange(1, n + 1) / n)
    extra = 2.0 ** (-4.0 * np.arange(1, 2 * (num_heads - n), 2) / n)
    return np.concatenate([slopes, extra])


def alibi_bias(config: AttentionConfig, segments: SegmentTable) -> np.ndarray:
    """``(B, N, T, S)`` ALiBi bias ``m_h * (j - i)`` (positions inside the segment; no diagonal offset)."""
    relative = segments.kv_pos[:, None, :] - segments.q_pos[:, :, None]                   # (B, T, S)
    return alibi_slopes(config.q_heads)[None, :, None, None] * relative[:, None]


def dropout_entropy(config: AttentionConfig, operands: Any, seed: int) -> int | list[int]:
    """What seeds the NumPy dropout mask: the static ``seed``, or with ``config.device_seed`` the int64 seed
    and offset in ``operands.dropout_seed``/``dropout_offset`` (8 bytes each, read as unsigned): the same
    operands draw the same mask, others another."""
    if not config.device_seed:
        return seed
    return [int(np.frombuffer(np.ascontiguousarray(np.asarray(x)).tobytes()[:8], np.uint64)[0])
            for x in (operands.dropout_seed, operands.dropout_offset)]


def dropout_keep(config: AttentionConfig, seed: int | list[int],
                 dropout_mask: np.ndarray | None) -> np.ndarray | None:
    """The ``(B, N, T, S)`` float64 keep-mask of dropout (1 keeps), or ``None`` without dropout.

    ``dropout_mask`` (nonzero keeps; e.g. cuDNN's ``rng_dump``) is used when given; otherwise the mask
    is drawn as ``numpy.random.default_rng(seed).random((B, N, T, S)) >= dropout_rate``.  That is *not*
    cuDNN's Philox stream: to compare with the GPU, pass the GPU's mask.

    Raises:
        ValueError: a ``dropout_mask`` of the wrong shape, or one given without a dropout rate.
    """
    shape = (config.batch, config.q_heads, config.q_len, config.kv_len)
    if not config.has_dropout:
        if dropout_mask is not None:
            raise ValueError(f"dropout_mask: given, but dropout_rate is 0 ({config.describe()})")
        return None
    if dropout_mask is None:
        return (np.random.default_rng(seed).random(shape) >= config.dropout_rate).astype(np.float64)
    dropout_mask = np.asarray(dropout_mask)
    if dropout_mask.shape != shape:
        raise ValueError(f"dropout_mask: must have shape (B, N, T, S) = {shape}, got {dropout_mask.shape}")
    return (dropout_mask != 0).astype(np.float64)
