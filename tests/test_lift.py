"""``cudnn_attn.core.padded_call``: training with a bias at odd T or S, and the backward at T == S == 1, run padded to
even lengths with masked rows and columns.

The padded call, sliced back, must equal the unpadded one: checked with the NumPy reference (float64,
so up to the io-dtype rounding both share: relative error 1e-6), with and without a user padding mask,
causal, bottom-right and windowed, in both layouts; and through the JAX bridge, whose kernel then sees
even lengths only, against the unpadded reference and JAX autodiff of a ``jax.numpy`` oracle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_jax_common import assert_close, jnp_attention, normal, qkv

from cudnn_attn import MaskType, reference
from cudnn_attn import jax_bridge as jb
from cudnn_attn.core.padded_call import lift, lifted_config
from cudnn_attn.core.validation import validate_call


def _close(x, ref, what):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert x.shape == ref.shape, (what, x.shape, ref.shape)
    np.testing.assert_allclose(x, ref, rtol=1e-6, atol=1e-6, err_msg=what)


CASES = {   # name -> (T, S, bias, mask_type, extra prepare arguments)
    "bias-odd-T": (7, 8, True, MaskType.NO_MASK, {}),
    "bias-odd-S-causal": (8, 9, True, MaskType.CAUSAL, {}),
    "bias-odd-both-padding-causal": (9, 11, True, MaskType.PADDING_CAUSAL, {}),
    "bias-odd-window-BNTH": (7, 7, True, MaskType.CAUSAL, dict(sliding_window_length=3, qkv_layout="BNTH")),
    "single-token": (1, 1, False, MaskType.NO_MASK, {}),
    "single-token-bottom-right": (1, 1, False, MaskType.CAUSAL, dict(diagonal_alignment="bottom_right")),
    "single-token-bias": (1, 1, True, MaskType.CAUSAL, {}),
}


@pytest.mark.parametrize("name", CASES)
def test_padded_call_equals_the_original_in_the_reference(name):
    t, s, with_bias, mask_type, extra = CASES[name]
    seed = list(CASES).index(name)
    rng = np.random.default_rng(seed)
    layout = extra.get("qkv_layout", "BTNH")
    def shape(length, heads):
        return (2, length, heads, 8) if layout == "BTNH" else (2, heads, length, 8)
    q = rng.standard_normal(shape(t, 4)).astype(np.float16)
    k, v = (rng.standard_normal(shape(s, 2)).astype(np.float16) for _ in range(2))
    bias = rng.standard_normal((1, 4, t, s)).astype(np.float16) if with_bias else None
    lengths = {}
    if mask_type is MaskType.PADDING_CAUSAL:
        lengths = dict(q_seqlen=np.array([t - 2, t], np.int32), kv_seqlen=np.array([s, s - 3], np.int32))
    config, operands = validate_call(q, k, v, bias, **lengths, scale=0.4, mask_type=mask_type, training=True, xp=np,
                                     **extra)
    lifted = lift(config, operands, np)
    assert lifted is not None and lifted.config.q_len % 2 == 0 and lifted.config.kv_len % 2 == 0
    assert lifted.config.mask.padding
    out = reference.forward(config, operands)
    got = lifted.unpad(reference.forward(lifted.config, lifted.operands))
    _close(got.output, out.output, f"output ({name}, seed {seed})")
    _close(got.logsumexp, out.logsumexp, f"logsumexp ({name}, seed {seed})")
    grad_output = rng.standard_normal(out.output.shape).astype(np.float16)
    grads = reference.backward(config, operands, out.output, grad_output, out.logsumexp)
    residuals = lifted.residuals(out.output, grad_output, out.logsumexp)
    got_grads = lifted.unpad(reference.backward(lifted.config, lifted.operands, *residuals))
    for field in ("dq", "dk", "dv", "dbias"):
        if getattr(grads, field) is not None:
            _close(getattr(got_grads, field), getattr(grads, field), f"{field} ({name}, seed {seed})")


def test_calls_that_need_no_lift_are_left_alone():
    q = np.zeros((1, 8, 2, 8), np.float16)
    config, _ = validate_call(q, q, q, np.zeros((1, 2, 8, 8), np.float16), training=True, xp=np)
    assert lifted_config(config) is None                         # even lengths
    config, _ = validate_call(q[:, :7], q, q, np.zeros((1, 2, 7, 8), np.float16), training=False, xp=np)
    assert lifted_config(config) is None                         # inference


def _kernel_shapes(fn, *args):
    """The query shapes the attention primitives are bound with (forward and backward)."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    shapes = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name.startswith("cudnn_attention"):
                shapes.append(tuple(eqn.invars[0].aval.shape))
            for value in eqn.params.values():
                inner = getattr(value, "jaxpr", None)
                if inner is not None:
                    walk(getattr(inner, "jaxpr", inner))
    walk(jaxpr.jaxpr)
    return shapes


def test_jax_bridge_trains_with_a_bias_at_odd_lengths():
    rng = np.random.default_rng(30)
    t, s = 7, 9
    q, k, v = qkv(rng, B=2, T=t, S=s, N=4, H=8)
    bias = normal(rng, (1, 4, t, s), "float16")
    weight = normal(rng, q.shape, "float32")

    def loss(fn):
        return lambda q, k, v, b: jnp.sum(fn(q, k, v, b).astype(jnp.float32) * weight)

    ours = lambda q, k, v, b: jb.dot_product_attention(q, k, v, b, scale=0.4, mask_type=MaskType.CAUSAL)  # noqa: E731
    oracle = lambda q, k, v, b: jnp_attention(q, k, v, scale=0.4, bias=b, causal=True)  # noqa: E731
    grads = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2, 3)))(q, k, v, bias)
    want = jax.grad(loss(oracle), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for name, g, e in zip(["dq", "dk", "dv", "dbias"], grads, want):
        assert_close(g, e, "float16", name, factor=2)
    out, lse = jax.jit(lambda *a: jb.dot_product_attention(*a, scale=0.4, mask_type=MaskType.CAUSAL,
                                                           return_residual=True))(q, k, v, bias)
    assert_close(out, oracle(q, k, v, bias), "float16", "output")
    assert lse.shape == (2, 4, t)
    shapes = _kernel_shapes(jax.grad(loss(ours), argnums=(0, 3)), q, k, v, bias)
    assert shapes and all(shape[1] % 2 == 0 for shape in shapes), shapes


def test_jax_bridge_backward_of_a_single_token():
    rng = np.random.default_rng(31)
    q, k, v = qkv(rng, B=3, T=1, S=1, N=2, H=8)
    fn = lambda q, k, v: jnp.sum(jb.dot_product_attention(q, k, v, scale=0.5).astype(jnp.float32) ** 2)  # noqa: E731
    oracle = lambda q, k, v: jnp.sum(jnp_attention(q, k, v, scale=0.5).astype(jnp.float32) ** 2)  # noqa: E731
    for name, g, e in zip("qkv", jax.jit(jax.grad(fn, argnums=(0, 1, 2)))(q, k, v),
                          jax.grad(oracle, argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(e, np.float32), atol=2e-3, err_msg=name)
    # with one key, dq is 0 and dv = dO: non-trivial for dv
    assert float(jnp.abs(jax.grad(fn, argnums=2)(q, k, v)).max()) > 0.1
