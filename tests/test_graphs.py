"""Graph construction (default tier: no GPU, no cuDNN library needed).

* every feature declares a graph that the frontend's own ``validate()`` accepts, with exactly the
  tensors the feature needs, under the stable :class:`TensorId` uids;
* Q/K/V/O are declared with the caller's strides (BTNH / BNTH, dense and paged);
* the builder's structural refusals and argument errors;
* ``BuiltGraph.execute`` binds buffers by id (a recording stand-in for the pygraph);
* the packed-segment conversion against plain NumPy loops, also under ``jax.jit``.
"""

from __future__ import annotations

import zlib

import cudnn
import numpy as np
import pytest
from deviceless.matrix import (
    BNTH,
    BR_PADDING_CAUSAL,
    BTNH,
    CAUSAL,
    PADDING,
    PADDING_CAUSAL,
    B,
    N,
    S,
    T,
    bias,
    config,
    fp8,
    packed,
    paged,
    softcap,
)

from cudnn_attn.core.config import AttentionConfig, StaticMask
from cudnn_attn.core.errors import UnsupportedConfigurationError
from cudnn_attn.core.score_mod_spec import score_mod_spec
from cudnn_attn.graphs import BuiltGraph, PlanInfo, TensorId, build_graph, declare_graph, packing
from cudnn_attn.graphs import tensors as tt

T_ = TensorId
CORE_FWD = {T_.Q, T_.K, T_.V, T_.O, T_.STATS}
CORE_BWD = {T_.Q, T_.K, T_.V, T_.O, T_.STATS, T_.DO, T_.DQ, T_.DK, T_.DV}
SEQ = {T_.SEQ_LEN_Q, T_.SEQ_LEN_KV}
RAGGED = {T_.RAGGED_Q, T_.RAGGED_K, T_.RAGGED_V, T_.RAGGED_O, T_.RAGGED_STATS}
FP8_FWD = {T_.DESCALE_Q, T_.DESCALE_K, T_.DESCALE_V, T_.DESCALE_S, T_.SCALE_S, T_.SCALE_O, T_.AMAX_S, T_.AMAX_O}
FP8_BWD = {T_.DESCALE_Q, T_.DESCALE_K, T_.DESCALE_V, T_.DESCALE_O, T_.DESCALE_DO, T_.DESCALE_S, T_.DESCALE_DP,
           T_.SCALE_S, T_.SCALE_DQ, T_.SCALE_DK, T_.SCALE_DV, T_.SCALE_DP,
           T_.AMAX_DQ, T_.AMAX_DK, T_.AMAX_DV, T_.AMAX_DP}

# name -> (config, tensors of the forward, tensors of the backward or None)
FEATURES = {
    "plain": (config(), CORE_FWD, CORE_BWD),
    "inference": (config(training=False), CORE_FWD - {T_.STATS}, None),
    "bf16-BNTH-causal": (config(dtype="bfloat16", layout=BNTH, mask=CAUSAL), CORE_FWD, CORE_BWD),
    "padding": (config(mask=PADDING), CORE_FWD | SEQ, CORE_BWD | SEQ),
    "alibi-causal": (config(mask=StaticMask(right_bound=0, alibi=True)), CORE_FWD, CORE_BWD),
    "window": (config(mask=StaticMask(right_bound=0, left_bound=16)), CORE_FWD, CORE_BWD),
    "bias-dbias": (config(bias=bias((1, N, T, S))), CORE_FWD | {T_.BIAS}, CORE_BWD | {T_.BIAS, T_.DBIAS}),
    "bias-mask-only": (config(bias=bias((B, 1, T, S), False)), CORE_FWD | {T_.BIAS}, CORE_BWD | {T_.BIAS}),
    "dropout": (config(dropout_rate=0.1), CORE_FWD | {T_.SEED, T_.OFFSET}, CORE_BWD | {T_.SEED, T_.OFFSET}),
    "packed": (config(packing=packed(), mask=PADDING_CAUSAL), CORE_FWD | SEQ | RAGGED, CORE_BWD | SEQ | RAGGED),
    "packed-inference": (config(packing=packed(), mask=PADDING, training=False),
                         CORE_FWD - {T_.STATS} | SEQ | RAGGED - {T_.RAGGED_STATS}, None),
    "paged": (config(training=False, paging=paged(), mask=BR_PADDING_CAUSAL),
              CORE_FWD - {T_.STATS} | SEQ | {T_.PAGE_TABLE_K, T_.PAGE_TABLE_V}, None),
    "gqa": (config(q_heads=8, kv_heads=2), CORE_FWD, CORE_BWD),
    "mla": (config(qk_dim=192, v_dim=128), CORE_FWD, CORE_BWD),
    "sink": (config(sink=True), CORE_FWD | {T_.SINK}, CORE_BWD | {T_.SINK, T_.DSINK}),
    "deterministic": (config(deterministic=True), CORE_FWD, CORE_BWD),
    "fp8": (fp8(mask=CAUSAL), CORE_FWD | FP8_FWD, CORE_BWD | FP8_BWD),
}


