"""plan/inputs.py: what the trainer and the plan preview both feed the planner (plan_spec_for: test_run.py)."""

import json

import numpy as np
import pytest

from HyperSloth.plan.inputs import dataset_lengths
from HyperSloth.plan.run import attention_coef

QWEN3 = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "8b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
}


def _model_dir(tmp_path, shape):
    folder = tmp_path / shape
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3[shape]))
    return folder


@pytest.mark.parametrize(("shape", "expected"), [("0.6b", 2048 / 15_728_640), ("8b", 4096 / 192_937_984)])
def test_attention_coef_is_attention_width_over_linear_weights_per_layer(tmp_path, shape, expected):
    assert attention_coef(str(_model_dir(tmp_path, shape))) == pytest.approx(expected)


def test_attention_coef_of_a_multimodal_model_is_its_language_models(tmp_path):
    """Gemma 3 4B+, Gemma 4, Qwen3.5 are published with the language model's shape under text_config."""
    folder = tmp_path / "mm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["X"], "text_config": QWEN3["8b"],
                                                    "vision_config": {"hidden_size": 32}}))
    assert attention_coef(str(folder)) == pytest.approx(4096 / 192_937_984)


def test_attention_coef_unknown_for_hub_ids_and_broken_configs(tmp_path):
    assert attention_coef("unsloth/Qwen3-8B") is None
    (tmp_path / "config.json").write_text("{not json")
    assert attention_coef(str(tmp_path)) is None


def test_dataset_lengths_loss_types_and_errors():
    data = {"length": [5, 9, 3], "num_trainable": [2, 4, 0]}
    lengths, trainable = dataset_lengths(data, "response_only", 16)
    assert lengths.tolist() == [5, 9, 3] and trainable.tolist() == [2, 4, 0]
    assert dataset_lengths(data, "all", 16)[1].tolist() == [4, 8, 2]  # position 0 is never a target
    with pytest.raises(ValueError, match="up to 9 tokens.*--max_seq_length 8"):
        dataset_lengths(data, "all", 8)
    with pytest.raises(ValueError, match="empty"):
        dataset_lengths({"length": np.array([], dtype=int), "num_trainable": []}, "all", 8)


def test_sample_token_counts_is_the_one_trainable_rule():
    from HyperSloth.plan.batching import sample_token_counts

    data = {"length": [5, 1, 3], "num_trainable": [2, 0, 1]}
    assert [a.tolist() for a in sample_token_counts(data, "all")] == [[5, 1, 3], [4, 0, 2]]
    assert [a.tolist() for a in sample_token_counts(data, "response_only")] == [[5, 1, 3], [2, 0, 1]]
    rows = np.array([2, 0])
    assert [a.tolist() for a in sample_token_counts(data, "all", rows)] == [[3, 5], [2, 4]]
    assert [a.tolist() for a in sample_token_counts(data, "response_only", rows)] == [[3, 5], [1, 2]]
    # loss_type="all" never reads num_trainable (a column the caller need not load)
    assert sample_token_counts({"length": [4]}, "all")[1].tolist() == [3]


class _SliceOnly:
    """A column that reads in one slice and refuses to be read element by element: np.asarray over a
    `datasets` Column read it row by row (7.5 s for a million rows, on every rank at start)."""

    def __init__(self, values):
        self.values = values

    def __len__(self):
        return len(self.values)

    def __getitem__(self, key):
        if not isinstance(key, slice):
            raise AssertionError(f"column read row by row (item {key!r})")
        return self.values[key]

    def __iter__(self):
        raise AssertionError("column read row by row")


def test_the_planner_inputs_read_each_column_in_one_slice():
    from HyperSloth.plan.batching import sample_token_counts
    from HyperSloth.plan.pairs import pair_plan_inputs

    columns = {"length": _SliceOnly([3, 5, 2]), "num_trainable": _SliceOnly([1, 4, 0])}
    lengths, trainable = sample_token_counts(columns, "response_only", rows=np.array([2, 0]))
    assert lengths.tolist() == [2, 3] and trainable.tolist() == [0, 1] and lengths.dtype == np.int64
    assert dataset_lengths(columns, "all", 8)[1].tolist() == [2, 4, 1]
    pairs = {"length": _SliceOnly([9]), "prompt_length": _SliceOnly([2]), "chosen_length": _SliceOnly([3]),
             "rejected_length": _SliceOnly([2])}
    assert pair_plan_inputs(pairs, 16)[0].tolist() == [9]


@pytest.mark.parametrize("view", ["plain", "selected", "numpy"])
def test_a_datasets_column_reads_as_its_values(view):
    import datasets

    from HyperSloth.plan.batching import int_column

    dataset = datasets.Dataset.from_dict({"length": [4, 7, 1, 9], "text": ["a", "b", "c", "d"]})
    dataset = {"plain": dataset, "selected": dataset.select([3, 1]), "numpy": dataset.with_format("numpy")}[view]
    expected = {"plain": [4, 7, 1, 9], "selected": [9, 7], "numpy": [4, 7, 1, 9]}[view]
    column = int_column(dataset, "length")
    assert isinstance(column, np.ndarray) and column.dtype == np.int64 and column.tolist() == expected
