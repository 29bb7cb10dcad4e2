"""notebooks/train.ipynb runs top to bottom: tiny model -> dataset -> config -> 2-worker CPU training ->
report -> export -> generation, in a temporary folder, leaving the repository as it was."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "train.ipynb"
# Where a careless demo would write inside the checkout.
WATCHED = ("data", "build", "outputs", "notebooks", "unsloth_compiled_cache")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def snapshot() -> dict[str, float]:
    """Every file under the watched folders of the repository, with its modification time."""
    files = {}
    for top in WATCHED:
        for path in (REPO / top).rglob("*"):
            if path.is_file():
                files[str(path.relative_to(REPO))] = path.stat().st_mtime
    return files


def cell_text(nb, needle: str) -> str:
    """The stdout text of the first code cell whose source contains `needle`."""
    cell = next(c for c in nb.cells if c.cell_type == "code" and needle in c.source)
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream" and o.name == "stdout")


def test_notebook_runs_end_to_end(tmp_path, monkeypatch):
    work = tmp_path / "demo"
    monkeypatch.setenv("HYPERSLOTH_DEMO_DIR", str(work))  # the kernel inherits this environment
    before = snapshot()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # kernel "python3" runs `python -m ipykernel_launcher`; jupyter_client swaps `python` for
    # sys.executable, so the kernel runs in this virtualenv (checked below).
    client = NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()

    assert f"python: {sys.executable}" in cell_text(nb, "print(f\"python:")
    summary = json.loads((work / "outputs" / "tiny-demo" / "train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 30 and len(summary["step_losses"]) == 30
    assert summary["padding_pct"] == 0.0 and summary["random_padding_pct"] > 10  # packed rows never pad
    # The eval curve: 10% of the chats held out, evaluated every 5 steps over both workers.
    assert [e["step"] for e in summary["eval"]] == [5, 10, 15, 20, 25, 30]
    assert summary["eval_set"]["num_rows"] == 40 and summary["best_eval"]["adapter"].endswith("best_adapter")
    assert "best eval_loss" in cell_text(nb, "format_console(summary)")
    assert (work / "outputs" / "tiny-demo" / "report.md").read_text().startswith("# HyperSloth run report")
    assert "plan: steps=" in cell_text(nb, 'cli("hypersloth-plan"')
    assert "HyperSloth run: 30 step(s) on 2 worker(s)" in cell_text(nb, "format_console(summary)")
    images = [o for c in nb.cells for o in c.get("outputs", []) if o.output_type == "display_data"]
    assert sum("image/png" in o.data for o in images) == 2  # the loss plot and report.png
    assert (work / "export" / "merged" / "model.safetensors").is_file()
    assert (work / "export" / "adapter" / "adapter_model.safetensors").is_file()
    answer = cell_text(nb, "merged.generate")
    assert answer.startswith("prompt: 'uppercase: apple bread'\nanswer: '") and len(answer.splitlines()) == 2
    assert len(answer.splitlines()[1]) > len("answer: ''")  # special tokens are shown: never empty
    difference = float(cell_text(nb, "logit difference").rsplit(":", 1)[1])
    assert difference < 1e-4
    assert snapshot() == before  # nothing written into the repository
