"""The reference backward against float64 central finite differences of the reference forward.

Loss ``L = sum(O * G)`` for a fixed random ``G``; ``dL/dx`` by central differences (step ``1e-6``,
truncation ~1e-12) against ``backward(..., grad_output=G)``.  The backward reads the float32
logsumexp (relative error ~6e-8 in P), hence the tolerance ``2e-6`` relative to the gradient's scale.
score_mod runs in float32 (as in the spec), so its case uses a larger step and tolerance.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cudnn_attn.core.config import AttentionConfig, BiasSpec, DiagonalAlignment, PackingSpec, StaticMask
from cudnn_attn.core.score_mod_spec import score_mod_spec
from cudnn_attn.core.types import AttentionLayout
from cudnn_attn.reference import backward, forward
from cudnn_attn.reference.inputs import random_operands

BASE = dict(batch=2, q_heads=2, kv_heads=1, q_len=4, kv_len=5, qk_dim=3, v_dim=2, dtype="float64", scale=0.8,
            training=True)


def config(**changes) -> AttentionConfig:
    return AttentionConfig(**{**BASE, **changes})


def numeric_gradient(loss, x: np.ndarray, step: float) -> np.ndarray:
    grad = np.zeros_like(x, dtype=np.float64)
    for index in np.ndindex(x.shape):
        if not np.isfinite(x[index]):
            continue
        plus, minus = x.copy(), x.copy()
        plus[index] += step
        minus[index] -= step
        grad[index] = (loss(plus) - loss(minus)) / (2 * step)
    return grad


def assert_gradient(analytic, numeric, rtol):
    scale = max(np.abs(numeric).max(), 1e-3)
    np.testing.assert_allclose(np.asarray(analytic, np.float64), numeric, rtol=0, atol=rtol * scale)


def softcap(score, cap):
    import jax.numpy as jnp
    return cap * jnp.tanh(score / cap)


CASES = {
    "plain": {},
    "causal_bnth": dict(mask=StaticMask(right_bound=0), layout=AttentionLayout.BNTH),
    "window_bottom_right": dict(mask=StaticMask(right_bound=0, left_bound=2,
                                                alignment=DiagonalAlignment.BOTTOM_RIGHT)),
    "padding_causal": dict(mask=StaticMask(right_bound=0, padding=True)),
    "alibi": dict(q_heads=3, kv_heads=3, mask=StaticMask(right_bound=0, alibi=True)),
    "bias_B1TS": dict(bias=BiasSpec((2, 1, 4, 5), True)),
    "bias_1NTS_causal": dict(bias=BiasSpec((1, 2, 4, 5), True), mask=StaticMask(right_bound=0)),
    "sink": dict(sink=True),
    "sink_padding": dict(sink=True, mask=StaticMask(padding=True)),
    "dropout": dict(dropout_rate=0.3),
    "packed": dict(q_len=7, kv_len=7, packing=PackingSpec(2), mask=StaticMask(right_bound=0, padding=True),
                   bias=BiasSpec((2, 2, 7, 7), True), sink=True),
    "score_mod_softcap": dict(score_mod=score_mod_spec(softcap, (2, 2, 4, 5), (((), "float32"),))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_match_finite_differences(name):
    cfg = config(**CASES[name])
    rng = np.random.default_rng(len(name))
    ops = random_operands(cfg, rng)
    if cfg.score_mod is not None:
        ops = ops.replace(score_mod_args=(np.float32(1.5),))
    keep = None
    if cfg.has_dropout:
        keep = (rng.random((cfg.batch, cfg.q_heads, cfg.q_len, cfg.kv_len)) >= cfg.dropout_rate).astype(float)
    step, rtol = (1e-3, 2e-3) if cfg.score_mod is not None else (1e-6, 2e-6)
    result = forward(cfg, ops, dropout_mask=keep)
    g = rng.standard_normal(result.output.shape)
    grads = backward(cfg, ops, result.output, g, result.logsumexp, dropout_mask=keep)

    def loss_of(field):
        return lambda x: float(np.nansum(forward(cfg, ops.replace(**{field: x}), dropout_mask=keep).output * g))

    for field, analytic in (("query", grads.dq), ("key", grads.dk), ("value", grads.dv)):
        assert_gradient(analytic, numeric_gradient(loss_of(field), np.asarray(ops.__dict__[field], float), step), rtol)
    if cfg.has_dbias:
        assert grads.dbias.shape == cfg.bias.shape
        assert_gradient(grads.dbias, numeric_gradient(loss_of("bias"), ops.bias, step), rtol)
    if cfg.sink:
        assert grads.dsink.dtype == np.float32 and grads.dsink.shape == (cfg.q_heads,)
        numeric = numeric_gradient(loss_of("sink"), ops.sink.astype(np.float64), step)
        np.testing.assert_allclose(grads.dsink, numeric, rtol=1e-5, atol=1e-6)


def test_gradients_outside_the_sequences_are_zero():
    cfg = config(mask=StaticMask(padding=True), batch=2)
    ops = random_operands(cfg, np.random.default_rng(1), poison=False).replace(
        q_seqlen=np.array([2, 4], np.int32), kv_seqlen=np.array([3, 1], np.int32))
    q, k, v = (np.array(x, dtype=float) for x in (ops.query, ops.key, ops.value))
    q[0, 2:], k[0, 3:], v[0, 3:], k[1, 1:], v[1, 1:] = np.nan, np.nan, np.nan, np.nan, np.nan
    ops = ops.replace(query=q, key=k, value=v)
    result = forward(cfg, ops)
    d_out = np.random.default_rng(2).standard_normal(result.output.shape)
    d_out[0, 2:] = np.nan                      # garbage in the padded rows of dO must not leak either
    grads = backward(cfg, ops, result.output, d_out, result.logsumexp)
    assert all(np.isfinite(x).all() for x in grads[:3])
    assert (grads.dq[0, 2:] == 0).all() and (grads.dk[0, 3:] == 0).all() and (grads.dv[1, 1:] == 0).all()
    assert (grads.dq[0, :2] != 0).all() and (grads.dv[0, :3] != 0).all()


@pytest.mark.parametrize("shape", [(1, 1, 4, 5), (2, 1, 4, 5), (1, 2, 4, 5)], ids=lambda s: "bias" + "".join(map(str, s)))
def test_dbias_is_full_gradient_summed_over_broadcast_dims(shape):
    cfg = config(bias=BiasSpec(shape, True), mask=StaticMask(right_bound=0))
    ops = random_operands(cfg, np.random.default_rng(3))
    result = forward(cfg, ops)
    d_out = np.random.default_rng(4).standard_normal(result.output.shape)
    grads = backward(cfg, ops, result.output, d_out, result.logsumexp)
    full_shape = (2, 2, 4, 5)
    full = dataclasses.replace(cfg, bias=BiasSpec(full_shape, True))
    full_ops = ops.replace(bias=np.broadcast_to(ops.bias, full_shape).copy())
    full_grads = backward(full, full_ops, result.output, d_out, result.logsumexp)
    axes = tuple(axis for axis in (0, 1) if shape[axis] == 1)
    assert grads.dbias.shape == shape
    np.testing.assert_allclose(grads.dbias, full_grads.dbias.sum(axis=axes, keepdims=True), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(grads.dq, full_grads.dq, rtol=1e-12, atol=1e-12)


def test_mask_only_bias_has_no_gradient():
    cfg = config(bias=BiasSpec((1, 1, 4, 5), differentiable=False))
    ops = random_operands(cfg, np.random.default_rng(5))
    result = forward(cfg, ops)
    grads = backward(cfg, ops, result.output, np.ones(result.output.shape), result.logsumexp)
    assert grads.dbias is None and grads.dsink is None


def test_additive_score_mod_equals_bias_and_its_gradient():
    def add(score, extra):
        return score + extra

    extra = np.random.default_rng(6).standard_normal((2, 2, 4, 5)).astype(np.float32)
    cfg = config(score_mod=score_mod_spec(add, (2, 2, 4, 5), (((2, 2, 4, 5), "float32"),)))
    ops = random_operands(cfg, np.random.default_rng(7)).replace(score_mod_args=(extra,))
    biased = dataclasses.replace(cfg, score_mod=None, bias=BiasSpec((2, 2, 4, 5), True))
    bias_ops = ops.replace(score_mod_args=(), bias=extra.astype(np.float64))
    result, reference = forward(cfg, ops), forward(biased, bias_ops)
    np.testing.assert_allclose(result.output, reference.output, rtol=1e-6, atol=1e-6)   # float32 scores
    d_out = np.random.default_rng(8).standard_normal(result.output.shape)
    grads = backward(cfg, ops, result.output, d_out, result.logsumexp)
    ref_grads = backward(biased, bias_ops, reference.output, d_out, reference.logsumexp)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(getattr(grads, name), getattr(ref_grads, name), rtol=1e-5, atol=1e-5)
