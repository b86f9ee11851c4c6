"""The max logit (``AuxRequest(max_logit=True)``: per-row ``score_max`` and per-head ``max_logit``) and dropout
from a PRNG key (the seed and offset as device operands), on the CPU: the NumPy reference, the support table, the
call's spec, and the JAX bridge (its CPU target runs the reference) under ``jit``, ``grad``, ``vmap``, automatic
partitioning on 8 CPU devices and context parallelism.

The reference's row maxima are exact (float64 scores, one rounding to float32), so they are compared with a
float32 tolerance of 1e-6 relative to an independent NumPy max of the admissible scores.  The CPU masks are
NumPy's (``reference.masks.dropout_entropy``), not cuDNN's Philox: tests check each mask against its own
statistics (a keep rate within 5 standard deviations of ``1 - rate``) and the mask identities (the same key, the
same mask; another key, another).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from test_jax_common import normal, qkv

from cudnn_attn import AuxRequest, MaskType, UnsupportedConfigurationError, causal, keep, padding, reference, window
from cudnn_attn import jax_bridge as jb
from cudnn_attn.core import masked_rows
from cudnn_attn.core.config import AttentionConfig, AttentionOperands, PackingSpec
from cudnn_attn.core.environment import Environment
from cudnn_attn.core.support import check_everywhere, not_supported_reasons
from cudnn_attn.core.types import Front
from cudnn_attn.core.validation import bind_seed, seed_operands
from cudnn_attn.engine.call import CallSpec, Fill
from cudnn_attn.graphs import TensorId
from cudnn_attn.jax_bridge import dropout
from cudnn_attn.jax_bridge.context_parallel import ContextParallel
from cudnn_attn.reference import masks as reference_masks

B, T, N, K, H = 2, 16, 4, 2, 8
SCALE = 0.3
MAX_LOGIT = AuxRequest(max_logit=True)


def _scores(q, k, bias=None):
    """Independent float64 scaled scores (B, N, T, S) of BTNH Q and K (K heads repeated for GQA)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    s = SCALE * np.einsum("btnh,bsnh->bnts", q, k)
    return s if bias is None else s + np.asarray(bias, np.float64)


def _row_max(s, admissible):
    return np.where(admissible.any(-1), np.where(admissible, s, -np.inf).max(-1), -np.inf)


# -- the reference ------------------------------------------------------------------------------------------

CASES = ["causal", "padding_causal", "bias_window", "keep_mask_empty_rows", "bottom_right_t_gt_s"]


