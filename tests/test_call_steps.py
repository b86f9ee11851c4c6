"""The call steps every front runs (:mod:`cudnn_attn.engine.call_steps`) on NumPy and on JAX arrays: both give
the same operands; and a jitted JAX call and a prepared CuPy call (on the stand-in GPU of
``tests/test_prepared.py``) pass through the same step functions."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_attn.core import settings
from cudnn_attn.core.config import AttentionOperands
from cudnn_attn.core.types import MaskType
from cudnn_attn.core.validation import bind_seed, validate_call
from cudnn_attn.engine import call_steps, prepared
from cudnn_attn.fronts import cupy as cupy_front
from cudnn_attn.engine.call import BWD, FWD, RESIDUALS, CallSpec
from cudnn_attn.jax_bridge import api

from stand_in_gpu import array
from test_prepared import gpu  # noqa: F401 (the stand-in GPU fixture)

B, N, H = 2, 2, 16
_PACKED = dict(q_seqlen=np.array([[3, 4], [7, -1]], np.int32), kv_seqlen=np.array([[3, 4], [7, -1]], np.int32),
               q_offsets=np.array([[0, 3, -1], [0, -1, -1]], np.int32),
               kv_offsets=np.array([[0, 3, -1], [0, -1, -1]], np.int32), mask_type=MaskType.PADDING)
CASES = {
    "plain": (8, {}),
    "padding": (8, dict(q_seqlen=np.array([8, 99], np.int32), kv_seqlen=np.array([-3, 5], np.int32),
                        mask_type=MaskType.PADDING_CAUSAL)),
    "packed": (8, _PACKED),
    "odd bias": (7, dict(bias=np.ones((1, N, 7, 7), np.float16), training=True)),
    "single row": (1, dict(training=True)),
    "odd bias, lengths": (7, dict(bias=np.ones((1, N, 7, 7), np.float16), q_seqlen=np.array([7, 3], np.int32),
                                  kv_seqlen=np.array([5, 7], np.int32), mask_type=MaskType.PADDING, training=True)),
    "odd bias, device seed": (7, dict(bias=np.ones((1, N, 7, 7), np.float16), dropout_rate=0.1, training=True,
                                      device_seed=(np.array([5, 0], np.uint32), np.array([11, 0], np.uint32)))),
}


def _call(case: str, seed: int = 0):
    """A validated NumPy call (float16 BTNH, ``T = S``) and its backward residuals."""
    t, extra = CASES[case]
    extra = dict(extra)
    device_seed = extra.pop("device_seed", None)
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, t, N, H)).astype(np.float16) for _ in range(3))
    config, operands = validate_call(q, k, v, **extra, xp=np)
    if device_seed is not None:
        config, operands, _ = bind_seed(config, operands, device_seed)
        assert config.device_seed
    residuals = dict(output=rng.standard_normal(config.o_shape).astype(np.float16),
                     grad_output=rng.standard_normal(config.o_shape).astype(np.float16),
                     logsumexp=rng.standard_normal(config.lse_shape).astype(np.float32))
    return config, operands, residuals


def _arrays(operands: AttentionOperands) -> dict:
    """The NumPy arrays of ``operands``, by field, as JAX arrays."""
    return {f.name: jnp.asarray(getattr(operands, f.name)) for f in dataclasses.fields(operands)
            if isinstance(getattr(operands, f.name), np.ndarray)}


def _on_jax(operands: AttentionOperands) -> AttentionOperands:
    return operands.replace(**_arrays(operands))


def _jitted(operands: AttentionOperands, function):
    """``function(operands)`` under ``jit``, the arrays of ``operands`` traced."""
    return jax.jit(lambda arrays: function(operands.replace(**arrays)))(_arrays(operands))


def _same(numpy_arrays: dict, jax_arrays: dict) -> None:
    assert set(numpy_arrays) == set(jax_arrays)
    for name, x in numpy_arrays.items():
        y = jax_arrays[name]
        assert (x is None) == (y is None), name
        if x is not None:
            assert isinstance(y, jax.Array), name
            assert y.dtype == x.dtype and y.shape == x.shape, name
            np.testing.assert_array_equal(np.asarray(y), x, err_msg=name)


@pytest.mark.parametrize("kind", [FWD, BWD])
@pytest.mark.parametrize("case", sorted(CASES))
def test_named_operands_and_back_give_the_same_arrays_on_numpy_and_jax(case, kind):
    config, operands, residuals = _call(case)
    found = {}
    for xp, ops, res in ((np, operands, residuals),
                         (jnp, _on_jax(operands), {n: jnp.asarray(x) for n, x in residuals.items()})):
        named = call_steps.named_operands(config, kind, ops, res if kind == BWD else None)
        assert tuple(named) == CallSpec.of(config, kind).operands
        back, back_residuals = call_steps.attention_operands(config, kind, named)
        assert call_steps.named_operands(config, kind, back, back_residuals or None) == named
        assert set(back_residuals) == (set(RESIDUALS) if kind == BWD else set())
        found[xp] = named
    _same(found[np], found[jnp])


@pytest.mark.parametrize("case", ["padding", "packed"])
def test_value_guards_clamp_alike_on_numpy_and_under_jit(case):
    config, operands, _ = _call(case)
    clamped = call_steps.guard_values(config, operands, np, check_values=False)
    assert clamped is not operands
    names = tuple(call_steps.values.present(operands))
    traced = _jitted(operands, lambda ops: {n: getattr(call_steps.guard_values(
        config, ops, jnp, check_values=False, check_later=lambda check, arrays: None), n) for n in names})
    _same({n: getattr(clamped, n) for n in names}, traced)
    if case == "padding":
        np.testing.assert_array_equal(clamped.q_seqlen, [8, 8])
        np.testing.assert_array_equal(clamped.kv_seqlen, [0, 5])


def test_the_checked_mode_reads_device_values_now_or_defers_traced_ones():
    config, operands, _ = _call("padding")
    with pytest.raises(ValueError, match=r"q_seqlen: row 1 is 99, outside \[0, 8\]"):
        call_steps.guard_values(config, operands, np, check_values=True)       # a device front: read now
    with pytest.raises(ValueError, match=r"q_seqlen: row 1 is 99"):           # concrete JAX values: checked now
        call_steps.guard_values(config, _on_jax(operands), jnp, check_values=False, check_later=print)
    deferred = []

    def later(check, arrays):
        deferred.append((check, arrays))

    _jitted(operands, lambda ops: call_steps.guard_values(config, ops, jnp, check_values=True,
                                                          check_later=later).q_seqlen)
    (check, arrays), = deferred
    assert len(arrays) == 2
    with pytest.raises(ValueError, match=r"q_seqlen: row 1 is 99"):
        check(operands.q_seqlen, operands.kv_seqlen)
    with pytest.raises(ValueError, match="check_values: must be True, False or None"):
        call_steps.guard_values(config, operands, np, check_values="yes")


def _echo(xp, seen: list):
    """A stand-in kernel: records the arrays it is launched on; its results are made of them (the output of Q,
    the logsumexp of the lengths' sum, the gradients of Q, K, V and the bias)."""
    def launch(config, named):
        seen.append((config, dict(named)))
        shapes = CallSpec.of(config, BWD if "grad_output" in named else FWD).result_shapes()
        made = {"output": named["query"] * 2, "dq": named["query"] + 1, "dk": named["key"] + 2,
                "dv": named["value"] + 3, "dbias": named.get("bias")}
        return {name: made[name] if name in made else
                xp.full(shape, float(config.q_len), dtype) for name, (shape, dtype) in shapes.items()}
    return launch


@pytest.mark.parametrize("kind", [FWD, BWD])
@pytest.mark.parametrize("case", ["plain", "odd bias", "single row", "odd bias, lengths", "odd bias, device seed"])
def test_the_padded_run_gives_the_kernel_the_same_operands_on_numpy_and_jax(case, kind):
    config, operands, residuals = _call(case)
    results, launched = {}, {}
    for xp, ops, res in ((np, operands, residuals),
                         (jnp, _on_jax(operands), {n: jnp.asarray(x) for n, x in residuals.items()})):
        seen = []
        named = call_steps.named_operands(config, kind, ops, res if kind == BWD else None)
        results[xp] = call_steps.run_padded(kind, config, named, xp, _echo(xp, seen))
        (launched_config, launched[xp]), = seen
    _same(launched[np], launched[jnp])
    _same(results[np], results[jnp])
    assert (launched_config != config) == (case != "plain")              # the odd and single-row cases run padded
    expected = CallSpec.of(config, kind).result_shapes()
    assert {name: x.shape for name, x in results[np].items() if x is not None} == \
        {name: shape for name, (shape, _) in expected.items() if name in results[np] and results[np][name] is not None}
    if kind == FWD:
        np.testing.assert_array_equal(results[np]["output"], operands.query * 2)     # the padded rows sliced away
    else:
        np.testing.assert_array_equal(results[np]["dk"], operands.key + 2)
    if config.device_seed:                                                # the seed reaches the padded kernel
        np.testing.assert_array_equal(launched[np]["dropout_seed"], operands.dropout_seed)


def _spy(monkeypatch) -> list:
    walked = []
    for name in ("guard_values", "dense_bias", "run_padded", "named_operands"):
        step = getattr(call_steps, name)

        def spied(*args, step=step, name=name, **kwargs):
            walked.append(name)
            return step(*args, **kwargs)

        monkeypatch.setattr(call_steps, name, spied)
    return walked


def test_a_jitted_jax_call_and_a_cupy_call_walk_the_same_steps(monkeypatch, gpu):  # noqa: F811
    """The JAX bridge's call under ``jit`` and the CuPy front's (its validation on the device, then its prepared
    call, on the stand-in GPU) run the same step functions."""
    config, operands, _ = _call("odd bias, lengths")
    walked = _spy(monkeypatch)
    monkeypatch.delenv(settings.CHECK_VALUES, raising=False)
    _jitted(operands, lambda ops: api.configured_attention(config, ops, api.call_options(config)).output)
    jax_steps = set(walked)
    walked.clear()
    _, extra = CASES["odd bias, lengths"]
    on_device = {name: array(x, x.dtype) for name, x in
                 (("query", operands.query), ("key", operands.key), ("value", operands.value),
                  ("bias", extra["bias"]), ("q_seqlen", extra["q_seqlen"]), ("kv_seqlen", extra["kv_seqlen"]))}
    static = {name: value for name, value in extra.items() if name not in on_device}
    cupy_config, cupy_operands = cupy_front._validate_on_device(on_device, static)
    assert cupy_config == config
    prepared.PreparedCall(cupy_config, FWD, 0).run(call_steps.named_operands(cupy_config, FWD, cupy_operands))
    assert jax_steps == set(walked) == {"guard_values", "dense_bias", "run_padded", "named_operands"}


def test_the_bias_reaches_the_kernel_dense_in_the_io_dtype_on_numpy_and_jax():
    config, operands, _ = _call("odd bias")
    assert call_steps.dense_bias(operands, np) is operands              # already dense, float16: unchanged
    wide = np.asfortranarray(np.random.default_rng(3).standard_normal(operands.bias.shape).astype(np.float32))
    for xp, bias in ((np, wide), (np, wide.astype(np.float16, order="F")), (jnp, jnp.asarray(wide))):
        ops = operands.replace(bias=bias) if xp is np else _on_jax(operands).replace(bias=bias)
        dense = call_steps.dense_bias(ops, xp).bias
        assert dense.dtype == np.float16 and dense.shape == operands.bias.shape, xp.__name__
        if xp is np:
            assert dense.flags.c_contiguous
        np.testing.assert_array_equal(np.asarray(dense), wide.astype(np.float16))
    on_jax = _on_jax(operands)
    assert call_steps.dense_bias(on_jax, jnp) is on_jax
