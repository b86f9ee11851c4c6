"""The static plan of context-parallel attention: which kernel calls a device makes at each step.

Pure Python on integers: no arrays, no JAX.  :mod:`.context_parallel` runs the plans.

Chunks
    A device's local sequence (queries or a block of keys) is a list of :class:`Chunk` s of the global
    sequence: ``Chunk(local, start, length)`` puts global positions ``start .. start + length - 1`` at
    local positions ``local ..``.  Natural order: one chunk per device.  Load-balanced ("zigzag") order
    for ``Z`` shards: the sequence is cut into ``2Z`` chunks and stored in the order ``0, 2Z-1, 1,
    2Z-2, ...``, so device ``d`` of ``Z`` holds chunks ``d`` and ``2Z-1-d`` and every device gets the
    same causal work (:func:`chunk_order`).  ``P`` devices with ``P`` dividing ``Z`` hold ``2Z/P``
    consecutive entries of that order each (correct for any such ``P``, balanced for ``P == Z``).

Band
    The mask of the whole call as a band of ``d = j - i`` (key position minus query position):
    key ``j`` is kept for query ``i`` iff ``lo < d <= hi`` (``None``: unbounded).  A causal mask is
    ``hi = 0``, a window of ``w`` keys ``lo = -w``; a bottom-right diagonal without per-sequence lengths
    shifts both by ``S - T`` (:meth:`Band.of`).  This is :class:`~cudnn_attn.core.config.StaticMask`'s rule with
    ``right_bound = hi`` and ``left_bound = -lo``.

Calls
    For the query chunks of a device against the key chunks it holds at one step, :func:`plan` returns
    the kernel calls (:class:`BlockCall`) that compute exactly the masked attention: none when the band
    removes every pair (the step is skipped), preferably one call over the whole region when one local
    band reproduces the mask of every chunk pair in it (a causal diagonal block, a full block), else one
    call per chunk pair that the band does not remove.  Every call is trimmed to the query rows that have
    a key and the keys that some query sees, which puts the diagonal inside the band: cuDNN's
    ``right_bound >= 0`` and ``left_bound >= 1`` always hold.

Packed segments
    cuDNN counts a segment's positions from the segment's first row and key *in the call*.  With every
    segment's keys at the positions of its queries, a causal (or unmasked) attention inside segments is
    the global band restricted to each segment, and a call keeps it exactly in three shapes
    (:func:`segment_fit`): a full block (no band: every segment sees all its keys in the block), a block
    whose first row and first key are the same global position (top-left causal inside each segment),
    and a block whose last row and last key are the same global position (bottom-right causal inside
    each segment once each segment's keys are cut at its last row in the block).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cudnn_attn.core.config import AttentionConfig, DiagonalAlignment


@dataclass(frozen=True)
class Chunk:
    """Global positions ``start .. start + length - 1`` stored at local positions ``local ..``."""

    local: int
    start: int
    length: int


def chunk_order(balance: int) -> tuple[int, ...]:
    """The storage order of the ``2 * balance`` chunks of the load-balanced sequence: 0, 2Z-1, 1, 2Z-2, ..."""
    last = 2 * balance - 1
    return tuple(c for d in range(balance) for c in (d, last - d))


def local_chunks(length: int, shards: int, index: int, balance: int = 0) -> tuple[Chunk, ...]:
    """The chunks of device ``index`` of ``shards`` for a global sequence of ``length`` positions.

    ``balance``: 0 for the natural order, else the ``Z`` of the load-balanced order (``shards`` divides it).
    """
    local_length = length // shards
    if not balance:
        return (Chunk(0, index * local_length, local_length),)
    size = length // (2 * balance)
    per_device = 2 * balance // shards
    mine = chunk_order(balance)[index * per_device:(index + 1) * per_device]
    return _merged(tuple(Chunk(i * size, c * size, size) for i, c in enumerate(mine)))


def _merged(chunks: tuple[Chunk, ...]) -> tuple[Chunk, ...]:
    """Adjacent chunks that are also adjacent globally, as one."""
    found: list[Chunk] = []
    for chunk in chunks:
        last = found[-1] if found else None
        if last and last.local + last.length == chunk.local and last.start + last.length == chunk.start:
            found[-1] = Chunk(last.local, last.start, last.length + chunk.length)
        else:
            found.append(chunk)
    return tuple(found)


@dataclass(frozen=True)
class Band:
    """Keys kept: ``lo < d <= hi`` with ``d = j - i`` (``None``: unbounded); see the module doc."""

    lo: int | None = None
    hi: int | None = None

    @classmethod
    def of(cls, config: AttentionConfig) -> "Band":
        """The band of ``config``'s mask in global positions (a bottom-right diagonal needs equal lengths
        for every sequence, i.e. no padding: the shift is ``S - T``)."""
        mask = config.mask
        shift = config.kv_len - config.q_len if mask.alignment is DiagonalAlignment.BOTTOM_RIGHT else 0
        return cls(None if mask.left_bound is None else shift - mask.left_bound,
                   None if mask.right_bound is None else shift + mask.right_bound)

    def shifted(self, delta: int) -> "Band":
        """The same keys in coordinates where ``d`` reads ``d - delta``."""
        return Band(None if self.lo is None else self.lo - delta, None if self.hi is None else self.hi - delta)

    def kept(self, q_len: int, k_len: int) -> tuple[int, int] | None:
        """The kept values of ``d`` on a ``q_len x k_len`` block (``d`` in ``[1 - q_len, k_len - 1]``), as a
        closed interval, or ``None`` when the band removes the whole block."""
        first = 1 - q_len if self.lo is None else max(self.lo + 1, 1 - q_len)
        last = k_len - 1 if self.hi is None else min(self.hi, k_len - 1)
        return (first, last) if first <= last else None


@dataclass(frozen=True)
class BlockCall:
    """One kernel call: local query rows ``[q_start, q_stop)`` against local keys ``[k_start, k_stop)``
    with cuDNN's top-left ``right_bound``/``left_bound`` (``None``: unbounded) on those rows and keys.

    ``q_global``/``k_global`` are the global positions of the first query row and key (the call's rows
    and keys are globally contiguous); they turn per-sequence lengths into the call's lengths.  They are
    not part of the call's identity (devices whose calls differ only by them share one plan, and read
    their own positions at run time).  ``padded``: the call needs cuDNN's padding mask even when the
    attention has none (cuDNN's window needs ``T <= S`` otherwise).
    """

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    right_bound: int | None
    left_bound: int | None
    q_global: int = field(default=0, compare=False)
    k_global: int = field(default=0, compare=False)
    padded: bool = False

    @property
    def q_len(self) -> int:
        return self.q_stop - self.q_start

    @property
    def k_len(self) -> int:
        return self.k_stop - self.k_start


class SegmentFit(enum.Enum):
    """How a call keeps the attention inside packed segments (module doc)."""

    FULL = "full"                    # no band: every key of a segment in the block is kept
    TOP_LEFT = "top_left"            # first row and first key at the same global position, causal
    BOTTOM_RIGHT = "bottom_right"    # last row and last key at the same global position, causal


def segment_fit(call: BlockCall) -> SegmentFit | None:
    """How ``call`` (of a causal or unmasked band) keeps packed segments exactly, or ``None`` when one
    call cannot (its band leaves each segment a different offset between its rows and keys)."""
    if call.left_bound is not None:
        return None
    if call.right_bound is None:
        return SegmentFit.FULL
    if call.right_bound == 0:            # causal band: the call starts on the diagonal
        return SegmentFit.TOP_LEFT
    if call.k_len == call.q_len + call.right_bound:
        return SegmentFit.BOTTOM_RIGHT
    return None


def _trimmed(q_start: int, q_len: int, k_start: int, k_len: int, band: Band, q_global: int,
             k_global: int) -> BlockCall:
    """The call on a block with ``band`` in block coordinates, trimmed to rows with keys and seen keys."""
    lo, hi = band.lo, band.hi
    q0 = 0 if hi is None else max(0, -hi)
    q1 = q_len if lo is None else min(q_len, k_len - 1 - lo)
    k0 = 0 if lo is None else max(0, q0 + lo + 1)
    k1 = k_len if hi is None else min(k_len, q1 + hi)
    rows, keys = q1 - q0, k1 - k0
    inner = band.shifted(k0 - q0)
    right = inner.hi if inner.hi is not None and inner.hi < keys - 1 else None
    left = -inner.lo if inner.lo is not None and inner.lo > -rows else None
    return BlockCall(q_start + q0, q_start + q1, k_start + k0, k_start + k1, right, left,
                     q_global + q0, k_global + k0, padded=left is not None and rows > keys)


def _same_mask(band: Band, candidate: Band, q_len: int, k_len: int) -> bool:
    return band.kept(q_len, k_len) == candidate.kept(q_len, k_len)


def plan(queries: tuple[Chunk, ...], keys: tuple[Chunk, ...], band: Band, *,
         contiguous_only: bool = False) -> tuple[BlockCall, ...]:
    """The kernel calls for local queries ``queries`` against the local keys ``keys`` (module doc).

    ``contiguous_only``: merge chunk pairs into one call only when the merged rows and keys are globally
    contiguous (needed with per-sequence lengths, which count from a global position).
    """
    pairs = [(q, k, band.shifted(k.start - q.start)) for q in queries for k in keys]
    live = [(q, k, b) for q, k, b in pairs if b.kept(q.length, k.length) is not None]
    if not live:
        return ()
    merged = _one_call(queries, keys, pairs, live, contiguous_only)
    if merged is not None:
        return (merged,)
    return tuple(_trimmed(q.local, q.length, k.local, k.length, b, q.start, k.start) for q, k, b in live)


def _one_call(queries: tuple[Chunk, ...], keys: tuple[Chunk, ...], pairs: list, live: list,
              contiguous_only: bool) -> BlockCall | None:
    """One call over the region of the live pairs, if one local band reproduces every pair in it."""
    q_lo = min(q.local for q, _, _ in live)
    q_hi = max(q.local + q.length for q, _, _ in live)
    k_lo = min(k.local for _, k, _ in live)
    k_hi = max(k.local + k.length for _, k, _ in live)
    inside = [(q, k, b) for q, k, b in pairs
              if q_lo <= q.local < q_hi and k_lo <= k.local < k_hi]
    q_chunks = sorted({q for q, _, _ in inside}, key=lambda c: c.local)
    k_chunks = sorted({k for _, k, _ in inside}, key=lambda c: c.local)
    if contiguous_only and (len(_merged(tuple(q_chunks))) > 1 or len(_merged(tuple(k_chunks))) > 1):
        return None

    def offset(q: Chunk, k: Chunk) -> int:          # region d minus pair d
        return (k.local - k_lo) - (q.local - q_lo)

    candidates = [Band()] + [b.shifted(-offset(q, k)) for q, k, b in live]
    for candidate in candidates:
        if all(_same_mask(b, candidate.shifted(offset(q, k)), q.length, k.length) for q, k, b in inside):
            return _trimmed(q_lo, q_hi - q_lo, k_lo, k_hi - k_lo, candidate, q_chunks[0].start, k_chunks[0].start)
    return None


@dataclass(frozen=True)
class StepPlans:
    """Every device's calls at one step: the distinct ``plans`` (global positions aside), the plan
    ``index`` of each device, and each device's ``calls`` (with its own global positions)."""

    plans: tuple[tuple[BlockCall, ...], ...]
    index: tuple[int, ...]
    calls: tuple[tuple[BlockCall, ...], ...]


def device_plans(queries: list[tuple[Chunk, ...]], keys: list[tuple[Chunk, ...]], band: Band, *,
                 contiguous_only: bool) -> StepPlans:
    """The plans of every device (``queries[r]`` against ``keys[r]``) at one step (:class:`StepPlans`)."""
    calls = tuple(plan(q, k, band, contiguous_only=contiguous_only) for q, k in zip(queries, keys))
    distinct = list(dict.fromkeys(calls))
    return StepPlans(tuple(distinct), tuple(distinct.index(c) for c in calls), calls)


# -- pieces --------------------------------------------------------------------------------------------

MIN_PIECE = 128         # positions: one cuDNN tile of rows; smaller pieces only add kernel calls


def pieces_of(length: int, requested: int | None) -> int:
    """Into how many equal pieces a local sequence of ``length`` positions is cut: ``requested``, or
    (``None``) the most of 8, 4, 2, 1 that divides ``length`` with pieces of at least :data:`MIN_PIECE`
    (8 pieces: per-device memory of a 2-device training step 0.59x one device's, 4 pieces 0.69x)."""
    if requested is not None:
        return requested
    return next(n for n in (8, 4, 2, 1) if length % n == 0 and (length // n >= MIN_PIECE or n == 1))


def piece(chunks: tuple[Chunk, ...], start: int, stop: int) -> tuple[Chunk, ...]:
    """The local positions ``[start, stop)`` of ``chunks``, as chunks of a sequence that starts at ``start``."""
    found = []
    for c in chunks:
        lo, hi = max(c.local, start), min(c.local + c.length, stop)
        if lo < hi:
            found.append(Chunk(lo - start, c.start + lo - c.local, hi - lo))
    return tuple(found)
