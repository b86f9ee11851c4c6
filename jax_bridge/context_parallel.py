"""Context parallelism: attention with the query/key sequence split over a mesh axis.

Each device holds ``T / P`` queries and ``S / P`` keys (``P`` devices on the sequence axes).  Two schemes,
both built from JAX collectives and the per-block kernel calls of the attention primitives:

* ``Scheme.RING`` (default): at step ``s`` every device attends its queries to the K/V block of the
  device ``s`` places before it, piece by piece: each device cuts its queries and the keys it holds into
  ``pieces`` (:class:`ContextParallel`), and piece ``j`` comes straight from the block's owner
  (``lax.ppermute`` by ``s``; the next piece travels while the current one is computed).  Partial outputs
  are merged with their logsumexps (``o = sum_b exp(lse_b - lse) o_b``, ``lse = logsumexp_b lse_b``).  The
  backward sweeps again: each block's kernel backward with the *final* output and logsumexp gives exact
  partial gradients (``P = exp(s - lse)``, ``D = rowsum(dO * O)``); dQ accumulates locally, and the partial
  dK/dV of a piece go back to its owner and accumulate there.  Memory: O, dQ, dK and dV accumulate in the
  operands' dtype in the buffers they are returned in (each piece's sum is float32, rounded once when
  added); besides its arguments and results a device holds about two pieces of K/V and one piece's
  partial results (``lax.optimization_barrier`` keeps XLA from starting every piece at once).  With 2
  devices the training step holds 0.59x one device's memory per device, 0.30x with 4 (README).
* ``Scheme.ALL_GATHER``: K/V are gathered once (``lax.all_gather``), every device attends its queries to
  the keys its mask needs in one call per query chunk; the backward reduces the dK/dV of the gathered
  keys back to their owners (``lax.psum_scatter``).  Memory: the whole K/V on every device.

Masks (:mod:`.sequence_plan`): every call is a block of global positions with a top-left band of cuDNN
(``right_bound``/``left_bound``, after slicing the block to the rows and keys that the mask keeps), so
causal (top-left, or bottom-right without per-sequence lengths), windows, per-sequence lengths
(``q_seqlen``/``kv_seqlen`` give each call its own lengths), a bias (each device holds its rows and
every column), GQA, MLA and an attention sink (the blocks run without it; it joins the merged denominator
once, and each device's share of its gradient is summed over the sequence axes) work in both schemes.  A
block that the mask removes entirely is not
computed: the devices take different branches (``lax.switch`` on the device's index into the distinct
plans of the step).  Refused (:class:`~cudnn_attn.core.errors.UnsupportedConfigurationError`), each by
one row of ``cudnn_attn.core.support.CONTEXT_PARALLEL_RESTRICTIONS`` with its reason: dropout, ALiBi, FP8,
``score_mod``, packed segments in a window or an off-diagonal band, paged caches, and a bottom-right
diagonal with per-sequence lengths.

Packed segments (``q_seqlen``/``kv_seqlen`` ``(B, M)``, ``q_offsets``/``kv_offsets`` ``(B, M + 1)``, in
global positions of the natural order, also with ``load_balance``; inside ``shard_map`` every device
passes its batch rows' global arrays): every block call is packed with the same ``M`` slots, each
segment's rows and keys being its clipped intersection with the block (empty slots have length 0), so
an unmasked call needs nothing more.  cuDNN counts a segment's causal diagonal from its first row and key
in the call; a causal call is exact for segments whose keys are their queries' positions
(``kv_offsets == q_offsets`` and ``kv_seqlen == q_seqlen``, the packed documents of training; with other
values a causal split call returns NaN in every output and gradient of that batch row, since the values
are traced and cannot raise) when the block is full, starts on the diagonal (top-left) or ends on it
(bottom-right, each segment's keys cut at its last row): :func:`~.sequence_plan.segment_fit`.  The plans
of ring and all-gather, natural or load-balanced, give only such blocks when the pieces of queries and
keys line up (the automatic pieces of equal lengths do); any other block is refused when the call is
traced (:func:`check`).  A row with no key of its segment in a block takes output 0 and logsumexp
``-inf`` there, so it adds nothing to the merge and its backward adds 0.  The logsumexp of a packed split
call (``return_residual=True``, shape ``(B*M, N, T)`` as unsplit) holds row ``b*M + m`` for segment
``m`` of batch row ``b`` at that segment's own query positions (sharded and ordered like the queries),
0 elsewhere; the unsplit call numbers present segments from row 0 and starts each at column 0.  The
backward reads the same layout.

Causal load balance: with the natural order device ``P-1`` computes ``P`` blocks and device 0 one.
:func:`load_balance` reorders a sequence into ``2P`` chunks stored as ``0, 2P-1, 1, 2P-2, ...``, so
device ``d`` holds chunks ``d`` and ``2P-1-d`` and every device computes the same number of blocks;
``ContextParallel(load_balance=P)`` tells the attention call that Q, K, V (and the bias, in both sequence
dimensions) are in that order; outputs and gradients come back in it too (:func:`restore_order`
inverts it).  The logsumexp of ``return_residual=True`` is in the stored order as well.

Where it runs: under ``jit`` automatic partitioning, a query whose sequence dimension is sharded
dispatches here from :mod:`.partitioning` (K/V and the bias are resharded as needed: K/V over the same
axes, the bias by rows); inside ``shard_map`` the call names its axis (``ContextParallel(axis="sp")``)
and passes its local Q/K/V, the bias as its rows by *all* columns ``(1|B, 1|N, T/P, S)``, and the
global ``q_seqlen``/``kv_seqlen``.  The scheme is an argument (``context_parallel=``) or the default of
a :func:`context_parallelism` block, read when the call is traced.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from cudnn_attn.core import support
from cudnn_attn.core.config import AttentionConfig, BiasSpec, DiagonalAlignment, StaticMask
from cudnn_attn.core.errors import UnsupportedConfigurationError
from cudnn_attn.core.types import AttentionLayout
from cudnn_attn.engine import call_steps

from .sequence_plan import (
    Band,
    BlockCall,
    SegmentFit,
    StepPlans,
    chunk_order,
    device_plans,
    local_chunks,
    piece,
    pieces_of,
    segment_fit,
)
from .signature import BWD, FWD, result_names
from .split_segments import SplitSegments

__all__ = ["ContextParallel", "Scheme", "context_parallelism", "load_balance", "restore_order"]


class Scheme(enum.Enum):
    """How K/V reach the queries of every device (module doc)."""

    RING = "ring"
    ALL_GATHER = "all_gather"


@dataclass(frozen=True)
class ContextParallel:
    """How a call whose sequence is split over devices runs (a static kernel option).

    ``scheme``: :class:`Scheme` or its name.  ``axis``: the mesh axis (or axes) of the sequence, for calls
    inside ``shard_map`` (under ``jit`` the axes are read from the query's sharding).  ``load_balance``:
    ``Z`` when Q/K/V are in the load-balanced order of :func:`load_balance` for ``Z`` shards (the number
    of sequence shards must divide ``Z``), ``None`` for the natural order.  ``pieces``: into how many equal
    pieces each device cuts its queries and the keys it holds (kernel calls per block and the unit a ring
    sends); ``None``: 8, 4, 2 or 1, the most that leaves pieces of at least 128 positions.
    """

    scheme: Scheme = Scheme.RING
    axis: str | tuple[str, ...] | None = None
    load_balance: int | None = None
    pieces: int | None = None

    def __post_init__(self):
        try:
            object.__setattr__(self, "scheme", Scheme(self.scheme))
        except ValueError:
            raise ValueError(f"context_parallel: scheme must be one of {[s.value for s in Scheme]}, "
                             f"got {self.scheme!r}") from None
        if isinstance(self.axis, list):
            object.__setattr__(self, "axis", tuple(self.axis))
        balance = self.load_balance
        if balance is not None and (isinstance(balance, bool) or not isinstance(balance, int) or balance < 1):
            raise ValueError(f"context_parallel: load_balance must be a positive int (the number of shards the "
                             f"sequence was reordered for) or None, got {balance!r}")
        pieces = self.pieces
        if pieces is not None and (isinstance(pieces, bool) or not isinstance(pieces, int) or pieces < 1):
            raise ValueError(f"context_parallel: pieces must be a positive int or None, got {pieces!r}")

    @property
    def axes(self) -> tuple[str, ...]:
        return () if self.axis is None else tuple(self.axis) if isinstance(self.axis, tuple) else (self.axis,)


_DEFAULT: contextvars.ContextVar[ContextParallel] = contextvars.ContextVar("cudnn_attn_context_parallel",
                                                                           default=ContextParallel())


@contextlib.contextmanager
def context_parallelism(scheme: str | Scheme = Scheme.RING, *, axis: str | tuple[str, ...] | None = None,
                        load_balance: int | None = None, pieces: int | None = None) -> Iterator[ContextParallel]:
    """The default :class:`ContextParallel` of the attention calls traced inside the block.

    Read when a call is *traced*: a function that ``jit`` traced before keeps the scheme it was traced
    with (pass ``context_parallel=`` to the call to make it part of the function instead).
    """
    token = _DEFAULT.set(ContextParallel(scheme, axis, load_balance, pieces))
    try:
        yield _DEFAULT.get()
    finally:
        _DEFAULT.reset(token)


def resolve(value: ContextParallel | str | Scheme | None) -> ContextParallel:
    """The call's :class:`ContextParallel`: the argument, a scheme name, or the current default."""
    if value is None:
        return _DEFAULT.get()
    if isinstance(value, ContextParallel):
        return value
    return ContextParallel(value)


# -- the load-balanced order ---------------------------------------------------------------------------

def _reorder(x: Any, shards: int, axis: int | Sequence[int], order: Sequence[int], what: str) -> Any:
    """``x`` with the ``2 * shards`` chunks of dimension(s) ``axis`` taken in ``order``; an array with
    Explicit mesh axes keeps its sharding (XLA moves the chunks between devices)."""
    x = jnp.asarray(x)
    sharding = jax.typeof(x).sharding
    explicit = not sharding.mesh.empty and any(entry is not None for entry in sharding.spec)
    for a in ((axis,) if isinstance(axis, int) else tuple(axis)):
        a = a % x.ndim
        length = x.shape[a]
        if length % (2 * shards):
            raise ValueError(f"{what}: dimension {a} of shape {tuple(x.shape)} has {length} positions, not a "
                             f"multiple of 2 * shards = {2 * shards}")
        size = length // (2 * shards)
        if explicit:
            positions = (np.asarray(order)[:, None] * size + np.arange(size)[None, :]).reshape(-1)
            x = x.at[(slice(None),) * a + (positions,)].get(out_sharding=sharding)
        else:        # slices, no index array: traced inside custom_partitioning, which takes no constants
            x = jnp.concatenate([jax.lax.slice_in_dim(x, c * size, (c + 1) * size, axis=a) for c in order], axis=a)
    return x


def load_balance(x: Any, shards: int, axis: int | Sequence[int] = 1) -> Any:
    """``x`` with its sequence dimension(s) ``axis`` in the load-balanced (zigzag) order for ``shards``
    devices: ``2 * shards`` chunks stored as ``0, 2P-1, 1, 2P-2, ...`` (device ``d`` then holds chunks
    ``d`` and ``2P-1-d``).  ``axis=1`` is the sequence of BTNH Q/K/V; a bias takes ``axis=(2, 3)``."""
    return _reorder(x, shards, axis, chunk_order(shards), "load_balance")


def restore_order(x: Any, shards: int, axis: int | Sequence[int] = 1) -> Any:
    """The inverse of :func:`load_balance`: the natural order of the sequence dimension(s) ``axis``."""
    return _reorder(x, shards, axis, np.argsort(chunk_order(shards)), "restore_order")


# -- what runs -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Split:
    """How the sequence of one call is split: ``shards`` devices on the mesh ``axes`` (none: one device
    holding the whole sequence), the load-balanced order ``balance`` (0: natural), the scheme and the
    pieces of :class:`ContextParallel` (``None``: chosen by length)."""

    axes: tuple[str, ...]
    shards: int
    balance: int
    scheme: Scheme
    pieces: int | None = None

    def axis_name(self) -> Any:
        return self.axes[0] if len(self.axes) == 1 else self.axes


def refusals(config: AttentionConfig) -> list[str]:
    """Why ``config`` cannot run with its sequence split (empty when it can): the support table's rows."""
    return support.context_parallel_reasons(config)


def check(config: AttentionConfig, split: Split) -> None:
    """Raise for a configuration that cannot run with ``split`` (module doc)."""
    reasons = refusals(config)
    if reasons:
        raise UnsupportedConfigurationError(reasons, config)
    multiple = 2 * split.balance if split.balance else split.shards
    for what, length in (("query", config.q_len), ("key/value", config.kv_len)):
        if length % multiple:
            raise ValueError(f"{what}: a sequence of {length} positions cannot be split into "
                             f"{'2 * load_balance = ' if split.balance else ''}{multiple} equal parts over the "
                             f"axes {split.axes}")
    if split.pieces is not None:
        held = config.kv_len // split.shards if split.scheme is Scheme.RING and split.shards > 1 else config.kv_len
        for what, length in (("query", config.q_len // split.shards), ("key/value", held)):
            if length % split.pieces:
                raise ValueError(f"context_parallel: pieces={split.pieces} does not divide the {length} {what} "
                                 f"positions a device holds")
    if split.balance and split.balance % split.shards:
        raise ValueError(f"context_parallel: load_balance={split.balance} (the order of the sequence) must be a "
                         f"multiple of the {split.shards} devices on the sequence axes {split.axes}")
    if config.packing is not None:
        unfit = _unfit_segment_call(config, split)
        if unfit is not None:
            raise UnsupportedConfigurationError(
                [f"context parallelism: not with packed segments on a causal block whose first row and key, and "
                 f"whose last row and key, are at different positions ({unfit}: {split.pieces or 'automatic'} "
                 f"pieces of {config.q_len // split.shards} queries and of the keys held do not line up; choose "
                 f"pieces that cut queries and keys at the same positions)"], config)


def _unfit_segment_call(config: AttentionConfig, split: Split) -> BlockCall | None:
    """A call of the split that no :class:`~.sequence_plan.SegmentFit` computes exactly, if any."""
    g = Geometry(config, split)
    for step in g.steps:
        for i in range(g.q_pieces):
            for j in range(g.k_pieces):
                for calls in g.plans(step, i, j).calls:
                    for call in calls:
                        if segment_fit(call) is None:
                            return call
    return None


Call = Callable[[AttentionConfig, Mapping[str, Any]], Mapping[str, Any]]


def run(kind: str, config: AttentionConfig, split: Split, operands: Mapping[str, Any], call: Call) -> dict[str, Any]:
    """The forward or backward results (``result_names(config, kind)``) of the local shard.

    ``config`` has the global sequence lengths (and the local batch and heads); ``operands`` are the
    local arrays (module doc); ``call(block_config, block_operands)`` runs the ``kind`` kernel.
    """
    check(config, split)
    engine = _Engine(config, split, operands)
    found = engine.forward(call) if kind == FWD else engine.backward(call)
    return {name: found[name] for name in result_names(config, kind)}


# -- the engine ----------------------------------------------------------------------------------------------

_NEG_INF = -jnp.inf


class Geometry:
    """The static side of one device's split call: its query chunks, the keys it holds at each step, and
    the pieces both are cut into (:func:`~.sequence_plan.pieces_of`).  Pure Python on integers."""

    def __init__(self, config: AttentionConfig, split: Split):
        self.config, self.split = config, split
        p = split.shards
        self.ring = split.scheme is Scheme.RING and p > 1
        self.q_local, self.k_local = config.q_len // p, config.kv_len // p
        self.held = self.k_local if self.ring else config.kv_len      # keys a device holds at one step
        self.q_pieces = pieces_of(self.q_local, split.pieces)
        self.k_pieces = pieces_of(self.held, split.pieces)
        self.q_piece, self.k_piece = self.q_local // self.q_pieces, self.held // self.k_pieces
        self.steps: list[int | None] = list(range(p)) if self.ring else [None]
        self.q_chunks = [local_chunks(config.q_len, p, r, split.balance) for r in range(p)]
        self.band = Band.of(config)

    def key_chunks(self, step: int | None) -> list:
        p, config = self.split.shards, self.config
        if step is None:                                  # all-gather: every key, natural order
            return [local_chunks(config.kv_len, 1, 0)] * p
        return [local_chunks(config.kv_len, p, (r - step) % p, self.split.balance) for r in range(p)]

    def plans(self, step: int | None, i: int, j: int) -> StepPlans:
        """Every device's calls for its query piece ``i`` against key piece ``j`` of the keys held at ``step``."""
        qp, kp = self.q_piece, self.k_piece
        queries = [piece(c, i * qp, (i + 1) * qp) for c in self.q_chunks]
        keys = [piece(c, j * kp, (j + 1) * kp) for c in self.key_chunks(step)]
        return device_plans(queries, keys, self.band, contiguous_only=self.config.mask.padding)


class _Engine:
    """One device's side of a split call: the plans of every step and piece, the block kernels, the
    accumulators (module doc: where each lives and in which dtype)."""

    def __init__(self, config: AttentionConfig, split: Split, operands: Mapping[str, Any]):
        self.config, self.split, self.ops = config, split, dict(operands)
        self.geometry = g = Geometry(config, split)
        self.seq = 1 if config.layout is AttentionLayout.BTNH else 2
        self.padding = config.mask.padding
        self.segments = SplitSegments.of(config, self.ops) if config.packing is not None else None
        self.index = jax.lax.axis_index(split.axis_name()) if split.shards > 1 else jnp.int32(0)
        self.ring = g.ring
        self.bias = self.ops.get("bias")       # its columns follow the order of the keys in use
        self.last: Any = ()                    # the results of the latest piece (what the next one waits for)

    # -- plans ----------------------------------------------------------------------------------------
    def _run_piece(self, step: int | None, i: int, j: int, branch: Callable, args: tuple) -> Any:
        """This device's calls of ``(step, i, j)``: ``branch(calls)(*args, starts)`` chosen by the device
        index (``lax.switch``), ``starts`` the global positions of its calls' first rows and keys (read per
        device at run time, so that devices differing only by them share a branch); ``None`` when no device
        has a call (the same on every device: the plans are static)."""
        found = self.geometry.plans(step, i, j)
        if not any(found.calls):
            return None
        result = self._run_plans(found, branch, args)
        self.last = result
        return result

    def _run_plans(self, found: StepPlans, branch: Callable, args: tuple) -> Any:
        most = max(len(calls) for calls in found.calls)
        starts = tuple((self._lookup([calls[n].q_global if n < len(calls) else 0 for calls in found.calls]),
                        self._lookup([calls[n].k_global if n < len(calls) else 0 for calls in found.calls]))
                       for n in range(most))
        if len(found.plans) == 1:
            return branch(found.plans[0])(*args, starts)
        return jax.lax.switch(self._lookup(found.index), [branch(calls) for calls in found.plans], *args, starts)

    def _lookup(self, values: Sequence[Any]) -> Any:
        """``values[device index]`` without an array constant (``custom_partitioning`` traces allow none)."""
        found = values[0]
        for r, value in enumerate(values[1:], start=1):
            found = jnp.where(self.index == r, value, found)
        return found

    def _sweep(self, visit: Callable[[int | None, int, Any, Any, Any], None], state: Callable[[], Any]) -> None:
        """``visit(step, j, key_j, value_j, first_column)`` for every step and key piece ``j``, in that order.

        On the ring, piece ``j`` of the block a device needs at ``step`` comes straight from the block's owner
        (``lax.ppermute`` by ``step`` devices), whose K/V are its arguments: no device keeps a received block.
        A piece is requested once the accumulators ``state()`` hold everything two pieces before it
        (:func:`_after`): one piece is computed while the next one travels.
        """
        g = self.geometry
        key, value = self.ops["key"], self.ops["value"]
        if not self.ring:
            key, value = self._gathered(key, value)
        kp = g.k_piece
        items = [(step, j) for step in g.steps for j in range(g.k_pieces)]

        def fetch(step: int | None, j: int) -> tuple[Any, Any]:
            k, v = _after(state(), (key, value))        # sliced only now: XLA would slice every piece up front
            own = self._rows(k, j * kp, (j + 1) * kp), self._rows(v, j * kp, (j + 1) * kp)
            return own if not step else self._from_owner(own, step)

        pending = fetch(*items[0])
        for n, (step, j) in enumerate(items):
            current = pending
            if n + 1 < len(items):
                pending = fetch(*items[n + 1])
            base = 0 if step is None else self._block_index(step) * g.k_local
            visit(step, j, *current, base + j * kp)

    # -- block operands -------------------------------------------------------------------------------
    def _rows(self, x: Any, start: int, stop: int, axis: int | None = None) -> Any:
        axis = self.seq if axis is None else axis
        return x if (start, stop) == (0, x.shape[axis]) else jax.lax.slice_in_dim(x, start, stop, axis=axis)

    def _query_piece(self, i: int, kind: str, state: Any) -> dict[str, Any]:
        """The query-side operands of query piece ``i`` (its rows of Q, the bias, O, dO and the logsumexp),
        sliced once ``state`` is computed (:func:`_after`)."""
        qp = self.geometry.q_piece
        whole = {"query": self.ops["query"]}
        if self.bias is not None:
            whole["bias"] = self.bias
        if kind == BWD:
            whole.update(output=self.ops["output"], grad_output=self.ops["grad_output"], logsumexp=self.lse)
        whole = _after(state, whole)
        return {name: self._rows(x, i * qp, (i + 1) * qp, axis=2 if name in ("bias", "logsumexp") else None)
                for name, x in whole.items()}

    def _block(self, call: BlockCall, kind: str, rows: Mapping[str, Any], key: Any, value: Any, key_base: Any,
               start: tuple) -> tuple:
        """The block's configuration and operands (Q/K/V, bias, lengths or segments); also its rows with a
        key and, for packed segments, the map of its logsumexp to per-row values (else ``None``).
        ``rows``: the query piece's operands; ``start``: the global positions of the call's first query row
        and key on this device."""
        config = self.config
        block = block_config(config, call)
        mask = block.mask
        ops = {"query": self._rows(rows["query"], call.q_start, call.q_stop),
               "key": self._rows(key, call.k_start, call.k_stop),
               "value": self._rows(value, call.k_start, call.k_stop)}
        if block.bias is not None:
            bias_rows = self._rows(rows["bias"], call.q_start, call.q_stop, axis=2)
            ops["bias"] = jax.lax.dynamic_slice_in_dim(bias_rows, key_base + call.k_start, call.k_len, axis=3)
        has_keys, tokens = None, None
        if self.segments is not None:
            found = self.segments.in_block(call, start, segment_fit(call))
            ops.update(found.operands())
            has_keys, tokens = found.rows_with_keys(), found.tokens
            if kind == BWD:
                ops["logsumexp"] = found.packed(self._rows(rows["logsumexp"], call.q_start, call.q_stop, axis=2))
        elif mask.padding:
            batch = config.batch
            if self.padding:
                q_len = jnp.clip(self.ops["q_seqlen"] - start[0], 0, call.q_len).astype(jnp.int32)
                kv_len = jnp.clip(self.ops["kv_seqlen"] - start[1], 0, call.k_len).astype(jnp.int32)
            else:
                q_len = jnp.full((batch,), call.q_len, jnp.int32)
                kv_len = jnp.full((batch,), call.k_len, jnp.int32)
            ops["q_seqlen"], ops["kv_seqlen"] = q_len, kv_len
            has_keys = _rows_with_keys(call, q_len, kv_len)
        if kind == BWD:
            for name in ("output", "grad_output"):
                ops[name] = self._rows(rows[name], call.q_start, call.q_stop)
            if tokens is None:
                ops["logsumexp"] = self._rows(rows["logsumexp"], call.q_start, call.q_stop, axis=2)
        return block, ops, has_keys, tokens

    def _with_sink(self, o: Any, lse: Any) -> tuple[Any, Any]:
        """The merged output and logsumexp with the sink's ``exp(sink_h)`` added to every row's denominator
        once: ``lse' = logaddexp(lse, sink)``, ``o' = o * exp(lse - lse')``.  A row without keys keeps output 0
        and logsumexp ``-inf``, as the unsplit call gives it."""
        sink = self.ops["sink"].astype(jnp.float32)[None, :, None]                 # (1, N, 1)
        merged = jnp.where(jnp.isfinite(lse), jnp.logaddexp(lse, sink), lse)
        scale = jnp.where(jnp.isfinite(lse), jnp.exp(lse - merged), 0.0)
        return (o.astype(jnp.float32) * self._per_row(scale)).astype(o.dtype), merged

    def _dsink(self, lse: Any) -> Any:
        """This device's share of the sink's gradient, ``-sum_{b,i} exp(sink_h - lse_i) D_i`` over its query
        rows (``D = rowsum(dO * O)``; rows without keys add nothing).  The shares are summed by
        :mod:`.partitioning` over the sequence axes, or by ``shard_map``'s transpose of the replicated sink."""
        o, grad = self.ops["output"].astype(jnp.float32), self.ops["grad_output"].astype(jnp.float32)
        delta = jnp.sum(o * grad, axis=-1)                                        # (B, T, N) or (B, N, T)
        if self.seq == 1:
            delta = jnp.swapaxes(delta, 1, 2)
        sink = self.ops["sink"].astype(jnp.float32)[None, :, None]
        p = jnp.where(jnp.isfinite(lse), jnp.exp(sink - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0.0)
        return -jnp.sum(p * delta, axis=(0, 2)).astype(jnp.float32)

    def _unaligned_as_nan(self, *arrays: Any) -> tuple:
        """``arrays`` (batch first: ``B`` rows, or ``B*M`` for the packed logsumexp; or the sink's gradient) as
        they are, with NaN in every batch row of a causal call where a segment's keys are not at its queries'
        positions (in all of dsink, a sum over the rows): the blocks would place such a segment's diagonal
        wrongly, so the result is made unmistakably invalid instead of silently wrong (the values are traced:
        nothing can raise)."""
        if self.config.mask.right_bound is None:
            return arrays
        aligned = self.segments.aligned()
        slots = self.config.packing.max_segments

        def guarded(x: Any) -> Any:
            if x.ndim == 1:                                    # dsink (N,): a sum over every row
                rows = jnp.all(aligned)
            elif x.shape[0] == aligned.shape[0]:               # (B, ...)
                rows = aligned.reshape((-1,) + (1,) * (x.ndim - 1))
            else:                                              # the packed logsumexp (B*M, ...)
                rows = jnp.repeat(aligned, slots).reshape((-1,) + (1,) * (x.ndim - 1))
            return jnp.where(rows, x, jnp.asarray(jnp.nan, x.dtype))
        return tuple(guarded(x) for x in arrays)

    def _per_row(self, x: Any) -> Any:
        """A ``(B, N, T)`` (or ``(B, 1, T)``) row statistic shaped to broadcast against O in the layout."""
        return jnp.swapaxes(x, 1, 2)[..., None] if self.seq == 1 else x[..., None]

    def _piece_shape(self, x: Any, length: int, dtype: Any = jnp.float32) -> jax.ShapeDtypeStruct:
        shape = list(x.shape)
        shape[self.seq] = length
        return jax.ShapeDtypeStruct(tuple(shape), dtype)

    # -- forward --------------------------------------------------------------------------------------
    def forward(self, call: Call) -> dict[str, Any]:
        config, q, g = self.config, self.ops["query"], self.geometry
        o_shape = list(q.shape)
        o_shape[-1] = config.v_dim
        heads = config.q_heads
        rows = (config.batch, heads, g.q_local)
        # O, the logsumexp and (with score_max) each row's max over every block: the max across the ring
        state = [jnp.zeros(o_shape, q.dtype), jnp.full(rows, _NEG_INF, jnp.float32)]
        if config.score_max:
            state.append(jnp.full(rows, -jnp.inf, jnp.float32))
        qp = g.q_piece
        piece_o = list(o_shape)
        piece_o[self.seq] = qp

        def branch(calls: tuple[BlockCall, ...]) -> Callable:
            def run_calls(rows, key, value, key_base, starts):
                found = (_full_like(q, piece_o, q.dtype, 0),
                         _full_like(q, (config.batch, heads, qp), jnp.float32, _NEG_INF))
                if config.score_max:
                    found += (_full_like(q, (config.batch, heads, qp), jnp.float32, -jnp.inf),)
                for c, start in zip(calls, starts):
                    block, ops, has_keys, tokens = self._block(c, FWD, rows, key, value, key_base, start)
                    result = call_steps.run_padded(FWD, block, ops, jnp, call)
                    lse = result["logsumexp"] if tokens is None else tokens(result["logsumexp"])
                    found = self._merge(found, c.q_start, result["output"], lse, has_keys, result.get("score_max"))
                return found
            return run_calls

        def visit(step, j, key, value, key_base):
            for i in range(g.q_pieces):
                found = self._run_piece(step, i, j, branch,
                                        (self._query_piece(i, FWD, self.last), key, value, key_base))
                if found is not None:
                    state[:] = self._merge(tuple(state), i * qp, found[0], found[1], None, *found[2:])

        self._sweep(visit, lambda: self.last)
        o, lse = state[:2]
        if config.sink:
            o, lse = self._with_sink(o, lse)
        score_max = state[2] if config.score_max else None
        if self.segments is not None:
            lse = self.segments.lse_by_segment(lse, self._global_rows())
            o, lse = self._unaligned_as_nan(o, lse)
        elif self.padding:
            valid = self._global_rows()[None, :] < self.ops["q_seqlen"][:, None]      # (B, T_local)
            lse = jnp.where(valid[:, None, :], lse, 0.0)
            if score_max is not None:
                score_max = jnp.where(valid[:, None, :], score_max, -jnp.inf)
        found = {"output": o, "logsumexp": lse}
        if score_max is not None:
            found["score_max"] = score_max
        return found

    def _merge(self, state: tuple, start: int, o: Any, lse: Any, has_keys: Any, score_max: Any = None) -> tuple:
        """``state`` (O, logsumexp, and with ``score_max`` the rows' maxima) with the partial result ``o``,
        ``lse`` (``score_max``) of the rows from ``start`` merged in (O keeps its dtype; the merge itself is
        float32; the maxima merge by their max)."""
        o_acc, lse_acc = state[:2]
        if has_keys is not None:
            lse = jnp.where(has_keys[:, None, :], lse, _NEG_INF)
            o = jnp.where(self._per_row(has_keys[:, None, :]), o, 0)
            if score_max is not None:
                score_max = jnp.where(has_keys[:, None, :], score_max, -jnp.inf)
        stop = start + lse.shape[-1]
        old_o = self._rows(o_acc, start, stop).astype(jnp.float32)
        old_lse = lse_acc[..., start:stop]
        top = jnp.maximum(old_lse, lse)
        top = jnp.where(jnp.isfinite(top), top, 0.0)
        w_old, w_new = jnp.exp(old_lse - top), jnp.exp(lse - top)
        total = w_old + w_new
        safe = jnp.where(total > 0, total, 1.0)
        new_o = old_o * self._per_row(w_old / safe) + o.astype(jnp.float32) * self._per_row(w_new / safe)
        new_lse = top + jnp.log(total)
        o_acc = jax.lax.dynamic_update_slice_in_dim(o_acc, new_o.astype(o_acc.dtype), start, axis=self.seq)
        lse_acc = jax.lax.dynamic_update_slice_in_dim(lse_acc, new_lse, start, axis=2)
        if len(state) == 2:
            return o_acc, lse_acc
        max_acc = state[2]
        new_max = jnp.maximum(max_acc[..., start:stop], score_max)
        return o_acc, lse_acc, jax.lax.dynamic_update_slice_in_dim(max_acc, new_max, start, axis=2)

    # -- backward -------------------------------------------------------------------------------------
    def backward(self, call: Call) -> dict[str, Any]:
        config, g = self.config, self.geometry
        lse = self.ops["logsumexp"]
        if self.segments is not None:
            lse = self.segments.lse_by_row(lse, self._global_rows())
        self.lse = jnp.where(jnp.isfinite(lse), lse, 0.0)          # rows without keys: P = exp(-inf - 0) = 0
        query, key, value = self.ops["query"], self.ops["key"], self.ops["value"]
        qp, kp = g.q_piece, g.k_piece
        q_piece = self._piece_shape(query, qp)
        k_piece, v_piece = self._piece_shape(key, kp), self._piece_shape(value, kp)
        bias = self.ops.get("bias")
        key_dtype, value_dtype = key.dtype, value.dtype
        # the ring accumulates in the operands' dtype, where the gradients stay (module doc); the gathered keys
        # of all-gather in float32 before their reduction
        if self.ring:
            acc = {"dq": jnp.zeros(query.shape, query.dtype), "dk": jnp.zeros(key.shape, key.dtype),
                   "dv": jnp.zeros(value.shape, value.dtype)}
        else:
            gathered = lambda x: self._piece_shape(x, g.held).shape  # noqa: E731
            acc = {"dq": jnp.zeros(query.shape, query.dtype), "dk": jnp.zeros(gathered(key), jnp.float32),
                   "dv": jnp.zeros(gathered(value), jnp.float32)}
        if config.has_dbias:
            acc["dbias"] = jnp.zeros(bias.shape, jnp.float32)

        def branch(calls: tuple[BlockCall, ...]) -> Callable:
            def run_calls(rows, key, value, key_base, starts):
                dq, dk, dv = (_full_like(query, s.shape, jnp.float32, 0) for s in (q_piece, k_piece, v_piece))
                db = _full_like(query, bias.shape[:2] + (qp, kp), jnp.float32, 0) if config.has_dbias else None
                for c, start in zip(calls, starts):
                    block, ops, has_keys, _ = self._block(c, BWD, rows, key, value, key_base, start)
                    found = call_steps.run_padded(BWD, block, ops, jnp, call)
                    grad = found["dq"]
                    if has_keys is not None:
                        grad = jnp.where(self._per_row(has_keys[:, None, :]), grad, 0)
                    dq = _add_rows(dq, grad, c.q_start, self.seq)
                    dk = _add_rows(dk, found["dk"], c.k_start, self.seq)
                    dv = _add_rows(dv, found["dv"], c.k_start, self.seq)
                    if db is not None:
                        block_rows = jax.lax.slice_in_dim(db, c.q_start, c.q_stop, axis=2)
                        block_rows = _add_rows(block_rows, found["dbias"], c.k_start, 3)
                        db = jax.lax.dynamic_update_slice_in_dim(db, block_rows, c.q_start, axis=2)
                return dq.astype(query.dtype), dk.astype(key_dtype), dv.astype(value_dtype), db
            return run_calls

        def visit(step, j, key, value, key_base):
            dk = dv = None               # this piece's gradients, in the operands' dtype
            for i in range(g.q_pieces):
                found = self._run_piece(step, i, j, branch,
                                        (self._query_piece(i, BWD, self.last), key, value, key_base))
                if found is None:
                    continue
                dq_i, dk_i, dv_i, db_i = found
                acc["dq"] = _add_rows(acc["dq"], dq_i, i * qp, self.seq)
                if dk is not None:
                    dk = (dk.astype(jnp.float32) + dk_i.astype(jnp.float32)).astype(dk_i.dtype)
                    dv = (dv.astype(jnp.float32) + dv_i.astype(jnp.float32)).astype(dv_i.dtype)
                else:
                    dk, dv = dk_i, dv_i
                self.last = (dk, dv)         # the next piece waits for the sum, not only for the kernels
                if db_i is not None:
                    rows = jax.lax.slice_in_dim(acc["dbias"], i * qp, (i + 1) * qp, axis=2)
                    columns = jax.lax.dynamic_slice_in_dim(rows, key_base, kp, axis=3)
                    rows = jax.lax.dynamic_update_slice_in_dim(rows, columns + db_i, key_base, axis=3)
                    acc["dbias"] = jax.lax.dynamic_update_slice_in_dim(acc["dbias"], rows, i * qp, axis=2)
            if dk is None:
                return
            if self.ring and step:             # the partial gradients of block (index - step) go to its owner
                dk, dv = self._send_home((dk, dv), step)
            acc["dk"] = _add_rows(acc["dk"], dk, j * kp, self.seq)
            acc["dv"] = _add_rows(acc["dv"], dv, j * kp, self.seq)

        self._sweep(visit, lambda: self.last)
        dk, dv = acc["dk"], acc["dv"]
        if not self.ring:
            dk, dv = self._scattered(dk), self._scattered(dv)
        found = {"dq": acc["dq"], "dk": dk.astype(key.dtype), "dv": dv.astype(value.dtype)}
        if config.sink:
            found["dsink"] = self._dsink(lse)
        if self.segments is not None:
            found = dict(zip(found, self._unaligned_as_nan(*found.values())))
        if config.has_dbias:
            dbias = acc["dbias"]
            if not self.ring and self.split.balance:
                dbias = load_balance(dbias, self.split.balance, axis=3)
            found["dbias"] = dbias.astype(bias.dtype)
        return found

    # -- communication ------------------------------------------------------------------------------
    def _block_index(self, step: int) -> Any:
        """The key block this device holds at ring step ``step``."""
        return (self.index - step) % self.split.shards

    def _from_owner(self, arrays: tuple, step: int) -> tuple:
        """Every device's ``arrays`` sent ``step`` devices on (device ``r`` receives those of ``r - step``)."""
        return self._permute(arrays, step)

    def _permute(self, arrays: tuple, shift: int) -> tuple:
        """``arrays`` sent ``shift`` devices on, as their bits: XLA's CPU collectives would otherwise send
        2-byte floats as float32 (a converted copy on each side)."""
        p = self.split.shards
        dtypes = [x.dtype for x in arrays]
        bits = tuple(jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x for x in arrays)
        sent = jax.lax.ppermute(bits, self.split.axis_name(), perm=[(i, (i + shift) % p) for i in range(p)])
        return tuple(jax.lax.bitcast_convert_type(x, d) if d.itemsize == 2 else x for x, d in zip(sent, dtypes))

    def _send_home(self, arrays: tuple, step: int) -> tuple:
        """Send the arrays of the block held at ``step`` to the device that owns it (``r`` -> ``r - step``)."""
        return self._permute(arrays, -step)

    def _gathered(self, key: Any, value: Any) -> tuple[Any, Any]:
        """All keys, in the natural order (the bias columns follow)."""
        gathered = []
        for x in (key, value):
            if self.split.shards > 1:
                x = jax.lax.all_gather(x, self.split.axis_name(), axis=self.seq, tiled=True)
            if self.split.balance:
                x = restore_order(x, self.split.balance, axis=self.seq)
            gathered.append(x)
        if self.bias is not None and self.split.balance:
            self.bias = restore_order(self.bias, self.split.balance, axis=3)
        return gathered[0], gathered[1]

    def _scattered(self, x: Any) -> Any:
        """The inverse of :meth:`_gathered` for gradients: each device's keys, summed over the devices."""
        if self.split.balance:
            x = load_balance(x, self.split.balance, axis=self.seq)
        if self.split.shards > 1:
            x = jax.lax.psum_scatter(x, self.split.axis_name(), scatter_dimension=self.seq, tiled=True)
        return x

    def _global_rows(self) -> Any:
        """The global position of every local query row (of this device)."""
        rows = [jnp.concatenate([jnp.arange(c.length, dtype=jnp.int32) + c.start for c in chunks])
                for chunks in self.geometry.q_chunks]
        return self._lookup(rows)


def block_config(config: AttentionConfig, call: BlockCall) -> AttentionConfig:
    """The kernel configuration of one block call of ``config`` (training: the merge needs the logsumexp)."""
    mask = StaticMask(right_bound=call.right_bound, left_bound=call.left_bound,
                      padding=config.mask.padding or call.padded)
    if config.packing is not None:           # the segments' own band (sequence_plan: packed segments)
        fit = segment_fit(call)
        mask = StaticMask(right_bound=None if fit is SegmentFit.FULL else 0, padding=True,
                          alignment=DiagonalAlignment.BOTTOM_RIGHT if fit is SegmentFit.BOTTOM_RIGHT
                          else DiagonalAlignment.TOP_LEFT)
    bias = config.bias and BiasSpec(config.bias.shape[:2] + (call.q_len, call.k_len), config.bias.differentiable)
    return config.replace(q_len=call.q_len, kv_len=call.k_len, mask=mask, bias=bias, training=True,
                          sink=False)         # the sink joins once, in the merged denominator


def block_configs(config: AttentionConfig, split: Split) -> set[AttentionConfig]:
    """Every kernel configuration a split call of ``config`` builds (for build checks: plans are static)."""
    g = Geometry(config, split)
    return {block_config(config, call)
            for step in g.steps for i in range(g.q_pieces) for j in range(g.k_pieces)
            for calls in g.plans(step, i, j).plans for call in calls}


def _rows_with_keys(call: BlockCall, q_len: Any, kv_len: Any) -> Any:
    """``(B, rows)`` bool: the row is a valid query with at least one admissible valid key in the call."""
    i = jnp.arange(call.q_len, dtype=jnp.int32)[None, :]
    first = jnp.zeros_like(i) if call.left_bound is None else jnp.maximum(i - call.left_bound + 1, 0)
    last = kv_len[:, None] - 1
    if call.right_bound is not None:
        last = jnp.minimum(last, i + call.right_bound)
    return (i < q_len[:, None]) & (first <= last)


def _full_like(x: Any, shape: Any, dtype: Any, value: Any) -> Any:
    """An array of ``value`` that varies over the same ``shard_map`` axes as ``x`` (branch results must)."""
    found = jnp.full(shape, value, dtype)
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None) or getattr(aval, "vma", None)       # jax 0.11: aval.mat.varying
    axes = tuple(sorted(getattr(mat, "varying", mat) or ()))
    return jax.lax.pcast(found, axes, to="varying") if axes else found


def _after(first: Any, then: Any) -> Any:
    """``then``, available only once ``first`` (the previous piece's kernel results) is computed
    (``lax.optimization_barrier``): keeps XLA from starting the next piece's kernels, or its send, early
    (it would otherwise slice and compute every piece at once and hold all their results)."""
    return jax.lax.optimization_barrier((first, then))[1]


def _add_rows(acc: Any, x: Any, start: int, axis: int) -> Any:
    """``acc`` with ``x`` added at rows ``start ..`` of ``axis`` (summed in float32, stored in ``acc``'s dtype)."""
    part = jax.lax.slice_in_dim(acc, start, start + x.shape[axis], axis=axis).astype(jnp.float32)
    part = part + x.astype(jnp.float32)
    return jax.lax.dynamic_update_slice_in_dim(acc, part.astype(acc.dtype), start, axis=axis)


# -- inside shard_map ------------------------------------------------------------------------------------

def axis_size(axes: tuple[str, ...]) -> int:
    """The number of devices on the mesh ``axes`` of the enclosing ``shard_map``."""
    try:
        return math.prod(jax.lax.axis_size(a) for a in axes)
    except NameError as error:
        raise ValueError(f"context_parallel: axis {axes} is not a mesh axis of an enclosing shard_map ({error}); "
                         "ContextParallel(axis=...) is for calls inside shard_map - under jit, shard the query's "
                         "sequence dimension instead") from None


def whole_sequence(context: ContextParallel, key: Any, value: Any, layout: Any) -> tuple[Any, Any]:
    """Inside ``shard_map`` (``context.axes``): shape stand-ins of the whole K and V (``numpy.empty``: no
    memory is touched, validation reads shapes and dtypes only), so that the call is validated as the whole
    sequence (the bias has every key column); else ``key`` and ``value``."""
    if not context.axes:
        return key, value
    shards = axis_size(context.axes)
    seq = 1 if AttentionLayout.parse(layout) is AttentionLayout.BTNH else 2

    def whole(x: Any) -> Any:
        if getattr(x, "ndim", 0) != 4:
            return x                              # prepare() reports the bad rank
        shape = list(x.shape)
        shape[seq] *= shards
        return np.empty(tuple(shape), x.dtype)

    return whole(key), whole(value)


def whole_config(config: AttentionConfig, context: ContextParallel) -> AttentionConfig:
    """The configuration of the whole sequence from one validated with local queries and whole keys."""
    q_len = config.q_len * axis_size(context.axes)
    bias = config.bias and BiasSpec(config.bias.shape[:2] + (q_len, config.kv_len), config.bias.differentiable)
    return config.replace(q_len=q_len, bias=bias)
