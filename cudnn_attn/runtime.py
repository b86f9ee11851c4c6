"""Where cuDNN runs: the device, its cuDNN handle, the stream, the workspace and the arrays.

Handles
    One ``cudnn.Handle`` per (device, thread), created while that device is current.  cuDNN handles
    are not meant to be driven from two threads at once, so every thread gets its own.

Streams
    Work is queued on the caller's current CuPy stream of the input's device, or on ``stream=``
    (an ``int`` ``cudaStream_t``, a CuPy stream, a torch stream, or anything implementing the
    ``__cuda_stream__`` protocol).  ``cudnn.set_stream`` is only called when the handle's stream
    changes.  Outputs and the workspace are allocated *on that stream* from CuPy's memory pool,
    which only reuses a freed block for later allocations on the same stream: everything stays
    stream-ordered and no call synchronises the host.

Workspace
    A grow-only buffer per (device, thread, stream): a cache-hit call allocates nothing for it.
    Reusing one buffer for consecutive calls is safe because they are ordered on that stream.

Arrays
    CuPy arrays are used as they are.  Any other GPU array with ``__dlpack__`` (JAX arrays, torch
    tensors) is imported zero-copy with :func:`cupy.from_dlpack` while the call's stream is current,
    so the producer orders its pending writes before our work (DLPack's ``stream=`` contract).
    Results are always **CuPy arrays** on the input's device; hand them back to a framework
    zero-copy with ``torch.from_dlpack(x)`` / ``jax.dlpack.from_dlpack(x)``.

bfloat16
    CuPy >= 14 has ``bfloat16`` arrays through ``ml_dtypes`` (``cupy.empty(shape, ml_dtypes.bfloat16)``,
    ``x.astype(ml_dtypes.bfloat16)``), and imports/exports bf16 over DLPack (torch ``torch.bfloat16``,
    JAX ``jnp.bfloat16``) - measured on the H200 with CuPy 14.2.  That is the supported way to pass
    bf16.  Integer arrays holding bf16 bit patterns are *not* accepted (their dtype says int).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from .errors import NoGPUError

_local = threading.local()


def _cupy():
    try:
        import cupy
    except ImportError as exc:  # pragma: no cover - cupy is a dependency
        raise NoGPUError(f"the cuDNN path needs CuPy ({exc}); use cudnn_attn.reference on a CPU") from exc
    return cupy


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


# -- per (device, thread) context ---------------------------------------------------------------------

class DeviceContext:
    """The cuDNN handle, stream wrappers and workspace buffers of one device for the current thread."""

    def __init__(self, device: int):
        import cudnn

        cupy = _cupy()
        self.device = device
        with cupy.cuda.Device(device):
            self.handle = cudnn.create_handle()
        self._streams: dict[int, Any] = {}
        self._workspaces: dict[int, Any] = {}
        self._environment = None

    def bind_stream(self, stream_ptr: int) -> None:
        """Point the handle at ``stream_ptr`` (``cudnn.set_stream`` skips unchanged streams itself)."""
        import cudnn

        cudnn.set_stream(self.handle, stream_ptr)

    def stream(self, stream_ptr: int) -> Any:
        """A CuPy stream object for ``stream_ptr``, to make it current while allocating."""
        stream = self._streams.get(stream_ptr)
        if stream is None:
            cupy = _cupy()
            stream = self._streams[stream_ptr] = cupy.cuda.ExternalStream(stream_ptr, self.device)
        return stream

    def workspace(self, stream_ptr: int, nbytes: int) -> int:
        """Device address of at least ``nbytes`` bytes of scratch, ordered on ``stream_ptr`` (0 if none)."""
        if nbytes == 0:
            return 0
        buffer = self._workspaces.get(stream_ptr)
        if buffer is None or buffer.nbytes < nbytes:
            cupy = _cupy()
            self._workspaces.pop(stream_ptr, None)  # release the smaller one first (same stream: ordered)
            with cupy.cuda.Device(self.device), self.stream(stream_ptr):
                buffer = self._workspaces[stream_ptr] = cupy.empty(nbytes, cupy.uint8)
        return buffer.data.ptr

    def workspace_bytes(self) -> int:
        """Bytes currently held by this context's workspace buffers."""
        return sum(b.nbytes for b in self._workspaces.values())

    def release_workspaces(self) -> None:
        self._workspaces.clear()

    @property
    def environment(self):
        """The :class:`~cudnn_attn.support.Environment` of this device (detected once)."""
        if self._environment is None:
            from .support import Environment

            with _cupy().cuda.Device(self.device):
                self._environment = Environment.detect()
        return self._environment


def context(device: int) -> DeviceContext:
    """This thread's :class:`DeviceContext` for ``device`` (created on first use)."""
    contexts = getattr(_local, "contexts", None)
    if contexts is None:
        contexts = _local.contexts = {}
    ctx = contexts.get(device)
    if ctx is None:
        require_gpu()
        ctx = contexts[device] = DeviceContext(device)
    return ctx


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


def as_cupy(name: str, x: Any, device: int | None, stream: Any) -> Any:
    """``x`` as a C-contiguous CuPy array on ``device`` (``None``: wherever ``x`` lives).

    CuPy arrays pass through; other ``__dlpack__`` GPU arrays are imported zero-copy with ``stream``
    current (a CuPy stream object or ``None`` for the current one).  Non-contiguous arrays are copied
    to a contiguous one on the same stream (cuDNN is given dense BTNH/BNTH strides).  Host arrays are
    refused: this path never copies between host and device behind the caller's back.
    """
    cupy = _cupy()
    if not isinstance(x, cupy.ndarray):
        found = device_of(name, x)          # refuses host arrays with a clear message
        if device is not None and found != device:
            raise ValueError(f"{name}: lives on GPU {found} but the query is on GPU {device}; "
                             f"all arrays of one call must be on the same device")
        try:
            if stream is None:
                x = cupy.from_dlpack(x)
            else:
                with stream:
                    x = cupy.from_dlpack(x)
        except (BufferError, TypeError, ValueError, RuntimeError) as exc:
            raise ValueError(f"{name}: could not import {type(x).__name__} zero-copy through DLPack "
                             f"(is it on a CUDA device?): {exc}") from exc
    if device is not None and x.device.id != device:
        raise ValueError(f"{name}: lives on GPU {x.device.id} but the query is on GPU {device}; "
                         f"all arrays of one call must be on the same device")
    if not x.flags.c_contiguous:
        if stream is None:
            x = cupy.ascontiguousarray(x)
        else:
            with stream:
                x = cupy.ascontiguousarray(x)
    return x


def on_device(device: int) -> Any:
    """A context manager making ``device`` current (a no-op when it already is)."""
    cupy = _cupy()
    if cupy.cuda.runtime.getDevice() == device:
        return contextlib.nullcontext()
    return cupy.cuda.Device(device)


def zero_fill(x: Any, stream_ptr: int) -> None:
    """``x[...] = 0`` as one ``cudaMemsetAsync`` on ``stream_ptr`` (cheaper than a CuPy kernel)."""
    _cupy().cuda.runtime.memsetAsync(x.data.ptr, 0, x.nbytes, stream_ptr)
