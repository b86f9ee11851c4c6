"""Emit a pointwise :class:`~.score_mod_ir.Program` as cuDNN operations inside a ``score_mod`` callback.

cuDNN calls ``score_mod(sg, s)`` / ``score_mod_bprop(sg, dS)`` while it lowers the attention node;
``sg`` is its backend graph (``cudnn._pybind_module.backend_graph``, seen through the frontend's
``_CallbackGraphShim``).  :func:`emit` appends pointwise operations for the program's nodes and returns
the result tensor.  Leaves map to:

* ``score`` / ``cotangent``: tensors the caller provides (the callback's input, or the forward score
  the backward saved, see :mod:`.score_mod`);
* ``index``: ``sg.gen_index(input=<callback input>, axis=a)`` (int32), generated afresh for each use;
* ``const``: ``sg.tensor_scalar(value, RUNTIME_PARAM)`` -- a by-value scalar whose value the
  frontend binds itself (measured on the H200 with cuDNN 9.19; ``COMPILE_TIME_CONST`` needs 9.22);
* ``arg`` / ``seq_len_q`` / ``seq_len_kv``: outer-graph tensors the graph builder declared.

cuDNN's fused-attention pattern matcher accepts only some shapes of pointwise graph.  What it refuses
(or crashes on) was measured with cuDNN 9.19 on sm90, and the emitter avoids it:

* an operation whose first input does not come from the score or a position (``1 - x``, ``c * c``):
  every operation gets such an *anchored* first input -- commutative operations and comparisons swap
  their operands, ``c - x`` becomes ``(-x) + c``, ``c / x`` becomes ``reciprocal(x) * c``, and an
  operation on scalars alone adds its first input to an anchored zero (``gen_index * 0``);
* ``logical_not``: a negated comparison is emitted instead (``not a < b`` -> ``a >= b``), or
  ``int(m) == 0``;
* ``logical_and`` / ``logical_or`` of most masks: they are emitted as ``int(a) + int(b) == 2`` /
  ``> 0``, except a mask on the query position combined with one on the key position (padding), which
  cuDNN wants as ``logical_and`` and crashes on otherwise.

Programs never compute on constants alone (:class:`~.score_mod_ir.ProgramBuilder` folds them).
"""

from __future__ import annotations

from typing import Any, Mapping

import cudnn

from cudnn_attn.core.score_mod_ir import BOOL, COMPARISONS, F32, I32, Node, Program

_DT = cudnn.data_type
_TYPES = {F32: _DT.FLOAT, I32: _DT.INT32, BOOL: _DT.BOOLEAN}
_COMMUTATIVE = frozenset({"add", "mul", "max", "min", "cmp_eq", "cmp_ne"})
_MIRRORED = {"cmp_lt": "cmp_gt", "cmp_gt": "cmp_lt", "cmp_le": "cmp_ge", "cmp_ge": "cmp_le"}
_INVERSE = {"cmp_lt": "cmp_ge", "cmp_ge": "cmp_lt", "cmp_le": "cmp_gt", "cmp_gt": "cmp_le",
            "cmp_eq": "cmp_ne", "cmp_ne": "cmp_eq"}
_METHODS = {"cmp_ne": "cmp_neq"}                    # program op -> backend_graph method, where they differ
_INPUT_PAIRS = frozenset({"max", "min", "pow"})     # methods taking (input0, input1) rather than (a, b)
_UNARY = frozenset({"neg", "abs", "exp", "log", "tanh", "sigmoid", "sqrt", "rsqrt", "reciprocal", "sin",
                    "cos", "tan", "erf", "floor", "ceil"})
_SCORE = "score"


class _Value:
    """An emitted value: its cuDNN tensor, program dtype and what it depends on.

    ``deps`` holds the score axes of the positions it reads and ``"score"`` when it derives from the
    callback's tensors; a value with no dependencies (a scalar) is not *anchored*.  A position has no
    tensor (``axis`` is set): each use generates its own.  ``comparison`` remembers ``(op, a, b)`` for
    a comparison's result, so that it can be negated without ``logical_not``.
    """

    __slots__ = ("tensor", "dtype", "deps", "axis", "comparison")

    def __init__(self, tensor: Any, dtype: str, deps: frozenset = frozenset(), axis: int | None = None):
        self.tensor, self.dtype, self.deps, self.axis = tensor, dtype, deps, axis
        self.comparison: tuple | None = None

    @property
    def anchored(self) -> bool:
        return bool(self.deps)


