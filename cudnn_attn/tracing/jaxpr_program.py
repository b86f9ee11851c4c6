"""Translate the jaxpr of a user ``score_mod`` into a pointwise :class:`~cudnn_attn.core.score_mod_ir.Program`.

The forward is ``jax.make_jaxpr(score_mod)(score, *args)`` on a float32 ``(B, N, T, S)`` score; the
backward is the jaxpr of its VJP with respect to the score, ``(g, s, *args) -> g·∂score_mod/∂s``, as
JAX's own cuDNN flex attention derives it.  Each equation becomes nodes of the program:

* elementwise arithmetic, comparisons, logic, ``select_n``, ``clamp``, ``integer_pow``, ``sign``,
  ``rem``, ``is_finite``, transcendental functions, ``erfc``, ``polynomial`` (Horner's rule; JAX >= 0.12
  emits it in the derivative of ``erf``) (see :data:`_ELEMENTWISE` and :meth:`_Translator._emit`);
* ``iota`` (``lax.broadcasted_iota``, ``jnp.arange``) becomes a position along a score axis: which
  axis is found by following the value through ``broadcast_in_dim`` / ``reshape`` to the score's
  shape (:func:`_score_axes`);
* ``broadcast_in_dim``, ``reshape``, ``squeeze``, ``copy``, ``stop_gradient`` and
  ``convert_element_type`` between types of the same kind cost nothing: every value broadcasts;
* calls (``jit``, ``custom_jvp_call``, ``custom_vjp_call``, ``checkpoint``, ...) are inlined;
* a float split into high and low parts by masking its low mantissa bits,
  ``bitcast_convert_type(bitcast_convert_type(x, uint32) & mask, float32)`` (JAX >= 0.12 computes
  ``exp(-x**2)`` in the derivative of ``erf`` this way, for accuracy) is ``x`` itself: the part below the
  mask (less than ``2**-k`` of ``x`` for a mask clearing ``k < 23`` bits) then comes out as 0, so the
  split's refinement is lost and the result is the plain float32 formula.  ``reduce_precision`` is
  likewise the identity (cuDNN computes in float32).

Anything else (reductions, gathers, matrix products, other bit manipulations, ...) raises
:class:`~cudnn_attn.core.errors.UnsupportedConfigurationError` naming the primitive and the function.
Arguments must be scalars: cuDNN 9.19 receives them by value (see :mod:`cudnn_attn.graphs.score_mod`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from cudnn_attn.core.errors import UnsupportedConfigurationError
from cudnn_attn.core.score_mod_ir import BOOL, F32, I32, Program, ProgramBuilder

_CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
                    "custom_vjp_call_jaxpr", "remat", "remat2", "checkpoint"})
_PASS_THROUGH = frozenset({"broadcast_in_dim", "reshape", "squeeze", "copy", "copy_p", "stop_gradient",
                           "optimization_barrier", "reduce_precision"})
# JAX primitive -> program op, for the ones that map one to one.
_ELEMENTWISE = {
    "neg": "neg", "abs": "abs", "exp": "exp", "log": "log", "tanh": "tanh", "logistic": "sigmoid",
    "sqrt": "sqrt", "rsqrt": "rsqrt", "sin": "sin", "cos": "cos", "tan": "tan", "erf": "erf",
    "floor": "floor", "ceil": "ceil",
    "add": "add", "add_any": "add", "sub": "sub", "mul": "mul", "div": "div", "max": "max", "min": "min",
    "pow": "pow", "rem": "rem",
    "lt": "cmp_lt", "le": "cmp_le", "gt": "cmp_gt", "ge": "cmp_ge", "eq": "cmp_eq", "ne": "cmp_ne",
}
_LOGICAL = {"and": "logical_and", "or": "logical_or", "not": "logical_not", "xor": "cmp_ne"}


def program_dtype(dtype: Any) -> str:
    """The program dtype of a JAX dtype: float32 for floats, int32 for integers, bool."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return BOOL
    if dtype.kind in "iu":
        return I32
    if dtype.kind == "f" or dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        return F32
    raise TypeError(dtype)


@dataclass
class _Eqn:
    """One equation of the inlined jaxpr, over integer value ids."""

    primitive: str
    params: dict
    inputs: list[int]
    outputs: list[int]


