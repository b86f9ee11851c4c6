"""The operators under ``torch.func`` transforms: ``grad``, ``vjp``, ``jacrev``, ``vmap`` and their compositions
(per-sample gradients: ``vmap(grad(f))``).

torch refuses a custom operator's autograd under these transforms: the ``autograd.Function`` that
``torch.library.register_autograd`` makes has no ``setup_context``, which transforms require (torch 2.11 and 2.13;
pytorch/pytorch#168393).  :func:`cudnn_attn.torch.api.sdpa` therefore runs an eager call under a transform as
:class:`TransformedAttention` (unless a dispatch mode is active, which must see the operator): the operators'
implementations, residuals and gradients (bit for bit the operators'), with ``setup_context`` apart from the
forward.  Its backward is :class:`TransformedAttentionBackward`, so that a
transform above the gradient (``vmap``) sees a function it can batch.  Both batch a ``vmap`` by folding the mapped
dimension into the batch: one call of ``V * B`` sequences, not ``V`` calls (torch's fallback for the operators).

Forward-mode transforms (``jvp``, ``jacfwd``) are refused by torch: cuDNN has no forward-mode attention.  Not twice
differentiable, as the operators are not.  ``torch.compile`` traces the operators, not these functions.
"""

from __future__ import annotations

from typing import Any

import torch

from .ops import _backward, _backward_implementation, _forward, _seed, _setup_context

__all__ = ["TransformedAttention", "TransformedAttentionBackward"]


class TransformedAttention(torch.autograd.Function):
    """``apply`` takes :func:`~cudnn_attn.torch.ops.attention_op`'s 15 arguments and returns its ``(output,
    logsumexp)``, with the operator's residuals (``setup_context``) and gradient."""

    setup_context = staticmethod(_setup_context)

    @staticmethod
    def forward(query, key, value, q_lengths, kv_lengths, keep, scale, causal, bottom_right, window, dropout_rate,
                seed, layout, training, seed_offset) -> tuple[torch.Tensor, torch.Tensor]:
        static = (scale, causal, bottom_right, window, dropout_rate, _seed(seed, seed_offset), layout)
        return _forward(query, key, value, q_lengths, kv_lengths, keep, static, training)

    @staticmethod
    def backward(ctx: Any, grad_output: Any, grad_logsumexp: Any) -> tuple:
        return _backward(ctx, grad_output, grad_logsumexp, TransformedAttentionBackward.apply)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *arguments: Any) -> tuple:
        size, batch = info.batch_size, _batch(arguments[0], in_dims[0])
        folded = [_folded(x, d, size) for x, d in zip(arguments[:5], in_dims)]
        keep = _folded_keep(arguments[5], in_dims[5], size, batch)
        seed_offset = _unmapped_seed(arguments[14], in_dims[14])
        output, logsumexp = TransformedAttention.apply(*folded, keep, *arguments[6:14], seed_offset)
        output = output.unflatten(0, (size, batch))
        if not arguments[13]:                     # not training: the empty logsumexp, one for every sample
            return (output, logsumexp), (0, None)
        return (output, logsumexp.unflatten(0, (size, batch))), (0, 0)


class TransformedAttentionBackward(torch.autograd.Function):
    """``apply`` takes :func:`~cudnn_attn.torch.ops.attention_backward_op`'s 17 arguments and returns its ``(dq,
    dk, dv)``."""

    forward = staticmethod(_backward_implementation)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple:
        raise RuntimeError("cudnn_attn::attention is not twice differentiable: its backward has no gradient")

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *arguments: Any) -> tuple:
        size, batch = info.batch_size, _batch(arguments[0], in_dims[0])
        folded = [_folded(x, d, size) for x, d in zip(arguments[:8], in_dims)]
        keep = _folded_keep(arguments[8], in_dims[8], size, batch)
        seed_offset = _unmapped_seed(arguments[16], in_dims[16])
        grads = TransformedAttentionBackward.apply(*folded, keep, *arguments[9:16], seed_offset)
        return tuple(g.unflatten(0, (size, batch)) for g in grads), (0, 0, 0)


def _batch(query: torch.Tensor, dim: Any) -> int:
    """The calls' batch: the query's first dimension in every layout of the torch front (its second where mapped at
    0, as :func:`_folded` moves it)."""
    return query.shape[0] if dim is None else query.movedim(dim, 0).shape[1]


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
