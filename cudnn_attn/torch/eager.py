"""Eager autograd without torch's dispatcher: :class:`AttentionFunction`, the custom operators' forward and gradient
(:mod:`cudnn_attn.torch.ops`) as a ``torch.autograd.Function`` over their implementations.

:func:`cudnn_attn.torch.api.sdpa` runs it for an eager call that autograd records and nothing else of torch would
see (:func:`cudnn_attn.torch.api.dispatch_free`); ``torch.compile``, ``torch.jit.trace``, dispatch modes and
``torch.func`` transforms see the operators instead.  Its results, residuals and gradients are the operators', bit
for bit; it is not twice differentiable, as the operators are not.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from cudnn_attn.engine.call import BWD, FWD

from .ops import _Direct, _backward_implementation, _check_trained, _forward, call_key, calls

__all__ = ["AttentionFunction", "DirectLaunches", "EagerCall", "apply_function"]


class DirectLaunches:
    """The direct launches (:class:`_Direct`) of one eager training signature's forward and backward, found by the
    first call of each through :data:`calls` and kept here, so that a repeated :class:`AttentionFunction` call
    launches without building its :func:`call_key` (``None``: not found yet, or the call runs the general path).
    Two threads that find one at once store the same entry."""

    __slots__ = ("forward", "backward")

    def __init__(self) -> None:
        self.forward: _Direct | None = None
        self.backward: _Direct | None = None


class EagerCall(Protocol):
    """What :class:`AttentionFunction` reads of a call besides its tensors and seed, fixed per call signature (the
    decision :func:`cudnn_attn.torch.api.sdpa` remembers, ``api._Decision``): the operator's static arguments but
    the seed (``scale, causal, bottom_right, window, dropout_rate``), the layout it runs in, ``training``, whether
    the caller's query, key and value are transposed views of that layout, which of them are copied, and the
    signature's :class:`DirectLaunches`."""

    static: tuple
    running: str
    training: bool
    transposed: bool
    copies: tuple
    launches: DirectLaunches


