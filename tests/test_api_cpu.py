"""What the cuDNN path does without a GPU: clear errors, stream/array parsing, the launcher's binding
logic (with a stand-in for the frontend graph) and the support check that precedes every build."""

from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import MaskType, NoGPUError, UnsupportedConfigurationError
from cudnn_attn.core import settings
from cudnn_attn.core.config import AttentionConfig
from cudnn_attn.core.support import Environment
from cudnn_attn.core.types import FP8_PARAM_KEYS, AttentionOutput
from cudnn_attn.engine import launch, prepared, runtime
from cudnn_attn.engine.cache import GraphKey, PlanChoice
from cudnn_attn.graphs.tensors import TensorId

needs_no_gpu = pytest.mark.skipif(runtime.is_gpu_available(), reason="a GPU is present: NoGPUError cannot happen")


def _qkv(rng, dtype=np.float16, shape=(2, 64, 4, 64)):
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(3))


# -- no GPU ----------------------------------------------------------------------------------------

@needs_no_gpu
@pytest.mark.parametrize("call", ["forward", "backward", "paged"])
def test_no_gpu_is_a_clear_error(call):
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng)
    with pytest.raises(NoGPUError, match="cudnn_attn.reference"):
        if call == "forward":
            cudnn_attn.dot_product_attention(q, k, v, mask_type=MaskType.CAUSAL)
        elif call == "backward":
            lse = rng.standard_normal((2, 4, 64)).astype(np.float32)
            cudnn_attn.dot_product_attention_bwd(q, k, v, q, q, lse)
        else:
            seqlen = np.full((2,), 64, np.int32)
            table = np.arange(4, dtype=np.int32).reshape(2, 1, 2, 1)
            cudnn_attn.paged_attention(q, k.reshape(4, 32, 4, 64), v.reshape(4, 32, 4, 64), seqlen, seqlen,
                                       table, table)


@needs_no_gpu
def test_no_gpu_creates_no_handle(monkeypatch):
    created = []
    monkeypatch.setattr(runtime, "DeviceContext", lambda device: created.append(device))
    q, k, v = _qkv(np.random.default_rng(1))
    with pytest.raises(NoGPUError):
        cudnn_attn.dot_product_attention(q, k, v)
    assert created == []


# -- streams and arrays ----------------------------------------------------------------------------

class _CupyLikeStream:
    ptr = 0x1234


class _TorchLikeStream:
    cuda_stream = 0x5678


class _ProtocolStream:
    def __cuda_stream__(self):
        return (0, 0x9ABC)


@pytest.mark.parametrize("stream, expected", [
    pytest.param(0x42, 0x42, id="int"),
    pytest.param(_CupyLikeStream(), 0x1234, id="cupy-like"),
    pytest.param(_TorchLikeStream(), 0x5678, id="torch-like"),
    pytest.param(_ProtocolStream(), 0x9ABC, id="__cuda_stream__"),
])
def test_stream_pointer(stream, expected):
    assert runtime.stream_pointer(stream, 0) == expected


@pytest.mark.parametrize("stream", [pytest.param("default", id="str"), pytest.param(True, id="bool"),
                                    pytest.param(1.5, id="float")])
def test_stream_pointer_rejects_other_objects(stream):
    with pytest.raises(ValueError, match="stream: expected None, an int cudaStream_t"):
        runtime.stream_pointer(stream, 0)


class _DLPackOnly:
    def __init__(self, kind, index):
        self._device = (kind, index)
        self.shape, self.dtype = (2, 3), np.dtype(np.float16)

    def __dlpack_device__(self):
        return self._device


def test_device_of_reads_dlpack_device():
    assert runtime.device_of("query", _DLPackOnly(2, 3)) == 3


@pytest.mark.parametrize("array", [
    pytest.param(np.zeros((2, 3), np.float16), id="numpy"),
    pytest.param(_DLPackOnly(1, 0), id="dlpack-cpu"),
    pytest.param([1.0, 2.0], id="list"),
])
def test_host_arrays_are_refused_with_the_argument_name(array):
    with pytest.raises(ValueError, match=r"^key: expected a GPU array .*cupy.asarray"):
        runtime.device_of("key", array)


