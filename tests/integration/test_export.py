"""hypersloth-export on a fake finished run: a tiny Qwen3 with a LoRA whose B weights are random and
non-zero (so the merge changes the logits), saved as a run's output_dir writes it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from HyperSloth.cli.export import export as export_cli
from HyperSloth.config import DataConfig, FastModelArgs, HyperConfig, LoraArgs, TrainingArgsConfig
from HyperSloth.outputs.export import ExportError, export_adapter, export_run, merge_adapter
from HyperSloth.train.tiny_model import build_tiny_model

INPUTS = [[5, 17, 42, 99, 3, 250], [300, 7, 8, 9, 10, 11]]


def write_resolved_config(run: Path, model_name: str, *, lora: bool = True, load_in_4bit: bool = False) -> None:
    """hypersloth_config.json as the worker writes it (built from the real pydantic models)."""
    hyper = HyperConfig(
        data=DataConfig(dataset_name="sample-chat"),
        fast_model_args=FastModelArgs(model_name=model_name, load_in_4bit=load_in_4bit),
        lora_args=LoraArgs(r=4, lora_alpha=8) if lora else None,
    )
    resolved = {"source_path": str(run / "cfg.py"), "hyper_config": hyper.model_dump(),
                "training_config": TrainingArgsConfig(output_dir=str(run)).model_dump()}
    (run / "hypersloth_config.json").write_text(json.dumps(resolved, indent=2))


def logits(model, rows=INPUTS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(rows)).logits.float()


def load_base(path: Path):
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny(tiny_model_dir) -> Path:
    return tiny_model_dir


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """A run folder holding a trained-looking adapter, a checkpoint copy and the reference logits."""
    run_dir = tmp_path_factory.mktemp("runs") / "run"
    torch.manual_seed(0)
    model = get_peft_model(load_base(tiny), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)  # a fresh adapter has B = 0 and would merge into nothing
    model.eval().save_pretrained(str(run_dir))
    AutoTokenizer.from_pretrained(str(tiny)).save_pretrained(str(run_dir))
    write_resolved_config(run_dir, str(tiny))
    (run_dir / "logs").mkdir()
    shutil.copytree(run_dir, run_dir / "checkpoint-2", ignore=shutil.ignore_patterns("logs", "checkpoint-*"))
    return run_dir, logits(model)


def test_adapter_and_merged_model_load_with_stock_libraries(tiny, run, tmp_path):
    run_dir, expected = run
    result = export_run(run_dir, tmp_path / "out", merge=True, dtype="float32")
    assert result.adapter_dir == tmp_path / "out" / "adapter" and result.merged_dir == tmp_path / "out" / "merged"
    assert result.base == str(tiny)
    adapted = PeftModel.from_pretrained(load_base(tiny), str(result.adapter_dir)).eval()
    torch.testing.assert_close(logits(adapted), expected, rtol=0, atol=0)
    merged = AutoModelForCausalLM.from_pretrained(str(result.merged_dir), dtype=torch.float32).eval()
    assert not hasattr(merged, "peft_config")
    torch.testing.assert_close(logits(merged), expected, rtol=0, atol=1e-4)
    assert (logits(load_base(tiny)) - expected).abs().max() > 1e-2  # the adapter really changes the model
    vocab = AutoTokenizer.from_pretrained(str(tiny)).get_vocab()
    for folder in (result.adapter_dir, result.merged_dir):
        assert AutoTokenizer.from_pretrained(str(folder)).get_vocab() == vocab
    config = json.loads((result.adapter_dir / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tiny)
    assert not list((tmp_path / "out").glob(".*tmp-*"))  # staging folders are gone


def test_cli_exports_a_checkpoint_in_bfloat16_by_default(run, capsys):
    run_dir, expected = run
    checkpoint = run_dir / "checkpoint-2"
    export_cli(str(checkpoint), merge=True)  # `python -m` runs the same function: see the error test below
    merged = checkpoint / "export" / "merged"
    assert f"merged (bfloat16): {merged}" in capsys.readouterr().out
    with safe_open(str(merged / "model.safetensors"), "pt") as handle:
        assert {handle.get_tensor(k).dtype for k in handle.keys()} == {torch.bfloat16}
    model = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    # bfloat16 keeps ~3 significant digits: close to the fp32 reference, not equal to it.
    assert (logits(model) - expected).abs().max() < 0.05


def test_existing_out_needs_force_and_force_replaces(run, tmp_path, capsys):
    run_dir, _ = run
    out = tmp_path / "out"
    (out / "adapter").mkdir(parents=True)
    (out / "adapter" / "stale.txt").write_text("old")
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_info:
        export_cli(str(run_dir), out=str(out))
    assert exit_info.value.code == 2
    assert f"{out} already exists: pass --force" in capsys.readouterr().err
    export_cli(str(run_dir), out=str(out), force=True)
    assert sorted(p.name for p in (out / "adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "chat_template.jinja", "hypersloth_config.json",
        "tokenizer.json", "tokenizer_config.json"]
    assert (out / "keep.txt").read_text() == "mine"  # --force only replaces what export writes
    assert "adapter: " in capsys.readouterr().out


def test_folder_without_adapter_exits_2_without_traceback(run, tmp_path):
    run_dir, _ = run
    empty = tmp_path / "empty"
    (empty / "checkpoint-3").mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-m", "HyperSloth.cli.export", str(empty)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (
        f"hypersloth-export: error: {empty} holds no trained adapter (adapter_config.json + "
        f"adapter_model.safetensors) and no full model; export one of its checkpoints instead, e.g. "
        f"{empty / 'checkpoint-3'}")
    with pytest.raises(ExportError, match="no such folder"):
        export_run(tmp_path / "missing")


def test_missing_base_model_is_a_clear_error(run, tmp_path):
    run_dir, _ = run
    moved = tmp_path / "run"
    shutil.copytree(run_dir, moved, ignore=shutil.ignore_patterns("checkpoint-*", "export"))
    write_resolved_config(moved, str(tmp_path / "gone" / "tiny-qwen3"))
    with pytest.raises(ExportError, match=r"base model folder .*gone/tiny-qwen3 \(from the run's "
                                          r"hypersloth_config.json .*\) not found: pass --base"):
        export_run(moved, tmp_path / "out")
    with pytest.raises(ExportError, match=r"from --base\) not found"):
        export_run(moved, tmp_path / "out", base=str(tmp_path / "nope"))
    assert not (tmp_path / "out").exists()


def test_base_override_and_relative_name_resolved_next_to_the_config(tiny, run, tmp_path, monkeypatch):
    run_dir, _ = run
    moved = tmp_path / "run"
    shutil.copytree(run_dir, moved, ignore=shutil.ignore_patterns("checkpoint-*", "export"))
    shutil.copytree(tiny, tmp_path / "build" / "tiny-qwen3")
    write_resolved_config(moved, "build/tiny-qwen3")  # relative, as the tiny-cpu template writes it
    resolved = json.loads((moved / "hypersloth_config.json").read_text())
    resolved["source_path"] = str(tmp_path / "cfg.py")
    (moved / "hypersloth_config.json").write_text(json.dumps(resolved))
    monkeypatch.chdir(moved)  # not where training ran: the config file's folder is tried next
    assert export_run(moved, tmp_path / "a").base == str(tmp_path / "build" / "tiny-qwen3")
    assert export_run(moved, tmp_path / "b", base=str(tiny)).base == str(tiny)


def test_prequantised_base_merge_asks_for_the_original_weights(tiny, run, tmp_path):
    run_dir, _ = run
    quantised = tmp_path / "Qwen3-8B-bnb-4bit"
    shutil.copytree(tiny, quantised)
    config = json.loads((quantised / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (quantised / "config.json").write_text(json.dumps(config))
    with pytest.raises(ExportError, match=r"stored pre-quantised \(bitsandbytes\).*e\.g\. --base .*/Qwen3-8B$"):
        merge_adapter(run_dir, tmp_path / "merged", base=str(quantised))
    with pytest.raises(ExportError, match="stored pre-quantised"):
        export_run(run_dir, tmp_path / "out", merge=True, base=str(quantised))
    assert not (tmp_path / "out").exists()  # refused before the adapter was written
    # The adapter alone is fine against the quantised base it was trained on (QLoRA's usual case).
    adapter = export_adapter(run_dir, tmp_path / "adapter", base=str(quantised))
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(quantised)


def test_qlora_run_merges_into_the_unquantised_base(tiny, run, tmp_path):
    run_dir, expected = run
    qlora = tmp_path / "qlora-run"
    shutil.copytree(run_dir, qlora, ignore=shutil.ignore_patterns("checkpoint-*", "export"))
    write_resolved_config(qlora, str(tiny), load_in_4bit=True)
    merged = merge_adapter(qlora, tmp_path / "merged", dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32)
    assert getattr(model.config, "quantization_config", None) is None
    torch.testing.assert_close(logits(model.eval()), expected, rtol=0, atol=1e-4)


def test_adapter_for_another_architecture_fails_verification(run, tmp_path):
    run_dir, _ = run
    other = build_tiny_model(tmp_path / "wide", hidden_size=96, head_dim=24)
    with pytest.raises(ExportError, match=rf"does not fit base {other} \(size mismatch for .*lora_A"):
        export_adapter(run_dir, tmp_path / "adapter", base=str(other))
    with pytest.raises(ExportError, match=rf"does not fit base {other} \(size mismatch"):
        merge_adapter(run_dir, tmp_path / "merged", base=str(other))
    assert not list(tmp_path.glob("*adapter*")) and not list(tmp_path.glob("*merged*"))  # nothing half-written


def test_full_finetune_run_is_resaved_as_merged(tiny, tmp_path):
    run_dir = tmp_path / "full-run"
    shutil.copytree(tiny, run_dir)
    write_resolved_config(run_dir, str(tiny), lora=False)
    result = export_run(run_dir, tmp_path / "out", dtype="float32")
    assert result.adapter_dir is None and result.merged_dir == tmp_path / "out" / "merged"
    exported = AutoModelForCausalLM.from_pretrained(str(result.merged_dir), dtype=torch.float32).eval()
    torch.testing.assert_close(logits(exported), logits(load_base(tiny)), rtol=0, atol=0)
