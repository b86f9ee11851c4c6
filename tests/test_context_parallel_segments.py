"""Packed segments (document masks) under context parallelism on 8 CPU devices: ring and all-gather,
natural and load-balanced order, pieces, ``jit`` automatic partitioning and ``shard_map``; outputs,
logsumexps and gradients against the unsharded packed call (the NumPy reference behind the same
primitives).

Every row holds several documents with seeded random boundaries, none of them on a shard boundary (a
document crosses every one), tokens after the last document that belong to none, and at least one empty
slot.  Documents are self-attention documents: each one's keys are its queries' positions
(``kv_offsets == q_offsets``, ``kv_seqlen == q_seqlen``), which a causal split call needs
(``jax_bridge.context_parallel``).  Tolerances are those of ``test_context_parallel``.

The split call's logsumexp has the unsharded call's shape ``(B*M, N, T)`` but its own layout: row
``b*M + m`` holds segment ``m`` of row ``b`` at the segment's own query positions (in the stored order,
sharded with the queries), 0 elsewhere; :func:`_by_position` brings the unsharded one to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_context_parallel import MESHES  # the meshes of the unpacked cases
from test_jax_common import assert_close, normal, qkv

from cudnn_attn import MaskType, UnsupportedConfigurationError
from cudnn_attn import jax_bridge as jb
from cudnn_attn.core.config import AttentionConfig, PackingSpec, StaticMask
from cudnn_attn.jax_bridge.context_parallel import ContextParallel, Scheme, Split, block_configs
from cudnn_attn.jax_bridge.context_parallel import check as check_split
from cudnn_attn.jax_bridge.context_parallel import load_balance, restore_order

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 JAX devices (tests/conftest.py)")

B, T, N, K, H, M = 2, 32, 4, 2, 8, 6
SCALE = 0.3


@dataclass(frozen=True)
class Case:
    mesh: str
    scheme: str
    causal: bool
    balanced: bool = False
    pieces: int | None = None

    @property
    def id(self) -> str:
        return "-".join([self.mesh, self.scheme, "causal" if self.causal else "none"]
                        + ["balanced"] * self.balanced + ([f"pieces{self.pieces}"] if self.pieces else []))

    @property
    def shards(self) -> int:
        shape, names, _ = MESHES[self.mesh]
        return shape[names.index("sp")]


CASES = [
    Case("sp4xdata2", "ring", True),
    Case("sp4xdata2", "ring", True, balanced=True),
    Case("sp2xdata2xheads2", "all_gather", True),
    Case("sp2xdata2xheads2", "all_gather", True, balanced=True),
    Case("sp8", "ring", True, balanced=True),
    Case("sp8", "all_gather", True, balanced=True),
    Case("sp4xheads2", "ring", False),
    Case("sp4xheads2", "all_gather", False, balanced=True),
    Case("sp2xdata2xheads2", "ring", True, balanced=True, pieces=4),
    Case("sp4xdata2", "all_gather", True, pieces=2),
    Case("sp4xheads2", "ring", False, balanced=True, pieces=2),
    Case("sp8", "ring", True),
]
AXIS_TYPES = [AxisType.Explicit if i % 2 else AxisType.Auto for i in range(len(CASES))]


def documents(rng: np.random.Generator, shards: int):
    """Per row 3..M-1 documents whose boundaries avoid every shard boundary, then 0..2 tokens in no
    document, then ``-1`` slots: ``(seqlen (B, M), offsets (B, M + 1))`` int32."""
    seqlen = np.full((B, M), -1, np.int32)
    offsets = np.full((B, M + 1), -1, np.int32)
    inner = [p for p in range(2, T - 3) if p % (T // shards)]
    for b in range(B):
        count = int(rng.integers(3, M))
        cuts = np.sort(rng.choice(inner, count - 1, replace=False))
        starts = np.concatenate([[0], cuts]).astype(np.int32)
        ends = np.concatenate([cuts, [T - int(rng.integers(0, 3))]]).astype(np.int32)
        seqlen[b, :count] = ends - starts
        offsets[b, :count] = starts
    return jnp.asarray(seqlen), jnp.asarray(offsets)


def _inputs(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    q, k, v = qkv(rng, B=B, T=T, S=T, N=N, K=K, H=H)
    seqlen, offsets = documents(rng, case.shards)
    weight = normal(rng, q.shape, "float32")
    return q, k, v, seqlen, offsets, weight


def _attention(case: Case, **extra):
    def fn(q, k, v, seqlen, offsets):
        return jb.dot_product_attention(q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets,
                                        kv_offsets=offsets, scale=SCALE,
                                        mask_type=MaskType.CAUSAL if case.causal else MaskType.NO_MASK,
                                        return_residual=True, **extra)
    return fn


def _loss(fn, weight):
    def loss(q, k, v, seqlen, offsets):
        return jnp.sum(fn(q, k, v, seqlen, offsets)[0].astype(jnp.float32) * weight)
    return loss


def _expected(case: Case, inputs):
    q, k, v, seqlen, offsets, weight = inputs
    fn = _attention(case)
    out, lse = jax.jit(fn)(q, k, v, seqlen, offsets)
    grads = jax.jit(jax.grad(_loss(fn, weight), argnums=(0, 1, 2)))(q, k, v, seqlen, offsets)
    return out, _by_position(np.asarray(lse), np.asarray(seqlen), np.asarray(offsets)), grads


def _by_position(lse: np.ndarray, seqlen: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The unsharded packed logsumexp (present segments numbered rows first, each from column 0) in the
    split call's layout (module doc)."""
    found = np.zeros_like(lse)
    g = 0
    for b in range(seqlen.shape[0]):
        for m in range(int((seqlen[b] >= 0).sum())):
            start, length = int(offsets[b, m]), int(seqlen[b, m])
            found[b * M + m, :, start:start + length] = lse[g, :, :length]
            g += 1
    return found


