"""Reading the library's on/off environment variables, one rule for all of them.

``1``/``true``/``yes``/``on`` turn a flag on, ``0``/``false``/``no``/``off`` turn it off (any case, spaces
ignored); unset, empty or anything else leaves the flag's default.
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
