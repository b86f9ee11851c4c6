"""FP8 attention emulated in float64, following the cuDNN frontend's FP8 SDPA graphs.

Forward (``sdpa_fp8``; Q/K/V hold FP8 values, ``d_x`` = ``descale_x``, ``s_x`` = ``scale_x``)::

    S      = scale * d_q * d_k * (q . k)              masked as in the fp16/bf16 path
    P      = softmax(S)                              (with the sink in the denominator, if any)
    amax_s = max P                                   before quantisation
    O      = (fp8(P * s_s) * d_s) . (v * d_v)
    amax_o = max |O|                                 before scale_o
    output = fp8(O * s_o)

Backward (``sdpa_fp8_backward``; O and dO are the FP8 forward output and incoming gradient)::

    D      = rowsum(dO * O) * d_dO * d_o
    P      = exp(S - lse)                            from the forward's logsumexp
    dV     = fp8(P * s_s)^T . dO * d_s * d_dO
    dP     = dO . v^T * d_dO * d_v
    dS     = P * (dP - D) * scale,   amax_dP = max |dS|
    dQ     = fp8(dS * s_dP) . k * d_dP * d_k         dK = fp8(dS * s_dP)^T . q * d_dP * d_q
    each of dQ/dK/dV: amax before its scale, result fp8(x * s_x)

``fp8(x)`` rounds to the io FP8 dtype with saturation.  The fused kernels quantise the *unnormalised*
``exp(S - running max)`` of flash attention rather than the normalised P, so they round P at slightly
different points: compare with FP8 tolerances (about 0.08 absolute + 0.2 relative on values of order
one, as the cuDNN frontend's own FP8 tests do).  Not emulated: bias, ALiBi, dropout, score_mod.

The amax values follow cuDNN 9.19 as read (not yet measured on the GPU): the sm90 forward kernel
reports ``amax_s`` as the maximum over rows of ``1 / sum_j exp(s_ij - max_j s_ij)``, which is ``max P``;
the frontend's ``sdpa_fp8_backward`` reduces ``amax_dP`` over ``dS`` after the attention scale, as above.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cudnn_attn.core.config import AttentionConfig, AttentionOperands
from cudnn_attn.core.types import AttentionGrads, AttentionOutput

from .problem import load, probabilities, scores, sink_probabilities, softmax
from .tensors import amax_array, as_float64, cast, io_dtype, scalar, to_physical


def _check_emulated(config: AttentionConfig, dropout_mask: Any) -> None:
    """The FP8 features neither cuDNN nor this emulation has (bias, ALiBi, dropout, score_mod) are refused
    before this module by the support table (:func:`~cudnn_attn.core.support.check_everywhere`); a dropout mask
    is meaningless here."""
    if dropout_mask is not None:
        raise ValueError(f"dropout_mask: FP8 attention has no dropout ({config.describe()})")


def _quantised(x: np.ndarray, config: AttentionConfig) -> np.ndarray:
    """``x`` rounded to the FP8 io dtype (saturating), as float64."""
    return as_float64(cast(x, io_dtype(config)))


def _scales(operands: AttentionOperands) -> dict[str, float]:
    return {name: scalar(value) for name, value in operands.fp8_scales.items()}


def forward(config: AttentionConfig, operands: AttentionOperands, dropout_mask: Any = None) -> AttentionOutput:
    """FP8 forward (module docstring).  ``output`` is FP8, ``amax_s``/``amax_o`` float32 ``(1, 1, 1, 1)``."""
    _check_emulated(config, dropout_mask)
    sc = _scales(operands)
    problem = load(config, operands)
    s, _ = scores(problem, config.scale * sc["descale_q"] * sc["descale_k"])
    p, lse = softmax(s, problem.sink)
    p_fp8 = _quantised(p * sc["scale_s"], config)
    o = np.einsum("bnts,bnsd->bntd", p_fp8, problem.v) * (sc["descale_s"] * sc["descale_v"])
    o = problem.zero_invalid_q(o)
    return AttentionOutput(
        output=to_physical(o * sc["scale_o"], config.layout, io_dtype(config)),
        logsumexp=problem.api_logsumexp(lse) if config.training else None,
        amax_s=amax_array(p.max()),
        amax_o=amax_array(np.abs(o).max()),
    )


def backward(config: AttentionConfig, operands: AttentionOperands, output: Any, grad_output: Any,
             logsumexp: Any, dropout_mask: Any = None) -> AttentionGrads:
    """FP8 backward (module docstring).  dq/dk/dv are FP8; the four amax values float32 ``(1, 1, 1, 1)``."""
    _check_emulated(config, dropout_mask)
    sc = _scales(operands)
    problem = load(config, operands)
    o, do = problem.read_q_like(output), problem.read_q_like(grad_output)
    lse = problem.token_logsumexp(logsumexp)

    s, _ = scores(problem, config.scale * sc["descale_q"] * sc["descale_k"])
    p = probabilities(s, lse)
    delta = np.einsum("bntd,bntd->bnt", do, o) * (sc["descale_dO"] * sc["descale_o"])

    dv = np.einsum("bnts,bntd->bnsd", _quantised(p * sc["scale_s"], config), do)
    dv = problem.zero_invalid_kv(problem.sum_query_groups(dv)) * (sc["descale_s"] * sc["descale_dO"])
    dp = np.einsum("bntd,bnsd->bnts", do, problem.v) * (sc["descale_dO"] * sc["descale_v"])
    ds = p * (dp - delta[..., None]) * config.scale
    ds_fp8 = _quantised(ds * sc["scale_dP"], config)
    dq = np.einsum("bnts,bnsh->bnth", ds_fp8, problem.k) * (sc["descale_dP"] * sc["descale_k"])
    dq = problem.zero_invalid_q(dq)
    dk = problem.sum_query_groups(np.einsum("bnts,bnth->bnsh", ds_fp8, problem.q))
    dk = problem.zero_invalid_kv(dk) * (sc["descale_dP"] * sc["descale_q"])

    dtype = io_dtype(config)
    grads = AttentionGrads(
        dq=to_physical(dq * sc["scale_dQ"], config.layout, dtype),
        dk=to_physical(dk * sc["scale_dK"], config.layout, dtype),
        dv=to_physical(dv * sc["scale_dV"], config.layout, dtype),
        amax_dQ=amax_array(np.abs(dq).max()), amax_dK=amax_array(np.abs(dk).max()),
        amax_dV=amax_array(np.abs(dv).max()), amax_dP=amax_array(np.abs(ds).max()),
    )
    if config.sink:
        dsink = -(sink_probabilities(problem.sink, lse) * delta).sum(axis=(0, 2))
        grads = grads._replace(dsink=dsink.astype(np.float32))
    return grads
