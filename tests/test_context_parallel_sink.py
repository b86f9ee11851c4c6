"""An attention sink under context parallelism on 8 CPU devices: every block call runs without it and the sink
joins the merged denominator once (``logaddexp``); its gradient is each device's share over its query rows,
summed over the sequence axes (by :mod:`cudnn_attn.jax_bridge.partitioning`, or by ``shard_map``'s transpose
of the replicated sink).  Ring and all-gather, natural and load-balanced order, pieces, heads and batch
sharded beside the sequence, padding; outputs, logsumexps and dq, dk, dv, dsink against the unsharded call (the
NumPy reference behind the same primitives), with the tolerances of ``test_context_parallel``.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_context_parallel import MESHES  # the meshes of the sink-free cases
from test_jax_common import assert_close, normal, qkv

from cudnn_attn import MaskType
from cudnn_attn import jax_bridge as jb
from cudnn_attn.core.config import AttentionConfig, StaticMask
from cudnn_attn.jax_bridge.context_parallel import (
    ContextParallel,
    Scheme,
    Split,
    block_configs,
    load_balance,
    restore_order,
)

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 JAX devices (tests/conftest.py)")

B, T, N, K, H = 2, 32, 4, 2, 8
SCALE = 0.3


@dataclass(frozen=True)
class Case:
    mesh: str
    scheme: str
    mask: str                    # causal | padding_causal | none
    balanced: bool = False
    pieces: int | None = None

    @property
    def id(self) -> str:
        return "-".join([self.mesh, self.scheme, self.mask] + ["balanced"] * self.balanced
                        + ([f"pieces{self.pieces}"] if self.pieces else []))


CASES = [
    Case("sp2xdata2xheads2", "ring", "causal"),
    Case("sp4xdata2", "ring", "causal", balanced=True),
    Case("sp2xdata2xheads2", "all_gather", "causal", balanced=True),
    Case("sp8", "ring", "padding_causal"),
    Case("sp4xdata2", "all_gather", "none"),
    Case("sp2xdata2xheads2", "ring", "causal", balanced=True, pieces=4),
]
MASKS = {"causal": MaskType.CAUSAL, "padding_causal": MaskType.PADDING_CAUSAL, "none": MaskType.NO_MASK}


def _inputs(seed: int, padded: bool):
    rng = np.random.default_rng(seed)
    q, k, v = qkv(rng, B=B, T=T, S=T, N=N, K=K, H=H)
    sink = jnp.asarray(rng.standard_normal(N) + 1.0, jnp.float32)
    lengths = jnp.asarray(rng.integers(T // 2, T + 1, size=B), jnp.int32) if padded else None
    return q, k, v, sink, lengths, normal(rng, q.shape, "float32")


def _attention(case: Case, **extra):
    def fn(q, k, v, sink, lengths):
        return jb.dot_product_attention(q, k, v, sink=sink, q_seqlen=lengths, kv_seqlen=lengths, scale=SCALE,
                                        mask_type=MASKS[case.mask], return_residual=True, **extra)
    return fn


def _grads(fn, weight, args):
    loss = lambda *a: jnp.sum(fn(*a)[0].astype(jnp.float32) * weight)  # noqa: E731
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)


def _compare(got, want, back, what: str):
    (out, lse), grads = got
    (e_out, e_lse), e_grads = want
    assert_close(back(out), e_out, "float16", f"output ({what})")
    np.testing.assert_allclose(np.asarray(back(lse, 2)), np.asarray(e_lse), rtol=2e-3, atol=2e-3,
                               err_msg=f"logsumexp ({what})")
    for name, g, e in zip(["dq", "dk", "dv"], grads, e_grads):
        assert_close(back(g), e, "float16", f"{name} ({what})", factor=2)
    np.testing.assert_allclose(np.asarray(grads[3]), np.asarray(e_grads[3]), rtol=4e-3, atol=4e-3,
                               err_msg=f"dsink ({what})")


def _orders(case: Case, shards: int):
    if not case.balanced:
        return (lambda x, axis=1: x), (lambda x, axis=1: x)
    return ((lambda x, axis=1: load_balance(x, shards, axis)), (lambda x, axis=1: restore_order(x, shards, axis)))


def _expected(case: Case, args: tuple, weight):
    """The unsharded call's (output, logsumexp) and (dq, dk, dv, dsink)."""
    fn = _attention(case)
    return jax.jit(fn)(*args), _grads(fn, weight, args)


