"""score_mod translation (``cudnn_attn.graphs.score_mod*``) on the CPU, and cuDNN's verdict deviceless.

Three layers are checked against JAX itself, on fresh random scores:

* the traced programs, run by the NumPy interpreter, equal ``score_mod`` and its ``jax.vjp``
  (float32 on both sides: ``rtol = atol = 2e-5``, a few ulps of the transcendental functions);
* the cuDNN operations the emitter produces, run by a NumPy model of cuDNN's pointwise operations,
  equal the program (exactly: same float32 operations, rewritten), and keep to the shapes cuDNN's
  fused-attention matcher accepts (no ``logical_not``, first operands derived from the score);
* deviceless, cuDNN 9.19 builds sm90 plans for the forward and backward graphs.

The GPU numerics are in ``tests/gpu/test_score_mod_gpu.py``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from deviceless.conftest import deviceless  # noqa: F401  (the session fixture of the deviceless tier)
from jax import lax

from cudnn_attn.core.config import AttentionConfig, BiasSpec, DiagonalAlignment, PackingSpec, StaticMask
from cudnn_attn.core.errors import UnsupportedConfigurationError
from cudnn_attn.core.score_mod_ir import F32, I32, ProgramBuilder, evaluate
from cudnn_attn.core.score_mod_spec import score_mod_program, score_mod_spec
from cudnn_attn.graphs import score_mod_cudnn
from cudnn_attn.core.score_mod_spec import score_mod_refusals
from cudnn_attn.graphs.score_mod import score_mod_graph

SHAPE = (2, 3, 16, 24)          # (B, N, T, S); T != S so that a transposed position cannot pass
TOLERANCE = dict(rtol=2e-5, atol=2e-5)


# -- score_mods, module level (the deviceless worker unpickles them by name) -------------------------
def _positions(score):
    return lax.broadcasted_iota(jnp.int32, score.shape, 2), lax.broadcasted_iota(jnp.int32, score.shape, 3)


def softcap(score, cap):
    return cap * jnp.tanh(score / cap)


def softcap_30(score):
    return 30.0 * jnp.tanh(score / 30.0)


def relative_bias(score, slope):
    row, col = _positions(score)
    return score + slope * (col - row)


def relative_bias_arange(score, slope):
    t, s = score.shape[2:]
    return score + slope * (jnp.arange(s)[None, None, None, :] - jnp.arange(t).reshape(1, 1, t, 1))


def document_mask(score, first_end, second_end):
    def document(i):
        return (i >= first_end).astype(jnp.int32) + (i >= second_end).astype(jnp.int32)
    row, col = _positions(score)
    return jnp.where(document(row) == document(col), score, -jnp.inf)


def blocks(score):
    row, col = _positions(score)
    return jnp.where((row // 5 == col // 5) | (col % 7 == 0), score, -1e9)


def alibi_from_positions(score):
    head = lax.broadcasted_iota(jnp.float32, score.shape, 1)
    row, col = _positions(score)
    return score + 2.0 ** (-8.0 * (head + 1) / score.shape[1]) * (col - row).astype(jnp.float32)


def leaky(score):
    return jnp.where(score > 0, score, 0.1 * score)


def relu(score):
    return jax.nn.relu(score)


def absolute(score):
    return jnp.abs(score) - jnp.sign(score) * 0.5


def clamped_cube(score):
    return jnp.clip(score, -1.5, 2.0) ** 3 + lax.integer_pow(score * score + 1.0, -2)


def transcendental(score):
    positive = score * score + 0.5
    return (jnp.exp2(score * 0.3) + jnp.log1p(positive) - jnp.expm1(score * 0.2) + jax.nn.sigmoid(score)
            + lax.erf(score) + jnp.sqrt(positive) + lax.rsqrt(positive) + jnp.sin(score) * jnp.cos(score))


def flag_and_scale(score, flag, scale):
    return jnp.where(flag, score * scale, -score)


@jax.jit
def _inner(score):
    return score * 0.5 + 1.0


def nested_calls(score):
    return jax.checkpoint(_inner)(score) + lax.stop_gradient(score) * 0.25


def float_remainder(score):
    return lax.rem(score * 3.0, 1.25) + score


FUNCTIONS = {
    # name: (score_mod, argument values)
    "softcap": (softcap, (np.float32(2.0),)),
    "softcap-constant": (softcap_30, ()),
    "relative-bias-iota": (relative_bias, (np.float32(0.3),)),
    "relative-bias-arange": (relative_bias_arange, (np.float32(-0.2),)),
    "document-mask-int-args": (document_mask, (np.int32(5), np.int32(11))),
    "blocks-floordiv-rem-or": (blocks, ()),
    "alibi-from-positions": (alibi_from_positions, ()),
    "leaky": (leaky, ()),
    "relu-custom-jvp": (relu, ()),
    "abs-sign": (absolute, ()),
    "clip-integer-pow": (clamped_cube, ()),
    "transcendental": (transcendental, ()),
    "bool-and-float-args": (flag_and_scale, (np.bool_(True), np.float32(1.5))),
    "jit-checkpoint-stop-gradient": (nested_calls, ()),
    "float-remainder": (float_remainder, ()),
}


def _spec(fn, args=(), shape=SHAPE):
    return score_mod_spec(fn, shape, tuple((np.shape(a), np.asarray(a).dtype.name) for a in args))



def _scores(rng, shape=SHAPE):
    return rng.standard_normal(shape).astype(np.float32) * 2


def _vjp(fn, score, grad, args):
    return np.asarray(jax.vjp(lambda s: fn(s, *args), jnp.asarray(score))[1](jnp.asarray(grad))[0])


# -- the traced programs against JAX ----------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_forward_program_equals_the_function(name, rng):
    fn, args = FUNCTIONS[name]
    score = _scores(rng)
    program = score_mod_program(_spec(fn, args)).forward
    np.testing.assert_allclose(evaluate(program, score=score, args=args), np.asarray(fn(jnp.asarray(score), *args)),
                               **TOLERANCE)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_backward_program_equals_the_vjp(name, rng):
    fn, args = FUNCTIONS[name]
    score, grad = _scores(rng), rng.standard_normal(SHAPE).astype(np.float32)
    program = score_mod_program(_spec(fn, args)).backward
    np.testing.assert_allclose(evaluate(program, score=score, cotangent=grad, args=args),
                               _vjp(fn, score, grad, args), **TOLERANCE)


def test_additive_modifications_have_the_identity_as_backward():
    relative = score_mod_program(_spec(relative_bias, (np.float32(1.0),)))
    capped = score_mod_program(_spec(softcap, (np.float32(1.0),)))
    assert relative.is_additive and not relative.backward_reads_score and len(relative.backward.nodes) == 1
    assert not capped.is_additive and capped.backward_reads_score


def test_builder_folds_constants_and_shares_subexpressions():
    b = ProgramBuilder("t")
    six = b.op("mul", b.const(2.0, F32), b.const(3.0, F32))
    assert b.nodes[six].op == "const" and b.nodes[six].param == 6.0
    score = b.leaf("score", F32)
    assert b.op("add", score, six) == b.op("add", score, six)
    assert b.const(0.0, F32) != b.const(-0.0, F32)          # signed zeros stay apart
    program = b.build(b.op("add", score, six))
    assert [n.op for n in program.nodes] == ["const", "score", "add"] or \
        [n.op for n in program.nodes] == ["score", "const", "add"]


def test_integer_division_rounds_toward_zero_like_lax():
    b = ProgramBuilder("t")
    index = b.leaf("index", I32, 3)
    program = b.build(b.op("cast", b.op("div", b.op("sub", index, b.const(11, I32)), b.const(4, I32)), dtype=F32))
    got = evaluate(program, score=np.zeros((1, 1, 1, 24), np.float32))[0, 0, 0]
    want = np.asarray(lax.div(jnp.arange(24) - 11, 4), np.float32)
    np.testing.assert_array_equal(got, want)


# -- what cannot be translated ------------------------------------------------------------------------
def row_softmax(score):
    return score - jnp.max(score, axis=-1, keepdims=True)


def table_lookup(score):
    table = np.linspace(0.0, 1.0, score.shape[3], dtype=np.float32)
    return score + table[None, None, None, :]


def parity(score):
    row, _ = _positions(score)
    return jnp.where((row & 1) == 0, score, -jnp.inf)


def square_positions(score):
    n = jnp.arange(score.shape[2])
    return score + n[None, None, :, None] + n[None, None, None, :]


def row_sums(score):
    return score.sum(axis=-1)


@pytest.mark.parametrize("fn, needle", [
    (row_softmax, "'reduce_max'"),
    (table_lookup, "constant array of shape (1, 1, 1, 24)"),
    (parity, "bitwise 'and'"),
], ids=["reduction", "closed-over-array", "bitwise"])
def test_untranslatable_functions_are_refused_naming_the_operation(fn, needle):
    with pytest.raises(UnsupportedConfigurationError) as error:
        score_mod_program(_spec(fn))
    message = str(error.value)
    assert needle in message and repr(fn.__name__) in message


def test_a_value_broadcast_to_two_axes_is_refused():
    with pytest.raises(UnsupportedConfigurationError, match="broadcast to the score in two different ways"):
        score_mod_program(_spec(square_positions, shape=(1, 1, 16, 16)))


def test_array_arguments_are_refused_with_the_reason():
    spec = score_mod_spec(relative_bias, SHAPE, (((24,), "float32"),))
    with pytest.raises(UnsupportedConfigurationError, match=r"score_mod_args\[0\] has shape \(24,\).*by-value scalars"):
        score_mod_program(spec)


def test_a_result_of_another_shape_is_a_value_error():
    with pytest.raises(ValueError, match=r"score_mod: 'row_sums' must return one float array of the score's shape "
                                         r"\(B, N, T, S\) = \(2, 3, 16, 24\), got float32\[2, 3, 16\]"):
        _spec(row_sums)


# -- masks and bias inside the modification ----------------------------------------------------------
def _config(fn, args=(), **fields):
    base = dict(batch=SHAPE[0], q_heads=SHAPE[1], kv_heads=SHAPE[1], q_len=SHAPE[2], kv_len=SHAPE[3], qk_dim=64,
                v_dim=64, dtype="float16", training=True, score_mod=_spec(fn, args))
    base.update(fields)
    return AttentionConfig(**base)


def _keep(mask: StaticMask, t: int, s: int, q_len: np.ndarray, kv_len: np.ndarray) -> np.ndarray:
    """StaticMask's rule (config.py), written independently: a (B, 1, T, S) boolean array."""
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    keep = np.ones((len(q_len), 1, t, s), bool)
    for b in range(len(q_len)):
        d = j - i - (s - t if mask.alignment is DiagonalAlignment.BOTTOM_RIGHT else 0)
        if mask.right_bound is not None:
            keep[b, 0] &= d <= mask.right_bound
        if mask.left_bound is not None:
            keep[b, 0] &= -d < mask.left_bound
        if mask.padding:
            keep[b, 0] &= (i < q_len[b]) & (j < kv_len[b])
    return keep


