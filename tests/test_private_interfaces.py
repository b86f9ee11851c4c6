"""The private interfaces the library keeps (DESIGN.md, "Private and fragile interfaces"), checked against the
installed libraries themselves: when the cuDNN frontend, jaxlib or CPython changes under one of them, this fails
and names it.  (Built graphs' raw launch path is checked by the deviceless tier:
``tests/deviceless/test_persist_deviceless.py`` asserts ``Launcher.path == "fast"`` for built and loaded plans.)"""

from __future__ import annotations

import ctypes
import sys

import pytest


def test_the_frontend_still_has_the_raw_handle_route():
    cudnn = pytest.importorskip("cudnn")
    backend = cudnn._pybind_module
    assert callable(backend.create_handle) and callable(backend.get_stream) and callable(backend._raw_destroy_handle)
    assert isinstance(cudnn.Handle, type)


def test_the_frontend_still_has_the_raw_launch_entry_points():
    cudnn = pytest.importorskip("cudnn")
    graph = cudnn.pygraph
    for name in ("_variant_pack_uids", "_materialize_backend_plan", "_engine_for"):
        assert hasattr(graph, name), f"cudnn.pygraph.{name} is gone: engine/launch.py falls back to execute()"


def test_the_word_view_reads_what_ctypes_reads():
    """``ffi._WORDS`` views the process's memory as 64-bit words: a pointer and an int64 written through ctypes read
    back through it (little-endian, 8-byte pointers)."""
    from cudnn_attn.jax_bridge import ffi

    assert sys.byteorder == "little" and ctypes.sizeof(ctypes.c_void_p) == 8
    values = (ctypes.c_uint64 * 3)(0x1234_5678_9ABC_DEF0, 2 ** 63 + 5, 7)
    address = ctypes.addressof(values)
    assert [ffi._WORDS[(address >> 3) + i] for i in range(3)] == list(values)
    record = bytes(ffi._MEMORY[address:address + 8])
    assert int.from_bytes(record, "little") == values[0]


def test_torch_still_has_the_mode_and_transform_queries():
    torch = pytest.importorskip("torch")
    from torch.utils import _python_dispatch

    assert _python_dispatch.is_in_torch_dispatch_mode() is False
    assert torch._C._are_functorch_transforms_active() is False


def test_jax_still_has_the_lowering_device_set():
    from jax._src import dispatch

    from cudnn_attn.jax_bridge import primitives

    assert primitives.forward.outer in dispatch.prim_requires_devices_during_lowering
    assert primitives.backward.inner in dispatch.prim_requires_devices_during_lowering


def test_reference_counts_of_a_kept_block_are_stable_under_this_cpython():
    """``result_blocks`` compares reference counts; a CPython whose counts move without a new reference (immortal
    objects, deferred counting) would make every block look taken (or free) - this catches it."""
    from cudnn_attn.engine.result_blocks import _block

    class Memory:
        pass

    class Pointer:
        def __init__(self):
            self.mem = Memory()

    class Array:
        def __init__(self):
            self.data, self.shape = Pointer(), (2, 3)

    arrays = (Array(), Array())
    block = _block(arrays)
    del arrays
    assert block.free()
    held = block.arrays[1].data              # a reference of the caller's: the block is in use
    assert not block.free()
    del held
    assert block.free()
