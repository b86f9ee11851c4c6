"""A user ``score_mod`` as a configuration holds it: its :class:`~cudnn_attn.core.config.ScoreModSpec`, its
translated :class:`ScoreModProgram`, and what cuDNN cannot run of it.

Tracing the function with JAX is :mod:`cudnn_attn.tracing.score_mod`'s (the layer above this one, which may
import JAX): :func:`score_mod_spec` hands the function to the tracer that module installs (:func:`install_tracer`),
and the package's face imports it, so every import of the library has it.  This layer imports neither JAX nor
torch (``tests/test_layers.py``).

Validity is decided at the call (so at trace time under ``jit``), as ``ValueError`` naming ``score_mod``: not
callable, a number of parameters that does not take ``(score, *score_mod_args)``, a function JAX cannot trace,
a result that is not one float array of the score's shape (``None``, a tuple, another shape), or one closing over
a value traced by an enclosing ``jit`` (its value is not known when the graph is built).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .config import AttentionConfig, DiagonalAlignment, ScoreModSpec
from .errors import UnsupportedConfigurationError
from .score_mod_ir import Program
from .types import Kind

ArgShapes = tuple[tuple[tuple[int, ...], str], ...]
Tracer = Callable[[Any, Sequence[int], ArgShapes], ScoreModSpec]


@dataclass(frozen=True)
class ScoreModProgram:
    """A ``score_mod`` translated into pointwise programs: its forward and its VJP w.r.t. the score."""

    name: str
    forward: Program        # (score, *args) -> modified score
    backward: Program       # (cotangent, score, *args) -> cotangent * d(modified)/d(score)
    num_args: int

    @property
    def is_additive(self) -> bool:
        """The modification adds something independent of the score (its VJP is the identity)."""
        return self.backward.nodes[self.backward.output].op == "cotangent"

    @property
    def backward_reads_score(self) -> bool:
        return self.backward.uses("score")


# -- the spec of a function ---------------------------------------------------------------------------

_tracer: Tracer | None = None


def install_tracer(trace: Tracer) -> None:
    """Make ``trace(fn, score_shape, arg_shapes) -> ScoreModSpec`` the tracer of :func:`score_mod_spec`
    (:mod:`cudnn_attn.tracing.score_mod` installs its own when imported)."""
    global _tracer
    _tracer = trace


def score_mod_spec(fn: Any, score_shape: Sequence[int], arg_shapes: ArgShapes = ()) -> ScoreModSpec:
    """The spec of ``fn`` for float32 scores of ``score_shape`` and arguments of ``arg_shapes``
    (``((shape, dtype name), ...)``), as the installed tracer makes it (module doc).

    Raises:
        ValueError: ``fn`` is not a valid ``score_mod`` for these arguments (the message names ``score_mod``).
    """
    if _tracer is None:
        raise RuntimeError("score_mod: no tracer is installed (import cudnn_attn installs "
                           "cudnn_attn.tracing.score_mod's)")
    return _tracer(fn, score_shape, arg_shapes)


def score_mod_program(spec: ScoreModSpec) -> ScoreModProgram:
    """The translated programs of ``spec``.

    Raises:
        UnsupportedConfigurationError: cuDNN cannot express the function (the reasons name the primitive).
    """
    if spec.program is None:
        raise UnsupportedConfigurationError(list(spec.refusals) or [f"score_mod {spec.name!r} was not translated"])
    return spec.program


# -- what the translation cannot express ------------------------------------------------------------

def score_mod_refusals(config: AttentionConfig, kind: str | None = None) -> list[str]:
    """Why ``config.score_mod`` cannot run in cuDNN with the rest of ``config`` (empty: it can).

    ``kind`` is a :class:`~cudnn_attn.core.types.Kind`; ``None`` means the graphs the configuration needs (the
    backward too when ``config.training``).  The support table's ``score_mod`` rows read these reasons
    (:mod:`cudnn_attn.core.support` decides; this function only knows what the translation cannot express).
    """
    if config.score_mod is None:
        return []
    reasons = []
    mask = config.mask
    if mask.alibi:
        reasons.append("score_mod with ALiBi: cuDNN refuses its ALiBi next to score_mod; add the ALiBi bias "
                       "inside score_mod (slopes from lax.broadcasted_iota on the head axis)")
    if mask.alignment is DiagonalAlignment.BOTTOM_RIGHT and mask.padding and \
            (mask.right_bound is not None or mask.left_bound is not None):
        reasons.append("score_mod with a bottom-right diagonal and per-sequence lengths (padding, packing or "
                       "paging): inside the modification cuDNN 9.19 computes that mask wrongly (measured on the "
                       "H200); use the top-left diagonal, or equal lengths without padding")
    try:
        program = score_mod_program(config.score_mod)
    except UnsupportedConfigurationError as error:
        return reasons + error.reasons
    if config.packing is not None and any(n.op == "index" and n.param == 0
                                          for p in (program.forward, program.backward) for n in p.nodes):
        reasons.append("score_mod reads the batch index, but cuDNN sees packed segments as the batch")
    backward = kind == Kind.BACKWARD or (kind is None and config.training)
    if backward and config.has_dbias and not program.is_additive:
        reasons.append(f"a bias gradient with the non-additive score_mod {program.name!r}: the spec applies "
                       "score_mod after the bias, so the bias goes inside the modification, where cuDNN "
                       "cannot produce dBias")
    return reasons
