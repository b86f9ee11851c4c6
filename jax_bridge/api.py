"""cuDNN fused attention on JAX arrays: JAX's cuDNN attention API, differentiable, inside every transform.

:func:`attention` is the native call (:func:`cudnn_attn.attention` on JAX arrays): masks as
:class:`~cudnn_attn.core.masks.MaskSpec` values (``causal() & window(l, r) & padding(q_lengths, kv_lengths)``), named
results (:class:`~cudnn_attn.core.types.AttentionOutput`), everything below holds for it too.  Every public function
here is made from its signature in :mod:`cudnn_attn.core.parameters` and runs :func:`forward_call`.

:func:`dot_product_attention` and :func:`paged_attention` keep the signatures, defaults and return
forms of JAX's ``jax._src.cudnn.fused_attention_stablehlo`` (the same as :mod:`cudnn_attn.fronts.cupy` and
:mod:`cudnn_attn.reference`), with keyword-only extensions after them:

* ``diagonal_alignment="top_left" | "bottom_right"``, ``sink`` (float32 ``(N,)`` attention-sink
  logits), ``deterministic`` (deterministic backward accumulation) - as on the CuPy side;
* ``cuda_graph=None`` - XLA may capture the GPU call into its CUDA graphs (command buffers) and replay
  it without running Python (the default, and ``True``); ``False`` runs the Python handler on every
  execution (see :mod:`.cudnn_target`);
* ``check_values=None`` - the checked mode for sequence lengths, offsets and page ids (below).
* ``backend="ffi" | "callback"`` - see :class:`~.call_site.Backend`.

They work under ``jit``, ``grad`` (``jax.custom_vjp``: gradients of ``query``, ``key``, ``value``, of
``bias`` and an additive ``mask``, of ``sink``; with FP8 the backward's amax values come out as the
cotangents of the ``amax_dQ``/``amax_dK``/``amax_dV``/``amax_dP`` entries of ``fp8_params``, as in
JAX), ``vmap``, ``shard_map`` and automatic partitioning (batch and head sharding).  On GPU the cuDNN
graph runs on XLA's stream and buffers; on CPU the NumPy reference runs behind the same primitives.
The cotangent of ``logsumexp`` (``return_residual=True``) is ignored, as in JAX.

``context_parallel=`` (a :class:`~.context_parallel.ContextParallel` or a scheme name, ``"ring"`` or
``"all_gather"``; default: the current :func:`~.context_parallel.context_parallelism` block, else the ring)
says how a call whose sequence is sharded runs: under ``jit`` a query sharded along its sequence
dimension dispatches to it; inside ``shard_map``, ``ContextParallel(axis=...)`` names the sequence axis
and the call takes its local Q/K/V (the bias: local rows, all columns; the lengths: global).

The dropout ``seed`` must be an int in ``[0, 2**63)`` (:func:`cudnn_attn.core.validation.check_seed`, as on
every front): cuDNN binds it by value, so under ``jit`` it is a compile-time constant (a new seed
compiles a new executable); the backward uses the forward's.  :func:`attention`'s ``dropout_rng`` (a PRNG
key, traced under ``jit``) makes the seed an operand that cuDNN reads at launch instead: a new key, a new
mask, in one compiled program (:mod:`.dropout`: what holds under ``vmap`` and sharding).  The CPU reference
draws its dropout mask from NumPy, not from cuDNN's Philox stream.

Values cuDNN reads as positions (:mod:`cudnn_attn.core.values`) never reach it out of range.  Concrete
arrays (eager calls, NumPy inputs) are checked before anything is bound: ``ValueError`` naming the
argument, the row and the value, as the reference raises it.  Traced values are clamped into range by
a few fused XLA operations (documented in :mod:`cudnn_attn.core.values`).  The checked mode
(``check_values=True``, or ``CUDNN_ATTN_CHECK_VALUES=1``) adds a host check of the traced values, a
``jax.debug.callback``: the call then fails at run time with XLA's error, whose message carries the
``ValueError`` (the argument, the row, the value), while the kernel still sees only clamped values.  It
works under ``jit``, ``vmap`` and ``grad`` and costs a device-host copy per call: a debugging mode.  In a
program sharded over several devices the callback runs on one of them, and when it fails, a collective
later in the program waits for that device (measured on 4 CPU devices: XLA aborts the process after
40 s; a result-returning ``pure_callback`` deadlocked even without a later collective): there, debug
with the program on one device.  ``jax.experimental.checkify`` would return the failure as a value
instead, but only inside the caller's own ``checkify.checkify``, so it cannot be the library's default.

Errors, at trace time, of the types the CuPy path raises: ``ValueError`` for invalid arguments
(:func:`cudnn_attn.core.validation.validate_call`, the seed, the options), and
:class:`~cudnn_attn.core.errors.UnsupportedConfigurationError` for calls no backend runs (FP8 with dropout,
a paged backward: :func:`cudnn_attn.core.support.check_everywhere`, before any primitive is bound).  What
depends on the GPU (head dims, cuDNN version, ``score_mod`` translation) is checked when the call is
lowered for it, with the support table's reasons - still before anything runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cudnn_attn.core import diagonal_warning, masked_rows, parameters
from cudnn_attn.core.config import AttentionConfig, AttentionOperands
from cudnn_attn.core.masks import MaskSpec
from cudnn_attn.core.parameters import AuxRequest
from cudnn_attn.core.support import check_everywhere
from cudnn_attn.core.types import FP8_PARAM_KEYS, AttentionOutput, FP8Params, MaskType
from cudnn_attn.core.validation import bind_seed, check_seed, validate_call
from cudnn_attn.engine import call_steps

from . import context_parallel as sequence_split
from . import dropout, primitives
from .call_site import Backend, CallOptions
from .signature import BWD, COTANGENT_OF, FWD, RESIDUALS, operand_names, result_names

__all__ = ["attention", "configured_attention", "dot_product_attention", "call_options", "paged_attention"]


def call_options(config: AttentionConfig, *, seed: Any = 42, backend: str | Backend = Backend.FFI,
                   cuda_graph: bool | None = None, context_parallel: Any = None) -> CallOptions:
    """The static options of a call (checked): the seed only matters with dropout; ``context_parallel``
    (a :class:`~.context_parallel.ContextParallel`, a scheme name, or ``None`` for the current default)."""
    seed = check_seed(seed)
    if cuda_graph is not None and not isinstance(cuda_graph, (bool, np.bool_)):
        raise ValueError(f"cuda_graph: must be None, True or False, got {cuda_graph!r}")
    context = sequence_split.resolve(context_parallel)
    return CallOptions(seed=seed if config.has_dropout else 0, backend=Backend.parse(backend),
                         cuda_graph=True if cuda_graph is None else bool(cuda_graph),
                         context=None if context == sequence_split.ContextParallel() else context)


def _run(kind: str, config: AttentionConfig, options: CallOptions, operands: Mapping[str, Any]) -> dict[str, Any]:
    """The ``kind`` call on ``operands``, padded to even lengths where the kernel needs it
    (:func:`cudnn_attn.engine.call_steps.run_padded`; inside ``shard_map`` with a sequence axis the operands are
    local: the engine lifts its block calls)."""
    run_kernel = functools.partial(_run_kernel, kind, options=options)
    if options.context is not None and options.context.axes:
        return run_kernel(config, operands)
    return call_steps.run_padded(kind, config, operands, jnp, run_kernel)


def _run_kernel(kind: str, config: AttentionConfig, operands: Mapping[str, Any], *,
                options: CallOptions) -> dict[str, Any]:
    """The ``kind`` primitive on ``operands``; inside ``shard_map`` with a sequence axis named by the call's
    ``ContextParallel(axis=...)``, the context-parallel engine over that axis (each block a primitive call)."""
    primitive = primitives.forward if kind == FWD else primitives.backward
    context = options.context
    if context is None or not context.axes:
        return primitive(config, options, operands)
    split = sequence_split.Split(context.axes, sequence_split.axis_size(context.axes), context.load_balance or 0,
                                 context.scheme)
    inner = dataclasses.replace(options, context=None)
    return sequence_split.run(kind, config, split, operands, lambda block, ops: primitive(block, inner, ops))


# -- the differentiable call -------------------------------------------------------------------------

def _inputs(config: AttentionConfig, operands: AttentionOperands) -> dict[str, Any]:
    """Every array the forward or the backward reads, by name (all FP8Params entries with FP8)."""
    inputs = call_steps.named_operands(config, FWD, operands)
    if config.fp8:
        inputs.update({key: operands.fp8_scales[key] for key in FP8_PARAM_KEYS})
    return inputs


def _select(config: AttentionConfig, kind: str, inputs: Mapping[str, Any], **residuals: Any) -> dict[str, Any]:
    return {name: residuals[name] if name in RESIDUALS else inputs[name] for name in operand_names(config, kind)}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attention(config: AttentionConfig, options: CallOptions, inputs: dict[str, Any]) -> dict[str, Any]:
    """The forward's named results; ``inputs`` holds every array of the call (see :func:`_inputs`)."""
    return _run(FWD, config, options, _select(config, FWD, inputs))


