"""score_mod (flex attention) on the GPU against the float64 reference, forward and backward.

The reference calls the user's function on the float32 scores and pulls gradients back through
``jax.vjp``; the GPU runs the translation (``cudnn_attn.graphs.score_mod``) inside cuDNN's callbacks.
Tolerances are the tier's (``_checks``: relative Frobenius error 2e-3 fp16, 1e-2 bf16): the
modification is evaluated in float32 on both sides, so it adds nothing measurable to the attention's
own rounding; a wrong derivative (softcap without ``tanh'``), a transposed position or a mask off by
one are errors of order 1.  Results are pre-filled with NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import cudnn_attn
from cudnn_attn import MaskType, reference
from cudnn_attn.core.config import BiasSpec
from cudnn_attn.core.score_mod_spec import score_mod_spec
from cudnn_attn.core.support import Environment, not_supported_reasons
from cudnn_attn.engine import prepared
from cudnn_attn.reference.inputs import random_operands

from ._checks import assert_close, assert_lse_close, io_dtype, make_config, poisoned, to_gpu

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


# -- score_mods, as users write them ------------------------------------------------------------------
def softcap(score, cap):
    return cap * jnp.tanh(score / cap)


def softcap_30(score):
    return 30.0 * jnp.tanh(score / 30.0)


def relative_bias(score, slope):
    row = lax.broadcasted_iota(jnp.int32, score.shape, 2)
    col = lax.broadcasted_iota(jnp.int32, score.shape, 3)
    return score + slope * (col - row)


def document_mask(score, first_end, second_end):
    """Three documents [0, first_end), [first_end, second_end), [second_end, ...) on both axes."""
    def document(i):
        return (i >= first_end).astype(jnp.int32) + (i >= second_end).astype(jnp.int32)
    row = lax.broadcasted_iota(jnp.int32, score.shape, 2)
    col = lax.broadcasted_iota(jnp.int32, score.shape, 3)
    return jnp.where(document(row) == document(col), score, -jnp.inf)


def blocks_of_24(score):
    row = lax.broadcasted_iota(jnp.int32, score.shape, 2)
    col = lax.broadcasted_iota(jnp.int32, score.shape, 3)
    return jnp.where(row // 24 == col // 24, score, -jnp.inf)


def alibi_from_positions(score):
    heads = score.shape[1]
    head = lax.broadcasted_iota(jnp.float32, score.shape, 1)
    distance = jnp.arange(score.shape[3], dtype=jnp.float32)[None, None, None, :] - \
        jnp.arange(score.shape[2], dtype=jnp.float32)[None, None, :, None]
    return score + 2.0 ** (-8.0 * (head + 1) / heads) * distance


def leaky(score):
    return jnp.where(score > 0, score, 0.1 * score)


# -- the public API: three cases ----------------------------------------------------------------------
PUBLIC = {
    "softcap-fp16-BTNH": (softcap, (np.float32(2.0),), "float16", "BTNH"),
    "softcap-bf16-BNTH": (softcap, (np.float32(2.0),), "bfloat16", "BNTH"),
    "relative-bias-fp16": (relative_bias, (np.float32(0.05),), "float16", "BTNH"),
    "relative-bias-bf16-BNTH": (relative_bias, (np.float32(-0.03),), "bfloat16", "BNTH"),
    "document-mask-fp16": (document_mask, (np.int32(40), np.int32(90)), "float16", "BTNH"),
    "document-mask-bf16": (document_mask, (np.int32(17), np.int32(64)), "bfloat16", "BTNH"),
}


def _qkv(rng, dtype, layout, B=2, T=128, S=128, N=4, H=64):
    dt = io_dtype(dtype)
    def make(length):
        shape = (B, length, N, H) if layout == "BTNH" else (B, N, length, H)
        return rng.standard_normal(shape).astype(dt)
    return make(T), make(S), make(S)


@pytest.mark.parametrize("case", list(PUBLIC), ids=list(PUBLIC))
def test_public_api_forward_and_backward_match_the_reference(case, rng):
    fn, args, dtype, layout = PUBLIC[case]
    q, k, v = _qkv(rng, dtype, layout)
    kwargs = dict(score_mod=fn, scale=0.125, qkv_layout=layout)
    gq, gk, gv = (cp.asarray(x) for x in (q, k, v))
    output, lse = cudnn_attn.dot_product_attention(gq, gk, gv, score_mod_args=args, return_residual=True, **kwargs)
    ref_out, ref_lse = reference.dot_product_attention(q, k, v, score_mod_args=args, return_residual=True, **kwargs)
    assert_close("output", output, ref_out, dtype)
    assert_lse_close(lse, ref_lse)
    grad = rng.standard_normal(q.shape).astype(q.dtype)
    grads = cudnn_attn.dot_product_attention_bwd(gq, gk, gv, output, cp.asarray(grad), lse, score_mod_args=args,
                                                 **kwargs)
    expected = reference.dot_product_attention_bwd(q, k, v, ref_out, grad, ref_lse, score_mod_args=args, **kwargs)
    for name in ("dq", "dk", "dv"):
        assert_close(name, getattr(grads, name), getattr(expected, name), dtype)


@jax.custom_vjp
def softcap_without_derivative(score, cap):
    """softcap whose backward skips tanh': what an identity score_mod_bprop would compute."""
    return softcap(score, cap)


softcap_without_derivative.defvjp(lambda score, cap: (softcap(score, cap), None), lambda _, g: (g, None))


