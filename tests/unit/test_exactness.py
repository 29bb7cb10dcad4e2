"""packing/exactness.py: a long sample inside a packed row trains exactly as it does alone (CPU, fp32, tiny Qwen3)."""

import numpy as np
import pytest
import torch

from HyperSloth.train.collate import IGNORE_INDEX, collate_packed
from HyperSloth.train.packing.exactness import packed_vs_alone, packing_controls, sample_losses, step_loss_reference

MAX_POSITIONS = 4096  # the tiny model's context (tiny_model.build_tiny_model's default): its longest sample
VOCAB = 512


@pytest.fixture(scope="module")
def lora_model():
    """A tiny fp32 Qwen3 with LoRA on all seven projections; A and B both random, so every adapter weight
    gets a gradient (with PEFT's default B = 0, A's gradient would be zero and prove nothing)."""
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128,
                         max_position_embeddings=MAX_POSITIONS, attn_implementation="sdpa")
    base = Qwen3ForCausalLM(config).float()
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    return get_peft_model(base, lora)


def _ids(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, VOCAB, size=n)


# slow tier (make test-slow; CI runs it): fp32 passes over a 4,096-token row, ~10-26 s of CPU
@pytest.mark.slow
def test_a_sample_of_the_longest_length_is_exact_inside_a_packed_row(lora_model):
    others = [_ids(n, s) for s, n in enumerate([37, 700, 2, 301, 1200])]
    result = packed_vs_alone(lora_model, _ids(MAX_POSITIONS, 99), others)
    assert result.sample_tokens == MAX_POSITIONS and result.row_tokens == MAX_POSITIONS + 2240
    assert result.position == 2  # samples before and after it
    assert result.grad_max_abs > 1e-4  # a real gradient reached the adapters
    assert result.loss_diff < 1e-5 and result.grad_rel_diff < 1e-4, result.as_record()
    assert result.exact(loss_tol=1e-5, grad_tol=1e-4)


@pytest.mark.parametrize("position", [0, 3])
def test_first_or_last_segment_is_exact_too(lora_model, position):
    others = [_ids(n, 10 + s) for s, n in enumerate([64, 500, 9])]
    result = packed_vs_alone(lora_model, _ids(1500, 7), others, position=position)
    assert result.position == position
    assert result.exact(loss_tol=1e-5, grad_tol=1e-4), result.as_record()


def test_the_check_sees_a_leak(lora_model):
    """Control: the same row without restarting positions is one causal sequence (samples see each other,
    positions continue); its loss on the long sample is far from the sample alone, so the check can fail."""
    sample, other = _ids(1024, 1), _ids(512, 2)
    batch = collate_packed([(other, np.full_like(other, IGNORE_INDEX)), (sample, sample.copy())])
    del batch["position_ids"]
    with torch.no_grad():
        leaked = float(lora_model(**batch, num_items_in_batch=sample.size - 1, use_cache=False).loss)
    alone = packed_vs_alone(lora_model, sample, [other], position=1).loss_alone
    assert abs(leaked - alone) > 1e-3


# slow tier (make test-slow; CI runs it): fp32 passes over a 4,096-token row, ~10-26 s of CPU
@pytest.mark.slow
def test_controls_separate_rounding_from_a_leak(lora_model):
    """The front row differs from alone by rounding only (here fp32: next to nothing); the row fed as one causal
    sequence differs by a leak, orders of magnitude more, in the loss and in the gradient."""
    others = [_ids(n, 30 + s) for s, n in enumerate([300, 41, 900, 12])]
    controls = packing_controls(lora_model, _ids(1500, 8), others)
    assert controls.sample_tokens == 1500 and controls.row_tokens == 1500 + 1253
    assert controls.front_loss_diff < 1e-5 and controls.front_grad_rel_diff < 1e-4, controls.as_record()
    assert controls.leaked_loss_diff > 1e-3, controls.as_record()
    assert controls.leaked_grad_rel_diff > 100 * max(controls.front_grad_rel_diff, 1e-6), controls.as_record()
    # The same alone pass as packed_vs_alone's: the two functions judge against one reference.
    assert controls.loss_alone == pytest.approx(packed_vs_alone(lora_model, _ids(1500, 8), others).loss_alone,
                                                rel=1e-6)


def test_controls_need_other_samples(lora_model):
    with pytest.raises(ValueError, match="need other samples"):
        packing_controls(lora_model, _ids(10, 0), [])


def test_position_must_lie_among_the_segments(lora_model):
    with pytest.raises(ValueError, match="position must be in"):
        packed_vs_alone(lora_model, _ids(10, 0), [_ids(5, 1)], position=3)


def test_step_reference_is_the_token_weighted_mean_of_samples_alone(lora_model):
    samples = [_ids(n, 20 + s) for s, n in enumerate([300, 17, 900])]
    sums = sample_losses(lora_model, samples, chunk_tokens=128)  # chunks that do not divide the lengths
    row = torch.as_tensor(samples[1])[None]
    with torch.no_grad():
        mean = float(lora_model(input_ids=row, labels=row).loss)
    assert sums[1] == pytest.approx(mean * 16, rel=1e-5)
    # The packed step (every sample a target) gives the same mean as the reference.
    batch = collate_packed([(s, s.copy()) for s in samples])
    with torch.no_grad():
        # use_cache=False, as the trainer passes it: with a KV cache transformers skips the packed mask.
        packed = float(lora_model(**batch, num_items_in_batch=sum(len(s) - 1 for s in samples), use_cache=False).loss)
    assert step_loss_reference(lora_model, samples) == pytest.approx(packed, rel=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and Unsloth")
def test_unsloth_varlen_rows_are_exact_at_the_longest_length(tmp_path):
    """The same proof through Unsloth's varlen path (bf16, `packed_seq_lengths`), judged against the size of a
    real leak on the same data (the row fed as one causal sequence): bf16 noise must be far below it."""
    pytest.importorskip("unsloth")
    from HyperSloth.config import FastModelArgs, LoraArgs
    from HyperSloth.train.model import load_model
    from HyperSloth.train.patches import enable_unsloth_torch_varlen
    from HyperSloth.train.tiny_model import build_tiny_model

    enable_unsloth_torch_varlen()
    path = build_tiny_model(tmp_path / "tiny")
    fast = FastModelArgs(model_name=str(path), max_seq_length=MAX_POSITIONS, dtype="bfloat16", backend="unsloth")
    model = load_model(fast, LoraArgs(r=4, lora_alpha=8)).model
    others = [_ids(n, s) for s, n in enumerate([37, 700, 2, 301, 1200])]
    sample = _ids(MAX_POSITIONS, 99)
    result = packed_vs_alone(model, sample, others, with_lengths=True)
    batch = collate_packed([*[(o, np.full_like(o, IGNORE_INDEX)) for o in others], (sample, sample.copy())])
    del batch["position_ids"]
    with torch.no_grad():
        leaked = float(model(**{k: v.cuda() for k, v in batch.items()}, num_items_in_batch=sample.size - 1,
                             use_cache=False).loss)
    assert result.loss_diff < max(1e-3, abs(leaked - result.loss_alone) / 10), result.as_record()
    # The gradient, between its controls (as the benchmark judges 131k on 8B): within bf16's rounding of a row
    # that cannot leak (or 2e-2), and far below the gradient error of a real leak.
    controls = packing_controls(model, sample, others, with_lengths=True)
    assert result.grad_rel_diff < max(2 * controls.front_grad_rel_diff, 2e-2), (result.as_record(), controls)
    assert controls.leaked_grad_rel_diff > 5 * result.grad_rel_diff, (result.as_record(), controls)
