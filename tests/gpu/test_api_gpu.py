"""The public API on the GPU: seed-compatible forms, DLPack inputs (torch, JAX), streams, the graph
cache, autotuning, both execute paths, paged attention and the errors raised before GPU work."""

from __future__ import annotations

import numpy as np
import pytest

import cudnn_attn
from cudnn_attn import MaskType, UnsupportedConfigurationError, reference
from cudnn_attn.core.validation import validate_call
from cudnn_attn.engine import call_steps, launch, prepared
from cudnn_attn.engine.cache import PlanChoice, graph_cache
from cudnn_attn.reference.inputs import random_operands

from ._checks import assert_close, assert_lse_close, make_config, poisoned, raw_launch, replace_nan, to_gpu

cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu


def _qkv(rng, dtype, B=2, T=128, S=128, N=4, K=4, H=64):
    from ._checks import io_dtype

    dt = io_dtype(dtype)
    return (rng.standard_normal((B, T, N, H)).astype(dt), rng.standard_normal((B, S, K, H)).astype(dt),
            rng.standard_normal((B, S, K, H)).astype(dt))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_seed_forms_and_boolean_mask(dtype, rng):
    """``dot_product_attention`` returns ``output`` or ``(output, logsumexp)``; a boolean mask is folded
    into the bias and gets no dbias."""
    q, k, v = _qkv(rng, dtype)
    mask = rng.random((2, 1, 128, 128)) < 0.8
    mask[..., 0] = True                                  # every query keeps a key
    kwargs = dict(mask_type=MaskType.CAUSAL, scale=0.125)
    gq, gk, gv, gmask = (cp.asarray(x) for x in (q, k, v, mask))
    only = cudnn_attn.dot_product_attention(gq, gk, gv, mask=gmask, **kwargs)
    output, lse = cudnn_attn.dot_product_attention(gq, gk, gv, mask=gmask, return_residual=True, **kwargs)
    assert isinstance(only, cp.ndarray) and cp.array_equal(only, output)
    ref_out, ref_lse = reference.dot_product_attention(q, k, v, mask=mask, return_residual=True, **kwargs)
    assert_close("output", output, ref_out, dtype)
    assert_lse_close(lse, ref_lse)
    grad = rng.standard_normal(q.shape).astype(q.dtype)
    grads = cudnn_attn.dot_product_attention_bwd(gq, gk, gv, output, cp.asarray(grad), lse, mask=gmask, **kwargs)
    ref_grads = reference.dot_product_attention_bwd(q, k, v, ref_out, grad, ref_lse, mask=mask, **kwargs)
    assert grads.dbias is None and ref_grads.dbias is None
    for name in ("dq", "dk", "dv"):
        assert_close(name, getattr(grads, name), getattr(ref_grads, name), dtype)


def test_bias_gradient_through_the_public_api(rng):
    q, k, v = _qkv(rng, "float16")
    bias = rng.standard_normal((1, 4, 128, 128)).astype(np.float16)
    g = [cp.asarray(x) for x in (q, k, v, bias)]
    output, lse = cudnn_attn.dot_product_attention(g[0], g[1], g[2], g[3], return_residual=True)
    grad = rng.standard_normal(q.shape).astype(np.float16)
    grads = cudnn_attn.dot_product_attention_bwd(g[0], g[1], g[2], output, cp.asarray(grad), lse, g[3])
    ref_out, ref_lse = reference.dot_product_attention(q, k, v, bias, return_residual=True)
    ref = reference.dot_product_attention_bwd(q, k, v, ref_out, grad, ref_lse, bias)
    assert grads.dbias.shape == bias.shape
    assert_close("dbias", grads.dbias, ref.dbias, "float16")


