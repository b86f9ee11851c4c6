"""Attention sinks (``sink=``, gpt-oss style) on the GPU through the public API against the reference.

A sink is a learnable logit per query head that joins every softmax denominator (and so the
logsumexp) without a value row; its gradient is ``dsink_h = -sum_{b,i} exp(sink_h - lse_i) D_i``.
Forward output and logsumexp, then dq, dk, dv and dsink of ``dot_product_attention_bwd``, for causal,
sliding-window, padded, GQA and bottom-right variants.

The sinks are drawn around 4, where a sink takes a fifth or more of a row's probability mass (most
of it in causal rows with few keys): a path that dropped the sink would be off by 10 % or more (the
least measured on the CPU over these cases), far above the tolerances, and each test checks that
against the reference itself.  Tolerances are the tier's (``_checks``: relative Frobenius error
2e-3 fp16, 1e-2 bf16; logsumexp 1e-3 per element); the public call allocates its results, so every
element is checked finite.  ``test_attention_gpu.py`` covers a causal fp16 sink through the native
API into NaN-filled results.
"""

from __future__ import annotations

import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import MaskType, UnsupportedConfigurationError, reference
from cudnn_attn.core.support import not_supported_reasons
from cudnn_attn.engine.cache import graph_cache
from cudnn_attn.reference.inputs import random_operands

from ._checks import RELATIVE_TOLERANCE, assert_close, assert_lse_close, io_dtype, make_config

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

SINK_CENTRE = 4.0

CASES = {
    # name: make_config keyword arguments (the sink is added by sink_config)
    "causal-fp16": dict(mask_type=MaskType.CAUSAL),
    "no-mask-BNTH-bf16": dict(layout="BNTH", dtype="bfloat16"),
    "window-24-fp16": dict(mask_type=MaskType.CAUSAL, sliding_window_length=24),
    "window-40-BNTH-bf16": dict(mask_type=MaskType.CAUSAL, sliding_window_length=40, layout="BNTH", dtype="bfloat16"),
    "padding-causal-gqa-8:2-fp16": dict(mask_type=MaskType.PADDING_CAUSAL, N=8, K=2),
    "causal-bottom-right-T64-S192-bf16": dict(mask_type=MaskType.CAUSAL, diagonal_alignment="bottom_right",
                                              T=64, S=192, dtype="bfloat16"),
    "d128-causal-fp16": dict(mask_type=MaskType.CAUSAL, H=128),
}


def sink_config(case: dict, *, training: bool = True):
    N = case.get("N", 4)
    return make_config(sink=np.empty((N,), np.float32), scale=case.get("H", 64) ** -0.5, training=training, **case)


def public_kwargs(config, case: dict, gpu: dict) -> dict:
    kwargs = dict(sink=gpu["sink"], scale=config.scale, mask_type=case.get("mask_type", MaskType.NO_MASK),
                  qkv_layout=config.layout.name, sliding_window_length=case.get("sliding_window_length"),
                  diagonal_alignment=case.get("diagonal_alignment", "top_left"))
    if config.mask.padding:
        kwargs.update(q_seqlen=gpu["q_seqlen"], kv_seqlen=gpu["kv_seqlen"])
    return kwargs


def sink_operands(config, rng):
    operands = random_operands(config, rng, poison=False)
    operands = operands.replace(sink=rng.normal(SINK_CENTRE, 1.0, config.q_heads).astype(np.float32))
    if config.mask.padding:   # every query row keeps a key: kv_seqlen >= q_seqlen
        operands = operands.replace(kv_seqlen=np.maximum(operands.kv_seqlen, operands.q_seqlen))
    return operands


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_sink_forward_logsumexp_and_gradients(case, rng):
    config = sink_config(CASES[case])
    operands = sink_operands(config, rng)
    expected = reference.forward(config, operands)
    without_sink = reference.forward(config.replace(sink=False), operands.replace(sink=None)).output
    assert relative_error(without_sink, expected.output) > 5 * RELATIVE_TOLERANCE[config.dtype], \
        "the sink is too weak for this test to notice a path that drops it"

    gpu = {name: cp.asarray(getattr(operands, name)) for name in ("query", "key", "value", "sink")
           if getattr(operands, name) is not None}
    if config.mask.padding:
        gpu.update(q_seqlen=cp.asarray(operands.q_seqlen), kv_seqlen=cp.asarray(operands.kv_seqlen))
    kwargs = public_kwargs(config, CASES[case], gpu)
    output, logsumexp = cudnn_attn.dot_product_attention(gpu["query"], gpu["key"], gpu["value"], return_residual=True,
                                                         **kwargs)
    assert_close("output", output, expected.output, config.dtype)
    assert_lse_close(logsumexp, expected.logsumexp)

    grad_output = rng.standard_normal(config.o_shape).astype(io_dtype(config.dtype))
    grads = cudnn_attn.dot_product_attention_bwd(gpu["query"], gpu["key"], gpu["value"], output,
                                                 cp.asarray(grad_output), logsumexp, **kwargs)
    expected_grads = reference.backward(config, operands, expected.output, grad_output, expected.logsumexp)
    assert grads.dsink.shape == (config.q_heads,) and grads.dsink.dtype == np.float32
    for name in ("dq", "dk", "dv", "dsink"):
        assert_close(name, getattr(grads, name), getattr(expected_grads, name), config.dtype)


REFUSED = {
    # name: (make_config keyword arguments, the forward's return_residual)
    "single-query": (dict(T=1, S=128), False),
    "packed-training": (dict(segments=2), True),
}


@pytest.mark.parametrize("case", list(REFUSED), ids=list(REFUSED))
def test_unsupported_sink_calls_are_refused_before_building(case, rng):
    """cuDNN 9.19 has no sink with a single query, and no sink gradient for packed segments (9.26):
    the call fails with the support table's reasons and builds nothing."""
    shape, training = REFUSED[case]
    config = sink_config(shape, training=training)
    reasons = not_supported_reasons(config)
    if not reasons:
        pytest.skip(f"supported by this GPU and cuDNN: {config.describe()}")
    operands = random_operands(config, rng, poison=False)
    arrays = {name: cp.asarray(getattr(operands, name)) for name in (
        "query", "key", "value", "sink", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets")
        if getattr(operands, name) is not None}
    before = graph_cache.stats()
    with pytest.raises(UnsupportedConfigurationError) as raised:
        cudnn_attn.dot_product_attention(**arrays, scale=config.scale, return_residual=training)
    assert raised.value.reasons == reasons
    after = graph_cache.stats()
    assert (after.entries, after.build_seconds) == (before.entries, before.build_seconds)