@pytest.mark.parametrize("case", CASES)
def test_reference_score_max_is_the_max_of_the_admissible_scores(case):
    rng = np.random.default_rng(CASES.index(case))
    t, s = (T, T // 2) if case == "bottom_right_t_gt_s" else (T, T)
    q, k, v = (np.asarray(x) for x in qkv(rng, B=B, T=t, S=s, N=N, K=K, H=H, dtype="float16"))
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    admissible = np.ones((B, 1, t, s), bool)
    bias, mask = None, None
    if case == "causal":
        mask = causal()
        admissible = admissible & (j <= i)
    elif case == "padding_causal":
        lengths = np.array([T, 11], np.int32)
        mask = causal() & padding(lengths, lengths)
        admissible = admissible & (j <= i) & (i < lengths[:, None, None, None]) & (j < lengths[:, None, None, None])
    elif case == "bias_window":
        bias = np.asarray(normal(rng, (1, N, T, T), "float16"))
        mask = window(3, 0)
        admissible = admissible & (j <= i) & (i - j <= 3)
    elif case == "keep_mask_empty_rows":
        kept = rng.random((B, 1, T, T)) > 0.3
        kept[1, 0, 5] = False                                       # a row that keeps no key
        mask = keep(kept)
        admissible = admissible & kept
    else:
        full = np.full(B, t, np.int32), np.full(B, s, np.int32)
        mask = causal("bottom_right") & padding(*full)              # rows 0..7 face no key
        admissible = admissible & (j <= i - (t - s))
    result = reference.attention(q, k, v, mask=mask, bias=bias, scale=SCALE, return_aux=MAX_LOGIT)
    expected = _row_max(_scores(q, k, bias), np.broadcast_to(admissible, (B, N, t, s)))
    assert result.score_max.dtype == np.float32 and result.score_max.shape == (B, N, t)
    assert np.array_equal(np.isinf(result.score_max), np.isinf(expected)), case
    finite = np.isfinite(expected)
    np.testing.assert_allclose(result.score_max[finite], expected[finite], rtol=1e-6, err_msg=case)
    assert result.max_logit.shape == (N,) and result.max_logit.dtype == np.float32
    np.testing.assert_array_equal(result.max_logit, result.score_max.max(axis=(0, 2)))
    plain = reference.attention(q, k, v, mask=mask, bias=bias, scale=SCALE)
    assert plain.score_max is None and plain.max_logit is None
    np.testing.assert_array_equal(plain.output, result.output)


def test_aux_request_is_checked():
    q, k, v = (np.asarray(x) for x in qkv(np.random.default_rng(0), B=1, T=8, S=8, N=2, H=8))
    with pytest.raises(ValueError, match="return_aux: AuxRequest.max_logit must be True or False"):
        reference.attention(q, k, v, return_aux=AuxRequest(max_logit=1))
    with pytest.raises(ValueError, match=r"return_aux: expected None or AuxRequest\(logsumexp=..., max_logit=...\)"):
        reference.attention(q, k, v, return_aux={"max_logit": True})


# -- the support table and the call's spec -------------------------------------------------------------------

def _config(**changes):
    fields = dict(batch=B, q_heads=N, kv_heads=K, q_len=T, kv_len=T, qk_dim=H * 8, v_dim=H * 8, dtype="bfloat16",
                  scale=SCALE, training=True)
    return AttentionConfig(**{**fields, **changes})


def test_support_rows_of_the_max_logit():
    sm90 = Environment(91900, (9, 0))
    assert not not_supported_reasons(_config(score_max=True), sm90, front=Front.CUPY)
    older = not_supported_reasons(_config(score_max=True), Environment(91800, (9, 0)), front=Front.CUPY)
    assert any("max logit (cuDNN's score_max): needs cuDNN >= 9.19.0" in r for r in older), older
    ampere = not_supported_reasons(_config(score_max=True), Environment(91900, (8, 0)), front=Front.CUPY)
    assert any("max logit (cuDNN's score_max): needs compute capability >= sm90" in r for r in ampere), ampere
    sink = not_supported_reasons(_config(score_max=True, sink=True), sm90, front=Front.JAX)
    assert any("max logit: not with an attention sink" in r for r in sink), sink
    for changes, found in ((dict(packing=PackingSpec(2)), "packed segments"),
                           (dict(dtype="float8_e4m3fn", qk_dim=128, v_dim=128, training=False), "FP8")):
        with pytest.raises(UnsupportedConfigurationError, match=f"max logit: not with {found}"):
            check_everywhere(_config(score_max=True, **changes), kind="fwd")     # the reference refuses it too


def test_the_spec_of_a_max_logit_call():
    spec = CallSpec.of(_config(score_max=True), "fwd")
    assert spec.result_names == ("output", "logsumexp", "score_max")
    graph = {r.tid: r for r in spec.graph_results}
    assert set(graph) == {TensorId.O, TensorId.SCORE_MAX, TensorId.SCORE_SUM_EXP}    # cuDNN writes no Stats then
    assert all(graph[t].shape == (B, N, T) and graph[t].fill is Fill.NONE
               for t in (TensorId.SCORE_MAX, TensorId.SCORE_SUM_EXP))
    bwd = CallSpec.of(_config(score_max=True), "bwd")
    assert "score_max" not in bwd.operands and bwd.result_names == ("dq", "dk", "dv")


def test_finish_makes_the_logsumexp_from_max_and_sum_exp():
    """On NumPy buffers: logsumexp = max + log(sum_exp), 0 on padded rows; score_max -inf on padded rows."""
    config = _config(score_max=True, mask=padding(np.zeros(B, np.int32), np.zeros(B, np.int32)).static(padding=True))
    spec = CallSpec.of(config, "fwd")
    rng = np.random.default_rng(3)
    score_max = rng.standard_normal((B, N, T)).astype(np.float32)
    sum_exp = rng.uniform(1, 5, (B, N, T)).astype(np.float32)
    q_seqlen = np.array([T, 5], np.int32)
    results = spec.finish(np, {"output": None, "score_max": score_max, "score_sum_exp": sum_exp},
                          {"q_seqlen": q_seqlen, "kv_seqlen": np.array([T, T], np.int32)}, None)
    assert "score_sum_exp" not in results
    rows = np.arange(T)[None, None, :] < q_seqlen[:, None, None]
    np.testing.assert_allclose(results["logsumexp"], np.where(rows, score_max + np.log(sum_exp), 0), rtol=1e-6)
    np.testing.assert_array_equal(results["score_max"], np.where(rows, score_max, -np.inf))


def test_the_spec_of_a_device_seed():
    static, device = _config(dropout_rate=0.1), _config(dropout_rate=0.1, device_seed=True)
    assert CallSpec.of(static, "fwd").host_scalars(7) == (7, 0)
    spec = CallSpec.of(device, "fwd")
    assert spec.operands[-2:] == ("dropout_seed", "dropout_offset") and spec.host_scalars(7) == ()
    assert {TensorId.DEVICE_SEED, TensorId.DEVICE_OFFSET} <= set(spec.graph_operands)
    assert CallSpec.of(device, "bwd").operands[-5:-3] == ("dropout_seed", "dropout_offset")
    assert _config(device_seed=True) == _config()                  # without dropout nothing reads a seed


def test_seed_operands_of_every_front():
    assert seed_operands(42) is None and seed_operands(np.int64(3)) is None
    pair = np.array([11, 5], np.int64)
    seed, offset = seed_operands(pair)
    assert seed.shape == offset.shape == (1,) and int(seed[0]) == 11 and int(offset[0]) == 5
    words = (np.zeros(2, np.uint32), np.zeros(2, np.uint32))
    assert seed_operands(words) is words
    with pytest.raises(ValueError, match=r"seed: a device dropout seed must be an int64 array of two elements"):
        seed_operands(np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="seed: the dropout offset must be an int64 array of one element"):
        seed_operands((np.zeros(1, np.int64), np.zeros(3, np.uint32)))
    config, operands = _config(dropout_rate=0.2), AttentionOperands(None, None, None)
    found, with_seed, static = bind_seed(config, operands, pair)
    assert found.device_seed and static == 0 and int(with_seed.dropout_offset[0]) == 5
    assert bind_seed(_config(), operands, pair)[0] == _config()      # no dropout: nothing to bind
    with pytest.raises(ValueError, match="seed: the dropout seed must be a Python or NumPy int"):
        bind_seed(config, operands, 1.5)


# -- the JAX bridge: max logit ------------------------------------------------------------------------------

def _inputs(seed, b=B, t=T, dtype="float16"):
    rng = np.random.default_rng(seed)
    return qkv(rng, B=b, T=t, S=t, N=N, K=K, H=H, dtype=dtype)


def _expected(q, k, v, mask):
    return reference.attention(np.asarray(q), np.asarray(k), np.asarray(v), mask=mask, scale=SCALE,
                               return_aux=MAX_LOGIT)


def test_jax_max_logit_under_jit_and_its_zero_gradient():
    q, k, v = _inputs(0)
    lengths = jnp.asarray([T, 9], jnp.int32)

    def fn(q, k, v, lengths):
        return jb.attention(q, k, v, mask=causal() & padding(lengths, lengths), scale=SCALE,
                            return_aux=AuxRequest(logsumexp=True, max_logit=True))

    got = jax.jit(fn)(q, k, v, lengths)
    expected = _expected(q, k, v, causal() & padding(np.asarray(lengths), np.asarray(lengths)))
    np.testing.assert_allclose(got.score_max, expected.score_max, rtol=1e-6)
    np.testing.assert_allclose(got.max_logit, expected.max_logit, rtol=1e-6)
    assert np.isneginf(np.asarray(got.score_max)[1, :, 9:]).all()
    grads = jax.grad(lambda q, k: jnp.sum(fn(q, k, v, lengths).max_logit), argnums=(0, 1))(q, k)
    assert all(float(jnp.abs(g.astype(jnp.float32)).max()) == 0.0 for g in grads)   # documented: zero
    mixed = jax.grad(lambda q: jnp.sum(fn(q, k, v, lengths).output.astype(jnp.float32))
                     + jnp.sum(fn(q, k, v, lengths).max_logit))(q)
    only_output = jax.grad(lambda q: jnp.sum(fn(q, k, v, lengths).output.astype(jnp.float32)))(q)
    np.testing.assert_array_equal(np.asarray(mixed), np.asarray(only_output))


def test_jax_max_logit_under_vmap_is_per_instance():
    q, k, v = _inputs(1)
    qs = jnp.stack([q, q * 2])
    got = jax.vmap(lambda q: jb.attention(q, k, v, mask=causal(), scale=SCALE, return_aux=MAX_LOGIT))(qs)
    assert got.max_logit.shape == (2, N) and got.score_max.shape == (2, B, N, T)
    for i in range(2):
        expected = _expected(qs[i], k, v, causal())
        np.testing.assert_allclose(got.max_logit[i], expected.max_logit, rtol=1e-6)
        np.testing.assert_allclose(got.score_max[i], expected.score_max, rtol=1e-6)


needs_8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 JAX devices (tests/conftest.py)")


@needs_8
@pytest.mark.parametrize("spec", [P("data"), P(None, None, "model"), P("data", None, "model")],
                         ids=["batch", "heads", "batch_and_heads"])
def test_jax_max_logit_under_automatic_partitioning_is_the_max_across_shards(spec):
    q, k, v = _inputs(2, b=8)
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    got = jax.jit(lambda q, k, v: jb.attention(q, k, v, mask=causal(), scale=SCALE, return_aux=MAX_LOGIT))(
        put(q), put(k), put(v))
    expected = _expected(q, k, v, causal())
    np.testing.assert_allclose(np.asarray(got.max_logit), expected.max_logit, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got.score_max), expected.score_max, rtol=1e-6)


