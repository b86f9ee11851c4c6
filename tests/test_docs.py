"""The documents are code: README.md's and DESIGN.md's Python blocks run (tests/docs_blocks.py says how; the blocks
marked ``# gpu`` run in the GPU tier, tests/gpu/test_docs_gpu.py), every ``cudnn_attn.…`` name and repository
path they mention exists, the README names both test commands, and the API reference builds
(scripts/api_reference.py, pdoc) without a warning.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys

import pytest
from docs_blocks import DOCUMENTS, ROOT, blocks, run

MENTIONED_IN = DOCUMENTS + ("CHANGELOG.md",)       # the changelog's names are checked as paths only (old names stay)
_NAME = re.compile(r"(?<![\w.])cudnn_attn(?:\.[A-Za-z_]\w*)+")
_PATH = re.compile(r"(?<![\w/.$~-])((?:cudnn_attn|graphs|jax_bridge|tests|scripts|benchmarks|examples|\.ci)/[\w./-]*"
                   r"|(?:README|DESIGN|CHANGELOG)\.md\b|pyproject\.toml)")
_HAS_TORCH = importlib.util.find_spec("torch") is not None


@pytest.mark.parametrize("document", DOCUMENTS)
def test_the_python_blocks_run_on_cpu(document):
    assert document != "README.md" or blocks(document), "README.md has no Python block"
    failures = run(document, gpu=False)
    assert not failures, "blocks that fail as written:\n" + "\n".join(failures)


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as error:
            if error.name and not dotted.startswith(error.name):
                raise                               # a missing dependency of an existing module
            continue
        for part in parts[cut:]:
            found = getattr(found, part)
        return found
    raise ModuleNotFoundError(dotted)


def _names(document: str) -> list[str]:
    return sorted(set(_NAME.findall((ROOT / document).read_text())))


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_dotted_name_exists(document):
    missing = []
    for name in _names(document):
        if name.startswith("cudnn_attn.torch") and not _HAS_TORCH:
            continue                                # needs torch (the Python 3.11 environment checks these)
        try:
            _resolve(name)
        except (ImportError, AttributeError) as error:
            missing.append(f"{name} ({type(error).__name__}: {error})")
    assert not missing, f"{document} names what does not exist:\n" + "\n".join(missing)


def _paths(document: str) -> list[str]:
    text = (ROOT / document).read_text()
    found = set()
    for match in _PATH.finditer(text):
        path = match.group(1).rstrip(".")
        if text[match.end():match.end() + 1] in ("*", "{") or "*" in path:
            continue                                # a pattern (tests/test_jax_*.py), not a path
        found.add(path)
    return sorted(found)


@pytest.mark.parametrize("document", MENTIONED_IN)
def test_every_repository_path_exists(document):
    if not (ROOT / document).exists():
        pytest.fail(f"{document} is missing")
    missing = [path for path in _paths(document) if not (ROOT / path).exists()]
    assert not missing, f"{document} names paths that do not exist: {missing}"


def test_the_readme_names_both_test_commands_and_ci_runs_the_matrix():
    readme = (ROOT / "README.md").read_text()
    assert "./scripts/test.sh " in readme or "./scripts/test.sh`" in readme or "./scripts/test.sh\n" in readme
    assert "./scripts/test.sh --all" in readme
    commands = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))]
    assert commands == ["./scripts/test.sh --all"], commands


def test_the_api_reference_builds_without_a_warning(tmp_path):
    pytest.importorskip("pdoc", reason="the API reference needs pdoc (pip install -e '.[test]')")
    spec = importlib.util.spec_from_file_location("api_reference", ROOT / "scripts" / "api_reference.py")
    reference = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("api_reference", reference)
    spec.loader.exec_module(reference)
    problems = reference.problems(tmp_path)
    assert not problems, "the API reference is broken:\n" + "\n".join(problems)
    index = (tmp_path / "cudnn_attn.html").read_text()
    for name in ("attention", "dot_product_attention", "paged_attention", "bind", "GraphCache", "causal", "padding"):
        assert f'id="{name}"' in index, f"the reference's cudnn_attn page has no {name}"
    bridge = (tmp_path / "cudnn_attn" / "jax_bridge.html").read_text()
    assert 'id="flax_attention_fn"' in bridge and 'id="dot_product_attention_nn"' in bridge
    assert 'id="PARAMETERS"' in (tmp_path / "cudnn_attn" / "core" / "parameters.html").read_text()


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but ``-`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_anchor_link_names_a_heading(document):
    text = (ROOT / document).read_text()
    headings = {_slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#") and " " in line}
    broken = sorted({anchor for anchor in re.findall(r"\]\(#([\w-]+)\)", text) if anchor not in headings})
    assert not broken, f"{document} links to no heading: {broken}"
