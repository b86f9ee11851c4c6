"""Every fp16/bf16 feature of the cuDNN path against the float64 reference: forward output,
logsumexp and every gradient, results pre-filled with NaN, fresh random inputs per test
(tolerances: ``_checks``)."""

from __future__ import annotations

import numpy as np
import pytest

from cudnn_attn import AttentionLayout, MaskType, reference
from cudnn_attn.engine import prepared
from cudnn_attn.reference.inputs import random_operands
from cudnn_attn.reference.segments import segments_of

from ._checks import assert_close, assert_lse_close, io_dtype, make_config, poisoned, replace_nan, to_gpu

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

CASES = {
    # name: make_config keyword arguments
    "no-mask-BTNH-fp16": dict(),
    "no-mask-BTNH-bf16": dict(dtype="bfloat16"),
    "no-mask-BNTH-fp16": dict(layout="BNTH"),
    "no-mask-BNTH-bf16": dict(layout="BNTH", dtype="bfloat16"),
    "T!=S-fp16": dict(T=96, S=160),
    "causal-fp16": dict(mask_type=MaskType.CAUSAL),
    "causal-BNTH-bf16": dict(mask_type=MaskType.CAUSAL, layout="BNTH", dtype="bfloat16"),
    "padding-bf16": dict(mask_type=MaskType.PADDING, dtype="bfloat16"),
    "padding-BNTH-fp16": dict(mask_type=MaskType.PADDING, layout="BNTH", T=96, S=160),
    "padding-causal-fp16": dict(mask_type=MaskType.PADDING_CAUSAL),
    "alibi-fp16": dict(mask_type=MaskType.ALIBI, N=8),
    "alibi-bf16": dict(mask_type=MaskType.ALIBI, dtype="bfloat16"),
    "causal-bottom-right-T<S-fp16": dict(mask_type=MaskType.CAUSAL, diagonal_alignment="bottom_right", T=64, S=192),
    "padding-causal-bottom-right-fp16": dict(mask_type=MaskType.PADDING_CAUSAL, diagonal_alignment="bottom_right"),
    "bias-1NTS-fp16": dict(bias_shape=(1, 4, 128, 128)),
    "bias-B1TS-fp16": dict(bias_shape=(2, 1, 128, 128)),
    "bias-BNTS-bf16": dict(bias_shape=(2, 4, 128, 128), dtype="bfloat16"),
    "bias-11TS-fp16": dict(bias_shape=(1, 1, 128, 128)),
    "bias-causal-padding-bf16": dict(bias_shape=(1, 4, 128, 128), mask_type=MaskType.PADDING_CAUSAL,
                                     dtype="bfloat16"),
    "window-16-fp16": dict(mask_type=MaskType.CAUSAL, sliding_window_length=16),
    "window-33-bf16": dict(sliding_window_length=33, dtype="bfloat16"),
    "packed-3-fp16": dict(segments=3),
    "packed-2-causal-bf16": dict(segments=2, mask_type=MaskType.CAUSAL, dtype="bfloat16"),
    "gqa-8:2-bf16": dict(N=8, K=2, dtype="bfloat16", mask_type=MaskType.CAUSAL),
    "mqa-8:1-fp16": dict(N=8, K=1),
    "mla-192:128-bf16": dict(H=192, Hv=128, dtype="bfloat16", mask_type=MaskType.CAUSAL),
    "d128-fp16": dict(H=128),
    "d256-bf16": dict(H=256, dtype="bfloat16"),
    "sink-fp16": dict(sink=np.empty((4,), np.float32), mask_type=MaskType.CAUSAL),
    "scale-bf16": dict(scale=0.125, dtype="bfloat16"),
}


def _run(config, operands, rng, *, seed=11, dropout_mask=None, rng_dump=None):
    """Forward + backward on the GPU into NaN-poisoned results; the reference with the same keep-mask."""
    gpu = to_gpu(operands)
    io = io_dtype(config.dtype)
    output, lse = poisoned(config.o_shape, io), poisoned(config.lse_shape, np.float32)
    result = prepared.forward(config, gpu, seed=seed, output=output, logsumexp=lse, rng_dump=rng_dump)
    assert result.output is output
    keep = None if rng_dump is None else cp.asnumpy(rng_dump)
    expected = reference.forward(config, operands, dropout_mask=keep)

    grad_output = rng.standard_normal(config.o_shape).astype(io)
    results = dict(dq=poisoned(config.q_shape, io), dk=poisoned(config.k_shape, io), dv=poisoned(config.v_shape, io))
    if config.has_dbias:
        results["dbias"] = poisoned(config.bias.shape, io)
    if config.sink:
        results["dsink"] = poisoned((config.q_heads,), np.float32)
    grads = prepared.backward(config, gpu, result.output, cp.asarray(grad_output), result.logsumexp, seed=seed,
                               **results)
    expected_grads = reference.backward(config, operands, expected.output, grad_output, expected.logsumexp,
                                        dropout_mask=keep)
    return result, expected, grads, expected_grads


def _check(config, result, expected, grads, expected_grads, *, scale=1.0):
    assert_close("output", result.output, expected.output, config.dtype, scale=scale)
    assert_lse_close(result.logsumexp, expected.logsumexp)
    for name in ("dq", "dk", "dv"):
        assert_close(name, getattr(grads, name), getattr(expected_grads, name), config.dtype, scale=scale)
    if config.has_dbias:
        assert_close("dbias", grads.dbias, expected_grads.dbias, config.dtype, scale=scale)
    else:
        assert grads.dbias is None
    if config.sink:
        assert_close("dsink", grads.dsink, expected_grads.dsink, config.dtype, scale=scale)


