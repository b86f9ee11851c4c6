"""The call plan (:mod:`cudnn_attn.engine.plan`) against its own interface, with a stand-in launch
(``tests/stand_in_gpu.py``): which tensors it binds in which order, that a built graph which reads other tensors
than its call binds is refused, the one launch sequence (device lock, thread context, workspace, stream, zero-fill,
host scalars, replay), the warm-up once, and the bytes each declared input spans."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import types

import pytest

from cudnn_attn.core import settings
from cudnn_attn.core.config import AttentionConfig, StaticMask
from cudnn_attn.engine import plan as call_plan
from cudnn_attn.engine.call import CallSpec, Fill
from cudnn_attn.graphs.tensors import TensorId

import stand_in_gpu


def _plan(monkeypatch, config, kind, ids, **built):
    monkeypatch.setattr(call_plan, "Launcher", stand_in_gpu.Launcher)
    return call_plan.CallPlan(stand_in_gpu.built_graph(config, kind, ids, **built), stand_in_gpu.Context())


CONFIG = AttentionConfig(batch=1, q_heads=2, kv_heads=2, q_len=8, kv_len=8, qk_dim=16, v_dim=16, dtype="float16")


def test_a_built_graph_that_reads_other_tensors_than_its_call_binds_is_refused(monkeypatch):
    with pytest.raises(RuntimeError, match=r"reads \['Q', 'K', 'V', 'BIAS'\].*its call binds \['Q', 'K', 'V'\]"):
        _plan(monkeypatch, CONFIG, "fwd", (TensorId.Q, TensorId.K, TensorId.V, TensorId.BIAS, TensorId.O))
    with pytest.raises(RuntimeError, match=r"lacks the results \['O'\]"):
        _plan(monkeypatch, CONFIG, "fwd", (TensorId.Q, TensorId.K, TensorId.V))


def test_the_plan_is_the_calls_spec_on_one_device(monkeypatch):
    plan = _plan(monkeypatch, CONFIG, "fwd", None)
    assert plan.spec is CallSpec.of(CONFIG, "fwd") and plan.device == 0
    assert plan.operand_ids == plan.spec.graph_operands and plan.scalar_ids == ()
    assert [s.name for s in plan.results] == ["output"] and plan.workspace_size == 256
    assert "fwd" in repr(plan) and "plan=eng0" in plan.describe()


def test_an_autotuned_plan_index_takes_that_plans_workspace(monkeypatch):
    plans = (types.SimpleNamespace(index=0, workspace_size=256), types.SimpleNamespace(index=3, workspace_size=4096))
    monkeypatch.setattr(call_plan, "Launcher", stand_in_gpu.Launcher)
    built = stand_in_gpu.built_graph(CONFIG, "fwd", plans=plans)
    assert call_plan.CallPlan(built, stand_in_gpu.Context(), plan_index=3).workspace_size == 4096
    assert call_plan.CallPlan(built, stand_in_gpu.Context()).workspace_size == 256


def test_a_sequence_fixes_its_scalars_and_a_call_may_give_others(monkeypatch):
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay=False))
    dropout = dataclasses.replace(CONFIG, dropout_rate=0.1, training=True)
    plan = _plan(monkeypatch, dropout, "fwd", None)
    seeds = []
    plan.launcher.kernel = lambda bound: seeds.append(ctypes.c_int64.from_address(bound[TensorId.SEED]).value)
    run = plan.sequence((11, 0))
    run([1, 2, 3, 4, 5], 0)
    run([1, 2, 3, 4, 5], 0, scalars=(12, 0))
    assert seeds == [11, 12]             # the plan's scalar buffer holds each launch's value when cuDNN reads it
    assert plan.context.streams == [0, 0] == [s for s, _ in plan.context.workspaces]   # stream 0 stays bound


def test_a_given_workspace_is_used_and_none_is_taken_from_the_context(monkeypatch):
    plan = _plan(monkeypatch, CONFIG, "fwd", None, workspace_size=0)
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay=False))
    plan.launch([1, 2, 3, 4], 0x55)
    plan.launch([1, 2, 3, 4], 0x55, workspace=0x77)
    assert [w for _, w in plan.launcher.calls] == [0, 0x77] and plan.context.workspaces == []


def test_warm_up_launches_once_on_scratch_and_survives_no_memory(monkeypatch, caplog):
    plan = _plan(monkeypatch, CONFIG, "fwd", None)
    scratch = []
    monkeypatch.setattr(plan, "_launch_on_scratch", lambda: scratch.append(1))
    plan.warm_up()
    plan.warm_up()
    assert scratch == [1]

    class OutOfMemoryError(Exception):
        pass

    short = _plan(monkeypatch, CONFIG, "fwd", None)
    monkeypatch.setattr(short, "_launch_on_scratch", lambda: (_ for _ in ()).throw(OutOfMemoryError("2 GiB")))
    with caplog.at_level(logging.WARNING, logger="cudnn_attn"):
        short.warm_up()
    assert "no scratch memory to warm up" in caplog.text and short._warm
    failing = _plan(monkeypatch, CONFIG, "fwd", None)
    monkeypatch.setattr(failing, "_launch_on_scratch", lambda: (_ for _ in ()).throw(RuntimeError("cuDNN")))
    with pytest.raises(RuntimeError, match="cuDNN"):
        failing.warm_up()
    assert not failing._warm


def test_the_bytes_of_each_declared_buffer_cover_every_element(monkeypatch):
    """``scratch`` sizes its buffers from the declared tensors: dense Q/K/V/O, int32 lengths, the results."""
    padded = dataclasses.replace(CONFIG, batch=3, mask=StaticMask(padding=True), training=True)
    plan = _plan(monkeypatch, padded, "fwd", None)
    sizes = dict(zip(plan.operand_ids + tuple(s.tid for s in plan.results), plan._byte_sizes()))
    q = 3 * 8 * 2 * 16 * 2
    assert sizes[TensorId.Q] == sizes[TensorId.K] == sizes[TensorId.V] == sizes[TensorId.O] == q
    assert sizes[TensorId.SEQ_LEN_Q] == sizes[TensorId.SEQ_LEN_KV] == 3 * 4
    assert sizes[TensorId.STATS] == 3 * 2 * 8 * 4
    assert [s.fill for s in plan.results] == [Fill.ZERO_BEFORE, Fill.ROWS_AFTER]


def test_launch_binds_operands_results_and_host_scalars_by_id(monkeypatch):
    config = AttentionConfig(batch=1, q_heads=2, kv_heads=2, q_len=8, kv_len=8, qk_dim=16, v_dim=16,
                             dtype="float16", dropout_rate=0.1, training=True)
    plan = _plan(monkeypatch, config, "fwd", (TensorId.Q, TensorId.K, TensorId.V, TensorId.O, TensorId.STATS,
                                              TensorId.SEED, TensorId.OFFSET))
    assert plan.operand_ids == (TensorId.Q, TensorId.K, TensorId.V)
    assert [s.tid for s in plan.results] == [TensorId.O, TensorId.STATS]
    assert plan.scalar_ids == (TensorId.SEED, TensorId.OFFSET)
    plan.launch([1, 2, 3, 4, 5], stream=0x55, scalars=CallSpec.of(config, 'fwd').host_scalars(1234))
    (bound, workspace), = plan.launcher.calls
    assert {t: bound[t] for t in plan.operand_ids + (TensorId.O, TensorId.STATS)} == {
        TensorId.Q: 1, TensorId.K: 2, TensorId.V: 3, TensorId.O: 4, TensorId.STATS: 5}
    assert ctypes.c_int64.from_address(bound[TensorId.SEED]).value == 1234 and workspace == 0xAAAA
    assert plan.context.workspaces == [(0x55, 256)]
    assert plan.context.streams == [0x55, 0]          # back to the default stream: 0x55 may be destroyed later
    plan.launch([1, 2, 3, 4, 5], stream=0x66, scalars=(7, 0), keep_stream=True)     # XLA's streams stay bound
    assert plan.context.streams == [0x55, 0, 0x66]


def test_launch_zeroes_before_what_the_policy_says(monkeypatch):
    config = AttentionConfig(batch=2, q_heads=2, kv_heads=2, q_len=8, kv_len=8, qk_dim=16, v_dim=16,
                             dtype="float16", training=True, mask=StaticMask(padding=True))
    zeroed = []
    monkeypatch.setattr(call_plan, "_memset_zero", lambda pointers, which, stream: zeroed.append(
        [(pointers[i], n) for i, n in which]))
    plan = _plan(monkeypatch, config, "bwd", (TensorId.Q, TensorId.K, TensorId.V, TensorId.O, TensorId.DO,
                                              TensorId.STATS, TensorId.SEQ_LEN_Q, TensorId.SEQ_LEN_KV,
                                              TensorId.DQ, TensorId.DK, TensorId.DV))
    pointers = list(range(100, 100 + len(plan.operand_ids) + len(plan.results)))
    plan.launch(pointers, stream=1, workspace=0x10)
    nbytes = 2 * 8 * 2 * 16 * 2
    assert zeroed == [[(pointers[-3], nbytes), (pointers[-2], nbytes), (pointers[-1], nbytes)]]   # dq, dk, dv
    assert plan.launcher.calls[0][1] == 0x10 and plan.context.workspaces == []



def test_the_direct_sequence_launches_then_captures_then_replays(monkeypatch):
    """``CallPlan.launch`` (the CuPy direct path; the JAX handler runs its own ``sequence``): a first
    sighting of the addresses launches through cuDNN on the caller's stream, the second captures that launch
    on the context's private stream and launches the graph, later ones only launch the graph - no handle
    stream change, no cuDNN call."""
    from cudnn_attn.engine import replay

    graph_launches = []
    runtime_calls = types.SimpleNamespace(
        streamCaptureModeThreadLocal=1, streamBeginCapture=lambda stream, mode: None,
        streamEndCapture=lambda stream: 0x6, graphInstantiate=lambda graph: 0xE0, graphDestroy=lambda graph: None,
        graphExecDestroy=lambda executable: None)
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay=True))
    monkeypatch.setattr(replay, "_runtime", lambda: runtime_calls)
    monkeypatch.setattr(replay, "_graph_launch", lambda executable, stream: graph_launches.append((executable, stream)))
    monkeypatch.setattr(replay, "_capturing", lambda stream: False)
    config = AttentionConfig(batch=1, q_heads=2, kv_heads=2, q_len=8, kv_len=8, qk_dim=16, v_dim=16, dtype="float16")
    plan = _plan(monkeypatch, config, "fwd", (TensorId.Q, TensorId.K, TensorId.V, TensorId.O))
    pointers = [1, 2, 3, 4]
    plan.launch(pointers, 0x55)
    assert len(plan.launcher.calls) == 1 and plan.context.streams == [0x55, 0] and graph_launches == []
    plan.launch(pointers, 0x55)                                      # captured on 0xCA, launched on 0x55
    assert len(plan.launcher.calls) == 2 and plan.context.streams == [0x55, 0, 0xCA]
    assert graph_launches == [(0xE0, 0x55)]
    plan.launch(pointers, 0x66)                                      # replayed: nothing but the graph launch
    assert len(plan.launcher.calls) == 2 and plan.context.streams == [0x55, 0, 0xCA]
    assert graph_launches == [(0xE0, 0x55), (0xE0, 0x66)]
    (replays,) = plan.replays
    assert (replays.captures, replays.replays) == (1, 1)
    plan.launch([1, 2, 3, 5], 0x55)                                  # another output: cuDNN again
    assert len(plan.launcher.calls) == 3 and plan.context.streams[-2:] == [0x55, 0]


def test_a_launch_on_a_thread_without_a_cuda_context_adopts_the_device_context_and_gives_it_back(monkeypatch):
    """XLA calls the handler on threads with no CUDA context current, where cudnnSetStream's driver queries fail
    (two soaks died inside it). Both launch routes make the device's context current first and unbind it
    afterwards - also when the launch raises - and leave a thread that had a context alone."""

    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay=False))
    config = AttentionConfig(batch=1, q_heads=2, kv_heads=2, q_len=8, kv_len=8, qk_dim=16, v_dim=16, dtype="float16")
    dropout = AttentionConfig(batch=1, q_heads=2, kv_heads=2, q_len=8, kv_len=8, qk_dim=16, v_dim=16,
                              dtype="float16", dropout_rate=0.1, training=True)
    raw = _plan(monkeypatch, config, "fwd", (TensorId.Q, TensorId.K, TensorId.V, TensorId.O))
    scalars = _plan(monkeypatch, dropout, "fwd", (TensorId.Q, TensorId.K, TensorId.V, TensorId.O, TensorId.STATS,
                                                  TensorId.SEED, TensorId.OFFSET))
    launches = {"raw sequence": lambda: raw.launch([1, 2, 3, 4], 0x55),
                "launch": lambda: scalars.launch([1, 2, 3, 4, 5], 0x55, scalars=(1, 0))}
    for name, launch in launches.items():
        context = (raw if name == "raw sequence" else scalars).context
        context.has_cuda_context = False
        launch()
        assert context.threads == ["adopt", "release"] and not context.has_cuda_context, name
        context.threads.clear()
        context.has_cuda_context = True
        launch()
        assert context.threads == ["had one"] and context.has_cuda_context, name
    failing = scalars.context
    failing.threads.clear()
    failing.has_cuda_context = False

    class Refusing:                                # a launcher without a raw path, whose launch fails
        def bound(self, context):
            return None

        def __call__(self, addresses, workspace, handle):
            raise RuntimeError("cuDNN refused")

    scalars.launcher = Refusing()
    scalars._launches.clear()                     # a sequence binds the launcher when it is made
    with pytest.raises(RuntimeError, match="cuDNN refused"):
        scalars.launch([1, 2, 3, 4, 5], 0x55, scalars=(1, 0))
    assert failing.threads == ["adopt", "release"] and not failing.has_cuda_context



def test_no_replay_when_switched_off(monkeypatch):

    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay=False))
    config = AttentionConfig(batch=1, q_heads=2, kv_heads=2, q_len=8, kv_len=8, qk_dim=16, v_dim=16, dtype="float16")
    plan = _plan(monkeypatch, config, "fwd", (TensorId.Q, TensorId.K, TensorId.V, TensorId.O))
    for _ in range(4):
        plan.launch([1, 2, 3, 4], 0x55)
    assert len(plan.launcher.calls) == 4 and len(plan.replays) == 0


def test_a_dropped_sequence_takes_its_graphs_along(monkeypatch):
    """Each JAX call site launches through its own sequence of the shared plan; when the site is dropped (its
    executables died), its graphs go with it although the plan stays cached."""
    import gc

    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay=True))
    config = AttentionConfig(batch=1, q_heads=2, kv_heads=2, q_len=8, kv_len=8, qk_dim=16, v_dim=16, dtype="float16")
    plan = _plan(monkeypatch, config, "fwd", (TensorId.Q, TensorId.K, TensorId.V, TensorId.O))
    sites = [plan.sequence((), keep_stream=True) for _ in range(3)]
    assert len(plan.replays) == 3
    del sites
    gc.collect()
    assert len(plan.replays) == 0
