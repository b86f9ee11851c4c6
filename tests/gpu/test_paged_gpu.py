"""Paged K/V attention (``cudnn_attn.paged_attention``) on the GPU against the float64 reference.

Decode (``T = 1``) and prefill, BTNH caches ``(num_blocks, block_size, K, H)`` and BNTH caches
``(num_blocks, K, block_size, H)``, GQA with 32 query heads over 8 K/V heads, caches holding more
blocks than the sequences use, K and V tables drawn independently from shuffled caches, random
sequence lengths (so partly filled last blocks).

Poison.  Cache blocks that no page table references hold NaN: cuDNN never reads them, so any NaN in a
result means a leak.  Everything cuDNN does read but masks - the tail of a sequence's last blocks and
the query rows past ``q_seqlen`` - holds a large finite constant instead (NaN there propagates through
the masked tile arithmetic; measured on the H200 with cuDNN 9.19, see :mod:`cudnn_attn.engine.prepared`).
The public call allocates its own output, so every element of it is checked finite and against the
reference; so is the native call's output, written into a NaN-filled buffer.

Tolerances: the tier's (``_checks``): relative Frobenius error 2e-3 fp16, 1e-2 bf16.
``tests/gpu/test_api_gpu.py`` already covers a small BTNH fp16 case with no NaN at all.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import MaskType, reference
from cudnn_attn.core.validation import validate_call
from cudnn_attn.engine import prepared
from cudnn_attn.reference.inputs import random_operands

from ._checks import assert_close, io_dtype, poisoned, replace_nan

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

GARBAGE = 8.0     # what cuDNN reads and masks: finite

CASES = {
    # name: call shape; blocks = blocks_per_seq, spare = cache blocks no table references
    "decode-BTNH-gqa-32:8-bf16": dict(B=4, T=1, N=32, K=8, H=128, block=64, blocks=8, spare=7, dtype="bfloat16"),
    "decode-BNTH-gqa-32:8-fp16": dict(B=4, T=1, N=32, K=8, H=128, block=32, blocks=12, spare=5, layout="BNTH"),
    "decode-BTNH-shared-prefix-fp16": dict(B=3, T=1, N=8, K=2, H=128, block=16, blocks=16, spare=9, shared_prefix=True),
    "prefill-BTNH-gqa-32:8-fp16": dict(B=2, T=64, N=32, K=8, H=128, block=64, blocks=6, spare=4),
    "prefill-causal-bottom-right-BNTH-gqa-32:8-bf16": dict(
        B=2, T=64, N=32, K=8, H=128, block=64, blocks=6, spare=3, layout="BNTH", dtype="bfloat16",
        mask_type=MaskType.PADDING_CAUSAL, diagonal_alignment="bottom_right"),
    "prefill-causal-bottom-right-BTNH-d64-fp16": dict(
        B=3, T=96, N=4, K=4, H=64, block=32, blocks=8, spare=6,
        mask_type=MaskType.PADDING_CAUSAL, diagonal_alignment="bottom_right"),
}


def paged_config(*, B, T, N, K, H, block, blocks, spare, dtype="float16", layout="BTNH",
                 mask_type=MaskType.PADDING, diagonal_alignment="top_left"):
    """The AttentionConfig ``prepare`` builds for this paged call (values are never read)."""
    dt = io_dtype(dtype)
    num_blocks = B * blocks + spare
    query = np.empty((B, T, N, H) if layout == "BTNH" else (B, N, T, H), dt)
    cache = np.empty((num_blocks, block, K, H) if layout == "BTNH" else (num_blocks, K, block, H), dt)
    table, seqlen = np.empty((B, 1, blocks, 1), np.int32), np.empty((B,), np.int32)
    config, _ = validate_call(query, cache, cache, None, None, seqlen, seqlen, None, None, table, table,
                              scale=1 / math.sqrt(H), mask_type=mask_type, qkv_layout=layout,
                              diagonal_alignment=diagonal_alignment, xp=np)
    return config


def poisoned_operands(config, rng, *, shared_prefix=False):
    """Random operands with NaN in every cache block no table references and finite garbage wherever
    cuDNN reads past the sequences (see the module doc).  With ``shared_prefix`` the second sequence's
    first K and V blocks are the first sequence's (prefix sharing, as serving systems do)."""
    operands = random_operands(config, rng, poison=True)
    # Every query row must keep a key under bottom-right causal alignment: q_seqlen <= kv_seqlen.
    operands = operands.replace(q_seqlen=np.minimum(operands.q_seqlen, operands.kv_seqlen),
                                query=replace_nan(operands.query, GARBAGE))
    for cache_name, table_name in (("key", "page_table_k"), ("value", "page_table_v")):
        table, cache = getattr(operands, table_name).copy(), getattr(operands, cache_name).copy()
        if shared_prefix:
            table[1, 0, 0, 0] = table[0, 0, 0, 0]
        referenced = np.unique(table)
        cache[referenced] = replace_nan(cache[referenced], GARBAGE)
        cache[np.setdiff1d(np.arange(cache.shape[0]), referenced)] = np.nan    # incl. a block sharing freed
        assert referenced.size < cache.shape[0], "the cache must hold blocks no table references"
        operands = operands.replace(**{cache_name: cache, table_name: table})
    return operands


def to_gpu(operands):
    return operands.replace(**{name: cp.asarray(getattr(operands, name)) for name in (
        "query", "key", "value", "q_seqlen", "kv_seqlen", "page_table_k", "page_table_v")})


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_paged_attention_matches_the_reference_and_never_reads_unused_blocks(case, rng):
    """The public call against the reference (every element finite), rows past ``q_seqlen`` exactly 0,
    and the native call into a NaN-filled buffer (every element written)."""
    call = dict(CASES[case])
    shared_prefix = call.pop("shared_prefix", False)
    config = paged_config(**call)
    operands = poisoned_operands(config, rng, shared_prefix=shared_prefix)
    gpu = to_gpu(operands)
    output = cudnn_attn.paged_attention(
        gpu.query, gpu.key, gpu.value, gpu.q_seqlen, gpu.kv_seqlen, gpu.page_table_k, gpu.page_table_v,
        scale=config.scale, qkv_layout=config.layout.name,
        mask_type=MaskType.PADDING_CAUSAL if config.mask.causal else MaskType.PADDING,
        diagonal_alignment=config.mask.alignment.value)
    expected = reference.forward(config, operands).output
    assert_close("output", output, expected, config.dtype)
    rows = cp.asnumpy(output) if config.layout.name == "BTNH" else cp.asnumpy(output).transpose(0, 2, 1, 3)
    for b, length in enumerate(operands.q_seqlen):
        assert (rows[b, length:] == 0).all(), f"sequence {b}: output rows past q_seqlen = {length} are not 0"
    native = prepared.forward(config, gpu, output=poisoned(config.o_shape, output.dtype))
    assert_close("output (native call, NaN-filled buffer)", native.output, expected, config.dtype)
