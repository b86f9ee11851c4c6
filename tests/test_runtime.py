"""Device contexts without a GPU: one per device for the whole process, made once under many
threads, never made on the execution path, closed at release; the call plan's launch under the lock."""

from __future__ import annotations

import ctypes
import dataclasses
import sys
import threading
import types

import pytest

from cudnn_attn.core import settings
from cudnn_attn.core.config import AttentionConfig, MaskSpec
from cudnn_attn.engine import plan as call_plan
from cudnn_attn.engine import runtime
from cudnn_attn.engine.call import CallSpec
from cudnn_attn.graphs.tensors import TensorId


class _FakeContext:
    made: list[int] = []

    def __init__(self, device):
        self.device = device
        self.lock = threading.Lock()
        self.closed = False
        _FakeContext.made.append(device)

    def close(self):
        self.closed = True


@pytest.fixture
def fake_contexts(monkeypatch):
    _FakeContext.made = []
    monkeypatch.setattr(runtime, "DeviceContext", _FakeContext)
    monkeypatch.setattr(runtime, "require_gpu", lambda: None)
    monkeypatch.setattr(runtime, "_contexts", {})
    monkeypatch.setattr(runtime, "_release_hooks", [])
    return _FakeContext.made


def test_one_context_per_device_across_many_short_lived_threads(fake_contexts):
    seen = []

    def use(device):
        seen.append(runtime.device_context(device))

    for _ in range(8):                          # 8 rounds of 16 short-lived threads on 2 devices
        threads = [threading.Thread(target=use, args=(i % 2,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(fake_contexts) == [0, 1]      # two handles for 128 threads, not one per thread
    assert len({id(c) for c in seen}) == 2 and sorted(runtime._contexts) == [0, 1]


def test_the_execution_path_never_creates_a_context(fake_contexts):
    with pytest.raises(RuntimeError, match="no cuDNN context was prepared for GPU 3.*never while XLA executes"):
        runtime.device_context(3, create=False)
    assert fake_contexts == []
    made = runtime.device_context(3)
    assert runtime.device_context(3, create=False) is made


def test_release_runs_hooks_then_closes_every_context(fake_contexts):
    order = []
    runtime.on_release(lambda: order.append("first registered"))
    runtime.on_release(lambda: order.append("last registered"))
    contexts = [runtime.device_context(d) for d in (0, 1)]
    runtime.release()
    assert order == ["last registered", "first registered"]
    assert all(c.closed for c in contexts) and not runtime._contexts


# -- the call plan's launch ------------------------------------------------------------------------------

class _Context:
    def __init__(self):
        self.device = 0
        self.lock = threading.Lock()
        self.handle = types.SimpleNamespace(backend_handle=7)
        self.streams, self.workspaces = [], []
        self.has_cuda_context, self.threads = True, []      # whether this thread has a CUDA context current

    def adopt_thread(self):
        assert self.lock.locked(), "made current for the launch, under the device lock"
        self.threads.append("adopt" if not self.has_cuda_context else "had one")
        adopted, self.has_cuda_context = not self.has_cuda_context, True
        return adopted

    def release_thread(self):
        assert self.lock.locked()
        self.threads.append("release")
        self.has_cuda_context = False

    def bind_stream(self, stream):
        assert self.lock.locked(), "the handle is pointed at a stream under the device lock"
        self.streams.append(stream)

    def workspace(self, stream, nbytes):
        assert self.lock.locked()
        self.workspaces.append((stream, nbytes))
        return 0xAAAA

    def capture_stream(self):
        assert self.lock.locked()
        return 0xCA


class _Launcher:
    def __init__(self, built, ids, plan_index=None):
        self.ids, self.calls = ids, []

    def __call__(self, addresses, workspace, handle):
        self.calls.append((dict(zip(self.ids, addresses)), workspace))

    def bound(self, context):                # the raw path: the caller holds the device lock
        def raw(addresses, workspace):
            assert context.lock.locked()
            self.calls.append((dict(zip(self.ids, addresses)), workspace))
        return raw


def _plan(monkeypatch, config, kind, ids):
    monkeypatch.setattr(call_plan, "Launcher", _Launcher)
    built = types.SimpleNamespace(config=config, kind=kind, uids={t: int(t) for t in ids}, workspace_size=256,
                                  plans=(), plan_name="eng0")
    return call_plan.CallPlan(built, _Context())


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
                             dtype="float16", training=True, mask=MaskSpec(padding=True))
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


class _FakeHandle:
    def __init__(self, backend_handle, ordinal=None, stream=None):
        self.backend_handle, self.ordinal, self.stream = backend_handle, ordinal, stream


def _fake_cudnn(monkeypatch, *, backend: bool = True, handle_type=_FakeHandle):
    """A stand-in ``cudnn`` module recording what :func:`runtime.create_handle` asks of it."""
    calls = []
    fake = types.ModuleType("cudnn")
    fake.Handle = handle_type
    fake.create_handle = lambda: calls.append("create_handle") or _FakeHandle(7, "looked up", 0)
    fake.destroy_handle = lambda handle: calls.append(("destroyed", handle.backend_handle))
    if backend:
        fake._pybind_module = types.SimpleNamespace(
            create_handle=lambda: calls.append("raw") or 1234, get_stream=lambda raw: 0)
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    return calls


def test_create_handle_wraps_the_backend_handle_with_the_known_device(monkeypatch):
    calls = _fake_cudnn(monkeypatch)
    handle = runtime.create_handle(3)
    assert (handle.backend_handle, handle.ordinal, handle.stream) == (1234, 3, 0)
    assert calls == ["raw"]                      # cudnn.create_handle (and its device lookup) never ran


def test_create_handle_falls_back_to_the_frontend(monkeypatch):
    calls = _fake_cudnn(monkeypatch, backend=False)
    assert runtime.create_handle(0).ordinal == "looked up" and calls == ["create_handle"]

    def another_signature(self, backend_handle):
        self.backend_handle = backend_handle

    calls = _fake_cudnn(monkeypatch, handle_type=type("Other", (), {"__init__": another_signature}))
    assert runtime.create_handle(0).ordinal == "looked up"
    assert calls == ["create_handle"]                       # no raw handle made for a Handle that cannot take it

    def refuse_a_stream(self, backend_handle, ordinal=None, stream=None):
        if stream is not None:
            raise TypeError("no stream")
        self.backend_handle = backend_handle

    calls = _fake_cudnn(monkeypatch, handle_type=type("Refusing", (), {"__init__": refuse_a_stream}))
    assert runtime.create_handle(0).ordinal == "looked up"
    assert calls == ["raw", ("destroyed", 1234), "create_handle"]   # destroyed through cudnn.destroy_handle


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


def test_device_context_makes_its_cuda_context_current_only_where_none_is():
    """``DeviceContext.adopt_thread`` against the driver's current-context calls (faked: no GPU here)."""
    current = {"context": 0}
    context = object.__new__(runtime.DeviceContext)
    context.cuda_context = 0xC0
    context._get_current = lambda: current["context"]
    context._set_current = lambda value: current.update(context=value)
    assert context.adopt_thread() is True and current["context"] == 0xC0
    context.release_thread()
    assert current["context"] == 0
    current["context"] = 0xD1                       # a thread with a context (another device's, even): untouched
    assert context.adopt_thread() is False and current["context"] == 0xD1


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
