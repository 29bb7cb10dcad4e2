"""GRPO's bound on generation memory (train/grpo/generation_memory.py): the bytes of a generated row, the chunks of
whole prompts under a limit, the limit from the GPU's numbers, and chunked sampling giving one call's completions."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from HyperSloth.config import GrpoArgs
from HyperSloth.train.grpo.generation_memory import (
    GIB,
    LOGIT_COPIES,
    GenerationMemory,
    RowCost,
    generation_limit,
    measured_limit,
    row_cost,
    split_prompts,
)


def test_a_rows_bytes_come_from_the_text_config_and_the_dtype():
    from transformers import Qwen3Config

    qwen3_8b = Qwen3Config(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, intermediate_size=12288, vocab_size=151936)
    cost = row_cost(qwen3_8b, dtype_bytes=2)
    assert cost.kv_per_token == 2 * 36 * 8 * 128 * 2 == 147_456  # 144 KiB per token
    assert cost.prefill_per_token == (3 * 12288 + 2 * 4096) * 2
    assert cost.logits == LOGIT_COPIES * 4 * 151936
    kv = 32 * 8 * cost.kv_per_token * 512  # the example: 32 prompts x 8 generations x 512 tokens
    assert round(kv / 1e9, 1) == 19.3
    # A row's peak (+ logits): the full cache at the end, or the prefill when prompts are long and completions short.
    assert cost.row_bytes(256, 256) == cost.kv_per_token * 512 + cost.logits
    assert cost.row_bytes(4096, 64) == (cost.kv_per_token + cost.prefill_per_token) * 4096 + cost.logits

    # No num_key_value_heads (multi-head attention), no head_dim, inside a multimodal config; a config without a shape.
    text = SimpleNamespace(num_hidden_layers=4, num_attention_heads=8, hidden_size=256, vocab_size=1000)
    multimodal = SimpleNamespace(get_text_config=lambda: text)
    assert row_cost(multimodal, 4) == RowCost(kv_per_token=2 * 4 * 8 * 32 * 4,
                                              prefill_per_token=(3 * 4 * 256 + 2 * 256) * 4, logits=40_000)
    assert row_cost(SimpleNamespace(hidden_size=256), 2) is None

    # Layers whose heads differ (Gemma 4: the full-attention layer's twice as wide): each layer's own cache.
    from HyperSloth.train.tiny_architectures import tiny_config

    gemma4 = tiny_config("gemma4", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.02,
                         pad_token_id=0, eos_token_id=1)
    assert row_cost(gemma4, 2).kv_per_token == 2 * (2 * 16 + 2 * 16 + 2 * 32) * 2


def test_prompts_are_cut_into_consecutive_chunks_of_whole_prompts_under_the_limit():
    cost = RowCost(kv_per_token=1, prefill_per_token=0, logits=0)  # a row of width w costs w + 10 bytes (C = 10)
    assert split_prompts([5] * 4, 2, 10, cost, limit_bytes=60).chunks == [range(0, 2), range(2, 4)]  # 30 B a prompt
    assert split_prompts([5] * 4, 2, 10, cost, limit_bytes=59).chunks == [range(k, k + 1) for k in range(4)]
    # Left padding counts: a long prompt widens every row of its chunk (2 + 10 beside 10 + 10 would be 80 B).
    assert split_prompts([2, 10, 2, 2], 2, 10, cost, 70).chunks == [range(0, 1), range(1, 2), range(2, 4)]
    whole = split_prompts([5] * 4, 2, 10, cost, limit_bytes=120)
    assert whole.chunks == [range(0, 4)] and whole.total_bytes == 120 and not whole.over_limit
    assert split_prompts([5] * 4, 2, 10, cost, limit_bytes=None).chunks == [range(0, 4)]  # CPU: no limit, one call
    assert split_prompts([], 2, 10, cost, limit_bytes=10).chunks == []
    # A prompt too large even alone is sampled alone (flagged for the warning), the others still share calls.
    big = split_prompts([5, 50, 5, 5], 2, 10, cost, limit_bytes=60)
    assert big.chunks == [range(0, 1), range(1, 2), range(2, 4)] and big.over_limit == [1]
    assert split_prompts([5, 5], 2, 10, cost, limit_bytes=-5).over_limit == [0, 1]  # a full GPU: each alone

    rng = np.random.default_rng(0)
    for _ in range(200):  # every prompt once, in order; a chunk fits, or holds one prompt
        lengths = rng.integers(1, 40, rng.integers(1, 12)).tolist()
        g, limit = int(rng.integers(1, 5)), int(rng.integers(10, 800))
        split = split_prompts(lengths, g, 10, cost, limit)
        assert [k for c in split.chunks for k in c] == list(range(len(lengths)))
        for chunk in split.chunks:
            need = len(chunk) * g * (max(lengths[k] for k in chunk) + 10)
            assert need <= limit or (len(chunk) == 1 and chunk.start in split.over_limit)
            nxt = chunk.stop  # greedy: the next prompt would not have fitted
            if nxt < len(lengths):
                assert (len(chunk) + 1) * g * (max(lengths[k] for k in [*chunk, nxt]) + 10) > limit


def test_the_limit_is_free_memory_plus_torchs_idle_cache_less_the_safety_fraction():
    free, total, reserved, allocated = 10 * GIB, 100 * GIB, 30 * GIB, 20 * GIB
    assert generation_limit(free, total, reserved, allocated, safety_fraction=0.08) == 12 * GIB
    assert generation_limit(free, total, 0, 0, safety_fraction=0.08) == 2 * GIB
    assert measured_limit(torch.device("cpu")) is None


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from HyperSloth.train.grpo.rollout import generation_config

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    grpo = GrpoArgs(num_generations=3, max_completion_length=6)
    return model, grpo, generation_config(grpo, pad_token_id=0, eos_token_ids=[2])


def test_chunked_sampling_gives_one_calls_completions_and_logs_each_new_split_once(tiny, logs, monkeypatch):
    from HyperSloth.train.grpo import rollout
    from HyperSloth.train.grpo.trainer import HyperSlothGRPOTrainer

    model, grpo, config = tiny
    prompts = [np.arange(5, 10) + 7 * k for k in range(4)]  # equal lengths: no padding differs between calls
    inputs = {"prompt_ids": prompts, "prompt_rows": [0, 1, 2, 3], "plan_step": 1}
    seeds = [rollout.prompt_seed(0, 1, row) for row in range(4)]  # the trainer's seeds for these rows (seed 0)
    one_call = [[c.tolist() for c in group] for group in rollout.sample_groups(model, prompts, seeds, grpo, config)]
    cost = GenerationMemory(grpo).cost(model)
    assert cost.kv_per_token == 2 * 2 * model.config.num_key_value_heads * model.config.head_dim * 4  # fp32
    per_prompt = grpo.num_generations * cost.row_bytes(5, grpo.max_completion_length)
    limit = {"bytes": 0}
    memory = GenerationMemory(grpo, limit=lambda device: limit["bytes"])
    from HyperSloth.train.grpo.merged_sampling import MergedSampling

    trainer = SimpleNamespace(grpo=grpo, sampling_seed=0, generation=config, generation_memory=memory,
                              backend="transformers", merged_sampling=MergedSampling(enabled=True))
    calls = []
    sample_groups = rollout.sample_groups  # counted: the prompts of each generate call
    monkeypatch.setattr(rollout, "sample_groups", lambda m, p, *a: calls.append(len(p)) or sample_groups(m, p, *a))
    for limit["bytes"], chunk_sizes in ((2 * per_prompt, [2, 2]), (3 * per_prompt, [3, 1]), (4 * per_prompt, [4]),
                                        (per_prompt // 2, [1] * 4)):
        calls.clear()
        model.train()
        groups = HyperSlothGRPOTrainer.sample(trainer, model, inputs)
        assert [[c.tolist() for c in group] for group in groups] == one_call
        assert calls == chunk_sizes and model.training  # sample() puts the mode back
    calls.clear()  # generation_batch="prompt": one call per prompt, whatever memory allows, the same completions
    limit["bytes"] = 4 * per_prompt
    trainer.grpo = grpo.model_copy(update={"generation_batch": "prompt"})
    groups = HyperSlothGRPOTrainer.sample(trainer, model, inputs)
    assert [[c.tolist() for c in group] for group in groups] == one_call and calls == [1] * 4
    trainer.grpo = grpo
    for limit["bytes"] in (2 * per_prompt, per_prompt, 2 * per_prompt, per_prompt // 2):  # the log, without sampling
        memory.chunks(model, [5] * 4)
    split_lines = [line for line in logs if line.startswith("generation split into")]
    assert [line.split(" generate calls")[0] for line in split_lines] == ["generation split into 2",
                                                                        "generation split into 4"]  # new maxima only
    assert "4 prompts x 3 generations" in split_lines[0] and "only if a step needs more calls" in split_lines[0]
    # Not even one prompt fits (twice): each sampled alone, and one warning in the run.
    warnings = [line for line in logs if "more generation memory than is free even alone" in line]
    assert len(warnings) == 1 and warnings[0].startswith("4 prompt(s)") and "grpo.max_completion_length" in warnings[0]