# -- the launcher ----------------------------------------------------------------------------------

class _FakeLowered:
    def __init__(self):
        self.calls = []

    def _execute_with_raw_ptrs(self, address, count, workspace, handle, plan):
        pointers = (ctypes.c_void_p * count).from_address(address)
        self.calls.append(([p or 0 for p in pointers], workspace, handle, plan))


class _FakePyGraph:
    """The private attributes of ``cudnn.pygraph`` the fast path reads (frontend 1.32)."""

    def __init__(self, order, python_engine=False):
        self._plan_index = 1
        self._plans = ["plan0", "plan1"]
        self._order = order
        self._python_engine = python_engine
        self._lowered_graph = _FakeLowered()

    def _engine_for(self, plan):
        return object() if self._python_engine else None

    def _materialize_backend_plan(self, index):
        return types.SimpleNamespace(cpp_index=10 + index)

    def _variant_pack_uids(self):
        return list(self._order)


class _FakeBuilt:
    kind = "fwd"

    def __init__(self, graph, ids):
        self.graph = graph
        self.uids = {tid: int(tid) for tid in ids}
        self.frontend_calls = []

    def execute(self, buffers, workspace, handle, *, plan_index=None):
        self.frontend_calls.append((dict(buffers), workspace, plan_index))


IDS = (TensorId.Q, TensorId.K, TensorId.V, TensorId.O, TensorId.SEED)
CALLER_ORDER = (TensorId.SEED, TensorId.V, TensorId.Q, TensorId.O, TensorId.K)    # any fixed order


def _built(**kw):
    return _FakeBuilt(_FakePyGraph(sorted(int(t) for t in IDS), **kw), IDS)


def test_fast_path_writes_pointers_in_variant_pack_order():
    built = _built()
    launcher = launch.Launcher(built, CALLER_ORDER)
    assert launcher.path == launch.FAST
    launcher([0x50, 0x30, 0x10, 0x40, 0x20], 0x99, types.SimpleNamespace(backend_handle=7))
    (pointers, workspace, handle, plan), = built.graph._lowered_graph.calls
    assert pointers == [0x10, 0x20, 0x30, 0x40, 0x50]  # ascending uid: Q K V O SEED
    assert (workspace, handle, plan) == (0x99, 7, 11)   # the selected plan's backend index
    assert built.frontend_calls == []


def test_fast_path_runs_an_explicit_plan():
    built = _built()
    launch.Launcher(built, IDS, plan_index=0, path=launch.FAST)([1] * 5, 0, types.SimpleNamespace(backend_handle=1))
    assert built.graph._lowered_graph.calls[0][3] == 10


@pytest.mark.parametrize("ids, message", [
    pytest.param(IDS[:4], r"binds exactly .*got \['Q', 'K', 'V', 'O'\]", id="missing"),
    pytest.param(IDS + (TensorId.BIAS,), r"got .*'BIAS'", id="extra"),
    pytest.param(IDS[:4] + (TensorId.BIAS,), r"got .*'BIAS'", id="swapped"),
    pytest.param(IDS + (TensorId.Q,), r"binds exactly", id="repeated"),
])
def test_launcher_refuses_ids_that_are_not_the_graphs(ids, message):
    with pytest.raises(ValueError, match=message):
        launch.Launcher(_built(), ids)


def test_python_engine_falls_back_to_the_frontend():
    built = _built(python_engine=True)
    launcher = launch.Launcher(built, CALLER_ORDER)
    assert launcher.path == launch.FRONTEND
    launcher([5, 3, 1, 4, 2], 0, None)
    assert built.frontend_calls == [({TensorId.SEED: 5, TensorId.V: 3, TensorId.Q: 1, TensorId.O: 4, TensorId.K: 2},
                                     0, None)]
    assert built.graph._lowered_graph.calls == []


