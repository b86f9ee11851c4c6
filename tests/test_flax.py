"""``cudnn_attn.jax_bridge.flax_attention_fn`` against Flax's default attention, on the CPU.

Flax's default (``flax.nnx.dot_product_attention``, without dropout: ``jax.nn.dot_product_attention``'s XLA
path) computes the logits and the softmax in float32 and rounds the probabilities to bfloat16; the
bridge's CPU kernel computes in float64 and rounds the output once.  So single calls are compared with
twice the bfloat16 tolerance of ``test_jax_common`` (3.2e-2 relative Frobenius error; a wrong mask, scale
or head mapping gives errors of order one).  In the jitted training step (two decoder blocks,
bfloat16 compute, float32 parameters, padding masks built with ``make_attention_mask``/``make_causal_mask``)
the two attentions' roundings go through every later layer: the losses must agree within 1e-3 relative
(measured: 6e-5) and every parameter's gradient within 2e-2 of the whole gradient's norm (measured: below 5e-3);
the same model's loss with the padding and causal mask left out differs by 7e-2 (more than 2e-2 is checked).
(Flax's default attention cannot run float16 on the CPU: XLA's CPU dot refuses F16_F16_F32.)
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_jax_common import assert_close, jnp_attention, relative_error

import cudnn_attn
from cudnn_attn.jax_bridge import flax_attention_fn

flax = pytest.importorskip("flax")
from flax import linen, nnx  # noqa: E402

B, T, N, H = 2, 16, 4, 8
D = N * H
BF16 = "bfloat16"


def _qkv(rng, *shape_head, K=N, dtype=jnp.bfloat16):
    lead = shape_head or (B,)
    q = jnp.asarray(rng.standard_normal((*lead, T, N, H)), dtype)
    k, v = (jnp.asarray(rng.standard_normal((*lead, T, K, H)), dtype) for _ in range(2))
    return q, k, v


def _tokens(rng, lengths=(T, 11)):
    tokens = rng.integers(1, 100, size=(len(lengths), T))
    for b, n in enumerate(lengths):
        tokens[b, n:] = 0
    return jnp.asarray(tokens)


def _padding_causal(tokens):
    return nnx.combine_masks(nnx.make_attention_mask(tokens > 0, tokens > 0), nnx.make_causal_mask(tokens))


# -- single calls -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["float_mask", "bool_mask_bias", "per_call_causal", "gqa", "batch_dims",
                                  "unbatched"])
def test_matches_flax_default(case, rng):
    ours = flax_attention_fn()
    kwargs: dict = {}
    q, k, v = _qkv(rng, K=2 if case == "gqa" else N)
    if case == "batch_dims":
        q, k, v = _qkv(rng, 2, 3)
        kwargs["mask"] = jnp.asarray(rng.random((2, 3, 1, T, T)) > 0.3, jnp.float32)
    if case == "unbatched":
        q, k, v = (x[0] for x in (q, k, v))
        kwargs["is_causal"] = True
    if case == "float_mask":
        kwargs["mask"] = _padding_causal(_tokens(rng))                  # float32 0/1 [B, 1, T, T]
    if case == "bool_mask_bias":
        kwargs["mask"] = jnp.asarray(rng.random((B, N, T, T)) > 0.4)
        kwargs["bias"] = jnp.asarray(rng.standard_normal((1, N, T, T)), jnp.bfloat16)
    if case in ("per_call_causal", "gqa"):
        kwargs["is_causal"] = True
    out = ours(q, k, v, **kwargs)
    ref = nnx.dot_product_attention(q, k, v, **kwargs)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    if case == "float_mask":       # padded query rows: both attend uniformly (finite masking); compare valid rows
        out, ref = out[1, :11], ref[1, :11]
    assert_close(out, ref, BF16, case, factor=2)


def test_factory_options_match_explicit_masks(rng):
    q, k, v = _qkv(rng)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    causal_window = jnp.asarray((j <= i) & (i - j <= 3))
    out = flax_attention_fn(is_causal=True, window=(3, 0))(q, k, v)
    assert_close(out, nnx.dot_product_attention(q, k, v, mask=causal_window), BF16, "causal window", factor=2)
    two_sided = jnp.asarray((i - j <= 2) & (j - i <= 1))
    out = flax_attention_fn(window=(2, 1))(q, k, v)
    assert_close(out, nnx.dot_product_attention(q, k, v, mask=two_sided), BF16, "window (2, 1)", factor=2)
    scaled = flax_attention_fn(scale=0.1)(q, k, v)
    assert_close(scaled, nnx.dot_product_attention(q * (0.1 * H ** 0.5), k, v), BF16, "scale", factor=2)


def test_softcap_matches_tanh_capped_scores(rng):
    q, k, v = _qkv(rng)
    q = q * 4                                          # scores beyond the cap, so the cap matters
    cap = 2.0
    out = flax_attention_fn(softcap=cap, is_causal=True)(q, k, v)
    qf, kf, vf = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("btnh,bsnh->bnts", qf, kf) / np.sqrt(H)
    s = cap * np.tanh(s / cap)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.einsum("bnts,bsnh->btnh", p, vf)
    assert_close(out, ref, BF16, "softcap")
    assert relative_error(flax_attention_fn(is_causal=True)(q, k, v), ref) > 0.1     # the cap changed the result


def test_maskspec_lengths_match_flax_padding_mask(rng):
    """``mask=cudnn_attn.padding(lengths, lengths)`` instead of the dense keep-mask: equal on the valid rows,
    zeros on the padded ones (the library's padding convention)."""
    q, k, v = _qkv(rng)
    lengths = jnp.asarray([T, 11], jnp.int32)
    out = flax_attention_fn(is_causal=True)(q, k, v, mask=cudnn_attn.padding(lengths, lengths))
    ref = nnx.dot_product_attention(q, k, v, mask=_padding_causal(_tokens(rng, (T, 11))))
    assert_close(out[0], ref[0], BF16, "full row", factor=2)
    assert_close(out[1, :11], ref[1, :11], BF16, "padded row's valid part", factor=2)
    assert not np.any(np.asarray(out[1, 11:], np.float32))


def test_maskspec_segments_match_flax_segment_mask(rng):
    """Packed sequences as ``mask=cudnn_attn.segments(...)`` against Flax's segment-id keep-mask
    (``make_attention_mask(ids, ids, jnp.equal)`` and causal): equal on the tokens inside a segment."""
    q, k, v = _qkv(rng)
    ids = np.zeros((B, T), np.int32)                           # row 0: segments [0, 6), [6, 16); row 1: [0, 11)
    ids[0, :6], ids[0, 6:], ids[1, :11] = 1, 2, 1
    lengths = jnp.asarray([[6, 10], [11, -1]], jnp.int32)
    offsets = jnp.asarray([[0, 6, -1], [0, -1, -1]], jnp.int32)              # start offsets, -1: none
    out = flax_attention_fn(is_causal=True)(q, k, v, mask=cudnn_attn.segments(lengths, lengths, offsets, offsets))
    same = nnx.make_attention_mask(jnp.asarray(ids), jnp.asarray(ids), jnp.equal)
    real = nnx.make_attention_mask(jnp.asarray(ids) > 0, jnp.asarray(ids) > 0)
    ref = nnx.dot_product_attention(q, k, v, mask=nnx.combine_masks(same, real), is_causal=True)
    inside = ids > 0
    assert_close(np.asarray(out, np.float32)[inside], np.asarray(ref, np.float32)[inside], BF16, "segments", factor=2)
    assert not np.any(np.asarray(out, np.float32)[~inside])


def test_sink_matches_the_oracle(rng):
    q, k, v = _qkv(rng)
    sink = jnp.asarray(rng.standard_normal((N,)), jnp.float32)
    out = flax_attention_fn(sink=sink)(q, k, v, is_causal=True)
    assert_close(out, jnp_attention(q, k, v, scale=H ** -0.5, causal=True, sink=sink), BF16, "sink", factor=2)
    called = flax_attention_fn(sink=lambda: sink)(q, k, v, is_causal=True)
    np.testing.assert_array_equal(np.asarray(called, np.float32), np.asarray(out, np.float32))


def test_linen_module_matches_default(rng):
    x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    mask = _padding_causal(_tokens(rng))
    make = lambda fn: linen.MultiHeadDotProductAttention(num_heads=N, qkv_features=D, dtype=jnp.bfloat16,
                                                         deterministic=True, attention_fn=fn)
    ours, default = make(flax_attention_fn()), make(linen.dot_product_attention)
    params = default.init(jax.random.key(0), x, mask=mask)

    def loss(module, p):
        y = module.apply(p, x, mask=mask).astype(jnp.float32)
        return jnp.mean((y * (mask[:, 0, :, :1] > 0)) ** 2)

    (l_ours, g_ours), (l_ref, g_ref) = (jax.jit(jax.value_and_grad(lambda p, m=m: loss(m, p)))(params)
                                        for m in (ours, default))
    assert abs(float(l_ours) - float(l_ref)) <= 2e-3 * abs(float(l_ref))
    _assert_gradients_close(g_ours, g_ref)


# -- the training step ----------------------------------------------------------------------------------

class _Block(nnx.Module):
    def __init__(self, attention_fn, rngs):
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(N, D, dtype=jnp.bfloat16, decode=False, attention_fn=attention_fn,
                                           rngs=rngs)
        self.mlp = nnx.Linear(D, D, dtype=jnp.bfloat16, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.norm(x), mask=mask).astype(jnp.float32)
        return x + nnx.gelu(self.mlp(x)).astype(jnp.float32)


class _Decoder(nnx.Module):
    def __init__(self, attention_fn, layers=2, seed=0):
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(100, D, rngs=rngs)
        self.blocks = nnx.List([_Block(attention_fn, rngs) for _ in range(layers)])
        self.head = nnx.Linear(D, 100, rngs=rngs)

    def __call__(self, tokens, mask):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)


