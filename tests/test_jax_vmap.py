"""``vmap`` of the bridge: the mapped axis is folded into the batch (one kernel call), and every
instance equals the unmapped call on that instance.

The expected values are the per-instance calls (a Python loop).  Each test also checks that the
vmapped computation holds exactly one forward (and backward) primitive whose batch is the folded one,
except where the fold is impossible and the documented sequential fallback applies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_jax_common import assert_close, jnp_attention, normal, qkv

from cudnn_attn import MaskType
from cudnn_attn import jax_bridge as jb
from cudnn_attn.core.types import FP8_PARAM_KEYS

SCALE = 0.3


def attention(q, k, v, bias=None, **kwargs):
    return jb.dot_product_attention(q, k, v, bias, scale=SCALE, **kwargs)


def _stack(xs):
    return jax.tree.map(lambda *x: jnp.stack(x), *xs)


def _primitives(fn, *args, name="cudnn_attention_fwd"):
    """The ``name`` equations of ``fn``'s jaxpr, nested jaxprs (scan, custom_vjp, ...) included."""
    found = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == name:
                found.append(eqn)
            for value in eqn.params.values():
                for item in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(item, "jaxpr", item)
                    if hasattr(inner, "eqns"):
                        visit(inner)
    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _per_instance(fn, in_axes, args):
    size = next(a.shape[ax] for a, ax in zip(args, in_axes) if ax is not None)
    take = lambda a, ax, i: a if ax is None else jnp.take(a, i, axis=ax)  # noqa: E731
    return _stack([jax.jit(fn)(*(take(a, ax, i) for a, ax in zip(args, in_axes))) for i in range(size)])


@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, None), (None, 1, 1), (2, 0, None)],
                         ids=["all", "query_only", "kv_at_axis1", "query_axis2_key_only"])
def test_vmap_folds_into_one_call(in_axes):
    rng = np.random.default_rng(1)
    V = 3
    q, k, v = qkv(rng, B=2, T=8, S=8, N=2)
    def batched(x, axis):
        return x if axis is None else jnp.stack([x * (1 + 0.1 * i) for i in range(V)], axis=axis)
    args = [batched(x, ax) for x, ax in zip((q, k, v), in_axes)]
    fn = lambda q, k, v: attention(q, k, v, mask_type=MaskType.CAUSAL)  # noqa: E731
    got = jax.jit(jax.vmap(fn, in_axes=in_axes))(*args)
    assert_close(got, _per_instance(fn, in_axes, args), "float16", str(in_axes), factor=0.1)
    calls = _primitives(jax.vmap(fn, in_axes=in_axes), *args)
    assert len(calls) == 1 and calls[0].params["config"].batch == V * 2


def test_nested_vmap_folds_both_levels():
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, B=2, T=8, S=8, N=2)
    Q = jnp.stack([jnp.stack([q * (1 + 0.1 * i + 0.01 * j) for j in range(3)]) for i in range(2)])
    fn = jax.vmap(jax.vmap(lambda q: attention(q, k, v)))
    got = jax.jit(fn)(Q)
    expected = _stack([_stack([attention(Q[i, j], k, v) for j in range(3)]) for i in range(2)])
    assert_close(got, expected, "float16", "nested", factor=0.1)
    calls = _primitives(fn, Q)
    assert len(calls) == 1 and calls[0].params["config"].batch == 2 * 3 * 2


@pytest.mark.parametrize("bias_axis", [None, 0], ids=["bias_shared", "bias_batched"])
def test_vmap_of_grad_gives_each_instance_its_own_bias_gradient(bias_axis):
    """A bias broadcast over the batch gets one gradient per instance, not the sum over instances."""
    rng = np.random.default_rng(3)
    V = 3
    q, k, v = qkv(rng, B=2, T=8, S=8, N=2)
    Q = jnp.stack([q * (1 + 0.2 * i) for i in range(V)])
    bias = normal(rng, (1, 2, 8, 8), "float16")
    B = bias if bias_axis is None else jnp.stack([bias * (1 - 0.1 * i) for i in range(V)])
    weight = normal(rng, q.shape, "float32")

    def loss(q, b):
        return jnp.sum(attention(q, k, v, b).astype(jnp.float32) * weight)

    grad = jax.grad(loss, argnums=(0, 1))
    got = jax.jit(jax.vmap(grad, in_axes=(0, bias_axis)))(Q, B)
    expected = _per_instance(grad, (0, bias_axis), (Q, B))
    for g, e, what in zip(got, expected, ("dq", "dbias")):
        assert g.shape == e.shape
        assert_close(g, e, "float16", what, factor=0.5)
    assert float(jnp.abs(got[1][0] - got[1][1]).max()) > 0      # the instances really differ
    assert len(_primitives(jax.vmap(grad, in_axes=(0, bias_axis)), Q, B, name="cudnn_attention_bwd")) == 1


