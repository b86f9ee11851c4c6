"""The direct path's kept result blocks (:mod:`cudnn_attn.result_blocks`), with stand-ins for CuPy's
``Memory`` / ``MemoryPointer`` / ``ndarray``: a block is reused only when nothing of the caller's refers to
it, per owner and stream, within its bounds, and never handed to two callers at once."""

from __future__ import annotations

import threading

import pytest

from cudnn_attn.result_blocks import ResultBlocks


class Memory:
    def __init__(self, nbytes):
        self.nbytes = nbytes


class Pointer:                      # what CuPy's arrays (and their views) hold
    def __init__(self, mem, offset=0):
        self.mem, self.offset = mem, offset


class Array:
    def __init__(self, data):
        self.data = data


def alloc(nbytes):
    return Pointer(Memory(nbytes))


def test_a_dropped_result_comes_back_at_the_same_block():
    blocks = ResultBlocks()
    first = blocks.memory("sig", 1, 256, alloc)
    out = Array(Pointer(first))
    del first, out
    assert blocks.memory("sig", 1, 256, alloc) is not None
    assert blocks.stats().reused == 1 and blocks.stats().allocated == 1


@pytest.mark.parametrize("holder", ["array", "view", "pointer", "container"])
def test_a_block_the_caller_still_holds_is_not_reused(holder):
    blocks = ResultBlocks()
    memory = blocks.memory("sig", 1, 256, alloc)
    out = Array(Pointer(memory))
    kept = {"array": out, "view": Array(Pointer(memory, 128)), "pointer": out.data, "container": [out]}[holder]
    del memory, out
    second = blocks.memory("sig", 1, 256, alloc)
    assert second is not (kept.mem if holder == "pointer" else (kept[0] if holder == "container" else kept).data.mem)
    assert blocks.stats() == (0, 2, 2, 512)


def test_a_loop_that_rebinds_its_result_alternates_two_blocks():
    """``o = f()``: the previous result is alive while the next call runs, so one block cannot be reused;
    two alternate, each at a fixed address (what the replayed launch needs)."""
    blocks = ResultBlocks()
    o, addresses = None, []
    for _ in range(8):
        o = Array(Pointer(blocks.memory("sig", 1, 256, alloc)))
        addresses.append(id(o.data.mem))
    assert addresses[2:] == addresses[:2] * 3 and addresses[0] != addresses[1]
    assert blocks.stats() == (6, 2, 2, 512)


def test_blocks_are_per_owner_and_stream():
    blocks = ResultBlocks()
    blocks.memory("a", 1, 256, alloc)
    blocks.memory("a", 2, 256, alloc)               # "a"'s block on stream 1 is free, but not this stream's
    assert blocks.stats().allocated == 2
    blocks.memory("b", 1, 256, alloc)
    assert blocks.stats().allocated == 3 and blocks.stats().kept == 3
    blocks.memory("a", 1, 256, alloc)
    assert blocks.stats().reused == 1


def test_bounds():
    blocks = ResultBlocks(budget=1000, block_max=400)
    blocks.memory("big", 1, 401, alloc)                     # never kept
    assert blocks.stats() == (0, 0, 0, 0)
    for owner in "abc":
        blocks.memory(owner, 1, 400, alloc)
    assert blocks.stats().kept == 2 and blocks.stats().kept_bytes == 800    # "a" dropped: least recent
    blocks.memory("a", 1, 400, alloc)
    assert blocks.stats().reused == 0
    blocks.clear()
    assert blocks.stats().kept == 0 and blocks.stats().kept_bytes == 0


def test_threads_never_share_a_block():
    blocks = ResultBlocks()
    seen, errors = [], []
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        for _ in range(2000):
            memory = blocks.memory("sig", 1, 64, alloc)
            out = Array(Pointer(memory))
            del memory
            if getattr(out.data.mem, "owner", None) is not None:
                errors.append("shared")
            out.data.mem.owner = threading.get_ident()
            seen.append(id(out.data.mem))
            out.data.mem.owner = None

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stats = blocks.stats()
    assert stats.reused + stats.allocated == 16000 and stats.reused > 0
