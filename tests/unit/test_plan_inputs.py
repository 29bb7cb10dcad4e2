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
