"""The workloads of scripts/benchmark.py (its docstring says what each measures): the Qwen3 shapes and the
training settings every system shares, the named workloads, their random-weight checkpoints and synthetic data
(ordered by HyperSloth's plan for the stock trainers), and the useful FLOPs of a step (for MFU). Imported by
plain name: scripts/ is on sys.path when a script there runs (bench_eval.py and graph_check.py add it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

import bench_dpo  # scripts/ is on sys.path
import bench_grpo
import bench_longctx

SHAPES = {  # hidden, layers, heads, kv heads, intermediate, tied embeddings (Qwen3 public configs)
    "0.6b": dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=3072, tie_word_embeddings=True),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 intermediate_size=6144, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=12288, tie_word_embeddings=False),
    # Qwen3-30B-A3B's layer (its public config: 32 / 4 heads, 128 experts, 8 active, expert width 768, untied
    # embeddings), 12 of its 48 layers: the MoE workloads' model, bf16 (issue 32).
    "30b-a3b-12l": dict(hidden_size=2048, num_hidden_layers=12, num_attention_heads=32, num_key_value_heads=4,
                        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                        norm_topk_prob=True, tie_word_embeddings=False),
}
FOUR_BIT = {"0.6b": False, "1.7b": False, "8b": True, "30b-a3b-12l": False}
VOCAB, HEAD_DIM, PEAK_FLOPS = 151936, 128, 989e12
LR, SEED, GLOBAL_BATCH = 2e-4, 3407, 32
MAX_POSITIONS = 131072  # room for the longest-sample measurement; compute does not depend on it
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Workload:
    model: str  # a SHAPES key
    mu: float  # token lengths: clip(exp(N(mu, sigma)), low, high)
    sigma: float
    low: int
    high: int
    long_sample: int = 0  # > 0: the first sample of step 1 is this long (the long-context workloads)
    pairs: bool = False  # preference pairs for DPO (scripts/bench_dpo.py); mu..high are the completions'
    prompts: bool = False  # prompts for GRPO (scripts/bench_grpo.py); mu..high are the words per prompt

    @property
    def max_len(self) -> int:
        """The longest sample: every system is given it as max_seq_length (no system should cut it)."""
        if self.pairs:  # a prompt + one completion
            return bench_dpo.PROMPT.high + bench_dpo.COMPLETION.high
        if self.prompts:  # the longest prompt + the longest completion
            return bench_grpo.MAX_PROMPT_TOKENS + bench_grpo.MAX_COMPLETION
        return max(self.high, self.long_sample)

    @property
    def four_bit(self) -> bool:
        return FOUR_BIT[self.model]

    @property
    def model_label(self) -> str:
        name = "Qwen3-30B-A3B shape, 12 layers" if self.model == "30b-a3b-12l" else f"Qwen3-{self.model}"
        return f"{name} " + ("4-bit" if self.four_bit else "bf16")


LONG_TOKENS = 131072  # the long-context workloads' long sample; --long-tokens overrides (32k, 131k, 262k)
SHORT, LONG = (6.2, 0.8, 32, 4096), (7.0, 0.6, 128, 8192)  # mean ~675 and ~1,310 tokens
WORKLOADS = {
    "short-0.6b": Workload("0.6b", *SHORT),
    "short-8b": Workload("8b", *SHORT),
    "long-0.6b": Workload("0.6b", *LONG),
    "long-8b": Workload("8b", *LONG),
    # One very long chat among 31 short ones in step 1 (its length: --long-tokens).
    "longctx-0.6b": Workload("0.6b", *SHORT, long_sample=LONG_TOKENS),
    "longctx-8b": Workload("8b", *SHORT, long_sample=LONG_TOKENS),
    # A mixture-of-experts model (Qwen3-30B-A3B's shape, 12 layers) on the short chats.
    "moe-short": Workload("30b-a3b-12l", *SHORT),
    # Preference pairs, global batch 32 pairs: HyperSloth's DPO against TRL's DPOTrainer (scripts/bench_dpo.py).
    "dpo-0.6b": Workload("0.6b", *vars(bench_dpo.COMPLETION).values(), pairs=True),
    # Prompts, 8 per step x 8 completions of 256 tokens: HyperSloth's GRPO against TRL's GRPOTrainer (bench_grpo.py).
    "grpo-0.6b": Workload("0.6b", bench_grpo.WORDS_MU, bench_grpo.WORDS_SIGMA, bench_grpo.WORDS_LOW,
                          bench_grpo.WORDS_HIGH, prompts=True),
}


def workload_of(name: str, long_tokens: int | None = None) -> Workload:
    """The named workload; a long-context one with its long sample set to `long_tokens` when given."""
    w = WORKLOADS[name]
    return replace(w, long_sample=long_tokens) if w.long_sample and long_tokens else w


def sample_lengths(w: Workload, n: int) -> np.ndarray:
    rng = np.random.default_rng(SEED)
    return np.clip(np.exp(rng.normal(w.mu, w.sigma, n)), w.low, w.high).astype(np.int64)


def build_checkpoint(model: str, folder: Path) -> None:
    """Random-weight Qwen3 of the given shape (bf16, built on the GPU) and a locally trained tokenizer.
    Runs in a child process (`--as-system build`), so the benchmark's parent never holds GPU memory."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    from HyperSloth.train.tiny_model import build_tiny_tokenizer

    if (folder / "config.json").exists():
        return
    shape = SHAPES[model]
    config_class = Qwen3MoeConfig if "num_experts" in shape else Qwen3Config
    config = config_class(vocab_size=VOCAB, head_dim=HEAD_DIM, max_position_embeddings=MAX_POSITIONS,
                          rope_theta=1e6, rms_norm_eps=1e-6, **shape)
    torch.manual_seed(0)
    with torch.device("cuda"):
        net = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    net.save_pretrained(folder)
    texts = [f"sample {i} text for the tokenizer" for i in range(200)]
    build_tiny_tokenizer(texts, vocab_size=512).save_pretrained(folder)


