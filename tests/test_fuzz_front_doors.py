"""Seeded fuzzing of every front door that runs without a GPU: only the error contract is asserted.

Front doors: the NumPy reference (``dot_product_attention``, ``dot_product_attention_bwd``,
``paged_attention``), the JAX bridge eager and under ``jit`` (``dot_product_attention``,
``paged_attention``), the ``jax.nn`` drop-in eager and under ``jit``, the support query
(``not_supported_reasons``, ``Environment``), the Flax door (``flax_attention_fn``'s options and the
``attention_fn`` it returns) and the torch front on CPU tensors (``cudnn_attn.torch.attention`` / ``sdpa``; skipped
where torch is not installed), plus the messages that name a fix: a float keep-mask (``m > 0``), another API's
keyword (``is_causal`` -> ``mask_type``), K/V in the other layout.

Each case starts from a valid call (shapes, layout, dtype and optional features drawn from the case's
seed) and breaks one argument in one way from a catalogue of bad values: wrong types (``None``,
strings, bools, floats, lists, ``jax.ShapeDtypeStruct``, duck objects), overflowing reals (``10**400``),
wrong ranks/shapes/dtypes, out-of-range values in the arrays cuDNN reads as positions, ``score_mod``
functions of the wrong arity/result, FP8 with dropout.  The contract:

* the call raises ``ValueError`` - or ``UnsupportedConfigurationError`` for a valid call nothing runs -
  and the message names the argument (the drop-in's own names for its arguments);
* never another exception (``TypeError``, ``IndexError``, ``ZeroDivisionError``, ``OverflowError``,
  ``AttributeError``, ...);
* under ``jit``, a bad *value* in a traced array is clamped (no error); with ``check_values=True`` the
  call fails at run time and XLA's message names the argument;
* the support query never raises for valid arguments;
* borderline valid calls (``scale=None``, packed segments in BNTH, bottom-right causal with a bias) run on
  every front, and the drop-in takes what ``jax.nn`` takes (lists, tuples, Python scalars, bool and int
  biases); a float 0/1 mask is refused naming ``mask``, as ``jax.nn`` refuses it.

A failure prints its case (front door, argument, value) and the one-line reproduction of tests/conftest.py.
"""

from __future__ import annotations

import math
import random
import re
import types
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cudnn_attn import MaskType, UnsupportedConfigurationError, reference
from cudnn_attn import jax_bridge as jb
from cudnn_attn.core import support
from cudnn_attn.core.types import FP8_PARAM_KEYS
from cudnn_attn.core.validation import validate_call

SEED = 20261130
B, T, S, N, H = 2, 8, 12, 2, 8
M, BLOCK, BLOCKS_PER_SEQ, NUM_BLOCKS = 2, 4, 3, 7


# -- valid base calls -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Base:
    """The random part of a case: a valid call's shapes and features."""

    layout: str
    dtype: Any
    kv_heads: int
    features: str            # "plain", "padded", "packed", "paged"

    @classmethod
    def draw(cls, rnd: random.Random, features: str) -> "Base":
        import ml_dtypes

        return cls(layout=rnd.choice(["BTNH", "BNTH"]) if features != "packed" else "BTNH",
                   dtype=rnd.choice([np.float16, ml_dtypes.bfloat16]), kv_heads=rnd.choice([1, 2]), features=features)

    def shape(self, length: int, heads: int) -> tuple[int, ...]:
        return (B, length, heads, H) if self.layout == "BTNH" else (B, heads, length, H)

    def call(self, rng: np.random.Generator) -> dict[str, Any]:
        """A valid call's arguments (NumPy arrays)."""
        q = rng.standard_normal(self.shape(T, N)).astype(self.dtype)
        call: dict[str, Any] = dict(query=q, scale=0.35, qkv_layout=self.layout)
        if self.features == "paged":
            cache = (NUM_BLOCKS, BLOCK, self.kv_heads, H) if self.layout == "BTNH" else \
                (NUM_BLOCKS, self.kv_heads, BLOCK, H)
            table = rng.permutation(NUM_BLOCKS)[:B * BLOCKS_PER_SEQ].reshape(B, 1, BLOCKS_PER_SEQ, 1).astype(np.int32)
            call.update(key=rng.standard_normal(cache).astype(self.dtype),
                        value=rng.standard_normal(cache).astype(self.dtype),
                        q_seqlen=np.array([T, 5], np.int32), kv_seqlen=np.array([12, 7], np.int32),
                        page_table_k=table, page_table_v=table.copy(), mask_type=MaskType.PADDING)
            return call
        call.update(key=rng.standard_normal(self.shape(S, self.kv_heads)).astype(self.dtype),
                    value=rng.standard_normal(self.shape(S, self.kv_heads)).astype(self.dtype))
        if self.features == "padded":
            call.update(q_seqlen=np.array([T, 5], np.int32), kv_seqlen=np.array([S, 7], np.int32),
                        mask_type=MaskType.PADDING)
        if self.features == "packed":
            call.update(q_seqlen=np.array([[3, 4], [8, -1]], np.int32),
                        kv_seqlen=np.array([[5, 6], [12, -1]], np.int32),
                        q_offsets=np.array([[0, 3, -1], [0, -1, -1]], np.int32),
                        kv_offsets=np.array([[0, 5, -1], [0, -1, -1]], np.int32))
        return call


