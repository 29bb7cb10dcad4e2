"""model.py: RoPE past the checkpoint's context, said in one line; the transformers backend applies Unsloth's
linear scaling (CPU, tiny Qwen3)."""

import pytest
import torch
from loguru import logger
from transformers import Qwen3Config

from HyperSloth.config import FastModelArgs
from HyperSloth.train.model import describe_rope, load_model, rope_extension, rope_parameters
from HyperSloth.train.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("rope") / "tiny-qwen3")  # context: 4,096 positions


def _load(path, max_seq_length):
    lines = []
    sink = logger.add(lambda message: lines.append(str(message)), level="WARNING")
    try:
        loaded = load_model(FastModelArgs(model_name=str(path), max_seq_length=max_seq_length, dtype="float32",
                                          backend="transformers"), None)
    finally:
        logger.remove(sink)
    return loaded, [line for line in lines if "RoPE" in line]


def test_transformers_backend_applies_unsloths_linear_scaling_past_the_context(tiny):
    loaded, lines = _load(tiny, 16384)
    params = rope_parameters(loaded.model.config)
    assert params["rope_type"] == "linear" and params["factor"] == pytest.approx(4.0)
    assert loaded.model.config.max_position_embeddings == 16384
    assert loaded.model.model.rotary_emb.rope_type == "linear"
    assert len(lines) == 1 and "transformers applied linear RoPE scaling, factor 4" in lines[0]
    assert "context of 4,096 positions" in lines[0]


def test_within_the_context_nothing_changes_and_nothing_is_said(tiny):
    loaded, lines = _load(tiny, 4096)
    assert rope_parameters(loaded.model.config)["rope_type"] == "default" and lines == []
    scaled, _ = _load(tiny, 8192)
    ids = torch.arange(20)[None]
    with torch.no_grad():  # the scaling changes the model's function even on short inputs: it is real
        assert not torch.allclose(loaded.model(ids).logits, scaled.model(ids).logits)


def test_describe_rope_for_what_unsloth_did_and_for_native_scaling():
    native = Qwen3Config(max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    unsloth = Qwen3Config(max_position_embeddings=131072,
                          rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6})
    line = describe_rope(native, unsloth, 131072, "unsloth")
    assert "unsloth applied linear RoPE scaling, factor 4" in line and "32,768" in line
    assert describe_rope(native, native, 131072, "unsloth").endswith("positions past the context are extrapolated")
    assert describe_rope(native, unsloth, 32768, "unsloth") is None
    yarn = Qwen3Config(max_position_embeddings=32768, rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                       "rope_theta": 1e6,
                                                                       "original_max_position_embeddings": 32768})
    assert rope_extension(yarn, 131072) is None  # a checkpoint scaled for long context keeps its own
    assert "own yarn RoPE scaling is kept" in describe_rope(yarn, yarn, 131072, "transformers")
    assert rope_extension(native, 65536)["factor"] == 2.0 and rope_extension(native, 32768) is None
