"""One attention call in logical float64 form, and the score/softmax steps shared by every path.

:func:`load` reads the operands once: Q as ``(B, N, T, H)``, K and V gathered from the pages when
paged and repeated to the ``N`` query heads (query head ``h`` reads K/V head ``h // (N // K)``), the
bias, the sink, the segments and the admissible-key mask.  Tokens outside every segment are zeroed,
so that garbage there (NaN-poisoned padding, unused cache blocks) cannot leak into the results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cudnn_attn.core.config import AttentionConfig, AttentionOperands
from cudnn_attn.tracing.score_mod import apply

from . import masks
from .segments import SegmentTable, segments_of
from .tensors import as_float64, gather_pages, to_logical


@dataclass(frozen=True)
class Problem:
    """The float64 tensors of one call (logical layouts, K/V per query head) and its geometry."""
    config: AttentionConfig
    segments: SegmentTable
    q: np.ndarray                  # (B, N, T, H)   zero outside the segments
    k: np.ndarray                  # (B, N, S, H)   repeated to the query heads
    v: np.ndarray                  # (B, N, S, Hv)
    allowed: np.ndarray            # (B, 1, T, S)   bool
    bias: np.ndarray | None        # (1|B, 1|N, T, S)
    sink: np.ndarray | None        # (N,)
    score_mod_args: tuple[Any, ...]

    def zero_invalid_q(self, x: np.ndarray) -> np.ndarray:
        """Zero the query tokens (axis 2 of a logical ``(B, N, T, ...)`` tensor) outside every segment."""
        return np.where(self.segments.valid_q[:, None, :, None], x, 0.0)

    def zero_invalid_kv(self, x: np.ndarray) -> np.ndarray:
        """Zero the key tokens (axis 2 of a logical ``(B, heads, S, ...)`` tensor) outside every segment."""
        return np.where(self.segments.valid_kv[:, None, :, None], x, 0.0)

    def read_q_like(self, x: Any) -> np.ndarray:
        """A physical O/dO-like array -> logical ``(B, N, T, D)`` float64, zero outside the segments."""
        return self.zero_invalid_q(to_logical(x, self.config.layout))

    def api_logsumexp(self, lse: np.ndarray) -> np.ndarray:
        """Per-token ``(B, N, T)`` logsumexp -> the float32 ``config.lse_shape`` result (0 outside)."""
        lse = np.where(self.segments.valid_q[:, None, :], lse, 0.0)
        return self.segments.pack_lse(lse).astype(np.float32)

    def token_logsumexp(self, logsumexp: Any) -> np.ndarray:
        """The ``config.lse_shape`` logsumexp of a forward -> per-token ``(B, N, T)`` float64, ``-inf``
        outside the segments (so that no probability or sink share arises there)."""
        lse = self.segments.unpack_lse(as_float64(logsumexp))
        return np.where(self.segments.valid_q[:, None, :], lse, -np.inf)

    def sum_query_groups(self, x: np.ndarray) -> np.ndarray:
        """``(B, N, S, D)`` per query head -> ``(B, K, S, D)`` per K/V head (the GQA group sum)."""
        b, n, s, d = x.shape
        return x.reshape(b, self.config.kv_heads, n // self.config.kv_heads, s, d).sum(axis=2)


def _keys_and_values(config: AttentionConfig, operands: AttentionOperands) -> tuple[np.ndarray, np.ndarray]:
    if config.paging is None:
        return to_logical(operands.key, config.layout), to_logical(operands.value, config.layout)
    kv_lengths = np.asarray(operands.kv_seqlen).astype(np.int64)
    return (gather_pages(operands.key, operands.page_table_k, kv_lengths, config.layout),
            gather_pages(operands.value, operands.page_table_v, kv_lengths, config.layout))


def load(config: AttentionConfig, operands: AttentionOperands) -> Problem:
    """Read ``operands`` (described by ``config``) into a :class:`Problem`."""
    segments = segments_of(config, operands)
    k, v = _keys_and_values(config, operands)
    valid_q = segments.valid_q[:, None, :, None]
    valid_kv = segments.valid_kv[:, None, :, None]
    group = config.q_heads // config.kv_heads
    return Problem(
        config=config, segments=segments,
        q=np.where(valid_q, to_logical(operands.query, config.layout), 0.0),
        k=np.repeat(np.where(valid_kv, k, 0.0), group, axis=1),
        v=np.repeat(np.where(valid_kv, v, 0.0), group, axis=1),
        allowed=masks.allowed(config, segments),
        bias=None if operands.bias is None else as_float64(operands.bias),
        sink=None if operands.sink is None else as_float64(operands.sink),
        score_mod_args=tuple(np.asarray(a) for a in operands.score_mod_args),
    )


def scores(problem: Problem, qk_scale: float) -> tuple[np.ndarray, np.ndarray | None]:
    """The masked scores ``(B, N, T, S)`` and, with a ``score_mod``, its float32 input.

    ``s = qk_scale * q.k + bias + alibi``; then ``s = score_mod(float32(s), *score_mod_args)``; then
    ``-inf`` wherever the key is not admissible.
    """
    config = problem.config
    s = qk_scale * np.einsum("bnth,bnsh->bnts", problem.q, problem.k)
    if problem.bias is not None:
        s = s + problem.bias
    if config.mask.alibi:
        s = s + masks.alibi_bias(config, problem.segments)
    score_input = None
    if config.score_mod is not None:
        score_input = s.astype(np.float32)
        s = apply(config.score_mod, score_input, problem.score_mod_args).astype(np.float64)
    return np.where(problem.allowed, s, -np.inf), score_input


def softmax(s: np.ndarray, sink: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``P`` and the natural-log ``lse`` of masked scores ``s`` (``-inf`` = excluded).

    ``lse = ln(sum_j exp(s_j) [+ exp(sink_h)])`` and ``P_j = exp(s_j - lse)``: the sink joins the
    denominator (and so the logsumexp, as in cuDNN) but has no value row.  A row without any term has
    ``P = 0`` and ``lse = -inf``.
    """
    m = s.max(axis=-1)
    if sink is not None:
        m = np.maximum(m, sink[None, :, None])
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m[..., None])
    total = e.sum(axis=-1)
    if sink is not None:
        total = total + np.exp(sink[None, :, None] - m)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(total[..., None] > 0, e / total[..., None], 0.0)
        lse = np.where(total > 0, m + np.log(total), -np.inf)
    return p, lse


def probabilities(s: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """``P = exp(s - lse)`` from the forward's logsumexp, as the backward kernels recompute it (0 where
    the score is excluded or the row has no finite logsumexp)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(np.isfinite(s) & np.isfinite(lse)[..., None], np.exp(s - lse[..., None]), 0.0)


def sink_probabilities(sink: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """``(B, N, T)`` share of the sink ``exp(sink_h - lse)`` (0 where the logsumexp is not finite)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(np.isfinite(lse), np.exp(sink[None, :, None] - lse), 0.0)