def _sds(x: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


def _duck(x: Any) -> Any:
    return types.SimpleNamespace(shape=x.shape, dtype=x.dtype, ndim=len(x.shape))


# -- the catalogue of bad values ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bad:
    """One way to break one argument.  ``change(call)`` returns the argument's new value; ``features``
    is the base call it needs; ``value`` marks data-dependent values (checked at run time under jit)."""

    argument: str
    label: str
    change: Callable[[dict], Any]
    fronts: tuple[str, ...]
    features: str = "plain"
    value: bool = False
    unsupported: bool = False
    extra: tuple = ()                        # other arguments to set: ((name, value), ...)
    named: str | None = None                 # the name the message must contain (default: argument)


ATTENTION = ("reference", "reference_bwd", "jax", "jax_jit")
PAGED = ("reference_paged", "jax_paged", "jax_paged_jit")
EVERY_CALL = ATTENTION + PAGED
EAGER = ("reference", "reference_bwd", "jax", "reference_paged", "jax_paged")
JAX = ("jax", "jax_jit", "jax_paged", "jax_paged_jit")


def _const(value: Any) -> Callable[[dict], Any]:
    return lambda call: value


def _label(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 10 ** 12:
        digits = str(abs(value))
        return f"10**{len(digits) - 1}" if digits.strip("0") == "1" else f"2**{abs(value).bit_length() - 1}"
    return repr(value)


def _valid(call: dict, name: str) -> Any:
    """The call's ``name`` array, or a valid one (bias) to break."""
    return call[name] if name in call else np.zeros((1, N, T, S), call["query"].dtype)


def _bad_arrays(name: str, fronts: tuple[str, ...], features: str = "plain") -> list[Bad]:
    def of(make: Callable[[Any], Any]) -> Callable[[dict], Any]:
        return lambda call: make(_valid(call, name))
    return [
        Bad(name, "None" if name in ("query", "key", "value") else "string", _const(None if name in
            ("query", "key", "value") else "x"), fronts, features),
        Bad(name, "ShapeDtypeStruct", of(_sds), fronts, features),
        Bad(name, "duck", of(_duck), fronts, features),
        Bad(name, "list", of(lambda x: np.asarray(x, np.float32).tolist()), fronts, features),
    ]


CATALOGUE: list[Bad] = [
    *(Bad("seed", _label(v), _const(v), EVERY_CALL) for v in (None, "42", True, -1, 1.5, 2 ** 64)),
    *(Bad("scale", _label(v), _const(v), EVERY_CALL) for v in (10 ** 400, math.nan, math.inf, "0.1", True, 1j)),
    *(Bad("dropout_rate", _label(v), _const(v), EVERY_CALL) for v in (10 ** 400, 1.0, -0.1, "0.1", None, math.nan)),
    *(Bad("mask_type", repr(v), _const(v), EVERY_CALL) for v in ("causal", 3, None)),
    *(Bad("qkv_layout", repr(v), _const(v), EVERY_CALL) for v in ("XYZ", 3, None)),
    *(Bad("sliding_window_length", repr(v), _const(v), EVERY_CALL) for v in (0, -2, 1.5, "4", True)),
    *(Bad("diagonal_alignment", repr(v), _const(v), EVERY_CALL) for v in ("middle", None, 3, [1])),
    *(Bad("return_residual", repr(v), _const(v), ATTENTION[:1] + ATTENTION[2:] + PAGED) for v in ("yes", None)),
    *(Bad("deterministic", repr(v), _const(v), ("reference_bwd", "jax", "jax_jit")) for v in ("yes", 2)),
    *(_bad for name in ("query", "key", "value") for _bad in _bad_arrays(name, ATTENTION)),
    Bad("query", "scalar", lambda c: np.float16(1.0), ATTENTION),
    Bad("query", "rank-3", lambda c: c["query"][0], ATTENTION),
    Bad("query", "zero-dim", lambda c: c["query"][:, :, :, :0], ATTENTION),
    Bad("query", "float32", lambda c: c["query"].astype(np.float32), ATTENTION),
    Bad("key", "head-dim", lambda c: c["key"][..., :4], ATTENTION),
    Bad("value", "batch", lambda c: c["value"][:1], ATTENTION),
    *(_bad_arrays("bias", ATTENTION)),
    Bad("bias", "shape", lambda c: np.zeros((3, 1, T, S), c["query"].dtype), ATTENTION),
    Bad("bias", "dtype", lambda c: np.zeros((1, 1, T, S), np.int32), ATTENTION),
    Bad("mask", "dtype", lambda c: np.zeros((T, S), np.int32), ATTENTION),
    Bad("mask", "shape", lambda c: np.ones((T + 1, S), bool), ATTENTION),
    Bad("q_seqlen", "float32", lambda c: c["q_seqlen"].astype(np.float32), ATTENTION, "padded"),
    Bad("kv_seqlen", "shape", lambda c: c["kv_seqlen"][:1], ATTENTION, "padded"),
    Bad("q_seqlen", "ShapeDtypeStruct", lambda c: _sds(c["q_seqlen"]), ATTENTION, "padded"),
    Bad("kv_seqlen", "999", lambda c: np.array([999, 7], np.int32), ATTENTION, "padded", value=True),
    Bad("q_seqlen", "-1", lambda c: np.array([-1, 5], np.int32), ATTENTION, "padded", value=True),
    Bad("q_offsets", "past-row", lambda c: np.array([[0, 7, -1], [0, -1, -1]], np.int32), ATTENTION, "packed",
        value=True),
    Bad("kv_offsets", "overlap", lambda c: np.array([[0, 2, -1], [0, -1, -1]], np.int32), ATTENTION, "packed",
        value=True),
    Bad("q_offsets", "shape", lambda c: c["q_offsets"][:, :2], ATTENTION, "packed"),
    Bad("kv_seqlen", "-1-pattern", lambda c: np.array([[5, 6], [-1, 3]], np.int32), ATTENTION, "packed", value=True),
    Bad("page_table_k", "999", lambda c: np.where(np.arange(B * BLOCKS_PER_SEQ).reshape(c["page_table_k"].shape) == 1,
                                                  999, c["page_table_k"]).astype(np.int32), PAGED, "paged", value=True),
    Bad("page_table_v", "-3", lambda c: np.where(np.arange(B * BLOCKS_PER_SEQ).reshape(c["page_table_v"].shape) == 0,
                                                 -3, c["page_table_v"]).astype(np.int32), PAGED, "paged", value=True),
    Bad("kv_seqlen", "paged-999", lambda c: np.array([999, 7], np.int32), PAGED, "paged", value=True),
    Bad("page_table_k", "int64", lambda c: c["page_table_k"].astype(np.int64), ("reference_paged",), "paged"),
    Bad("page_table_v", "shape", lambda c: c["page_table_v"][:, :, :2], PAGED, "paged"),
    Bad("page_table_k", "ShapeDtypeStruct", lambda c: _sds(c["page_table_k"]), PAGED, "paged"),
    Bad("fp8_params", "missing-keys", _const({"descale_q": np.ones((1, 1, 1, 1), np.float32)}), ATTENTION,
        extra=(("use_fp8", True),)),
    Bad("fp8_params", "not-a-dict", _const([1.0]), ATTENTION, extra=(("use_fp8", True),)),
    Bad("use_fp8", "'yes'", _const("yes"), ATTENTION),
    Bad("dropout_rate", "fp8-with-dropout", _const(0.1), ("reference", "jax", "jax_jit"), unsupported=True,
        extra=(("use_fp8", True), ("fp8", True), ("mask_type", MaskType.NO_MASK)), named="dropout"),
    Bad("bias", "bottom-right-padding", lambda c: np.zeros((1, 1, T, S), c["query"].dtype), ATTENTION, "padded",
        unsupported=True, extra=(("mask_type", MaskType.PADDING_CAUSAL), ("diagonal_alignment", "bottom_right")),
        named="bottom-right"),
    Bad("score_mod", "not-callable", _const("tanh"), ATTENTION),
    Bad("score_mod", "arity", _const(lambda s, a: s), ATTENTION),
    Bad("score_mod", "returns-None", _const(lambda s: None), ATTENTION),
    Bad("score_mod", "shape", _const(lambda s: s[..., :1]), ATTENTION),
    Bad("score_mod", "int-result", _const(lambda s: s.astype(jnp.int32)), ATTENTION),
    Bad("score_mod", "tuple-result", _const(lambda s: (s, s)), ATTENTION),
    Bad("score_mod", "raises", _const(lambda s: jnp.dot(s, jnp.ones(3))), ATTENTION),
    Bad("score_mod", "python-branch", _const(lambda s: s if s.sum() > 0 else -s), ATTENTION),
    Bad("score_mod_args", "not-a-tuple", lambda c: np.ones((1,), np.float32), ATTENTION,
        extra=(("score_mod", lambda s, a: s * a),)),
    Bad("score_mod_args", "not-an-array", _const((0.5,)), ATTENTION, extra=(("score_mod", lambda s, a: s * a),)),
    Bad("score_mod_args", "without-score_mod", _const((np.ones((), np.float32),)), ATTENTION),
    Bad("sink", "shape", _const(np.zeros((N + 1,), np.float32)), EVERY_CALL),
    Bad("sink", "dtype", _const(np.zeros((N,), np.float16)), EVERY_CALL),
    Bad("backend", "'tvm'", _const("tvm"), JAX),
    Bad("cuda_graph", "'yes'", _const("yes"), JAX),
    Bad("check_values", "'yes'", _const("yes"), JAX),
    Bad("dropout_mask", "shape", _const(np.ones((B, N, T, T))), ("reference",), extra=(("dropout_rate", 0.2),)),
    *(Bad(name, "shape", lambda c, name=name: np.zeros((1, 2, 3), np.float32), ("reference_bwd",))
      for name in ("output", "grad_output", "logsumexp")),
]


# -- the front doors ----------------------------------------------------------------------------------------
def _residuals(call: dict, rng: np.random.Generator) -> dict:
    config, _ = validate_call(**{n: call[n] for n in ("query", "key", "value", "q_seqlen", "kv_seqlen", "q_offsets",
                                                "kv_offsets") if n in call},
                        qkv_layout=call["qkv_layout"], mask_type=call.get("mask_type", MaskType.NO_MASK),
                        training=True)
    o = rng.standard_normal(config.o_shape).astype(call["query"].dtype)
    return dict(output=o, grad_output=o.copy(), logsumexp=rng.standard_normal(config.lse_shape).astype(np.float32))


def _fp8(call: dict) -> dict:
    """The call with FP8 Q/K/V and parameters (what ``extra=fp8`` asks for)."""
    import ml_dtypes

    fp8 = {n: call[n].astype(np.float32).astype(ml_dtypes.float8_e4m3fn) for n in ("query", "key", "value")}
    params = {k: np.ones((1, 1, 1, 1), np.float32) for k in FP8_PARAM_KEYS}
    return {**call, **fp8, "fp8_params": params}


def _to_jax(call: dict) -> dict:
    def convert(x: Any) -> Any:
        if isinstance(x, np.ndarray):
            return jnp.asarray(x)
        if isinstance(x, dict):
            return {k: convert(v) for k, v in x.items()}
        return x
    return {n: convert(x) for n, x in call.items()}


def _jit(fn: Callable[..., Any], call: dict) -> Any:
    """``fn(**call)`` under ``jit``: arrays are traced arguments, everything else is closed over."""
    traced = {n: x for n, x in call.items() if isinstance(x, jax.Array)}
    static = {n: x for n, x in call.items() if n not in traced}
    return jax.block_until_ready(jax.jit(lambda arrays: fn(**arrays, **static))(traced))


FRONTS: dict[str, Callable[[dict], Any]] = {
    "reference": lambda c: reference.dot_product_attention(**c),
    "reference_bwd": lambda c: reference.dot_product_attention_bwd(**c),
    "reference_paged": lambda c: reference.paged_attention(**c),
    "jax": lambda c: jax.block_until_ready(jb.dot_product_attention(**_to_jax(c))),
    "jax_jit": lambda c: _jit(jb.dot_product_attention, _to_jax(c)),
    "jax_paged": lambda c: jax.block_until_ready(jb.paged_attention(**_to_jax(c))),
    "jax_paged_jit": lambda c: _jit(jb.paged_attention, _to_jax(c)),
}


@dataclass(frozen=True)
class Case:
    front: str
    bad: Bad
    seed: int

    @property
    def id(self) -> str:
        return _id(f"{self.front}-{self.bad.argument}-{self.bad.label}")

    def describe(self) -> str:
        return f"{self.front}({self.bad.argument}={self.bad.label}, seed={self.seed})"


def _id(text: str) -> str:
    """A test id without characters a shell would interpret."""
    return re.sub(r"[^\w.+=-]", "_", text)


def _cases() -> list[Case]:
    cases = []
    for index, bad in enumerate(CATALOGUE):
        for front in bad.fronts:
            cases.append(Case(front, bad, SEED + 1000 * index + len(cases)))
    return cases


CASES = _cases()


def _call(case: Case) -> dict:
    rnd = random.Random(case.seed)
    bad = case.bad
    features = "paged" if case.front in PAGED else bad.features
    call = Base.draw(rnd, features).call(np.random.default_rng(case.seed))
    extra = dict(bad.extra)
    if extra.pop("fp8", False):
        call = _fp8(call)
    call.update(extra)
    if case.front == "reference_bwd":
        call.update(_residuals(call, np.random.default_rng(case.seed + 1)))
    call[bad.argument] = bad.change(call)
    return call


def _names_argument(message: str, bad: Bad) -> bool:
    return (bad.named or bad.argument) in message


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_front_door(case: Case):
    call = _call(case)
    front = FRONTS[case.front]
    jit = case.front.endswith("_jit")
    if jit and case.bad.value:
        try:                # traced values are clamped: no error; the CPU reference refuses what clamping
            front(call)     # leaves (overlapping segments) at run time, naming the argument
        except Exception as error:  # noqa: BLE001
            assert _names_argument(str(error), case.bad), f"{case.describe()}: {str(error)[-400:]}"
        call["check_values"] = True
        with pytest.raises(Exception) as raised:              # the checked mode fails at run time
            front(call)
        assert _names_argument(str(raised.value), case.bad), f"{case.describe()}: {str(raised.value)[-400:]}"
        return
    expected = UnsupportedConfigurationError if case.bad.unsupported else ValueError
    try:
        front(call)
    except expected as error:
        assert _names_argument(str(error), case.bad), \
            f"{case.describe()} raised {type(error).__name__} not naming {case.bad.argument!r}: {error}"
    except Exception as error:  # noqa: BLE001 -- the contract is about exactly this
        pytest.fail(f"{case.describe()} raised {type(error).__name__} instead of {expected.__name__}: {error}")
    else:
        pytest.fail(f"{case.describe()} raised nothing")


# -- borderline calls that run on every front ------------------------------------------------------------------
@dataclass(frozen=True)
class Borderline:
    """A valid call that once surprised: ``changes(call)`` returns the arguments to set; it must run."""

    label: str
    features: str
    changes: Callable[[dict], dict]


def _packed_bnth(call: dict) -> dict:
    return {n: np.ascontiguousarray(np.swapaxes(call[n], 1, 2)) for n in ("query", "key", "value")} | \
        {"qkv_layout": "BNTH"}


BORDERLINE = [
    Borderline("scale-None", "plain", lambda c: {"scale": None}),
    Borderline("packed-BNTH", "packed", _packed_bnth),
    Borderline("bottom-right-causal-bias", "plain", lambda c: {
        "mask_type": MaskType.CAUSAL, "diagonal_alignment": "bottom_right",
        "bias": np.random.default_rng(3).standard_normal((1, 1, T, S)).astype(c["query"].dtype)}),
]


def _finite(result: Any) -> bool:
    leaves = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(result) if x is not None]
    return bool(leaves) and all(np.isfinite(x).all() for x in leaves)


@pytest.mark.parametrize("front", ATTENTION)
@pytest.mark.parametrize("case", BORDERLINE, ids=[b.label for b in BORDERLINE])
def test_borderline_call_runs(case: Borderline, front: str):
    seed = SEED + BORDERLINE.index(case)
    call = Base.draw(random.Random(seed), case.features).call(np.random.default_rng(seed))
    call.update(case.changes(call))
    if front == "reference_bwd":
        call.update(_residuals(call, np.random.default_rng(seed + 1)))
    assert _finite(FRONTS[front](call)), f"{front}({case.label}, seed={seed}): non-finite results"


# -- the jax.nn drop-in ---------------------------------------------------------------------------------------
NN_BAD = [
    ("query", "scalar", lambda c: jnp.float16(1.0)),
    ("query", "zero-head-dim", lambda c: c["query"][..., :0]),
    ("query", "rank-2", lambda c: c["query"][0, 0]),
    ("query", "None", lambda c: None),
    ("key", "ShapeDtypeStruct", lambda c: _sds(c["key"])),
    ("value", "rank-3", lambda c: c["value"][0]),
    ("query", "float32", lambda c: c["query"].astype(jnp.float32)),
    ("local_window_size", "1.5", lambda c: 1.5),
    ("local_window_size", "-1", lambda c: -1),
    ("local_window_size", "(1,)", lambda c: (1,)),
    ("local_window_size", "'3'", lambda c: "3"),
    ("local_window_size", "(2, -1)", lambda c: (2, -1)),
    ("is_causal", "'yes'", lambda c: "yes"),
    ("is_causal", "None", lambda c: None),
    ("query_seq_lengths", "float32", lambda c: jnp.ones((B,), jnp.float32)),
    ("query_seq_lengths", "shape", lambda c: jnp.ones((B + 1,), jnp.int32)),
    ("key_value_seq_lengths", "list-of-floats", lambda c: [3.0, 4.0]),
    ("query_seq_lengths", "-1", lambda c: jnp.asarray([-1, 3], jnp.int32)),
    ("key_value_seq_lengths", "999", lambda c: jnp.asarray([999, 3], jnp.int32)),
    ("mask", "int32", lambda c: jnp.zeros((T, S), jnp.int32)),
    ("bias", "list-rank-5", lambda c: [[[[[0.0]]]]]),
    ("bias", "complex", lambda c: jnp.zeros((T, S), jnp.complex64)),
    ("bias", "string", lambda c: "0.5"),
    ("mask", "float-0-1", lambda c: jnp.ones((T, S), jnp.float32)),
    ("mask", "list-of-floats", lambda c: [[1.0] * S] * T),
    ("bias", "shape", lambda c: jnp.zeros((3, 1, T, S), jnp.float16)),
    ("scale", "10**400", lambda c: 10 ** 400),
    ("scale", "'0.1'", lambda c: "0.1"),
    ("check_values", "'yes'", lambda c: "yes"),
]
NN_VALUES = ("query_seq_lengths-1", "key_value_seq_lengths999")


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("argument, label, change", NN_BAD, ids=[_id(f"{a}-{label}") for a, label, _ in NN_BAD])
def test_jax_nn_drop_in(argument, label, change, jit):
    rng = np.random.default_rng(SEED + len(argument) + len(label))
    call = dict(query=jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float16),
                key=jnp.asarray(rng.standard_normal((B, S, 1, H)), jnp.float16),
                value=jnp.asarray(rng.standard_normal((B, S, 1, H)), jnp.float16))
    call[argument] = change(call)
    describe = f"dot_product_attention_nn({argument}={label}, {'jit' if jit else 'eager'})"
    if jit and f"{argument}{label}" in NN_VALUES:
        _jit(jb.dot_product_attention_nn, call)                        # clamped
        call["check_values"] = True
        with pytest.raises(Exception, match=argument):
            _jit(jb.dot_product_attention_nn, call)
        return
    try:
        _jit(jb.dot_product_attention_nn, call) if jit else jb.dot_product_attention_nn(**call)
    except ValueError as error:
        assert argument in str(error), f"{describe}: ValueError not naming {argument!r}: {error}"
    except Exception as error:  # noqa: BLE001
        pytest.fail(f"{describe} raised {type(error).__name__} instead of ValueError: {error}")
    else:
        pytest.fail(f"{describe} raised nothing")


