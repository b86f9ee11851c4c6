"""The torch front on CPU (skipped where torch is not installed): the custom operators' registration and fake
implementations, the values and gradients of the CPU path (the NumPy reference) against torch's own math SDPA,
``torch.compile(fullgraph=True)``, argument errors, and transformers' attention registration.

Tolerances: the reference computes in float64 and rounds once to the io dtype; torch's math SDPA runs here in
float32 on the same (io-dtype) inputs.  Relative Frobenius errors are bounded by 2e-3 (fp16) and 1e-2 (bf16),
the GPU tier's bounds (``tests/gpu/_checks.py``), several times the rounding of the io dtype.
"""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode

import cudnn_attn.torch as ct
from cudnn_attn import AuxRequest, causal, keep, padding, window
from torch_modes import names_mode

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}
OPS = ("attention", "attention_backward")


def _random(rng, shape, dtype):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)


def _qkv(rng, dtype, B=2, T=8, S=8, N=4, K=2, H=16, requires_grad=True):
    q, k, v = (_random(rng, shape, dtype) for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, H)))
    return tuple(x.requires_grad_(requires_grad) for x in (q, k, v))


def _math_sdpa(q, k, v, keep_mask=None, *, is_causal=False, q_lengths=None):
    """torch's math SDPA in float32 on BTNH tensors (GQA by repeating K/V); rows past ``q_lengths`` zeroed
    (the library's rule for rows it does not compute)."""
    groups = q.shape[2] // k.shape[2]
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    kf, vf = kf.repeat_interleave(groups, 1), vf.repeat_interleave(groups, 1)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=keep_mask, is_causal=is_causal)
    out = out.transpose(1, 2)
    if q_lengths is not None:
        rows = torch.arange(q.shape[1])[None, :, None, None] < q_lengths[:, None, None, None]
        out = out * rows
    return out


def _error(got, want):
    got, want = got.detach(), want.detach()
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def _check_grads(out, ref, inputs, rng, dtype):
    grad = _random(rng, out.shape, dtype)
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(ref, inputs, grad.float())
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.shape == w.shape and g.dtype == dtype, name
        assert _error(g, w) <= TOLERANCE[dtype], f"{name}: relative error {_error(g, w):.2e}"


# -- registration and fake implementations -----------------------------------------------------------------

def test_operators_are_registered_with_fake_and_autograd(rng):
    for name in OPS:
        packet = getattr(torch.ops.cudnn_attn, name)
        if hasattr(torch.Tag, "cudagraph_unsafe"):        # CUDA graphs may hold both (cudnn_attn.torch.ops)
            assert torch.Tag.cudagraph_unsafe not in packet.default.tags, name
    q, k, v = _qkv(rng, torch.float16, B=1, T=4, S=4, N=2, K=1, H=16)
    arguments = (q, k, v, None, None, None, 0.25, True, False, 0, 0.0, 0, "BTNH", True)
    result = torch.library.opcheck(torch.ops.cudnn_attn.attention.default, arguments)
    assert set(result.values()) == {"SUCCESS"}, result