class _Emitter:
    def __init__(self, sg: Any, main: Any, leaves: Mapping[str, Any], name: str):
        self.sg, self.main, self.leaves, self.name = sg, main, leaves, name
        self._zeros: dict[str, _Value] = {}
        self._count = 0

    # -- cuDNN calls -----------------------------------------------------------------------------
    def tensor(self, value: _Value) -> Any:
        return value.tensor if value.axis is None else self._index(value.axis).tensor

    def _call(self, method: str, dtype: str, compute: Any, **operands: Any) -> _Value:
        """One backend-graph operation; ``_Value`` operands are unwrapped and their deps merged."""
        deps = frozenset().union(*(v.deps for v in operands.values() if isinstance(v, _Value)))
        tensors = {k: (self.tensor(v) if isinstance(v, _Value) else v) for k, v in operands.items()}
        self._count += 1
        name = f"{self.name}_{self._count}_{method}"
        result = getattr(self.sg, method)(**tensors, compute_data_type=compute, name=name)
        result.set_data_type(_TYPES[dtype])
        if dtype == F32 and _SCORE in deps:
            self.main = result          # positions are generated from the latest score value (see emit)
        return _Value(result, dtype, deps)

    def _index(self, axis: int) -> _Value:
        value = self._call("gen_index", I32, _DT.INT32, input=self.main, axis=axis)
        value.deps = frozenset({axis})
        return value

    def _const(self, value: Any, dtype: str) -> _Value:
        if dtype == BOOL:
            return self._binary("cmp_ne", self._zero(I32), self._const(int(value), I32), BOOL)
        tensor = self.sg.tensor_scalar(float(value) if dtype == F32 else int(value), cudnn.scalar_type.RUNTIME_PARAM)
        tensor.set_data_type(_TYPES[dtype])
        return _Value(tensor, dtype)

    def _zero(self, dtype: str) -> _Value:
        """An anchored zero (``gen_index * 0``, converted for float32), built once per callback."""
        if dtype not in self._zeros:
            if dtype == I32:
                self._zeros[I32] = self._call("mul", I32, _DT.INT32, a=self._index(3), b=self._const(0, I32))
            else:
                self._zeros[F32] = self._call("identity", F32, _DT.FLOAT, input=self._zero(I32))
        return self._zeros[dtype]

    def lift(self, value: _Value) -> _Value:
        """``value`` as an anchored tensor: ``0 + value`` for a scalar (booleans always are anchored:
        they come from comparisons, whose first operand is lifted)."""
        if value.anchored:
            return value
        return self._call("add", value.dtype, _TYPES[value.dtype], a=self._zero(value.dtype), b=value)

    # -- nodes -------------------------------------------------------------------------------------
    def leaf(self, node: Node) -> _Value:
        if node.op == "index":
            return _Value(None, I32, frozenset({node.param}), axis=node.param)
        if node.op == "const":
            return self._const(node.param, node.dtype)
        if node.op == "arg":
            return _Value(self.leaves["args"][node.param], F32)
        if node.op in ("seq_len_q", "seq_len_kv"):
            return _Value(self.leaves[node.op], I32)
        return _Value(self.leaves[node.op], F32, frozenset({_SCORE}))       # score / cotangent

    def op(self, node: Node, x: list[_Value]) -> _Value:
        op, dtype = node.op, node.dtype
        if op == "cast":
            return self.cast(x[0], dtype)
        if op == "select":
            return self.select(*x)
        if op == "logical_not":
            return self.negate(x[0])
        if op in ("logical_and", "logical_or"):
            return self.combine(op, *x)
        if op in _UNARY:
            return self._call(op, dtype, _TYPES[dtype], input=self.lift(x[0]))
        a, b = x
        if op == "rem":
            return self.remainder(a, b, dtype)
        if not a.anchored and b.anchored:
            if op in _COMMUTATIVE or op in _MIRRORED:
                op, a, b = _MIRRORED.get(op, op), b, a
            elif op == "sub":                                     # c - x = (-x) + c
                return self._binary("add", self._call("neg", dtype, _TYPES[dtype], input=b), a, dtype)
            elif op == "div" and dtype == F32:                    # c / x = (1 / x) * c
                return self._binary("mul", self._call("reciprocal", F32, _DT.FLOAT, input=b), a, dtype)
        return self._binary(op, self.lift(a), b, dtype)

    def _binary(self, op: str, a: _Value, b: _Value, dtype: str) -> _Value:
        method = _METHODS.get(op, op)
        if op in COMPARISONS:      # compared as float32, or (integers) as cuDNN's own masks do
            compute = _DT.FLOAT if a.dtype == F32 else _DT.BOOLEAN
            result = self._call(method, BOOL, compute, input=a, comparison=b)
            result.comparison = (op, a, b)
            return result
        if op in _INPUT_PAIRS:
            return self._call(method, dtype, _TYPES[dtype], input0=a, input1=b)
        return self._call(method, dtype, _TYPES[dtype], a=a, b=b)

    def remainder(self, a: _Value, b: _Value, dtype: str) -> _Value:
        """``a - b * trunc(a / b)`` (integer division truncates; floats truncate through floor/ceil)."""
        quotient = self.op(Node("div", dtype=dtype), [a, b])
        if dtype == F32:
            zero = self._const(0.0, F32)
            quotient = self.select(self._binary("cmp_ge", quotient, zero, BOOL),
                                   self._call("floor", F32, _DT.FLOAT, input=quotient),
                                   self._call("ceil", F32, _DT.FLOAT, input=quotient))
        return self.op(Node("sub", dtype=dtype), [a, self.op(Node("mul", dtype=dtype), [quotient, b])])

    def negate(self, mask: _Value) -> _Value:
        """``not mask`` without ``logical_not``: the inverse comparison, or ``int(mask) == 0``."""
        if mask.comparison is not None:
            op, a, b = mask.comparison
            return self._binary(_INVERSE[op], a, b, BOOL)
        return self._binary("cmp_eq", self.cast(mask, I32), self._const(0, I32), BOOL)

    def combine(self, op: str, a: _Value, b: _Value) -> _Value:
        """``a and b`` / ``a or b``: ``logical_*`` for a query-position mask with a key-position mask,
        else ``int(a) + int(b) == 2`` / ``> 0``."""
        if {a.deps, b.deps} == {frozenset({2}), frozenset({3})}:
            return self._call(op, BOOL, _DT.BOOLEAN, a=a, b=b)
        total = self._binary("add", self.cast(a, I32), self.cast(b, I32), I32)
        if op == "logical_and":
            return self._binary("cmp_eq", total, self._const(2, I32), BOOL)
        return self._binary("cmp_gt", total, self._const(0, I32), BOOL)

    def select(self, mask: _Value, on_true: _Value, on_false: _Value) -> _Value:
        if not on_true.anchored and on_false.anchored:
            mask, on_true, on_false = self.negate(mask), on_false, on_true
        dtype = on_true.dtype
        return self._call("binary_select", dtype, _TYPES[dtype], input0=self.lift(on_true), input1=on_false,
                          mask=self.lift(mask))

    def cast(self, value: _Value, dtype: str) -> _Value:
        if dtype == BOOL:                                         # x != 0
            return self._binary("cmp_ne", self.lift(value), self._const(0, value.dtype), BOOL)
        return self._call("identity", dtype, _TYPES[dtype], input=self.lift(value))


def emit(sg: Any, program: Program, main: Any, leaves: Mapping[str, Any]) -> Any:
    """Append ``program`` to the callback graph ``sg``; returns the float32 result tensor.

    ``main`` is the callback's input tensor; ``gen_index`` reads the shape of the latest float32 value
    computed from it (cuDNN refuses a padding mask whose positions come from an earlier one, measured
    with cuDNN 9.19, as for softcap followed by padding).  ``leaves`` maps
    ``"score"``, ``"cotangent"``, ``"seq_len_q"``, ``"seq_len_kv"`` to tensors and ``"args"`` to the
    sequence of by-value argument tensors -- only the ones the program reads are needed.
    """
    name = "".join(c if c.isalnum() else "_" for c in program.name)
    emitter = _Emitter(sg, main, leaves, name)
    values: list[_Value] = []
    for node in program.nodes:
        values.append(emitter.leaf(node) if node.is_leaf else emitter.op(node, [values[i] for i in node.inputs]))
    return emitter.tensor(emitter.lift(values[program.output]))
