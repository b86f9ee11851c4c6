"""Packed segments under batch sharding, in training: forward with the logsumexp and the backward, on
2 x 2 and 4 x 2 (batch x heads) meshes of 8 CPU devices, against the unsharded call.

Each batch shard numbers the logsumexp rows of its own segments (``jax_bridge.partitioning``): block
``d`` of ``B / pb * M`` rows equals the unsharded logsumexp of shard ``d``'s rows alone.  The rows hold
different numbers of segments, so that blocked layout differs from the unsharded numbering and a wrong
numbering in the backward shows in the gradients.
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

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 JAX devices (tests/conftest.py)")

B, T, N, H, M = 8, 16, 4, 8, 3
SCALE = 0.35


def packed_rows(rng: np.random.Generator, batch: int, length: int, max_segments: int):
    """Per row 1..M segments with random boundaries, then -1: ``(seqlen, offsets)`` int32."""
    seqlen = np.full((batch, max_segments), -1, np.int32)
    offsets = np.full((batch, max_segments + 1), -1, np.int32)
    for b in range(batch):
        count = int(rng.integers(1, max_segments + 1))
        cuts = np.sort(rng.choice(np.arange(2, length - 1), count - 1, replace=False)) if count > 1 else []
        starts = np.concatenate([[0], cuts]).astype(np.int32)
        ends = np.concatenate([cuts, [length - int(rng.integers(0, 3))]]).astype(np.int32)
        seqlen[b, :count] = ends - starts
        offsets[b, :count] = starts
    return jnp.asarray(seqlen), jnp.asarray(offsets)


@pytest.mark.parametrize("mask_type", [MaskType.CAUSAL, MaskType.PADDING_CAUSAL], ids=["causal", "padding_causal"])
@pytest.mark.parametrize("mesh_shape", [(2, 2), (4, 2)], ids=["2x2", "4x2"])
def test_packed_training_under_batch_and_head_sharding(mesh_shape, mask_type):
    seed = 100 + mesh_shape[0] + 10 * (mask_type is MaskType.CAUSAL)
    rng = np.random.default_rng(seed)
    q, k, v = qkv(rng, B=B, T=T, S=T, N=N, K=2, H=H)               # GQA: 4 query heads on 2 K/V heads
    seqlen, offsets = packed_rows(rng, B, T, M)
    weight = normal(rng, q.shape, "float32")

    def fn(q, k, v, seqlen, offsets):
        return jb.dot_product_attention(q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets,
                                        kv_offsets=offsets, scale=SCALE, mask_type=mask_type,
                                        return_residual=True)

    def loss(q, k, v, seqlen, offsets):
        return jnp.sum(fn(q, k, v, seqlen, offsets)[0].astype(jnp.float32) * weight)

    out, lse = jax.jit(fn)(q, k, v, seqlen, offsets)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, seqlen, offsets)

    mesh = jax.make_mesh(mesh_shape, ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[:mesh_shape[0] * mesh_shape[1]])
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    args = (*(put(x, P("data", None, "model")) for x in (q, k, v)), put(seqlen, P("data")), put(offsets, P("data")))
    reproduce = f"reproduce: seed={seed} mesh={mesh_shape} mask={mask_type.name}"
    got_out, got_lse = jax.jit(fn)(*args)
    assert_close(got_out, out, "float16", f"output ({reproduce})", factor=0.01)
    got_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    for name, g, e in zip("qkv", got_grads, grads):
        assert_close(g, e, "float16", f"d{name} ({reproduce})", factor=0.01)
        assert g.sharding.spec[:3] == P("data", None, "model")[:3], (name, g.sharding)

    shards = mesh_shape[0]
    rows = B // shards
    blocks = np.asarray(got_lse).reshape(shards, rows * M, N, T)
    for d in range(shards):
        local = slice(d * rows, (d + 1) * rows)
        _, want = jax.jit(fn)(q[local], k[local], v[local], seqlen[local], offsets[local])
        np.testing.assert_allclose(blocks[d], np.asarray(want), rtol=1e-6, atol=1e-6, err_msg=f"shard {d} {reproduce}")
    present = int(np.sum(np.asarray(seqlen) >= 0))
    assert present < B * M, "the test needs rows with fewer than M segments"
