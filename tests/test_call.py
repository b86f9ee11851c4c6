"""What one call binds and returns (:mod:`cudnn_attn.engine.call`) against its own interface, on NumPy: the
operands and results of each configuration, the graph tensors :meth:`CallSpec.bind` makes of the named arrays
(exactly :attr:`CallSpec.graph_operands`), the after-launch fills of :meth:`CallSpec.finish` and the host scalars.
(The same binding under JAX's abstract evaluation: ``tests/test_jax_cudnn_binding.py``.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cudnn_attn.core import masked_rows
from cudnn_attn.core.types import FP8_BWD_KEYS, FP8_FWD_KEYS, MaskType
from cudnn_attn.core.validation import validate_call
from cudnn_attn.engine.call import BWD, FWD, RESIDUALS, CallSpec, Fill, result_specs, zero_rows
from cudnn_attn.engine.call_steps import named_operands
from cudnn_attn.graphs.tensors import TensorId

B, T, S, N, H = 2, 8, 8, 2, 16


def _call(seed: int = 0, **extra):
    """A validated call on NumPy float16 arrays (BTNH) and its named arrays; ``extra`` as validate_call takes."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, n, N, H)).astype(np.float16) for n in (T, S, S))
    config, operands = validate_call(q, k, v, **extra, xp=np)
    return config, operands


def _residuals(config, seed: int = 1):
    rng = np.random.default_rng(seed)
    output = rng.standard_normal(config.o_shape).astype(np.float16)
    return dict(output=output, grad_output=rng.standard_normal(config.o_shape).astype(np.float16),
                logsumexp=rng.standard_normal(config.lse_shape).astype(np.float32))


def test_a_kind_is_forward_or_backward_and_the_spec_is_made_once():
    config, _ = _call()
    with pytest.raises(ValueError, match="kind: must be one of"):
        CallSpec.of(config, "sideways")
    assert CallSpec.of(config, FWD) is CallSpec.of(config, "fwd")
    assert CallSpec.of(config, FWD).kind is FWD


def test_operands_and_results_follow_the_configuration():
    plain, _ = _call()
    assert CallSpec.of(plain, FWD).operands == ("query", "key", "value")
    assert CallSpec.of(plain, FWD).result_names == ("output",)
    assert CallSpec.of(plain, BWD).operands == ("query", "key", "value", *RESIDUALS)
    assert CallSpec.of(plain, BWD).result_names == ("dq", "dk", "dv")

    rng = np.random.default_rng(2)
    bias = rng.standard_normal((1, N, T, S)).astype(np.float16)
    lengths = np.array([T, 5], np.int32)
    full, _ = _call(bias=bias, q_seqlen=lengths, kv_seqlen=lengths, mask_type=MaskType.PADDING_CAUSAL, training=True)
    fwd, bwd = CallSpec.of(full, FWD), CallSpec.of(full, BWD)
    assert fwd.operands == ("query", "key", "value", "bias", "q_seqlen", "kv_seqlen")
    assert fwd.result_shapes() == {"output": ((B, T, N, H), np.dtype(np.float16)),
                                   "logsumexp": ((B, N, T), np.dtype(np.float32))}
    assert bwd.result_shapes()["dbias"] == ((1, N, T, S), np.dtype(np.float16))      # an explicit bias: its gradient


def test_fp8_calls_bind_their_scales_and_return_their_amaxes():
    config, _ = _call()
    fp8 = dataclasses.replace(config, dtype="float8_e4m3fn")
    assert CallSpec.of(fp8, FWD).operands[3:] == tuple(FP8_FWD_KEYS)
    assert CallSpec.of(fp8, BWD).operands[3:-3] == tuple(FP8_BWD_KEYS)
    assert [r.name for r in CallSpec.of(fp8, FWD).results] == ["output", "amax_s", "amax_o"]


def test_the_fill_policy_of_each_graph_result():
    lengths = np.array([T, 3], np.int32)
    padded, _ = _call(q_seqlen=lengths, kv_seqlen=lengths, mask_type=MaskType.PADDING, training=True)
    fills = {s.name: s.fill for s in result_specs(padded, FWD)}
    assert fills == {"output": Fill.ZERO_BEFORE, "logsumexp": Fill.ROWS_AFTER}
    assert {s.fill for s in result_specs(padded, BWD)} == {Fill.ZERO_BEFORE}
    plain, _ = _call(training=True)
    assert {s.fill for s in result_specs(plain, FWD) + result_specs(plain, BWD)} == {Fill.NONE}
    assert [s.tid for s in result_specs(plain, FWD, rng_dump=True)] == sorted(
        [TensorId.O, TensorId.STATS, TensorId.RNG_DUMP])