CASES = [pytest.param(cfg, kind, expected, id=f"{name}-{kind}")
         for name, (cfg, fwd, bwd) in FEATURES.items()
         for kind, expected in (("fwd", fwd), ("bwd", bwd)) if expected is not None]


@pytest.mark.parametrize("cfg, kind, expected", CASES)
def test_every_feature_declares_a_graph_the_frontend_validates(cfg, kind, expected):
    graph, uids = declare_graph(cfg, kind)
    graph.validate()
    assert set(uids) == expected, sorted(t.name for t in set(uids) ^ expected)
    assert all(uids[t] == int(t) and graph.find_tensor(int(t)) is not None for t in uids)


def test_tensor_ids_are_stable():
    # Uids are part of the cache key and of recorded launches: these values must never change.
    assert {t.name: int(t) for t in (T_.Q, T_.K, T_.V, T_.O, T_.STATS, T_.BIAS, T_.DO, T_.DQ, T_.DK, T_.DV,
                                     T_.SEQ_LEN_Q, T_.RAGGED_Q, T_.PAGE_TABLE_K, T_.SEED, T_.DESCALE_Q,
                                     T_.AMAX_O, T_.SCORE_MOD_ARG_0)} == {
        "Q": 1, "K": 2, "V": 3, "O": 4, "STATS": 5, "BIAS": 6, "DO": 10, "DQ": 11, "DK": 12, "DV": 13,
        "SEQ_LEN_Q": 20, "RAGGED_Q": 22, "PAGE_TABLE_K": 30, "SEED": 40, "DESCALE_Q": 50, "AMAX_O": 71,
        "SCORE_MOD_ARG_0": 80}
    assert len({int(t) for t in TensorId}) == len(TensorId)
    assert set(tt.FP8_SCALE_IDS) | set(tt.FP8_AMAX_IDS) >= {"descale_q", "scale_dP", "amax_dQ", "amax_o"}


def _declared(graph, tid):
    t = graph.find_tensor(int(tid))
    return tuple(t.dim), tuple(t.stride)


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize("layout", [BTNH, BNTH], ids=["BTNH", "BNTH"])
def test_tensors_carry_the_callers_strides(layout, kind):
    Bq, Nq, K, Tq, Sk, Dqk, Dv = 3, 8, 2, 48, 80, 128, 64
    cfg = AttentionConfig(batch=Bq, q_heads=Nq, kv_heads=K, q_len=Tq, kv_len=Sk, qk_dim=Dqk, v_dim=Dv,
                          dtype="float16", layout=layout, training=True)
    graph, _ = declare_graph(cfg, kind)

    def strides(heads, length, dim):   # the physical buffer's strides, in logical (B, heads, length, dim) order
        if layout is BTNH:
            return (length * heads * dim, dim, heads * dim, 1)
        return (heads * length * dim, length * dim, dim, 1)

    expected = {T_.Q: ((Bq, Nq, Tq, Dqk), strides(Nq, Tq, Dqk)), T_.K: ((Bq, K, Sk, Dqk), strides(K, Sk, Dqk)),
                T_.V: ((Bq, K, Sk, Dv), strides(K, Sk, Dv)), T_.O: ((Bq, Nq, Tq, Dv), strides(Nq, Tq, Dv)),
                T_.STATS: ((Bq, Nq, Tq, 1), (Nq * Tq, Tq, 1, 1))}
    if kind == "bwd":
        expected.update({T_.DQ: expected[T_.Q], T_.DK: expected[T_.K], T_.DV: expected[T_.V], T_.DO: expected[T_.O]})
    for tid, layout_ in expected.items():
        assert _declared(graph, tid) == layout_, tid.name


