"""Gradients through the bridge's custom VJP, against JAX's autodiff of an independent float32 oracle.

Every differentiable input is checked: ``query``, ``key``, ``value``, an explicit ``bias`` (full and
broadcast shapes: its gradient is reduced to the bias's own shape), an additive ``mask``.  The loss is
``sum(output * w)`` with a random ``w``, so every output element carries a distinct cotangent.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_jax_common import assert_close, jnp_attention, normal, qkv

from cudnn_attn import MaskType
from cudnn_attn import jax_bridge as jb

SCALE = 0.41


def _setup(case: str, dtype: str, rng: np.random.Generator):
    """``(inputs, bridge(**inputs), oracle(**inputs))`` for one feature; inputs are the differentiable arrays."""
    B, T, S, N = 2, 16, 16, 4
    K = 2 if case == "gqa_causal" else N
    layout = "BNTH" if case == "bnth" else "BTNH"
    q, k, v = qkv(rng, B=B, T=T, S=S, N=N, K=K, H=8, dtype=dtype, layout=layout)
    inputs = {"query": q, "key": k, "value": v}
    bridge: dict = {"qkv_layout": layout}
    oracle: dict = {"layout": layout}
    if case == "gqa_causal":
        bridge["mask_type"], oracle["causal"] = MaskType.CAUSAL, True
    if case in ("bias_full", "bias_heads", "bias_2d"):
        shape = {"bias_full": (B, N, T, S), "bias_heads": (1, N, T, S), "bias_2d": (T, S)}[case]
        inputs["bias"] = normal(rng, shape, dtype)
    if case == "additive_mask":
        inputs["mask"] = normal(rng, (B, 1, T, S), dtype)
    if case == "padding":
        lengths = jnp.asarray([10, 16], jnp.int32), jnp.asarray([16, 6], jnp.int32)
        bridge.update(q_seqlen=lengths[0], kv_seqlen=lengths[1], mask_type=MaskType.PADDING)
        oracle.update(q_seqlen=lengths[0], kv_seqlen=lengths[1])
    if case == "window":
        bridge.update(sliding_window_length=5, mask_type=MaskType.CAUSAL)
        oracle.update(causal=True, window=(4, 0))

    def run_bridge(query, key, value, bias=None, mask=None):
        return jb.dot_product_attention(query, key, value, bias, mask, scale=SCALE, **bridge)

    def run_oracle(query, key, value, bias=None, mask=None):
        combined = bias if mask is None else mask
        return jnp_attention(query, key, value, scale=SCALE, bias=combined, **oracle)

    return inputs, run_bridge, run_oracle


CASES = ["plain", "gqa_causal", "bnth", "bias_full", "bias_heads", "bias_2d", "additive_mask", "padding", "window"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
def test_gradients_match_autodiff_of_the_oracle(case, dtype):
    rng = np.random.default_rng(CASES.index(case))
    inputs, run_bridge, run_oracle = _setup(case, dtype, rng)
    weight = normal(rng, jax.eval_shape(lambda: run_oracle(**inputs)).shape, "float32")

    def loss(run):
        return lambda inputs: jnp.sum(run(**inputs).astype(jnp.float32) * weight)

    got = jax.jit(jax.grad(loss(run_bridge)))(inputs)
    expected = jax.grad(loss(run_oracle))(inputs)
    assert set(got) == set(inputs)
    for name in inputs:
        assert got[name].shape == inputs[name].shape and got[name].dtype == inputs[name].dtype
        # dbias sums dS over the broadcast dimensions: a larger float32 rounding, hence the factor.
        factor = 2.0 if name in ("bias", "mask") else 1.0
        assert_close(got[name], expected[name], dtype, f"{case} d{name}", factor)


def test_boolean_mask_gets_no_bias_gradient_and_costs_no_dbias():
    """A boolean mask becomes a constant bias: the backward computes no dbias at all."""
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng)
    mask = jnp.asarray(rng.random((1, 1, 16, 16)) > 0.2)

    def loss(q):
        return jnp.sum(jb.dot_product_attention(q, k, v, mask=mask, scale=SCALE).astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss))(q)
    backward = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "cudnn_attention_bwd"]
    assert len(backward) == 1
    config = backward[0].params["config"]
    assert config.bias is not None and not config.has_dbias
    assert len(backward[0].outvars) == 3                                  # dq, dk, dv


def test_sink_gradient_matches_autodiff_of_the_oracle():
    rng = np.random.default_rng(12)
    q, k, v = qkv(rng, dtype="float16")
    sink = jnp.asarray(rng.standard_normal((4,)), jnp.float32)
    weight = normal(rng, q.shape, "float32")

    def loss(run):
        return lambda q, sink: jnp.sum(run(q, k, v, scale=SCALE, sink=sink).astype(jnp.float32) * weight)

    got = jax.jit(jax.grad(loss(jb.dot_product_attention), argnums=(0, 1)))(q, sink)
    expected = jax.grad(loss(jnp_attention), argnums=(0, 1))(q, sink)
    assert_close(got[0], expected[0], "float16", "dq")
    assert_close(got[1], expected[1], "float16", "dsink")


def test_residual_cotangent_is_ignored_and_output_gradient_unchanged():
    rng = np.random.default_rng(13)
    q, k, v = qkv(rng)

    def with_residual(q):
        out, lse = jb.dot_product_attention(q, k, v, scale=SCALE, return_residual=True)
        return jnp.sum(out.astype(jnp.float32)) + 0.0 * jnp.sum(lse)

    def without(q):
        return jnp.sum(jb.dot_product_attention(q, k, v, scale=SCALE).astype(jnp.float32))

    np.testing.assert_array_equal(jax.jit(jax.grad(with_residual))(q), jax.jit(jax.grad(without))(q))


def test_remat_and_scan_over_layers():
    """``grad(scan(checkpoint(attention)))``: the residual-free recomputation path."""
    rng = np.random.default_rng(14)
    q, k, v = qkv(rng, dtype="float16")
    weights = jnp.asarray(rng.uniform(0.5, 1.5, (3,)), jnp.float16)

    def layers(run):
        def body(h, w):
            return jax.checkpoint(lambda h: run(h * w, k, v))(h), None
        return lambda h: jnp.sum(jax.lax.scan(body, h, weights)[0].astype(jnp.float32))

    bridge = lambda q, k, v: jb.dot_product_attention(q, k, v, scale=SCALE)  # noqa: E731
    oracle = lambda q, k, v: jnp_attention(q, k, v, scale=SCALE)  # noqa: E731
    assert_close(jax.jit(jax.grad(layers(bridge)))(q), jax.grad(layers(oracle))(q), "float16", "scan", 2.0)
