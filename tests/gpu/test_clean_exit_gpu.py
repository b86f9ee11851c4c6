"""A GPU process that used the library exits cleanly: no cuDNN frontend object outlives the interpreter.

The child process makes CuPy calls (plain causal, and a score_mod forward and backward, whose graphs can hold
a reference cycle through cuDNN's C++ graph (its callbacks)) and jitted JAX calls (forward and gradient,
with and without XLA's command buffers), checks the results are finite, and exits normally.  nanobind
prints ``nanobind: leaked ...`` at exit for every frontend object still alive; there must be none.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.gpu

CHILD = textwrap.dedent("""
    import numpy as np
    import cupy as cp
    import jax
    import jax.numpy as jnp
    import cudnn_attn
    from cudnn_attn import jax_bridge as jb

    def softcap(score):
        return 20.0 * jnp.tanh(score / 20.0)

    rng = np.random.default_rng(11)
    shape = (2, 128, 4, 64)
    q, k, v = (cp.asarray(rng.standard_normal(shape).astype(np.float16)) for _ in range(3))
    out = cudnn_attn.dot_product_attention(q, k, v, mask_type=cudnn_attn.MaskType.CAUSAL)
    out, lse = cudnn_attn.dot_product_attention(q, k, v, score_mod=softcap, return_residual=True)
    grads = cudnn_attn.dot_product_attention_bwd(q, k, v, out, cp.asarray(rng.standard_normal(shape), cp.float16),
                                                 lse, score_mod=softcap)
    assert bool(cp.isfinite(out).all()) and bool(cp.isfinite(grads.dq).all())

    jq, jk, jv = (jnp.asarray(cp.asnumpy(x)) for x in (q, k, v))
    for cuda_graph, score_mod in ((True, None), (False, None), (None, softcap)):
        def loss(q, k, v):
            out = jb.dot_product_attention(q, k, v, mask_type=cudnn_attn.MaskType.CAUSAL if score_mod is None
                                           else cudnn_attn.MaskType.NO_MASK, score_mod=score_mod,
                                           cuda_graph=cuda_graph)
            return out.astype(jnp.float32).sum()
        value, dq = jax.jit(jax.value_and_grad(loss))(jq, jk, jv)
        assert bool(jnp.isfinite(value)) and bool(jnp.isfinite(dq).all())
    print("child done")
""")


def test_no_frontend_object_leaks_at_exit():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "child done" in done.stdout
    leaks = [line for line in done.stderr.splitlines() if line.startswith(("nanobind:", " - leaked"))]
    assert not leaks, "\n".join(leaks[:30])