@pytest.mark.parametrize("layout", ["BTNH", "BNTH"])
def test_fake_shapes(layout):
    from torch._subclasses.fake_tensor import FakeTensorMode

    B, T, S, N, K, H, Hv = 2, 6, 10, 8, 2, 32, 16
    seq = (lambda b, t, n, h: (b, t, n, h)) if layout == "BTNH" else (lambda b, t, n, h: (b, n, t, h))
    with FakeTensorMode():
        q = torch.empty(seq(B, T, N, H), dtype=torch.bfloat16)
        k = torch.empty(seq(B, S, K, H), dtype=torch.bfloat16)
        v = torch.empty(seq(B, S, K, Hv), dtype=torch.bfloat16)
        out, lse = torch.ops.cudnn_attn.attention(q, k, v, None, None, None, 0.1, True, True, 0, 0.0, 0, layout, True)
        assert out.shape == seq(B, T, N, Hv) and out.dtype == torch.bfloat16
        assert lse.shape == (B, N, T) and lse.dtype == torch.float32
        _, lse = torch.ops.cudnn_attn.attention(q, k, v, None, None, None, 0.1, False, False, 0, 0.0, 0, layout, False)
        assert lse.shape == (0,)
        dq, dk, dv = torch.ops.cudnn_attn.attention_backward(q, k, v, out, out, torch.empty(B, N, T), None, None,
                                                             None, 0.1, True, True, 0, 0.0, 0, layout)
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_meta_tensors_and_compiled_shapes():
    q = torch.empty(2, 4, 5, 16, dtype=torch.float16, device="meta")          # BNTH
    k = torch.empty(2, 2, 7, 16, dtype=torch.float16, device="meta")
    out, lse = ct.sdpa(q, k, k, causal=True, bottom_right=True, layout="BNTH", training=True)
    assert (out.shape, out.device.type, lse.shape) == ((2, 4, 5, 16), "meta", (2, 4, 5))

    graphs = []

    def record(gm, inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(lambda q, k: ct.sdpa(q, k, k, causal=True, layout="BNTH")[0], fullgraph=True,
                             backend=record)
    assert compiled(q, k).shape == (2, 4, 5, 16)
    targets = [node.target for gm in graphs for node in gm.graph.nodes]
    assert torch.ops.cudnn_attn.attention.default in targets or torch.ops.cudnn_attn.attention in targets


# -- which calls skip torch's dispatcher (api.dispatch_free, api.unrecorded) --------------------------------------

class _OperatorSpy:
    """Counts the calls that reach ``torch.ops.cudnn_attn.attention`` (in place of ``api.attention_op``)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return ct.attention_op(*args)


def test_eager_calls_skip_the_dispatcher_and_give_the_operators_results_and_gradients(rng, monkeypatch):
    """An eager call runs without the operator: its implementation alone when autograd records nothing, else
    ``AttentionFunction``, whose values and gradients are the operator's, bit for bit."""
    from cudnn_attn.torch import api

    spy = _OperatorSpy()
    monkeypatch.setattr(api, "attention_op", spy)
    q, k, v = _qkv(rng, torch.bfloat16, T=5, S=8, requires_grad=False)
    out, _ = ct.sdpa(q, k, v, causal=True, bottom_right=True)
    with torch.no_grad():
        ct.sdpa(*(x.requires_grad_(True) for x in (q, k, v)), causal=True, bottom_right=True)
    want, _ = ct.sdpa(q, k, v, causal=True, bottom_right=True)        # q, k, v require grad: recorded
    assert spy.calls == 0
    assert type(want.grad_fn).__name__ == "AttentionFunctionBackward", want.grad_fn
    assert torch.equal(out, want.detach())
    grad = _random(rng, want.shape, torch.bfloat16)
    got = torch.autograd.grad(want, (q, k, v), grad)
    through_operator, _ = ct.attention_op(q, k, v, None, None, None, 0.25, True, True, 0, 0.0, 0, "BTNH", True)
    assert "attention" in type(through_operator.grad_fn).__name__.lower(), through_operator.grad_fn
    assert torch.equal(through_operator, want)
    expected = torch.autograd.grad(through_operator, (q, k, v), grad, retain_graph=True)
    for name, a, b in zip("qkv", got, expected):
        assert torch.equal(a, b), name
    for output in (ct.sdpa(q, k, v, causal=True, bottom_right=True)[0], through_operator):
        dq, = torch.autograd.grad(output, q, grad.clone().requires_grad_(), create_graph=True, retain_graph=True)
        with pytest.raises(RuntimeError, match="differentiate twice|no autograd formula"):   # neither is twice
            dq.float().sum().backward()                                                     # differentiable


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing_gives_the_same_gradients(rng, reentrant):
    """``torch.utils.checkpoint`` (both kinds; the non-reentrant one recomputes through saved-tensor hooks) around an
    eager call gives the gradients of the call without it, bit for bit."""
    from torch.utils.checkpoint import checkpoint

    q, k, v = _qkv(rng, torch.float16)
    grad = _random(rng, q.shape, torch.float16)

    def loss(q, k, v):
        return (ct.sdpa(q, k, v, causal=True)[0].float() * grad.float()).sum()

    want = torch.autograd.grad(loss(q, k, v), (q, k, v))
    checkpoint(loss, q, k, v, use_reentrant=reentrant).backward()      # the reentrant kind takes no autograd.grad
    for name, a, b in zip("qkv", (q.grad, k.grad, v.grad), want):
        assert torch.equal(a, b), name


def test_torch_jit_trace_records_the_operator(rng):
    """``torch.jit.trace`` records the operator, so the trace computes attention for new inputs (a call that skipped
    the dispatcher would be a constant of the trace, its first result)."""
    def attend(q, k, v):
        return ct.sdpa(q, k, v, causal=True)[0]

    with torch.no_grad():
        traced = torch.jit.trace(attend, _qkv(rng, torch.float16, requires_grad=False), check_trace=False)
        assert "cudnn_attn::attention" in str(traced.graph), traced.graph
        fresh = _qkv(rng, torch.float16, requires_grad=False)
        assert torch.equal(traced(*fresh), attend(*fresh))


def test_dispatch_modes_and_function_transforms_see_the_operator(rng):
    from cudnn_attn.torch import api

    q, k, v = _qkv(rng, torch.float16, requires_grad=False)
    with names_mode() as mode:
        ct.sdpa(q, k, v)
    assert any(name.startswith("cudnn_attn.attention") for name in mode.names), mode.names
    with names_mode() as mode:                                        # a call autograd records, and its backward
        out, _ = ct.sdpa(*(x.detach().requires_grad_() for x in (q, k, v)))
        out.sum().backward()
    assert any(name.startswith("cudnn_attn.attention_backward") for name in mode.names), mode.names
    assert api.dispatch_free(q, k, v) and not api.dispatch_free(q.to("meta"), k, v)
    assert api.unrecorded(q, k, v)
    with names_mode():
        assert not api.unrecorded(q, k, v)
    seen = []
    torch.func.vmap(lambda x: (seen.append(api.unrecorded(x)), x)[1])(q)
    assert seen == [False]
    assert not api.unrecorded(q.requires_grad_(True))


# -- values and gradients (CPU: the NumPy reference) ---------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("masked", ["none", "causal", "bottom_right"])
def test_values_and_grads_against_math_sdpa(rng, dtype, masked):
    T, S = (5, 8) if masked == "bottom_right" else (8, 8)
    q, k, v = _qkv(rng, dtype, T=T, S=S)
    mask = {"none": None, "causal": causal(), "bottom_right": causal("bottom_right")}[masked]
    out = ct.attention(q, k, v, mask=mask).output
    keep_mask = None
    if masked == "bottom_right":
        keep_mask = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + S - T
    ref = _math_sdpa(q, k, v, keep_mask, is_causal=masked == "causal")
    assert out.shape == q.shape and out.dtype == dtype
    assert _error(out, ref) <= TOLERANCE[dtype]
    _check_grads(out, ref, (q, k, v), rng, dtype)


def test_padding_and_keep_mask_match_math_sdpa(rng):
    dtype = torch.float16
    q, k, v = _qkv(rng, dtype, T=8, S=8)
    q_lengths, kv_lengths = torch.tensor([8, 5], dtype=torch.int32), torch.tensor([8, 6], dtype=torch.int32)
    out = ct.attention(q, k, v, mask=causal() & padding(q_lengths, kv_lengths)).output
    keys = torch.arange(8)[None, None, None, :] < kv_lengths[:, None, None, None]
    keep_mask = keys & torch.ones(8, 8, dtype=torch.bool).tril()
    ref = _math_sdpa(q, k, v, keep_mask, q_lengths=q_lengths)
    assert _error(out, ref) <= TOLERANCE[dtype]
    _check_grads(out, ref, (q, k, v), rng, dtype)

    left = torch.arange(8)[None, :] >= torch.tensor([0, 3])[:, None]          # left padding, as transformers
    keep_mask = (left[:, None, None, :] & torch.ones(8, 8, dtype=torch.bool).tril())
    keep_mask = keep_mask | ~keep_mask.any(-1, keepdim=True)          # fully masked rows: any finite answer
    out = ct.attention(q, k, v, mask=keep(keep_mask)).output
    ref = _math_sdpa(q, k, v, keep_mask)
    valid = left[:, :, None, None].expand_as(out)
    assert _error(out[valid], ref[valid]) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mask_layout", ["dense", "transposed", "broadcast_rows", "two_dims"])
def test_the_direct_launchs_keep_mask_fold_is_validations_fold_in_one_operation(rng, dtype, mask_layout):
    """``ops._folded`` (the keep-mask's bias on the direct launch) equals validation's fold of the same mask, bit
    for bit, dense in ``config.bias``'s shape, whatever the mask's strides; a dense mask of the bias's shape is
    folded by one torch operation (``aten.add``, no copy to the device: a CUDA graph holds it)."""
    from cudnn_attn.core.validation import validate_call
    from cudnn_attn.torch import ops

    B, T, S, N = 2, 3, 40, 4
    drawn = torch.from_numpy(rng.random((B, 1, S, T)) > 0.3)
    keep_mask = {"dense": drawn.transpose(2, 3).contiguous(), "transposed": drawn.transpose(2, 3),
                 "broadcast_rows": drawn[:, :, :1, :1].expand(B, 1, T, S), "two_dims": drawn[0, 0].T}[mask_layout]
    q, k, v = _qkv(rng, dtype, B=B, T=T, S=S, N=N, K=N, requires_grad=False)
    config = ops.config_of(q, k, v, None, None, keep_mask, (0.25, False, False, 0, 0.0, 0, "BTNH"), False)

    class Operations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    with Operations() as operations:
        bias = ops._folded(keep_mask, config)
    numpy_dtype = ops._NUMPY_DTYPES[dtype]
    stand_ins = [np.zeros(x.shape, numpy_dtype) for x in (q, k, v)]
    _, operands = validate_call(*stand_ins, mask=keep_mask.numpy(), scale=0.25, xp=np)
    want = np.ascontiguousarray(operands.bias).view(np.int16)
    assert bias.dtype == dtype and tuple(bias.shape) == config.bias.shape == want.shape and bias.is_contiguous()
    assert np.array_equal(bias.view(torch.int16).numpy(), want), f"repro: mask_layout={mask_layout} {dtype}"
    if mask_layout == "dense":
        assert operations.seen == [torch.ops.aten.add.Tensor]


def test_window_and_logsumexp(rng):
    q, k, v = _qkv(rng, torch.bfloat16, requires_grad=False)
    result = ct.attention(q, k, v, mask=window(2, 0), return_aux=AuxRequest(logsumexp=True))
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    keep_mask = (j <= i) & (j >= i - 2)
    assert _error(result.output, _math_sdpa(q, k, v, keep_mask)) <= TOLERANCE[torch.bfloat16]
    groups = q.shape[2] // k.shape[2]
    scores = torch.einsum("btnh,bsnh->bnts", q.double(), k.double().repeat_interleave(groups, 2)) / math.sqrt(16)
    lse = scores.masked_fill(~keep_mask, -math.inf).logsumexp(-1)
    assert result.logsumexp.shape == (2, 4, 8) and result.logsumexp.dtype == torch.float32
    assert torch.allclose(result.logsumexp.double(), lse, atol=1e-3, rtol=1e-3)


def test_strided_views_run_in_the_layout_they_are_dense_in(rng):
    """transformers' query is a BNTH view of a dense BTNH tensor; a cache is dense BNTH; a slice is dense in
    neither.  Every combination gives the dense call's values and gradients."""
    dtype = torch.float16
    q, k, v = _qkv(rng, dtype, S=8)
    ref = ct.attention(q, k, v, mask=causal()).output
    q_view = q.detach().transpose(1, 2).requires_grad_()                                 # BNTH view of BTNH memory
    k_cache = k.detach().transpose(1, 2).contiguous().requires_grad_()                   # dense BNTH
    v_slice = torch.cat([v.detach(), v.detach()], dim=-1)[..., :16].transpose(1, 2).requires_grad_()   # neither
    out = ct.attention(q_view, k_cache, v_slice, mask=causal(), layout="BNTH").output
    assert out.shape == (2, 4, 8, 16)
    assert torch.equal(out.transpose(1, 2), ref)
    grad = _random(rng, out.shape, dtype)
    dq, dk, dv = torch.autograd.grad(out, (q_view, k_cache, v_slice), grad)
    want = torch.autograd.grad(ref, (q, k, v), grad.transpose(1, 2))
    for got, expected in zip((dq, dk, dv), want):
        assert torch.equal(got.transpose(1, 2), expected)


def test_a_call_signature_tells_apart_what_decides_the_call(rng):
    """``api._signature`` (what ``sdpa`` remembers its decisions by) differs for another shape, strides,
    dtype, ``requires_grad``, an absent or present mask, a scalar of another type (``True`` and ``1``), and grad
    mode; it is ``None`` for a tensor subclass; an unhashable scalar gives a signature nothing is remembered for.
    A remembered decision is found again, and a repeated call on it gives the first call's values."""
    from cudnn_attn.torch import api

    scalars = (None, True, False, 0, 0.0, "BTNH", None)
    q, k, v = _qkv(rng, torch.float16, requires_grad=False)
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    base = api._signature((q, k, v, None, None, None), *scalars)
    assert base == api._signature((q.clone(), k.clone(), v.clone(), None, None, None), *scalars)
    others = [api._signature((q[:, :4], k, v, None, None, None), *scalars),
              api._signature((q.transpose(1, 2).contiguous().transpose(1, 2), k, v, None, None, None), *scalars),
              api._signature((q.to(torch.bfloat16), k, v, None, None, None), *scalars),
              api._signature((q.detach().requires_grad_(), k, v, None, None, None), *scalars),
              api._signature((q, k, v, None, None, mask), *scalars),
              api._signature((q, k, v, None, None, None), None, 1, False, 0, 0.0, "BTNH", None)]
    with torch.no_grad():
        others.append(api._signature((q, k, v, None, None, None), *scalars))
    assert all(other != base for other in others) and len(set(others)) == len(others)

    class Sub(torch.Tensor):
        pass

    assert api._signature((q.as_subclass(Sub), k, v, None, None, None), *scalars) is None
    unhashable = api._signature((q, k, v, None, None, None), [0.25], *scalars[1:])
    api._remember(unhashable, "never stored")
    assert api._decided(unhashable) is None
    first, _ = ct.sdpa(q, k, v, causal=True)
    assert api._decided(base) is not None
    again, _ = ct.sdpa(q.clone(), k.clone(), v.clone(), causal=True)
    assert torch.equal(first, again)


@pytest.mark.parametrize("guard", ["torch's", "public reads"])
def test_the_fast_entrys_tensor_guard_tells_apart_what_a_signature_does(rng, monkeypatch, guard):
    """``api._tensor_guard`` (what a known inference forward's fast entry is matched by before any signature) matches
    tensors of the same type, shape, strides, dtype, device and ``requires_grad`` whatever their values, and no
    tensor that differs in one of them; torch's private guard and the public reads it falls back to agree.  With
    this torch, the guard is torch's (``TensorGuards``: 0.49 against 1.50 us for three tensors, ``api._tensor_guard``'s
    doc): where it is gone or its constructor changed, this test says so."""
    from cudnn_attn.torch import api

    if guard == "public reads":
        monkeypatch.setattr(api, "_TensorGuards", None)
    q, k, v = _qkv(rng, torch.float16, requires_grad=False)
    mask = torch.ones(2, 1, 8, 8, dtype=torch.bool)
    matches = api._tensor_guard((q, k, v, mask))
    if guard == "torch's":
        assert type(getattr(matches, "__self__", None)) is api._TensorGuards, matches
    assert matches(q.clone(), torch.randn_like(k), v.clone(), mask.clone())

    class Sub(torch.Tensor):
        pass

    others = {"shape": (q[:, :4], k, v, mask), "strides": (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, mask),
              "dtype": (q, k.to(torch.bfloat16), v, mask), "requires_grad": (q, k, v.detach().requires_grad_(), mask),
              "subclass": (q.as_subclass(Sub), k, v, mask), "device": (q, k, v.to("meta"), mask),
              "mask's dtype": (q, k, v, mask.to(torch.uint8)), "mask's shape": (q, k, v, mask[:1])}
    for name, tensors in others.items():
        assert not matches(*tensors), name


def test_a_call_reads_no_fast_entry_that_its_tensors_do_not_match(rng, monkeypatch):
    """A fast entry (``api._fast``) under a call's fast key whose tensor guard the call's tensors fail is not taken:
    the call runs as its signature decides (here the NumPy reference, which a CPU call always runs), and gives that
    call's values."""
    from cudnn_attn.torch import api

    q, k, v = _qkv(rng, torch.float16, requires_grad=False)
    taken = []
    never = api._Fast(lambda *tensors: False, lambda *tensors: taken.append(tensors), None)
    want, _ = ct.sdpa(q, k, v, causal=True)
    monkeypatch.setattr(api, "_fast", collections.defaultdict(lambda: never))
    got, _ = ct.sdpa(q, k, v, causal=True)
    assert not taken and torch.equal(got, want)


def test_a_repeated_recorded_call_is_found_by_its_fast_entry(rng, monkeypatch):
    """A call that autograd records leaves a fast entry (``api._Fast.recorded``, its decision) under its fast key: a
    repeated call is found by it without a signature and runs ``AttentionFunction`` through torch's C entry
    (``eager.apply_function``), with the first call's values and gradients, bit for bit, on new tensors.  Tensors
    its guard does not match (``requires_grad`` off, a dead functorch wrapper), a dispatch mode and a ``torch.func``
    transform do not take it."""
    from cudnn_attn.torch import api

    q, k, v = _qkv(rng, torch.float16, T=6, S=8)
    grad = _random(rng, (2, 6, 4, 16), torch.float16)
    want, _ = ct.sdpa(q, k, v, causal=True)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    decision = api._decided(api._signature((q, k, v, None, None, None), None, True, False, 0, 0.0, "BTNH", None))
    assert decision is not None and decision.autograd and decision.fast is not None, decision
    assert decision.fast.recorded == decision._replace(fast=None) and decision.fast.launch is None, decision.fast
    assert any(entry is decision.fast for entry in api._fast.values())

    def no_signature(*arguments):
        raise AssertionError("a repeated recorded call made its signature")

    monkeypatch.setattr(api, "_signature", no_signature)
    fresh = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
    got, _ = ct.sdpa(*fresh, causal=True)
    assert type(got.grad_fn).__name__ == "AttentionFunctionBackward", got.grad_fn
    assert torch.equal(got, want)
    for name, a, b in zip("qkv", torch.autograd.grad(got, fresh, grad), want_grads):
        assert torch.equal(a, b), name
    with pytest.raises(AssertionError, match="signature"):         # requires_grad off: the guard fails
        ct.sdpa(*(x.detach() for x in (q, k, v)), causal=True)
    leaked = []
    torch.func.grad(lambda x: (leaked.append(x), x.float().sum())[1])(q)
    with pytest.raises(AssertionError, match="signature"):         # a dead functorch wrapper: the guard fails
        ct.sdpa(leaked[0], k, v, causal=True)
    monkeypatch.undo()

    with names_mode() as mode:
        out, _ = ct.sdpa(q, k, v, causal=True)
        out.backward(grad)
    assert any(name.startswith("cudnn_attn.attention_backward") for name in mode.names), mode.names
    assert torch.equal(out, want)

    class Seen(Exception):
        pass

    class Transformed:
        @staticmethod
        def apply(*arguments):
            raise Seen

    monkeypatch.setattr(api, "TransformedAttention", Transformed)
    with pytest.raises(Seen):                         # a transform: the call goes to the transforms' function
        torch.func.grad(lambda x: ct.sdpa(x, k, v, causal=True)[0].float().sum())(q.detach())


@pytest.mark.parametrize("dynamic", [False, True], ids=["static_shapes", "dynamic_shapes"])
def test_compiled_forward_and_backward_match_eager(rng, dynamic):
    """With dynamic shapes the fake implementation sees symbolic sizes (it then only computes the shapes)."""
    def loss(q, k, v):
        return (ct.sdpa(q, k, v, causal=True)[0].float() ** 2).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for length in (8, 12):
        q, k, v = _qkv(rng, torch.float16, T=length, S=length)
        got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
        want = torch.autograd.grad(loss(q, k, v), (q, k, v))
        for g, w in zip(got, want):
            assert torch.equal(g, w)


def test_traced_calls_guard_no_memo_table(rng):
    """A call ``torch.compile`` traces reads none of the eager path's memo tables (the remembered decisions, their
    fast entries, the validated configurations, the table of calls, the shared empty logsumexps): the compiled code
    would be guarded on them, and every step of a compiled decode loop evaluates its guards.  With the decisions'
    table read, each remembered signature added about 111 guards on its key (4535 guards after 40 eager signatures,
    92 without)."""
    import re

    for length in (8, 9, 10):                          # eager calls first: the tables hold their entries
        q, k, v = _qkv(rng, torch.float16, T=length, S=length, requires_grad=False)
        keep_mask = torch.ones(2, 1, length, length, dtype=torch.bool)
        ct.sdpa(q, k, v, keep=keep_mask)
    explanation = torch._dynamo.explain(lambda q, k, v, m: ct.sdpa(q, k, v, keep=m)[0])(q, k, v, keep_mask)
    guarded = " ".join(guard.name for guard in explanation.out_guards)
    assert "cudnn_attn" in guarded                     # the traced library code is guarded at all
    for table in ("_decisions", "_fast", "_validated_configs", "calls", "_empty_lses"):
        assert not re.search(rf"\.{table}\b", guarded), (table, guarded)


def test_dropout_is_reproducible_by_seed(rng):
    q, k, v = _qkv(rng, torch.float16, requires_grad=False)
    first = ct.attention(q, k, v, dropout_rate=0.5, seed=7).output
    assert torch.equal(first, ct.attention(q, k, v, dropout_rate=0.5, seed=7).output)
    assert not torch.equal(first, ct.attention(q, k, v).output)


# -- errors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case, argument", [
    ("head_dims", "key"), ("int64_lengths", "q_lengths"), ("layout", "layout"), ("keep_shape", "keep"),
    ("rank", "query"), ("not_a_tensor", "value"), ("float32", "query"), ("alibi", "mask"),
    ("right_window", "mask"), ("seed", "seed"),
])
def test_bad_arguments_raise_value_errors_naming_them(rng, case, argument):
    from cudnn_attn import alibi

    q, k, v = _qkv(rng, torch.float16, requires_grad=False)
    lengths = torch.tensor([8, 8], dtype=torch.int32)
    calls = {
        "head_dims": lambda: ct.sdpa(q, k[..., :8], v),
        "int64_lengths": lambda: ct.sdpa(q, k, v, q_lengths=lengths.long(), kv_lengths=lengths),
        "layout": lambda: ct.sdpa(q, k, v, layout="TBNH"),
        "keep_shape": lambda: ct.sdpa(q, k, v, keep=torch.ones(2, 1, 3, 8, dtype=torch.bool)),
        "rank": lambda: ct.sdpa(q[0], k, v),
        "not_a_tensor": lambda: ct.sdpa(q, k, v.numpy()),
        "float32": lambda: ct.sdpa(q.float(), k.float(), v.float()),
        "alibi": lambda: ct.attention(q, k, v, mask=causal() & alibi()),
        "right_window": lambda: ct.attention(q, k, v, mask=window(2, 1)),
        "seed": lambda: ct.sdpa(q, k, v, dropout_rate=0.1, seed=-1),
    }
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        calls[case]()


