"""A ``score_mod``'s identity is its traced program, not the Python function object.

Equal functions - inline lambdas re-created in a loop, ``functools.partial`` of one function with the
same constants - give equal configurations (one graph-cache key, one cuDNN graph); different constants
give different ones; nothing keeps the user's function alive; a function seen before is not traced again.
"""

from __future__ import annotations

import functools
import gc
import pickle
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_attn import reference
from cudnn_attn.core.score_mod_spec import score_mod_program, score_mod_spec
from cudnn_attn.tracing.score_mod import apply, vjp
from cudnn_attn.core.validation import validate_call

B, T, S, N, H = 2, 16, 24, 4, 32


def _qkv(rng):
    q = rng.standard_normal((B, T, N, H)).astype(np.float16)
    k, v = (rng.standard_normal((B, S, N, H)).astype(np.float16) for _ in range(2))
    return q, k, v


def _config(score_mod, args=()):
    q, k, v = _qkv(np.random.default_rng(0))
    return validate_call(q, k, v, score_mod=score_mod, score_mod_args=args)[0]


def softcap(score, cap):
    return cap * jnp.tanh(score / cap)


def test_lambdas_recreated_in_a_loop_give_equal_configs():
    configs = [_config(lambda s: 30.0 * jnp.tanh(s / 30.0)) for _ in range(4)]
    assert len(set(configs)) == 1 and len({hash(c) for c in configs}) == 1


def test_partials_with_equal_constants_are_equal_and_others_are_not():
    same = [_config(functools.partial(softcap, cap=30.0)) for _ in range(2)]
    other = _config(functools.partial(softcap, cap=20.0))
    assert same[0] == same[1] and hash(same[0]) == hash(same[1])
    assert other != same[0]
    assert _config(lambda s: 20.0 * jnp.tanh(s / 20.0)) != _config(lambda s: 30.0 * jnp.tanh(s / 30.0))


def test_equal_programs_written_differently_share_a_config():
    """jit-wrapped helpers are inlined: the translated program, not the source text, is the identity."""
    helper = jax.jit(lambda x: x * 0.5 + 1.0)
    assert _config(lambda s: helper(s)) == _config(lambda s: s * 0.5 + 1.0)


def test_no_reference_to_the_function_remains():
    fn = lambda s: s * 2.0 + 1.0          # noqa: E731
    alive = weakref.ref(fn)
    config = _config(fn)
    q, k, v = _qkv(np.random.default_rng(1))
    reference.dot_product_attention(q, k, v, score_mod=fn)            # traced, evaluated, cached nowhere
    del fn
    gc.collect()
    assert alive() is None
    assert config.score_mod.name == "<lambda>"


def test_a_function_seen_before_is_not_traced_again():
    traces = []

    def counting(score):
        traces.append(1)                     # runs once per trace, never per evaluation
        return score * 3.0

    first, second = _config(counting), _config(counting)
    assert first == second and len(traces) == 1


def test_pickling_keeps_the_identity_and_the_programs_but_not_the_jaxpr():
    spec = _config(functools.partial(softcap, cap=5.0)).score_mod
    copy = pickle.loads(pickle.dumps(spec))
    assert copy == spec and copy.jaxpr is None and copy.program == spec.program


def test_the_program_runs_at_a_batch_it_was_not_traced_for():
    """vmap folds into the batch: the reference then runs the translated (shape-free) program."""
    spec = score_mod_spec(softcap, (B, N, T, S), (((), "float32"),))
    rng = np.random.default_rng(2)
    score = rng.standard_normal((3 * B, N, T, S)).astype(np.float32) * 4
    cap = np.float32(2.5)
    np.testing.assert_allclose(apply(spec, score, (cap,)), np.asarray(softcap(jnp.asarray(score), cap)),
                               rtol=2e-5, atol=2e-5)
    grad = rng.standard_normal(score.shape).astype(np.float32)
    want = jax.vjp(lambda x: softcap(x, cap), jnp.asarray(score))[1](jnp.asarray(grad))[0]
    np.testing.assert_allclose(vjp(spec, score, grad, (cap,)), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_an_untranslatable_function_still_runs_on_the_reference_at_its_shape():
    spec = score_mod_spec(lambda s: s - jnp.max(s, axis=-1, keepdims=True), (B, N, T, S))
    assert spec.program is None and "reduce_max" in spec.refusals[0]
    score = np.random.default_rng(3).standard_normal((B, N, T, S)).astype(np.float32)
    np.testing.assert_allclose(apply(spec, score, ()), score - score.max(-1, keepdims=True), rtol=1e-6)
    with pytest.raises(Exception, match="reduce_max"):
        score_mod_program(spec)


def test_jit_reuses_one_kernel_for_recreated_lambdas():
    from cudnn_attn.jax_bridge import dot_product_attention
    from cudnn_attn.jax_bridge.call_site import registry

    q, k, v = (jnp.asarray(x) for x in _qkv(np.random.default_rng(4)))
    outputs = []
    for _ in range(3):
        outputs.append(jax.jit(lambda q, k, v: dot_product_attention(q, k, v, score_mod=lambda s: s * 0.5))(q, k, v))
        if len(outputs) == 1:
            keys = len(registry)
    assert len(registry) == keys
    np.testing.assert_array_equal(np.asarray(outputs[0]), np.asarray(outputs[-1]))
