"""The rules for the library's environment variables (:func:`cudnn_attn.core.settings.flag`,
:func:`cudnn_attn.core.settings.count`), and :mod:`cudnn_attn.core.settings` as the library's one reader of the
environment."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from cudnn_attn.core import cpu_target, settings
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


# -- one reader of the environment ----------------------------------------------------------------------

_ROOT = Path(__file__).resolve().parent.parent
_LIBRARY = ("cudnn_attn", "graphs", "jax_bridge")
_SETTINGS = _ROOT / "cudnn_attn" / "core" / "settings.py"
_OS_ENVIRONMENT = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _library_sources() -> list[Path]:
    return [path for folder in _LIBRARY for path in sorted((_ROOT / folder).rglob("*.py")) if path != _SETTINGS]


def test_the_environment_is_read_in_core_settings_alone():
    """No library module but :mod:`cudnn_attn.core.settings` reads the process environment: ``os.environ``,
    ``os.getenv`` and their kin, however imported (an alias of ``os``, ``from os import environ``)."""
    found = []
    for path in _library_sources():
        tree = ast.parse(path.read_text())
        aliases = {"os"} | {a.asname for node in ast.walk(tree) if isinstance(node, ast.Import)
                            for a in node.names if a.name == "os" and a.asname}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in _OS_ENVIRONMENT and \
                    isinstance(node.value, ast.Name) and node.value.id in aliases:
                found.append(f"{path.relative_to(_ROOT)}:{node.lineno}: {node.value.id}.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "os":
                found += [f"{path.relative_to(_ROOT)}:{node.lineno}: from os import {a.name}"
                          for a in node.names if a.name in _OS_ENVIRONMENT]
    assert not found, "read the environment in cudnn_attn/core/settings.py:\n" + "\n".join(found)


def test_every_variable_name_is_a_constant_of_core_settings():
    """A ``"CUDNN_ATTN_..."`` string in code (not a docstring) outside :mod:`cudnn_attn.core.settings` names a
    variable that module does not own."""
    owned = {value for name, value in vars(settings).items() if name.isupper() and isinstance(value, str)}
    found = []
    for path in _library_sources():
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        found += [f"{path.relative_to(_ROOT)}:{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                  and re.fullmatch(r"CUDNN_ATTN_[A-Z0-9_]+", node.value)]
    assert not found, "name the variable through cudnn_attn.core.settings:\n" + "\n".join(found)
    assert settings.CPU_TARGET in owned


def test_the_cpu_target_is_read_through_settings(monkeypatch):
    monkeypatch.setenv(settings.CPU_TARGET, " SM80:9.19 ")
    assert settings.cpu_target() == "sm80:9.19"
    assert cpu_target.target().compute_capability == (8, 0)
    monkeypatch.setenv(settings.CPU_TARGET, "off")
    assert cpu_target.target() is None
