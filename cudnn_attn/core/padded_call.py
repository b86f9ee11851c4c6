"""Two kernel limits lifted by padding the call: training with a bias at odd ``T`` or ``S``, and the
backward at ``T == S == 1``.

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

from .config import AttentionConfig, AttentionOperands, BiasSpec
from .types import AttentionGrads, AttentionLayout, AttentionOutput

__all__ = ["Lifted", "lift", "lifted_config"]


def _padded_lengths(config: AttentionConfig) -> tuple[int, int] | None:
    """The ``(T', S')`` the call runs at, or ``None`` when no limit applies."""
    if not config.training or config.fp8 or config.paging is not None:
        return None
    if config.q_len == 1 and config.kv_len == 1:
        return 2, 2
    if config.bias is not None and (config.q_len % 2 or config.kv_len % 2):
        return config.q_len + config.q_len % 2, config.kv_len + config.kv_len % 2
    return None


def lifted_config(config: AttentionConfig) -> AttentionConfig | None:
    """The padded configuration that runs ``config`` (module doc), or ``None`` when it runs as it is."""
    lengths = _padded_lengths(config)
    if lengths is None:
        return None
    q_len, kv_len = lengths
    bias = config.bias and BiasSpec(config.bias.shape[:2] + (q_len, kv_len), config.bias.differentiable)
    return config.replace(q_len=q_len, kv_len=kv_len, bias=bias, mask=dataclasses.replace(config.mask, padding=True))


@dataclass(frozen=True)
class Lifted:
    """A call padded to even lengths: run :attr:`config` on :attr:`operands`, then :meth:`unpad` the results."""

    config: AttentionConfig
    operands: AttentionOperands
    original: AttentionConfig
    xp: Any

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
        return (self._pad(output, self._seq_axis, extra), self._pad(grad_output, self._seq_axis, extra),
                self._pad(logsumexp, 2, extra))

    def unpad(self, result: AttentionOutput | AttentionGrads) -> AttentionOutput | AttentionGrads:
        """``result`` of the padded call, sliced back to the original lengths."""
        t, s, axis = self.original.q_len, self.original.kv_len, self._seq_axis

        def cut(x: Any, length: int, *axes: int) -> Any:
            if x is None:
                return None
            index = [slice(None)] * x.ndim
            for a in axes:
                index[a] = slice(0, length if a != 3 else s)
            return x[tuple(index)]

        if isinstance(result, AttentionOutput):
            return result._replace(output=cut(result.output, t, axis), logsumexp=cut(result.logsumexp, t, 2))
        return result._replace(dq=cut(result.dq, t, axis), dk=cut(result.dk, s, axis), dv=cut(result.dv, s, axis),
                               dbias=cut(result.dbias, t, 2, 3))


def lift(config: AttentionConfig, operands: AttentionOperands, xp: Any) -> Lifted | None:
    """The padded call of ``config`` on ``operands`` (module doc), or ``None`` when it runs as it is."""
    padded = lifted_config(config)
    if padded is None:
        return None
    extra_q, extra_kv = padded.q_len - config.q_len, padded.kv_len - config.kv_len
    lifted = Lifted(padded, operands, config, xp)
    axis = lifted._seq_axis
    batch = config.batch
    changes: dict[str, Any] = dict(
        query=lifted._pad(operands.query, axis, extra_q), key=lifted._pad(operands.key, axis, extra_kv),
        value=lifted._pad(operands.value, axis, extra_kv),
        bias=lifted._pad(lifted._pad(operands.bias, 2, extra_q), 3, extra_kv))
    if not config.mask.padding:
        changes["q_seqlen"] = xp.full((batch,), config.q_len, dtype=xp.int32)
        changes["kv_seqlen"] = xp.full((batch,), config.kv_len, dtype=xp.int32)
    return dataclasses.replace(lifted, operands=operands.replace(**changes))
