"""Replaying a plan's launch as a CUDA graph: the same device work for a fraction of the host time.

cuDNN's raw launch costs 6.8 us (forward) and 14.8 us (backward) of host time per call on the H200
(building the variant pack, cuDNN's own checks, one to four kernel launches: ``benchmarks/bench_host.py``).
A call whose addresses were all seen before can instead replay a CUDA graph captured from that very
launch: one ``cudaGraphLaunch``, and the device runs exactly the kernels the capture recorded.  Eager
loops hit it all the time: CuPy's memory pool hands the same blocks back, so a loop over the same shapes
passes the same few address sets (the JAX handler without command buffers sees XLA's fixed buffers).

:class:`Replays` holds one plan's graphs:

* **Keyed by every address the launch uses** - operands, results and the workspace.  The plan fixes
  everything else (shapes, strides, dtypes, the chosen engine; plans with host scalars or zero-fills
  never replay), so a graph found under a call's addresses performs exactly that call.
* **Captured on the second call with the same addresses**, never the first (a one-off call pays no
  capture): on a private stream of the device in thread-local capture mode, then launched on the
  caller's stream.  The caller holds the device lock, as for every launch.
* **Not when the caller's stream is being captured** (the user's CUDA graph, or XLA recording a command
  buffer): the launch is then recorded the ordinary way.  The legacy default stream (``0``, CuPy's null
  stream, or ``cudaStreamLegacy``) cannot be captured, so it is not asked (0.6 us a call); nor is the stream
  of a caller that is never recorded (``capturable=False``: the JAX target without the command-buffer
  trait, which XLA does not record).
* **Bounded**: at most ``settings.current.replay_graphs_per_plan`` graphs per plan, and at most ``settings.current.replay_graphs`` per device over
  all plans.  At either bound a plan gives its own least recently used graph to the new addresses: the new
  capture updates that executable graph in place (``cudaGraphExecUpdate``: the plan's kernels are the same,
  only their arguments differ), so no executable graph is made or destroyed (a fallback instantiates a new one
  when CUDA refuses the update).  A plan without graphs at the device bound captures nothing until other
  plans' graphs are destroyed.  Each executable graph holds
  device and host memory of its own; without the device bound, plans that live long (those a compiled JAX
  program holds) filled up to 64 graphs each, which a 93k-call soak measured as +90 MiB of device and
  +16 MiB of host memory (+4 / +0.3 MiB with replay off).  A graph holds about
  123 KiB of device and 31 KiB of host memory (DESIGN.md, "Measured facts"), so the default
  bound of 64 holds at most ~8 MiB of device memory per GPU.  Where XLA records the JAX call into its
  own command buffers (its default under ``jit``), the handler does not replay at all.  Address sets that cycle
  through more than a plan's capacity would capture on every call; a plan whose captures reach
  ``settings.current.replay_patience`` without as many replays stops capturing for good.  :func:`live_graphs` counts the graphs,
  :func:`churn` how many were made, destroyed and updated in place.
* A failed capture turns replay off for the plan (logged), and the call launches the ordinary way.
* ``CUDNN_ATTN_REPLAY=0`` turns it off for the process (:mod:`cudnn_attn.core.settings`).

Graphs are destroyed with their plan (CUDA frees an executable graph that is still running when its
launches complete).
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Callable, NamedTuple, Sequence

from cudnn_attn.core import settings

logger = logging.getLogger("cudnn_attn")

class Replays:
    """The CUDA graphs of one plan's launches (see the module doc).

    Args:
        raw: ``raw(addresses, workspace)`` - the plan's launch on the handle's current stream.
        bind_stream: points the handle at a stream (the device context's).
        capture_stream: ``() -> cudaStream_t`` of a private stream of the plan's device.
        device: the plan's device (whose ``settings.current.replay_graphs`` its graphs count against).
    """

    __slots__ = ("_raw", "_bind_stream", "_capture_stream", "_graphs", "_seen", "captures", "replays",
                 "enabled", "device", "__weakref__")

    def __init__(self, raw: Callable[[Sequence[int], int], None], bind_stream: Callable[[int], None],
                 capture_stream: Callable[[], int], device: int = 0):
        self._raw, self._bind_stream, self._capture_stream = raw, bind_stream, capture_stream
        self.device = device
        self._graphs: collections.OrderedDict[tuple, int] = collections.OrderedDict()
        self._seen: dict[tuple, None] = {}
        self.captures = self.replays = 0
        self.enabled = settings.current.replay

    def launch(self, addresses: Sequence[int], workspace: int, stream: int, capturable: bool = True) -> bool:
        """Launch by replay when the addresses allow it; ``False`` when the caller must launch itself.
        ``capturable=False``: the caller's stream is never being captured (it is not asked)."""
        if not self.enabled or (capturable and stream > _LEGACY and _capturing(stream)):
            return False                    # a stream being recorded gets the plain launch, recorded in turn
        key = (*addresses, workspace)
        graph = self._graphs.get(key)
        if graph is None:
            if key not in self._seen:
                if len(self._seen) >= 4 * settings.current.replay_graphs_per_plan:
                    self._seen.clear()
                self._seen[key] = None
                return False
            if self.captures >= settings.current.replay_patience and self.replays < self.captures:
                self.disable()              # addresses do not repeat within the bound: capturing only costs
                return False
            graph = self._capture(key, addresses, workspace)
            if graph is None:
                return False
        else:
            self._graphs.move_to_end(key)
            self.replays += 1
        _graph_launch(graph, stream)
        return True

    def _capture(self, key: tuple, addresses: Sequence[int], workspace: int) -> int | None:
        runtime = _runtime()
        recycled = None                     # the plan's least recently used graph, given to these addresses
        if len(self._graphs) >= settings.current.replay_graphs_per_plan \
                or _live[self.device] >= settings.current.replay_graphs:
            if not self._graphs:
                return None                 # the device's bound is held by other plans' graphs
            recycled = self._graphs.popitem(last=False)[1]
        side = self._capture_stream()
        self._bind_stream(side)
        graph = None
        try:
            runtime.streamBeginCapture(side, runtime.streamCaptureModeThreadLocal)
            try:
                self._raw(addresses, workspace)
            finally:
                graph = runtime.streamEndCapture(side)
            if recycled is not None and settings.current.replay_recycle and _update(recycled, graph):
                executable, recycled = recycled, None
                _count(self.device, 0)
            else:
                executable = runtime.graphInstantiate(graph)
                _count(self.device, 1)
        except Exception as error:          # noqa: BLE001 - any CUDA or cuDNN error: launch the ordinary way
            self.disable()
            logger.warning("cudnn_attn: capturing a launch into a CUDA graph failed (%s); this plan launches "
                           "without replay from now on", error)
            return None
        finally:
            if graph:
                runtime.graphDestroy(graph)
            if recycled is not None:        # not updated: destroyed (CUDA finishes its launches in flight)
                runtime.graphExecDestroy(recycled)
                _count(self.device, -1)
        self._seen.pop(key, None)
        self._graphs[key] = executable
        self.captures += 1
        return executable

    def __len__(self) -> int:
        return len(self._graphs)

    def disable(self) -> None:
        """No more replays or captures for this plan; its graphs are destroyed."""
        self.enabled = False
        self._seen.clear()
        self.clear()

    def clear(self) -> None:
        """Destroy every graph (CUDA finishes launches in flight first)."""
        graphs, self._graphs = self._graphs, collections.OrderedDict()
        if not graphs:
            return
        _count(self.device, -len(graphs))
        try:
            destroy = _runtime().graphExecDestroy
            for executable in graphs.values():
                destroy(executable)
        except Exception:                   # noqa: BLE001 - at exit the CUDA context may be gone
            pass

    def __del__(self) -> None:
        self.clear()


_LEGACY = 1                                                # cudaStreamLegacy; 0 is the same stream
_live: collections.Counter = collections.Counter()          # executable graphs alive, by device
_churn = collections.Counter()                             # graphs "made" and "destroyed", all devices
_live_lock = threading.Lock()                              # never held while anything else runs


def _count(device: int, change: int) -> None:
    """``change`` graphs made (1) or destroyed (-1) on ``device``; 0: one updated in place."""
    with _live_lock:
        _live[device] += change
        if change > 0:
            _churn["made"] += change
        elif change < 0:
            _churn["destroyed"] -= change
        else:
            _churn["updated"] += 1


class Churn(NamedTuple):
    made: int
    destroyed: int
    updated: int


def churn() -> Churn:
    """Replay graphs this process instantiated, destroyed, and updated in place for new addresses (soaks: how
    the bounds made the plans replace graphs)."""
    with _live_lock:
        return Churn(_churn["made"], _churn["destroyed"], _churn["updated"])


def live_graphs() -> dict[int, int]:
    """Executable graphs alive, by device (soaks, notebooks)."""
    with _live_lock:
        return {device: count for device, count in _live.items() if count}


def _runtime() -> Any:
    from cupy_backends.cuda.api import runtime

    return runtime


def _graph_launch(executable: int, stream: int) -> None:
    """``cudaGraphLaunch`` (CuPy's binding); the first call replaces this module function by the binding itself,
    so that the hot path makes one call, not two (and CuPy is imported only when a graph is launched)."""
    global _graph_launch
    _graph_launch = _runtime().graphLaunch
    _graph_launch(executable, stream)


def _capturing(stream: int) -> bool:
    """Whether ``stream`` is being captured; the first call replaces this module function by
    :func:`_capture_query`'s closure over CuPy's binding."""
    global _capturing
    _capturing = _capture_query(_runtime())
    return _capturing(stream)


def _capture_query(runtime: Any) -> Callable[[int], bool]:
    """``cudaStreamIsCapturing`` through ``runtime`` (CuPy's binding, as for the launch: cuda-python's builds enum
    objects on every call, 0.6 us of each replayed launch on the H200's host); an error counts as capturing."""
    is_capturing, none = runtime.streamIsCapturing, runtime.streamCaptureStatusNone

    def capturing(stream: int) -> bool:
        try:
            return is_capturing(stream) != none
        except Exception:                  # noqa: BLE001 - CUDARuntimeError: an error counts as capturing
            return True

    return capturing


def _update(executable: int, graph: int) -> bool:
    """``cudaGraphExecUpdate``: ``executable`` (of the same plan) takes ``graph``'s kernel arguments; launches in
    flight keep the old ones.  ``False`` when CUDA refuses (the thread's last CUDA error is then cleared, so that
    no later check reads it).  The first call replaces this module function by a closure over the binding."""
    global _update
    from cuda.bindings import runtime

    update, last_error, success = runtime.cudaGraphExecUpdate, runtime.cudaGetLastError, runtime.cudaError_t.cudaSuccess

    def updated(executable: int, graph: int) -> bool:
        if update(executable, graph)[0] == success:
            return True
        last_error()
        return False

    _update = updated
    return updated(executable, graph)
