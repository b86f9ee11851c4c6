"""Device contexts without a GPU: one per device for the whole process, made once under many
threads, never made on the execution path, closed at release; the cuDNN handle of a known device.  (The call
plan's launch sequence is ``tests/test_plan.py``'s.)"""

from __future__ import annotations

import sys
import threading
import types

import pytest

from cudnn_attn.engine import runtime


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