NN_GOOD = [
    ("bias", "list", lambda c: np.ones((T, S)).tolist()),
    ("bias", "tuple", lambda c: tuple(tuple(row) for row in np.ones((T, S)).tolist())),
    ("bias", "python-scalar", lambda c: 0.5),
    ("bias", "bool", lambda c: jnp.eye(T, S, dtype=bool)),
    ("bias", "int32", lambda c: jnp.ones((1, 1, T, S), jnp.int32)),
    ("bias", "numpy-float64", lambda c: np.zeros((T, S))),
    ("mask", "list", lambda c: np.ones((T, S), bool).tolist()),
    ("mask", "python-bool", lambda c: True),
    ("scale", "None", lambda c: None),
    ("key_value_seq_lengths", "list", lambda c: [3, 4]),
    ("query", "numpy", lambda c: np.asarray(c["query"])),
]


@pytest.mark.parametrize("argument, label, change", NN_GOOD, ids=[_id(f"{a}-{label}") for a, label, _ in NN_GOOD])
def test_jax_nn_drop_in_takes_what_jax_nn_takes(argument, label, change):
    rng = np.random.default_rng(SEED + len(argument) + len(label))
    call = dict(query=jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.float16),
                key=jnp.asarray(rng.standard_normal((B, S, 1, H)), jnp.float16),
                value=jnp.asarray(rng.standard_normal((B, S, 1, H)), jnp.float16))
    call[argument] = change(call)
    out = jb.dot_product_attention_nn(**call)
    assert out.shape == (B, T, N, H) and _finite(out), f"dot_product_attention_nn({argument}={label})"


