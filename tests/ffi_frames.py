"""An XLA FFI execution call frame built in host memory, to drive the library's FFI handlers without XLA (CPU tests).

Laid out with :mod:`cudnn_attn.jax_bridge.ffi`'s structures, as XLA passes it.
"""

from __future__ import annotations

import ctypes as C

from cudnn_attn.jax_bridge.ffi import (
    _ATTR_SCALAR, _FUNCTIONS, _S64, _STAGE_EXECUTE, _Api, _ApiVersion, _Attrs, _Buffer, _ByteSpan, _CallFrame, _List,
    _Scalar,
)


def _zero_function() -> int:
    """Address of a C function of one pointer argument that returns 0 (XLA's "no error")."""
    libc = C.CDLL(None)
    if libc.geteuid() == 0:
        return C.cast(libc.geteuid, C.c_void_p).value
    return C.cast(libc.sched_yield, C.c_void_p).value      # returns 0; a syscall, so it overstates the cost


class HostCallFrame:
    """An execution call frame laid out as XLA passes it, built in host memory (tests and benchmarks):
    ``n_args`` + ``n_rets`` bf16 buffers at addresses ``0x1000 * (i + 1)`` (never dereferenced), the one
    int64 attribute ``key``, an execution context ``0x77`` and an API table whose functions all return 0
    (no error; the stream and device ordinal read as 0)."""

    def __init__(self, key: int, n_args: int, n_rets: int):
        zero = _zero_function()
        self.api = _Api(C.sizeof(_Api), None, _ApiVersion(C.sizeof(_ApiVersion), None, 0, 4), None,
                        *[zero] * len(_FUNCTIONS))
        self.buffers = [_Buffer(C.sizeof(_Buffer), None, 16, 0x1000 * (i + 1), 0, None)
                        for i in range(n_args + n_rets)]
        self.arg_table = (C.c_void_p * n_args)(*[C.addressof(b) for b in self.buffers[:n_args]])
        self.ret_table = (C.c_void_p * n_rets)(*[C.addressof(b) for b in self.buffers[n_args:]])
        self.types = (C.c_int * max(n_args, n_rets))()
        self.value = C.c_int64(key)
        self.scalar = _Scalar(_S64, C.addressof(self.value))
        self.name = b"key"
        self.span = _ByteSpan(C.cast(C.c_char_p(self.name), C.c_void_p).value, 3)
        self.attr_types = (C.c_int * 1)(_ATTR_SCALAR)
        self.attr_names = (C.POINTER(_ByteSpan) * 1)(C.pointer(self.span))
        self.attr_values = (C.c_void_p * 1)(C.addressof(self.scalar))
        args = _List(C.sizeof(_List), None, n_args, self.types, self.arg_table)
        rets = _List(C.sizeof(_List), None, n_rets, self.types, self.ret_table)
        attrs = _Attrs(C.sizeof(_Attrs), None, 1, self.attr_types, self.attr_names,
                       C.cast(self.attr_values, C.POINTER(C.c_void_p)))
        self.frame = _CallFrame(C.sizeof(_CallFrame), None, C.addressof(self.api), 0x77, _STAGE_EXECUTE,
                                args, rets, attrs, None)
        self.address = C.addressof(self.frame)
