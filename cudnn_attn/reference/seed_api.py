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

from typing import Any, NamedTuple

import numpy as np

from cudnn_attn.core import cpu_target, parameters
from cudnn_attn.core.types import AttentionGrads, AttentionOutput, Front, Kind
from cudnn_attn.core.validation import validate_backward, validate_call

from .core import backward, forward


def _forward(call: NamedTuple) -> AttentionOutput:
    arrays, static = parameters.arguments(call)
    with parameters.native_names(call):
        config, operands = validate_call(**arrays, **static, xp=np)
    config = parameters.finish(call, config)
    cpu_target.check(config, kind=Kind.FORWARD, front=Front.CUPY)
    return forward(config, operands, seed=call.seed, dropout_mask=call.dropout_mask)


@parameters.front(parameters.NATIVE, "deterministic", "dropout_mask")
def attention(call: NamedTuple) -> AttentionOutput:
    """Reference of the native :func:`cudnn_attn.attention`: an :class:`AttentionOutput` (``logsumexp`` with
    ``return_aux=AuxRequest(logsumexp=True)``, ``amax_s``/``amax_o`` with FP8)."""
    return _forward(call)


@parameters.front(parameters.FORWARD, "dropout_mask")
def dot_product_attention(call: NamedTuple) -> Any:
    """Reference ``dot_product_attention``: returns the output, ``(output, logsumexp)`` with
    ``return_residual``, or ``(output, amax_s, amax_o)`` with ``use_fp8`` (as the seed)."""
    return _forward(call).seed_form(call.use_fp8, call.return_residual)


@parameters.front(parameters.PAGED, "dropout_mask")
def paged_attention(call: NamedTuple) -> Any:
    """Reference ``paged_attention``: K/V are block caches read through the page tables; returns the
    output, or ``(output, logsumexp)`` with ``return_residual``."""
    return _forward(call).seed_form(call.use_fp8, call.return_residual)


@parameters.front(parameters.BACKWARD, "dropout_mask", "deterministic")
def dot_product_attention_bwd(call: NamedTuple) -> AttentionGrads:
    """Reference backward of :func:`dot_product_attention` called with the same arguments.

    ``output`` and ``logsumexp`` are the forward's results (``return_residual=True``), ``grad_output``
    the gradient of the output.  ``return_residual`` and ``deterministic`` are accepted for signature
    parity with the forward and the GPU backward; they change nothing here.
    """
    arrays, static = parameters.arguments(call, backward=True)
    config, operands = validate_call(**arrays, **static, xp=np)
    validate_backward(config, call.output, call.grad_output, call.logsumexp)
    cpu_target.check(config, kind=Kind.BACKWARD, front=Front.CUPY)
    return backward(config, operands, call.output, call.grad_output, call.logsumexp, seed=call.seed,
                    dropout_mask=call.dropout_mask)
