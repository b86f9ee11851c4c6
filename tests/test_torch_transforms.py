"""``torch.func`` transforms through the torch front (:mod:`cudnn_attn.torch.transforms`), on the CPU (the NumPy
reference; the GPU tier runs them on cuDNN): ``grad``, ``vjp``, ``jacrev`` and ``vmap`` give what
``torch.autograd`` gives, bit for bit; ``vmap`` runs one call of the folded batch; a forward-mode transform, a
second derivative and a mapped device seed are refused with a clear error."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cudnn_attn.torch as ct
from cudnn_attn.torch import transforms
from torch_modes import names_mode

DTYPE = torch.bfloat16
TOLERANCE = 1e-2        # bfloat16 against torch's math SDPA in float32, relative (the torch front's tests' rule)


def _random(rng, shape, dtype=DTYPE):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(dtype)


def _loss(q, k, v, keep=None, **kwargs):
    """A scalar of the output that weighs every element differently (a sum alone has a zero query gradient)."""
    out, _ = ct.sdpa(q, k, v, keep=keep, **kwargs)
    weights = torch.linspace(-1.0, 1.0, out.numel(), dtype=torch.float32).reshape(out.shape)
    return (out.float() * weights).sum()


def _autograd(q, k, v, keep=None, **kwargs):
    leaves = tuple(x.detach().clone().requires_grad_() for x in (q, k, v))
    return torch.autograd.grad(_loss(*leaves, keep, **kwargs), leaves)


def _math_grads(q, k, v, **kwargs):
    """The gradients of :func:`_loss` through torch's math SDPA in float32 (GQA by repeating K/V)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = tuple(x.detach().float().requires_grad_() for x in (q, k, v))
    qf, kf, vf = (x.transpose(1, 2) for x in leaves)
    groups = qf.shape[1] // kf.shape[1]
    kf, vf = kf.repeat_interleave(groups, 1), vf.repeat_interleave(groups, 1)
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, **kwargs).transpose(1, 2)
    weights = torch.linspace(-1.0, 1.0, out.numel(), dtype=torch.float32).reshape(out.shape)
    return torch.autograd.grad((out * weights).sum(), leaves)