class AttentionFunction(torch.autograd.Function):
    """:func:`attention_op` and its gradient as an ``autograd.Function`` over the operators' implementations: what
    an eager call that autograd records runs when nothing else of torch would see the operator (no ``torch.compile``
    or ``torch.jit.trace`` tracing, dispatch mode or ``torch.func`` transform:
    :func:`cudnn_attn.torch.api.dispatch_free`).

    ``apply(query, key, value, q_lengths, kv_lengths, keep, seed, seed_offset, call)`` takes the caller's tensors
    and an :class:`EagerCall`; the forward returns the output in the caller's layout and the backward the gradients
    in it, so autograd records one node per call, not one more per transposed view.  A repeated call of a direct
    launch runs it from ``call.launches`` on the caller's tensors, read by address, into results allocated in the
    caller's layout; the general path makes the running layout's views (and copies) itself.
    The same results, residuals and gradients as the operator's, without torch's dispatcher on the way in and the
    way back: through the custom operators an eager training call (forward and ``autograd.grad``, B2 T=S=256 16/4
    heads d64 bf16, causal) took 928.1 us of host time, through this function 289.2 us, and torch SDPA's 191.2
    (``benchmarks/bench_torch_host.py``, H200 host).  Not twice differentiable, as the operator is not."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_lengths: Any,
                kv_lengths: Any, keep: Any, seed: int, seed_offset: Any, call: EagerCall) -> tuple:
        static = (*call.static, seed, call.running)           # the backward's; the forward's seed may be a tensor
        transposed, launches, copied = call.transposed, call.launches, any(call.copies)
        direct = launches.forward
        if direct is not None and seed_offset is None and not copied and direct.takes((query, key, value)):
            # The direct launch reads addresses alone (a transposed view's is its tensor's) and allocates the output
            # in the caller's layout: no view of the running layout is made, here or in the backward.
            output, logsumexp = direct.launch((query, key, value), seed, keep, transposed)
            used = (query, key, value)
        else:
            views = (query, key, value)
            if transposed:
                views = (query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
            if copied:
                views = tuple(x.contiguous() if copy else x for x, copy in zip(views, call.copies))
            running = static if seed_offset is None else (*call.static, seed_offset, call.running)
            output, logsumexp = _forward(*views, q_lengths, kv_lengths, keep, running, call.training)
            if direct is None and call.training and seed_offset is None and query.is_cuda:
                known = calls.get(call_key(FWD, (*views, q_lengths, kv_lengths, keep), static, True))
                if type(known) is _Direct:
                    launches.forward = known
            if transposed:
                output = output.transpose(1, 2)
            used = views if copied else (query, key, value)
        # Residuals: the query, key and value the launch read (the caller's, or their copies in the running layout)
        # and the output in the caller's layout.
        ctx.save_for_backward(*used, output, logsumexp, q_lengths, kv_lengths, keep, seed_offset)
        ctx.call = (static, call.training, transposed, launches, not copied)
        ctx.mark_non_differentiable(logsumexp)
        ctx.set_materialize_grads(False)          # no zero-filled gradient of the logsumexp, a kernel per call
        return output, logsumexp

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, grad_logsumexp: Any) -> tuple:
        if torch.is_grad_enabled():              # create_graph: once_differentiable refuses a second derivative
            return _once_differentiable_backward(ctx, grad_output, grad_logsumexp)
        return _backward(ctx, grad_output)


def _backward(ctx: Any, grad_output: torch.Tensor | None, _: Any = None) -> tuple:
    """:meth:`AttentionFunction.backward` with grad mode off (what ``once_differentiable`` runs it under)."""
    static, training, transposed, launches, given = ctx.call
    _check_trained(training)
    if grad_output is None:                       # the output was not used
        return (None,) * 9
    query, key, value, out, logsumexp, q_lengths, kv_lengths, keep, seed_offset = ctx.saved_tensors
    # The output's gradient dense in the running layout: as given where its strides are the output's.
    if grad_output.stride() != out.stride():
        grad_output = (grad_output.transpose(1, 2) if transposed else grad_output).contiguous()
        if transposed:
            grad_output = grad_output.transpose(1, 2)
    direct = launches.backward
    if direct is not None and seed_offset is None and direct.takes((query, key, value)):
        grads = direct.launch((query, key, value, out, grad_output, logsumexp), static[5], None, transposed)
        return (grads[0], grads[1], grads[2]) + (None,) * 6
    tensors = (query, key, value, out, grad_output)
    if transposed:
        tensors = tuple(x.transpose(1, 2) if given or i >= 3 else x for i, x in enumerate(tensors))
    tensors = (*tensors, logsumexp)
    grads = _backward_implementation(*tensors, q_lengths, kv_lengths, keep, *static, seed_offset)
    if direct is None and launches.forward is not None and seed_offset is None:
        known = calls.get(call_key(BWD, (*tensors, q_lengths, kv_lengths, keep), static, True))
        if type(known) is _Direct:
            launches.backward = known
    if transposed:
        return (grads[0].transpose(1, 2), grads[1].transpose(1, 2), grads[2].transpose(1, 2)) + (None,) * 6
    return (grads[0], grads[1], grads[2]) + (None,) * 6


_once_differentiable_backward = torch.autograd.function.once_differentiable(_backward)
"""The backward under grad mode (``create_graph=True``): ``once_differentiable``'s, which runs it without grad and
makes a second derivative through it an error.  Without grad mode the backward runs directly, which saves the
decorator's grad-mode switch."""


def _c_entry() -> Any:
    """torch's C entry of :class:`AttentionFunction` (``torch._C._FunctionBase.apply`` bound to it), or the public
    ``AttentionFunction.apply`` where this torch resolves the name to anything else."""
    entry = getattr(super(torch.autograd.Function, AttentionFunction), "apply", None)
    if type(entry).__name__ == "builtin_function_or_method" and getattr(entry, "__self__", None) is AttentionFunction:
        return entry
    return AttentionFunction.apply


apply_function = _c_entry()
"""``AttentionFunction.apply`` without ``torch.autograd.Function.apply``'s Python lines: torch's C entry, which that
method calls after its checks.  For a call :func:`cudnn_attn.torch.api.sdpa` found by its fast entry, where every
check is known to pass: :class:`AttentionFunction` defines no ``setup_context``, no ``torch.func`` transform is
active (``api._untraced``), and no tensor is a functorch wrapper (the entry's guard, torch's own, compares
dispatch keys).  10.1 against 15.5 us per call of a two-output function of nine arguments (CPU host, ``timeit``)."""
