"""The documents' Python blocks on the GPU machine: every block of README.md and DESIGN.md in order, the blocks
marked ``# gpu`` among them (tests/docs_blocks.py says how they run; the CPU run is tests/test_docs.py).  A block
passes when it runs as written; the CuPy and torch blocks print their difference from the NumPy reference."""

from __future__ import annotations

import pytest

from docs_blocks import DOCUMENTS, blocks, run  # noqa: I001 -- tests/ is on sys.path (tests/conftest.py's folder)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_python_block_runs_on_the_gpu(document):
    assert any(block.gpu for block in blocks("README.md")), "README.md has no # gpu block"
    failures = run(document, gpu=True)
    assert not failures, "blocks that fail as written on the GPU:\n" + "\n".join(failures)
