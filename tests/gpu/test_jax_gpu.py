"""The JAX bridge on the GPU: cuDNN graphs on XLA's stream and buffers, under ``jit``, ``grad``, ``vmap``,
CUDA graphs and sharding, against the NumPy reference (tolerances of ``_checks``).

Needs JAX with a CUDA backend; the sharding tests need 2 GPUs (the 2-GPU H200 machine).
"""

from __future__ import annotations

import numpy as np
import pytest

from cudnn_attn import MaskType, UnsupportedConfigurationError, reference

from ._checks import assert_close, assert_lse_close, io_dtype

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
jb = pytest.importorskip("cudnn_attn.jax_bridge")


def _gpus() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _gpus(), reason="JAX has no CUDA backend here")]
two_gpus = pytest.mark.skipif(len(_gpus()) < 2, reason="needs 2 GPUs (the 2-GPU H200 machine)")

SCALE = 0.125


def _arrays(rng, dtype, *shapes):
    dt = io_dtype(dtype)
    return tuple(rng.standard_normal(shape).astype(dt) for shape in shapes)


def _case(name: str, rng: np.random.Generator, dtype: str = "bfloat16"):
    """``(numpy q, k, v), numpy keyword arguments`` of one feature (B=2, T=S=256, N=4, K=2, H=64)."""
    B, T, S, N, K, H = 2, 256, 256, 4, 2, 64
    layout = "BNTH" if name == "bnth" else "BTNH"
    shape = (lambda L, heads: (B, L, heads, H)) if layout == "BTNH" else (lambda L, heads: (B, heads, L, H))
    q, k, v = _arrays(rng, dtype, shape(T, N), shape(S, K), shape(S, K))
    kwargs: dict = {"scale": SCALE, "qkv_layout": layout}
    if name in ("causal", "bnth"):
        kwargs["mask_type"] = MaskType.CAUSAL
    if name == "bias":
        kwargs["bias"] = _arrays(rng, dtype, (1, N, T, S))[0]
    if name == "padding_causal":
        kwargs.update(q_seqlen=np.array([200, 256], np.int32), kv_seqlen=np.array([256, 130], np.int32),
                      mask_type=MaskType.PADDING_CAUSAL)
    if name == "window":
        kwargs.update(sliding_window_length=64, mask_type=MaskType.CAUSAL)
    if name == "packed":
        kwargs.update(q_seqlen=np.array([[100, 120], [256, -1]], np.int32),
                      kv_seqlen=np.array([[90, 130], [256, -1]], np.int32),
                      q_offsets=np.array([[0, 100, -1], [0, -1, -1]], np.int32),
                      kv_offsets=np.array([[0, 90, -1], [0, -1, -1]], np.int32))
    if name == "sink":
        kwargs["sink"] = rng.standard_normal((N,)).astype(np.float32)
    return (q, k, v), kwargs


def _jax(kwargs: dict) -> dict:
    return {n: jnp.asarray(x) if isinstance(x, np.ndarray) else x for n, x in kwargs.items()}


FORWARD = ["causal", "bnth", "bias", "padding_causal", "window", "packed", "sink"]


@pytest.mark.parametrize("case", FORWARD)
def test_forward_under_jit_matches_reference(case, rng):
    (q, k, v), kwargs = _case(case, rng)
    arrays = {n: x for n, x in _jax(kwargs).items() if isinstance(x, jax.Array)}
    static = {n: x for n, x in kwargs.items() if n not in arrays}
    fn = jax.jit(lambda q, k, v, a: jb.dot_product_attention(q, k, v, **a, **static, return_residual=True))
    out, lse = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), arrays)
    ref_out, ref_lse = reference.dot_product_attention(q, k, v, **kwargs, return_residual=True)
    assert_close("output", np.asarray(out), ref_out, "bfloat16")
    assert_lse_close(np.asarray(lse), ref_lse)


