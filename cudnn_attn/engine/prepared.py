"""The prepared call: one (configuration, forward/backward, device), ready to run - the one owner of a call's
execution on GPU arrays.

A :class:`PreparedCall` is what a front holds for a call it has seen: the CuPy front (:mod:`cudnn_attn.fronts.cupy`)
keeps one per repeated call in :data:`calls`, :func:`forward` / :func:`backward` make one for a prepared
``(AttentionConfig, AttentionOperands)``, and the JAX GPU target launches the plans of its call sites through the
same :class:`~cudnn_attn.engine.plan.CallPlan` sequence.  It owns, once:

* the operands and results of the call (:class:`~cudnn_attn.engine.call.CallSpec`: names, shapes, dtypes, the
  zero-fill policy) and their binding to graph tensors, packed segments included;
* the steps every front shares (:mod:`cudnn_attn.engine.call_steps`): value guards (lengths, offsets and page
  ids clamped on the device, or checked on the host in the checked mode) and internal padding for odd lengths
  (the call runs padded and is sliced back);
* zero-fill before and after the launch, and the single locked launch and replay sequence
  (:meth:`~cudnn_attn.engine.plan.CallPlan.sequence`);
* the plan, found in (or built into) the graph cache and held weakly, so that evicting it frees it;
* for calls of Q/K/V alone (and the backward's residuals), the direct launch: results allocated as views of one
  allocation (or handed back by :mod:`cudnn_attn.engine.result_blocks`), one launch.

The identity of a repeated call is :func:`call_key`: the kind, each array's descriptor (its type, shape, dtype,
strides and device: :func:`descriptor` for CuPy, the torch front's for tensors) and the front's static arguments.
The CuPy front and the torch front remember their calls under it in one bounded table, :data:`calls` (the
descriptor's array type keeps the fronts' entries apart); the validation memo (:func:`validated`) is its own
table, :data:`validations`.

Results the fill policy covers come back as zeros: rows ``t >= q_seqlen[b]`` of the output / logsumexp / dq,
keys ``s >= kv_seqlen[b]`` of dk / dv, tokens outside every packed segment.
"""

from __future__ import annotations

import functools
import operator
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from cudnn_attn.core import masked_rows, settings, values
from cudnn_attn.core.config import AttentionConfig, AttentionOperands
from cudnn_attn.core.padded_call import lifted_config
from cudnn_attn.core.types import FP8_PARAM_KEYS, AttentionGrads, AttentionOutput
from cudnn_attn.core.validation import validate_call

from . import call_steps, runtime
from .autotune import tuned_plan
from .cache import PlanChoice, graph_cache
from cudnn_attn.graphs.tensors import TensorId

from .call import BWD, FWD, OPERAND_IDS, CallSpec, Fill
from .result_blocks import result_blocks

_ALIGNMENT = 256                        # bytes between the results of one allocation (cuDNN asks for 16)
_AS_GIVEN = frozenset({TensorId.Q, TensorId.K, TensorId.V})


def plan_choice(autotune: bool | None) -> PlanChoice:
    """``autotune`` (``None``: :attr:`cudnn_attn.core.settings.Settings.autotune`) as the graph cache's plan choice."""
    if autotune is None:
        autotune = settings.current.autotune
    elif not isinstance(autotune, (bool, np.bool_)):
        raise ValueError(f"autotune: must be True, False or None (then ${settings.AUTOTUNE} decides), "
                         f"got {autotune!r}")
    return PlanChoice.AUTOTUNED if autotune else PlanChoice.HEURISTIC


