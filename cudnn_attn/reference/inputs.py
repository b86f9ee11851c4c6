"""Fresh random operands for any :class:`AttentionConfig` (tests of the reference and of the GPU path).

Values are standard normal in the io dtype (FP8: quantised with power-of-two scales, whose descales
go into ``fp8_scales``).  Sequences are random: padded lengths in ``[1, T]``, packed rows of random
segments with gaps, page tables drawn from a shuffled cache that holds spare blocks.  With ``poison``
every value that must not matter is NaN: query/key/value tokens outside every sequence, unused cache
blocks and the cache tail past ``kv_seqlen`` -- a result that is still finite proves it never read them.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from cudnn_attn.core.config import FP8_DTYPES, AttentionConfig, AttentionOperands
from cudnn_attn.core.types import FP8_PARAM_KEYS, AttentionLayout

from .segments import segments_of
from .tensors import cast, io_dtype


def fp8_scale(amax: float, dtype: np.dtype) -> float:
    """The power-of-two scale that maps ``amax`` into the FP8 range: ``2^floor(log2(max_fp8 / amax))``."""
    return 2.0 ** math.floor(math.log2(float(ml_dtypes.finfo(dtype).max) / amax))


def _partition(total: int, parts: int, rng: np.random.Generator) -> np.ndarray:
    """``parts`` random non-negative integers summing to ``total``."""
    cuts = np.sort(rng.integers(0, total + 1, size=parts - 1))
    return np.diff(np.concatenate([[0], cuts, [total]]))


def _packed_row(count: int, length: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Start offsets and lengths (>= 1) of ``count`` segments with random gaps inside ``length`` tokens."""
    parts = _partition(length - count, 2 * count + 1, rng)
    sizes = parts[1::2] + 1
    gaps = parts[0::2][:-1]
    starts = np.cumsum(gaps + np.concatenate([[0], sizes[:-1]]))
    return starts, sizes


def _sequences(config: AttentionConfig, rng: np.random.Generator) -> dict:
    batch, t, s = config.batch, config.q_len, config.kv_len
    if config.packing:
        m = config.packing.max_segments
        arrays = {name: np.full((batch, m + extra), -1, np.int32) for name, extra in
                  (("q_offsets", 1), ("kv_offsets", 1), ("q_seqlen", 0), ("kv_seqlen", 0))}
        for b in range(batch):
            count = int(rng.integers(1, min(m, t, s) + 1))
            for side, length in (("q", t), ("kv", s)):
                starts, sizes = _packed_row(count, length, rng)
                arrays[f"{side}_offsets"][b, :count] = starts
                arrays[f"{side}_seqlen"][b, :count] = sizes
        return arrays
    if config.mask.padding:
        return {"q_seqlen": rng.integers(1, t + 1, size=batch).astype(np.int32),
                "kv_seqlen": rng.integers(1, s + 1, size=batch).astype(np.int32)}
    return {}