def test_fake_implementation_raises_the_same_errors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 8, 4, 16, dtype=torch.float16)
        k = torch.empty(2, 8, 3, 16, dtype=torch.float16)             # 4 query heads, 3 key heads
        with pytest.raises(ValueError, match=r"^key\b"):
            ct.sdpa(q, k, k)


# -- transformers ------------------------------------------------------------------------------------------

def test_register_transformers_registers_attention_and_mask():
    transformers = pytest.importorskip("transformers")
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = ct.register_transformers("cudnn_attn_test")
    assert name == "cudnn_attn_test"
    assert transformers.AttentionInterface()[name] is ct.transformers_attention
    assert AttentionMaskInterface()[name] is sdpa_mask
    with pytest.raises(ValueError, match="^name"):
        ct.register_transformers("")


def test_transformers_attention_refuses_an_additive_mask(rng):
    q, k, v = (x.transpose(1, 2) for x in _qkv(rng, torch.float16, requires_grad=False))
    with pytest.raises(ValueError, match="^attention_mask"):
        ct.transformers_attention(torch.nn.Module(), q, k, v, torch.zeros(2, 1, 8, 8, dtype=torch.float16))


def _llama(layers=2, left_padding=True):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=1024, intermediate_size=512,
                                      num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                                      head_dim=64, max_position_embeddings=64, initializer_range=0.2)
    model = transformers.LlamaForCausalLM(config).to(torch.float16).eval()
    ids = torch.randint(3, 128, (2, 10))
    attention_mask = torch.ones(2, 10, dtype=torch.long)
    if left_padding:
        attention_mask[1, :4] = 0
        ids[1, :4] = 0
    return model, ids, attention_mask


