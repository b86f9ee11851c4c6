"""The reference forward against a brute-force per-element implementation, and its conventions.

The brute force below is written independently of the reference: one loop per (batch, head, query),
the admissible keys listed by the plain rules of the docs (causal ``j <= i + delta``, window
``j > i + delta - w``, padding ``j < kv_seqlen``), then an explicit softmax.  Everything runs in
float64, so the tolerance is float64 round-off plus the float32 rounding of the logsumexp.
"""

from __future__ import annotations

import dataclasses
import math
import zlib

import numpy as np
import pytest

from cudnn_attn.core.config import AttentionConfig, BiasSpec, DiagonalAlignment, StaticMask
from cudnn_attn.core.types import AttentionLayout
from cudnn_attn.reference import alibi_slopes, forward
from cudnn_attn.reference.inputs import random_operands

RTOL, ATOL = 1e-10, 1e-10           # float64 output
LSE_RTOL = 2e-7                     # float32 logsumexp

BASE = dict(batch=2, q_heads=4, kv_heads=2, q_len=5, kv_len=7, qk_dim=3, v_dim=3, dtype="float64", scale=0.7,
            training=True)


def config(**changes) -> AttentionConfig:
    return AttentionConfig(**{**BASE, **changes})


def btnh(x: np.ndarray, layout: AttentionLayout) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x if layout is AttentionLayout.BTNH else x.transpose(0, 2, 1, 3)


def brute_force(cfg: AttentionConfig, ops, keep=None) -> tuple[np.ndarray, np.ndarray]:
    """Output (B, T, N, Hv) and per-token logsumexp (B, N, T), by loops."""
    q, k, v = (btnh(x, cfg.layout) for x in (ops.query, ops.key, ops.value))
    B, T, N, _ = q.shape
    S, K = k.shape[1], k.shape[2]
    out = np.zeros((B, T, N, cfg.v_dim))
    lse = np.zeros((B, N, T))
    slopes = alibi_slopes(N) if cfg.mask.alibi else np.zeros(N)
    for b in range(B):
        q_len = int(ops.q_seqlen[b]) if cfg.mask.padding else T
        kv_len = int(ops.kv_seqlen[b]) if cfg.mask.padding else S
        delta = kv_len - q_len if cfg.mask.alignment is DiagonalAlignment.BOTTOM_RIGHT else 0
        for h in range(N):
            kh = h // (N // K)
            for i in range(q_len):
                keys, logits = [], []
                for j in range(kv_len):
                    if cfg.mask.right_bound is not None and j > i + delta + cfg.mask.right_bound:
                        continue
                    if cfg.mask.left_bound is not None and j <= i + delta - cfg.mask.left_bound:
                        continue
                    x = cfg.scale * float(q[b, i, h] @ k[b, j, kh]) + slopes[h] * (j - i)
                    if ops.bias is not None:
                        x += float(ops.bias[b % ops.bias.shape[0], h % ops.bias.shape[1], i, j])
                    keys.append(j)
                    logits.append(x)
                denominator = sum(math.exp(x) for x in logits)
                if ops.sink is not None:
                    denominator += math.exp(float(ops.sink[h]))
                lse[b, h, i] = math.log(denominator) if denominator > 0 else -math.inf
                for j, x in zip(keys, logits):
                    weight = math.exp(x) / denominator
                    if keep is not None:
                        weight *= keep[b, h, i, j] / (1 - cfg.dropout_rate)
                    out[b, i, h] += weight * v[b, j, kh]
    return out, lse


def token_lse(cfg: AttentionConfig, ops, logsumexp: np.ndarray) -> np.ndarray:
    """The API logsumexp (B, N, T) of an unpacked call is already per token."""
    assert logsumexp.shape == (cfg.batch, cfg.q_heads, cfg.q_len)
    return logsumexp.astype(np.float64)