@needs_8
@pytest.mark.parametrize("scheme", ["ring", "all_gather"])
def test_jax_max_logit_with_context_parallelism_is_the_max_across_the_ring(scheme):
    q, k, v = _inputs(3, t=32)
    lengths = jnp.asarray([32, 21], jnp.int32)
    mask = causal() & padding(lengths, lengths)
    mesh = jax.make_mesh((2, 4), ("data", "sp"), axis_types=(AxisType.Explicit,) * 2)
    spec = P("data", "sp")
    put = lambda x: jax.device_put(x, NamedSharding(mesh, spec))  # noqa: E731
    context = ContextParallel(scheme)
    got = jax.jit(lambda q, k, v: jb.attention(q, k, v, mask=mask, scale=SCALE, return_aux=MAX_LOGIT,
                                               context_parallel=context))(put(q), put(k), put(v))
    expected = _expected(q, k, v, causal() & padding(np.asarray(lengths), np.asarray(lengths)))
    np.testing.assert_allclose(np.asarray(got.score_max), expected.score_max, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got.max_logit), expected.max_logit, rtol=1e-6)
    local = ContextParallel(scheme, axis="sp")
    sharded = jax.shard_map(lambda q, k, v: jb.attention(q, k, v, mask=causal(), scale=SCALE, return_aux=MAX_LOGIT,
                                                         context_parallel=local).max_logit,
                            mesh=mesh, in_specs=(P(None, "sp"),) * 3, out_specs=P())
    local_put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "sp")))  # noqa: E731
    np.testing.assert_allclose(np.asarray(jax.jit(sharded)(local_put(q), local_put(k), local_put(v))),
                               _expected(q, k, v, causal()).max_logit, rtol=1e-6)


