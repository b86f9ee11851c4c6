"""``score_mod`` (flex attention) on cuDNN: a user function of the scores becomes cuDNN pointwise graphs.

Users write ``score_mod(score, *score_mod_args)`` with ``jax.numpy`` / ``jax.lax`` on the float32
``(B, N, T, S)`` scores (after ``scale`` and the bias, before the softmax, as the spec says): softcap
``c * tanh(s / c)``, relative-position biases from ``lax.broadcasted_iota`` or ``jnp.arange``, document
masks from index comparisons, ALiBi variants.  Here that function is

1. traced with JAX when the call is made (:mod:`cudnn_attn.tracing.score_mod`; its identity in the configuration is
   the traced program) and translated (:mod:`cudnn_attn.tracing.jaxpr_program`) into a pointwise
   :class:`~.score_mod_ir.Program` for the forward and one for its VJP with respect to the score
   (``score_mod_bprop``);
2. combined with the configuration's masks (:func:`masked_programs`): cuDNN refuses ``score_mod``
   together with its built-in causal / window / padding masks, so they are expressed inside the
   modification;
3. emitted as cuDNN operations inside the callbacks (:mod:`.score_mod_cudnn`) that the graph builder
   passes to ``sdpa(score_mod=...)`` and ``sdpa_backward(score_mod=..., score_mod_bprop=...)``.

What cuDNN 9.19 does, as measured on the H200 (sm90), and what follows from it:

* The backward callback receives only ``dS`` (the gradient w.r.t. the modified score), but a
  non-linear modification (softcap) needs the score itself.  The backward graph calls ``score_mod``
  first (to recompute ``P``), so the forward callback records the score tensor it was given and the
  bprop callback reads it: cuDNN builds that graph and its gradients match the reference.
* cuDNN adds the bias *after* ``score_mod``; the spec (and the reference) apply ``score_mod`` to the
  biased score.  Unless the modification is additive (its VJP is the identity, e.g. a relative-position
  bias, so both orders agree), the bias is added inside the forward callback instead of being given to
  cuDNN.  cuDNN then cannot produce dBias: a differentiable bias with a non-additive modification is
  refused.
* Padding inside the modification needs the per-sequence lengths: the builder gives ``seq_len_q`` /
  ``seq_len_kv`` to the operation (without ``use_padding_mask``), which also makes cuDNN skip the padded
  tiles, write zeros to padded output rows and zero dQ/dK/dV there; the callbacks read the same tensors
  (without them in the operation, the in-callback mask alone gave wrong results on the H200).
* Constants are runtime scalars of the callback graph (``tensor_scalar(v, RUNTIME_PARAM)``), bound by
  the frontend; arguments are by-value float32 host scalars of the outer graph, in call order (integer
  and boolean arguments are converted inside the program).  Arrays as arguments are refused: on 9.19 a
  column operand ``(..., 1, S)`` gives wrong gradients and a device scalar inside a select fails to
  compile (measured), so only by-value scalars are offered.
* cuDNN's pattern matcher accepts only some shapes of pointwise graph; :mod:`.score_mod_cudnn` says which
  and how the emission keeps to them.

Combinations (measured on the H200 with cuDNN 9.19, forward and backward against the reference):
causal and sliding window with the top-left diagonal, causal with the bottom-right diagonal without
padding (T < S), padding alone and with a top-left causal mask, bias (inside the modification, or given to cuDNN for an
additive modification, then with dBias), GQA, both layouts, fp16 and bf16.  Refused: ALiBi (write it in
the ``score_mod``), a bottom-right diagonal together with per-sequence lengths (cuDNN computes that mask
wrongly inside the modification), a bias gradient with a non-additive modification; FP8 is the support
table's refusal (the seed's FP8 path has no score_mod).  Masked scores are ``-inf`` (as cuDNN's own masks
from 9.10 and the reference), so a query with no admissible key has no defined result.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from cudnn_attn.core.config import AttentionConfig, DiagonalAlignment
from cudnn_attn.core.score_mod_ir import F32, I32, Program, ProgramBuilder, evaluate
from cudnn_attn.core.score_mod_spec import ScoreModProgram, score_mod_program
from cudnn_attn.core.support import check_structure
from cudnn_attn.core.types import Kind

from .score_mod_cudnn import emit

NEGATIVE_INFINITY = -math.inf      # the fill of masked scores: cuDNN's own masks use -inf from cuDNN 9.10


# ---------------------------------------------------------------------------------------------------
# The configuration's masks, inside the modification
# ---------------------------------------------------------------------------------------------------
def _mask_conditions(b: ProgramBuilder, config: AttentionConfig) -> list[Callable[[str], int]]:
    """Builders of the conditions a (query i, key j) pair must meet under ``config.mask`` (see
    :class:`~cudnn_attn.core.config.StaticMask`): padding, then the diagonal band.  Each takes a tag that keeps
    its positions apart from earlier ones.  (A bottom-right band with per-sequence lengths is refused:
    :func:`score_mod_refusals`.)"""
    mask = config.mask
    conditions: list[Callable[[str], int]] = []

    def padding(tag: str) -> int:
        row, col = b.leaf("index", I32, 2, tag), b.leaf("index", I32, 3, tag)
        return b.op("logical_and", b.op("cmp_lt", row, b.leaf("seq_len_q", I32)),
                    b.op("cmp_lt", col, b.leaf("seq_len_kv", I32)))

    def band(tag: str) -> int:
        d = b.op("sub", b.leaf("index", I32, 3, tag), b.leaf("index", I32, 2, tag))      # j - i - delta
        if mask.alignment is DiagonalAlignment.BOTTOM_RIGHT:
            d = b.op("sub", d, b.const(config.kv_len - config.q_len, I32))
        bounds = []
        if mask.right_bound is not None:
            bounds.append(b.op("cmp_le", d, b.const(mask.right_bound, I32)))
        if mask.left_bound is not None:
            bounds.append(b.op("cmp_gt", d, b.const(-mask.left_bound, I32)))
        return functools.reduce(lambda x, y: b.op("logical_and", x, y), bounds)

    if mask.padding:                    # packing and paging imply it (AttentionConfig)
        conditions.append(padding)
    if mask.right_bound is not None or mask.left_bound is not None:
        conditions.append(band)
    return conditions


def _with_mask(program: Program, config: AttentionConfig, fill: float) -> Program:
    """``program`` followed by ``select(condition, result, fill)`` for each mask condition in turn.

    Each condition is built after the previous select, from its own positions: cuDNN wants a mask's
    positions generated from the score value it masks (measured with cuDNN 9.19: padding then causal
    is refused otherwise), and the emitter generates positions from the latest score value.
    """
    b = ProgramBuilder(program.name)
    ids: list[int] = []
    for node in program.nodes:                                   # replay into a builder
        if node.op == "const":
            ids.append(b.const(node.param, node.dtype))
        elif node.is_leaf:
            ids.append(b.leaf(node.op, node.dtype, node.param, node.tag))
        else:
            ids.append(b.op(node.op, *(ids[i] for i in node.inputs), dtype=node.dtype))
    conditions = _mask_conditions(b, config)
    if not conditions:
        return program
    result = ids[program.output]
    for number, condition in enumerate(conditions):
        result = b.op("select", condition(f"mask{number}"), result, b.const(fill, F32))
    return b.build(result)


def masked_programs(config: AttentionConfig) -> tuple[Program, Program]:
    """The forward and backward programs of ``config.score_mod`` with ``config.mask`` applied.

    Masked scores become ``-inf`` (as cuDNN's own masks since 9.10 and the reference); their
    gradients become 0.
    """
    program = score_mod_program(config.score_mod)
    return _with_mask(program.forward, config, NEGATIVE_INFINITY), _with_mask(program.backward, config, 0.0)


# ---------------------------------------------------------------------------------------------------
# The graph builder's hook
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScoreModGraph:
    """How the graph builder wires ``config.score_mod`` into one forward or backward graph.

    The builder declares ``num_args`` by-value FLOAT ``(1, 1, 1, 1)`` tensors (the user's arguments in
    call order, bound with host float32 values); when ``takes_bias`` it keeps the bias away from cuDNN's
    ``bias=`` and hands it to :meth:`callbacks`; when ``takes_seq_lens`` it passes ``seq_len_q`` /
    ``seq_len_kv`` to the operation *without* ``use_padding_mask`` (and without any built-in mask
    option) and to :meth:`callbacks`.
    """

    config: AttentionConfig
    program: ScoreModProgram
    forward: Program
    backward: Program
    kind: str = "bwd"       # the graph's kind: its last callback ("score_mod" in a forward graph) ends the wiring

    @property
    def num_args(self) -> int:
        return self.program.num_args

    @property
    def takes_bias(self) -> bool:
        return self.config.bias is not None and not self.program.is_additive

    @property
    def takes_seq_lens(self) -> bool:
        return self.forward.uses("seq_len_q") or self.forward.uses("seq_len_kv")

    def callbacks(self, args: Sequence[Any], *, bias: Any = None, seq_len_q: Any = None,
                  seq_len_kv: Any = None) -> tuple[Callable[[Any, Any], Any], Callable[[Any, Any], Any]]:
        """``(score_mod, score_mod_bprop)`` callbacks with cuDNN's signature ``(sg, tensor) -> tensor``.

        ``args`` are the declared argument tensors; the other tensors are required exactly when
        :attr:`takes_bias` / :attr:`takes_seq_lens` say so.  The bprop callback reads the score that
        the forward callback received in the same (backward) graph, so cuDNN must call the forward
        callback first, which it does (it recomputes the probabilities before their gradient).
        """

        if len(args) != self.num_args:
            raise ValueError(f"args: {self.program.name!r} takes {self.num_args} arguments, got {len(args)}")
        if (bias is not None) != self.takes_bias:
            raise ValueError(f"bias: {'required' if self.takes_bias else 'not taken'} by {self.program.name!r} here")
        if (seq_len_q is None or seq_len_kv is None) and self.takes_seq_lens:
            raise ValueError("seq_len_q, seq_len_kv: the modification masks padding and needs both")
        state: dict[str, Any] = {"leaves": {"args": tuple(args), "seq_len_q": seq_len_q, "seq_len_kv": seq_len_kv},
                                 "bias": bias}
        last = "score_mod" if self.kind == "fwd" else "score_mod_bprop"

        def taken(name: str) -> dict[str, Any]:
            if "leaves" not in state:
                raise RuntimeError(f"cuDNN called {name} after the graph's last score_mod callback")
            return state

        def finish(name: str, sg: Any) -> None:
            if name == last:
                state.clear()
                _release_lowering(sg)

        def score_mod(sg: Any, score: Any) -> Any:
            held = taken("score_mod")
            if held["bias"] is not None:
                score = sg.add(a=score, b=held["bias"], name=f"{self.forward.name}_bias")
            held["score"] = score
            out = emit(sg, self.forward, score, {**held["leaves"], "score": score})
            finish("score_mod", sg)
            return out

        def score_mod_bprop(sg: Any, grad: Any) -> Any:
            held = taken("score_mod_bprop")
            if self.backward.uses("score") and "score" not in held:
                raise RuntimeError("cuDNN called score_mod_bprop before score_mod; the score is not available")
            out = emit(sg, self.backward, grad, {**held["leaves"], "cotangent": grad, "score": held.get("score")})
            finish("score_mod_bprop", sg)
            return out

        return score_mod, score_mod_bprop

    def evaluate(self, score: np.ndarray, args: Sequence[Any] = (), *, bias: np.ndarray | None = None,
                 cotangent: np.ndarray | None = None, seq_len_q: Any = None, seq_len_kv: Any = None) -> np.ndarray:
        """The same programs run with NumPy (the forward, or the backward when ``cotangent`` is given).

        ``score`` is the scaled ``q·k`` float32 ``(B, N, T, S)``; ``bias`` is added to it first when
        :attr:`takes_bias` (cuDNN adds it after the forward otherwise, outside the modification).
        """
        if self.takes_bias:
            if bias is None:
                raise ValueError(f"bias: {self.program.name!r} adds the bias inside the modification; pass it")
            score = np.asarray(score, np.float32) + np.asarray(bias, np.float32)
        program = self.forward if cotangent is None else self.backward
        return evaluate(program, score=score, cotangent=cotangent, args=tuple(args),
                        seq_len_q=seq_len_q, seq_len_kv=seq_len_kv)


def _release_lowering(sg: Any) -> None:
    """Break the reference cycle through C++ that a score_mod callback puts in a cuDNN graph.

    cuDNN keeps the callbacks (a ``std::function``) in its C++ graph; what they reach keeps that graph
    alive: our closure's tensors (keep-alive on their graph) and the frontend's lowering closure
    (``_CallbackGraphShim._lower``, whose cells hold the C++ graph and its tensor map).  Python's
    collector cannot see through C++, so every score_mod graph stayed alive until exit (measured
    deviceless: each built graph's ``backend_graph`` and tensors were reported by nanobind as leaked at
    exit, and never freed by the cache's eviction).  cuDNN calls each callback once, while planning;
    after the graph's last callback the lowering is done, so its closure cells are emptied.
    """
    lower = getattr(sg, "_lower", None)                     # frontend 1.32's shim; absent: nothing to break
    for cell in getattr(lower, "__closure__", None) or ():
        cell.cell_contents = None


def score_mod_graph(config: AttentionConfig, kind: str) -> ScoreModGraph:
    """The translation of ``config.score_mod`` for its ``kind`` (a :class:`~cudnn_attn.core.types.Kind`) graph.

    Raises:
        UnsupportedConfigurationError: the support table's ``score_mod`` rows refuse the ``kind`` graph
            (the function cannot be translated, or the configuration combines it with what cuDNN cannot
            do inside the modification: :func:`score_mod_refusals`).
        ValueError: no score_mod, or a bad ``kind``.
    """
    if config.score_mod is None:
        raise ValueError("config: has no score_mod")
    if kind not in tuple(Kind):
        raise ValueError(f"kind: expected 'fwd' or 'bwd', got {kind!r}")
    check_structure(config, kind=kind)
    forward, backward = masked_programs(config)
    return ScoreModGraph(config, score_mod_program(config.score_mod), forward, backward, kind)

