"""Fully masked rows (a boolean mask keeps no key of a query row) have one semantics on every front:
``jax.nn.dot_product_attention(implementation="xla")``'s mean of V, logsumexp ``-inf``, and its gradients.

Compared here: the NumPy reference, the JAX bridge on CPU (``dot_product_attention(mask=)``, the native
``attention(mask=keep(...))``, the ``jax.nn`` drop-in) and ``jax.nn``'s XLA path, fp16 and bf16, forward and
``jax.grad``, several seeds, masks with some rows fully masked and some not, GQA.  Tolerance: twice the
io-dtype bound of ``test_jax_common`` (relative Frobenius error; the XLA path computes in float32, the
reference in float64, each rounds P or O once).  Without the fix-up the reference returned the softmax of
the scores for such a row (float64 keeps the scores' differences next to the ``-2**41`` bias): errors of
order one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_jax_common import assert_close, qkv

import cudnn_attn
from cudnn_attn import jax_bridge as jb
from cudnn_attn import reference
from cudnn_attn.core import masked_rows
from cudnn_attn.core.types import MaskType
from cudnn_attn.core.validation import LARGE_NEGATIVE, validate_call
from cudnn_attn.graphs import packing
from cudnn_attn.reference.masks import allowed
from cudnn_attn.reference.segments import segments_of

B, T, S, N, H = 2, 12, 16, 4, 8
SCALE = 0.3
DTYPES = ["float16", "bfloat16"]
SEEDS = [0, 1, 2]


def _mask(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A random keep-mask of ``shape`` (..., T, S) with about a third of the rows fully masked (some rows of
    every (batch, head) slice keep keys)."""
    mask = rng.random(shape) < 0.5
    rows = rng.random(shape[:-1]) < 0.35
    rows[..., 0] = False
    rows[..., 1] = True
    mask[rows] = False
    return mask


def _case(dtype: str, seed: int, kv_heads: int, mask_shape: tuple[int, ...]):
    rng = np.random.default_rng(1000 * seed + kv_heads)
    q, k, v = qkv(rng, B=B, T=T, S=S, N=N, K=kv_heads, H=H, dtype=dtype)
    return q, k, v, _mask(rng, mask_shape)


def _xla(q, k, v, mask, bias=None):
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=jnp.asarray(mask), scale=SCALE,
                                        implementation="xla")


def _cotangent(shape, dtype):
    return jnp.asarray(np.random.default_rng(5).standard_normal(shape), dtype)


