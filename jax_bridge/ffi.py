"""XLA FFI handlers written in Python: the C ABI of ``xla/ffi/api/c_api.h`` through ctypes.

XLA calls a custom-call target through one C function, ``XLA_FFI_Error* handler(XLA_FFI_CallFrame*)``.
:func:`make_handler` turns a Python function into such a function pointer (a ctypes callback), which
:func:`register` hands to ``jax.ffi.register_ffi_target`` under a name, for a platform (``"cpu"`` or
``"CUDA"``).  No compiler is involved, and the target is an ordinary named custom call: it lowers
inside ``custom_partitioning`` (where host callbacks crash) and, on GPU, receives XLA's own device
buffers and stream (zero copy).

The Python function receives a :class:`Call`: the argument and result buffers (:class:`Buffer`:
address, shape, dtype), the scalar attributes of the call site and, on GPU, XLA's stream and device
ordinal.  A Python exception never crosses the C boundary: it becomes an XLA FFI error carrying the
exception's message (``ValueError`` -> INVALID_ARGUMENT, ``NotImplementedError`` -> UNIMPLEMENTED,
anything else INTERNAL), which JAX raises as ``JaxRuntimeError``.

Protocol (``c_api.h``, XLA FFI API 0.x; jaxlib 0.11.2 ships minor version 4):

* At registration XLA calls the handler once with a *metadata extension* in the call frame; the
  handler fills in the API version it was written against and its traits (bit 0: safe to capture into
  a command buffer, i.e. a CUDA graph) and returns ``NULL``.
* At execution it calls the handler with the call frame; ``NULL`` means success.
* A handler made with ``instantiate=`` is also registered for XLA's *instantiate* stage, which XLA runs
  once per call site when it builds an executable: the Python function returns an object that this
  module keeps as the call site's *state* (``XLA_FFI_State_Set`` with a registered type whose deleter
  XLA calls when the executable is destroyed).  That is the executable-lifetime hook the JAX bridge uses
  to keep a cuDNN plan as long as a compiled program can run it (:mod:`.call_site`).  The deleter runs
  no Python (it posts a semaphore, see :class:`_States`): the objects held for a destroyed executable
  are dropped at the next instantiation, or by :func:`release_destroyed_states`.

Interpreter exit: a handler needs the GIL, and JAX's own exit hook destroys the backends while holding
it.  A computation still in flight at exit would then wait for the GIL forever, so an exit hook
(registered after JAX's, hence run before it) first waits for every live array to be ready.  The
deleter needs no GIL (:class:`_States`).  What no live array names is not waited for: a CPU computation
dispatched and dropped just before exit whose custom call has not run yet reaches its handler after
finalization began, and the thread that takes the GIL there is ended, so the exit hangs (JAX's own
callbacks check for finalization in C++, which a ctypes callback cannot do before taking the GIL).  A
script blocks on its last result before it ends.

Only structures and functions that exist since API 0.1 are read, except the device ordinal
(``XLA_FFI_DeviceOrdinal_Get``), which is looked up only when the runtime's table has it.  Every
structure carries ``struct_size`` for forward compatibility; XLA promises (``c_api.h``) to support old
API versions for at least 12 months and not to break the ABI.
"""

from __future__ import annotations

import atexit
import ctypes as C
import functools
import struct
import sys
import threading
import traceback
from typing import Any, Callable, NamedTuple

import ml_dtypes
import numpy as np

# -- the C structures (field order and types as in c_api.h) -------------------------------------------


class _InternalExtension(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("type", C.c_int), ("next", C.c_void_p)]


class _ApiVersion(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p),
                ("major_version", C.c_int), ("minor_version", C.c_int)]


class _Metadata(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("api_version", _ApiVersion), ("traits", C.c_uint32),
                ("state_type_id", C.c_int64)]


class _MetadataExtension(C.Structure):
    _fields_ = [("extension_base", _InternalExtension), ("metadata", C.POINTER(_Metadata))]


class _ByteSpan(C.Structure):
    _fields_ = [("ptr", C.c_void_p), ("len", C.c_size_t)]


class _List(C.Structure):
    """``XLA_FFI_Args`` and ``XLA_FFI_Rets`` (same layout)."""

    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("size", C.c_int64),
                ("types", C.POINTER(C.c_int)), ("items", C.POINTER(C.c_void_p))]


