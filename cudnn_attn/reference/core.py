"""Forward and backward of fp16/bf16 attention in float64 (FP8 calls go to :mod:`.fp8`).

Per batch row ``b``, query head ``h`` (reading K/V head ``h // (N // K)``), query ``i``, key ``j``::
    s_ij   = score_mod(scale * q_i . k_j + bias_ij + alibi_ij)   masked to -inf where not admissible
    lse_i  = ln(sum_j exp(s_ij) [+ exp(sink_h)])
    P_ij   = exp(s_ij - lse_i)
    O_i    = sum_j P_ij * keep_ij / (1 - p) * v_j

and backward, for an incoming gradient ``dO``::
    dP_ij  = dO_i . v_j * keep_ij / (1 - p)
    D_i    = dO_i . O_i
    dS_ij  = P_ij * (dP_ij - D_i)                    (through score_mod's vjp when there is one)
    dq_i   = scale * sum_j dS_ij k_j      dk_j = scale * sum_i dS_ij q_i      dv_j = sum_i P_ij keep_ij / (1 - p) dO_i
    dbias  = dS summed over the broadcast dimensions of the bias
    dsink_h = -sum_{b, i} exp(sink_h - lse_i) * D_i

dk/dv are summed over the query heads sharing a K/V head.  Conventions: query tokens outside every
segment (``t >= q_seqlen[b]``, gaps between packed segments) have output, logsumexp and dq 0; key
tokens outside have dk = dv = 0.  A query without any admissible key (e.g. bottom-right causal with
``T > S``, ``kv_seqlen[b] == 0``) gets output 0 and logsumexp ``-inf``, as every front returns it.  A row
that the boolean mask keeps no key of averages V (:mod:`cudnn_attn.core.masked_rows`, as ``jax.nn``'s XLA
path; the formula above would give the softmax of its scores next to the large negative bias).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cudnn_attn.core import masked_rows
from cudnn_attn.core.config import AttentionConfig, AttentionOperands
from cudnn_attn.tracing.score_mod import vjp
from cudnn_attn.core.support import check_everywhere
from cudnn_attn.core.types import AttentionGrads, AttentionOutput, Kind
from cudnn_attn.core.validation import check_seed

from . import fp8, masks
from .problem import Problem, load, probabilities, scores, sink_probabilities, softmax
from .tensors import as_float64, cast, io_dtype, to_physical


def _dropout(config: AttentionConfig, operands: AttentionOperands, seed: int,
             dropout_mask: Any) -> np.ndarray | float:
    """The factor ``keep / (1 - p)`` applied to P (1.0 without dropout)."""
    entropy = seed if dropout_mask is not None else masks.dropout_entropy(config, operands, seed)
    keep = masks.dropout_keep(config, entropy, dropout_mask)
    return 1.0 if keep is None else keep / (1.0 - config.dropout_rate)


def forward(config: AttentionConfig, operands: AttentionOperands, *, seed: int = 42,
            dropout_mask: Any = None) -> AttentionOutput:
    """Attention forward (formula in the module docstring) on NumPy arrays.

    Args:
        config, operands: the call, as built by :func:`cudnn_attn.core.validation.validate_call`.
        seed: seeds the NumPy dropout mask when ``dropout_mask`` is absent (not cuDNN's Philox).
        dropout_mask: optional ``(B, N, T, S)`` keep-mask (nonzero keeps), e.g. cuDNN's ``rng_dump``.

    Returns:
        :class:`AttentionOutput`: ``output`` in the query's layout and io dtype; ``logsumexp`` float32
        ``config.lse_shape`` when ``config.training``; ``score_max``/``max_logit`` when ``config.score_max``;
        ``amax_s``/``amax_o`` for FP8.

    Raises:
        ValueError: a bad ``seed``, or sequence lengths, offsets or page-table entries that do not describe
            the call (:func:`cudnn_attn.core.values.check`).
        UnsupportedConfigurationError: what no backend runs (:func:`cudnn_attn.core.support.check_everywhere`).
    """
    seed = check_seed(seed)
    check_everywhere(config, kind=Kind.FORWARD)
    if config.fp8:
        return fp8.forward(config, operands, dropout_mask)
    problem = load(config, operands)
    s, _ = scores(problem, config.scale)
    p, lse = softmax(s, problem.sink)
    o = np.einsum("bnts,bnsd->bntd", p * _dropout(config, operands, seed, dropout_mask), problem.v)
    output = to_physical(problem.zero_invalid_q(o), config.layout, np.float64)
    logsumexp = problem.api_logsumexp(lse) if config.training else None
    output, logsumexp = masked_rows.forward_output(np, config, operands, output, logsumexp, np.float64)
    score_max = max_logit = None
    if config.score_max:                 # the row maxima of the admissible scores (-inf where there are none)
        score_max = masked_rows.masked_score_max(np, config, operands, np.max(s, axis=-1).astype(np.float32))
        max_logit = masked_rows.max_logit(np, score_max)
    return AttentionOutput(output=cast(output, io_dtype(config)), logsumexp=logsumexp, score_max=score_max,
                           max_logit=max_logit)


def _score_mod_vjp(problem: Problem, score_input: np.ndarray, ds: np.ndarray) -> np.ndarray:
    """Pull ``ds`` (gradient w.r.t. the modified score) back through ``score_mod`` (its traced VJP)."""
    return vjp(problem.config.score_mod, score_input, ds, problem.score_mod_args).astype(np.float64)


def _bias_gradient(ds: np.ndarray, bias_shape: tuple[int, ...]) -> np.ndarray:
    """``dS`` summed over the dimensions the bias broadcasts (its size-1 batch/head dimensions)."""
    return ds.sum(axis=tuple(axis for axis in (0, 1) if bias_shape[axis] == 1), keepdims=True)


def backward(config: AttentionConfig, operands: AttentionOperands, output: Any, grad_output: Any,
             logsumexp: Any, *, seed: int = 42, dropout_mask: Any = None) -> AttentionGrads:
    """Attention backward (formula in the module docstring), as cuDNN computes it: P is recomputed
    from the given ``logsumexp`` and ``D`` from the given ``output``.

    Args:
        output, grad_output: O and dO in the query's layout (``config.o_shape``).
        logsumexp: the forward's float32 ``config.lse_shape`` logsumexp.
        seed, dropout_mask: as for :func:`forward` (they must reproduce the forward's mask).

    Returns:
        :class:`AttentionGrads`: dq/dk/dv in the layout and io dtype of Q/K/V; ``dbias`` (bias dtype and
        shape) when ``config.has_dbias``; ``dsink`` float32 ``(N,)`` when ``config.sink``; FP8 amax values.

    Raises:
        ValueError: as for :func:`forward`.
        UnsupportedConfigurationError: paged K/V (cuDNN has no paged backward either), FP8 refusals.
    """
    seed = check_seed(seed)
    check_everywhere(config, kind=Kind.BACKWARD)
    if config.fp8:
        return fp8.backward(config, operands, output, grad_output, logsumexp, dropout_mask)
    problem = load(config, operands)
    kernel_do, logsumexp = masked_rows.backward_residuals(np, config, operands, as_float64(grad_output),
                                                          as_float64(logsumexp))
    o, do = problem.read_q_like(output), problem.read_q_like(kernel_do)
    lse = problem.token_logsumexp(logsumexp)

    s, score_input = scores(problem, config.scale)
    p = probabilities(s, lse)
    drop = _dropout(config, operands, seed, dropout_mask)
    dp = np.einsum("bntd,bnsd->bnts", do, problem.v) * drop
    delta = np.einsum("bntd,bntd->bnt", do, o)
    ds = p * (dp - delta[..., None])
    if config.score_mod is not None:
        ds = np.where(problem.allowed, _score_mod_vjp(problem, score_input, ds), 0.0)

    dq = config.scale * np.einsum("bnts,bnsh->bnth", ds, problem.k)
    dk = config.scale * np.einsum("bnts,bnth->bnsh", ds, problem.q)
    dv = np.einsum("bnts,bntd->bnsd", p * drop, do)
    dv = to_physical(problem.zero_invalid_kv(problem.sum_query_groups(dv)), config.layout, np.float64)
    dtype = io_dtype(config)
    grads = AttentionGrads(
        dq=to_physical(problem.zero_invalid_q(dq), config.layout, dtype),
        dk=to_physical(problem.zero_invalid_kv(problem.sum_query_groups(dk)), config.layout, dtype),
        dv=cast(masked_rows.backward_dv(np, config, operands, as_float64(grad_output), dv, np.float64), dtype),
    )
    if config.has_dbias:
        bias = np.asarray(operands.bias)
        grads = grads._replace(dbias=cast(_bias_gradient(ds, bias.shape), bias.dtype))
    if config.sink:
        dsink = -(sink_probabilities(problem.sink, lse) * delta).sum(axis=(0, 2))
        grads = grads._replace(dsink=dsink.astype(np.float32))
    return grads
