"""The public signatures, written once, and the one translation of a call into validation's arguments.

The seed's ``dot_product_attention``, ``paged_attention`` and ``dot_product_attention_bwd`` (and the native
``attention``) are each served by three fronts - the CuPy API, the NumPy reference and the JAX bridge - with
the same parameters and front-specific keyword extensions.  Here every parameter has one entry
(:data:`PARAMETERS`: default and annotation), every function one :class:`Form` (which parameters, in which
order).  Each front writes its public functions' signatures out in full, and :func:`front` checks them against
the table when the module is imported: a front cannot drift from the table, and tools see real signatures.
A new keyword is one entry here and one in each front's signature.

:func:`arguments` turns the bound arguments into :func:`cudnn_attn.core.validation.validate_call`'s (the arrays by
name and the static keywords), and for the native form maps the :class:`~cudnn_attn.core.masks.MaskSpec` onto
them; :func:`finish` applies what the seed's arguments cannot say (windows, ALiBi without the ALIBI mask
type) to the prepared configuration.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
from typing import Any, Callable, Iterator, NamedTuple

from .diagonal_warning import warn_top_left
from .masks import as_mask
from .types import MaskType

_REQUIRED = inspect.Parameter.empty
_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
_KEYWORD = inspect.Parameter.KEYWORD_ONLY

# name -> (default, annotation as written in the public signatures)
PARAMETERS: dict[str, tuple[Any, str]] = {
    # arrays
    "query": (_REQUIRED, "Any"), "key": (_REQUIRED, "Any"), "value": (_REQUIRED, "Any"),
    "output": (_REQUIRED, "Any"), "grad_output": (_REQUIRED, "Any"), "logsumexp": (_REQUIRED, "Any"),
    "bias": (None, "Any"), "mask": (None, "Any"), "q_seqlen": (None, "Any"), "kv_seqlen": (None, "Any"),
    "q_offsets": (None, "Any"), "kv_offsets": (None, "Any"), "page_table_k": (None, "Any"),
    "page_table_v": (None, "Any"), "fp8_params": (None, "FP8Params | None"), "score_mod_args": ((), "Sequence[Any]"),
    # the seed's keywords
    "scale": (1.0, "float | None"), "mask_type": (MaskType.NO_MASK, "MaskType"), "seed": (42, "int"),
    "dropout_rate": (0.0, "float"), "qkv_layout": ("BTNH", "str"), "sliding_window_length": (None, "int | None"),
    "score_mod": (None, "Callable[..., Any] | None"), "use_fp8": (False, "bool"), "return_residual": (False, "bool"),
    # extensions every front has
    "diagonal_alignment": ("top_left", "str"), "sink": (None, "Any"), "deterministic": (False, "bool"),
    # the native API's
    "layout": ("BTNH", "str"), "return_aux": (None, "AuxRequest | None"),
    # CuPy
    "stream": (None, "Any"), "autotune": (None, "bool | None"), "fp8_dtype": ("float8_e4m3fn", "str"),
    "out_type": (None, "str | None"), "check_values": (None, "bool | None"),
    # reference
    "dropout_mask": (None, "Any"),
    # JAX
    "cuda_graph": (None, "bool | None"), "backend": ("ffi", "str"), "context_parallel": (None, "Any"),
    "dropout_rng": (None, "Any"),
}

_SEED_ARRAYS = ("bias", "mask", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "fp8_params", "score_mod_args")
_SEED_KEYWORDS = ("scale", "mask_type", "seed", "dropout_rate", "qkv_layout", "sliding_window_length", "score_mod",
                  "use_fp8", "return_residual", "diagonal_alignment", "sink")


class Form(NamedTuple):
    """One public function's parameters: ``positional`` (the first ``required`` without default), then the
    keyword-only ``keywords``; ``overrides`` replaces :data:`PARAMETERS` entries for this form."""

    name: str
    positional: tuple[str, ...]
    required: int
    keywords: tuple[str, ...]
    overrides: dict[str, tuple[Any, str]] | None = None

    def parameters(self, extensions: tuple[str, ...] = ()) -> list[inspect.Parameter]:
        found = []
        for i, name in enumerate(self.positional + self.keywords + extensions):
            default, annotation = (self.overrides or {}).get(name) or PARAMETERS[name]
            if i < self.required:
                default = _REQUIRED
            found.append(inspect.Parameter(name, _POSITIONAL if i < len(self.positional) else _KEYWORD,
                                           default=default, annotation=annotation))
        return found


FORWARD = Form("dot_product_attention", ("query", "key", "value", *_SEED_ARRAYS), 3, _SEED_KEYWORDS)
PAGED = Form("paged_attention", ("query", "key", "value", "q_seqlen", "kv_seqlen", "page_table_k", "page_table_v",
                                 "bias", "mask", "fp8_params"), 7, tuple(k for k in _SEED_KEYWORDS if k != "score_mod"))
BACKWARD = Form("dot_product_attention_bwd", ("query", "key", "value", "output", "grad_output", "logsumexp",
                                              *_SEED_ARRAYS), 6, _SEED_KEYWORDS)
NATIVE = Form("attention", ("query", "key", "value"), 3,
              ("mask", "bias", "scale", "dropout_rate", "seed", "layout", "sink", "fp8_params", "return_aux"),
              overrides={"mask": (None, "MaskSpec | None"), "scale": (None, "float | None")})


def front(form: Form, *extensions: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator of a front's public function ``form.name``, whose signature is written out in full (so that
    IDEs, type checkers and ``inspect`` see it): checks, when the module is imported, that the written signature is
    exactly ``form``'s parameters and ``extensions`` (keyword-only, after them) - names, kinds, defaults and
    annotations - and attaches ``arguments``, the named tuple of those parameters (its ``form`` the form), with
    which the body binds its call: ``call = name.arguments(**locals())``."""
    def check(function: Callable[..., Any]) -> Callable[..., Any]:
        parameters = form.parameters(tuple(extensions))
        written = list(inspect.signature(function).parameters.values())
        expected = [(p.name, p.kind, p.default, p.annotation) for p in parameters]
        found = [(p.name, p.kind, p.default, p.annotation) for p in written]
        if found != expected or function.__name__ != form.name:
            wrong = next((f"{w} != {e}" for w, e in zip(found, expected) if w != e),
                         f"{len(found)} parameters, the table has {len(expected)}")
            raise TypeError(f"{function.__module__}.{function.__name__}: the written signature differs from the "
                            f"parameter table (cudnn_attn.core.parameters): {wrong}")
        arguments = collections.namedtuple(f"{form.name}_arguments", [p.name for p in parameters],
                                           module=function.__module__,
                                           defaults=[p.default for p in parameters[form.required:]])
        arguments.form = form
        accepted = {p.name for p in parameters}

        @functools.wraps(function)
        def public(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            except TypeError:
                # Only a keyword that is not a parameter, so the call failed binding: say what to write instead.
                foreign = next((name for name in kwargs if name not in accepted and name in FOREIGN_KEYWORDS), None)
                if foreign is None:
                    raise
                seed_form, native_form = FOREIGN_KEYWORDS[foreign]
                raise TypeError(f"{form.name}() got an unexpected keyword argument {foreign!r}; write "
                                f"{native_form if form is NATIVE else seed_form} instead") from None

        public.arguments = arguments
        return public
    return check


# Keywords of other attention APIs (torch SDPA, flash-attn, Flax) that the public functions do not take, with
# what each function form writes instead: (the seed forms, the native ``attention``).
FOREIGN_KEYWORDS = {
    "is_causal": ("mask_type=MaskType.CAUSAL (PADDING_CAUSAL with lengths)", "mask=causal()"),
    "causal": ("mask_type=MaskType.CAUSAL (PADDING_CAUSAL with lengths)", "mask=causal()"),
    "attn_mask": ("mask= (a boolean keep-mask, or an additive one) or bias=", "mask=keep(bool_array) or bias="),
    "dropout_p": ("dropout_rate=", "dropout_rate="),
    "softmax_scale": ("scale=", "scale="),
    "window_size": ("sliding_window_length=w", "mask=window(left, right)"),
}


# -- onto validation's arguments -----------------------------------------------------------------------

_ARRAY_NAMES = ("query", "key", "value", "bias", "mask", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets",
                "page_table_k", "page_table_v", "fp8_params", "score_mod_args", "sink")
_STATIC_NAMES = ("scale", "mask_type", "dropout_rate", "qkv_layout", "sliding_window_length", "score_mod",
                 "use_fp8", "diagonal_alignment", "deterministic")
# What validation's messages call an argument, and what the native API calls it.
NATIVE_NAMES = {"q_seqlen": "mask (q_lengths)", "kv_seqlen": "mask (kv_lengths)", "q_offsets": "mask (q_offsets)",
                "kv_offsets": "mask (kv_offsets)", "mask": "mask (keep)", "qkv_layout": "layout",
                "training (return_residual)": "return_aux", "use_fp8": "fp8_params"}


def is_native(call: NamedTuple) -> bool:
    """``call`` holds the arguments of the native ``attention`` (not of a seed function)."""
    return type(call).form is NATIVE


def arguments(call: NamedTuple, *, backward: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(arrays, static)``: the bound arguments of a seed or native call as
    :func:`cudnn_attn.core.validation.validate_call`'s (arrays by name, ``None`` where absent; the static keywords, with
    ``training`` from ``return_residual`` / ``return_aux``, always on for the backward)."""
    given = call._asdict()
    if is_native(call):
        return _native_arguments(given)
    arrays = {name: given[name] for name in _ARRAY_NAMES if name in given}
    static = {name: given[name] for name in _STATIC_NAMES if name in given}
    static["training"] = True if backward else given["return_residual"]
    return arrays, static


def _native_arguments(given: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    mask = as_mask(given["mask"])
    query = given["query"]
    arrays = dict(query=query, key=given["key"], value=given["value"], bias=given["bias"], **mask.seed_arrays(),
                  fp8_params=given["fp8_params"], sink=given["sink"])
    static = dict(scale=given["scale"], dropout_rate=given["dropout_rate"], qkv_layout=given["layout"],
                  use_fp8=given["fp8_params"] is not None, training=wants_logsumexp(given["return_aux"]),
                  mask_type=MaskType.PADDING if mask.q_lengths is not None else MaskType.NO_MASK,
                  deterministic=given.get("deterministic", False))
    return arrays, static


def finish(call: NamedTuple, config: Any) -> Any:
    """The prepared configuration of ``call`` with the native mask's static fields and ``score_max`` from
    ``AuxRequest(max_logit=True)`` (``config`` unchanged for the seed forms, whose
    ``mask_type``/``sliding_window_length`` validation has already translated)."""
    if not is_native(call):
        return config
    if wants_max_logit(call.return_aux):
        config = config.replace(score_max=True)
    if call.mask is None:
        return config
    mask = call.mask
    static = mask.static(padding=config.mask.padding)
    if static == config.mask:
        return config
    config = config.replace(mask=static)
    warn_top_left(config)
    return config


@contextlib.contextmanager
def native_names(call: NamedTuple, names: dict[str, str] | None = None) -> Iterator[None]:
    """Validation's ``ValueError``s of a native call, with the argument named as the native API names it
    (:data:`NATIVE_NAMES`, or ``names``: a front's own)."""
    if not is_native(call):
        yield
        return
    with renamed_arguments(NATIVE_NAMES if names is None else names):
        yield


@contextlib.contextmanager
def renamed_arguments(names: dict[str, str]) -> Iterator[None]:
    """Validation's ``ValueError``s with the argument they name (``"q_seqlen: ..."``) renamed by ``names``: for a
    front whose parameters are called otherwise than validation's."""
    try:
        yield
    except ValueError as error:
        message = str(error)
        argument, colon, rest = message.partition(": ")
        renamed = "/".join(names.get(part, part) for part in argument.split("/"))
        if not colon or renamed == argument:
            raise
        raise ValueError(f"{renamed}: {rest}") from error


class AuxRequest(NamedTuple):
    """Which auxiliary results the native :func:`~cudnn_attn.attention` returns besides the output (as PyTorch
    flex attention's ``AuxRequest``):

    * ``logsumexp`` - the natural-log float32 ``(B, N, T)`` softmax normaliser (``(B*M, N, T)`` with packed
      segments);
    * ``max_logit`` - the maximum scaled logit of each query head over the batch and the query rows, float32
      ``(N,)``, and beside it ``score_max``, each row's maximum, float32 ``(B, N, T)``: the max over the keys the
      masks admit of ``scale * q.k`` plus the bias (and ALiBi), before dropout.  A row without any admissible key
      (a padded query, a causal row before its first key, a row a boolean mask keeps no key of) is ``-inf``.
      Neither is differentiable: a gradient through them is zero.

    FP8 amax values come back whenever FP8 runs."""

    logsumexp: bool = False
    max_logit: bool = False


def _aux_request(return_aux: Any) -> AuxRequest:
    if return_aux is None:
        return AuxRequest()
    if not isinstance(return_aux, AuxRequest):
        raise ValueError(f"return_aux: expected None or AuxRequest(logsumexp=..., max_logit=...), got "
                         f"{type(return_aux).__name__}")
    for name, value in return_aux._asdict().items():
        if not isinstance(value, bool):
            raise ValueError(f"return_aux: AuxRequest.{name} must be True or False, got {value!r}")
    return return_aux


def wants_logsumexp(return_aux: Any) -> bool:
    """Whether the native call's ``return_aux`` (``None`` or an :class:`AuxRequest`) asks for the logsumexp.

    Raises:
        ValueError: ``return_aux`` is neither, or a field is not a bool (naming ``return_aux``).
    """
    return _aux_request(return_aux).logsumexp


def wants_max_logit(return_aux: Any) -> bool:
    """Whether ``return_aux`` asks for the max logit (``score_max`` and ``max_logit``); raises as
    :func:`wants_logsumexp`."""
    return _aux_request(return_aux).max_logit