def _generate(model, implementation, ids, attention_mask, **options):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model.generate(ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                              **options)[:, ids.shape[1]:]


@pytest.mark.parametrize("left_padding", [True, False], ids=["left_padded", "unpadded"])
def test_llama_prefill_and_generate_match_sdpa_on_cpu(left_padding):
    """Left padded, every call has a keep-mask; unpadded, transformers passes none (causal prefill, decoding
    against the whole cache)."""
    model, ids, attention_mask = _llama(left_padding=left_padding)
    name = ct.register_transformers()
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        want = model(ids, attention_mask=attention_mask).logits
        model.set_attn_implementation(name)
        got = model(ids, attention_mask=attention_mask).logits
    valid = attention_mask.bool()
    assert _error(got[valid], want[valid]) <= TOLERANCE[torch.float16] * 2
    assert torch.equal(_generate(model, name, ids, attention_mask), _generate(model, "sdpa", ids, attention_mask))


def test_llama_static_cache_generate_compiles_the_operator():
    """``cache_implementation="static"`` makes transformers compile the decoding step (fullgraph here; on CPU
    only with ``_compile_all_devices``): the graph holds the operator and the tokens are sdpa's."""
    from transformers.generation.configuration_utils import CompileConfig

    model, ids, attention_mask = _llama(layers=1)
    name = ct.register_transformers()
    graphs = []

    def record(gm, inputs, **options):             # transformers passes mode="reduce-overhead"
        graphs.append(gm)
        return gm

    compile_config = CompileConfig(fullgraph=True, backend=record)
    compile_config._compile_all_devices = True
    got = _generate(model, name, ids, attention_mask, cache_implementation="static", compile_config=compile_config)
    want = _generate(model, "sdpa", ids, attention_mask, cache_implementation="static")
    assert torch.equal(got, want)
    targets = {node.target for gm in graphs for node in gm.graph.nodes}
    assert graphs and (torch.ops.cudnn_attn.attention.default in targets or torch.ops.cudnn_attn.attention in targets)


