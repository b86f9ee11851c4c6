"""The pointwise program a ``score_mod`` is translated into, and its NumPy interpreter.

A :class:`Program` is a list of :class:`Node` in SSA order over three value types (``float32``,
``int32``, ``bool``) whose leaves are what cuDNN's ``score_mod`` callbacks can reach:

=============  =================================================================================
leaf           value
=============  =================================================================================
``score``      the float32 ``(B, N, T, S)`` score the modification receives
``cotangent``  (backward programs) the gradient w.r.t. the modified score, which cuDNN hands to
               ``score_mod_bprop``
``index``      ``param`` = axis 0..3: the position along that axis (cuDNN ``gen_index``), int32
``arg``        ``param`` = position of a user scalar argument, bound by value as float32
``seq_len_q``  per-sequence lengths ``(B, 1, 1, 1)`` int32 (for padding inside the modification)
``seq_len_kv``
``const``      ``param`` = the value (a NumPy scalar of the node's dtype)
=============  =================================================================================

Every other node is one operation of :data:`OPS` on earlier nodes; values broadcast like NumPy
(leaves are scalars, ``(B, 1, 1, 1)`` lengths or positions along one axis).  The semantics of each
operation is the NumPy function in :data:`OPS` (JAX's for the same operation: integer ``div`` rounds
toward zero, ``cast`` from float to int truncates).  :func:`evaluate` runs a program with NumPy, which
is how the translation is tested without a GPU; :mod:`.score_mod_cudnn` emits the same list as cuDNN
pointwise operations.

:class:`ProgramBuilder` creates nodes with common-subexpression elimination and constant folding, so
programs never compute anything from constants alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

F32, I32, BOOL = "float32", "int32", "bool"
DTYPES = (F32, I32, BOOL)
LEAVES = ("score", "cotangent", "index", "arg", "seq_len_q", "seq_len_kv", "const")


def _int_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Integer division rounding toward zero (C, cuDNN and ``lax.div`` semantics)."""
    q = np.abs(a) // np.where(b == 0, 1, np.abs(b))
    return np.where(b == 0, 0, np.where((a < 0) != (b < 0), -q, q)).astype(np.int32)


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.asarray(a).dtype.kind == "i":
        return _int_div(np.asarray(a), np.asarray(b))
    return np.true_divide(a, b)


_ERF = np.vectorize(math.erf, otypes=[np.float32])

# op name -> (number of inputs, NumPy semantics).  Results take the node's dtype.
OPS: dict[str, tuple[int, Callable[..., Any]]] = {
    "neg": (1, np.negative),
    "abs": (1, np.abs),
    "exp": (1, np.exp),
    "log": (1, np.log),
    "tanh": (1, np.tanh),
    "sigmoid": (1, lambda x: 1 / (1 + np.exp(-x))),
    "sqrt": (1, np.sqrt),
    "rsqrt": (1, lambda x: 1 / np.sqrt(x)),
    "reciprocal": (1, np.reciprocal),
    "sin": (1, np.sin),
    "cos": (1, np.cos),
    "tan": (1, np.tan),
    "erf": (1, _ERF),
    "floor": (1, np.floor),
    "ceil": (1, np.ceil),
    "logical_not": (1, np.logical_not),
    "cast": (1, lambda x: x),                  # to the node's dtype (float -> int truncates)
    "add": (2, np.add),
    "sub": (2, np.subtract),
    "mul": (2, np.multiply),
    "div": (2, _div),
    "max": (2, np.maximum),
    "min": (2, np.minimum),
    "pow": (2, np.power),
    "rem": (2, np.fmod),                       # the sign of the dividend (C, lax.rem)
    "cmp_lt": (2, np.less),
    "cmp_le": (2, np.less_equal),
    "cmp_gt": (2, np.greater),
    "cmp_ge": (2, np.greater_equal),
    "cmp_eq": (2, np.equal),
    "cmp_ne": (2, np.not_equal),
    "logical_and": (2, np.logical_and),
    "logical_or": (2, np.logical_or),
    "select": (3, lambda mask, on_true, on_false: np.where(mask, on_true, on_false)),
}
COMPARISONS = frozenset(op for op in OPS if op.startswith("cmp_"))


