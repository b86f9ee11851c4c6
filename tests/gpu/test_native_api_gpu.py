"""The native API on the GPU: ``cudnn_attn.attention`` (CuPy) and ``jax_bridge.attention`` (JAX under ``jit``
and ``grad``) for every mask factory, against the NumPy reference's native call.

Tolerances (``_checks``): relative Frobenius error of the output within 2e-3 (fp16) / 1e-2 (bf16), the
logsumexp within 1e-3 relative.  Rows past a query length must come back as exact zeros (the fill policy);
the JAX results are written into NaN-poisoned donated buffers, so an unwritten row shows as NaN.
"""

from __future__ import annotations

import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import AuxRequest, alibi, causal, keep, padding, reference, segments, window
from cudnn_attn.core.config import AttentionConfig, PackingSpec, StaticMask
from cudnn_attn.reference.inputs import random_operands

from ._checks import assert_close, assert_lse_close, io_dtype

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

B, T, S, N, K, H = 2, 128, 128, 4, 2, 64


def _qkv(rng, dtype):
    dt = io_dtype(dtype)
    return (rng.standard_normal((B, T, N, H)).astype(dt), rng.standard_normal((B, S, K, H)).astype(dt),
            rng.standard_normal((B, S, K, H)).astype(dt))


def _mask(name, rng):
    """The native mask of a case, its arrays NumPy arrays (:func:`_arrays_of` moves them)."""
    ql = rng.integers(1, T + 1, size=B).astype(np.int32)
    kvl = rng.integers(1, S + 1, size=B).astype(np.int32)
    ql[0], kvl[0] = T, S                                 # one full row
    kept = rng.random((B, 1, T, S)) < 0.8
    kept[..., 0] = True
    return {
        "causal": causal(),
        "causal_bottom_right": causal("bottom_right"),
        "sliding_window": causal() & window(31, 0),
        "band": window(16, 8),
        "padding": padding(ql, kvl),
        "padding_causal_window": padding(ql, kvl) & causal() & window(15, 0),
        "alibi": causal() & alibi(),
        "keep": keep(kept),
    }[name]


CASES = ["causal", "causal_bottom_right", "sliding_window", "band", "padding", "padding_causal_window", "alibi",
         "keep"]


def _arrays_of(mask, convert):
    """``mask`` with its arrays passed through ``convert``."""
    import dataclasses

    return dataclasses.replace(mask, **{name: convert(getattr(mask, name)) for name in (
        "q_lengths", "kv_lengths", "q_offsets", "kv_offsets", "keep") if getattr(mask, name) is not None})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
def test_cupy_native_call_against_the_reference(case, dtype, rng):
    q, k, v = _qkv(rng, dtype)
    mask = _mask(case, rng)
    aux = AuxRequest(logsumexp=True)
    want = reference.attention(q, k, v, mask=mask, scale=0.125, return_aux=aux)
    got = cudnn_attn.attention(*(cp.asarray(x) for x in (q, k, v)), mask=_arrays_of(mask, cp.asarray), scale=0.125,
                               return_aux=aux)
    assert isinstance(got, cudnn_attn.AttentionOutput) and isinstance(got.output, cp.ndarray)
    assert_close("output", got.output, want.output, dtype)
    assert_lse_close(got.logsumexp, want.logsumexp)
    if mask.q_lengths is not None:                       # rows past the query lengths are exact zeros
        out = cp.asnumpy(got.output).astype(np.float32)
        for b, length in enumerate(mask.q_lengths):
            assert (out[b, length:] == 0).all()
    plain = cudnn_attn.attention(*(cp.asarray(x) for x in (q, k, v)), mask=_arrays_of(mask, cp.asarray), scale=0.125)
    assert plain.logsumexp is None and cp.array_equal(plain.output, got.output)


def test_cupy_native_segments_against_the_reference(rng):
    config = AttentionConfig(batch=B, q_heads=N, kv_heads=K, q_len=T, kv_len=S, qk_dim=H, v_dim=H, dtype="bfloat16",
                             mask=StaticMask(padding=True), packing=PackingSpec(max_segments=3))
    ops = random_operands(config, rng, poison=False)
    mask = segments(ops.q_seqlen, ops.kv_seqlen, ops.q_offsets, ops.kv_offsets) & causal()
    want = reference.attention(ops.query, ops.key, ops.value, mask=mask, return_aux=AuxRequest(logsumexp=True))
    got = cudnn_attn.attention(*(cp.asarray(x) for x in (ops.query, ops.key, ops.value)),
                               mask=_arrays_of(mask, cp.asarray), return_aux=AuxRequest(logsumexp=True))
    assert_close("output", got.output, want.output, "bfloat16")
    assert_lse_close(got.logsumexp, want.logsumexp)


