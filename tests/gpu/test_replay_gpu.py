"""Replayed launches (:mod:`cudnn_attn.engine.replay`) on the GPU: a launch replayed from a CUDA graph writes what
the launch itself writes, reads the arrays' current contents, stays out of a user's own capture, and the
JAX handler replays too.  Results are poisoned with NaN before every call, so an unwritten element shows."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import MaskType, reference
from cudnn_attn.core import settings

from ._checks import assert_close

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def _qkv(rng, T=256, S=256, N=8, K=8, H=64):
    import ml_dtypes

    dt = ml_dtypes.bfloat16
    return [cp.asarray(rng.standard_normal(shape).astype(dt)) for shape in ((2, T, N, H), (2, S, K, H), (2, S, K, H))]


def _replays(call):
    plan = call.plan()
    return sum(r.replays for r in plan.replays), sum(r.captures for r in plan.replays)


def test_replayed_forward_equals_the_launch_and_reads_current_contents():
    rng = np.random.default_rng(61)
    q, k, v = _qkv(rng)
    bound = cudnn_attn.bind(q, k, v, scale=0.125, mask_type=MaskType.CAUSAL)
    out = cp.full(q.shape, np.nan, q.dtype)
    first = cp.array(bound(q, k, v, out=out))
    for _ in range(4):                                   # seen, captured, then replayed
        out.fill(np.nan)
        assert cp.array_equal(bound(q, k, v, out=out), first)
    replays, captures = _replays(bound._forward.call)
    assert captures == 1 and replays >= 2, (captures, replays)
    q[...] = cp.asarray(rng.standard_normal(q.shape).astype(q.dtype))   # same address, new values
    out.fill(np.nan)
    bound(q, k, v, out=out)
    ref = reference.dot_product_attention(*(cp.asnumpy(x) for x in (q, k, v)), scale=0.125,
                                          mask_type=MaskType.CAUSAL)
    assert_close("output", out, ref, "bfloat16")


def test_replayed_backward_matches_the_reference():
    rng = np.random.default_rng(67)
    q, k, v = _qkv(rng, T=192, K=2)
    grad = cp.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    kwargs = dict(scale=0.125, mask_type=MaskType.CAUSAL)
    bound = cudnn_attn.bind(q, k, v, return_residual=True, **kwargs)
    o, lse = bound(q, k, v)
    ref_o, ref_lse = reference.dot_product_attention(*(cp.asnumpy(x) for x in (q, k, v)), return_residual=True,
                                                     **kwargs)
    ref = reference.dot_product_attention_bwd(*(cp.asnumpy(x) for x in (q, k, v)), ref_o, cp.asnumpy(grad),
                                              ref_lse, **kwargs)
    for _ in range(5):
        grads = bound.backward(q, k, v, o, grad, lse)
        for name in ("dq", "dk", "dv"):
            assert_close(name, getattr(grads, name), getattr(ref, name), "bfloat16")
        del grads                                        # the pool hands the same block back: same addresses
    replays, captures = _replays(bound._backward.call)
    assert captures >= 1 and replays >= 1, (captures, replays)


def test_public_calls_replay_and_stay_right():
    rng = np.random.default_rng(71)
    q, k, v = _qkv(rng, T=128, S=320, N=4, K=4)
    ref = reference.dot_product_attention(*(cp.asnumpy(x) for x in (q, k, v)), scale=0.2)
    for _ in range(5):
        assert_close("output", cudnn_attn.dot_product_attention(q, k, v, scale=0.2), ref, "bfloat16")


def test_dropped_results_come_back_at_the_same_address_and_replay():
    """A loop that drops each result gets it back at the same address (cudnn_attn.engine.result_blocks), so the
    launch replays; each result is poisoned with NaN before it is dropped, so a reused block that the next
    launch did not rewrite shows.  Results that are still alive are never handed out again."""
    from cudnn_attn.engine.prepared import calls
    from cudnn_attn.engine.result_blocks import result_blocks

    rng = np.random.default_rng(83)
    q, k, v = _qkv(rng, T=192, S=256, N=4, K=2)
    kwargs = dict(scale=0.15, mask_type=MaskType.CAUSAL)
    ref = reference.dot_product_attention(*(cp.asnumpy(x) for x in (q, k, v)), **kwargs)
    before = result_blocks.stats()
    addresses = []
    for _ in range(6):
        o = cudnn_attn.dot_product_attention(q, k, v, **kwargs)
        assert_close("output", o, ref, "bfloat16")
        addresses.append(o.data.ptr)
        o.fill(np.nan)
        del o
    after = result_blocks.stats()
    assert len(set(addresses[1:])) == 1, addresses            # the first call is the generic path
    assert after.reused - before.reused >= 4, (before, after)
    direct = next(d for d in calls.direct_launches() if d.config.scale == pytest.approx(0.15))
    replays, captures = _replays(direct)
    assert captures >= 1 and replays >= 2, (captures, replays)
    held = [cudnn_attn.dot_product_attention(q, k, v, **kwargs) for _ in range(3)]
    assert len({x.data.ptr for x in held}) == 3
    for x in held:
        assert_close("output", x, ref, "bfloat16")
    del held, x
    o, rebound = None, []                                      # o = f(...): two blocks alternate
    for _ in range(6):
        if o is not None:
            o.fill(np.nan)
        o = cudnn_attn.dot_product_attention(q, k, v, **kwargs)
        assert_close("output", o, ref, "bfloat16")
        rebound.append(o.data.ptr)
    assert len(set(rebound[2:])) == 2 and rebound[2:4] == rebound[4:6], rebound


def test_no_replay_into_a_stream_the_user_captures():
    """A call inside the user's own CUDA-graph capture is recorded into it (not replayed from ours): the
    user's graph, launched later, computes the attention of the contents at launch time."""
    rng = np.random.default_rng(73)
    q, k, v = _qkv(rng)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        bound = cudnn_attn.bind(q, k, v, scale=0.125)
        out = cp.full(q.shape, np.nan, q.dtype)
        for _ in range(3):                               # our graph for these addresses exists
            bound(q, k, v, out=out)
        stream.begin_capture()
        bound(q, k, v, out=out)
        graph = stream.end_capture()
        q[...] = cp.asarray(rng.standard_normal(q.shape).astype(q.dtype))
        out.fill(np.nan)
        graph.launch(stream)
    stream.synchronize()
    ref = reference.dot_product_attention(*(cp.asnumpy(x) for x in (q, k, v)), scale=0.125)
    assert_close("output", out, ref, "bfloat16")


