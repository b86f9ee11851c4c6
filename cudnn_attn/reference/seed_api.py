"""The seed-compatible entry points (JAX's ``dot_product_attention`` / ``paged_attention`` argument
names and defaults) on NumPy arrays, running the reference.

Extensions, keyword-only after the seed's: ``diagonal_alignment`` ("top_left" or "bottom_right"),
``sink`` (float32 ``(N,)`` attention-sink logits) and ``dropout_mask`` (the ``(B, N, T, S)`` keep-mask
to use instead of drawing one from ``seed``).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..types import AttentionGrads, FP8Params, MaskType
from ..validation import validate_call, validate_backward
from .core import backward, forward


def dot_product_attention(
    query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, q_seqlen: Any = None,
    kv_seqlen: Any = None, q_offsets: Any = None, kv_offsets: Any = None, fp8_params: FP8Params | None = None,
    score_mod_args: Sequence[Any] = (), *, scale: float = 1.0, mask_type: MaskType = MaskType.NO_MASK,
    seed: int = 42, dropout_rate: float = 0.0, qkv_layout: str = "BTNH", sliding_window_length: int | None = None,
    score_mod: Callable[..., Any] | None = None, use_fp8: bool = False, return_residual: bool = False,
    diagonal_alignment: str = "top_left", sink: Any = None, dropout_mask: Any = None,
) -> Any:
    """Reference ``dot_product_attention``: returns the output, ``(output, logsumexp)`` with
    ``return_residual``, or ``(output, amax_s, amax_o)`` with ``use_fp8`` (as the seed)."""
    config, operands = validate_call(
        query, key, value, bias, mask, q_seqlen, kv_seqlen, q_offsets, kv_offsets, None, None, fp8_params,
        score_mod_args, sink, scale=scale, mask_type=mask_type, dropout_rate=dropout_rate, qkv_layout=qkv_layout,
        sliding_window_length=sliding_window_length, score_mod=score_mod, use_fp8=use_fp8,
        training=return_residual, diagonal_alignment=diagonal_alignment, xp=np)
    return forward(config, operands, seed=seed, dropout_mask=dropout_mask).seed_form(use_fp8, return_residual)


def paged_attention(
    query: Any, key: Any, value: Any, q_seqlen: Any, kv_seqlen: Any, page_table_k: Any, page_table_v: Any,
    bias: Any = None, mask: Any = None, fp8_params: FP8Params | None = None, *, scale: float = 1.0,
    mask_type: MaskType = MaskType.NO_MASK, seed: int = 42, dropout_rate: float = 0.0, qkv_layout: str = "BTNH",
    sliding_window_length: int | None = None, use_fp8: bool = False, return_residual: bool = False,
    diagonal_alignment: str = "top_left", sink: Any = None, dropout_mask: Any = None,
) -> Any:
    """Reference ``paged_attention``: K/V are block caches read through the page tables; returns the
    output, or ``(output, logsumexp)`` with ``return_residual``."""
    config, operands = validate_call(
        query, key, value, bias, mask, q_seqlen, kv_seqlen, None, None, page_table_k, page_table_v, fp8_params,
        (), sink, scale=scale, mask_type=mask_type, dropout_rate=dropout_rate, qkv_layout=qkv_layout,
        sliding_window_length=sliding_window_length, use_fp8=use_fp8, training=return_residual,
        diagonal_alignment=diagonal_alignment, xp=np)
    return forward(config, operands, seed=seed, dropout_mask=dropout_mask).seed_form(use_fp8, return_residual)


def dot_product_attention_bwd(
    query: Any, key: Any, value: Any, output: Any, grad_output: Any, logsumexp: Any, bias: Any = None,
    mask: Any = None, q_seqlen: Any = None, kv_seqlen: Any = None, q_offsets: Any = None, kv_offsets: Any = None,
    fp8_params: FP8Params | None = None, score_mod_args: Sequence[Any] = (), *, scale: float = 1.0,
    mask_type: MaskType = MaskType.NO_MASK, seed: int = 42, dropout_rate: float = 0.0, qkv_layout: str = "BTNH",
    sliding_window_length: int | None = None, score_mod: Callable[..., Any] | None = None, use_fp8: bool = False,
    return_residual: bool = False, diagonal_alignment: str = "top_left", sink: Any = None,
    dropout_mask: Any = None, deterministic: bool = False,
) -> AttentionGrads:
    """Reference backward of :func:`dot_product_attention` called with the same arguments.

    ``output`` and ``logsumexp`` are the forward's results (``return_residual=True``), ``grad_output``
    the gradient of the output.  ``return_residual`` and ``deterministic`` are accepted for signature
    parity with the forward and the GPU backward; they change nothing here.
    """
    del return_residual  # signature parity only
    config, operands = validate_call(
        query, key, value, bias, mask, q_seqlen, kv_seqlen, q_offsets, kv_offsets, None, None, fp8_params,
        score_mod_args, sink, scale=scale, mask_type=mask_type, dropout_rate=dropout_rate, qkv_layout=qkv_layout,
        sliding_window_length=sliding_window_length, score_mod=score_mod, use_fp8=use_fp8, training=True,
        diagonal_alignment=diagonal_alignment, deterministic=deterministic, xp=np)
    validate_backward(config, output, grad_output, logsumexp)
    return backward(config, operands, output, grad_output, logsumexp, seed=seed, dropout_mask=dropout_mask)
