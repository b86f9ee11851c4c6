"""The rules for the library's environment variables (:func:`cudnn_attn.core.settings.flag`, :func:`cudnn_attn.core.settings.count`)."""

from __future__ import annotations

import pytest

from cudnn_attn.core.settings import count, flag


@pytest.mark.parametrize("value, default, expected", [
    ("1", False, True), (" TRUE ", False, True), ("yes", False, True), ("On", False, True),
    ("0", True, False), ("false", True, False), (" no", True, False), ("OFF", True, False),
    ("", True, True), ("", False, False), ("2", True, True), ("2", False, False), (None, True, True),
])
def test_flag(value, default, expected):
    environ = {} if value is None else {"CUDNN_ATTN_X": value}
    assert flag("CUDNN_ATTN_X", default, environ) is expected


@pytest.mark.parametrize("value, expected", [(None, 64), ("", 64), (" ", 64), ("0", 0), (" 8 ", 8), ("128", 128)])
def test_count(value, expected):
    environ = {} if value is None else {"CUDNN_ATTN_N": value}
    assert count("CUDNN_ATTN_N", 64, environ) == expected


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "1e3", "\u00b2"])
def test_count_refuses_what_is_not_a_non_negative_integer_naming_the_variable(value):
    with pytest.raises(ValueError, match=r"\$CUDNN_ATTN_N: expected a non-negative integer"):
        count("CUDNN_ATTN_N", 64, {"CUDNN_ATTN_N": value})


def test_a_bad_replay_bound_fails_the_import_with_the_variables_name():
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import cudnn_attn.engine.replay"], capture_output=True, text=True,
                          env={**os.environ, "CUDNN_ATTN_REPLAY_GRAPHS": "many"})
    assert done.returncode != 0 and "$CUDNN_ATTN_REPLAY_GRAPHS: expected a non-negative integer" in done.stderr