def plan_for(config: AttentionConfig, kind: str, device: int, autotune: bool | None = None,
             rng_dump: bool = False, tune_on: Any = None) -> Any:
    """The :class:`~cudnn_attn.engine.plan.CallPlan` of a call (built on a miss).  ``tune_on`` is a callable
    ``(candidate plan) -> launch arguments`` for autotuning on the call's own buffers."""
    choice = plan_choice(autotune)
    key = graph_cache.key(config, kind, device, plan=choice, rng_dump=rng_dump)
    if choice is PlanChoice.HEURISTIC:
        return graph_cache.entry(key).plan
    return graph_cache.entry(key, lambda key: tuned_plan(key, tune_on)).plan


@functools.cache
def buffer_dtype(dtype: np.dtype) -> np.dtype:
    """The CuPy dtype of a buffer of ``dtype``: FP8 values travel as their bytes (CuPy has no float8).  Cached:
    NumPy 2.5 takes about 0.1 ms for ``.name`` of an ml_dtypes float8 dtype on the GPU machine (cProfile), and
    an FP8 call asks for three results."""
    return np.dtype(np.uint8) if dtype.name.startswith("float8") else dtype


class PreparedCall:
    """``config``'s ``kind`` call on CUDA ``device`` (see the module doc).

    Args:
        config: the call's configuration (as the caller sees it; a padded run is internal).
        kind: ``"fwd"`` or ``"bwd"``.
        device: the CUDA ordinal.
        autotune: the plan choice (``None``: the settings' default).
    """

    __slots__ = ("config", "kind", "device", "autotune", "spec", "padded", "dropout", "training", "_plan",
                 "_layout", "_nbytes", "_sequences", "__weakref__")

    def __init__(self, config: AttentionConfig, kind: str, device: int, *, autotune: bool | None = None):
        plan_choice(autotune)                              # a bad value fails here, named
        self.config, self.kind, self.device, self.autotune = config, kind, device, autotune
        self.spec = CallSpec.of(config, kind)
        self.padded = lifted_config(config)
        self.dropout = config.has_dropout and not config.device_seed     # a static seed, bound on the host
        self.training = config.training
        self._plan: Any = None
        self._layout: tuple = ()
        self._nbytes = 0
        self._sequences: list = [None, None]    # :meth:`launch_into`'s, by ``replay``: weak references

    def plan(self) -> Any:
        """The :class:`~cudnn_attn.engine.plan.CallPlan` (from the graph cache, built on a miss; held weakly)."""
        plan = self._plan() if self._plan is not None else None
        if plan is None:
            plan = plan_for(self.padded or self.config, self.kind, self.device, self.autotune)
            self._plan = weakref.ref(plan)
            layout, offset = [], 0
            for spec in plan.results:
                layout.append((spec.shape, buffer_dtype(spec.dtype), offset))
                offset += -(-spec.nbytes // _ALIGNMENT) * _ALIGNMENT
            self._layout, self._nbytes = tuple(layout), offset
        return plan

    def __repr__(self) -> str:
        return f"PreparedCall({self.kind} {self.config.describe()} on GPU {self.device})"

    # -- the general call ----------------------------------------------------------------------------------
    def run(self, named: Mapping[str, Any], *, seed: int = 42, stream: Any = None,
            given: Mapping[str, Any] | None = None, check_values: bool | None = None,
            rng_dump: Any = None) -> dict[str, Any]:
        """One call on CuPy arrays: the results by name (:attr:`CallSpec.results`).

        ``named`` maps the spec's operand names to CuPy arrays on :attr:`device` (``score_mod_arg_<i>`` may be
        host scalars, bound by value); ``stream`` is where to run (``None``: the current CuPy stream); ``given``
        optional preallocated results by name; ``rng_dump`` (tests) a float32 ``(B*M, N, T, S)`` buffer that
        receives cuDNN's dropout keep-mask; ``check_values`` the checked mode for lengths, offsets and page ids.
        """
        cupy = runtime.cupy()
        given = given or {}
        with runtime.on_device(self.device), runtime.stream_scope(stream, self.device) as stream_ptr:
            operands, _ = call_steps.attention_operands(self.config, self.kind, named)
            guarded = call_steps.guard_values(self.config, operands, cupy, check_values)
            if guarded is not operands:                    # clamped lengths, offsets, page ids
                named = {**named, **values.present(guarded)}
            if self.padded is not None:
                if rng_dump is not None:
                    raise ValueError("rng_dump: a call that runs padded (odd lengths with a bias, or T = S = 1 "
                                     "in the backward) has no keep-mask of its own lengths")
                def launch(config: AttentionConfig, arrays: Mapping[str, Any]) -> dict[str, Any]:
                    return self._launch(cupy, CallSpec.of(config, self.kind), arrays, seed, stream_ptr, {}, None)

                results = call_steps.run_padded(self.kind, self.config, named, cupy, launch)
                return _into(cupy, results, given)
            return self._launch(cupy, self.spec, named, seed, stream_ptr, given, rng_dump)

    def _launch(self, cupy: Any, spec: CallSpec, named: Mapping[str, Any], seed: int, stream_ptr: int,
                given: Mapping[str, Any], rng_dump: Any) -> dict[str, Any]:
        inputs, segments = spec.bind(cupy, named)
        # Computed inputs (packed offsets, token-major statistics) are made dense and kept alive until the launch is
        # queued (their memory returns to CuPy's pool in this stream's order); Q, K and V go as they are: a view
        # cuDNN reads with its own strides (AttentionConfig.strides) must not be copied.
        inputs = {t: x if t in _AS_GIVEN else cupy.ascontiguousarray(x) for t, x in inputs.items()}
        given = dict(given, rng_dump=rng_dump) if rng_dump is not None else given
        scalars = spec.host_scalars(seed, [_host_float(named[n]) for n in spec.operands
                                           if n.startswith("score_mod_arg_")])

        def operands_of(plan: Any) -> tuple[list[int], dict[str, Any]]:
            results = {r.name: _result(cupy, r, given.get(r.name)) for r in plan.results}
            return [inputs[t].data.ptr for t in plan.operand_ids] + \
                [results[r.name].data.ptr for r in plan.results], results

        plan = plan_for(spec.config, self.kind, self.device, self.autotune, rng_dump is not None,
                        tune_on=lambda candidate: (operands_of(candidate)[0], stream_ptr, scalars))
        pointers, buffers = operands_of(plan)
        plan.launch(pointers, stream_ptr, scalars=scalars)
        results = spec.finish(cupy, buffers, named, segments)
        for r in plan.results:
            if r.name not in results or results[r.name] is buffers[r.name]:
                continue
            target = buffers[r.name] if r.fill is not Fill.SEGMENTS else given.get(r.name)
            if target is not None:                           # into the caller's (or the launch's) buffer
                _check_given(r.name, target, results[r.name].shape, results[r.name].dtype)
                target[...] = results[r.name]
                results[r.name] = target
        for name, target in given.items():                   # computed after the launch (a score_max call's
            if target is not None and name in results and name not in buffers:      # logsumexp)
                _check_given(name, target, results[name].shape, results[name].dtype)
                target[...] = results[name]
                results[name] = target
        return results

    # -- the direct launch of Q/K/V calls --------------------------------------------------------------------
    def direct(self, pointers: list[int], seed: int, out: Any = None) -> list[Any]:
        """The call of Q/K/V alone (or the backward's residuals besides): ``pointers`` are the operand
        addresses in the plan's order (:func:`direct_order`); returns the results in the plan's order,
        allocated on the current device and stream (see the module doc), ``out`` the output when given."""
        cupy = runtime.cupy()
        plan = self._plan() if self._plan is not None else None
        if plan is None:
            plan = self.plan()
        stream = cupy.cuda.get_current_stream().ptr
        if out is None:
            results = result_blocks.results(self, stream, self._nbytes, self._new_results)
        else:
            shape, dtype, _ = self._layout[0]
            if type(out) is not cupy.ndarray or out.shape != shape or out.dtype != dtype \
                    or not out.flags.c_contiguous or out.data.device_id != self.device:
                raise ValueError(f"out: must be a C-contiguous CuPy array {dtype}{list(shape)} on GPU {self.device}, "
                                 f"got {type(out).__name__}" + (f" {out.dtype}{list(out.shape)}"
                                                               if hasattr(out, "shape") else ""))
            results = [out] + [cupy.empty(shape, dtype) for shape, dtype, _ in self._layout[1:]]
        pointers += [r.data.ptr for r in results]
        plan.launch(pointers, stream, None, (seed, 0) if self.dropout else ())
        return results

    def result_layout(self) -> tuple[tuple[tuple, np.dtype], ...]:
        """``(shape, dtype)`` of each result of the direct launch, in the plan's order (dense buffers)."""
        self.plan()
        return tuple((shape, dtype) for shape, dtype, _ in self._layout)

    def launch_into(self, pointers: list[int], stream: int, seed: int, *, replay: bool = True,
                    workspace: int | None = None) -> None:
        """The direct launch into results the caller allocated: ``pointers`` are the operand addresses in the
        plan's order (:meth:`direct_order`) followed by those of dense buffers of :meth:`result_layout`, all on
        this call's device, which must be current; ``stream`` is a ``cudaStream_t``; ``replay=False`` never
        replays (:meth:`~cudnn_attn.engine.plan.CallPlan.sequence`); ``workspace`` the address of at least
        :attr:`workspace_size` bytes ordered on ``stream`` (``None``: the device context's).  For a front whose
        framework allocates its own results and workspace (torch's caching allocator: :mod:`cudnn_attn.torch.ops`)."""
        # Through CallPlan.launch this call took 11.7 us of host time, the sequence alone 8.6 (H200).
        self.sequence(replay)(pointers, stream, workspace, True, (seed, 0) if self.dropout else ())

    def sequence(self, replay: bool = True) -> Callable[..., None]:
        """The launch sequence :meth:`launch_into` runs: ``run(pointers, stream, workspace, True, scalars)`` (the
        plan's own sequence, :meth:`~cudnn_attn.engine.plan.CallPlan.own_sequence`; ``scalars`` ``(seed, 0)`` for a
        dropout call, else ``()``).  It lives as long as the plan, which this call holds weakly, and so does this
        call's reference to it: while the plan lives every call returns the same sequence, and after an eviction the
        next call makes the plan and its sequence again.  A front that launches by itself (the torch front's
        launcher) asks for it at each launch rather than holding it."""
        held = self._sequences[replay]
        run = held() if held is not None else None
        if run is None:
            run = self.plan().own_sequence(replay=replay)
            self._sequences[replay] = weakref.ref(run)
        return run

    @property
    def workspace_size(self) -> int:
        """The bytes of workspace a launch of this call needs (its plan's)."""
        return self.plan().workspace_size

    def _new_results(self) -> list[Any]:
        """The results as views of one allocation from CuPy's pool, 256-byte aligned: one pool allocation costs
        about as much as one ``cupy.empty`` (the pool's lock and free-list search dominate), a view only the
        array object."""
        ndarray = runtime.cupy().ndarray
        if len(self._layout) == 1:
            shape, dtype, _ = self._layout[0]
            return [ndarray(shape, dtype)]
        memory = runtime.cupy().cuda.alloc(self._nbytes)
        return [ndarray(shape, dtype, memory + offset if offset else memory) for shape, dtype, offset in self._layout]

    def direct_order(self, names: Sequence[str]) -> Callable[[Sequence[Any]], tuple]:
        """A function that puts arrays given in the order of ``names`` into the plan's operand order."""
        position = {OPERAND_IDS[name]: i for i, name in enumerate(names)}
        return operator.itemgetter(*(position[t] for t in self.plan().operand_ids))

    @property
    def direct_capable(self) -> bool:
        """Whether the direct launch serves this call: no padding mask, packing, FP8, score_mod or padded run (those
        bind more than the arrays and a seed), and no query row that can be left without keys (its logsumexp is
        set after the launch)."""
        config = self.config
        return not (config.packing is not None or config.fp8 or config.score_mod is not None or config.mask.padding
                    or self.padded is not None or masked_rows.may_leave_rows_without_keys(config))


@functools.lru_cache(maxsize=1024)
def prepared_call(config: AttentionConfig, kind: str, device: int, autotune: bool | None = None) -> PreparedCall:
    """The :class:`PreparedCall` of ``config``'s ``kind`` call on ``device`` (one per process, for the 1024 most
    recently used; a prepared call holds its plan weakly, so this keeps no graph alive)."""
    return PreparedCall(config, kind, device, autotune=autotune)


# -- the identity of repeated calls --------------------------------------------------------------------------

def call_key(kind: str, arrays: Sequence[Any], static: Any,
             describe: Callable[[Any], tuple] | None = None) -> tuple:
    """The identity of a repeated call of ``arrays`` (``None`` where one is absent) with the front's ``static``
    arguments: ``(kind, describe(x) for each array, static)``, ``describe`` defaulting to :func:`descriptor`."""
    describe = descriptor if describe is None else describe
    return (kind, *[None if x is None else describe(x) for x in arrays], static)


class Known(NamedTuple):
    """A call seen before: its configuration, the names of the operands it passes through unchanged (the arrays
    of a new call with the same key replace them), and its prepared call for the direct launch (``None`` when
    the call needs more than its arrays: a folded mask, FP8 scales, score_mod values)."""

    config: AttentionConfig
    kept: frozenset
    prepared: PreparedCall | None = None
    order: Callable[[Sequence[Any]], tuple] | None = None


class Calls:
    """A bounded, thread-safe table of calls seen before (:class:`Known` entries, or a front's own), least recently
    added first out."""

    def __init__(self, maxsize: int = 1024):
        self._maxsize = maxsize
        self._known: OrderedDict[tuple, Known] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> Known | None:
        """The known call of ``key`` (``None``: not seen, or ``key`` holds an unhashable argument)."""
        try:
            return self._known.get(key)
        except TypeError:
            return None

    def remember(self, key: tuple, known: Known) -> None:
        try:
            hash(key)
        except TypeError:
            return
        with self._lock:
            self._known[key] = known
            while len(self._known) > self._maxsize:
                self._known.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._known.clear()

    def items(self) -> list[tuple[tuple, Any]]:
        """The ``(key, entry)`` pairs remembered, oldest first (a copy)."""
        with self._lock:
            return list(self._known.items())

    def direct_launches(self) -> list[PreparedCall]:
        """The prepared calls of the direct launches remembered (oldest first): the entries with a launch order."""
        return [known.prepared for known in list(self._known.values()) if getattr(known, "order", None) is not None]

    def __len__(self) -> int:
        return len(self._known)


calls = Calls()
"""The repeated calls of the CuPy front and the torch front, by :func:`call_key` (see the module doc)."""

validations = Calls()
"""The validation memo of :func:`validated`: a signature's configuration, by its arrays' descriptors and static
arguments."""


def validated(arrays: Mapping[str, Any], static: Mapping[str, Any], *, xp: Any = None,
              table: Calls | None = None) -> tuple[AttentionConfig, AttentionOperands]:
    """:func:`~cudnn_attn.core.validation.validate_call` of a call, reused for a repeated signature (the shape,
    dtype and strides of every array, the FP8 scales among them, and every static argument) from ``table``
    (default :data:`validations`).

    ``validate_call`` reads nothing but shapes, dtypes and the static arguments, so its verdict and its
    configuration hold for every call with the same signature.  When it passed the arrays through unchanged (no
    mask folded into the bias, no score_mod arguments), a repeated signature reuses the configuration object and
    only rebinds the new arrays.  FP8 calls take the memo too: their validation checks 20 scale arrays, about
    0.4 ms of host time on the GPU machine, against a bf16 call's 15 us in all."""
    table = validations if table is None else table
    key = None
    scales = _scale_signature(arrays.get("fp8_params"))
    if arrays.get("mask") is None and scales is not None and not arrays.get("score_mod_args"):
        key = ("validated", tuple(None if arrays.get(n) is None else
                                  (arrays[n].shape, arrays[n].dtype, getattr(arrays[n], "strides", None))
                                  for n in OPERAND_FIELDS), scales, tuple(static.items()))
        known = table.get(key)
        if known is not None:
            fp8 = arrays.get("fp8_params")
            return known.config, AttentionOperands(
                **{n: arrays[n] for n in known.kept},
                fp8_scales=None if not fp8 or not known.config.fp8 else {n: fp8[n] for n in FP8_PARAM_KEYS})
    config, operands = validate_call(**arrays, **static, xp=xp)
    kept = frozenset(n for n in OPERAND_FIELDS if getattr(operands, n) is not None)
    unchanged = all(getattr(operands, n) is arrays.get(n) for n in kept) and (
        operands.fp8_scales is None or all(x is arrays["fp8_params"][n] for n, x in operands.fp8_scales.items()))
    if key is not None and unchanged:
        table.remember(key, Known(config, kept))
    return config, operands


def descriptor(x: Any) -> tuple:
    """What a repeated call's identity reads of an array: its type, shape, dtype, strides and device."""
    return type(x), x.shape, x.dtype, x.strides, x.data.device_id


def _scale_signature(fp8_params: Any) -> tuple | None:
    """The descriptors of the FP8 scales (``()`` without them), or ``None`` when the validation memo cannot key
    them (not a mapping of arrays with every FP8Params entry: validation explains)."""
    if not fp8_params:
        return ()
    if not isinstance(fp8_params, Mapping) or not all(hasattr(fp8_params.get(n), "shape") for n in FP8_PARAM_KEYS):
        return None
    return tuple((fp8_params[n].shape, fp8_params[n].dtype, getattr(fp8_params[n], "strides", None))
                 for n in FP8_PARAM_KEYS)


# -- on a prepared (AttentionConfig, AttentionOperands) ---------------------------------------------------------

OPERAND_FIELDS = ("query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets",
                  "page_table_k", "page_table_v", "sink")


def forward(config: AttentionConfig, operands: AttentionOperands, *, seed: int = 42, stream: Any = None,
            autotune: bool | None = None, output: Any = None, logsumexp: Any = None,
            rng_dump: Any = None, check_values: bool | None = None) -> AttentionOutput:
    """cuDNN attention forward on CuPy ``operands`` (see the module doc).

    ``output`` / ``logsumexp`` are optional preallocated results (``config.o_shape`` in the io dtype;
    float32 ``config.lse_shape``, only with ``config.training``).  ``rng_dump`` (debug/tests) is a
    float32 ``(B*M, N, T, S)`` buffer that receives cuDNN's dropout keep-mask.  ``check_values``: the
    checked mode for lengths, offsets and page ids.
    """
    plan_choice(autotune)                                  # a bad value fails here, named
    if logsumexp is not None and not config.training:
        raise ValueError("logsumexp: only produced when training (return_residual=True)")
    device = operands.query.device.id
    results = prepared_call(config, FWD, device, autotune).run(
        call_steps.named_operands(config, FWD, operands), seed=seed, stream=stream,
        given=dict(output=output, logsumexp=logsumexp), check_values=check_values, rng_dump=rng_dump)
    result = AttentionOutput(**{name: results.get(name) for name in AttentionOutput._fields})
    if operands.keep_mask is not None or config.score_max:     # rows without keys (core.masked_rows)
        with runtime.on_device(device), runtime.stream_scope(stream, device):
            cupy = runtime.cupy()
            if operands.keep_mask is not None:
                masked_rows.set_forward(cupy, config, operands, result.output, result.logsumexp)
            if config.score_max:
                score_max = masked_rows.masked_score_max(cupy, config, operands, result.score_max)
                result = result._replace(score_max=score_max, max_logit=masked_rows.max_logit(cupy, score_max))
    return result


def backward(config: AttentionConfig, operands: AttentionOperands, output: Any, grad_output: Any,
             logsumexp: Any, *, seed: int = 42, stream: Any = None, autotune: bool | None = None,
             dq: Any = None, dk: Any = None, dv: Any = None, dbias: Any = None, dsink: Any = None,
             rng_dump: Any = None, check_values: bool | None = None) -> AttentionGrads:
    """cuDNN attention backward on CuPy arrays; ``seed`` must be the forward's (same dropout mask).

    ``output``/``logsumexp`` are the forward's results, ``grad_output`` the gradient of ``output``.
    ``dq``/``dk``/``dv``/``dbias``/``dsink`` are optional preallocated results.  ``dbias`` is returned
    when the bias is differentiable, ``dsink`` with a sink.
    """
    plan_choice(autotune)                                  # a bad value fails here, named
    device = operands.query.device.id
    caller_grad_output = grad_output
    if operands.keep_mask is not None:               # the kernel sees dO = 0 on rows the mask keeps no key of
        with runtime.on_device(device), runtime.stream_scope(stream, device):
            grad_output, logsumexp = masked_rows.backward_residuals(runtime.cupy(), config, operands, grad_output,
                                                                    logsumexp)
    named = call_steps.named_operands(config, BWD, operands,
                                      dict(output=output, grad_output=grad_output, logsumexp=logsumexp))
    results = prepared_call(config, BWD, device, autotune).run(
        named, seed=seed, stream=stream, given=dict(dq=dq, dk=dk, dv=dv, dbias=dbias, dsink=dsink),
        check_values=check_values, rng_dump=rng_dump)
    grads = AttentionGrads(**{name: results.get(name) for name in AttentionGrads._fields})
    if operands.keep_mask is not None:
        with runtime.on_device(device), runtime.stream_scope(stream, device):
            masked_rows.add_dv(runtime.cupy(), config, operands, caller_grad_output, grads.dv)
    return grads


# -- buffers ------------------------------------------------------------------------------------------------

def _result(cupy: Any, spec: Any, given: Any) -> Any:
    """A result buffer: ``given`` (checked) or a new one on the current stream."""
    dtype = buffer_dtype(spec.dtype)
    if given is None or spec.fill is Fill.SEGMENTS:       # packed statistics: a token-major buffer of ours
        return cupy.empty(spec.shape, dtype)
    _check_given(spec.name, given, spec.shape, dtype)
    return given


def _check_given(name: str, given: Any, shape: tuple, dtype: Any) -> None:
    if tuple(given.shape) != tuple(shape) or given.dtype != np.dtype(dtype) or not given.flags.c_contiguous:
        raise ValueError(f"{name}: a preallocated result must be a C-contiguous {np.dtype(dtype).name}"
                         f"{list(shape)}, got {given.dtype}{list(given.shape)}")


def _into(cupy: Any, results: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """``results`` with their sliced (non-contiguous) members made contiguous, or copied into the given buffers."""
    found = {}
    for name, x in results.items():
        target = given.get(name)
        if x is not None and target is not None:
            _check_given(name, target, x.shape, x.dtype)
            target[...] = x
            x = target
        found[name] = None if x is None else cupy.ascontiguousarray(x)
    return found


def _host_float(x: Any) -> float:
    """A score_mod argument's value for by-value binding (a device scalar is read back: one sync)."""
    return float(x.get() if hasattr(x, "get") else x)
