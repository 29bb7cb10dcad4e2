"""scripts/sampling_bench.py on the CPU: the two transformers engines sample the tiny model, each in its own
process, and agree on every completion (fp32), as do one with the adapter off and one on merged weights; the token-step profile; a misspelt
engine is refused, and so is a -sync variant on the CPU (where nothing is deferred). Its GPU figures are
docs/grpo.md's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "sampling_bench.py"


@pytest.mark.slow
def test_the_engines_sample_the_same_completions_and_report_each_call(tiny_model_dir, tmp_path):
    out = tmp_path / "sampling.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--device", "cpu",
                           "--engines", "hf-dynamic,hf-static,hf-dynamic-no-lora,hf-dynamic-merged", "--max-new", "4", "--calls", "2",
                           "--out", str(out),
                           "--profile-steps", "2", "--profile-from", "0", "--profile-dir", str(tmp_path / "profiles")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    dynamic, static, no_lora, merged = json.loads(out.read_text())
    assert (dynamic["engine"], static["engine"]) == ("hf-dynamic", "hf-static")
    assert len(dynamic["seconds"]) == len(static["seconds"]) == 2 and static["first_call_s"] > 0
    assert static["same_completions_as_hf-dynamic"] == 1.0
    # the adapter off while sampling: a fresh adapter (B = 0) changes nothing, so the same completions
    assert no_lora["engine"] == "hf-dynamic-no-lora" and no_lora["same_completions_as_hf-dynamic"] == 1.0
    assert merged["engine"] == "hf-dynamic-merged" and merged["same_completions_as_hf-dynamic"] == 1.0
    # one more call each, token steps 2-3 of its 4 under torch.profiler: the sampler marked the steps
    for record in (dynamic, static):
        profile = record["profile"]
        assert profile["token_steps"] == 2 and profile["wall_ms_per_token_step"] > 0
        assert profile["gpu_busy_ms_per_token_step"] is None  # CPU
        table = (tmp_path / "profiles" / f"{record['engine']}.txt").read_text()
        assert table.startswith(json.dumps(profile)) and "aten::mm" in table


def test_a_sync_variant_names_its_engine_and_is_refused_on_the_cpu(tiny_model_dir):
    """GRPO defers the stop check on a GPU (rollout.deferred_stop_check, tested in tests/unit/test_grpo_rollout.py);
    ENGINE-sync is the comparison, which the CPU cannot make."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sampling_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.base_engine("unsloth-no-lora-sync") == "unsloth"
    assert bench.base_engine("unsloth-merged-folded-sync") == "unsloth"
    assert bench.variants("unsloth-merged-folded") == {bench.MERGED, bench.FOLDED} and not bench.variants("hf-static")
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--device", "cpu",
                           "--engines", "hf-dynamic-sync"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "runs on a GPU only" in done.stderr, done.stderr


def test_an_unknown_engine_is_refused(tiny_model_dir):
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--engines", "vllm"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "unknown engines ['vllm']" in done.stderr