MASKS = {
    "causal": StaticMask(right_bound=0),
    "causal-bottom-right": StaticMask(right_bound=0, alignment=DiagonalAlignment.BOTTOM_RIGHT),
    "window-6": StaticMask(right_bound=0, left_bound=6),
    "band-2-4": StaticMask(right_bound=2, left_bound=4),
    "padding": StaticMask(padding=True),
    "padding-causal": StaticMask(right_bound=0, padding=True),
}


@pytest.mark.parametrize("mask", list(MASKS), ids=list(MASKS))
@pytest.mark.parametrize("name", ["softcap", "relative-bias-iota", "document-mask-int-args"])
def test_masks_are_applied_inside_the_modification(mask, name, rng):
    fn, args = FUNCTIONS[name]
    graph = score_mod_graph(_config(fn, args, mask=MASKS[mask]), "bwd")
    score, grad = _scores(rng), rng.standard_normal(SHAPE).astype(np.float32)
    q_len, kv_len = rng.integers(1, SHAPE[2] + 1, SHAPE[0]), rng.integers(1, SHAPE[3] + 1, SHAPE[0])
    keep = _keep(MASKS[mask], SHAPE[2], SHAPE[3], q_len, kv_len)
    lengths = dict(seq_len_q=q_len, seq_len_kv=kv_len) if graph.takes_seq_lens else {}
    assert graph.takes_seq_lens == MASKS[mask].padding
    forward = graph.evaluate(score, args, **lengths)
    np.testing.assert_allclose(forward, np.where(keep, np.asarray(fn(jnp.asarray(score), *args)), -np.inf),
                               **TOLERANCE)
    backward = graph.evaluate(score, args, cotangent=grad, **lengths)
    np.testing.assert_allclose(backward, np.where(keep, _vjp(fn, score, grad, args), 0.0), **TOLERANCE)


