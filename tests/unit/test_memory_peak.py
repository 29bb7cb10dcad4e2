"""scripts/memory_peak.py: the peak of a CUDA memory snapshot and what is alive there, on a hand-made snapshot
in torch's format (device_traces of alloc / free_requested / free_completed events, segments of blocks)."""

import pickle
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import memory_peak  # noqa: E402

MIB = 2**20


def _frames(*where):
    """Innermost first, as torch records them: C++ frames, torch's own Python, then the callers."""
    return [{"name": "c10::malloc", "filename": "CUDACachingAllocator.cpp", "line": 0},
            {"name": "apply", "filename": "/venv/lib/python3.12/site-packages/torch/autograd/function.py", "line": 596},
            *({"name": n, "filename": f, "line": ln} for f, ln, n in where)]


def _snapshot():
    mlp = _frames(("/site/unsloth/kernels/fast_lora.py", 418, "forward"), ("/repo/train.py", 10, "step"))
    attn = _frames(("/site/unsloth/utils/attention_dispatch.py", 502, "forward"), ("/repo/train.py", 10, "step"))
    opt = _frames(("/site/torch/optim/adamw.py", 300, "_fused_adamw"), ("/repo/train.py", 12, "step"))
    trace = [
        {"action": "alloc", "addr": 1, "size": 300 * MIB, "time_us": 1, "frames": mlp},
        {"action": "alloc", "addr": 2, "size": 100 * MIB, "time_us": 2, "frames": attn},
        {"action": "alloc", "addr": 3, "size": 200 * MIB, "time_us": 3, "frames": mlp},  # the peak: 600 MiB
        {"action": "free_requested", "addr": 1, "size": 300 * MIB, "time_us": 4, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 300 * MIB, "time_us": 4, "frames": []},
        {"action": "free_completed", "addr": 3, "size": 200 * MIB, "time_us": 5, "frames": []},
        {"action": "alloc", "addr": 4, "size": 450 * MIB, "time_us": 6, "frames": opt},  # 550 MiB: below it
    ]
    # At the dump: 1 GiB allocated before recording began, plus the trace's survivors (2 and 4).
    segments = [{"device": 0, "blocks": [{"size": 1024 * MIB, "state": "active_allocated"},
                                         {"size": 100 * MIB, "state": "active_allocated"},
                                         {"size": 450 * MIB, "state": "active_allocated"},
                                         {"size": 64 * MIB, "state": "inactive"}]}]
    return {"segments": segments, "device_traces": [trace]}


def test_the_peak_counts_what_was_alive_before_recording():
    peak = memory_peak.find_peak(_snapshot())
    assert peak.baseline_bytes == 1024 * MIB
    assert peak.peak_bytes == (1024 + 600) * MIB and peak.at_us == 3


def test_what_is_alive_at_the_peak_is_grouped_by_the_innermost_frame_outside_torch():
    record = memory_peak.find_peak(_snapshot()).as_record(top=5)
    sites = {s["site"]: s for s in record["sites"]}
    assert set(sites) == {"unsloth/kernels/fast_lora.py:418 forward", "unsloth/utils/attention_dispatch.py:502 forward"}
    mlp = sites["unsloth/kernels/fast_lora.py:418 forward"]
    assert mlp["gib"] == pytest.approx(500 / 1024) and mlp["count"] == 2 and mlp["context"] == "repo/train.py:10 step"
    assert record["sites"][0]["site"].startswith("unsloth/kernels/fast_lora.py")  # largest first
    assert record["in_trace_gib"] == pytest.approx(600 / 1024)


def test_the_script_prints_the_peak_and_refuses_a_snapshot_without_the_device(tmp_path):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(_snapshot()))
    argv = [sys.executable, str(SCRIPTS / "memory_peak.py"), str(path), "--json", str(tmp_path / "p.json")]
    out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
    assert "peak 1.59 GiB allocated: 1.00 GiB alive before recording" in out and "fast_lora.py:418" in out
    assert (tmp_path / "p.json").exists()
    bad = subprocess.run([sys.executable, str(SCRIPTS / "memory_peak.py"), str(path), "--device", "1"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "no trace for device 1" in bad.stderr
