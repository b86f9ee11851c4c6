"""Reading the library's environment variables, one rule for each kind.

On/off (:func:`flag`): ``1``/``true``/``yes``/``on`` turn a flag on, ``0``/``false``/``no``/``off`` turn it off
(any case, spaces ignored); unset, empty or anything else leaves the flag's default.  Counts (:func:`count`): a
non-negative integer; unset or empty leaves the default, anything else is a ``ValueError`` naming the variable.
"""

from __future__ import annotations

import os
from typing import Mapping

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