def _attention_fwd(config: AttentionConfig, options: CallOptions, inputs: dict[str, Any]) -> tuple[dict, tuple]:
    """The training forward (with the logsumexp); residuals: the inputs, the output, the logsumexp."""
    check_everywhere(config, kind=BWD)                # a paged call has no backward anywhere
    training = config.replace(training=True)
    results = _run(FWD, training, options, _select(training, FWD, inputs))
    primal = {name: results[name] for name in result_names(config, FWD)}
    return primal, (inputs, results["output"], results["logsumexp"])


def _attention_bwd(config: AttentionConfig, options: CallOptions, residuals: tuple, cotangents: dict) -> tuple:
    """One cotangent per input: the gradients and FP8 amax values of :data:`COTANGENT_OF`, ``None`` (zero)
    for the rest (sequence lengths, offsets, scale factors, a boolean mask's bias)."""
    inputs, output, logsumexp = residuals
    training = config.replace(training=True, score_max=False)     # score_max has no gradient: zero
    if config.bias is not None and not (options.context is not None and options.context.axes):
        logsumexp = masked_rows.silent_rows_lse(jnp, config, cotangents["output"], logsumexp)
    grads = _run(BWD, training, options, _select(
        training, BWD, inputs, output=output, grad_output=cotangents["output"], logsumexp=logsumexp))
    found = {}
    for name, x in inputs.items():
        grad = grads.get(COTANGENT_OF.get(name))
        found[name] = None if grad is None else grad.reshape(x.shape).astype(x.dtype)
    return (found,)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _varying_axes(x: Any) -> frozenset:
    """The shard_map manual axes ``x`` varies over (``aval.mat.varying``; a frozenset ``aval.vma`` before
    jax 0.11)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None) or getattr(aval, "vma", None)
    return frozenset(getattr(mat, "varying", mat) or ())


def _align_manual_axes(inputs: dict[str, Any]) -> dict[str, Any]:
    """Inside ``shard_map``, make every operand vary over the same manual axes (``pcast``), so that the
    primitive's results have one consistent type and the gradient of an operand that did not vary is
    summed over those axes by JAX's own transpose of ``pcast``."""
    axes = {name: _varying_axes(x) for name, x in inputs.items()}
    union = frozenset().union(*axes.values())
    if not union:
        return inputs
    return {name: x if axes[name] == union else jax.lax.pcast(x, tuple(sorted(union - axes[name])), to="varying")
            for name, x in inputs.items()}


