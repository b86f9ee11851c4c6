"""One behaviour on every front: ``scale=None``, the lazy ``cudnn_attn.reference`` attribute, the CPU fronts'
support check against the default GPU target, packed BNTH run as BTNH, the warning of a top-left causal mask
with fewer queries than keys, bottom-right causal with a bias, and the checked mode under ``jit``."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import jax_bridge
from cudnn_attn import reference as ref
from cudnn_attn.core.padded_call import lift
from cudnn_attn.core.validation import validate_call

TOL = dict(atol=2e-3, rtol=2e-3)        # float16 results of two float64 computations rounded apart


def _qkv(rng, shape=(2, 8, 4, 16), kv_shape=None, dtype=np.float16):
    kv_shape = kv_shape or shape
    return (rng.standard_normal(shape).astype(dtype), rng.standard_normal(kv_shape).astype(dtype),
            rng.standard_normal(kv_shape).astype(dtype))


# -- scale=None ---------------------------------------------------------------------------------------

def test_scale_none_is_one_over_sqrt_h_on_every_front(rng):
    q, k, v = _qkv(rng)
    expected = ref.dot_product_attention(q, k, v, scale=1 / math.sqrt(16)).astype(np.float64)
    jq, jk, jv = map(jnp.asarray, (q, k, v))
    found = {
        "reference seed": ref.dot_product_attention(q, k, v, scale=None),
        "reference native": ref.attention(q, k, v, scale=None).output,
        "reference bwd": None,
        "jax seed": jax_bridge.dot_product_attention(jq, jk, jv, scale=None),
        "jax native": jax_bridge.attention(jq, jk, jv, scale=None).output,
        "jax.nn drop-in": jax_bridge.dot_product_attention_nn(jq, jk, jv, scale=None),
    }
    for name, out in found.items():
        if out is not None:
            np.testing.assert_allclose(np.asarray(out).astype(np.float64), expected, **TOL, err_msg=name)
    out, lse = ref.dot_product_attention(q, k, v, scale=None, return_residual=True)
    do = rng.standard_normal(out.shape).astype(np.float16)
    grads = ref.dot_product_attention_bwd(q, k, v, out, do, lse, scale=None)
    explicit = ref.dot_product_attention_bwd(q, k, v, out, do, lse, scale=0.25)
    np.testing.assert_array_equal(grads.dq, explicit.dq)


def test_seed_functions_keep_their_default_scale_of_one(rng):
    q, k, v = _qkv(rng)
    np.testing.assert_array_equal(ref.dot_product_attention(q, k, v), ref.dot_product_attention(q, k, v, scale=1.0))


# -- cudnn_attn.reference -----------------------------------------------------------------------------

def test_reference_is_an_attribute_imported_on_first_use():
    code = ("import sys, cudnn_attn; assert 'cudnn_attn.reference' not in sys.modules; "
            "print(cudnn_attn.reference.attention.__module__); "
            "import cudnn_attn as c\n"
            "try:\n    c.no_such_thing\nexcept AttributeError as e:\n    print(e)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"CUDNN_ATTN_PRELOAD": "0", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["cudnn_attn.reference.seed_api",
                                        "module 'cudnn_attn' has no attribute 'no_such_thing'"]
    assert cudnn_attn.reference is ref


# -- the CPU fronts hold a call to the GPU target -------------------------------------------------------------

def test_cpu_fronts_refuse_what_the_default_gpu_target_refuses(rng):
    q, k, v = _qkv(rng, shape=(1, 4, 2, 320))                  # inference head dim 320: sm90 serves <= 256
    for run in (lambda: ref.dot_product_attention(q, k, v),
                lambda: ref.attention(q, k, v),
                lambda: jax_bridge.dot_product_attention(*map(jnp.asarray, (q, k, v))),
                lambda: jax.jit(jax_bridge.dot_product_attention)(*map(jnp.asarray, (q, k, v)))):
        with pytest.raises(cudnn_attn.UnsupportedConfigurationError) as raised:
            run()
        assert raised.value.reasons == ["head dim: 320 > 256 (sm90 maximum)"]
        assert "CUDNN_ATTN_CPU_TARGET" in str(raised.value)


def test_the_target_is_named_by_a_variable_and_off_is_the_unrestricted_oracle(rng, monkeypatch):
    q, k, v = _qkv(rng, shape=(1, 4, 2, 160))
    expected = ref.forward(*_validated(q, k, v)).output              # the core function checks no target
    np.testing.assert_array_equal(ref.dot_product_attention(q, k, v), expected)      # sm90 runs H=160
    monkeypatch.setenv("CUDNN_ATTN_CPU_TARGET", "sm80:9.19")
    with pytest.raises(cudnn_attn.UnsupportedConfigurationError, match="160 > 128 \\(sm80 maximum\\)"):
        ref.dot_product_attention(q, k, v)
    monkeypatch.setenv("CUDNN_ATTN_CPU_TARGET", "off")
    q, k, v = _qkv(rng, shape=(1, 4, 2, 320))
    np.testing.assert_array_equal(ref.dot_product_attention(q, k, v), ref.forward(*_validated(q, k, v)).output)
    monkeypatch.setenv("CUDNN_ATTN_CPU_TARGET", "h200")
    with pytest.raises(ValueError, match="CUDNN_ATTN_CPU_TARGET"):
        ref.dot_product_attention(q, k, v)


def _validated(*arrays, **kwargs):
    return validate_call(*arrays, xp=np, **kwargs)


# -- lifts: packed BNTH as BTNH, bottom-right causal folded into a bias --------------------------------------

def _packed(rng, layout):
    q, k, v = _qkv(rng, shape=(2, 12, 4, 16), kv_shape=(2, 12, 2, 16))
    if layout == "BNTH":
        q, k, v = (np.ascontiguousarray(np.swapaxes(x, 1, 2)) for x in (q, k, v))
    return dict(query=q, key=k, value=v, q_seqlen=np.array([[5, 7], [9, -1]], np.int32),
                kv_seqlen=np.array([[4, 8], [12, -1]], np.int32), q_offsets=np.array([[0, 5, -1], [0, -1, -1]], np.int32),
                kv_offsets=np.array([[0, 4, -1], [0, -1, -1]], np.int32), qkv_layout=layout)


def _lifted_matches_reference(config, operands, rng):
    """Forward and backward of the lifted call (padded_call.lift on NumPy) against the reference of ``config``."""
    lifted = lift(config, operands, np)
    assert lifted is not None
    want = ref.forward(config, operands)
    got = lifted.unpad(ref.forward(lifted.config, lifted.operands))
    np.testing.assert_allclose(got.output.astype(np.float64), want.output.astype(np.float64), **TOL)
    np.testing.assert_allclose(got.logsumexp, want.logsumexp, atol=1e-4, rtol=1e-4)
    do = rng.standard_normal(want.output.shape).astype(want.output.dtype)
    want_grads = ref.backward(config, operands, want.output, do, want.logsumexp)
    residuals = lifted.residuals(want.output, do, want.logsumexp)
    got_grads = lifted.unpad(ref.backward(lifted.config, lifted.operands, *residuals))
    for name in ("dq", "dk", "dv", "dbias"):
        g, w = getattr(got_grads, name), getattr(want_grads, name)
        assert (g is None) == (w is None), name
        if w is not None:
            np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), **TOL, err_msg=name)
    return lifted


def test_packed_bnth_runs_as_btnh(rng):
    call = _packed(rng, "BNTH")
    config, operands = _validated(**{n: call.pop(n) for n in ("query", "key", "value")}, **call, training=True)
    lifted = _lifted_matches_reference(config, operands, rng)
    assert lifted.config.layout.name == "BTNH" and lifted.operands.query.shape == (2, 12, 4, 16)


def test_packed_bnth_on_every_cpu_front_equals_btnh_transposed(rng):
    bnth, btnh = _packed(rng, "BNTH"), _packed(np.random.default_rng(1), "BTNH")
    for name in ("query", "key", "value"):
        bnth[name] = np.ascontiguousarray(np.swapaxes(btnh[name], 1, 2))
    want = np.swapaxes(ref.dot_product_attention(**btnh), 1, 2).astype(np.float64)
    np.testing.assert_allclose(ref.dot_product_attention(**bnth).astype(np.float64), want, **TOL)
    arrays = {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in bnth.items()}
    got = jax.jit(lambda a: jax_bridge.dot_product_attention(**a, qkv_layout="BNTH"))(
        {n: x for n, x in arrays.items() if n != "qkv_layout"})
    np.testing.assert_allclose(np.asarray(got, np.float64), want, **TOL)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("lengths", [(8, 8), (3, 8)], ids=["T=S", "T<S"])
def test_bottom_right_with_a_bias_runs_folded_into_the_bias(rng, lengths, window):
    t, s = lengths
    q, k, v = _qkv(rng, shape=(2, t, 2, 16), kv_shape=(2, s, 2, 16))
    bias = rng.standard_normal((1, 2, t, s)).astype(np.float16)
    config, operands = _validated(q, k, v, bias, mask_type=cudnn_attn.MaskType.CAUSAL,
                                  diagonal_alignment="bottom_right", sliding_window_length=window, training=True)
    lifted = _lifted_matches_reference(config, operands, rng)
    assert lifted.config.mask.right_bound is None and lifted.config.bias.shape[:2] == config.bias.shape[:2]


def test_bottom_right_with_a_bias_under_jax_grad_matches_the_reference(rng):
    q, k, v = _qkv(rng, shape=(2, 4, 2, 16), kv_shape=(2, 8, 2, 16))
    bias = rng.standard_normal((2, 1, 4, 8)).astype(np.float16)
    kwargs = dict(mask_type=cudnn_attn.MaskType.CAUSAL, diagonal_alignment="bottom_right")
    config, operands = _validated(q, k, v, bias, training=True, **kwargs)
    want = ref.forward(config, operands)
    do = rng.standard_normal(want.output.shape).astype(np.float16)
    grads = ref.backward(config, operands, want.output, do, want.logsumexp)

    def loss(q, k, v, bias):
        out = jax_bridge.dot_product_attention(q, k, v, bias, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(do, jnp.float32))

    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*map(jnp.asarray, (q, k, v, bias)))
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), got, (grads.dq, grads.dk, grads.dv, grads.dbias)):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64), atol=4e-3, rtol=4e-3,
                                   err_msg=name)
    with pytest.raises(cudnn_attn.UnsupportedConfigurationError, match="bias and a padding mask"):
        ref.dot_product_attention(q, k, v, bias, q_seqlen=np.array([4, 2], np.int32),
                                  kv_seqlen=np.array([8, 5], np.int32), mask_type=cudnn_attn.MaskType.PADDING_CAUSAL,
                                  diagonal_alignment="bottom_right")


# -- the warning of top-left causal with T < S ---------------------------------------------------------------

def test_top_left_causal_with_fewer_queries_warns_once_per_configuration(rng):
    q, k, v = _qkv(rng, shape=(1, 1, 2, 24), kv_shape=(1, 9, 2, 24))
    with pytest.warns(cudnn_attn.TopLeftCausalWarning, match='diagonal_alignment="bottom_right"'):
        ref.dot_product_attention(q, k, v, mask_type=cudnn_attn.MaskType.CAUSAL)
    with warnings.catch_warnings():
        warnings.simplefilter("error", cudnn_attn.TopLeftCausalWarning)
        ref.dot_product_attention(q, k, v, mask_type=cudnn_attn.MaskType.CAUSAL)          # the same: no warning
        ref.dot_product_attention(q, k, v, mask_type=cudnn_attn.MaskType.CAUSAL, diagonal_alignment="bottom_right")
        ref.dot_product_attention(q, k[:, :1], v[:, :1], mask_type=cudnn_attn.MaskType.CAUSAL)   # T == S
    with pytest.warns(cudnn_attn.TopLeftCausalWarning):
        jax_bridge.attention(*map(jnp.asarray, (q, k, v)), mask=cudnn_attn.causal())       # native: its own config


# -- the checked mode under jit ---------------------------------------------------------------------------------

def test_check_values_raises_from_a_jitted_call_naming_the_argument(rng):
    q, k, v = map(jnp.asarray, _qkv(rng))
    lengths = jnp.asarray([8, 99], jnp.int32)                       # 99 > S = 8

    def run(check_values):
        return jax.jit(lambda q, k, v, kv: jax_bridge.dot_product_attention(
            q, k, v, q_seqlen=jnp.asarray([8, 8], jnp.int32), kv_seqlen=kv, mask_type=cudnn_attn.MaskType.PADDING,
            check_values=check_values))(q, k, v, lengths)

    clamped = run(None)                                              # clamped to S: the full row
    full = jax_bridge.dot_product_attention(q, k, v)
    np.testing.assert_allclose(np.asarray(clamped, np.float64), np.asarray(full, np.float64), **TOL)
    with pytest.raises(Exception, match=r"kv_seqlen: row 1"):
        jax.block_until_ready(run(True))
