"""Masks of the native API, built by factories and combined with ``&``.

``mask=causal() & window(128, 0) & padding(q_lengths, kv_lengths)``: a :class:`MaskSpec` holds orthogonal
fields, each mapping onto one knob of cuDNN's SDPA (and one field of
:class:`cudnn_attn.core.config.StaticMask`, the static part of the configuration).  For query ``i`` and key ``j``
(with ``alignment="bottom_right"`` the diagonal of each sequence moves by ``S_b - T_b``):

* :func:`causal` - keys ``j <= i``;
* :func:`window` ``(left, right)`` - keys ``i - left <= j <= i + right`` (``jax.nn``'s ``local_window_size``);
* :func:`padding` ``(q_lengths, kv_lengths)`` - int32 ``(B,)`` lengths: queries ``i >= q_lengths[b]`` and keys
  ``j >= kv_lengths[b]`` do not exist (their output rows come back as zeros);
* :func:`segments` ``(q_lengths, kv_lengths, q_offsets, kv_offsets)`` - packed segments (the seed's
  ``q_offsets``/``kv_offsets``): int32 ``(B, M)`` lengths and ``(B, M + 1)`` offsets; attention stays inside
  a segment;
* :func:`alibi` - cuDNN's ALiBi bias ``m_h * (j - i)`` (cuDNN runs it with :func:`causal`);
* :func:`keep` ``(array)`` - a boolean array broadcastable to ``(B, N, T, S)``, True keeps (folded into the
  bias with a large finite negative number, as JAX does).

``a & b`` keeps a key when both keep it.  Two diagonal bounds intersect (the tighter wins), so
``causal() & window(128, 0)`` is a causal window.  Combining what cannot be intersected by fields - two
different alignments, two windows of different sizes, two sources of lengths, offsets or keep-masks - raises
a :class:`ValueError` naming ``mask``.  Shapes and dtypes of the arrays are checked with the call (they
depend on Q/K/V).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

from .config import DiagonalAlignment, StaticMask

__all__ = ["MaskSpec", "alibi", "causal", "keep", "padding", "segments", "window"]

_ARRAYS = ("q_lengths", "kv_lengths", "q_offsets", "kv_offsets", "keep")


@dataclass(frozen=True, eq=False)
class MaskSpec:
    """A mask of the native API (module doc).  ``right_bound``/``left_bound`` are
    :class:`cudnn_attn.core.config.StaticMask`'s: key ``j`` of query ``i`` is kept iff ``j - i <= right_bound`` and
    ``i - j < left_bound`` (``None``: unbounded).  The arrays are runtime values (``None``: absent)."""

    right_bound: int | None = None
    left_bound: int | None = None
    alignment: DiagonalAlignment = DiagonalAlignment.TOP_LEFT
    alibi: bool = False
    q_lengths: Any = None
    kv_lengths: Any = None
    q_offsets: Any = None
    kv_offsets: Any = None
    keep: Any = None

    @property
    def has_diagonal(self) -> bool:
        return self.right_bound is not None or self.left_bound is not None

    @property
    def has_arrays(self) -> bool:
        return any(getattr(self, name) is not None for name in _ARRAYS)

    @property
    def causal(self) -> bool:
        return self.right_bound == 0

    def __and__(self, other: "MaskSpec") -> "MaskSpec":
        if not isinstance(other, MaskSpec):
            return NotImplemented
        for name in _ARRAYS:
            if getattr(self, name) is not None and getattr(other, name) is not None:
                raise ValueError(f"mask: both sides of & give {name} ({self.describe()} & {other.describe()}); "
                                 "combine the arrays into one factory call")
        if self.has_diagonal and other.has_diagonal and self.alignment is not other.alignment:
            raise ValueError(f"mask: the diagonals are aligned differently ({self.alignment.value} & "
                             f"{other.alignment.value})")
        both_windows = self.left_bound is not None and other.left_bound is not None
        if both_windows and (self.left_bound, self.right_bound) != (other.left_bound, other.right_bound):
            raise ValueError(f"mask: two windows of different sizes ({self.describe()} & {other.describe()}); "
                             "give one window(left, right)")
        first = self if self.has_diagonal else other
        return MaskSpec(right_bound=_tighter(self.right_bound, other.right_bound),
                        left_bound=_tighter(self.left_bound, other.left_bound), alignment=first.alignment,
                        alibi=self.alibi or other.alibi,
                        **{name: _either(getattr(self, name), getattr(other, name)) for name in _ARRAYS})

    def describe(self) -> str:
        """``causal+window(127,0)+padding`` - the parts, for messages."""
        parts = []
        if self.left_bound is not None:
            parts.append(f"window({self.left_bound - 1},{'inf' if self.right_bound is None else self.right_bound})")
        elif self.causal:
            parts.append("causal")
        elif self.right_bound is not None:
            parts.append(f"window(inf,{self.right_bound})")
        if self.has_diagonal and self.alignment is DiagonalAlignment.BOTTOM_RIGHT:
            parts.append("bottom_right")
        if self.alibi:
            parts.append("alibi")
        if self.q_offsets is not None:
            parts.append("segments")
        elif self.q_lengths is not None:
            parts.append("padding")
        if self.keep is not None:
            parts.append("keep")
        return "+".join(parts) or "none"

    def __repr__(self) -> str:
        return f"MaskSpec({self.describe()})"

    # -- onto the configuration ------------------------------------------------------------------------
    def seed_arrays(self) -> dict[str, Any]:
        """The arrays as the seed's arguments (``q_seqlen``, ``kv_seqlen``, ``q_offsets``, ``kv_offsets``, and the
        boolean ``mask``) for :func:`cudnn_attn.core.validation.validate_call`."""
        return dict(q_seqlen=self.q_lengths, kv_seqlen=self.kv_lengths, q_offsets=self.q_offsets,
                    kv_offsets=self.kv_offsets, mask=self.keep)

    def static(self, padding: bool) -> StaticMask:
        """The configuration's mask fields (``padding``: the call has lengths, packing or paging)."""
        return StaticMask(right_bound=self.right_bound, left_bound=self.left_bound,
                          alignment=self.alignment if self.has_diagonal else DiagonalAlignment.TOP_LEFT,
                          padding=padding, alibi=self.alibi)


