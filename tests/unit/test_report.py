"""The run report from synthetic run folders: files written, numbers shown, sparse summaries tolerated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from HyperSloth.outputs.report import compute_saved_pct, format_console, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def full_summary(steps: int = 6) -> dict:
    losses = [3.0 - 0.25 * i for i in range(steps)]
    return {
        "world_size": 2, "backend": "transformers", "batching": "packed", "global_batch_size": 16,
        "steps": steps, "step_losses": losses, "grad_norms": [0.5] * steps,
        "learning_rates": [1e-3 * (i + 1) for i in range(steps)],
        "first_loss": losses[0], "last_loss": losses[-1], "tokens_seen": 12345, "train_runtime_s": 2.5,
        "tokens_per_s": 4938.0, "padding_pct": 10.0, "random_padding_pct": 40.0, "imbalance": 1.0123,
        "wall_s": 7.25, "step_seconds": [0.1, 0.3, 0.2, 0.4, 0.2, 0.5][:steps],
        "phase_seconds_per_step": {"forward": 0.03, "backward": 0.06, "allreduce": 0.01},
        "peak_gpu_gb": 3.5, "startup": {"launch_unix": 1.0, "total_s": 4.56, "phase_s": {"first_step": 4.56},
                                        "end_s": {"first_step": 4.56}},
    }


def make_run(tmp_path: Path, summary: dict, *, ranks: list[dict] | None = None, config: dict | None = None) -> Path:
    (tmp_path / "train_summary.json").write_text(json.dumps(summary))
    if config is not None:
        (tmp_path / "hypersloth_config.json").write_text(json.dumps(config))
    for record in ranks or []:
        (tmp_path / "logs").mkdir(exist_ok=True)
        (tmp_path / "logs" / f"rank{record['rank']}.final.json").write_text(json.dumps(record))
    return tmp_path


def test_saved_pct_is_the_share_of_random_batchings_computed_tokens():
    # 900 real tokens: random batching computes 900/0.6 = 1500, ours 900/0.9 = 1000 -> 1/3 saved.
    assert compute_saved_pct(10.0, 40.0) == pytest.approx(100 / 3)
    assert compute_saved_pct(0.0, 43.8) == pytest.approx(43.8)
    assert compute_saved_pct(20.0, 20.0) == pytest.approx(0.0)


def test_full_report_has_numbers_curves_ranks_and_config(tmp_path):
    config = {"source_path": "/x/cfg.py", "hyper_config": {"fast_model_args": {"model_name": "tiny-model-xyz"}},
              "training_config": {"logging_steps": 1, "learning_rate": 0.003}}
    ranks = [{"rank": r, "sha256": "ab" * 32, "trainable_params": 32768, "peak_gpu_gb": 3.5} for r in (1, 0)]
    path = write_report(make_run(tmp_path, full_summary(), ranks=ranks, config=config))
    assert path == tmp_path / "report.md"
    text = path.read_text()
    for expected in ("| optimizer steps | 6 |", "| tokens/s | 4,938.0 |", "| tokens seen | 12,345 |",
                     "| padding | 10.00% |", "| padding with random batching | 40.00% |",
                     "| computed tokens saved vs random | 33.33% |", "| rank load imbalance (max/mean) | 1.0123 |",
                     "| wall time (load + train) | 7.25 s |", "| start-up (launch to end of step 1) | 4.56 s |",
                     "| peak GPU memory (rank 0) | 3.50 GiB |",
                     "| first loss | 3.0000 |", "| last loss | 1.7500 |",
                     "![loss and learning rate per step](report.png)",
                     "every rank ended with identical trained weights", "| 0 | 32,768 | `abababababab` | 3.50 GiB |",
                     "| backward | 0.0600 | 60.0% |", '"model_name": "tiny-model-xyz"',
                     "| 6 | 1.7500 | 0.006 | 0.5000 | 0.500 |"):
        assert expected in text, expected
    assert text.index("| 0 | 32,768") < text.index("| 1 | 32,768")  # ranks in order
    png = (tmp_path / "report.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 5000


def test_mismatched_rank_weights_are_flagged(tmp_path):
    ranks = [{"rank": 0, "sha256": "a" * 64}, {"rank": 1, "sha256": "b" * 64}]
    text = write_report(make_run(tmp_path, full_summary(), ranks=ranks)).read_text()
    assert "WARNING: ranks ended with 2 different sets of trained weights" in text


def test_one_step_run_with_only_required_keys(tmp_path):
    summary = {"steps": 1, "world_size": 1, "step_losses": [2.5]}
    text = write_report(make_run(tmp_path, summary)).read_text()
    assert "| optimizer steps | 1 |" in text and "| tokens/s | — |" in text
    assert "| 1 | 2.5000 | — | — | — |" in text
    assert (tmp_path / "report.png").read_bytes().startswith(PNG_MAGIC)
    assert "Resolved config" not in text and "## Ranks" not in text


def test_nulls_and_empty_lists_give_a_report_without_a_picture(tmp_path):
    summary = {**full_summary(), "step_losses": [], "learning_rates": [], "grad_norms": [None],
               "first_loss": None, "last_loss": None, "tokens_per_s": None, "peak_gpu_gb": None}
    text = write_report(make_run(tmp_path, summary)).read_text()
    assert not (tmp_path / "report.png").exists() and "Curves" not in text
    assert "| first loss | — |" in text and "| peak GPU memory (rank 0) | — |" in text


def test_learning_rates_logged_every_k_steps_sit_on_their_steps(tmp_path):
    summary = {**full_summary(steps=6), "learning_rates": [0.1, 0.2, 0.3], "grad_norms": [1.0, 2.0, 3.0]}
    config = {"training_config": {"logging_steps": 2}}
    text = write_report(make_run(tmp_path, summary, config=config)).read_text()
    # Logged every 2nd step: each value sits on the step it was logged at, the others stay empty.
    assert "| 2 | 2.7500 | 0.1 | 1.0000 | 0.300 |" in text
    assert "| 1 | 3.0000 | — | — | 0.100 |" in text
    assert (tmp_path / "report.png").is_file()


def test_resumed_run_numbers_every_curve_and_table_by_global_step(tmp_path):
    # Resumed at step 4 of 6: 3 losses of this run, lr/grad norm logged at steps 1..6 (history restored).
    losses = [2.0, 1.5, 1.75]
    summary = {**full_summary(steps=6), "first_step": 4, "step_losses": losses, "first_loss": 2.0,
               "last_loss": 1.75, "log_steps": [1, 2, 3, 4, 5, 6], "step_seconds": [0.1, 0.2, 0.3],
               "learning_rates": [1e-3 * s for s in range(1, 7)], "grad_norms": [0.1 * s for s in range(1, 7)]}
    text = write_report(make_run(tmp_path, summary)).read_text()
    assert "(min 1.5000 at step 5)" in text
    assert "| 4 | 2.0000 | 0.004 | 0.4000 | 0.100 |" in text and "| 6 | 1.7500 | 0.006 | 0.6000 | 0.300 |" in text
    assert "| 1 | " not in text and "| 3 | " not in text  # no row numbered 1..3 for this run's losses
    assert (tmp_path / "report.png").is_file()


def test_a_resumed_run_is_described_whole_in_the_report_and_console_line(tmp_path):
    # Resumed at step 4 of 6: the losses of all 6 steps (the first 3 from the checkpoint), the times and
    # tokens of this process's 3 steps, the token count of the whole run.
    summary = {**full_summary(steps=6), "first_step": 1, "step_losses": [3.0, 2.5, 2.25, 2.0, 1.5, 1.75],
               "log_steps": [1, 2, 3, 4, 5, 6], "step_seconds": [0.1, 0.2, 0.3], "tokens_seen": 8000,
               "tokens_this_run": 4000, "train_runtime_s": 2.0, "tokens_per_s": 2000.0,
               "learning_rates": [1e-3 * s for s in range(1, 7)], "grad_norms": [0.1 * s for s in range(1, 7)]}
    console = format_console(summary)
    assert "2,000 tokens/s; 4,000 tokens in 2.0 s of training; 8,000 tokens over the whole run" in console
    text = write_report(make_run(tmp_path, summary)).read_text()
    assert "| 1 | 3.0000 | 0.001 | 0.1000 | — |" in text and "| 3 | 2.2500 | 0.003 | 0.3000 | — |" in text
    assert "| 4 | 2.0000 | 0.004 | 0.4000 | 0.100 |" in text and "| 6 | 1.7500 | 0.006 | 0.6000 | 0.300 |" in text


def test_a_long_run_shows_every_kth_step_with_a_correct_ordinal(tmp_path):
    steps = 40  # two rows per table row: every 2nd step
    summary = {**full_summary(steps=steps), "step_losses": [3.0 - 0.01 * s for s in range(steps)],
               "log_steps": list(range(1, steps + 1)), "step_seconds": [0.1] * steps,
               "learning_rates": [1e-3] * steps, "grad_norms": [0.5] * steps}
    text = write_report(make_run(tmp_path, summary)).read_text()
    assert "## Steps (every 2nd step)" in text or "## Steps (every 2nd)" in text
    assert "2th" not in text


def test_missing_summary_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_summary.json not found"):
        write_report(tmp_path)


def test_console_summary_is_short_and_has_the_key_numbers():
    text = format_console(full_summary())
    lines = text.splitlines()
    assert 5 <= len(lines) <= 8
    assert lines[0] == "HyperSloth run: 6 step(s) on 2 worker(s) (transformers, packed batching, global batch 16)"
    assert "3.0000 -> 1.7500 (min 1.7500 at step 6)" in text
    assert "4,938 tokens/s" in text and "10.0% (random batching: 40.0%; 33.3% fewer computed tokens)" in text
    assert "imbalance 1.012" in text and "median step 0.250 s" in text and "peak 3.50 GiB" in text
    assert "wall 7.2 s (model load + training); start-up 4.6 s (launch to the end of step 1); median step" in text


def test_console_summary_of_a_sparse_one_step_run():
    text = format_console({"steps": 1, "step_losses": [2.0]})
    assert text.splitlines() == ["HyperSloth run: 1 step(s) on ? worker(s)", "  loss        2.0000 -> 2.0000"]
