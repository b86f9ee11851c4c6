"""The one static description of an attention call.

:class:`AttentionConfig` is frozen and hashable.  It is built once at the public boundary (see
:func:`cudnn_attn.core.validation.validate_call`) and then crosses every layer unchanged: it is the graph-cache
key (with device and cuDNN version), the static description the JAX primitives carry (next to their
kernel options: the dropout seed, the backend), and the input of the support table, the reference, the
graph builder and the batching/sharding rules.

Runtime values are *not* part of it: the arrays (in :class:`AttentionOperands`), the dropout seed,
the FP8 scale values and the ``score_mod`` argument values.

Naming: ``B`` batch, ``T`` query length, ``S`` key/value length, ``N`` query heads, ``K`` key/value
heads, ``H`` query/key head dim, ``Hv`` value head dim.  The cuDNN graph always sees logical
``(B, N, T, H)`` tensors; the layout only changes the strides.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from .types import AttentionLayout

IO_DTYPES = ("float16", "bfloat16")
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
CUDNN_DTYPES = (*IO_DTYPES, *FP8_DTYPES)
"""The Q/K/V types of cuDNN's attention graphs."""
CONFIG_DTYPES = (*CUDNN_DTYPES, "float32", "float64")
"""What :attr:`AttentionConfig.dtype` may name: cuDNN's input types, and float32/float64 for the NumPy reference
(the support table's "input dtype" row reports those two on the cuDNN fronts; the graph builder refuses them)."""
_SIZES = ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "qk_dim", "v_dim")


@dataclass(frozen=True)
class RealRule:
    """The rule of a static real argument, stated once: validation names the caller's argument with it,
    :class:`AttentionConfig` its own field."""

    text: str                             # "a finite real number"
    accept: Callable[[float], bool]

    def check(self, value: Any) -> float:
        """``value`` as a float, or a ``ValueError`` saying what the rule is (the caller adds the name)."""
        number = value
        if type(value) is not float:
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"must be {self.text}, got {value!r}")
            try:
                number = float(value)
            except (OverflowError, ValueError):          # 10**400 does not fit a float
                raise ValueError(f"must be {self.text}, got {value!r}, which does not fit a float") from None
        if not self.accept(number):
            raise ValueError(f"must be {self.text}, got {value!r}")
        return number


SCALE_RULE = RealRule("a finite real number", math.isfinite)
DROPOUT_RULE = RealRule("a real number in [0, 1)", lambda p: 0.0 <= p < 1.0)


class DiagonalAlignment(enum.Enum):
    """Where the causal diagonal starts: query ``i`` faces key ``i`` (TOP_LEFT) or key ``i + S - T``
    (BOTTOM_RIGHT, per sequence when lengths are given)."""

    TOP_LEFT = "top_left"
    BOTTOM_RIGHT = "bottom_right"


@dataclass(frozen=True)
class StaticMask:
    """Orthogonal mask fields; each maps one-to-one onto a cuDNN SDPA knob.

    With ``d = j - i - delta`` for query ``i`` and key ``j`` (``delta = 0`` for TOP_LEFT,
    ``S_b - T_b`` for BOTTOM_RIGHT), key ``j`` is kept iff

    * ``right_bound is None or d <= right_bound``  (``right_bound == 0`` is causal), and
    * ``left_bound is None or -d < left_bound``     (a window of ``left_bound`` keys ending at the
      diagonal; the seed's ``sliding_window_length``), and
    * with ``padding``: ``i < q_seqlen[b]`` and ``j < kv_seqlen[b]``.

    ``alibi`` adds cuDNN's ALiBi bias ``m_h * (j - i)`` (requires causal).
    """

    right_bound: int | None = None
    left_bound: int | None = None
    alignment: DiagonalAlignment = DiagonalAlignment.TOP_LEFT
    padding: bool = False
    alibi: bool = False

    @property
    def causal(self) -> bool:
        return self.right_bound == 0

    def describe(self) -> str:
        parts = []
        if self.causal:
            parts.append("causal" + ("(bottom-right)" if self.alignment is DiagonalAlignment.BOTTOM_RIGHT else ""))
        elif self.right_bound is not None:
            parts.append(f"right_bound={self.right_bound}")
        if self.left_bound is not None:
            parts.append(f"window={self.left_bound}")
        if self.padding:
            parts.append("padding")
        if self.alibi:
            parts.append("alibi")
        return "+".join(parts) or "none"


