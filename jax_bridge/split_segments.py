"""Packed segments of a context-parallel call, per block (:mod:`.context_parallel`).

Every block call of a packed split call is packed with the same ``M`` slots: each segment's rows and keys are
its clipped intersection with the block's global positions, computed in the traced program from the global
offsets and lengths (:meth:`SplitSegments.in_block`), and an absent or outside slot has length 0 at the end of the
block, so the block's logsumexp row ``b*M + m`` is always slot ``m`` of row ``b``.  :class:`BlockSegments`
turns a block's packed logsumexp into per-row values for the merge and back for the backward; :class:`SplitSegments`
lays the merged per-row logsumexp out by segment (the split call's layout, module doc of
:mod:`.context_parallel`) and back, and says which rows hold segments whose keys are at their queries'
positions (what a causal split needs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import jax.numpy as jnp

from cudnn_attn.core.config import AttentionConfig

from .sequence_plan import BlockCall, SegmentFit

__all__ = ["BlockSegments", "SplitSegments"]


@dataclass(frozen=True)
class SplitSegments:
    """The packed segments of a split call, in global (natural-order) positions: ``(B, M)`` int32 starts and
    lengths of every slot's queries and keys, and whether the slot holds a segment (sanitized operands:
    an absent slot is ``-1`` in all four)."""

    q_start: Any
    q_len: Any
    k_start: Any
    k_len: Any
    present: Any

    @classmethod
    def of(cls, config: AttentionConfig, ops: Mapping[str, Any]) -> "SplitSegments":
        m = config.packing.max_segments
        q_start, k_start = ops["q_offsets"][:, :m], ops["kv_offsets"][:, :m]
        q_len, k_len = ops["q_seqlen"], ops["kv_seqlen"]
        present = (q_start >= 0) & (k_start >= 0) & (q_len >= 0) & (k_len >= 0)
        return cls(q_start, q_len, k_start, k_len, present)

    def aligned(self) -> Any:
        """``(B,)`` bool: every present segment of the row has its keys at its queries' positions
        (``kv_offsets == q_offsets`` and ``kv_seqlen == q_seqlen``), which a causal split call needs."""
        same = (self.q_start == self.k_start) & (self.q_len == self.k_len)
        return jnp.all(same | ~self.present, axis=1)

    def _rows_in(self, positions: Any) -> Any:
        """``(B, M, R)`` bool: the query at global position ``positions[r]`` lies in segment ``m``."""
        p = positions[None, None, :]
        return (self.present[..., None] & (self.q_start[..., None] <= p)
                & (p < (self.q_start + self.q_len)[..., None]))

    def lse_by_segment(self, lse: Any, positions: Any) -> Any:
        """Per-row logsumexp ``(B, N, R)`` (rows at global ``positions``) -> the split call's packed layout
        ``(B*M, N, R)``: row ``b*M + m`` holds segment ``m`` of row ``b`` in its own rows, 0 elsewhere."""
        inside = self._rows_in(positions)[:, :, None, :]
        found = jnp.where(inside, lse[:, None], 0.0)
        return found.reshape((-1,) + found.shape[2:])

    def lse_by_row(self, lse: Any, positions: Any) -> Any:
        """The inverse of :meth:`lse_by_segment`."""
        batch, slots = self.present.shape
        by_slot = lse.reshape((batch, slots) + lse.shape[1:])
        return jnp.sum(jnp.where(self._rows_in(positions)[:, :, None, :], by_slot, 0.0), axis=1)

    def in_block(self, call: BlockCall, start: tuple, fit: SegmentFit) -> "BlockSegments":
        """Every segment's rows and keys in one call whose first row and key are at global ``start``:
        the clipped intersections, with each segment's keys cut at its last row for a bottom-right fit;
        an absent or outside slot is empty (at the end of the block)."""
        rows, keys = call.q_len, call.k_len
        q_first, k_first = start
        q0 = jnp.clip(self.q_start - q_first, 0, rows)
        q1 = jnp.clip(self.q_start + self.q_len - q_first, 0, rows)
        k0 = jnp.clip(self.k_start - k_first, 0, keys)
        k1 = jnp.clip(self.k_start + self.k_len - k_first, 0, keys)
        if fit is SegmentFit.BOTTOM_RIGHT:
            k1 = jnp.maximum(jnp.minimum(k1, q1 + (q_first - k_first)), k0)
        q0, q1 = jnp.where(self.present, q0, rows), jnp.where(self.present, q1, rows)
        k0, k1 = jnp.where(self.present, k0, keys), jnp.where(self.present, k1, keys)
        return BlockSegments(*(x.astype(jnp.int32) for x in (q0, q1, k0, k1)), rows=rows, fit=fit)


@dataclass(frozen=True)
class BlockSegments:
    """One call's segments in block positions: rows ``[q0, q1)`` and keys ``[k0, k1)`` of every slot
    ``(B, M)``; the call is packed with all ``M`` slots present (empty ones of length 0), so its
    logsumexp row ``b*M + m`` is slot ``m`` of row ``b``."""

    q0: Any
    q1: Any
    k0: Any
    k1: Any
    rows: int
    fit: SegmentFit

    def operands(self) -> dict[str, Any]:
        end = jnp.full(self.q0.shape[:1] + (1,), -1, jnp.int32)
        return {"q_seqlen": self.q1 - self.q0, "kv_seqlen": self.k1 - self.k0,
                "q_offsets": jnp.concatenate([self.q0, end], axis=1),
                "kv_offsets": jnp.concatenate([self.k0, end], axis=1)}

    def _inside(self) -> Any:
        """``(B, M, rows)`` bool: block row ``i`` lies in slot ``m``."""
        i = jnp.arange(self.rows, dtype=jnp.int32)[None, None, :]
        return (self.q0[..., None] <= i) & (i < self.q1[..., None])

    def rows_with_keys(self) -> Any:
        """``(B, rows)`` bool: the row lies in a segment that keeps at least one of its keys in the block
        for it (bottom-right: row ``i' = i - q0`` keeps keys ``j' <= i' + (k1 - k0) - (q1 - q0)``)."""
        keeps = (self.k1 > self.k0)[..., None] & self._inside()
        if self.fit is SegmentFit.BOTTOM_RIGHT:
            i = jnp.arange(self.rows, dtype=jnp.int32)[None, None, :]
            keeps &= i - self.q1[..., None] + (self.k1 - self.k0)[..., None] >= 0
        return jnp.any(keeps, axis=1)

    def tokens(self, lse: Any) -> Any:
        """The call's packed logsumexp ``(B*M, N, rows)`` (slot ``m``'s rows from column 0) -> per row
        ``(B, N, rows)`` (rows outside every segment: any value, they have no keys)."""
        batch, slots = self.q0.shape
        inside = self._inside()
        slot = jnp.argmax(inside, axis=1)                                       # (B, rows)
        column = jnp.arange(self.rows, dtype=jnp.int32)[None, :] - jnp.take_along_axis(self.q0, slot, axis=1)
        column = jnp.clip(column, 0, self.rows - 1)
        by_slot = lse.reshape((batch, slots) + lse.shape[1:])                   # (B, M, N, rows)
        row = jnp.arange(batch, dtype=jnp.int32)[:, None]
        return jnp.swapaxes(by_slot[row, slot, :, column], 1, 2)               # (B, rows, N) -> (B, N, rows)

    def packed(self, lse: Any) -> Any:
        """The inverse of :meth:`tokens`: per-row ``(B, N, rows)`` -> the call's ``(B*M, N, rows)``."""
        column = jnp.arange(self.rows, dtype=jnp.int32)[None, None, :]
        source = jnp.clip(self.q0[..., None] + column, 0, self.rows - 1)          # (B, M, rows)
        shape = source.shape[:2] + lse.shape[1:]                                  # (B, M, N, rows)
        gathered = jnp.take_along_axis(jnp.broadcast_to(lse[:, None], shape),
                                       jnp.broadcast_to(source[:, :, None, :], shape), axis=3)
        valid = (column < (self.q1 - self.q0)[..., None])[:, :, None, :]
        found = jnp.where(valid, gathered, 0.0)
        return found.reshape((-1,) + found.shape[2:])