def test_a_llama_training_step_makes_no_copy_that_sdpas_does_not():
    """Around the attention, a transformers training step through the torch front runs no more copies and fills
    than through sdpa (counted by a dispatch mode, which sees the operators whole): transformers passes a BTNH query
    with the BNTH key and value its cache concatenated, so the call runs in the query's layout and reads key and
    value with their strides - the output and the query's gradient come back dense where the projections read them,
    and the logsumexp gets no zero-filled gradient."""
    import collections

    class Counted(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.name()] += 1
            return func(*args, **(kwargs or {}))

    model, ids, _ = _llama(layers=2, left_padding=False)
    model = model.to(torch.bfloat16).train()
    counted = {}
    for implementation in (ct.register_transformers(), "sdpa"):
        model.set_attn_implementation(implementation)
        model.zero_grad(set_to_none=True)
        with Counted() as mode:
            model(ids, labels=ids).loss.backward()
        counted[implementation] = mode.ops
    ours, theirs = counted["cudnn_attn"], counted["sdpa"]
    assert ours["cudnn_attn::attention"] == ours["cudnn_attn::attention_backward"] == 2
    for op in ("aten::clone", "aten::copy_", "aten::contiguous", "aten::zeros", "aten::zeros_like", "aten::fill_",
               "aten::full"):
        assert ours[op] <= theirs[op], (op, ours[op], theirs[op])