@dataclass(frozen=True)
class Node:
    """One value: a leaf (see the module doc) or ``op`` applied to earlier nodes ``inputs``."""

    op: str
    inputs: tuple[int, ...] = ()
    dtype: str = F32
    param: Any = None
    tag: str = ""        # distinguishes otherwise equal leaves (kept apart by common-subexpression elimination)

    @property
    def is_leaf(self) -> bool:
        return self.op in LEAVES


@dataclass(frozen=True)
class Program:
    """A pointwise program: ``nodes`` in SSA order; ``output`` is the float32 result node."""

    name: str
    nodes: tuple[Node, ...]
    output: int

    def leaves(self, op: str) -> list[Node]:
        return [n for n in self.nodes if n.op == op]

    def uses(self, op: str) -> bool:
        return any(n.op == op for n in self.nodes)

    @property
    def constants(self) -> tuple[Any, ...]:
        """The constant values the program needs (cuDNN receives them as runtime scalars)."""
        return tuple(n.param for n in self.leaves("const"))

    def describe(self) -> str:
        """One line per node, for error messages and debugging."""
        lines = [f"{self.name}:"]
        for i, n in enumerate(self.nodes):
            what = f"{n.op}({', '.join(f'%{j}' for j in n.inputs)})" if n.inputs else n.op
            if n.param is not None:
                what += f"[{n.param}]"
            lines.append(f"  %{i}: {n.dtype} = {what}")
        lines.append(f"  return %{self.output}")
        return "\n".join(lines)


def _as_dtype(value: Any, dtype: str) -> np.ndarray:
    return np.asarray(value).astype(np.dtype(dtype))


class ProgramBuilder:
    """Appends nodes with common-subexpression elimination and constant folding."""

    def __init__(self, name: str):
        self.name = name
        self.nodes: list[Node] = []
        self._index: dict[tuple, int] = {}
        self._non_negative: set[int] = set()

    def _add(self, node: Node) -> int:
        param = node.param.tobytes() if isinstance(node.param, np.generic) else node.param   # -0.0 != 0.0, nan
        key = (node.op, node.inputs, node.dtype, param, node.tag)
        if key not in self._index:
            self._index[key] = len(self.nodes)
            self.nodes.append(node)
        return self._index[key]

    def dtype(self, node: int) -> str:
        return self.nodes[node].dtype

    def leaf(self, op: str, dtype: str, param: Any = None, tag: str = "") -> int:
        if op not in LEAVES or op == "const":
            raise ValueError(f"leaf: expected one of {LEAVES[:-1]}, got {op!r}")
        node = self._add(Node(op, (), dtype, param, tag))
        if op in ("index", "seq_len_q", "seq_len_kv"):      # positions and lengths are never negative
            self._non_negative.add(node)
        return node

    def const(self, value: Any, dtype: str) -> int:
        node = self._add(Node("const", (), dtype, _as_dtype(value, dtype)[()]))
        if self.nodes[node].param >= 0:
            self._non_negative.add(node)
        return node

    def _constant(self, node: int) -> Any:
        return self.nodes[node].param if self.nodes[node].op == "const" else None

    def _simplify(self, op: str, inputs: tuple[int, ...]) -> int | None:
        """An existing node equal to ``op(*inputs)``, from constant booleans and from the signs known
        of positions and lengths (what JAX's ``%`` and ``//`` test for negative operands); else None."""
        known = [self._constant(i) for i in inputs]
        if op == "select" and known[0] is not None:
            return inputs[1] if known[0] else inputs[2]
        if op in ("logical_and", "logical_or"):
            for mine, other in ((0, 1), (1, 0)):
                if known[mine] is not None:
                    absorbing = (op == "logical_and") != bool(known[mine])     # and False / or True
                    return inputs[mine] if absorbing else inputs[other]
        if op in ("cmp_ne", "cmp_eq") and self.dtype(inputs[0]) == BOOL:
            for mine, other in ((0, 1), (1, 0)):                                 # x != False, x == True
                if known[mine] is not None and bool(known[mine]) == (op == "cmp_eq"):
                    return inputs[other]
        if op in ("cmp_lt", "cmp_ge") and inputs[0] in self._non_negative and known[1] is not None and known[1] <= 0:
            return self.const(op == "cmp_ge", BOOL)                              # x >= 0 > c or x >= 0 >= c
        return None

    def _track_sign(self, op: str, inputs: tuple[int, ...], node: int) -> None:
        signs = [i in self._non_negative for i in inputs]
        if (op in ("add", "mul", "div", "min", "select") and all(signs[-2:])) or \
                (op in ("rem", "cast") and signs[0]) or op == "abs" or (op == "max" and any(signs)):
            self._non_negative.add(node)

    def op(self, op: str, *inputs: int, dtype: str | None = None) -> int:
        """``op`` on ``inputs``; the result dtype defaults to the first input's (bool for comparisons)."""
        arity, semantics = OPS[op]
        if len(inputs) != arity:
            raise ValueError(f"{op} takes {arity} inputs, got {len(inputs)}")
        if dtype is None:
            dtype = BOOL if op in COMPARISONS else self.dtype(inputs[-1] if op == "select" else inputs[0])
        if op == "cast" and self.dtype(inputs[0]) == dtype:
            return inputs[0]
        if all(self.nodes[i].op == "const" for i in inputs):      # fold
            values = [np.asarray(self.nodes[i].param) for i in inputs]
            with np.errstate(all="ignore"):
                return self.const(_convert(semantics(*values), dtype), dtype)
        simpler = self._simplify(op, tuple(inputs))
        if simpler is not None:
            return simpler
        node = self._add(Node(op, tuple(inputs), dtype))
        self._track_sign(op, tuple(inputs), node)
        return node

    def build(self, output: int) -> Program:
        """The program computing ``output`` (float32), without the nodes it does not need."""
        if self.dtype(output) != F32:
            output = self.op("cast", output, dtype=F32)
        live, order = {output}, []
        for i in range(output, -1, -1):
            if i in live:
                order.append(i)
                live.update(self.nodes[i].inputs)
        renumber = {old: new for new, old in enumerate(sorted(order))}
        nodes = tuple(Node(n.op, tuple(renumber[j] for j in n.inputs), n.dtype, n.param, n.tag)
                      for n in (self.nodes[i] for i in sorted(order)))
        return Program(self.name, nodes, renumber[output])