def test_missing_private_entry_point_falls_back_to_the_frontend():
    built = _built()
    del built.graph._lowered_graph
    assert launch.Launcher(built, IDS).path == launch.FRONTEND


def test_pack_that_disagrees_with_the_graph_falls_back():
    built = _FakeBuilt(_FakePyGraph([1, 2, 3, 4, 40, 99]), IDS)   # a slot the graph did not declare
    assert launch.Launcher(built, IDS).path == launch.FRONTEND


def test_frontend_path_on_request():
    assert launch.Launcher(_built(), IDS, path=launch.FRONTEND).path == launch.FRONTEND
    with pytest.raises(ValueError, match="path: must be"):
        launch.Launcher(_built(), IDS, path="turbo")


# -- support before build, plan choice, return forms -------------------------------------------------

@pytest.mark.parametrize("builder", ["heuristic", "autotuned"])
def test_unsupported_configuration_is_refused_before_building(monkeypatch, builder):
    import cudnn_attn.graphs as graphs
    from cudnn_attn.engine import autotune, cache

    def never(*args, **kwargs):
        raise AssertionError("build_graph must not run for an unsupported configuration")

    monkeypatch.setattr(graphs, "build_graph", never)
    context = types.SimpleNamespace(environment=Environment(91900, (8, 0), "NVIDIA A100"), device=0)
    monkeypatch.setattr(runtime, "device_context", lambda device, create=True: context)
    config = AttentionConfig(batch=1, q_heads=4, kv_heads=4, q_len=128, kv_len=128, qk_dim=256, v_dim=256,
                             dtype="float16")
    key = GraphKey(config, "fwd", 0, 91900,
                   PlanChoice.HEURISTIC if builder == "heuristic" else PlanChoice.AUTOTUNED)
    with pytest.raises(UnsupportedConfigurationError) as raised:
        cache.build_plan(key) if builder == "heuristic" else autotune.tuned_plan(key, None)
    assert raised.value.reasons and raised.value.config == config


@pytest.mark.parametrize("default, per_call, expected", [
    (False, None, PlanChoice.HEURISTIC),
    (True, None, PlanChoice.AUTOTUNED),
    (True, False, PlanChoice.HEURISTIC),
    (False, True, PlanChoice.AUTOTUNED),
])
def test_autotune_option_and_its_whole_program_default(default, per_call, expected):
    with settings.override(autotune=default):
        assert prepared.plan_choice(per_call) is expected


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), (" ON ", True), ("yes", True), ("0", False),
                                       ("", False), ("off", False), (None, False)])
def test_autotune_environment_variable(value, on):
    environ = {} if value is None else {settings.AUTOTUNE: value}
    assert settings.Settings.from_environment(environ).autotune is on


@pytest.mark.parametrize("bad", [1, "yes", 0.0])
def test_autotune_must_be_a_bool_or_none(bad):
    with pytest.raises(ValueError, match="autotune: must be True, False or None"):
        prepared.plan_choice(bad)


def test_seed_return_forms():
    result = AttentionOutput("o", "lse", "amax_s", "amax_o")
    assert result.seed_form(use_fp8=False, return_residual=False) == "o"
    assert result.seed_form(use_fp8=False, return_residual=True) == ("o", "lse")
    assert result.seed_form(use_fp8=True, return_residual=False) == ("o", "amax_s", "amax_o")


# -- the validation memo -----------------------------------------------------------------------------

def _memo_call(memo, rng, **static):
    q, k, v = _qkv(rng)
    seqlen = np.full((2,), 64, np.int32)
    arrays = dict(query=q, key=k, value=v, q_seqlen=seqlen, kv_seqlen=seqlen)
    return arrays, _validate(memo, arrays, dict(scale=0.125, mask_type=MaskType.CAUSAL, **static))


def _validate(memo, arrays, static):
    return prepared.validated(arrays, static, xp=np, table=memo)


