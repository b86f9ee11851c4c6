"""Flax on the GPU: ``cudnn_attn.jax_bridge.flax_attention_fn`` against Flax's default attention.

* The training step of ``benchmarks/bench_frameworks.py`` (an ``nnx`` decoder, bfloat16 compute, float32
  parameters, Flax-built padding-and-causal float masks, SGD, ``nnx.jit``), smaller: 2 layers, d_model 512,
  8 heads, T=512, B=4, 3 steps.  Every step's loss within 2e-3 relative of the same model with
  ``nnx.dot_product_attention`` (bfloat16 training; the two attentions round differently, as in
  ``test_training_gpu``), every parameter's gradient within 2e-2 of the whole gradient's norm (the CPU tier
  measured below 5e-3 with this model family), everything finite; the gradients of the first step with
  the mask left out must differ by more than 2e-2 (so the tolerance can fail).
* One call with a Flax float keep-mask and a bias against the NumPy reference (float64 on the same
  bfloat16 inputs), forward and the gradients of Q/K/V through ``jax.grad``, with the GPU tier's bfloat16
  tolerance (``_checks.RELATIVE_TOLERANCE``).  XLA allocates the results, so there is no NaN poisoning here;
  every result must be finite.

Under the GPU tier's per-test timeout (``benchmarks/run_all.py``: ``--timeout 200``).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from ._checks import assert_close

pytestmark = pytest.mark.gpu
flax = pytest.importorskip("flax")

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import bench_frameworks as frameworks  # noqa: E402

SHAPE = frameworks.DecoderShape(batch=4, length=512, d_model=512, heads=8, layers=2, vocab=4096)


def _gradient_error(ours, ref) -> float:
    """The largest error of a parameter's gradient, relative to the norm of the whole reference gradient."""
    import jax

    leaves, ref_leaves = jax.tree.leaves(ours), jax.tree.leaves(ref)
    total = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in ref_leaves)))
    worst = 0.0
    for a, b in zip(leaves, ref_leaves, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.all(np.isfinite(a)), f"gradient {b.shape}: not finite"
        worst = max(worst, float(np.linalg.norm(a - b)) / total)
    return worst


def test_nnx_training_step_matches_flax_default():
    import jax.numpy as jnp
    from flax import nnx

    from cudnn_attn.jax_bridge import flax_attention_fn

    tokens, mask = frameworks.batch(SHAPE, seed=3)
    step = frameworks.make_train_step(with_grads=True)
    ours = frameworks.decoder(flax_attention_fn(), SHAPE, seed=1)
    default = frameworks.decoder(nnx.dot_product_attention, SHAPE, seed=1)
    unmasked = nnx.jit(nnx.grad(frameworks.loss))(ours, tokens, jnp.ones_like(mask))   # before any step
    for i in range(3):
        l_ours, g_ours = step(ours, tokens, mask)
        l_ref, g_ref = step(default, tokens, mask)
        l_ours, l_ref = float(l_ours), float(l_ref)
        assert np.isfinite(l_ours), f"step {i}: loss {l_ours}"
        assert abs(l_ours - l_ref) <= 2e-3 * abs(l_ref), f"step {i}: loss {l_ours} vs Flax's {l_ref}"
        error = _gradient_error(g_ours, g_ref)
        assert error <= 2e-2, f"step {i}: a gradient differs by {error:.2e} of the gradient's norm (> 2e-2)"
        if i == 0:
            bad = _gradient_error(unmasked, g_ref)
            assert bad > 2e-2, f"without the mask the gradients differ by only {bad:.2e}: the check cannot fail"


def test_call_with_flax_mask_matches_reference(rng):
    import jax
    import jax.numpy as jnp
    import ml_dtypes
    from flax import nnx

    from cudnn_attn import AuxRequest, keep, reference
    from cudnn_attn.jax_bridge import flax_attention_fn

    B, T, N, H = 2, 256, 8, 64
    q, k, v = (rng.standard_normal((B, T, N, H)).astype(ml_dtypes.bfloat16) for _ in range(3))
    bias = rng.standard_normal((1, N, T, T)).astype(ml_dtypes.bfloat16)
    tokens = np.ones((B, T), np.int32)
    tokens[1, 200:] = 0
    mask = np.asarray(nnx.combine_masks(nnx.make_attention_mask(tokens > 0, tokens > 0), nnx.make_causal_mask(tokens)))
    cotangent = rng.standard_normal((B, T, N, H)).astype(ml_dtypes.bfloat16)
    fn = flax_attention_fn()
    ins = [jnp.asarray(x) for x in (q, k, v)]
    out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, bias=jnp.asarray(bias), mask=jnp.asarray(mask)), *ins)
    dq, dk, dv = vjp(jnp.asarray(cotangent))

    scale = H ** -0.5
    ref = reference.attention(q, k, v, mask=keep(mask > 0), bias=bias, scale=scale,
                              return_aux=AuxRequest(logsumexp=True))
    grads = reference.dot_product_attention_bwd(q, k, v, ref.output, cotangent, ref.logsumexp, bias=bias,
                                                mask=mask > 0, scale=scale)
    for name, got, want in (("output", out, ref.output), ("dq", dq, grads.dq), ("dk", dk, grads.dk),
                            ("dv", dv, grads.dv)):
        assert_close(name, np.asarray(got.astype(jnp.float32)), want, "bfloat16")

