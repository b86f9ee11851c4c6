"""The torch front on the GPU (:mod:`cudnn_attn.torch`): outputs and gradients against torch's math SDPA in fp16
and bf16 (GQA, causal top-left and bottom-right, padding, a keep-mask, both layouts, strided views), torch's
current stream, ``torch.compile(fullgraph=True)`` forward and backward, dropout, and transformers' Llama
(``generate`` with the dynamic and the static cache, greedy, a left-padded batch) against sdpa.

The reference is ``torch.nn.functional.scaled_dot_product_attention`` under ``sdpa_kernel(SDPBackend.MATH)`` in
float32 on the same io-dtype inputs, compared by relative Frobenius error with the GPU tier's bounds
(``_checks.RELATIVE_TOLERANCE``: 2e-3 fp16, 1e-2 bf16).  The operators allocate their results (from torch's
caching allocator, on both paths), so instead of NaN-filled output buffers the allocators' free memory is filled
with NaN before each call (:func:`_poison_pool`): a row cuDNN left unwritten reads back as NaN and fails the
finiteness check.
"""

from __future__ import annotations

import faulthandler
import math

import ml_dtypes
import numpy as np
import pytest

from cudnn_attn import reference

from ._checks import assert_close

torch = pytest.importorskip("torch")
cp = pytest.importorskip("cupy")
pytestmark = pytest.mark.gpu

import cudnn_attn.torch as ct
from cudnn_attn import causal, keep, padding

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
WATCHDOG_S = 600