class _Flattener:
    """Inlines call primitives and numbers every value (jaxpr variables, literals, constants)."""

    def __init__(self, unsupported: Callable[[str], UnsupportedConfigurationError]):
        self.unsupported = unsupported
        self.eqns: list[_Eqn] = []
        self.shapes: dict[int, tuple[int, ...]] = {}
        self.dtypes: dict[int, Any] = {}
        self.literals: dict[int, np.ndarray] = {}

    def new_value(self, aval: Any) -> int:
        vid = len(self.shapes)
        self.shapes[vid], self.dtypes[vid] = tuple(aval.shape), aval.dtype
        return vid

    def literal(self, value: Any, aval: Any) -> int:
        value = np.asarray(value)
        if value.size != 1:
            raise self.unsupported(
                f"it uses a constant array of shape {value.shape}; only scalar constants reach cuDNN "
                "(compute per-position values from lax.broadcasted_iota instead)")
        vid = self.new_value(aval)
        self.literals[vid] = value.reshape(())
        return vid

    def inline(self, jaxpr: Any, consts: Sequence[Any], inputs: Sequence[int]) -> list[int]:
        """Append ``jaxpr``'s equations with its inputs bound to ``inputs``; returns its output ids."""
        from jax.extend.core import Literal

        env: dict[Any, int] = {}
        for var, value in zip(jaxpr.constvars, consts):
            env[var] = self.literal(value, var.aval)
        env.update(zip(jaxpr.invars, inputs))

        def read(atom: Any) -> int:
            if isinstance(atom, Literal):
                return self.literal(atom.val, atom.aval)
            return env[atom]

        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            inputs_ = [read(a) for a in eqn.invars]
            if name in _CALLS:
                outputs = self._call(eqn, inputs_)
            else:
                outputs = [self.new_value(v.aval) for v in eqn.outvars]
                self.eqns.append(_Eqn(name, dict(eqn.params), inputs_, outputs))
            env.update(zip(eqn.outvars, outputs))
        return [read(a) for a in jaxpr.outvars]

    def _call(self, eqn: Any, inputs: list[int]) -> list[int]:
        from jax.extend.core import jaxprs_in_params

        subs = list(jaxprs_in_params(eqn.params))
        if len(subs) != 1:
            raise self.unsupported(f"the call primitive {eqn.primitive.name!r} has {len(subs)} bodies")
        body = subs[0]
        jaxpr, consts = (body.jaxpr, body.consts) if hasattr(body, "consts") else (body, ())
        return self.inline(jaxpr, consts, inputs)


def _score_axes(flat: _Flattener, live: list[_Eqn], output: int, score_shape: tuple[int, ...],
                unsupported: Callable[[str], UnsupportedConfigurationError]) -> dict[int, tuple]:
    """For each value, the score axis (0..3) each of its dimensions broadcasts to (``None``: size 1).

    Values with the score's rank are positional.  Lower-rank values (``jnp.arange(T)``, a reshaped
    iota) get their axes from the ``broadcast_in_dim`` / ``reshape`` that brings them to the score's
    shape, propagated backwards from the output.
    """
    def positional(vid: int) -> tuple:
        return tuple(None if n == 1 else a for a, n in enumerate(flat.shapes[vid]))

    axes: dict[int, tuple] = {output: positional(output)}

    def assign(vid: int, value: tuple) -> None:
        if len(flat.shapes[vid]) == len(score_shape):
            value = positional(vid)
        if axes.setdefault(vid, value) != value:
            raise unsupported(f"a value of shape {flat.shapes[vid]} is broadcast to the score in two different ways")

    for eqn in reversed(live):
        out_axes = axes.get(eqn.outputs[0])
        if out_axes is None:
            continue
        for vid in eqn.inputs:
            shape = flat.shapes[vid]
            if eqn.primitive == "broadcast_in_dim":
                dims = eqn.params["broadcast_dimensions"]
                assign(vid, tuple(None if n == 1 else out_axes[d] for n, d in zip(shape, dims)))
            elif eqn.primitive in ("reshape", "squeeze"):
                sizes = [n for n in shape if n != 1]
                targets = [(n, a) for n, a in zip(flat.shapes[eqn.outputs[0]], out_axes) if n != 1]
                if sizes != [n for n, _ in targets]:
                    raise unsupported(f"it reshapes {shape} to {flat.shapes[eqn.outputs[0]]}, which mixes dimensions")
                mapped = iter(a for _, a in targets)
                assign(vid, tuple(None if n == 1 else next(mapped) for n in shape))
            elif len(shape) == 0:
                assign(vid, ())
            elif len(shape) == len(out_axes):           # same rank; size-1 dimensions broadcast
                assign(vid, tuple(None if n == 1 else a for n, a in zip(shape, out_axes)))
            else:
                raise unsupported(f"{eqn.primitive!r} changes the shape {shape} -> {flat.shapes[eqn.outputs[0]]}")
    return axes


