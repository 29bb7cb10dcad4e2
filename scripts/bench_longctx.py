"""The long-context workloads of scripts/benchmark.py (`longctx-0.6b`, `longctx-8b`): did a system train the
long sample whole?

Step 1 of these workloads holds one very long chat (`--long-tokens`: 32k, 131k, 262k) among 31 short ones.
Two measurements decide whether a system trained it whole, made by the `reference` system, in its own
process on the same checkpoint loaded the same way (Unsloth, 4-bit for 8B):

- the exact step-1 loss: every sample of step 1 alone, unpacked, no gradients, logits in chunks
  (`HyperSloth.train.packing.exactness.step_loss_reference`). LoRA's B starts at zero, so step 1's loss is the base
  model's on that batch whatever the adapter seed. A system that cuts the long sample logs another number.
- the attention floor: torch's flash attention forward of one causal sequence of the long sample's length
  on the model's heads, timed for one layer and multiplied by the layer count. Every step that trains the
  sample whole runs that forward at least once, so none can be faster. (Forward only: the forward+backward
  this measured until 2026-12-01 over-stated at 262,144 tokens on Qwen3-8B, 216 s through SDPA with the
  key/value heads expanded, against 199 s for HyperSloth's whole step with the forward run twice, whose
  loss equalled the reference's to 2.2e-5.)

With `--exactness` the reference also runs `HyperSloth.train.packing.exactness.packed_vs_alone` on the GPU: the long
sample's loss and LoRA gradient inside a packed row of step 1's short samples against the sample alone,
through Unsloth's varlen path (with its gradient checkpointing, so 131k+ fits). In bf16 that difference is
not zero; `--exactness controls` instead runs `packing_controls`, the two rows it is judged between: the
sample first in the row (only rounding can separate it from alone) and the row fed as one causal sequence
(a real leak), recorded as `packing_controls`.

Every record of the workload then gets `ref_loss_diff` (|step-1 loss - reference|), `attention_floor_s`,
`truncated` (its longest sample is shorter than the long sample) and `trained_whole`.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

REF_LOSS_TOL = 5e-3  # bf16 + 4-bit kernels: short-chat step losses of two correct systems agree to ~1e-3
FLOOR_FRACTION = 0.9  # a step below 90% of the attention floor cannot have run the sample's attention


def with_long_sample(lengths: np.ndarray, long_tokens: int, samples_per_step: int, seed: int) -> np.ndarray:
    """`lengths` with the first sample of HyperSloth's step 1 made `long_tokens` long. The planner's steps
    come from a seeded permutation that never reads the lengths, so the sample stays in step 1 (and the
    stock systems, fed in HyperSloth's plan order, see it in their step 1 too)."""
    from HyperSloth.plan.batching import PlanSpec, adaptive_partition_batches

    if not long_tokens:
        return lengths
    spec = PlanSpec(num_ranks=1, samples_per_step=samples_per_step, mode="packed", token_budget=1 << 22, seed=seed)
    first = adaptive_partition_batches(lengths, lengths - 1, spec, epoch=0).steps[0].ranks[0][0][0]
    lengths = lengths.copy()
    lengths[first] = long_tokens
    return lengths


def attention_floor_s(tokens: int, heads: int, kv_heads: int, head_dim: int, layers: int) -> float:
    """Seconds of causal flash attention forward for one sequence of `tokens` on every layer.

    One layer is timed (after a short warm-up of the same kernel) and multiplied by `layers`: the layers
    have the same shapes. Key/value heads are expanded to the query heads (what GQA does inside the kernel).
    """
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def once(n: int) -> float:
        q = torch.randn(1, heads, n, head_dim, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(1, kv_heads, n, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        groups = heads // kv_heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)  # outside the timing
        torch.cuda.synchronize()
        started = time.perf_counter()
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    once(min(tokens, 4096))
    return once(tokens) * layers


def run_reference(a, workload, shape: dict, head_dim: int, seed: int, projections: list[str]) -> dict:
    """The `reference` system (see the module docstring); runs in its own process on one GPU."""
    import unsloth  # noqa: F401  (first, it patches transformers/trl)
    import torch
    from datasets import load_from_disk

    from HyperSloth.config import FastModelArgs, LoraArgs
    from HyperSloth.train.packing.exactness import packed_vs_alone, packing_controls, sample_losses, step_loss_reference
    from HyperSloth.train.model import load_model
    from HyperSloth.train.patches import enable_unsloth_torch_varlen

    enable_unsloth_torch_varlen()
    started = time.perf_counter()
    # HyperSloth's loader: FastLanguageModel.from_pretrained + get_peft_model with the stock rows' arguments,
    # plus Unsloth's permission for a packed row longer than max_seq_length (the exactness row is).
    fast = FastModelArgs(model_name=a.checkpoint, max_seq_length=workload.max_len, dtype="bfloat16",
                         load_in_4bit=workload.four_bit, backend="unsloth",
                         use_gradient_checkpointing="unsloth" if a.exactness else False)
    model = load_model(fast, LoraArgs(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=projections,
                                      random_state=seed)).model
    load_s = time.perf_counter() - started
    stock = load_from_disk(str(Path(a.work) / "stock_data"))  # samples in plan order: step 1 first
    step = [np.asarray(ids) for ids in stock.select(range(32))["input_ids"]]
    longest = max(range(len(step)), key=lambda i: len(step[i]))
    shorts = [s for i, s in enumerate(step) if i != longest]
    started = time.perf_counter()
    reference = step_loss_reference(model, step)
    reference_s = time.perf_counter() - started
    # The chunked reference against the model's own loss on the short samples (where logits fit): a
    # reference that read the wrong hidden states would differ here.
    with torch.no_grad():
        own = [float(model(input_ids=torch.as_tensor(s)[None].cuda(), labels=torch.as_tensor(s)[None].cuda(),
                           num_items_in_batch=1, use_cache=False).loss) for s in shorts[:4]]
    check = max(abs(x - y) / max(abs(y), 1.0) for x, y in zip(sample_losses(model, shorts[:4]), own))
    record = {"reference_loss": reference, "reference_s": reference_s, "load_s": load_s,
              "reference_check_rel_diff": check, "long_tokens": int(len(step[longest])),
              "attention_floor_s": attention_floor_s(len(step[longest]), shape["num_attention_heads"],
                                                     shape["num_key_value_heads"], head_dim,
                                                     shape["num_hidden_layers"])}
    if a.exactness:
        model.train()
        started = time.perf_counter()
        if a.exactness == "controls":
            result = packing_controls(model, step[longest], shorts, with_lengths=True)
            record["packing_controls"] = {**result.as_record(), "seconds": time.perf_counter() - started}
        else:
            result = packed_vs_alone(model, step[longest], shorts, with_lengths=True)
            record["exactness"] = {**result.as_record(), "seconds": time.perf_counter() - started}
    record["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    return record


def earlier_reference(path: str | None, workload: str, long_tokens: int) -> list[dict]:
    """The reference record of `workload` at `long_tokens` from an earlier records file ([] without a path);
    SystemExit when the file holds none (a reference of another length would judge the wrong sample)."""
    import json

    if not path:
        return []
    found = [r for r in json.loads(Path(path).read_text()) if r.get("workload") == workload
             and r.get("system") == "reference" and r.get("long_tokens") == long_tokens and "reference_loss" in r]
    if not found:
        raise SystemExit(f"{path} holds no reference record of {workload} at {long_tokens:,} tokens: run the "
                         f"reference system for it first (--slots reference --long-tokens {long_tokens})")
    return found[:1]


def annotate(records: list[dict], long_tokens: int) -> list[dict]:
    """Give every system record of a long-context workload its verdict against the `reference` record."""
    reference = next((r for r in records if r.get("system") == "reference" and "reference_loss" in r), None)
    for r in records:
        if r.get("system") == "reference" or "losses" not in r:
            continue
        longest = r.get("longest_sample_tokens")
        r["truncated"] = longest is not None and longest < long_tokens
        if reference is None:
            continue
        r["ref_loss_diff"] = abs(r["losses"][0] - reference["reference_loss"]) if r["losses"] else None
        r["attention_floor_s"] = reference["attention_floor_s"]
        r["trained_whole"] = bool(
            "error" not in r  # a loss that went non-finite (benchmark.loss_problem) is no whole training
            and not r["truncated"] and r["ref_loss_diff"] is not None and r["ref_loss_diff"] <= REF_LOSS_TOL
            and r["first_step_s"] >= FLOOR_FRACTION * reference["attention_floor_s"])
    return records


def verdict_line(r: dict) -> str:
    """One printed line per system: the long-context columns of issue 22."""
    keys = ("longest_sample_tokens", "first_step_s", "startup_s", "probe_s", "peak_gb", "ref_loss_diff",
            "attention_floor_s", "trained_whole", "truncated")
    cells = [f"{k}={r.get(k):.4g}" if isinstance(r.get(k), float) else f"{k}={r.get(k)}" for k in keys]
    flag = "  <-- DID NOT TRAIN THE LONG SAMPLE WHOLE" if r.get("truncated") or r.get("trained_whole") is False else ""
    error = f"  ({r['error']})" if r.get("error") else ""
    return f"[{r['workload']} {r['system']}] " + " ".join(cells) + flag + error
