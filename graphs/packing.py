"""Packed segments: from the API's per-row description to cuDNN's ragged batch.

The API (like JAX's) describes packing per batch row: ``offsets[b, m]`` is the token where segment
``m`` of row ``b`` starts inside that row and ``seqlen[b, m]`` its length, ``-1`` for absent segments
(arrays ``(B, M + 1)`` and ``(B, M)``; the last offsets column is not read).  cuDNN instead sees
``B * M`` independent sequences ("segments") of a ragged batch: sequence ``i`` has length
``seq_len[i]`` and starts at element ``ragged_offset[i]`` of the flattened buffer.

Conversion (:func:`segments`): the present segments are listed in row-major order first (left-shifted,
as JAX does), the remaining slots get length 0 and start at the end of the buffer.  Row ``b``'s segment
``m`` starts at token ``b * T + offsets[b, m]`` of the flattened ``(B * T)`` token axis.  A segment is
present when both its query and its key/value offsets are ``>= 0``.

Every function takes the array namespace ``xp`` (``numpy``, ``cupy`` or ``jax.numpy``), uses only
static shapes and never reads values back to the host, so it runs inside ``jax.jit`` and on a CUDA
stream without a synchronisation.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from cudnn_attn.core.config import AttentionConfig

from cudnn_attn.core.config import ragged_offset_dtype

from .tensors import TensorId


class RaggedSegments(NamedTuple):
    """The ``B * M`` cuDNN sequences of a packed call (arrays of namespace ``xp``).

    ``q_seqlen``/``kv_seqlen`` are int32 ``(B*M,)`` (0 for empty slots); ``q_start``/``kv_start`` are
    int32 ``(B*M + 1,)`` token positions in the flattened ``(B*T)``/``(B*S)`` token axes, the last
    entry (and every empty slot) being the end of the axis.
    """

    q_seqlen: Any
    kv_seqlen: Any
    q_start: Any
    kv_start: Any


def _left_shift(xp: Any, values: Any, present: Any, fill: int) -> Any:
    """The ``present`` entries of the 1-D ``values`` in order, then ``fill`` (gather form, jit-friendly)."""
    n = values.shape[0]
    rank = xp.cumsum(present.astype(xp.int32))          # rank[i] = number of present entries in [0, i]
    slots = xp.arange(n, dtype=xp.int32)
    source = xp.searchsorted(rank, slots + 1, side="left")  # index of the (slot+1)-th present entry
    source = xp.minimum(source, n - 1)
    return xp.where(slots < rank[-1], xp.take(values, source), fill)


def segments(xp: Any, q_seqlen: Any, kv_seqlen: Any, q_offsets: Any, kv_offsets: Any,
             q_len: int, kv_len: int) -> RaggedSegments:
    """cuDNN's ragged batch from the API's ``(B, M)`` seqlens and ``(B, M + 1)`` offsets (int32)."""
    batch, max_segments = q_seqlen.shape
    present = ((q_offsets[:, :max_segments] >= 0) & (kv_offsets[:, :max_segments] >= 0)).reshape(-1)
    rows = xp.arange(batch, dtype=xp.int32)[:, None]

    def starts(offsets: Any, length: int) -> Any:
        tokens = (offsets[:, :max_segments].astype(xp.int32) + rows * length).reshape(-1)
        shifted = _left_shift(xp, tokens, present, batch * length)
        end = xp.full((1,), batch * length, dtype=xp.int32)
        return xp.concatenate([shifted.astype(xp.int32), end])

    def lengths(seqlen: Any) -> Any:
        return _left_shift(xp, xp.maximum(seqlen.astype(xp.int32), 0).reshape(-1), present, 0).astype(xp.int32)

    return RaggedSegments(lengths(q_seqlen), lengths(kv_seqlen), starts(q_offsets, q_len), starts(kv_offsets, kv_len))


def cudnn_buffers(xp: Any, config: AttentionConfig, segs: RaggedSegments) -> dict:
    """The arrays to bind for a packed graph: sequence lengths and element offsets, by :class:`TensorId`.

    Element offsets are token starts times the elements of one token (``heads * head_dim``; the
    token-major statistics hold ``heads`` floats per token), in :func:`ragged_offset_dtype`.
    """
    dtype = getattr(xp, ragged_offset_dtype(config))
    q_start, kv_start = segs.q_start.astype(dtype), segs.kv_start.astype(dtype)
    return {
        TensorId.SEQ_LEN_Q: segs.q_seqlen,
        TensorId.SEQ_LEN_KV: segs.kv_seqlen,
        TensorId.RAGGED_Q: q_start * (config.q_heads * config.qk_dim),
        TensorId.RAGGED_O: q_start * (config.q_heads * config.v_dim),
        TensorId.RAGGED_K: kv_start * (config.kv_heads * config.qk_dim),
        TensorId.RAGGED_V: kv_start * (config.kv_heads * config.v_dim),
        TensorId.RAGGED_STATS: q_start * config.q_heads,
    }


def lse_from_tokens(xp: Any, lse_tokens: Any, segs: RaggedSegments, q_len: int) -> Any:
    """Token-major statistics ``(B*T, N)`` (what the packed graph writes) -> logsumexp ``(B*M, N, T)``.

    Row ``i`` of the result is segment ``i``; positions past the segment's length are 0.
    """
    total, heads = lse_tokens.shape
    count = segs.q_seqlen.shape[0]
    positions = xp.arange(q_len, dtype=xp.int32)[None, :]
    tokens = xp.minimum(segs.q_start[:count, None] + positions, total - 1)          # (B*M, T)
    gathered = xp.take(lse_tokens, tokens.reshape(-1), axis=0).reshape(count, q_len, heads)
    inside = (positions < segs.q_seqlen[:, None])[:, :, None]
    return xp.transpose(xp.where(inside, gathered, 0), (0, 2, 1)).astype(lse_tokens.dtype)


def lse_to_tokens(xp: Any, lse: Any, segs: RaggedSegments, total_tokens: int) -> Any:
    """Logsumexp ``(B*M, N, T)`` -> the token-major ``(B*T, N)`` statistics a packed backward reads.

    ``total_tokens`` is ``B * T``.  Tokens outside every segment get 0.
    """
    count, heads, q_len = lse.shape
    tokens = xp.arange(total_tokens, dtype=xp.int32)
    segment = xp.searchsorted(segs.q_start[:count], tokens, side="right").astype(xp.int32) - 1
    segment = xp.maximum(segment, 0)
    position = tokens - xp.take(segs.q_start, segment)
    inside = (position >= 0) & (position < xp.take(segs.q_seqlen, segment))
    flat = xp.transpose(lse, (0, 2, 1)).reshape(count * q_len, heads)
    index = segment * q_len + xp.clip(position, 0, q_len - 1)
    return xp.where(inside[:, None], xp.take(flat, index, axis=0), 0).astype(lse.dtype)
