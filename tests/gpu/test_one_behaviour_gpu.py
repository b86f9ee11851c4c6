"""One behaviour on every front, on the H200: packed BNTH (run as BTNH), bottom-right causal with a bias
(folded into the bias), ``scale=None``, the ``jax.nn`` drop-in's array-likes, and the checked mode under
``jit``.  Every result is compared with the NumPy reference's core functions (``reference.forward`` /
``backward``, which compute packed BNTH and bottom-right natively) within ``_checks``' tolerances; results the
test allocates start NaN-poisoned."""

from __future__ import annotations

import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import MaskType, reference
from cudnn_attn.core.validation import validate_call
from cudnn_attn.engine import prepared

from ._checks import assert_close, assert_lse_close, poisoned, to_gpu

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def _jax_gpu():
    try:
        import jax
        return bool(jax.devices("gpu"))
    except Exception:  # noqa: BLE001 -- no JAX, or no CUDA backend
        return False


jax_gpu = pytest.mark.skipif(not _jax_gpu(), reason="JAX has no CUDA backend here")


def _normal(rng, shape, dtype=np.float16):
    return rng.standard_normal(shape).astype(dtype)


def _packed_bnth(rng):
    """A packed call in BNTH: B=2, T=S=128, N=4, K=2, H=64, two segments in row 0, one in row 1."""
    q, k, v = (np.ascontiguousarray(np.swapaxes(_normal(rng, (2, 128, n, 64)), 1, 2)) for n in (4, 2, 2))
    return dict(query=q, key=k, value=v, q_seqlen=np.array([[40, 70], [128, -1]], np.int32),
                kv_seqlen=np.array([[50, 60], [100, -1]], np.int32),
                q_offsets=np.array([[0, 40, -1], [0, -1, -1]], np.int32),
                kv_offsets=np.array([[0, 50, -1], [0, -1, -1]], np.int32), qkv_layout="BNTH")


def _run_execution(config, operands, rng):
    """Forward and backward through ``engine.prepared`` into NaN-poisoned buffers, against the reference."""
    gpu = to_gpu(operands)
    out = prepared.forward(config, gpu, output=poisoned(config.o_shape, operands.query.dtype),
                            logsumexp=poisoned(config.lse_shape, np.float32))
    want = reference.forward(config, operands)
    assert_close("output", out.output, want.output, config.dtype)
    assert_lse_close(out.logsumexp, want.logsumexp)
    do = _normal(rng, config.o_shape, operands.query.dtype)
    grads = prepared.backward(config, gpu, out.output, cp.asarray(do), out.logsumexp,
                               dq=poisoned(operands.query.shape, operands.query.dtype),
                               dk=poisoned(operands.key.shape, operands.key.dtype),
                               dv=poisoned(operands.value.shape, operands.value.dtype))
    want_grads = reference.backward(config, operands, want.output, do, want.logsumexp)
    for name in ("dq", "dk", "dv", "dbias"):
        if getattr(want_grads, name) is not None:
            assert_close(name, getattr(grads, name), getattr(want_grads, name), config.dtype)


def test_packed_bnth_runs_as_btnh(rng):
    call = _packed_bnth(rng)
    arrays = {n: call.pop(n) for n in ("query", "key", "value")}
    config, operands = validate_call(**arrays, **call, training=True, xp=np)
    _run_execution(config, operands, rng)
    public = cudnn_attn.dot_product_attention(*(cp.asarray(arrays[n]) for n in ("query", "key", "value")),
                                              **{n: cp.asarray(x) if isinstance(x, np.ndarray) else x
                                                 for n, x in call.items()})
    assert_close("public output", public, reference.forward(config.replace(training=False), operands).output,
                 "float16")


@pytest.mark.parametrize("t, window", [(128, None), (32, None), (64, 48)], ids=["T=S", "T<S", "T<S-window"])
def test_bottom_right_causal_with_a_bias_runs(rng, t, window):
    q, k, v = _normal(rng, (2, t, 4, 64)), _normal(rng, (2, 128, 4, 64)), _normal(rng, (2, 128, 4, 64))
    bias = _normal(rng, (1, 4, t, 128))
    config, operands = validate_call(q, k, v, bias, mask_type=MaskType.CAUSAL, diagonal_alignment="bottom_right",
                                     sliding_window_length=window, training=True, xp=np)
    _run_execution(config, operands, rng)