def test_validation_memo_reuses_the_config_and_binds_new_arrays():
    memo, rng = prepared.Calls(), np.random.default_rng(2)
    _, (config, _) = _memo_call(memo, rng)
    arrays, (again, operands) = _memo_call(memo, rng)
    assert again is config
    assert operands.query is arrays["query"] and operands.value is arrays["value"]
    assert operands.q_seqlen is None          # CAUSAL without padding: prepare drops the lengths, so does the memo
    arrays, (padded, operands) = _memo_call(memo, rng, training=True)
    assert padded is not config and padded.training and operands.kv_seqlen is None


def test_validation_memo_checks_every_new_signature():
    memo, rng = prepared.Calls(), np.random.default_rng(3)
    _memo_call(memo, rng)
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="dtype"):
        _validate(memo, dict(query=q, key=k.astype(np.float32), value=v), dict(scale=0.125))
    with pytest.raises(ValueError, match="sliding_window_length"):
        _validate(memo, dict(query=q, key=k, value=v), dict(sliding_window_length=0))


def test_validation_memo_skips_calls_whose_arrays_prepare_transforms():
    memo, rng = prepared.Calls(), np.random.default_rng(4)
    q, k, v = _qkv(rng)
    small_bias = rng.standard_normal((64, 64)).astype(np.float16)   # broadcast to 4-D by prepare
    first = _validate(memo, dict(query=q, key=k, value=v, bias=small_bias), {})
    second = _validate(memo, dict(query=q, key=k, value=v, bias=small_bias), {})
    assert first[0] == second[0] and first[0] is not second[0]
    assert second[1].bias.shape == (1, 1, 64, 64)


# -- the direct path's one allocation for several results ---------------------------------------------------

def test_direct_results_are_aligned_disjoint_views_of_one_allocation(monkeypatch):
    """The backward's dq, dk, dv (odd byte sizes here) come from one pool allocation at 256-byte-aligned,
    disjoint offsets; a later call reuses that block once its results are dropped, and not while one of
    them is alive."""
    from cudnn_attn.engine.call import ResultSpec
    from cudnn_attn.engine.result_blocks import ResultBlocks

    specs = [ResultSpec(name, None, shape, np.dtype(np.float16), None)
             for name, shape in (("dq", (1, 3, 5, 7)), ("dk", (1, 11, 5, 7)), ("dv", (1, 11, 5, 7)))]
    class Plan:                                       # referred to weakly by the prepared call
        results = tuple(specs)

    plan = Plan()
    monkeypatch.setattr(prepared, "plan_for", lambda *a: plan)
    blocks = ResultBlocks()
    config = AttentionConfig(batch=1, q_heads=5, kv_heads=5, q_len=3, kv_len=11, qk_dim=7, v_dim=7,
                             dtype="float16", training=True)
    direct = prepared.PreparedCall(config, "bwd", 0)
    direct.plan()
    allocations = []

    class Memory:                                   # allocations records (address, size): no reference
        def __init__(self, nbytes):
            self.ptr, self.nbytes = 0x10000 * (len(allocations) + 1), nbytes
            allocations.append((self.ptr, nbytes))

    class Pointer:
        def __init__(self, mem, offset):
            self.mem, self.ptr = mem, mem.ptr + offset

    class Array:
        def __init__(self, shape, dtype, data=None):
            self.shape, self.dtype, self.data = shape, dtype, data if data is not None else Pointer(Memory(0), 0)

    class MemoryPointer(Pointer):
        def __add__(self, offset):
            return MemoryPointer(self.mem, self.ptr - self.mem.ptr + offset)

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(alloc=lambda n: MemoryPointer(Memory(n), 0)),
                                 ndarray=Array)
    monkeypatch.setattr(runtime, "cupy", lambda: fake)

    def allocate(stream):
        return blocks.results(direct, stream, direct._nbytes, direct._new_results)
    results = allocate(stream=7)
    sizes = [spec.nbytes for spec in specs]
    assert len(allocations) == 1 and [(r.shape, r.dtype) for r in results] == [(s.shape, s.dtype) for s in specs]
    starts = [r.data.ptr - allocations[0][0] for r in results]
    assert all(start % 256 == 0 for start in starts)
    assert all(a + n <= b for a, n, b in zip(starts, sizes, starts[1:])) and starts[-1] + sizes[-1] <= allocations[0][1]
    dv = results[2]
    del results
    assert allocate(stream=7)[0].data.ptr == allocations[1][0]    # dv alive: a new block
    del dv
    again = allocate(stream=7)                         # the second block, now dropped
    assert len(allocations) == 2 and again[0].data.ptr == allocations[1][0]
    del again
    assert allocate(stream=8)[0].data.ptr == allocations[2][0]    # another stream: its own block
    assert allocate(stream=7)[0].data.ptr == allocations[1][0] and len(allocations) == 3