GRADIENTS = ["causal", "bias", "padding_causal", "sink"]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", GRADIENTS)
def test_gradients_match_reference_backward(case, dtype, rng):
    (q, k, v), kwargs = _case(case, rng, dtype)
    do = _arrays(rng, dtype, q.shape)[0]
    diff = {"query": q, "key": k, "value": v}
    for name in ("bias", "sink"):
        if name in kwargs:
            diff[name] = kwargs.pop(name)
    fixed = _jax(kwargs)
    arrays = {n: x for n, x in fixed.items() if isinstance(x, jax.Array)}
    static = {n: x for n, x in kwargs.items() if n not in arrays}

    def run(diff, arrays):
        return jb.dot_product_attention(**diff, **arrays, **static)

    out, pullback = jax.vjp(lambda d: run(d, arrays), _jax(diff))
    grads = jax.jit(pullback)(jnp.asarray(do))[0]
    call = dict(kwargs, **{n: diff[n] for n in ("bias", "sink") if n in diff})
    ref_out, ref_lse = reference.dot_product_attention(q, k, v, **call, return_residual=True)
    ref = reference.dot_product_attention_bwd(q, k, v, ref_out, do, ref_lse, **call)
    assert_close("output", np.asarray(out), ref_out, dtype)
    # dbias and dsink are sums over many bf16 products (batch, queries): twice, and for dsink three times, the
    # tolerance (FlashAttention's rule: about twice the error of a same-precision reference).
    for name, field, scale in (("query", "dq", 1), ("key", "dk", 1), ("value", "dv", 1), ("bias", "dbias", 2),
                               ("sink", "dsink", 3)):
        if name in diff:
            assert_close(field, np.asarray(grads[name]), getattr(ref, field), dtype, scale=scale)


