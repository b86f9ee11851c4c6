"""Bad device values on the GPU: lengths past the buffers, negative lengths, offsets past the
row, page ids outside the cache - handed to cuDNN only after :func:`cudnn_attn.core.values.sanitize`.

For every kind of bad value: no error escapes but the documented ones (``ValueError`` in the checked
mode, naming the argument, the row and the value), and the results equal the NumPy reference run on the
clamped values (every element finite: results start NaN-poisoned where the test allocates them).  A
negative ``kv_seqlen`` is left to the CPU tests: clamped to 0 it leaves queries without a
key, whose result the reference does not pin down yet.

* execution level: ``values.sanitize(config, operands, cupy)`` then :func:`cudnn_attn.engine.prepared.forward` /
  ``backward`` - independent of how the public call is wired;
* the public CuPy call (``cudnn_attn.dot_product_attention`` / ``paged_attention``) - once it guards its
  values (skipped until it takes ``check_values``);
* the JAX bridge on the GPU: ``jit`` clamps, eager calls and the checked mode report.

What cuDNN 9.19 does with raw bad values (reads and writes out of bounds) is in DESIGN.md, "Measured facts".
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import MaskType, reference
from cudnn_attn.core import values
from cudnn_attn.core.validation import validate_call
from cudnn_attn.engine import prepared

from ._checks import assert_close, assert_lse_close, poisoned, to_gpu

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

B, T, S, N, H = 2, 64, 64, 4, 64
BLOCK, BLOCKS_PER_SEQ, NUM_BLOCKS = 16, 4, 8

CASES = {
    # name: (kind, value arrays, the argument the checked mode names)
    "kv_seqlen=999": ("padded", dict(q_seqlen=[64, 40], kv_seqlen=[999, 64]), "kv_seqlen"),
    "q_seqlen=999": ("padded", dict(q_seqlen=[999, 40], kv_seqlen=[50, 64]), "q_seqlen"),
    "q_seqlen=-1": ("padded", dict(q_seqlen=[-1, 40], kv_seqlen=[50, 64]), "q_seqlen"),
    "packed-offset-past-row": ("packed", dict(q_seqlen=[[20, 30, -1], [64, -1, -1]],
                                              q_offsets=[[0, 50, -1, -1], [0, -1, -1, -1]]), "q_offsets"),
    "packed-length-999": ("packed", dict(q_seqlen=[[20, 999, -1], [64, -1, -1]],
                                         q_offsets=[[0, 20, -1, -1], [0, -1, -1, -1]]), "q_offsets"),
    "page-id-999": ("paged", dict(kv_seqlen=[64, 50], page_table_k=[[0, 1, 999, 3], [4, 5, 6, 7]]), "page_table_k"),
    "page-id-negative": ("paged", dict(kv_seqlen=[64, 50], page_table_k=[[0, 1, -3, 3], [4, 5, 6, 7]]),
                         "page_table_k"),
    "paged-kv_seqlen-999": ("paged", dict(kv_seqlen=[999, 50], page_table_k=[[0, 1, 2, 3], [4, 5, 6, 7]]),
                            "kv_seqlen"),
}


def _call(case: str, rng: np.random.Generator) -> tuple[dict, dict]:
    """``(arrays, static)`` of a call with the case's bad values: NumPy arrays, random fp16 Q/K/V."""
    kind, bad, _ = CASES[case]
    arrays = {n: np.asarray(x, np.int32) for n, x in bad.items()}
    q = rng.standard_normal((B, T, N, H)).astype(np.float16)
    if kind == "paged":
        k = rng.standard_normal((NUM_BLOCKS, BLOCK, N, H)).astype(np.float16)
        arrays["q_seqlen"] = np.array([T, 40], np.int32)
        arrays["page_table_k"] = arrays["page_table_k"].reshape(B, 1, BLOCKS_PER_SEQ, 1)
        arrays["page_table_v"] = arrays["page_table_k"].copy()
    else:
        k = rng.standard_normal((B, S, N, H)).astype(np.float16)
    if kind == "packed":
        arrays.update(kv_seqlen=arrays["q_seqlen"].copy(), kv_offsets=arrays["q_offsets"].copy())
    arrays.update(query=q, key=k, value=rng.standard_normal(k.shape).astype(np.float16))
    static = dict(scale=0.125, mask_type=MaskType.PADDING if kind != "packed" else MaskType.NO_MASK)
    return arrays, static