def checkpoint_for_check(model: str, folder: Path) -> Path:
    """`folder` holding the random-weight checkpoint of `model`'s shape, built in a child process
    (`benchmark.py --as-system build`) when it holds none: the GPU checks (graph_check.py, reuse_check.py) load it
    afterwards in their own process, with Unsloth imported first."""
    import subprocess
    import sys

    if not (folder / "config.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("benchmark.py")), "--as-system", "build",
                        "--model", model, "--checkpoint", str(folder)], check=True)
    return folder


def build_data(work: Path, w: Workload, steps: int, checkpoint: Path | None = None) -> dict:
    """Synthetic samples, registered for HyperSloth and ordered by its plan for the stock trainers (GRPO's
    prompts are tokenised with the `checkpoint`'s tokenizer, as TRL tokenises them)."""
    if w.prompts:
        return bench_grpo.build_prompt_data(work, steps, checkpoint, SEED)
    if w.pairs:
        return bench_dpo.build_pair_data(work, steps, GLOBAL_BATCH, VOCAB, SEED)
    from datasets import Dataset

    from HyperSloth.plan.batching import PlanSpec, adaptive_partition_batches

    n = GLOBAL_BATCH * steps
    lengths = bench_longctx.with_long_sample(sample_lengths(w, n), w.long_sample, GLOBAL_BATCH, SEED)
    rng = np.random.default_rng(SEED + 1)
    ids = [rng.integers(100, VOCAB - 100, size=int(L)).tolist() for L in lengths]
    ds = Dataset.from_dict({"input_ids": ids, "labels": ids, "length": lengths.tolist(),
                            "num_trainable": (lengths - 1).tolist(), "text": [""] * n})
    ds.save_to_disk(str(work / "data" / "built_dataset" / "bench"))
    (work / "data" / "data_config.json").write_text(json.dumps(
        {"version": 1, "datasets": {"bench": {"name": "bench", "path": "built_dataset/bench",
                                              # what hypersloth-build-dataset writes: the launcher reads the
                                              # longest sample here instead of the dataset's length column
                                              "stats": {"max_tokens": int(lengths.max())}}}}))
    # HyperSloth's step sets do not depend on the rank count: order the stock data step by step.
    spec = PlanSpec(num_ranks=1, samples_per_step=GLOBAL_BATCH, mode="packed", token_budget=1 << 22, seed=SEED)
    plan = adaptive_partition_batches(lengths, lengths - 1, spec, epoch=0)
    order = [i for step in plan.steps for mb in step.ranks[0] for i in sorted(mb)]
    Dataset.from_dict({"input_ids": [ids[i] for i in order]}).save_to_disk(str(work / "stock_data"))
    step_tokens = [int(sum(lengths[i] for mb in s.ranks[0] for i in mb)) for s in plan.steps]
    return {"order": order, "lengths": lengths.tolist(), "step_tokens": step_tokens}


def flops_per_step(model: str, step_lengths: list[int], dpo: bool = False) -> float:
    """Useful FLOPs of one step over its sequences (module docstring); `dpo` adds the reference model's
    forward to every sequence: 6 N L + 8 layers d_attn L^2."""
    s = SHAPES[model]
    d, layers, ff = s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"]
    attn = s["num_attention_heads"] * HEAD_DIM
    kv = s["num_key_value_heads"] * HEAD_DIM
    if "num_experts" in s:  # the active experts' MLPs and the router, per token
        per_layer = d * (attn + 2 * kv) + attn * d + 3 * d * s["moe_intermediate_size"] * s["num_experts_per_tok"]
        per_layer += d * s["num_experts"]
    else:
        per_layer = d * (attn + 2 * kv) + attn * d + 3 * d * ff
    n = layers * per_layer + d * VOCAB
    if dpo:
        return float(sum(6 * n * L + 8 * layers * attn * L * L for L in step_lengths))
    return float(sum(4 * n * L + 6 * layers * attn * L * L for L in step_lengths))
