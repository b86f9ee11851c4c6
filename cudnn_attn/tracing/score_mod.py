"""Tracing a user ``score_mod`` with JAX into its :class:`~cudnn_attn.core.config.ScoreModSpec`: the program is the
identity.

:func:`trace` (installed as :func:`cudnn_attn.core.score_mod_spec.score_mod_spec`'s tracer when this module is
imported) traces ``score_mod(score, *score_mod_args)`` with JAX once, at the call's float32
``(B, N, T, S)`` score shape, and keeps what was traced, never the function:

* the closed jaxpr (``spec.jaxpr``), which the NumPy reference evaluates (:func:`apply`, :func:`vjp`);
* the translation of the forward and of its VJP into pointwise programs (``spec.program``, a
  :class:`~cudnn_attn.core.score_mod_spec.ScoreModProgram`, :mod:`.jaxpr_program`), from which the graph builder
  emits cuDNN operations - or, when cuDNN cannot express the function, the reasons (``spec.refusals``);
* ``spec.digest``, the identity: a hash of the translated programs (operations, their order and
  constants), or of the jaxpr's structure and constants when there is no translation.  Two calls with
  equal functions - an inline lambda re-created in a loop, a ``functools.partial`` of the same function
  and constants - give equal specs and so equal configurations: they share one cuDNN graph.

Tracing costs about a millisecond; a weak-keyed memo by function object avoids it for a function seen
before (the entry goes when the function does).  As with ``jax.jit``, a function whose behaviour depends
on Python state that changes between calls is traced once: pass changing values as ``score_mod_args``.

A configuration whose batch or head count changes after the call (``vmap`` folds into the batch,
automatic sharding splits batch and heads) keeps the spec: the translated programs are shape-free
(positions are read per axis), so cuDNN and the reference run them at the new shape; the jaxpr is used
only at the shape it was traced for.
"""

from __future__ import annotations

import enum
import hashlib
import inspect
import math
import re
import threading
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from cudnn_attn.core import score_mod_spec as _spec
from cudnn_attn.core.config import ScoreModSpec
from cudnn_attn.core.errors import UnsupportedConfigurationError
from cudnn_attn.core.score_mod_ir import Program, evaluate
from cudnn_attn.core.score_mod_spec import ArgShapes, ScoreModProgram

from .jaxpr_program import program_dtype, translate_jaxpr

_MEMO_PER_FUNCTION = 32
_memo: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_memo_lock = threading.Lock()


def trace(fn: Any, score_shape: Sequence[int], arg_shapes: ArgShapes = ()) -> ScoreModSpec:
    """The spec of ``fn`` for float32 scores of ``score_shape`` and arguments of ``arg_shapes``
    (``((shape, dtype name), ...)``), traced once per function object (module doc).

    Raises:
        ValueError: ``fn`` is not a valid ``score_mod`` for these arguments (the message names ``score_mod``).
    """
    key = (tuple(int(n) for n in score_shape), tuple((tuple(s), str(d)) for s, d in arg_shapes))
    try:
        with _memo_lock:
            known = _memo.get(fn, {}).get(key)
    except TypeError:              # neither hashable nor weakly referenceable: trace every time
        known = None
    if known is not None:
        return known
    spec = _trace(fn, *key)
    try:
        with _memo_lock:
            specs = _memo.setdefault(fn, {})
            if len(specs) >= _MEMO_PER_FUNCTION:
                specs.clear()
            specs[key] = spec
    except TypeError:
        pass
    return spec


def _name(fn: Any) -> str:
    for candidate in (fn, getattr(fn, "func", None)):          # functools.partial: the wrapped function
        name = getattr(candidate, "__name__", None)
        if isinstance(name, str):
            return name
    return type(fn).__name__


def _check_arity(fn: Any, name: str, count: int) -> None:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):          # no introspectable signature (some builtins): tracing decides
        return
    try:
        signature.bind(*([None] * (1 + count)))
    except TypeError as error:
        raise ValueError(f"score_mod: {name!r} is called as score_mod(score, *score_mod_args) with 1 + {count} "
                         f"argument(s), but its signature {signature} does not take them ({error})") from None


def _describe_result(out: Any) -> str:
    import jax

    if isinstance(out, jax.ShapeDtypeStruct):
        return f"{np.dtype(out.dtype).name}{list(out.shape)}"
    if out is None:
        return "None"
    leaves = jax.tree.leaves(out)
    return f"{type(out).__name__} of {len(leaves)} array(s)"


