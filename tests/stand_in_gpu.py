"""A stand-in GPU for the engine's CPU tests (``tests/test_plan.py``, ``tests/test_prepared.py``).

* :class:`Array` - a NumPy array that answers what the engine asks of a CuPy array: ``x.data.ptr`` (its host
  address here), ``x.data.device_id``, ``x.device.id``;
* :func:`cupy_namespace` - a CuPy namespace over NumPy whose arrays are :class:`Array`; ``empty`` fills float
  buffers with NaN, so an element nobody wrote is seen;
* :class:`Context` - a device context that records the streams, workspaces and threads of its launches and
  asserts the device lock is held;
* :class:`Launcher` - records every launch (tensor id -> address) and runs a ``kernel(buffers)`` over the
  memory at those addresses, the stand-in of cuDNN's work;
* :func:`built_graph` - the built graph of a call as :class:`~cudnn_attn.engine.plan.CallPlan` reads it.
"""

from __future__ import annotations

import ctypes
import threading
import types
from typing import Any, Callable

import numpy as np

from cudnn_attn.engine.call import CallSpec, result_specs
from cudnn_attn.graphs.tensors import HOST_SCALAR_IDS, TensorId

STREAM = 0x55


class _Pointer:
    __slots__ = ("ptr", "device_id", "mem")

    def __init__(self, ptr: int):
        self.ptr, self.device_id, self.mem = ptr, 0, None


class Array(np.ndarray):
    """A NumPy array with CuPy's ``data.ptr`` and ``device`` (device 0)."""

    @property
    def data(self) -> _Pointer:           # type: ignore[override]
        return _Pointer(int(self.ctypes.data))

    @property
    def device(self) -> Any:
        return types.SimpleNamespace(id=0)


def array(x: Any, dtype: Any = None) -> Array:
    return np.ascontiguousarray(x, dtype).view(Array)


def cupy_namespace() -> Any:
    """A ``cupy`` module over NumPy (see the module doc)."""

    class Namespace(types.ModuleType):
        ndarray = Array
        cuda = types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=STREAM))

        def __getattr__(self, name: str) -> Any:
            found = getattr(np, name)
            if not callable(found) or isinstance(found, type):
                return found

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                out = found(*args, **kwargs)
                return out.view(Array) if isinstance(out, np.ndarray) else out
            return wrapped

        @staticmethod
        def empty(shape: Any, dtype: Any = np.float32) -> Array:
            out = np.empty(shape, dtype).view(Array)
            if np.dtype(dtype).kind == "f":
                out[...] = np.nan                  # poisoned: what no one writes stays NaN
            return out

    return Namespace("cupy")


def view(pointer: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """The memory at ``pointer`` as a writable NumPy array."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    memory = (ctypes.c_char * max(count * dtype.itemsize, 1)).from_address(pointer)
    return np.frombuffer(memory, dtype, count).reshape(shape)


def memset_zero(pointers: list[int], zeroed: tuple[tuple[int, int], ...], stream: int) -> None:
    """``engine.plan._memset_zero`` on host memory."""
    for position, nbytes in zeroed:
        ctypes.memset(pointers[position], 0, nbytes)


class Context:
    """A device context (see the module doc)."""

    def __init__(self, device: int = 0):
        self.device = device
        self.lock = threading.Lock()
        self.handle = types.SimpleNamespace(backend_handle=7)
        self.streams: list[int] = []
        self.workspaces: list[tuple[int, int]] = []
        self.has_cuda_context, self.threads = True, []      # whether this thread has a CUDA context current

    def adopt_thread(self) -> bool:
        assert self.lock.locked(), "made current for the launch, under the device lock"
        self.threads.append("adopt" if not self.has_cuda_context else "had one")
        adopted, self.has_cuda_context = not self.has_cuda_context, True
        return adopted

    def release_thread(self) -> None:
        assert self.lock.locked()
        self.threads.append("release")
        self.has_cuda_context = False

    def bind_stream(self, stream: int) -> None:
        assert self.lock.locked(), "the handle is pointed at a stream under the device lock"
        self.streams.append(stream)

    def workspace(self, stream: int, nbytes: int) -> int:
        assert self.lock.locked()
        self.workspaces.append((stream, nbytes))
        return 0xAAAA

    def capture_stream(self) -> int:
        assert self.lock.locked()
        return 0xCA


class Launcher:
    """Records launches (``calls``: tensor id -> address, and the workspace) and runs :attr:`kernel` on them."""

    kernel: Callable[[dict], None] | None = None

    def __init__(self, built: Any, ids: Any, plan_index: int | None = None):
        self.ids, self.calls = ids, []

    def _run(self, addresses: Any, workspace: int) -> None:
        bound = dict(zip(self.ids, addresses))
        self.calls.append((bound, workspace))
        if self.kernel is not None:
            self.kernel(bound)

    def __call__(self, addresses: Any, workspace: int, handle: Any) -> None:
        self._run(addresses, workspace)

    def bound(self, context: Any) -> Callable[[Any, int], None]:          # the raw path: under the device lock
        def raw(addresses: Any, workspace: int) -> None:
            assert context.lock.locked()
            self._run(addresses, workspace)
        return raw


def built_graph(config: Any, kind: str, ids: Any = None, *, workspace_size: int = 256, plans: tuple = ()) -> Any:
    """A built graph of ``config``'s ``kind`` call: ``ids`` its tensors (default: what the call binds and writes,
    and the dropout scalars)."""
    if ids is None:
        ids = set(CallSpec.of(config, kind).graph_operands) | {s.tid for s in result_specs(config, kind)}
        if config.has_dropout:
            ids |= {TensorId.SEED, TensorId.OFFSET}
    assert all(t not in HOST_SCALAR_IDS or t in (TensorId.SEED, TensorId.OFFSET) for t in ids)
    return types.SimpleNamespace(config=config, kind=kind, uids={t: int(t) for t in ids},
                                 workspace_size=workspace_size, plans=plans, plan_name="eng0")
