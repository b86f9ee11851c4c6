"""Result memory of the direct path, handed back at the same address once the caller has let go of it.

A loop of eager calls (``o = dot_product_attention(q, k, v)``, use ``o``, drop it, call again) frees each
result before the next call allocates one.  CuPy's pool does give that memory back, but not at the same
address: it pops an arbitrary free chunk of the size bin (``_get_chunk`` takes from a ``set``).  Two things
pay for the new address: the allocation itself (the pool's lock and free-list search, about 2.6 us on the
H200's host) and the replayed launch (:mod:`cudnn_attn.replay` keys a CUDA graph by every address, so a new
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
noise), and all kept blocks together stay under :data:`BUDGET_BYTES` (least recently used dropped back to
CuPy's pool).  :meth:`ResultBlocks.clear` returns every kept block; ``cupy``'s ``free_all_blocks`` cannot,
because a kept block is in use as far as the pool knows.
"""

from __future__ import annotations

import collections
import sys
import threading
from typing import Any, Callable, NamedTuple

BLOCK_MAX_BYTES = 16 << 20
"""The largest result block kept for reuse."""
BUDGET_BYTES = 64 << 20
"""All kept blocks together (per process)."""
PER_KEY = 2
"""Calls' results kept per signature and stream: two cover ``o = f(q, k, v)`` in a loop, where the previous result is
still bound to ``o`` while the next call runs (the two blocks alternate)."""


def _references(arrays: tuple) -> list[tuple[int, int, int]]:
    """Reference counts of each array, its ``MemoryPointer`` and its ``Memory`` (as read from this function)."""
    counts = []
    for array in arrays:
        pointer = array.data
        counts.append((sys.getrefcount(array), sys.getrefcount(pointer), sys.getrefcount(pointer.mem)))
    return counts


class _Block:
    """One call's results, kept: free when every count is what it was when only this block held them."""

    __slots__ = ("arrays", "shapes", "counts")

    def __init__(self, arrays: tuple):
        self.arrays = arrays
        self.shapes = [a.shape for a in arrays]
        self.counts = _references(arrays)

    def free(self) -> bool:
        return _references(self.arrays) == self.counts and [a.shape for a in self.arrays] == self.shapes


class BlockStats(NamedTuple):
    reused: int
    allocated: int
    kept: int
    kept_bytes: int


class ResultBlocks:
    """The kept result blocks of the direct path (see the module doc); thread-safe."""

    def __init__(self, budget: int = BUDGET_BYTES, block_max: int = BLOCK_MAX_BYTES, per_key: int = PER_KEY):
        self.budget, self.block_max, self.per_key = budget, block_max, per_key
        self._blocks: collections.OrderedDict[tuple, tuple[list, int]] = collections.OrderedDict()
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
        with self._lock:                   # taken out: no other thread can hand out the same block meanwhile
            entry = self._blocks.pop(key, None)
            if entry is not None:
                self._bytes -= len(entry[0]) * entry[1]
        kept = [] if entry is None else entry[0]
        free = -1
        for i, block in enumerate(kept):
            if block.free():
                free = i
                break
        if free >= 0:
            block = kept.pop(free)
        else:
            block = _Block(tuple(make()))
            del kept[self.per_key - 1:]    # the oldest: its caller still uses it, and frees it to the pool
        kept.insert(0, block)
        with self._lock:
            if free >= 0:
                self._reused += 1
            else:
                self._allocated += 1
            raced = self._blocks.pop(key, None)   # a thread that ran the same key meanwhile: ours replace its
            if raced is not None:
                self._bytes -= len(raced[0]) * raced[1]
            self._blocks[key] = (kept, nbytes)
            self._bytes += len(kept) * nbytes
            while self._bytes > self.budget:
                _, (blocks, size) = self._blocks.popitem(last=False)
                self._bytes -= len(blocks) * size
        return list(block.arrays)

    def clear(self) -> None:
        """Return every kept block (those nothing else references go back to CuPy's pool)."""
        with self._lock:
            self._blocks.clear()
            self._bytes = 0

    def stats(self) -> BlockStats:
        with self._lock:
            return BlockStats(self._reused, self._allocated, sum(len(b) for b, _ in self._blocks.values()),
                              self._bytes)


result_blocks = ResultBlocks()
"""The process's kept result blocks (used by :mod:`cudnn_attn.api`'s direct path and :func:`cudnn_attn.bind`)."""