GARBAGE = 8.0   # what the tokens outside every sequence hold in the garbage tests


def _operands(config, rng, *, poison):
    """Random operands; with bottom-right alignment every query keeps at least one key
    (``kv_seqlen >= q_seqlen``), the only regime where cuDNN and the reference define the result.

    With ``poison`` the Q/K/V tokens outside every sequence hold a large constant.  Not NaN: cuDNN
    reads them inside its tiles and masks their contribution, so NaN there would propagate (measured
    on the H200, cuDNN 9.19; documented in :mod:`cudnn_attn.engine.prepared`)."""
    operands = random_operands(config, rng, poison=poison)
    if poison:
        operands = operands.replace(**{name: replace_nan(getattr(operands, name), GARBAGE)
                                       for name in ("query", "key", "value")})
    if config.mask.alignment.value == "bottom_right" and operands.q_seqlen is not None:
        operands = operands.replace(kv_seqlen=np.maximum(operands.kv_seqlen, operands.q_seqlen))
    return operands


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_forward_and_gradients_match_the_reference(case, rng):
    config = make_config(**CASES[case])
    operands = _operands(config, rng, poison=False)
    _check(config, *_run(config, operands, rng))


@pytest.mark.parametrize("case", ["padding-bf16", "padding-BNTH-fp16", "packed-3-fp16", "packed-2-causal-bf16"])
def test_garbage_outside_the_sequences_never_leaks(case, rng):
    """Q/K/V tokens outside every sequence hold garbage: results must equal the reference, and the
    output, dq, dk and dv there are exactly 0 (results are NaN-poisoned before the call)."""
    config = make_config(**CASES[case])
    operands = _operands(config, rng, poison=True)
    result, expected, grads, expected_grads = _run(config, operands, rng)
    _check(config, result, expected, grads, expected_grads)
    segments = segments_of(config, operands)
    token_axis = 1 if config.layout is AttentionLayout.BTNH else 2
    for name, got, valid in (("output", result.output, segments.valid_q), ("dq", grads.dq, segments.valid_q),
                             ("dk", grads.dk, segments.valid_kv), ("dv", grads.dv, segments.valid_kv)):
        outside = np.moveaxis(cp.asnumpy(got).astype(np.float64), token_axis, 1)[~valid]
        assert (outside == 0).all(), f"{name}: {int((outside != 0).sum())} nonzero elements outside the sequences"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("extra", [{}, {"mask_type": MaskType.PADDING_CAUSAL, "bias_shape": (1, 4, 128, 128)}],
                         ids=["plain", "padding-causal-bias"])
def test_dropout_matches_the_reference_with_cudnns_keep_mask(dtype, extra, rng):
    """cuDNN's Philox keep-mask (``rng_dump``) fed to the reference: forward and backward agree, so the
    backward regenerated the forward's mask from the seed.  Tolerance 1.5x: the kept, bf16-rounded
    probabilities are rescaled by 1 / (1 - p) (measured dq error 1.01e-2 in bf16 at p = 0.25)."""
    rate = 0.25
    config = make_config(dtype=dtype, dropout_rate=rate, **extra)
    operands = random_operands(config, rng, poison=False)
    dump = cp.zeros((config.segments, config.q_heads, config.q_len, config.kv_len), np.float32)  # debug output
    result, expected, grads, expected_grads = _run(config, operands, rng, seed=1234, rng_dump=dump)
    keep = cp.asnumpy(dump)
    assert set(np.unique(keep)) <= {0.0, 1.0}
    if not config.mask.padding:
        assert abs(keep.mean() - (1 - rate)) < 0.02
    _check(config, result, expected, grads, expected_grads, scale=1.5)


def test_dropout_seed_is_a_runtime_value(rng):
    config = make_config(dropout_rate=0.5)
    gpu = to_gpu(random_operands(config, rng, poison=False))
    from cudnn_attn.engine.cache import graph_cache

    first = prepared.forward(config, gpu, seed=1).output
    misses = graph_cache.stats().misses
    again = prepared.forward(config, gpu, seed=1).output
    other = prepared.forward(config, gpu, seed=2).output
    assert graph_cache.stats().misses == misses
    assert cp.array_equal(first, again) and not cp.array_equal(first, other)


def test_deterministic_backward_is_bit_identical(rng):
    config = make_config(N=8, K=2, T=256, S=256, mask_type=MaskType.CAUSAL, deterministic=True)
    operands = random_operands(config, rng, poison=False)
    gpu = to_gpu(operands)
    result = prepared.forward(config, gpu)
    grad_output = cp.asarray(rng.standard_normal(config.o_shape).astype(np.float16))
    runs = [prepared.backward(config, gpu, result.output, grad_output, result.logsumexp) for _ in range(3)]
    for name in ("dq", "dk", "dv"):
        assert all(cp.array_equal(getattr(runs[0], name), getattr(r, name)) for r in runs[1:]), name
    expected = reference.forward(config, operands)
    expected_grads = reference.backward(config, operands, expected.output, cp.asnumpy(grad_output), expected.logsumexp)
    assert_close("dq", runs[0].dq, expected_grads.dq, "float16")


def test_inference_forward_has_no_logsumexp(rng):
    config = make_config(training=False, mask_type=MaskType.CAUSAL)
    operands = random_operands(config, rng, poison=False)
    result = prepared.forward(config, to_gpu(operands), output=poisoned(config.o_shape, np.float16))
    assert result.logsumexp is None
    assert_close("output", result.output, reference.forward(config, operands).output, "float16")