def test_padded_rows_are_zero_in_poisoned_buffers(rng):
    """The rows cuDNN does not write must come back as 0 even in memory that held NaN.  The results are
    written into donated NaN-filled buffers (``keep_unused``: unused arguments are otherwise dropped):
    JAX aliases a donated input to the output of its shape and dtype, and the test checks that the
    results occupy exactly those buffers, so it cannot pass without looking at poisoned memory."""
    (q, k, v), kwargs = _case("padding_causal", rng)
    q, k, v = (jnp.asarray(x) for x in (q, k, v))
    arrays = _jax(kwargs)

    def attention(q, k, v):
        return jb.dot_product_attention(q, k, v, **arrays)

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v).astype(jnp.float32))

    def forward(q, k, v, poison):           # ``poison`` is donated: its buffer receives the output
        return attention(q, k, v)

    def gradients(q, k, v, *poisons):       # likewise for dq, dk, dv
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    poison = jnp.full(q.shape, jnp.nan, q.dtype)          # the output has the query's shape (H == Hv)
    address = poison.unsafe_buffer_pointer()
    out = jax.jit(forward, donate_argnums=3, keep_unused=True)(q, k, v, poison)
    assert out.unsafe_buffer_pointer() == address, "the output was not written into the NaN-filled buffer"
    poisons = [jnp.full(x.shape, jnp.nan, x.dtype) for x in (q, k, v)]
    addresses = {p.unsafe_buffer_pointer() for p in poisons}
    grads = jax.jit(gradients, donate_argnums=(3, 4, 5), keep_unused=True)(q, k, v, *poisons)
    assert {g.unsafe_buffer_pointer() for g in grads} == addresses, "dq/dk/dv are not in the NaN-filled buffers"
    out = np.asarray(out, np.float32)
    dq, dk, dv = (np.asarray(g, np.float32) for g in grads)
    assert np.all(out[0, 200:] == 0) and np.all(dq[0, 200:] == 0)
    assert np.all(dk[1, 130:] == 0) and np.all(dv[1, 130:] == 0)
    for name, x in (("output", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert np.all(np.isfinite(x)), f"{name}: {int((~np.isfinite(x)).sum())} elements not finite"


def test_vmap_and_vmap_of_grad_fold_into_one_launch(rng):
    (q, k, v), _ = _case("causal", rng)
    Q = jnp.asarray(np.stack([q, q[::-1], -q]))
    fn = lambda q: jb.dot_product_attention(q, jnp.asarray(k), jnp.asarray(v), scale=SCALE,  # noqa: E731
                                            mask_type=MaskType.CAUSAL)
    got = np.asarray(jax.jit(jax.vmap(fn))(Q))
    for i in range(3):
        ref = reference.dot_product_attention(np.asarray(Q[i]), k, v, scale=SCALE, mask_type=MaskType.CAUSAL)
        assert_close(f"instance {i}", got[i], ref, "bfloat16")
    loss = lambda q: jnp.sum(fn(q).astype(jnp.float32) ** 2)  # noqa: E731
    batched = np.asarray(jax.jit(jax.vmap(jax.grad(loss)))(Q), np.float32)
    single = np.asarray(jax.jit(jax.grad(loss))(Q[1]), np.float32)
    assert_close("vmap(grad)", batched[1], single, "bfloat16")


def test_cuda_graph_mode_is_exact_when_buffer_addresses_change(rng):
    """With ``cuda_graph=True`` XLA replays a captured graph while the addresses repeat and captures again
    when they change; every run must equal the uncaptured call."""
    (q, k, v), _ = _case("causal", rng)

    def chain(cuda_graph):
        def run(q, k, v):
            for _ in range(4):
                q = jb.dot_product_attention(q, k, v, scale=SCALE, mask_type=MaskType.CAUSAL, cuda_graph=cuda_graph)
            return q
        return jax.jit(run)

    graph, plain = chain(True), chain(False)
    inputs = [tuple(jnp.asarray(x) for x in (q, k, v)),
              tuple(jnp.asarray(x) * 0.5 for x in (q, k, v))]
    for args in inputs + inputs[::-1] + [tuple(jnp.asarray(np.asarray(x)) for x in inputs[0])]:
        expected = np.asarray(plain(*args))
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(graph(*args)), expected)


def test_jax_arrays_reach_the_cupy_api_zero_copy_and_in_order(rng):
    cp = pytest.importorskip("cupy")
    import cudnn_attn

    (q, k, v), _ = _case("causal", rng)
    jq = jax.jit(lambda x: x * 2)(jnp.asarray(q))          # still being computed when handed over
    jk, jv = jnp.asarray(k), jnp.asarray(v)
    assert cp.from_dlpack(jk).data.ptr == jk.unsafe_buffer_pointer()
    out = cudnn_attn.dot_product_attention(jq, jk, jv, scale=SCALE, mask_type=MaskType.CAUSAL)
    assert isinstance(out, jax.Array)                       # results come back in the query's framework
    ref = reference.dot_product_attention((q.astype(np.float32) * 2).astype(q.dtype), k, v, scale=SCALE,
                                          mask_type=MaskType.CAUSAL)
    assert_close("output", np.asarray(out), ref, "bfloat16")


def test_the_handler_launches_the_same_plan_as_the_public_call():
    """One call plan for both fronts: the JAX handler (captured by XLA or not) and the CuPy public call run
    the same cached plan, so their outputs are bit-identical."""
    cp = pytest.importorskip("cupy")
    import cudnn_attn
    from cudnn_attn.core.validation import validate_call
    from cudnn_attn.engine.cache import graph_cache
    from cudnn_attn.jax_bridge import cudnn_target
    from cudnn_attn.jax_bridge.call_site import AttentionCall, registry

    rng = np.random.default_rng(41)
    (q, k, v), _ = _case("causal", rng)
    args = tuple(jnp.asarray(x) for x in (q, k, v))
    want = cudnn_attn.dot_product_attention(*(cp.asarray(x) for x in (q, k, v)), scale=SCALE,
                                            mask_type=MaskType.CAUSAL)
    for cuda_graph in (True, False):
        fn = jax.jit(lambda q, k, v: jb.dot_product_attention(q, k, v, scale=SCALE, mask_type=MaskType.CAUSAL,
                                                              cuda_graph=cuda_graph))
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(fn(*args)), cp.asnumpy(want))
    config, _ = validate_call(*args, scale=SCALE, mask_type=MaskType.CAUSAL, xp=jnp)
    key = registry.key(AttentionCall(config, "fwd", 0))
    assert cudnn_target.pinned_plan(key, 0) is graph_cache.plan(config, "fwd", 0)