class _Translator:
    """Emits program nodes for the live equations of one flattened jaxpr."""

    def __init__(self, flat: _Flattener, axes: dict[int, tuple], builder: ProgramBuilder,
                 unsupported: Callable[[str], UnsupportedConfigurationError]):
        self.flat, self.axes, self.b, self.unsupported = flat, axes, builder, unsupported
        self.env: dict[int, int] = {}

    def value(self, vid: int) -> int:
        if vid not in self.env:
            self.env[vid] = self.b.const(self.flat.literals[vid], program_dtype(self.flat.dtypes[vid]))
        return self.env[vid]

    def run(self, eqns: list[_Eqn]) -> None:
        for eqn in eqns:
            if len(eqn.outputs) != 1:
                raise self.unsupported(f"the primitive {eqn.primitive!r} has {len(eqn.outputs)} results")
            out = eqn.outputs[0]
            try:
                dtype = program_dtype(self.flat.dtypes[out])
            except TypeError:
                raise self.unsupported(f"{eqn.primitive!r} produces {self.flat.dtypes[out]} values") from None
            self.env[out] = self._emit(eqn, [self.value(v) for v in eqn.inputs], dtype)

    def _emit(self, eqn: _Eqn, x: list[int], dtype: str) -> int:
        b, p, name = self.b, eqn.params, eqn.primitive
        if name in _PASS_THROUGH:
            return x[0]
        if name in _ELEMENTWISE:
            return b.op(_ELEMENTWISE[name], *x)
        if name in _LOGICAL:
            if dtype != BOOL:
                raise self.unsupported(f"bitwise {name!r} on integers has no cuDNN pointwise equivalent")
            return b.op(_LOGICAL[name], *x)
        if name == "iota":
            axis = self.axes[eqn.outputs[0]][p["dimension"]]
            index = b.const(0, I32) if axis is None else b.leaf("index", I32, axis)
            return b.op("cast", index, dtype=dtype)
        if name == "convert_element_type":
            return b.op("cast", x[0], dtype=dtype)
        if name == "select_n":
            if len(x) != 3:
                raise self.unsupported(f"select_n with {len(x) - 1} cases (only two-way selects)")
            return b.op("select", b.op("cast", x[0], dtype=BOOL), x[2], x[1])
        if name == "clamp":
            return b.op("min", b.op("max", x[1], x[0]), x[2])
        if name == "integer_pow":
            return self._integer_pow(x[0], p["y"], dtype)
        if name == "square":
            return b.op("mul", x[0], x[0])
        if name == "one_minus_square":
            return b.op("sub", b.const(1, dtype), b.op("mul", x[0], x[0]))
        if name == "sign":
            one, zero = b.const(1, dtype), b.const(0, dtype)
            negative = b.op("select", b.op("cmp_lt", x[0], zero), b.op("neg", one), zero)
            return b.op("select", b.op("cmp_gt", x[0], zero), one, negative)
        if name == "exp2":
            return b.op("exp", b.op("mul", x[0], b.const(math.log(2.0), F32)))
        if name == "log1p":
            return b.op("log", b.op("add", x[0], b.const(1, F32)))
        if name == "expm1":
            return b.op("sub", b.op("exp", x[0]), b.const(1, F32))
        if name == "erfc":
            return b.op("sub", b.const(1, F32), b.op("erf", x[0]))
        if name == "is_finite":                   # x - x is 0 for finite x, NaN for inf and NaN
            return b.op("cmp_eq", b.op("sub", x[0], x[0]), b.const(0, F32))
        if name == "polynomial":                  # a_0 + x (a_1 + x (a_2 + ...)), coefficients as operands
            value = x[-1]
            for coefficient in reversed(x[1:-1]):
                value = b.op("add", b.op("mul", value, x[0]), coefficient)
            return value
        raise self.unsupported(f"the JAX primitive {name!r} has no cuDNN pointwise equivalent")

    def _integer_pow(self, x: int, y: int, dtype: str) -> int:
        b = self.b
        if y == 0:
            return b.const(1, dtype)
        result, base, n = None, x, abs(y)
        while n:
            if n & 1:
                result = base if result is None else b.op("mul", result, base)
            n >>= 1
            if n:
                base = b.op("mul", base, base)
        return b.op("reciprocal", result) if y < 0 else result


