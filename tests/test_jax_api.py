"""The JAX bridge's forward under ``jit`` on CPU: every feature against the NumPy reference.

On CPU the bridge's kernel is the reference itself, reached through the named XLA FFI target the GPU
uses (zero-copy host buffers).  So the results must be *identical* to calling the reference on the
same arrays: any difference is a plumbing error (an operand bound to the wrong name, a layout or dtype
mix-up, a lost flag), which is exactly what these tests are for.  Numerical accuracy of the gradients
is checked against an independent oracle in ``test_jax_grad.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_jax_common import normal, qkv

from cudnn_attn import MaskType, UnsupportedConfigurationError, reference
from cudnn_attn import jax_bridge as jb
from cudnn_attn.core.types import FP8_PARAM_KEYS


def _numpy(kwargs: dict) -> dict:
    def convert(x):
        if isinstance(x, dict):
            return {k: convert(v) for k, v in x.items()}
        if isinstance(x, tuple):
            return tuple(convert(v) for v in x)
        return np.asarray(x) if isinstance(x, jax.Array) else x
    return {name: convert(x) for name, x in kwargs.items()}


def _assert_identical(got, expected):
    got, expected = (got, expected) if isinstance(got, tuple) else ((got,), (expected,))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, g.dtype, e.shape, e.dtype)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(e))


def _seq(values):
    return jnp.asarray(values, jnp.int32)


def _case(name: str, rng: np.random.Generator) -> tuple[tuple, dict]:
    """``((q, k, v), keyword arguments)`` of one feature, fp16 unless the case says otherwise."""
    B, T, S, N = 2, 16, 16, 4
    kwargs: dict = {"scale": 0.37}
    layout, K, Hv, dtype = "BTNH", N, 8, "float16"
    if name == "bnth_bf16":
        layout, dtype = "BNTH", "bfloat16"
    if name == "gqa_causal":
        K, kwargs["mask_type"] = 2, MaskType.CAUSAL
    if name == "mla":
        Hv = 16
    if name == "bottom_right":
        T, kwargs.update(mask_type=MaskType.CAUSAL, diagonal_alignment="bottom_right")
        T = 8
    q, k, v = qkv(rng, B=B, T=T, S=S, N=N, K=K, Hv=Hv, dtype=dtype, layout=layout)
    if layout != "BTNH":
        kwargs["qkv_layout"] = layout
    if name == "bias_full":
        kwargs["bias"] = normal(rng, (B, N, T, S), dtype)
    if name == "bias_broadcast_and_bool_mask":
        kwargs["bias"] = normal(rng, (T, S), dtype)
        kwargs["mask"] = jnp.asarray(rng.random((B, 1, T, S)) > 0.3)
    if name == "additive_mask":
        kwargs["mask"] = normal(rng, (1, N, T, S), dtype)
    if name == "padding_causal":
        kwargs.update(q_seqlen=_seq([11, 16]), kv_seqlen=_seq([16, 7]), mask_type=MaskType.PADDING_CAUSAL)
    if name == "sliding_window":
        kwargs.update(sliding_window_length=4, mask_type=MaskType.CAUSAL)
    if name == "alibi":
        kwargs["mask_type"] = MaskType.ALIBI
    if name == "dropout":
        kwargs.update(dropout_rate=0.25, seed=1234)
    if name == "sink":
        kwargs["sink"] = jnp.asarray(rng.standard_normal((N,)), jnp.float32)
    if name == "packed":
        kwargs.update(q_seqlen=_seq([[5, 7, -1], [16, -1, -1]]), kv_seqlen=_seq([[6, 4, -1], [9, -1, -1]]),
                      q_offsets=_seq([[0, 5, -1, -1], [0, -1, -1, -1]]),
                      kv_offsets=_seq([[0, 6, -1, -1], [0, -1, -1, -1]]), return_residual=True)
    if name == "score_mod":
        kwargs.update(score_mod=lambda s, cap: cap * jnp.tanh(s / cap),
                      score_mod_args=(jnp.asarray(2.5, jnp.float32),))
    if name == "residual":
        kwargs["return_residual"] = True
    return (q, k, v), kwargs


CASES = ["plain", "bnth_bf16", "gqa_causal", "mla", "bottom_right", "bias_full", "bias_broadcast_and_bool_mask",
         "additive_mask", "padding_causal", "sliding_window", "alibi", "dropout", "sink", "packed", "score_mod",
         "residual"]


@pytest.mark.parametrize("case", CASES)
def test_forward_under_jit_is_the_reference(case, monkeypatch):
    if case == "score_mod":       # traced score_mod arguments: the CPU target only (the cuDNN target refuses them)
        monkeypatch.setenv("CUDNN_ATTN_CPU_TARGET", "off")
    (q, k, v), kwargs = _case(case, np.random.default_rng(CASES.index(case)))
    arrays = {n: x for n, x in kwargs.items() if isinstance(x, (jax.Array, tuple))}
    static = {n: x for n, x in kwargs.items() if n not in arrays}
    got = jax.jit(lambda q, k, v, a: jb.dot_product_attention(q, k, v, **a, **static))(q, k, v, arrays)
    expected = reference.dot_product_attention(np.asarray(q), np.asarray(k), np.asarray(v), **_numpy(kwargs))
    _assert_identical(got, expected)


def test_eager_call_runs_the_same_kernel():
    (q, k, v), kwargs = _case("padding_causal", np.random.default_rng(3))
    eager = jb.dot_product_attention(q, k, v, **kwargs)
    _assert_identical(eager, reference.dot_product_attention(np.asarray(q), np.asarray(k), np.asarray(v),
                                                             **_numpy(kwargs)))


def test_callback_backend_matches_ffi_backend():
    (q, k, v), kwargs = _case("bias_full", np.random.default_rng(4))
    f = jax.jit(lambda q, k, v, b, backend: jb.dot_product_attention(q, k, v, b, scale=0.37, backend=backend),
                static_argnums=4)
    _assert_identical(f(q, k, v, kwargs["bias"], "callback"), f(q, k, v, kwargs["bias"], "ffi"))
    loss = lambda backend: jax.grad(lambda q: jnp.sum(jb.dot_product_attention(  # noqa: E731
        q, k, v, scale=0.37, backend=backend).astype(jnp.float32) ** 2))(q)
    _assert_identical(jax.jit(lambda: loss("callback"))(), jax.jit(lambda: loss("ffi"))())


def test_paged_attention_is_the_reference():
    rng = np.random.default_rng(5)
    B, T, N, H, block, per_seq = 2, 8, 4, 8, 4, 3
    q = normal(rng, (B, T, N, H), "float16")
    k_cache, v_cache = normal(rng, (7, block, N, H), "float16"), normal(rng, (7, block, N, H), "float16")
    table = jnp.asarray(rng.permutation(7)[:B * per_seq].reshape(B, 1, per_seq, 1), jnp.int32)
    q_len, kv_len = _seq([8, 5]), _seq([12, 6])
    got = jax.jit(lambda *a: jb.paged_attention(*a, scale=0.3, mask_type=MaskType.PADDING, return_residual=True))(
        q, k_cache, v_cache, q_len, kv_len, table, table)
    expected = reference.paged_attention(*(np.asarray(x) for x in (q, k_cache, v_cache, q_len, kv_len, table, table)),
                                         scale=0.3, mask_type=MaskType.PADDING, return_residual=True)
    _assert_identical(got, expected)
    with pytest.raises(UnsupportedConfigurationError, match="no backward"):
        jax.grad(lambda q: jnp.sum(jb.paged_attention(q, k_cache, v_cache, q_len, kv_len, table, table,
                                                      mask_type=MaskType.PADDING).astype(jnp.float32)))(q)


def _fp8_params(rng) -> dict:
    return {name: jnp.asarray(rng.uniform(0.5, 2.0), jnp.float32).reshape(1, 1, 1, 1) for name in FP8_PARAM_KEYS}


def test_fp8_forward_and_amax_gradients(monkeypatch):
    monkeypatch.setenv("CUDNN_ATTN_CPU_TARGET", "off")     # FP8 training at H=16, T=16: the reference only
    rng = np.random.default_rng(6)
    q, k, v = (x.astype(jnp.float8_e4m3fn) for x in qkv(rng, dtype="float16", H=16))
    params = _fp8_params(rng)
    out, amax_s, amax_o = jax.jit(lambda q, k, v, p: jb.dot_product_attention(
        q, k, v, fp8_params=p, scale=0.25, use_fp8=True, mask_type=MaskType.CAUSAL))(q, k, v, params)
    expected = reference.dot_product_attention(*(np.asarray(x) for x in (q, k, v)), fp8_params=_numpy(params),
                                               scale=0.25, use_fp8=True, mask_type=MaskType.CAUSAL)
    _assert_identical((out, amax_s, amax_o), expected)

    # The amax_d* "gradients" are the backward's amax values (JAX's convention).
    def loss(q, k, v, p):
        o = jb.dot_product_attention(q, k, v, fp8_params=p, scale=0.25, use_fp8=True,
                                     mask_type=MaskType.CAUSAL)[0]
        return jnp.sum(o.astype(jnp.float32))
    dq, dk, dv, dparams = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, params)
    ones = np.ones(out.shape, np.float32).astype(out.dtype)
    grads = reference.dot_product_attention_bwd(
        *(np.asarray(x) for x in (q, k, v)), np.asarray(out), ones, _fp8_lse(q, k, v, params),
        fp8_params=_numpy(params), scale=0.25, use_fp8=True, mask_type=MaskType.CAUSAL)
    _assert_identical((dq, dk, dv), (grads.dq, grads.dk, grads.dv))
    for key, value in (("amax_dQ", grads.amax_dQ), ("amax_dK", grads.amax_dK), ("amax_dV", grads.amax_dV),
                       ("amax_dP", grads.amax_dP)):
        np.testing.assert_array_equal(np.asarray(dparams[key]), value)
        assert float(value.reshape(())) > 0
    assert all(float(jnp.abs(dparams[key]).max()) == 0 for key in FP8_PARAM_KEYS if not key.startswith("amax"))


def _fp8_lse(q, k, v, params):
    from cudnn_attn.core import validation

    config, operands = validation.validate_call(*(np.asarray(x) for x in (q, k, v)), fp8_params=_numpy(params),
                                                scale=0.25, use_fp8=True, mask_type=MaskType.CAUSAL, training=True,
                                                xp=np)
    return reference.forward(config, operands).logsumexp


# -- errors ------------------------------------------------------------------------------------------

def test_invalid_input_is_a_value_error_at_trace_time():
    q, k, v = qkv(np.random.default_rng(9))
    with pytest.raises(ValueError, match="key: head dim"):
        jax.jit(lambda q, k, v: jb.dot_product_attention(q, k[..., :4], v))(q, k, v)
    with pytest.raises(ValueError, match="seed: the dropout seed must be a Python or NumPy int"):
        jax.jit(lambda q, s: jb.dot_product_attention(q, k, v, dropout_rate=0.1, seed=s))(q, jnp.int32(3))
    with pytest.raises(ValueError, match="backend"):
        jb.dot_product_attention(q, k, v, backend="tvm")


def test_bad_traced_values_are_clamped_or_checked_at_run_time():
    """A page id outside the cache under jit: clamped by default (the result is the reference's for the
    clamped table); in the checked mode a host check fails the call with the argument, row and value in
    XLA's message (the kernel still sees the clamped table), and the runtime stays usable."""
    rng = np.random.default_rng(10)
    q = normal(rng, (1, 4, 2, 8), "float16")
    cache = normal(rng, (2, 4, 2, 8), "float16")
    table = jnp.asarray([[[[0], [5]]]], jnp.int32)
    call = lambda q, t, **kw: jb.paged_attention(q, cache, cache, _seq([4]), _seq([8]), t, t, **kw)  # noqa: E731
    clamped = jax.jit(call)(q, table)
    want = reference.paged_attention(np.asarray(q), np.asarray(cache), np.asarray(cache), np.array([4], np.int32),
                                     np.array([8], np.int32), *(np.array([[[[0], [1]]]], np.int32),) * 2)
    np.testing.assert_array_equal(np.asarray(clamped), want)
    checked = jax.jit(lambda q, t: call(q, t, check_values=True))
    with pytest.raises(Exception, match=r"page_table_k: row 0: entry \[0, 0, 1, 0\] = 5 is not a block index"):
        jax.block_until_ready(checked(q, table))
    good = checked(q, jnp.asarray([[[[0], [1]]]], jnp.int32))
    np.testing.assert_array_equal(np.asarray(good), want)


def test_concrete_bad_values_raise_value_errors_eagerly():
    rng = np.random.default_rng(11)
    q = normal(rng, (2, 4, 2, 8), "float16")
    with pytest.raises(ValueError, match=r"kv_seqlen: row 1 is 9, outside \[0, 4\]"):
        jb.dot_product_attention(q, q, q, q_seqlen=_seq([4, 4]), kv_seqlen=_seq([4, 9]), mask_type=MaskType.PADDING)
    with pytest.raises(ValueError, match=r"query_seq_lengths: row 0 is -1"):
        jb.dot_product_attention_nn(q, q, q, query_seq_lengths=_seq([-1, 2]))