"""Query rows that the boolean mask leaves without a key: one semantics on every front.

A *fully masked row* is a query row whose keys are all False in the boolean ``mask`` (``keep(...)``), or
whose kept keys the other masks (causal diagonal, window, lengths) all exclude, while they admit some.  It
gets what ``jax.nn.dot_product_attention``'s XLA path computes (it combines all masks into one), a uniform
average:

* output: the mean of V over the keys of its sequence (all ``S`` keys; the first ``kv_seqlen[b]`` with a
  padding mask), per query head from its K/V head;
* logsumexp: ``-inf`` (the row has no key, like a row that the lengths or the diagonal leave none);
* gradients: nothing to dq, dk, dbias and dsink; every key ``s`` of its sequence gets ``dv += dO_row / L``
  (``L`` keys).

The kernels cannot give it through the bias: a mask becomes ``LARGE_NEGATIVE`` (``-2**41`` bf16,
``-2**15`` fp16), and float32 scores next to ``-2**15`` keep their differences, so an fp16 row is a softmax
of its scores rather than the mean.  So :func:`~cudnn_attn.core.validation.validate_call` keeps the boolean mask
next to the bias it folds it into (``AttentionOperands.keep_mask``), and the fronts find the rows
(:func:`empty_rows`, with the call's final mask fields: the native API sets them after validation) and fix
their results here, for any array namespace ``xp`` (``numpy``, ``cupy``, ``jax.numpy``): :func:`forward_output`
after a forward; :func:`backward_residuals` before a backward kernel and :func:`backward_dv` after it.
Packed segments take no mask (the support table), so rows are per batch row.

A row that the lengths or the diagonal bounds leave without any admissible key (``kv_seqlen[b] == 0``, a
bottom-right diagonal with more queries than keys, a window past the keys) has output 0 and logsumexp
``-inf`` on every front: :func:`keyless_logsumexp` sets it after a launch.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from .config import AttentionConfig, AttentionOperands, DiagonalAlignment, StaticMask
from .types import AttentionLayout

# The logsumexp a backward kernel is given for a fully masked row: exp(score - lse) is then exactly 0 for
# every key (with the row's dO set to 0, the row contributes nothing), while -inf there gives inf * 0.
# 2**100 stays finite after cuDNN's multiplication by log2(e).
NO_PROBABILITY_LSE = float(2 ** 100)


def empty_rows(xp: Any, keep: Any, mask: StaticMask, q_seqlen: Any = None, kv_seqlen: Any = None,
               packed: bool = False) -> Any:
    """``(1|B, 1|N, T)`` bool: the rows of a 4-D boolean ``keep`` mask (True keeps) that the other masks (the
    causal diagonal, a window, the lengths of a padding mask: :func:`_key_window`) admit keys to, none of them
    kept.  A mask that keeps only keys the diagonal excludes leaves the row as empty as one of all False; a row
    the other masks admit no key to is not one of these (it has output 0).  (Packed segments take no mask on
    any front, the support table's refusal: there only ``keep`` is read.)"""
    if packed or not (mask.padding or mask.right_bound is not None or mask.left_bound is not None):
        return ~xp.any(keep, axis=-1)
    q_len, kv_len = keep.shape[2], keep.shape[3]
    first, last, _ = _key_window(xp, mask, q_len, kv_len, q_seqlen, kv_seqlen)             # (1|B, 1, T)
    keys = xp.arange(kv_len, dtype=xp.int32)
    admitted = (keys >= first[..., None]) & (keys <= last[..., None])                      # (1|B, 1, T, S)
    return ~xp.any(keep & admitted, axis=-1) & (first <= last)


def _key_counts(xp: Any, config: AttentionConfig, operands: AttentionOperands) -> Any:
    """``(B,)`` int32: the keys of each batch row's sequence."""
    if config.mask.padding:
        return xp.clip(xp.reshape(operands.kv_seqlen, (-1,)).astype(xp.int32), 0, config.kv_len)
    return xp.full((config.batch,), config.kv_len, dtype=xp.int32)


def _query_rows(xp: Any, config: AttentionConfig, operands: AttentionOperands) -> Any:
    """``(B, 1, T)`` bool: the query rows inside the sequences."""
    rows = xp.arange(config.q_len, dtype=xp.int32)[None, None, :]
    if not config.mask.padding:
        return xp.broadcast_to(rows >= 0, (config.batch, 1, config.q_len))
    return rows < xp.reshape(operands.q_seqlen, (-1, 1, 1)).astype(xp.int32)


def _logical_values(xp: Any, config: AttentionConfig, operands: AttentionOperands, counts: Any) -> Any:
    """V as ``(B, S, K, Hv)``: transposed from BNTH, gathered through the page table when paged (blocks that
    hold no key of the sequence read block 0)."""
    value = operands.value
    if config.layout is AttentionLayout.BNTH:
        value = xp.swapaxes(value, 1, 2)
    if config.paging is None:
        return value
    block = config.paging.block_size
    table = xp.reshape(operands.page_table_v, (config.batch, -1)).astype(xp.int32)
    used = xp.arange(table.shape[1], dtype=xp.int32)[None, :] * block < counts[:, None]
    blocks = value[xp.where(used, table, 0)]               # (B, blocks_per_seq, block_size, K, Hv)
    return xp.reshape(blocks, (config.batch, -1) + tuple(blocks.shape[3:]))


def _per_query_head(xp: Any, config: AttentionConfig, x: Any) -> Any:
    """``(B, K, ...)`` per K/V head -> ``(B, N, ...)`` per query head (head ``h`` reads ``h // (N // K)``)."""
    return xp.repeat(x, config.q_heads // config.kv_heads, axis=1)


def _rows(xp: Any, config: AttentionConfig, operands: AttentionOperands) -> Any:
    """``(B, N, T)`` bool: the fully masked rows inside the sequences."""
    empty = empty_rows(xp, operands.keep_mask, config.mask, operands.q_seqlen, operands.kv_seqlen,
                       config.packing is not None)
    empty = xp.broadcast_to(empty, (config.batch, config.q_heads, config.q_len))
    return empty & _query_rows(xp, config, operands)


def _physical(config: AttentionConfig, x: Any, xp: Any) -> Any:
    """A logical ``(B, N, T, ...)`` array in the layout of Q/O."""
    return xp.swapaxes(x, 1, 2) if config.layout is AttentionLayout.BTNH else x


def forward_output(xp: Any, config: AttentionConfig, operands: AttentionOperands, output: Any,
                   logsumexp: Any = None, compute_dtype: Any = np.float32) -> tuple[Any, Any]:
    """``(output, logsumexp)`` of a forward with the fully masked rows set: the mean of V, ``-inf``.

    ``output`` in the layout of Q, ``logsumexp`` ``(B, N, T)`` or ``None``; the mean is computed in
    ``compute_dtype``.  Without a boolean mask (``operands.keep_mask is None``) both are returned as given.
    """
    if operands.keep_mask is None:
        return output, logsumexp
    counts = _key_counts(xp, config, operands)
    values = _logical_values(xp, config, operands, counts)                      # (B, S, K, Hv)
    keys = xp.arange(values.shape[1], dtype=xp.int32)[None, :, None, None] < counts[:, None, None, None]
    total = xp.sum(xp.where(keys, values.astype(compute_dtype), xp.zeros((), compute_dtype)), axis=1)
    mean = total / xp.maximum(counts, 1).astype(compute_dtype)[:, None, None]   # (B, K, Hv)
    mean = _per_query_head(xp, config, mean)[:, :, None, :]                     # (B, N, 1, Hv)
    rows = _rows(xp, config, operands)
    fixed = _physical(config, xp.where(rows[..., None], mean, xp.zeros((), compute_dtype)), xp)
    output = xp.where(_physical(config, rows[..., None], xp), fixed.astype(output.dtype), output).astype(output.dtype)
    if logsumexp is not None:
        logsumexp = xp.where(rows, xp.full((), -np.inf, dtype=logsumexp.dtype), logsumexp)
    return output, logsumexp


def backward_residuals(xp: Any, config: AttentionConfig, operands: AttentionOperands, grad_output: Any,
                       logsumexp: Any) -> tuple[Any, Any]:
    """``(grad_output, logsumexp)`` for a backward kernel: on the fully masked rows dO = 0 and the logsumexp
    :data:`NO_PROBABILITY_LSE`, so that those rows add nothing to dq, dk, dv, dbias or dsink."""
    if operands.keep_mask is None:
        return grad_output, logsumexp
    rows = _rows(xp, config, operands)
    grad_output = xp.where(_physical(config, rows[..., None], xp), xp.zeros((), grad_output.dtype),
                           grad_output).astype(grad_output.dtype)
    logsumexp = xp.where(rows, xp.full((), NO_PROBABILITY_LSE, dtype=logsumexp.dtype), logsumexp)
    return grad_output, logsumexp


def backward_dv(xp: Any, config: AttentionConfig, operands: AttentionOperands, grad_output: Any, dv: Any,
                compute_dtype: Any = np.float32) -> Any:
    """``dv`` (the layout of V) plus the fully masked rows' share: ``dO_row / L`` on each of the ``L`` keys of
    the row's sequence, summed over the rows and the query heads of each K/V head."""
    if operands.keep_mask is None:
        return dv
    rows = _rows(xp, config, operands)
    do = grad_output if config.layout is AttentionLayout.BNTH else xp.swapaxes(grad_output, 1, 2)
    do = xp.where(rows[..., None], do.astype(compute_dtype), xp.zeros((), compute_dtype))      # (B, N, T, Hv)
    per_head = xp.sum(do, axis=2)                                                               # (B, N, Hv)
    group = config.q_heads // config.kv_heads
    per_kv_head = xp.sum(xp.reshape(per_head, (config.batch, config.kv_heads, group, -1)), axis=2)
    counts = _key_counts(xp, config, operands)
    share = per_kv_head / xp.maximum(counts, 1).astype(compute_dtype)[:, None, None]          # (B, K, Hv)
    keys = xp.arange(config.kv_len, dtype=xp.int32)[None, None, :, None] < counts[:, None, None, None]
    add = xp.where(keys, share[:, :, None, :], xp.zeros((), compute_dtype))                   # (B, K, S, Hv)
    if config.layout is AttentionLayout.BTNH:
        add = xp.swapaxes(add, 1, 2)
    return (dv.astype(compute_dtype) + add).astype(dv.dtype)


@functools.lru_cache(maxsize=1024)
def kernel_gives_the_mean(config: AttentionConfig) -> bool:
    """Whether cuDNN's own forward output of a fully masked row already is the mean of V over all ``S`` keys, and
    no logsumexp is returned: then :func:`set_forward` has nothing to set.

    In bfloat16 the folded mask is ``-2**41``, and a float32 score next to it keeps 24 bits: any score of magnitude
    below ``2**17`` vanishes, so every score of such a row is ``-2**41`` and its softmax uniform over the keys the
    kernel admits - all ``S`` when no length, diagonal, window, ALiBi, sink, dropout or score_mod shapes the row
    (and a bias beside the mask could be large enough to survive).  A kept key's score is unchanged by the same
    rounding rule as every masked key's, so a partly masked row is unaffected.  Pinned on the GPU by
    ``tests/gpu/test_masked_rows_gpu.py``; fp16's ``-2**15`` keeps the scores' differences and always needs the
    fix."""
    mask = config.mask
    return (config.dtype == "bfloat16" and not config.training and config.bias is not None
            and not config.bias.differentiable and not mask.padding and mask.right_bound is None
            and mask.left_bound is None and not mask.alibi and not config.has_dropout and not config.sink
            and config.score_mod is None and config.packing is None and config.paging is None)


def set_forward(xp: Any, config: AttentionConfig, operands: AttentionOperands, output: Any,
                logsumexp: Any = None) -> None:
    """:func:`forward_output` written into ``output`` and ``logsumexp`` (CuPy arrays after a cuDNN forward; nothing
    to write where :func:`kernel_gives_the_mean`)."""
    if operands.keep_mask is None or kernel_gives_the_mean(config):
        return
    fixed, fixed_lse = forward_output(xp, config, operands, output, logsumexp)
    output[...] = fixed
    if logsumexp is not None:
        logsumexp[...] = fixed_lse


def add_dv(xp: Any, config: AttentionConfig, operands: AttentionOperands, grad_output: Any, dv: Any) -> None:
    """:func:`backward_dv` written into ``dv`` (NumPy or CuPy arrays); ``grad_output`` is the caller's dO."""
    if operands.keep_mask is not None:
        dv[...] = backward_dv(xp, config, operands, grad_output, dv)


@functools.lru_cache(maxsize=1024)
def may_leave_rows_without_keys(config: AttentionConfig) -> bool:
    """Whether the lengths or diagonal bounds of a call can leave a query row no admissible key (remembered per
    configuration: the CuPy front asks on every call)."""
    if config.mask.padding:
        return True                                   # a length (of a sequence or a packed segment) may be 0
    if config.mask.right_bound is None and config.mask.left_bound is None:
        return False
    return bool(rows_without_keys(np, config).any())


def _key_window(xp: Any, mask: StaticMask, q_len: int, kv_len: int, q_seqlen: Any = None,
                kv_seqlen: Any = None) -> tuple[Any, Any, Any]:
    """``(first, last, lengths)``, each ``(R|1, 1, T)`` int32: query ``i`` of a row may read the keys
    ``first <= j <= last``; ``lengths`` the row's queries.

    ``R`` sequences of lengths ``q_seqlen``/``kv_seqlen`` (``(R,)``) with a padding mask, else one row of
    ``q_len`` queries and ``kv_len`` keys.  With the lengths ``Lq``, ``Lk`` of the row's sequence and ``delta =
    Lk - Lq`` (bottom-right) or 0: ``first = max(0, i + delta - left_bound + 1)``, ``last = min(Lk - 1, i + delta
    + right_bound)`` (the :class:`~cudnn_attn.core.config.StaticMask` rule, an absent bound dropped).
    """
    rows = xp.arange(q_len, dtype=xp.int32)[None, None, :]
    if mask.padding:
        lengths = xp.clip(xp.reshape(q_seqlen, (-1, 1, 1)).astype(xp.int32), 0, q_len)
        keys = xp.clip(xp.reshape(kv_seqlen, (-1, 1, 1)).astype(xp.int32), 0, kv_len)
    else:
        lengths = xp.full((1, 1, 1), q_len, dtype=xp.int32)
        keys = xp.full((1, 1, 1), kv_len, dtype=xp.int32)
    diagonal = rows + (keys - lengths if mask.alignment is DiagonalAlignment.BOTTOM_RIGHT else 0)
    last = keys - 1 + 0 * rows
    if mask.right_bound is not None:
        last = xp.minimum(last, diagonal + mask.right_bound)
    first = xp.zeros_like(last)
    if mask.left_bound is not None:
        first = xp.maximum(first, diagonal - mask.left_bound + 1)
    return first, last, lengths


def rows_without_keys(xp: Any, config: AttentionConfig, q_seqlen: Any = None, kv_seqlen: Any = None) -> Any:
    """``(R, 1, T)`` bool: the query rows inside the sequences that no key is admissible to (:func:`_key_window`).

    ``R`` is the number of lengths with a padding mask - the batch rows, or with packed segments the rows of
    the logsumexp, one per segment - else ``B``.
    """
    first, last, lengths = _key_window(xp, config.mask, config.q_len, config.kv_len, q_seqlen, kv_seqlen)
    rows = (first > last) & (xp.arange(config.q_len, dtype=xp.int32)[None, None, :] < lengths)
    return rows if config.mask.padding else xp.broadcast_to(rows, (config.batch, 1, config.q_len))


def keyless_logsumexp(xp: Any, config: AttentionConfig, logsumexp: Any, q_seqlen: Any = None,
                      kv_seqlen: Any = None, segments: Any = None) -> Any:
    """The logsumexp (``config.lse_shape``) with ``-inf`` on the rows of :func:`rows_without_keys` (unchanged
    when :func:`may_leave_rows_without_keys` is False).  With packed segments the lengths are the segments'
    (``segments``: the :class:`cudnn_attn.graphs.packing.RaggedSegments` of the call, ``(B*M,)`` lengths)."""
    if not may_leave_rows_without_keys(config):
        return logsumexp
    if config.packing is not None:
        q_seqlen, kv_seqlen = segments.q_seqlen, segments.kv_seqlen
    rows = rows_without_keys(xp, config, q_seqlen, kv_seqlen)
    return xp.where(rows, xp.full((), -np.inf, dtype=logsumexp.dtype), logsumexp)


def silent_rows_lse(xp: Any, config: AttentionConfig, grad_output: Any, logsumexp: Any) -> Any:
    """The backward's logsumexp with :data:`NO_PROBABILITY_LSE` on every query row whose ``grad_output`` row is all
    zero (a row fixed outside the kernel, whose cotangent the fix-up zeroed).  Such a row adds nothing to any
    gradient, but under a boolean mask's large negative bias the kernel's recomputed scores can differ from the
    forward's by more than ``exp`` survives (the H200 gave NaN dq with the forward's own logsumexp there): with this
    logsumexp its probabilities are 0.  Not for packed calls (their logsumexp is per segment)."""
    if config.packing is not None:
        return logsumexp
    silent = xp.all(grad_output == 0, axis=-1)                           # (B, T, N) or (B, N, T)
    if config.layout is AttentionLayout.BTNH:
        silent = xp.swapaxes(silent, 1, 2)
    return xp.where(silent, xp.full((), NO_PROBABILITY_LSE, dtype=logsumexp.dtype), logsumexp)


def keyless_score_max(xp: Any, config: AttentionConfig, score_max: Any, q_seqlen: Any = None,
                      kv_seqlen: Any = None) -> Any:
    """The ``(B, N, T)`` row maxima of the scaled scores with ``-inf`` on the rows of padded queries (which cuDNN
    leaves unwritten) and on the rows of :func:`rows_without_keys`."""
    rows = None
    if config.mask.padding:
        rows = ~(xp.arange(config.q_len, dtype=xp.int32)[None, None, :] < q_seqlen.reshape(-1, 1, 1))
    if may_leave_rows_without_keys(config):
        keyless = rows_without_keys(xp, config, q_seqlen, kv_seqlen)
        rows = keyless if rows is None else rows | keyless
    if rows is None:
        return score_max
    return xp.where(rows, xp.full((), -np.inf, dtype=score_max.dtype), score_max)


def masked_score_max(xp: Any, config: AttentionConfig, operands: AttentionOperands, score_max: Any) -> Any:
    """``score_max`` of the call ``config`` (as the caller made it, before any lifting) with ``-inf`` on every row
    without an admissible key: :func:`keyless_score_max`'s rows, and the rows a boolean mask keeps no key of
    (whose kernel maximum is the folded mask's large negative value, as is that of a row a folded bottom-right
    diagonal leaves without keys).  ``None`` stays ``None``."""
    if score_max is None:
        return None
    score_max = keyless_score_max(xp, config, score_max, operands.q_seqlen, operands.kv_seqlen)
    if operands.keep_mask is None:
        return score_max
    return xp.where(_rows(xp, config, operands), xp.full((), -np.inf, dtype=score_max.dtype), score_max)


def max_logit(xp: Any, score_max: Any) -> Any:
    """The maximum scaled logit of each query head, float32 ``(N,)``, from the ``(B, N, T)`` row maxima (``-inf``
    for a head without any admissible score)."""
    return xp.max(score_max, axis=(0, 2))
