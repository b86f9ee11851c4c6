"""The max logit (cuDNN's ``score_max`` with ``score_sum_exp``) and dropout from device seed/offset tensors on the
GPU, against the float64 reference: fresh random inputs per test (``rng``: a failure prints its seed), results
pre-filled with NaN.

Tolerances.  ``score_max`` is a float32 maximum of float32 scores of the io-dtype Q and K, the reference's a float64
one of the same inputs rounded once: compared per element like the logsumexp (``_checks.LSE_TOLERANCE``:
``|gpu - ref| <= 1e-3 * max(1, |ref|)``), and its ``-inf`` rows (no admissible key) must match exactly.  The
logsumexp made from ``max + log(sum_exp)`` has the logsumexp's tolerance; outputs and gradients the relative
Frobenius bounds of ``_checks`` (1.5x with dropout, as ``test_attention_gpu``'s dropout test).  Dropout keep rates
are checked within 5 standard deviations of ``1 - rate`` over every draw of the call.
"""

from __future__ import annotations

import numpy as np
import pytest

from cudnn_attn import AuxRequest, MaskType, reference
from cudnn_attn.core import masked_rows
from cudnn_attn.engine import prepared
from cudnn_attn.reference.inputs import random_operands

from ._checks import LSE_TOLERANCE, assert_close, assert_lse_close, io_dtype, make_config, poisoned, to_gpu

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

CASES = {
    "causal-gqa-8:2-bf16": dict(N=8, K=2, dtype="bfloat16", mask_type=MaskType.CAUSAL),
    "padding-causal-gqa-8:2-fp16": dict(N=8, K=2, mask_type=MaskType.PADDING_CAUSAL),
    "padding-gqa-4:2-bf16-inference": dict(N=4, K=2, dtype="bfloat16", mask_type=MaskType.PADDING, training=False),
    "bias-1NTS-causal-fp16": dict(bias_shape=(1, 4, 128, 128), mask_type=MaskType.CAUSAL),
    "padding-causal-bottom-right-bf16": dict(mask_type=MaskType.PADDING_CAUSAL, diagonal_alignment="bottom_right",
                                             dtype="bfloat16"),
    "window-16-BNTH-fp16": dict(mask_type=MaskType.CAUSAL, sliding_window_length=16, layout="BNTH"),
    "T64-S192-gqa-bf16": dict(T=64, S=192, N=8, K=2, dtype="bfloat16"),
}


