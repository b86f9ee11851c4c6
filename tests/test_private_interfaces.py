"""The private interfaces the library keeps (DESIGN.md, "Private and fragile interfaces"), checked against the
installed libraries themselves: when the cuDNN frontend, jaxlib or CPython changes under one of them, this fails
and names it.  (Built graphs' raw launch path is checked by the deviceless tier:
``tests/deviceless/test_persist_deviceless.py`` asserts ``Launcher.path == "fast"`` for built and loaded plans.)"""

from __future__ import annotations

import ctypes
import sys

import pytest


def test_the_frontend_still_has_the_raw_handle_route():
    """``engine.runtime.create_handle``: ``_pybind_module.create_handle``/``get_stream`` and a public ``Handle`` that
    takes ``(backend_handle, ordinal, stream)``; a raw handle it could not wrap goes back through the public
    ``cudnn.destroy_handle``."""
    cudnn = pytest.importorskip("cudnn")
    from cudnn_attn.engine import runtime

    backend = cudnn._pybind_module
    assert callable(backend.create_handle) and callable(backend.get_stream)
    assert runtime._takes_a_raw_handle(cudnn.Handle), "cudnn.Handle changed: runtime.create_handle falls back"
    assert callable(cudnn.destroy_handle)


def test_the_frontend_still_has_the_raw_launch_entry_points():
    """``engine.launch.Launcher`` (and ``persist.build``'s check of a loaded graph) read the ranked plans
    (``_plans``, ``_plan_index``), whether a plan is a Python engine (``_engine_for``), the backend plan
    (``_materialize_backend_plan``), the variant pack's order (``_variant_pack_uids``) and the lowered graph's
    ``_execute_with_raw_ptrs``."""
    cudnn = pytest.importorskip("cudnn")
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.HALF, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
    for name in ("_variant_pack_uids", "_materialize_backend_plan", "_engine_for"):
        assert callable(getattr(graph, name, None)), f"cudnn.pygraph.{name} is gone: Launcher falls back to execute()"
    assert graph._plans == [] and graph._plan_index == 0, "the ranked plan list changed: Launcher falls back"
    assert hasattr(graph, "_lowered_graph"), "cudnn.pygraph._lowered_graph is gone: Launcher falls back"
    assert callable(getattr(cudnn._pybind_module.backend_graph, "_execute_with_raw_ptrs", None)), \
        "the lowered graph's _execute_with_raw_ptrs is gone: Launcher falls back to execute()"


def test_the_callback_shim_still_holds_the_lowering_closure():
    """``graphs.score_mod._release_lowering`` empties the cells of ``_CallbackGraphShim._lower``: the frontend's
    ``lower_tensor`` closure over the C++ graph and its tensor map (the cycle that kept score_mod graphs alive;
    ``tests/deviceless/test_lifetime_deviceless.py`` checks that they are freed)."""
    pytest.importorskip("cudnn")
    import inspect

    from cudnn import _pygraph

    def lower_tensor(tensor):
        return tensor

    assert _pygraph._CallbackGraphShim(object(), lower_tensor)._lower is lower_tensor

    def nested(code):
        for const in code.co_consts:
            if inspect.iscode(const):
                yield const
                yield from nested(const)

    closures = {c.co_name: c.co_freevars for c in nested(_pygraph.pygraph._lower_to_cpp.__code__)}
    assert {"graph", "tensor_map"} <= set(closures.get("lower_tensor", ())), closures


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


def test_torch_still_has_its_tensor_guard():
    """``torch._C._dynamo.guards.TensorGuards`` with the constructor ``torch.api._tensor_guard`` calls (its public
    fallback is slower: the guard's doc); ``tests/test_torch.py`` holds what it matches to the public reads'."""
    torch = pytest.importorskip("torch")
    from cudnn_attn.torch import api

    x = torch.ones(2, 3)
    matches = api._tensor_guard((x, x.t()))
    assert type(getattr(matches, "__self__", None)) is api._TensorGuards is not None
    assert matches(torch.zeros(2, 3), torch.zeros(2, 3).t()) and not matches(x, x)


def test_torch_still_has_the_autograd_functions_c_entry():
    """``eager.apply_function`` is torch's C entry of ``AttentionFunction`` (what ``torch.autograd.Function.apply``
    calls after its Python checks; its gain is in its doc), and gives the public ``apply``'s results and node."""
    torch = pytest.importorskip("torch")
    from cudnn_attn.torch import api, eager

    assert eager.apply_function is not eager.AttentionFunction.apply
    assert type(eager.apply_function).__name__ == "builtin_function_or_method"
    assert eager.apply_function.__self__ is eager.AttentionFunction
    q = torch.randn(1, 4, 2, 16, dtype=torch.float16, requires_grad=True)
    decision = api._decide((q, q, q, None, None, None), None, False, False, 0, 0.0, 0, "BTNH", None)
    public = eager.AttentionFunction.apply(q, q, q, None, None, None, 0, None, decision)
    entry = eager.apply_function(q, q, q, None, None, None, 0, None, decision)
    assert type(entry[0].grad_fn) is type(public[0].grad_fn)
    assert torch.equal(entry[0], public[0]) and torch.equal(entry[1], public[1])


def test_the_eager_primitive_is_jax_jit():
    """An attention primitive bound outside a trace runs through the public ``jax.jit`` (one per parameters), not
    ``jax._src.dispatch.apply_primitive``: measured on the CI runner, 133.9-136.4 us per eager call against
    139.8-141.2 through ``apply_primitive`` (min over 15 rounds of 200 calls, the CPU reference target)."""
    import inspect

    from cudnn_attn.jax_bridge import primitives

    assert "apply_primitive" not in inspect.getsource(primitives)
    assert primitives.forward.outer.impl.func is primitives._eager


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
