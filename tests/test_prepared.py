"""The prepared call (:mod:`cudnn_attn.engine.prepared`) against its own interface, on a stand-in GPU
(``tests/stand_in_gpu.py``: NumPy arrays with device addresses, a real :class:`~cudnn_attn.engine.plan.CallPlan`
whose launch runs a Python kernel over the memory at the launch's addresses).  The kernel writes what cuDNN
writes: ``2 * Q`` as the output of the rows of each sequence and a non-finite logsumexp in padded rows, nothing
else; result buffers start as NaN.  So each test sees what the prepared call itself adds: the binding, the value
guards, the zero-fill before and after the launch, the padded run, the given buffers, the direct launch, and the
table of repeated calls with its validation memo."""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest

from cudnn_attn.core import settings
from cudnn_attn.core.types import MaskType
from cudnn_attn.core.validation import validate_call
from cudnn_attn.engine import cache, call_steps, prepared, runtime
from cudnn_attn.engine import plan as call_plan
from cudnn_attn.engine.call import FWD
from cudnn_attn.graphs.tensors import TensorId

import stand_in_gpu
from stand_in_gpu import STREAM, array, view

B, T, N, H = 2, 8, 2, 16


class StandIn:
    """The stand-in GPU of one test: its plans by (configuration, kind), and what their launches saw."""

    def __init__(self):
        self.plans, self.asked, self.seen_lengths = {}, [], []

    def plan_for(self, config, kind, device, autotune=None, rng_dump=False, tune_on=None):
        self.asked.append(config)
        plan = self.plans.get((config, kind))
        if plan is None:
            plan = call_plan.CallPlan(stand_in_gpu.built_graph(config, kind), stand_in_gpu.Context(device))
            plan.launcher.kernel = lambda bound, plan=plan: self.kernel(plan.config, bound)
            self.plans[(config, kind)] = plan
        return plan

    def kernel(self, config, bound):
        """cuDNN's forward as far as these tests read it (the module doc)."""
        q = view(bound[TensorId.Q], config.q_shape, np.float16)
        o = view(bound[TensorId.O], config.o_shape, np.float16)
        lengths = view(bound[TensorId.SEQ_LEN_Q], (config.batch,), np.int32).copy() \
            if TensorId.SEQ_LEN_Q in bound else np.full(config.batch, config.q_len, np.int32)
        self.seen_lengths.append(lengths.tolist())
        lse = view(bound[TensorId.STATS], config.lse_shape, np.float32) if TensorId.STATS in bound else None
        for b, n in enumerate(lengths):
            o[b, :n] = 2 * q[b, :n]
            if lse is not None:
                lse[b, :, :n], lse[b, :, n:] = 1.0, np.inf

    def launches(self):
        return [call for plan in self.plans.values() for call in plan.launcher.calls]


@pytest.fixture
def gpu(monkeypatch):
    stand_in = StandIn()
    cupy = stand_in_gpu.cupy_namespace()
    monkeypatch.setattr(runtime, "cupy", lambda: cupy)
    monkeypatch.setattr(runtime, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(runtime, "stream_scope", lambda stream, device: contextlib.nullcontext(
        STREAM if stream is None else stream))
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay=False))
    monkeypatch.setattr(call_plan, "Launcher", stand_in_gpu.Launcher)
    monkeypatch.setattr(call_plan, "_memset_zero", stand_in_gpu.memset_zero)
    monkeypatch.setattr(prepared, "plan_for", stand_in.plan_for)
    prepared.prepared_call.cache_clear()
    yield stand_in
    prepared.prepared_call.cache_clear()


def _call(seed=0, t=T, **extra):
    rng = np.random.default_rng(seed)
    q = array(rng.standard_normal((B, t, N, H)), np.float16)
    k, v = (array(rng.standard_normal((B, t, N, H)), np.float16) for _ in range(2))
    config, operands = validate_call(q, k, v, **extra, xp=np)
    return config, operands, call_steps.named_operands(config, FWD, operands)