def test_a_non_additive_modification_takes_the_bias_first(rng):
    cap = (np.float32(1.5),)
    graph = score_mod_graph(_config(softcap, cap, bias=BiasSpec((1, 3, 16, 24), differentiable=False)), "bwd")
    assert graph.takes_bias and graph.num_args == 1
    score, bias = _scores(rng), rng.standard_normal((1, 3, 16, 24)).astype(np.float32)
    np.testing.assert_allclose(graph.evaluate(score, cap, bias=bias), np.asarray(softcap(score + bias, *cap)),
                               **TOLERANCE)
    additive = score_mod_graph(_config(relative_bias, cap, bias=BiasSpec((1, 3, 16, 24), differentiable=True)), "bwd")
    assert not additive.takes_bias                       # cuDNN adds it, and produces dBias


@pytest.mark.parametrize("fields, kind, needle", [
    (dict(mask=StaticMask(right_bound=0, alibi=True)), "fwd", "ALiBi"),
    (dict(mask=StaticMask(right_bound=0, padding=True, alignment=DiagonalAlignment.BOTTOM_RIGHT)), "fwd",
     "bottom-right diagonal and per-sequence lengths"),
    (dict(bias=BiasSpec((1, 3, 16, 24), differentiable=True)), "bwd", "a bias gradient with the non-additive"),
    (dict(packing=PackingSpec(2), mask=StaticMask(padding=True)), "fwd", "reads the batch index"),
], ids=["alibi", "bottom-right-with-lengths", "dbias-of-softcap", "batch-index-when-packed"])
def test_combinations_cudnn_cannot_do_are_refused(fields, kind, needle):
    fn = alibi_with_batch if "packing" in fields else softcap
    args = () if "packing" in fields else (np.float32(2.0),)
    config = _config(fn, args, **fields)
    with pytest.raises(UnsupportedConfigurationError, match=needle):
        score_mod_graph(config, kind)
    assert any(needle in reason for reason in score_mod_refusals(config))     # what the support table asks


