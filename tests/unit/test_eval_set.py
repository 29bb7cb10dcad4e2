"""eval_set.py: the seeded hold-out, its fingerprint, and the refusals made before any worker starts."""

import math

import numpy as np
import pytest
from datasets import Dataset

from HyperSloth.config import ConfigError
from HyperSloth.plan.eval_set import (
    EvalSet,
    check_eval_fraction,
    holdout_size,
    resolve_eval_dataset,
    resolve_holdout,
    rows_fingerprint,
    split_for_run,
    split_holdout,
)


def _rows(n: int, *, seed: int = 0, with_replies: bool = True) -> dict[str, list]:
    rng = np.random.default_rng(seed)
    columns = {"input_ids": [], "labels": [], "length": [], "num_trainable": []}
    for _ in range(n):
        ids = rng.integers(3, 90, size=int(rng.integers(4, 30))).tolist()
        cut = len(ids) // 2
        labels = [-100] * cut + (ids[cut:] if with_replies else [-100] * (len(ids) - cut))
        columns["input_ids"].append(ids)
        columns["labels"].append(labels)
        columns["length"].append(len(ids))
        columns["num_trainable"].append(sum(lab != -100 for lab in labels[1:]))
    return columns


@pytest.fixture
def saved(tmp_path):
    """A built-dataset-like folder of 40 rows; returns its path."""
    path = tmp_path / "chat"
    Dataset.from_dict(_rows(40)).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("bad", [-0.1, 0.51, 1.0, math.nan, True, "0.1"])
def test_eval_fraction_outside_range_is_refused_with_the_range(bad):
    with pytest.raises(ValueError, match=r"eval_fraction must be in \[0, 0.5\].*e.g. eval_fraction=0.05"):
        check_eval_fraction(bad)


def test_holdout_size_rounds_half_up():
    assert [holdout_size(n, f) for n, f in [(256, 0.1), (10, 0.05), (10, 0.04), (3, 0.5), (100, 0.0)]] == [26, 1, 0, 2, 0]


def test_split_is_seeded_disjoint_and_complete():
    train, held = split_holdout(1000, 0.1, seed=7)
    assert held.size == 100 and train.size == 900
    assert np.array_equal(np.sort(np.concatenate([train, held])), np.arange(1000))
    again_train, again_held = split_holdout(1000, 0.1, seed=7)
    assert np.array_equal(held, again_held) and np.array_equal(train, again_train)
    assert not np.array_equal(held, split_holdout(1000, 0.1, seed=8)[1])
    # Not simply the first or last rows: a random sample.
    assert held.min() < 100 and held.max() > 900


def test_fingerprint_covers_rows_and_their_tokens(saved):
    from datasets import load_from_disk

    dataset = load_from_disk(str(saved))
    rows = np.array([3, 5, 11])
    first = rows_fingerprint(dataset, rows)
    assert first == rows_fingerprint(dataset, rows.copy())
    assert first != rows_fingerprint(dataset, np.array([3, 5, 12]))
    # A select()ed view hashes the rows it shows (indices 0..2 of the view are rows 3, 5, 11).
    view = dataset.select(rows)
    assert rows_fingerprint(view, np.arange(3)) == rows_fingerprint(
        Dataset.from_dict(dataset[rows.tolist()]), np.arange(3))
    changed = _rows(40)
    changed["input_ids"][5][0] += 1
    assert rows_fingerprint(Dataset.from_dict(changed), rows) != first


def test_resolve_holdout_records_count_tokens_and_fingerprint(saved):
    eval_set = resolve_holdout("chat", saved, fraction=0.25, seed=3, loss_type="response_only")
    _, held = split_holdout(40, 0.25, 3)
    columns = _rows(40)
    assert (eval_set.source, eval_set.num_rows, eval_set.fraction, eval_set.seed) == ("holdout", 10, 0.25, 3)
    assert eval_set.tokens == sum(columns["length"][i] for i in held)
    assert eval_set.target_tokens == sum(columns["num_trainable"][i] for i in held)
    everything = resolve_holdout("chat", saved, fraction=0.25, seed=3, loss_type="all")
    assert everything.target_tokens == eval_set.tokens - 10  # position 0 of each row is never a target
    assert EvalSet.from_dict(eval_set.to_dict()) == eval_set
    assert "10 conversations held out of 'chat'" in eval_set.describe()


