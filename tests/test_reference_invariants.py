"""Identities between reference calls, forward and backward: each rewrites one feature in terms of
another (packed = separate calls, paged = contiguous, GQA = repeated heads, ...).  float64 throughout,
so the tolerance is round-off (and the float32 logsumexp the backward reads)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cudnn_attn.core.config import AttentionConfig, BiasSpec, DiagonalAlignment, PackingSpec, PagingSpec, StaticMask
from cudnn_attn.core.types import AttentionLayout
from cudnn_attn.reference import backward, forward
from cudnn_attn.reference.inputs import random_operands

TOL = dict(rtol=1e-9, atol=1e-9)
GRAD_TOL = dict(rtol=2e-6, atol=2e-6)        # the backward reads the float32 logsumexp

BASE = dict(batch=2, q_heads=4, kv_heads=2, q_len=6, kv_len=6, qk_dim=3, v_dim=3, dtype="float64", scale=0.6,
            training=True)


def config(**changes) -> AttentionConfig:
    return AttentionConfig(**{**BASE, **changes})


def run(cfg, ops, rng_seed=0, **kw):
    """Forward, then backward with a fixed random dO: (output, logsumexp, grads)."""
    result = forward(cfg, ops, **kw)
    d_out = np.random.default_rng(rng_seed).standard_normal(result.output.shape)
    grads = backward(cfg, ops, result.output, d_out, result.logsumexp, **kw)
    return result.output, result.logsumexp, grads, d_out


def bnth(x):
    return np.asarray(x).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("mask", [StaticMask(padding=True), StaticMask(right_bound=0, padding=True),
                                  StaticMask(right_bound=0, left_bound=2, padding=True),
                                  StaticMask(right_bound=0, padding=True, alignment=DiagonalAlignment.BOTTOM_RIGHT)],
                         ids=lambda m: m.describe())
def test_packed_equals_separate_calls_per_segment(mask):
    cfg = config(batch=2, q_len=9, kv_len=10, mask=mask, packing=PackingSpec(max_segments=3), sink=True)
    ops = random_operands(cfg, np.random.default_rng(1))
    out, lse, grads, d_out = run(cfg, ops)
    q, k, v, do = (np.asarray(x) for x in (ops.query, ops.key, ops.value, d_out))
    g = 0
    covered_q, covered_kv = np.zeros(q.shape[:2], bool), np.zeros(k.shape[:2], bool)
    for b in range(cfg.batch):
        for m in range(cfg.packing.max_segments):
            if ops.q_seqlen[b, m] < 0:
                continue
            qs = slice(ops.q_offsets[b, m], ops.q_offsets[b, m] + ops.q_seqlen[b, m])
            ks = slice(ops.kv_offsets[b, m], ops.kv_offsets[b, m] + ops.kv_seqlen[b, m])
            covered_q[b, qs], covered_kv[b, ks] = True, True
            single = config(q_len=qs.stop - qs.start, kv_len=ks.stop - ks.start, batch=1, sink=True,
                            mask=dataclasses.replace(mask, padding=False))
            part = ops.replace(query=q[b:b + 1, qs], key=k[b:b + 1, ks], value=v[b:b + 1, ks], q_seqlen=None,
                               kv_seqlen=None, q_offsets=None, kv_offsets=None)
            result = forward(single, part)
            part_grads = backward(single, part, result.output, do[b:b + 1, qs], result.logsumexp)
            np.testing.assert_allclose(out[b:b + 1, qs], result.output, **TOL)
            np.testing.assert_allclose(lse[g, :, :qs.stop - qs.start], result.logsumexp[0], **TOL)
            np.testing.assert_allclose(grads.dq[b:b + 1, qs], part_grads.dq, **GRAD_TOL)
            np.testing.assert_allclose(grads.dk[b:b + 1, ks], part_grads.dk, **GRAD_TOL)
            np.testing.assert_allclose(grads.dv[b:b + 1, ks], part_grads.dv, **GRAD_TOL)
            g += 1
    assert (lse[g:] == 0).all()
    assert (out[~covered_q] == 0).all() and (grads.dq[~covered_q] == 0).all()
    assert (grads.dk[~covered_kv] == 0).all() and (grads.dv[~covered_kv] == 0).all()


@pytest.mark.parametrize("layout", list(AttentionLayout), ids=lambda x: x.name)
@pytest.mark.parametrize("spare_blocks", [0, 5], ids=lambda n: f"spare{n}")
def test_paged_equals_gathered_contiguous_cache(layout, spare_blocks):
    block, per_seq, batch = 3, 4, 3
    paging = PagingSpec(num_blocks_k=batch * per_seq + spare_blocks, num_blocks_v=batch * per_seq + spare_blocks,
                        block_size=block, blocks_per_seq=per_seq)
    cfg = config(batch=batch, q_len=4, kv_len=block * per_seq, layout=layout, paging=paging,
                 mask=StaticMask(right_bound=0, padding=True, alignment=DiagonalAlignment.BOTTOM_RIGHT))
    ops = random_operands(cfg, np.random.default_rng(2))        # shuffled tables, NaN in unused blocks/tails
    assert np.isnan(np.asarray(ops.key)).any()
    contiguous = []
    for cache, table in ((ops.key, ops.page_table_k), (ops.value, ops.page_table_v)):
        cache = np.asarray(cache) if layout is AttentionLayout.BTNH else bnth(cache)   # (blocks, bs, K, H)
        kv = cache[table[:, 0, :, 0]].reshape(batch, per_seq * block, *cache.shape[2:])
        contiguous.append(kv if layout is AttentionLayout.BTNH else bnth(kv))
    plain = forward(dataclasses.replace(cfg, paging=None),
                    ops.replace(key=contiguous[0], value=contiguous[1], page_table_k=None, page_table_v=None))
    paged = forward(cfg, ops)
    assert np.isfinite(paged.output).all()
    np.testing.assert_allclose(paged.output, plain.output, **TOL)
    np.testing.assert_allclose(paged.logsumexp, plain.logsumexp, **TOL)


@pytest.mark.parametrize("kv_heads", [1, 2], ids=["mqa", "gqa"])
def test_grouped_heads_equal_repeated_kv_heads(kv_heads):
    cfg = config(q_heads=4, kv_heads=kv_heads, mask=StaticMask(right_bound=0, padding=True),
                 bias=BiasSpec((1, 4, 6, 6), True), sink=True)
    ops = random_operands(cfg, np.random.default_rng(3))
    out, lse, grads, d_out = run(cfg, ops)
    repeat = 4 // kv_heads
    full = dataclasses.replace(cfg, kv_heads=4)
    ops_full = ops.replace(key=np.repeat(ops.key, repeat, axis=2), value=np.repeat(ops.value, repeat, axis=2))
    result = forward(full, ops_full)
    full_grads = backward(full, ops_full, result.output, d_out, result.logsumexp)
    np.testing.assert_allclose(out, result.output, **TOL)
    np.testing.assert_allclose(grads.dq, full_grads.dq, **GRAD_TOL)
    for mine, theirs in ((grads.dk, full_grads.dk), (grads.dv, full_grads.dv)):
        b, s, _, h = theirs.shape
        np.testing.assert_allclose(mine, theirs.reshape(b, s, kv_heads, repeat, h).sum(axis=3), **GRAD_TOL)
    np.testing.assert_allclose(grads.dbias, full_grads.dbias, **GRAD_TOL)
    np.testing.assert_allclose(grads.dsink, full_grads.dsink, rtol=1e-5)


def test_padding_causal_equals_causal_on_the_valid_prefix():
    cfg = config(batch=2, q_len=6, kv_len=7, mask=StaticMask(right_bound=0, padding=True))
    ops = random_operands(cfg, np.random.default_rng(4))
    out, lse, grads, d_out = run(cfg, ops)
    for b in range(cfg.batch):
        t, s = int(ops.q_seqlen[b]), int(ops.kv_seqlen[b])
        prefix = config(batch=1, q_len=t, kv_len=s, mask=StaticMask(right_bound=0))
        part = ops.replace(query=ops.query[b:b + 1, :t], key=ops.key[b:b + 1, :s], value=ops.value[b:b + 1, :s],
                           q_seqlen=None, kv_seqlen=None)
        result = forward(prefix, part)
        part_grads = backward(prefix, part, result.output, d_out[b:b + 1, :t], result.logsumexp)
        np.testing.assert_allclose(out[b:b + 1, :t], result.output, **TOL)
        np.testing.assert_allclose(lse[b:b + 1, :, :t], result.logsumexp, **TOL)
        for name in ("dq", "dk", "dv"):
            length = t if name == "dq" else s
            np.testing.assert_allclose(getattr(grads, name)[b:b + 1, :length], getattr(part_grads, name), **GRAD_TOL)


def test_btnh_equals_transposed_bnth():
    cfg = config(q_len=5, kv_len=7, v_dim=4, mask=StaticMask(right_bound=0, left_bound=3, padding=True),
                 bias=BiasSpec((2, 1, 5, 7), True), sink=True)
    ops = random_operands(cfg, np.random.default_rng(5))
    out, lse, grads, d_out = run(cfg, ops)
    transposed = ops.replace(query=bnth(ops.query), key=bnth(ops.key), value=bnth(ops.value))
    cfg_bnth = dataclasses.replace(cfg, layout=AttentionLayout.BNTH)
    result = forward(cfg_bnth, transposed)
    bnth_grads = backward(cfg_bnth, transposed, result.output, bnth(d_out), result.logsumexp)
    np.testing.assert_allclose(out, bnth(result.output), **TOL)
    np.testing.assert_array_equal(lse, result.logsumexp)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(getattr(grads, name), bnth(getattr(bnth_grads, name)), **GRAD_TOL)
    np.testing.assert_allclose(grads.dbias, bnth_grads.dbias, **GRAD_TOL)


@pytest.mark.parametrize("mask", [StaticMask(right_bound=0), StaticMask(right_bound=0, left_bound=2)],
                         ids=["causal", "window2"])
def test_bottom_right_equals_top_left_when_lengths_match(mask):
    cfg = config(q_len=6, kv_len=6, mask=mask)
    ops = random_operands(cfg, np.random.default_rng(6))
    out, lse, grads, _ = run(cfg, ops)
    br = dataclasses.replace(cfg, mask=dataclasses.replace(mask, alignment=DiagonalAlignment.BOTTOM_RIGHT))
    out_br, lse_br, grads_br, _ = run(br, ops)
    np.testing.assert_array_equal(out, out_br)
    np.testing.assert_array_equal(grads.dq, grads_br.dq)
    # ... and differs once T != S
    longer = config(q_len=4, kv_len=6, mask=mask)
    ops = random_operands(longer, np.random.default_rng(6))
    assert not np.allclose(forward(longer, ops).output,
                           forward(dataclasses.replace(longer, mask=br.mask), ops).output)


def test_dropout_mask_of_ones_equals_no_dropout_scaled():
    p = 0.2
    cfg = config(dropout_rate=p, mask=StaticMask(right_bound=0))
    ops = random_operands(cfg, np.random.default_rng(7))
    ones = np.ones((cfg.batch, cfg.q_heads, cfg.q_len, cfg.kv_len))
    out, lse, grads, d_out = run(cfg, ops, dropout_mask=ones)
    plain = dataclasses.replace(cfg, dropout_rate=0.0)
    ref_out, ref_lse, ref_grads, _ = run(plain, ops)
    np.testing.assert_allclose(out * (1 - p), ref_out, **TOL)
    np.testing.assert_array_equal(lse, ref_lse)                     # the logsumexp is of the undropped P
    # dO -> dO / (1 - p) through the dropout scale: with dO' = (1 - p) dO the gradients are the plain ones
    grads_scaled = backward(cfg, ops, out, d_out * (1 - p), lse, dropout_mask=ones)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_allclose(getattr(grads_scaled, name), getattr(ref_grads, name), **GRAD_TOL)


def test_drawn_dropout_mask_follows_the_seed():
    cfg = config(dropout_rate=0.5)
    ops = random_operands(cfg, np.random.default_rng(8))
    first, again, other = (forward(cfg, ops, seed=s).output for s in (1, 1, 2))
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other)
    keep = (np.random.default_rng(1).random((2, 4, 6, 6)) >= 0.5).astype(float)
    np.testing.assert_array_equal(first, forward(cfg, ops, dropout_mask=keep).output)


def test_random_operands_poison_exactly_the_unused_values():
    cfg = config(batch=3, mask=StaticMask(padding=True), layout=AttentionLayout.BNTH)
    ops = random_operands(cfg, np.random.default_rng(9))
    for b in range(cfg.batch):
        t, s = int(ops.q_seqlen[b]), int(ops.kv_seqlen[b])
        assert np.isnan(ops.query[b, :, t:]).all() and not np.isnan(ops.query[b, :, :t]).any()
        assert np.isnan(ops.key[b, :, s:]).all() and not np.isnan(ops.value[b, :, :s]).any()
    paging = PagingSpec(num_blocks_k=9, num_blocks_v=9, block_size=2, blocks_per_seq=3)
    paged = config(batch=2, kv_len=6, paging=paging, mask=StaticMask(padding=True))
    ops = random_operands(paged, np.random.default_rng(10))
    used = np.unique(ops.page_table_k)
    spare = np.setdiff1d(np.arange(9), used)
    assert len(used) == 6 and np.isnan(ops.key[spare]).all()
