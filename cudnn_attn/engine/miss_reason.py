"""Why a graph-cache lookup missed: the fields in which its key differs from the nearest cached key.

A graph is keyed by its :class:`~cudnn_attn.core.config.AttentionConfig` and a few key fields (kind, device,
cuDNN version, plan choice, ``rng_dump``).  :func:`difference` names the fields in which two keys differ, in the
names a user knows (``B``, ``T``, ``S``, ``N``, ``K``, ``H``, ``Hv``, ``dtype``, ``layout``, ``mask``, ``scale``,
...), each as ``old→new``; :func:`nearest` picks the cached key that differs in the fewest fields.  Only the
miss path calls them (the hit path is one dictionary lookup).
"""

from __future__ import annotations

import enum
from typing import Any, Iterable, Sequence

from cudnn_attn.core.config import AttentionConfig

CONFIG_NAMES = {
    "batch": "B", "q_len": "T", "kv_len": "S", "q_heads": "N", "kv_heads": "K", "qk_dim": "H", "v_dim": "Hv",
    "dtype": "dtype", "layout": "layout", "scale": "scale", "mask": "mask", "bias": "bias",
    "dropout_rate": "dropout", "packing": "packing", "paging": "paging", "score_mod": "score_mod", "sink": "sink",
    "training": "training", "deterministic": "deterministic", "score_max": "score_max",
    "device_seed": "device_seed",
}
""":class:`AttentionConfig` field -> the name the listing and the miss reasons use (the config module's naming)."""

KEY_NAMES = {"kind": "kind", "device": "device", "cudnn_version": "cuDNN", "plan": "plan", "rng_dump": "rng_dump"}
""":class:`~cudnn_attn.engine.cache.GraphKey` fields besides the configuration -> their names in a miss reason."""


def _show(name: str, value: Any) -> str:
    if value is None:
        return "none"
    if name == "mask":
        return value.describe()
    if name == "bias":
        return "x".join(map(str, value.shape)) + ("+dbias" if value.differentiable else "")
    if name == "packing":
        return f"M={value.max_segments}"
    if name == "paging":
        return f"bs={value.block_size} blocks={value.num_blocks_k}/{value.num_blocks_v} per_seq={value.blocks_per_seq}"
    if name == "score_mod":
        return f"{value.name}@{value.digest[:8]}"
    if isinstance(value, enum.Enum):
        return value.name if isinstance(value.value, int) else str(value.value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _fields(key: Any) -> dict[str, Any]:
    """The named fields of a graph key: the configuration's, then the key's own."""
    config: AttentionConfig = key.config
    named = {shown: getattr(config, field) for field, shown in CONFIG_NAMES.items()}
    named.update({shown: getattr(key, field) for field, shown in KEY_NAMES.items()})
    return named


def difference(old: Any, new: Any) -> list[str]:
    """``["T 1024→1025", "mask none→causal", ...]``: every field in which key ``new`` differs from ``old``."""
    before, after = _fields(old), _fields(new)
    return [f"{name} {_show(name, before[name])}→{_show(name, after[name])}"
            for name in after if before[name] != after[name]]


def nearest(key: Any, candidates: Iterable[tuple[int, Any]]) -> tuple[int, list[str]] | None:
    """``(number, difference)`` of the candidate ``(number, key)`` whose key differs from ``key`` in the fewest
    fields (the most recent one of equals: candidates come least recently used first), or ``None`` without any."""
    best: tuple[int, list[str]] | None = None
    for number, other in candidates:
        found = difference(other, key)
        if best is None or len(found) <= len(best[1]):
            best = (number, found)
    return best


def describe(changes: Sequence[str]) -> str:
    """The changes as one phrase: ``"T 1024→1025"``, ``"T 1024→1025, S 1024→1025"``."""
    return ", ".join(changes) if changes else "no field"
