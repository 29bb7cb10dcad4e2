"""MoE expert adapters, PEFT's parametrization against HyperSloth's grouped GEMMs (train/lora/experts.py): seconds
per forward+backward, the process's peak memory growth and what autograd keeps for the backward inside the experts
modules (an exact count), each variant in a process of its own, on this machine.

The model is a random Qwen3-MoE at the given widths (default: Qwen3-30B-A3B's 128 experts, 8 active, expert width
768, at hidden 1024 and 2 layers so that it runs on a CPU), LoRA r=16 on attention and the experts, one packed row.

    python scripts/moe_lora_bench.py                      # both variants, a table
    python scripts/moe_lora_bench.py --tokens 2048 --device cuda
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--active", type=int, default=8)
    p.add_argument("--width", type=int, default=768, help="expert width (moe_intermediate_size)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--steps", type=int, default=3, help="timed forward+backward passes after one warm-up")
    p.add_argument("--device", default="cpu")
    p.add_argument("--variant", choices=["peft", "grouped"], help="run one variant here and print its JSON line")
    return p.parse_args(argv)


def peak_gib() -> float:
    """This process's peak resident memory (CPU), or the CUDA allocator's peak."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def experts_saved_gib(model, ids) -> float:
    """What autograd keeps for the backward inside the experts modules during one forward (unique storages, GiB):
    an exact count, where the process's peak memory is noisy."""
    import torch

    kept: dict[int, int] = {}
    inside = [0]

    def pack(t):
        if inside[0]:
            storage = t.untyped_storage()
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    def enter(*_):
        inside[0] += 1

    def leave(*_):
        inside[0] -= 1

    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    handles = [h for m in experts for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
    finally:
        for h in handles:
            h.remove()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(n for ptr, n in kept.items() if ptr not in weights) / 2**30


def run_variant(a: argparse.Namespace) -> dict:
    import torch

    import HyperSloth.train.tiny_architectures as tiny
    from HyperSloth.config import LoraArgs
    from HyperSloth.train.lora.experts import install_grouped_expert_lora
    from HyperSloth.train.model import _attach_peft

    tiny.TINY_EXPERTS, tiny.TINY_ACTIVE_EXPERTS = a.experts, a.active
    config = tiny.tiny_config("qwen3_moe", vocab_size=1024, hidden_size=a.hidden, intermediate_size=2 * a.width,
                              num_layers=a.layers, num_heads=8, num_kv_heads=4, head_dim=128,
                              max_position_embeddings=max(4096, a.tokens), initializer_range=0.02, pad_token_id=0,
                              eos_token_id=1)
    torch.manual_seed(0)
    model = _attach_peft(tiny.tiny_causal_lm(config).to(a.device), LoraArgs(r=16, lora_alpha=16))
    if a.variant == "grouped":
        assert install_grouped_expert_lora(model)[0] == a.layers
    ids = torch.randint(2, 1024, (1, a.tokens), device=a.device)
    before = peak_gib()
    seconds = []
    for _ in range(a.steps + 1):
        started = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if a.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return {"variant": a.variant, "median_s": statistics.median(seconds[1:]), "first_s": seconds[0],
            "peak_growth_gib": peak_gib() - before, "experts_saved_gib": experts_saved_gib(model, ids)}


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    if a.variant:
        print(json.dumps(run_variant(a)))
        return
    args = sys.argv[1:] if argv is None else argv
    rows = []
    for variant in ("peft", "grouped"):
        out = subprocess.run([sys.executable, __file__, *args, "--variant", variant], capture_output=True, text=True)
        if out.returncode != 0:
            raise SystemExit(f"{variant} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"{a.experts} experts ({a.active} active), expert width {a.width}, hidden {a.hidden}, {a.layers} layers, "
          f"{a.tokens} tokens, r=16, {a.device}; median of {a.steps} forward+backward after one warm-up")
    print("| expert adapters | s per forward+backward | first | peak memory growth | kept for the backward in the "
          "experts |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['median_s']:.2f} | {r['first_s']:.2f} | {r['peak_growth_gib']:.2f} GiB | "
              f"{r['experts_saved_gib']:.3f} GiB |")


if __name__ == "__main__":
    main()