class _Attrs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("size", C.c_int64),
                ("types", C.POINTER(C.c_int)), ("names", C.POINTER(C.POINTER(_ByteSpan))),
                ("attrs", C.POINTER(C.c_void_p))]


class _CallFrame(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("api", C.c_void_p),
                ("ctx", C.c_void_p), ("stage", C.c_int), ("args", _List), ("rets", _List), ("attrs", _Attrs),
                ("future", C.c_void_p)]


class _Buffer(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("dtype", C.c_int),
                ("data", C.c_void_p), ("rank", C.c_int64), ("dims", C.POINTER(C.c_int64))]


class _Scalar(C.Structure):
    _fields_ = [("dtype", C.c_int), ("value", C.c_void_p)]


class _ContextArgs(C.Structure):
    """``XLA_FFI_Stream_Get_Args`` (``out`` is a ``void*``)."""

    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("ctx", C.c_void_p),
                ("out", C.c_void_p)]


class _DeviceOrdinalArgs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("ctx", C.c_void_p),
                ("device_ordinal", C.c_int32)]


class _ErrorCreateArgs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("message", C.c_char_p),
                ("errc", C.c_int)]


class _ErrorDestroyArgs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("error", C.c_void_p)]


class _TypeId(C.Structure):
    _fields_ = [("type_id", C.c_int64)]


_DELETER = C.CFUNCTYPE(None, C.c_void_p)


class _TypeInfo(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("deleter", C.c_void_p)]


class _StateSetArgs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("ctx", C.c_void_p),
                ("stage", C.c_int), ("type_id", C.POINTER(_TypeId)), ("state", C.c_void_p)]


_FUNCTIONS = ("Error_Create", "Error_GetDetails", "Error_Destroy", "Handler_Register", "Stream_Get",
              "Type_Register", "InvokeContext_Get", "State_Set", "State_Get", "DeviceMemory_Allocate",
              "DeviceMemory_Free", "ThreadPool_Schedule", "ThreadPool_NumThreads", "Future_Create",
              "Future_SetAvailable", "Future_SetError", "RunId_Get", "DeviceOrdinal_Get")


class _Api(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("extension_start", C.c_void_p), ("api_version", _ApiVersion),
                ("internal_api", C.c_void_p)] + [(name, C.c_void_p) for name in _FUNCTIONS]


_HANDLER = C.CFUNCTYPE(C.c_void_p, C.c_void_p)       # XLA_FFI_Error* (*)(XLA_FFI_CallFrame*)
# XLA's API functions are called with the GIL held (PYFUNCTYPE): each returns at once, and releasing and
# re-taking the GIL around a call costs more than the call itself (0.8 us per query on a 2-core CPU, and
# far more while other XLA threads wait for the GIL).
_ERROR_CREATE = C.PYFUNCTYPE(C.c_void_p, C.POINTER(_ErrorCreateArgs))
_ERROR_DESTROY = C.PYFUNCTYPE(None, C.POINTER(_ErrorDestroyArgs))
_BY_ADDRESS = C.PYFUNCTYPE(C.c_void_p, C.c_void_p)    # Stream_Get / DeviceOrdinal_Get, args passed by address
_STATE_SET = C.PYFUNCTYPE(C.c_void_p, C.POINTER(_StateSetArgs))

# The hot path reads the call frame as 64-bit words: ``_WORDS[address >> 3]`` is the aligned word at
# ``address`` (an unchecked view of the process's memory, like ``from_address``, at a third of its cost:
# no ctypes object is made per read).  Every field read this way is a pointer or an int64 of a structure
# that XLA allocates with pointer alignment; the int32 fields are the low half of their word (x86-64 and
# aarch64 are little-endian).  Word indices of the fields, from the structures above:
_WORDS = (C.c_uint64 * (1 << 57)).from_address(0)
_W = C.sizeof(C.c_uint64)
assert C.sizeof(C.c_void_p) == _W and sys.byteorder == "little", "the XLA FFI hot path reads 64-bit words"
_FW_API = _CallFrame.api.offset // _W
_FW_CTX = _CallFrame.ctx.offset // _W
_FW_STAGE = _CallFrame.stage.offset // _W
_FW_EXTENSION = _CallFrame.extension_start.offset // _W
_BW_DATA = _Buffer.data.offset // _W
_SW_VALUE = _Scalar.value.offset // _W
_EW_TYPE = _InternalExtension.type.offset // _W
_LOW32 = 0xFFFFFFFF
assert all(f.offset % _W == 0 for f in (_CallFrame.api, _CallFrame.ctx, _CallFrame.stage, _CallFrame.args,
                                         _CallFrame.rets, _CallFrame.attrs, _Buffer.data, _Scalar.value,
                                         _InternalExtension.type)), "XLA FFI struct layout"