# -- the support query --------------------------------------------------------------------------------------------
def _config(rng: np.random.Generator) -> Any:
    base = Base.draw(random.Random(int(rng.integers(1 << 30))), str(rng.choice(["plain", "padded", "packed"])))
    call = base.call(rng)
    extras = [dict(), dict(dropout_rate=0.1), dict(mask_type=MaskType.CAUSAL), dict(sliding_window_length=3),
              dict(score_mod=lambda s: 30 * jnp.tanh(s / 30)), dict(score_mod=lambda s: s - s.max(-1, keepdims=True)),
              dict(diagonal_alignment="bottom_right", mask_type=MaskType.CAUSAL), dict(return_residual=True)]
    extra = extras[int(rng.integers(len(extras)))]
    if "mask_type" in extra and base.features == "padded":
        extra = {**extra, "mask_type": MaskType.PADDING_CAUSAL}
    training = extra.pop("return_residual", bool(rng.integers(2)))
    call.pop("scale")
    return validate_call(**{**call, **extra}, training=training)[0]


SUPPORT_BAD = [
    ("kind", "'forward'", dict(kind="forward")),
    ("kind", "3", dict(kind=3)),
    ("enforced_by", "'CUDNN'", dict(enforced_by="CUDNN")),
    ("enforced_by", "None-string", dict(enforced_by="none")),
    ("env", "'sm90'", dict(env="sm90")),
    ("env", "tuple", dict(env=(91900, (9, 0)))),
    ("config", "None", dict(config=None)),
    ("config", "dict", dict(config={"batch": 2})),
]