def _loss(model, tokens, mask):
    logits = model(tokens[:, :-1], mask)
    targets = tokens[:, 1:]
    valid = (targets > 0).astype(jnp.float32)
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32))
    nll = -jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * valid) / jnp.sum(valid)


@nnx.jit
def _train_step(model, tokens, mask, lr=0.05):
    loss, grads = nnx.value_and_grad(_loss)(model, tokens, mask)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - lr * g, params, grads))
    return loss, grads


def _assert_gradients_close(ours, ref, tol=2e-2):
    leaves, ref_leaves = jax.tree.leaves(ours), jax.tree.leaves(ref)
    total = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in ref_leaves)))
    for a, b in zip(leaves, ref_leaves, strict=True):
        err = float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))) / total
        assert err <= tol, f"gradient {np.shape(b)}: error {err:.2e} of the gradient's norm > {tol}"


@pytest.mark.slow
def test_nnx_training_step_matches_flax_default(rng):
    raw = rng.integers(1, 100, size=(B, T + 1))
    raw[1, 12:] = 0                                                   # row 1: 12 tokens, then padding
    tokens = jnp.asarray(raw)
    inputs = tokens[:, :-1]
    mask = _padding_causal(inputs)
    ours, default = _Decoder(flax_attention_fn()), _Decoder(nnx.dot_product_attention)
    unmasked = float(nnx.jit(_loss)(ours, tokens, jnp.ones_like(mask)))     # the same model without the mask
    for step in range(2):
        l_ours, g_ours = _train_step(ours, tokens, mask)
        l_ref, g_ref = _train_step(default, tokens, mask)
        assert abs(float(l_ours) - float(l_ref)) <= 1e-3 * abs(float(l_ref)), (step, float(l_ours), float(l_ref))
        _assert_gradients_close(g_ours, g_ref)
        if step == 0:
            assert abs(unmasked - float(l_ref)) > 2e-2 * abs(float(l_ref))       # twenty times the tolerance