def test_cupy_native_call_equals_the_seed_call(rng):
    """One path: the native call and the seed call of the same attention give the same bits."""
    q, k, v = (cp.asarray(x) for x in _qkv(rng, "bfloat16"))
    native = cudnn_attn.attention(q, k, v, mask=causal() & window(63, 0), scale=0.125,
                                  return_aux=AuxRequest(logsumexp=True))
    out, lse = cudnn_attn.dot_product_attention(q, k, v, scale=0.125, mask_type=cudnn_attn.MaskType.CAUSAL,
                                                sliding_window_length=64, return_residual=True)
    assert cp.array_equal(native.output, out) and cp.array_equal(native.logsumexp, lse)


@pytest.mark.parametrize("case", ["padding_causal_window", "band", "keep"])
def test_jax_native_call_and_gradients_against_the_reference(case, rng):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    from cudnn_attn import jax_bridge as jb

    dtype = "bfloat16"
    q, k, v = _qkv(rng, dtype)
    mask = _mask(case, rng)
    do = rng.standard_normal((B, T, N, H)).astype(q.dtype)
    want = reference.attention(q, k, v, mask=mask, scale=0.125, return_aux=AuxRequest(logsumexp=True))
    jmask = _arrays_of(mask, jnp.asarray)

    def run(q, k, v, poison):
        del poison                                       # donated: XLA may reuse it for the output
        return jb.attention(q, k, v, mask=jmask, scale=0.125, return_aux=AuxRequest(logsumexp=True))

    poison = jnp.full(q.shape, jnp.nan, q.dtype)
    got = jax.jit(run, donate_argnums=3, keep_unused=True)(q, k, v, poison)
    assert_close("output", np.asarray(got.output), want.output, dtype)
    assert_lse_close(np.asarray(got.logsumexp), want.logsumexp)

    grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(
        jb.attention(q, k, v, mask=jmask, scale=0.125).output.astype(jnp.float32) * do.astype(np.float32)),
        argnums=(0, 1, 2)))(q, k, v)
    seed_kwargs = dict(mask=mask.keep) if mask.keep is not None else {}
    if case == "keep":
        ref_out, ref_lse = reference.dot_product_attention(q, k, v, scale=0.125, return_residual=True, **seed_kwargs)
        ref = reference.dot_product_attention_bwd(q, k, v, ref_out, do, ref_lse, scale=0.125, **seed_kwargs)
    else:
        ref = _reference_grads(q, k, v, do, mask)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert_close(name, np.asarray(g), getattr(ref, name), dtype)


def _reference_grads(q, k, v, do, mask):
    """The reference backward of a native mask (validation's configuration with the mask's fields)."""
    from cudnn_attn.core.validation import validate_call

    arrays = mask.seed_arrays()
    padded = arrays["q_seqlen"] is not None
    config, operands = validate_call(q, k, v, None, arrays["mask"], arrays["q_seqlen"], arrays["kv_seqlen"], scale=0.125,
                               mask_type=cudnn_attn.MaskType.PADDING if padded else cudnn_attn.MaskType.NO_MASK,
                               training=True, xp=np)
    config = config.replace(mask=mask.static(config.mask.padding))
    forward = reference.forward(config, operands)
    return reference.backward(config, operands, forward.output, do, forward.logsumexp)


def test_repeated_cupy_native_calls_take_the_direct_path(rng):
    """A repeated native call of CuPy Q/K/V with an array-free mask is remembered once and then launched
    directly; its results are the generic path's bits."""
    from cudnn_attn.engine.prepared import calls

    q, k, v = (cp.asarray(x) for x in _qkv(rng, "float16"))
    kwargs = dict(mask=causal() & window(31, 0), scale=0.125, return_aux=AuxRequest(logsumexp=True))
    calls.clear()
    first = cudnn_attn.attention(q, k, v, **kwargs)
    assert len(calls.direct_launches()) == 1
    again = cudnn_attn.attention(q, k, v, mask=causal() & window(31, 0), scale=0.125,
                                 return_aux=AuxRequest(logsumexp=True))     # a new, equal mask object
    assert len(calls.direct_launches()) == 1
    assert cp.array_equal(first.output, again.output) and cp.array_equal(first.logsumexp, again.logsumexp)
    other = cudnn_attn.attention(q, k, v, mask=causal(), scale=0.125)       # another mask: another entry
    assert len(calls.direct_launches()) == 2 and other.logsumexp is None
    want = reference.attention(*(cp.asnumpy(x) for x in (q, k, v)), mask=causal(), scale=0.125)
    assert_close("output", other.output, want.output, "float16")