# -- the JAX bridge: dropout from a key --------------------------------------------------------------------

RATE = 0.25


def _probe(b=B, s=32):
    """Q = K = 0 (every probability 1/S) and V the identity (S keys, S features): output[t, j] is
    keep[t, j] / (S (1 - rate)), so the kept entries are the non-zero ones."""
    zeros = jnp.zeros((b, s, N, s), jnp.float16)
    eye = jnp.broadcast_to(jnp.eye(s, dtype=jnp.float16)[None, :, None, :], (b, s, N, s))
    return zeros, zeros, eye


def _kept(out):
    return np.asarray(out) != 0


def test_dropout_from_a_key_under_jit_draws_a_mask_per_key():
    q, k, v = _probe()
    step = jax.jit(lambda key: jb.attention(q, k, v, dropout_rate=RATE, dropout_rng=key).output)
    masks = [_kept(step(jax.random.key(i))) for i in (0, 1, 0)]
    np.testing.assert_array_equal(masks[0], masks[2])
    assert (masks[0] != masks[1]).mean() > 0.1
    for kept in masks[:2]:                                          # 2 * 32 * 4 * 32 = 8192 draws
        assert abs(kept.mean() - (1 - RATE)) < 5 * np.sqrt(RATE * (1 - RATE) / kept.size), kept.mean()
    legacy = jax.jit(lambda key: jb.attention(q, k, v, dropout_rate=RATE, dropout_rng=key).output)
    assert _kept(legacy(jax.random.PRNGKey(4))).mean() > 0.5          # the uint32 (2,) key data works too
    with pytest.raises(ValueError, match="dropout_rng: expected a JAX PRNG key"):
        jb.attention(q, k, v, dropout_rate=RATE, dropout_rng=jnp.zeros(3, jnp.int32))