@pytest.mark.parametrize("case", ["plain", "bias", "padding", "packed"])
@pytest.mark.parametrize("kind", [FWD, BWD])
def test_bind_gives_the_graph_exactly_the_tensors_its_plan_checks(case, kind):
    lengths = np.array([T, 5], np.int32)
    extra = {"plain": {}, "bias": dict(bias=np.ones((B, N, T, S), np.float16)),
             "padding": dict(q_seqlen=lengths, kv_seqlen=lengths, mask_type=MaskType.PADDING),
             "packed": dict(q_seqlen=np.array([[3, 5], [8, -1]], np.int32),
                            kv_seqlen=np.array([[3, 5], [8, -1]], np.int32),
                            q_offsets=np.array([[0, 3, -1], [0, -1, -1]], np.int32),
                            kv_offsets=np.array([[0, 3, -1], [0, -1, -1]], np.int32), mask_type=MaskType.PADDING)}[case]
    config, operands = _call(training=True, **extra)
    spec = CallSpec.of(config, kind)
    named = named_operands(config, kind, operands, _residuals(config) if kind == BWD else None)
    bound, segments = spec.bind(np, {**named, "score_mod_arg_0": 1.5})      # a host scalar: not a graph tensor
    assert tuple(sorted(bound)) == spec.graph_operands
    assert (segments is not None) == (case == "packed")
    for name, tid in (("query", TensorId.Q), ("key", TensorId.K), ("value", TensorId.V)):
        assert bound[tid] is named[name]                          # Q, K, V reach cuDNN as they are


def test_the_backward_reads_a_row_without_keys_as_one_with_no_probability():
    lengths = np.array([T, 4], np.int32)
    config, operands = _call(q_seqlen=lengths, kv_seqlen=np.array([S, 0], np.int32), mask_type=MaskType.PADDING,
                             training=True)
    residuals = _residuals(config)
    residuals["logsumexp"][1] = -np.inf                           # the forward's logsumexp of keyless rows
    bound, _ = CallSpec.of(config, BWD).bind(np, named_operands(config, BWD, operands, residuals))
    stats = bound[TensorId.STATS]
    assert np.all(stats[1] == masked_rows.NO_PROBABILITY_LSE)
    np.testing.assert_array_equal(stats[0], residuals["logsumexp"][0])


def test_finish_zeroes_padded_logsumexp_rows_and_marks_rows_without_keys():
    """cuDNN writes non-finite values into the logsumexp rows of padded queries: ``finish`` sets them to 0, and a
    row without any key (``kv_seqlen`` 0) to ``-inf``; the output passes through."""
    q_lengths, kv_lengths = np.array([6, 3], np.int32), np.array([S, 0], np.int32)
    config, operands = _call(q_seqlen=q_lengths, kv_seqlen=kv_lengths, mask_type=MaskType.PADDING, training=True)
    spec = CallSpec.of(config, FWD)
    named = named_operands(config, FWD, operands)
    lse = np.random.default_rng(3).standard_normal(config.lse_shape).astype(np.float32)
    lse[:, :, 6:] = np.inf
    output = np.full(config.o_shape, 0.25, np.float16)
    results = spec.finish(np, {"output": output, "logsumexp": lse.copy()}, named, None)
    assert results["output"] is output
    np.testing.assert_array_equal(results["logsumexp"][0, :, :6], lse[0, :, :6])
    assert np.all(results["logsumexp"][0, :, 6:] == 0)               # padded rows of a sequence of 6 queries
    assert np.all(results["logsumexp"][1, :, :3] == -np.inf)         # keyless rows
    assert np.all(results["logsumexp"][1, :, 3:] == 0)


def test_zero_rows_keeps_the_rows_of_each_sequence():
    lse = np.arange(B * N * T, dtype=np.float32).reshape(B, N, T) + 1
    zeroed = zero_rows(np, lse, np.array([2, 7], np.int32))
    assert np.count_nonzero(zeroed[0], axis=-1).tolist() == [2, 2]
    assert np.count_nonzero(zeroed[1], axis=-1).tolist() == [7, 7]


def test_host_scalars_are_the_dropout_seed_and_offset_then_score_mod_arguments():
    plain, _ = _call()
    dropout, _ = _call(dropout_rate=0.1, training=True)
    assert CallSpec.of(plain, FWD).host_scalars(7) == ()
    assert CallSpec.of(plain, FWD).host_scalars(7, [np.float32(0.5), 2]) == (0.5, 2.0)
    assert CallSpec.of(dropout, FWD).host_scalars(2 ** 40, [3]) == (2 ** 40, 0, 3.0)
