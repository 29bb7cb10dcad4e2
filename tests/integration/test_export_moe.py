"""An MoE adapter (experts adapted through PEFT's target_parameters) exports, loads with stock PEFT and merges
into plain weights with the adapter's logits (fp32): Qwen3-MoE, and gpt-oss (experts stored (in, out), with
biases)."""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from test_export import logits, write_resolved_config
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from HyperSloth.outputs.export import export_run
from HyperSloth.train.lora.targets import resolve_targets
from HyperSloth.train.tiny_model import build_tiny_model


@pytest.mark.parametrize("architecture", ["qwen3_moe", "gpt_oss"])
def test_moe_adapter_exports_loads_and_merges(tmp_path, architecture):
    tiny = build_tiny_model(tmp_path / "tiny-moe", architecture=architecture)
    base = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    targets = resolve_targets(base, None)
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets.modules),
                                            target_parameters=list(targets.parameters)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # a fresh adapter has B = 0 and would merge into nothing
    run = tmp_path / "run"
    model.eval().save_pretrained(str(run))
    AutoTokenizer.from_pretrained(str(tiny)).save_pretrained(str(run))
    write_resolved_config(run, str(tiny))
    expected = logits(model)

    result = export_run(run, tmp_path / "out", merge=True, dtype="float32")
    fresh = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval()
    adapted = PeftModel.from_pretrained(fresh, str(result.adapter_dir)).eval()
    assert any("experts" in name and "lora_B" in name for name, _ in adapted.named_parameters())
    torch.testing.assert_close(logits(adapted), expected, rtol=0, atol=0)
    merged = AutoModelForCausalLM.from_pretrained(str(result.merged_dir), dtype=torch.float32).eval()
    torch.testing.assert_close(logits(merged), expected, rtol=0, atol=1e-4)
    base_logits = logits(AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32).eval())
    assert (base_logits - expected).abs().max() > 1e-2  # the adapters really change the model
    plain = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    for name in ("gate_up_proj", "down_proj"):  # and the experts' own deltas were folded in
        before = getattr(plain.model.layers[0].mlp.experts, name)
        after = getattr(merged.model.layers[0].mlp.experts, name)
        assert (after - before).abs().amax(dim=(1, 2)).min() > 1e-4, name  # every expert's slice moved
