"""Composable masks for the native API: ``causal() & window(128) & padding(q_lengths, kv_lengths)``.

A :class:`Mask` is the static part of masking - a :class:`~cudnn_attn.config.MaskSpec`, whose fields map
one-to-one onto cuDNN's knobs - plus the arrays some of its parts need (sequence lengths, packed segment
offsets, a boolean keep-mask).  Masks combine with ``&``: a key is kept when every part keeps it.

Factories (query position ``i``, key position ``j``; with ``alignment="bottom_right"`` the diagonal of a
sequence is shifted by ``S - T``, per sequence when lengths are given):

* :func:`causal` - keys ``j <= i``;
* :func:`window` ``(left, right=0)`` - keys ``i - left <= j <= i + right`` (``jax.nn``'s
  ``local_window_size``: ``left`` keys before the diagonal, ``right`` after);
* :func:`padding` ``(q_lengths, kv_lengths)`` - per-sequence lengths, int32 ``(B,)``: queries
  ``i >= q_lengths[b]`` and keys ``j >= kv_lengths[b]`` do not exist (their rows come back as zeros);
* :func:`segments` ``(q_lengths, kv_lengths, q_offsets, kv_offsets)`` - packed segments, int32
  ``(B, M)`` lengths and ``(B, M + 1)`` offsets: attention stays inside a segment;
* :func:`alibi` - cuDNN's ALiBi bias ``m_h * (j - i)`` (needs :func:`causal`);
* :func:`keep` ``(mask)`` - a boolean array broadcastable to ``(B, N, T, S)``, True keeps (folded into the
  bias with a large negative number, as JAX does).

``&`` intersects: the tighter of two bounds wins; two diagonals must agree on their alignment; two
sources of lengths, offsets or keep-masks are refused (combine the arrays first).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .config import DiagonalAlignment, MaskSpec

__all__ = ["Mask", "alibi", "causal", "keep", "padding", "segments", "window"]


@dataclass(frozen=True, eq=False)
class Mask:
    """A mask of the native API (see the module doc).  ``spec`` is static; the arrays are runtime values."""

    spec: MaskSpec = MaskSpec()
    q_lengths: Any = None
    kv_lengths: Any = None
    q_offsets: Any = None
    kv_offsets: Any = None
    keep: Any = None

    def __and__(self, other: "Mask") -> "Mask":
        if not isinstance(other, Mask):
            return NotImplemented
        a, b = self.spec, other.spec
        arrays = {}
        for name in ("q_lengths", "kv_lengths", "q_offsets", "kv_offsets", "keep"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is not None and theirs is not None:
                raise ValueError(f"mask: both masks give {name}; combine the arrays into one mask first")
            arrays[name] = mine if mine is not None else theirs
        has_diagonal = [s for s in (a, b) if s.right_bound is not None or s.left_bound is not None]
        if len(has_diagonal) == 2 and a.alignment is not b.alignment:
            raise ValueError(f"mask: the diagonals of the two masks are aligned differently "
                             f"({a.alignment.value} and {b.alignment.value})")
        spec = MaskSpec(right_bound=_tighter(a.right_bound, b.right_bound),
                        left_bound=_tighter(a.left_bound, b.left_bound),
                        alignment=has_diagonal[0].alignment if has_diagonal else DiagonalAlignment.TOP_LEFT,
                        padding=a.padding or b.padding, alibi=a.alibi or b.alibi)
        return Mask(spec, **arrays)

    def describe(self) -> str:
        parts = [self.spec.describe()]
        if self.q_offsets is not None:
            parts.append("segments")
        if self.keep is not None:
            parts.append("keep-mask")
        return "+".join(p for p in parts if p != "none") or "none"

    def __repr__(self) -> str:
        return f"Mask({self.describe()})"


def _tighter(x: int | None, y: int | None) -> int | None:
    return y if x is None else x if y is None else min(x, y)


def _alignment(alignment: str | DiagonalAlignment) -> DiagonalAlignment:
    try:
        return DiagonalAlignment(alignment)
    except ValueError:
        raise ValueError(f"alignment: must be 'top_left' or 'bottom_right', got {alignment!r}") from None


def _count(name: str, value: Any, minimum: int) -> int:
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}: must be an int >= {minimum}, got {value!r}")
    return int(value)


def causal(alignment: str | DiagonalAlignment = "top_left") -> Mask:
    """Keys ``j <= i`` (``j <= i + S - T`` bottom-right aligned)."""
    return Mask(MaskSpec(right_bound=0, alignment=_alignment(alignment)))


def window(left: int, right: int = 0, *, alignment: str | DiagonalAlignment = "top_left") -> Mask:
    """Keys ``i - left <= j <= i + right``: ``left`` keys before the diagonal and ``right`` after it."""
    left, right = _count("window left", left, 0), _count("window right", right, 0)
    return Mask(MaskSpec(right_bound=right, left_bound=left + 1, alignment=_alignment(alignment)))


def padding(q_lengths: Any, kv_lengths: Any) -> Mask:
    """Per-sequence lengths, int32 ``(B,)`` each."""
    if q_lengths is None or kv_lengths is None:
        raise ValueError("padding: give both q_lengths and kv_lengths (the full length where nothing is padded)")
    return Mask(MaskSpec(padding=True), q_lengths=q_lengths, kv_lengths=kv_lengths)


def segments(q_lengths: Any, kv_lengths: Any, q_offsets: Any, kv_offsets: Any) -> Mask:
    """Packed segments: lengths int32 ``(B, M)``, offsets int32 ``(B, M + 1)`` (``-1`` for absent segments)."""
    if any(x is None for x in (q_lengths, kv_lengths, q_offsets, kv_offsets)):
        raise ValueError("segments: give q_lengths, kv_lengths, q_offsets and kv_offsets")
    return Mask(MaskSpec(padding=True), q_lengths=q_lengths, kv_lengths=kv_lengths, q_offsets=q_offsets,
                kv_offsets=kv_offsets)


def alibi() -> Mask:
    """cuDNN's ALiBi bias (combine with :func:`causal`)."""
    return Mask(MaskSpec(alibi=True))


def keep(mask: Any) -> Mask:
    """A boolean array broadcastable to ``(B, N, T, S)``; True keeps the key."""
    if mask is None:
        raise ValueError("keep: expected a boolean array, got None")
    return Mask(keep=mask)


def as_mask(mask: Any) -> Mask:
    """``None`` (no mask) or a :class:`Mask`, checked."""
    if mask is None:
        return Mask()
    if not isinstance(mask, Mask):
        raise ValueError(f"mask: expected a cudnn_attn.masks.Mask (causal(), window(...), padding(...), ... "
                         f"combined with &) or None, got {type(mask).__name__}; a boolean array goes in "
                         f"masks.keep(array)")
    return mask


def replace_spec(mask: Mask, **changes: Any) -> Mask:
    return dataclasses.replace(mask, spec=dataclasses.replace(mask.spec, **changes))
