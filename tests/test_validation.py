"""validation.validate_call / validate_backward: the configuration it builds, the mask/bias folding, and every
ValueError (type and message)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cudnn_attn.core.config import BiasSpec, DiagonalAlignment, PackingSpec, PagingSpec, StaticMask
from cudnn_attn.core.score_mod_spec import score_mod_spec
from cudnn_attn.core.types import FP8_PARAM_KEYS, AttentionLayout, MaskType
from cudnn_attn.core.validation import LARGE_NEGATIVE, validate_backward, validate_call

RNG = np.random.default_rng(20261130)
B, T, S, N, K, H = 2, 16, 24, 4, 2, 32


def randn(shape, dtype=np.float16):
    return RNG.standard_normal(shape).astype(dtype)


def qkv(layout="BTNH", dtype=np.float16, b=B, t=T, s=S, n=N, k=K, h=H, hv=H):
    if layout == "BTNH":
        return randn((b, t, n, h), dtype), randn((b, s, k, h), dtype), randn((b, s, k, hv), dtype)
    return randn((b, n, t, h), dtype), randn((b, k, s, h), dtype), randn((b, k, s, hv), dtype)


def seqlens(shape=(B,)):
    return RNG.integers(1, T, size=shape).astype(np.int32)


def fp8_params(**override):
    params = {key: np.full((1, 1, 1, 1), RNG.uniform(0.5, 2.0), np.float32) for key in FP8_PARAM_KEYS}
    params.update(override)
    return params


def paged_kv(blocks=7, block_size=8, blocks_per_seq=3, layout="BTNH", dtype=np.float16):
    cache = (blocks, block_size, K, H) if layout == "BTNH" else (blocks, K, block_size, H)
    table = RNG.integers(0, blocks, size=(B, 1, blocks_per_seq, 1)).astype(np.int32)
    return randn(cache, dtype), randn(cache, dtype), table, table.copy()


def score_mod(score, *args):
    return score


# -- the configuration -------------------------------------------------------------------------------

@pytest.mark.parametrize("layout_name, layout", [
    ("BTNH", AttentionLayout.BTNH), ("BNTH", AttentionLayout.BNTH), ("bsnh", AttentionLayout.BTNH),
    ("BNSH", AttentionLayout.BNTH), (AttentionLayout.BNTH, AttentionLayout.BNTH),
], ids=["BTNH", "BNTH", "bsnh-lowercase", "BNSH", "enum"])
def test_shapes_are_read_in_the_layout(layout_name, layout):
    q, k, v = qkv(layout.name, hv=64)
    config, operands = validate_call(q, k, v, qkv_layout=layout_name, scale=0.125)
    assert (config.batch, config.q_len, config.kv_len, config.q_heads, config.kv_heads) == (B, T, S, N, K)
    assert (config.qk_dim, config.v_dim, config.dtype, config.layout) == (H, 64, "float16", layout)
    assert config.q_shape == q.shape and config.k_shape == k.shape and config.v_shape == v.shape
    assert config.scale == 0.125 and config.is_gqa and config.is_mla
    assert operands.query is q and operands.key is k and operands.value is v


@pytest.mark.parametrize("mask_type, window, alignment, expected", [
    (MaskType.NO_MASK, None, "top_left", StaticMask()),
    (MaskType.CAUSAL, None, "top_left", StaticMask(right_bound=0)),
    (MaskType.PADDING, None, "top_left", StaticMask(padding=True)),
    (MaskType.PADDING_CAUSAL, None, "top_left", StaticMask(right_bound=0, padding=True)),
    (MaskType.ALIBI, None, "top_left", StaticMask(right_bound=0, alibi=True)),
    (MaskType.NO_MASK, 5, "top_left", StaticMask(right_bound=0, left_bound=5)),
    (MaskType.PADDING_CAUSAL, 3, "top_left", StaticMask(right_bound=0, left_bound=3, padding=True)),
    (MaskType.CAUSAL, None, "bottom_right",
     StaticMask(right_bound=0, alignment=DiagonalAlignment.BOTTOM_RIGHT)),
    (MaskType.NO_MASK, 4, DiagonalAlignment.BOTTOM_RIGHT,
     StaticMask(right_bound=0, left_bound=4, alignment=DiagonalAlignment.BOTTOM_RIGHT)),
    (MaskType.PADDING, None, "bottom_right", StaticMask(padding=True)),   # no diagonal: alignment dropped
], ids=["none", "causal", "padding", "padding_causal", "alibi", "window", "padding_causal+window",
        "causal-bottom_right", "window-bottom_right-enum", "padding-bottom_right-ignored"])
def test_mask_type_translation(mask_type, window, alignment, expected):
    q, k, v = qkv()
    config, _ = validate_call(q, k, v, q_seqlen=seqlens(), kv_seqlen=seqlens(), mask_type=mask_type,
                              sliding_window_length=window, diagonal_alignment=alignment)
    assert config.mask == expected


def test_seqlens_are_dropped_without_a_padding_mask():
    q, k, v = qkv()
    config, operands = validate_call(q, k, v, q_seqlen=seqlens(), kv_seqlen=seqlens())
    assert not config.mask.padding
    assert operands.q_seqlen is None and operands.kv_seqlen is None


def test_packing_implies_padding_and_counts_segments():
    q, k, v = qkv()
    offsets = np.array([[0, 5, 9, -1], [0, 7, -1, -1]], np.int32)
    config, operands = validate_call(q, k, v, q_seqlen=seqlens((B, 3)), kv_seqlen=seqlens((B, 3)), q_offsets=offsets,
                                     kv_offsets=offsets.copy(), training=True)
    assert config.packing == PackingSpec(max_segments=3) and config.mask.padding
    assert config.segments == B * 3 and config.lse_shape == (B * 3, N, T)
    assert operands.q_offsets is offsets and operands.q_seqlen.shape == (B, 3)


@pytest.mark.parametrize("layout", ["BTNH", "BNTH"])
def test_paging_reads_caches_and_tables(layout):
    q, _, _ = qkv(layout)
    k, v, table_k, table_v = paged_kv(blocks=7, block_size=8, blocks_per_seq=3, layout=layout)
    config, operands = validate_call(q, k, v, q_seqlen=seqlens(), kv_seqlen=seqlens(), page_table_k=table_k,
                                     page_table_v=table_v, qkv_layout=layout)
    assert config.paging == PagingSpec(num_blocks_k=7, num_blocks_v=7, block_size=8, blocks_per_seq=3)
    assert config.kv_len == 24 and config.mask.padding       # 7 blocks >= B * 3 is not required
    assert config.k_shape == k.shape and config.v_shape == v.shape
    assert operands.page_table_k is table_k and operands.q_seqlen is not None


def test_static_flags_and_score_mod_spec():
    q, k, v = qkv()
    args = (randn((N,), np.float32), randn((1, 1), np.float32))
    sink = randn((N,), np.float32)
    config, operands = validate_call(q, k, v, score_mod_args=args, sink=sink, score_mod=score_mod, dropout_rate=0.25,
                                     training=True, deterministic=True)
    assert config.score_mod.name == "score_mod" and config.score_mod.score_shape == (B, N, T, S)
    assert config.score_mod == score_mod_spec(score_mod, (B, N, T, S), config.score_mod.arg_shapes)
    assert config.score_mod.arg_shapes == (((N,), "float32"), ((1, 1), "float32"))
    assert config.sink and config.training and config.deterministic and config.dropout_rate == 0.25
    assert operands.score_mod_args == args and operands.sink is sink


def test_fp8_config_keeps_every_scale():
    q, k, v = qkv(dtype=ml_dtypes.float8_e4m3fn, h=128, hv=128)
    params = fp8_params(descale_q=np.float32(RNG.uniform(1, 2)).reshape(()))
    config, operands = validate_call(q, k, v, fp8_params=params, use_fp8=True, mask_type=MaskType.CAUSAL)
    assert config.fp8 and config.dtype == "float8_e4m3fn" and config.mask.causal
    assert list(operands.fp8_scales) == list(FP8_PARAM_KEYS)
    assert all(operands.fp8_scales[key] is params[key] for key in FP8_PARAM_KEYS)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_configs_are_hashable_and_equal_for_equal_calls(dtype):
    a, _ = validate_call(*qkv(dtype=dtype), mask_type=MaskType.CAUSAL)
    b, _ = validate_call(*qkv(dtype=dtype), mask_type=MaskType.CAUSAL)
    assert a == b and hash(a) == hash(b)
    assert a != validate_call(*qkv(dtype=dtype))[0]


# -- bias and mask folding ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_boolean_mask_becomes_the_large_negative_number(dtype):
    q, k, v = qkv(dtype=dtype)
    mask = RNG.random((T, S)) < 0.5
    config, operands = validate_call(q, k, v, mask=mask)
    name = np.dtype(dtype).name
    expected = np.where(mask, 0, LARGE_NEGATIVE[name]).astype(dtype).reshape(1, 1, T, S)
    assert operands.bias.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(operands.bias, expected)
    assert config.bias == BiasSpec(shape=(1, 1, T, S), differentiable=False)
    assert float(operands.bias.min()) == {"float16": -32768.0, "bfloat16": -2.0 ** 41}[name]


@pytest.mark.parametrize("bias_shape, mask_shape, mask_dtype, spec_shape, differentiable", [
    ((T, S), None, None, (1, 1, T, S), True),
    ((B, N, T, S), None, None, (B, N, T, S), True),
    ((1, N, T, S), (B, 1, T, S), "bool", (B, N, T, S), True),
    (None, (B, 1, 1, S), "bool", (B, 1, T, S), False),          # key-padding mask, broadcast over T
    (None, (N, T, S), "float16", (1, N, T, S), True),           # additive mask is differentiable
    ((B, 1, T, 1), None, None, (B, 1, T, S), True),             # broadcast over S
], ids=["bias-TS", "bias-full", "bias+bool-mask", "bool-key-mask", "additive-mask", "bias-broadcast-S"])
def test_bias_and_mask_fold_into_one_4d_bias(bias_shape, mask_shape, mask_dtype, spec_shape, differentiable):
    q, k, v = qkv()
    bias = None if bias_shape is None else randn(bias_shape)
    if mask_dtype == "bool":
        mask = RNG.random(mask_shape) < 0.5
    else:
        mask = None if mask_shape is None else randn(mask_shape)
    config, operands = validate_call(q, k, v, bias=bias, mask=mask)
    expected = np.zeros(spec_shape, np.float16)
    if bias is not None:
        expected = expected + bias.reshape((1,) * (4 - bias.ndim) + bias.shape)
    if mask is not None:
        additive = np.where(mask, 0, -32768).astype(np.float16) if mask_dtype == "bool" else mask
        expected = expected + additive.reshape((1,) * (4 - additive.ndim) + additive.shape)
    assert config.bias == BiasSpec(shape=spec_shape, differentiable=differentiable)
    assert operands.bias.shape == spec_shape and operands.bias.flags.c_contiguous
    np.testing.assert_array_equal(operands.bias, expected.astype(np.float16))


def test_folding_with_jax_numpy_matches_numpy():
    q, k, v = qkv(dtype=ml_dtypes.bfloat16)
    bias = randn((1, N, T, S), ml_dtypes.bfloat16)
    mask = RNG.random((B, 1, 1, S)) < 0.5
    _, expected = validate_call(q, k, v, bias=bias, mask=mask)
    config, operands = validate_call(*map(jnp.asarray, (q, k, v)), bias=jnp.asarray(bias), mask=jnp.asarray(mask))
    assert isinstance(operands.bias, jax.Array) and config.bias.shape == (B, N, T, S)
    np.testing.assert_array_equal(np.asarray(operands.bias), expected.bias)
    _, with_numpy_xp = validate_call(q, k, v, bias=bias, mask=mask, xp=jnp)   # xp overrides the detection
    assert isinstance(with_numpy_xp.bias, jax.Array)


def test_prepare_under_jit_reads_no_values():
    q, k, v = qkv()
    mask = RNG.random((T, S)) < 0.5

    @jax.jit
    def folded(q, k, v, mask):
        return validate_call(q, k, v, mask=mask, mask_type=MaskType.CAUSAL)[1].bias

    np.testing.assert_array_equal(np.asarray(folded(q, k, v, mask)), validate_call(q, k, v, mask=mask)[1].bias)


@pytest.mark.parametrize("name", ["query", "key", "value", "bias", "mask", "q_seqlen", "sink"])
def test_descriptions_without_data_are_refused(name):
    """``jax.ShapeDtypeStruct`` (or any object with .shape and .dtype) is not an array: refused up front."""
    q, k, v = qkv()
    arrays = dict(query=q, key=k, value=v, bias=randn((B, 1, T, S)), mask=RNG.random((T, S)) < 0.5,
                  q_seqlen=seqlens(), kv_seqlen=seqlens(), sink=randn((N,), np.float32))
    arrays[name] = jax.ShapeDtypeStruct(arrays[name].shape, arrays[name].dtype)
    with pytest.raises(ValueError, match=rf"^{name}: expected an array.*ShapeDtypeStruct \(a shape/dtype description"):
        validate_call(**arrays, mask_type=MaskType.PADDING)


# -- errors -----------------------------------------------------------------------------------------

class From:
    """An argument computed from the other arguments of the valid call."""

    def __init__(self, fn):
        self.fn = fn


def _plain():
    q, k, v = qkv()
    return dict(query=q, key=k, value=v)


def _fp8_base():
    q, k, v = qkv(dtype=ml_dtypes.float8_e4m3fn, h=128, hv=128)
    return dict(query=q, key=k, value=v, use_fp8=True, fp8_params=fp8_params())


def _paged_base():
    k, v, table_k, table_v = paged_kv()
    return dict(_plain(), key=k, value=v, page_table_k=table_k, page_table_v=table_v, q_seqlen=seqlens(),
                kv_seqlen=seqlens())


def _packed_base():
    offsets = np.array([[0, 5, -1], [0, 3, 9]], np.int32)
    return dict(_plain(), q_seqlen=seqlens((B, 2)), kv_seqlen=seqlens((B, 2)), q_offsets=offsets,
                kv_offsets=offsets.copy())


def _call(base, **changes):
    """A builder of ``validate_call`` kwargs: a valid call from ``base`` with ``changes`` applied."""
    def build():
        kwargs = base()
        for name, value in changes.items():
            kwargs[name] = value.fn(kwargs) if isinstance(value, From) else value
        return kwargs
    return build


def _with(**changes):
    return _call(_plain, **changes)


def _fp8(**changes):
    return _call(_fp8_base, **changes)


def _paged(**changes):
    return _call(_paged_base, **changes)


def _packed(**changes):
    return _call(_packed_base, **changes)


ERRORS = [
    # Q/K/V
    ("query-rank-3", _with(query=From(lambda a: a["query"][0])), "query", "must have rank 4, got rank 3"),
    ("key-not-an-array", _with(key=[1.0, 2.0]), "key", "expected an array, got list"),
    ("value-zero-length", _with(value=From(lambda a: a["value"][:, :0])), "value", "every dimension must be >= 1"),
    ("float32-inputs", _with(**{n: From(lambda a, n=n: a[n].astype(np.float32)) for n in ("query", "key", "value")}),
     "query", "dtype must be one of float16, bfloat16, got float32"),
    ("mixed-dtypes", _with(key=From(lambda a: a["key"].astype(ml_dtypes.bfloat16))), "query/key/value",
     "must have the same dtype"),
    ("fp8-without-use_fp8",
     _with(**{n: From(lambda a, n=n: a[n].astype(ml_dtypes.float8_e5m2)) for n in ("query", "key", "value")}),
     "query", "hint: FP8 inputs need use_fp8=True"),
    ("unknown-layout", _with(qkv_layout="BXNH"), "qkv_layout", "unsupported layout 'BXNH'"),
    ("batch-mismatch", _with(key=From(lambda a: a["key"][:1]), value=From(lambda a: a["value"][:1])), "query/key/value",
     "batch sizes must be equal, got 2, 1, 1"),
    ("qk-head-dim", _with(key=From(lambda a: a["key"][..., :16])), "key",
     "head dim 16 must equal the query head dim 32"),
    ("kv-heads", _with(value=From(lambda a: a["value"][:, :, :1])), "value",
     "number of heads 1 must equal the key's 2"),
    ("gqa-not-divisible", _with(key=From(lambda a: randn((B, S, 3, H))), value=From(lambda a: randn((B, S, 3, H)))),
     "key/value", "query heads N=4 must be a multiple of key/value heads K=3"),
    ("kv-lengths", _with(value=From(lambda a: a["value"][:, :S - 1])), "value", f"sequence length {S - 1} must equal"),
    # bias and mask
    ("bias-list", _with(bias=[[0.0]]), "bias", "expected an array or None, got list"),
    ("kv_seqlen-tuple", _with(q_seqlen=seqlens(), kv_seqlen=(3, 4), mask_type=MaskType.PADDING), "kv_seqlen",
     "got tuple"),
    ("bias-rank-5", _with(bias=randn((1, B, N, T, S))), "bias", "does not broadcast to (B, N, T, S)"),
    ("bias-wrong-T", _with(bias=randn((B, N, T + 1, S))), "bias", f"shape {(B, N, T + 1, S)} does not broadcast"),
    ("bias-wrong-heads", _with(bias=randn((B, 3, T, S))), "bias", "each dimension is 1 or the full size"),
    ("bias-dtype", _with(bias=randn((T, S), np.float32)), "bias", "dtype must be one of float16, got float32"),
    ("mask-int", _with(mask=np.ones((T, S), np.int32)), "mask", "dtype must be one of bool, float16, got int32"),
    ("mask-shape", _with(mask=np.ones((T, S + 2), bool)), "mask", "does not broadcast"),
    # sequence lengths and packing
    ("q_seqlen-int64", _with(q_seqlen=np.full((B,), 3, np.int64), kv_seqlen=seqlens(), mask_type=MaskType.PADDING),
     "q_seqlen", "must be int32 of shape (B,) = (2,), got int64[2]"),
    ("kv_seqlen-rank-2", _with(q_seqlen=seqlens(), kv_seqlen=seqlens((B, 1)), mask_type=MaskType.PADDING),
     "kv_seqlen", "got int32[2, 1]"),
    ("q_seqlen-batch", _with(q_seqlen=seqlens((3,)), kv_seqlen=seqlens(), mask_type=MaskType.PADDING),
     "q_seqlen", "(B,) = (2,)"),
    ("padding-without-seqlens", _with(mask_type=MaskType.PADDING), "q_seqlen/kv_seqlen",
     "PADDING requires both q_seqlen and kv_seqlen"),
    ("padding_causal-one-seqlen", _with(mask_type=MaskType.PADDING_CAUSAL, q_seqlen=seqlens()),
     "q_seqlen/kv_seqlen", "PADDING_CAUSAL requires both"),
    ("only-q_offsets", _with(q_offsets=np.zeros((B, 3), np.int32)), "q_offsets/kv_offsets", "both offsets"),
    ("offsets-without-seqlens", _with(q_offsets=np.zeros((B, 3), np.int32), kv_offsets=np.zeros((B, 3), np.int32)),
     "q_seqlen/kv_seqlen", "packed segments (q_offsets/kv_offsets) require both"),
    ("offsets-one-column", _packed(q_offsets=np.zeros((B, 1), np.int32)), "q_offsets", "(B, M + 1)"),
    ("offsets-int64", _packed(kv_offsets=np.zeros((B, 3), np.int64)), "kv_offsets", "must be int32"),
    ("offsets-differ", _packed(kv_offsets=np.zeros((B, 4), np.int32)), "kv_offsets",
     "must have the shape of q_offsets (2, 3)"),
    ("packed-seqlen-rank-1", _packed(q_seqlen=seqlens()), "q_seqlen", "(B, M) with packed segments = (2, 2)"),
    # masks and scalars
    ("mask_type-string", _with(mask_type="causal"), "mask_type", "must be a MaskType"),
    ("window-zero", _with(sliding_window_length=0), "sliding_window_length", "must be an int > 0 or None, got 0"),
    ("window-float", _with(sliding_window_length=2.5), "sliding_window_length", "got 2.5"),
    ("window-bool", _with(sliding_window_length=True), "sliding_window_length", "got True"),
    ("alignment", _with(diagonal_alignment="center"), "diagonal_alignment", "'top_left' or 'bottom_right'"),
    ("dropout-one", _with(dropout_rate=1.0), "dropout_rate", "in [0, 1), got 1.0"),
    ("dropout-negative", _with(dropout_rate=-0.1), "dropout_rate", "got -0.1"),
    ("dropout-string", _with(dropout_rate="0.1"), "dropout_rate", "got '0.1'"),
    ("scale-nan", _with(scale=math.nan), "scale", "a finite real number, got nan"),
    ("scale-inf", _with(scale=-math.inf), "scale", "got -inf"),
    ("scale-bool", _with(scale=True), "scale", "got True"),
    # score_mod and sink
    ("args-without-score_mod", _with(score_mod_args=(randn((1,), np.float32),)), "score_mod_args",
     "given without score_mod"),
    ("score_mod-not-callable", _with(score_mod="tanh"), "score_mod", "must be callable"),
    ("score_mod_args-not-tuple", _with(score_mod=score_mod, score_mod_args=randn((2,), np.float32)),
     "score_mod_args", "must be a tuple of arrays"),
    ("score_mod_arg-not-array", _with(score_mod=score_mod, score_mod_args=(0.5,)), "score_mod_args[0]",
     "must be an array, got float"),
    ("sink-float16", _with(sink=randn((N,))), "sink", f"must be float32 of shape (N,) = ({N},), got float16[{N}]"),
    ("sink-shape", _with(sink=randn((1, N, 1, 1), np.float32)), "sink", "got float32[1, 4, 1, 1]"),
    # fp8
    ("fp8-float16-inputs", _with(use_fp8=True, fp8_params=fp8_params()), "query",
     "dtype must be one of float8_e4m3fn, float8_e5m2 (use_fp8=True), got float16"),
    ("fp8-without-params", _fp8(fp8_params=None), "fp8_params", "use_fp8=True requires fp8_params, a dict"),
    ("fp8-params-list", _fp8(fp8_params=[1.0]), "fp8_params", "got list"),
    ("fp8-missing-keys", _fp8(fp8_params=From(lambda a: {k: v for k, v in a["fp8_params"].items()
                                                    if k not in ("scale_o", "amax_dP")})),
     "fp8_params", "missing keys: amax_dP, scale_o"),
    ("fp8-param-float16",
     _fp8(fp8_params=From(lambda a: dict(a["fp8_params"], scale_s=np.ones((1, 1, 1, 1), np.float16)))),
     "fp8_params['scale_s']", "float32 array with one element"),
    ("fp8-param-python-float", _fp8(fp8_params=From(lambda a: dict(a["fp8_params"], descale_q=1.0))),
     "fp8_params['descale_q']", "got float"),
    # paging
    ("paged-one-table", _paged(page_table_v=None), "page_table_k/page_table_v", "give both page tables"),
    ("paged-table-int64", _paged(page_table_k=From(lambda a: a["page_table_k"].astype(np.int64))), "page_table_k",
     "must be int32 of shape (B, 1, blocks_per_seq, 1), got int64"),
    ("paged-table-rank-3", _paged(page_table_v=From(lambda a: a["page_table_v"][:, 0])), "page_table_v",
     "(B, 1, blocks_per_seq, 1)"),
    ("paged-table-batch",
     _paged(page_table_k=From(lambda a: a["page_table_k"][:1]), page_table_v=From(lambda a: a["page_table_v"][:1])),
     "page_table_k", "batch 1 differs from the query batch 2"),
    ("paged-tables-differ", _paged(page_table_v=From(lambda a: a["page_table_v"][:, :, :2])), "page_table_v",
     "must have the shape of page_table_k (2, 1, 3, 1)"),
    ("paged-block-sizes", _paged(value=From(lambda a: a["value"][:, :4])), "key/value",
     "must have the same block_size, got 8 vs 4"),
    ("paged-without-seqlens", _paged(q_seqlen=None), "q_seqlen/kv_seqlen", "paged attention requires both"),
]


@pytest.mark.parametrize("build, argument, rule", [pytest.param(*case[1:], id=case[0]) for case in ERRORS])
def test_invalid_calls_raise_value_errors_that_explain(build, argument, rule):
    kwargs = build()
    with pytest.raises(ValueError) as raised:
        validate_call(**kwargs)
    message = str(raised.value)
    assert message.startswith(f"{argument}: ") or message.startswith("qkv_layout: "), message
    assert rule in message, message
    if argument != "qkv_layout":
        q = kwargs["query"]
        assert f"query={np.dtype(q.dtype).name}{list(q.shape)}" in message, message


# Well formed, but no front runs them: validation accepts them and the support table (the one authority on
# "unsupported", cudnn_attn.core.support) refuses them - on every front where the reference cannot run them either.
FP8 = ml_dtypes.float8_e4m3fn
REFUSED_BY_THE_TABLE = [
    ("fp8-padding", _fp8(mask_type=MaskType.PADDING, q_seqlen=seqlens(), kv_seqlen=seqlens()),
     "FP8 attention: no mask or a causal mask only, found padding", False),
    ("fp8-alibi", _fp8(mask_type=MaskType.ALIBI), "FP8 attention: no mask or a causal mask only, found ALiBi", True),
    ("fp8-bias", _fp8(bias=randn((T, S))), "FP8 attention: takes no bias", True),
    ("fp8-mask", _fp8(mask=np.ones((T, S), bool)), "FP8 attention: takes no bias", True),
    ("paged-fp8", _paged(use_fp8=True, fp8_params=fp8_params(), **{name: From(lambda a, n=name: a[n].astype(FP8))
                                                                   for name in ("query", "key", "value")}),
     "FP8 attention: no mask or a causal mask only, found padding", False),
    ("paged-packed", _paged(q_seqlen=seqlens((B, 2)), kv_seqlen=seqlens((B, 2)), q_offsets=np.zeros((B, 3), np.int32),
                            kv_offsets=np.zeros((B, 3), np.int32)),
     "packed segments: cannot be combined with paged K/V", True),
]


@pytest.mark.parametrize("build, reason, everywhere", [pytest.param(*case[1:], id=case[0])
                                                       for case in REFUSED_BY_THE_TABLE])
def test_well_formed_calls_no_front_runs_are_the_support_tables_to_refuse(build, reason, everywhere):
    from cudnn_attn.core import support

    config, _ = validate_call(**build())
    reasons = support.not_supported_reasons(config, support.Environment.sm90())
    assert any(r.startswith(reason) for r in reasons), reasons
    on_reference = support.not_supported_reasons(config, front="reference")
    assert any(r.startswith(reason) for r in on_reference) == everywhere, on_reference


def test_fp8_sequence_lengths_without_a_padding_mask_are_ignored_as_for_fp16():
    config, operands = validate_call(**_fp8(q_seqlen=seqlens(), kv_seqlen=seqlens())())
    assert not config.mask.padding and operands.q_seqlen is None and operands.kv_seqlen is None


def test_wrong_dtype_message_carries_a_hint():
    q, k, v = (x.astype(np.float32) for x in qkv())
    with pytest.raises(ValueError, match="hint: cast Q/K/V to float16 or bfloat16"):
        validate_call(q, k, v)


def test_gqa_message_carries_a_hint():
    q, _, _ = qkv()
    k, v = randn((B, S, 3, H)), randn((B, S, 3, H))
    with pytest.raises(ValueError, match="hint: grouped-query attention shares each K/V head"):
        validate_call(q, k, v)


# -- validate_backward ------------------------------------------------------------------------------

def _training_config():
    config, _ = validate_call(*qkv(hv=64), training=True)
    return config


def test_validate_backward_accepts_the_forward_residuals():
    config = _training_config()
    out = randn(config.o_shape)
    validate_backward(config, out, randn(config.o_shape), randn(config.lse_shape, np.float32))


@pytest.mark.parametrize("name, replace, found", [
    ("output", lambda c: randn(c.q_shape), "float16[2, 16, 4, 32]"),
    ("grad_output", lambda c: randn(c.o_shape, ml_dtypes.bfloat16), "bfloat16[2, 16, 4, 64]"),
    ("logsumexp", lambda c: randn((B, T, N), np.float32), "float32[2, 16, 4]"),
    ("logsumexp", lambda c: randn(c.lse_shape), "float16[2, 4, 16]"),
    ("output", lambda c: None, "None"),
], ids=["output-shape", "grad_output-dtype", "lse-shape", "lse-dtype", "output-missing"])
def test_validate_backward_rejects_mismatches(name, replace, found):
    config = _training_config()
    arrays = dict(output=randn(config.o_shape), grad_output=randn(config.o_shape),
                  logsumexp=randn(config.lse_shape, np.float32))
    arrays[name] = replace(config)
    with pytest.raises(ValueError) as raised:
        validate_backward(config, **arrays)
    message = str(raised.value)
    assert message.startswith(f"{name}: expected ") and f"got {found}" in message, message
    assert config.describe() in message
