"""Context parallelism on the GPU: at T = S = 32k on 2 GPUs against one GPU, packed segments
under batch sharding, and the lifted limits (bias at odd lengths in training, backward at T = S = 1)
against the NumPy reference.

Tolerances (``_checks``): relative Frobenius error 1e-2 for bf16 (2e-3 fp16).  The sharded call merges
per-block bf16 outputs in float32, so it differs from the one-GPU call by about one bf16 ulp of the
output; the gradients add the bf16 rounding of every block's dQ/dK/dV (2 blocks per query row at most
with 2 GPUs), the same order.

Run: ``pytest -m gpu tests/gpu/test_context_parallel_gpu.py`` (the 2-GPU tests need the 2-GPU machine).
The CuPy-path lift tests pass once ``cudnn_attn.engine.prepared`` applies :func:`cudnn_attn.core.padded_call.lift`.
"""

from __future__ import annotations

import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import MaskType, reference

from ._checks import assert_close, assert_lse_close, io_dtype
from .test_jax_gpu import (
    _gpus,
    jax,
    jb,
    jnp,
    pytestmark,  # noqa: F401  (gpu marker, skipped without JAX on CUDA)
    two_gpus,
)


def _relative(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(x)), "non-finite values"
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


@two_gpus
@pytest.mark.parametrize("scheme, balanced", [("ring", True), ("ring", False), ("all_gather", True)],
                         ids=["ring-balanced", "ring", "all_gather-balanced"])
def test_sequence_sharded_causal_attention_at_32k_equals_one_gpu(scheme, balanced):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    B, T, N, H = 1, 32768, 8, 128
    key = jax.random.PRNGKey(40)
    q, k, v, dout = (jax.random.normal(kk, (B, T, N, H), jnp.bfloat16) for kk in jax.random.split(key, 4))
    scale = H ** -0.5

    def loss(q, k, v, dout, context=None):
        out = jb.dot_product_attention(q, k, v, scale=scale, mask_type=MaskType.CAUSAL, context_parallel=context)
        return jnp.sum(out.astype(jnp.float32) * dout.astype(jnp.float32)), out

    one = jax.devices("gpu")[0]
    args = [jax.device_put(x, one) for x in (q, k, v, dout)]
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)

    mesh = jax.make_mesh((2,), ("sp",), devices=_gpus()[:2])
    context = jb.ContextParallel(scheme, load_balance=2 if balanced else None)
    order = (lambda x: jb.load_balance(x, 2)) if balanced else (lambda x: x)
    back = (lambda x: jb.restore_order(x, 2)) if balanced else (lambda x: x)
    sharded = [jax.device_put(order(x), NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v, dout)]
    fn = jax.jit(jax.value_and_grad(lambda *a: loss(*a, context=context), argnums=(0, 1, 2), has_aux=True))
    (_, got), got_grads = fn(*sharded)
    reproduce = f"reproduce: B={B} T={T} N={N} H={H} bf16 causal {scheme} balanced={balanced}"
    error = _relative(back(got), out)
    assert error <= 1e-2, f"output: relative error {error:.2e} ({reproduce})"
    for name, g, e in zip(("dq", "dk", "dv"), got_grads, grads):
        error = _relative(back(g), e)
        assert error <= 1e-2, f"{name}: relative error {error:.2e} ({reproduce})"


@two_gpus
def test_packed_segments_train_under_batch_sharding():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    B, T, N, K, H = 4, 512, 4, 2, 64
    rng = np.random.default_rng(41)
    dt = io_dtype("bfloat16")
    q = rng.standard_normal((B, T, N, H)).astype(dt)
    k, v = (rng.standard_normal((B, T, K, H)).astype(dt) for _ in range(2))
    seqlen = np.array([[200, 300], [512, -1], [100, 400], [256, 200]], np.int32)
    offsets = np.array([[0, 200, -1], [0, -1, -1], [0, 100, -1], [0, 256, -1]], np.int32)
    kwargs = dict(q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets, kv_offsets=offsets, scale=0.125,
                  mask_type=MaskType.PADDING_CAUSAL)
    ref_out, ref_lse = reference.dot_product_attention(q, k, v, return_residual=True, **kwargs)
    dout = rng.standard_normal(ref_out.shape).astype(dt)
    ref = reference.dot_product_attention_bwd(q, k, v, ref_out, dout, ref_lse, **kwargs)

    mesh = jax.make_mesh((2,), ("data",), devices=_gpus()[:2])
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))  # noqa: E731
    jkw = {name: put(x) if isinstance(x, np.ndarray) else x for name, x in kwargs.items()}

    def loss(q, k, v):
        out = jb.dot_product_attention(q, k, v, **jkw)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout, jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(put(q), put(k), put(v))
    assert_close("output", np.asarray(out), ref_out, "bfloat16")
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert_close(name, np.asarray(g), getattr(ref, name), "bfloat16")