def test_grad_of_vmap():
    rng = np.random.default_rng(4)
    q, k, v = qkv(rng, B=1, T=8, S=8, N=2)
    Q = jnp.stack([q, 0.5 * q, -q])

    def loss(run):
        return lambda Q: jnp.sum(jax.vmap(lambda q: run(q, k, v, scale=SCALE))(Q).astype(jnp.float32) ** 2)

    assert_close(jax.jit(jax.grad(loss(jb.dot_product_attention)))(Q), jax.grad(loss(jnp_attention))(Q),
                 "float16", "grad(vmap)")


def test_jacobian():
    """``jax.jacobian`` (vmap of the VJP over every output element): shapes by ``eval_shape`` on a realistic
    size, values against the oracle's jacobian on a tiny one."""
    rng = np.random.default_rng(5)
    q, k, v = qkv(rng, B=2, T=32, S=32, N=4, H=16)
    shapes = jax.eval_shape(jax.jacobian(lambda q, k: attention(q, k, v).astype(jnp.float32), argnums=(0, 1)), q, k)
    assert shapes[0].shape == q.shape + q.shape and shapes[1].shape == q.shape + k.shape
    q, k, v = qkv(rng, B=1, T=3, S=4, N=1, H=8)
    got = jax.jit(jax.jacobian(lambda q: attention(q, k, v).astype(jnp.float32)))(q)
    expected = jax.jacobian(lambda q: jnp_attention(q, k, v, scale=SCALE).astype(jnp.float32))(q)
    assert_close(got, expected, "float16", "jacobian", factor=2.0)


def test_vmap_over_sequence_lengths_only():
    rng = np.random.default_rng(6)
    q, k, v = qkv(rng, B=2, T=8, S=8, N=2)
    lengths = jnp.asarray([[8, 3], [5, 8], [1, 1]], jnp.int32)
    fn = lambda ql, kl: attention(q, k, v, q_seqlen=ql, kv_seqlen=kl, mask_type=MaskType.PADDING)  # noqa: E731
    got = jax.jit(jax.vmap(fn))(lengths, lengths[::-1])
    assert_close(got, _per_instance(fn, (0, 0), (lengths, lengths[::-1])), "float16", "seqlens", factor=0.1)


def test_vmap_of_packed_segments_keeps_each_instance_logsumexp():
    """Packed logsumexp rows are the present segments of the whole batch; the fold renumbers them per
    instance (instances with different segment counts)."""
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, B=2, T=8, S=8, N=2)
    seqlen = jnp.asarray([[[3, 5], [8, -1]], [[8, -1], [2, -1]], [[4, 4], [6, 2]]], jnp.int32)
    offsets = jnp.asarray([[[0, 3, -1], [0, -1, -1]], [[0, -1, -1], [0, -1, -1]], [[0, 4, -1], [0, 6, -1]]],
                          jnp.int32)
    V = 3
    Q = jnp.stack([q * (1 + 0.1 * i) for i in range(V)])

    def fn(q, seqlen, offsets):
        return attention(q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets, kv_offsets=offsets,
                         return_residual=True)

    got = jax.jit(jax.vmap(fn))(Q, seqlen, offsets)
    expected = _per_instance(fn, (0, 0, 0), (Q, seqlen, offsets))
    assert_close(got[0], expected[0], "float16", "output", factor=0.1)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(expected[1]), rtol=1e-6, atol=1e-6)

    def loss(q, seqlen, offsets):
        return jnp.sum(fn(q, seqlen, offsets)[0].astype(jnp.float32) ** 2)
    assert_close(jax.jit(jax.vmap(jax.grad(loss)))(Q, seqlen, offsets),
                 _per_instance(jax.grad(loss), (0, 0, 0), (Q, seqlen, offsets)), "float16", "packed dq", factor=0.5)


def test_vmap_of_paged_attention_over_caches_and_tables():
    rng = np.random.default_rng(8)
    V, B, T, N, H, block = 2, 2, 4, 2, 8, 4
    Q = normal(rng, (V, B, T, N, H), "float16")
    caches = normal(rng, (V, 5, block, N, H), "float16")
    tables = jnp.asarray(np.stack([rng.permutation(5)[:4].reshape(B, 1, 2, 1) for _ in range(V)]), jnp.int32)
    q_len, kv_len = jnp.asarray([4, 3], jnp.int32), jnp.asarray([8, 5], jnp.int32)

    def fn(q, cache, table):
        return jb.paged_attention(q, cache, cache, q_len, kv_len, table, table, scale=SCALE,
                                  mask_type=MaskType.PADDING)

    got = jax.jit(jax.vmap(fn))(Q, caches, tables)
    assert_close(got, _per_instance(fn, (0, 0, 0), (Q, caches, tables)), "float16", "paged", factor=0.1)
    calls = _primitives(jax.vmap(fn), Q, caches, tables)
    assert len(calls) == 1 and calls[0].params["config"].paging.num_blocks_k == V * 5