def _mesh(case: Case):
    """The case's mesh, the Q/K/V spec, the sink's (split with the heads) and the devices on the sequence."""
    shape, names, spec = MESHES[case.mesh]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
    return mesh, spec, P("model") if "model" in names else P(), mesh.shape["sp"]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_a_sink_under_jit_partitioning(case):
    seed = 600 + CASES.index(case)
    q, k, v, sink, lengths, weight = _inputs(seed, "padding" in case.mask)
    want = _expected(case, (q, k, v, sink, lengths), weight)
    mesh, spec, sink_spec, shards = _mesh(case)
    to_stored, back = _orders(case, shards)
    put = lambda x, s=spec: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    args = (put(to_stored(q)), put(to_stored(k)), put(to_stored(v)), put(sink, sink_spec), lengths)
    split = _attention(case, context_parallel=ContextParallel(case.scheme, load_balance=shards if case.balanced
                                                              else None, pieces=case.pieces))
    got = (jax.jit(split)(*args), _grads(split, put(to_stored(weight)), args))
    _compare(got, want, back, f"reproduce: seed {seed}, case {case.id}")


@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=[CASES[1].id, CASES[2].id])
def test_a_sink_inside_shard_map(case):
    """Inside shard_map the call takes its local Q/K/V and its heads of the sink; the sink's gradient, a share
    per device, is summed by shard_map's transpose of the replicated sink."""
    seed = 650 + CASES.index(case)
    q, k, v, sink, lengths, weight = _inputs(seed, False)
    want = _expected(case, (q, k, v, sink, lengths), weight)
    mesh, spec, sink_spec, shards = _mesh(case)
    to_stored, back = _orders(case, shards)
    context = ContextParallel(case.scheme, axis="sp", load_balance=shards if case.balanced else None)
    local = _attention(case, context_parallel=context)
    lse_spec = P(spec[0], spec[2] if len(spec) > 2 else None, "sp")
    sharded = jax.shard_map(lambda q, k, v, s: local(q, k, v, s, None), mesh=mesh,
                            in_specs=(spec, spec, spec, sink_spec), out_specs=(spec, lse_spec))
    put = lambda x, s=spec: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
    args = (put(to_stored(q)), put(to_stored(k)), put(to_stored(v)), put(sink, sink_spec))
    out = jax.jit(sharded)(*args)
    loss = lambda *a: jnp.sum(sharded(*a)[0].astype(jnp.float32) * put(to_stored(weight)))  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    _compare((out, grads), want, back, f"reproduce: seed {seed}, shard_map case {case.id}")


@pytest.mark.parametrize("scheme", list(Scheme), ids=[s.value for s in Scheme])
def test_the_block_calls_of_a_sink_carry_no_sink(scheme):
    config = AttentionConfig(batch=2, q_heads=4, kv_heads=4, q_len=1024, kv_len=1024, qk_dim=64, v_dim=64,
                             dtype="bfloat16", mask=StaticMask(right_bound=0), sink=True, training=True)
    blocks = block_configs(config, Split(("sp",), 2, 2, scheme))
    assert blocks and not any(block.sink for block in blocks)


def test_a_sink_in_the_load_balanced_order_on_one_device():
    """No mesh: the call that declares the load-balanced order runs the split engine on one device, in pieces."""
    case = Case("sp8", "ring", "causal", balanced=True, pieces=4)
    q, k, v, sink, lengths, weight = _inputs(700, False)
    want = _expected(case, (q, k, v, sink, lengths), weight)
    to_stored, back = _orders(case, 2)
    split = _attention(case, context_parallel=ContextParallel(load_balance=2, pieces=4))
    args = (to_stored(q), to_stored(k), to_stored(v), sink, lengths)
    got = (jax.jit(split)(*args), _grads(split, to_stored(weight), args))
    _compare(got, want, back, "reproduce: seed 700, one device, load_balance=2 pieces=4")
