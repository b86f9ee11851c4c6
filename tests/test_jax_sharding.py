"""Sharding on 8 CPU devices: automatic partitioning of ``jit`` (``custom_partitioning`` + Shardy) and
``shard_map``, with batch and head sharding, against the unsharded call.

``tests/conftest.py`` gives JAX 8 host devices.  Every test checks values (outputs and gradients equal
the unsharded ones), placement (the output keeps the query's sharding, a gradient its input's) and,
for automatic partitioning, that each device runs the kernel on its own shard: the compiled program
calls the kernel with the local shape and gathers no Q/K/V.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_jax_common import assert_close, normal, qkv

from cudnn_attn import MaskType
from cudnn_attn import jax_bridge as jb
from cudnn_attn.core.types import FP8_PARAM_KEYS

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 JAX devices "
                                "(XLA_FLAGS=--xla_force_host_platform_device_count=8, set by tests/conftest.py)")

SCALE = 0.3
B, T, N, H = 8, 16, 4, 8


def _mesh(axis_type=AxisType.Explicit):
    return jax.make_mesh((4, 2), ("data", "model"), axis_types=(axis_type, axis_type))


def _put(mesh, spec, *arrays):
    return tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in arrays)


def _kernel_calls(compiled_text: str) -> list[str]:
    """The attention custom calls of a compiled (per-device) HLO module, one line each."""
    return [line for line in compiled_text.splitlines() if 'custom_call_target="cudnn_attn"' in line]


def _loss(fn, weight):
    return lambda *args: jnp.sum(fn(*args).astype(jnp.float32) * weight)


SPECS = {
    "batch": (P("data"), "BTNH"),
    "heads": (P(None, None, "model"), "BTNH"),
    "batch_and_heads": (P("data", None, "model"), "BTNH"),
    "bnth_batch_and_heads": (P("data", "model"), "BNTH"),
    "two_axes_on_batch": (P(("data", "model")), "BTNH"),
}


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
@pytest.mark.parametrize("sharding", list(SPECS))
def test_automatic_partitioning_runs_each_shard_locally(sharding, axis_type):
    spec, layout = SPECS[sharding]
    rng = np.random.default_rng(list(SPECS).index(sharding))
    q, k, v = qkv(rng, B=B, T=T, S=T, N=N, K=2, H=H, layout=layout)        # grouped K/V heads
    weight = normal(rng, q.shape, "float32")
    fn = lambda q, k, v: jb.dot_product_attention(q, k, v, scale=SCALE, qkv_layout=layout,  # noqa: E731
                                                  mask_type=MaskType.CAUSAL)
    expected = jax.jit(fn)(q, k, v)
    expected_grads = jax.jit(jax.grad(_loss(fn, weight), argnums=(0, 1, 2)))(q, k, v)

    mesh = _mesh(axis_type)
    args = _put(mesh, spec, q, k, v)
    out = jax.jit(fn)(*args)
    assert_close(out, expected, "float16", "output", factor=0.01)
    assert out.sharding.is_equivalent_to(args[0].sharding, 4)
    compiled = jax.jit(fn).lower(*args).compile().as_text()
    assert "all-gather" not in compiled and "all-to-all" not in compiled
    local = args[0].addressable_shards[0].data.shape
    calls = _kernel_calls(compiled)
    assert len(calls) == 1 and f"f16[{','.join(map(str, local))}]" in calls[0], calls

    weight_sharded, = _put(mesh, spec, weight)
    grads = jax.jit(jax.grad(_loss(fn, weight_sharded), argnums=(0, 1, 2)))(*args)
    for name, g, e, a in zip("qkv", grads, expected_grads, args):
        assert_close(g, e, "float16", f"d{name}", factor=0.01)
        assert g.sharding.is_equivalent_to(a.sharding, 4), (name, g.sharding, a.sharding)


@pytest.mark.parametrize("bias_shape", [(1, N, T, T), (B, 1, T, T), (B, N, T, T)],
                         ids=["shared_over_batch", "shared_over_heads", "full"])
def test_bias_gradient_is_summed_over_the_shards_that_share_the_bias(bias_shape):
    rng = np.random.default_rng(20)
    q, k, v = qkv(rng, B=B, T=T, S=T, N=N, H=H)
    bias = normal(rng, bias_shape, "float16")
    weight = normal(rng, q.shape, "float32")
    fn = lambda q, k, v, b: jb.dot_product_attention(q, k, v, b, scale=SCALE)  # noqa: E731
    expected = jax.jit(jax.grad(_loss(fn, weight), argnums=(0, 3)))(q, k, v, bias)
    mesh = _mesh()
    args = _put(mesh, P("data", None, "model"), q, k, v)
    bias_spec = P(*("data" if d == B else None for d in bias_shape[:1]), "model" if bias_shape[1] == N else None)
    sharded_bias, = _put(mesh, bias_spec, bias)
    got = jax.jit(jax.grad(_loss(fn, weight), argnums=(0, 3)))(*args, sharded_bias)
    assert_close(got[0], expected[0], "float16", "dq", factor=0.01)
    assert_close(got[1], expected[1], "float16", "dbias", factor=0.5)
    assert got[1].sharding.is_equivalent_to(sharded_bias.sharding, 4)


def test_sink_gradient_and_fp8_amax_combine_over_shards():
    rng = np.random.default_rng(21)
    mesh = _mesh()
    q, k, v = qkv(rng, B=B, T=T, S=T, N=N, H=H)
    sink = jnp.asarray(rng.standard_normal((N,)), jnp.float32)
    loss = lambda q, k, v, s: jnp.sum(jb.dot_product_attention(q, k, v, scale=SCALE, sink=s)  # noqa: E731
                                      .astype(jnp.float32) ** 2)
    expected = jax.jit(jax.grad(loss, argnums=3))(q, k, v, sink)
    got = jax.jit(jax.grad(loss, argnums=3))(*_put(mesh, P("data", None, "model"), q, k, v), sink)
    assert_close(got, expected, "float16", "dsink")

    q8, k8, v8 = (x.astype(jnp.float8_e4m3fn) for x in qkv(rng, B=B, T=T, S=T, N=N, H=16))
    params = {name: jnp.ones((1, 1, 1, 1), jnp.float32) for name in FP8_PARAM_KEYS}
    fp8 = jax.jit(lambda q, k, v: jb.dot_product_attention(q, k, v, fp8_params=params, use_fp8=True))
    _, amax_s, amax_o = fp8(q8, k8, v8)
    _, sharded_s, sharded_o = fp8(*_put(mesh, P("data", None, "model"), q8, k8, v8))
    np.testing.assert_array_equal(np.asarray(sharded_s), np.asarray(amax_s))
    np.testing.assert_array_equal(np.asarray(sharded_o), np.asarray(amax_o))


@pytest.mark.parametrize("with_bias", [False, True], ids=["qkv", "replicated_bias"])
def test_shard_map_forward_and_gradient(with_bias):
    """Inside ``shard_map`` each device calls the kernel on its block; an operand that does not vary over
    every manual axis (a bias shared by the batch shards) gets the sum of the per-device gradients."""
    rng = np.random.default_rng(22)
    mesh = _mesh()
    q, k, v = qkv(rng, B=B, T=T, S=T, N=N, H=H)
    bias = normal(rng, (1, N, T, T), "float16") if with_bias else None
    weight = normal(rng, q.shape, "float32")
    spec = P("data", None, "model")
    bias_spec = P(None, "model")

    def local(q, k, v, b):
        return jb.dot_product_attention(q, k, v, b, scale=SCALE, mask_type=MaskType.CAUSAL)

    sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, bias_spec), out_specs=spec)
    expected = jax.jit(local)(q, k, v, bias)
    args = (*_put(mesh, spec, q, k, v), None if bias is None else _put(mesh, bias_spec, bias)[0])
    assert_close(jax.jit(sharded)(*args), expected, "float16", "output", factor=0.01)

    argnums = (0, 1, 2, 3) if with_bias else (0, 1, 2)
    got = jax.jit(jax.grad(_loss(sharded, weight), argnums=argnums))(*args)
    want = jax.jit(jax.grad(_loss(local, weight), argnums=argnums))(q, k, v, bias)
    for i, (g, e) in enumerate(zip(got, want)):
        assert_close(g, e, "float16", f"gradient {i}", factor=0.5)


@pytest.mark.parametrize("spec, layout, what", [
    (P(None, None, None, "model"), "BTNH", "head"),
    (P(None, "data", None, "model"), "BNTH", "head"),
], ids=["head_dim_btnh", "head_dim_bnth"])
def test_head_dim_sharding_is_a_clear_error(spec, layout, what):
    """Explicit mesh axes: a ValueError when the call is traced.  Auto axes: the sharding is only known when
    XLA partitions the program, so the same ValueError comes back wrapped in XLA's compile error."""
    rng = np.random.default_rng(23)
    q, k, v = qkv(rng, B=B, T=T, S=T, N=N, H=H, layout=layout)
    fn = jax.jit(lambda q, k, v: jb.dot_product_attention(q, k, v, qkv_layout=layout))
    message = f"query: sharding on the {what} dimension is not supported.*batch, the heads and the sequence"
    with pytest.raises(ValueError, match=message):
        fn(*_put(_mesh(AxisType.Explicit), spec, q, k, v))
    with pytest.raises(jax.errors.JaxRuntimeError, match="ValueError: " + message):
        fn(*_put(_mesh(AxisType.Auto), spec, q, k, v))