def _assert_score_max_close(got, want) -> None:
    got, want = cp.asnumpy(got).astype(np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert not np.isnan(got).any(), f"score_max: {int(np.isnan(got).sum())} NaN elements (unwritten rows)"
    assert np.array_equal(np.isneginf(got), np.isneginf(want)), \
        f"score_max: -inf at {int(np.isneginf(got).sum())} elements, the reference at {int(np.isneginf(want).sum())}"
    finite = np.isfinite(want)
    err = np.abs(got[finite] - want[finite]) / np.maximum(1.0, np.abs(want[finite]))
    assert err.max(initial=0.0) <= LSE_TOLERANCE, f"score_max: error {err.max():.2e} > {LSE_TOLERANCE}"


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_score_max_and_the_per_head_max_match_the_reference(case, rng):
    config = make_config(**CASES[case]).replace(score_max=True)
    operands = random_operands(config, rng, poison=False)
    if operands.q_seqlen is not None and config.mask.alignment.value == "bottom_right":
        operands = operands.replace(kv_seqlen=np.maximum(operands.kv_seqlen, operands.q_seqlen))
    gpu = to_gpu(operands)
    output = poisoned(config.o_shape, io_dtype(config.dtype))
    lse = poisoned(config.lse_shape, np.float32) if config.training else None
    result = prepared.forward(config, gpu, output=output, logsumexp=lse)
    expected = reference.forward(config, operands)
    assert result.output is output and (lse is None or result.logsumexp is lse)
    assert_close("output", result.output, expected.output, config.dtype)
    if config.training:                           # max + log(sum_exp): the logsumexp the backward reads
        assert_lse_close(result.logsumexp, expected.logsumexp)
    _assert_score_max_close(result.score_max, expected.score_max)
    _assert_score_max_close(result.max_logit, expected.max_logit)
    if config.training:                           # the backward of a score_max forward reads that logsumexp
        grad_output = rng.standard_normal(config.o_shape).astype(io_dtype(config.dtype))
        grads = prepared.backward(config.replace(score_max=False), gpu, result.output, cp.asarray(grad_output),
                                  result.logsumexp)
        expected_grads = reference.backward(config, operands, expected.output, grad_output, expected.logsumexp)
        for name in ("dq", "dk", "dv"):
            assert_close(name, getattr(grads, name), getattr(expected_grads, name), config.dtype)


def test_the_cupy_native_call_returns_the_max_logit(rng):
    import cudnn_attn

    q, k, v = (cp.asarray(rng.standard_normal((2, 128, n, 64)).astype(np.float16)) for n in (8, 2, 2))
    lengths = cp.asarray(np.array([128, 77], np.int32))
    mask = cudnn_attn.causal() & cudnn_attn.padding(lengths, lengths)
    got = cudnn_attn.attention(q, k, v, mask=mask, return_aux=AuxRequest(logsumexp=True, max_logit=True))
    host = cudnn_attn.causal() & cudnn_attn.padding(cp.asnumpy(lengths), cp.asnumpy(lengths))
    want = reference.attention(*(cp.asnumpy(x) for x in (q, k, v)), mask=host,
                               return_aux=AuxRequest(logsumexp=True, max_logit=True))
    assert got.max_logit.shape == (8,) and got.score_max.shape == (2, 8, 128)
    _assert_score_max_close(got.score_max, want.score_max)
    _assert_score_max_close(got.max_logit, want.max_logit)
    assert_lse_close(got.logsumexp, want.logsumexp)
    assert bool(cp.isneginf(got.score_max[1, :, 77:]).all())


# -- dropout from device tensors ---------------------------------------------------------------------------

RATE = 0.25


def _seeded(config, operands, seed: int, offset: int = 0):
    """``config`` and the GPU ``operands`` with a device seed and offset (int64 ``(1,)`` CuPy arrays)."""
    pair = cp.asarray(np.array([seed, offset], np.int64))
    return config.replace(device_seed=True), operands.replace(dropout_seed=pair[0:1], dropout_offset=pair[1:2])


def _keep_rate_ok(keep: np.ndarray) -> bool:
    return abs(keep.mean() - (1 - RATE)) < 5 * np.sqrt(RATE * (1 - RATE) / keep.size)


@pytest.mark.parametrize("extra", [dict(dtype="bfloat16", N=8, K=2, mask_type=MaskType.CAUSAL),
                                   dict(mask_type=MaskType.PADDING_CAUSAL, bias_shape=(1, 4, 128, 128))],
                         ids=["causal-gqa-bf16", "padding-causal-bias-fp16"])
def test_device_seed_forward_and_backward_draw_the_same_mask(extra, rng):
    """cuDNN's keep-mask of the forward (``rng_dump``) fed to the reference: the forward and the backward (which
    reads the same device seed) both match it, and the mask's keep rate is ``1 - rate``."""
    config = make_config(dropout_rate=RATE, **extra)
    operands = random_operands(config, rng, poison=False)
    config, gpu = _seeded(config, to_gpu(operands), seed=int(rng.integers(1, 2**62)))
    io = io_dtype(config.dtype)
    dump = cp.zeros((config.segments, config.q_heads, config.q_len, config.kv_len), np.float32)
    result = prepared.forward(config, gpu, output=poisoned(config.o_shape, io),
                              logsumexp=poisoned(config.lse_shape, np.float32), rng_dump=dump)
    keep = cp.asnumpy(dump)
    assert set(np.unique(keep)) <= {0.0, 1.0}
    if not config.mask.padding:
        assert _keep_rate_ok(keep), keep.mean()
    expected = reference.forward(config, operands, dropout_mask=keep)
    assert_close("output", result.output, expected.output, config.dtype, scale=1.5)
    assert_lse_close(result.logsumexp, expected.logsumexp)
    grad_output = rng.standard_normal(config.o_shape).astype(io)
    grads = prepared.backward(config, gpu, result.output, cp.asarray(grad_output), result.logsumexp,
                              dq=poisoned(config.q_shape, io), dk=poisoned(config.k_shape, io),
                              dv=poisoned(config.v_shape, io),
                              **({"dbias": poisoned(config.bias.shape, io)} if config.has_dbias else {}))
    expected_grads = reference.backward(config, operands, expected.output, grad_output, expected.logsumexp,
                                        dropout_mask=keep)
    for name in ("dq", "dk", "dv") + (("dbias",) if config.has_dbias else ()):
        assert_close(name, getattr(grads, name), getattr(expected_grads, name), config.dtype, scale=1.5)


def test_device_seed_values_change_the_mask_without_a_new_graph(rng):
    from cudnn_attn.engine.cache import graph_cache

    config = make_config(dropout_rate=RATE)
    gpu = to_gpu(random_operands(config, rng, poison=False))
    pair = cp.asarray(np.array([5, 0], np.int64))
    seeded = config.replace(device_seed=True)
    operands = gpu.replace(dropout_seed=pair[0:1], dropout_offset=pair[1:2])
    first = prepared.forward(seeded, operands).output.copy()
    misses = graph_cache.stats().misses
    again = prepared.forward(seeded, operands).output.copy()
    pair[0] = 6                                              # a new seed in the same device memory
    other = prepared.forward(seeded, operands).output.copy()
    pair[0], pair[1] = 5, 1024                               # the first seed, another offset
    shifted = prepared.forward(seeded, operands).output.copy()
    assert graph_cache.stats().misses == misses
    assert cp.array_equal(first, again)
    assert not cp.array_equal(first, other) and not cp.array_equal(first, shifted)


def test_cupy_seed_array_through_the_public_call(rng):
    import cudnn_attn

    q, k, v = (cp.asarray(rng.standard_normal((2, 128, 4, 64)).astype(np.float16)) for _ in range(3))
    seed = cp.asarray(np.array([7, 0], np.int64))
    a = cudnn_attn.attention(q, k, v, dropout_rate=RATE, seed=seed).output
    b = cudnn_attn.attention(q, k, v, dropout_rate=RATE, seed=seed).output
    seed[0] = 8
    c = cudnn_attn.attention(q, k, v, dropout_rate=RATE, seed=seed).output
    assert cp.array_equal(a, b) and not cp.array_equal(a, c)


# -- the JAX bridge ------------------------------------------------------------------------------------------

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")


def _jax_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


needs_jax_gpu = pytest.mark.skipif(not _jax_gpu(), reason="JAX has no CUDA backend here")


@needs_jax_gpu
def test_jax_dropout_masks_differ_across_jitted_steps_and_match_cupy(rng):
    """Under ``jit`` each key draws its own mask and the same key the same one.  The JAX call's gradients equal
    the reference's with the keep-mask that a CuPy call of the same configuration dumps for the same seed words
    (cuDNN's mask depends on the seed, the offset and the positions only)."""
    from cudnn_attn import causal
    from cudnn_attn import jax_bridge as jb
    from cudnn_attn.core.validation import validate_call
    from cudnn_attn.jax_bridge import dropout

    B, T, N, K, H = 2, 128, 8, 2, 64
    q, k, v = (rng.standard_normal(shape).astype(np.float16) for shape in ((B, T, N, H), (B, T, K, H), (B, T, K, H)))
    weight = rng.standard_normal((B, T, N, H)).astype(np.float32)
    scale = H ** -0.5

    def loss(q, k, v, key):
        out = jb.attention(q, k, v, mask=causal(), scale=scale, dropout_rate=RATE, dropout_rng=key).output
        return jnp.sum(out.astype(jnp.float32) * weight), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
    (_, out0), grads0 = step(q, k, v, jax.random.key(0))
    (_, out1), _ = step(q, k, v, jax.random.key(1))
    (_, again), _ = step(q, k, v, jax.random.key(0))
    assert np.array_equal(np.asarray(out0), np.asarray(again))
    assert not np.array_equal(np.asarray(out0), np.asarray(out1))

    words = np.asarray(dropout.seed_operands(jax.random.key(0))[0])      # the int64 seed's two words, low first
    seed = cp.asarray(np.array([int(words.view(np.uint64)[0]), 0], np.uint64).view(np.int64))
    config, operands = validate_call(q, k, v, scale=scale, dropout_rate=RATE, training=True)
    config = config.replace(mask=causal().static(padding=False), device_seed=True)
    gpu = to_gpu(operands).replace(dropout_seed=seed[0:1], dropout_offset=seed[1:2])
    dump = cp.zeros((B, N, T, T), np.float32)
    prepared.forward(config, gpu, rng_dump=dump)
    keep = cp.asnumpy(dump)
    assert _keep_rate_ok(keep), keep.mean()
    expected = reference.forward(config, operands, dropout_mask=keep)
    assert_close("output", np.asarray(out0), expected.output, "float16", scale=1.5)
    expected_grads = reference.backward(config, operands, expected.output, weight.astype(np.float16),
                                        expected.logsumexp, dropout_mask=keep)
    for name, got in zip(("dq", "dk", "dv"), grads0):
        assert_close(name, np.asarray(got), getattr(expected_grads, name), "float16", scale=1.5)


@needs_jax_gpu
def test_jax_max_logit_under_jit_and_vmap_match_the_reference(rng):
    from cudnn_attn import causal, padding
    from cudnn_attn import jax_bridge as jb

    B, T, N, K, H = 2, 256, 8, 2, 64
    q, k, v = (rng.standard_normal(shape).astype(np.float16) for shape in ((B, T, N, H), (B, T, K, H), (B, T, K, H)))
    lengths = np.array([256, 131], np.int32)
    aux = AuxRequest(logsumexp=True, max_logit=True)
    got = jax.jit(lambda q, k, v, n: jb.attention(q, k, v, mask=causal() & padding(n, n), return_aux=aux))(
        q, k, v, jnp.asarray(lengths))
    want = reference.attention(q, k, v, mask=causal() & padding(lengths, lengths), return_aux=aux)
    _assert_score_max_close(cp.asarray(np.asarray(got.score_max)), want.score_max)
    _assert_score_max_close(cp.asarray(np.asarray(got.max_logit)), want.max_logit)
    assert_lse_close(cp.asarray(np.asarray(got.logsumexp)), want.logsumexp)
    grad = jax.grad(lambda q: jnp.sum(jb.attention(q, k, v, mask=causal(), return_aux=aux).max_logit))(q)
    assert float(jnp.abs(grad.astype(jnp.float32)).max()) == 0.0
    qs = np.stack([q, -q])
    batched = jax.jit(jax.vmap(lambda q: jb.attention(q, k, v, mask=causal(), return_aux=aux).max_logit))(qs)
    for i in range(2):
        one = reference.attention(qs[i], k, v, mask=causal(), return_aux=aux)
        _assert_score_max_close(cp.asarray(np.asarray(batched[i])), one.max_logit)
    assert masked_rows.max_logit(np, np.asarray(got.score_max)).tolist() == np.asarray(got.max_logit).tolist()


@needs_jax_gpu
def test_flax_training_step_with_attention_dropout_draws_a_fresh_mask_per_step():
    """``bench_frameworks``' ``flax_dropout`` decoder on cuDNN: with a learning rate of 0 two jitted steps differ
    only by their masks (equal without dropout); with SGD the loss falls over 10 steps."""
    import os
    import sys

    pytest.importorskip("flax")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    import bench_frameworks as frameworks

    from cudnn_attn.jax_bridge import flax_attention_fn

    shape = frameworks.DecoderShape(batch=4, length=256, d_model=256, heads=4, layers=2, vocab=1024)
    for rate, distinct in ((0.1, 3), (0.0, 1)):
        losses = frameworks.frozen_losses(flax_attention_fn(), shape, rate)
        assert all(np.isfinite(losses)) and len(set(losses)) == distinct, (rate, losses)
    tokens, mask = frameworks.batch(shape)
    model = frameworks.decoder(flax_attention_fn(), shape, dropout_rate=0.1)
    step = frameworks.make_train_step()
    losses = [float(step(model, tokens, mask)) for _ in range(10)]
    assert losses[-1] < losses[0], losses
