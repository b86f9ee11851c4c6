"""The drop-in takes what ``jax.nn.dot_product_attention`` takes and refuses what it refuses, over a table of
inputs: array-likes (lists, tuples, NumPy arrays, Python scalars), bool/int/float biases, bool masks,
lower ranks, and the bad ones.  Where ``jax.nn`` (XLA path, on CPU) returns, the drop-in returns the same
values: relative Frobenius error <= 4e-3 (twice the float16 tolerance of ``test_jax_common``: each side
rounds P or O once).  Where ``jax.nn`` raises, the drop-in raises a ``ValueError`` whose first line starts
with the argument's name.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_jax_common import assert_close

from cudnn_attn import jax_bridge as jb

B, T, S, N, H = 2, 8, 8, 2, 8


def _arrays(rng):
    q, k, v = (rng.standard_normal((B, T, N, H)).astype(np.float16) for _ in range(3))
    bias = rng.standard_normal((T, S)).astype(np.float32)
    keep = rng.random((B, 1, T, S)) > 0.4
    keep[..., np.arange(T), np.arange(S)] = True              # no row fully masked
    return q, k, v, bias, keep


def _accepted(q, k, v, bias, keep):
    """name -> (args, kwargs) that jax.nn.dot_product_attention accepts."""
    return {
        "numpy-qkv": ((q, k, v), {}),
        "bias-list": ((q, k, v), {"bias": bias.tolist()}),
        "bias-tuple": ((q, k, v), {"bias": tuple(tuple(row) for row in bias.tolist())}),
        "bias-python-scalar": ((q, k, v), {"bias": 0.5}),
        "bias-bool": ((q, k, v), {"bias": keep}),
        "bias-int32": ((q, k, v), {"bias": (bias * 2).astype(np.int32)}),
        "bias-float16-keys-only": ((q, k, v), {"bias": bias[:1].astype(np.float16)[None, None]}),
        "mask-list": ((q, k, v), {"mask": keep.tolist()}),
        "mask-keys-only": ((q, k, v), {"mask": keep[:, :, :1]}),
        "mask-python-bool": ((q, k, v), {"mask": True}),
        "rank-3": ((q[0], k[0], v[0]), {"bias": bias}),
        "lengths-list": ((q, k, v), {"query_seq_lengths": [5, 8], "key_value_seq_lengths": (8, 3)}),
        "scale-none": ((q, k, v), {"scale": None}),
        "scale-int": ((q, k, v), {"scale": 1}),
        "causal-window-list": ((q, k, v), {"is_causal": True, "local_window_size": [3, 1]}),
    }


def _refused(q, k, v, bias, keep):
    """name -> (args, kwargs, the argument our error names) that jax.nn.dot_product_attention refuses."""
    return {
        "mask-float-0-1": ((q, k, v), {"mask": keep.astype(np.float32)}, "mask"),
        "mask-int": ((q, k, v), {"mask": keep.astype(np.int32)}, "mask"),
        "value-list": ((q, k, v.tolist()), {}, "query/key/value"),
        "bias-rank-5": ((q, k, v), {"bias": bias[None, None, None]}, "bias"),
        "mask-rank-5": ((q, k, v), {"mask": keep[None]}, "mask"),
        "lengths-float": ((q, k, v), {"query_seq_lengths": np.full((B,), 4.0, np.float32)}, "query_seq_lengths"),
        "lengths-shape": ((q, k, v), {"key_value_seq_lengths": np.full((B + 1,), 4, np.int32)},
                          "key_value_seq_lengths"),
        "key-float32": ((q, k.astype(np.float32), v.astype(np.float32)), {}, "query/key/value"),
        "heads-not-a-multiple": ((q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2)), {}, "key/value"),
        "value-other-length": ((q, k, v[:, :4]), {}, "value"),
        "bias-three-heads": ((q, k, v), {"bias": np.zeros((1, 3, T, S), np.float16)}, "bias"),
        "query-rank-5": ((q[None], k, v), {}, "query"),
        "query-string": (("query", k, v), {}, "query"),
    }


_NAMES = list(_accepted(*_arrays(np.random.default_rng(0))))
_BAD = list(_refused(*_arrays(np.random.default_rng(0))))


@pytest.mark.parametrize("case", _NAMES)
def test_accepts_what_jax_nn_accepts_with_its_values(case, rng):
    args, kwargs = _accepted(*_arrays(rng))[case]
    expected = jax.nn.dot_product_attention(*args, implementation="xla", **kwargs)
    got = jb.dot_product_attention_nn(*args, **kwargs)
    assert got.shape == expected.shape and got.dtype == expected.dtype, (got.shape, expected.shape)
    assert_close(got, expected, "float16", case, factor=2.0)


@pytest.mark.parametrize("case", _BAD)
def test_refuses_what_jax_nn_refuses_naming_the_argument(case, rng):
    args, kwargs, argument = _refused(*_arrays(rng))[case]
    with pytest.raises(Exception):
        jax.nn.dot_product_attention(*args, implementation="xla", **kwargs)
    with pytest.raises(ValueError) as raised:
        jb.dot_product_attention_nn(*args, **kwargs)
    first = str(raised.value).splitlines()[0]
    assert first.startswith(f"{argument}:"), first


def test_a_float_keep_mask_is_explained_without_suggesting_bias(rng):
    q, k, v, _, keep = _arrays(rng)
    with pytest.raises(ValueError) as raised:
        jb.dot_product_attention_nn(q, k, v, mask=keep.astype(np.float16))
    message = str(raised.value)
    assert "mask=m > 0" in message and "bias" not in message, message
    expected = jax.nn.dot_product_attention(q, k, v, mask=keep, implementation="xla")
    assert_close(jb.dot_product_attention_nn(q, k, v, mask=keep.astype(np.float16) > 0), expected, "float16",
                 "mask=m > 0", factor=2.0)


def test_array_likes_under_jit(rng):
    q, k, v, bias, keep = _arrays(rng)
    run = jax.jit(lambda q, k, v: jb.dot_product_attention_nn(q, k, v, bias=bias.tolist(), mask=keep,
                                                              query_seq_lengths=[6, 8]))
    expected = jax.nn.dot_product_attention(q, k, v, bias=bias.tolist(), mask=keep,
                                            query_seq_lengths=jnp.asarray([6, 8], jnp.int32))
    assert_close(run(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)), expected, "float16", "jit", factor=2.0)
