"""The one rule for the library's on/off environment variables (:func:`cudnn_attn.env.flag`)."""

from __future__ import annotations

import pytest

from cudnn_attn.env import flag


@pytest.mark.parametrize("value, default, expected", [
    ("1", False, True), (" TRUE ", False, True), ("yes", False, True), ("On", False, True),
    ("0", True, False), ("false", True, False), (" no", True, False), ("OFF", True, False),
    ("", True, True), ("", False, False), ("2", True, True), ("2", False, False), (None, True, True),
])
def test_flag(value, default, expected):
    environ = {} if value is None else {"CUDNN_ATTN_X": value}
    assert flag("CUDNN_ATTN_X", default, environ) is expected
