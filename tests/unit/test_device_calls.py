"""The device calls still to run parse on the CPU. Every `python3 scripts/X.py ...` and `bench ...` command of the
call scripts that hold them (PENDING) goes to its script's own argument parser, stopped right after parsing, and
the names it passes are known to the script (benchmark's workloads and systems, arch_check's architectures,
sampling_bench's engines). A misspelt flag or name would otherwise be found on the GPU machine, at the cost of a
call: minutes of a 30-minute session."""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"
# The call scripts whose calls are still to run (their headers and docs/benchmarks.md say which, in what order).
PENDING = ["docs/benchmarks/2026-12-05-device-calls.sh", "docs/benchmarks/2026-12-02-fa4-device-calls.sh"]
BENCH_FIXED = ["--work", "/tmp/hs_bench", "--out", "/tmp/out", "--num-gpus", "1"]  # device_calls_lib.sh's bench()

sys.path.insert(0, str(SCRIPTS))


def commands(script: Path) -> list[tuple[str, list[str]]]:
    """(script name, argv) of each command in a call script: `$(left N)` becomes 300 seconds, a variable in a
    value becomes a placeholder path, one standing alone (a loop's optional flag) is left out; redirections, pipes
    and `&` end a command. Commands that take their arguments from the caller ("$@") are left out."""
    text = re.sub(r"\\\n\s*", " ", script.read_text())
    found = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for match in re.finditer(r"(?:python3 scripts/(\w+)\.py|(?:^|[;&|])\s*(bench)(?=\s))", line):
            name = match.group(1) or "benchmark"
            rest = line[match.end():]
            rest = re.split(r"\s(?:\d?>|&>|\|\||\||&&|;|&(?:\s|$))", rest + " ", maxsplit=1)[0]
            if '"$@"' in rest:
                continue
            argv = []
            for token in shlex.split(re.sub(r"\$\(left \$?\w+\)", "300", rest)):
                if re.fullmatch(r"\$\{?\w+\}?", token) and not (argv and argv[-1].startswith("--")):
                    continue  # a loop's optional flag ($reuse): the command without it
                argv.append(re.sub(r"\$\{?[A-Za-z_]\w*(?::\+[^}]*)?\}?", "/tmp/placeholder", token))
            found.append((name, BENCH_FIXED + argv if match.group(2) else argv))
    return found


class Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace):
        self.namespace = namespace


def parse(name: str, argv: list[str], monkeypatch) -> argparse.Namespace:
    """The namespace SCRIPTS/name.py's own parser gives `argv` (the script stopped right after parsing)."""
    real = argparse.ArgumentParser.parse_args

    def stop_after_parsing(self, args=None, namespace=None):
        raise Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop_after_parsing)
    monkeypatch.setattr(sys, "argv", [str(SCRIPTS / f"{name}.py"), *argv])
    with pytest.raises(Parsed) as parsed:
        runpy.run_path(str(SCRIPTS / f"{name}.py"), run_name="__main__")
    return parsed.value.namespace


def check_names(name: str, a: argparse.Namespace) -> None:
    """The names a command passes are the script's own."""
    if name == "benchmark" and not a.as_system:
        from bench_workloads import WORKLOADS
        from benchmark import parse_slots

        assert set(a.workloads.split(",")) <= WORKLOADS.keys(), a.workloads
        parse_slots(a.slots)  # SystemExit for an unknown system
    if name == "arch_check":
        from HyperSloth.train.tiny_architectures import ARCHITECTURES

        assert set(a.architectures.split(",")) <= set(ARCHITECTURES), a.architectures
    if name == "sampling_bench":
        from sampling_bench import ENGINES, base_engine

        assert {base_engine(e) for e in a.engines.split(",")} <= set(ENGINES), a.engines


CALLS = [(f"{Path(script).name}: {name} {' '.join(argv)}", name, argv)
         for script in PENDING for name, argv in commands(ROOT / script)]


def test_the_pending_call_scripts_hold_commands_of_every_kind():
    names = {name for _, name, _ in CALLS}
    assert {"benchmark", "arch_check", "graph_check", "sampling_bench", "reuse_check", "profile_step"} <= names, names
    assert len(CALLS) >= 20


@pytest.mark.parametrize("call", CALLS, ids=[c[0][:120] for c in CALLS])
def test_every_pending_device_command_parses(call, monkeypatch):
    _, name, argv = call
    check_names(name, parse(name, argv, monkeypatch))


def test_a_misspelt_flag_or_name_is_caught(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parse("graph_check", ["--model", "0.6b", "--rowz", "8192"], monkeypatch)
    assert "unrecognized arguments: --rowz" in capsys.readouterr().err
    with pytest.raises(AssertionError):
        check_names("sampling_bench", parse("sampling_bench", ["--model", "m", "--engines", "unsloth-merged-foldd"],
                                                  monkeypatch))
    with pytest.raises(SystemExit, match="unknown systems"):
        check_names("benchmark", parse("benchmark", [*BENCH_FIXED, "--slots", "hypersloth-l"], monkeypatch))