def test_empty_holdout_is_refused_with_what_to_change(saved):
    with pytest.raises(ConfigError, match=r"holds out no conversation.*raise eval_fraction to at least 0.025"):
        resolve_holdout("chat", saved, fraction=0.01, seed=0, loss_type="response_only")
    with pytest.raises(ConfigError, match=r"data.eval_fraction must be in \[0, 0.5\]"):
        resolve_holdout("chat", saved, fraction=0.6, seed=0, loss_type="response_only")


def test_holdout_without_assistant_tokens_is_refused(tmp_path):
    path = tmp_path / "prompts"
    Dataset.from_dict(_rows(20, with_replies=False)).save_to_disk(str(path))
    with pytest.raises(ConfigError, match="no token to score under loss_type='response_only'.*loss_type='all'"):
        resolve_holdout("prompts", path, fraction=0.2, seed=0, loss_type="response_only")
    assert resolve_holdout("prompts", path, fraction=0.2, seed=0, loss_type="all").target_tokens > 0


def test_split_for_run_rebuilds_the_resolved_rows_and_refuses_a_changed_dataset(saved, tmp_path):
    from datasets import load_from_disk

    eval_set = resolve_holdout("chat", saved, fraction=0.25, seed=3, loss_type="response_only")
    dataset = load_from_disk(str(saved))
    train, held = split_for_run(dataset, eval_set)
    train_idx, held_idx = split_holdout(40, 0.25, 3)
    assert len(train) == 30 and len(held) == 10
    assert held["input_ids"] == [dataset[int(i)]["input_ids"] for i in held_idx]
    assert train["input_ids"] == [dataset[int(i)]["input_ids"] for i in train_idx]
    assert not {tuple(r) for r in train["input_ids"]} & {tuple(r) for r in held["input_ids"]}
    assert split_for_run(dataset, None) == (dataset, None)
    rebuilt = tmp_path / "rebuilt"
    Dataset.from_dict(_rows(40, seed=1)).save_to_disk(str(rebuilt))
    with pytest.raises(ConfigError, match="changed after the run was resolved"):
        split_for_run(load_from_disk(str(rebuilt)), eval_set)


def test_eval_dataset_is_used_whole(saved, tmp_path):
    path = tmp_path / "other"
    Dataset.from_dict(_rows(7, seed=5)).save_to_disk(str(path))
    eval_set = resolve_eval_dataset("other", path, {"tokenizer": None}, model_name="m", loss_type="all")
    assert (eval_set.source, eval_set.num_rows) == ("dataset", 7)
    from datasets import load_from_disk

    train, evaluated = split_for_run(load_from_disk(str(saved)), eval_set)
    assert len(train) == 40 and len(evaluated) == 7


def test_empty_eval_dataset_is_refused(tmp_path):
    path = tmp_path / "empty"
    Dataset.from_dict({k: [] for k in _rows(1)}).save_to_disk(str(path))
    with pytest.raises(ConfigError, match="of 'empty' is missing, empty or incomplete: rebuild it"):
        resolve_eval_dataset("empty", path, {}, model_name="m", loss_type="all")


def test_eval_dataset_built_with_another_tokenizer_is_refused(saved, tmp_path):
    from HyperSloth.train.tiny_model import build_tiny_tokenizer

    texts = [f"hello world number {i} and some more words" for i in range(50)]
    build_tiny_tokenizer(texts, vocab_size=300).save_pretrained(tmp_path / "model")
    build_tiny_tokenizer(texts[:10], vocab_size=280).save_pretrained(tmp_path / "other")
    entry = {"tokenizer": str(tmp_path / "other")}
    with pytest.raises(ConfigError, match=r"eval dataset: dataset 'chat' was tokenised with .*--tokenizer"):
        resolve_eval_dataset("chat", saved, entry, model_name=str(tmp_path / "model"), loss_type="all")
    same = {"tokenizer": str(tmp_path / "model")}
    assert resolve_eval_dataset("chat", saved, same, model_name=str(tmp_path / "model"), loss_type="all").num_rows == 40


