"""The eval set in the resolved run (run.json): recorded before any worker starts, refusals collected."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
from datasets import Dataset

from HyperSloth.config import ConfigError, load_config
from HyperSloth.plan.eval_set import rows_fingerprint, split_holdout
from HyperSloth.plan.run import MachineFacts, read_run, resolve_run, write_run

CPU = MachineFacts(cuda_device_count=0, unsloth_available=False, cpu_count=2)


def _register(data_dir: Path, name: str, rows: int, seed: int = 0) -> Dataset:
    rng = np.random.default_rng(seed)
    ids = [rng.integers(3, 90, size=int(n)).tolist() for n in rng.integers(5, 40, size=rows)]
    labels = [[-100] * (len(r) // 2) + r[len(r) // 2:] for r in ids]
    dataset = Dataset.from_dict({"input_ids": ids, "labels": labels, "length": [len(r) for r in ids],
                                 "num_trainable": [sum(x != -100 for x in lab[1:]) for lab in labels],
                                 "text": [""] * rows})
    dataset.save_to_disk(str(data_dir / "built_dataset" / name))
    registry = data_dir / "data_config.json"
    content = json.loads(registry.read_text()) if registry.is_file() else {"version": 1, "datasets": {}}
    content["datasets"][name] = {"name": name, "path": f"built_dataset/{name}", "num_samples": rows,
                                 "stats": {"max_tokens": max(len(r) for r in ids)}}
    registry.write_text(json.dumps(content))
    return dataset


@pytest.fixture
def data(tmp_path):
    return _register(tmp_path / "data", "chat", 60)


def _config(tmp_path: Path, data_extra: str = "", targs_extra: str = "", name: str = "cfg.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(f"""
        from HyperSloth.config import *
        hyper_config_model = HyperConfig(
            data=DataConfig(dataset_name="chat", data_dir={str(tmp_path / 'data')!r}{data_extra}),
            training=TrainingConfig(gpus=[0, 1]),
            fast_model_args=FastModelArgs(model_name={str(tmp_path / 'model')!r}, max_seq_length=64),
        )
        training_config_model = TrainingArgsConfig(output_dir={str(tmp_path / 'out')!r}, seed=7, max_steps=5
                                                   {targs_extra})
    """))
    return path


def _resolve(path: Path):
    return resolve_run(load_config(path), world_size=2, machine=CPU)


def test_the_holdout_is_recorded_in_the_run_description(tmp_path, data):
    run = _resolve(_config(tmp_path, ", eval_fraction=0.1", ", eval_steps=2"))
    held = split_holdout(60, 0.1, 7)[1]
    assert (run.eval_set.source, run.eval_set.num_rows, run.eval_set.seed) == ("holdout", 6, 7)
    assert run.eval_set.fingerprint == rows_fingerprint(data, held)
    assert read_run(write_run(run)).eval_set == run.eval_set
    assert _resolve(_config(tmp_path, name="plain.py")).eval_set is None
    # Another hold-out trains on other rows: a resume must notice.
    other = _resolve(_config(tmp_path, ", eval_fraction=0.2", name="other.py"))
    assert run.planning_key()["held-out rows"] != other.planning_key()["held-out rows"]


def test_another_registered_dataset_is_recorded_whole(tmp_path, data):
    _register(tmp_path / "data", "chat-eval", 9, seed=1)
    run = _resolve(_config(tmp_path, ", eval_dataset_name='chat-eval'"))
    assert (run.eval_set.source, run.eval_set.dataset_name, run.eval_set.num_rows) == ("dataset", "chat-eval", 9)
    assert run.planning_key()["held-out rows"] is None


@pytest.mark.parametrize(("data_extra", "targs_extra", "message"), [
    (", eval_fraction=0.001", "", "holds out no conversation of 'chat' (60 rows): raise eval_fraction to at least 0.0167"),
    ("", ", eval_steps=5", "eval_steps / early_stopping_patience need an eval set: set data.eval_fraction"),
    ("", ", early_stopping_patience=2", "need an eval set"),
    (", eval_fraction=0.1", ", early_stopping_patience=2", "early_stopping_patience needs evaluations during training: set eval_steps"),
    (", eval_dataset_name='missing'", "", "dataset 'missing' is not registered"),
])
def test_eval_problems_are_refused_before_any_worker_starts(tmp_path, data, data_extra, targs_extra, message):
    with pytest.raises(ConfigError, match="cannot run this config") as err:
        _resolve(_config(tmp_path, data_extra, targs_extra))
    assert message in str(err.value)


def test_eval_fraction_out_of_range_is_refused_when_the_config_loads(tmp_path, data):
    with pytest.raises(ConfigError, match=r"data.eval_fraction: eval_fraction must be in \[0, 0.5\]"):
        load_config(_config(tmp_path, ", eval_fraction=0.75"))


def test_the_eval_example_holds_out_five_percent_and_stops_early():
    root = Path(__file__).resolve().parents[2]
    loaded = load_config(root / "examples" / "eval_holdout.py")
    assert (loaded.hyper.data.eval_fraction, loaded.hyper.data.eval_dataset_name) == (0.05, None)
    args = loaded.training_args
    assert (args.eval_steps, args.early_stopping_patience, args.save_best_adapter) == (10, 3, True)
    assert "eval_holdout.py" in (root / "examples" / "README.md").read_text()


def test_plan_preview_plans_the_training_rows_and_shows_the_eval_plan(tmp_path, data):
    from HyperSloth.cli.plan import format_summary, preview
    from HyperSloth.plan.eval_set import eval_row_lengths, plan_eval

    summary = preview(str(_config(tmp_path, ", eval_fraction=0.1", ", eval_steps=2")))
    assert summary.num_samples == 54  # 60 rows, 6 held out
    assert summary.trainable_tokens == sum(data["num_trainable"]) - sum(
        data["num_trainable"][int(i)] for i in split_holdout(60, 0.1, 7)[1])
    text = format_summary(summary)
    assert "  eval set       6 conversations held out of 'chat' (eval_fraction 0.1, seed 7)" in text
    run = _resolve(_config(tmp_path, ", eval_fraction=0.1", name="again.py"))
    expected = plan_eval(*eval_row_lengths(run.eval_set, "response_only"), summary.spec).stats
    assert f"  eval plan      {expected.micro_batches_per_rank} micro-batches per rank per evaluation" in text
    assert text.splitlines()[-1].startswith("plan: steps=")
    plain = format_summary(preview(str(_config(tmp_path, name="plain.py"))))
    assert "eval set" not in plain