def test_refusals_are_empty_for_what_runs_and_follow_the_kind():
    assert score_mod_refusals(_config(softcap, (np.float32(2.0),), mask=StaticMask(right_bound=0, padding=True))) == []
    config = _config(softcap, (np.float32(2.0),), bias=BiasSpec((1, 3, 16, 24), True))
    assert score_mod_refusals(config, "fwd") == [] and score_mod_refusals(config, "bwd")
    assert score_mod_refusals(config.replace(training=False)) == []


def alibi_with_batch(score):
    return score + lax.broadcasted_iota(jnp.float32, score.shape, 0)


def test_the_forward_of_a_softcap_with_a_differentiable_bias_is_allowed():
    graph = score_mod_graph(_config(softcap, (np.float32(2.0),), bias=BiasSpec((1, 3, 16, 24), True)), "fwd")
    assert graph.takes_bias


# -- the emitted cuDNN operations, run by a NumPy model of cuDNN's pointwise operations ---------------
class _Tensor:
    """A cuDNN tensor of the model: a value, and whether it derives from the score or a position."""

    _TYPES = {"FLOAT": np.float32, "INT32": np.int32, "BOOLEAN": np.bool_}

    def __init__(self, value, anchored):
        self.value, self.anchored = np.asarray(value), anchored

    def set_data_type(self, dtype):
        target = self._TYPES[dtype.name]
        if target is np.bool_:
            self.value = self.value != 0
        elif target is np.int32 and self.value.dtype.kind == "f":
            self.value = np.trunc(self.value).astype(np.int32)
        else:
            self.value = self.value.astype(target)
        return self