def _normal(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal(shape)


def _quantise(x: np.ndarray, config: AttentionConfig, scales: dict, name: str) -> np.ndarray:
    dtype = io_dtype(config)
    if dtype.name not in FP8_DTYPES:
        return cast(x, dtype)
    scale = fp8_scale(float(np.abs(x).max()), dtype)
    scales[f"descale_{name}"] = 1.0 / scale
    return cast(x * scale, dtype)


def _fp8_scales(config: AttentionConfig, v_amax: float, scales: dict) -> dict:
    """The FP8Params values: Q/K/V descales from their quantisation, ``scale_s`` for P in [0, 1],
    ``scale_o`` for |O| <= max |v|; every backward entry 1 (a test sets those for its own dO)."""
    dtype = io_dtype(config)
    values = {name: 1.0 for name in FP8_PARAM_KEYS}
    values.update(scales)
    values["scale_s"] = fp8_scale(1.0, dtype)
    values["descale_s"] = 1.0 / values["scale_s"]
    values["scale_o"] = fp8_scale(v_amax, dtype)
    values["descale_o"] = 1.0 / values["scale_o"]
    return {name: np.full((1, 1, 1, 1), value, np.float32) for name, value in values.items()}


def _poison_tokens(x: np.ndarray, valid: np.ndarray, layout: AttentionLayout) -> np.ndarray:
    """NaN in the tokens (B, length) of a physical Q/K/V-like array that are not ``valid``."""
    token_axis = 1 if layout is AttentionLayout.BTNH else 2
    shape = [valid.shape[0], 1, 1, 1]
    shape[token_axis] = valid.shape[1]
    return np.where(valid.reshape(shape), x, np.nan)


def _paged(config: AttentionConfig, logical_bthd: np.ndarray, kv_lengths: np.ndarray, num_blocks: int,
           rng: np.random.Generator, poison: bool) -> tuple[np.ndarray, np.ndarray]:
    """Cache (in the layout) and page table holding ``logical_bthd`` ``(B, S, K, D)``."""
    paging = config.paging
    batch, bs, per_seq = config.batch, paging.block_size, paging.blocks_per_seq
    order = rng.permutation(num_blocks)
    table = order[:batch * per_seq].reshape(batch, per_seq)
    fill = np.nan if poison else 0.0
    if poison:
        tail = np.arange(per_seq * bs)[None, :] >= kv_lengths[:, None]
        logical_bthd = np.where(tail[:, :, None, None], np.nan, logical_bthd)
    cache = rng.standard_normal((num_blocks, bs) + logical_bthd.shape[2:])
    cache[order[batch * per_seq:]] = fill
    cache[table.reshape(-1)] = logical_bthd.reshape((batch * per_seq, bs) + logical_bthd.shape[2:])
    if config.layout is AttentionLayout.BNTH:
        cache = cache.transpose(0, 2, 1, 3)
    return np.ascontiguousarray(cache), table.reshape(batch, 1, per_seq, 1).astype(np.int32)


def random_operands(config: AttentionConfig, rng: np.random.Generator, *, poison: bool = True) -> AttentionOperands:
    """Random operands of ``config`` (see the module docstring)."""
    sequences = _sequences(config, rng)
    segments = segments_of(config, AttentionOperands(query=None, key=None, value=None, **sequences))
    kv_shape = (config.batch, config.kv_len, config.kv_heads)
    logical_k, logical_v = _normal(kv_shape + (config.qk_dim,), rng), _normal(kv_shape + (config.v_dim,), rng)
    fp8: dict = {}
    query = _quantise(_normal(config.q_shape, rng), config, fp8, "q").astype(np.float64)
    k_values = _quantise(logical_k, config, fp8, "k").astype(np.float64)       # (B, S, K, H)
    v_values = _quantise(logical_v, config, fp8, "v").astype(np.float64)
    if poison:
        query = _poison_tokens(query, segments.valid_q, config.layout)
        k_values = np.where(segments.valid_kv[:, :, None, None], k_values, np.nan)
        v_values = np.where(segments.valid_kv[:, :, None, None], v_values, np.nan)
    tables = {}
    if config.paging:
        kv_lengths = np.asarray(sequences["kv_seqlen"])
        key, tables["page_table_k"] = _paged(config, k_values, kv_lengths, config.paging.num_blocks_k, rng, poison)
        value, tables["page_table_v"] = _paged(config, v_values, kv_lengths, config.paging.num_blocks_v, rng, poison)
    elif config.layout is AttentionLayout.BTNH:
        key, value = k_values, v_values
    else:
        key, value = k_values.transpose(0, 2, 1, 3), v_values.transpose(0, 2, 1, 3)
    dtype = io_dtype(config)
    return AttentionOperands(
        query=cast(query, dtype), key=cast(key, dtype), value=cast(value, dtype), **sequences, **tables,
        bias=None if config.bias is None else cast(_normal(config.bias.shape, rng), dtype),
        sink=_normal((config.q_heads,), rng).astype(np.float32) if config.sink else None,
        score_mod_args=() if config.score_mod is None else tuple(
            _normal(shape, rng).astype(dtype_name) for shape, dtype_name in config.score_mod.arg_shapes),
        fp8_scales=_fp8_scales(config, float(np.abs(logical_v).max()), fp8) if config.fp8 else None,
    )
