"""The GPU a call on a CPU front is held to: what that GPU's cuDNN path would refuse, the CPU refuses too.

The NumPy reference's public functions (:mod:`cudnn_attn.reference`'s ``attention``,
``dot_product_attention``, ``paged_attention``, ``dot_product_attention_bwd``) and the JAX bridge on CPU
check every call against the support table (:mod:`.support`) for this target, the rows of the front the
call would run on there (the reference: the CuPy front; the JAX bridge: its cuDNN target), after the
library's lifts (:mod:`.padded_call`: what a lift serves runs on the GPU).  So a call developed on a laptop
runs on the GPU, or fails on the laptop with the GPU's reasons.

``$CUDNN_ATTN_CPU_TARGET`` names the target, read on every check (:func:`target`):

* unset, empty or ``sm90``: compute capability 9.0 (the H200) with the installed cuDNN, 9.19.0 when none loads;
* ``smXY`` (``sm80``, ``sm100``, ``sm103``, ...), optionally with a cuDNN version: ``sm100:9.13`` or
  ``sm100:91300``;
* ``off``: no target; the reference refuses only what no front runs (the exact, unrestricted oracle).

The core functions :func:`cudnn_attn.reference.forward` / :func:`~cudnn_attn.reference.backward` never
check a target: they are the oracle the tests compare against.
"""

from __future__ import annotations

import functools
import re
from typing import Mapping

from . import settings
from .config import AttentionConfig
from .environment import Environment, cudnn_version
from .errors import UnsupportedConfigurationError
from .padded_call import lifted_config
from .support import not_supported_reasons

VARIABLE = settings.CPU_TARGET
DEFAULT_CUDNN = 91900           # the target's cuDNN when none loads here: 9.19.0
_OFF = ("off", "none", "0")
_PATTERN = re.compile(r"sm(\d+)(\d)(?::(\d+)(?:\.(\d+)(?:\.(\d+))?)?)?")


def target(environ: Mapping[str, str] | None = None) -> Environment | None:
    """The target of ``$CUDNN_ATTN_CPU_TARGET`` (module doc), ``None`` for ``off``.

    Raises:
        ValueError: a value that is none of the module doc's forms (naming the variable).
    """
    return _parse(settings.cpu_target() if environ is None else settings.cpu_target(environ))


@functools.lru_cache(maxsize=8)
def _parse(value: str) -> Environment | None:
    if value in _OFF:
        return None
    found = _PATTERN.fullmatch(value or "sm90")
    if found is None:
        raise ValueError(f"${VARIABLE}: expected 'sm90', 'smXY', 'smXY:9.19' (a cuDNN version) or 'off', "
                         f"got {value!r}")
    major, minor, version, *rest = found.groups()
    if version is None:
        cudnn = cudnn_version() or DEFAULT_CUDNN
    elif rest[0] is None:
        cudnn = int(version)
    else:
        cudnn = int(version) * 10000 + int(rest[0]) * 100 + int(rest[1] or 0)
    name = f"the CPU fronts' target ${VARIABLE}={value or 'sm90'}; 'off' runs the reference unrestricted"
    return Environment(cudnn, (int(major), int(minor)), name)


def check(config: AttentionConfig, *, kind: str, front: str) -> None:
    """Raise :class:`~.errors.UnsupportedConfigurationError` when ``front`` on the target GPU would refuse the
    ``kind`` graph of ``config`` (after the library's lifts); nothing with ``$CUDNN_ATTN_CPU_TARGET=off``."""
    env = target()
    if env is None:
        return
    reasons = not_supported_reasons(lifted_config(config) or config, env, kind=kind, front=front)
    if reasons:
        raise UnsupportedConfigurationError(reasons, config, env)
