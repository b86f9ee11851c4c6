"""AttentionConfig says what it means: FP8 is its dtype, packing and paging imply the padding mask, and its
hash (the key of every cache lookup) is computed once and never travels between processes."""

from __future__ import annotations

import pickle

import pytest

from cudnn_attn.config import AttentionConfig, MaskSpec, PackingSpec, PagingSpec

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
    config = BASE.replace(mask=MaskSpec(right_bound=0), **changes)
    assert config.mask == MaskSpec(right_bound=0, padding=True)
    assert config == BASE.replace(mask=MaskSpec(right_bound=0, padding=True), **changes)


def test_the_hash_is_computed_once_and_stays_in_the_process():
    config = BASE.replace(mask=MaskSpec(right_bound=0))
    first = hash(config)
    assert config.__dict__["_hash"] == first and hash(config) == first
    assert hash(BASE.replace(mask=MaskSpec(right_bound=0))) == first and config == BASE.replace(mask=config.mask)
    copy = pickle.loads(pickle.dumps(config))
    assert "_hash" not in copy.__dict__          # str hashes differ between processes: recomputed there
    assert copy == config and hash(copy) == first