def _check_at_run_time(check: Callable[..., None], arrays: tuple) -> None:
    """The checked mode's host check of traced values (module doc): a ``jax.debug.callback``."""
    jax.debug.callback(check, *arrays)


def configured_attention(config: AttentionConfig, operands: AttentionOperands, options: CallOptions, *,
                         check_values: bool | None = None, names: Mapping[str, str] | None = None) -> AttentionOutput:
    """Attention on a validated call (:func:`cudnn_attn.core.validation.validate_call` with ``xp=jax.numpy``):
    :class:`~cudnn_attn.core.types.AttentionOutput` out, differentiable with respect to the operands.
    The value operands pass :func:`cudnn_attn.engine.call_steps.guard_values` first (``check_values``, ``names``:
    see there): concrete values are checked now, traced ones clamped (and checked at run time in the checked mode).

    Rows that a boolean mask keeps no key of are set outside the differentiable kernel call
    (:func:`cudnn_attn.core.masked_rows.forward_output`): JAX differentiates the mean of V, and the kernel's
    backward sees dO = 0 on those rows.  (Inside ``shard_map`` with a sequence axis the keys are local, so
    there the kernel's rows are returned as they are.)

    Raises :class:`~cudnn_attn.core.errors.UnsupportedConfigurationError` at once for what no backend runs."""
    check_everywhere(config, kind=FWD)
    operands = call_steps.guard_values(config, operands, jnp, check_values, names, check_later=_check_at_run_time)
    operands = call_steps.dense_bias(operands, jnp)
    results = dict(_attention(config, options, _align_manual_axes(_inputs(config, operands))))
    if options.context is None or not options.context.axes:
        results["output"], results["logsumexp"] = masked_rows.forward_output(
            jnp, config, operands, results["output"], results.get("logsumexp"))
        results["score_max"] = masked_rows.masked_score_max(jnp, config, operands, results.get("score_max"))
    if config.score_max:                 # no gradient flows into either (the VJP reads dO alone)
        results["score_max"] = jax.lax.stop_gradient(results["score_max"])
        results["max_logit"] = masked_rows.max_logit(jnp, results["score_max"])
        if options.context is not None and options.context.axes:     # local rows: the max across the ring
            results["max_logit"] = jax.lax.pmax(results["max_logit"], options.context.axes)
    return AttentionOutput(**{name: results.get(name) for name in AttentionOutput._fields})