def _orders(case: Case):
    if not case.balanced:
        return (lambda x, axis=1: x), (lambda x, axis=1: x)
    return ((lambda x, axis=1: load_balance(x, case.shards, axis)),
            (lambda x, axis=1: restore_order(x, case.shards, axis)))


def _compare(got, expected, back, what: str):
    out, lse, grads = got
    e_out, e_lse, e_grads = expected
    assert_close(back(out), e_out, "float16", f"output ({what})")
    np.testing.assert_allclose(np.asarray(back(lse, 2)), e_lse, rtol=2e-3, atol=2e-3, err_msg=f"logsumexp ({what})")
    for name, g, e in zip(["dq", "dk", "dv"], grads, e_grads):
        assert np.isfinite(np.asarray(g, np.float32)).all(), f"{name} is not finite ({what})"
        assert_close(back(g), e, "float16", f"{name} ({what})", factor=2)


@pytest.mark.parametrize("case, axis_type", list(zip(CASES, AXIS_TYPES)),
                         ids=[f"{c.id}-{'explicit' if a is AxisType.Explicit else 'auto'}"
                              for c, a in zip(CASES, AXIS_TYPES)])
def test_packed_segments_under_jit_partitioning(case, axis_type):
    seed = 200 + CASES.index(case)
    inputs = _inputs(case, seed)
    expected = _expected(case, inputs)
    shape, names, spec = MESHES[case.mesh]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))
    to_stored, back = _orders(case)
    q, k, v, seqlen, offsets, weight = inputs
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    args = (put(to_stored(q)), put(to_stored(k)), put(to_stored(v)), seqlen, offsets)
    context = ContextParallel(case.scheme, load_balance=case.shards if case.balanced else None, pieces=case.pieces)
    fn = _attention(case, context_parallel=context)
    out, lse = jax.jit(fn)(*args)
    assert out.sharding.is_equivalent_to(args[0].sharding, 4), out.sharding
    grads = jax.jit(jax.grad(_loss(fn, put(to_stored(weight))), argnums=(0, 1, 2)))(*args)
    _compare((out, lse, grads), expected, back, f"reproduce: seed {seed}, case {case.id} {axis_type}")


SHARD_MAP_CASES = [CASES[i] for i in (1, 2, 7, 8)]


@pytest.mark.parametrize("case", SHARD_MAP_CASES, ids=[c.id for c in SHARD_MAP_CASES])
def test_packed_segments_inside_shard_map(case):
    """Inside shard_map the call takes its local Q/K/V and the global segments of its batch rows."""
    seed = 300 + CASES.index(case)
    inputs = _inputs(case, seed)
    expected = _expected(case, inputs)
    shape, names, spec = MESHES[case.mesh]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
    to_stored, back = _orders(case)
    q, k, v, seqlen, offsets, weight = inputs
    context = ContextParallel(case.scheme, axis="sp", load_balance=case.shards if case.balanced else None,
                              pieces=case.pieces)
    local = _attention(case, context_parallel=context)
    rows = P(spec[0])                                 # the batch shard's segments, in global positions
    lse_spec = P(spec[0], spec[2] if len(spec) > 2 else None, "sp")
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, rows, rows), out_specs=(spec, lse_spec))
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    args = (put(to_stored(q), spec), put(to_stored(k), spec), put(to_stored(v), spec), put(seqlen, rows),
            put(offsets, rows))
    out, lse = jax.jit(sharded)(*args)
    grads = jax.jit(jax.grad(_loss(sharded, put(to_stored(weight), spec)), argnums=(0, 1, 2)))(*args)
    _compare((out, lse, grads), expected, back, f"reproduce: seed {seed}, shard_map case {case.id}")