@pytest.mark.parametrize("layout", [BTNH, BNTH], ids=["BTNH", "BNTH"])
def test_paged_caches_are_containers_of_blocks(layout):
    cfg = config(training=False, layout=layout, paging=paged(block_size=32), mask=BR_PADDING_CAUSAL,
                 q_heads=8, kv_heads=2)
    graph, _ = declare_graph(cfg, "fwd")
    blocks = cfg.paging.num_blocks_k
    block_strides = (32 * 2 * 64, 64, 2 * 64, 1) if layout is BTNH else (2 * 32 * 64, 32 * 64, 64, 1)
    assert _declared(graph, T_.K) == ((blocks, 2, 32, 64), block_strides)
    assert _declared(graph, T_.PAGE_TABLE_K) == ((B, 1, 4, 1), (4, 4, 1, 1))
    assert graph.find_tensor(int(T_.PAGE_TABLE_V)).data_type == cudnn.data_type.INT32


def test_packed_graph_is_ragged_with_token_major_stats():
    cfg = config(packing=packed(3), mask=PADDING_CAUSAL)
    graph, _ = declare_graph(cfg, "bwd")
    segments = B * 3
    assert _declared(graph, T_.STATS) == ((segments, N, T, 1), (T * N, 1, N, 1))
    assert _declared(graph, T_.SEQ_LEN_Q) == ((segments, 1, 1, 1), (1, 1, 1, 1))
    assert _declared(graph, T_.RAGGED_Q) == ((segments + 1, 1, 1, 1), (1, 1, 1, 1))
    for tid, offset in ((T_.Q, T_.RAGGED_Q), (T_.DQ, T_.RAGGED_Q), (T_.DO, T_.RAGGED_O), (T_.DV, T_.RAGGED_V),
                        (T_.STATS, T_.RAGGED_STATS)):
        assert graph.find_tensor(int(tid)).ragged_offset.uid == int(offset), tid.name


@pytest.mark.parametrize("heads, length, expected", [(8, 128, cudnn.data_type.INT32),
                                                     (128, 65536, cudnn.data_type.INT64)])
def test_ragged_offsets_are_int64_only_when_int32_overflows(heads, length, expected):
    cfg = config(packing=packed(), mask=PADDING, q_heads=heads, kv_heads=heads, q_len=length, kv_len=length, d=128)
    graph, _ = declare_graph(cfg, "fwd")
    assert graph.find_tensor(int(T_.RAGGED_K)).data_type == expected
    assert packing.cudnn_buffers(np, cfg, _segments_example())[T_.RAGGED_K].dtype == \
        (np.int32 if expected == cudnn.data_type.INT32 else np.int64)


def test_host_scalars_are_pass_by_value():
    graph, uids = declare_graph(config(dropout_rate=0.3), "fwd")
    for tid in (T_.SEED, T_.OFFSET):
        t = graph.find_tensor(int(tid))
        assert t.is_pass_by_value and t.data_type == cudnn.data_type.INT64 and tuple(t.dim) == (1, 1, 1, 1)
    assert not graph.find_tensor(int(T_.Q)).is_pass_by_value


def test_rng_dump_is_a_float_BNTS_tensor():
    graph, uids = declare_graph(config(dropout_rate=0.3, q_len=64), "fwd", rng_dump=True)
    assert _declared(graph, T_.RNG_DUMP) == ((B, N, 64, S), (N * 64 * S, 64 * S, S, 1))
    graph.validate()


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize("mask", [StaticMask(), PADDING_CAUSAL], ids=["no-mask", "padding-causal"])
def test_score_mod_arguments_are_by_value_float_scalars(kind, mask):
    pytest.importorskip("jax")
    spec = score_mod_spec(softcap, (B, N, T, S), (((), "float32"),))
    graph, uids = declare_graph(config(score_mod=spec, mask=mask), kind)
    graph.validate()
    arg = graph.find_tensor(int(T_.SCORE_MOD_ARG_0))
    assert arg.is_pass_by_value and arg.data_type == cudnn.data_type.FLOAT and tuple(arg.dim) == (1, 1, 1, 1)
    assert T_.SCORE_MOD_ARG_1 not in uids
    assert (T_.SEQ_LEN_Q in uids) == mask.padding


