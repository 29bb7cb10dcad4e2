"""The console scripts' wrapper (HyperSloth/cli/console.py): whatever the CLI's main does (returns, exits, raises), the
process's objects are frozen before it exits, so the interpreter's last collection does not walk them (~3 s with
the training stack loaded, on the 2-core CPU machine)."""

from __future__ import annotations

import gc
import sys
import types

import pytest

from HyperSloth.cli import console


@pytest.mark.parametrize("ending", ["returns", "exits", "raises"])
def test_every_ending_of_a_command_freezes_before_the_exit(ending, monkeypatch):
    def main():
        calls.append("main")
        if ending == "exits":
            raise SystemExit(2)
        if ending == "raises":
            raise RuntimeError("a bug")

    calls = []
    monkeypatch.setitem(sys.modules, "fake_cli", types.SimpleNamespace(main=main))
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    expected = {"returns": None, "exits": SystemExit, "raises": RuntimeError}[ending]
    if expected is None:
        console._console("fake_cli", "fake")
    else:
        with pytest.raises(expected):
            console._console("fake_cli", "fake")
    assert calls == ["main", "freeze"]
