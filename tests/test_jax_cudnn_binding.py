"""The call plan's binding, checked on CPU against the cuDNN graphs the library declares.

Both fronts bind a call through :class:`cudnn_attn.engine.call.CallSpec`: :meth:`~cudnn_attn.engine.call.CallSpec.bind` turns the
named operands into the graph's tensors by :class:`~cudnn_attn.graphs.tensors.TensorId` (converting
packed segments with the front's array namespace, here ``jax.numpy`` as in the CUDA lowering), and
:func:`~cudnn_attn.engine.call.result_specs` names the graph's outputs.  cuDNN refuses to execute unless
exactly the graph's tensors are bound, so here, for every feature, the bound ids (operands + results +
host scalars) must equal the ids of the graph ``graphs.declare_graph`` declares - no GPU and no cuDNN
library needed - and the shapes must be the ones the graph reads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_attn import MaskType
from cudnn_attn.core.types import FP8_PARAM_KEYS
from cudnn_attn.core.validation import validate_call
from cudnn_attn.engine import call as call_plan
from cudnn_attn.engine.call import CallSpec
from cudnn_attn.graphs import declare_graph
from cudnn_attn.graphs import tensors as tt
from cudnn_attn.graphs.tensors import HOST_SCALAR_IDS, TensorId
from cudnn_attn.jax_bridge import cudnn_target
from cudnn_attn.jax_bridge.call_site import AttentionCall
from cudnn_attn.jax_bridge.signature import BWD, FWD, operand_names, result_shapes

B, T, S, N, K, H = 2, 32, 48, 4, 2, 64


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _array(shape, dtype):
    """A real array to describe a call (validation refuses shape/dtype descriptions); values never matter."""
    return np.zeros(shape, np.dtype(dtype))


def _config(case: str, training: bool):
    f16 = jnp.float16
    dtype = jnp.float8_e4m3fn if case == "fp8" else f16
    arrays = [_array((B, T, N, H), dtype), _array((B, S, K, H), dtype), _array((B, S, K, H), dtype)]
    kwargs: dict = {"training": training}
    if case == "bias_dbias":
        kwargs["bias"] = _array((1, N, T, S), f16)
    if case == "mask_only":
        kwargs["mask"] = _array((B, 1, T, S), jnp.bool_)
    if case == "padding_causal":
        kwargs.update(q_seqlen=_array((B,), jnp.int32), kv_seqlen=_array((B,), jnp.int32),
                      mask_type=MaskType.PADDING_CAUSAL)
    if case == "packed":
        kwargs.update(q_seqlen=_array((B, 3), jnp.int32), kv_seqlen=_array((B, 3), jnp.int32),
                      q_offsets=_array((B, 4), jnp.int32), kv_offsets=_array((B, 4), jnp.int32))
    if case == "paged":
        arrays[1:] = [_array((7, 16, K, H), f16), _array((7, 16, K, H), f16)]
        kwargs.update(q_seqlen=_array((B,), jnp.int32), kv_seqlen=_array((B,), jnp.int32),
                      page_table_k=_array((B, 1, 3, 1), jnp.int32), page_table_v=_array((B, 1, 3, 1), jnp.int32))
    if case == "dropout_sink":
        kwargs.update(dropout_rate=0.1, sink=_array((N,), jnp.float32))
    if case == "alibi_window":
        kwargs.update(mask_type=MaskType.ALIBI, sliding_window_length=8)
    if case == "fp8":
        kwargs.update(fp8_params={k: _array((1, 1, 1, 1), jnp.float32) for k in FP8_PARAM_KEYS}, use_fp8=True,
                      mask_type=MaskType.CAUSAL)
    return validate_call(*arrays, xp=jnp, **kwargs)


CASES = ["plain", "bias_dbias", "mask_only", "padding_causal", "packed", "paged", "dropout_sink", "alibi_window", "fp8"]
KINDS = [(FWD, False), (FWD, True), (BWD, True)]


@pytest.mark.parametrize("kind, training", KINDS, ids=["inference", "training_forward", "backward"])
@pytest.mark.parametrize("case", CASES)
def test_bound_tensors_are_the_graphs_tensors(case, kind, training):
    if case == "paged" and kind == BWD:
        pytest.skip("paged attention has no backward")
    config, operands = _config(case, training)
    named = {}
    for name in operand_names(config, kind):
        if name in ("output", "grad_output"):
            named[name] = _sds(config.o_shape, operands.query.dtype)
        elif name == "logsumexp":
            named[name] = _sds(config.lse_shape, jnp.float32)
        elif name in FP8_PARAM_KEYS:
            named[name] = operands.fp8_scales[name]
        else:
            value = getattr(operands, name)
            named[name] = _sds(value.shape, value.dtype)
    bound = jax.eval_shape(lambda named: CallSpec.of(config, kind).bind(jnp, named)[0], named)
    results = {spec.tid: (spec.shape, spec.dtype) for spec in call_plan.result_specs(config, kind)}
    expected = declare_graph(config, kind).uids
    host = {t for t in expected if t in HOST_SCALAR_IDS}
    assert set(bound) | set(results) | host == set(expected)
    assert not set(bound) & set(results) and not set(bound) & host
    assert CallSpec.of(config, kind).graph_operands == tuple(sorted(bound))      # what a CallPlan checks once

    # Shapes the graph reads (a few representative tensors).
    if config.packing is None:
        assert tuple(bound[TensorId.Q].shape) == config.q_shape
        if TensorId.STATS in results:
            assert results[TensorId.STATS][0] == tt.stats_tensor(B, N, T, ragged=False)[0][:3]
    else:
        segments = config.segments
        assert bound[TensorId.SEQ_LEN_Q].shape == (segments,) and bound[TensorId.RAGGED_Q].shape == (segments + 1,)
        if TensorId.STATS in results:
            assert results[TensorId.STATS][0] == (B * T, N)              # token-major statistics
    if config.has_dropout:
        assert host == {TensorId.SEED, TensorId.OFFSET}
        assert CallSpec.of(config, "fwd").host_scalars(7) == (7, 0)
    expected_results = result_shapes(config, kind)
    assert len(results) == len(expected_results)


def _fills(config, kind):
    return {spec.tid: spec.fill for spec in call_plan.result_specs(config, kind) if spec.fill is not call_plan.Fill.NONE}


def test_one_fill_policy_for_rows_cudnn_does_not_compute():
    Fill = call_plan.Fill
    padded, _ = _config("padding_causal", True)
    plain, _ = _config("bias_dbias", True)
    packed, _ = _config("packed", True)
    assert _fills(padded, FWD) == {TensorId.O: Fill.ZERO_BEFORE, TensorId.STATS: Fill.ROWS_AFTER}
    assert _fills(padded, BWD) == {TensorId.DQ: Fill.ZERO_BEFORE, TensorId.DK: Fill.ZERO_BEFORE,
                                   TensorId.DV: Fill.ZERO_BEFORE}
    assert _fills(packed, FWD) == {TensorId.O: Fill.ZERO_BEFORE, TensorId.STATS: Fill.SEGMENTS}
    assert _fills(plain, FWD) == {}
    assert _fills(plain, BWD) == {TensorId.DBIAS: Fill.ZERO_BEFORE}       # cuDNN accumulates dbias


def test_zero_rows_sets_padded_query_rows_to_zero():
    lse = jnp.arange(2 * 3 * 4, dtype=jnp.float32).reshape(2, 3, 4) + 1.0
    fixed = call_plan.zero_rows(jnp, lse, jnp.array([1, 4], jnp.int32))
    assert bool((fixed[0, :, 1:] == 0).all()) and bool((fixed[0, :, :1] == lse[0, :, :1]).all())
    assert bool((fixed[1] == lse[1]).all())


def test_score_mod_arguments_are_refused_on_the_gpu_path():
    from cudnn_attn import UnsupportedConfigurationError

    q = _array((B, T, N, H), jnp.float16)
    config, _ = validate_call(q, q, q, score_mod=lambda s, c: s * c, score_mod_args=(_array((), jnp.float32),), xp=jnp)
    with pytest.raises(UnsupportedConfigurationError, match="score_mod arguments are traced arrays"):
        cudnn_target._check_expressible(AttentionCall(config, FWD))