def test_bound_check_names_the_array_that_differs(monkeypatch):
    """A bound call's signature check, with a stand-in array type: the bound signature passes, and a different
    shape, dtype, device or type is a ValueError naming that array (the GPU tier runs it on CuPy arrays)."""
    from cudnn_attn.fronts import cupy as cupy_front

    class Array:
        def __init__(self, shape, dtype=np.float16, device=0):
            self.shape, self.dtype = shape, np.dtype(dtype)
            self.strides = tuple(int(np.prod(shape[i + 1:])) * self.dtype.itemsize for i in range(len(shape)))
            self.data = types.SimpleNamespace(device_id=device)

    monkeypatch.setattr(cupy_front, "_NDARRAY", Array)
    arrays = (Array((1, 8, 2, 4)), Array((1, 16, 2, 4)), Array((1, 16, 2, 4)))
    direct = types.SimpleNamespace(typed=[(Array, x.shape, x.dtype, x.strides, 0) for x in arrays])
    assert [prepared.descriptor(x) for x in arrays] == direct.typed      # what bind records and the check compares
    bound = cupy_front.BoundAttention.__new__(cupy_front.BoundAttention)
    bound._check(direct, arrays)
    for position, bad in ((1, Array((1, 8, 2, 4))), (2, Array((1, 16, 2, 4), np.float32)),
                          (1, Array((1, 16, 2, 4), device=1)), (0, np.zeros((1, 8, 2, 4), np.float16))):
        given = list(arrays)
        given[position] = bad
        name = ("query", "key", "value")[position]
        with pytest.raises(ValueError, match=f"^{name}: this bound call takes a CuPy array float16"):
            bound._check(direct, tuple(given))


def _fp8_call(memo, rng, scale_dtype=np.float32):
    q, k, v = (rng.integers(0, 120, (2, 64, 4, 64), dtype=np.uint8) for _ in range(3))   # E4M3 bytes
    params = {name: np.full((1, 1, 1, 1), rng.uniform(0.5, 2.0), scale_dtype) for name in FP8_PARAM_KEYS}
    arrays = dict(query=q, key=k, value=v, fp8_params=params)
    static = dict(scale=0.125, mask_type=MaskType.CAUSAL, use_fp8=True, fp8_dtype="float8_e4m3fn")
    return arrays, _validate(memo, arrays, static)


def test_validation_memo_takes_fp8_calls_and_binds_their_new_scales():
    memo, rng = prepared.Calls(), np.random.default_rng(5)
    _, (config, _) = _fp8_call(memo, rng)
    arrays, (again, operands) = _fp8_call(memo, rng)
    assert again is config and config.fp8
    assert operands.query is arrays["query"]
    assert set(operands.fp8_scales) == set(FP8_PARAM_KEYS)
    assert all(operands.fp8_scales[n] is arrays["fp8_params"][n] for n in FP8_PARAM_KEYS)
    with pytest.raises(ValueError, match=r"fp8_params\['\w+'\]: must be a float32 array"):
        _fp8_call(memo, rng, scale_dtype=np.float16)          # a new signature: validated again


def test_fp8_buffers_travel_as_bytes():
    import ml_dtypes

    for name in ("float8_e4m3fn", "float8_e5m2"):
        assert prepared.buffer_dtype(np.dtype(getattr(ml_dtypes, name))) == np.uint8
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.int32):
        assert prepared.buffer_dtype(np.dtype(dtype)) == np.dtype(dtype)