def test_the_handler_backward_equals_the_public_backward():
    """Forward and backward through the handler on every execution (``cuda_graph=False``) and through XLA's
    command buffers give the public CuPy calls' gradients (one plan per configuration; cuDNN accumulates dQ
    with atomics, so the gradients agree to rounding, not bit for bit: 1/8 of the bf16 tolerance)."""
    cp = pytest.importorskip("cupy")
    import cudnn_attn

    rng = np.random.default_rng(47)
    (q, k, v), _ = _case("causal", rng)
    grad = rng.standard_normal(q.shape).astype(q.dtype)
    cq, ck, cv, cgrad = (cp.asarray(x) for x in (q, k, v, grad))
    out, lse = cudnn_attn.dot_product_attention(cq, ck, cv, scale=SCALE, mask_type=MaskType.CAUSAL,
                                                return_residual=True)
    want = cudnn_attn.dot_product_attention_bwd(cq, ck, cv, out, cgrad, lse, scale=SCALE, mask_type=MaskType.CAUSAL)
    args = tuple(jnp.asarray(x) for x in (q, k, v))
    for cuda_graph in (False, True):
        def attend(q, k, v):
            return jb.dot_product_attention(q, k, v, scale=SCALE, mask_type=MaskType.CAUSAL, cuda_graph=cuda_graph)

        step = jax.jit(lambda q, k, v, g: jax.vjp(attend, q, k, v)[1](g))
        for _ in range(3):                               # repeated: the handler's per-call path, not only the first
            grads = step(*args, jnp.asarray(grad))
            for name, got in zip(("dq", "dk", "dv"), grads):
                want_name = cp.asnumpy(getattr(want, name)).astype(np.float32)
                assert_close(f"{name} cuda_graph={cuda_graph}", np.asarray(got).astype(np.float32), want_name,
                             "bfloat16", scale=0.125)


def test_repeated_eager_executions_stay_exact(rng):
    """The eager target's handler runs on every execution: every execution gives the reference's result on fresh
    inputs (a stale pointer would show)."""
    (q, k, v), kwargs = _case("causal", rng)
    step = jax.jit(lambda q, k, v: jb.dot_product_attention(q, k, v, cuda_graph=False, **kwargs))
    for i in range(6):
        q = rng.standard_normal(q.shape).astype(q.dtype)
        got = np.asarray(step(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))).astype(np.float32)
        want = reference.dot_product_attention(q, k, v, **kwargs)
        assert_close(f"execution {i}", got, np.asarray(want).astype(np.float32), "bfloat16")


