"""The seed-compatible entry points (JAX's ``dot_product_attention`` / ``paged_attention`` argument
names and defaults, from :mod:`cudnn_attn.core.parameters`) and the native ``attention`` on NumPy arrays,
running the reference.  They refuse what the CuPy front would refuse on the CPU fronts' GPU target
(:mod:`cudnn_attn.core.cpu_target`; ``$CUDNN_ATTN_CPU_TARGET=off`` for none); :func:`.core.forward` and
:func:`.core.backward` check no target.

Extensions, keyword-only after the seed's: ``diagonal_alignment`` ("top_left" or "bottom_right"),
``sink`` (float32 ``(N,)`` attention-sink logits) and ``dropout_mask`` (the ``(B, N, T, S)`` keep-mask
to use instead of drawing one from ``seed``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from cudnn_attn.core import cpu_target, parameters
from cudnn_attn.core.masks import MaskSpec
from cudnn_attn.core.parameters import AuxRequest
from cudnn_attn.core.types import AttentionGrads, AttentionOutput, FP8Params, Front, Kind, MaskType
from cudnn_attn.core.validation import bind_seed, validate_backward, validate_call

from .core import backward, forward


def _forward(call: NamedTuple) -> AttentionOutput:
    arrays, static = parameters.arguments(call)
    with parameters.native_names(call):
        config, operands = validate_call(**arrays, **static, xp=np)
    config, operands, seed = bind_seed(parameters.finish(call, config), operands, call.seed)
    cpu_target.check(config, kind=Kind.FORWARD, front=Front.CUPY)
    return forward(config, operands, seed=seed, dropout_mask=call.dropout_mask)


@parameters.front(parameters.NATIVE, "deterministic", "dropout_mask")
def attention(query: Any, key: Any, value: Any, *, mask: MaskSpec | None = None, bias: Any = None,
              scale: float | None = None, dropout_rate: float = 0.0, seed: int = 42, layout: str = "BTNH",
              sink: Any = None, fp8_params: FP8Params | None = None, return_aux: AuxRequest | None = None,
              deterministic: bool = False, dropout_mask: Any = None) -> AttentionOutput:
    """Reference of the native :func:`cudnn_attn.attention`: an :class:`AttentionOutput` (``logsumexp`` with
    ``return_aux=AuxRequest(logsumexp=True)``, ``score_max``/``max_logit`` with ``AuxRequest(max_logit=True)``,
    ``amax_s``/``amax_o`` with FP8).  ``seed`` may be an int64 ``[seed, offset]`` array, as on the CuPy front
    (the mask is NumPy's, drawn from those values: :func:`cudnn_attn.reference.masks.dropout_entropy`)."""
    call = attention.arguments(query, key, value, mask, bias, scale, dropout_rate, seed, layout, sink, fp8_params,
                               return_aux, deterministic, dropout_mask)
    return _forward(call)


@parameters.front(parameters.FORWARD, "dropout_mask")
def dot_product_attention(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, q_seqlen: Any = None,
                          kv_seqlen: Any = None, q_offsets: Any = None, kv_offsets: Any = None,
                          fp8_params: FP8Params | None = None, score_mod_args: Sequence[Any] = (), *,
                          scale: float | None = 1.0, mask_type: MaskType = MaskType.NO_MASK, seed: int = 42,
                          dropout_rate: float = 0.0, qkv_layout: str = "BTNH",
                          sliding_window_length: int | None = None, score_mod: Callable[..., Any] | None = None,
                          use_fp8: bool = False, return_residual: bool = False, diagonal_alignment: str = "top_left",
                          sink: Any = None, dropout_mask: Any = None) -> Any:
    """Reference ``dot_product_attention``: returns the output, ``(output, logsumexp)`` with
    ``return_residual``, or ``(output, amax_s, amax_o)`` with ``use_fp8`` (as the seed)."""
    call = dot_product_attention.arguments(query, key, value, bias, mask, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
                                           fp8_params, score_mod_args, scale, mask_type, seed, dropout_rate,
                                           qkv_layout, sliding_window_length, score_mod, use_fp8, return_residual,
                                           diagonal_alignment, sink, dropout_mask)
    return _forward(call).seed_form(call.use_fp8, call.return_residual)


@parameters.front(parameters.PAGED, "dropout_mask")
def paged_attention(query: Any, key: Any, value: Any, q_seqlen: Any, kv_seqlen: Any, page_table_k: Any,
                    page_table_v: Any, bias: Any = None, mask: Any = None, fp8_params: FP8Params | None = None, *,
                    scale: float | None = 1.0, mask_type: MaskType = MaskType.NO_MASK, seed: int = 42,
                    dropout_rate: float = 0.0, qkv_layout: str = "BTNH", sliding_window_length: int | None = None,
                    use_fp8: bool = False, return_residual: bool = False, diagonal_alignment: str = "top_left",
                    sink: Any = None, dropout_mask: Any = None) -> Any:
    """Reference ``paged_attention``: K/V are block caches read through the page tables; returns the
    output, or ``(output, logsumexp)`` with ``return_residual``."""
    call = paged_attention.arguments(query, key, value, q_seqlen, kv_seqlen, page_table_k, page_table_v, bias, mask,
                                     fp8_params, scale, mask_type, seed, dropout_rate, qkv_layout,
                                     sliding_window_length, use_fp8, return_residual, diagonal_alignment, sink,
                                     dropout_mask)
    return _forward(call).seed_form(call.use_fp8, call.return_residual)


@parameters.front(parameters.BACKWARD, "dropout_mask", "deterministic")
def dot_product_attention_bwd(query: Any, key: Any, value: Any, output: Any, grad_output: Any, logsumexp: Any,
                              bias: Any = None, mask: Any = None, q_seqlen: Any = None, kv_seqlen: Any = None,
                              q_offsets: Any = None, kv_offsets: Any = None, fp8_params: FP8Params | None = None,
                              score_mod_args: Sequence[Any] = (), *, scale: float | None = 1.0,
                              mask_type: MaskType = MaskType.NO_MASK, seed: int = 42, dropout_rate: float = 0.0,
                              qkv_layout: str = "BTNH", sliding_window_length: int | None = None,
                              score_mod: Callable[..., Any] | None = None, use_fp8: bool = False,
                              return_residual: bool = False, diagonal_alignment: str = "top_left", sink: Any = None,
                              dropout_mask: Any = None, deterministic: bool = False) -> AttentionGrads:
    """Reference backward of :func:`dot_product_attention` called with the same arguments.

    ``output`` and ``logsumexp`` are the forward's results (``return_residual=True``), ``grad_output``
    the gradient of the output.  ``return_residual`` and ``deterministic`` are accepted for signature
    parity with the forward and the GPU backward; they change nothing here.
    """
    call = dot_product_attention_bwd.arguments(query, key, value, output, grad_output, logsumexp, bias, mask,
                                               q_seqlen, kv_seqlen, q_offsets, kv_offsets, fp8_params, score_mod_args,
                                               scale, mask_type, seed, dropout_rate, qkv_layout,
                                               sliding_window_length, score_mod, use_fp8, return_residual,
                                               diagonal_alignment, sink, dropout_mask, deterministic)
    arrays, static = parameters.arguments(call, backward=True)
    config, operands = validate_call(**arrays, **static, xp=np)
    validate_backward(config, call.output, call.grad_output, call.logsumexp)
    config, operands, seed = bind_seed(config, operands, call.seed)
    cpu_target.check(config, kind=Kind.BACKWARD, front=Front.CUPY)
    return backward(config, operands, call.output, call.grad_output, call.logsumexp, seed=seed,
                    dropout_mask=call.dropout_mask)