def _trace(fn: Any, score_shape: tuple[int, ...], arg_shapes: ArgShapes) -> ScoreModSpec:
    import jax
    import jax.numpy as jnp

    if not callable(fn):
        raise ValueError(f"score_mod: must be callable as score_mod(score, *score_mod_args), got {fn!r}")
    name = _name(fn)
    _check_arity(fn, name, len(arg_shapes))
    score = jax.ShapeDtypeStruct(score_shape, np.float32)
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in arg_shapes]
    try:
        closed, out = jax.make_jaxpr(fn, return_shape=True)(score, *args)
    except Exception as error:  # noqa: BLE001 -- anything the user's function raises while traced
        raise ValueError(f"score_mod: tracing {name}(score, *score_mod_args) with JAX on a float32 score "
                         f"{list(score_shape)} and {len(args)} argument(s) failed: {type(error).__name__}: "
                         f"{error}") from error
    if not (isinstance(out, jax.ShapeDtypeStruct) and tuple(out.shape) == score_shape
            and jnp.issubdtype(out.dtype, jnp.floating)):
        raise ValueError(f"score_mod: {name!r} must return one float array of the score's shape (B, N, T, S) = "
                         f"{score_shape}, got {_describe_result(out)}")
    if any(isinstance(c, jax.core.Tracer) for c in closed.consts):
        raise ValueError(f"score_mod: {name!r} closes over a value traced by an enclosing jit/grad/vmap; cuDNN "
                         "builds score_mod into its graph when the call is traced, so every constant must be "
                         "known then: close over Python numbers or concrete arrays (or pass scalars as "
                         "score_mod_args outside JAX)")
    try:
        program, refusals = _translate(closed, name, score_shape, arg_shapes), ()
        digest = "ir:" + _hash((_program_key(program.forward), _program_key(program.backward)))
    except UnsupportedConfigurationError as error:
        program, refusals = None, tuple(error.reasons)
        digest = "jaxpr:" + _hash((_structure(closed.jaxpr, closed.consts), _vjp_structure(closed)))
    return ScoreModSpec(digest=digest, arg_shapes=arg_shapes, name=name, score_shape=score_shape,
                        program=program, refusals=refusals, jaxpr=closed)


def _vjp_jaxpr(closed: Any) -> Any:
    """The jaxpr of ``(cotangent, score, *args) -> cotangent * d(fn)/d(score)``, from ``fn``'s jaxpr."""
    import jax
    from jax.extend.core import jaxpr_as_fun

    fn = jaxpr_as_fun(closed)
    score = closed.in_avals[0]

    def vjp(cotangent: Any, s: Any, *values: Any) -> Any:
        return jax.vjp(lambda x: fn(x, *values)[0], s)[1](cotangent)[0]

    return jax.make_jaxpr(vjp)(score, score, *closed.in_avals[1:])


def _translate(closed: Any, name: str, score_shape: tuple[int, ...], arg_shapes: ArgShapes) -> ScoreModProgram:
    """Forward and backward programs (raises :class:`UnsupportedConfigurationError` with the reason)."""
    for position, (shape, dtype) in enumerate(arg_shapes):
        if math.prod(shape) != 1:
            raise UnsupportedConfigurationError([
                f"score_mod {name!r}: score_mod_args[{position}] has shape {tuple(shape)}; cuDNN 9.19 takes "
                "score_mod arguments as by-value scalars only (array operands give wrong gradients or fail "
                "to compile), so build per-position values from lax.broadcasted_iota inside score_mod"])
        try:
            program_dtype(dtype)
        except TypeError:
            raise UnsupportedConfigurationError(
                [f"score_mod {name!r}: score_mod_args[{position}] has dtype {dtype}"]) from None
    args = ["arg"] * len(arg_shapes)
    forward = translate_jaxpr(closed, ["score", *args], score_shape, name)
    try:
        backward_jaxpr = _vjp_jaxpr(closed)
    except Exception as error:  # noqa: BLE001 -- JAX cannot differentiate it: cuDNN cannot run its backward
        raise UnsupportedConfigurationError(
            [f"score_mod {name!r}: its VJP cannot be traced ({type(error).__name__}: {error})"]) from error
    backward = translate_jaxpr(backward_jaxpr, ["cotangent", "score", *args], score_shape, f"{name} (backward)")
    return ScoreModProgram(name=name, forward=forward, backward=backward, num_args=len(arg_shapes))


# -- identity ------------------------------------------------------------------------------------------

def _hash(key: Any) -> str:
    return hashlib.sha256(repr(key).encode()).hexdigest()[:32]


def _value_key(value: Any) -> tuple:
    array = np.asarray(value)
    return (array.dtype.str, array.shape, hashlib.sha256(array.tobytes()).hexdigest()[:16])


