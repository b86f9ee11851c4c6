"""The steps of a call around its launch, one implementation for every front and any array namespace ``xp``
(``numpy``, ``cupy``, ``jax.numpy``): the CuPy front's :class:`~cudnn_attn.engine.prepared.PreparedCall` and the
JAX bridge (:mod:`cudnn_attn.jax_bridge.api`, its context-parallel block calls, its CPU reference target) run
these functions, and only the launch differs (a cuDNN plan on CuPy buffers; a JAX primitive).

* :func:`named_operands` / :func:`attention_operands` - between
  :class:`~cudnn_attn.core.config.AttentionOperands` (plus the backward's residuals) and the call's arrays by
  name, in the binding order of :attr:`CallSpec.operands <cudnn_attn.engine.call.CallSpec.operands>`;
* :func:`guard_values` - lengths, offsets and page ids checked on the host or clamped on the device
  (:mod:`cudnn_attn.core.values`);
* :func:`dense_bias` - the bias as cuDNN reads it: in the io dtype, dense;
* :func:`run_padded` - a call that the kernel takes only at even lengths (or in the BTNH layout) run lifted and
  sliced back (:mod:`cudnn_attn.core.padded_call`).

The fix-ups of rows a boolean mask keeps no key of are :mod:`cudnn_attn.core.masked_rows`' (also for any ``xp``).
Nothing here imports an array library but NumPy (the host check's copies).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from cudnn_attn.core import values
from cudnn_attn.core.config import AttentionConfig, AttentionOperands
from cudnn_attn.core.padded_call import lift, lifted_config
from cudnn_attn.core.types import FP8_BWD_KEYS, FP8_FWD_KEYS, AttentionGrads, AttentionOutput

from .call import BWD, FWD, RESIDUALS, CallSpec, score_mod_arg_name

__all__ = ["attention_operands", "dense_bias", "guard_values", "named_operands", "run_padded"]

Launch = Callable[[AttentionConfig, Mapping[str, Any]], Mapping[str, Any]]


# -- between AttentionOperands and named arrays ------------------------------------------------------

def named_operands(config: AttentionConfig, kind: str, operands: AttentionOperands,
                   residuals: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``operands`` (plus the backward's ``residuals``: ``output``, ``grad_output``, ``logsumexp``) as
    ``name -> array``, in binding order (:attr:`CallSpec.operands <cudnn_attn.engine.call.CallSpec.operands>`)."""
    found = {}
    for name in CallSpec.of(config, kind).operands:
        if name.startswith("score_mod_arg_"):
            found[name] = operands.score_mod_args[int(name.rsplit("_", 1)[1])]
        elif name in RESIDUALS:
            found[name] = residuals[name]
        elif config.fp8 and name in operands.fp8_scales:
            found[name] = operands.fp8_scales[name]
        else:
            found[name] = getattr(operands, name)
    return found


def attention_operands(config: AttentionConfig, kind: str,
                       named: Mapping[str, Any]) -> tuple[AttentionOperands, dict[str, Any]]:
    """The inverse of :func:`named_operands`: ``(AttentionOperands, residuals)`` from the arrays by name."""
    fields = {name: named[name] for name in AttentionOperands.__dataclass_fields__ if name in named}
    score_mod_args = tuple(named[score_mod_arg_name(i)]
                           for i in range(len(config.score_mod.arg_shapes) if config.score_mod else 0))
    fp8_keys = (FP8_FWD_KEYS if kind == FWD else FP8_BWD_KEYS) if config.fp8 else ()
    operands = AttentionOperands(**fields, score_mod_args=score_mod_args,
                                 fp8_scales={k: named[k] for k in fp8_keys} if config.fp8 else None)
    return operands, {name: named[name] for name in RESIDUALS if name in named}


# -- value guards ----------------------------------------------------------------------------------------

def guard_values(config: AttentionConfig, operands: AttentionOperands, xp: Any, check_values: bool | None = None,
                 names: Mapping[str, str] | None = None,
                 check_later: Callable[[Callable[..., None], tuple], None] | None = None) -> AttentionOperands:
    """``operands`` whose lengths, offsets and page ids cannot take cuDNN outside the buffers
    (:mod:`cudnn_attn.core.values`): clamped with ``xp``, or in the checked mode (``check_values``,
    :func:`~cudnn_attn.core.values.checking`) checked on the host.

    ``check_later(check, arrays)`` is how a front whose values may be traced defers that check (JAX: a
    ``jax.debug.callback`` at run time; the values are clamped besides); such a front may also be given concrete
    host values (eager JAX arrays, NumPy), which are checked now and pass unchanged.  Without it (CuPy: device
    arrays) the checked mode reads the values now, a device-host copy, and passes them unchanged.  ``names``
    renames arguments in the messages (the ``jax.nn`` drop-in's).

    Raises:
        ValueError: a value breaks the rules, or ``check_values`` is not a bool or ``None``.
    """
    found = values.present(operands)
    if not found:                                  # the environment is read only for a call with values
        if check_values is not None:
            values.checking(check_values)          # a bad value fails here, named
        return operands
    checked = values.checking(check_values)
    if check_later is None:
        if not checked:
            return values.sanitize(config, operands, xp)
        values.check(config, operands, names)
        return operands
    if values.check_concrete(config, operands, names):
        return operands
    if checked:
        order = tuple(found)

        def check_on_host(*arrays: Any) -> None:
            values.check_arrays(config, {n: np.asarray(a).astype(np.int64) for n, a in zip(order, arrays)}, names)

        check_later(check_on_host, tuple(found.values()))
    return values.sanitize(config, operands, xp)


# -- the bias -------------------------------------------------------------------------------------------

def dense_bias(operands: AttentionOperands, xp: Any) -> AttentionOperands:
    """``operands`` with a bias cuDNN can read: in the query's (io) dtype and, for an array with memory layout
    (NumPy, CuPy; a JAX array is always dense), C-contiguous.  A bias validation folded from a mask may be neither:
    CuPy 14's bfloat16 ``where`` computes in float32, and a broadcast or sliced bias is a strided view."""
    bias = operands.bias
    if bias is None:
        return operands
    flags = getattr(bias, "flags", None)
    if bias.dtype == operands.query.dtype and (flags is None or flags.c_contiguous):
        return operands
    if flags is None:
        return operands.replace(bias=bias.astype(operands.query.dtype))
    return operands.replace(bias=xp.ascontiguousarray(bias.astype(operands.query.dtype, copy=False)))


# -- odd lengths -----------------------------------------------------------------------------------------

def run_padded(kind: str, config: AttentionConfig, named: Mapping[str, Any], xp: Any, launch: Launch) -> dict[str, Any]:
    """``launch(config, named)`` (the ``kind`` kernel on the arrays by name), run lifted
    (:func:`cudnn_attn.core.padded_call.lift` with ``xp``) and sliced back when the kernel needs it."""
    if lifted_config(config) is None:
        return dict(launch(config, named))
    operands, residuals = attention_operands(config, kind, named)
    lifted = lift(config, operands, xp)
    padded = dict(zip(RESIDUALS, lifted.residuals(*(residuals.get(name) for name in RESIDUALS))))
    results = launch(lifted.config, named_operands(lifted.config, kind, lifted.operands,
                                                   padded if kind == BWD else None))
    container = AttentionOutput if kind == FWD else AttentionGrads
    unpadded = lifted.unpad(container(**{name: results.get(name) for name in container._fields}))
    return {name: getattr(unpadded, name) for name in results}