def test_run_launches_the_callers_arrays_and_returns_the_results(gpu):
    config, operands, named = _call()
    results = prepared.PreparedCall(config, FWD, 0).run(named)
    (bound, workspace), = gpu.launches()
    assert {t: bound[t] for t in (TensorId.Q, TensorId.K, TensorId.V)} == {
        TensorId.Q: operands.query.ctypes.data, TensorId.K: operands.key.ctypes.data,
        TensorId.V: operands.value.ctypes.data}                       # Q, K and V as given: no copy
    assert list(results) == ["output"] and isinstance(results["output"], stand_in_gpu.Array)
    np.testing.assert_array_equal(results["output"], 2 * operands.query)
    plan = next(iter(gpu.plans.values()))
    assert plan.context.streams == [STREAM, 0] and plan.context.workspaces == [(STREAM, 256)]


def test_padded_rows_come_back_zero_and_lengths_are_clamped_before_the_launch(gpu):
    lengths = array([999, 3], np.int32)
    config, operands, named = _call(q_seqlen=lengths, kv_seqlen=array([T, 3], np.int32),
                                    mask_type=MaskType.PADDING, training=True)
    results = prepared.PreparedCall(config, FWD, 0).run(named)
    assert gpu.seen_lengths == [[T, 3]]                                # clamped on the device (values.sanitize)
    output, lse = results["output"], results["logsumexp"]
    np.testing.assert_array_equal(output[0], 2 * operands.query[0])
    np.testing.assert_array_equal(output[1, :3], 2 * operands.query[1, :3])
    assert np.all(output[1, 3:] == 0)                                  # zeroed before the launch, not NaN
    assert np.all(lse[1, :, :3] == 1) and np.all(lse[1, :, 3:] == 0)   # the kernel's inf set to 0 after it
    with pytest.raises(ValueError, match="q_seqlen"):
        prepared.PreparedCall(config, FWD, 0).run(named, check_values=True)
    assert len(gpu.launches()) == 1                                    # the checked mode refused before launching


def test_given_results_are_written_in_place_and_checked(gpu):
    config, operands, named = _call()
    out = array(np.full(config.o_shape, np.nan), np.float16)
    results = prepared.PreparedCall(config, FWD, 0).run(named, given={"output": out})
    assert results["output"] is out
    np.testing.assert_array_equal(out, 2 * operands.query)
    with pytest.raises(ValueError, match=r"output: a preallocated result must be a C-contiguous float16\[2, 8, 2, 16\]"):
        prepared.PreparedCall(config, FWD, 0).run(named, given={"output": array(np.zeros((B, T, N, 8)), np.float16)})


def test_odd_lengths_with_a_bias_run_padded_and_come_back_sliced(gpu):
    """Training with a bias at odd T = S: cuDNN needs even lengths, so the call runs at T = S = 8 and is sliced."""
    bias = array(np.random.default_rng(4).standard_normal((1, N, 7, 7)), np.float16)
    config, operands, named = _call(t=7, bias=bias, training=True)
    call = prepared.PreparedCall(config, FWD, 0)
    assert call.padded is not None and call.padded.q_len == 8 and not call.direct_capable
    results = call.run(named)
    assert [c.q_len for c in gpu.asked] == [8]
    assert results["output"].shape == config.o_shape and results["logsumexp"].shape == config.lse_shape
    np.testing.assert_array_equal(results["output"], 2 * operands.query)
    with pytest.raises(ValueError, match="rng_dump: a call that runs padded"):
        call.run(named, rng_dump=array(np.zeros(1), np.float32))