def test_torch_tensors_zero_copy(rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    q, k, v = _qkv(rng, "bfloat16")
    tq, tk, tv = (torch.from_dlpack(cp.asarray(x)) for x in (q, k, v))
    assert tq.dtype == torch.bfloat16
    out = cudnn_attn.dot_product_attention(tq, tk, tv, mask_type=MaskType.CAUSAL)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16       # back in the caller's framework
    out = cp.from_dlpack(out)
    assert out.dtype == q.dtype
    same = cudnn_attn.dot_product_attention(cp.from_dlpack(tq), cp.from_dlpack(tk), cp.from_dlpack(tv),
                                            mask_type=MaskType.CAUSAL)
    assert cp.array_equal(out, same)
    assert torch.from_dlpack(out).dtype == torch.bfloat16
    assert_close("output", out, reference.dot_product_attention(q, k, v, mask_type=MaskType.CAUSAL), "bfloat16")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        on_stream = cudnn_attn.dot_product_attention(tq, tk, tv, mask_type=MaskType.CAUSAL, stream=stream)
    stream.synchronize()
    assert isinstance(on_stream, torch.Tensor) and cp.array_equal(cp.from_dlpack(on_stream), out)


def test_jax_arrays_zero_copy(rng):
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX without a GPU backend")
    import jax.numpy as jnp

    q, k, v = _qkv(rng, "bfloat16")
    jq, jk, jv = (jnp.asarray(x) for x in (q, k, v))
    out = cudnn_attn.dot_product_attention(jq, jk, jv, scale=0.125)
    assert isinstance(out, jax.Array)                              # back in the caller's framework
    assert_close("output", np.asarray(out), reference.dot_product_attention(q, k, v, scale=0.125), "bfloat16")
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    as_cupy = cudnn_attn.dot_product_attention(jq, jk, jv, scale=0.125, out_type="cupy")
    assert isinstance(as_cupy, cp.ndarray) and cp.array_equal(as_cupy, cp.from_dlpack(out))


def test_explicit_stream_orders_the_work(rng):
    q, k, v = (cp.asarray(x) for x in _qkv(rng, "float16"))
    expected = cudnn_attn.dot_product_attention(q, k, v)
    stream = cp.cuda.Stream(non_blocking=True)
    for given in (stream, stream.ptr):
        out = cudnn_attn.dot_product_attention(q, k, v, stream=given)
        stream.synchronize()
        assert cp.array_equal(out, expected)
    with stream:                                         # the current CuPy stream is the default
        out = cudnn_attn.dot_product_attention(q, k, v)
    stream.synchronize()
    assert cp.array_equal(out, expected)


def test_non_contiguous_inputs_give_the_dense_result(rng):
    q, k, v = _qkv(rng, "float16")
    wide = cp.asarray(np.concatenate([q, q], axis=-1))
    view = wide[..., :64]
    assert not view.flags.c_contiguous
    out = cudnn_attn.dot_product_attention(view, cp.asarray(k), cp.asarray(v))
    assert_close("output", out, reference.dot_product_attention(q, k, v), "float16")


def test_cache_hits_listing_and_dump(rng):
    config = make_config(T=192, S=192, mask_type=MaskType.CAUSAL)
    gpu = to_gpu(random_operands(config, rng, poison=False))
    prepared.forward(config, gpu)
    before = graph_cache.stats()
    for _ in range(3):
        prepared.forward(config, gpu)
    after = graph_cache.stats()
    assert (after.hits - before.hits, after.misses - before.misses) == (3, 0)
    rows = [r for r in graph_cache.entries() if r.features.startswith(config.describe())]
    assert rows and rows[0].hits >= 3 and rows[0].build_seconds > 0
    text = graph_cache.dump(rows[0].index)
    assert "sdpa" in text.lower() or "attention" in text.lower()
    assert "<table>" in graph_cache.entries()._repr_html_()


@pytest.mark.parametrize("path", [launch.FAST, launch.FRONTEND])
def test_both_execute_paths_give_identical_results(path, monkeypatch, rng):
    config = make_config(dropout_rate=0.2, mask_type=MaskType.PADDING_CAUSAL, T=160, S=160)
    gpu = to_gpu(random_operands(config, rng, poison=False))
    reference_run = prepared.forward(config, gpu, seed=5)
    plan = graph_cache.plan(config, "fwd", gpu.query.device.id)
    assert plan.launcher.path == launch.FAST
    monkeypatch.setattr(plan, "launcher", launch.Launcher(plan.built, plan.launcher.ids, path=path))
    again = prepared.forward(config, gpu, seed=5)
    assert plan.launcher.path == path
    assert cp.array_equal(again.output, reference_run.output)
    assert cp.array_equal(again.logsumexp, reference_run.logsumexp)


def test_autotune_keeps_a_timed_plan(rng):
    config = make_config(T=256, S=256, mask_type=MaskType.CAUSAL, dtype="bfloat16")
    operands = random_operands(config, rng, poison=False)
    result = prepared.forward(config, to_gpu(operands), autotune=True,
                               output=poisoned(config.o_shape, operands.query.dtype))
    key = graph_cache.key(config, "fwd", 0, plan=PlanChoice.AUTOTUNED)
    assert key in graph_cache
    assert_close("output", result.output, reference.forward(config, operands).output, "bfloat16")


def test_paged_attention_ignores_unused_blocks(rng):
    """Decode (T=1) and prefill over shuffled page tables with padding; unused cache blocks and the
    cache past ``kv_seqlen`` hold garbage (a large constant: cuDNN's prefill kernel reads the tail of
    a used block and masks it, so NaN there would propagate - measured on the H200, cuDNN 9.19)."""
    for T in (1, 64):
        B, N, H, bs, per_seq = 2, 4, 64, 32, 4
        qf = np.empty((B, T, N, H), np.float16)
        cache = np.empty((B * per_seq + 3, bs, N, H), np.float16)
        table = np.empty((B, 1, per_seq, 1), np.int32)
        seqlen = np.empty((B,), np.int32)
        config, _ = validate_call(qf, cache, cache, None, None, seqlen, seqlen, None, None, table, table,
                                  mask_type=MaskType.PADDING, xp=np)
        operands = random_operands(config, rng, poison=True)
        operands = operands.replace(key=replace_nan(operands.key, 8.0), value=replace_nan(operands.value, 8.0))
        g = to_gpu(operands)
        out = cudnn_attn.paged_attention(g.query, g.key, g.value, g.q_seqlen, g.kv_seqlen, g.page_table_k,
                                         g.page_table_v, mask_type=MaskType.PADDING)
        assert_close(f"output T={T}", out, reference.forward(config, operands).output, "float16")


def test_unsupported_configuration_fails_before_building(rng):
    """A head dim of 264 (sm90 runs at most 256): the support table refuses it before any graph is built."""
    q, k, v = (cp.asarray(rng.standard_normal((2, 64, 4, 264)).astype(np.float16)) for _ in range(3))
    before = graph_cache.stats()
    with pytest.raises(UnsupportedConfigurationError) as raised:
        cudnn_attn.dot_product_attention(q, k, v, mask_type=MaskType.CAUSAL)
    assert raised.value.reasons
    after = graph_cache.stats()
    assert after.entries == before.entries and after.build_seconds == before.build_seconds


def test_invalid_input_is_a_value_error_naming_the_argument(rng):
    q, k, v = (cp.asarray(x) for x in _qkv(rng, "float16"))
    with pytest.raises(ValueError, match="key"):
        cudnn_attn.dot_product_attention(q, k[:, :, :, :32], v)
    with pytest.raises(ValueError, match="q_seqlen: expected a GPU array"):
        cudnn_attn.dot_product_attention(q, k, v, q_seqlen=np.full((2,), 64, np.int32),
                                         kv_seqlen=cp.full((2,), 64, np.int32), mask_type=MaskType.PADDING)


@pytest.mark.parametrize("case", ["padding", "packed"])
def test_fill_policy_matches_what_cudnn_writes(case):
    """cuDNN on this GPU is the truth behind the plan's one zero-fill policy (``cudnn_attn.engine.plan``): launched
    raw (no fills) into NaN-poisoned results, the elements a ``ZERO_BEFORE`` result leaves to the policy
    (rows of padded queries/keys, tokens outside packed segments) must be untouched (still NaN) or 0 -
    zeroing them before the launch is then right - while every other element is written."""
    from cudnn_attn.engine.call import Fill
    from cudnn_attn.reference.segments import segments_of

    rng = np.random.default_rng(21)
    config = make_config(T=160, S=192, segments=2 if case == "packed" else None,
                         mask_type=MaskType.PADDING_CAUSAL if case == "padding" else MaskType.NO_MASK)
    operands = random_operands(config, rng, poison=False)
    valid = segments_of(config, operands)
    gpu = to_gpu(operands)
    forward = prepared.forward(config, gpu)
    output, lse = forward.output, forward.logsumexp
    grad_output = cp.asarray(rng.standard_normal(config.o_shape).astype(np.float16))
    for kind, residuals in (("fwd", {}), ("bwd", dict(output=output, grad_output=grad_output, logsumexp=lse))):
        for spec, result in raw_launch(config, kind, call_steps.named_operands(config, kind, gpu, residuals or None)):
            if spec.fill is not Fill.ZERO_BEFORE or spec.name not in ("output", "dq", "dk", "dv"):
                continue
            host = cp.asnumpy(result).astype(np.float32)                          # BTNH: (B, L, heads, dim)
            tokens = valid.valid_q if spec.name in ("output", "dq") else valid.valid_kv
            outside, inside = host[~tokens], host[tokens]
            assert np.all(np.isnan(outside) | (outside == 0)), \
                f"{kind} {spec.name}: cuDNN wrote {np.sum(np.isfinite(outside) & (outside != 0))} nonzero values " \
                f"outside the sequences; zeroing before the launch would be wrong"
            assert np.isfinite(inside).all(), f"{kind} {spec.name}: cuDNN left elements inside the sequences unwritten"


def test_direct_path_and_bound_call_equal_the_public_call():
    """The per-signature direct path (a repeated Q/K/V call) and ``cudnn_attn.bind`` launch the same plan
    as the first, fully validated call: bit-identical results, forward and backward."""
    rng = np.random.default_rng(31)
    q, k, v = (cp.asarray(x) for x in _qkv(rng, "bfloat16", T=192, S=256, K=2))
    grad = cp.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    kwargs = dict(scale=0.125, mask_type=MaskType.CAUSAL)
    first, lse = cudnn_attn.dot_product_attention(q, k, v, return_residual=True, **kwargs)
    again, lse_again = cudnn_attn.dot_product_attention(q, k, v, return_residual=True, **kwargs)   # direct path
    bound = cudnn_attn.bind(q, k, v, return_residual=True, **kwargs)
    bound_out, bound_lse = bound(q, k, v)
    for x in (again, bound_out):
        assert cp.array_equal(x, first)
    assert cp.array_equal(lse_again, lse) and cp.array_equal(bound_lse, lse)
    want = cudnn_attn.dot_product_attention_bwd(q, k, v, first, grad, lse, **kwargs)
    direct = cudnn_attn.dot_product_attention_bwd(q, k, v, first, grad, lse, **kwargs)
    via_bound = bound.backward(q, k, v, first, grad, lse)
    for got in (direct, via_bound):
        for name in ("dq", "dk", "dv"):
            assert cp.array_equal(getattr(got, name), getattr(want, name)), name
    ref = reference.dot_product_attention(*(cp.asnumpy(x) for x in (q, k, v)), **kwargs)
    assert_close("output", bound_out, ref, "bfloat16")
    with pytest.raises(ValueError, match="key: this bound call takes"):
        bound(q, k[:, :128], v)
    with pytest.raises(ValueError, match="query: this bound call takes"):
        bound(q.astype(cp.float16), k, v)


def test_bound_call_with_autotune_runs_a_timed_plan():
    """``bind(..., autotune=True)`` times the plans once and its calls run the winner: the output matches the
    reference (a different plan may round differently from the heuristic's, so not bit-identical)."""
    rng = np.random.default_rng(43)
    q, k, v = (cp.asarray(x) for x in _qkv(rng, "bfloat16", T=128, S=128))
    bound = cudnn_attn.bind(q, k, v, scale=0.125, mask_type=MaskType.CAUSAL, autotune=True)
    ref = reference.dot_product_attention(*(cp.asnumpy(x) for x in (q, k, v)), scale=0.125,
                                          mask_type=MaskType.CAUSAL)
    assert_close("output", bound(q, k, v), ref, "bfloat16")
    assert graph_cache.key(bound.config, "fwd", 0, plan=PlanChoice.AUTOTUNED) in graph_cache


def test_direct_path_results_of_one_allocation_are_independent_arrays():
    """The direct path allocates the backward's dq, dk, dv (and the training forward's output and logsumexp)
    as 256-byte-aligned views of one pool allocation: each is its own C-contiguous array, writing one leaves
    the others intact, and the values equal the fully validated call's."""
    rng = np.random.default_rng(37)
    q, k, v = (cp.asarray(x) for x in _qkv(rng, "bfloat16", T=128, S=192, K=2))
    grad = cp.asarray(rng.standard_normal(q.shape).astype(q.dtype))
    o, lse = cudnn_attn.dot_product_attention(q, k, v, scale=0.125, return_residual=True)
    o2, lse2 = cudnn_attn.dot_product_attention(q, k, v, scale=0.125, return_residual=True)     # direct path
    assert cp.array_equal(o2, o) and cp.array_equal(lse2, lse)
    want = cudnn_attn.dot_product_attention_bwd(q, k, v, o, grad, lse, scale=0.125)
    got = cudnn_attn.dot_product_attention_bwd(q, k, v, o, grad, lse, scale=0.125)              # direct path
    arrays = (got.dq, got.dk, got.dv, o2, lse2)
    for x in arrays:
        assert x.flags.c_contiguous and x.data.ptr % 256 == 0
    spans = sorted((x.data.ptr, x.data.ptr + x.nbytes) for x in arrays[:3])
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "dq, dk, dv overlap"
    kept = [cp.array(x) for x in (got.dk, got.dv)]
    got.dq.fill(0)
    assert cp.array_equal(got.dk, kept[0]) and cp.array_equal(got.dv, kept[1])
    assert cp.array_equal(got.dk, want.dk) and cp.array_equal(got.dv, want.dv)


@pytest.mark.parametrize("framework", ["torch", "jax", "cupy"])
def test_results_come_back_in_the_callers_framework(framework):
    """torch tensors in -> torch tensors out, JAX arrays in -> JAX arrays out (zero-copy through DLPack);
    ``out_type="cupy"`` keeps CuPy arrays.  Values equal the CuPy call's."""
    rng = np.random.default_rng(32)
    q, k, v = (cp.asarray(x) for x in _qkv(rng, "float16"))
    want, want_lse = cudnn_attn.dot_product_attention(q, k, v, scale=0.125, return_residual=True)
    if framework == "torch":
        torch = pytest.importorskip("torch")
        args = [torch.from_dlpack(x) for x in (q, k, v)]
        kind = torch.Tensor
    elif framework == "jax":
        jax = pytest.importorskip("jax")
        args = [jax.dlpack.from_dlpack(x) for x in (q, k, v)]
        kind = jax.Array
    else:
        args, kind = [q, k, v], cp.ndarray
    out, lse = cudnn_attn.dot_product_attention(*args, scale=0.125, return_residual=True)
    assert isinstance(out, kind) and isinstance(lse, kind)
    assert cp.array_equal(cp.from_dlpack(out), want) and cp.array_equal(cp.from_dlpack(lse), want_lse)
    forced = cudnn_attn.dot_product_attention(*args, scale=0.125, out_type="cupy")
    assert isinstance(forced, cp.ndarray) and cp.array_equal(forced, want)
    grads = cudnn_attn.dot_product_attention_bwd(*args, out, out, lse, scale=0.125)
    assert isinstance(grads.dq, kind) and isinstance(grads, cudnn_attn.AttentionGrads)


def _gpu_count() -> int:
    try:
        return cp.cuda.runtime.getDeviceCount()
    except cp.cuda.runtime.CUDARuntimeError:       # no driver (CI collects this module too)
        return 0


@pytest.mark.skipif(_gpu_count() < 2, reason="needs 2 GPUs (the 2-GPU H200 machine)")
def test_a_key_on_another_gpu_never_takes_a_remembered_signature():
    """The direct path and a bound call compare the device of every array, not only the query's: a K of the
    remembered shapes on GPU 1 is refused with a ValueError naming it, before any launch."""
    rng = np.random.default_rng(83)
    q, k, v = (cp.asarray(x) for x in _qkv(rng, "bfloat16", T=128, S=128))
    with cp.cuda.Device(1):
        k1 = cp.asarray(k.get())
    for _ in range(2):                                   # the second call takes the direct path
        cudnn_attn.dot_product_attention(q, k, v, scale=0.125)
    with pytest.raises(ValueError, match="key"):
        cudnn_attn.dot_product_attention(q, k1, v, scale=0.125)
    bound = cudnn_attn.bind(q, k, v, scale=0.125)
    with pytest.raises(ValueError, match="key: this bound call takes"):
        bound(q, k1, v)


def test_a_launch_from_a_thread_with_no_cuda_context():
    """XLA calls the handler on threads that have no CUDA context current, where ``cudnnSetStream``'s driver
    queries fail (``cudnn_attn.engine.runtime``, "A thread with no CUDA context"; two soaks died inside it).  A
    launch from a new thread, on a stream of its own, computes what the same plan computes here, and leaves
    the thread without a context, as it found it."""
    import threading

    from cudnn_attn.engine.call import CallSpec

    rng = np.random.default_rng(43)
    config = make_config(T=128, S=192, mask_type=MaskType.CAUSAL)
    gpu = to_gpu(random_operands(config, rng, poison=False))
    expected = prepared.forward(config, gpu).output
    plan = graph_cache.plan(config, "fwd", 0)
    inputs, _ = CallSpec.of(config, "fwd").bind(cp, call_steps.named_operands(config, "fwd", gpu))
    inputs = {t: cp.ascontiguousarray(x) for t, x in inputs.items()}
    results = [poisoned(spec.shape, spec.dtype) for spec in plan.results]
    workspace = cp.empty(max(plan.workspace_size, 1), cp.uint8)
    stream = cp.cuda.Stream(non_blocking=True)
    cp.cuda.get_current_stream().synchronize()
    pointers = [inputs[t].data.ptr for t in plan.operand_ids] + [r.data.ptr for r in results]
    seen, errors = {}, []

    def launch_from_a_new_thread():
        try:
            seen["before"] = cp.cuda.driver.ctxGetCurrent()
            plan.launch(pointers, stream.ptr, workspace.data.ptr)
            seen["after"] = cp.cuda.driver.ctxGetCurrent()
        except Exception as error:      # noqa: BLE001 -- re-raised below, in the test's thread
            errors.append(error)

    thread = threading.Thread(target=launch_from_a_new_thread)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    stream.synchronize()
    assert seen == {"before": 0, "after": 0}, f"the new thread's CUDA context before and after the launch: {seen}"
    output = next(r for spec, r in zip(plan.results, results) if spec.name == "output")
    assert cp.array_equal(output, expected), "the launch from a thread without a context computed another output"
