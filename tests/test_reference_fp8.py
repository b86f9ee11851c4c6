"""The FP8 emulation against exact float64 attention on the dequantised inputs.

FP8 rounds P, O, dS and the gradients to 3 (E4M3) or 2 (E5M2) mantissa bits, so the comparison uses
the cuDNN frontend's own FP8 tolerances (atol 0.08 / 0.125, rtol 0.2) on values scaled to a maximum
of one.  Every scale in these tests is a distinct power of two, so a scale applied in the wrong
place shows up as a factor of 2 or more.  The amax values are checked against the exact float64
quantities they summarise.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from cudnn_attn.core.config import AttentionConfig, BiasSpec, StaticMask
from cudnn_attn.core.errors import UnsupportedConfigurationError
from cudnn_attn.core.types import AttentionLayout
from cudnn_attn.reference import backward, forward
from cudnn_attn.reference.inputs import fp8_scale, random_operands

TOLERANCE = {"float8_e4m3fn": (0.08, 0.2), "float8_e5m2": (0.125, 0.2)}


def config(dtype="float8_e4m3fn", **changes) -> AttentionConfig:
    return AttentionConfig(**{**dict(batch=2, q_heads=4, kv_heads=2, q_len=16, kv_len=16, qk_dim=16, v_dim=16,
                                     dtype=dtype, scale=0.25, training=True), **changes})


def value(scales, name):
    return float(scales[name].reshape(()))


def dequantised(cfg, ops):
    """float64 config and operands holding the real values of the FP8 inputs."""
    sc = ops.fp8_scales
    exact = dataclasses.replace(cfg, dtype="float64")
    return exact, ops.replace(query=ops.query.astype(np.float64) * value(sc, "descale_q"),
                              key=ops.key.astype(np.float64) * value(sc, "descale_k"),
                              value=ops.value.astype(np.float64) * value(sc, "descale_v"), fp8_scales=None)


def assert_fp8_close(actual, expected, dtype):
    atol, rtol = TOLERANCE[dtype]
    norm = np.abs(expected).max()
    np.testing.assert_allclose(actual / norm, expected / norm, atol=atol, rtol=rtol)


CASES = {
    "e4m3": {},
    "e4m3_causal_bnth": dict(mask=StaticMask(right_bound=0), layout=AttentionLayout.BNTH),
    "e4m3_sink_padding": dict(sink=True, mask=StaticMask(right_bound=0, padding=True)),
    "e5m2_causal": dict(dtype="float8_e5m2", mask=StaticMask(right_bound=0)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_backward_match_float64_within_fp8_rounding(name):
    cfg = config(**CASES[name])
    dtype = cfg.dtype
    rng = np.random.default_rng(len(name))
    ops = random_operands(cfg, rng)
    exact_cfg, exact_ops = dequantised(cfg, ops)
    exact = forward(exact_cfg, exact_ops)
    result = forward(cfg, ops)
    sc = ops.fp8_scales

    o = result.output.astype(np.float64) * value(sc, "descale_o")
    assert result.output.dtype == np.dtype(dtype)
    assert_fp8_close(o, exact.output, dtype)
    np.testing.assert_allclose(result.logsumexp, exact.logsumexp, rtol=1e-6, atol=1e-6)   # from unquantised S
    assert result.amax_s.shape == result.amax_o.shape == (1, 1, 1, 1)
    # amax_o is max |O| before scale_o: the dequantised output is within half an FP8 step of it
    step = 2.0 ** -ml_dtypes.finfo(np.dtype(dtype)).nmant
    assert abs(np.abs(o).max() - result.amax_o.item()) <= step * result.amax_o.item()
    assert abs(result.amax_o.item() - np.abs(exact.output).max()) <= 0.1 * np.abs(exact.output).max()

    # backward: dO quantised at its own scale; dS, dQ, dK, dV scales from a float64 pass (as cuDNN's tests do)
    d_out = rng.standard_normal(exact.output.shape)
    exact_grads = backward(exact_cfg, exact_ops, exact.output, d_out, exact.logsumexp)
    scale_do = fp8_scale(np.abs(d_out).max(), np.dtype(dtype))
    d_out_fp8 = (d_out * scale_do).astype(dtype)
    amax_ds = _exact_amax_ds(exact_cfg, exact_ops, exact.output, d_out, exact.logsumexp)
    scales = dict(sc, descale_dO=1 / scale_do, scale_dP=fp8_scale(amax_ds, np.dtype(dtype)),
                  scale_dQ=fp8_scale(np.abs(exact_grads.dq).max(), np.dtype(dtype)),
                  scale_dK=fp8_scale(np.abs(exact_grads.dk).max(), np.dtype(dtype)),
                  scale_dV=fp8_scale(np.abs(exact_grads.dv).max(), np.dtype(dtype)))
    scales["descale_dP"] = 1 / scales["scale_dP"]
    scales = {k: np.full((1, 1, 1, 1), v, np.float32) for k, v in scales.items()}
    grads = backward(cfg, ops.replace(fp8_scales=scales), result.output, d_out_fp8, result.logsumexp)

    for name_, actual, expected, amax in (("dQ", grads.dq, exact_grads.dq, grads.amax_dQ),
                                          ("dK", grads.dk, exact_grads.dk, grads.amax_dK),
                                          ("dV", grads.dv, exact_grads.dv, grads.amax_dV)):
        assert actual.dtype == np.dtype(dtype)
        assert_fp8_close(actual.astype(np.float64) / value(scales, f"scale_{name_}"), expected, dtype)
        assert abs(amax.item() - np.abs(expected).max()) <= 0.15 * np.abs(expected).max(), name_
    assert abs(grads.amax_dP.item() - amax_ds) <= 0.15 * amax_ds
    if cfg.sink:
        np.testing.assert_allclose(grads.dsink, exact_grads.dsink, rtol=0.2, atol=0.05 * np.abs(exact_grads.dsink).max())


def _exact_amax_ds(cfg, ops, output, d_out, lse):
    """max |scale * P * (dP - D)| of the exact problem: the quantity amax_dP reports."""
    from cudnn_attn.reference.problem import load, probabilities, scores
    problem = load(cfg, ops)
    s, _ = scores(problem, cfg.scale)
    p = probabilities(s, problem.token_logsumexp(lse))
    o, do = problem.read_q_like(output), problem.read_q_like(d_out)
    dp = np.einsum("bntd,bnsd->bnts", do, problem.v)
    return float(np.abs(cfg.scale * p * (dp - (do * o).sum(-1)[..., None])).max())


def test_amax_s_is_max_of_the_unquantised_probabilities():
    cfg = config(mask=StaticMask(right_bound=0, left_bound=3))
    ops = random_operands(cfg, np.random.default_rng(11))
    exact_cfg, exact_ops = dequantised(cfg, ops)
    from cudnn_attn.reference.problem import load, scores, softmax
    problem = load(exact_cfg, exact_ops)
    p, _ = softmax(scores(problem, cfg.scale)[0], None)
    np.testing.assert_allclose(forward(cfg, ops).amax_s.item(), p.max(), rtol=1e-6)


def test_quantisation_saturates_instead_of_overflowing():
    cfg = config()
    ops = random_operands(cfg, np.random.default_rng(12))
    scales = dict(ops.fp8_scales, scale_o=np.full((1, 1, 1, 1), 2.0 ** 20, np.float32))
    out = forward(cfg, ops.replace(fp8_scales=scales)).output.astype(np.float64)
    assert np.isfinite(out).all() and np.abs(out).max() == 448.0


@pytest.mark.parametrize("feature", ["bias", "dropout", "alibi"])
def test_unemulated_features_are_refused(feature):
    changes = {"bias": dict(bias=BiasSpec((1, 1, 16, 16), True)), "dropout": dict(dropout_rate=0.1),
               "alibi": dict(mask=StaticMask(right_bound=0, alibi=True))}[feature]
    cfg = config(**changes)
    ops = random_operands(cfg, np.random.default_rng(13))
    with pytest.raises(UnsupportedConfigurationError, match={"bias": "takes no bias", "dropout": "no dropout",
                                                             "alibi": "found ALiBi"}[feature]):
        forward(cfg, ops)
