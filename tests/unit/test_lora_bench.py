"""scripts/lora_bench.py end to end on CPU (--device cpu --quick): Unsloth absent, ours timed and checked
against the fp32 reference, every record written to $OUT/lora_bench.json; a failing variant is reported."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import lora_bench  # noqa: E402


def test_quick_cpu_run_writes_every_case_with_small_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert lora_bench.main(["--device", "cpu", "--quick", "--tokens", "13", "--reps", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["header"]["unsloth"].startswith("absent")
    saved = json.loads((tmp_path / "lora_bench.json").read_text())
    assert saved["cases"] == lines[1:] and [c["block"] for c in lines[1:]] == ["qkv", "mlp", "o"]
    for case in lines[1:]:
        expected = {"ours_auto"} if case["block"] == "o" else {"ours_auto", "ours_concat", "ours_epilogue"}
        assert set(case["variants"]) == expected
        for result in case["variants"].values():
            assert max(result["rel_err"].values()) < 1e-5 and result["median_ms"] > 0


def test_a_failing_variant_is_reported_and_the_rest_still_run(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(lora_bench.lp, "lora_linear", broken)
    monkeypatch.delenv("OUT", raising=False)
    argv = ["--device", "cpu", "--quick", "--tokens", "5", "--reps", "1", "--blocks", "o", "qkv"]
    assert lora_bench.main(argv) == 0
    o_case, qkv_case = [json.loads(line) for line in capsys.readouterr().out.splitlines()[1:]]
    assert o_case["variants"]["ours_auto"]["error"] == "RuntimeError: boom"
    assert "median_ms" in qkv_case["variants"]["ours_auto"]


def test_the_time_budget_skips_the_cases_left(capsys):
    assert lora_bench.main(["--device", "cpu", "--quick", "--budget-s", "0"]) == 0
    cases = [json.loads(line) for line in capsys.readouterr().out.splitlines()[1:]]
    assert len(cases) == 6 and all(c["skipped"].startswith("time budget") for c in cases)