def test_packed_segments_shard_over_heads():
    rng = np.random.default_rng(24)
    q, k, v = qkv(rng, B=B, T=T, S=T, N=N, H=H)
    seqlen = jnp.asarray(np.tile([[6, 10]], (B, 1)), jnp.int32)
    offsets = jnp.asarray(np.tile([[0, 6, -1]], (B, 1)), jnp.int32)
    fn = jax.jit(lambda q, k, v: jb.dot_product_attention(q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen,
                                                          q_offsets=offsets, kv_offsets=offsets,
                                                          return_residual=True))
    expected = fn(q, k, v)
    mesh = _mesh(AxisType.Auto)
    got = fn(*_put(mesh, P(None, None, "model"), q, k, v))
    assert_close(got[0], expected[0], "float16", "output", factor=0.01)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(expected[1]), rtol=1e-6)
    # batch sharding in training: tests/test_packed_batch_sharding.py


def test_gspmd_propagation_when_shardy_is_off():
    """The ``infer_sharding_from_operands`` rule serves the (deprecated) GSPMD partitioner."""
    rng = np.random.default_rng(25)
    q, k, v = qkv(rng, B=B, T=T, S=T, N=N, H=H)
    fn = lambda q, k, v: jb.dot_product_attention(q, k, v, scale=SCALE)  # noqa: E731
    expected = jax.jit(fn)(q, k, v)
    previous = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        args = _put(_mesh(AxisType.Auto), P("data", None, "model"), q, k, v)
        out = jax.jit(fn)(*args)
        assert out.sharding.is_equivalent_to(args[0].sharding, 4)
        assert_close(out, expected, "float16", "output", factor=0.01)
    finally:
        jax.config.update("jax_use_shardy_partitioner", previous)
