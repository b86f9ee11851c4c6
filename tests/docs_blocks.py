"""The Python blocks of README.md and DESIGN.md, and how they run (tests/test_docs.py on CPU, the GPU tier's
tests/gpu/test_docs_gpu.py on the GPU machine).

Every block fenced as ```` ```python ```` is code.  The blocks of one document run top to bottom in one namespace,
as the cells of a notebook: a block may use the names an earlier block defined.  A block whose first line is a
``# gpu`` comment (``# gpu: why``) needs an NVIDIA GPU: the CPU run leaves it out (so no CPU block may use what a
GPU block defines), the GPU tier runs every block.  A block whose first line is ``# torch`` needs torch (CPU
tensors run the NumPy reference): it runs wherever torch is installed (CI's Python 3.11 environment, the GPU
machine).  A block whose first line is ``# devices: N`` shards over N devices: it runs where JAX has at least N
(CI's 8 CPU devices; on a one-GPU machine it is left out).  Warnings of this library (``TopLeftCausalWarning``, ...) fail
the block: a snippet that warns teaches the wrong call.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", "DESIGN.md")
GPU_MARK = re.compile(r"^#\s*gpu\b")
TORCH_MARK = re.compile(r"^#\s*torch\b")
DEVICES_MARK = re.compile(r"^#\s*devices:\s*(\d+)")
_FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    document: str
    line: int                # the first code line, 1-based
    source: str

    @property
    def gpu(self) -> bool:
        return bool(GPU_MARK.match(self.source))

    @property
    def torch(self) -> bool:
        return bool(TORCH_MARK.match(self.source))

    @property
    def devices(self) -> int:
        found = DEVICES_MARK.match(self.source)
        return int(found.group(1)) if found else 1

    def where(self) -> str:
        return f"{self.document}:{self.line}"


def blocks(document: str) -> list[Block]:
    """The ```python blocks of ``document`` (a path relative to the repository), in order."""
    found, language, start, lines = [], None, 0, []
    for number, text in enumerate((ROOT / document).read_text().splitlines(), 1):
        fence = _FENCE.match(text)
        if language is None:
            if fence:
                language, start, lines = fence.group(1), number + 1, []
        elif fence and not fence.group(1):
            if language == "python":
                found.append(Block(document, start, "\n".join(lines) + "\n"))
            language = None
        else:
            lines.append(text)
    assert language is None, f"{document}: a fence opened at line {start - 1} is never closed"
    return found


def run(document: str, *, gpu: bool) -> list[str]:
    """Run ``document``'s blocks in order (the GPU-only ones too when ``gpu``); the blocks that failed, each as
    ``"README.md:26: ValueError: ..."`` (empty: all ran).  A failed block's names stay undefined for the next."""
    import cudnn_attn

    namespace: dict = {"__name__": f"docs:{document}"}
    failures = []
    has_torch = importlib.util.find_spec("torch") is not None
    for block in blocks(document):
        if (block.gpu and not gpu) or (block.torch and not has_torch):
            continue
        if block.devices > 1:
            import jax

            if jax.device_count() < block.devices:
                continue
        try:
            code = compile("\n" * (block.line - 1) + block.source, str(ROOT / document), "exec")
            with warnings.catch_warnings():
                warnings.simplefilter("error", cudnn_attn.TopLeftCausalWarning)
                exec(code, namespace)  # noqa: S102 -- the documents' code is what this runs
        except Exception as error:  # noqa: BLE001 -- every failure is reported with its block
            failures.append(f"{block.where()}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
    return failures
