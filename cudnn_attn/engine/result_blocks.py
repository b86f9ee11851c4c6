"""Result memory of the direct path, handed back at the same address once the caller has let go of it.

A loop of eager calls (``o = dot_product_attention(q, k, v)``, use ``o``, drop it, call again) frees each
result before the next call allocates one.  CuPy's pool does give that memory back, but not at the same
address: it pops an arbitrary free chunk of the size bin (``_get_chunk`` takes from a ``set``).  Two things
pay for the new address: the allocation itself (the pool's lock and free-list search, about 2.6 us on the
H200's host) and the replayed launch (:mod:`cudnn_attn.engine.replay` keys a CUDA graph by every address, so a new
output address means the ordinary launch, 5 us more).

:class:`ResultBlocks` keeps the results of the last :data:`PER_KEY` calls of each direct-path signature and
stream, the arrays themselves.  A call hands them out again when nothing of the caller's refers to them any
more: the reference counts of each array, its ``MemoryPointer`` and its ``Memory`` are what they were when
only the kept block held them (so no array, view, DLPack capsule or ``MemoryPointer`` of the caller's is
alive), and their shapes are unchanged.  Reusing the array objects also skips making them (an ``ndarray``
over given memory costs about as much as ``cupy.empty``).  When every kept call's results are still in use,
the call makes new ones, kept in place of the oldest.

This is exactly CuPy's own rule for a freed block: it is reused in the order of the stream it was
allocated on (the key includes the stream), so work already queued on that stream that reads the old
result runs before the new launch overwrites it.  Work on *another* stream that reads a result its caller
has dropped needs the same synchronisation it needs with CuPy's pool.

Bounded: blocks above :data:`BLOCK_MAX_BYTES` are never kept (their calls are GPU-bound: an allocation is
noise), and all kept blocks together stay under :data:`BUDGET_BYTES` (the signature that made new results
longest ago is dropped first, back to CuPy's pool).  :meth:`ResultBlocks.clear` returns every kept block; ``cupy``'s ``free_all_blocks`` cannot,
because a kept block is in use as far as the pool knows.
"""

from __future__ import annotations

import operator
import threading
from sys import getrefcount
from typing import Any, Callable, NamedTuple

_shape = operator.attrgetter("shape")

BLOCK_MAX_BYTES = 16 << 20
"""The largest result block kept for reuse."""
BUDGET_BYTES = 64 << 20
"""All kept blocks together (per process)."""
PER_KEY = 2
"""Calls' results kept per signature and stream: two cover ``o = f(q, k, v)`` in a loop, where the previous result is
still bound to ``o`` while the next call runs (the two blocks alternate)."""


class _Block:
    """One call's results, kept: free when the reference count of every array, its ``MemoryPointer`` and its
    ``Memory`` is what it was when only this block held them, and no shape has changed.  The counts are taken
    by :meth:`free`'s own code (its locals hold references too)."""

    __slots__ = ("arrays", "shapes", "objects", "counts")

    def __init__(self, arrays: tuple):
        self.arrays = arrays
        self.shapes = tuple(a.shape for a in arrays)
        self.objects = tuple(x for a in arrays for x in (a, a.data, a.data.mem))
        self.counts = self._counts()

    def _counts(self) -> tuple:
        return tuple(map(getrefcount, self.objects))

    def free(self) -> bool:
        return tuple(map(getrefcount, self.objects)) == self.counts and tuple(map(_shape, self.arrays)) == self.shapes


class _OneBlock(_Block):
    """:class:`_Block` of a single result (a forward's output), spelled out: 0.2 us against 0.8 for the loop
    over three objects on a 2-core CPU."""

    __slots__ = ()

    def _counts(self) -> tuple:
        array, pointer, memory = self.objects
        return getrefcount(array), getrefcount(pointer), getrefcount(memory)

    def free(self) -> bool:
        array, pointer, memory = self.objects
        return ((getrefcount(array), getrefcount(pointer), getrefcount(memory)) == self.counts
                and array.shape == self.shapes[0])