# -- the lifted limits ----------------------------------------------------------------------------------

def _bias_odd_case(rng, t=255, s=257):
    dt = io_dtype("bfloat16")
    q = rng.standard_normal((2, t, 4, 64)).astype(dt)
    k, v = (rng.standard_normal((2, s, 4, 64)).astype(dt) for _ in range(2))
    bias = rng.standard_normal((1, 4, t, s)).astype(dt)
    return q, k, v, bias


def test_jax_bridge_trains_with_a_bias_at_odd_lengths():
    rng = np.random.default_rng(42)
    q, k, v, bias = _bias_odd_case(rng)
    kwargs = dict(scale=0.125, mask_type=MaskType.CAUSAL)
    ref_out, ref_lse = reference.dot_product_attention(q, k, v, bias, return_residual=True, **kwargs)
    dout = rng.standard_normal(ref_out.shape).astype(ref_out.dtype)
    ref = reference.dot_product_attention_bwd(q, k, v, ref_out, dout, ref_lse, bias, **kwargs)

    def loss(q, k, v, b):
        out, lse = jb.dot_product_attention(q, k, v, b, return_residual=True, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(dout, jnp.float32)), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, bias)
    assert_close("output", np.asarray(out), ref_out, "bfloat16")
    assert_lse_close(np.asarray(lse), ref_lse)
    for name, g in zip(("dq", "dk", "dv", "dbias"), grads):
        assert_close(name, np.asarray(g), getattr(ref, name), "bfloat16")


def test_jax_bridge_backward_at_a_single_token():
    rng = np.random.default_rng(43)
    dt = io_dtype("bfloat16")
    q, k, v = (rng.standard_normal((3, 1, 4, 64)).astype(dt) for _ in range(3))
    ref_out, ref_lse = reference.dot_product_attention(q, k, v, scale=0.125, return_residual=True)
    dout = rng.standard_normal(ref_out.shape).astype(dt)
    ref = reference.dot_product_attention_bwd(q, k, v, ref_out, dout, ref_lse, scale=0.125)
    loss = lambda q, k, v: jnp.sum(jb.dot_product_attention(q, k, v, scale=0.125).astype(jnp.float32)  # noqa: E731
                                   * jnp.asarray(dout, jnp.float32))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for name, g in zip(("dq", "dk", "dv"), grads):
        want = getattr(ref, name)
        if name in ("dq", "dk"):               # one key: P = 1, so dq = dk = 0 up to rounding
            assert float(np.abs(np.asarray(g, np.float32)).max()) < 1e-3, name
        else:
            assert_close(name, np.asarray(g), want, "bfloat16")


def test_cupy_path_trains_with_a_bias_at_odd_lengths_and_backward_at_a_single_token():
    """Needs cudnn_attn.engine.prepared to apply cudnn_attn.core.padded_call."""
    import cupy as cp

    rng = np.random.default_rng(44)
    q, k, v, bias = _bias_odd_case(rng, t=127, s=129)
    kwargs = dict(scale=0.125, mask_type=MaskType.CAUSAL)
    ref_out, ref_lse = reference.dot_product_attention(q, k, v, bias, return_residual=True, **kwargs)
    dout = rng.standard_normal(ref_out.shape).astype(ref_out.dtype)
    ref = reference.dot_product_attention_bwd(q, k, v, ref_out, dout, ref_lse, bias, **kwargs)
    gpu = [cp.asarray(x) for x in (q, k, v, bias, dout)]
    out, lse = cudnn_attn.dot_product_attention(gpu[0], gpu[1], gpu[2], gpu[3], return_residual=True, **kwargs)
    assert_close("output", cp.asnumpy(out), ref_out, "bfloat16")
    assert_lse_close(cp.asnumpy(lse), ref_lse)
    grads = cudnn_attn.dot_product_attention_bwd(gpu[0], gpu[1], gpu[2], out, gpu[4], lse, gpu[3], **kwargs)
    for name in ("dq", "dk", "dv", "dbias"):
        assert_close(name, cp.asnumpy(getattr(grads, name)), getattr(ref, name), "bfloat16")

    q1, k1, v1 = (rng.standard_normal((2, 1, 4, 64)).astype(io_dtype("bfloat16")) for _ in range(3))
    o1, l1 = reference.dot_product_attention(q1, k1, v1, scale=0.125, return_residual=True)
    d1 = rng.standard_normal(o1.shape).astype(o1.dtype)
    ref1 = reference.dot_product_attention_bwd(q1, k1, v1, o1, d1, l1, scale=0.125)
    g1 = cudnn_attn.dot_product_attention_bwd(*(cp.asarray(x) for x in (q1, k1, v1, o1, d1, l1)), scale=0.125)
    assert float(cp.abs(g1.dk.astype(cp.float32)).max()) < 1e-3         # one key: dk = 0 up to rounding
    assert_close("dv", cp.asnumpy(g1.dv), ref1.dv, "bfloat16")