@two_gpus
def test_two_gpu_eager_executions_stay_exact():
    """On two GPUs XLA runs each device's handler on a thread of its own: repeated executions of a batch-sharded
    call give the reference's result on fresh inputs."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(53)
    (q, k, v), _ = _case("causal", rng)
    mesh = jax.make_mesh((2,), ("x",), devices=_gpus()[:2])
    step = jax.jit(lambda q, k, v: jb.dot_product_attention(q, k, v, scale=SCALE, mask_type=MaskType.CAUSAL,
                                                            cuda_graph=False))
    for i in range(6):
        q = rng.standard_normal(q.shape).astype(q.dtype)
        args = tuple(jax.device_put(jnp.asarray(x), NamedSharding(mesh, P("x"))) for x in (q, k, v))
        got = np.asarray(step(*args)).astype(np.float32)
        want = reference.dot_product_attention(q, k, v, scale=SCALE, mask_type=MaskType.CAUSAL)
        assert_close(f"execution {i}", got, np.asarray(want).astype(np.float32), "bfloat16")


def test_unsupported_configuration_fails_when_lowered():
    """The support check runs when the call is lowered for the GPU, before any graph is built."""
    q = jax.ShapeDtypeStruct((1, 128, 2, 264), jnp.bfloat16)          # head dim 264 > 256 on sm90
    with pytest.raises(UnsupportedConfigurationError, match="head dim: 264 > 256"):
        jax.jit(lambda q: jb.dot_product_attention(q, q, q)).lower(q)


def test_callback_backend_runs_the_reference_on_the_host(rng):
    (q, k, v), kwargs = _case("bias", rng)
    got = jax.jit(lambda q, k, v, b: jb.dot_product_attention(q, k, v, b, scale=SCALE, backend="callback"))(
        *(jnp.asarray(x) for x in (q, k, v, kwargs["bias"])))
    np.testing.assert_array_equal(np.asarray(got), reference.dot_product_attention(q, k, v, kwargs["bias"],
                                                                                   scale=SCALE))


@two_gpus
@pytest.mark.parametrize("spec", ["batch", "heads"])
def test_two_gpu_sharding_forward_and_backward(spec, rng):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    (q, k, v), _ = _case("causal", rng)
    do = _arrays(rng, "bfloat16", q.shape)[0]
    mesh = jax.make_mesh((2,), ("x",), devices=_gpus()[:2])
    partition = P("x") if spec == "batch" else P(None, None, "x")
    put = lambda x: jax.device_put(jnp.asarray(x), NamedSharding(mesh, partition))  # noqa: E731
    fn = lambda q, k, v: jb.dot_product_attention(q, k, v, scale=SCALE, mask_type=MaskType.CAUSAL)  # noqa: E731

    def train(q, k, v, do):
        out, pullback = jax.vjp(fn, q, k, v)
        return (out,) + pullback(do)

    single = [np.asarray(x) for x in jax.jit(train)(*(jnp.asarray(x) for x in (q, k, v, do)))]
    sharded = jax.jit(train)(*(put(x) for x in (q, k, v, do)))
    for name, got, want in zip(("output", "dq", "dk", "dv"), sharded, single):
        assert got.sharding.is_equivalent_to(NamedSharding(mesh, partition), got.ndim), (name, got.sharding)
        assert_close(name, np.asarray(got), want, "bfloat16", scale=0.1)
    text = jax.jit(train).lower(*(put(x) for x in (q, k, v, do))).compile().as_text()
    assert "all-gather" not in text

    local = jax.shard_map(train, mesh=mesh, in_specs=(partition,) * 4, out_specs=(partition,) * 4)
    for name, got, want in zip(("output", "dq", "dk", "dv"), jax.jit(local)(*(put(x) for x in (q, k, v, do))),
                               single):
        assert_close(f"shard_map {name}", np.asarray(got), want, "bfloat16", scale=0.1)


@pytest.mark.parametrize("cuda_graph", [True, False])
def test_executables_hold_the_handlers_plans_until_they_die(cuda_graph, monkeypatch):
    """XLA runs the targets' instantiate stage (with command buffers or without), so a
    live executable pins its plan; once it is destroyed and the site is not among the recent lowerings, the
    plan the handler ran is dropped - the graph cache's bound holds on the JAX side."""
    import gc

    from cudnn_attn.jax_bridge import cudnn_target, ffi
    from cudnn_attn.jax_bridge.call_site import registry

    assert cudnn_target.plan_holds.releasing, "the CUDA targets are registered with their instantiate stage"
    rng = np.random.default_rng(83)
    (q, k, v), _ = _case("causal", rng)
    args = tuple(jnp.asarray(x) for x in (q, k, v))
    scale = 0.0917 if cuda_graph else 0.0919                     # sites no other test lowers
    fn = jax.jit(lambda q, k, v: jb.dot_product_attention(q, k, v, scale=scale, cuda_graph=cuda_graph))
    out = np.asarray(fn(*args))
    assert_close("output", out, reference.dot_product_attention(q, k, v, scale=scale), "bfloat16")
    key = next(key for key, call in registry._calls.items() if call.config.scale == scale)
    assert cudnn_target.plan_holds.pins[key] >= 1 and (key, 0) in cudnn_target._launches
    monkeypatch.setattr(cudnn_target.plan_holds, "_recent_size", lambda: 1)
    other = jax.jit(lambda q, k, v: jb.dot_product_attention(q, k, v, scale=0.5))
    np.asarray(other(*args))                                    # another lowering: the site leaves the recent one
    assert (key, 0) in cudnn_target._launches, "a live executable keeps its plan"
    np.testing.assert_array_equal(np.asarray(fn(*args)), out)
    del fn
    jax.clear_caches()
    gc.collect()
    assert ffi.release_destroyed_states() >= 1, "XLA posted the state of the destroyed executable"
    assert cudnn_target.plan_holds.pins[key] == 0
    assert (key, 0) not in cudnn_target._launches, "the executable died: its plan is released"
    assert cudnn_target.plan_holds.releasing, "no execution ran without its instantiate stage"