def _tighter(x: int | None, y: int | None) -> int | None:
    return y if x is None else x if y is None else min(x, y)


def _either(x: Any, y: Any) -> Any:
    return y if x is None else x


def _alignment(alignment: Any) -> DiagonalAlignment:
    try:
        return DiagonalAlignment(alignment)
    except ValueError:
        raise ValueError(f"mask: alignment must be 'top_left' or 'bottom_right', got {alignment!r}") from None


def _count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"mask: window {name} must be an int >= 0, got {value!r}")
    return int(value)


def _present(factory: str, **arrays: Any) -> dict[str, Any]:
    missing = [name for name, x in arrays.items() if x is None]
    if missing:
        raise ValueError(f"mask: {factory}(...) needs {', '.join(arrays)}; missing {', '.join(missing)}")
    return arrays


# -- factories -------------------------------------------------------------------------------------------

def causal(alignment: str = "top_left") -> MaskSpec:
    """Keys ``j <= i`` (``j <= i + S - T`` with ``alignment="bottom_right"``)."""
    return MaskSpec(right_bound=0, alignment=_alignment(alignment))


def window(left: int, right: int, *, alignment: str = "top_left") -> MaskSpec:
    """Keys ``i - left <= j <= i + right``: ``left`` keys before the diagonal and ``right`` after it
    (``window(w - 1, 0)`` is the seed's ``sliding_window_length=w``)."""
    return MaskSpec(right_bound=_count("right", right), left_bound=_count("left", left) + 1,
                    alignment=_alignment(alignment))


def padding(q_lengths: Any, kv_lengths: Any) -> MaskSpec:
    """Per-sequence lengths, int32 ``(B,)`` each (the full length where a side is not padded)."""
    return MaskSpec(**_present("padding", q_lengths=q_lengths, kv_lengths=kv_lengths))


def segments(q_lengths: Any, kv_lengths: Any, q_offsets: Any, kv_offsets: Any) -> MaskSpec:
    """Packed segments: lengths int32 ``(B, M)``, offsets int32 ``(B, M + 1)`` (the seed's; ``-1`` marks an
    absent segment)."""
    return MaskSpec(**_present("segments", q_lengths=q_lengths, kv_lengths=kv_lengths, q_offsets=q_offsets,
                               kv_offsets=kv_offsets))


def alibi() -> MaskSpec:
    """cuDNN's ALiBi bias ``m_h * (j - i)`` with the standard head slopes (combine with :func:`causal`)."""
    return MaskSpec(alibi=True)


def keep(mask: Any) -> MaskSpec:
    """A boolean array broadcastable to ``(B, N, T, S)``; True keeps the key."""
    _present("keep", mask=mask)
    return MaskSpec(keep=mask)


def as_mask(mask: Any) -> MaskSpec:
    """``None`` (no mask) or a :class:`MaskSpec`, checked."""
    if mask is None:
        return MaskSpec()
    if not isinstance(mask, MaskSpec):
        raise ValueError(f"mask: expected a MaskSpec (causal(), window(l, r), padding(...), segments(...), alibi(), "
                         f"keep(array), combined with &) or None, got {type(mask).__name__}")
    return mask