def test_a_device_seed_tensor_draws_its_own_mask_and_bad_ones_are_named(rng):
    """``seed`` as an int64 tensor ``[seed, offset]`` (the reference's masks on CPU): equal values draw equal masks,
    other values others, and the gradient flows; a tensor of another size or dtype is a ValueError naming ``seed``."""
    q, k, v = _qkv(rng, torch.bfloat16, B=2, T=16, S=16, N=4, K=4, H=32)
    seed = torch.tensor([5, 0])
    first = ct.sdpa(q, k, v, dropout_rate=0.3, seed=seed)[0]
    assert torch.equal(first, ct.sdpa(q, k, v, dropout_rate=0.3, seed=seed.clone())[0])
    assert not torch.equal(first, ct.sdpa(q, k, v, dropout_rate=0.3, seed=torch.tensor([6, 0]))[0])
    first.float().sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))
    for bad in (torch.tensor([1, 2, 3]), torch.tensor([1.0, 2.0])):
        with pytest.raises(ValueError, match="seed: a device dropout seed"):
            ct.sdpa(q, k, v, dropout_rate=0.3, seed=bad)


def test_the_max_logit_is_refused_with_its_reason(rng):
    from cudnn_attn import AuxRequest
    from cudnn_attn.core.errors import UnsupportedConfigurationError

    q, k, v = _qkv(rng, torch.float16, B=1, T=4, S=4, N=2, K=2, H=16)
    with pytest.raises(UnsupportedConfigurationError, match="no max logit"):
        ct.attention(q, k, v, return_aux=AuxRequest(max_logit=True))


