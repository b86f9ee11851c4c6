"""The values cuDNN uses as addresses: sequence lengths, packed-segment offsets, page-table entries.

:func:`~cudnn_attn.core.validation.validate_call` never reads array values.  Three of the operands are read by
cuDNN as positions, though - a length past ``T``/``S``, an offset past the row, a page id past the cache
would make it read or write outside the buffers.  This module owns their rules and the two ways of
enforcing them:

* :func:`check` reads the values on the host and raises ``ValueError`` naming the argument, the row
  and the value.  Concrete host values (NumPy arrays, JAX arrays that are not being traced) are always
  checked (:func:`check_concrete`); device values are checked in the *checked mode* (``check_values=True``,
  or ``CUDNN_ATTN_CHECK_VALUES=1`` for whole programs; :func:`checking`), at the cost of a host read
  (CuPy: before the launch; JAX under ``jit``: a host callback at run time, see :mod:`cudnn_attn.jax_bridge.api`).
* :func:`sanitize` clamps device values into ranges where cuDNN cannot leave the buffers, with array
  operations only (``xp`` is ``cupy`` or ``jax.numpy``: no host synchronisation, usable under ``jit``).

The rules (``T``/``S`` the query/key length, ``S`` logical ``blocks_per_seq * block_size`` when paged)
and what :func:`sanitize` does with a value that breaks them:

===================  ==============================================  =========================================
operand              rule (checked)                                  sanitized (unchecked device values)
===================  ==============================================  =========================================
``q_seqlen`` (B,)    ``0 <= q_seqlen[b] <= T``                       clamped into ``[0, T]``
``kv_seqlen`` (B,)   ``0 <= kv_seqlen[b] <= S``                      clamped into ``[0, S]``
packed ``(B, M)``    row ``b`` lists its ``n`` segments first        a slot with any negative entry among its
lengths and          (lengths, offsets ``>= 0``), then ``-1``        four becomes absent (all four ``-1``); the
``(B, M + 1)``       everywhere else (the last offsets column is     present slots move to the front of the
offsets              always ``-1``); segment ``m`` lies in the row   row in order; offsets are clamped into
                     (``offset + length <= T`` / ``S``) and starts   ``[0, T]`` / ``[0, S]`` and lengths into
                     where segment ``m - 1`` ends or later           ``[0, T - offset]`` / ``[0, S - offset]``
``page_table_k/v``   entries of blocks holding a token               clamped into ``[0, num_blocks - 1]`` (all
``(B, 1, P, 1)``     ``< kv_seqlen[b]`` lie in ``[0, num_blocks)``   entries; unused ones are never read)
===================  ==============================================  =========================================

A clamped call computes what the reference computes for the clamped values: a sequence longer than
its buffer is cut at the buffer, a page id past the cache reads its last block.  Overlapping or
out-of-order packed segments stay inside the buffers (each lies in its row) and are computed as given
on the GPU; the reference, which needs ordered segments, refuses them under ``jit`` at run time.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from . import settings
from .config import AttentionConfig, AttentionOperands

ENV_VAR = settings.CHECK_VALUES
FIELDS = ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "page_table_k", "page_table_v")


def checking(check_values: bool | None) -> bool:
    """Whether values are checked: ``check_values`` when given, else the environment variable
    ``CUDNN_ATTN_CHECK_VALUES`` (``1``/``true``/``yes`` turn it on).

    Raises:
        ValueError: ``check_values`` is neither a bool nor ``None``.
    """
    if check_values is None:
        return settings.check_values()
    if not isinstance(check_values, (bool, np.bool_)):
        raise ValueError(f"check_values: must be True, False or None (then ${ENV_VAR} decides), got {check_values!r}")
    return bool(check_values)


def present(operands: AttentionOperands) -> dict[str, Any]:
    """The value operands of a call, by name."""
    return {name: getattr(operands, name) for name in FIELDS if getattr(operands, name) is not None}


# -- host checks ----------------------------------------------------------------------------------------

def is_concrete(x: Any) -> bool:
    """``x`` can be read on the host without tracing or a device copy by this library's choice: a NumPy
    array or a JAX array that is not a tracer (its read may wait for the device)."""
    if isinstance(x, (np.ndarray, np.generic)):
        return True
    import sys

    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)


def _host(x: Any) -> np.ndarray:
    import sys

    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        x = x.get()
    return np.asarray(x).astype(np.int64)


def check(config: AttentionConfig, operands: AttentionOperands, names: Mapping[str, str] | None = None) -> None:
    """Read the value operands on the host (NumPy as is, CuPy with ``.get()``, JAX with ``numpy.asarray``)
    and check them (module doc).  ``names`` renames arguments in messages (the ``jax.nn`` drop-in's).

    Raises:
        ValueError: naming the argument, the row and the value.
    """
    check_arrays(config, {name: _host(x) for name, x in present(operands).items()}, names)


def check_concrete(config: AttentionConfig, operands: AttentionOperands,
                   names: Mapping[str, str] | None = None) -> bool:
    """:func:`check` when every value operand is concrete (:func:`is_concrete`); returns whether it ran."""
    found = present(operands)
    if not all(is_concrete(x) for x in found.values()):
        return False
    check(config, operands, names)
    return True


def check_arrays(config: AttentionConfig, arrays: Mapping[str, np.ndarray],
                 names: Mapping[str, str] | None = None) -> None:
    """The rules on host integer arrays ``name -> values`` (module doc)."""
    names = names or {}

    def error(name: str, rule: str) -> ValueError:
        return ValueError(f"{names.get(name, name)}: {rule}  ({config.describe()})")

    if config.packing is not None:
        _check_packed(config, arrays, error)
    elif config.mask.padding:
        for name, limit, axis in (("q_seqlen", config.q_len, "T"), ("kv_seqlen", config.kv_len, "S")):
            lengths = arrays[name]
            bad = np.flatnonzero((lengths < 0) | (lengths > limit))
            if bad.size:
                b = int(bad[0])
                raise error(name, f"row {b} is {int(lengths[b])}, outside [0, {limit}] ({axis} = {limit}); "
                                  f"all rows: {lengths.tolist()}")
    if config.paging is not None and "page_table_k" in arrays:     # (absent only while inputs are generated)
        _check_pages(config, arrays, error)


def _check_packed(config: AttentionConfig, arrays: Mapping[str, np.ndarray], error: Any) -> None:
    q_seqlen = arrays["q_seqlen"]
    for b in range(q_seqlen.shape[0]):
        count = int((q_seqlen[b] >= 0).sum())
        for name in ("q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets"):
            valid = arrays[name][b] >= 0
            if not valid[:count].all() or valid[count:].any():
                raise error(name, f"row {b} is {arrays[name][b].tolist()}, but q_seqlen[{b}] = "
                                  f"{q_seqlen[b].tolist()} has {count} segment(s); each row must list exactly its "
                                  f"{count} segment(s) first (start offsets, lengths) and pad the rest with -1")
        for side, limit in (("q", config.q_len), ("kv", config.kv_len)):
            offsets, lengths = arrays[f"{side}_offsets"][b], arrays[f"{side}_seqlen"][b]
            end = 0
            for m in range(count):
                start, stop = int(offsets[m]), int(offsets[m]) + int(lengths[m])
                if stop > limit:
                    raise error(f"{side}_offsets", f"row {b}, segment {m}: [{start}, {stop}) (offset {start}, length "
                                                   f"{int(lengths[m])}) must lie inside the row of {limit} tokens")
                if start < end:
                    raise error(f"{side}_offsets", f"row {b}, segment {m} starts at {start}, before segment {m - 1} "
                                                   f"ends at {end}: segments must be in order and must not overlap")
                end = stop


def _check_pages(config: AttentionConfig, arrays: Mapping[str, np.ndarray], error: Any) -> None:
    paging, kv_lengths = config.paging, arrays["kv_seqlen"]
    for name, blocks in (("page_table_k", paging.num_blocks_k), ("page_table_v", paging.num_blocks_v)):
        table = arrays[name].reshape(arrays[name].shape[0], -1)                      # (B, blocks_per_seq)
        used = np.arange(table.shape[1])[None, :] * paging.block_size < kv_lengths[:, None]
        bad = np.argwhere(used & ((table < 0) | (table >= blocks)))
        if bad.size:
            b, j = (int(i) for i in bad[0])
            raise error(name, f"row {b}: entry [{b}, 0, {j}, 0] = {int(table[b, j])} is not a block index of the "
                              f"cache (0 <= index < num_blocks = {blocks}); it is used since kv_seqlen[{b}] = "
                              f"{int(kv_lengths[b])} > {j * paging.block_size}")


# -- device guard ---------------------------------------------------------------------------------------

def sanitize(config: AttentionConfig, operands: AttentionOperands, xp: Any) -> AttentionOperands:
    """``operands`` with every value operand clamped (module doc) by array operations of ``xp``
    (``cupy`` or ``jax.numpy``; ``numpy`` works too): no host synchronisation, traceable under ``jit``.
    Operands without value operands are returned as they are."""
    changes: dict[str, Any] = {}
    if config.packing is not None:
        changes.update(_sanitize_packed(config, operands, xp))
    elif config.mask.padding:
        changes["q_seqlen"] = _clamp(xp, operands.q_seqlen, 0, config.q_len)
        changes["kv_seqlen"] = _clamp(xp, operands.kv_seqlen, 0, config.kv_len)
    if config.paging is not None:
        changes["page_table_k"] = _clamp(xp, operands.page_table_k, 0, config.paging.num_blocks_k - 1)
        changes["page_table_v"] = _clamp(xp, operands.page_table_v, 0, config.paging.num_blocks_v - 1)
    return operands.replace(**changes) if changes else operands


def _clamp(xp: Any, x: Any, low: int, high: Any) -> Any:
    """The int32 ``x`` clamped into ``[low, high]`` (``high`` may be an array): one kernel for scalar bounds."""
    if isinstance(high, int):
        return xp.clip(x, low, high)
    return xp.minimum(xp.maximum(x, low), high)


def _sanitize_packed(config: AttentionConfig, operands: AttentionOperands, xp: Any) -> dict[str, Any]:
    batch, slots = config.batch, config.packing.max_segments
    q_offsets, kv_offsets = operands.q_offsets[:, :slots], operands.kv_offsets[:, :slots]
    q_seqlen, kv_seqlen = operands.q_seqlen, operands.kv_seqlen
    present_ = (q_offsets >= 0) & (kv_offsets >= 0) & (q_seqlen >= 0) & (kv_seqlen >= 0)
    # Present slots first, in order: sort by (absent, slot); the keys are distinct, so any sort is stable.
    order = xp.argsort(xp.where(present_, 0, slots) + xp.arange(slots, dtype=xp.int32)[None, :], axis=1)
    present_ = xp.take_along_axis(present_, order, axis=1)

    def side(offsets: Any, lengths: Any, limit: int) -> tuple[Any, Any]:
        start = _clamp(xp, xp.take_along_axis(offsets, order, axis=1), 0, limit)
        length = _clamp(xp, xp.take_along_axis(lengths, order, axis=1), 0, limit - start)
        return xp.where(present_, start, -1), xp.where(present_, length, -1)

    q_start, q_length = side(q_offsets, q_seqlen, config.q_len)
    kv_start, kv_length = side(kv_offsets, kv_seqlen, config.kv_len)
    last = xp.full((batch, 1), -1, dtype=xp.int32)
    return dict(q_seqlen=q_length, kv_seqlen=kv_length, q_offsets=xp.concatenate([q_start, last], axis=1),
                kv_offsets=xp.concatenate([kv_start, last], axis=1))