def _convert(value: np.ndarray, dtype: str) -> np.ndarray:
    """A value in ``dtype``; float -> int truncates toward zero, anything -> bool tests ``!= 0``."""
    value = np.asarray(value)
    if dtype == BOOL:
        return value != 0
    if dtype == I32 and value.dtype.kind == "f":
        return np.trunc(value).astype(np.int32)
    return value.astype(np.dtype(dtype))


def evaluate(program: Program, *, score: np.ndarray, cotangent: np.ndarray | None = None,
             args: tuple = (), seq_len_q: np.ndarray | None = None,
             seq_len_kv: np.ndarray | None = None) -> np.ndarray:
    """Run ``program`` with NumPy on a float32 ``(B, N, T, S)`` score; returns float32 ``(B, N, T, S)``.

    ``args`` are the user's scalar arguments (by position), ``seq_len_q`` / ``seq_len_kv`` int
    ``(B,)`` arrays for programs that mask padding.
    """
    score = np.asarray(score, np.float32)
    if score.ndim != 4:
        raise ValueError(f"score: expected a (B, N, T, S) array, got shape {score.shape}")
    shape = score.shape
    leaves: Mapping[str, Callable[[Node], Any]] = {
        "score": lambda n: score,
        "cotangent": lambda n: _required(cotangent, "cotangent", program),
        "index": lambda n: np.arange(shape[n.param], dtype=np.int32).reshape(
            [shape[a] if a == n.param else 1 for a in range(4)]),
        "arg": lambda n: np.float32(np.asarray(args[n.param]).reshape(())),
        "seq_len_q": lambda n: np.asarray(_required(seq_len_q, "seq_len_q", program), np.int32).reshape(-1, 1, 1, 1),
        "seq_len_kv": lambda n: np.asarray(_required(seq_len_kv, "seq_len_kv", program), np.int32).reshape(-1, 1, 1, 1),
        "const": lambda n: np.asarray(n.param),
    }
    values: list[Any] = []
    with np.errstate(all="ignore"):
        for node in program.nodes:
            if node.is_leaf:
                values.append(leaves[node.op](node))
            else:
                result = OPS[node.op][1](*(values[i] for i in node.inputs))
                values.append(_convert(result, node.dtype))
    return np.broadcast_to(values[program.output], shape).astype(np.float32)


def _required(value: Any, name: str, program: Program) -> Any:
    if value is None:
        raise ValueError(f"{name}: the program {program.name!r} reads it; pass it to evaluate()")
    return value
