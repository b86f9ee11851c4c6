"""The seed-compatible wrappers: argument handling, return conventions and value errors."""

from __future__ import annotations

import numpy as np
import pytest

from cudnn_attn.core.config import AttentionConfig, PagingSpec, StaticMask
from cudnn_attn.core.errors import UnsupportedConfigurationError
from cudnn_attn.core.types import FP8_PARAM_KEYS, AttentionGrads, MaskType
from cudnn_attn.core.validation import validate_call
from cudnn_attn.reference import backward, dot_product_attention, dot_product_attention_bwd, forward, paged_attention
from cudnn_attn.reference.inputs import random_operands

B, T, S, N, K, H = 2, 6, 8, 4, 2, 8


def qkv(dtype=np.float16, seed=0, layout="BTNH"):
    rng = np.random.default_rng(seed)
    shapes = [(B, T, N, H), (B, S, K, H), (B, S, K, H)]
    if layout == "BNTH":
        shapes = [(b, n, t, h) for b, t, n, h in shapes]
    return tuple(rng.standard_normal(shape).astype(dtype) for shape in shapes)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["BTNH", "BNTH"])
def test_wrapper_equals_core_forward_and_backward(dtype, layout):
    q, k, v = qkv(np.dtype(dtype), layout=layout)
    seqlens = np.array([4, 6], np.int32), np.array([8, 3], np.int32)
    kwargs = dict(scale=0.4, mask_type=MaskType.PADDING_CAUSAL, qkv_layout=layout)
    out, lse = dot_product_attention(q, k, v, None, None, *seqlens, return_residual=True, **kwargs)
    config, operands = validate_call(q, k, v, None, None, *seqlens, training=True, xp=np, **kwargs)
    core = forward(config, operands)
    np.testing.assert_array_equal(out, core.output)
    np.testing.assert_array_equal(lse, core.logsumexp)
    assert out.dtype == np.dtype(dtype) and lse.dtype == np.float32 and lse.shape == (B, N, T)
    d_out = np.random.default_rng(1).standard_normal(out.shape).astype(out.dtype)
    grads = dot_product_attention_bwd(q, k, v, out, d_out, lse, None, None, *seqlens, **kwargs)
    assert isinstance(grads, AttentionGrads)
    for mine, theirs in zip(grads[:3], backward(config, operands, out, d_out, lse)[:3]):
        np.testing.assert_array_equal(mine, theirs)
    assert grads.dbias is None


def test_plain_call_returns_only_the_output():
    q, k, v = qkv()
    out = dot_product_attention(q, k, v, scale=0.5)
    assert isinstance(out, np.ndarray) and out.shape == (B, T, N, H)


def test_boolean_mask_acts_like_the_causal_mask_type():
    q, k, v = qkv(seed=2)
    causal = dot_product_attention(q, k, v, scale=0.5, mask_type=MaskType.CAUSAL)
    keep = np.tril(np.ones((T, S), bool))
    masked = dot_product_attention(q, k, v, mask=keep, scale=0.5)
    np.testing.assert_allclose(masked.astype(float), causal.astype(float), atol=2e-3)


def test_differentiable_bias_gets_a_gradient_and_boolean_mask_does_not():
    q, k, v = qkv(seed=3)
    bias = np.random.default_rng(4).standard_normal((1, N, T, S)).astype(np.float16)
    keep = np.random.default_rng(5).random((T, S)) > 0.3
    keep[:, 0] = True
    out, lse = dot_product_attention(q, k, v, bias, keep, return_residual=True)
    d_out = np.ones_like(out)
    with_bias = dot_product_attention_bwd(q, k, v, out, d_out, lse, bias, keep)
    assert with_bias.dbias.shape == (1, N, T, S) and with_bias.dbias.dtype == np.float16
    out, lse = dot_product_attention(q, k, v, None, keep, return_residual=True)
    assert dot_product_attention_bwd(q, k, v, out, d_out, lse, None, keep).dbias is None


def test_extension_keywords(monkeypatch):
    monkeypatch.setenv("CUDNN_ATTN_CPU_TARGET", "off")          # bottom-right with dropout: no GPU runs it
    q, k, v = qkv(seed=6)
    sink = np.random.default_rng(7).standard_normal(N).astype(np.float32)
    keep = np.random.default_rng(8).random((B, N, T, S)) > 0.25
    kwargs = dict(mask_type=MaskType.CAUSAL, diagonal_alignment="bottom_right", sink=sink, dropout_rate=0.25,
                  dropout_mask=keep)
    out, lse = dot_product_attention(q, k, v, return_residual=True, **kwargs)
    config, operands = validate_call(q, k, v, sink=sink, mask_type=MaskType.CAUSAL, diagonal_alignment="bottom_right",
                                     dropout_rate=0.25, training=True, xp=np)
    assert config.sink and config.mask.alignment.value == "bottom_right"
    np.testing.assert_array_equal(out, forward(config, operands, dropout_mask=keep).output)
    grads = dot_product_attention_bwd(q, k, v, out, np.ones_like(out), lse, deterministic=True, **kwargs)
    assert grads.dsink.shape == (N,) and grads.dsink.dtype == np.float32


