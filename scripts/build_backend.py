"""The build backend (pyproject.toml's ``build-backend``): setuptools' own, with one notice of its editable
builds left out.

setuptools installs this project editable through a meta path finder, because ``cudnn_attn.graphs`` and
``cudnn_attn.jax_bridge`` come from the folders ``graphs/`` and ``jax_bridge/`` (``package-dir``).  That strategy
always ends with the notice "Editable installation. Please be careful with folders in your working directory
with the same name as your package as they may take precedence during imports" (a ``setuptools.warnings.
InformationOnly``), which pip prints as a warning.  Here the folder with the package's name is the package's own
source, so nothing can take precedence over it: the notice is filtered out of ``build_editable`` alone, and every
other message of setuptools is kept.
"""

from __future__ import annotations

import warnings
from typing import Any

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every hook of setuptools' backend)
from setuptools.warnings import InformationOnly


def build_editable(wheel_directory: str, config_settings: Any = None, metadata_directory: Any = None) -> str:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Editable installation", category=InformationOnly)
        return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
