"""Kernel limits lifted by reshaping the call: training with a bias at odd ``T`` or ``S`` and the backward at
``T == S == 1`` (padded), packed segments in the BNTH layout (run as BTNH).

Packed segments need the token-major BTNH layout (cuDNN's ragged offsets index tokens).  A packed BNTH call
runs as BTNH: Q/K/V (and the backward's O and dO) are transposed in, the output and dQ/dK/dV transposed back;
the logsumexp's ``(B*M, N, T)`` shape is the same in both layouts, and offsets and lengths count tokens in
both.  The transposition comes first, so a packed BNTH backward at ``T == S == 1`` is transposed, then padded.

cuDNN refuses a bottom-right causal mask (or window) next to a bias.  Without padding its diagonal is the
static offset ``S - T``, so such a call runs with the mask folded into the bias, as validation folds a
boolean mask: the bias gets the large negative number of the io dtype at every key ``j`` with
``d = j - i - (S - T) > right_bound`` or ``-d >= left_bound``, and the configuration loses its diagonal.
The bias keeps its shape and stays differentiable; dbias is 0 at the masked keys, as with the mask.  With a
padding mask the diagonal moves with each sequence's lengths, and the call stays refused.

cuDNN's training graphs need even sequence lengths when a bias is present (the seed refuses such calls:
"cuDNN doesn't support bias with odd sequence length in training"), and its backward refuses
``T == S == 1`` (a deviceless cuDNN 9.19 sm90 build fails).  Both are lifted the same way, front-neutrally
(``xp`` is ``numpy``, ``cupy`` or ``jax.numpy``):

* every odd length among ``T`` and ``S`` (or both lengths, at ``T == S == 1``) grows by one; Q/K/V (and the
  backward's O, dO, logsumexp) get a zero row there, the bias a zero row and column;
* the call gets cuDNN's padding mask with the *true* lengths: the user's ``q_seqlen``/``kv_seqlen`` when the
  call already had a padding mask (they never exceed the true lengths), else the full ``T`` and ``S``.  The
  added position is therefore outside every sequence: no query attends to it and it attends to nothing;
  its results are zero and are sliced away;
* results are sliced back to ``T``/``S`` (:meth:`Lifted.unpad`).

Every mask combines with it: causal and windows keep their positions (the added row and column come
last); a bottom-right diagonal with the true lengths has the same offset ``S - T`` as without padding;
packed segments keep their offsets (the added token belongs to no segment).  Not lifted: FP8 (its own
length rules: multiples of 128) and paged K/V (no backward).  Dropout: the lifted call draws cuDNN's
Philox mask of the padded ``(T', S')`` problem, a valid dropout mask but not the one of the unpadded
positions (only visible when comparing against ``rng_dump`` of an unpadded call).

Use: ``lifted = lift(config, operands, xp)`` (``None`` when nothing needs lifting), run
``lifted.config`` on ``lifted.operands`` (the backward: ``lifted.residuals(output, grad_output,
logsumexp)`` too), then ``lifted.unpad(result)`` on the :class:`~.types.AttentionOutput` or
:class:`~.types.AttentionGrads`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .config import AttentionConfig, AttentionOperands, BiasSpec, DiagonalAlignment
from .types import AttentionGrads, AttentionLayout, AttentionOutput
from .validation import LARGE_NEGATIVE

__all__ = ["Lifted", "folds_diagonal", "lift", "lifted_config"]


def _padded_lengths(config: AttentionConfig) -> tuple[int, int] | None:
    """The ``(T', S')`` the call runs at, or ``None`` when no limit applies."""
    if not config.training or config.fp8 or config.paging is not None:
        return None
    if config.q_len == 1 and config.kv_len == 1:
        return 2, 2
    if config.bias is not None and (config.q_len % 2 or config.kv_len % 2):
        return config.q_len + config.q_len % 2, config.kv_len + config.kv_len % 2
    return None


def _transposed(config: AttentionConfig) -> bool:
    """``config`` runs in the BTNH layout instead of its own (packed segments in BNTH)."""
    return config.packing is not None and config.layout is not AttentionLayout.BTNH


def folds_diagonal(config: AttentionConfig) -> bool:
    """``config``'s bottom-right diagonal runs folded into its bias (module doc)."""
    mask = config.mask
    return (mask.alignment is DiagonalAlignment.BOTTOM_RIGHT and mask.right_bound is not None
            and config.bias is not None and not mask.padding and not mask.alibi and not config.fp8
            and config.score_mod is None)


