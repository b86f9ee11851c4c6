"""The native API: ``attention(q, k, v, mask=causal() & window(l, r) & padding(...), return_aux=...)``.

Every mask factory and combination is checked against the seed-compatible reference call that says
the same thing (identical results: both run the NumPy reference), or against a boolean keep-mask built
by brute force where the seed has no spelling for it (windows with a right side).  Then the named results,
the errors (conflicting masks name ``mask``), the one signature table, and the JAX bridge's native call
under ``jit``, ``grad`` and ``vmap`` on CPU.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import (
    AttentionOutput,
    AuxRequest,
    MaskSpec,
    MaskType,
    alibi,
    causal,
    keep,
    padding,
    reference,
    segments,
    window,
)
from cudnn_attn.core import parameters
from cudnn_attn.core.config import AttentionConfig, PackingSpec, StaticMask
from cudnn_attn.core.types import FP8_PARAM_KEYS
from cudnn_attn.reference.inputs import random_operands

B, T, S, N, K, H = 2, 8, 8, 4, 2, 16


def _qkv(rng, dtype="float16", t=T, s=S):
    dt = np.dtype(dtype)
    return (rng.standard_normal((B, t, N, H)).astype(dt), rng.standard_normal((B, s, K, H)).astype(dt),
            rng.standard_normal((B, s, K, H)).astype(dt))


def _lengths(rng):
    return rng.integers(1, T + 1, size=B).astype(np.int32), rng.integers(1, S + 1, size=B).astype(np.int32)


def _band(left, right, t=T, s=S):
    """Brute force: keys ``i - left <= j <= i + right`` (None: unbounded), as a boolean ``(T, S)`` array."""
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    kept = np.ones((t, s), bool)
    if left is not None:
        kept &= j >= i - left
    if right is not None:
        kept &= j <= i + right
    return kept


def _identical(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    np.testing.assert_array_equal(got, want)


# -- every factory against the seed's spelling -------------------------------------------------------------

def _case(name, rng):
    """``(native mask, seed keyword arguments)`` that must give the same output and logsumexp."""
    ql, kvl = _lengths(rng)
    pad = dict(q_seqlen=ql, kv_seqlen=kvl)
    if name == "none":
        return None, {}
    if name == "causal":
        return causal(), dict(mask_type=MaskType.CAUSAL)
    if name == "causal_bottom_right":
        return causal("bottom_right"), dict(mask_type=MaskType.CAUSAL, diagonal_alignment="bottom_right")
    if name == "sliding_window":
        return causal() & window(2, 0), dict(mask_type=MaskType.CAUSAL, sliding_window_length=3)
    if name == "window_alone":
        return window(2, 0), dict(mask_type=MaskType.CAUSAL, sliding_window_length=3)
    if name == "padding":
        return padding(ql, kvl), dict(mask_type=MaskType.PADDING, **pad)
    if name == "padding_causal":
        return causal() & padding(ql, kvl), dict(mask_type=MaskType.PADDING_CAUSAL, **pad)
    if name == "padding_window_causal":
        return padding(ql, kvl) & window(3, 0) & causal(), dict(mask_type=MaskType.PADDING_CAUSAL,
                                                                 sliding_window_length=4, **pad)
    if name == "alibi":
        return causal() & alibi(), dict(mask_type=MaskType.ALIBI)
    if name == "keep":
        kept = rng.random((B, 1, T, S)) < 0.7
        kept[..., 0] = True                                       # every query keeps a key
        return keep(kept), dict(mask=kept)
    if name == "band":                                            # no seed spelling: a boolean keep-mask
        return window(2, 1), dict(mask=_band(2, 1))
    if name == "band_padding":                                    # every query keeps a key: full key lengths
        kvl = np.full((B,), S, np.int32)
        return window(1, 3) & padding(ql, kvl), dict(mask=_band(1, 3), mask_type=MaskType.PADDING, q_seqlen=ql,
                                                     kv_seqlen=kvl)
    if name == "causal_keep":
        kept = rng.random((T, S)) < 0.8
        np.fill_diagonal(kept, True)
        return causal() & keep(kept), dict(mask=kept, mask_type=MaskType.CAUSAL)
    raise AssertionError(name)


CASES = ["none", "causal", "causal_bottom_right", "sliding_window", "window_alone", "padding", "padding_causal",
         "padding_window_causal", "alibi", "keep", "band", "band_padding", "causal_keep"]


@pytest.mark.parametrize("layout", ["BTNH", "BNTH"])
@pytest.mark.parametrize("case", CASES)
def test_every_mask_equals_the_seed_call(case, layout, rng):
    q, k, v = _qkv(rng)
    if layout == "BNTH":
        q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    mask, seed_kwargs = _case(case, rng)
    if case == "band" or case == "band_padding":                # a boolean mask and a bound differ by the bias
        seed_kwargs["mask"] = np.broadcast_to(seed_kwargs["mask"], (B, 1, T, S))
    got = reference.attention(q, k, v, mask=mask, scale=0.3, layout=layout, return_aux=AuxRequest(logsumexp=True))
    out, lse = reference.dot_product_attention(q, k, v, scale=0.3, qkv_layout=layout, return_residual=True,
                                               **seed_kwargs)
    assert isinstance(got, AttentionOutput) and got.amax_s is None and got.amax_o is None
    if case.startswith("band"):
        # The keep-mask is a large finite negative bias, the window an exact -inf: equal to rounding.
        np.testing.assert_allclose(got.output.astype(float), out.astype(float), atol=2e-3)
        np.testing.assert_allclose(got.logsumexp, lse, atol=1e-4)
    else:
        _identical(got.output, out)
        _identical(got.logsumexp, lse)


def test_segments_equal_the_seed_offsets(rng):
    config = AttentionConfig(batch=B, q_heads=N, kv_heads=K, q_len=T, kv_len=S, qk_dim=H, v_dim=H, dtype="float16",
                             mask=StaticMask(padding=True), packing=PackingSpec(max_segments=3))
    ops = random_operands(config, rng, poison=False)
    spec = segments(ops.q_seqlen, ops.kv_seqlen, ops.q_offsets, ops.kv_offsets) & causal()
    got = reference.attention(ops.query, ops.key, ops.value, mask=spec, scale=0.5,
                              return_aux=AuxRequest(logsumexp=True))
    out, lse = reference.dot_product_attention(ops.query, ops.key, ops.value, q_seqlen=ops.q_seqlen,
                                               kv_seqlen=ops.kv_seqlen, q_offsets=ops.q_offsets,
                                               kv_offsets=ops.kv_offsets, mask_type=MaskType.CAUSAL, scale=0.5,
                                               return_residual=True)
    _identical(got.output, out)
    _identical(got.logsumexp, lse)
    assert lse.shape == (B * 3, N, T)


def test_the_window_reaches_the_configuration_exactly():
    """``window(l, r)`` is ``left_bound = l + 1``, ``right_bound = r``; ``&`` takes the tighter bound."""
    assert (causal() & window(5, 2)).static(padding=False) == StaticMask(right_bound=0, left_bound=6)
    assert window(5, 2).static(padding=True) == StaticMask(right_bound=2, left_bound=6, padding=True)
    assert (window(3, 0, alignment="bottom_right") & causal("bottom_right")).static(False).alignment.value == \
        "bottom_right"
    assert (causal() & alibi()).static(False) == StaticMask(right_bound=0, alibi=True)
    assert MaskSpec().static(False) == StaticMask()
    assert repr(causal() & window(3, 0) & padding(1, 2)) == "MaskSpec(window(3,0)+padding)"


# -- named results ---------------------------------------------------------------------------------------------

def test_logsumexp_only_on_request_and_the_default_scale(rng):
    q, k, v = _qkv(rng)
    plain = reference.attention(q, k, v, mask=causal())
    asked = reference.attention(q, k, v, mask=causal(), return_aux=AuxRequest(logsumexp=True))
    unasked = reference.attention(q, k, v, mask=causal(), return_aux=AuxRequest())
    seed = reference.dot_product_attention(q, k, v, scale=1 / np.sqrt(H), mask_type=MaskType.CAUSAL)
    assert plain.logsumexp is None and unasked.logsumexp is None
    assert asked.logsumexp.shape == (B, N, T) and asked.logsumexp.dtype == np.float32
    for result in (plain, asked, unasked):
        _identical(result.output, seed)


def test_fp8_returns_the_amax_values(rng):
    q, k, v = (x.astype(np.float32).astype("float8_e4m3fn") for x in _qkv(rng, np.float32))
    params = {name: np.ones((1, 1, 1, 1), np.float32) for name in FP8_PARAM_KEYS}
    got = reference.attention(q, k, v, mask=causal(), scale=0.3, fp8_params=params)
    out, amax_s, amax_o = reference.dot_product_attention(q, k, v, fp8_params=params, use_fp8=True, scale=0.3,
                                                          mask_type=MaskType.CAUSAL)
    _identical(got.output, out)
    _identical(got.amax_s, amax_s)
    _identical(got.amax_o, amax_o)
    assert got.logsumexp is None


# -- errors -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("combine, match", [
    (lambda: window(2, 0) & window(3, 0), "mask: two windows of different sizes"),
    (lambda: window(2, 0) & window(2, 1), "mask: two windows of different sizes"),
    (lambda: padding(1, 2) & padding(1, 2), "mask: both sides of & give q_lengths"),
    (lambda: padding(1, 2) & segments(1, 2, 3, 4), "mask: both sides of & give q_lengths"),
    (lambda: keep(1) & keep(2), "mask: both sides of & give keep"),
    (lambda: causal() & causal("bottom_right"), "mask: the diagonals are aligned differently"),
    (lambda: window(-1, 0), "mask: window left must be an int >= 0"),
    (lambda: window(1, 2.5), "mask: window right must be an int >= 0"),
    (lambda: causal("diagonal"), "mask: alignment must be"),
    (lambda: padding(None, 2), "mask: padding.*missing q_lengths"),
    (lambda: segments(1, 2, None, 4), "mask: segments.*missing q_offsets"),
    (lambda: keep(None), "mask: keep"),
], ids=["windows", "window_sides", "two_paddings", "padding_and_segments", "two_keeps", "alignments",
        "negative_window", "float_window", "alignment_name", "padding_none", "segments_none", "keep_none"])
def test_conflicting_or_bad_masks_name_mask(combine, match):
    with pytest.raises(ValueError, match=match):
        combine()


def test_same_window_twice_and_causal_with_a_window_combine():
    assert (window(2, 0) & window(2, 0)).static(False) == window(2, 0).static(False)
    assert (causal() & window(4, 3)).static(False) == StaticMask(right_bound=0, left_bound=5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(mask=MaskType.CAUSAL), "mask: expected a MaskSpec"),
    (dict(mask=np.ones((T, S), bool)), "mask: expected a MaskSpec"),
    (dict(return_aux=True), "return_aux: expected None or AuxRequest"),
    (dict(return_aux=AuxRequest(logsumexp="yes")), "return_aux: AuxRequest.logsumexp"),
    (dict(layout="BXTH"), "qkv_layout|layout"),
    (dict(mask=padding(np.ones(B, np.int64), np.ones(B, np.int32))), r"mask \(q_lengths\): must be int32"),
    (dict(mask=padding(np.ones(B + 1, np.int32), np.ones(B, np.int32))), r"mask \(q_lengths\)"),
    (dict(mask=keep(np.ones((T, S + 1), bool))), r"mask \(keep\): shape"),
    (dict(scale=float("nan")), "scale: must be a finite"),
], ids=["mask_type", "array_mask", "aux_bool", "aux_field", "layout", "lengths_dtype", "lengths_shape",
        "keep_shape", "scale"])
def test_bad_native_arguments_name_the_native_argument(kwargs, match, rng):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match=match):
        reference.attention(q, k, v, **kwargs)


# -- one signature table -----------------------------------------------------------------------------------

def _seed_part(fn, form):
    names = list(inspect.signature(fn).parameters)
    return names[:len(form.positional) + len(form.keywords)]


@pytest.mark.parametrize("form, name", [(parameters.FORWARD, "dot_product_attention"),
                                        (parameters.PAGED, "paged_attention"),
                                        (parameters.BACKWARD, "dot_product_attention_bwd"),
                                        (parameters.NATIVE, "attention")])
def test_every_front_has_the_forms_parameters(form, name):
    from cudnn_attn import jax_bridge
    from cudnn_attn.fronts import cupy as cupy_front

    fronts = [getattr(m, name) for m in (cupy_front, reference, jax_bridge) if hasattr(m, name)]
    assert len(fronts) >= 2
    expected = list(form.positional + form.keywords)
    for fn in fronts:
        assert _seed_part(fn, form) == expected, fn.__module__
        parameters = inspect.signature(fn).parameters
        assert [p.default for p in list(parameters.values())[:form.required]] == [inspect.Parameter.empty] * \
            form.required
        assert fn.__name__ == name and fn.__doc__


def test_made_functions_reject_unknown_and_missing_arguments(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(TypeError, match="unexpected keyword argument 'mask_typ'"):
        reference.dot_product_attention(q, k, v, mask_typ=MaskType.CAUSAL)
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'value'"):
        reference.attention(q, k)
    with pytest.raises(TypeError, match="positional"):
        reference.attention(q, k, v, causal())                    # mask is keyword-only


def test_import_loads_no_framework():
    code = "import sys, cudnn_attn; print(sorted(m for m in ('jax', 'cupy', 'cudnn', 'torch') if m in sys.modules))"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env=dict(os.environ, CUDNN_ATTN_PRELOAD="0")).stdout   # cudnn: tests/test_preload.py
    assert found.strip() == "[]"
    assert {"attention", "AttentionOutput", "AuxRequest", "MaskSpec", "causal", "window", "padding", "segments",
            "alibi"} <= set(cudnn_attn.__all__)


def test_cupy_native_call_without_gpu_is_no_gpu_error(rng):
    from cudnn_attn.engine import runtime

    if runtime.is_gpu_available():
        pytest.skip("a GPU is present")
    q, k, v = _qkv(rng)
    with pytest.raises(cudnn_attn.NoGPUError):
        cudnn_attn.attention(q, k, v, mask=causal())


# -- the JAX bridge's native call on CPU ---------------------------------------------------------------------

jax = pytest.importorskip("jax")
jnp = jax.numpy


def _jax_case(rng):
    q, k, v = _qkv(rng)
    ql, kvl = _lengths(rng)
    return (q, k, v), causal() & window(3, 0) & padding(ql, kvl)


def test_jax_native_equals_the_reference_eager_and_under_jit(rng):
    from cudnn_attn import jax_bridge as jb

    (q, k, v), mask = _jax_case(rng)
    want = reference.attention(q, k, v, mask=mask, scale=0.4, return_aux=AuxRequest(logsumexp=True))
    eager = jb.attention(*(jnp.asarray(x) for x in (q, k, v)), mask=mask, scale=0.4,
                         return_aux=AuxRequest(logsumexp=True))

    @jax.jit
    def run(q, k, v, ql, kvl):
        return jb.attention(q, k, v, mask=causal() & window(3, 0) & padding(ql, kvl), scale=0.4,
                            return_aux=AuxRequest(logsumexp=True))

    jitted = run(q, k, v, mask.q_lengths, mask.kv_lengths)
    for got in (eager, jitted):
        assert isinstance(got, AttentionOutput) and got.amax_s is None
        _identical(np.asarray(got.output), want.output)
        _identical(np.asarray(got.logsumexp), want.logsumexp)


def test_jax_native_gradients_equal_the_seed_calls(rng):
    from cudnn_attn import jax_bridge as jb

    (q, k, v), mask = _jax_case(rng)
    cotangent = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float32)

    def native(q, k, v):
        return jnp.sum(jb.attention(q, k, v, mask=mask, scale=0.4).output.astype(jnp.float32) * cotangent)

    def seed(q, k, v):
        out = jb.dot_product_attention(q, k, v, q_seqlen=mask.q_lengths, kv_seqlen=mask.kv_lengths, scale=0.4,
                                       mask_type=MaskType.PADDING_CAUSAL, sliding_window_length=4)
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    got = jax.jit(jax.grad(native, argnums=(0, 1, 2)))(q, k, v)
    want = jax.jit(jax.grad(seed, argnums=(0, 1, 2)))(q, k, v)
    for g, w in zip(got, want):
        _identical(np.asarray(g), np.asarray(w))
    assert all(np.isfinite(np.asarray(g, np.float32)).all() and np.abs(np.asarray(g, np.float32)).max() > 0
               for g in got)


def test_jax_native_vmap_equals_per_instance_calls(rng):
    from cudnn_attn import jax_bridge as jb

    stacks = [_qkv(rng) for _ in range(3)]
    q, k, v = (np.stack(xs) for xs in zip(*stacks))
    ql = np.stack([_lengths(rng)[0] for _ in range(3)])

    def one(q, k, v, ql):
        return jb.attention(q, k, v, mask=padding(ql, jnp.full((B,), S, jnp.int32)) & causal(), scale=0.4,
                            return_aux=AuxRequest(logsumexp=True))

    batched = jax.jit(jax.vmap(one))(q, k, v, ql)
    for i in range(3):
        want = reference.attention(q[i], k[i], v[i], mask=padding(ql[i], np.full((B,), S, np.int32)) & causal(),
                                   scale=0.4, return_aux=AuxRequest(logsumexp=True))
        _identical(np.asarray(batched.output[i]), want.output)
        _identical(np.asarray(batched.logsumexp[i]), want.logsumexp)


def test_jax_native_errors_at_trace_time(rng):
    from cudnn_attn import jax_bridge as jb

    q, k, v = (jnp.asarray(x) for x in _qkv(rng))
    with pytest.raises(ValueError, match="mask: expected a MaskSpec"):
        jb.attention(q, k, v, mask="causal")
    with pytest.raises(ValueError, match=r"mask \(kv_lengths\)"):
        jb.attention(q, k, v, mask=padding(jnp.ones(B, jnp.int32), jnp.ones(B + 1, jnp.int32)))