CASES = {
    "plain": {},
    "plain_bnth": dict(layout=AttentionLayout.BNTH),
    "mha": dict(kv_heads=4),
    "mqa": dict(kv_heads=1),
    "mla_v_dim_5": dict(v_dim=5),
    "causal": dict(mask=StaticMask(right_bound=0)),
    "causal_bottom_right": dict(mask=StaticMask(right_bound=0, alignment=DiagonalAlignment.BOTTOM_RIGHT)),
    "band_right_2": dict(mask=StaticMask(right_bound=2)),
    "window_3": dict(mask=StaticMask(right_bound=0, left_bound=3)),
    "window_2_bottom_right": dict(mask=StaticMask(right_bound=0, left_bound=2,
                                                  alignment=DiagonalAlignment.BOTTOM_RIGHT)),
    "padding": dict(mask=StaticMask(padding=True)),
    "padding_causal": dict(mask=StaticMask(right_bound=0, padding=True)),
    "padding_causal_bottom_right": dict(mask=StaticMask(right_bound=0, padding=True,
                                                        alignment=DiagonalAlignment.BOTTOM_RIGHT)),
    "padding_window_2_bnth": dict(mask=StaticMask(right_bound=0, left_bound=2, padding=True),
                                  layout=AttentionLayout.BNTH),
    "alibi": dict(mask=StaticMask(right_bound=0, alibi=True)),
    "alibi_6_heads_padding": dict(q_heads=6, kv_heads=3, mask=StaticMask(right_bound=0, alibi=True, padding=True)),
    "bias_BNTS": dict(bias=BiasSpec((2, 4, 5, 7), True)),
    "bias_1NTS": dict(bias=BiasSpec((1, 4, 5, 7), True)),
    "bias_B1TS": dict(bias=BiasSpec((2, 1, 5, 7), True)),
    "bias_11TS_causal": dict(bias=BiasSpec((1, 1, 5, 7), True), mask=StaticMask(right_bound=0)),
    "sink": dict(sink=True),
    "sink_padding_causal": dict(sink=True, mask=StaticMask(right_bound=0, padding=True)),
    "dropout": dict(dropout_rate=0.25),
    "everything": dict(q_heads=4, kv_heads=1, v_dim=2, layout=AttentionLayout.BNTH, bias=BiasSpec((2, 1, 5, 7), True),
                       mask=StaticMask(right_bound=0, left_bound=4, padding=True), sink=True, dropout_rate=0.5),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_brute_force(name):
    cfg = config(**CASES[name])
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    ops = random_operands(cfg, rng)
    keep = None
    if cfg.has_dropout:
        keep = (rng.random((cfg.batch, cfg.q_heads, cfg.q_len, cfg.kv_len)) >= cfg.dropout_rate).astype(float)
    result = forward(cfg, ops, dropout_mask=keep)
    expected_out, expected_lse = brute_force(cfg, ops, keep)
    np.testing.assert_allclose(btnh(result.output, cfg.layout), expected_out, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(token_lse(cfg, ops, result.logsumexp), expected_lse, rtol=LSE_RTOL, atol=LSE_RTOL)


def test_logsumexp_is_natural_log_of_summed_exponentials():
    cfg = config(mask=StaticMask(right_bound=0), training=True)
    ops = random_operands(cfg, np.random.default_rng(3))
    q, k = btnh(ops.query, cfg.layout), np.repeat(btnh(ops.key, cfg.layout), 2, axis=2)
    s = cfg.scale * np.einsum("bind,bjnd->bnij", q, k)
    s = np.where(np.tril(np.ones((cfg.q_len, cfg.kv_len), bool)), s, -np.inf)
    lse = forward(cfg, ops).logsumexp
    assert lse.dtype == np.float32 and lse.shape == cfg.lse_shape
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=LSE_RTOL)


def test_inference_config_returns_no_logsumexp():
    cfg = config(training=False)
    assert forward(cfg, random_operands(cfg, np.random.default_rng(4))).logsumexp is None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_output_is_float64_result_rounded_once_to_io_dtype(dtype):
    cfg = config(dtype=dtype, mask=StaticMask(right_bound=0))
    ops = random_operands(cfg, np.random.default_rng(5))
    result = forward(cfg, ops)
    exact = forward(dataclasses.replace(cfg, dtype="float64"),
                    ops.replace(query=ops.query.astype(np.float64), key=ops.key.astype(np.float64),
                                value=ops.value.astype(np.float64))).output
    assert result.output.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(result.output, exact.astype(dtype))


@pytest.mark.parametrize("heads,expected", [
    (1, [2.0 ** -8]),
    (4, [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]),
    (8, [2.0 ** -h for h in range(1, 9)]),
    # 6 heads: the 4 slopes of 4 heads, then slopes 1 and 3 of 8 heads (ALiBi paper, cuDNN fp16_ref.py)
    (6, [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]),
    (12, [2.0 ** -h for h in range(1, 9)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5]),
], ids=lambda x: f"heads{x}" if isinstance(x, int) else "")
def test_alibi_slopes(heads, expected):
    np.testing.assert_allclose(alibi_slopes(heads), expected, rtol=1e-15)


def test_alibi_equals_explicit_bias_of_slope_times_key_minus_query():
    cfg = config(mask=StaticMask(right_bound=0, alibi=True))
    ops = random_operands(cfg, np.random.default_rng(6))
    j_minus_i = np.arange(cfg.kv_len)[None, :] - np.arange(cfg.q_len)[:, None]
    bias = alibi_slopes(cfg.q_heads)[None, :, None, None] * j_minus_i
    explicit = forward(config(mask=StaticMask(right_bound=0), bias=BiasSpec(bias.shape, True)), ops.replace(bias=bias))
    np.testing.assert_allclose(forward(cfg, ops).output, explicit.output, rtol=1e-13, atol=1e-13)


def test_tokens_outside_the_sequences_give_zero_and_never_leak():
    cfg = config(mask=StaticMask(right_bound=0, padding=True), batch=3)
    ops = random_operands(cfg, np.random.default_rng(7), poison=False)
    q, k, v = (btnh(x, cfg.layout).copy() for x in (ops.query, ops.key, ops.value))
    for b, (q_len, kv_len) in enumerate([(5, 7), (2, 3), (1, 1)]):
        q[b, q_len:] = np.nan
        k[b, kv_len:] = np.nan
        v[b, kv_len:] = np.nan
    ops = ops.replace(query=q, key=k, value=v, q_seqlen=np.array([5, 2, 1], np.int32),
                      kv_seqlen=np.array([7, 3, 1], np.int32))
    result = forward(cfg, ops)
    out = btnh(result.output, cfg.layout)
    assert np.isfinite(out).all() and np.isfinite(result.logsumexp).all()
    assert (out[1, 2:] == 0).all() and (out[2, 1:] == 0).all()
    assert (result.logsumexp[1, :, 2:] == 0).all() and (result.logsumexp[2, :, 1:] == 0).all()
    assert (out[0] != 0).all() and (out[1, :2] != 0).all()


def test_query_without_admissible_key_gives_zero_output_and_minus_inf_logsumexp():
    # bottom-right causal with T > S: query i sees keys j <= i - (T - S); the first T - S see none.
    cfg = config(q_len=6, kv_len=4, mask=StaticMask(right_bound=0, alignment=DiagonalAlignment.BOTTOM_RIGHT))
    result = forward(cfg, random_operands(cfg, np.random.default_rng(8)))
    out = btnh(result.output, cfg.layout)
    assert (out[:, :2] == 0).all() and (result.logsumexp[:, :, :2] == -np.inf).all()
    assert np.isfinite(out[:, 2:]).all() and (out[:, 2:] != 0).all()


def test_sink_joins_the_denominator_only():
    cfg = config(sink=True)
    ops = random_operands(cfg, np.random.default_rng(9))
    with_sink = forward(cfg, ops)
    without = forward(config(), ops.replace(sink=None))
    # O_sink = O * sum exp(s) / (sum exp(s) + exp(sink)) = O * (1 - exp(sink - lse_sink))
    share = np.exp(ops.sink.astype(np.float64)[None, :, None] - with_sink.logsumexp.astype(np.float64))
    np.testing.assert_allclose(btnh(with_sink.output, cfg.layout),
                               btnh(without.output, cfg.layout) * (1 - share).transpose(0, 2, 1)[..., None],
                               rtol=1e-6)
    np.testing.assert_allclose(np.exp(with_sink.logsumexp.astype(np.float64)),
                               np.exp(without.logsumexp.astype(np.float64)) + np.exp(ops.sink)[None, :, None],
                               rtol=1e-6)