def test_eval_row_lengths_and_plan_lines_follow_the_resolved_rows(saved):
    from HyperSloth.plan.batching import PlanSpec
    from HyperSloth.plan.eval_set import describe_eval_plan, eval_row_lengths, plan_eval

    eval_set = resolve_holdout("chat", saved, fraction=0.25, seed=3, loss_type="response_only")
    _, held = split_holdout(40, 0.25, 3)
    columns = _rows(40)
    lengths, scored = eval_row_lengths(eval_set, "response_only")
    assert lengths.tolist() == [columns["length"][i] for i in held]
    assert scored.tolist() == [columns["num_trainable"][i] for i in held] and scored.sum() == eval_set.target_tokens
    assert eval_row_lengths(eval_set, "all")[1].tolist() == (lengths - 1).tolist()
    plan = plan_eval(lengths, scored, PlanSpec(num_ranks=2, samples_per_step=4, token_budget=64))
    lines = describe_eval_plan(eval_set, plan)
    assert lines[0].startswith("  eval set       10 conversations held out of 'chat'")
    assert f"{plan.stats.micro_batches_per_rank} micro-batches per rank per evaluation" in lines[1]


def test_eval_dataset_longer_than_max_seq_length_is_refused(saved):
    longest = max(_rows(40)["length"])
    with pytest.raises(ConfigError, match=f"up to {longest} tokens but fast_model_args.max_seq_length is 8"):
        resolve_eval_dataset("chat", saved, {}, model_name="m", loss_type="all", max_seq_length=8)
    assert resolve_eval_dataset("chat", saved, {}, model_name="m", loss_type="all", max_seq_length=longest).num_rows == 40


def test_training_rows_leave_out_exactly_the_holdout(saved, tmp_path):
    from HyperSloth.plan.eval_set import training_rows

    eval_set = resolve_holdout("chat", saved, fraction=0.25, seed=3, loss_type="response_only")
    train_idx, held = split_holdout(40, 0.25, 3)
    assert np.array_equal(training_rows(eval_set, 40), train_idx)
    assert np.array_equal(training_rows(None, 40), np.arange(40))
    other = tmp_path / "other"
    Dataset.from_dict(_rows(7, seed=5)).save_to_disk(str(other))
    separate = resolve_eval_dataset("other", other, {}, model_name="m", loss_type="all")
    assert np.array_equal(training_rows(separate, 40), np.arange(40))


def test_config_fields_have_the_issue_names_and_refuse_bad_values():
    from pydantic import ValidationError

    from HyperSloth.config import DataConfig, TrainingArgsConfig

    data = DataConfig(dataset_name="chat", eval_fraction=0.05)
    assert (data.eval_fraction, data.eval_dataset_name) == (0.05, None)
    assert DataConfig(dataset_name="chat", eval_dataset_name="other").eval_fraction == 0.0
    with pytest.raises(ValidationError, match=r"eval_fraction must be in \[0, 0.5\]"):
        DataConfig(dataset_name="chat", eval_fraction=0.7)
    with pytest.raises(ValidationError, match="eval_dataset_name and eval_fraction are both set"):
        DataConfig(dataset_name="chat", eval_fraction=0.1, eval_dataset_name="other")
    args = TrainingArgsConfig(eval_steps=10, early_stopping_patience=3, save_best_adapter=False)
    assert (args.eval_steps, args.early_stopping_patience, args.save_best_adapter) == (10, 3, False)
    assert TrainingArgsConfig().save_best_adapter is True
    # HyperSloth's own fields never reach SFTConfig as such.
    assert not {"eval_steps", "early_stopping_patience", "save_best_adapter"} & set(args.to_sft_kwargs())
