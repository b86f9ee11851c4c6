"""The library's settings: every ``CUDNN_ATTN_*`` environment variable and every switch, in one object.

:data:`current` is a :class:`Settings`, read from the environment when :mod:`cudnn_attn` is imported; the modules
that act on a setting read it from there when they act (``settings.current.replay``).  Tests and benchmarks change
settings for a block with :func:`override`.  Three variables are read at each use instead, because a program may
set them after the import: ``CUDNN_ATTN_CHECK_VALUES`` (:func:`check_values`), ``CUDNN_ATTN_CACHE_DIR``
(:func:`cache_location`, for :mod:`cudnn_attn.persist.store`) and ``CUDNN_ATTN_CPU_TARGET`` (:func:`cpu_target`,
for :mod:`cudnn_attn.core.cpu_target`).  This module is the library's one reader of the environment: the other
variables it reads for others are ``XDG_CACHE_HOME`` and ``HOME`` (the plan store's default folder) and ``CC``
(the compiler of the deviceless driver stub); ``tests/test_env.py`` fails on an ``os.environ`` anywhere else.

Variables, one rule for each kind: on/off (:func:`flag`) - ``1``/``true``/``yes``/``on`` turn a flag on,
``0``/``false``/``no``/``off`` turn it off (any case, spaces ignored); unset, empty or anything else leaves the
flag's default.  Counts (:func:`count`) - a non-negative integer; unset or empty leaves the default, anything else
is a ``ValueError`` naming the variable.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Iterator, Mapping

AUTOTUNE = "CUDNN_ATTN_AUTOTUNE"
CACHE_DIR = "CUDNN_ATTN_CACHE_DIR"
CHECK_VALUES = "CUDNN_ATTN_CHECK_VALUES"
CPU_TARGET = "CUDNN_ATTN_CPU_TARGET"
PRELOAD = "CUDNN_ATTN_PRELOAD"
PRELOAD_ENGINES = "CUDNN_ATTN_PRELOAD_ENGINES"
REPLAY = "CUDNN_ATTN_REPLAY"
REPLAY_GRAPHS = "CUDNN_ATTN_REPLAY_GRAPHS"

_ON = ("1", "true", "yes", "on")
_OFF = ("0", "false", "no", "off")


def flag(name: str, default: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """The value of the on/off environment variable ``name`` (see the module doc)."""
    value = environ.get(name, "").strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    return default


def count(name: str, default: int, environ: Mapping[str, str] = os.environ) -> int:
    """The value of the count environment variable ``name`` (see the module doc)."""
    value = environ.get(name, "").strip()
    if not value:
        return default
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"${name}: expected a non-negative integer, got {environ[name]!r}")
    return int(value)


@dataclass(frozen=True)
class Settings:
    """Every switch of the library (see the module doc)."""

    autotune: bool = False
    """What ``autotune=None`` (every call's default, :func:`cudnn_attn.bind` included) means: ``$CUDNN_ATTN_AUTOTUNE``,
    for a program whose calls cannot pass ``autotune=True`` (a training script, a third-party model)."""
    replay: bool = True
    """Whether plans replay repeated launches as CUDA graphs (``$CUDNN_ATTN_REPLAY``; :mod:`cudnn_attn.engine.replay`)."""
    replay_graphs: int = 64
    """Replay graphs kept per device over all plans (``$CUDNN_ATTN_REPLAY_GRAPHS``)."""
    replay_graphs_per_plan: int = 16
    """Replay graphs kept per plan."""
    replay_patience: int = 32
    """Captures after which a plan whose graphs are replayed fewer times than captured stops capturing."""
    replay_recycle: bool = True
    """Whether a plan at its bound updates its least recently used graph in place (``False``: destroys it and
    instantiates a new one)."""
    preload: bool = True
    """Whether ``import cudnn_attn`` imports the cuDNN frontend on a thread (``$CUDNN_ATTN_PRELOAD``;
    :mod:`cudnn_attn.engine.preload`)."""
    preload_engines: bool = True
    """Whether that thread also loads cuDNN's engine libraries (``$CUDNN_ATTN_PRELOAD_ENGINES``)."""

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> "Settings":
        """The settings the environment gives (a bad count raises ``ValueError`` naming its variable)."""
        return cls(autotune=flag(AUTOTUNE, False, environ), replay=flag(REPLAY, True, environ),
                   replay_graphs=count(REPLAY_GRAPHS, 64, environ), preload=flag(PRELOAD, True, environ),
                   preload_engines=flag(PRELOAD_ENGINES, True, environ))


current = Settings.from_environment()
"""The process's settings (read when the library is imported)."""


@contextlib.contextmanager
def override(**changes: object) -> Iterator[Settings]:
    """``current`` with ``changes`` for the block (tests, benchmarks); unknown names raise ``TypeError``."""
    global current
    before = current
    current = dataclasses.replace(before, **changes)
    try:
        yield current
    finally:
        current = before


def check_values(environ: Mapping[str, str] = os.environ) -> bool:
    """``$CUDNN_ATTN_CHECK_VALUES`` now: the checked mode for every call that does not say (read at each use)."""
    return flag(CHECK_VALUES, False, environ)


def cpu_target(environ: Mapping[str, str] = os.environ) -> str:
    """``$CUDNN_ATTN_CPU_TARGET`` now, stripped and lower case (empty when unset; read at each use; its forms are
    :mod:`cudnn_attn.core.cpu_target`'s)."""
    return environ.get(CPU_TARGET, "").strip().lower()


def cache_location(environ: Mapping[str, str] = os.environ) -> tuple[str | None, str | None, str | None]:
    """``($CUDNN_ATTN_CACHE_DIR, $XDG_CACHE_HOME, $HOME)`` now, ``None`` where unset: what decides the plan
    store's folder (:func:`cudnn_attn.persist.store.default_directory`; read at each use)."""
    return environ.get(CACHE_DIR), environ.get("XDG_CACHE_HOME"), environ.get("HOME")


def c_compiler(environ: Mapping[str, str] = os.environ) -> str | None:
    """``$CC``: the C compiler asked for the deviceless driver stub (:mod:`cudnn_attn.graphs.driver_stub`)."""
    return environ.get("CC")