def _error(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_grad_and_vjp_give_autograds_gradients(rng, causal):
    q, k, v = _random(rng, (2, 8, 4, 16)), _random(rng, (2, 8, 2, 16)), _random(rng, (2, 8, 2, 16))
    want = _autograd(q, k, v, causal=causal)
    got = torch.func.grad(lambda *x: _loss(*x, causal=causal), argnums=(0, 1, 2))(q, k, v)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == DTYPE and torch.equal(a, b), name
    for name, a, b in zip(("dq", "dk", "dv"), got, _math_grads(q, k, v, is_causal=causal)):
        assert _error(a, b) <= TOLERANCE, f"{name}: relative error {_error(a, b):.2e} against torch's math SDPA"
    out, pullback = torch.func.vjp(lambda *x: ct.sdpa(*x, causal=causal)[0], q, k, v)
    cotangent = _random(rng, out.shape)
    leaves = tuple(x.clone().requires_grad_() for x in (q, k, v))
    for name, a, b in zip(("dq", "dk", "dv"), pullback(cotangent),
                          torch.autograd.grad(ct.sdpa(*leaves, causal=causal)[0], leaves, cotangent)):
        assert torch.equal(a, b), name


def test_jacrev_is_a_gradient_per_output(rng):
    q, k, v = _random(rng, (1, 2, 2, 8)), _random(rng, (1, 3, 2, 8)), _random(rng, (1, 3, 2, 8))
    jacobian = torch.func.jacrev(lambda x: ct.sdpa(x, k, v)[0].float())(q)
    assert jacobian.shape == (1, 2, 2, 8, 1, 2, 2, 8)
    for index in ((0, 0, 0, 0), (0, 1, 1, 5)):
        leaf = q.clone().requires_grad_()
        row, = torch.autograd.grad(ct.sdpa(leaf, k, v)[0].float()[index], leaf)
        assert torch.equal(jacobian[index].to(DTYPE), row), index


def test_per_sample_gradients_fold_into_one_call(rng, monkeypatch):
    """``vmap(grad(f))`` over 3 samples of batch 2: the gradients of each sample alone, from one forward and one
    backward of batch 6; a keep-mask mapped with the samples, and one shared by them."""
    samples = _random(rng, (3, 2, 5, 4, 16))
    k, v = _random(rng, (2, 7, 2, 16)), _random(rng, (2, 7, 2, 16))
    mapped = torch.from_numpy(rng.random((3, 2, 1, 5, 7)) < 0.7)
    mapped[..., 0] = True                                  # every row keeps a key
    shared = torch.from_numpy(rng.random((5, 7)) < 0.7)
    shared[:, 0] = True
    calls = []
    forward = transforms._forward
    monkeypatch.setattr(transforms, "_forward", lambda q, *a: (calls.append(tuple(q.shape)), forward(q, *a))[1])
    for keep, dims in ((None, (0, None, None, None)), (mapped, (0, None, None, 0)), (shared, (0, None, None, None))):
        calls.clear()
        got = torch.vmap(torch.func.grad(_loss), in_dims=dims)(samples, k, v, keep)
        assert calls == [(6, 5, 4, 16)], calls
        for i in range(3):
            one = None if keep is None else mapped[i] if keep is mapped else shared
            want, _, _ = _autograd(samples[i], k, v, one)
            assert torch.equal(got[i], want), (i, None if keep is None else keep.shape)


def test_vmap_of_the_forward_maps_every_argument(rng):
    """Inference under ``vmap`` with the key and value mapped too, and per-sample lengths."""
    q, k, v = _random(rng, (3, 2, 5, 4, 16)), _random(rng, (3, 2, 6, 2, 16)), _random(rng, (3, 2, 6, 2, 16))
    q_lengths = torch.tensor([[5, 3], [2, 5], [4, 4]], dtype=torch.int32)
    kv_lengths = torch.tensor([[6, 1], [3, 6], [6, 2]], dtype=torch.int32)
    got = torch.vmap(lambda *x: ct.sdpa(x[0], x[1], x[2], q_lengths=x[3], kv_lengths=x[4])[0])(
        q, k, v, q_lengths, kv_lengths)
    for i in range(3):
        want, _ = ct.sdpa(q[i], k[i], v[i], q_lengths=q_lengths[i], kv_lengths=kv_lengths[i])
        assert torch.equal(got[i], want), i


def test_what_transforms_cannot_do_is_refused(rng):
    q, k, v = _random(rng, (1, 4, 2, 8)), _random(rng, (1, 4, 2, 8)), _random(rng, (1, 4, 2, 8))
    with pytest.raises(NotImplementedError, match="jvp"):             # forward mode: torch's own refusal
        torch.func.jvp(lambda x: ct.sdpa(x, k, v)[0], (q,), (q,))
    with pytest.raises(RuntimeError, match="not twice differentiable"):
        torch.func.grad(lambda x: torch.func.grad(_loss)(x, k, v).float().square().sum())(q)
    seeds = torch.tensor([[1, 0], [2, 0]], dtype=torch.int64)
    with pytest.raises(ValueError, match="seed: a device seed mapped by vmap"):
        torch.vmap(lambda x, s: ct.sdpa(x, k, v, dropout_rate=0.1, seed=s)[0])(q.expand(2, *q.shape), seeds)


def test_a_dispatch_mode_under_a_transform_still_sees_the_operator(rng):
    """The transforms' functions call the implementations, which a dispatch mode would not see (a FLOP counter
    would count nothing): with a mode active the call stays the operator's, which torch then refuses under
    ``grad`` as it refuses any custom operator's autograd there."""
    q, k, v = _random(rng, (1, 4, 2, 8)), _random(rng, (1, 4, 2, 8)), _random(rng, (1, 4, 2, 8))
    with names_mode() as mode:
        torch.vmap(lambda x: ct.sdpa(x, k, v)[0])(q.expand(2, *q.shape))
    assert any(name.startswith("cudnn_attn.attention") for name in mode.names), mode.names
    with names_mode(), pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(_loss)(q, k, v)
