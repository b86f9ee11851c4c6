"""Shared pieces of the JAX bridge tests, and the check that the oracle they use is right.

``jnp_attention`` is an independent float32 ``jax.numpy`` attention (dense logits, explicit masks):
its gradients, taken by JAX's own autodiff, are the oracle for the bridge's custom VJP.  It is checked
here against the NumPy float64 reference (``cudnn_attn.reference``), so a wrong oracle fails too.

Tolerances: the bridge's CPU kernel computes in float64 and rounds once to the io dtype; the oracle
computes in float32 from the same io-dtype inputs.  Results are compared by their relative Frobenius
error ``||x - ref|| / ||ref||``: ``2e-3`` for float16 (a few ulps of 2^-11), ``1.6e-2`` for bfloat16
(2^-8 ulps) - tight enough that a wrong mask, scale, layout or missing gradient term (errors of
order one) fails.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_attn import MaskType, reference

TOLERANCE = {"float16": 2e-3, "bfloat16": 1.6e-2}


def dtype_of(name: str):
    return jnp.bfloat16 if name == "bfloat16" else jnp.dtype(name)


def relative_error(x, ref) -> float:
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    assert np.all(np.isfinite(x)), "non-finite values"
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_close(x, ref, dtype: str, what: str = "", factor: float = 1.0) -> None:
    err = relative_error(x, ref)
    assert err <= TOLERANCE[dtype] * factor, f"{what}: relative error {err:.2e} > {TOLERANCE[dtype] * factor:.1e}"


def normal(rng: np.random.Generator, shape, dtype: str):
    return jnp.asarray(rng.standard_normal(shape), dtype_of(dtype))


def qkv(rng, *, B=2, T=16, S=16, N=4, K=None, H=8, Hv=None, dtype="float16", layout="BTNH"):
    K, Hv = K or N, Hv or H
    def shape(length, heads, dim):
        return (B, length, heads, dim) if layout == "BTNH" else (B, heads, length, dim)
    return normal(rng, shape(T, N, H), dtype), normal(rng, shape(S, K, H), dtype), normal(rng, shape(S, K, Hv), dtype)


def jnp_attention(q, k, v, *, scale, bias=None, causal=False, q_seqlen=None, kv_seqlen=None, layout="BTNH",
                  window=None, sink=None):
    """float32 attention with explicit masks; ``window=(left, right)`` keeps ``i - left <= j <= i + right``;
    ``sink`` (N,) joins every softmax denominator.  Padded query rows are 0.  Returns the output in the
    query's layout and dtype."""
    def logical(x):
        x = x.astype(jnp.float32)
        return jnp.transpose(x, (0, 2, 1, 3)) if layout == "BTNH" else x
    ql, kl, vl = logical(q), logical(k), logical(v)
    group = ql.shape[1] // kl.shape[1]
    kl, vl = jnp.repeat(kl, group, axis=1), jnp.repeat(vl, group, axis=1)
    s = jnp.einsum("bnth,bnsh->bnts", ql, kl) * scale
    if bias is not None:
        b = bias.astype(jnp.float32)
        s = s + b.reshape((1,) * (4 - b.ndim) + b.shape)
    T, S = s.shape[-2:]
    i, j = jnp.arange(T)[:, None], jnp.arange(S)[None, :]
    keep = jnp.ones((T, S), bool)
    if causal:
        keep &= j <= i
    if window is not None:
        keep &= (i - j <= window[0]) & (j - i <= window[1])
    keep = keep[None, None]
    if kv_seqlen is not None:
        keep = keep & (j[None, None] < kv_seqlen[:, None, None, None])
    s = jnp.where(keep, s, -jnp.inf)
    if sink is None:
        p = jax.nn.softmax(s, axis=-1)
    else:
        sinks = jnp.broadcast_to(sink.astype(jnp.float32)[None, :, None, None], s.shape[:3] + (1,))
        p = jnp.exp(s - jax.nn.logsumexp(jnp.concatenate([s, sinks], axis=-1), axis=-1, keepdims=True))
    o = jnp.einsum("bnts,bnsd->bntd", p, vl)
    if q_seqlen is not None:
        o = jnp.where(i[None, None] < q_seqlen[:, None, None, None], o, 0.0)
    o = jnp.transpose(o, (0, 2, 1, 3)) if layout == "BTNH" else o
    return o.astype(q.dtype)


# -- the oracle against the NumPy reference -----------------------------------------------------------

@pytest.mark.parametrize("case", ["plain", "causal_gqa", "bias_bnth", "padding", "window", "sink"])
def test_oracle_matches_numpy_reference(case):
    rng = np.random.default_rng(7)
    layout = "BNTH" if case == "bias_bnth" else "BTNH"
    q, k, v = qkv(rng, N=4, K=2 if case == "causal_gqa" else 4, layout=layout)
    kwargs, oracle = {}, {}
    if case == "causal_gqa":
        kwargs["mask_type"], oracle["causal"] = MaskType.CAUSAL, True
    if case == "bias_bnth":
        kwargs["bias"] = oracle["bias"] = normal(rng, (1, 4, 16, 16), "float16")
    if case == "padding":
        lengths = (jnp.asarray([9, 16], jnp.int32), jnp.asarray([5, 12], jnp.int32))
        kwargs.update(q_seqlen=lengths[0], kv_seqlen=lengths[1], mask_type=MaskType.PADDING)
        oracle.update(q_seqlen=lengths[0], kv_seqlen=lengths[1])
    if case == "window":
        kwargs.update(sliding_window_length=3, mask_type=MaskType.CAUSAL)
        oracle.update(causal=True, window=(2, 0))
    if case == "sink":
        kwargs["sink"] = oracle["sink"] = jnp.asarray(rng.standard_normal((4,)), jnp.float32)
    numpy_args = {n: np.asarray(x) for n, x in kwargs.items() if hasattr(x, "shape")}
    expected = reference.dot_product_attention(np.asarray(q), np.asarray(k), np.asarray(v), scale=0.35,
                                               qkv_layout=layout, **{**kwargs, **numpy_args})
    assert_close(jnp_attention(q, k, v, scale=0.35, layout=layout, **oracle), expected, "float16", case)


def test_oracle_is_not_trivially_close():
    """The tolerance separates a right answer from a slightly wrong one (scale off by 5%)."""
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng)
    right = reference.dot_product_attention(np.asarray(q), np.asarray(k), np.asarray(v), scale=0.5)
    wrong = jnp_attention(q, k, v, scale=0.5 * 1.05)
    assert relative_error(wrong, right) > TOLERANCE["float16"]