@dataclass(frozen=True)
class BiasSpec:
    """Additive bias of shape ``(1 or B, 1 or N, T, S)`` in the io dtype (a boolean mask is folded in).

    ``differentiable`` is False when the bias came only from a boolean mask: nobody can ask for its
    gradient, so the backward skips dbias.
    """

    shape: tuple[int, int, int, int]
    differentiable: bool


@dataclass(frozen=True)
class PackingSpec:
    """Packed segments (seed ``q_offsets``/``kv_offsets``): each batch row holds up to ``max_segments``
    segments; attention stays inside a segment.  cuDNN sees ``B * max_segments`` ragged sequences."""

    max_segments: int


@dataclass(frozen=True)
class PagingSpec:
    """Paged K/V: caches of ``num_blocks`` blocks of ``block_size`` tokens; page tables of shape
    ``(B, 1, blocks_per_seq, 1)`` map logical to physical blocks."""

    num_blocks_k: int
    num_blocks_v: int
    block_size: int
    blocks_per_seq: int


@dataclass(frozen=True)
class ScoreModSpec:
    """A user ``score_mod(score, *args)`` on the float32 ``(B, N, T, S)`` scores, as traced by JAX.

    Identity is the traced program - ``digest``, a hash of its operations and constants - and the
    static shapes/dtypes of its arguments (their values are runtime), never the function object: equal
    functions give equal specs, and no spec keeps the function alive.  Made by
    :func:`cudnn_attn.core.score_mod_spec.score_mod_spec`, which also translates it for cuDNN: ``program`` holds the
    pointwise programs of the forward and its VJP, or ``refusals`` why cuDNN cannot express them.
    ``jaxpr`` (for the NumPy reference, at ``score_shape``) stays in the process: pickling drops it.
    """

    digest: str
    arg_shapes: tuple[tuple[tuple[int, ...], str], ...] = ()
    name: str = field(default="score_mod", compare=False)
    score_shape: tuple[int, ...] = field(default=(), compare=False)
    program: Any = field(default=None, compare=False, repr=False)
    refusals: tuple[str, ...] = field(default=(), compare=False, repr=False)
    jaxpr: Any = field(default=None, compare=False, repr=False)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "jaxpr": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


Strides = tuple[int, int, int, int]


@dataclass(frozen=True)
class InputStrides:
    """The element strides of the Q, K and V arrays a caller passed, in the physical order of the call's layout
    (``(B, T, N, H)`` for BTNH, ``(B, N, T, H)`` for BNTH); ``None`` for an array with the layout's dense strides.
    Views of other memory (a BNTH view of BTNH memory, a transposed view, sliced heads) reach cuDNN with their own
    strides: the graph is declared with them, so they are part of the configuration and of every cache key."""

    query: Strides | None = None
    key: Strides | None = None
    value: Strides | None = None

    def describe(self) -> str:
        return "strided(" + ",".join(name[0] for name in ("query", "key", "value") if getattr(self, name)) + ")"


