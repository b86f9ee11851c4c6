"""``examples/graph_cache.ipynb`` runs top to bottom and shows what it says it shows.

The notebook is executed by a real Jupyter kernel (nbclient, ipykernel).  Without a GPU it builds deviceless
H200 plans (a stub ``libcuda.so.1``, the H200's device properties) and computes results with the NumPy reference;
it is skipped, with the reason, where deviceless planning is impossible (no cuDNN wheel, no C compiler).  Every
cell has a time limit (nbclient's ``timeout``), so a hung kernel fails the test instead of stalling CI.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cudnn_attn.core.environment import cudnn_version
from cudnn_attn.engine import runtime
from cudnn_attn.graphs import driver_stub

nbformat = pytest.importorskip("nbformat", reason="the notebook test needs nbformat (pip install 'cudnn-attn[test]')")
nbclient = pytest.importorskip("nbclient", reason="the notebook test needs nbclient (pip install 'cudnn-attn[test]')")
pytest.importorskip("ipykernel", reason="the notebook test needs ipykernel (pip install 'cudnn-attn[test]')")

NOTEBOOK = Path(__file__).resolve().parent.parent / "examples" / "graph_cache.ipynb"
CELL_SECONDS = 300          # the slowest cell builds three deviceless plans: 2.5-5.5 s each on the 2-core CI host

pytestmark = pytest.mark.slow


def _can_plan() -> str | None:
    """Why the notebook cannot plan here (``None``: it can)."""
    if runtime.is_gpu_available() or driver_stub.real_driver_present():
        return None
    if driver_stub.cudnn_library_dir() is None:
        return "no GPU and no cuDNN wheel to plan deviceless with (pip install 'cudnn-attn[cudnn]')"
    if cudnn_version() is None:
        return "the cuDNN frontend cannot load libcudnn here (cudnn.backend_version() fails)"
    if driver_stub.c_compiler() is None:
        return "no GPU and no C compiler to build the stub libcuda.so.1 with"
    return None


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    reason = _can_plan()
    if reason:
        pytest.skip(f"the graph-cache notebook: {reason}")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=CELL_SECONDS, startup_timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path_factory.mktemp("notebook"))}})
    client.execute()
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


def _text(cell) -> str:
    """What a cell printed on stdout or displayed, as text (stderr carries the kernel's warnings and logs)."""
    parts = []
    for output in cell.get("outputs", []):
        if output.output_type == "stream" and output.name == "stdout":
            parts.append(output.text)
        elif output.output_type in ("execute_result", "display_data"):
            parts.append(output.data.get("text/plain", ""))
    return "\n".join(parts)


def _html(cell) -> str:
    return "\n".join(o.data.get("text/html", "") for o in cell.get("outputs", [])
                     if o.output_type in ("execute_result", "display_data"))


def _cell(executed, source_part: str):
    found = [c for c in executed if source_part in c.source]
    assert len(found) == 1, f"{len(found)} cells contain {source_part!r}"
    return found[0]


def test_it_says_whether_it_runs_on_a_gpu(executed):
    first = _text(executed[0])
    if runtime.is_gpu_available():
        assert first.startswith("GPU: ") and "builds and runs every graph on it" in first
    else:
        assert first.startswith("No GPU here: this notebook runs without one.")
        assert "deviceless" in first and "NumPy reference" in first


def test_a_build_then_a_hit(executed):
    cell = _cell(executed, '"fwd", 0)       # a miss: built')
    assert "GraphCache: 1/2 graphs, 1 hits, 1 misses, 0 evictions" in _text(cell)
    page = _html(cell)
    assert 'class="cudnn-attn-cache"' in page and "nothing cached" in page and page.count("<tr>") == 4


def test_a_miss_names_its_reason(executed):
    text = _text(_cell(executed, "longer = config.replace"))
    reason = r"^#1: T 512→513, S 512→513 differs from entry #0; built \d+\.\d\d s$"
    assert re.search(reason, text, re.MULTILINE), text


def test_the_entry_detail_and_dump_of_a_built_graph(executed):
    detail = _text(_cell(executed, "cache.entry_detail(1)"))
    assert re.search(r"^origin +built$", detail, re.MULTILINE), detail
    assert re.search(r"^engine +engine \d+$", detail, re.MULTILINE), detail
    assert re.search(r"^workspace +\d", detail, re.MULTILINE) and "no compiled JAX program" in detail
    assert "<caption>graph cache entry #1</caption>" in _html(_cell(executed, "cache.entry_detail(1)"))
    dump = _text(_cell(executed, "cache.dump(1)"))
    assert dump.startswith("# fwd float16 BTNH B=1 N=4 T=513 S=513 d=64 mask=causal")
    assert '"nodes": [' in dump and '"nodes": []' not in dump and "sdpa" in dump.lower()


def test_an_eviction_loop_misses_every_step_and_loads_from_the_store(executed):
    cell = _cell(executed, "for step in range(2)")
    text = _text(cell)
    assert "misses=6, evictions=4" in text
    rows = [line for line in text.splitlines() if re.match(r"^\d+ +fwd ", line)]
    assert len(rows) == 6 and all("was cached, evicted earlier" in r and "loaded" in r for r in rows[3:]), text
    assert "mask causal→none differs from entry #0" in rows[2]
    loaded = _text(_cell(executed, "cache.entry_detail(cache.entries()[-1].index)"))
    assert re.search(r"^origin +loaded$", loaded, re.MULTILINE)


def test_the_plan_store_lists_the_three_plans(executed):
    cell = _cell(executed, '"cache", "list"')
    lines = [line for line in _text(cell).strip().splitlines() if re.match(r"^\d+ ", line)]
    assert len(lines) == 3 and all("fwd float16" in line and "sm90" in line for line in lines), cell.outputs


def test_it_calls_only_public_names_and_leaves_no_folder_behind(executed):
    code = "\n".join(cell.source for cell in executed)
    internal = re.findall(r"cudnn_attn\.(?:core|engine|persist|fronts|tools)\b|from cudnn_attn\.graphs\.\w", code)
    assert not internal, internal
    removed = re.search(r"^removed (\S+)$", _text(executed[-1]), re.MULTILINE)
    assert removed and "cudnn_attn-notebook-" in removed.group(1) and not Path(removed.group(1)).exists()


def test_results_and_the_jax_program(executed):
    result = _text(_cell(executed, "reference.dot_product_attention"))
    assert "output (1, 512, 4, 64)" in result
    jax_cell = _text(_cell(executed, "@jax.jit"))
    error = float(re.search(r"relative error against the reference (\S+)", jax_cell).group(1))
    assert error <= 2e-3, jax_cell                     # the GPU tier's float16 bound (tests/gpu/_checks.py); 0 on CPU
    if runtime.is_gpu_available():
        error = float(re.search(r"cuDNN on the GPU: relative error against the reference (\S+)", result).group(1))
        assert error <= 2e-3, result
    else:
        assert "NumPy reference (no GPU)" in result
    if not runtime.is_gpu_available():
        assert "no cuDNN plan is held by a compiled JAX program (no GPU" in jax_cell
    else:
        assert "JAX call site" in jax_cell and "live executable(s)" in jax_cell
