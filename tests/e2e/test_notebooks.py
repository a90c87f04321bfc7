"""The Colab notebooks execute top to bottom (GSPO_JAX_NOTEBOOK_QUICK=1: tiny settings).

colabs/gspo_vs_grpo.ipynb runs `python -m experiments.gspo_vs_grpo --quick` on the
dense arms, so this also tests the experiment command end to end (runs, markdown, plots).
"""

import os
import pathlib

import pytest
from helpers import CPU_TEST_FLAGS

nbclient = pytest.importorskip("nbclient", reason="requirements-test.txt: nbclient")
nbformat = pytest.importorskip("nbformat", reason="requirements-test.txt: nbformat")

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["quickstart.ipynb", "gspo_vs_grpo.ipynb"])
def test_notebook_executes(name, monkeypatch, tmp_path):
    monkeypatch.setenv("GSPO_JAX_NOTEBOOK_QUICK", "1")
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the notebooks' fresh workdirs land here
    monkeypatch.setenv("XLA_FLAGS", CPU_TEST_FLAGS)  # one CPU device, as in Colab
    path = ROOT / "colabs" / name
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    errors = [
        out
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    assert not errors
    text = "".join(
        out.get("text", "") + str(out.get("data", {}).get("text/plain", ""))
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )
    if name == "quickstart.ipynb":
        assert "update 0: ratio [1.00000, 1.00000]" in text  # on-policy first update
        assert "->" in text  # sampled answers printed
    else:
        written = list(tmp_path.glob("gspo_vs_grpo_*/results.md"))
        assert len(written) == 1
        results = written[0].read_text()
        assert "| GSPO (dense) |" in results and "| GRPO (dense) |" in results
        assert (written[0].parent / "results" / "gspo_vs_grpo_dense.png").exists()
    assert os.environ["GSPO_JAX_NOTEBOOK_QUICK"] == "1"