class _Graph:
    """The backend graph's pointwise methods in NumPy; records every call."""

    _BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "max": np.maximum, "min": np.minimum,
               "pow": np.power, "cmp_lt": np.less, "cmp_le": np.less_equal, "cmp_gt": np.greater,
               "cmp_ge": np.greater_equal, "cmp_eq": np.equal, "cmp_neq": np.not_equal,
               "logical_and": np.logical_and, "logical_or": np.logical_or}
    _UNARY = {"neg": np.negative, "abs": np.abs, "exp": np.exp, "log": np.log, "tanh": np.tanh,
              "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "sqrt": np.sqrt, "rsqrt": lambda x: 1 / np.sqrt(x),
              "reciprocal": np.reciprocal, "sin": np.sin, "cos": np.cos, "tan": np.tan, "floor": np.floor,
              "ceil": np.ceil, "identity": lambda x: x, "erf": np.vectorize(math.erf, otypes=[np.float32])}

    def __init__(self, shape):
        self.shape, self.calls, self.latest = shape, [], None

    def tensor_scalar(self, value, kind):
        return _Tensor(value, anchored=False)

    def gen_index(self, input, axis, compute_data_type, name):
        self.calls.append(("gen_index", input))
        shape = [n if a == axis else 1 for a, n in enumerate(input.value.shape)]
        return _Tensor(np.broadcast_to(np.arange(input.value.shape[axis]).reshape(shape), input.value.shape), True)

    def binary_select(self, input0, input1, mask, compute_data_type, name):
        self.calls.append(("binary_select", input0, input1, mask))
        return _Tensor(np.where(mask.value, input0.value, input1.value), True)

    def div(self, a, b, compute_data_type, name):
        self.calls.append(("div", a, b))
        x, y = a.value, b.value
        if compute_data_type.name == "INT32":
            q = np.abs(x) // np.abs(y)
            return _Tensor(np.where((x < 0) != (y < 0), -q, q), True)
        return _Tensor(np.true_divide(x, y), True)

    def __getattr__(self, method):
        def call(compute_data_type, name, **operands):
            values = list(operands.values())
            self.calls.append((method, *values))
            if method in self._UNARY:
                return _Tensor(self._UNARY[method](values[0].value), True)
            with np.errstate(all="ignore"):
                return _Tensor(self._BINARY[method](values[0].value, values[1].value), True)
        if method not in self._BINARY and method not in self._UNARY:
            raise AttributeError(method)
        return call


def _lengths(lengths):
    return None if lengths is None else _Tensor(np.asarray(lengths, np.int32).reshape(-1, 1, 1, 1), False)