# The same memory as bytes, for ``struct`` reads of several fields at once: one ``unpack_from`` of the call
# frame's hot fields costs what two word reads do.
_MEMORY = memoryview(_WORDS).cast("B")


def _fields_reader(fields: list[tuple[int, str]]) -> Callable[[memoryview, int], tuple]:
    """``unpack_from`` of the fields at the given ``(byte offset, struct code)`` of a structure, in order."""
    layout, at = "<", 0
    for offset, code in fields:
        layout += f"{offset - at}x{code}" if offset > at else code
        at = offset + struct.calcsize("<" + code)
    return struct.Struct(layout).unpack_from


# api, ctx, argument count and buffer table, result count and buffer table, attribute count and values
_read_frame = _fields_reader([
    (_CallFrame.api.offset, "Q"), (_CallFrame.ctx.offset, "Q"),
    (_CallFrame.args.offset + _List.size.offset, "q"), (_CallFrame.args.offset + _List.items.offset, "Q"),
    (_CallFrame.rets.offset + _List.size.offset, "q"), (_CallFrame.rets.offset + _List.items.offset, "Q"),
    (_CallFrame.attrs.offset + _Attrs.size.offset, "q"), (_CallFrame.attrs.offset + _Attrs.attrs.offset, "Q")])
_pointer_readers: dict[int, Callable[[memoryview, int], tuple]] = {}


def _pointer_reader(count: int) -> Callable[[memoryview, int], tuple]:
    """``unpack_from`` of ``count`` consecutive pointers."""
    return _pointer_readers.setdefault(count, struct.Struct(f"<{count}Q").unpack_from)


# Byte offsets of the fields the structured (slow-path) readers use.
_FRAME_API = _CallFrame.api.offset
_FRAME_ARGS = _CallFrame.args.offset
_FRAME_RETS = _CallFrame.rets.offset
_FRAME_ATTRS = _CallFrame.attrs.offset
_LIST_SIZE = _List.size.offset               # size, types, items follow each other
_ATTRS_SIZE = _Attrs.size.offset             # size, types, names, attrs follow each other
_VOID_P = C.c_void_p
_LIST_HEADER = struct.Struct("qPP")           # XLA_FFI_Args/Rets: size, types, items
_ATTRS_HEADER = struct.Struct("qPPP")         # XLA_FFI_Attrs: size, types, names, attrs
_POINTER_BYTES = C.sizeof(C.c_void_p)
_INT_BYTES = C.sizeof(C.c_int)
_S64 = 5                                      # XLA_FFI_DataType_S64


def _read(fmt: struct.Struct, address: int) -> tuple:
    """Several fields at once (one copy of the bytes, one unpack)."""
    return fmt.unpack(C.string_at(address, fmt.size))


def _word(address: int) -> int:
    """One pointer-sized field at any address."""
    return _VOID_P.from_address(address).value or 0


@functools.lru_cache(maxsize=None)
def _pointers(count: int) -> struct.Struct:
    return struct.Struct(f"{count}P")


_EXTENSION_METADATA = 1
_STAGE_INSTANTIATE = 0
_STAGE_EXECUTE = 3
_ATTR_SCALAR = 3
_TRAIT_COMMAND_BUFFER_COMPATIBLE = 1
_API_VERSION = (0, 1)          # the oldest API whose structures this module reads

_ERROR_CODES = ((ValueError, 3), (NotImplementedError, 12))   # INVALID_ARGUMENT, UNIMPLEMENTED
_INTERNAL = 13