def test_paged_attention_equals_contiguous_call():
    block, per_seq = 2, S // 2
    cfg = AttentionConfig(batch=B, q_heads=N, kv_heads=K, q_len=T, kv_len=S, qk_dim=H, v_dim=H, dtype="float16",
                          mask=StaticMask(padding=True), paging=PagingSpec(11, 11, block, per_seq))
    ops = random_operands(cfg, np.random.default_rng(9))
    out = paged_attention(ops.query, ops.key, ops.value, ops.q_seqlen, ops.kv_seqlen, ops.page_table_k,
                          ops.page_table_v, scale=0.3, mask_type=MaskType.PADDING)
    k = ops.key[ops.page_table_k[:, 0, :, 0]].reshape(B, S, K, H)
    v = ops.value[ops.page_table_v[:, 0, :, 0]].reshape(B, S, K, H)
    expected = dot_product_attention(ops.query, k, v, q_seqlen=ops.q_seqlen, kv_seqlen=ops.kv_seqlen, scale=0.3,
                                     mask_type=MaskType.PADDING)
    np.testing.assert_array_equal(out, expected)
    assert np.isfinite(out.astype(float)).all()


def test_fp8_call_returns_output_and_amax_values(monkeypatch):
    monkeypatch.setenv("CUDNN_ATTN_CPU_TARGET", "off")          # FP8 at head dim 8: no GPU runs it
    q, k, v = (x.astype(np.float32).astype("float8_e4m3fn") for x in qkv(np.float32, seed=11))
    params = {name: np.ones((1, 1, 1, 1), np.float32) for name in FP8_PARAM_KEYS}
    params["scale_s"] = np.full((1, 1, 1, 1), 256, np.float32)
    params["descale_s"] = np.full((1, 1, 1, 1), 1 / 256, np.float32)
    out, amax_s, amax_o = dot_product_attention(q, k, v, fp8_params=params, use_fp8=True, scale=0.3,
                                                mask_type=MaskType.CAUSAL)
    assert out.dtype == np.dtype("float8_e4m3fn") and amax_s.shape == amax_o.shape == (1, 1, 1, 1)
    assert amax_s.item() == 1.0                      # the first query sees one key
    assert 0 < amax_o.item() <= np.abs(v.astype(float)).max()


@pytest.mark.parametrize("offsets,seqlen,match", [
    ([[0, 3, -1], [0, -1, -1]], [[3, -1], [2, -1]], r"q_offsets: row 0 is \[0, 3, -1\], but q_seqlen\[0\]"),
    ([[0, 2, 3], [0, -1, -1]], [[2, 4], [2, -1]], "q_offsets: row 0"),
    ([[0, 4, -1], [0, -1, -1]], [[4, 3], [2, -1]], "must lie inside the row"),
    ([[0, 2, -1], [0, -1, -1]], [[4, 2], [2, -1]], "overlap"),
], ids=["seqlen_missing_a_segment", "offsets_with_extra_entry", "segment_past_row_end", "overlapping_segments"])
def test_inconsistent_packed_segments_are_value_errors(offsets, seqlen, match):
    q, k, v = qkv(seed=12)
    offsets, seqlen = np.array(offsets, np.int32), np.array(seqlen, np.int32)
    with pytest.raises(ValueError, match=match):
        dot_product_attention(q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets, kv_offsets=offsets)


def test_out_of_range_lengths_and_page_entries_are_value_errors():
    q, k, v = qkv(seed=13)
    with pytest.raises(ValueError, match=r"kv_seqlen: row 0 is 9, outside \[0, 8\]"):
        dot_product_attention(q, k, v, q_seqlen=np.array([1, 2], np.int32), kv_seqlen=np.array([9, 2], np.int32),
                              mask_type=MaskType.PADDING)
    cache = np.zeros((4, 2, K, H), np.float16)
    table = np.array([[0, 1, 2, 3], [3, 2, 1, 9]], np.int32).reshape(B, 1, 4, 1)
    with pytest.raises(ValueError, match=r"page_table_k: row 1: entry \[1, 0, 3, 0\] = 9"):
        paged_attention(q, cache, cache, np.array([6, 6], np.int32), np.array([8, 8], np.int32), table, table)
    # the same entry is never read when kv_seqlen ends before its block
    paged_attention(q, cache, cache, np.array([6, 6], np.int32), np.array([8, 6], np.int32), table, table)


def test_dropout_mask_needs_a_rate_and_the_right_shape():
    q, k, v = qkv(seed=14)
    with pytest.raises(ValueError, match="dropout_mask: given, but dropout_rate is 0"):
        dot_product_attention(q, k, v, dropout_mask=np.ones((B, N, T, S)))
    with pytest.raises(ValueError, match=r"dropout_mask: must have shape \(B, N, T, S\)"):
        dot_product_attention(q, k, v, dropout_rate=0.1, dropout_mask=np.ones((B, N, T, T)))


def test_score_mod_must_keep_the_score_shape():
    q, k, v = qkv(seed=15)
    with pytest.raises(ValueError, match=r"score_mod: .* must return one float array of the score.s shape"):
        dot_product_attention(q, k, v, score_mod=lambda s: s[..., :1])


def test_paged_backward_is_unsupported():
    block, per_seq = 2, S // 2
    cfg = AttentionConfig(batch=B, q_heads=N, kv_heads=K, q_len=T, kv_len=S, qk_dim=H, v_dim=H, dtype="float16",
                          mask=StaticMask(padding=True), paging=PagingSpec(8, 8, block, per_seq), training=True)
    ops = random_operands(cfg, np.random.default_rng(16))
    result = forward(cfg, ops)
    with pytest.raises(UnsupportedConfigurationError, match="paged"):
        backward(cfg, ops, result.output, np.ones_like(result.output), result.logsumexp)
