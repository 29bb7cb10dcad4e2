"""scripts/sampling_bench.py on the CPU: the two transformers engines sample the tiny model, each in its own
process, and agree on every completion (fp32), as does one with the adapter off; the token-step profile; a misspelt
engine is refused, and so is the deferred stop check on the CPU (its patch of transformers checked apart). Its GPU figures are docs/grpo.md's."""

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
                           "--engines", "hf-dynamic,hf-static,hf-dynamic-no-lora", "--max-new", "4", "--calls", "2",
                           "--out", str(out),
                           "--profile-steps", "2", "--profile-from", "0", "--profile-dir", str(tmp_path / "profiles")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    dynamic, static, no_lora = json.loads(out.read_text())
    assert (dynamic["engine"], static["engine"]) == ("hf-dynamic", "hf-static")
    assert len(dynamic["seconds"]) == len(static["seconds"]) == 2 and static["first_call_s"] > 0
    assert static["same_completions_as_hf-dynamic"] == 1.0
    # the adapter off while sampling: a fresh adapter (B = 0) changes nothing, so the same completions
    assert no_lora["engine"] == "hf-dynamic-no-lora" and no_lora["same_completions_as_hf-dynamic"] == 1.0
    # one more call each, token steps 2-3 of its 4 under torch.profiler: the sampler marked the steps
    for record in (dynamic, static):
        profile = record["profile"]
        assert profile["token_steps"] == 2 and profile["wall_ms_per_token_step"] > 0
        assert profile["gpu_busy_ms_per_token_step"] is None  # CPU
        table = (tmp_path / "profiles" / f"{record['engine']}.txt").read_text()
        assert table.startswith(json.dumps(profile)) and "aten::mm" in table


def test_the_deferred_stop_check_is_turned_on_for_any_device_and_off_again(tiny_model_dir):
    import importlib.util

    import torch
    from transformers.generation.utils import DeferredStopCheck

    spec = importlib.util.spec_from_file_location("sampling_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cuda = torch.device("cuda")
    assert not DeferredStopCheck.is_supported(cuda, None, False, False)  # transformers 5.17: MPS only
    with bench.deferred_stop_check():
        assert DeferredStopCheck.is_supported(cuda, None, False, False)
        assert not DeferredStopCheck.is_supported(cuda, None, True, False)  # a returned cache would need cropping
    assert not DeferredStopCheck.is_supported(cuda, None, False, False)
    assert bench.base_engine("unsloth-no-lora-deferred") == "unsloth"
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--device", "cpu",
                           "--engines", "hf-dynamic-deferred"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "needs a GPU" in done.stderr


def test_an_unknown_engine_is_refused(tiny_model_dir):
    done = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_model_dir), "--engines", "vllm"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "unknown engines ['vllm']" in done.stderr