@pytest.mark.parametrize("argument, label, change", SUPPORT_BAD,
                         ids=[_id(f"{a}-{label}") for a, label, _ in SUPPORT_BAD])
def test_support_query_validates_its_arguments(argument, label, change):
    config = _config(np.random.default_rng(SEED))
    kwargs = {"config": config, "env": support.Environment.sm90(), **change}
    with pytest.raises(ValueError, match=argument):
        support.not_supported_reasons(kwargs.pop("config"), kwargs.pop("env"), **kwargs)


@pytest.mark.parametrize("fields, argument", [
    (("9.19", (9, 0)), "cudnn_version"), ((-1, (9, 0)), "cudnn_version"), ((91900, (9,)), "compute_capability"),
    ((91900, "sm90"), "compute_capability"), ((91900, (9, 0), 5), "device_name"),
], ids=["version-string", "version-negative", "capability-short", "capability-string", "name-int"])
def test_environment_validates_its_fields(fields, argument):
    with pytest.raises(ValueError, match=argument):
        support.Environment(*fields)


def test_support_query_never_raises_for_valid_arguments():
    rng = np.random.default_rng(SEED)
    envs = [support.Environment.sm90(), support.Environment(91000, (8, 0)), support.Environment(92600, (10, 0)),
            support.Environment(None, None), support.Environment(8904, (9, 0))]
    for number in range(60):
        config = _config(rng)
        env, kind = envs[number % len(envs)], [None, "fwd", "bwd"][number % 3]
        enforced_by = [None, support.CUDNN, support.LIBRARY][number % 3]
        reasons = support.not_supported_reasons(config, env, kind=kind, enforced_by=enforced_by)
        assert isinstance(reasons, list) and all(isinstance(r, str) for r in reasons), (number, config.describe())