def lifted_config(config: AttentionConfig) -> AttentionConfig | None:
    """The configuration that runs ``config`` (module doc), or ``None`` when it runs as it is."""
    lengths, transposed, folds = _padded_lengths(config), _transposed(config), folds_diagonal(config)
    if lengths is None and not transposed and not folds:
        return None
    if transposed:                                     # new dense arrays: the callers' strides do not apply
        config = config.replace(layout=AttentionLayout.BTNH, strides=None)
    if folds:
        config = config.replace(mask=dataclasses.replace(config.mask, right_bound=None, left_bound=None,
                                                          alignment=DiagonalAlignment.TOP_LEFT))
    if lengths is None:
        return config
    q_len, kv_len = lengths
    bias = config.bias and BiasSpec(config.bias.shape[:2] + (q_len, kv_len), config.bias.differentiable)
    return config.replace(q_len=q_len, kv_len=kv_len, bias=bias, mask=dataclasses.replace(config.mask, padding=True),
                          strides=None)                      # padded copies are dense


@dataclass(frozen=True)
class Lifted:
    """A call padded to even lengths and/or transposed to BTNH: run :attr:`config` on :attr:`operands`, then
    :meth:`unpad` the results."""

    config: AttentionConfig
    operands: AttentionOperands
    original: AttentionConfig
    xp: Any

    @property
    def _transposed(self) -> bool:
        return self.config.layout is not self.original.layout

    def _swap(self, x: Any) -> Any:
        """``x`` with its sequence and head axes exchanged (BNTH <-> BTNH) when the call is transposed, dense."""
        if x is None or not self._transposed:
            return x
        x = self.xp.swapaxes(x, 1, 2)
        return self.xp.ascontiguousarray(x) if hasattr(self.xp, "ascontiguousarray") else x

    @property
    def _seq_axis(self) -> int:
        return 1 if self.config.layout is AttentionLayout.BTNH else 2

    def _pad(self, x: Any, axis: int, extra: int) -> Any:
        if x is None or extra == 0:
            return x
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, extra)
        return self.xp.pad(x, widths)

    def residuals(self, output: Any, grad_output: Any, logsumexp: Any) -> tuple[Any, Any, Any]:
        """The backward's O, dO and logsumexp, padded like the queries."""
        extra = self.config.q_len - self.original.q_len
        return (self._pad(self._swap(output), self._seq_axis, extra),
                self._pad(self._swap(grad_output), self._seq_axis, extra), self._pad(logsumexp, 2, extra))

    def unpad(self, result: AttentionOutput | AttentionGrads) -> AttentionOutput | AttentionGrads:
        """``result`` of the lifted call, sliced back to the original lengths and layout."""
        t, s, axis = self.original.q_len, self.original.kv_len, self._seq_axis

        def cut(x: Any, length: int, *axes: int) -> Any:
            if x is None:
                return None
            index = [slice(None)] * x.ndim
            for a in axes:
                index[a] = slice(0, length if a != 3 else s)
            return x[tuple(index)]

        if isinstance(result, AttentionOutput):
            return result._replace(output=self._swap(cut(result.output, t, axis)),
                                   logsumexp=cut(result.logsumexp, t, 2), score_max=cut(result.score_max, t, 2))
        return result._replace(dq=self._swap(cut(result.dq, t, axis)), dk=self._swap(cut(result.dk, s, axis)),
                               dv=self._swap(cut(result.dv, s, axis)), dbias=cut(result.dbias, t, 2, 3))


def _fold_diagonal(config: AttentionConfig, bias: Any, xp: Any) -> Any:
    """``bias`` plus the large negative number at the keys ``config``'s bottom-right diagonal masks (module doc)."""
    mask, t, s = config.mask, config.q_len, config.kv_len
    d = xp.arange(s)[None, :] - xp.arange(t)[:, None] - (s - t)
    keep = d <= mask.right_bound
    if mask.left_bound is not None:
        keep = keep & (-d < mask.left_bound)
    negative = xp.full((), LARGE_NEGATIVE[config.dtype], dtype=bias.dtype)
    return bias + xp.where(keep, xp.full((), 0, dtype=bias.dtype), negative)


def lift(config: AttentionConfig, operands: AttentionOperands, xp: Any) -> Lifted | None:
    """The lifted call of ``config`` on ``operands`` (module doc), or ``None`` when it runs as it is."""
    padded = lifted_config(config)
    if padded is None:
        return None
    extra_q, extra_kv = padded.q_len - config.q_len, padded.kv_len - config.kv_len
    lifted = Lifted(padded, operands, config, xp)
    axis = lifted._seq_axis
    batch = config.batch
    bias = _fold_diagonal(config, operands.bias, xp) if folds_diagonal(config) else operands.bias
    changes: dict[str, Any] = dict(
        query=lifted._pad(lifted._swap(operands.query), axis, extra_q),
        key=lifted._pad(lifted._swap(operands.key), axis, extra_kv),
        value=lifted._pad(lifted._swap(operands.value), axis, extra_kv),
        bias=lifted._pad(lifted._pad(bias, 2, extra_q), 3, extra_kv))
    if not config.mask.padding and padded.mask.padding:
        changes["q_seqlen"] = xp.full((batch,), config.q_len, dtype=xp.int32)
        changes["kv_seqlen"] = xp.full((batch,), config.kv_len, dtype=xp.int32)
    return dataclasses.replace(lifted, operands=operands.replace(**changes))
