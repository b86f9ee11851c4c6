"""Strided Q/K/V views reach cuDNN with their own strides: no copy, results equal the reference.

Each view lives inside a larger buffer whose every other element is NaN: a graph that read the view as dense
memory would read the poison (or the wrong elements) and fail the comparison.  ``graph_cache.stats().copies``
counts the inputs the front had to copy: none for readable views, one per view cuDNN cannot read (a last
dimension that is not contiguous).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import MaskType, reference

from ._checks import assert_close

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

B, T, N, K, H = 2, 128, 8, 4, 64


def _poisoned_like(shape, dtype):
    return cp.full(shape, np.nan, dtype)


def _views(rng, kind: str):
    """Q, K, V as views of NaN-poisoned memory, the dense host copies, and the layout they are in."""
    dt = ml_dtypes.bfloat16
    host = [rng.standard_normal(s).astype(dt) for s in ((B, T, N, H), (B, T, K, H), (B, T, K, H))]
    if kind == "bnth_view_of_btnh":          # transformers' (B, N, T, H) views of (B, T, N, H) projections
        views = []
        for x in host:
            buffer = cp.asarray(x)
            views.append(buffer.transpose(0, 2, 1, 3))
        return views, [x.transpose(0, 2, 1, 3) for x in host], "BNTH"
    if kind == "sliced_heads":               # every other head of a buffer twice as wide, the rest NaN
        views = []
        for x in host:
            b, t, n, h = x.shape
            buffer = _poisoned_like((b, t, 2 * n, h), x.dtype)
            buffer[:, :, ::2] = cp.asarray(x)
            views.append(buffer[:, :, ::2])
        return views, host, "BTNH"
    if kind == "padded_rows":                # each token row padded with NaN columns (a fused QKV projection)
        views = []
        for x in host:
            b, t, n, h = x.shape
            buffer = _poisoned_like((b, t, n + 3, h), x.dtype)
            buffer[:, :, :n] = cp.asarray(x)
            views.append(buffer[:, :, :n])
        return views, host, "BTNH"
    raise ValueError(kind)


KINDS = ["bnth_view_of_btnh", "sliced_heads", "padded_rows"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mask_type", [MaskType.NO_MASK, MaskType.CAUSAL])
def test_strided_views_run_without_a_copy_and_match_the_reference(kind, mask_type):
    seed = 7000 + 10 * KINDS.index(kind) + mask_type.value
    rng = np.random.default_rng(seed)
    (q, k, v), (hq, hk, hv), layout = _views(rng, kind)
    assert not q.flags.c_contiguous
    before = cudnn_attn.graph_cache.stats().copies
    out, lse = cudnn_attn.dot_product_attention(q, k, v, scale=H ** -0.5, mask_type=mask_type, qkv_layout=layout,
                                                return_residual=True)
    again = cudnn_attn.dot_product_attention(q, k, v, scale=H ** -0.5, mask_type=mask_type, qkv_layout=layout)
    assert cudnn_attn.graph_cache.stats().copies == before, f"a readable view was copied (seed {seed})"
    want, want_lse = reference.dot_product_attention(hq, hk, hv, scale=H ** -0.5, mask_type=mask_type,
                                                     qkv_layout=layout, return_residual=True)
    assert_close(f"output {kind} (seed {seed})", out, want, "bfloat16")
    assert_close(f"repeated output {kind} (seed {seed})", again, want, "bfloat16")
    assert cp.allclose(lse, cp.asarray(want_lse), rtol=1e-3, atol=1e-3), f"logsumexp {kind} (seed {seed})"
    do = rng.standard_normal(out.shape).astype(ml_dtypes.bfloat16)
    grads = cudnn_attn.dot_product_attention_bwd(q, k, v, out, cp.asarray(do), lse, scale=H ** -0.5,
                                                 mask_type=mask_type, qkv_layout=layout)
    ref = reference.dot_product_attention_bwd(hq, hk, hv, cp.asnumpy(out), do, cp.asnumpy(lse), scale=H ** -0.5,
                                              mask_type=mask_type, qkv_layout=layout)
    for name in ("dq", "dk", "dv"):
        assert_close(f"{name} {kind} (seed {seed})", getattr(grads, name), getattr(ref, name), "bfloat16")
    assert cudnn_attn.graph_cache.stats().copies == before


def test_a_view_cudnn_cannot_read_is_copied_and_counted():
    rng = np.random.default_rng(7100)
    host = [rng.standard_normal((B, T, N, 2 * H)).astype(ml_dtypes.bfloat16) for _ in range(3)]
    q, k, v = (cp.asarray(x)[..., ::2] for x in host)              # the head dim itself is strided
    before = cudnn_attn.graph_cache.stats().copies
    out = cudnn_attn.dot_product_attention(q, k, v, scale=H ** -0.5)
    assert cudnn_attn.graph_cache.stats().copies == before + 3
    want = reference.dot_product_attention(*(x[..., ::2].copy() for x in host), scale=H ** -0.5)
    assert_close("output of copied views (seed 7100)", out, want, "bfloat16")


def test_bind_takes_readable_views_and_refuses_the_others():
    rng = np.random.default_rng(7200)
    (q, k, v), (hq, hk, hv), layout = _views(rng, "bnth_view_of_btnh")
    bound = cudnn_attn.bind(q, k, v, scale=H ** -0.5, qkv_layout=layout)
    want = reference.dot_product_attention(hq, hk, hv, scale=H ** -0.5, qkv_layout=layout)
    assert_close("bound strided output (seed 7200)", bound(q, k, v), want, "bfloat16")
    unreadable = cp.asarray(rng.standard_normal((B, T, N, 2 * H)).astype(ml_dtypes.bfloat16))[..., ::2]
    with pytest.raises(ValueError, match="query: bind takes arrays cuDNN reads as they are"):
        cudnn_attn.bind(unreadable, unreadable, unreadable)
