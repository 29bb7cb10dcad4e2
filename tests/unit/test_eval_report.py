"""The eval curve in the run report (report.md, report.png, console) and the summary's eval entries."""

from __future__ import annotations

import json

from HyperSloth.outputs.report import format_console, write_report
from HyperSloth.outputs.run_files import BEST_ADAPTER_DIR, BEST_EVAL_FILE
from HyperSloth.train.evaluation import eval_summary

EVALS = [{"step": 0, "eval_loss": 3.2, "eval_tokens": 1500}, {"step": 2, "eval_loss": 2.75, "eval_tokens": 1500},
         {"step": 4, "eval_loss": 2.8, "eval_tokens": 1500}, {"step": 6, "eval_loss": 2.9, "eval_tokens": 1500}]


def _summary(**extra):
    return {"steps": 6, "world_size": 2, "step_losses": [3.1, 3.0, 2.9, 2.8, 2.7, 2.6], "first_loss": 3.1,
            "last_loss": 2.6, **extra}


def test_console_names_the_best_evaluation():
    text = format_console(_summary(eval=EVALS))
    assert "eval        best eval_loss 2.7500 at step 2 (4 evaluation(s); last 2.9000 at step 6)" in text
    assert "eval " not in format_console(_summary())


def test_report_has_the_eval_table_and_the_curve(tmp_path):
    best = {"step": 2, "eval_loss": 2.75, "eval_tokens": 1500, "adapter": str(tmp_path / BEST_ADAPTER_DIR)}
    (tmp_path / "train_summary.json").write_text(json.dumps(_summary(eval=EVALS, best_eval=best)))
    report = write_report(tmp_path).read_text()
    assert "## Evaluation" in report and "Lowest at step 2; its adapter is in" in report
    assert "| 2 | 2.7500 | 1,500 | best |" in report and "| 6 | 2.9000 | 1,500 |  |" in report
    assert "best eval_loss 2.7500 at step 2" in report
    assert (tmp_path / "report.png").stat().st_size > 0
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "train_summary.json").write_text(json.dumps(_summary()))
    assert "## Evaluation" not in write_report(plain).read_text()


def test_report_does_not_claim_a_best_adapter_that_was_not_kept(tmp_path):
    (tmp_path / "train_summary.json").write_text(json.dumps(_summary(eval=EVALS, best_eval=dict(EVALS[1]))))
    report = write_report(tmp_path).read_text()
    assert "Lowest at step 2." in report and "best_adapter" not in report


def test_eval_plot_draws_train_and_eval_curves(tmp_path):
    from HyperSloth.outputs import report

    drawn = {}

    class Recorder:
        def __init__(self):
            self.lines = [type("Line", (), {"set_label": lambda self, label: drawn.setdefault("train", label)})()]

        def plot(self, xs, ys, **kwargs):
            drawn.setdefault("plots", []).append((list(xs), list(ys), kwargs.get("label")))

        def legend(self, **kwargs):
            drawn["legend"] = True

    report._plot_eval(Recorder(), _summary(eval=EVALS))
    assert drawn["train"] == "train loss" and drawn["legend"]
    assert drawn["plots"][0] == ([0, 2, 4, 6], [3.2, 2.75, 2.8, 2.9], "eval loss (held out)")
    assert drawn["plots"][1] == ([2], [2.75], "best (step 2)")


def test_eval_summary_points_at_the_best_adapter_only_when_it_holds_the_best(tmp_path):
    log = [{**e, "eval_runtime": 0.5} for e in EVALS]
    folder = tmp_path / BEST_ADAPTER_DIR
    folder.mkdir()
    (folder / BEST_EVAL_FILE).write_text(json.dumps({"step": 2, "eval_loss": 2.75, "eval_tokens": 1500}))
    summary = eval_summary(log, None, tmp_path)
    assert summary["best_eval"] == {"step": 2, "eval_loss": 2.75, "eval_tokens": 1500, "adapter": str(folder)}
    assert summary["eval_seconds"] == [0.5] * 4 and summary["eval"] == EVALS
    (folder / BEST_EVAL_FILE).write_text(json.dumps({"step": 4}))
    assert "adapter" not in eval_summary(log, None, tmp_path)["best_eval"]


def test_overwrite_removes_an_earlier_runs_best_adapter(tmp_path):
    from HyperSloth.outputs import run_files

    (tmp_path / BEST_ADAPTER_DIR).mkdir()
    (tmp_path / BEST_ADAPTER_DIR / BEST_EVAL_FILE).write_text("{}")
    assert run_files.clear_results(tmp_path) == [] and (tmp_path / BEST_ADAPTER_DIR).is_dir()  # a resume keeps it
    assert tmp_path / BEST_ADAPTER_DIR in run_files.clear_run(tmp_path)
    assert not (tmp_path / BEST_ADAPTER_DIR).exists()