def test_a_document_with_no_keys_in_a_block_gives_finite_gradients():
    """One document per row ends before the last shard begins: the last shard's rows of it are absent,
    and its blocks against other shards hold rows with no key (output 0, logsumexp -inf in the merge)."""
    case = Case("sp4xdata2", "ring", True)
    rng = np.random.default_rng(400)
    q, k, v = qkv(rng, B=B, T=T, S=T, N=N, K=K, H=H)
    seqlen = jnp.asarray([[5, 14, -1, -1, -1, -1], [23, 1, 3, -1, -1, -1]], jnp.int32)
    offsets = jnp.asarray([[0, 9, -1, -1, -1, -1, -1], [2, 25, 28, -1, -1, -1, -1]], jnp.int32)
    weight = normal(rng, q.shape, "float32")
    inputs = (q, k, v, seqlen, offsets, weight)
    expected = _expected(case, inputs)
    shape, names, spec = MESHES[case.mesh]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    args = (put(q), put(k), put(v), seqlen, offsets)
    fn = _attention(case, context_parallel=ContextParallel("ring"))
    out, lse = jax.jit(fn)(*args)
    grads = jax.jit(jax.grad(_loss(fn, put(weight)), argnums=(0, 1, 2)))(*args)
    _compare((out, lse, grads), expected, lambda x, axis=1: x, "reproduce: seed 400, fixed documents")


PACKED = AttentionConfig(batch=2, q_heads=4, kv_heads=4, q_len=1024, kv_len=1024, qk_dim=64, v_dim=64,
                         dtype="float16", packing=PackingSpec(max_segments=4),
                         mask=StaticMask(right_bound=0, padding=True), training=True)


def test_refusals_of_packed_segments():
    with pytest.raises(UnsupportedConfigurationError, match="packed segments in a sliding window"):
        check_split(PACKED.replace(mask=StaticMask(right_bound=0, left_bound=64, padding=True)),
                    Split(("sp",), 4, 0, Scheme.RING))
    # load-balanced chunks of 96 cut into query pieces of 64 against gathered keys in pieces of 128: device
    # 1's first piece (positions 96..159) faces keys 0..127, a band that neither starts nor ends on the diagonal
    odd = PACKED.replace(q_len=384, kv_len=384)
    with pytest.raises(UnsupportedConfigurationError, match="not with packed segments on a causal block"):
        check_split(odd, Split(("sp",), 2, 2, Scheme.ALL_GATHER, pieces=3))
    check_split(odd.replace(mask=StaticMask(padding=True)), Split(("sp",), 2, 2, Scheme.ALL_GATHER, pieces=3))


@pytest.mark.parametrize("scheme", list(Scheme), ids=[s.value for s in Scheme])
@pytest.mark.parametrize("balance", [0, 4], ids=["natural", "balanced"])
def test_packed_block_calls_are_full_or_aligned_causal(scheme, balance):
    """Every block call of a packed causal split is padded and packed, and either has no band or is
    causal (top-left, or bottom-right where the block's last row and key coincide)."""
    found = block_configs(PACKED, Split(("sp",), 4, balance, scheme))
    assert found
    for config in found:
        assert config.packing == PACKED.packing and config.mask.padding and config.mask.left_bound is None
        assert config.mask.right_bound in (None, 0), config.mask


def test_packed_segments_in_the_load_balanced_order_on_one_device():
    """A packed call that declares the load-balanced order but runs unsharded: the same attention, and the
    split call's logsumexp layout in the stored order."""
    case = Case("sp4xdata2", "ring", True, balanced=True)
    inputs = _inputs(case, 500)
    expected = _expected(case, inputs)
    q, k, v, seqlen, offsets, weight = inputs
    to_stored, back = _orders(case)
    fn = _attention(case, context_parallel=ContextParallel(load_balance=4))
    args = (to_stored(q), to_stored(k), to_stored(v), seqlen, offsets)
    out, lse = jax.jit(fn)(*args)
    grads = jax.jit(jax.grad(_loss(fn, to_stored(weight)), argnums=(0, 1, 2)))(*args)
    _compare((out, lse, grads), expected, back, "reproduce: seed 500, one device, load_balance=4")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "none"])
