"""Fully masked rows and rows without keys on the GPU: the CuPy front and JAX give the reference's rows.

* A row that the boolean mask keeps no key of: output the mean of V, logsumexp ``-inf``, the gradients of
  ``jax.nn``'s XLA path (:mod:`cudnn_attn.core.masked_rows`), fp16 and bf16.  In fp16 cuDNN alone returns
  the softmax of the scores there (the ``-2**15`` bias keeps their differences in float32).
* A row that the lengths or the diagonal leave no admissible key: output 0, logsumexp ``-inf``; what cuDNN
  itself writes there is pinned by a raw launch into NaN-poisoned buffers.

Inputs are seeded standard normal (never zeros), results NaN-poisoned; tolerances of ``_checks``.
"""

from __future__ import annotations

import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import MaskType, reference
from cudnn_attn.core import masked_rows
from cudnn_attn.core.validation import validate_call
from cudnn_attn.engine import call_steps, prepared
from cudnn_attn.graphs import packing

from ._checks import assert_close, assert_lse_close, io_dtype, poisoned, raw_launch

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

B, T, S, N, K, H = 2, 128, 192, 4, 2, 64
SCALE = 0.125
DTYPES = ["float16", "bfloat16"]


def _inputs(dtype: str, seed: int):
    """Q/K/V (GQA 4:2) and a keep-mask of which about a third of the rows keep no key."""
    rng = np.random.default_rng(seed)
    dt = io_dtype(dtype)
    q, k, v = (rng.standard_normal(shape).astype(dt) for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
    mask = rng.random((B, N, T, S)) < 0.5
    rows = rng.random((B, N, T)) < 0.35
    rows[..., 0], rows[..., 1] = False, True
    mask[rows] = False
    return q, k, v, mask, rng


def _gpu_call(q, k, v, mask, **kwargs):
    """``validate_call`` on CuPy arrays, the folded bias in the io dtype as the CuPy front binds it."""
    config, operands = validate_call(*(cp.asarray(x) for x in (q, k, v)), mask=cp.asarray(mask), scale=SCALE,
                                     training=True, xp=cp, **kwargs)
    bias = cp.ascontiguousarray(operands.bias.astype(operands.query.dtype))
    return config, operands.replace(bias=bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cupy_forward_and_backward_give_the_reference_fully_masked_rows(dtype):
    q, k, v, mask, rng = _inputs(dtype, 41)
    config, gpu = _gpu_call(q, k, v, mask)
    io = io_dtype(dtype)
    out = prepared.forward(config, gpu, output=poisoned(config.o_shape, io),
                            logsumexp=poisoned(config.lse_shape, np.float32))
    want, want_lse = reference.dot_product_attention(q, k, v, mask=mask, scale=SCALE, return_residual=True)
    assert_close("output", out.output, want, dtype)
    assert_lse_close(out.logsumexp, want_lse)
    assert np.isneginf(cp.asnumpy(out.logsumexp)[~mask.any(-1)]).all()

    grad_output = rng.standard_normal(config.o_shape).astype(io)
    grads = prepared.backward(config, gpu, out.output, cp.asarray(grad_output), out.logsumexp,
                               dq=poisoned(config.q_shape, io), dk=poisoned(config.k_shape, io),
                               dv=poisoned(config.v_shape, io))
    expected = reference.dot_product_attention_bwd(q, k, v, want, grad_output, want_lse, mask=mask, scale=SCALE)
    for name in ("dq", "dk", "dv"):
        assert_close(name, getattr(grads, name), getattr(expected, name), dtype)


def test_bfloat16_inference_takes_cudnns_own_mean_of_fully_masked_rows():
    """bfloat16 inference with a keep-mask alone: the front sets nothing (``kernel_gives_the_mean``), and what
    cuDNN writes on the fully masked rows is the reference's mean of V (the whole output, and those rows alone)."""
    q, k, v, mask, _ = _inputs("bfloat16", 47)
    config, operands = validate_call(*(cp.asarray(x) for x in (q, k, v)), mask=cp.asarray(mask), scale=SCALE,
                                     xp=cp)
    operands = operands.replace(bias=cp.ascontiguousarray(operands.bias.astype(operands.query.dtype)))
    assert masked_rows.kernel_gives_the_mean(config)
    out = prepared.forward(config, operands, output=poisoned(config.o_shape, io_dtype("bfloat16"))).output
    want = reference.dot_product_attention(q, k, v, mask=mask, scale=SCALE)
    assert_close("output", out, want, "bfloat16")
    empty = ~mask.any(-1)                                                      # (B, N, T)
    rows = lambda x: np.swapaxes(np.asarray(x, np.float32), 1, 2)[empty]      # noqa: E731 - (rows, H)
    assert empty.sum() > 50
    assert_close("output of the fully masked rows", rows(cp.asnumpy(out)), rows(want), "bfloat16")


@pytest.mark.parametrize("dtype", DTYPES)
def test_public_cupy_calls_give_the_reference_fully_masked_rows(dtype):
    q, k, v, mask, rng = _inputs(dtype, 43)
    gpu = [cp.asarray(x) for x in (q, k, v)]
    out, lse = cudnn_attn.dot_product_attention(*gpu, mask=cp.asarray(mask), scale=SCALE, return_residual=True)
    want, want_lse = reference.dot_product_attention(q, k, v, mask=mask, scale=SCALE, return_residual=True)
    assert_close("output", out, want, dtype)
    assert_lse_close(lse, want_lse)
    grad_output = rng.standard_normal(want.shape).astype(want.dtype)
    grads = cudnn_attn.dot_product_attention_bwd(*gpu, out, cp.asarray(grad_output), lse, mask=cp.asarray(mask),
                                                 scale=SCALE)
    expected = reference.dot_product_attention_bwd(q, k, v, want, grad_output, want_lse, mask=mask, scale=SCALE)
    for name in ("dq", "dk", "dv"):
        assert_close(name, getattr(grads, name), getattr(expected, name), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_forward_and_grad_give_the_reference_fully_masked_rows(dtype):
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    jb = pytest.importorskip("cudnn_attn.jax_bridge")
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no CUDA backend here")
    q, k, v, mask, rng = _inputs(dtype, 47)
    jq, jk, jv, jmask = (jax.device_put(jnp.asarray(x), device) for x in (q, k, v, mask))
    out, lse = jax.jit(lambda q, k, v: jb.dot_product_attention(q, k, v, mask=jmask, scale=SCALE,
                                                                return_residual=True))(jq, jk, jv)
    want, want_lse = reference.dot_product_attention(q, k, v, mask=mask, scale=SCALE, return_residual=True)
    assert_close("output", np.asarray(out), want, dtype)
    assert_lse_close(np.asarray(lse), want_lse)
    xla = jax.nn.dot_product_attention(jq, jk, jv, mask=jmask, scale=SCALE, implementation="xla")
    assert_close("jax.nn xla output", np.asarray(xla), want, dtype, scale=2.0)

    grad_output = rng.standard_normal(want.shape).astype(want.dtype)
    cotangent = jax.device_put(jnp.asarray(grad_output), device)

    def loss(q, k, v):
        o = jb.dot_product_attention(q, k, v, mask=jmask, scale=SCALE)
        return jnp.sum(o.astype(jnp.float32) * cotangent.astype(jnp.float32))
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(jq, jk, jv)
    expected = reference.dot_product_attention_bwd(q, k, v, want, grad_output, want_lse, mask=mask, scale=SCALE)
    for name, x in zip(("dq", "dk", "dv"), got):
        assert_close(name, np.asarray(x), getattr(expected, name), dtype)


# -- rows without an admissible key ------------------------------------------------------------------------

KEYLESS = {
    # name: (keyword arguments, the lengths (and packed offsets)); T = S = 128
    "empty-sequence-fp16": (dict(mask_type=MaskType.PADDING), dict(q_seqlen=[100, 64], kv_seqlen=[90, 0])),
    "bottom-right-causal-bf16": (dict(mask_type=MaskType.PADDING_CAUSAL, diagonal_alignment="bottom_right"),
                                 dict(q_seqlen=[128, 96], kv_seqlen=[64, 128])),
    "window-past-the-keys-fp16": (dict(mask_type=MaskType.PADDING_CAUSAL, sliding_window_length=16),
                                  dict(q_seqlen=[128, 80], kv_seqlen=[32, 128])),
    "packed-empty-segment-fp16": (dict(mask_type=MaskType.PADDING_CAUSAL),
                                  dict(q_seqlen=[[60, 40], [100, -1]], kv_seqlen=[[70, 0], [128, -1]],
                                       q_offsets=[[0, 64, -1], [0, -1, -1]], kv_offsets=[[0, 70, -1], [0, -1, -1]])),
}
UNPACKED = [case for case in KEYLESS if not case.startswith("packed")]


def _keyless_call(case: str):
    kwargs, sequences = KEYLESS[case]
    dtype = "bfloat16" if case.endswith("bf16") else "float16"
    rng = np.random.default_rng(sorted(KEYLESS).index(case) + 61)
    dt = io_dtype(dtype)
    q, k, v = (rng.standard_normal((2, 128, 4, 64)).astype(dt) for _ in range(3))
    host = dict({n: np.array(x, np.int32) for n, x in sequences.items()}, scale=SCALE, **kwargs)
    config, operands = validate_call(q, k, v, training=True, **host)
    lengths = (operands.q_seqlen, operands.kv_seqlen)
    if config.packing is not None:
        segs = packing.segments(np, *lengths, operands.q_offsets, operands.kv_offsets, config.q_len, config.kv_len)
        lengths = (segs.q_seqlen, segs.kv_seqlen)
    rows = masked_rows.rows_without_keys(np, config, *lengths)           # (rows of the logsumexp, 1, T)
    assert rows.any()
    return dtype, (q, k, v), host, config, rows


@pytest.mark.parametrize("case", UNPACKED)
def test_cudnn_output_and_logsumexp_of_rows_without_keys(case):
    """Raw launch (no fill policy) into NaN-poisoned results: what cuDNN writes into the rows of queries that
    have no admissible key.  The library's after-launch fill (``masked_rows.keyless_logsumexp``) sets their
    logsumexp to -inf whatever cuDNN writes there; their output must be unwritten (NaN here: zeroed before the
    launch by the plan) or 0."""
    _, arrays, host, config, rows = _keyless_call(case)
    gpu = validate_call(*(cp.asarray(x) for x in arrays), training=True,
                        **{n: cp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in host.items()})[1]
    launched = raw_launch(config, "fwd", call_steps.named_operands(config, "fwd", gpu))
    found = {spec.name: cp.asnumpy(r).astype(np.float32) for spec, r in launched}
    lse_rows = np.broadcast_to(rows, found["logsumexp"].shape)
    written = np.unique(found["logsumexp"][lse_rows])
    output_rows = found["output"][np.broadcast_to(rows, (2, 4, 128)).transpose(0, 2, 1)]    # (rows * N..., H)
    assert np.all(np.isnan(output_rows) | (output_rows == 0)), \
        f"{case}: cuDNN wrote {np.unique(output_rows[np.isfinite(output_rows)])[:5]} into the output of rows " \
        f"without keys (logsumexp there: {written[:5]})"
    assert not np.isfinite(written).any(), f"{case}: cuDNN wrote finite logsumexp values {written[:5]} there"


@pytest.mark.parametrize("case", list(KEYLESS))
def test_every_front_gives_rows_without_keys_output_0_and_logsumexp_minus_inf(case):
    dtype, (q, k, v), host, config, rows = _keyless_call(case)
    want, want_lse = reference.dot_product_attention(q, k, v, return_residual=True, **host)
    lse_rows = np.broadcast_to(rows, want_lse.shape)
    assert np.isneginf(want_lse[lse_rows]).all()
    gpu_host = {n: cp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in host.items()}
    config, gpu = validate_call(*(cp.asarray(x) for x in (q, k, v)), training=True, **gpu_host)
    io = io_dtype(dtype)
    out = prepared.forward(config, gpu, output=poisoned(config.o_shape, io),
                            logsumexp=poisoned(config.lse_shape, np.float32))
    public, public_lse = cudnn_attn.dot_product_attention(*(cp.asarray(x) for x in (q, k, v)), return_residual=True,
                                                          **gpu_host)
    found = {"cupy execution": (out.output, out.logsumexp), "cupy public": (public, public_lse)}
    try:
        import jax
        import jax.numpy as jnp

        from cudnn_attn import jax_bridge as jb
        device = jax.devices("gpu")[0]
        jax_host = {n: jax.device_put(jnp.asarray(x), device) if isinstance(x, np.ndarray) else x
                    for n, x in host.items()}
        found["jax"] = jb.dot_product_attention(*(jax.device_put(jnp.asarray(x), device) for x in (q, k, v)),
                                                return_residual=True, **jax_host)
    except (ImportError, RuntimeError):
        pass
    for front, (output, lse) in found.items():
        lse = np.asarray(lse.get() if hasattr(lse, "get") else lse)
        assert np.isneginf(lse[lse_rows]).all(), f"{front}: logsumexp {np.unique(lse[lse_rows])[:5]} on rows without keys"
        assert_lse_close(lse, want_lse)
        assert_close(f"{front} output", np.asarray(output.get() if hasattr(output, "get") else output), want, dtype)