def _run_emitted(program, score, grad=None, args=(), seq_len_q=None, seq_len_kv=None):
    graph = _Graph(score.shape)
    main = _Tensor(score if grad is None else grad, True)
    leaves = {"args": tuple(_Tensor(np.float32(a), False) for a in args), "score": _Tensor(score, True),
              "cotangent": main,
              "seq_len_q": _lengths(seq_len_q), "seq_len_kv": _lengths(seq_len_kv)}
    with np.errstate(all="ignore"):
        result = score_mod_cudnn.emit(graph, program, main, leaves)
    return np.broadcast_to(result.value, score.shape), graph.calls


def _assert_matcher_friendly(calls):
    methods = [c[0] for c in calls]
    assert "logical_not" not in methods
    for method, *operands in calls:
        if method != "gen_index":
            assert operands[0].anchored, f"{method}: first operand not derived from the score or a position"


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_emitted_operations_compute_the_program(name, rng):
    fn, args = FUNCTIONS[name]
    score, grad = _scores(rng), rng.standard_normal(SHAPE).astype(np.float32)
    program = score_mod_program(_spec(fn, args))
    for prog, cotangent in ((program.forward, None), (program.backward, grad)):
        got, calls = _run_emitted(prog, score, cotangent, [np.float32(a) for a in args])
        want = evaluate(prog, score=score, cotangent=cotangent, args=args)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        _assert_matcher_friendly(calls)


@pytest.mark.parametrize("mask", ["padding-causal", "window-6"])
def test_emitted_masks_compute_the_program(mask, rng):
    fn, args = FUNCTIONS["softcap"]
    graph = score_mod_graph(_config(fn, args, mask=MASKS[mask]), "bwd")
    score, grad = _scores(rng), rng.standard_normal(SHAPE).astype(np.float32)
    lengths = dict(seq_len_q=rng.integers(1, 17, 2), seq_len_kv=rng.integers(1, 25, 2)) if graph.takes_seq_lens else {}
    for prog, cotangent in ((graph.forward, None), (graph.backward, grad)):
        got, calls = _run_emitted(prog, score, cotangent, list(args), **lengths)
        np.testing.assert_allclose(got, graph.evaluate(score, args, cotangent=cotangent, **lengths), rtol=1e-6)
        _assert_matcher_friendly(calls)


# -- cuDNN's verdict: sm90 plans, deviceless ------------------------------------------------------------
DEVICELESS = {
    "softcap": _config(softcap, (np.float32(2.0),)),
    "softcap-constant-bf16": _config(softcap_30, dtype="bfloat16"),
    "relative-bias": _config(relative_bias, (np.float32(0.3),)),
    "document-mask": _config(document_mask, (np.int32(5), np.int32(11))),
    "blocks-floordiv-rem-or": _config(blocks),
    "alibi-from-positions": _config(alibi_from_positions),
    "leaky": _config(leaky),
    "softcap-causal": _config(softcap, (np.float32(2.0),), mask=StaticMask(right_bound=0)),
    "softcap-window": _config(softcap, (np.float32(2.0),), mask=StaticMask(right_bound=0, left_bound=8)),
    "softcap-padding-causal": _config(softcap, (np.float32(2.0),), mask=StaticMask(right_bound=0, padding=True)),
    "softcap-of-biased-score": _config(softcap, (np.float32(2.0),), bias=BiasSpec((1, 3, 16, 24), False)),
    "relative-bias-with-dbias": _config(relative_bias, (np.float32(0.3),), bias=BiasSpec((1, 3, 16, 24), True)),
}


@pytest.mark.deviceless
@pytest.mark.parametrize("kind", ["fwd", "bwd"])
@pytest.mark.parametrize("case", list(DEVICELESS), ids=list(DEVICELESS))
def test_cudnn_builds_the_modification_for_sm90(deviceless, case, kind):  # noqa: F811
    verdict = deviceless.verdict(DEVICELESS[case], kind)
    assert verdict.ok, f"{kind} {case}: refused by {verdict.refused_by}: {verdict.message[:500]}"