# -- the messages users met: each names the argument and the fix ---------------------------------------------
def _qkv(rng: np.random.Generator, layout: str = "BTNH") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    import ml_dtypes

    shape = (B, T, N, H) if layout == "BTNH" else (B, N, T, H)
    kv = (B, S, N, H) if layout == "BTNH" else (B, N, S, H)
    return (rng.standard_normal(shape).astype(ml_dtypes.bfloat16),
            *(rng.standard_normal(kv).astype(ml_dtypes.bfloat16) for _ in range(2)))


@pytest.mark.parametrize("door", ["reference", "jax"])
def test_a_float_keep_mask_suggests_m_greater_than_zero(door, rng):
    from cudnn_attn import keep

    q, k, v = _qkv(rng)
    attention = reference.attention if door == "reference" else jb.attention
    with pytest.raises(ValueError, match=r"(?s)mask \(keep\): dtype must be one of bool.*keep\(m > 0\)"):
        attention(q, k, v, mask=keep(np.ones((T, S), np.float32)))


@pytest.mark.parametrize("door", ["reference", "jax", "cupy"])
@pytest.mark.parametrize("foreign, fix", [("is_causal", "mask_type=MaskType.CAUSAL"), ("dropout_p", "dropout_rate="),
                                          ("softmax_scale", "scale=")])