def test_the_direct_launch_into_given_and_caller_allocated_results(gpu):
    config, operands, named = _call()
    call = prepared.PreparedCall(config, FWD, 0)
    assert call.direct_capable and call.result_layout() == ((config.o_shape, np.dtype(np.float16)),)
    order = call.direct_order(("value", "query", "key"))
    pointers = [x.ctypes.data for x in order((operands.value, operands.query, operands.key))]
    out = array(np.full(config.o_shape, np.nan), np.float16)
    assert call.direct(list(pointers), seed=0, out=out) == [out]
    np.testing.assert_array_equal(out, 2 * operands.query)
    into = array(np.full(config.o_shape, np.nan), np.float16)
    call.launch_into(list(pointers) + [into.ctypes.data], STREAM, seed=0)
    np.testing.assert_array_equal(into, 2 * operands.query)
    with pytest.raises(ValueError, match="out: must be a C-contiguous CuPy array"):
        call.direct(list(pointers), seed=0, out=np.zeros(config.o_shape, np.float16))
    padded, _, _ = _call(q_seqlen=array([T, 3], np.int32), kv_seqlen=array([T, 3], np.int32),
                         mask_type=MaskType.PADDING)
    assert not prepared.PreparedCall(padded, FWD, 0).direct_capable     # lengths: more than the arrays and a seed


def test_launch_into_follows_its_plan_when_the_cache_rebuilds_it(gpu):
    """``launch_into`` holds its plan's launch sequence weakly, as it holds the plan: while the plan lives every
    launch runs that plan; once the graph cache drops it, the next launch runs the rebuilt one."""
    import gc

    config, operands, _ = _call()
    call = prepared.PreparedCall(config, FWD, 0)
    pointers = [x.ctypes.data for x in call.direct_order(("query", "key", "value"))(
        (operands.query, operands.key, operands.value))]
    outputs = [array(np.full(config.o_shape, np.nan), np.float16) for _ in range(3)]
    call.launch_into(pointers + [outputs[0].ctypes.data], STREAM, seed=0)
    call.launch_into(pointers + [outputs[1].ctypes.data], STREAM, seed=0)
    first = gpu.plans.pop((config, FWD))                    # evicted: the cache no longer holds it
    assert len(first.launcher.calls) == 2
    del first
    gc.collect()
    call.launch_into(pointers + [outputs[2].ctypes.data], STREAM, seed=0)
    rebuilt = gpu.plans[(config, FWD)]
    assert len(rebuilt.launcher.calls) == 1
    for out in outputs:
        np.testing.assert_array_equal(out, 2 * operands.query)


def test_the_sequence_a_front_launches_by_itself_is_its_plans_and_is_made_again_after_an_eviction(gpu):
    """``sequence()`` (what the torch front's launcher calls at each launch): the same sequence while the plan
    lives, and after the graph cache drops the plan a new one, whose launches run the rebuilt plan."""
    import gc

    config, operands, _ = _call(seed=3)
    call = prepared.PreparedCall(config, FWD, 0)
    pointers = [x.ctypes.data for x in call.direct_order(("query", "key", "value"))(
        (operands.query, operands.key, operands.value))]
    outputs = [array(np.full(config.o_shape, np.nan), np.float16) for _ in range(2)]
    first_sequence = call.sequence(False)
    assert call.sequence(False) is first_sequence
    first_sequence(pointers + [outputs[0].ctypes.data], STREAM, None, True, ())
    first = gpu.plans.pop((config, FWD))
    assert len(first.launcher.calls) == 1
    del first, first_sequence
    gc.collect()
    call.sequence(False)(pointers + [outputs[1].ctypes.data], STREAM, None, True, ())
    assert len(gpu.plans[(config, FWD)].launcher.calls) == 1
    for out in outputs:
        np.testing.assert_array_equal(out, 2 * operands.query)


def test_the_plan_choice_is_checked_when_the_call_is_prepared(gpu):
    config, _, _ = _call()
    with pytest.raises(ValueError, match="autotune: must be True, False or None"):
        prepared.PreparedCall(config, FWD, 0, autotune="yes")
    assert prepared.plan_choice(True) is cache.PlanChoice.AUTOTUNED
    with settings.override(autotune=False):
        assert prepared.plan_choice(None) is cache.PlanChoice.HEURISTIC


