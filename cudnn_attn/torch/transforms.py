"""The operators under ``torch.func`` transforms: ``grad``, ``vjp``, ``jacrev``, ``vmap`` and their compositions
(per-sample gradients: ``vmap(grad(f))``).

torch refuses a custom operator's autograd under these transforms: the ``autograd.Function`` that
``torch.library.register_autograd`` makes has no ``setup_context``, which transforms require (torch 2.11 and 2.13;
pytorch/pytorch#168393).  :func:`cudnn_attn.torch.api.sdpa` therefore runs an eager call under a transform as
:class:`TransformedAttention` (unless a dispatch mode is active, which must see the operator): the operators' implementations, residuals and gradients (bit for bit the operators'),
with ``setup_context`` apart from the forward.  Its backward is :class:`TransformedAttentionBackward`, so that a
transform above the gradient (``vmap``) sees a function it can batch.  Both batch a ``vmap`` by folding the mapped
dimension into the batch: one call of ``V * B`` sequences, not ``V`` calls (torch's fallback for the operators).

Forward-mode transforms (``jvp``, ``jacfwd``) are refused by torch: cuDNN has no forward-mode attention.  Not twice
differentiable, as the operators are not.  ``torch.compile`` traces the operators, not these functions.
"""

from __future__ import annotations

from typing import Any

import torch

from .ops import _backward_implementation, _check_trained, _forward, _seed

__all__ = ["TransformedAttention", "TransformedAttentionBackward"]


class TransformedAttention(torch.autograd.Function):
    """``apply(query, key, value, q_lengths, kv_lengths, keep, seed_offset, static, training)`` -> ``(output,
    logsumexp)``: :func:`~cudnn_attn.torch.ops.attention_op` of those tensors, ``static`` its ``(scale, causal,
    bottom_right, window, dropout_rate, seed, layout)``."""

    @staticmethod
    def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, q_lengths: Any, kv_lengths: Any,
                keep: Any, seed_offset: Any, static: tuple, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        running = static[:5] + (_seed(static[5], seed_offset), static[6])
        return _forward(query, key, value, q_lengths, kv_lengths, keep, running, training)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        query, key, value, q_lengths, kv_lengths, keep, seed_offset, static, training = inputs
        ctx.save_for_backward(query, key, value, *output, q_lengths, kv_lengths, keep, seed_offset)
        ctx.static, ctx.training = static, training
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)          # no zero-filled gradient of the logsumexp

    @staticmethod
    def backward(ctx: Any, grad_output: Any, _: Any) -> tuple:
        _check_trained(ctx.training)
        if grad_output is None:                   # the output was not used
            return (None,) * 9
        query, key, value, output, logsumexp, q_lengths, kv_lengths, keep, seed_offset = ctx.saved_tensors
        grads = TransformedAttentionBackward.apply(query, key, value, output, grad_output, logsumexp, q_lengths,
                                                   kv_lengths, keep, seed_offset, ctx.static)
        return (*grads, None, None, None, None, None, None)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, query, key, value, q_lengths, kv_lengths, keep, seed_offset, static,
             training) -> tuple:
        size, batch = _sizes(info, in_dims, (query, key, value))
        q, k, v, q_lengths, kv_lengths = (_folded(x, d, size) for x, d in
                                          zip((query, key, value, q_lengths, kv_lengths), in_dims))
        keep = _folded_keep(keep, in_dims[5], size, batch)
        output, logsumexp = TransformedAttention.apply(q, k, v, q_lengths, kv_lengths, keep,
                                                       _unmapped_seed(seed_offset, in_dims[6]), static, training)
        output = output.unflatten(0, (size, batch))
        if not training:                          # the empty logsumexp: one for every sample
            return (output, logsumexp), (0, None)
        return (output, logsumexp.unflatten(0, (size, batch))), (0, 0)


class TransformedAttentionBackward(torch.autograd.Function):
    """``apply(query, key, value, output, grad_output, logsumexp, q_lengths, kv_lengths, keep, seed_offset,
    static)`` -> ``(dq, dk, dv)``: :func:`~cudnn_attn.torch.ops.attention_backward_op` of those tensors."""

    @staticmethod
    def forward(query, key, value, output, grad_output, logsumexp, q_lengths, kv_lengths, keep, seed_offset,
                static) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _backward_implementation(query, key, value, output, grad_output, logsumexp, q_lengths, kv_lengths,
                                        keep, *static, seed_offset)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        raise RuntimeError("cudnn_attn::attention is not twice differentiable: its backward has no gradient")

    @staticmethod
    def vmap(info: Any, in_dims: tuple, query, key, value, output, grad_output, logsumexp, q_lengths, kv_lengths,
             keep, seed_offset, static) -> tuple:
        size, batch = _sizes(info, in_dims, (query, key, value, output, grad_output))
        folded = [_folded(x, d, size) for x, d in zip((query, key, value, output, grad_output, logsumexp,
                                                       q_lengths, kv_lengths), in_dims)]
        keep = _folded_keep(keep, in_dims[8], size, batch)
        grads = TransformedAttentionBackward.apply(*folded, keep, _unmapped_seed(seed_offset, in_dims[9]), static)
        return tuple(g.unflatten(0, (size, batch)) for g in grads), (0, 0, 0)


def _sizes(info: Any, in_dims: tuple, tensors: tuple) -> tuple[int, int]:
    """The mapped size and the calls' batch (the first dimension of the query's layout, which every layout of the
    torch front has)."""
    query, dim = tensors[0], in_dims[0]
    return info.batch_size, query.shape[1 if dim is not None else 0]


def _folded(x: Any, dim: Any, size: int) -> Any:
    """``x`` with the mapped dimension (``dim``; ``None``: not mapped, every sample's the same) folded into its
    first: ``(size * B, ...)``."""
    if x is None:
        return None
    x = x.movedim(dim, 0) if dim is not None else x.expand(size, *x.shape)
    return x.flatten(0, 1)


def _folded_keep(keep: Any, dim: Any, size: int, batch: int) -> Any:
    """A keep-mask broadcastable to ``(B, N, T, S)``, mapped or not, as one broadcastable to ``(size * B, N, T,
    S)``."""
    if keep is None:
        return None
    if dim is None:
        keep = keep.reshape((1,) * (4 - keep.dim()) + tuple(keep.shape))
        return keep if keep.shape[0] == 1 else keep.repeat(size, 1, 1, 1)
    keep = keep.movedim(dim, 0)
    keep = keep.reshape((size,) + (1,) * (5 - keep.dim()) + tuple(keep.shape[1:]))
    return keep.expand(size, batch, *keep.shape[2:]).flatten(0, 1)


def _unmapped_seed(seed_offset: Any, dim: Any) -> Any:
    """A device dropout seed is one ``[seed, offset]`` for the whole folded call; a mapped one is refused."""
    if dim is not None:
        raise ValueError(f"seed: a device seed mapped by vmap (shape {list(seed_offset.shape)}) is not supported; "
                         f"pass one int64 [seed, offset] tensor for every sample")
    return seed_offset