# -- the public functions (signatures: cudnn_attn.core.parameters) ---------------------------------------

def forward_call(call: Any, names: Mapping[str, str] | None = None) -> AttentionOutput:
    """A seed or native call's forward: validated, configured, run.  ``names`` renames arguments in the
    messages (the ``jax.nn`` drop-in's; default: the native API's names for a native call)."""
    arrays, static = parameters.arguments(call)
    sequence_parallel = "context_parallel" in call._fields
    context = sequence_split.resolve(getattr(call, "context_parallel", None))
    if sequence_parallel:
        arrays["key"], arrays["value"] = sequence_split.whole_sequence(context, call.key, call.value,
                                                                       static["qkv_layout"])
    inside = sequence_parallel and bool(context.axes)   # inside shard_map: the call describes the whole sequence
    # There the local queries are validated against the whole sequence's keys: the diagonal's warning waits for
    # the whole call.
    with diagonal_warning.deferred() if inside else contextlib.nullcontext():
        with parameters.native_names(call, names):
            config, operands = validate_call(**arrays, **static, xp=jnp)
        config = parameters.finish(call, config)
    if inside:
        config = sequence_split.whole_config(config, context)
        diagonal_warning.warn_top_left(config)
        operands = operands.replace(key=call.key, value=call.value)
    rng = getattr(call, "dropout_rng", None)        # a key: the seed as operands read at launch, not a constant
    config, operands, seed = bind_seed(config, operands, call.seed if rng is None else dropout.seed_operands(rng))
    options = call_options(config, seed=seed, backend=call.backend, cuda_graph=call.cuda_graph,
                           context_parallel=context if sequence_parallel else None)
    return configured_attention(config, operands, options, check_values=call.check_values, names=names)


@parameters.front(parameters.NATIVE, "deterministic", "cuda_graph", "backend", "context_parallel", "check_values",
                  "dropout_rng")
def attention(query: Any, key: Any, value: Any, *, mask: MaskSpec | None = None, bias: Any = None,
              scale: float | None = None, dropout_rate: float = 0.0, seed: int = 42, layout: str = "BTNH",
              sink: Any = None, fp8_params: FP8Params | None = None, return_aux: AuxRequest | None = None,
              deterministic: bool = False, cuda_graph: bool | None = None, backend: str = "ffi",
              context_parallel: Any = None, check_values: bool | None = None,
              dropout_rng: Any = None) -> AttentionOutput:
    """Scaled dot-product attention with named results (the native API; :func:`cudnn_attn.attention` on JAX
    arrays), differentiable, under ``jit``, ``vmap`` and sharding like :func:`dot_product_attention`.

    ``mask`` is a :class:`~cudnn_attn.core.masks.MaskSpec` (``causal()``, ``window(left, right)``,
    ``padding(q_lengths, kv_lengths)``, ``segments(...)``, ``alibi()``, ``keep(array)``, combined with ``&``);
    ``scale=None`` is ``1/sqrt(H)``; ``fp8_params`` runs FP8.  Returns
    :class:`~cudnn_attn.core.types.AttentionOutput`: ``output``, ``logsumexp`` with
    ``return_aux=AuxRequest(logsumexp=True)`` (else ``None``), ``score_max`` and ``max_logit`` with
    ``AuxRequest(max_logit=True)`` (no gradient), ``amax_s``/``amax_o`` with FP8.

    ``dropout_rng`` (a JAX PRNG key, traced or not) replaces the static ``seed``: cuDNN reads the seed from the
    device at launch, so a compiled step draws a new mask for every new key (:mod:`.dropout`).
    """
    call = attention.arguments(query, key, value, mask, bias, scale, dropout_rate, seed, layout, sink, fp8_params,
                               return_aux, deterministic, cuda_graph, backend, context_parallel, check_values,
                               dropout_rng)
    return forward_call(call)


