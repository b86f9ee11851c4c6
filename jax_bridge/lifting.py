"""Primitive calls on named operands, padded to even lengths where cuDNN needs it (:mod:`cudnn_attn.core.padded_call`:
training with a bias at odd ``T`` or ``S``, the backward at ``T == S == 1``).  Used by the API for every
call and by :mod:`.context_parallel` for its block calls (sliced windows make odd blocks)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax.numpy as jnp

from cudnn_attn.core.config import AttentionConfig
from cudnn_attn.core.padded_call import lift, lifted_config
from cudnn_attn.core.types import AttentionGrads, AttentionOutput

from .signature import BWD, FWD, RESIDUALS, attention_operands, named_operands, operand_names

Call = Callable[[AttentionConfig, Mapping[str, Any]], Mapping[str, Any]]


def run(kind: str, config: AttentionConfig, operands: Mapping[str, Any], call: Call) -> dict[str, Any]:
    """``call(config, operands)`` (the ``kind`` kernel on named operands), padded when it must be."""
    if lifted_config(config) is None:
        return dict(call(config, operands))
    found, residuals = attention_operands(config, kind, [operands[name] for name in operand_names(config, kind)])
    lifted = lift(config, found, jnp)
    padded = dict(zip(RESIDUALS, lifted.residuals(*(residuals.get(name) for name in RESIDUALS))))
    results = call(lifted.config, named_operands(lifted.config, kind, lifted.operands, padded if kind == BWD else None))
    container = AttentionOutput if kind == FWD else AttentionGrads
    unpadded = lifted.unpad(container(**{name: results.get(name) for name in container._fields}))
    return {name: getattr(unpadded, name) for name in results}
