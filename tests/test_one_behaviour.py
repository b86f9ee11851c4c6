"""One behaviour on every front: ``scale=None``, the lazy ``cudnn_attn.reference`` attribute, the CPU fronts'
support check against the default GPU target, packed BNTH run as BTNH, the warning of a top-left causal mask
with fewer queries than keys, bottom-right causal with a bias, and the checked mode under ``jit``."""

from __future__ import annotations

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import jax_bridge
from cudnn_attn import reference as ref

TOL = dict(atol=2e-3, rtol=2e-3)        # float16 results of two float64 computations rounded apart


def _qkv(rng, shape=(2, 8, 4, 16), kv_shape=None, dtype=np.float16):
    kv_shape = kv_shape or shape
    return (rng.standard_normal(shape).astype(dtype), rng.standard_normal(kv_shape).astype(dtype),
            rng.standard_normal(kv_shape).astype(dtype))


# -- scale=None ---------------------------------------------------------------------------------------

def test_scale_none_is_one_over_sqrt_h_on_every_front(rng):
    q, k, v = _qkv(rng)
    expected = ref.dot_product_attention(q, k, v, scale=1 / math.sqrt(16)).astype(np.float64)
    jq, jk, jv = map(jnp.asarray, (q, k, v))
    found = {
        "reference seed": ref.dot_product_attention(q, k, v, scale=None),
        "reference native": ref.attention(q, k, v, scale=None).output,
        "reference bwd": None,
        "jax seed": jax_bridge.dot_product_attention(jq, jk, jv, scale=None),
        "jax native": jax_bridge.attention(jq, jk, jv, scale=None).output,
        "jax.nn drop-in": jax_bridge.dot_product_attention_nn(jq, jk, jv, scale=None),
    }
    for name, out in found.items():
        if out is not None:
            np.testing.assert_allclose(np.asarray(out).astype(np.float64), expected, **TOL, err_msg=name)
    out, lse = ref.dot_product_attention(q, k, v, scale=None, return_residual=True)
    do = rng.standard_normal(out.shape).astype(np.float16)
    grads = ref.dot_product_attention_bwd(q, k, v, out, do, lse, scale=None)
    explicit = ref.dot_product_attention_bwd(q, k, v, out, do, lse, scale=0.25)
    np.testing.assert_array_equal(grads.dq, explicit.dq)


def test_seed_functions_keep_their_default_scale_of_one(rng):
    q, k, v = _qkv(rng)
    np.testing.assert_array_equal(ref.dot_product_attention(q, k, v), ref.dot_product_attention(q, k, v, scale=1.0))


# -- cudnn_attn.reference -----------------------------------------------------------------------------

def test_reference_is_an_attribute_imported_on_first_use():
    code = ("import sys, cudnn_attn; assert 'cudnn_attn.reference' not in sys.modules; "
            "print(cudnn_attn.reference.attention.__module__); "
            "import cudnn_attn as c\n"
            "try:\n    c.no_such_thing\nexcept AttributeError as e:\n    print(e)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"CUDNN_ATTN_PRELOAD": "0", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["cudnn_attn.reference.seed_api",
                                        "module 'cudnn_attn' has no attribute 'no_such_thing'"]
    assert cudnn_attn.reference is ref