def test_dropout_forward_and_backward_draw_the_same_mask():
    """The gradients equal the reference's with the forward's mask given explicitly."""
    q, k, v = _inputs(4)
    key = jax.random.key(9)
    weight = normal(np.random.default_rng(5), q.shape, "float32")

    def loss(q, k, v):
        out = jb.attention(q, k, v, mask=causal(), scale=SCALE, dropout_rate=RATE, dropout_rng=key).output
        return jnp.sum(out.astype(jnp.float32) * weight)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    seed, offset = (np.asarray(x) for x in dropout.seed_operands(key))
    config = _config(dtype="float16", qk_dim=H, v_dim=H, dropout_rate=RATE, device_seed=True,
                     mask=causal().static(padding=False))
    entropy = reference_masks.dropout_entropy(config, AttentionOperands(None, None, None, dropout_seed=seed,
                                                                        dropout_offset=offset), 0)
    mask = reference_masks.dropout_keep(config, entropy, None)
    args = dict(scale=SCALE, mask_type=MaskType.CAUSAL, dropout_rate=RATE, dropout_mask=mask)
    out, lse = reference.dot_product_attention(*(np.asarray(x) for x in (q, k, v)), return_residual=True, **args)
    got_out = jb.attention(q, k, v, mask=causal(), scale=SCALE, dropout_rate=RATE, dropout_rng=key).output
    np.testing.assert_array_equal(np.asarray(got_out), out)
    expected = reference.dot_product_attention_bwd(*(np.asarray(x) for x in (q, k, v)), out,
                                                   np.asarray(weight, np.float16), lse, **args)
    for name, got, want in zip("qkv", grads, expected[:3]):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-3,
                                   err_msg=f"d{name}")


def test_dropout_under_vmap_instances_draw_their_own_masks():
    q, k, v = _probe()
    shared = jax.jit(jax.vmap(lambda q, key: jb.attention(q, k, v, dropout_rate=RATE, dropout_rng=key).output,
                              in_axes=(0, None)))(jnp.stack([q, q]), jax.random.key(0))
    assert (_kept(shared[0]) != _kept(shared[1])).mean() > 0.1       # one folded mask: rows differ per instance
    keys = jax.random.split(jax.random.key(1), 2)
    per_key = jax.jit(jax.vmap(lambda key: jb.attention(q, k, v, dropout_rate=RATE, dropout_rng=key).output))(keys)
    assert (_kept(per_key[0]) != _kept(per_key[1])).mean() > 0.1
    one = jb.attention(q, k, v, dropout_rate=RATE, dropout_rng=keys[1]).output
    np.testing.assert_array_equal(np.asarray(per_key[1]), np.asarray(one))    # a key's instance is its own call


