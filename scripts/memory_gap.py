"""Why training peaks above the budget probe's line (issue 22, item 4), one candidate at a time, on one GPU.

    python scripts/memory_gap.py --checkpoint CKPT --four-bit --gc unsloth --tokens 18432 --out gap.json

docs/benchmarks.md measured training 2.5-5.0 GiB above the probe's line on Qwen3-8B 4-bit (13.6 against 9.3
GiB predicted with Unsloth's checkpointing at a row of 18,432 tokens) and within 0.8 GiB on 0.6B. The probe
runs a bare forward+backward; training differs from it in these ways, each measured here on the same row
(peak allocated bytes, `torch.cuda.max_memory_allocated`, after `reset_peak_memory_stats`):

- `probe`: the probe's own pass (`HyperSloth.train.budget.probe.peak_of_forward_backward`), the baseline;
- `autocast`: the forward under bf16 autocast with fp32 outputs, which is what accelerate's `prepare`
  wraps `model.forward` in when HF's Trainer runs with bf16=True (accelerate `Accelerator.prepare_model`,
  `native_amp`); the probe runs before the trainer exists, without it;
- `optimizer`: fused AdamW state and `.grad` alive, as from step 2 on (the probe's limit reserves 3 x 4 bytes
  per trainable parameter for them; this measures what they really add, temporaries included);
- `gc_off`: five steps with Python's cyclic collector off, as `trainer.StepGarbageCollection` runs training
  (a reference cycle that holds activations lives until the next collection, every 50 steps);
- `after_larger`: the row after a row twice as long: Unsloth's offloaded-checkpointing staging buffers (one,
  then two with its double buffering after the first backward; unsloth_zoo.gradient_checkpointing
  GPU_BUFFERS / GPU_BUFFERS_B) keep the size of the largest layer input seen;
- `after_release`: the same after `model.release_checkpointing_buffers` (what the probe does at its end);
- `hf_enable`: after `model.gradient_checkpointing_enable(...)` called exactly as HF's `Trainer.train()` calls it
  when `args.gradient_checkpointing` is on (TRL's SFTConfig default, kept on the Unsloth backend by
  `trainer_args.sft_config_for`): if that replaces Unsloth's offloaded checkpoint function, every layer's input
  stays on the GPU (8B: 36 layers x 18,432 tokens x 4,096 x 2 bytes = 5.4 GB).
Every number is reported as bytes above `probe`. A memory snapshot of the `autocast` + `optimizer` pass is
written next to --out (open it at https://pytorch.org/memory_viz) to name the largest blocks at the peak.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import numpy as np


def peak_of(model, batch: dict, *, autocast: bool = False, optimizer=None) -> int:
    """Peak allocated bytes of one forward+backward (+ optimizer step) of `batch`."""
    import torch

    batch = {k: v if k == "packed_seq_lengths" else v.cuda() for k, v in batch.items()}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**batch, num_items_in_batch=int(batch["input_ids"].shape[1]), use_cache=False).loss
    loss.float().backward()
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def _enable_as_hf_trainer_does(model) -> None:
    """transformers 5.17 Trainer.train(): `if args.gradient_checkpointing: model.gradient_checkpointing_enable(...)`
    with the SFTConfig's kwargs (every_n_layers and offload popped)."""
    import tempfile

    from trl import SFTConfig

    args = SFTConfig(output_dir=tempfile.mkdtemp(), report_to="none")
    kwargs = dict(args.gradient_checkpointing_kwargs or {})
    every, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None, every_n_layers=every,
                                            offload=offload)


def measure(model, tokens: int, snapshot: Path) -> dict:
    import torch

    from HyperSloth.train.budget.probe import release_memory
    from HyperSloth.train.model import release_checkpointing_buffers
    from profile_step import packed_row

    rng = np.random.default_rng(0)
    row, larger = packed_row(tokens, rng), packed_row(2 * tokens, rng)
    peak_of(model, row)  # warm-up: compilation and autotuning on first use are not what training keeps
    release_memory(model)
    out = {"probe": peak_of(model, row)}
    release_memory(model)
    out["autocast"] = peak_of(model, row, autocast=True)
    release_memory(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=True)
    peak_of(model, row, autocast=True, optimizer=optimizer)  # creates the state, as step 1 does
    out["optimizer"] = peak_of(model, row, optimizer=optimizer)
    torch.cuda.memory._record_memory_history(max_entries=200000)
    out["autocast_optimizer"] = peak_of(model, row, autocast=True, optimizer=optimizer)
    torch.cuda.memory._dump_snapshot(str(snapshot))
    torch.cuda.memory._record_memory_history(enabled=None)
    gc.collect()
    gc.disable()
    try:
        out["gc_off"] = max(peak_of(model, row, autocast=True, optimizer=optimizer) for _ in range(5))
    finally:
        gc.enable()
    del optimizer
    release_memory(model)
    peak_of(model, larger)
    release_memory(model)
    out["after_larger"] = peak_of(model, row)
    release_checkpointing_buffers()
    release_memory(model)
    out["after_release"] = peak_of(model, row)
    _enable_as_hf_trainer_does(model)
    release_memory(model)
    out["hf_enable"] = peak_of(model, row)
    return {"peak_bytes": out, "above_probe_gib": {k: (v - out["probe"]) / 2**30 for k, v in out.items()},
            "trainable_params": sum(p.numel() for p in params)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--four-bit", action="store_true")
    p.add_argument("--gc", default="False", help="False, True or unsloth")
    p.add_argument("--tokens", type=int, default=18432, help="the row (docs/benchmarks.md's step 16: 18,432)")
    p.add_argument("--out", required=True)
    a = p.parse_args()

    import unsloth  # noqa: F401  (first: it patches transformers)
    import torch

    from HyperSloth.config import FastModelArgs, LoraArgs
    from HyperSloth.train.model import load_model
    from HyperSloth.train.patches import enable_unsloth_torch_varlen

    enable_unsloth_torch_varlen()
    gc_mode = {"True": True, "False": False}.get(a.gc, a.gc)
    fast = FastModelArgs(model_name=a.checkpoint, max_seq_length=max(4096, 2 * a.tokens), dtype="bfloat16",
                         backend="unsloth", load_in_4bit=a.four_bit, use_gradient_checkpointing=gc_mode)
    model = load_model(fast, LoraArgs(r=16, lora_alpha=16)).model
    model.train()
    result = {"checkpoint": a.checkpoint, "gc": a.gc, "tokens": a.tokens, "gpu": torch.cuda.get_device_name(),
              **measure(model, a.tokens, Path(a.out).with_suffix(".snapshot.pickle"))}
    Path(a.out).write_text(json.dumps(result, indent=2))
    print("MEMORY_GAP " + json.dumps(result))


if __name__ == "__main__":
    main()
