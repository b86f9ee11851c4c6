"""Context parallelism on 8 CPU devices: the query/key sequence sharded over a mesh axis of 2, 4 or 8
devices (with batch and head axes beside it), ring and all-gather schemes, natural and load-balanced
order, under ``jit`` automatic partitioning and inside ``shard_map``; outputs, logsumexps and gradients
against the unsharded call (the NumPy reference behind the same primitives).

Tolerance: every block's output is rounded to float16, and the merged output and the summed gradients are
stored in float16 after each merged piece (P x pieces roundings per row at most), so the sharded results
differ from the once-rounded reference by a few float16 ulps (relative error bound 2e-3 for the output,
the ``float16`` tolerance of ``test_jax_common``, twice that for gradients).  ``pieces`` cases cut every
device's queries and keys into 2 or 4 pieces.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_jax_common import assert_close, normal, qkv

from cudnn_attn import MaskType, UnsupportedConfigurationError
from cudnn_attn import jax_bridge as jb
from cudnn_attn.jax_bridge.context_parallel import ContextParallel, load_balance, restore_order

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 JAX devices (tests/conftest.py)")

B, T, N, K, H = 2, 32, 4, 2, 8
SCALE = 0.3
MESHES = {                                   # name -> (mesh shape, axis names, query/key/value spec)
    "sp2xdata2xheads2": ((2, 2, 2), ("data", "sp", "model"), P("data", "sp", "model")),
    "sp4xdata2": ((2, 4), ("data", "sp"), P("data", "sp")),
    "sp4xheads2": ((4, 2), ("sp", "model"), P(None, "sp", "model")),
    "sp8": ((8,), ("sp",), P(None, "sp")),
}


@dataclass(frozen=True)
class Case:
    mesh: str
    scheme: str
    mask: str                    # causal | window | padding_causal | none | padding
    bias: bool = False
    balanced: bool = False
    layout: str = "BTNH"
    pieces: int | None = None

    @property
    def id(self) -> str:
        return "-".join([self.mesh, self.scheme, self.mask] + ["bias"] * self.bias + ["balanced"] * self.balanced
                        + ([self.layout] if self.layout != "BTNH" else [])
                        + ([f"pieces{self.pieces}"] if self.pieces else []))


CASES = [
    Case("sp2xdata2xheads2", "ring", "causal"),
    Case("sp2xdata2xheads2", "all_gather", "causal", balanced=True),
    Case("sp4xdata2", "ring", "causal", balanced=True),
    Case("sp4xdata2", "all_gather", "window"),
    Case("sp4xdata2", "ring", "window", bias=True, balanced=True),      # odd window blocks with a bias: lifted
    Case("sp4xheads2", "ring", "padding_causal"),
    Case("sp2xdata2xheads2", "ring", "padding_causal", balanced=True),
    Case("sp4xheads2", "all_gather", "padding", balanced=True),
    Case("sp4xheads2", "ring", "none", bias=True),
    Case("sp4xdata2", "ring", "causal", bias=True, balanced=True),
    Case("sp4xdata2", "all_gather", "causal", bias=True),
    Case("sp8", "ring", "causal"),
    Case("sp8", "ring", "padding_causal"),
    Case("sp8", "all_gather", "causal", bias=True, balanced=True),
    Case("sp2xdata2xheads2", "ring", "causal", layout="BNTH"),
    Case("sp2xdata2xheads2", "ring", "causal", balanced=True, pieces=4),
    Case("sp4xdata2", "ring", "padding_causal", bias=True, balanced=True, pieces=2),
    Case("sp4xheads2", "ring", "window", pieces=2, layout="BNTH"),
    Case("sp4xdata2", "all_gather", "causal", balanced=True, pieces=4),
]
# Explicit mesh axes for every other case (the sharding is checked when the call is traced), Auto for the rest.
AXIS_TYPES = [AxisType.Explicit if i % 2 else AxisType.Auto for i in range(len(CASES))]


def _inputs(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    q, k, v = qkv(rng, B=B, T=T, S=T, N=N, K=K, H=H, layout=case.layout)
    bias = normal(rng, (1, N, T, T), "float16") if case.bias else None
    lengths = jnp.asarray(rng.integers(T // 2, T + 1, size=B), jnp.int32) if "padding" in case.mask else None
    weight = normal(rng, q.shape, "float32")
    return q, k, v, bias, lengths, weight


def _attention(case: Case, **extra):
    mask_type = {"causal": MaskType.CAUSAL, "window": MaskType.CAUSAL, "padding_causal": MaskType.PADDING_CAUSAL,
                 "none": MaskType.NO_MASK, "padding": MaskType.PADDING}[case.mask]
    window = 6 if case.mask == "window" else None

    def fn(q, k, v, bias, lengths):
        return jb.dot_product_attention(q, k, v, bias, q_seqlen=lengths, kv_seqlen=lengths, scale=SCALE,
                                        mask_type=mask_type, sliding_window_length=window, qkv_layout=case.layout,
                                        return_residual=True, **extra)
    return fn


def _loss(fn, weight):
    def loss(q, k, v, bias, lengths):
        return jnp.sum(fn(q, k, v, bias, lengths)[0].astype(jnp.float32) * weight)
    return loss


def _argnums(case: Case):
    return (0, 1, 2, 3) if case.bias else (0, 1, 2)


def _expected(case: Case, inputs):
    q, k, v, bias, lengths, weight = inputs
    fn = _attention(case)
    out, lse = jax.jit(fn)(q, k, v, bias, lengths)
    grads = jax.jit(jax.grad(_loss(fn, weight), argnums=_argnums(case)))(q, k, v, bias, lengths)
    return out, lse, grads


def _orders(case: Case, shards: int):
    """(to the stored order, back to the natural order) of every sequence dimension."""
    seq = 1 if case.layout == "BTNH" else 2
    if not case.balanced:
        same = lambda x, name: x  # noqa: E731
        return same, same
    def axes(name):
        return {"bias": (2, 3), "lse": 2}.get(name, seq)
    return (lambda x, name: None if x is None else load_balance(x, shards, axes(name)),
            lambda x, name: restore_order(x, shards, axes(name)))


def _compare(case: Case, got, expected, back, what: str):
    out, lse, grads = got
    e_out, e_lse, e_grads = expected
    assert_close(back(out, "q"), e_out, "float16", f"output ({what})")
    lse = np.asarray(back(lse, "lse"))
    np.testing.assert_allclose(lse, np.asarray(e_lse), rtol=2e-3, atol=2e-3, err_msg=f"logsumexp ({what})")
    for name, g, e in zip(["dq", "dk", "dv", "dbias"], grads, e_grads):
        assert_close(back(g, "bias" if name == "dbias" else "q"), e, "float16", f"{name} ({what})", factor=2)


@pytest.mark.parametrize("case, axis_type", list(zip(CASES, AXIS_TYPES)),
                         ids=[f"{c.id}-{'explicit' if a is AxisType.Explicit else 'auto'}"
                              for c, a in zip(CASES, AXIS_TYPES)])
def test_jit_partitioning_of_a_sharded_sequence(case, axis_type):
    seed = CASES.index(case)
    inputs = _inputs(case, seed)
    expected = _expected(case, inputs)
    shape, names, spec = MESHES[case.mesh]
    mesh = jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))
    if case.layout == "BNTH":
        spec = P(spec[0], spec[2], spec[1])
    shards = mesh.shape["sp"]
    to_stored, back = _orders(case, shards)
    q, k, v, bias, lengths, weight = inputs
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    args = (put(to_stored(q, "q")), put(to_stored(k, "q")), put(to_stored(v, "q")), to_stored(bias, "bias"), lengths)
    context = ContextParallel(case.scheme, load_balance=shards if case.balanced else None, pieces=case.pieces)
    fn = _attention(case, context_parallel=context)
    out, lse = jax.jit(fn)(*args)
    assert out.sharding.is_equivalent_to(args[0].sharding, 4), out.sharding
    grads = jax.jit(jax.grad(_loss(fn, put(to_stored(weight, "q"))), argnums=_argnums(case)))(*args)
    for g, a in zip(grads[:3], args):
        assert g.sharding.is_equivalent_to(a.sharding, 4), (g.sharding, a.sharding)
    _compare(case, (out, lse, grads), expected, back, f"reproduce: {case.id} {axis_type}, seed {seed}")


SHARD_MAP_CASES = [CASES[i] for i in (0, 3, 6, 9, 11, 15)]


@pytest.mark.parametrize("case", SHARD_MAP_CASES, ids=[c.id for c in SHARD_MAP_CASES])
def test_shard_map_with_a_sequence_axis(case):
    """Inside shard_map the call names its sequence axis and takes its local Q/K/V, its rows of the bias
    (all columns) and the global lengths."""
    seed = 50 + CASES.index(case)
    inputs = _inputs(case, seed)
    expected = _expected(case, inputs)
    shape, names, spec = MESHES[case.mesh]
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))
    shards = mesh.shape["sp"]
    to_stored, back = _orders(case, shards)
    q, k, v, bias, lengths, weight = inputs
    bias_spec = P(None, None, "sp", None)
    context = ContextParallel(case.scheme, axis="sp", load_balance=shards if case.balanced else None,
                              pieces=case.pieces)
    local = _attention(case, context_parallel=context)
    length_spec = P(spec[0])                          # the batch shard's lengths, of the whole sequence
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, bias_spec, length_spec),
                            out_specs=(spec, P(spec[0], spec[2] if len(spec) > 2 else None, "sp")))
    put = lambda x, spec: None if x is None else jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    args = (put(to_stored(q, "q"), spec), put(to_stored(k, "q"), spec), put(to_stored(v, "q"), spec),
            put(to_stored(bias, "bias"), bias_spec), put(lengths, length_spec))
    out, lse = jax.jit(sharded)(*args)
    grads = jax.jit(jax.grad(_loss(sharded, put(to_stored(weight, "q"), spec)), argnums=_argnums(case)))(*args)
    _compare(case, (out, lse, grads), expected, back, f"reproduce: shard_map {case.id}, seed {seed}")


def test_ring_sends_blocks_and_all_gather_gathers_them():
    """The compiled programs communicate as their scheme says, and never gather the queries."""
    rng = np.random.default_rng(7)
    q, k, v = qkv(rng, B=B, T=T, S=T, N=N, H=H)
    mesh = jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Explicit,))
    args = [jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v)]
    texts = {}
    for scheme in ("ring", "all_gather"):
        fn = jax.jit(lambda q, k, v: jb.dot_product_attention(q, k, v, mask_type=MaskType.CAUSAL,  # noqa: B023
                                                              context_parallel=scheme))
        texts[scheme] = fn.lower(*args).compile().as_text()
    assert "collective-permute" in texts["ring"] and "all-gather" not in texts["ring"]
    assert "all-gather" in texts["all_gather"] and "collective-permute" not in texts["all_gather"]
    for text in texts.values():          # every kernel's output is a block of at most T / 8 query rows
        results = [line.split("custom-call(")[0] for line in text.splitlines()
                   if 'custom_call_target="cudnn_attn"' in line]
        rows = [int(m) for r in results for m in re.findall(rf"f16\[{B},(\d+),{N},{H}\]", r)]
        assert results and len(rows) == len(results) and max(rows) <= T // 8, results


def test_context_manager_sets_the_default_scheme():
    rng = np.random.default_rng(8)
    q, k, v = qkv(rng, B=B, T=T, S=T, N=N, H=H)
    mesh = jax.make_mesh((8,), ("sp",), axis_types=(AxisType.Explicit,))
    args = [jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v)]
    with jb.context_parallelism("all_gather"):
        text = jax.jit(lambda q, k, v: jb.dot_product_attention(q, k, v)).lower(*args).compile().as_text()
    assert "all-gather" in text and "collective-permute" not in text


def test_load_balance_round_trip_and_order():
    x = jnp.arange(16).reshape(1, 16)
    balanced = load_balance(x, 2)
    np.testing.assert_array_equal(np.asarray(balanced)[0], [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11])
    np.testing.assert_array_equal(np.asarray(restore_order(balanced, 2)), np.asarray(x))
    with pytest.raises(ValueError, match="not a multiple of 2 \\* shards = 6"):
        load_balance(x, 3)


def _sequence_sharded(fn, mesh_shape=(8,), length=T):
    rng = np.random.default_rng(9)
    q, k, v = qkv(rng, B=B, T=length, S=length, N=N, H=H)
    mesh = jax.make_mesh(mesh_shape, ("sp",), axis_types=(AxisType.Explicit,))
    return jax.jit(fn)(*[jax.device_put(x, NamedSharding(mesh, P(None, "sp"))) for x in (q, k, v)])


def test_refusals_are_clear():
    with pytest.raises(UnsupportedConfigurationError, match="context parallelism: not with dropout"):
        _sequence_sharded(lambda q, k, v: jb.dot_product_attention(q, k, v, dropout_rate=0.1))
    with pytest.raises(ValueError, match="load_balance=4 .* multiple of the 8 devices"):
        _sequence_sharded(lambda q, k, v: jb.dot_product_attention(
            q, k, v, context_parallel=ContextParallel(load_balance=4)))
    with pytest.raises(ValueError, match="40 positions cannot be split into 2 \\* load_balance = 16 equal parts"):
        _sequence_sharded(lambda q, k, v: jb.dot_product_attention(
            q, k, v, context_parallel=ContextParallel(load_balance=8)), length=40)
    with pytest.raises(ValueError, match="not a mesh axis of an enclosing shard_map"):
        rng = np.random.default_rng(10)
        q, k, v = qkv(rng, B=B, T=T, S=T, N=N, H=H)
        jb.dot_product_attention(q, k, v, context_parallel=ContextParallel(axis="sp"))
    with pytest.raises(ValueError, match="scheme must be one of"):
        ContextParallel("zigzag")
    with pytest.raises(ValueError, match="pieces must be a positive int"):
        ContextParallel(pieces=0)
    with pytest.raises(ValueError, match="pieces=3 does not divide the 4 query positions a device holds"):
        _sequence_sharded(lambda q, k, v: jb.dot_product_attention(q, k, v, context_parallel=ContextParallel(pieces=3)))


def test_load_balanced_order_on_one_device_is_still_honoured():
    """A call that declares the load-balanced order but runs unsharded computes the same attention."""
    rng = np.random.default_rng(11)
    q, k, v = qkv(rng, B=B, T=T, S=T, N=N, H=H)
    fn = lambda q, k, v, **kw: jb.dot_product_attention(q, k, v, mask_type=MaskType.CAUSAL, **kw)  # noqa: E731
    expected = jax.jit(fn)(q, k, v)
    got = jax.jit(lambda q, k, v: fn(q, k, v, context_parallel=ContextParallel(load_balance=4)))(
        *(load_balance(x, 4) for x in (q, k, v)))
    assert_close(restore_order(got, 4), expected, "float16", "output")