@pytest.mark.parametrize("case", ["dense", "one query, another layout's strides", "transposed view", "another dtype"])
def test_the_fast_launchers_output_has_the_results_shape_and_strides(case):
    """``ops._allocation`` (how a fast entry's launcher makes its output from the query): whichever way it chooses
    (``torch.empty_like`` of the query as it is, or dense, or ``torch.empty_strided``), the output has the result's
    shape, strides and dtype, for every query of the call's signature."""
    from cudnn_attn.torch import ops

    dense = torch.empty(4, 16, 1, 64, dtype=torch.bfloat16)
    query, shape, strides, dtype = {
        "dense": (dense, (4, 16, 1, 64), (1024, 64, 64, 1), torch.bfloat16),
        "one query, another layout's strides": (torch.empty(4, 1, 16, 64, dtype=torch.bfloat16).transpose(1, 2),
                                                (4, 16, 1, 64), (1024, 64, 64, 1), torch.bfloat16),
        "transposed view": (torch.empty(2, 8, 4, 16, dtype=torch.float16).transpose(1, 2), (2, 4, 8, 16),
                            (512, 16, 64, 1), torch.float16),
        "another dtype": (dense, (4, 16, 1, 64), (1024, 64, 64, 1), torch.float16),
    }[case]
    allocate = ops._allocation(query, shape, strides, dtype, torch.device("cpu"))
    for like in (query, query.clone() if query.is_contiguous() else query.transpose(1, 2).clone().transpose(1, 2)):
        assert like.stride() == query.stride()
        output = allocate(like)
        assert (tuple(output.shape), output.stride(), output.dtype) == (shape, strides, dtype), case