def test_a_keyword_of_another_api_names_ours(door, foreign, fix, rng):
    import cudnn_attn

    q, k, v = _qkv(rng)
    function = {"reference": reference.dot_product_attention, "jax": jb.dot_product_attention,
                "cupy": cudnn_attn.dot_product_attention}[door]
    with pytest.raises(TypeError, match=f"'{foreign}'; write {re.escape(fix)}"):
        function(q, k, v, **{foreign: True})
    with pytest.raises(TypeError, match=r"'is_causal'; write mask=causal\(\)"):
        (reference.attention if door == "reference" else jb.attention)(q, k, v, is_causal=True)


@pytest.mark.parametrize("layout", ["BTNH", "BNTH"])
def test_key_value_in_the_other_layout_names_the_layout(layout, rng):
    q, k, v = _qkv(rng, layout)
    other = "BNTH" if layout == "BTNH" else "BTNH"
    k, v = (x.transpose(0, 2, 1, 3) for x in (k, v))
    with pytest.raises(ValueError, match=f"read as {other}, key/value would have K={N} heads and S={S} positions"):
        reference.dot_product_attention(q, k, v, qkv_layout=layout)


# -- the Flax door ---------------------------------------------------------------------------------------------
FLAX_OPTIONS_BAD = [
    ("is_causal", dict(is_causal="yes")), ("diagonal_alignment", dict(is_causal=True, diagonal_alignment="middle")),
    ("window", dict(window=-1)), ("window", dict(window=(1, 2, 3))), ("scale", dict(scale="0.1")),
    ("scale", dict(scale=math.nan)), ("softcap", dict(softcap=-1.0)), ("dropout_seed", dict(dropout_seed=-1)),
    ("dropout_seed", dict(dropout_seed="x")), ("compute_dtype", dict(compute_dtype=jnp.float32)),
    ("sink", dict(sink="x")), ("score_mod", dict(score_mod="tanh")), ("is_casual", dict(is_casual=True)),
]


@pytest.mark.parametrize("argument, options", FLAX_OPTIONS_BAD,
                         ids=[_id(f"{a}-{sorted(o.items())[-1][1]!r}") for a, o in FLAX_OPTIONS_BAD])
def test_flax_factory_validates_its_options(argument, options):
    from cudnn_attn.jax_bridge import flax_attention_fn

    with pytest.raises(ValueError, match=argument):
        flax_attention_fn(**options)


FLAX_CALLS_BAD = [
    ("query", lambda c: dict(c, query=None)), ("query", lambda c: dict(c, query=c["query"][0, 0])),
    ("mask", lambda c: dict(c, mask=np.ones((T + 1, S), bool))), ("bias", lambda c: dict(c, bias=np.ones((3, T, S)))),
    ("dropout_rate", lambda c: dict(c, dropout_rate=2.0)), ("dropout_rate", lambda c: dict(c, dropout_rate="0.1")),
    ("broadcast_dropout", lambda c: dict(c, dropout_rate=0.1, dropout_rng=jax.random.key(0))),
    ("einsum_dot_general", lambda c: dict(c, einsum_dot_general=jnp.einsum)),
]


