"""The replay policy of :mod:`cudnn_attn.replay` on CPU, with the CUDA runtime replaced by a recorder (the GPU
tier checks replayed results against launched ones: tests/gpu/test_api_gpu.py)."""

from __future__ import annotations

import collections
import gc

import pytest

from cudnn_attn import replay


class FakeRuntime:
    streamCaptureModeThreadLocal = 1

    def __init__(self, fail_capture: bool = False):
        self.events, self.fail_capture, self._next = [], fail_capture, 100

    def streamBeginCapture(self, stream, mode):
        self.events.append(("begin", stream, mode))

    def streamEndCapture(self, stream):
        self.events.append(("end", stream))
        return 7

    def graphInstantiate(self, graph):
        if self.fail_capture:
            raise RuntimeError("cudaErrorStreamCaptureUnsupported")
        self._next += 1
        self.events.append(("instantiate", self._next))
        return self._next

    def graphDestroy(self, graph):
        self.events.append(("destroy graph", graph))

    def graphExecDestroy(self, executable):
        self.events.append(("destroy", executable))

    def graphLaunch(self, executable, stream):
        self.events.append(("launch", executable, stream))


@pytest.fixture
def fake(monkeypatch):
    runtime = FakeRuntime()
    capturing = set()
    monkeypatch.setattr(replay, "_runtime", lambda: runtime)
    monkeypatch.setattr(replay, "_graph_launch", runtime.graphLaunch)
    monkeypatch.setattr(replay, "_capturing", lambda stream: stream in capturing)
    monkeypatch.setattr(replay, "_live", collections.Counter())
    monkeypatch.setattr(replay, "_churn", collections.Counter())
    runtime.capturing = capturing
    yield runtime
    gc.collect()                        # the test's graphs are destroyed against its own count


def _replays(fake, launches, device=0):
    bound = []

    def raw(addresses, workspace):
        launches.append((tuple(addresses), workspace, bound[-1] if bound else None))

    return replay.Replays(raw, bound.append, lambda: 99, device)


def test_first_call_launches_second_captures_third_replays(fake):
    launches = []
    replays = _replays(fake, launches)
    assert not replays.launch([1, 2, 3], 50, stream=5)                 # first sight: the caller launches
    assert launches == [] and len(replays) == 0
    assert replays.launch([1, 2, 3], 50, stream=5)                     # second: captured on the side stream
    assert launches == [((1, 2, 3), 50, 99)]
    assert fake.events[0] == ("begin", 99, 1) and ("launch", 101, 5) in fake.events
    assert replays.launch([1, 2, 3], 50, stream=6)                     # third: replayed, no cuDNN call
    assert len(launches) == 1 and fake.events[-1] == ("launch", 101, 6)
    assert (replays.captures, replays.replays) == (1, 1)


def test_any_changed_address_is_a_different_launch(fake):
    launches = []
    replays = _replays(fake, launches)
    for _ in range(2):
        replays.launch([1, 2, 3], 50, stream=5)
    assert not replays.launch([1, 2, 4], 50, stream=5)                 # another result buffer
    assert not replays.launch([1, 2, 3], 51, stream=5)                 # another workspace
    assert len(replays) == 1


def test_no_replay_or_capture_into_a_stream_being_captured(fake):
    launches = []
    replays = _replays(fake, launches)
    fake.capturing.add(5)
    for _ in range(3):
        assert not replays.launch([1, 2, 3], 50, stream=5)
    assert launches == [] and len(replays) == 0
    fake.capturing.clear()
    assert replays.launch([1, 2, 3], 50, stream=5)
    fake.capturing.add(5)
    assert not replays.launch([1, 2, 3], 50, stream=5)                 # a graph exists, but the stream records


def test_capacity_destroys_the_least_recently_used(fake, monkeypatch):
    monkeypatch.setattr(replay, "CAPACITY", 2)
    launches = []
    replays = _replays(fake, launches)
    for address in (1, 2, 3):
        for _ in range(3):
            replays.launch([address], 0, stream=5)
    assert len(replays) == 2 and ("destroy", 101) in fake.events


def test_addresses_cycling_beyond_capacity_stop_capturing(fake, monkeypatch):
    monkeypatch.setattr(replay, "CAPACITY", 2)
    monkeypatch.setattr(replay, "PATIENCE", 4)
    launches = []
    replays = _replays(fake, launches)
    for _ in range(6):                         # five address sets in a cycle, two graphs: every capture is wasted
        for address in range(5):
            replays.launch([address], 0, stream=5)
    assert not replays.enabled and replays.captures == 4


def test_a_failed_capture_turns_replay_off(fake, caplog):
    fake.fail_capture = True
    launches = []
    replays = _replays(fake, launches)
    replays.launch([1], 0, stream=5)
    assert not replays.launch([1], 0, stream=5)
    assert not replays.enabled and ("end", 99) in fake.events and "capturing a launch" in caplog.text


def test_clear_destroys_every_graph(fake):
    replays = _replays(fake, [])
    for address in (1, 2):
        for _ in range(2):
            replays.launch([address], 0, stream=5)
    replays.clear()
    assert len(replays) == 0 and {("destroy", 101), ("destroy", 102)} <= set(fake.events)


def test_the_device_bound_holds_over_all_plans(fake, monkeypatch):
    """At DEVICE_CAPACITY graphs on a device, a plan with graphs replaces its own least recently used one, a
    plan without any captures nothing (and launches itself), another device is not affected, and graphs
    destroyed with their plan free the bound."""
    monkeypatch.setattr(replay, "DEVICE_CAPACITY", 3)
    first, second, other = (_replays(fake, [], device) for device in (0, 0, 1))

    def twice(replays, address):
        return [replays.launch([address], 0, stream=5) for _ in range(2)][-1]

    assert all(twice(first, address) for address in (1, 2, 3))
    assert replay.live_graphs() == {0: 3}
    assert not twice(second, 9) and len(second) == 0               # no graph of its own to give up
    assert twice(first, 4) and len(first) == 3 and ("destroy", 101) in fake.events
    assert twice(other, 9) and replay.live_graphs() == {0: 3, 1: 1}
    del first
    gc.collect()
    assert replay.live_graphs() == {1: 1}
    assert second.launch([9], 0, stream=5) and len(second) == 1     # seen before: captured now
    second.clear()
    other.disable()
    assert replay.live_graphs() == {}
    assert replay.churn() == (6, 6)            # first: 4 (one replaced), second 1, other 1


def test_the_legacy_default_stream_is_never_asked_whether_it_is_captured(fake, monkeypatch):
    """Streams 0 and 1 (cudaStreamLegacy) cannot be captured: no capture-status query for them."""
    asked = []
    monkeypatch.setattr(replay, "_capturing", lambda stream: asked.append(stream) or False)
    replays = _replays(fake, [])
    for stream in (0, 0, 0, 1, 7, 7, 7):
        replays.launch([1], 0, stream=stream)
    assert asked == [7, 7, 7] and replays.replays == 5         # graphs are keyed by addresses, not streams