_MANTISSA_BITS = 23      # float32


def _keeps_high_bits(mask: np.ndarray) -> bool:
    """``mask`` (a 32-bit integer) clears only low mantissa bits of a float32: ``~(2**k - 1)``, ``k < 23``."""
    cleared = ~int(mask) & 0xFFFFFFFF
    return (cleared & (cleared + 1)) == 0 and cleared < (1 << _MANTISSA_BITS)


def _merge_mantissa_splits(flat: _Flattener) -> None:
    """Rewrite ``bitcast(bitcast(x, u32) & mask, f32)`` (the high part of ``x``) as ``x`` (module doc)."""
    producer = {vid: eqn for eqn in flat.eqns for vid in eqn.outputs}

    def float32(vid: int) -> bool:
        return np.dtype(flat.dtypes[vid]) == np.float32

    for position, eqn in enumerate(flat.eqns):
        if eqn.primitive != "bitcast_convert_type" or not float32(eqn.outputs[0]):
            continue
        masked = producer.get(eqn.inputs[0])
        if masked is None or masked.primitive != "and" or len(masked.inputs) != 2:
            continue
        for bits, mask in (masked.inputs, masked.inputs[::-1]):
            source = producer.get(bits)
            if (mask in flat.literals and source is not None and source.primitive == "bitcast_convert_type"
                    and float32(source.inputs[0]) and np.dtype(flat.dtypes[bits]).itemsize == 4
                    and _keeps_high_bits(flat.literals[mask])):
                flat.eqns[position] = _Eqn("copy", {}, [source.inputs[0]], eqn.outputs)
                break


def _live(eqns: list[_Eqn], output: int) -> list[_Eqn]:
    needed, live = {output}, []
    for eqn in reversed(eqns):
        if needed.intersection(eqn.outputs):
            live.append(eqn)
            needed.update(eqn.inputs)
    return live[::-1]


def translate_jaxpr(closed: Any, leaves: Sequence[str], score_shape: tuple[int, ...], name: str) -> Program:
    """Translate a closed jaxpr into a :class:`Program` called ``name``.

    ``leaves`` names the jaxpr's inputs in order: ``"score"``, ``"cotangent"`` or ``"arg"`` (numbered in
    order).  The result must have the score's shape and a float dtype.

    Raises:
        UnsupportedConfigurationError: a primitive or a pattern without a cuDNN pointwise equivalent.
        ValueError: the jaxpr does not return one float array of the score's shape.
    """
    def unsupported(why: str) -> UnsupportedConfigurationError:
        return UnsupportedConfigurationError([f"score_mod {name!r} cannot run inside cuDNN: {why}"])

    flat = _Flattener(unsupported)
    inputs = [flat.new_value(var.aval) for var in closed.jaxpr.invars]
    outputs = flat.inline(closed.jaxpr, closed.consts, inputs)
    output = outputs[0]
    if len(outputs) != 1 or flat.shapes[output] != tuple(score_shape) or _safe_kind(flat.dtypes[output]) != F32:
        got = [(flat.shapes[o], str(np.dtype(flat.dtypes[o]))) for o in outputs]
        raise ValueError(f"score_mod: {name!r} must return one float array of the score's shape "
                         f"{tuple(score_shape)}, got {got}")
    _merge_mantissa_splits(flat)
    live = _live(flat.eqns, output)
    axes = _score_axes(flat, live, output, tuple(score_shape), unsupported)
    builder = ProgramBuilder(name)
    translator = _Translator(flat, axes, builder, unsupported)
    arg_position = 0
    for vid, leaf in zip(inputs, leaves):
        if leaf == "arg":
            # By-value scalars reach cuDNN as float32; integer and bool arguments are converted back.
            value = builder.leaf("arg", F32, arg_position)
            translator.env[vid] = builder.op("cast", value, dtype=program_dtype(flat.dtypes[vid]))
            arg_position += 1
        else:
            translator.env[vid] = builder.leaf(leaf, F32)
    translator.run(live)
    return builder.build(translator.env[output])


def _safe_kind(dtype: Any) -> str | None:
    try:
        return program_dtype(dtype)
    except TypeError:
        return None
