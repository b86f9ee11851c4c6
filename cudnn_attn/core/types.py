"""Public enums and small named containers shared by every layer.

``MaskType``, ``AttentionLayout`` and ``FP8Params`` are the seed-compatible front door (the names and
members of JAX's cuDNN attention module).  Everything behind the front door works on the orthogonal
fields of :class:`cudnn_attn.core.config.StaticMask` instead of ``MaskType``.
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple, TypedDict


class Kind(enum.StrEnum):
    """Which graph of an attention call: the forward or the backward.  (A ``str`` enum: ``Kind.FORWARD ==
    "fwd"``, so the spelled-out strings are accepted wherever a kind is.)"""

    FORWARD = "fwd"
    BACKWARD = "bwd"


class Front(enum.StrEnum):
    """What runs a call: cuDNN through CuPy arrays, cuDNN through XLA (the JAX bridge), or the NumPy
    reference (the CPU backend of both).  The support table says per front what it refuses."""

    CUPY = "cupy"
    JAX = "jax"
    REFERENCE = "reference"


class AttentionLayout(enum.Enum):
    """Physical layout of Q/K/V/O.  ``B`` batch, ``T``/``S`` query/key length, ``N`` heads, ``H`` head dim."""

    BTNH = 0
    BNTH = 1

    @classmethod
    def parse(cls, layout: "str | AttentionLayout") -> "AttentionLayout":
        """Accept an enum member or one of ``BTNH``, ``BNTH``, ``BSNH``, ``BNSH`` (any case)."""
        if isinstance(layout, AttentionLayout):
            return layout
        if isinstance(layout, str):
            name = layout.upper().replace("S", "T")
            if name in cls.__members__:
                return cls[name]
        raise ValueError(
            f"qkv_layout: unsupported layout {layout!r}; expected one of 'BTNH', 'BNTH', 'BSNH', 'BNSH'."
        )


class MaskType(enum.Enum):
    """The seed's mask enum.  Translated at the API boundary into :class:`~cudnn_attn.core.config.StaticMask`."""

    NO_MASK = 0
    PADDING = 1
    CAUSAL = 2
    PADDING_CAUSAL = 3
    ALIBI = 4


class FP8Params(TypedDict, total=False):
    """Scaling factors and amax placeholders of FP8 attention (seed semantics).

    Every entry is a float32 scalar (shape ``()`` or ``(1, 1, 1, 1)``).  ``descale_x`` multiplies the
    stored FP8 value of ``x`` back to its real value; ``scale_x`` multiplies a real value before it is
    quantised to FP8.  The ``amax_d*`` entries are placeholders whose *gradient* receives the
    backward's amax values under JAX's ``grad``.
    """

    amax_dQ: Any
    amax_dK: Any
    amax_dV: Any
    amax_dP: Any
    descale_q: Any
    descale_k: Any
    descale_v: Any
    descale_s: Any
    scale_s: Any
    scale_o: Any
    descale_o: Any
    descale_dO: Any
    descale_dP: Any
    scale_dQ: Any
    scale_dK: Any
    scale_dV: Any
    scale_dP: Any


FP8_PARAM_KEYS = tuple(FP8Params.__annotations__)
# The backward's amax results carry the names of the fp8_params placeholders whose cotangents they are.
FP8_BWD_AMAX = ("amax_dQ", "amax_dK", "amax_dV", "amax_dP")
FP8_FWD_KEYS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
FP8_BWD_KEYS = (
    "descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
    "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP",
)


class AttentionOutput(NamedTuple):
    """Result of the native forward API.  Absent members are ``None``.

    ``output`` has the query's layout and ``v``'s head dim.  ``logsumexp`` (natural log, float32) has
    shape ``(B, N, T)`` (``(B*M, N, T)`` for packed inputs with ``M`` segments per row).  ``amax_s`` and
    ``amax_o`` are FP8 statistics of shape ``(1, 1, 1, 1)``.  ``score_max`` (float32 ``(B, N, T)``, each row's
    maximum scaled logit) and ``max_logit`` (float32 ``(N,)``, its maximum per head) come with
    ``AuxRequest(max_logit=True)``; ``-inf`` where no key is admissible.
    """

    output: Any
    logsumexp: Any = None
    amax_s: Any = None
    amax_o: Any = None
    score_max: Any = None
    max_logit: Any = None

    def seed_form(self, use_fp8: bool, return_residual: bool) -> Any:
        """The seed's return form: ``output``, ``(output, logsumexp)`` or ``(output, amax_s, amax_o)``."""
        if use_fp8:
            return self.output, self.amax_s, self.amax_o
        if return_residual:
            return self.output, self.logsumexp
        return self.output


class AttentionGrads(NamedTuple):
    """Result of the backward.  ``dbias`` is present when the bias is differentiable, ``dsink`` when a
    sink is given, and the ``amax_*`` members for FP8 (spelled as the :class:`FP8Params` keys whose
    cotangents they are under JAX's ``grad``: :data:`FP8_BWD_AMAX`)."""

    dq: Any
    dk: Any
    dv: Any
    dbias: Any = None
    dsink: Any = None
    amax_dQ: Any = None
    amax_dK: Any = None
    amax_dV: Any = None
    amax_dP: Any = None