def test_non_scalar_score_mod_arguments_are_refused():
    spec = score_mod_spec(lambda s, table: s, (B, N, T, S), (((4, 128), "float32"),))
    with pytest.raises(UnsupportedConfigurationError, match="scalars"):
        declare_graph(config(score_mod=spec), "fwd")


@pytest.mark.parametrize("cfg, kind, rule", [
    pytest.param(config(training=False, paging=paged(), mask=BR_PADDING_CAUSAL), "bwd", "no backward", id="paged-bwd"),
    pytest.param(config(packing=packed(), layout=BNTH, mask=PADDING), "fwd", "BTNH", id="packed-BNTH"),
    pytest.param(config(packing=packed(), mask=PADDING, bias=bias((1, N, T, S))), "fwd", "bias", id="packed-bias"),
    pytest.param(fp8(bias=bias((1, N, T, S))), "bwd", "FP8 backward", id="fp8-bwd-bias"),
])
def test_structures_cudnn_cannot_express_are_unsupported(cfg, kind, rule):
    with pytest.raises(UnsupportedConfigurationError, match=rule) as info:
        declare_graph(cfg, kind)
    assert info.value.config is cfg and info.value.cudnn_message is None


@pytest.mark.parametrize("call, argument", [
    pytest.param(lambda: declare_graph(config(), "forward"), "kind", id="kind"),
    pytest.param(lambda: declare_graph(config(dtype="float32"), "fwd"), "config.dtype", id="dtype"),
    pytest.param(lambda: declare_graph(config(), "fwd", target=7), "target", id="target"),
    pytest.param(lambda: build_graph(config(), "fwd", None), "target", id="no-target"),
    pytest.param(lambda: build_graph(config(), "fwd", 7, plan=3), "plan", id="plan"),
])
def test_malformed_requests_raise_value_errors(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


# ---------------------------------------------------------------------------------------------------
# BuiltGraph.execute
# ---------------------------------------------------------------------------------------------------
class _RecordingGraph:
    def __init__(self):
        self.calls = []

    def execute(self, pointers, workspace, *, handle, tensor_uids):
        self.calls.append(("execute", pointers, workspace, handle, tensor_uids))

    def execute_plan_at_index(self, pointers, workspace, index, handle, *, tensor_uids):
        self.calls.append(("at_index", pointers, workspace, index, handle, tensor_uids))


def _built(uids):
    return BuiltGraph(graph=_RecordingGraph(), config=config(dropout_rate=0.1), kind="fwd",
                      uids={t: int(t) for t in uids}, workspace_size=256, plan_name="eng2_k24=7",
                      build_seconds=0.5, num_plans=3, plans=(PlanInfo(0, "eng2_k24=7", 256),))


def test_execute_binds_every_pointer_to_its_uid():
    rng = np.random.default_rng(0)
    ids = [T_.Q, T_.K, T_.V, T_.O, T_.SEED, T_.OFFSET]
    built = _built(ids)
    buffers = {t: int(p) for t, p in zip(ids, rng.integers(1 << 20, 1 << 40, len(ids)))}
    built.execute(buffers, workspace=4096, handle="h")
    built.execute(buffers, workspace=8192, handle="h", plan_index=2)
    (_, pointers, ws, handle, uids), (_, pointers2, ws2, index, _, uids2) = built.graph.calls
    assert dict(zip(uids, pointers)) == {int(t): p for t, p in buffers.items()} == dict(zip(uids2, pointers2))
    assert (ws, handle, ws2, index) == (4096, "h", 8192, 2)
    assert built.host_scalar_ids == {T_.SEED, T_.OFFSET}


@pytest.mark.parametrize("change", ["missing", "extra"])
def test_execute_refuses_a_wrong_set_of_buffers(change):
    built = _built([T_.Q, T_.K, T_.V, T_.O])
    buffers = {T_.Q: 1, T_.K: 2, T_.V: 3, T_.O: 4}
    if change == "missing":
        del buffers[T_.V]
    else:
        buffers[T_.BIAS] = 5
    with pytest.raises(ValueError, match="buffers: .*(missing \\['V'\\]|not in the graph \\['BIAS'\\])"):
        built.execute(buffers, workspace=0, handle=None)
    assert built.graph.calls == []


# ---------------------------------------------------------------------------------------------------
# Packed segments
# ---------------------------------------------------------------------------------------------------
def _segments_example():
    q_off = np.array([[0, 5, 9, -1], [0, 7, -1, -1]], np.int32)
    lengths = np.array([[5, 4, 3], [7, 6, -1]], np.int32)
    return packing.segments(np, lengths, lengths, q_off, q_off, 16, 16)


def _random_packing(rng, batch, max_segments, length):
    """Per-row segments with gaps between them; absent ones are -1 (the API's format)."""
    offsets = np.full((batch, max_segments + 1), -1, np.int32)
    seqlens = np.full((batch, max_segments), -1, np.int32)
    for b in range(batch):
        count = int(rng.integers(1, max_segments + 1))
        cuts = np.sort(rng.choice(np.arange(1, length), size=2 * count - 1, replace=False))
        bounds = np.concatenate([[int(rng.integers(0, cuts[0]))], cuts])
        for m in range(count):
            start, end = bounds[2 * m], bounds[2 * m + 1]
            offsets[b, m], seqlens[b, m] = start, end - start
    return seqlens, offsets


def _loop_segments(q_seqlen, kv_seqlen, q_offsets, kv_offsets, q_len, kv_len):
    """cuDNN's ragged batch, written the obvious way."""
    batch, m = q_seqlen.shape
    rows = [(b, j) for b in range(batch) for j in range(m) if q_offsets[b, j] >= 0 and kv_offsets[b, j] >= 0]
    count = batch * m
    q_len_out = [q_seqlen[b, j] for b, j in rows] + [0] * (count - len(rows))
    kv_len_out = [kv_seqlen[b, j] for b, j in rows] + [0] * (count - len(rows))
    q_start = [b * q_len + q_offsets[b, j] for b, j in rows] + [batch * q_len] * (count + 1 - len(rows))
    kv_start = [b * kv_len + kv_offsets[b, j] for b, j in rows] + [batch * kv_len] * (count + 1 - len(rows))
    return q_len_out, kv_len_out, q_start, kv_start


@pytest.mark.parametrize("seed", range(5))
def test_segments_match_a_numpy_loop(seed):
    rng = np.random.default_rng(seed)
    batch, m, q_len, kv_len = int(rng.integers(1, 5)), int(rng.integers(1, 5)), 64, 96
    q_seqlen, q_offsets = _random_packing(rng, batch, m, q_len)
    kv_seqlen, kv_offsets = _random_packing(rng, batch, m, kv_len)
    kv_offsets[q_offsets < 0] = -1          # a segment needs both sides: align which ones exist
    q_offsets[kv_offsets < 0] = -1
    segs = packing.segments(np, q_seqlen, kv_seqlen, q_offsets, kv_offsets, q_len, kv_len)
    for got, want in zip(segs, _loop_segments(q_seqlen, kv_seqlen, q_offsets, kv_offsets, q_len, kv_len)):
        np.testing.assert_array_equal(got, np.asarray(want, np.int32))
        assert got.dtype == np.int32


def test_segments_under_jax_jit_equal_numpy():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    rng = np.random.default_rng(7)
    q_seqlen, q_offsets = _random_packing(rng, 3, 4, 128)
    fn = jax.jit(lambda *a: packing.segments(jnp, *a, 128, 128))
    got = fn(q_seqlen, q_seqlen, q_offsets, q_offsets)
    want = packing.segments(np, q_seqlen, q_seqlen, q_offsets, q_offsets, 128, 128)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_cudnn_buffers_are_element_offsets():
    cfg = config(packing=packed(3), mask=PADDING, q_heads=8, kv_heads=2, qk_dim=128, v_dim=64)
    segs = _segments_example()
    buffers = packing.cudnn_buffers(np, cfg, segs)
    np.testing.assert_array_equal(buffers[T_.RAGGED_Q], segs.q_start * 8 * 128)
    np.testing.assert_array_equal(buffers[T_.RAGGED_O], segs.q_start * 8 * 64)
    np.testing.assert_array_equal(buffers[T_.RAGGED_K], segs.kv_start * 2 * 128)
    np.testing.assert_array_equal(buffers[T_.RAGGED_V], segs.kv_start * 2 * 64)
    np.testing.assert_array_equal(buffers[T_.RAGGED_STATS], segs.q_start * 8)
    assert buffers[T_.SEQ_LEN_Q] is segs.q_seqlen


@pytest.mark.parametrize("seed", range(3))
def test_lse_conversions_match_loops(seed):
    rng = np.random.default_rng(seed)
    batch, m, q_len, heads = 3, 3, 32, 2
    q_seqlen, q_offsets = _random_packing(rng, batch, m, q_len)
    segs = packing.segments(np, q_seqlen, q_seqlen, q_offsets, q_offsets, q_len, q_len)
    tokens = rng.standard_normal((batch * q_len, heads)).astype(np.float32)
    lse = packing.lse_from_tokens(np, tokens, segs, q_len)
    want = np.zeros((batch * m, heads, q_len), np.float32)
    for i in range(batch * m):
        for t in range(segs.q_seqlen[i]):
            want[i, :, t] = tokens[segs.q_start[i] + t]
    np.testing.assert_array_equal(lse, want)
    back = packing.lse_to_tokens(np, lse, segs, batch * q_len)
    inside = np.zeros(batch * q_len, bool)
    for i in range(batch * m):
        inside[segs.q_start[i]:segs.q_start[i] + segs.q_seqlen[i]] = True
    np.testing.assert_array_equal(back, np.where(inside[:, None], tokens, 0))


# ---------------------------------------------------------------------------------------------------
# GPU: the built graphs compute what the reference computes (fp16; skipped without a GPU)
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpu():
    cupy = pytest.importorskip("cupy")
    try:
        devices = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 -- no driver / no runtime: no GPU
        devices = 0
    if devices < 1:
        pytest.skip("no CUDA GPU (the gpu tier runs on the GPU machine)")
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, cupy.cuda.get_current_stream().ptr)
    yield cupy, handle
    cudnn.destroy_handle(handle)