def _poison_pool(nbytes: int = 64 << 20) -> None:
    """Fill ``nbytes`` of CuPy's pool and of torch's caching allocator (its large blocks, and eight of its
    small ones) with NaN and give them back: the next results come from NaN memory, whichever allocator makes
    them (the direct launch takes torch's, the CuPy front CuPy's)."""
    block = cp.full(nbytes // 2, np.nan, dtype=cp.float16)
    cp.cuda.get_current_stream().synchronize()
    del block
    blocks = [torch.full((n,), float("nan"), dtype=torch.float16, device="cuda")
              for n in (nbytes // 2,) + (256 << 10,) * 8]
    del blocks


def _random(rng, shape, dtype, device="cuda"):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(device=device, dtype=dtype)


def _qkv(rng, dtype, B=2, T=256, S=256, N=16, K=4, H=64, layout="BTNH"):
    shapes = [(B, T, N, H), (B, S, K, H), (B, S, K, H)]
    if layout == "BNTH":
        shapes = [(b, n, t, h) for b, t, n, h in shapes]
    return tuple(_random(rng, shape, dtype).requires_grad_() for shape in shapes)


def _math_sdpa(q, k, v, keep_mask=None, *, is_causal=False, layout="BTNH", q_lengths=None):
    """Float32 math SDPA of BTNH/BNTH tensors (GQA through ``enable_gqa``); rows past ``q_lengths`` zeroed."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    to_bnth = (lambda x: x.transpose(1, 2)) if layout == "BTNH" else (lambda x: x)
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            *(to_bnth(x).float() for x in (q, k, v)), attn_mask=keep_mask, is_causal=is_causal, enable_gqa=True)
    if q_lengths is not None:
        rows = torch.arange(out.shape[2], device=out.device)[None, None, :, None] < q_lengths[:, None, None, None]
        out = out * rows
    return to_bnth(out)


def _host(x):
    return x.detach().float().cpu().numpy()


def _compare(out, ref, inputs, rng, dtype_name, grad_mask=None):
    """Output and (dq, dk, dv) against the reference's, for a seeded random output gradient."""
    assert_close("output", _host(out), _host(ref), dtype_name)
    grad = _random(rng, out.shape, out.dtype)
    if grad_mask is not None:
        grad = grad * grad_mask
    _poison_pool()
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(ref, inputs, grad.float())
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and g.dtype == out.dtype, name
        assert_close(name, _host(g), _host(w), dtype_name)


@pytest.mark.parametrize("layout", ["BTNH", "BNTH"])
@pytest.mark.parametrize("masked", ["none", "causal", "bottom_right", "padding", "keep"])
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_outputs_and_grads_against_math_sdpa(rng, dtype_name, masked, layout):
    dtype = DTYPES[dtype_name]
    T, S = (128, 256) if masked == "bottom_right" else (256, 256)
    q, k, v = _qkv(rng, dtype, T=T, S=S, layout=layout)
    seq = 1 if layout == "BTNH" else 2
    keep_mask = q_lengths = None
    if masked == "none":
        mask = None
    elif masked == "causal":
        mask = causal()
    elif masked == "bottom_right":
        mask = causal("bottom_right")
        keep_mask = torch.ones(T, S, dtype=torch.bool, device="cuda").tril(S - T)
    elif masked == "padding":
        q_lengths = torch.tensor([T, T - 37], dtype=torch.int32, device="cuda")
        kv_lengths = torch.tensor([S - 11, S], dtype=torch.int32, device="cuda")
        mask = causal() & padding(q_lengths, kv_lengths)
        keys = torch.arange(S, device="cuda")[None, None, None, :] < kv_lengths[:, None, None, None]
        keep_mask = keys & torch.ones(T, S, dtype=torch.bool, device="cuda").tril()
    else:
        keep_mask = torch.from_numpy(rng.random((2, 1, T, S)) < 0.7).cuda()
        keep_mask[..., 0] = True                                          # every query keeps a key
        mask = keep(keep_mask)
    _poison_pool()
    out = ct.attention(q, k, v, mask=mask, layout=layout).output
    assert out.shape == q.shape and out.device == q.device
    ref = _math_sdpa(q, k, v, keep_mask, is_causal=masked == "causal", layout=layout, q_lengths=q_lengths)
    grad_mask = None
    if q_lengths is not None:       # queries past their length have no output, so no gradient flows from them
        rows = torch.arange(T, device="cuda")[None, :] < q_lengths[:, None]
        grad_mask = (rows[:, :, None, None] if seq == 1 else rows[:, None, :, None]).to(dtype)
    _compare(out, ref, (q, k, v), rng, dtype_name, grad_mask)


def test_strided_views_as_transformers_passes_them(rng):
    """Query a BNTH view of dense BTNH memory, key a dense BNTH cache, value dense in neither layout."""
    q, k, v = _qkv(rng, torch.bfloat16)
    dense = ct.attention(q, k, v, mask=causal()).output
    q_view = q.detach().transpose(1, 2).requires_grad_()
    k_cache = k.detach().transpose(1, 2).contiguous().requires_grad_()
    v_strided = torch.cat([v.detach(), v.detach()], dim=-1)[..., :64].transpose(1, 2).requires_grad_()
    out = ct.attention(q_view, k_cache, v_strided, mask=causal(), layout="BNTH").output
    assert_close("output", _host(out.transpose(1, 2)), _host(dense), "bfloat16")
    ref = _math_sdpa(q_view, k_cache, v_strided, is_causal=True, layout="BNTH")
    _compare(out, ref, (q_view, k_cache, v_strided), rng, "bfloat16")


def test_runs_on_torch_current_stream(rng):
    """On a side stream, with the inputs written there just before: the call must see them and finish there."""
    q, k, v = (x.detach() for x in _qkv(rng, torch.float16))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        busy = torch.ones(4096, 4096, device="cuda", dtype=torch.float16)
        for _ in range(8):                                               # the side stream busy for a while
            busy = (busy @ busy).clamp_(-1, 1)
        q3 = (q * 2.0 + busy[0, 0] * 0) * 0.5                            # written on the side stream, after it
        keep_mask = torch.ones(256, 256, dtype=torch.bool, device="cuda").tril() & (busy[0, 0] > -2)
        out = ct.attention(q3, k, v, mask=keep(keep_mask)).output           # the mask is folded on the stream
        again = out.clone()
        direct = ct.attention(q3, k, v, mask=causal()).output.clone()       # the direct launch, same stream
    side.synchronize()
    assert_close("output", _host(again), _host(_math_sdpa(q, k, v, is_causal=True)), "float16")
    assert_close("output (direct launch)", _host(direct), _host(_math_sdpa(q, k, v, is_causal=True)), "float16")


def test_dense_calls_launch_directly_into_torch_memory_through_a_growing_cache(rng, monkeypatch):
    """Decoding through a growing cache (one query against one more key each call, transformers' BNTH tensors),
    a left-padded batch under a keep-mask (bfloat16 inference: cuDNN's own mean of V on a row that keeps no key),
    then a repeated training call: every call is a direct launch - the CuPy front never runs, no CUDA graph is
    captured - into tensors of torch's allocator, equal to the math SDPA (the NumPy reference with the row keeping
    no key), and so are the gradients."""
    from cudnn_attn.engine import replay
    from cudnn_attn.fronts import cupy as cupy_front
    from cudnn_attn.torch import ops

    def refuse(*args, **kwargs):
        raise AssertionError("a dense call ran the CuPy front instead of the direct launch")

    monkeypatch.setattr(cupy_front, "run_forward", refuse)
    monkeypatch.setattr(cupy_front, "run_backward", refuse)
    cache_k, cache_v = (_random(rng, (4, 4, 140, 64), torch.bfloat16) for _ in range(2))
    before = len(ops.calls)
    for length in (128, 129, 130, 131, 129):
        q = _random(rng, (4, 16, 1, 64), torch.bfloat16)
        k, v = cache_k[:, :, :length].contiguous(), cache_v[:, :, :length].contiguous()
        out = lse = None                                     # the last step's output freed before counting
        _poison_pool()
        allocated = torch.cuda.memory_allocated()
        out, lse = ct.sdpa(q, k, v, layout="BNTH")
        assert torch.cuda.memory_allocated() > allocated and lse.numel() == 0
        assert_close(f"output (S={length})", _host(out), _host(_math_sdpa(q, k, v, layout="BNTH")), "bfloat16")
    assert len(ops.calls) == before + 4                    # one entry per new signature, S = 129 found again
    for length in (140, 141):                                # a left-padded batch, its last row keeping no key
        q = _random(rng, (4, 16, 1, 64), torch.bfloat16)
        k, v = (_random(rng, (4, 4, length, 64), torch.bfloat16) for _ in range(2))
        pads = torch.tensor([0, 3, 7, length], device="cuda")
        mask = (torch.arange(length, device="cuda")[None, :] >= pads[:, None]).view(4, 1, 1, length)
        _poison_pool()
        out, _ = ct.sdpa(q, k, v, keep=mask, scale=0.125, layout="BNTH")
        bf16 = lambda x: _host(x).astype(ml_dtypes.bfloat16)               # noqa: E731 - exact: bf16 values
        want = reference.dot_product_attention(bf16(q), bf16(k), bf16(v), mask=_host(mask).astype(bool),
                                               scale=0.125, qkv_layout="BNTH")
        assert_close(f"output, keep-mask (S={length})", _host(out), want, "bfloat16")
        assert_close("the row keeping no key: the mean of V", _host(out)[3], want[3], "bfloat16")
    assert len(ops.calls) == before + 6
    made = replay.churn().made
    q, k, v = (_random(rng, (4, 16, 1, 64), torch.bfloat16) for _ in range(3))
    for _ in range(4):                                       # the same addresses again and again: no capture
        ct.sdpa(q, k, v, layout="BNTH")
    assert replay.churn().made == made
    for _ in range(2):                                       # the second call repeats the first's signatures
        q, k, v = _qkv(rng, torch.float16, T=192, S=320)
        _poison_pool()
        out = ct.attention(q, k, v, mask=causal("bottom_right")).output
        keep_mask = torch.ones(192, 320, dtype=torch.bool, device="cuda").tril(320 - 192)
        _compare(out, _math_sdpa(q, k, v, keep_mask), (q, k, v), rng, "float16")


def test_strided_views_launch_directly_and_a_misaligned_view_takes_the_general_path(rng, monkeypatch):
    """transformers' training call - a BNTH view of a BTNH query, with the dense BNTH key and value its cache
    concatenated - runs in the query's layout as a direct launch that reads key and value with their strides,
    forward and backward (the CuPy front never runs), and matches the math SDPA.  A query view of padded memory
    (dense in neither layout) is read with its strides too; the same view one element further on has the same
    signature but starts off a 16-byte boundary: the general path copies it, and its values match too."""
    from cudnn_attn.fronts import cupy as cupy_front

    def refuse(*args, **kwargs):
        raise AssertionError("a call cuDNN reads as given ran the CuPy front")

    B, T, N, K, H = 2, 192, 16, 4, 64
    q = _random(rng, (B, T, N, H), torch.bfloat16).transpose(1, 2).requires_grad_()
    k, v = (_random(rng, (B, K, T, H), torch.bfloat16).requires_grad_() for _ in range(2))
    padded = _random(rng, (B, T, N, H + 8), torch.bfloat16)
    views = [padded[..., :H].transpose(1, 2), padded[..., 1:H + 1].transpose(1, 2)]
    with monkeypatch.context() as patched:
        patched.setattr(cupy_front, "run_forward", refuse)
        patched.setattr(cupy_front, "run_backward", refuse)
        for _ in range(2):                                     # the second call repeats the first's signature
            _poison_pool()
            out = ct.attention(q, k, v, mask=causal(), layout="BNTH").output
            assert out.transpose(1, 2).is_contiguous()          # dense in the query's layout
            _compare(out, _math_sdpa(q, k, v, is_causal=True, layout="BNTH"), (q, k, v), rng, "bfloat16")
        with torch.no_grad():
            _poison_pool()
            aligned = ct.sdpa(views[0], k, v, causal=True, layout="BNTH")[0]
        assert_close("output (a view of padded memory)", _host(aligned),
                     _host(_math_sdpa(views[0], k, v, is_causal=True, layout="BNTH")), "bfloat16")
    general, run_forward = [], cupy_front.run_forward
    monkeypatch.setattr(cupy_front, "run_forward", lambda *a, **kw: general.append(1) or run_forward(*a, **kw))
    with torch.no_grad():
        _poison_pool()
        shifted = ct.sdpa(views[1], k, v, causal=True, layout="BNTH")[0]
    assert general, "the misaligned view was launched directly"
    assert_close("output (the view one element on)", _host(shifted),
                 _host(_math_sdpa(views[1], k, v, is_causal=True, layout="BNTH")), "bfloat16")


REPEATED_CASES = ("dense", "transposed views", "strided value", "copied value", "keep-mask")


@pytest.mark.parametrize("case", REPEATED_CASES)
def test_a_repeated_eager_call_runs_its_remembered_direct_launch(rng, monkeypatch, case):
    """``sdpa`` remembers a signature's direct launch (``api._Decision.direct``) and runs it on the next calls
    from its fast entry (``api._Fast``, found before any signature) without the operator's implementation: decode
    steps of BNTH tensors, of BNTH views of BTNH memory (the addresses are the same), of a value view cuDNN reads
    with its strides, and under a bfloat16 keep-mask (the fold).  A value whose last dimension is strided is copied
    on every call, so it never takes that path.  Each call has new random
    values and matches the math SDPA; a bad seed on a remembered signature still raises ``ValueError``."""
    from cudnn_attn.torch import api, ops

    S = 200 + 8 * REPEATED_CASES.index(case)                  # a signature per case

    def inputs():
        q = _random(rng, (4, 1, 16, 64) if case == "transposed views" else (4, 16, 1, 64), torch.bfloat16)
        k, v = (_random(rng, (4, S, 4, 64) if case == "transposed views" else (4, 4, S, 64), torch.bfloat16)
                for _ in range(2))
        if case == "transposed views":
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        if case == "strided value":                  # dense in neither layout; cuDNN reads its strides
            v = torch.cat([v, v], dim=-1)[..., :64]
        if case == "copied value":                   # every other element of the last dimension: no cuDNN layout
            v = torch.cat([v, v], dim=-1)[..., ::2]
        mask = None
        if case == "keep-mask":
            pads = torch.from_numpy(rng.integers(0, S // 2, 4)).cuda()
            mask = (torch.arange(S, device="cuda")[None, :] >= pads[:, None]).view(4, 1, 1, S)
        return q, k, v, mask

    def signature(q, k, v, mask):
        return api._signature((q, k, v, None, None, mask), None, False, False, 0, 0.0, "BNTH", None)

    implementation, fast_launches = api.attention_unrecorded, []
    for call in range(4):
        q, k, v, mask = inputs()
        if call == 2:           # from here on a remembered direct launch must not reach the implementation
            decision = api._decided(signature(q, k, v, mask))
            assert decision is not None
            if case == "copied value":
                assert decision.copies == (False, False, True) and decision.direct is None, decision
            else:
                assert decision.as_given and type(decision.direct) is ops._Direct, decision
                keys = [key for key, entry in api._fast.items() if entry is decision.fast]
                assert decision.fast is not None and len(keys) == 1, (decision.fast, api._fast)
                monkeypatch.setitem(api._fast, keys[0], decision.fast._replace(
                    launch=lambda *tensors: fast_launches.append(S) or decision.fast.launch(*tensors)))

                def refuse(*args, **kwargs):
                    raise AssertionError("a remembered direct launch ran the operator's implementation")
                monkeypatch.setattr(api, "attention_unrecorded", refuse)
        _poison_pool()
        out, lse = ct.sdpa(q, k, v, keep=mask, layout="BNTH")
        assert out.shape == q.shape and lse.numel() == 0
        assert_close(f"output ({case}, call {call}, S={S})", _host(out),
                     _host(_math_sdpa(q, k, v, mask, layout="BNTH")), "bfloat16")
    assert fast_launches == ([] if case == "copied value" else [S, S]), fast_launches
    monkeypatch.setattr(api, "attention_unrecorded", implementation)
    for seed in (-1, True, 1.5):
        with pytest.raises(ValueError, match="seed"):
            ct.sdpa(q, k, v, keep=mask, layout="BNTH", seed=seed)


def test_calls_under_one_fast_key_that_differ_in_their_tensors_each_run_their_own(rng):
    """Decode calls against one cache shape (one fast key: ``api._Fast``) whose query or key differs in what the
    tensor guard reads - another query length, the query's strides, its dtype with the cache's, ``requires_grad``
    under ``torch.no_grad`` - alternate, each on fresh random values: every call matches the math SDPA in its own
    terms, whichever entry the key held before it (a later decision of the key replaces its entry)."""
    from cudnn_attn.torch import api

    S = 328

    def inputs(variant):
        dtype = torch.float16 if variant == "float16" else torch.bfloat16
        q = _random(rng, (4, 2 if variant == "two queries" else 1, 16, 64), dtype)
        q = q.transpose(1, 2) if variant in ("two queries", "strides") else q.view(4, 16, 1, 64)
        if variant == "strides":                    # a (4, 16, 1, 64) view of (4, 1, 16, 64) memory
            assert q.stride() != (1024, 64, 64, 1)
        k, v = (_random(rng, (4, 4, S, 64), dtype) for _ in range(2))
        return (q.requires_grad_() if variant == "requires_grad" else q), k, v

    variants = ("plain", "two queries", "strides", "float16", "requires_grad")
    with torch.no_grad():
        for round in range(3):
            for variant in variants:
                q, k, v = inputs(variant)
                _poison_pool()
                out, _ = ct.sdpa(q, k, v, layout="BNTH")
                assert out.shape == q.shape and out.dtype == q.dtype
                dtype_name = "float16" if variant == "float16" else "bfloat16"
                assert_close(f"output ({variant}, round {round})", _host(out),
                             _host(_math_sdpa(q, k, v, None, layout="BNTH")), dtype_name)
    keys = {key for key in api._fast if key[0] == (4, 4, S, 64)}
    assert len(keys) == 1, keys


EAGER_CASES = ("dense causal", "transposed views", "mixed layouts", "lengths", "keep-mask", "device-seed dropout")
EAGER_DIRECT = ("dense causal", "transposed views", "mixed layouts")
TRANSPOSED = ("transposed views", "mixed layouts")         # the call runs in the other layout than it is given in


@pytest.mark.parametrize("case", EAGER_CASES)
def test_an_eager_training_call_gives_the_operators_values_and_gradients(rng, monkeypatch, case):
    """An eager call autograd records runs ``AttentionFunction`` (no dispatcher) with the operator's results and
    gradients, bit for bit, on the direct launch (dense, transposed views, and transformers' training call: a BNTH
    view of BTNH query memory with a dense BNTH key and value, which runs in BTNH) and the general path (lengths, a
    keep-mask, a device dropout seed); both against the math SDPA where the mask is deterministic.  A repeated call of
    a direct launch runs it from its signature's ``DirectLaunches`` without the implementations, its results and
    gradients allocated in the caller's layout.  A repeated call without lengths or a device seed is found by its fast
    entry (``api._Fast.recorded``), without its signature."""
    from cudnn_attn.torch import api, eager, ops

    B, T, N, K, H = 2, 128 + 8 * EAGER_CASES.index(case), 8, 2, 64           # a signature per case
    q, k, v = _qkv(rng, torch.bfloat16, B=B, T=T, S=T, N=N, K=K, H=H)
    layout, lengths, mask, seed, rate = "BTNH", None, None, 0, 0.0
    if case == "transposed views":
        layout = "BNTH"
        q, k, v = (x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v))
    if case == "mixed layouts":
        layout = "BNTH"
        q = q.detach().transpose(1, 2).requires_grad_()
        k, v = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (k, v))
    if case == "lengths":
        lengths = torch.tensor([T, T - 37], dtype=torch.int32, device="cuda")
    if case == "keep-mask":
        mask = torch.from_numpy(rng.random((B, 1, T, T)) < 0.7).cuda() | torch.eye(T, dtype=torch.bool, device="cuda")
    if case == "device-seed dropout":
        rate, seed = 0.25, torch.tensor([int(rng.integers(1 << 40)), 0], dtype=torch.int64, device="cuda")
    causal_ = mask is None
    grad = _random(rng, q.shape, torch.bfloat16)
    if case == "mixed layouts":            # o_proj's gradient, through transformers' transpose: dense BTNH memory
        grad = _random(rng, (B, T, N, H), torch.bfloat16).transpose(1, 2)

    def refuse(*args, **kwargs):
        raise AssertionError("a repeated direct launch ran the operator's implementation")

    def no_signature(*args):
        raise AssertionError("a repeated recorded call made its signature instead of finding its fast entry")

    results = []
    for run in ("first", "repeated", "operator"):
        _poison_pool()
        if run == "repeated" and case in EAGER_DIRECT:
            monkeypatch.setattr(eager, "_forward", refuse)
            monkeypatch.setattr(eager, "_backward_implementation", refuse)
        if run == "repeated" and case not in ("lengths", "device-seed dropout"):     # found by its fast entry
            monkeypatch.setattr(api, "_signature", no_signature)
        if run != "operator":
            out, _ = ct.sdpa(q, k, v, causal=causal_, q_lengths=lengths, kv_lengths=lengths, keep=mask,
                             dropout_rate=rate, seed=seed, layout=layout)
            assert type(out.grad_fn).__name__ == "AttentionFunctionBackward", out.grad_fn
        else:
            running = layout if case not in TRANSPOSED else "BTNH"
            views = [x.transpose(1, 2) if case in TRANSPOSED else x for x in (q, k, v)]
            out, _ = ops.attention_op(*views, lengths, lengths, mask, 1 / math.sqrt(H), causal_, False, 0, rate,
                                      0, running, True, seed if rate else None)
            out = out.transpose(1, 2) if case in TRANSPOSED else out
        results.append((out.detach().clone(), *torch.autograd.grad(out, (q, k, v), grad)))
        monkeypatch.undo()
    for run, result in zip(("first", "repeated"), results):
        for name, a, b in zip(("output", "dq", "dk", "dv"), result, results[-1]):
            assert torch.equal(a, b), f"{case}, {run} call: {name} differs between AttentionFunction and the operator"
            assert a.stride() == b.stride(), f"{case}, {run} call: {name} strides {a.stride()} against {b.stride()}"
    if rate == 0 and lengths is None:
        assert_close(f"output ({case})", _host(results[0][0]),
                     _host(_math_sdpa(q, k, v, mask, is_causal=causal_, layout=layout)), "bfloat16")


@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_torch_compile_fullgraph_forward_and_backward(rng, dtype_name):
    q, k, v = _qkv(rng, DTYPES[dtype_name])
    grad = _random(rng, q.shape, q.dtype)

    def step(q, k, v):
        out = ct.sdpa(q, k, v, causal=True)[0]
        return (out.float() * grad.float()).sum()

    compiled = torch.compile(step, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    want = torch.autograd.grad(step(q, k, v), (q, k, v))
    ref = torch.autograd.grad((_math_sdpa(q, k, v, is_causal=True) * grad.float()).sum(), (q, k, v))
    for name, g, w, r in zip(("dq", "dk", "dv"), got, want, ref):
        assert_close(name, _host(g), _host(w), dtype_name)
        assert_close(name, _host(g), _host(r), dtype_name)



def test_torch_func_grad_and_per_sample_gradients(rng):
    """``torch.func.grad`` on cuDNN gives ``torch.autograd``'s gradients bit for bit, and the math SDPA's within the
    tier's bound; ``vmap(grad(f))`` over 3 samples gives each sample's own (:mod:`cudnn_attn.torch.transforms`:
    one call of the folded batch, so another cuDNN graph than a sample's alone: within the tier's bound)."""
    samples = _random(rng, (3, 2, 128, 16, 64), torch.bfloat16)
    k, v = (_random(rng, (2, 128, 4, 64), torch.bfloat16) for _ in range(2))
    weights = _random(rng, (2, 128, 16, 64), torch.float32)

    def loss(q, k, v):
        return (ct.sdpa(q, k, v, causal=True)[0].float() * weights).sum()

    _poison_pool()
    got = torch.func.grad(loss, argnums=(0, 1, 2))(samples[0], k, v)
    leaves = tuple(x.detach().clone().requires_grad_() for x in (samples[0], k, v))
    want = torch.autograd.grad(loss(*leaves), leaves)
    ref = torch.autograd.grad((_math_sdpa(*leaves, is_causal=True) * weights).sum(), leaves)
    for name, g, w, r in zip(("dq", "dk", "dv"), got, want, ref):
        assert torch.equal(g, w), name
        assert_close(name, _host(g), _host(r), "bfloat16")
    _poison_pool()
    per_sample = torch.vmap(torch.func.grad(loss), in_dims=(0, None, None))(samples, k, v)
    for i in range(3):
        leaf = samples[i].clone().requires_grad_()
        one, = torch.autograd.grad(loss(leaf, k, v), leaf)
        assert_close(f"sample {i}'s dq", _host(per_sample[i]), _host(one), "bfloat16")   # batch 6 against 2


def test_dropout_reproducible_by_seed_and_differentiable(rng):
    q, k, v = _qkv(rng, torch.bfloat16)
    first = ct.attention(q, k, v, mask=causal(), dropout_rate=0.25, seed=11).output
    second = ct.attention(q, k, v, mask=causal(), dropout_rate=0.25, seed=11).output
    other = ct.attention(q, k, v, mask=causal(), dropout_rate=0.25, seed=12).output
    assert torch.equal(first, second) and not torch.equal(first, other)
    grads = torch.autograd.grad(first.float().sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)
    # E[dropout(P)] = P: the mean over 128 seeds approaches the dropout-free output.  One seed's relative error is
    # about sqrt(p / (1 - p)) = 0.58 for random values, so the mean's is about 0.58 / sqrt(128) = 0.05; a wrong
    # 1 / (1 - p) scaling would leave 0.25 or more.
    with torch.no_grad():
        mean = sum(ct.attention(q, k, v, mask=causal(), dropout_rate=0.25, seed=s).output.float()
                   for s in range(128)) / 128
        plain = ct.attention(q, k, v, mask=causal()).output.float()
    assert float((mean - plain).norm() / plain.norm()) < 0.1


# -- transformers ------------------------------------------------------------------------------------------

def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=2048, num_hidden_layers=3,
                                      num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                      max_position_embeddings=256, initializer_range=0.2)
    model = transformers.LlamaForCausalLM(config).to(device="cuda", dtype=torch.float16).eval()
    ids = torch.randint(3, 512, (3, 40), device="cuda")
    attention_mask = torch.ones_like(ids)
    for row, pad in ((1, 9), (2, 23)):                                   # left padding
        attention_mask[row, :pad] = 0
        ids[row, :pad] = 0
    return model, ids, attention_mask


def _generate(model, implementation, ids, attention_mask, cache):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model.generate(ids, attention_mask=attention_mask, max_new_tokens=32, do_sample=False, pad_token_id=0,
                              cache_implementation=cache)[:, ids.shape[1]:]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_llama_generate_matches_sdpa(cache):
    """Greedy tokens of a left-padded batch equal sdpa's; with the static cache transformers compiles the
    decoding step (torch.compile, mode="reduce-overhead"), under a watchdog."""
    model, ids, attention_mask = _llama()
    name = ct.register_transformers()
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    try:
        with torch.no_grad():
            model.set_attn_implementation("sdpa")
            want_logits = model(ids, attention_mask=attention_mask).logits
            model.set_attn_implementation(name)
            got_logits = model(ids, attention_mask=attention_mask).logits
        valid = attention_mask.bool()
        # two fp16 attention kernels through three layers: 5x the one-kernel bound
        assert_close("prefill logits", _host(got_logits[valid]), _host(want_logits[valid]), "float16", scale=5.0)
        want = _generate(model, "sdpa", ids, attention_mask, cache)
        got = _generate(model, name, ids, attention_mask, cache)
    finally:
        faulthandler.cancel_dump_traceback_later()
    agree = int((got == want).sum())
    assert agree == want.numel(), f"{agree}/{want.numel()} greedy tokens equal sdpa's ({cache} cache)"


def test_llama_training_step_grads_match_sdpa():
    """One forward+backward of the Llama (bf16 parameters, causal, no padding): every parameter's gradient
    against sdpa's (relative Frobenius error within 4x the bf16 bound: two bf16 paths, not one against float32)."""
    model, ids, _ = _llama()
    model = model.to(torch.bfloat16).train()
    name = ct.register_transformers()
    ids = torch.randint(3, 512, ids.shape, device="cuda")
    grads = {}
    for implementation in ("sdpa", name):
        model.set_attn_implementation(implementation)
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        grads[implementation] = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert grads[name].keys() == grads["sdpa"].keys() and grads[name]
    for parameter, want in grads["sdpa"].items():
        assert_close(parameter, _host(grads[name][parameter]), _host(want), "bfloat16", scale=4.0)
    assert math.isfinite(sum(float(g.float().norm()) for g in grads[name].values()))