def test_segments_whose_keys_are_elsewhere(causal):
    """Segments whose keys are not their queries' positions (row 0: a document's keys one shorter): unmasked,
    the split call equals the unsharded one; causal, the blocks cannot place that segment's diagonal, so
    every output and gradient of row 0 is NaN rather than silently wrong, and row 1 is right."""
    case = Case("sp4xdata2", "ring", causal)
    rng = np.random.default_rng(500)
    q, k, v = qkv(rng, B=B, T=T, S=T, N=N, K=K, H=H)
    seqlen, offsets = documents(rng, case.shards)
    kv_seqlen = seqlen.at[0, 0].add(-1)
    weight = normal(rng, q.shape, "float32")

    def attention(**extra):
        def fn(q, k, v, seqlen, offsets):
            return jb.dot_product_attention(q, k, v, q_seqlen=seqlen, kv_seqlen=kv_seqlen, q_offsets=offsets,
                                            kv_offsets=offsets, scale=SCALE, return_residual=True,
                                            mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK, **extra)
        return fn

    shape, names, spec = MESHES[case.mesh]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    split = attention(context_parallel=ContextParallel("ring"))
    out, _ = jax.jit(split)(put(q), put(k), put(v), seqlen, offsets)
    grads = jax.jit(jax.grad(_loss(split, put(weight)), argnums=(0, 1, 2)))(put(q), put(k), put(v), seqlen, offsets)
    want = jax.jit(attention())(q, k, v, seqlen, offsets)[0]
    want_grads = jax.jit(jax.grad(_loss(attention(), weight), argnums=(0, 1, 2)))(q, k, v, seqlen, offsets)
    if causal:                             # row 0 holds the misplaced keys; row 1 is computed as ever
        for name, x, e in zip(["output", "dq", "dk", "dv"], (out, *grads), (want, *want_grads)):
            x, e = np.asarray(x, np.float32), np.asarray(e, np.float32)
            assert np.isnan(x[0]).all(), f"{name}: expected NaN in row 0 (reproduce: seed 500)"
            assert_close(x[1:], e[1:], "float16", f"{name} of row 1 (reproduce: seed 500)", factor=2)
        return
    assert_close(out, want, "float16", "output (reproduce: seed 500, unmasked)")
    for name, g, e in zip(["dq", "dk", "dv"], grads, want_grads):
        assert_close(g, e, "float16", f"{name} (reproduce: seed 500, unmasked)", factor=2)


@pytest.mark.parametrize("scheme", ["ring", "all_gather"])
def test_packed_segments_with_a_sink(scheme, monkeypatch):
    """Packed documents and an attention sink together, trained.  Unsplit, cuDNN 9.19 has no packed backward with a
    sink (the support table refuses it for the CPU fronts' sm90 target); split, the block calls are packed calls
    without the sink and the sink joins the merge, so the split call runs it.  Against the unsplit call on the
    unrestricted reference (``$CUDNN_ATTN_CPU_TARGET=off``): output, logsumexp, dq, dk, dv and dsink."""
    case = Case("sp4xdata2", scheme, True, balanced=True)
    seed = 800 + ["ring", "all_gather"].index(scheme)
    q, k, v, seqlen, offsets, weight = _inputs(case, seed)
    sink = jnp.asarray(np.random.default_rng(seed).standard_normal(N) + 1.0, jnp.float32)

    def attention(**extra):
        def fn(q, k, v, sink):
            return _attention(case, sink=sink, **extra)(q, k, v, seqlen, offsets)
        return fn

    def grads(fn, weight, args):
        loss = lambda *a: jnp.sum(fn(*a)[0].astype(jnp.float32) * weight)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)

    with pytest.raises(UnsupportedConfigurationError, match=r"packed segments with a sink \(backward\)"):
        grads(attention(), weight, (q, k, v, sink))
    monkeypatch.setenv("CUDNN_ATTN_CPU_TARGET", "off")
    want_out, want_lse = jax.jit(attention())(q, k, v, sink)
    want_grads = grads(attention(), weight, (q, k, v, sink))
    monkeypatch.delenv("CUDNN_ATTN_CPU_TARGET")
    shape, names, spec = MESHES[case.mesh]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
    to_stored, back = _orders(case)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    args = (put(to_stored(q)), put(to_stored(k)), put(to_stored(v)), jax.device_put(sink, NamedSharding(mesh, P())))
    split = attention(context_parallel=ContextParallel(scheme, load_balance=case.shards))
    out, lse = jax.jit(split)(*args)
    got_grads = grads(split, put(to_stored(weight)), args)
    what = f"reproduce: seed {seed}, case {case.id} with a sink"
    expected = (want_out, _by_position(np.asarray(want_lse), np.asarray(seqlen), np.asarray(offsets)), want_grads[:3])
    _compare((out, lse, got_grads[:3]), expected, back, what)
    np.testing.assert_allclose(np.asarray(got_grads[3]), np.asarray(want_grads[3]), rtol=4e-3, atol=4e-3,
                               err_msg=f"dsink ({what})")
