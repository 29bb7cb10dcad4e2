"""HyperSloth's GRPO loss equals TRL's GRPOTrainer's, the reference implementation, on the same completions.

One tiny Qwen3 with a LoRA adapter (HyperSloth's loader; the adapter's B made non-zero so A has gradients),
three chat prompts of different lengths with an `answer` column, four fixed completions each (some
ending with the end-of-turn token, some cut at max_completion_length), two reward functions. TRL runs its
own code path on them: `_generate_and_score_completions` (its tokenisation, its rewards, its advantages
and token count; only the sampling is replaced by the fixed completions) and `_compute_loss`. HyperSloth
runs its path: `data.prompts.prompt_ids`, `rollout.score` and `rollout.advantages`, the completions packed
into several micro-batches (`loss.pack_completions`, `collate_completions`) and `loss.micro_batch_loss` over
`target_logps`. The loss and every LoRA gradient agree within 1e-5 (fp32), for TRL 1.15's default loss
(dapo) and for dr_grpo with a KL term (beta > 0: the adapter switched off on both sides) and batch scaling.

TRL's per-token log-probability kernel is Triton (GPU only); on CPU the test gives TRL the same function
computed from its definition (trl_cpu_kernel.py). Everything else is TRL's code.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.slow

G, MAX_LEN, TEMPERATURE = 4, 8, 0.7
PROMPTS = [[{"role": "user", "content": "What is two plus three?"}],
           [{"role": "user", "content": "Name a colour"}],
           [{"role": "user", "content": "Count to four, slowly, one number per line please"}]]
ANSWERS = ["5", "red", "4"]


def length_reward(prompts, completions, **kwargs):
    return [len(c[0]["content"]) / 10.0 for c in completions]


def answer_reward(prompts, completions, answer, **kwargs):
    return [float(a in c[0]["content"]) + 0.1 * k for k, (c, a) in enumerate(zip(completions, answer))]


def _completions(tokenizer, eos: int) -> list[list[int]]:
    """Fixed completions: random non-special tokens, every other one ended early by the end-of-turn token."""
    rng = np.random.default_rng(5)
    specials = set(tokenizer.all_special_ids)
    vocab = [t for t in range(len(tokenizer)) if t not in specials]
    out = []
    for k in range(len(PROMPTS) * G):
        length = int(rng.integers(2, MAX_LEN + 1)) if k % 2 else MAX_LEN
        ids = [int(t) for t in rng.choice(vocab, length)]
        out.append(ids[:-1] + [eos] if k % 2 else ids)
    return out


def _model(model_dir):
    from HyperSloth.config import FastModelArgs, LoraArgs
    from HyperSloth.train.model import load_model

    fast = FastModelArgs(model_name=str(model_dir), max_seq_length=256, dtype="float32", backend="transformers")
    loaded = load_model(fast, LoraArgs(r=8, lora_alpha=16, lora_dropout=0.0))
    _set_lora_b(loaded.model, 0)
    return loaded


def _set_lora_b(model, seed: int) -> None:
    """The trained adapter's B matrices drawn from `seed` (the adapter then differs from the base model)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name and ".default." in name:
                generator = torch.Generator().manual_seed(zlib.crc32(name.encode()) + seed)
                param.normal_(0, 0.2, generator=generator)