def test_jax_handler_replays_without_command_buffers():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from cudnn_attn import jax_bridge
    from cudnn_attn.jax_bridge import cudnn_target
    from cudnn_attn.jax_bridge.call_site import registry

    rng = np.random.default_rng(79)
    q, k, v = (jnp.asarray(cp.asnumpy(x)) for x in _qkv(rng, T=128, S=128))
    f = jax.jit(lambda q, k, v: jax_bridge.dot_product_attention(q, k, v, scale=0.3, cuda_graph=False))
    first = np.asarray(f(q, k, v))
    ref = reference.dot_product_attention(*(np.asarray(x) for x in (q, k, v)), scale=0.3)
    assert_close("output", first, ref, "bfloat16")
    for _ in range(6):
        np.testing.assert_array_equal(np.asarray(f(q, k, v)), first)
    sites = [key for key, call in registry._calls.items() if call.config.scale == pytest.approx(0.3)]
    plans = [cudnn_target.pinned_plan(key, 0) for key in sites]
    counts = [(r.captures, r.replays) for p in plans if p is not None for r in p.replays]
    print("JAX handler replays (captures, replays):", counts)
    assert plans and all(p is not None for p in plans)


@pytest.mark.parametrize("kind", ["fwd", "bwd"])
def test_graphs_updated_in_place_for_new_addresses_write_the_new_results(kind, monkeypatch):
    """At its bound a plan gives its least recently used graph to new addresses (cudaGraphExecUpdate): with a
    bound of 2 graphs and 5 result buffers in a cycle, every replay writes into the buffer of its own call,
    and the others keep what they held (each buffer is poisoned with NaN before its call)."""
    from cudnn_attn.engine import replay

    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay_graphs_per_plan=2))
    monkeypatch.setattr(settings, "current", dataclasses.replace(settings.current, replay_patience=10 ** 6))
    rng = np.random.default_rng(73 if kind == "fwd" else 79)
    q, k, v = _qkv(rng, T=128, S=192, N=4, K=2)
    kwargs = dict(scale=0.125, mask_type=MaskType.CAUSAL)
    host = [cp.asnumpy(x) for x in (q, k, v)]
    made, destroyed, updated = replay.churn()
    if kind == "fwd":
        bound = cudnn_attn.bind(q, k, v, **kwargs)
        want = reference.dot_product_attention(*host, **kwargs)
        buffers = [cp.empty_like(q) for _ in range(5)]
        call = lambda i: bound(q, k, v, out=buffers[i])                                 # noqa: E731
    else:
        bound = cudnn_attn.bind(q, k, v, return_residual=True, **kwargs)
        o, lse = bound(q, k, v)
        ref_o, ref_lse = reference.dot_product_attention(*host, return_residual=True, **kwargs)
        grads = [cp.asarray(rng.standard_normal(q.shape).astype(q.dtype)) for _ in range(5)]
        wants = [reference.dot_product_attention_bwd(*host, ref_o, cp.asnumpy(g), ref_lse, **kwargs).dq
                 for g in grads]
        call = lambda i: bound.backward(q, k, v, o, grads[i], lse).dq                  # noqa: E731
    for sweep in range(4):
        for i in range(5):
            if kind == "fwd":
                buffers[i].fill(np.nan)
            got = call(i)
            assert_close(f"{kind} call {i} of sweep {sweep}", got, want if kind == "fwd" else wants[i], "bfloat16")
            del got
    if kind == "fwd":
        for i in range(5):
            assert_close(f"buffer {i} at the end", buffers[i], want, "bfloat16")
    now = replay.churn()
    assert now.updated > updated, (made, destroyed, updated, now)