# -- dropout -------------------------------------------------------------------------------------------------

def test_dropout_seed_from_a_concrete_key(rng):
    q, k, v = _qkv(rng)
    fn = flax_attention_fn()
    kw = dict(dropout_rate=0.3, broadcast_dropout=False, deterministic=False)
    a = fn(q, k, v, dropout_rng=jax.random.key(1), **kw)
    b = fn(q, k, v, dropout_rng=jax.random.key(1), **kw)
    c = fn(q, k, v, dropout_rng=jax.random.key(2), **kw)
    plain = fn(q, k, v)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert relative_error(a, c) > 0.1 and relative_error(a, plain) > 0.1
    off = fn(q, k, v, dropout_rng=jax.random.key(1), **{**kw, "deterministic": True})
    np.testing.assert_array_equal(np.asarray(off, np.float32), np.asarray(plain, np.float32))


def test_dropout_under_jit_draws_a_mask_per_key(rng):
    q, k, v = _qkv(rng)
    kw = dict(dropout_rate=0.3, broadcast_dropout=False, deterministic=False)
    traced = jax.jit(lambda key: flax_attention_fn()(q, k, v, dropout_rng=key, **kw))
    a, b, again = traced(jax.random.key(0)), traced(jax.random.key(1)), traced(jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(again, np.float32))
    assert relative_error(a, b) > 0.1
    fixed = jax.jit(lambda key: flax_attention_fn(dropout_seed=7)(q, k, v, dropout_rng=key, **kw))
    out = fixed(jax.random.key(0))
    direct = cudnn_attn.jax_bridge.attention(q, k, v, dropout_rate=0.3, seed=7).output
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(direct, np.float32))
    np.testing.assert_array_equal(np.asarray(fixed(jax.random.key(5)), np.float32), np.asarray(out, np.float32))
    with pytest.raises(ValueError, match="dropout_rng: traced"):       # the seed form takes a static seed only
        jax.jit(lambda key: flax_attention_fn(softcap=5.0)(q, k, v, dropout_rng=key, **kw))(jax.random.key(0))