def _program_key(program: Program) -> tuple:
    """A program's operations, wiring and constants (not its name)."""
    def param(p: Any) -> Any:
        return _value_key(p) if isinstance(p, (np.generic, np.ndarray)) else p
    return tuple((n.op, n.inputs, n.dtype, param(n.param), n.tag) for n in program.nodes) + (program.output,)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _param_key(p: Any) -> Any:
    from jax.extend.core import ClosedJaxpr, Jaxpr

    if isinstance(p, ClosedJaxpr):
        return ("closed", _structure(p.jaxpr, p.consts))
    if isinstance(p, Jaxpr):
        return ("jaxpr", _structure(p, ()))
    if isinstance(p, (tuple, list)):
        return tuple(_param_key(x) for x in p)
    if isinstance(p, (str, int, float, bool, type(None), enum.Enum, np.dtype)):
        return repr(p)
    if isinstance(p, (np.ndarray, np.generic)) or hasattr(p, "__array__"):
        return _value_key(p)
    if callable(p):               # custom derivative rules: their effect is in the VJP's structure
        return "<callable>"
    return _ADDRESS.sub("", repr(p))


def _structure(jaxpr: Any, consts: Sequence[Any]) -> tuple:
    """A jaxpr's equations, wiring, parameters and constants, with variables numbered in order."""
    from jax.extend.core import Literal

    ids: dict[Any, int] = {}
    for var in (*jaxpr.constvars, *jaxpr.invars):
        ids[var] = len(ids)

    def atom(a: Any) -> Any:
        return ("literal", _value_key(a.val)) if isinstance(a, Literal) else ids[a]

    eqns = []
    for eqn in jaxpr.eqns:
        inputs = tuple(atom(a) for a in eqn.invars)
        for var in eqn.outvars:
            ids[var] = len(ids)
        eqns.append((eqn.primitive.name, inputs, tuple(str(v.aval) for v in eqn.outvars),
                     tuple(sorted((k, _param_key(v)) for k, v in eqn.params.items()))))
    return (tuple(str(v.aval) for v in jaxpr.invars), tuple(_value_key(c) for c in consts), tuple(eqns),
            tuple(atom(a) for a in jaxpr.outvars))


def _vjp_structure(closed: Any) -> Any:
    try:
        backward = _vjp_jaxpr(closed)
    except Exception:  # noqa: BLE001 -- not differentiable: the forward alone is the identity
        return None
    return _structure(backward.jaxpr, backward.consts)


# -- evaluation (the NumPy reference) -------------------------------------------------------------------

def _runnable(spec: ScoreModSpec, shape: tuple[int, ...]) -> ScoreModProgram:
    if spec.program is None:
        raise UnsupportedConfigurationError(
            [f"score_mod {spec.name!r} was traced for scores {list(spec.score_shape)}; at {list(shape)} (a batch or "
             "head count changed by vmap or sharding) only its translated program can run, and there is none: "
             + "; ".join(spec.refusals)])
    return spec.program


def _traced_function(spec: ScoreModSpec, shape: tuple[int, ...]) -> Callable[..., Any] | None:
    if spec.jaxpr is None or tuple(shape) != tuple(spec.score_shape):
        return None
    from jax.extend.core import jaxpr_as_fun

    return jaxpr_as_fun(spec.jaxpr)


def apply(spec: ScoreModSpec, score: np.ndarray, args: Sequence[Any]) -> np.ndarray:
    """``score_mod(score, *args)`` on a float32 ``(B, N, T, S)`` NumPy score: the traced jaxpr at the traced
    shape, the translated program at any other."""
    score = np.asarray(score, np.float32)
    fn = _traced_function(spec, score.shape)
    if fn is None:
        return evaluate(_runnable(spec, score.shape).forward, score=score, args=tuple(args))
    return np.asarray(fn(score, *args)[0])


def vjp(spec: ScoreModSpec, score: np.ndarray, cotangent: np.ndarray, args: Sequence[Any]) -> np.ndarray:
    """``cotangent * d score_mod(score, *args) / d score`` (as :func:`apply` chooses)."""
    score, cotangent = np.asarray(score, np.float32), np.asarray(cotangent, np.float32)
    fn = _traced_function(spec, score.shape)
    if fn is None:
        return evaluate(_runnable(spec, score.shape).backward, score=score, cotangent=cotangent, args=tuple(args))
    import jax
    import jax.numpy as jnp

    _, pullback = jax.vjp(lambda s: fn(s, *args)[0], jnp.asarray(score))
    return np.asarray(pullback(jnp.asarray(cotangent))[0])


_spec.install_tracer(trace)
