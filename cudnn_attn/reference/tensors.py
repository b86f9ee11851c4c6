"""Conversions between the caller's arrays and the reference's logical float64 tensors.

Inside the reference every Q/K/V-like tensor is *logical* ``(B, heads, length, dim)`` float64,
whatever the call's layout; these helpers read the caller's arrays into that form (layout
transpose, paged-cache gather, FP8 scalars) and write results back (layout, io dtype, FP8
quantisation).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 names with NumPy)
import numpy as np

from cudnn_attn.core.config import FP8_DTYPES, AttentionConfig
from cudnn_attn.core.types import AttentionLayout


def io_dtype(config: AttentionConfig) -> np.dtype:
    """The NumPy dtype of Q/K/V/O (``float16``, ``bfloat16``, ``float8_*``; ``float32``/``float64`` are
    accepted too, which lets tests run the reference exactly in float64)."""
    return np.dtype(config.dtype)


def as_float64(x: Any) -> np.ndarray:
    """``x`` as a float64 NumPy array (exact for every io dtype)."""
    return np.asarray(x).astype(np.float64)


def to_logical(x: Any, layout: AttentionLayout) -> np.ndarray:
    """A physical Q/K/V/O-like array in ``layout`` -> logical ``(B, heads, length, dim)`` float64."""
    x = as_float64(x)
    return x.transpose(0, 2, 1, 3) if layout is AttentionLayout.BTNH else x


def to_physical(x: np.ndarray, layout: AttentionLayout, dtype: np.dtype) -> np.ndarray:
    """Logical ``(B, heads, length, dim)`` -> the physical layout, cast to ``dtype``."""
    if layout is AttentionLayout.BTNH:
        x = x.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(cast(x, dtype))


def cast(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round ``x`` to ``dtype``; FP8 conversion saturates at the largest finite value, like the
    ``cvt.rn.satfinite`` conversion of the FP8 kernels (plain NumPy casting would give NaN/inf)."""
    dtype = np.dtype(dtype)
    if dtype.name in FP8_DTYPES:
        limit = float(ml_dtypes.finfo(dtype).max)
        x = np.clip(x, -limit, limit)
    return np.asarray(x).astype(dtype)


def gather_pages(cache: Any, page_table: Any, kv_lengths: np.ndarray, layout: AttentionLayout) -> np.ndarray:
    """Logical ``(B, K, blocks_per_seq * block_size, dim)`` K or V from a paged cache.

    ``K[b, :, s] = cache[page_table[b, 0, s // block_size, 0], s % block_size]`` (layout-aware).
    Only the table entries of blocks that hold a token ``s < kv_lengths[b]`` are read (the others may
    hold anything; the used ones are block indices, :func:`cudnn_attn.core.values.check`); tokens at
    ``s >= kv_lengths[b]`` are whatever the cache holds and are left to the caller to discard
    (:func:`.problem.load` zeroes them).
    """
    cache = as_float64(cache)
    if layout is AttentionLayout.BTNH:                       # (blocks, block_size, K, dim)
        cache = cache.transpose(0, 2, 1, 3)                  # -> (blocks, K, block_size, dim)
    num_blocks, heads, block_size, dim = cache.shape
    table = np.asarray(page_table)[:, 0, :, 0].astype(np.int64)          # (B, blocks_per_seq)
    batch, blocks_per_seq = table.shape
    used = np.arange(blocks_per_seq)[None, :] * block_size < kv_lengths[:, None]
    blocks = cache[np.where(used, table, 0)]                 # (B, blocks_per_seq, K, block_size, dim)
    return blocks.transpose(0, 2, 1, 3, 4).reshape(batch, heads, blocks_per_seq * block_size, dim)


def scalar(x: Any) -> float:
    """The value of a one-element array (an FP8 scale of shape ``()`` or ``(1, 1, 1, 1)``)."""
    return float(np.asarray(x, dtype=np.float64).reshape(()))


def amax_array(value: float) -> np.ndarray:
    """An FP8 statistic as the ``(1, 1, 1, 1)`` float32 array the GPU path returns."""
    return np.full((1, 1, 1, 1), value, dtype=np.float32)