# A layer whose dropout mask can be read off its output: with q = k = 0 every probability is 1/S, and with V the
# identity (S keys, S features) output[t, j] = keep[t, j] / (S (1 - p)), so the kept entries are the non-zero ones.
S_MASK, RATE = 64, 0.1


class _MaskProbe(nnx.Module):
    def __init__(self, rngs):
        self.rngs = rngs
        self.scale = nnx.Param(jnp.ones((), jnp.float32))         # one parameter, so that the step trains

    def __call__(self, attention_fn):
        zeros = jnp.zeros((2, S_MASK, N, S_MASK), jnp.bfloat16)
        eye = jnp.broadcast_to(jnp.eye(S_MASK, dtype=jnp.bfloat16)[None, :, None, :], (2, S_MASK, N, S_MASK))
        out = attention_fn(zeros, zeros, eye * self.scale[...].astype(jnp.bfloat16), dropout_rate=RATE,
                           broadcast_dropout=False, deterministic=False, dropout_rng=self.rngs.dropout())
        return out.astype(jnp.float32)


def test_nnx_training_step_with_dropout_draws_a_fresh_mask_each_step():
    model = _MaskProbe(nnx.Rngs(dropout=3))
    fn = flax_attention_fn()

    @nnx.jit
    def step(model):
        def loss(model):
            out = model(fn)
            return jnp.mean((out - 1.0) ** 2), out
        (value, out), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, nnx.state(model, nnx.Param), grads))
        return value, out != 0

    masks, losses = [], []
    for _ in range(3):
        value, kept = step(model)
        masks.append(np.asarray(kept))
        losses.append(float(value))
    for kept in masks:            # 2 * 4 * 64 * 64 = 32768 draws: the keep rate within 5 standard deviations
        rate = kept.mean()
        assert abs(rate - (1 - RATE)) < 5 * np.sqrt(RATE * (1 - RATE) / kept.size), rate
    assert (masks[0] != masks[1]).mean() > 0.1 and (masks[1] != masks[2]).mean() > 0.1
    assert losses[2] < losses[0], losses


