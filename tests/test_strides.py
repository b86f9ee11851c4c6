"""Q/K/V views with their own strides: which views cuDNN reads as they are, and how their strides reach the graph
(the GPU tier runs them: ``tests/gpu/test_strided_gpu.py``)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from cudnn_attn.core.config import AttentionConfig, InputStrides
from cudnn_attn.core.types import AttentionLayout
from cudnn_attn.engine import runtime
from cudnn_attn.graphs import tensors as tt


def _array(shape, strides_elements, itemsize=2, pointer=0x10000):
    return types.SimpleNamespace(ndim=len(shape), shape=shape, itemsize=itemsize,
                                 strides=tuple(s * itemsize for s in strides_elements),
                                 data=types.SimpleNamespace(ptr=pointer))


@pytest.mark.parametrize("shape, strides, readable", [
    ((2, 8, 4, 64), (8 * 4 * 64, 64, 8 * 64, 1), True),          # a (B, N, T, H) view of (B, T, N, H) memory
    ((2, 128, 4, 64), (128 * 8 * 64, 8 * 64, 2 * 64, 1), True),  # every other head
    ((2, 128, 4, 64), (128 * 4 * 128, 4 * 128, 128, 2), False),  # a strided head dim
    ((2, 128, 4, 64), (0, 4 * 64, 64, 1), False),                # a broadcast batch
    ((2, 128, 4, 60), (128 * 4 * 61, 4 * 61, 61, 1), False),     # rows not 16-byte aligned
    ((1, 128, 4, 64), (7, 4 * 64, 64, 1), True),                 # an extent-1 dimension's stride reads nothing
])
def test_readable_strides(shape, strides, readable):
    assert runtime.readable_strides(_array(shape, strides)) is readable


def test_unaligned_data_is_copied():
    assert not runtime.readable_strides(_array((2, 8, 4, 64), (8 * 4 * 64, 64, 8 * 64, 1), pointer=0x10008))


def test_element_strides_normalise_extent_one_dimensions():
    assert runtime.element_strides(_array((1, 128, 4, 64), (7, 4 * 64, 64, 1))) == (128 * 4 * 64, 4 * 64, 64, 1)


def _config(layout, strides=None):
    return AttentionConfig(batch=2, q_heads=4, kv_heads=4, q_len=8, kv_len=8, qk_dim=64, v_dim=64, dtype="bfloat16",
                           layout=layout, strides=strides)


def test_the_graph_reads_the_callers_strides_in_logical_order():
    """The graph's tensors are logical (b, h, s, d): a BTNH view's physical (B, T, N, H) strides are reordered, a
    BNTH view's are taken as they are; arrays without strides keep the layout's dense strides."""
    btnh = _config(AttentionLayout.BTNH, InputStrides(query=(4096, 128, 512, 1)))
    assert tt.q_tensor(btnh) == ((2, 4, 8, 64), (4096, 512, 128, 1))
    assert tt.k_tensor(btnh) == tt.k_tensor(_config(AttentionLayout.BTNH))
    bnth = _config(AttentionLayout.BNTH, InputStrides(value=(2048, 64, 256, 1)))
    assert tt.v_tensor(bnth) == ((2, 4, 8, 64), (2048, 64, 256, 1))
    assert "strided(v)" in bnth.describe()


def test_strided_and_dense_calls_are_different_configurations():
    dense, strided = _config(AttentionLayout.BTNH), _config(AttentionLayout.BTNH, InputStrides(query=(4096, 128, 512, 1)))
    assert dense != strided and hash(dense) != hash(strided)
    assert np.array_equal(tt.q_tensor(dense)[0], tt.q_tensor(strided)[0])



def test_a_padded_run_reads_its_dense_copies_densely():
    """Training with a bias at an odd length runs on padded copies (core.padded_call): those are dense, so the
    padded configuration carries no strides; a folded diagonal changes no array and keeps them."""
    from cudnn_attn.core.config import BiasSpec
    from cudnn_attn.core.padded_call import lifted_config

    strided = AttentionConfig(batch=2, q_heads=4, kv_heads=4, q_len=7, kv_len=8, qk_dim=64, v_dim=64,
                              dtype="bfloat16", training=True, bias=BiasSpec((1, 4, 7, 8), True),
                              strides=InputStrides(query=(7 * 8 * 64, 8 * 64, 64, 1)))
    lifted = lifted_config(strided)
    assert lifted is not None and lifted.q_len == 8 and lifted.strides is None