@needs_8
def test_dropout_under_batch_sharding_each_shard_draws_its_own_mask():
    q, k, v = _probe(b=8)                                           # every batch row the same inputs
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", None, "model")))  # noqa: E731
    step = jax.jit(lambda q, k, v, key: jb.attention(q, k, v, dropout_rate=RATE, dropout_rng=key).output)
    kept = _kept(step(put(q), put(k), put(v), jax.random.key(2)))
    again = _kept(step(put(q), put(k), put(v), jax.random.key(2)))
    np.testing.assert_array_equal(kept, again)
    shards = [kept[2 * i:2 * i + 2][:, :, 2 * j:2 * j + 2] for i in range(4) for j in range(2)]
    for a in range(len(shards)):
        for b in range(a + 1, len(shards)):
            assert (shards[a] != shards[b]).mean() > 0.1, (a, b)      # no two shards draw copies of one mask
    assert abs(kept.mean() - (1 - RATE)) < 5 * np.sqrt(RATE * (1 - RATE) / kept.size)


def test_dropout_through_the_jax_nn_drop_in():
    q, k, v = _probe()
    step = jax.jit(lambda key: jb.dot_product_attention_nn(q, k, v, dropout_rate=RATE, dropout_rng=key))
    a, b = _kept(step(jax.random.key(0))), _kept(step(jax.random.key(1)))
    assert (a != b).mean() > 0.1
    with pytest.raises(ValueError, match="dropout_rng: required with dropout_rate > 0"):
        jb.dot_product_attention_nn(q, k, v, dropout_rate=RATE)


def test_masked_rows_max_logit_of_a_head_without_scores():
    assert masked_rows.max_logit(np, np.full((2, 3, 4), -np.inf, np.float32)).tolist() == [-np.inf] * 3


def test_the_reference_takes_a_device_seed_array():
    """The reference's seed functions take an int64 ``[seed, offset]`` array as the CuPy front does: the same
    values draw the same mask in the forward and the backward, other values another."""
    q, k, v = (np.asarray(x) for x in _inputs(6))
    seed = np.array([3, 0], np.int64)
    args = dict(scale=SCALE, dropout_rate=RATE)
    out, lse = reference.dot_product_attention(q, k, v, seed=seed, return_residual=True, **args)
    np.testing.assert_array_equal(out, reference.dot_product_attention(q, k, v, seed=seed.copy(), **args))
    assert not np.array_equal(out, reference.dot_product_attention(q, k, v, seed=np.array([3, 1], np.int64), **args))
    config = _config(dtype="float16", qk_dim=H, v_dim=H, dropout_rate=RATE, device_seed=True, training=False)
    entropy = reference_masks.dropout_entropy(config, AttentionOperands(None, None, None, dropout_seed=seed[0:1],
                                                                        dropout_offset=seed[1:2]), 0)
    mask = reference_masks.dropout_keep(config, entropy, None)
    np.testing.assert_array_equal(out, reference.dot_product_attention(q, k, v, dropout_mask=mask, **args))
    grad_output = np.asarray(normal(np.random.default_rng(7), out.shape, "float16"))
    by_seed = reference.dot_product_attention_bwd(q, k, v, out, grad_output, lse, seed=seed, **args)
    by_mask = reference.dot_product_attention_bwd(q, k, v, out, grad_output, lse, dropout_mask=mask, **args)
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(by_seed, name), getattr(by_mask, name))


def test_the_reference_with_a_given_mask_needs_no_seed_operands():
    """The GPU tests run the reference on a device-seed configuration with cuDNN's own mask (``rng_dump``) and
    host operands that hold no seed."""
    q, k, v = (np.asarray(x) for x in _inputs(8))
    config = _config(dtype="float16", qk_dim=H, v_dim=H, dropout_rate=RATE, device_seed=True, training=True)
    operands = AttentionOperands(q, k, v)
    mask = (np.random.default_rng(9).random((B, N, T, T)) >= RATE).astype(np.float32)
    out = reference.forward(config, operands, dropout_mask=mask)
    grads = reference.backward(config, operands, out.output, out.output, out.logsumexp, dropout_mask=mask)
    plain = reference.forward(config.replace(device_seed=False), operands, dropout_mask=mask)
    np.testing.assert_array_equal(out.output, plain.output)
    assert np.isfinite(np.asarray(grads.dq, np.float32)).all()