@pytest.mark.parametrize("argument, change", FLAX_CALLS_BAD, ids=[f"{a}-{i}" for i, (a, _) in enumerate(FLAX_CALLS_BAD)])
def test_flax_attention_fn_validates_flax_arguments(argument, change, rng):
    from cudnn_attn.jax_bridge import flax_attention_fn

    q, k, v = (jnp.asarray(x) for x in _qkv(rng))
    call = change(dict(query=q, key=k, value=v))
    with pytest.raises(ValueError, match=argument):
        flax_attention_fn()(**call)


def test_flax_attention_fn_given_uncalled_says_to_call_it(rng):
    nnx = pytest.importorskip("flax.nnx")
    from cudnn_attn.jax_bridge import flax_attention_fn

    attention = nnx.MultiHeadAttention(N, N * H, dtype=jnp.bfloat16, decode=False, attention_fn=flax_attention_fn,
                                       rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((B, T, N * H)), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"attention_fn: .*attention_fn=flax_attention_fn\(\)"):
        attention(x)
    called = nnx.MultiHeadAttention(N, N * H, dtype=jnp.bfloat16, decode=False, attention_fn=flax_attention_fn(),
                                    rngs=nnx.Rngs(0))
    assert called(x).shape == (B, T, N * H)


# -- the torch door (skipped where torch is not installed) -----------------------------------------------------
def _torch_call(rng: np.random.Generator) -> dict:
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16) for x in _qkv(rng))
    return dict(query=q, key=k, value=v)


TORCH_BAD = [
    # (door, argument, change of the call's keywords)
    *(("attention", name, lambda c, name=name: {**c, name: None}) for name in ("query", "key", "value")),
    ("sdpa", "query", lambda c: {**c, "query": c["query"].float().numpy()}),
    ("attention", "query", lambda c: {**c, "query": c["query"][0]}),
    *(("attention", "scale", lambda c, v=v: {**c, "scale": v}) for v in ("0.1", math.nan, math.inf, True, 10 ** 400)),
    *(("attention", "seed", lambda c, v=v: {**c, "seed": v}) for v in ("x", None, -1, True, 1.5, 2 ** 64)),
    *(("attention", "dropout_rate", lambda c, v=v: {**c, "dropout_rate": v}) for v in ("0.1", 1.0, -0.1, None)),
    *(("sdpa", "window", lambda c, v=v: {**c, "causal": True, "window": v}) for v in (-3, 1.5, "4", True)),
    ("sdpa", "causal", lambda c: {**c, "causal": "yes"}),
    ("sdpa", "bottom_right", lambda c: {**c, "causal": True, "bottom_right": "yes"}),
    ("sdpa", "training", lambda c: {**c, "training": "yes"}),
    ("attention", "layout", lambda c: {**c, "layout": "XYZ"}),
    ("attention", "mask", lambda c: {**c, "mask": "causal"}),
    ("sdpa", "q_lengths", lambda c: {**c, "q_lengths": np.full((B,), T, np.int32), "kv_lengths": None}),
    ("sdpa", "keep", lambda c: {**c, "keep": __import__("torch").ones((T, S), dtype=__import__("torch").int32)}),
    ("attention", "key", lambda c: {**c, "key": c["key"][..., :4]}),
    ("attention", "BNTH", lambda c: {**c, "key": c["key"].transpose(1, 2).contiguous(),
                                     "value": c["value"].transpose(1, 2).contiguous()}),
]


@pytest.mark.parametrize("door, argument, change", TORCH_BAD,
                         ids=[f"{d}-{a}-{i}" for i, (d, a, _) in enumerate(TORCH_BAD)])
def test_torch_front_validates_like_the_other_fronts(door, argument, change, rng):
    call = change(_torch_call(rng))
    import cudnn_attn.torch as ct

    try:
        getattr(ct, door)(**call)
    except ValueError as error:
        assert argument in str(error), f"ct.{door} {argument}: {error}"
    except Exception as error:  # noqa: BLE001 -- the contract is about exactly this
        pytest.fail(f"ct.{door} {argument} raised {type(error).__name__} instead of ValueError: {error}")
    else:
        pytest.fail(f"ct.{door} {argument}: raised nothing")


@pytest.mark.parametrize("window", [0, None, 3])
def test_torch_front_takes_its_valid_scalars(window, rng):
    call = _torch_call(rng)
    import cudnn_attn.torch as ct

    output, _ = ct.sdpa(**call, causal=True, bottom_right=True, window=window, scale=np.float32(0.3), seed=np.int64(7))
    assert output.shape == call["query"].shape
    assert ct.attention(**call, scale=1).output.shape == call["query"].shape
