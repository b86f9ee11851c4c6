"""Where cuDNN runs: one context per device (handle, lock, workspace), streams and arrays.

Devices
    :func:`device_context` returns the process-wide :class:`DeviceContext` of a CUDA device: one
    ``cudnn.Handle`` created while that device is current, the lock that serialises its use, the
    device's :class:`~cudnn_attn.core.support.Environment` and the CuPy path's workspace buffers.  It is
    created once, by the first caller that asks with ``create=True`` - the CuPy front on its first
    call, the JAX lowering for every device of the program - and never inside an XLA FFI handler:
    creating a handle allocates device memory and may synchronise the device, which deadlocks a
    multi-GPU program whose other devices wait in a collective for this one, and is not allowed
    while XLA captures a CUDA graph.  The handler only looks contexts up
    (``create=False``) and fails with a clear error if one is missing.

Threads
    cuDNN handles may be used from any thread but not from two at once (cuDNN's thread-safety rule).
    A context has two: the *launch* handle - every use (pointing it at a stream, taking the workspace,
    launching) happens under ``DeviceContext.lock``, held for a few microseconds of host work (the
    launch is asynchronous) - and the *planning* handle (:meth:`DeviceContext.planning`), which builds
    and deserializes graphs under a lock of its own, so that a build of up to a second never blocks a
    launch.  Plans built on one handle run on another of the same device.

A thread with no CUDA context
    A new thread has no CUDA context current until something makes one current (the CUDA runtime does so
    lazily; the driver API does not).  XLA calls the FFI handler on such threads, and there
    ``cudnnSetStream`` issues driver queries that fail with CUDA_ERROR_INVALID_CONTEXT: the H200 soak
    counted 14 of 4,591 rebinds without a context, and two soaks died of SIGSEGV inside ``cudnnSetStream``.  Every use of a handle therefore starts with :meth:`DeviceContext.adopt_thread`, which
    makes the device's primary context current when no context is, and ends with
    :meth:`DeviceContext.release_thread`, which unbinds it again, so the caller's thread is left as it was.

Streams a handle may not outlive
    cuDNN keeps the stream a handle points at and queries it (deserializing a plan checks whether it is
    being captured).  Pointing a handle at a stream that is later destroyed corrupts the next use: on
    the H200 the plan store's deserialization then failed with "context is destroyed" and the CUDA
    context was lost.  So the planning handle stays on the default stream, and after a CuPy-path launch
    on any other stream the launch handle goes back to it; only XLA's streams, which live as long as
    the process, stay bound.

Streams
    Work is queued on the caller's current CuPy stream of the input's device, or on ``stream=``
    (an ``int`` ``cudaStream_t``, a CuPy stream, a torch stream, or anything implementing the
    ``__cuda_stream__`` protocol).  Outputs are allocated with that stream current from CuPy's
    memory pool, which reuses a freed block only in that stream's order: nothing synchronises the host.

Workspace (CuPy path)
    A grow-only buffer per (device, stream), taken under the device lock, so a cache-hit call
    allocates nothing for it and a growth can never free a buffer another thread is about to use.
    The JAX path gets its workspace from XLA (an extra result of the FFI call) instead.

Another framework's memory
    Inside :func:`memory_from` every CuPy allocation of the thread - results, folded masks, clamped lengths,
    temporaries - and every launch's workspace come from the caller's allocator instead of CuPy's pool and the
    cached workspace.  The torch front runs its general path so, with torch's caching allocator on torch's
    current stream: a CUDA graph torch captures then holds memory from its own pool alone, which outlives the
    graph, where a cached workspace that grows would free memory a captured launch still reads.

Arrays
    CuPy arrays are used as they are.  Any other GPU array with ``__dlpack__`` (JAX arrays, torch
    tensors) is imported zero-copy with :func:`cupy.from_dlpack` while the call's stream is current,
    so the producer orders its pending writes before our work (DLPack's ``stream=`` contract).

bfloat16
    CuPy >= 14 has ``bfloat16`` arrays through ``ml_dtypes`` and imports/exports them over DLPack
    (measured on the H200 with CuPy 14.2).  Integer arrays holding bf16 bit patterns are not accepted.

Exit
    :func:`release` (registered with ``atexit``) runs the release hooks - the JAX bridge waits for the
    computations in flight and unpins its plans, the graph cache drops its graphs - then destroys the
    handles and drops the workspaces, so that no cuDNN frontend object outlives the interpreter (nanobind
    reports those as leaks at exit).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import inspect
import logging
import threading
from typing import Any, Iterator, Sequence

from cudnn_attn.core.config import dense_strides
from cudnn_attn.core.environment import Environment
from cudnn_attn.core.errors import NoGPUError

logger = logging.getLogger("cudnn_attn")


_cupy_module: Any = None


def cupy() -> Any:
    """The ``cupy`` module (:class:`NoGPUError` without it).  Imported on first use: ``import cudnn_attn`` does not
    import CuPy; later calls return it without an import statement (this is on every call's path)."""
    global _cupy_module
    if _cupy_module is None:
        try:
            import cupy
        except ImportError as exc:  # pragma: no cover - cupy is a dependency
            raise NoGPUError(f"the cuDNN path needs CuPy ({exc}); use cudnn_attn.reference on a CPU") from exc
        _cupy_module = cupy
    return _cupy_module


_cupy = cupy


_gpu_found = False


def require_gpu() -> None:
    """Raise :class:`NoGPUError` unless CuPy sees a CUDA device (checked until one is found)."""
    global _gpu_found
    if _gpu_found:
        return
    cupy = _cupy()
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError when there is no driver
        raise NoGPUError(f"no usable CUDA GPU ({exc}); the cuDNN path needs one. "
                         "Use cudnn_attn.reference (NumPy) or the JAX bridge on CPU.") from exc
    if count == 0:
        raise NoGPUError("no CUDA GPU is visible; the cuDNN path needs one. "
                         "Use cudnn_attn.reference (NumPy) or the JAX bridge on CPU.")
    _gpu_found = True


def is_gpu_available() -> bool:
    """Whether this process sees a CUDA GPU the cuDNN path can use (CuPy imports and finds a device); without
    one the CuPy front raises :class:`~cudnn_attn.core.errors.NoGPUError`, and the NumPy reference and the JAX
    bridge on CPU still run."""
    try:
        require_gpu()
    except NoGPUError:
        return False
    return True


# -- streams ----------------------------------------------------------------------------------------

def stream_pointer(stream: Any, device: int) -> int:
    """The ``cudaStream_t`` of ``stream`` (see the module doc); ``None`` is CuPy's current stream."""
    if stream is None:
        return _cupy().cuda.get_current_stream(device).ptr
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    for attribute in ("ptr", "cuda_stream"):  # CuPy streams, torch streams
        value = getattr(stream, attribute, None)
        if isinstance(value, int):
            return value
    protocol = getattr(stream, "__cuda_stream__", None)
    if protocol is not None:
        return int(protocol()[1])
    raise ValueError(f"stream: expected None, an int cudaStream_t, a CuPy or torch stream, or an object with "
                     f"__cuda_stream__; got {type(stream).__name__}")


@contextlib.contextmanager
def stream_scope(stream: Any, device: int) -> Iterator[int]:
    """Make ``stream`` (see :func:`stream_pointer`; ``None``: the current CuPy stream) CuPy's current stream of
    ``device`` for the block - CuPy allocates results on it, so its pool reuses their memory in that stream's
    order - and give its ``cudaStream_t``.  The one place a call's stream is scoped."""
    pointer = stream_pointer(stream, device)
    if stream is None:
        yield pointer
        return
    with device_context(device).stream(pointer):
        yield pointer


class _StreamHandle:
    """A raw ``cudaStream_t`` under the CUDA stream protocol (what ``cupy.cuda.Stream.from_external`` takes)."""
    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


# -- one context per device ---------------------------------------------------------------------------

def create_handle(device: int) -> Any:
    """A ``cudnn.Handle`` of CUDA ``device`` (current while this runs).

    ``cudnn.create_handle()`` asks ``cudnn.frost.device.current_device()`` for the ordinal, which imports
    ``cuda.bindings`` and finds the driver library (84 ms measured on a CPU machine, where it then fails;
    paid on the first call of every process).  The ordinal is known here, so the backend handle is
    wrapped with it, as the frontend documents for raw handles (``cudnn.Handle(backend_handle, ordinal,
    stream)``); frontends without that route get ``cudnn.create_handle()``.
    """
    import cudnn

    backend = getattr(cudnn, "_pybind_module", None)
    create, get_stream = getattr(backend, "create_handle", None), getattr(backend, "get_stream", None)
    if create is None or get_stream is None or not _takes_a_raw_handle(getattr(cudnn, "Handle", None)):
        return cudnn.create_handle()
    raw = create()
    try:
        return cudnn.Handle(raw, device, get_stream(raw))
    except Exception:
        with contextlib.suppress(Exception):
            cudnn.destroy_handle(cudnn.Handle(raw, device))
        return cudnn.create_handle()


def _takes_a_raw_handle(handle_type: Any) -> bool:
    """Whether ``handle_type(backend_handle, ordinal, stream)`` is a call its signature takes (then a raw handle
    made for it can also be destroyed through the public ``cudnn.destroy_handle``)."""
    try:
        inspect.signature(handle_type).bind(0, 0, 0)
    except (TypeError, ValueError):
        return False
    return isinstance(handle_type, type)


class DeviceContext:
    """The cuDNN handle of one device, the lock that guards it, its environment and the CuPy path's
    workspaces (see the module doc).  Made by :func:`device_context`."""

    def __init__(self, device: int):
        cupy = _cupy()
        self.device = device
        self.lock = threading.Lock()
        self._planning_lock = threading.Lock()
        with cupy.cuda.Device(device):
            self.handle = create_handle(device)
            self._planning_handle = create_handle(device)
            self.environment = Environment.detect()
            # the device's primary context, current here (cudaSetDevice makes it so)
            self._get_current, self._set_current = cupy.cuda.driver.ctxGetCurrent, cupy.cuda.driver.ctxSetCurrent
            self.cuda_context = self._get_current()
        self.handle_address = int(self.handle.backend_handle)
        self._stream = None                       # the stream the handle points at
        self._streams: dict[int, Any] = {}
        self._workspaces: dict[int, Any] = {}
        self._capture: Any = None                 # the private stream launches are captured on (cudnn_attn.engine.replay)

    def adopt_thread(self) -> bool:
        """Make the device's CUDA context current on this thread when no context is (see the module doc);
        ``True`` when it did, and the caller then calls :meth:`release_thread` after its cuDNN calls.
        Thread-local: no lock needed.  Costs one driver query when a context is current."""
        if self._get_current():
            return False
        self._set_current(self.cuda_context)
        return True

    def release_thread(self) -> None:
        """Unbind the context :meth:`adopt_thread` made current, leaving the thread as it found it."""
        self._set_current(0)

    @contextlib.contextmanager
    def planning(self):
        """The planning handle (on the default stream), held for one build or deserialization."""
        with self._planning_lock:
            adopted = self.adopt_thread()
            try:
                yield self._planning_handle
            finally:
                if adopted:
                    self.release_thread()

    def bind_stream(self, stream_ptr: int) -> None:
        """Point the launch handle at ``stream_ptr``.  Hold :attr:`lock`."""
        if stream_ptr != self._stream:
            import cudnn

            cudnn.set_stream(self.handle, stream_ptr)
            self._stream = stream_ptr

    def capture_stream(self) -> int:
        """A private non-blocking stream of the device, on which :mod:`cudnn_attn.engine.replay` captures launches.
        Hold :attr:`lock`."""
        if self._capture is None:
            cupy = _cupy()
            with cupy.cuda.Device(self.device):
                self._capture = cupy.cuda.Stream(non_blocking=True)
        return self._capture.ptr

    def stream(self, stream_ptr: int) -> Any:
        """A CuPy stream object for ``stream_ptr``, to make it current while allocating."""
        stream = self._streams.get(stream_ptr)
        if stream is None:
            cupy = _cupy()
            with cupy.cuda.Device(self.device):
                stream = cupy.cuda.Stream.from_external(_StreamHandle(stream_ptr))
            stream = self._streams.setdefault(stream_ptr, stream)
        return stream

    def workspace(self, stream_ptr: int, nbytes: int) -> int:
        """Device address of at least ``nbytes`` bytes of scratch, ordered on ``stream_ptr`` (0 if none).
        Hold :attr:`lock`: the buffer is shared by every call on that stream.  Inside :func:`memory_from` a new
        buffer from its allocator, held until the block ends."""
        if nbytes == 0:
            return 0
        held = getattr(_borrowed, "held", None)
        if held is not None:
            cupy = _cupy()
            with cupy.cuda.Device(self.device):
                held.append(cupy.empty(nbytes, cupy.uint8))
            return held[-1].data.ptr
        buffer = self._workspaces.get(stream_ptr)
        if buffer is None or buffer.nbytes < nbytes:
            cupy = _cupy()
            self._workspaces.pop(stream_ptr, None)  # released in stream order before the bigger one
            with cupy.cuda.Device(self.device), self.stream(stream_ptr):
                buffer = self._workspaces[stream_ptr] = cupy.empty(nbytes, cupy.uint8)
        return buffer.data.ptr

    def close(self) -> None:
        """Drop the workspaces and destroy the handle (at exit; the context is unusable afterwards)."""
        import cudnn

        with self.lock, self._planning_lock:
            self._workspaces.clear()
            self._streams.clear()
            self._capture = None
            handles = (self.handle, self._planning_handle)
            self.handle = self._planning_handle = None
            for handle in handles:
                if handle is not None:
                    with contextlib.suppress(Exception):
                        cudnn.destroy_handle(handle)

    def __repr__(self) -> str:
        return f"DeviceContext(device={self.device}, {self.environment})"


_contexts: dict[int, DeviceContext] = {}
_contexts_lock = threading.Lock()


def device_context(device: int, *, create: bool = True) -> DeviceContext:
    """The :class:`DeviceContext` of CUDA device ``device``.

    With ``create=False`` (the XLA FFI handler) a missing context is an error instead of being made:
    nothing on the execution path creates a handle (see the module doc).
    """
    context = _contexts.get(device)
    if context is not None:
        return context
    if not create:
        raise RuntimeError(
            f"cudnn_attn: no cuDNN context was prepared for GPU {device}. Contexts are made before a computation "
            f"runs (when it is lowered for its devices, or by a direct call), never while XLA executes it; "
            f"prepared devices: {sorted(_contexts)}")
    require_gpu()
    with _contexts_lock:
        context = _contexts.get(device)
        if context is None:
            context = _contexts[device] = DeviceContext(device)
    return context



_release_hooks: list[Any] = []


def on_release(hook: Any) -> None:
    """Run ``hook()`` in :func:`release`, before the contexts close (caches drop their cuDNN graphs)."""
    _release_hooks.append(hook)


def release() -> None:
    """Drop every cached cuDNN object and close every context (registered with ``atexit``)."""
    for hook in reversed(_release_hooks):
        with contextlib.suppress(Exception):
            hook()
    with _contexts_lock:
        contexts = list(_contexts.values())
        _contexts.clear()
    for context in contexts:
        context.close()


atexit.register(release)


# -- arrays ----------------------------------------------------------------------------------------

_KDL_CUDA = 2  # DLPack device type of CUDA memory


def device_of(name: str, x: Any) -> int:
    """The CUDA device ``x`` lives on (CuPy arrays, or any array with ``__dlpack_device__``)."""
    device = getattr(x, "device", None)
    if type(x).__module__.partition(".")[0] == "cupy" and hasattr(device, "id"):
        return device.id
    probe = getattr(x, "__dlpack_device__", None)
    if probe is not None:
        kind, index = probe()
        if int(kind) == _KDL_CUDA:
            return int(index)
    raise ValueError(
        f"{name}: expected a GPU array (CuPy, or any __dlpack__ array on a CUDA device such as a torch tensor "
        f"or a JAX array), got {type(x).__name__}" + (f" {x.dtype}{list(x.shape)}" if hasattr(x, "shape") else "")
        + "; move it to the GPU first (cupy.asarray) or use cudnn_attn.reference for NumPy inputs.")


copies: collections.Counter = collections.Counter()
"""Input arrays the fronts copied because cuDNN cannot read them as they are, by argument name
(``graph_cache.stats().copies`` counts them; each is logged at DEBUG on the ``cudnn_attn`` logger)."""


def readable_strides(x: Any) -> bool:
    """Whether cuDNN reads the rank-4 CuPy array ``x`` with its own strides (:func:`readable_layout`) at its address:
    the data 16-byte aligned too (a view of other memory: a BNTH view of BTNH memory, a transposed view, sliced
    heads)."""
    return x.ndim == 4 and not x.data.ptr % 16 and readable_layout(x.shape, x.strides, x.itemsize)


def readable_layout(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> bool:
    """Whether cuDNN reads a rank-4 array of ``shape`` and byte ``strides`` as it is: every stride positive and
    16-byte aligned, the last dimension contiguous (dimensions of extent 1 read nothing and count for nothing).  The
    rule of every front; the data's own alignment is the caller's to check."""
    if len(shape) != 4:
        return False
    for extent, stride in zip(shape, strides):
        if extent != 1 and (stride <= 0 or stride % itemsize):
            return False
    last = shape[-1] == 1 or strides[-1] == itemsize
    return last and all(extent == 1 or stride % 16 == 0 for extent, stride in zip(shape[:-1], strides[:-1]))


def element_strides(x: Any) -> tuple[int, ...]:
    """``x``'s strides in elements, with the row-major value for dimensions of extent 1 (whose stride reads nothing)."""
    return normalized_strides(x.shape, [s // x.itemsize for s in x.strides])


def normalized_strides(shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    """Element ``strides`` of ``shape`` with the row-major value for dimensions of extent 1 (:func:`element_strides`'s
    rule, for a framework that gives element strides)."""
    dense = dense_strides(tuple(shape))
    return tuple(d if extent == 1 else s for extent, s, d in zip(shape, strides, dense))


def as_cupy(name: str, x: Any, device: int | None, stream: Any, *, strided: bool = False) -> Any:
    """``x`` as a C-contiguous CuPy array on ``device`` (``None``: wherever ``x`` lives).

    CuPy arrays pass through; other ``__dlpack__`` GPU arrays are imported zero-copy with ``stream``
    current (a CuPy stream object or ``None`` for the current one).  Non-contiguous arrays are copied
    to a contiguous one on the same stream, except with ``strided`` where cuDNN reads them as they are
    (:func:`readable_strides`; Q, K and V: the configuration then carries their strides).  Host arrays are
    refused: this path never copies between host and device behind the caller's back.
    """
    cupy = _cupy()
    if not isinstance(x, cupy.ndarray):
        found = device_of(name, x)          # refuses host arrays with a clear message
        if device is not None and found != device:
            raise ValueError(f"{name}: lives on GPU {found} but the query is on GPU {device}; "
                             f"all arrays of one call must be on the same device")
        try:
            with stream if stream is not None else contextlib.nullcontext():
                x = cupy.from_dlpack(x)
        except (BufferError, TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{name}: could not import {type(x).__name__} zero-copy through DLPack "
                             f"(is it on a CUDA device?): {exc}") from exc
    if device is not None and x.device.id != device:
        raise ValueError(f"{name}: lives on GPU {x.device.id} but the query is on GPU {device}; "
                         f"all arrays of one call must be on the same device")
    if not x.flags.c_contiguous and not (strided and readable_strides(x)):
        copies[name] += 1
        logger.debug("cudnn_attn: %s %s%s with strides %s copied to a dense array (cuDNN cannot read it as it is)",
                     name, x.dtype, list(x.shape), x.strides)
        with stream if stream is not None else contextlib.nullcontext():
            x = cupy.ascontiguousarray(x)
    return x


_borrowed = threading.local()


@contextlib.contextmanager
def memory_from(allocate: Any, device: int) -> Iterator[None]:
    """CuPy allocations of this thread on ``device`` inside the block come from ``allocate(nbytes) -> (address,
    owner)`` (the memory lives as long as ``owner``), and launches take a new workspace from it, held until the
    block ends (see the module doc).  Nested blocks take the innermost allocator."""
    cupy = _cupy()
    memory, pointer = cupy.cuda.UnownedMemory, cupy.cuda.MemoryPointer

    def allocator(nbytes: int) -> Any:
        address, owner = allocate(nbytes)
        return pointer(memory(address, nbytes, owner, device), 0)

    outer = getattr(_borrowed, "held", None)
    _borrowed.held = []
    try:
        with cupy.cuda.using_allocator(allocator):
            yield
    finally:
        _borrowed.held = outer


def on_device(device: int) -> Any:
    """A context manager making ``device`` current (a no-op when it already is)."""
    cupy = _cupy()
    if cupy.cuda.runtime.getDevice() == device:
        return contextlib.nullcontext()
    return cupy.cuda.Device(device)