def dense_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major element strides of ``shape``."""
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


@dataclass(frozen=True)
class AttentionConfig:
    """Everything static about one attention call (forward and its backward)."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    qk_dim: int
    v_dim: int
    dtype: str                       # numpy dtype name of Q/K/V: float16, bfloat16, float8_e4m3fn, float8_e5m2
                                     # (float64: the reference's exact mode)
    layout: AttentionLayout = AttentionLayout.BTNH
    scale: float = 1.0
    mask: StaticMask = StaticMask()
    bias: BiasSpec | None = None
    dropout_rate: float = 0.0
    packing: PackingSpec | None = None
    paging: PagingSpec | None = None
    score_mod: ScoreModSpec | None = None
    sink: bool = False
    training: bool = False           # forward also produces the logsumexp needed by the backward
    deterministic: bool = False      # backward: deterministic dQ accumulation
    strides: InputStrides | None = None   # Q/K/V views with their own strides (CuPy/DLPack fronts); None: dense
    score_max: bool = False          # forward also writes each row's max scaled score (fp32 (B, N, T); no gradient)
    device_seed: bool = False        # dropout seed and offset are int64 device operands read at launch, not host
                                     # scalars bound into the launch (a traced key; DESIGN "Dropout from a device seed")

    def __post_init__(self):
        """Invariants.  The fields describe a call that exists (``ValueError`` naming ``config.<field>``
        otherwise: a configuration made by hand must not reach the support table, a cache or cuDNN as if it
        were one).  Packed segments and paged K/V carry per-sequence lengths, so they imply the padding
        mask - ``mask.padding`` is then set, and is the one place every layer reads it from; ``device_seed``
        without dropout is cleared (one configuration, one cache entry)."""
        for name in _SIZES:
            value = getattr(self, name)
            if not (type(value) is int or isinstance(value, numbers.Integral) and not isinstance(value, bool)) \
                    or value < 1:
                raise ValueError(f"config.{name}: must be a positive int, got {value!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"config.q_heads: query heads {self.q_heads} must be a multiple of key/value heads "
                             f"{self.kv_heads} (config.kv_heads)")
        if self.dtype not in CONFIG_DTYPES:
            raise ValueError(f"config.dtype: must be one of {', '.join(CONFIG_DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.layout, AttentionLayout):
            raise ValueError(f"config.layout: must be an AttentionLayout, got {self.layout!r}")
        for name, rule in (("scale", SCALE_RULE), ("dropout_rate", DROPOUT_RULE)):
            try:
                rule.check(getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"config.{name}: {exc}") from None
        if self.device_seed and not self.has_dropout:     # no dropout: nothing reads a seed
            object.__setattr__(self, "device_seed", False)
        if (self.packing is not None or self.paging is not None) and not self.mask.padding:
            object.__setattr__(self, "mask", dataclasses.replace(self.mask, padding=True))

    def __hash__(self) -> int:
        """Computed once: the configuration is the key of every cache lookup (its ``score_mod`` and mask
        specs make the field tuple deep)."""
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}   # str hashes differ between processes

    # -- derived facts -------------------------------------------------------------------------
    @property
    def fp8(self) -> bool:
        """Q/K/V are FP8 (``sdpa_fp8`` graphs, scale factors, amax results): derived from :attr:`dtype`."""
        return self.dtype in FP8_DTYPES

    @property
    def is_gqa(self) -> bool:
        return self.kv_heads != self.q_heads

    @property
    def is_mla(self) -> bool:
        return self.v_dim != self.qk_dim

    @property
    def has_dropout(self) -> bool:
        return self.dropout_rate > 0.0

    @property
    def has_dbias(self) -> bool:
        return self.bias is not None and self.bias.differentiable

    @property
    def segments(self) -> int:
        """Sequences cuDNN sees: ``B`` or ``B * M`` when packed."""
        return self.batch * (self.packing.max_segments if self.packing else 1)

    def replace(self, **changes: Any) -> "AttentionConfig":
        return dataclasses.replace(self, **changes)

    # -- physical shapes (in the config's layout) ------------------------------------------------
    def _shape(self, heads: int, length: int, dim: int) -> tuple[int, int, int, int]:
        if self.layout is AttentionLayout.BTNH:
            return (self.batch, length, heads, dim)
        return (self.batch, heads, length, dim)

    @property
    def q_shape(self) -> tuple[int, int, int, int]:
        return self._shape(self.q_heads, self.q_len, self.qk_dim)

    @property
    def k_shape(self) -> tuple[int, int, int, int]:
        if self.paging:
            return self._paged_shape(self.paging.num_blocks_k, self.qk_dim)
        return self._shape(self.kv_heads, self.kv_len, self.qk_dim)

    @property
    def v_shape(self) -> tuple[int, int, int, int]:
        if self.paging:
            return self._paged_shape(self.paging.num_blocks_v, self.v_dim)
        return self._shape(self.kv_heads, self.kv_len, self.v_dim)

    def _paged_shape(self, blocks: int, dim: int) -> tuple[int, int, int, int]:
        bs = self.paging.block_size
        if self.layout is AttentionLayout.BTNH:
            return (blocks, bs, self.kv_heads, dim)
        return (blocks, self.kv_heads, bs, dim)

    @property
    def o_shape(self) -> tuple[int, int, int, int]:
        return self._shape(self.q_heads, self.q_len, self.v_dim)

    @property
    def lse_shape(self) -> tuple[int, int, int]:
        return (self.segments, self.q_heads, self.q_len)

    def describe(self) -> str:
        """One line for logs, errors and the cache listing."""
        kv = f"{self.kv_heads}kv" if self.is_gqa else ""
        dims = f"d={self.qk_dim}" + (f"/{self.v_dim}" if self.is_mla else "")
        parts = [
            f"{self.dtype} {self.layout.name} B={self.batch} N={self.q_heads}{'/' + kv if kv else ''} "
            f"T={self.q_len} S={self.kv_len} {dims}",
            f"mask={self.mask.describe()}",
        ]
        if self.bias:
            parts.append(f"bias{list(self.bias.shape)}{'+dbias' if self.bias.differentiable else ''}")
        if self.has_dropout:
            parts.append(f"dropout={self.dropout_rate:g}")
        if self.packing:
            parts.append(f"packed(M={self.packing.max_segments})")
        if self.paging:
            parts.append(f"paged(bs={self.paging.block_size})")
        if self.fp8:
            parts.append("fp8")
        if self.score_mod:
            parts.append(f"score_mod={self.score_mod.name}")
        if self.sink:
            parts.append("sink")
        if self.deterministic:
            parts.append("deterministic")
        if self.score_max:
            parts.append("score_max")
        if self.device_seed:
            parts.append("device_seed")
        if self.strides is not None:
            parts.append(self.strides.describe())
        parts.append("train" if self.training else "infer")
        return " ".join(parts)


