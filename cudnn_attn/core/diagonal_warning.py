"""The warning of a top-left causal mask with fewer queries than keys.

Top-left, query ``i`` attends to keys ``j <= i``: with ``T < S`` the first query sees key 0 alone and the
last ``S - T`` keys are seen by no query.  That is ``jax.nn``'s and the seed's causal mask, and it is what a
decode step (one query against ``S`` cached keys) or a chunked prefill does *not* want: there the queries
are the last ``T`` positions, the bottom-right diagonal (keys ``j <= i + S - T``).  Such a call warns with
:class:`TopLeftCausalWarning`, once per configuration in a process; ``warnings.simplefilter("ignore",
TopLeftCausalWarning)`` silences it.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Iterator

from .config import AttentionConfig, DiagonalAlignment

__all__ = ["TopLeftCausalWarning", "deferred", "warn_top_left"]


class TopLeftCausalWarning(UserWarning):
    """A causal mask aligned top-left with fewer queries than keys (module doc)."""


_warned: set[AttentionConfig] = set()
_lock = threading.Lock()
_this_thread = threading.local()


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Within it, :func:`warn_top_left` warns nothing on this thread: for a caller that validates a part of a
    call (``shard_map``'s local queries against the whole sequence's keys) and warns on the whole call itself."""
    _this_thread.deferred = getattr(_this_thread, "deferred", 0) + 1
    try:
        yield
    finally:
        _this_thread.deferred -= 1


def warn_top_left(config: AttentionConfig) -> None:
    """Warn once per ``config`` when its causal diagonal is top-left and ``T < S`` (module doc)."""
    mask = config.mask
    if getattr(_this_thread, "deferred", 0):
        return
    if mask.right_bound is None or mask.alignment is not DiagonalAlignment.TOP_LEFT \
            or config.q_len >= config.kv_len:
        return
    with _lock:
        if config in _warned:
            return
        _warned.add(config)
    warnings.warn(
        f"causal mask aligned top-left with fewer queries than keys (T={config.q_len} < S={config.kv_len}): query "
        "i attends to keys j <= i, so the first query sees key 0 alone; when the queries are the last T "
        "positions (a decode step, a chunked prefill) pass diagonal_alignment=\"bottom_right\" "
        "(causal(alignment=\"bottom_right\") in the native API): keys j <= i + S - T",
        TopLeftCausalWarning, stacklevel=4)
