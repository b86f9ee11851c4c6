"""Which *valid* attention calls this GPU and cuDNN can run, and why not.

Two tables, both data:

* :data:`REQUIREMENTS` — one row per feature: the minimum cuDNN version and compute capability it
  needs (and cuDNN versions known to be broken for it).
* :data:`RESTRICTIONS` — combinations that cannot run, each a small named check returning what was
  found.  Every row says who enforces it: ``CUDNN`` (cuDNN 9.19 refuses the graph on sm90; verified
  with deviceless builds: ``tests/deviceless/test_support_agreement.py``) or ``LIBRARY`` (this
  library follows the JAX seed's policy, or has no path for it, although cuDNN might build it), the
  graphs it concerns (:class:`~cudnn_attn.core.types.Kind`), the fronts it holds on
  (:class:`~cudnn_attn.core.types.Front`: CuPy and JAX run cuDNN, the NumPy reference runs on the CPU) and
  the graphs the builder cannot even declare it for (``structural``: cuDNN's API has no way to say it).

This module is the only place that decides "unsupported": validation decides only whether a call is
well formed, and every other layer asks here.  :func:`not_supported_reasons` evaluates both tables
against an :class:`Environment` and a front, and never raises for a configuration;
:func:`check_supported` raises :class:`~cudnn_attn.core.errors.UnsupportedConfigurationError` with the
reasons.  Two environment-free questions have their own names: :func:`check_everywhere` (what no front
runs - the reference refuses exactly these, so the JAX bridge asks it at trace time) and
:func:`check_structure` (what the graph builder cannot declare).

cuDNN versions are integers as ``cudnn.backend_version()`` returns them: ``91900`` is 9.19.0 and
``8904`` is 8.9.4.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Callable

from .config import CUDNN_DTYPES, AttentionConfig, DiagonalAlignment, ragged_offset_dtype
from .environment import Environment, format_version
from .errors import UnsupportedConfigurationError
from .padded_call import folds_diagonal
from .score_mod_spec import score_mod_refusals
from .types import AttentionLayout, Front, Kind

CUDNN = "cudnn"
LIBRARY = "library"

# score_mod arguments are bound by value, one reserved tensor id each (graphs.tensors.TensorId.SCORE_MOD_ARG_*).
SCORE_MOD_MAX_ARGS = 8


def _sm(capability: tuple[int, int]) -> str:
    return f"sm{capability[0]}{capability[1]}"


# -- feature requirements -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Requirement:
    """A feature used by a configuration and what it needs."""

    feature: str
    applies: Callable[[AttentionConfig], bool]
    min_cudnn: int
    min_compute: tuple[int, int] = (8, 0)
    broken_cudnn: tuple[int, ...] = ()
    enforced_by: str = CUDNN

    def unmet(self, config: AttentionConfig, env: Environment) -> list[str]:
        if not self.applies(config):
            return []
        reasons = []
        version = env.cudnn_version
        if version is not None and version < self.min_cudnn:
            reasons.append(f"{self.feature}: needs cuDNN >= {format_version(self.min_cudnn)}, "
                           f"found {format_version(version)}")
        elif version in self.broken_cudnn:
            reasons.append(f"{self.feature}: cuDNN {format_version(version)} is excluded (known bugs); "
                           "use another version")
        cc = env.compute_capability
        if cc is not None and cc < self.min_compute:
            reasons.append(f"{self.feature}: needs compute capability >= {_sm(self.min_compute)}, found {_sm(cc)}")
        return reasons


def _bottom_right(c: AttentionConfig) -> bool:
    return c.mask.alignment is DiagonalAlignment.BOTTOM_RIGHT and c.mask.right_bound is not None


REQUIREMENTS: tuple[Requirement, ...] = (
    # 8.9.4 is JAX's floor for fused attention; cuDNN 9.10.0/9.10.1 refuse fp16/bf16 SDPA (known bugs).
    Requirement("fused attention (fp16/bf16)", lambda c: not c.fp8, 8904, (8, 0), broken_cudnn=(91000, 91001)),
    Requirement("FP8 attention", lambda c: c.fp8, 90100, (9, 0), broken_cudnn=(91000,)),
    Requirement("FP8 bottom-right causal mask", lambda c: c.fp8 and _bottom_right(c), 90700, (10, 0)),
    Requirement("sliding window", lambda c: c.mask.left_bound is not None, 90200),
    Requirement("sliding window with bias or dropout",
                lambda c: c.mask.left_bound is not None and (c.bias is not None or c.has_dropout), 91002),
    Requirement("bottom-right causal mask", _bottom_right, 90600),
    Requirement("paged K/V cache", lambda c: c.paging is not None, 90500),
    Requirement("paged K/V cache with head dim > 128", lambda c: c.paging is not None and max(c.qk_dim, c.v_dim) > 128,
                91000),
    # The seed requires Hopper for packed segments; cuDNN itself serves THD below Hopper from 9.18.1.
    Requirement("packed segments", lambda c: c.packing is not None, 90500, (9, 0)),
    Requirement("packed segments with GQA (backward)", lambda c: c.packing is not None and c.is_gqa and c.training,
                90600, (9, 0)),
    Requirement("packed segments with a sink (backward)", lambda c: c.packing is not None and c.sink and c.training,
                92600),
    Requirement("dbias with padding (backward)", lambda c: c.has_dbias and c.mask.padding and c.training, 90500),
    Requirement("multi-head latent attention (v_dim != qk_dim)", lambda c: c.is_mla, 91000, (9, 0)),
    # cuDNN serves score_mod graphs from 9.6; the seed (JAX's flex attention) requires 9.13.
    Requirement("score_mod", lambda c: c.score_mod is not None, 91300, (9, 0), enforced_by=LIBRARY),
    # sink_token arrived with frontend 1.14.1, "for cuDNN 9.13.0+".
    Requirement("attention sink", lambda c: c.sink, 91300),
    # cuDNN's score_max/score_sum_exp outputs: built deviceless for sm90 with cuDNN 9.19
    # (tests/deviceless/test_training_features_builds.py); not offered on what was not built.
    Requirement("max logit (cuDNN's score_max)", lambda c: c.score_max, 91900, (9, 0), enforced_by=LIBRARY),
)


# -- restrictions -----------------------------------------------------------------------------------

Check = Callable[[AttentionConfig, Environment], "str | None"]


KINDS = tuple(Kind)
CUDNN_FRONTS = (Front.CUPY, Front.JAX)
EVERY_FRONT = tuple(Front)


@dataclass(frozen=True)
class Restriction:
    """A combination that cannot run; ``check`` returns what was found, or ``None`` when it is fine.

    ``kinds``: the graphs the rule concerns.  ``fronts``: where it holds (:data:`EVERY_FRONT`: the NumPy
    reference cannot run it either).  ``structural``: the graphs the builder cannot declare it for.
    """

    feature: str
    check: Check
    enforced_by: str
    kinds: tuple[Kind, ...] = KINDS
    fronts: tuple[Front, ...] = CUDNN_FRONTS
    structural: tuple[Kind, ...] = ()

    def unmet(self, config: AttentionConfig, env: Environment) -> list[str]:
        found = self.check(config, env)
        return [f"{self.feature}: {found}"] if found else []


def _major(env: Environment) -> int | None:
    return env.compute_capability[0] if env.compute_capability else None


def _present(*features: tuple[str, bool]) -> str:
    """The names of the features that are present, comma separated."""
    return ", ".join(name for name, present in features if present)


def _head_dim_multiple(c: AttentionConfig, env: Environment) -> str | None:
    multiple = 16 if c.fp8 else 8
    bad = [d for d in (c.qk_dim, c.v_dim) if d % multiple]
    return f"{bad[0]} is not a multiple of {multiple}" if bad else None


def _head_dim_backward_sm90(c: AttentionConfig, env: Environment) -> str | None:
    # The sm90 backward refuses head dims above 256.  (The forward still builds them with a
    # non-flash engine; the seed's flash-only policy, _head_dim_limit, does not offer that.)
    worst = max(c.qk_dim, c.v_dim)
    if _major(env) == 9 and c.training and not c.fp8 and worst > 256:
        return f"{worst} > 256 in the backward (sm90 maximum)"
    return None


def _head_dim_backward_sm100(c: AttentionConfig, env: Environment) -> str | None:
    if _major(env) != 10 or not c.training or c.fp8:
        return None
    dims = (c.qk_dim, c.v_dim)
    served = (max(dims) <= 128 or dims == (192, 128) or all(256 < d <= 512 for d in dims)
              or (dims == (256, 256) and (env.cudnn_version or 0) >= 92300))
    return None if served else f"{dims} in the backward (sm100 serves <= 128, (192, 128), (256, 256) or (256, 512])"


def _head_dim_limit(c: AttentionConfig, env: Environment) -> str | None:
    major = _major(env)
    if c.fp8 or major is None or (major == 9 and c.training):   # the latter: cuDNN's own refusal above
        return None
    limit = 256 if major >= 9 else 128
    worst = max(c.qk_dim, c.v_dim)
    return f"{worst} > {limit} ({_sm(env.compute_capability)} maximum)" if worst > limit else None


def _alibi_needs_causal(c: AttentionConfig, env: Environment) -> str | None:
    return "needs a causal mask" if c.mask.alibi and not c.mask.causal else None


def _bottom_right_exclusions(c: AttentionConfig, env: Environment) -> str | None:
    # Without padding, a bias takes the diagonal in (cudnn_attn.core.padded_call); then dropout is fine too.
    if not _bottom_right(c):
        return None
    folded = folds_diagonal(c)
    found = _present(("bias" + (" and a padding mask" if c.mask.padding else ""), c.bias is not None and not folded),
                     ("dropout", c.has_dropout and not folded), ("ALiBi", c.mask.alibi))
    return f"cannot be combined with {found}" if found else None


def _long_queries(c: AttentionConfig) -> str | None:
    if c.mask.padding or c.q_len <= c.kv_len:
        return None
    return f"needs T <= S without padding, found T={c.q_len} > S={c.kv_len}"


def _bottom_right_lengths(c: AttentionConfig, env: Environment) -> str | None:
    return _long_queries(c) if _bottom_right(c) else None


def _window_lengths(c: AttentionConfig, env: Environment) -> str | None:
    return _long_queries(c) if c.mask.left_bound is not None else None


def _score_mod_limits(c: AttentionConfig, kind: Kind) -> str | None:
    """What the score_mod translation cannot express with the rest of the configuration in the ``kind``
    graph (built-in masks are folded into the modification; see
    :func:`cudnn_attn.core.score_mod_spec.score_mod_refusals`)."""
    if c.score_mod is None or _score_mod_args(c, _ANYWHERE):
        return None
    return "; ".join(score_mod_refusals(c, kind)) or None


def _score_mod_limits_forward(c: AttentionConfig, env: Environment) -> str | None:
    return _score_mod_limits(c, Kind.FORWARD)


def _score_mod_limits_backward(c: AttentionConfig, env: Environment) -> str | None:
    return _score_mod_limits(c, Kind.BACKWARD)


def _sink_needs_queries(c: AttentionConfig, env: Environment) -> str | None:
    return "not supported with a single query (T == 1)" if c.sink and c.q_len == 1 else None


def _deterministic_sm100(c: AttentionConfig, env: Environment) -> str | None:
    if not (c.deterministic and c.training and _major(env) == 10):
        return None
    if (env.cudnn_version or 0) < 91800:
        return "needs cuDNN >= 9.18.0 on sm100"
    found = _present(("dbias", c.has_dbias), ("dropout", c.has_dropout), ("ALiBi", c.mask.alibi))
    return f"not on sm100 with {found}" if found else None


def _packed_dbias_sm100(c: AttentionConfig, env: Environment) -> str | None:
    if c.packing and c.has_dbias and c.training and _major(env) == 10:
        return "no dbias on sm100"
    return None


def _fp8_bias(c: AttentionConfig, env: Environment) -> str | None:
    return "takes no bias (cuDNN's FP8 forward refuses one, the FP8 backward has none)" \
        if c.fp8 and c.bias is not None else None


def _fp8_sink(c: AttentionConfig, env: Environment) -> str | None:
    return "no attention sink (the sm90 plan does not compile)" if c.fp8 and c.sink else None


def _fp8_head_dim(c: AttentionConfig, env: Environment) -> str | None:
    worst = max(c.qk_dim, c.v_dim)
    return f"head dim {worst} > 256" if c.fp8 and worst > 256 else None


def _fp8_backward_hopper(c: AttentionConfig, env: Environment) -> str | None:
    if not (c.fp8 and c.training and _major(env) == 9):
        return None
    if (c.qk_dim, c.v_dim) != (128, 128):
        return f"the sm90 backward needs qk_dim == v_dim == 128, found ({c.qk_dim}, {c.v_dim})"
    return "the sm90 backward does not support packed segments" if c.packing else None


def _fp8_training_head_dim(c: AttentionConfig, env: Environment) -> str | None:
    # The seed trains FP8 only with H == 128; on sm90 cuDNN enforces it itself (_fp8_backward_hopper).
    if c.fp8 and c.training and _major(env) != 9 and (c.qk_dim, c.v_dim) != (128, 128):
        return f"training needs qk_dim == v_dim == 128, found ({c.qk_dim}, {c.v_dim})"
    return None


def _fp8_training_lengths(c: AttentionConfig, env: Environment) -> str | None:
    if c.fp8 and c.training and (c.q_len % 128 or c.kv_len % 128):
        return f"training needs T and S multiples of 128, found T={c.q_len}, S={c.kv_len}"
    return None


def _fp8_masks(c: AttentionConfig, env: Environment) -> str | None:
    found = _present(("padding", c.mask.padding), ("sliding window", c.mask.left_bound is not None))
    return f"no mask or a causal mask only, found {found} (packing and paging imply padding)" \
        if c.fp8 and found else None


def _fp8_alibi(c: AttentionConfig, env: Environment) -> str | None:
    return "no mask or a causal mask only, found ALiBi" if c.fp8 and c.mask.alibi else None


def _fp8_extras(c: AttentionConfig, env: Environment) -> str | None:
    found = _present(("dropout", c.has_dropout), ("score_mod", c.score_mod is not None))
    return f"no {found} (the seed's FP8 path has neither)" if c.fp8 and found else None


def _score_max_sink(c: AttentionConfig, env: Environment) -> str | None:
    return "not with an attention sink (cuDNN 9.19 builds no sm90 plan for both)" if c.score_max and c.sink else None


def _score_max_extras(c: AttentionConfig, env: Environment) -> str | None:
    found = _present(("packed segments", c.packing is not None), ("FP8", c.fp8))
    return f"not with {found} (no path for their row statistics here)" if c.score_max and found else None


def _paged_forward_only(c: AttentionConfig, env: Environment) -> str | None:
    return "no backward (cuDNN's sdpa_backward takes no page tables)" if c.paging else None


def _packed_layout(c: AttentionConfig, env: Environment) -> str | None:
    if c.packing and c.layout is not AttentionLayout.BTNH:
        return f"need the token-major BTNH layout (ragged offsets index tokens), found {c.layout.name}"
    return None


def _packed_bias(c: AttentionConfig, env: Environment) -> str | None:
    return "cannot be combined with bias (cuDNN indexes it per segment)" if c.packing and c.bias is not None \
        else None


def _packed_paged(c: AttentionConfig, env: Environment) -> str | None:
    return ("cannot be combined with paged K/V (cuDNN indexes the caches per segment; the reference reads "
            "them per sequence)") if c.packing and c.paging is not None else None


def _score_mod_args(c: AttentionConfig, env: Environment) -> str | None:
    if c.score_mod is None:
        return None
    shapes = [shape for shape, _ in c.score_mod.arg_shapes]
    if len(shapes) > SCORE_MOD_MAX_ARGS:
        return f"takes at most {SCORE_MOD_MAX_ARGS} arguments, found {len(shapes)}"
    if any(math.prod(shape) != 1 for shape in shapes):
        return f"arguments must be scalars (bound by value), found shapes {shapes}"
    return None


def _jax_score_mod_args(c: AttentionConfig, env: Environment) -> str | None:
    if c.score_mod is not None and c.score_mod.arg_shapes:
        return ("score_mod arguments are traced arrays under JAX, but cuDNN binds them by value on the host; "
                "close over Python floats in score_mod instead of passing score_mod_args")
    return None


def _jax_int64_offsets(c: AttentionConfig, env: Environment) -> str | None:
    if c.packing is None:
        return None
    jax = sys.modules.get("jax")       # the JAX front's row: that front imported JAX; without it, JAX's default
    if ragged_offset_dtype(c) == "int64" and not (jax is not None and jax.config.jax_enable_x64):
        return "these packed tensors need int64 ragged offsets; enable jax_enable_x64"
    return None


def _cudnn_dtype(c: AttentionConfig, env: Environment) -> str | None:
    if c.dtype in CUDNN_DTYPES:
        return None
    return f"{c.dtype} (cuDNN takes {', '.join(CUDNN_DTYPES)}; {c.dtype} runs in the NumPy reference only)"


def _sm103_cudnn(c: AttentionConfig, env: Environment) -> str | None:
    if env.compute_capability == (10, 3) and env.cudnn_version is not None and env.cudnn_version < 91100:
        return f"sm103 needs cuDNN >= 9.11.0, found {format_version(env.cudnn_version)}"
    return None


RESTRICTIONS: tuple[Restriction, ...] = (
    # Enforced by cuDNN: each sm90 refusal was seen in a deviceless cuDNN 9.19 build; the sm100 rows are
    # read from the frontend's support surface (sdpa_support_surface.h), not executed.
    Restriction("input dtype", _cudnn_dtype, CUDNN),
    Restriction("head dim", _head_dim_multiple, CUDNN),
    Restriction("head dim", _head_dim_backward_sm90, CUDNN),
    Restriction("head dim", _head_dim_backward_sm100, CUDNN),
    Restriction("ALiBi", _alibi_needs_causal, CUDNN),
    Restriction("bottom-right causal mask", _bottom_right_exclusions, CUDNN),
    Restriction("bottom-right causal mask", _bottom_right_lengths, CUDNN),
    Restriction("sliding window", _window_lengths, CUDNN),
    Restriction("attention sink", _sink_needs_queries, CUDNN),
    # The backward at T == S == 1 (refused by cuDNN) and training with a bias at odd T or S (refused by
    # the seed) run padded to even lengths (cudnn_attn.core.padded_call): no rule, users never meet them.
    # Packed BNTH runs transposed to BTNH, and bottom-right without padding folded into a bias, likewise.
    Restriction("deterministic backward", _deterministic_sm100, CUDNN),
    Restriction("packed segments with dbias", _packed_dbias_sm100, CUDNN),
    Restriction("FP8 attention", _fp8_bias, CUDNN, fronts=EVERY_FRONT, structural=(Kind.BACKWARD,)),
    Restriction("FP8 attention", _fp8_sink, CUDNN),
    Restriction("FP8 attention", _fp8_head_dim, CUDNN),
    Restriction("FP8 attention", _fp8_backward_hopper, CUDNN),
    Restriction("max logit", _score_max_sink, CUDNN, kinds=(Kind.FORWARD,)),
    Restriction("paged K/V cache", _paged_forward_only, CUDNN, kinds=(Kind.BACKWARD,), fronts=EVERY_FRONT,
                structural=(Kind.BACKWARD,)),
    # This library's policy (the seed's rules) or a path it does not have; cuDNN may build these.
    Restriction("head dim", _head_dim_limit, LIBRARY),
    Restriction("FP8 attention", _fp8_masks, LIBRARY),
    Restriction("FP8 attention", _fp8_alibi, LIBRARY, fronts=EVERY_FRONT, structural=(Kind.BACKWARD,)),
    Restriction("FP8 attention", _fp8_extras, LIBRARY, fronts=EVERY_FRONT, structural=(Kind.BACKWARD,)),
    Restriction("FP8 attention", _fp8_training_head_dim, LIBRARY),
    Restriction("FP8 attention", _fp8_training_lengths, LIBRARY),
    Restriction("max logit", _score_max_extras, LIBRARY, kinds=(Kind.FORWARD,), fronts=EVERY_FRONT),
    # The builder cannot declare it; every call that has it runs transposed (padded_call): no call meets it.
    Restriction("packed segments", _packed_layout, LIBRARY, kinds=(), structural=KINDS),
    Restriction("packed segments", _packed_bias, LIBRARY, structural=KINDS),
    Restriction("packed segments", _packed_paged, LIBRARY, fronts=EVERY_FRONT, structural=KINDS),
    Restriction("score_mod", _score_mod_args, LIBRARY, structural=KINDS),
    Restriction("score_mod", _score_mod_limits_forward, LIBRARY, kinds=(Kind.FORWARD,), structural=(Kind.FORWARD,)),
    Restriction("score_mod", _score_mod_limits_backward, LIBRARY, kinds=(Kind.BACKWARD,),
                structural=(Kind.BACKWARD,)),
    Restriction("GPU", _sm103_cudnn, LIBRARY),
    # The JAX bridge's cuDNN path: what XLA's FFI cannot hand to cuDNN.
    Restriction("JAX on cuDNN", _jax_score_mod_args, LIBRARY, fronts=(Front.JAX,)),
    Restriction("JAX on cuDNN", _jax_int64_offsets, LIBRARY, fronts=(Front.JAX,)),
)


# -- context parallelism ------------------------------------------------------------------------------

@dataclass(frozen=True)
class SplitRestriction:
    """A feature that cannot run with the query/key sequence split over devices (the JAX bridge's context
    parallelism, ``jax_bridge.context_parallel``): ``applies(config)`` and the reason it does not run."""

    feature: str
    applies: Callable[[AttentionConfig], bool]
    reason: str

    def unmet(self, config: AttentionConfig) -> list[str]:
        return [f"context parallelism: not with {self.feature} ({self.reason})"] if self.applies(config) else []


CONTEXT_PARALLEL_RESTRICTIONS: tuple[SplitRestriction, ...] = (
    SplitRestriction("dropout", lambda c: c.has_dropout,
                     "every block call would draw the same Philox positions; cuDNN takes no per-block offset here"),
    SplitRestriction("ALiBi", lambda c: c.mask.alibi,
                     "cuDNN's slopes count positions from each block's first row and key, not the sequence's"),
    SplitRestriction("FP8", lambda c: c.fp8,
                     "the blocks' partial outputs are merged by their logsumexps, which FP8 graphs rescale"),
    SplitRestriction("score_mod", lambda c: c.score_mod is not None,
                     "a score_mod reads block positions, not the sequence's"),
    SplitRestriction("packed segments in a sliding window or an off-diagonal band",
                     lambda c: c.packing is not None and (c.mask.left_bound is not None
                                                          or c.mask.right_bound not in (None, 0)),
                     "cuDNN counts a segment's band from its first row and key in each block, so a block off the "
                     "diagonal would need a different band for every segment that starts inside it"),
    SplitRestriction("paged K/V caches", lambda c: c.paging is not None, "a page table addresses the whole cache"),
    SplitRestriction("a bottom-right diagonal with per-sequence lengths",
                     lambda c: (c.mask.alignment is DiagonalAlignment.BOTTOM_RIGHT and c.mask.padding
                                and c.mask.right_bound is not None),
                     "its offset differs per sequence"),
)


def context_parallel_reasons(config: AttentionConfig) -> list[str]:
    """Why ``config`` cannot run with its sequence split over devices (:data:`CONTEXT_PARALLEL_RESTRICTIONS`;
    empty when it can).  Refusals of the placement itself (lengths that do not split evenly) are
    ``ValueError`` s of ``jax_bridge.context_parallel``."""
    _check_config(config)
    return [reason for rule in CONTEXT_PARALLEL_RESTRICTIONS for reason in rule.unmet(config)]


# -- public -----------------------------------------------------------------------------------------

ENFORCERS = (CUDNN, LIBRARY)
_ANYWHERE = Environment(None, None)      # the environment-free questions: no version or GPU rule applies


def _kinds(config: AttentionConfig, kind: str | None) -> tuple[Kind, ...]:
    if kind is None:
        return KINDS if config.training else (Kind.FORWARD,)
    try:
        return (Kind(kind),)
    except ValueError:
        raise ValueError(f"kind: expected 'fwd', 'bwd' or None (every graph the configuration needs), "
                         f"got {kind!r}") from None


def _front(front: str) -> Front:
    try:
        return Front(front)
    except ValueError:
        names = ", ".join(repr(f.value) for f in EVERY_FRONT)
        raise ValueError(f"front: expected one of {names}, got {front!r}") from None


def _check_config(config: AttentionConfig) -> None:
    if not isinstance(config, AttentionConfig):
        raise ValueError(f"config: expected an AttentionConfig (cudnn_attn.core.validation.validate_call builds one), "
                         f"got {type(config).__name__}")


def _unique(reasons: list[str]) -> list[str]:
    """``reasons`` without repeats (a rule of both graphs may say the same of each), in order."""
    return list(dict.fromkeys(reasons))


def _restrictions(config: AttentionConfig, env: Environment, kinds: tuple[Kind, ...], front: Front,
                  enforced_by: str | None = None, structural: bool = False) -> list[str]:
    reasons = []
    for rule in RESTRICTIONS:
        if front not in rule.fronts or (enforced_by is not None and rule.enforced_by != enforced_by):
            continue
        if not set(rule.structural if structural else rule.kinds) & set(kinds):
            continue
        reasons += rule.unmet(config, env)
    return _unique(reasons)


def not_supported_reasons(config: AttentionConfig, env: Environment | None = None, *,
                          kind: str | None = None, enforced_by: str | None = None,
                          front: str = Front.CUPY) -> list[str]:
    """Every reason ``config`` cannot run in ``env`` (detected when ``None``) on ``front``; empty when it can.

    ``kind`` (``"fwd"``/``"bwd"``, a :class:`~cudnn_attn.core.types.Kind`) asks about one graph; ``None`` asks
    about every graph the configuration needs (the backward too when ``config.training``): a paged
    forward that returns the logsumexp is fine, its backward is not.  ``enforced_by`` (``CUDNN`` or
    ``LIBRARY``) keeps only the rules of that kind (the missing GPU or cuDNN is reported by neither).
    ``front`` (``"cupy"``, ``"jax"`` or ``"reference"``) is what runs the call: the reference needs no
    GPU or cuDNN and ignores ``env``.  With valid arguments this never raises: everything it finds is
    a reason.

    Raises:
        ValueError: ``config`` is not an :class:`AttentionConfig`, ``env`` not an :class:`Environment`,
            ``kind``, ``enforced_by`` or ``front`` not one of the values above.
    """
    _check_config(config)
    if env is not None and not isinstance(env, Environment):
        raise ValueError(f"env: expected a cudnn_attn.core.support.Environment or None, got {type(env).__name__}")
    if enforced_by is not None and enforced_by not in ENFORCERS:
        raise ValueError(f"enforced_by: expected {CUDNN!r}, {LIBRARY!r} or None, got {enforced_by!r}")
    kinds, front = _kinds(config, kind), _front(front)
    if front is Front.REFERENCE:
        return _restrictions(config, _ANYWHERE, kinds, front, enforced_by)
    env = Environment.detect() if env is None else env
    reasons = []
    if enforced_by is None:
        if env.cudnn_version is None:
            reasons.append("no cuDNN library found (install nvidia-cudnn-cu13)")
        if env.compute_capability is None:
            reasons.append("no CUDA GPU with cuDNN found")
    for rule in REQUIREMENTS:
        if enforced_by is None or rule.enforced_by == enforced_by:
            reasons += rule.unmet(config, env)
    return reasons + _restrictions(config, env, kinds, front, enforced_by)


def check_supported(config: AttentionConfig, env: Environment | None = None, *, kind: str | None = None,
                    front: str = Front.CUPY) -> None:
    """Raise :class:`UnsupportedConfigurationError` listing every reason ``config`` (or its ``kind``
    graph) cannot run on ``front`` (see :func:`not_supported_reasons`)."""
    env = Environment.detect() if env is None and front != Front.REFERENCE else env
    reasons = not_supported_reasons(config, env, kind=kind, front=front)
    if reasons:
        raise UnsupportedConfigurationError(reasons, config, env)


def check_everywhere(config: AttentionConfig, *, kind: str | None = None) -> None:
    """Raise :class:`UnsupportedConfigurationError` with the restrictions no front lifts - neither cuDNN on
    any GPU nor the NumPy reference - with the same reasons :func:`check_supported` gives for them.  The
    reference refuses exactly these (``front="reference"``)."""
    check_supported(config, kind=kind, front=Front.REFERENCE)


def check_structure(config: AttentionConfig, *, kind: str) -> None:
    """Raise :class:`UnsupportedConfigurationError` with the rows whose ``kind`` graph the builder cannot
    declare (cuDNN's API has no way to say them), in any environment: the graph builder's refusals."""
    _check_config(config)
    reasons = _restrictions(config, _ANYWHERE, _kinds(config, kind), Front.CUPY, structural=True)
    if reasons:
        raise UnsupportedConfigurationError(reasons, config)
