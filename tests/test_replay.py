"""The replay policy of :mod:`cudnn_attn.engine.replay` on CPU, with the CUDA runtime replaced by a recorder (the GPU
tier checks replayed results against launched ones: tests/gpu/test_api_gpu.py)."""

from __future__ import annotations

import collections
import dataclasses
import gc

import pytest

from cudnn_attn.core import settings
from cudnn_attn.engine import replay


class FakeRuntime:
    streamCaptureModeThreadLocal = 1

    def __init__(self, fail_capture: bool = False):
        self.events, self.fail_capture, self._next = [], fail_capture, 100
        self.refuse_update = False

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

    def update(self, executable, graph):
        self.events.append(("update", executable, graph))
        return not self.refuse_update


@pytest.fixture
def fake(monkeypatch):
    runtime = FakeRuntime()
    capturing = set()
    monkeypatch.setattr(replay, "_runtime", lambda: runtime)
    monkeypatch.setattr(replay, "_graph_launch", runtime.graphLaunch)
    monkeypatch.setattr(replay, "_capturing", lambda stream: stream in capturing)
    monkeypatch.setattr(replay, "_update", runtime.update)
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
    fake.capturing.clear()                  # calls recorded by the caller's capture were not sightings
    assert [replays.launch([1, 2, 3], 50, stream=5) for _ in range(2)] == [False, True]
    fake.capturing.add(5)
    assert not replays.launch([1, 2, 3], 50, stream=5)                 # a graph exists, but the stream records


def test_at_capacity_the_least_recently_used_graph_is_updated_in_place(fake, monkeypatch):
    """A plan at CAPACITY gives its least recently used executable graph to the new addresses
    (cudaGraphExecUpdate): nothing is instantiated or destroyed, and the old addresses no longer replay."""
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay_graphs_per_plan=2))
    launches = []
    replays = _replays(fake, launches)
    for address in (1, 2, 3):
        for _ in range(3):
            replays.launch([address], 0, stream=5)
    assert len(replays) == 2 and ("update", 101, 7) in fake.events
    assert [e for e in fake.events if e[0] in ("instantiate", "destroy")] == [("instantiate", 101), ("instantiate", 102)]
    assert fake.events[-1] == ("launch", 101, 5)                       # address 3 replays the updated graph
    assert replay.churn() == (2, 0, 1) and replay.live_graphs() == {0: 2}
    assert not replays.launch([1], 0, stream=5)                        # address 1's graph went to address 3


def test_a_refused_update_destroys_the_graph_and_instantiates_a_new_one(fake, monkeypatch):
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay_graphs_per_plan=2))
    fake.refuse_update = True
    replays = _replays(fake, [])
    for address in (1, 2, 3):
        for _ in range(3):
            replays.launch([address], 0, stream=5)
    assert len(replays) == 2 and ("destroy", 101) in fake.events and ("instantiate", 103) in fake.events
    assert replay.churn() == (3, 1, 0) and replay.live_graphs() == {0: 2}


def test_without_recycling_the_least_recently_used_graph_is_destroyed(fake, monkeypatch):
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay_graphs_per_plan=2))
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay_recycle=False))
    replays = _replays(fake, [])
    for address in (1, 2, 3):
        for _ in range(3):
            replays.launch([address], 0, stream=5)
    assert len(replays) == 2 and ("destroy", 101) in fake.events
    assert not any(e[0] == "update" for e in fake.events) and replay.churn() == (3, 1, 0)


def test_addresses_cycling_beyond_capacity_stop_capturing(fake, monkeypatch):
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay_graphs_per_plan=2))
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay_patience=4))
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
    """At DEVICE_CAPACITY graphs on a device, a plan with graphs gives its own least recently used one to the new
    addresses, a plan without any captures nothing (and launches itself), another device is not affected, and graphs
    destroyed with their plan free the bound."""
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay_graphs=3))
    first, second, other = (_replays(fake, [], device) for device in (0, 0, 1))

    def twice(replays, address):
        return [replays.launch([address], 0, stream=5) for _ in range(2)][-1]

    assert all(twice(first, address) for address in (1, 2, 3))
    assert replay.live_graphs() == {0: 3}
    assert not twice(second, 9) and len(second) == 0               # no graph of its own to give up
    assert twice(first, 4) and len(first) == 3 and ("update", 101, 7) in fake.events
    assert twice(other, 9) and replay.live_graphs() == {0: 3, 1: 1}
    del first
    gc.collect()
    assert replay.live_graphs() == {1: 1}
    assert second.launch([9], 0, stream=5) and len(second) == 1     # seen before: captured now
    second.clear()
    other.disable()
    assert replay.live_graphs() == {}
    assert replay.churn() == (5, 5, 1)         # first: 3 and one updated, second 1, other 1


def test_the_legacy_default_stream_is_never_asked_whether_it_is_captured(fake, monkeypatch):
    """Streams 0 and 1 (cudaStreamLegacy) cannot be captured: no capture-status query for them."""
    asked = []
    monkeypatch.setattr(replay, "_capturing", lambda stream: asked.append(stream) or False)
    replays = _replays(fake, [])
    for stream in (0, 0, 0, 1, 7, 7, 7):
        replays.launch([1], 0, stream=stream)
    assert asked == [7, 7, 7] and replays.replays == 5         # graphs are keyed by addresses, not streams


def test_a_caller_that_is_never_recorded_is_not_asked_whether_it_is_captured(fake, monkeypatch):
    """``capturable=False`` (the JAX target without the command-buffer trait): no capture-status query at all,
    and the call still captures on its second sight and replays on its third."""
    asked = []
    monkeypatch.setattr(replay, "_capturing", lambda stream: asked.append(stream) or True)
    replays = _replays(fake, [])
    assert [replays.launch([1], 0, stream=7, capturable=False) for _ in range(3)] == [False, True, True]
    assert asked == [] and replays.captures == 1 and replays.replays == 1
    assert not replays.launch([1], 0, stream=7)               # a capturable caller is asked (here: "recording")
    assert asked == [7]


def test_update_binding_refuses_without_a_driver():
    """The real ``cudaGraphExecUpdate`` binding takes the integer handles CuPy gives, and a refusal is ``False``,
    not an exception (here: no driver; on a GPU the tier updates real graphs)."""
    runtime = pytest.importorskip("cuda.bindings.runtime")
    if runtime.cudaGetDeviceCount()[0] == runtime.cudaError_t.cudaSuccess:
        pytest.skip("a CUDA driver is present: handles made up here would be dereferenced")
    assert replay._update(0x1234, 0x5678) is False



def test_capture_query_answers_by_cudas_status_and_counts_an_error_as_capturing():
    """The query closure over a runtime binding (here faked; the GPU tier stays out of a real capture:
    tests/gpu/test_replay_gpu.py): the status against CUDA's "none", and a failed query is "capturing" (no
    replay), not an exception."""
    class Runtime:
        streamCaptureStatusNone = 0

        def __init__(self, status):
            self.status, self.asked = status, []

        def streamIsCapturing(self, stream):
            self.asked.append(stream)
            if isinstance(self.status, Exception):
                raise self.status
            return self.status

    for status, expected in ((0, False), (1, True), (2, True), (RuntimeError("cudaErrorInvalidResourceHandle"), True)):
        runtime = Runtime(status)
        capturing = replay._capture_query(runtime)
        assert capturing(0x77) is expected and capturing(0x78) is expected, status
        assert runtime.asked == [0x77, 0x78]