def _lora_grads(model) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _trl_trainer(loaded, grpo, tmp_path):
    """TRL's GRPOTrainer on the model (with beta > 0 it copies the adapter as it is now: the reference)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(PROMPTS) * G,
                      num_generations=G, max_completion_length=MAX_LEN, temperature=TEMPERATURE, beta=grpo.beta,
                      loss_type=grpo.loss_type, scale_rewards=grpo.scale_rewards, epsilon=grpo.epsilon,
                      epsilon_high=grpo.epsilon_high, use_cpu=True, bf16=False,
                      report_to="none", logging_steps=1, save_strategy="no", gradient_checkpointing=False)
    return GRPOTrainer(model=loaded.model, reward_funcs=[length_reward, answer_reward], args=args,
                       train_dataset=Dataset.from_dict({"prompt": PROMPTS, "answer": ANSWERS}),
                       processing_class=loaded.tokenizer)


def _trl(trainer, completions, old: list[torch.Tensor] | None = None):
    """TRL's loss, advantages, prompt ids and LoRA gradients on the fixed completions (with `old`: each
    completion's old log-probabilities, TRL's `old_per_token_logps` of num_iterations > 1)."""
    seen = {}

    def fixed(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        seen["prompt_ids"] = [list(p) for p in prompt_ids]
        return completions, None

    trainer._generate_single_turn = fixed
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    rows = [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, ANSWERS) for _ in range(G)]
    inputs = trainer._generate_and_score_completions(rows)
    if old is not None:
        padded = torch.zeros(inputs["completion_ids"].shape)
        for k, values in enumerate(old):
            padded[k, :len(values)] = values
        inputs["old_per_token_logps"] = padded
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return float(loss), inputs["advantages"].numpy(), seen["prompt_ids"], _lora_grads(trainer.model)


def _ours(loaded, completions, grpo, reference, shift_old: bool = False):
    """HyperSloth's loss, advantages, prompt ids and LoRA gradients on the same completions (`shift_old`: with
    old log-probabilities = the current ones + seeded noise, so ratios leave [1 - eps, 1 + eps]; returned too)."""
    from HyperSloth.data.prompts import prompt_ids
    from HyperSloth.train.dpo.preference import target_logps
    from HyperSloth.train.grpo import loss as grpo_loss
    from HyperSloth.train.grpo.rollout import advantages, completion_texts, score
    from HyperSloth.train.grpo.trainer import _std

    tok, model = loaded.tokenizer, loaded.model
    ids = [prompt_ids(tok, p) for p in PROMPTS]
    flat = [np.asarray(c) for c in completions]
    scored = score([length_reward, answer_reward], None, prompts=[p for p in PROMPTS for _ in range(G)],
                   completions=completion_texts(tok, flat, True), completion_ids=completions,
                   columns=[{"answer": a} for a in ANSWERS for _ in range(G)], step=1)
    rewards = scored.weighted.astype(np.float64)
    batch_std = _std(rewards.sum(), (rewards ** 2).sum(), rewards.size)
    adv = advantages(scored.weighted, G, grpo.scale, batch_std)[0]
    items = [grpo_loss.Completion(np.asarray(ids[k // G]), flat[k], float(adv[k])) for k in range(len(flat))]
    denominator, rule = grpo_loss.normaliser(grpo, len(flat), sum(len(c) for c in flat))
    batches = grpo_loss.pack_completions(items, token_budget=60)
    assert len(batches) >= 3  # several micro-batches: the sum over them is what is checked
    model.train()
    total, olds, clipped = 0.0, [None] * len(items), 0.0
    for indices in batches:
        batch = grpo_loss.collate_completions([items[k] for k in indices], rule)
        ref = old = None
        if grpo.beta:
            with torch.no_grad(), reference.active(model):
                ref = target_logps(model, batch, TEMPERATURE)
        logps = target_logps(model, batch, TEMPERATURE)
        if shift_old:
            noise = torch.randn(logps.shape, generator=torch.Generator().manual_seed(indices[0])) * 0.3
            old = logps.detach() + noise
            parts = old.split([len(items[k].completion_ids) for k in indices])
            for k, part in zip(indices, parts):
                olds[k] = part
        share, sums = grpo_loss.micro_batch_loss(logps, batch, grpo, denominator, old=old, ref=ref)
        clipped += float(sums[3])
        share.backward()
        total += float(share.detach())
    assert not shift_old or clipped >= 5  # the clipped branch of the objective is exercised
    return total, adv, ids, _lora_grads(model), olds if shift_old else None


@pytest.mark.parametrize("settings", [dict(), dict(loss_type="dr_grpo", beta=0.05, scale_rewards="batch"),
                                      dict(loss_type="grpo", epsilon_high=0.28, shift_old=True)],
                         ids=["dapo-default", "dr_grpo-kl-batch", "grpo-old-logps-clipped"])
def test_grpo_loss_and_lora_gradients_equal_trl(tiny_model_dir, tmp_path, monkeypatch, settings):
    import trl.trainer.utils as trl_utils
    from trl_cpu_kernel import ReferenceLogProbFunction

    from HyperSloth.config import GrpoArgs

    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", ReferenceLogProbFunction)
    settings = dict(settings)
    shift_old = settings.pop("shift_old", False)
    grpo = GrpoArgs(num_generations=G, max_completion_length=MAX_LEN, temperature=TEMPERATURE, **settings)
    from HyperSloth.train.dpo.preference import add_reference_adapter

    loaded = _model(tiny_model_dir)
    trainer = _trl_trainer(loaded, grpo, tmp_path)
    # beta > 0: the reference is the initial adapter on both sides (TRL copies it at construction; HyperSloth
    # loads it from init_adapter_path), and the trained adapter then moves away from it, so the KL is not 0.
    loaded.model.save_pretrained(str(tmp_path / "initial"), selected_adapters=["default"])
    reference = add_reference_adapter(loaded.model, str(tmp_path / "initial"))
    _set_lora_b(loaded.model, 1)
    completions = _completions(loaded.tokenizer, loaded.tokenizer.eos_token_id)
    ours = _ours(loaded, completions, grpo, reference, shift_old)
    theirs = _trl(trainer, completions, ours[4])
    assert ours[2] == theirs[2][::G]  # the same prompt tokens (TRL: one row per completion)
    np.testing.assert_allclose(ours[1], theirs[1], rtol=1e-5, atol=1e-6)
    assert np.abs(ours[1]).max() > 0.1  # the rewards differ within groups
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5, abs=1e-6)
    assert ours[3].keys() == theirs[3].keys() and len(ours[3]) > 0
    for name, grad in theirs[3].items():
        scale = float(grad.abs().max())
        assert scale > 0, name
        np.testing.assert_allclose(ours[3][name].numpy(), grad.numpy(), rtol=0, atol=1e-5 * scale, err_msg=name)