# -- errors ---------------------------------------------------------------------------------------------------

def test_errors_name_the_argument(rng):
    q, k, v = _qkv(rng)
    fn = flax_attention_fn()
    with pytest.raises(ValueError, match="broadcast_dropout: cuDNN draws an independent"):
        fn(q, k, v, dropout_rate=0.1, dropout_rng=jax.random.key(0))
    with pytest.raises(ValueError, match="dropout_rng: required"):
        fn(q, k, v, dropout_rate=0.1, broadcast_dropout=False)
    with pytest.raises(ValueError, match="qk_attn_weights_einsum: must be None"):
        fn(q, k, v, qk_attn_weights_einsum=jnp.einsum)
    with pytest.raises(ValueError, match="mask: .* does not broadcast"):
        fn(q, k, v, mask=jnp.ones((B, 3, T, T)))
    with pytest.raises(ValueError, match="key: batch dimensions"):
        fn(q, k[:1], v)
    with pytest.raises(ValueError, match="query: dtype must be one of float16, bfloat16 .* float32 .*compute_dtype="):
        fn(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    with pytest.raises(ValueError, match="dropout_rate: must be in"):
        fn(q, k, v, dropout_rate=1.5, broadcast_dropout=False, dropout_rng=jax.random.key(0))
    for options, name in ((dict(window=(-1, 0)), "window"), (dict(softcap=0.0), "softcap"),
                          (dict(softcap=1.0, score_mod=jnp.tanh), "softcap/score_mod"),
                          (dict(compute_dtype=jnp.float32), "compute_dtype"), (dict(dropout_seed=-1), "dropout_seed"),
                          (dict(is_causal=1), "is_causal"), (dict(diagonal_alignment="up"), "diagonal_alignment: must be"),
                          (dict(sink=[0.0] * N), "sink")):
        with pytest.raises(ValueError, match=f"^{name}"):
            flax_attention_fn(**options)
    with pytest.raises(ValueError, match="window: with softcap/score_mod"):
        flax_attention_fn(softcap=5.0, window=(2, 1))(q, k, v)


def test_compute_dtype_runs_float32_models(rng):
    q, k, v = (x.astype(jnp.float32) for x in _qkv(rng))
    out = flax_attention_fn(compute_dtype=jnp.bfloat16)(q, k, v, is_causal=True)
    assert out.dtype == jnp.float32
    assert_close(out, nnx.dot_product_attention(q, k, v, is_causal=True), BF16, "compute_dtype", factor=2)


def test_importing_the_bridge_does_not_import_flax():
    code = "import sys, cudnn_attn.jax_bridge as jb; jb.flax_attention_fn(); assert 'flax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_the_benchmarks_dropout_decoder_draws_a_fresh_mask_at_every_jitted_step():
    """``benchmarks/bench_frameworks.py``'s ``flax_dropout`` model on the CPU: with a learning rate of 0 the
    parameters stay, so two steps' losses differ only by their dropout masks (equal without dropout)."""
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import bench_frameworks as frameworks

    shape = frameworks.DecoderShape(batch=2, length=16, d_model=32, heads=4, layers=1, vocab=64)
    for rate, distinct in ((0.1, 3), (0.0, 1)):
        losses = frameworks.frozen_losses(flax_attention_fn(), shape, rate)
        assert all(np.isfinite(losses)) and len(set(losses)) == distinct, (rate, losses)