def _close(got, want, rel=5e-3, name=""):
    """max |got - want| <= rel * max(1, max |want|) (cuDNN fp16 attention: ~3e-4 measured)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    bound = rel * max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max())
    assert err <= bound, f"{name}: max error {err:.3g} > {bound:.3g}"


def _pointers(arrays):
    return {t: (a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr) for t, a in arrays.items()}


def _run(cupy, handle, built, arrays):
    workspace = cupy.empty(max(built.workspace_size, 1), cupy.uint8)
    built.execute(_pointers(arrays), workspace.data.ptr, handle)
    cupy.cuda.get_current_stream().synchronize()


def _packed_inputs(rng, batch, segments, length):
    lengths = np.full((batch, segments), -1, np.int32)
    offsets = np.full((batch, segments + 1), -1, np.int32)
    for b in range(batch):
        count = 1 + b % segments
        starts = np.sort(rng.choice(np.arange(0, length, 8), size=count, replace=False))
        ends = np.append(starts[1:], length)
        offsets[b, :count] = starts
        lengths[b, :count] = [int(rng.integers(1, e - s + 1)) for s, e in zip(starts, ends)]
    return lengths, offsets


def _problem(rng, name):
    """``(prepare kwargs, arrays)`` of one GPU case, random fp16 inputs (never zeros)."""
    from cudnn_attn.core.types import MaskType
    b, t, s, n, k, d = 2, 128, 128, 8, 2, 64
    q = rng.standard_normal((b, t, n, d)).astype(np.float16)
    key = rng.standard_normal((b, s, k, d)).astype(np.float16)
    v = rng.standard_normal((b, s, k, d)).astype(np.float16)
    lengths = np.array([100, 37], np.int32), np.array([128, 64], np.int32)
    kw = dict(scale=d ** -0.5, training=True)
    if name == "causal-gqa":
        return dict(kw, mask_type=MaskType.CAUSAL), (q, key, v)
    if name == "BNTH-bias-padding":
        bias_ = rng.standard_normal((1, n, t, s)).astype(np.float16)
        return dict(kw, qkv_layout="BNTH", mask_type=MaskType.PADDING, bias=bias_, q_seqlen=lengths[0],
                    kv_seqlen=lengths[1]), tuple(np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, key, v))
    if name == "window-sink":
        sink = rng.standard_normal(n).astype(np.float32)
        return dict(kw, mask_type=MaskType.CAUSAL, sliding_window_length=32, sink=sink), (q, key, v)
    if name == "packed-causal":
        q_len, q_off = _packed_inputs(rng, b, 3, t)
        return dict(kw, mask_type=MaskType.CAUSAL, q_seqlen=q_len, kv_seqlen=q_len, q_offsets=q_off,
                    kv_offsets=q_off), (q, key, v)
    raise KeyError(name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal-gqa", "BNTH-bias-padding", "window-sink", "packed-causal"])
def test_gpu_forward_and_backward_match_the_reference(gpu, name):
    from cudnn_attn import reference
    from cudnn_attn.core.validation import validate_call
    cupy, handle = gpu
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    kwargs, (q, k, v) = _problem(rng, name)
    cfg, ops = validate_call(q, k, v, xp=np, **kwargs)
    dev = {T_.Q: cupy.asarray(q), T_.K: cupy.asarray(k), T_.V: cupy.asarray(v),
           T_.O: cupy.zeros(cfg.o_shape, cupy.float16)}
    if cfg.packing is not None:
        segs = packing.segments(cupy, *(cupy.asarray(a) for a in (ops.q_seqlen, ops.kv_seqlen, ops.q_offsets,
                                                                   ops.kv_offsets)), cfg.q_len, cfg.kv_len)
        dev.update(packing.cudnn_buffers(cupy, cfg, segs))
        dev[T_.STATS] = cupy.zeros((cfg.batch * cfg.q_len, cfg.q_heads), cupy.float32)
    else:
        dev[T_.STATS] = cupy.zeros(cfg.lse_shape, cupy.float32)
        if cfg.mask.padding:
            dev[T_.SEQ_LEN_Q], dev[T_.SEQ_LEN_KV] = cupy.asarray(ops.q_seqlen), cupy.asarray(ops.kv_seqlen)
    if cfg.bias is not None:
        dev[T_.BIAS] = cupy.asarray(ops.bias)
    if cfg.sink:
        dev[T_.SINK] = cupy.asarray(ops.sink)

    fwd = build_graph(cfg, "fwd", handle)
    _run(cupy, handle, fwd, {t: dev[t] for t in fwd.uids})
    lse = dev[T_.STATS]
    if cfg.packing is not None:
        lse = packing.lse_from_tokens(cupy, lse, segs, cfg.q_len)
    want = reference.forward(cfg, ops)
    _close(dev[T_.O].get(), want.output, name="O")
    # cuDNN writes -inf into the statistics of padded query rows; the library's convention is 0.
    _close(cupy.where(cupy.isneginf(lse), 0, lse).get(), want.logsumexp, name="logsumexp")

    d_o = rng.standard_normal(cfg.o_shape).astype(np.float16)
    dev.update({T_.DO: cupy.asarray(d_o), T_.DQ: cupy.zeros_like(dev[T_.Q]), T_.DK: cupy.zeros_like(dev[T_.K]),
                T_.DV: cupy.zeros_like(dev[T_.V])})
    if cfg.has_dbias:
        dev[T_.DBIAS] = cupy.zeros(cfg.bias.shape, cupy.float16)
    if cfg.sink:
        dev[T_.DSINK] = cupy.zeros(cfg.q_heads, cupy.float32)
    bwd = build_graph(cfg, "bwd", handle)
    _run(cupy, handle, bwd, {t: dev[t] for t in bwd.uids})
    grads = reference.backward(cfg, ops, dev[T_.O].get(), d_o, lse.get())
    for tid, ref in ((T_.DQ, grads.dq), (T_.DK, grads.dk), (T_.DV, grads.dv), (T_.DBIAS, grads.dbias),
                     (T_.DSINK, grads.dsink)):
        if ref is not None:
            _close(dev[tid].get(), ref, rel=1e-2, name=tid.name)


@pytest.mark.gpu
def test_gpu_dropout_seed_is_a_runtime_host_scalar(gpu):
    from cudnn_attn import reference
    from cudnn_attn.core.validation import validate_call
    cupy, handle = gpu
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((2, 128, 4, 64)).astype(np.float16) for _ in range(3))
    cfg, ops = validate_call(q, k, v, xp=np, scale=0.125, dropout_rate=0.25, training=True)
    built = build_graph(cfg, "fwd", handle, rng_dump=True)
    masks = []
    for seed in (1234, 1234, 99):
        dev = {T_.Q: cupy.asarray(q), T_.K: cupy.asarray(k), T_.V: cupy.asarray(v),
               T_.O: cupy.zeros(cfg.o_shape, cupy.float16), T_.STATS: cupy.zeros(cfg.lse_shape, cupy.float32),
               T_.RNG_DUMP: cupy.zeros((2, 4, 128, 128), cupy.float32),
               T_.SEED: np.array([seed], np.int64), T_.OFFSET: np.array([0], np.int64)}
        _run(cupy, handle, built, dev)
        mask = dev[T_.RNG_DUMP].get()
        masks.append(mask)
        _close(dev[T_.O].get(), reference.forward(cfg, ops, dropout_mask=mask).output, name=f"O seed={seed}")
    assert abs(masks[0].mean() - 0.75) < 0.01 and set(np.unique(masks[0])) <= {0.0, 1.0}
    np.testing.assert_array_equal(masks[0], masks[1])
    assert (masks[0] != masks[2]).mean() > 0.2


@pytest.mark.gpu
def test_gpu_paged_decode_matches_the_reference(gpu):
    from cudnn_attn import reference
    from cudnn_attn.core.types import MaskType
    from cudnn_attn.core.validation import validate_call
    cupy, handle = gpu
    rng = np.random.default_rng(5)
    b, n, d, bs, blocks_per_seq = 2, 4, 64, 32, 4
    blocks = b * blocks_per_seq
    q = rng.standard_normal((b, 1, n, d)).astype(np.float16)
    k_cache, v_cache = (rng.standard_normal((blocks, bs, n, d)).astype(np.float16) for _ in range(2))
    table = rng.permutation(blocks).astype(np.int32).reshape(b, 1, blocks_per_seq, 1)
    q_len, kv_len = np.array([1, 1], np.int32), np.array([128, 77], np.int32)
    cfg, ops = validate_call(q, k_cache, v_cache, q_seqlen=q_len, kv_seqlen=kv_len, page_table_k=table,
                             page_table_v=table, xp=np, scale=0.125, mask_type=MaskType.PADDING)
    built = build_graph(cfg, "fwd", handle)
    dev = {T_.Q: cupy.asarray(q), T_.K: cupy.asarray(k_cache), T_.V: cupy.asarray(v_cache),
           T_.O: cupy.zeros(cfg.o_shape, cupy.float16), T_.SEQ_LEN_Q: cupy.asarray(q_len),
           T_.SEQ_LEN_KV: cupy.asarray(kv_len), T_.PAGE_TABLE_K: cupy.asarray(table),
           T_.PAGE_TABLE_V: cupy.asarray(table)}
    _run(cupy, handle, built, {t: dev[t] for t in built.uids})
    _close(dev[T_.O].get(), reference.forward(cfg, ops).output, name="O")


@pytest.mark.gpu
def test_gpu_every_autotuning_plan_computes_the_same_attention(gpu):
    from cudnn_attn import reference
    from cudnn_attn.core.types import MaskType
    from cudnn_attn.core.validation import validate_call
    from cudnn_attn.graphs import ALL_PLANS
    cupy, handle = gpu
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, 128, 4, 64)).astype(np.float16) for _ in range(3))
    cfg, ops = validate_call(q, k, v, xp=np, scale=0.125, mask_type=MaskType.CAUSAL)
    built = build_graph(cfg, "fwd", handle, plan=ALL_PLANS)
    assert len(built.plans) > 1, built.plans
    want = reference.forward(cfg, ops).output
    for plan in built.plans:
        dev = {T_.Q: cupy.asarray(q), T_.K: cupy.asarray(k), T_.V: cupy.asarray(v),
               T_.O: cupy.zeros(cfg.o_shape, cupy.float16)}
        workspace = cupy.empty(max(plan.workspace_size, 1), cupy.uint8)
        built.execute(_pointers(dev), workspace.data.ptr, handle, plan_index=plan.index)
        cupy.cuda.get_current_stream().synchronize()
        _close(dev[T_.O].get(), want, name=f"O with {plan.name}")
