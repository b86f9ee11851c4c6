"""Where the sequences of one call lie in its query and key rows.

Every call is reduced to a list of *segments* (the sequences cuDNN sees): segment ``g`` lives in
batch row ``row[g]``, its queries are rows ``q_start[g] .. q_start[g] + q_len[g] - 1`` of that row
and its keys ``kv_start[g] .. kv_start[g] + kv_len[g] - 1``.  A segment only attends to itself and
positions (causal diagonal, window, ALiBi) are counted from its start.

* no padding: one segment per row covering all ``T`` queries and ``S`` keys;
* padding (and paging): one segment per row of ``q_seqlen[b]`` queries and ``kv_seqlen[b]`` keys;
* packed (``q_offsets``): the valid (``>= 0``) segments of every row, rows in order, segments in
  order.  This is the seed's ``_shift_to_left`` order, so ``g`` is also the logsumexp row.

Tokens outside every segment take no part: their outputs, logsumexp and gradients are 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cudnn_attn.core.config import AttentionConfig, AttentionOperands
from cudnn_attn.core.values import check


@dataclass(frozen=True)
class SegmentTable:
    """The segments of one call (``G`` of them) and the per-token maps derived from them."""

    row: np.ndarray          # (G,) batch row of each segment
    q_start: np.ndarray      # (G,)
    q_len: np.ndarray        # (G,)
    kv_start: np.ndarray     # (G,)
    kv_len: np.ndarray       # (G,)
    q_segment: np.ndarray    # (B, T) segment of each query token, -1 outside every segment
    q_pos: np.ndarray        # (B, T) position of each query token inside its segment (0 outside)
    kv_segment: np.ndarray   # (B, S)
    kv_pos: np.ndarray       # (B, S)
    lse_rows: int            # rows of the logsumexp: B, or B * M when packed

    @property
    def valid_q(self) -> np.ndarray:
        """(B, T) bool: the query token belongs to a segment."""
        return self.q_segment >= 0

    @property
    def valid_kv(self) -> np.ndarray:
        """(B, S) bool: the key token belongs to a segment."""
        return self.kv_segment >= 0

    def pack_lse(self, lse: np.ndarray) -> np.ndarray:
        """Per-token ``(B, N, T)`` logsumexp -> the ``(lse_rows, N, T)`` layout of the API: row ``g`` holds
        segment ``g`` from column 0; every other entry is 0."""
        out = np.zeros((self.lse_rows,) + lse.shape[1:], dtype=lse.dtype)
        for g in range(len(self.row)):
            start, length = self.q_start[g], self.q_len[g]
            out[g, :, :length] = lse[self.row[g], :, start:start + length]
        return out

    def unpack_lse(self, lse: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`pack_lse`: ``(lse_rows, N, T)`` -> per-token ``(B, N, T)`` (0 outside)."""
        batch, q_len = self.q_segment.shape
        out = np.zeros((batch, lse.shape[1], q_len), dtype=lse.dtype)
        for g in range(len(self.row)):
            start, length = self.q_start[g], self.q_len[g]
            out[self.row[g], :, start:start + length] = lse[g, :, :length]
        return out


def _ints(x: Any) -> np.ndarray:
    return np.asarray(x).astype(np.int64)


def _packed_segments(q_seqlen: np.ndarray, kv_seqlen: np.ndarray, q_offsets: np.ndarray,
                     kv_offsets: np.ndarray) -> list[tuple[int, ...]]:
    """``(row, q_start, q_len, kv_start, kv_len)`` of the valid segments, rows then segments in order (the
    values follow the rules of :mod:`cudnn_attn.core.values`)."""
    found = []
    for b in range(q_seqlen.shape[0]):
        for m in range(int((q_seqlen[b] >= 0).sum())):
            found.append((b, int(q_offsets[b, m]), int(q_seqlen[b, m]), int(kv_offsets[b, m]), int(kv_seqlen[b, m])))
    return found


def _token_maps(found: list[tuple[int, ...]], batch: int, length: int, side: str) -> tuple[np.ndarray, np.ndarray]:
    """(B, length) segment index and in-segment position of every token of one side ("q" or "kv")."""
    segment = np.full((batch, length), -1, dtype=np.int64)
    position = np.zeros((batch, length), dtype=np.int64)
    column = 1 if side == "q" else 3
    for g, entry in enumerate(found):
        b, start, size = entry[0], entry[column], entry[column + 1]
        segment[b, start:start + size] = g
        position[b, start:start + size] = np.arange(size)
    return segment, position


def segments_of(config: AttentionConfig, operands: AttentionOperands) -> SegmentTable:
    """The segments of one call, read from its seqlens/offsets (values are read: this is NumPy).

    Raises:
        ValueError: lengths or offsets that do not describe segments inside the rows
            (:func:`cudnn_attn.core.values.check`, naming the argument, the row and the value).
    """
    check(config, operands)
    batch, q_limit, kv_limit = config.batch, config.q_len, config.kv_len
    if config.packing:
        found = _packed_segments(_ints(operands.q_seqlen), _ints(operands.kv_seqlen), _ints(operands.q_offsets),
                                 _ints(operands.kv_offsets))
    elif config.mask.padding:
        q_lengths, kv_lengths = _ints(operands.q_seqlen), _ints(operands.kv_seqlen)
        found = [(b, 0, int(q_lengths[b]), 0, int(kv_lengths[b])) for b in range(batch)]
    else:
        found = [(b, 0, q_limit, 0, kv_limit) for b in range(batch)]
    q_segment, q_pos = _token_maps(found, batch, q_limit, "q")
    kv_segment, kv_pos = _token_maps(found, batch, kv_limit, "kv")
    table = np.array(found, dtype=np.int64).reshape(-1, 5)
    return SegmentTable(row=table[:, 0], q_start=table[:, 1], q_len=table[:, 2], kv_start=table[:, 3],
                        kv_len=table[:, 4], q_segment=q_segment, q_pos=q_pos, kv_segment=kv_segment, kv_pos=kv_pos,
                        lse_rows=config.lse_shape[0])