def _block(arrays: tuple) -> _Block:
    return _OneBlock(arrays) if len(arrays) == 1 else _Block(arrays)


class BlockStats(NamedTuple):
    reused: int
    allocated: int
    kept: int
    kept_bytes: int


class ResultBlocks:
    """The kept results of the direct path (see the module doc); thread-safe.

    The reuse path takes no lock: a key's list of kept calls is taken out of the dictionary (one atomic
    ``dict.pop``), so no other thread can hand out the same results meanwhile, and put back.  Making new
    results, the byte budget and eviction (oldest key first) run under the lock.  The ``reused`` count is not
    locked (it may miss a few under threads); ``allocated`` is exact.
    """

    def __init__(self, budget: int = BUDGET_BYTES, block_max: int = BLOCK_MAX_BYTES, per_key: int = PER_KEY):
        self.budget, self.block_max, self.per_key = budget, block_max, per_key
        self._blocks: dict[tuple, list[_Block]] = {}
        self._counted: dict[tuple, tuple[int, int]] = {}     # key -> (blocks counted in _bytes, bytes each)
        self._bytes = 0
        self._lock = threading.Lock()
        self._reused = self._allocated = 0

    def results(self, owner: Any, stream: int, nbytes: int, make: Callable[[], Any]) -> list:
        """``owner``'s results on ``stream``: the arrays of a kept call that nothing references any more, else
        ``make()``'s new ones (taking ``nbytes``), kept in place of the oldest.

        ``owner`` (hashable; one per result layout, e.g. a direct-path signature) must make the same arrays
        (shapes, dtypes, bytes) on every call.
        """
        if nbytes > self.block_max:
            return list(make())
        key = (owner, stream)
        kept = self._blocks.pop(key, None)
        if kept is not None:
            for i, block in enumerate(kept):
                if block.free():
                    if i:
                        kept.insert(0, kept.pop(i))
                    if self._blocks.setdefault(key, kept) is not kept:
                        self._store(key, kept, nbytes)          # another thread stored new results meanwhile
                    self._reused += 1
                    return list(block.arrays)
        block = _block(tuple(make()))
        self._store(key, [block] + (kept or []), nbytes, made=True)
        return list(block.arrays)

    def _store(self, key: tuple, blocks: list, nbytes: int, made: bool = False) -> None:
        """Keep ``blocks`` (newest first) for ``key`` with what another thread stored there meanwhile, at most
        :attr:`per_key` of them; then hold the byte budget."""
        with self._lock:
            if made:
                self._allocated += 1
            raced = self._blocks.pop(key, None) or []
            merged = blocks + [b for b in raced if all(b is not mine for mine in blocks)]
            del merged[self.per_key:]           # the oldest: its caller still uses it, and frees it to the pool
            counted, _ = self._counted.get(key, (0, nbytes))
            self._bytes += (len(merged) - counted) * nbytes
            self._counted[key] = (len(merged), nbytes)
            self._blocks[key] = merged
            while self._bytes > self.budget:
                oldest = next((k for k in self._blocks if k != key), None)
                if oldest is None:
                    break
                del self._blocks[oldest]
                count, size = self._counted.pop(oldest)
                self._bytes -= count * size

    def clear(self) -> None:
        """Return every kept call's results (those nothing else references go back to CuPy's pool)."""
        with self._lock:
            self._blocks.clear()
            self._counted.clear()
            self._bytes = 0

    def stats(self) -> BlockStats:
        with self._lock:
            return BlockStats(self._reused, self._allocated, sum(len(b) for b in self._blocks.values()),
                              self._bytes)


result_blocks = ResultBlocks()
"""The process's kept results (used by :mod:`cudnn_attn.fronts.cupy`'s direct path and :func:`cudnn_attn.bind`)."""
