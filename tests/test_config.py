"""AttentionConfig says what it means: FP8 is its dtype, packing and paging imply the padding mask, and its
hash (the key of every cache lookup) is computed once and never travels between processes."""

from __future__ import annotations

import pickle

import pytest

from cudnn_attn.core.config import AttentionConfig, PackingSpec, PagingSpec, StaticMask

BASE = AttentionConfig(batch=2, q_heads=4, kv_heads=2, q_len=16, kv_len=24, qk_dim=64, v_dim=64, dtype="float16")


@pytest.mark.parametrize("dtype, fp8", [("float16", False), ("bfloat16", False), ("float8_e4m3fn", True),
                                        ("float8_e5m2", True), ("float64", False)])
def test_fp8_is_derived_from_the_dtype(dtype, fp8):
    config = BASE.replace(dtype=dtype)
    assert config.fp8 is fp8
    with pytest.raises(TypeError):
        BASE.replace(fp8=True)          # no separate flag that could contradict the dtype


@pytest.mark.parametrize("changes", [dict(packing=PackingSpec(3)),
                                     dict(paging=PagingSpec(num_blocks_k=4, num_blocks_v=4, block_size=8,
                                                            blocks_per_seq=3))],
                         ids=["packing", "paging"])
def test_packing_and_paging_imply_the_padding_mask(changes):
    config = BASE.replace(mask=StaticMask(right_bound=0), **changes)
    assert config.mask == StaticMask(right_bound=0, padding=True)
    assert config == BASE.replace(mask=StaticMask(right_bound=0, padding=True), **changes)


def test_the_hash_is_computed_once_and_stays_in_the_process():
    config = BASE.replace(mask=StaticMask(right_bound=0))
    first = hash(config)
    assert config.__dict__["_hash"] == first and hash(config) == first
    assert hash(BASE.replace(mask=StaticMask(right_bound=0))) == first and config == BASE.replace(mask=config.mask)
    copy = pickle.loads(pickle.dumps(config))
    assert "_hash" not in copy.__dict__          # str hashes differ between processes: recomputed there
    assert copy == config and hash(copy) == first


@pytest.mark.parametrize("changes, argument", [
    (dict(batch=0), "config.batch"), (dict(q_len=-1), "config.q_len"), (dict(qk_dim=64.0), "config.qk_dim"),
    (dict(kv_heads=True), "config.kv_heads"), (dict(q_heads=3), "config.q_heads"),
    (dict(dtype="int8"), "config.dtype"), (dict(layout="BTNH"), "config.layout"),
    (dict(scale=float("nan")), "config.scale"), (dict(scale="0.1"), "config.scale"),
    (dict(dropout_rate=1.0), "config.dropout_rate"), (dict(dropout_rate=-0.1), "config.dropout_rate"),
])
def test_a_configuration_of_no_possible_call_is_refused_naming_the_field(changes, argument):
    with pytest.raises(ValueError, match=argument):
        BASE.replace(**changes)


def test_the_support_query_never_sees_a_configuration_of_no_possible_call():
    """A hand-made configuration with a zero batch is refused, not reported runnable (``[]``)."""
    from cudnn_attn.core import support

    with pytest.raises(ValueError, match="config.batch"):
        support.not_supported_reasons(BASE.replace(batch=0), support.Environment.sm90(91900))
    assert support.not_supported_reasons(BASE, support.Environment.sm90(91900)) == []


def test_numpy_integers_and_reals_are_accepted():
    import numpy as np

    config = BASE.replace(batch=np.int64(3), scale=np.float32(0.5))
    assert config.batch == 3 and config.scale == 0.5