@dataclass
class AttentionOperands:
    """The arrays of one call, by name.  Absent members are ``None`` (never placeholder arrays).

    ``bias`` is the combined additive bias (explicit bias plus a boolean mask turned into a large
    negative number), 4-D.  ``q_seqlen``/``kv_seqlen`` are int32 ``(B,)`` or ``(B, M)`` when packed;
    ``q_offsets``/``kv_offsets`` int32 ``(B, M + 1)``.  ``fp8_scales`` maps FP8Params keys to float32
    scalars.  ``sink`` is float32 ``(N,)``.  ``keep_mask`` is a boolean ``mask`` (True keeps) read as 4-D
    (``(1|B, 1|N, 1|T, 1|S)``): the rows it keeps no key of average V (:mod:`cudnn_attn.core.masked_rows`).
    """

    query: Any
    key: Any
    value: Any
    bias: Any = None
    q_seqlen: Any = None
    kv_seqlen: Any = None
    q_offsets: Any = None
    kv_offsets: Any = None
    page_table_k: Any = None
    page_table_v: Any = None
    sink: Any = None
    score_mod_args: tuple = ()
    fp8_scales: dict | None = None
    keep_mask: Any = None
    dropout_seed: Any = None       # with config.device_seed: the Philox seed and offset on the device
    dropout_offset: Any = None     # (engine.call.DROPOUT_OPERANDS says their types)

    def replace(self, **changes: Any) -> "AttentionOperands":
        return dataclasses.replace(self, **changes)


def ragged_offset_dtype(config: AttentionConfig) -> str:
    """``"int32"`` when every element offset of the packed tensors fits in int32, else ``"int64"``.

    Static (from the config) so that the graph and the arrays agree; int32 keeps JAX usable without
    ``jax_enable_x64`` for all but enormous inputs.
    """
    q_elems = config.batch * config.q_len * config.q_heads * max(config.qk_dim, config.v_dim)
    kv_elems = config.batch * config.kv_len * config.kv_heads * max(config.qk_dim, config.v_dim)
    return "int32" if max(q_elems, kv_elems) < 2**31 else "int64"