# XLA_FFI_DataType (== xla::PrimitiveType) -> NumPy.
DTYPES: dict[int, np.dtype] = {
    1: np.dtype(np.bool_), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
    5: np.dtype(np.int64), 6: np.dtype(np.uint8), 7: np.dtype(np.uint16), 8: np.dtype(np.uint32),
    9: np.dtype(np.uint64), 10: np.dtype(np.float16), 11: np.dtype(np.float32), 12: np.dtype(np.float64),
    16: np.dtype(ml_dtypes.bfloat16), 19: np.dtype(ml_dtypes.float8_e5m2),
    20: np.dtype(ml_dtypes.float8_e4m3fn),
}


# -- what the Python function sees ------------------------------------------------------------------

class Buffer(NamedTuple):
    """One argument or result of the call: an address in the platform's memory, shape and dtype."""

    address: int
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def host_array(buffer: Buffer, *, writeable: bool) -> np.ndarray:
    """A NumPy view of a host (CPU) buffer, without copying."""
    if buffer.nbytes == 0:
        return np.empty(buffer.shape, buffer.dtype)
    raw = (C.c_uint8 * buffer.nbytes).from_address(buffer.address)
    array = np.frombuffer(raw, dtype=buffer.dtype).reshape(buffer.shape)
    array.flags.writeable = writeable
    return array


class _Functions(NamedTuple):
    """The XLA FFI API functions a handler calls (one table per process, so built once)."""

    error_create: Any
    error_destroy: Any
    stream_get: Any               # called with the address of a _ContextArgs
    device_ordinal_get: Any       # with the address of a _DeviceOrdinalArgs; None before the API had it


_function_tables: dict[int, _Functions] = {}


def _functions(api_address: int) -> _Functions:
    found = _function_tables.get(api_address)
    if found is None:
        api = _Api.from_address(api_address)
        has_ordinal = api.struct_size > _Api.DeviceOrdinal_Get.offset and api.DeviceOrdinal_Get
        found = _function_tables.setdefault(api_address, _Functions(
            _ERROR_CREATE(api.Error_Create), _ERROR_DESTROY(api.Error_Destroy), _BY_ADDRESS(api.Stream_Get),
            _BY_ADDRESS(api.DeviceOrdinal_Get) if has_ordinal else None))
    return found