@parameters.front(parameters.FORWARD, "deterministic", "cuda_graph", "backend", "context_parallel", "check_values")
def dot_product_attention(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, q_seqlen: Any = None,
                          kv_seqlen: Any = None, q_offsets: Any = None, kv_offsets: Any = None,
                          fp8_params: FP8Params | None = None, score_mod_args: Sequence[Any] = (), *,
                          scale: float | None = 1.0, mask_type: MaskType = MaskType.NO_MASK, seed: int = 42,
                          dropout_rate: float = 0.0, qkv_layout: str = "BTNH",
                          sliding_window_length: int | None = None, score_mod: Callable[..., Any] | None = None,
                          use_fp8: bool = False, return_residual: bool = False, diagonal_alignment: str = "top_left",
                          sink: Any = None, deterministic: bool = False, cuda_graph: bool | None = None,
                          backend: str = "ffi", context_parallel: Any = None,
                          check_values: bool | None = None) -> Any:
    """Scaled dot-product attention (JAX's cuDNN ``dot_product_attention``; module doc for the extras).

    Shapes: Q ``(B, T, N, H)`` / K, V ``(B, S, K, H)`` in BTNH (``(B, N, T, H)`` in BNTH); ``bias`` and
    ``mask`` broadcast to ``(B, N, T, S)`` (``mask`` True keeps); ``q_seqlen``/``kv_seqlen`` int32
    ``(B,)``, or ``(B, M)`` with packed segments given by ``q_offsets``/``kv_offsets`` ``(B, M + 1)``.

    Returns the output (the query's layout, ``value``'s head dim), ``(output, logsumexp)`` with
    ``return_residual`` (float32 ``(B, N, T)``, ``(B*M, N, T)`` packed), or ``(output, amax_s, amax_o)``
    with ``use_fp8``.
    """
    call = dot_product_attention.arguments(query, key, value, bias, mask, q_seqlen, kv_seqlen, q_offsets, kv_offsets,
                                           fp8_params, score_mod_args, scale, mask_type, seed, dropout_rate,
                                           qkv_layout, sliding_window_length, score_mod, use_fp8, return_residual,
                                           diagonal_alignment, sink, deterministic, cuda_graph, backend,
                                           context_parallel, check_values)
    return forward_call(call).seed_form(call.use_fp8, call.return_residual)


@parameters.front(parameters.PAGED, "cuda_graph", "backend", "check_values")
def paged_attention(query: Any, key: Any, value: Any, q_seqlen: Any, kv_seqlen: Any, page_table_k: Any,
                    page_table_v: Any, bias: Any = None, mask: Any = None, fp8_params: FP8Params | None = None, *,
                    scale: float | None = 1.0, mask_type: MaskType = MaskType.NO_MASK, seed: int = 42,
                    dropout_rate: float = 0.0, qkv_layout: str = "BTNH", sliding_window_length: int | None = None,
                    use_fp8: bool = False, return_residual: bool = False, diagonal_alignment: str = "top_left",
                    sink: Any = None, cuda_graph: bool | None = None, backend: str = "ffi",
                    check_values: bool | None = None) -> Any:
    """Attention over paged K/V caches (forward only; JAX's cuDNN ``paged_attention``).

    K/V are caches of blocks ``(num_blocks, block_size, K, H)`` (BTNH) or ``(num_blocks, K, block_size, H)``
    (BNTH); ``page_table_k``/``page_table_v`` int32 ``(B, 1, blocks_per_seq, 1)`` map each sequence's
    logical blocks to cache blocks.  Returns the output, or ``(output, logsumexp)`` with ``return_residual``.
    Differentiating it raises :class:`~cudnn_attn.core.errors.UnsupportedConfigurationError`.
    """
    call = paged_attention.arguments(query, key, value, q_seqlen, kv_seqlen, page_table_k, page_table_v, bias, mask,
                                     fp8_params, scale, mask_type, seed, dropout_rate, qkv_layout,
                                     sliding_window_length, use_fp8, return_residual, diagonal_alignment, sink,
                                     cuda_graph, backend, check_values)
    return forward_call(call).seed_form(call.use_fp8, call.return_residual)