def test_batched_sink_runs_instances_in_sequence():
    """A per-head sink cannot be folded into the batch: the instances run one after another."""
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, B=2, T=8, S=8, N=2)
    sinks = jnp.asarray(rng.standard_normal((3, 2)), jnp.float32)
    fn = lambda sink: attention(q, k, v, sink=sink)  # noqa: E731
    got = jax.jit(jax.vmap(fn))(sinks)
    assert_close(got, _per_instance(fn, (0,), (sinks,)), "float16", "sink", factor=0.1)

    def loss(sink):
        return jnp.sum(fn(sink).astype(jnp.float32) ** 2)
    assert_close(jax.jit(jax.vmap(jax.grad(loss)))(sinks), _per_instance(jax.grad(loss), (0,), (sinks,)),
                 "float16", "dsink", factor=0.5)


def test_fp8_amax_is_a_whole_batch_statistic():
    rng = np.random.default_rng(10)
    q, k, v = (x.astype(jnp.float8_e4m3fn) for x in qkv(rng, B=1, T=8, S=8, N=2, H=16))
    params = {name: jnp.ones((1, 1, 1, 1), jnp.float32) for name in FP8_PARAM_KEYS}
    Q = jnp.stack([q, (q.astype(jnp.float32) * 0.5).astype(q.dtype)])
    fn = lambda q, p: attention(q, k, v, fp8_params=p, use_fp8=True)  # noqa: E731
    out, amax_s, amax_o = jax.jit(jax.vmap(fn, in_axes=(0, None)))(Q, params)
    per_instance = [jax.jit(fn)(Q[i], params) for i in range(2)]
    # Every instance sees the statistic of the whole folded batch (JAX's documented FP8 semantics).
    for amax, position in ((amax_s, 1), (amax_o, 2)):
        assert amax.shape == (2, 1, 1, 1, 1)
        whole_batch = max(float(r[position].reshape(())) for r in per_instance)
        np.testing.assert_array_equal(np.asarray(amax).reshape(2), [whole_batch, whole_batch])
    assert float(per_instance[0][2].reshape(())) != float(per_instance[1][2].reshape(()))
    np.testing.assert_array_equal(np.asarray(out[1], np.float32), np.asarray(per_instance[1][0], np.float32))


@pytest.mark.parametrize("batched", [("descale_q",), ("descale_q", "scale_o", "descale_s")], ids=["one", "three"])
def test_vmap_over_fp8_scales_runs_one_kernel_per_scale_group(batched):
    """Vmapped scale factors (refused by JAX: one scale per tensor in the kernel) run instance by instance:
    each instance equals the unbatched call with its own scales, amax included."""
    rng = np.random.default_rng(12)
    q, k, v = (x.astype(jnp.float8_e4m3fn) for x in qkv(rng, B=2, T=8, S=8, N=2, H=16))
    params = {name: jnp.ones((1, 1, 1, 1), jnp.float32) for name in FP8_PARAM_KEYS}
    values = {name: jnp.asarray(rng.uniform(0.25, 2.0, (3, 1, 1, 1, 1)), jnp.float32) for name in batched}
    fn = lambda q, p: attention(q, k, v, fp8_params=p, use_fp8=True)  # noqa: E731
    axes = ({name: (0 if name in batched else None) for name in params},)
    got = jax.jit(jax.vmap(lambda p: fn(q, p), in_axes=axes))(dict(params, **values))
    for i in range(3):
        want = jax.jit(fn)(q, dict(params, **{name: x[i] for name, x in values.items()}))
        for name, g, w in zip(("output", "amax_s", "amax_o"), got, want):
            np.testing.assert_array_equal(np.asarray(g[i], np.float32), np.asarray(w, np.float32),
                                          err_msg=f"{name} of instance {i} (seed 12, batched {batched})")
    assert float(jnp.abs(got[0][0].astype(jnp.float32) - got[0][1].astype(jnp.float32)).max()) > 0


@pytest.mark.parametrize("in_axes", [(0, 0, 0), (0, None, None)], ids=["all", "query-only"])
def test_vmap_over_an_empty_axis_gives_empty_results_and_runs_nothing(in_axes):
    """As ``vmap`` of any function: the results have the mapped size 0 in front; no kernel is called."""
    rng = np.random.default_rng(2)
    q, k, v = qkv(rng, B=2, T=8, S=12, N=4, K=2, H=8)
    args = [x[None][:0] if axis == 0 else x for x, axis in zip((q, k, v), in_axes)]
    fn = lambda q, k, v: attention(q, k, v, mask_type=MaskType.CAUSAL, return_residual=True)  # noqa: E731
    out, lse = jax.jit(jax.vmap(fn, in_axes=in_axes))(*args)
    assert out.shape == (0, 2, 8, 4, 8) and out.dtype == q.dtype
    assert lse.shape == (0, 2, 4, 8) and lse.dtype == jnp.float32
    assert not _primitives(jax.vmap(fn, in_axes=in_axes), *args)
    loss = lambda q, k, v: attention(q, k, v).astype(jnp.float32).sum()  # noqa: E731
    grads = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)), in_axes=in_axes)(*args)
    assert [g.shape for g in grads] == [(0,) + q.shape, (0,) + k.shape, (0,) + v.shape]