def _grads(attention, q, k, v, cotangent):
    def loss(q, k, v):
        return jnp.sum(attention(q, k, v).astype(jnp.float32) * cotangent.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


FRONTS = {
    "jax_bridge": lambda mask: lambda q, k, v: jb.dot_product_attention(q, k, v, mask=jnp.asarray(mask),
                                                                         scale=SCALE),
    "native": lambda mask: lambda q, k, v: jb.attention(q, k, v, mask=cudnn_attn.keep(jnp.asarray(mask)),
                                                        scale=SCALE).output,
    "jax_nn_drop_in": lambda mask: lambda q, k, v: jb.dot_product_attention_nn(q, k, v, mask=jnp.asarray(mask),
                                                                               scale=SCALE),
}
MASK_SHAPES = {"full": (B, N, T, S), "per_batch": (B, 1, T, S), "shared": (T, S)}


@pytest.mark.parametrize("mask_shape", list(MASK_SHAPES))
@pytest.mark.parametrize("kv_heads", [N, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_forward_and_backward_equal_jax_nn_xla(dtype, seed, kv_heads, mask_shape):
    q, k, v, mask = _case(dtype, seed, kv_heads, MASK_SHAPES[mask_shape])
    expected = _xla(q, k, v, mask)
    host = [np.asarray(x) for x in (q, k, v)]
    output, lse = reference.dot_product_attention(*host, mask=mask, scale=SCALE, return_residual=True)
    assert_close(output, expected, dtype, "reference output", factor=2)
    empty = np.broadcast_to(~mask.reshape((1,) * (4 - mask.ndim) + mask.shape).any(-1), lse.shape)
    assert np.isneginf(lse[empty]).all() and np.isfinite(lse[~empty]).all()

    cotangent = _cotangent(q.shape, dtype)
    want = _grads(lambda q, k, v: _xla(q, k, v, mask), q, k, v, cotangent)
    got = reference.dot_product_attention_bwd(*host, output, np.asarray(cotangent), lse, mask=mask, scale=SCALE)
    for name, x, w in zip(("dq", "dk", "dv"), (got.dq, got.dk, got.dv), want):
        assert_close(x, w, dtype, f"reference {name}", factor=2)


@pytest.mark.parametrize("front", list(FRONTS))
@pytest.mark.parametrize("kv_heads", [N, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_jax_fronts_forward_and_grad_equal_jax_nn_xla(dtype, seed, kv_heads, front):
    q, k, v, mask = _case(dtype, seed, kv_heads, (B, N, T, S))
    attention = FRONTS[front](mask)
    assert_close(jax.jit(attention)(q, k, v), _xla(q, k, v, mask), dtype, f"{front} output", factor=2)
    cotangent = _cotangent(q.shape, dtype)
    want = _grads(lambda q, k, v: _xla(q, k, v, mask), q, k, v, cotangent)
    got = jax.jit(lambda q, k, v: _grads(attention, q, k, v, cotangent))(q, k, v)
    for name, x, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(x, w, dtype, f"{front} {name}", factor=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fully_masked_row_is_exactly_the_mean_of_v_and_its_logsumexp_is_minus_inf(dtype):
    """The issue's case: one query row, every key masked (bf16: the reference returned the unmasked softmax)."""
    rng = np.random.default_rng(17)
    q, k, v = qkv(rng, B=1, T=1, S=8, N=1, H=8, dtype=dtype)
    mask = np.zeros((1, 1, 1, 8), bool)
    mean = np.asarray(v, np.float64).mean(axis=1)[:, None]
    tolerance = 2.0 ** -7 if dtype == "bfloat16" else 2.0 ** -10          # one rounding of a value below 2
    ref_out, ref_lse = reference.dot_product_attention(*(np.asarray(x) for x in (q, k, v)), mask=mask,
                                                       return_residual=True)
    jax_out, jax_lse = jb.dot_product_attention(q, k, v, mask=jnp.asarray(mask), return_residual=True)
    for name, out, lse in (("reference", ref_out, ref_lse), ("jax_bridge", jax_out, jax_lse)):
        assert np.abs(np.asarray(out, np.float64) - mean).max() <= tolerance, name
        assert np.isneginf(np.asarray(lse)).all(), name
    xla = _xla(q, k, v, mask, None)
    assert np.abs(np.asarray(xla, np.float64) - mean).max() <= tolerance


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gradient_is_zero_on_fully_masked_rows_as_in_jax_nn(dtype):
    q, k, v, mask = _case(dtype, 3, N, (B, 1, T, S))
    bias = jnp.asarray(np.random.default_rng(8).standard_normal((1, N, T, S)), q.dtype)
    cotangent = _cotangent(q.shape, dtype)

    def dbias(attention):
        return jax.grad(lambda b: jnp.sum(attention(b).astype(jnp.float32) * cotangent.astype(jnp.float32)))(bias)
    got = dbias(lambda b: jb.dot_product_attention(q, k, v, bias=b, mask=jnp.asarray(mask), scale=SCALE))
    want = dbias(lambda b: _xla(q, k, v, mask, b))
    assert_close(got, want, dtype, "dbias", factor=2)
    rows = ~mask.any(-1).any(0)                  # (1, T): masked in every batch row (the bias is shared by them)
    assert rows.any() and not np.asarray(got, np.float32)[np.broadcast_to(rows, (1, N, T))].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_averages_over_the_sequence_keys_and_an_empty_sequence_gives_zero(dtype):
    """With a padding mask a fully masked row averages the ``kv_seqlen[b]`` keys of its sequence (keys past it
    take no part anywhere); ``kv_seqlen[b] == 0`` leaves the row no key: output 0, logsumexp -inf.  Rows past
    ``q_seqlen`` stay 0.  The reference and the JAX bridge agree, forward and gradients."""
    rng = np.random.default_rng(23)
    q, k, v = qkv(rng, B=3, T=T, S=S, N=N, K=2, H=H, dtype=dtype)
    mask = _mask(rng, (3, N, T, S))
    q_len, kv_len = np.array([12, 9, 7], np.int32), np.array([16, 11, 0], np.int32)
    kwargs = dict(mask=mask, scale=SCALE, q_seqlen=q_len, kv_seqlen=kv_len, mask_type=MaskType.PADDING)
    host = [np.asarray(x) for x in (q, k, v)]
    output, lse = reference.dot_product_attention(*host, **kwargs, return_residual=True)
    values = np.repeat(np.asarray(v, np.float64), N // 2, axis=2)                  # (B, S, N, H)
    for b in range(2):
        empty = ~mask[b].any(-1)                                                   # (N, T)
        for n, t in zip(*np.nonzero(empty)):
            if t < q_len[b]:
                mean = values[b, :kv_len[b], n].mean(axis=0)
                assert np.abs(np.asarray(output[b, t, n], np.float64) - mean).max() <= 2.0 ** -7, (b, t, n)
                assert np.isneginf(lse[b, n, t])
    assert not np.asarray(output[2], np.float32).any() and np.isneginf(lse[2, :, :q_len[2]]).all()
    assert not np.asarray(output[1, q_len[1]:], np.float32).any() and not lse[1, :, q_len[1]:].any()

    jax_kwargs = {**kwargs, "mask": jnp.asarray(mask), "q_seqlen": jnp.asarray(q_len), "kv_seqlen": jnp.asarray(kv_len)}
    jax_out, jax_lse = jb.dot_product_attention(q, k, v, **jax_kwargs, return_residual=True)
    assert_close(jax_out, output, dtype, "jax output")
    assert np.array_equal(np.isneginf(np.asarray(jax_lse)), np.isneginf(lse))
    cotangent = _cotangent(q.shape, dtype)
    got = _grads(lambda q, k, v: jb.dot_product_attention(q, k, v, **jax_kwargs), q, k, v, cotangent)
    want = reference.dot_product_attention_bwd(*host, output, np.asarray(cotangent), lse, **kwargs)
    for name, x, w in zip(("dq", "dk", "dv"), got, (want.dq, want.dk, want.dv)):
        assert_close(x, w, dtype, f"padded {name}")
    assert not np.asarray(want.dv[1, kv_len[1]:], np.float32).any()


def test_only_a_boolean_mask_is_kept_and_its_empty_rows_follow_the_other_masks():
    rng = np.random.default_rng(4)
    q, k, v = (np.asarray(x) for x in qkv(rng, B=B, T=T, S=S, N=N, H=H))
    mask = _mask(rng, (B, 1, T, S))
    config, operands = validate_call(q, k, v, mask=mask)
    assert operands.keep_mask.shape == (B, 1, T, S)
    assert np.array_equal(masked_rows.empty_rows(np, operands.keep_mask, config.mask), ~mask.any(-1))
    additive = np.where(mask, 0, -1e4).astype(q.dtype)
    assert validate_call(q, k, v, mask=additive)[1].keep_mask is None
    assert validate_call(q, k, v, bias=additive)[1].keep_mask is None
    assert validate_call(q, k, v)[1].keep_mask is None
    # Causal: a row keeping only keys j > i is empty too; a (T, S) mask is read as (1, 1, T, S).
    future = np.arange(S)[None, :] > np.arange(T)[:, None]
    config, operands = validate_call(q, k, v, mask=future, mask_type=MaskType.CAUSAL)
    assert operands.keep_mask.shape == (1, 1, T, S)
    assert masked_rows.empty_rows(np, operands.keep_mask, config.mask).all()


def test_backward_residuals_give_a_backward_kernel_nothing_to_do_on_fully_masked_rows():
    """What a backward kernel is given on those rows: dO = 0 and a logsumexp that makes exp(s - lse) 0 for any
    finite float32 score (where -inf would make it inf, and inf * 0 NaN)."""
    rng = np.random.default_rng(6)
    q, k, v = (np.asarray(x) for x in qkv(rng, B=B, T=T, S=S, N=N, H=H))
    mask = _mask(rng, (B, N, T, S))
    config, operands = validate_call(q, k, v, mask=mask, training=True)
    grad_output = np.ones(config.o_shape, q.dtype)
    lse = np.full(config.lse_shape, -np.inf, np.float32)
    do, kernel_lse = masked_rows.backward_residuals(np, config, operands, grad_output, lse)
    rows = masked_rows.empty_rows(np, operands.keep_mask, config.mask)               # (B, N, T)
    assert do.dtype == grad_output.dtype and not do.transpose(0, 2, 1, 3)[rows].any()
    assert (do.transpose(0, 2, 1, 3)[~rows] == 1).all() and np.isneginf(kernel_lse[~rows]).all()
    with np.errstate(over="raise", invalid="raise"):
        assert (np.exp(np.float32(3e4) - kernel_lse[rows].astype(np.float32) * np.float32(np.log2(np.e))) == 0).all()


KEYLESS_CASES = {
    "padding_empty_sequence": dict(mask_type=MaskType.PADDING),
    "bottom_right_causal": dict(mask_type=MaskType.CAUSAL, diagonal_alignment="bottom_right"),
    "bottom_right_padding_causal": dict(mask_type=MaskType.PADDING_CAUSAL, diagonal_alignment="bottom_right"),
    "window": dict(mask_type=MaskType.PADDING, sliding_window_length=3),
    "bottom_right_window": dict(mask_type=MaskType.PADDING_CAUSAL, sliding_window_length=2,
                                diagonal_alignment="bottom_right"),
}


@pytest.mark.parametrize("case", list(KEYLESS_CASES))
@pytest.mark.parametrize("seed", SEEDS)
def test_rows_without_keys_are_the_references_and_have_logsumexp_minus_inf(case, seed):
    """``rows_without_keys`` (what a front uses after a launch) is exactly the set of rows the reference finds no
    admissible key for, and the reference's logsumexp is -inf there and finite on every other row inside the
    sequences (0 outside)."""
    rng = np.random.default_rng(seed)
    batch, t, s = 4, 16, 8
    q, k, v = (np.asarray(x) for x in qkv(rng, B=batch, T=t, S=s, N=2, H=8))
    kwargs = dict(KEYLESS_CASES[case])
    if kwargs["mask_type"] in (MaskType.PADDING, MaskType.PADDING_CAUSAL):
        kwargs["q_seqlen"] = rng.integers(1, t + 1, batch).astype(np.int32)
        kv = rng.integers(0, s + 1, batch).astype(np.int32)
        kv[0] = 0
        kwargs["kv_seqlen"] = kv
    config, operands = validate_call(q, k, v, training=True, **kwargs)
    segments = segments_of(config, operands)
    want = ~allowed(config, segments).any(-1) & segments.valid_q[:, None]            # (B, 1, T)
    got = masked_rows.rows_without_keys(np, config, operands.q_seqlen, operands.kv_seqlen)
    assert want.any() and np.array_equal(got, want)
    lse = reference.forward(config, operands).logsumexp
    rows = np.broadcast_to(want, lse.shape)
    inside = np.broadcast_to(segments.valid_q[:, None], lse.shape)
    assert np.isneginf(lse[rows]).all() and np.isfinite(lse[inside & ~rows]).all() and not lse[~inside].any()
    poisoned = np.where(inside, np.float32(np.nan), np.float32(0))
    fixed = masked_rows.keyless_logsumexp(np, config, np.where(rows, poisoned, lse), operands.q_seqlen,
                                          operands.kv_seqlen)
    assert np.array_equal(fixed, lse)


def test_paged_fully_masked_row_averages_the_keys_read_through_the_page_table():
    rng = np.random.default_rng(3)
    batch, heads, block, blocks = 2, 2, 4, 3
    q = rng.standard_normal((batch, 4, heads, 8)).astype(np.float16)
    cache_k, cache_v = (rng.standard_normal((batch * blocks + 2, block, heads, 8)).astype(np.float16) for _ in "kv")
    table = rng.permutation(batch * blocks + 2)[:batch * blocks].reshape(batch, 1, blocks, 1).astype(np.int32)
    mask = np.ones((batch, heads, 4, block * blocks), bool)
    mask[0, 1, 2] = mask[1, 0, 0] = False
    kv_len = np.array([10, 7], np.int32)
    output, lse = reference.paged_attention(q, cache_k, cache_v, np.array([4, 3], np.int32), kv_len, table,
                                            table.copy(), mask=mask, mask_type=MaskType.PADDING,
                                            return_residual=True)
    for b, n, t in ((0, 1, 2), (1, 0, 0)):
        values = np.concatenate([cache_v[table[b, 0, i, 0]] for i in range(blocks)])[:kv_len[b], n]
        assert np.abs(output[b, t, n].astype(np.float64) - values.astype(np.float64).mean(0)).max() <= 2.0 ** -10
        assert np.isneginf(lse[b, n, t])


def test_rows_without_keys_of_packed_segments_are_the_references():
    """With packed segments the rows are the logsumexp's, one per segment (bottom-right causal: a segment of 6
    queries and 3 keys leaves its first 3 queries none; a segment of 0 keys all of its 4)."""
    rng = np.random.default_rng(9)
    q, k, v = (np.asarray(x) for x in qkv(rng, B=2, T=16, S=16, N=2, H=8))
    sequences = dict(q_seqlen=np.array([[6, 4], [8, -1]], np.int32), kv_seqlen=np.array([[3, 0], [10, -1]], np.int32),
                     q_offsets=np.array([[0, 6, -1], [0, -1, -1]], np.int32),
                     kv_offsets=np.array([[0, 3, -1], [0, -1, -1]], np.int32))
    config, operands = validate_call(q, k, v, **sequences, mask_type=MaskType.PADDING_CAUSAL,
                                     diagonal_alignment="bottom_right", training=True)
    lse = reference.forward(config, operands).logsumexp                               # (B*M, N, T)
    segs = packing.segments(np, operands.q_seqlen, operands.kv_seqlen, operands.q_offsets, operands.kv_offsets,
                            config.q_len, config.kv_len)
    rows = masked_rows.rows_without_keys(np, config, segs.q_seqlen, segs.kv_seqlen)
    assert rows.sum() == 7 and np.array_equal(np.broadcast_to(rows, lse.shape), np.isneginf(lse))
    fixed = masked_rows.keyless_logsumexp(np, config, np.where(np.isneginf(lse), np.float32(np.nan), lse),
                                          segments=segs)
    assert np.array_equal(fixed, lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mask_that_keeps_only_keys_the_diagonal_excludes_is_a_fully_masked_row(dtype):
    """Left padding under a causal mask (``mask`` drops the first ``p_b`` keys, ``is_causal``): query rows
    ``i < p_b`` keep no key the diagonal admits.  ``jax.nn``'s XLA path averages V over all S keys there; so
    do the reference, the JAX bridge and the drop-in, forward and gradients (without the rule the reference
    returned the softmax of the admitted scores, cuDNN in bf16 their uniform average)."""
    rng = np.random.default_rng(29)
    q, k, v = qkv(rng, B=B, T=S, S=S, N=N, K=2, H=H, dtype=dtype)
    pad = np.array([5, 9])
    mask = np.broadcast_to(np.arange(S)[None, None, None, :] >= pad[:, None, None, None], (B, 1, S, S))
    xla = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask), is_causal=True, scale=SCALE,
                                       implementation="xla")
    host = [np.asarray(x) for x in (q, k, v)]
    ref, lse = reference.dot_product_attention(*host, mask=mask, mask_type=MaskType.CAUSAL, scale=SCALE,
                                               return_residual=True)
    assert_close(ref, xla, dtype, "reference output", factor=2)
    assert np.isneginf(lse[0, :, :5]).all() and np.isfinite(lse[0, :, 5:]).all()

    def bridge(q, k, v):
        return jb.dot_product_attention(q, k, v, mask=jnp.asarray(mask), mask_type=MaskType.CAUSAL, scale=SCALE)

    def drop_in(q, k, v):
        return jb.dot_product_attention_nn(q, k, v, mask=jnp.asarray(mask), is_causal=True, scale=SCALE)
    cotangent = _cotangent(q.shape, dtype)
    want = _grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(mask), is_causal=True,
                                                               scale=SCALE, implementation="xla"), q, k, v, cotangent)
    for name, attention in (("jax_bridge", bridge), ("jax_nn_drop_in", drop_in)):
        assert_close(attention(q, k, v), xla, dtype, f"{name} output", factor=2)
        for grad, x, w in zip(("dq", "dk", "dv"), _grads(attention, q, k, v, cotangent), want):
            assert_close(x, w, dtype, f"{name} {grad}", factor=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cupy_fronts_sequence_on_a_kernel_without_the_fix_gives_the_reference(dtype):
    """What ``engine.prepared`` does around the cuDNN kernel, with NumPy for CuPy and the reference run
    without the kept mask as the kernel (it then computes what the bias alone gives): ``set_forward`` after the
    forward; ``backward_residuals`` before the backward and ``add_dv`` after it.  The results equal the
    reference's (which applies the same rule), within one io-dtype rounding."""
    q, k, v, mask = _case(dtype, 7, 2, (B, N, T, S))
    host = [np.asarray(x) for x in (q, k, v)]
    config, operands = validate_call(*host, mask=mask, scale=SCALE, training=True)
    kernel = operands.replace(keep_mask=None)
    raw = reference.forward(config, kernel)
    output, lse = raw.output.copy(), raw.logsumexp.copy()
    masked_rows.set_forward(np, config, operands, output, lse)
    want = reference.forward(config, operands)
    assert_close(output, want.output, dtype, "output")
    assert np.array_equal(np.isneginf(lse), np.isneginf(want.logsumexp))

    grad_output = np.asarray(_cotangent(q.shape, dtype))
    do, kernel_lse = masked_rows.backward_residuals(np, config, operands, grad_output, lse)
    grads = reference.backward(config, kernel, output, do, kernel_lse)
    dv = grads.dv.copy()
    masked_rows.add_dv(np, config, operands, grad_output, dv)
    expected = reference.backward(config, operands, want.output, grad_output, want.logsumexp)
    for name, x, w in (("dq", grads.dq, expected.dq), ("dk", grads.dk, expected.dk), ("dv", dv, expected.dv)):
        assert np.isfinite(np.asarray(x, np.float32)).all(), name
        assert_close(x, w, dtype, name)



def test_bfloat16_inference_with_a_keep_mask_alone_leaves_the_rows_to_the_kernel():
    """Where ``kernel_gives_the_mean`` holds, the CuPy front writes nothing after the kernel; everywhere else it
    sets the rows.  The float32 arithmetic it relies on: scores of magnitude below ``2**17`` next to the
    bfloat16 mask's ``-2**41`` round to it, so a fully masked row's softmax is uniform (its output the mean of
    V), while in a partly masked row the masked keys get probability 0 and the kept ones their softmax."""
    rng = np.random.default_rng(11)
    q, k, v, mask = _case("bfloat16", 3, 2, (B, N, T, S))
    config, operands = validate_call(*(np.asarray(x) for x in (q, k, v)), mask=mask, scale=SCALE)
    assert masked_rows.kernel_gives_the_mean(config)
    output = np.full(config.o_shape, 7.0, np.float32)
    masked_rows.set_forward(np, config, operands, output)
    assert (output == 7.0).all()                                                  # nothing written
    others = {
        "float16": dict(dtype="float16"), "training": dict(training=True),
        "causal": dict(mask_type=MaskType.CAUSAL, diagonal_alignment="bottom_right"),
        "a bias beside the mask": dict(bias=np.zeros((T, S), "float32")),
        "dropout": dict(dropout_rate=0.1), "a sink": dict(sink=np.zeros(N, np.float32)),
        "padding": dict(mask_type=MaskType.PADDING, q_seqlen=np.full(B, T, np.int32),
                        kv_seqlen=np.full(B, S, np.int32)),
    }
    for name, change in others.items():
        dtype = change.pop("dtype", "bfloat16")
        arrays = [np.asarray(x).astype(dtype) if dtype == "float16" else np.asarray(x) for x in (q, k, v)]
        if "bias" in change:
            change["bias"] = change["bias"].astype(arrays[0].dtype)
        other, _ = validate_call(*arrays, mask=mask, scale=SCALE, **change)
        assert not masked_rows.kernel_gives_the_mean(other), name

    neg = np.float32(LARGE_NEGATIVE["bfloat16"])
    scores = rng.uniform(-2 ** 16, 2 ** 16, size=(64, S)).astype(np.float32)
    masked = scores + neg                                                         # fully masked rows, float32
    assert (masked == neg).all()
    assert (np.exp(masked - masked.max(-1, keepdims=True)) == 1).all()            # uniform: the mean of V
    kept = rng.random((64, S)) < 0.5
    kept[:, 0] = True
    partly = np.where(kept, scores / 2 ** 12, scores / 2 ** 12 + neg)
    p = np.exp(partly - partly.max(-1, keepdims=True))
    assert (p[~kept] == 0).all() and (p[kept] > 0).all()