def test_forward_runs_the_prepared_call_of_its_configuration(gpu):
    config, operands, _ = _call(training=True)
    result = prepared.forward(config, operands)
    np.testing.assert_array_equal(result.output, 2 * operands.query)
    assert result.logsumexp.shape == config.lse_shape
    assert prepared.prepared_call(config, FWD, 0) is prepared.prepared_call(config, FWD, 0)
    with pytest.raises(ValueError, match="logsumexp: only produced when training"):
        prepared.forward(dataclasses.replace(config, training=False), operands, logsumexp=result.logsumexp)


# -- the table of repeated calls and the validation memo ------------------------------------------------------

def test_the_table_is_bounded_and_ignores_unhashable_keys():
    table = prepared.Calls(maxsize=2)
    config, _, _ = _call()
    for i in range(3):
        table.remember(("call", i), prepared.Known(config, frozenset()))
    assert len(table) == 2 and table.get(("call", 0)) is None and table.get(("call", 2)).config is config
    table.remember(("call", [1]), prepared.Known(config, frozenset()))       # a list argument: not remembered
    assert len(table) == 2 and table.get(("call", [1])) is None
    marker = object()
    table.remember(("direct",), prepared.Known(config, frozenset(), marker, order=len))
    assert table.direct_launches() == [marker]
    table.clear()
    assert len(table) == 0


def test_a_repeated_signature_reuses_its_validation(monkeypatch):
    validations = []

    def counted(*args, **kwargs):
        validations.append(kwargs.get("mask") is not None)
        return validate_call(*args, **kwargs)

    monkeypatch.setattr(prepared, "validate_call", counted)
    table = prepared.Calls()
    rng = np.random.default_rng(5)

    def arrays(**extra):
        q, k, v = (rng.standard_normal((B, T, N, H)).astype(np.float16) for _ in range(3))
        return dict(query=q, key=k, value=v, **extra)

    static = dict(scale=0.25, mask_type=MaskType.CAUSAL)
    first, second = arrays(), arrays()
    config, operands = prepared.validated(first, static, xp=np, table=table)
    again, operands_again = prepared.validated(second, static, xp=np, table=table)
    assert again is config and operands_again.query is second["query"] and len(validations) == 1
    prepared.validated(arrays(), dict(static, scale=0.5), xp=np, table=table)        # another static argument
    assert len(validations) == 2
    mask = np.ones((B, N, T, T), bool)
    for _ in range(2):                                   # a folded mask makes new operands: validated every time
        prepared.validated(arrays(mask=mask), static, xp=np, table=table)
    assert validations[2:] == [True, True]


def test_the_validation_memo_is_its_own_table_apart_from_the_calls():
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((B, T, N, H)).astype(np.float16) for _ in range(3))
    calls_before, memo_before = len(prepared.calls), len(prepared.validations)
    prepared.validated(dict(query=q, key=k, value=v), dict(scale=0.125, mask_type=MaskType.CAUSAL), xp=np)
    assert len(prepared.calls) == calls_before and len(prepared.validations) == memo_before + 1


def test_one_call_key_for_every_front_keeps_their_entries_apart():
    """The CuPy front's key reads :func:`prepared.descriptor`; another front passes its own, whose array type
    keeps its entries apart in the one table; an absent array is ``None``."""
    rng = np.random.default_rng(7)
    x = array(rng.standard_normal((B, T, N, H)).astype(np.float16), np.float16)
    key = prepared.call_key("fwd", (x, None), ("static",))
    assert key == ("fwd", prepared.descriptor(x), None, ("static",))
    assert prepared.call_key("fwd", (x, None), ("static",)) == key and hash(key) == hash(prepared.call_key(
        "fwd", (x, None), ("static",)))
    other = prepared.call_key("fwd", (x, None), ("static",), describe=lambda a: ("another front", a.shape))
    assert other != key and other[1] == ("another front", x.shape)
    assert prepared.call_key("bwd", (x, None), ("static",)) != key