def test_softcap_gradient_differs_from_an_identity_bprop(rng):
    """The softcap gradient needs tanh' of the score, which cuDNN does not hand to score_mod_bprop.  With
    a small cap the two gradients differ by far more than the tolerance, and the GPU follows the true one."""
    q, k, v = _qkv(rng, "float16", "BTNH")
    cap = (np.float32(1.0),)
    gq, gk, gv = (cp.asarray(x) for x in (q, k, v))
    output, lse = cudnn_attn.dot_product_attention(gq, gk, gv, score_mod_args=cap, score_mod=softcap,
                                                   return_residual=True)
    grad = rng.standard_normal(q.shape).astype(q.dtype)
    grads = cudnn_attn.dot_product_attention_bwd(gq, gk, gv, output, cp.asarray(grad), lse, score_mod_args=cap,
                                                 score_mod=softcap)
    out, lse_ = cp.asnumpy(output), cp.asnumpy(lse)
    true = reference.dot_product_attention_bwd(q, k, v, out, grad, lse_, score_mod_args=cap, score_mod=softcap)
    wrong = reference.dot_product_attention_bwd(q, k, v, out, grad, lse_, score_mod_args=cap,
                                                score_mod=softcap_without_derivative)
    assert_close("dq", grads.dq, true.dq, "float16")
    gap = np.linalg.norm(np.asarray(true.dq, np.float64) - np.asarray(wrong.dq, np.float64))
    assert gap > 50 * 2e-3 * np.linalg.norm(np.asarray(true.dq, np.float64))


# -- masks, bias and more functions inside the modification (execution level) -------------------------
def _spec(fn, *dtypes):
    """The function and its argument dtypes; traced for the configuration's scores in :func:`_matrix_config`."""
    return fn, tuple(((), d) for d in dtypes)


MATRIX = {
    # name: (make_config keywords, score_mod spec, argument values)
    "softcap-causal": (dict(mask_type=MaskType.CAUSAL), _spec(softcap, "float32"), (2.0,)),
    "softcap-causal-bottom-right-T<S": (dict(mask_type=MaskType.CAUSAL, diagonal_alignment="bottom_right", T=64, S=192),
                                        _spec(softcap, "float32"), (2.0,)),
    "softcap-window-16": (dict(mask_type=MaskType.CAUSAL, sliding_window_length=16), _spec(softcap, "float32"), (2.0,)),
    "softcap-padding": (dict(mask_type=MaskType.PADDING), _spec(softcap, "float32"), (2.0,)),
    "relative-bias-padding-causal-bf16": (dict(mask_type=MaskType.PADDING_CAUSAL, dtype="bfloat16"),
                                          _spec(relative_bias, "float32"), (0.05,)),
    "softcap-of-biased-score": (dict(bias_shape=(1, 4, 128, 128)), _spec(softcap, "float32"), (2.0,)),
    "relative-bias-with-dbias": (dict(bias_shape=(1, 4, 128, 128)), _spec(relative_bias, "float32"), (0.05,)),
    "constant-softcap-bf16": (dict(dtype="bfloat16"), _spec(softcap_30), ()),
    "blocks-of-24": (dict(), _spec(blocks_of_24), ()),
    "alibi-from-positions-gqa": (dict(N=8, K=2), _spec(alibi_from_positions), ()),
    "leaky": (dict(), _spec(leaky), ()),
}


def _matrix_config(case):
    call, (fn, arg_shapes), _ = MATRIX[case]
    config = make_config(**call)
    scores = (config.batch, config.q_heads, config.q_len, config.kv_len)
    config = config.replace(score_mod=score_mod_spec(fn, scores, arg_shapes))
    if case == "softcap-of-biased-score":         # a bias nobody differentiates: added inside the modification
        config = config.replace(bias=BiasSpec(config.bias.shape, differentiable=False))
    return config


@pytest.mark.parametrize("case", list(MATRIX), ids=list(MATRIX))
def test_modification_with_masks_and_bias_matches_the_reference(case, rng):
    config = _matrix_config(case)
    reasons = not_supported_reasons(config, Environment.detect())
    if reasons:
        pytest.skip(f"the support table refuses it: {reasons}")
    operands = random_operands(config, rng, poison=False)
    operands = operands.replace(score_mod_args=tuple(np.asarray(a, d) for a, (_, d) in
                                                     zip(MATRIX[case][2], config.score_mod.arg_shapes)))
    gpu, io = to_gpu(operands), io_dtype(config.dtype)
    output, lse = poisoned(config.o_shape, io), poisoned(config.lse_shape, np.float32)
    result = prepared.forward(config, gpu, output=output, logsumexp=lse)
    expected = reference.forward(config, operands)
    assert_close("output", result.output, expected.output, config.dtype)
    assert_lse_close(result.logsumexp, expected.logsumexp)
    grad = rng.standard_normal(config.o_shape).astype(io)
    results = dict(dq=poisoned(config.q_shape, io), dk=poisoned(config.k_shape, io), dv=poisoned(config.v_shape, io))
    if config.has_dbias:
        results["dbias"] = poisoned(config.bias.shape, io)
    grads = prepared.backward(config, gpu, result.output, cp.asarray(grad), result.logsumexp, **results)
    expected_grads = reference.backward(config, operands, expected.output, grad, expected.logsumexp)
    for name in ("dq", "dk", "dv") + (("dbias",) if config.has_dbias else ()):
        assert_close(name, getattr(grads, name), getattr(expected_grads, name), config.dtype)