def test_scale_none_is_one_over_sqrt_h(rng):
    q, k, v = (_normal(rng, (2, 128, 4, 64)) for _ in range(3))
    got = cudnn_attn.dot_product_attention(*(cp.asarray(x) for x in (q, k, v)), scale=None)
    assert_close("output", got, reference.dot_product_attention(q, k, v, scale=0.125), "float16")


@jax_gpu
def test_jax_bridge_packed_bnth_and_bottom_right_bias_under_jit(rng):
    import jax
    import jax.numpy as jnp

    from cudnn_attn import jax_bridge

    call = _packed_bnth(rng)
    arrays = {n: jnp.asarray(x) for n, x in call.items() if isinstance(x, np.ndarray)}
    got = jax.jit(lambda a: jax_bridge.dot_product_attention(**a, qkv_layout="BNTH"))(arrays)
    config, operands = validate_call(**{n: x for n, x in call.items()}, xp=np)
    assert_close("packed BNTH", np.asarray(got), reference.forward(config, operands).output, "float16")

    q, k, v = _normal(rng, (2, 32, 4, 64)), _normal(rng, (2, 128, 4, 64)), _normal(rng, (2, 128, 4, 64))
    bias = _normal(rng, (2, 1, 32, 128))
    kwargs = dict(mask_type=MaskType.CAUSAL, diagonal_alignment="bottom_right")
    config, operands = validate_call(q, k, v, bias, training=True, xp=np, **kwargs)
    want = reference.forward(config, operands)
    do = _normal(rng, q.shape)
    want_grads = reference.backward(config, operands, want.output, do, want.logsumexp)

    def loss(q, k, v, bias):
        out = jax_bridge.dot_product_attention(q, k, v, bias, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * jnp.asarray(do, jnp.float32))

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*map(jnp.asarray, (q, k, v, bias)))
    for name, g in zip(("dq", "dk", "dv", "dbias"), grads):
        assert_close(name, np.asarray(g), getattr(want_grads, name), "float16")


@jax_gpu
def test_jax_nn_drop_in_array_likes_match_jax_nn(rng):
    import jax
    import jax.numpy as jnp

    from cudnn_attn import jax_bridge

    q, k, v = (jnp.asarray(_normal(rng, (2, 128, 4, 64))) for _ in range(3))
    bias = rng.standard_normal((128, 128)).tolist()
    keep = jnp.asarray(rng.random((2, 1, 128, 128)) > 0.3) | jnp.eye(128, dtype=bool)
    for kwargs in (dict(bias=bias), dict(bias=keep), dict(mask=keep.tolist(), scale=None)):
        got = jax_bridge.dot_product_attention_nn(q, k, v, **kwargs)
        want = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kwargs)
        assert_close(f"drop-in {sorted(kwargs)}", np.asarray(got), np.asarray(want), "float16", scale=2.0)


@jax_gpu
def test_check_values_raises_from_a_jitted_call_naming_the_argument(rng):
    import jax
    import jax.numpy as jnp

    from cudnn_attn import jax_bridge

    q, k, v = (jnp.asarray(_normal(rng, (2, 128, 4, 64))) for _ in range(3))
    lengths = jnp.asarray([128, 999], jnp.int32)
    run = jax.jit(lambda q, k, v, lengths: jax_bridge.dot_product_attention_nn(
        q, k, v, key_value_seq_lengths=lengths, check_values=True))
    with pytest.raises(Exception, match=r"key_value_seq_lengths: row 1"):
        jax.block_until_ready(run(q, k, v, lengths))
    clamped = jax.jit(lambda q, k, v, lengths: jax_bridge.dot_product_attention_nn(
        q, k, v, key_value_seq_lengths=lengths))(q, k, v, lengths)
    want = reference.dot_product_attention(*(np.asarray(x) for x in (q, k, v)), scale=0.125)
    assert_close("clamped", np.asarray(clamped), want, "float16")
