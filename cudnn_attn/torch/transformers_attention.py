"""Hugging Face transformers (5.x) on cuDNN attention: ``register_transformers()`` then
``attn_implementation="cudnn_attn"``.

The mask function registered is transformers' own ``sdpa_mask``: a boolean ``(B, 1, T, S)`` keep-mask (True
keeps), or ``None`` where the call is plain causal attention (no padding, ``T == S`` or one query, or a
prefill into an empty static cache).  :func:`transformers_attention` follows ``sdpa_attention_forward``'s rules
for it:

* a keep-mask runs as :func:`cudnn_attn.keep` (left padding, decoding against a padded cache, the static
  cache's empty slots, sliding windows: whatever the mask says);
* no mask and ``T > 1`` runs top-left causal over the first ``T`` keys (equal to bottom-right when ``T == S``;
  with ``S > T`` the keys past ``T`` are a static cache's empty slots, which sdpa crops the same way);
* no mask and ``T == 1`` (decoding without padding) attends to the whole cache.

Key/value heads may divide the query heads (GQA: transformers passes them unrepeated).  Under
``generate(cache_implementation="static")`` transformers compiles the forward with ``torch.compile``; the
call is a custom operator (:mod:`cudnn_attn.torch.ops`), opaque to the tracer.
"""

from __future__ import annotations

from typing import Any

import torch

from .api import sdpa

__all__ = ["register_transformers", "transformers_attention"]


def transformers_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0,
                           scaling: float | None = None, is_causal: bool | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An attention function of transformers' ``AttentionInterface``: ``query`` ``(B, N, T, H)``, ``key``/``value``
    ``(B, K, S, H)``, ``attention_mask`` the registered mask function's (module doc).  Returns the output
    ``(B, T, N, H)`` and ``None`` (no attention weights)."""
    if kwargs.get("output_attentions") or kwargs.get("s_aux") is not None \
            or kwargs.get("position_bias") is not None:
        raise ValueError("attention: cudnn_attn's transformers attention computes no attention weights and takes "
                         "no sinks (s_aux) or position bias; use attn_implementation='eager' for this model")
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        raise ValueError(f"attention_mask: expected the boolean keep-mask of the cudnn_attn mask function, got "
                         f"{attention_mask.dtype}{list(attention_mask.shape)} (register the mask with "
                         f"cudnn_attn.torch.register_transformers)")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q_length, kv_length = query.shape[2], key.shape[2]
    causal = q_length > 1 and attention_mask is None and causal
    if causal and kv_length > q_length:
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    seed = 0
    if dropout > 0:             # a new dropout mask per call, drawn on the device: inside a CUDA graph too
        seed = torch.randint(0, 2 ** 62, (2,), device=query.device) if query.is_cuda else \
            int(torch.randint(0, 2 ** 62, (), device="cpu"))
    output, _ = sdpa(query, key, value, causal=causal, keep=attention_mask, scale=scaling, dropout_rate=dropout,
                     seed=seed, layout="BNTH")
    return output.transpose(1, 2), None


def register_transformers(name: str = "cudnn_attn") -> str:
    """Register :func:`transformers_attention` with ``transformers.AttentionInterface`` and transformers' ``sdpa_mask``
    with ``transformers.masking_utils.AttentionMaskInterface`` under ``name``; returns ``name``, the value of
    ``attn_implementation`` (``LlamaConfig(..., attn_implementation=name)``, ``from_pretrained(...,
    attn_implementation=name)`` or ``model.set_attn_implementation(name)``)."""
    import transformers
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if not isinstance(name, str) or not name:
        raise ValueError(f"name: must be a non-empty string, got {name!r}")
    transformers.AttentionInterface.register(name, transformers_attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
