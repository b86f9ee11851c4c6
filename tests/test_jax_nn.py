"""The ``jax.nn.dot_product_attention`` drop-in against ``jax.nn.dot_product_attention(implementation="xla")``.

``jax.nn``'s XLA path computes logits in float32 and rounds the probabilities to the io dtype before
``P @ V``; the bridge's CPU kernel computes in float64.  Both are compared to each other with twice
the io-dtype tolerance of ``test_jax_common`` (each side carries one rounding of P or O).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_jax_common import assert_close, normal, qkv

from cudnn_attn import jax_bridge as jb

B, T, S, N, H = 2, 16, 16, 4, 8


def _case(name: str, rng: np.random.Generator) -> tuple[tuple, dict]:
    K = 2 if name == "gqa_causal" else N
    dtype = "bfloat16" if name == "bf16_scale" else "float16"
    q, k, v = qkv(rng, B=B, T=T, S=S, N=N, K=K, H=H, dtype=dtype)
    kwargs: dict = {}
    if name == "gqa_causal":
        kwargs["is_causal"] = True
    if name == "bf16_scale":
        kwargs["scale"] = 0.2
    if name == "bias_and_mask":
        kwargs["bias"] = normal(rng, (1, N, T, S), dtype)
        mask = rng.random((B, 1, T, S)) > 0.4
        mask[..., np.arange(T), np.arange(S)] = True                    # no row fully masked
        kwargs["mask"] = jnp.asarray(mask)
    if name == "lengths":
        kwargs.update(query_seq_lengths=jnp.asarray([11, 16], jnp.int32),
                      key_value_seq_lengths=jnp.asarray([16, 9], jnp.int32))
    if name == "query_lengths_causal":
        kwargs.update(query_seq_lengths=jnp.asarray([5, 13], jnp.int32), is_causal=True)
    if name == "window_symmetric":
        kwargs["local_window_size"] = 3
    if name == "window_band":
        kwargs["local_window_size"] = (4, 1)
    if name == "window_causal":
        kwargs.update(local_window_size=(5, 2), is_causal=True)
    if name == "unbatched":
        q, k, v = q[0], k[0], v[0]
    return (q, k, v), kwargs


CASES = ["plain", "bf16_scale", "gqa_causal", "bias_and_mask", "lengths", "query_lengths_causal",
         "window_symmetric", "window_band", "window_causal", "unbatched"]


@pytest.mark.parametrize("case", CASES)
def test_matches_jax_nn_xla(case):
    (q, k, v), kwargs = _case(case, np.random.default_rng(CASES.index(case)))
    got = jax.jit(lambda q, k, v: jb.dot_product_attention_nn(q, k, v, **kwargs))(q, k, v)
    expected = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    assert_close(got, expected, str(q.dtype), case, factor=2.0)


@pytest.mark.parametrize("case", ["gqa_causal", "bias_and_mask", "window_band"])
def test_gradients_match_jax_nn_xla(case):
    (q, k, v), kwargs = _case(case, np.random.default_rng(100 + CASES.index(case)))
    bias = kwargs.pop("bias", None)
    weight = normal(np.random.default_rng(1), q.shape, "float32")

    def loss(run):
        return lambda q, k, v, bias: jnp.sum(run(q, k, v, bias, **kwargs).astype(jnp.float32) * weight)

    argnums = (0, 1, 2) + ((3,) if bias is not None else ())
    got = jax.jit(jax.grad(loss(jb.dot_product_attention_nn), argnums=argnums))(q, k, v, bias)
    def xla(q, k, v, bias, **kw):
        return jax.nn.dot_product_attention(q, k, v, bias, implementation="xla", **kw)

    expected = jax.grad(loss(xla), argnums=argnums)(q, k, v, bias)
    for name, g, e in zip(("dq", "dk", "dv", "dbias"), got, expected):
        assert_close(g, e, "float16", f"{case} {name}", factor=2.0)


def test_refusals_name_the_argument():
    q, k, v = qkv(np.random.default_rng(2))
    with pytest.raises(ValueError, match="query: dtype must be one of float16, bfloat16"):
        jb.dot_product_attention_nn(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    with pytest.raises(ValueError, match="mask: must be boolean"):
        jb.dot_product_attention_nn(q, k, v, mask=jnp.zeros((T, S), jnp.float16))
    with pytest.raises(ValueError, match="local_window_size"):
        jb.dot_product_attention_nn(q, k, v, local_window_size=(-1, 2))