def _clamped_reference(arrays: dict, static: dict, training: bool):
    config, operands = validate_call(**arrays, **static, training=training, xp=np)
    return config, operands, values.sanitize(config, operands, np)


@pytest.mark.parametrize("case", list(CASES))
def test_execution_on_sanitized_device_values_equals_the_clamped_reference(case, rng):
    arrays, static = _call(case, rng)
    training = CASES[case][0] != "paged"
    config, operands, clamped = _clamped_reference(arrays, static, training)
    gpu = values.sanitize(config, to_gpu(operands), cp)
    for name, x in values.present(gpu).items():
        np.testing.assert_array_equal(cp.asnumpy(x), getattr(clamped, name), err_msg=name)
    output = poisoned(config.o_shape, np.float16)
    lse = poisoned(config.lse_shape, np.float32) if training else None
    result = prepared.forward(config, gpu, output=output, logsumexp=lse)
    expected = reference.forward(config, clamped)
    assert_close("output", result.output, expected.output, "float16")
    if not training:
        return
    assert_lse_close(result.logsumexp, expected.logsumexp)
    grad = rng.standard_normal(config.o_shape).astype(np.float16)
    given = dict(dq=poisoned(config.q_shape, np.float16), dk=poisoned(config.k_shape, np.float16),
                 dv=poisoned(config.v_shape, np.float16))
    grads = prepared.backward(config, gpu, result.output, cp.asarray(grad), result.logsumexp, **given)
    want = reference.backward(config, clamped, expected.output, grad, expected.logsumexp)
    for name in ("dq", "dk", "dv"):
        assert_close(name, getattr(grads, name), getattr(want, name), "float16")


_GUARDED = "check_values" in inspect.signature(cudnn_attn.dot_product_attention).parameters
public = pytest.mark.skipif(not _GUARDED, reason="the CuPy path does not guard its values yet (cudnn_attn.fronts.cupy "
                                                 "must call cudnn_attn.core.values)")


def _public(arrays: dict, static: dict, **kw):
    gpu = {n: cp.asarray(x) for n, x in arrays.items()}
    if "page_table_k" in gpu:
        return cudnn_attn.paged_attention(**gpu, **static, **kw)
    return cudnn_attn.dot_product_attention(**gpu, **static, **kw)


@public
@pytest.mark.parametrize("case", list(CASES))
def test_public_cupy_call_clamps_bad_device_values(case, rng):
    arrays, static = _call(case, rng)
    config, _, clamped = _clamped_reference(arrays, static, False)
    got = _public(arrays, static)
    assert_close("output", got, reference.forward(config, clamped).output, "float16")


@public
@pytest.mark.parametrize("case", list(CASES))
def test_public_cupy_call_in_checked_mode_names_argument_row_and_value(case, rng):
    arrays, static = _call(case, rng)
    argument = CASES[case][2]
    with pytest.raises(ValueError, match=rf"^{argument}: row \d"):
        _public(arrays, static, check_values=True)


# -- the JAX bridge on the GPU -------------------------------------------------------------------------------
def _jax_gpu():
    try:
        import jax
        return bool(jax.devices("gpu"))
    except Exception:  # noqa: BLE001 -- no JAX, or no CUDA backend
        return False


jax_gpu = pytest.mark.skipif(not _jax_gpu(), reason="JAX has no CUDA backend here")


def _jax_call(arrays: dict, static: dict, **kw):
    from cudnn_attn import jax_bridge as jb

    if "page_table_k" in arrays:
        return jb.paged_attention(**arrays, **static, **kw)
    return jb.dot_product_attention(**arrays, **static, **kw)


@jax_gpu
@pytest.mark.parametrize("case", list(CASES))
def test_jax_jit_clamps_and_eager_and_checked_mode_report(case, rng):
    import jax
    import jax.numpy as jnp

    arrays, static = _call(case, rng)
    config, _, clamped = _clamped_reference(arrays, static, False)
    device = {n: jnp.asarray(x) for n, x in arrays.items()}
    got = jax.jit(lambda a: _jax_call(a, static))(device)
    assert_close("output", np.asarray(got), reference.forward(config, clamped).output, "float16")
    argument = CASES[case][2]
    with pytest.raises(ValueError, match=rf"^{argument}: row \d"):
        _jax_call(device, static)                                        # eager: concrete values are read
    checked = jax.jit(lambda a: _jax_call(a, static, check_values=True))
    with pytest.raises(Exception, match=rf"{argument}: row \d"):
        jax.block_until_ready(checked(device))