class _QueryArgs:
    """One thread's argument structures for the stream and device queries (filled in place per call)."""

    def __init__(self):
        self.stream = _ContextArgs(C.sizeof(_ContextArgs), None, None, None)
        self.stream_address = C.addressof(self.stream)
        self.device = _DeviceOrdinalArgs(C.sizeof(_DeviceOrdinalArgs), None, None, 0)
        self.device_address = C.addressof(self.device)
        assert self.stream_address % _W == 0 and self.device_address % _W == 0, "read as words"
        self.words = (self.stream_address // _W, self.device_address // _W)


_QW_CTX = _ContextArgs.ctx.offset // _W
_QW_OUT = _ContextArgs.out.offset // _W
_QW_ORDINAL = _DeviceOrdinalArgs.device_ordinal.offset // _W
assert _DeviceOrdinalArgs.ctx.offset == _ContextArgs.ctx.offset and _DeviceOrdinalArgs.device_ordinal.offset % _W == 0

# By OS thread id, not threading.local: ctypes enters a callback on a thread Python did not start (XLA's) with a
# fresh Python thread state each time, whose thread-local data would start empty on every call.
_query_args: dict[int, _QueryArgs] = {}
_get_ident = threading.get_ident


def _thread_query_args() -> _QueryArgs:
    ident = _get_ident()
    args = _query_args.get(ident)
    if args is None:
        args = _query_args.setdefault(ident, _QueryArgs())
    return args


def _stream(functions: _Functions, ctx: int) -> int:
    """XLA's ``cudaStream_t`` of the call whose execution context is ``ctx``."""
    args = _query_args.get(_get_ident()) or _thread_query_args()
    words, stream_word = _WORDS, args.words[0]
    words[stream_word + _QW_CTX] = ctx
    error = functions.stream_get(args.stream_address)
    if error:
        _raise(functions, error, "XLA_FFI_Stream_Get")
    return words[stream_word + _QW_OUT]


def _device(functions: _Functions, ctx: int) -> int | None:
    """The device ordinal of the call whose execution context is ``ctx`` (``None`` when the runtime predates
    the query)."""
    if functions.device_ordinal_get is None:
        return None
    args = _query_args.get(_get_ident()) or _thread_query_args()
    words, device_word = _WORDS, args.words[1]
    words[device_word + _QW_CTX] = ctx
    error = functions.device_ordinal_get(args.device_address)
    if error:
        _raise(functions, error, "XLA_FFI_DeviceOrdinal_Get")
    return words[device_word + _QW_ORDINAL] & _LOW32


def _raise(functions: _Functions, error: int, what: str) -> None:
    functions.error_destroy(C.byref(_ErrorDestroyArgs(C.sizeof(_ErrorDestroyArgs), None, error)))
    raise RuntimeError(f"{what} failed (is this a GPU call?)")


def _data_addresses(count: int, items: int) -> list[int]:
    """The data addresses of the ``count`` ``XLA_FFI_Buffer*`` listed at ``items``."""
    words, read = _WORDS, _pointer_readers.get(count) or _pointer_reader(count)
    return [words[(b >> 3) + _BW_DATA] for b in read(_MEMORY, items)]


_new_tuple = tuple.__new__


class Snapshot(NamedTuple):
    """What a GPU handler reads of a call, in one pass (:meth:`Call.snapshot`)."""

    key: int                      # the call site's single int64 attribute
    addresses: list[int]          # the argument addresses, then the result addresses
    stream: int                   # XLA's cudaStream_t
    device: int | None            # the device ordinal (None when the runtime predates the query)


class Call:
    """One execution of a target: its buffers, attributes and (GPU) stream and device."""

    __slots__ = ("_frame",)

    def __init__(self, frame: int):
        self._frame = frame

    @property
    def args(self) -> tuple[Buffer, ...]:
        return _buffers(self._frame + _FRAME_ARGS)

    @property
    def rets(self) -> tuple[Buffer, ...]:
        return _buffers(self._frame + _FRAME_RETS)

    def attributes(self) -> dict[str, Any]:
        """The scalar attributes of the call site, by name."""
        attrs = _Attrs.from_address(self._frame + _FRAME_ATTRS)
        found = {}
        for i in range(attrs.size):
            if attrs.types[i] != _ATTR_SCALAR:
                continue
            span = attrs.names[i].contents
            scalar = C.cast(attrs.attrs[i], C.POINTER(_Scalar)).contents
            dtype = DTYPES[scalar.dtype]
            found[C.string_at(span.ptr, span.len).decode()] = np.frombuffer(
                C.string_at(scalar.value, dtype.itemsize), dtype)[0].item()
        return found

    def int64_attribute(self, name: str) -> int:
        """The int64 scalar attribute ``name`` - the fast path of :meth:`attributes` for a handler that
        knows its call sites."""
        count, types, names, values = _read(_ATTRS_HEADER, self._frame + _FRAME_ATTRS + _ATTRS_SIZE)
        wanted = name.encode()
        for i in range(count):
            span = _ByteSpan.from_address(_word(names + i * _POINTER_BYTES))
            if C.string_at(span.ptr, span.len) != wanted:
                continue
            scalar = _Scalar.from_address(_word(values + i * _POINTER_BYTES))
            if C.c_int.from_address(types + i * _INT_BYTES).value != _ATTR_SCALAR or scalar.dtype != _S64:
                raise TypeError(f"attribute {name!r}: expected an int64 scalar")
            return C.c_int64.from_address(scalar.value).value
        raise KeyError(f"attribute {name!r}: not set at this call site")

    def stream(self) -> int:
        """XLA's ``cudaStream_t`` for this call (GPU only)."""
        return _stream(self._functions(), _WORDS[(self._frame >> 3) + _FW_CTX])

    def device_ordinal(self) -> int | None:
        """The device this call runs on, or ``None`` when the runtime predates the query."""
        return _device(self._functions(), _WORDS[(self._frame >> 3) + _FW_CTX])

    def snapshot(self, device: int | None = None) -> Snapshot:
        """The key attribute, buffer addresses, stream and device in one pass over the call frame: the hot
        path of a GPU handler whose call sites carry exactly one attribute, an int64 (else read by name).

        ``device``: the device ordinal when the caller knows it (a process with one GPU), which saves XLA's
        device query (a ctypes call, about a microsecond); ``None`` asks XLA."""
        api, ctx, n_args, args, n_rets, rets, n_attrs, attrs = _read_frame(_MEMORY, self._frame)
        functions = _function_tables.get(api) or _functions(api)
        stream = _stream(functions, ctx)
        if device is None:
            device = _device(functions, ctx)
        addresses = _data_addresses(n_args, args)
        addresses += _data_addresses(n_rets, rets)
        key = self._key(attrs) if n_attrs == 1 else self.int64_attribute("key")
        # tuple.__new__ skips the named tuple's Python-level __new__ (0.3 us of a 4.5 us read on a 2-core CPU)
        return _new_tuple(Snapshot, (key, addresses, stream, device))

    @staticmethod
    def _key(attrs: int) -> int:
        """The value of a call site's only attribute, an int64 scalar; ``attrs`` is the frame's table of
        attribute values (the named lookup, :meth:`int64_attribute`, serves sites with other attributes)."""
        words = _WORDS
        scalar = words[attrs >> 3] >> 3
        value = words[scalar + _SW_VALUE]
        if words[scalar] & _LOW32 != _S64:
            raise TypeError("the call site's attribute must be an int64 scalar")
        if value & 7:
            return C.c_int64.from_address(value).value
        value = words[value >> 3]
        return value - (1 << 64) if value >> 63 else value        # the word as a signed int64

    def _functions(self) -> _Functions:
        return _functions(_WORDS[(self._frame >> 3) + _FW_API])


def _item_addresses(items: int) -> tuple[int, ...]:
    """The buffer addresses of the ``XLA_FFI_Args``/``XLA_FFI_Rets`` at address ``items``."""
    count, _, table = _read(_LIST_HEADER, items + _LIST_SIZE)
    return _read(_pointers(count), table) if count else ()


def _buffers(items: int) -> tuple[Buffer, ...]:
    found = []
    for address in _item_addresses(items):
        b = _Buffer.from_address(address)
        found.append(Buffer(int(b.data or 0), tuple(b.dims[j] for j in range(b.rank)), DTYPES[b.dtype]))
    return tuple(found)


# -- handlers --------------------------------------------------------------------------------------

class Handler(NamedTuple):
    """A Python function as an XLA FFI handler (:func:`register` keeps registered ones alive)."""

    name: str
    callback: Any           # the ctypes callback object (owns the C function pointer)
    address: int
    state_type: Any = None  # the _TypeId of its executable state (a handler made with ``instantiate=``)


# -- executable-lifetime state ----------------------------------------------------------------------

class _Semaphores:
    """libc's unnamed POSIX semaphores, in memory of libc's ``malloc`` (``None`` where libc lacks them)."""

    BYTES = 64                      # sem_t: 32 bytes on 64-bit glibc and musl

    def __init__(self, libc: Any):
        self.malloc, self.free = libc.malloc, libc.free
        self.malloc.restype, self.malloc.argtypes, self.free.argtypes = C.c_void_p, (C.c_size_t,), (C.c_void_p,)
        self.init, self.trywait, self.destroy = libc.sem_init, libc.sem_trywait, libc.sem_destroy
        self.init.argtypes = (C.c_void_p, C.c_int, C.c_uint)
        self.trywait.argtypes = self.destroy.argtypes = (C.c_void_p,)
        # XLA's deleter, void (*)(void*): sem_post's int result is left in a register that XLA never reads
        self.post = C.cast(libc.sem_post, C.c_void_p).value

    @classmethod
    def load(cls) -> _Semaphores | None:
        try:
            semaphores = cls(C.CDLL(None))
            probe = semaphores.new()
        except (OSError, AttributeError, TypeError):     # TypeError: Windows has no CDLL(None)
            return None
        semaphores.discard(probe)
        return semaphores

    def new(self) -> int:
        address = self.malloc(self.BYTES)
        if not address:
            raise MemoryError("malloc of a semaphore")
        if self.init(address, 0, 0) != 0:            # macOS: unnamed semaphores are not implemented
            self.free(address)
            raise OSError("sem_init failed")
        return address

    def posted(self, address: int) -> bool:
        return self.trywait(address) == 0

    def discard(self, address: int) -> None:
        self.destroy(address)
        self.free(address)


class _States:
    """Python objects held as XLA FFI execution state, dropped (and called, when callable) once XLA has
    destroyed their executable.

    XLA calls a state type's deleter on whichever thread destroys the executable: on the CPU client that
    is usually a thread of its pool, when an execution that held the last reference ends, and at
    interpreter exit it can be after Python began finalizing.  A deleter written in Python needs the GIL
    there, and a thread that takes the GIL once finalization has begun is ended on the spot (Python
    3.12; 3.14 parks it forever): the pool then never sees that thread finish, and the client's destructor
    joins it forever.  With a Python deleter, 2 of 100 exits of ``python -m cudnn_attn.tools.demo`` hung
    that way on a 2-core machine with a third process spinning (0 of 100 with this one), and a script whose
    last execution outlives the interpreter hung every time (``tests/test_jax_lifetime.py``).

    So the deleter needs no Python: each state is one of libc's semaphores (in ``malloc``-ed memory,
    which outlives Python's objects at exit) and XLA's deleter is ``sem_post``.  The objects of posted
    states are dropped by :meth:`release_destroyed`, on the thread of a Python caller: at each
    instantiation (a compilation made a new executable: what it pinned is held by then, so nothing it
    needs is dropped and planned again) and by :func:`release_destroyed_states`.  Where libc has no
    unnamed semaphores (macOS), the deleter is a Python callback that drops the object at once.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._objects: dict[int, Any] = {}
        self._next = 1
        self._semaphores = _Semaphores.load()
        if self._semaphores is None:
            self._python_deleter = _DELETER(self._delete)
            deleter = C.cast(self._python_deleter, C.c_void_p).value
        else:
            deleter = self._semaphores.post
        self.info = _TypeInfo(C.sizeof(_TypeInfo), None, deleter)

    def keep(self, obj: Any) -> int:
        """Hold ``obj``; returns the state pointer to hand to ``XLA_FFI_State_Set`` (a semaphore's address, or a
        number for the Python deleter)."""
        self.release_destroyed()
        with self._lock:
            if self._semaphores is None:
                token, self._next = self._next, self._next + 1
            else:
                token = self._semaphores.new()
            self._objects[token] = obj
        return token

    def release_destroyed(self) -> int:
        """Drop (and call) the objects whose executables XLA has destroyed; returns how many."""
        if self._semaphores is None:
            return 0
        posted = self._semaphores.posted
        with self._lock:
            tokens = [token for token in self._objects if posted(token)]
            objects = [self._objects.pop(token) for token in tokens]
        for token in tokens:
            self._semaphores.discard(token)
        for obj in objects:
            if callable(obj):
                obj()
        return len(objects)

    def discard(self, token: int) -> None:
        """Drop (and call) the object of a state XLA never took."""
        with self._lock:
            obj = self._objects.pop(token, None)
        if self._semaphores is not None:
            self._semaphores.discard(token)
        if callable(obj):
            obj()

    def _delete(self, token: int | None) -> None:
        """The Python deleter (no semaphores): runs on XLA's thread, so it never raises."""
        try:
            with self._lock:
                obj = self._objects.pop(token or 0, None)
            if callable(obj):
                obj()
        except BaseException:       # noqa: BLE001 - nothing may unwind through XLA's C++ frames
            pass

    def __len__(self) -> int:
        return len(self._objects)


_states = _States()


def release_destroyed_states() -> int:
    """Drop the objects held for executables XLA has destroyed since (unpinning their call sites and
    plans); returns how many.  Each instantiation does it too."""
    return _states.release_destroyed()


def live_states() -> int:
    """How many executable states are alive: call sites of executables XLA has not destroyed (the
    destroyed ones are released first)."""
    release_destroyed_states()
    return len(_states)


def _set_state(frame: int, type_id: Any, obj: Any) -> None:
    """Hand ``obj`` to XLA as the state of the call site being instantiated."""
    words = _WORDS
    api = words[(frame >> 3) + _FW_API]
    token = _states.keep(obj)
    args = _StateSetArgs(C.sizeof(_StateSetArgs), None, words[(frame >> 3) + _FW_CTX], _STAGE_INSTANTIATE,
                         C.pointer(type_id), token)
    error = _STATE_SET(_Api.from_address(api).State_Set)(C.byref(args))
    if error:
        _states.discard(token)
        _raise(_functions(api), error, "XLA_FFI_State_Set")


def _error(api_address: int, exc: BaseException) -> int:
    """An ``XLA_FFI_Error`` carrying ``exc``'s type and message (its code from :data:`_ERROR_CODES`)."""
    code = next((c for kind, c in _ERROR_CODES if isinstance(exc, kind)), _INTERNAL)
    message = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")
    args = _ErrorCreateArgs(C.sizeof(_ErrorCreateArgs), None, message, code)
    return _functions(api_address).error_create(C.byref(args))


_exit_hook_registered = False


def finish_pending_calls() -> None:
    """Wait for in-flight computations (see the module doc); never raises at exit."""
    try:
        import jax

        for array in jax.live_arrays():
            array.block_until_ready()
    except Exception:
        pass


def make_handler(name: str, fn: Callable[[Call], None], *, command_buffer_compatible: bool = False,
                 instantiate: Callable[[Call], Any] | None = None) -> Handler:
    """Wrap ``fn(call)`` as an XLA FFI handler.

    ``command_buffer_compatible`` declares that every call launches the same device work for the same
    attributes, so XLA may capture it into a CUDA graph and replay it without running Python; XLA
    re-captures when the buffer addresses change, so ``fn`` must read the addresses on every call
    (never cache them) and must not synchronise or allocate device memory.

    ``instantiate(call)`` (a call with attributes, no buffers) runs once per call site of every
    executable XLA builds; what it returns is kept until XLA destroys that executable, then called if
    callable (see the module doc).  Without ``register_ffi_type`` in JAX, :func:`register` registers
    the handler without it and says so.
    """
    traits = _TRAIT_COMMAND_BUFFER_COMPATIBLE if command_buffer_compatible else 0
    state_type = _TypeId(0) if instantiate is not None else None

    def handler(frame: int) -> int | None:
        try:
            extension = _WORDS[(frame >> 3) + _FW_EXTENSION]
            if extension and _WORDS[(extension >> 3) + _EW_TYPE] & _LOW32 == _EXTENSION_METADATA:
                metadata = _MetadataExtension.from_address(extension).metadata.contents
                metadata.api_version.major_version, metadata.api_version.minor_version = _API_VERSION
                metadata.traits = traits
                if state_type is not None:
                    metadata.state_type_id = state_type.type_id
                return None
            stage = _WORDS[(frame >> 3) + _FW_STAGE] & _LOW32
            if stage != _STAGE_EXECUTE:
                if stage == _STAGE_INSTANTIATE and state_type is not None:
                    _set_state(frame, state_type, instantiate(Call(frame)))
                return None
            fn(Call(frame))
            return None
        except BaseException as exc:      # nothing may unwind through XLA's C++ frames
            try:
                return _error(_word(frame + _FRAME_API), exc)
            except BaseException:
                traceback.print_exc()
                return None

    global _exit_hook_registered
    if not _exit_hook_registered:
        import jax  # noqa: F401  (JAX's exit hooks first, so that this one runs before them)

        atexit.register(finish_pending_calls)
        _exit_hook_registered = True
    callback = _HANDLER(handler)
    return Handler(name, callback, C.cast(callback, C.c_void_p).value, state_type)


_registered: list[Handler] = []        # XLA holds raw function pointers: their callbacks must never be freed


def register(handler: Handler, platform: str) -> bool:
    """Register ``handler`` as the XLA FFI target ``handler.name`` for ``platform`` (``"cpu"``, ``"CUDA"``),
    and keep it alive for the rest of the process.  Returns whether its instantiate stage (the
    executable-lifetime state) is registered too: ``False`` for a handler made without ``instantiate=``
    and for a JAX without ``jax.ffi.register_ffi_type``.

    Registering for a platform whose plugin is not loaded (CUDA on a CPU-only install) is queued by
    jaxlib until the plugin appears.  A stateful handler is registered for one platform only (each
    platform's runtime numbers its own state types).
    """
    import jax

    capsule = jax.ffi.pycapsule(handler.address)
    stateful = handler.state_type is not None and hasattr(jax.ffi, "register_ffi_type")
    if stateful:
        if any(h is handler for h in _registered):
            raise ValueError(f"handler {handler.name!r}: a stateful handler is registered for one platform")
        jax.ffi.register_ffi_type(f"{handler.name}.executable_state", {
            "type_id": jax.ffi.pycapsule(C.addressof(handler.state_type)),
            "type_info": jax.ffi.pycapsule(C.addressof(_states.info))}, platform=platform)
    _registered.append(handler)
    jax.ffi.register_ffi_target(handler.name, {"instantiate": capsule, "execute": capsule} if stateful else capsule,
                                platform=platform)
    return stateful
