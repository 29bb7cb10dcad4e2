"""HyperSloth.cli.command: the flag table every CLI checks argv against before anything runs."""

from __future__ import annotations

import importlib
import inspect

import pytest

from HyperSloth.cli.command import Command, Flag, Positional, UsageError

DEMO = Command(
    prog="demo",
    summary="A demo command.",
    positionals=(Positional("path", "PATH", "the file"), Positional("extra", "EXTRA", "more", required=False)),
    flags=(
        Flag("template", "a template", value="NAME"),
        Flag("force", "overwrite"),
        Flag("dry_run", "plan only", label="--dry-run"),
        Flag("n", "how many", value="N", short="-n"),
        Flag("print_samples", "print N samples", value="N", optional_value=True),
        Flag("seed", "seed", value="SEED"),
    ),
    examples=("demo x.py --force",),
    notes="exit codes: 0 ok",
)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["x.py"], ["x.py"]),
        (["x.py", "--template", "lora"], ["x.py", "--template=lora"]),
        (["--template=lora", "x.py"], ["x.py", "--template=lora"]),
        # A switch never swallows the next word (fire would make x.py the value of --force).
        (["--force", "x.py"], ["x.py", "--force=True"]),
        (["x.py", "--noforce"], ["x.py", "--force=False"]),
        (["x.py", "--force=false"], ["x.py", "--force=False"]),
        (["x.py", "--dry-run"], ["x.py", "--dry_run=True"]),
        (["x.py", "--dry_run"], ["x.py", "--dry_run=True"]),
        (["x.py", "-n", "5"], ["x.py", "--n=5"]),
        (["x.py", "--seed", "-1"], ["x.py", "--seed=-1"]),
        (["x.py", "--print_samples"], ["x.py", "--print_samples=True"]),
        (["x.py", "--print_samples", "4"], ["x.py", "--print_samples=4"]),
        (["--print_samples", "x.py"], ["x.py", "--print_samples=True"]),
        (["--path", "x.py", "y"], ["y", "--path=x.py"]),  # a positional given by name, as fire allows
    ],
)
def test_check_normalises_for_fire(argv, expected):
    assert DEMO.check(argv) == expected


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["x.py", "--templat", "lora"], "unknown option --templat; did you mean --template?"),
        (["x.py", "--dryrun"], "unknown option --dryrun; did you mean --dry-run?"),
        (["x.py", "--forse"], "unknown option --forse; did you mean --force?"),
        (["x.py", "--zzzzzz"], "unknown option --zzzzzz (see `demo --help`)"),
        (["x.py", "-x"], "unknown option -x"),
        (["x.py", "-force"], "unknown option -force; did you mean --force?"),
        (["x.py", "--template"], "--template needs a value (--template NAME)"),
        (["x.py", "--template", "--force"], "--template needs a value"),
        (["x.py", "--force=maybe"], "--force is a switch"),
        (["x.py", "y", "z"], "unexpected argument(s): z"),
        (["--force"], "missing PATH"),
        (["x.py", "--", "--trace"], "unexpected '--'"),
    ],
)
def test_check_refuses_with_a_message_that_says_what_to_change(argv, message):
    with pytest.raises(UsageError) as err:
        DEMO.check(argv)
    assert message in str(err.value)


def test_help_is_plain_text_with_arguments_options_and_examples():
    text = DEMO.help_text()
    lines = text.splitlines()
    # The usage wraps between items, never inside one; descriptions start in one column.
    assert lines[0] == "usage: demo PATH [EXTRA] [--template NAME] [--force] [--dry-run] [--n N] [--print_samples [N]]"
    assert lines[1] == "            [--seed SEED]"
    column = len("  --print_samples [N]  ")  # the longest label + 2 spaces
    for label, description in [("PATH", "the file"), ("--template NAME", "a template"), ("-n, --n N", "how many"),
                                ("-h, --help", "show this help")]:
        assert f"  {label}".ljust(column) + description in lines
    assert "arguments:" in lines and "options:" in lines
    assert "examples:\n  demo x.py --force" in text and text.endswith("\n\nexit codes: 0 ok\n")
    assert "Type:" not in text and "Optional" not in text


def test_run_calls_the_function_only_with_a_valid_command_line(capsys):
    calls = []

    def function(path, extra=None, template="t", force=False, dry_run=False, n=None, print_samples=0, seed=0):
        calls.append((path, template, force, n))

    DEMO.run(function, ["x.py", "--template", "lora", "-n", "3"])
    assert calls == [("x.py", "lora", False, 3)]
    with pytest.raises(SystemExit) as exit_info:
        DEMO.run(function, ["x.py", "--templat", "lora"])
    assert exit_info.value.code == 2 and len(calls) == 1
    assert capsys.readouterr().err == ("demo: error: unknown option --templat; did you mean --template? "
                                       "(see `demo --help`)\n")


@pytest.mark.parametrize(("argv", "code"), [(["--help"], 0), (["x.py", "-h"], 0), ([], 2)])
def test_help_and_no_arguments_print_the_help(capsys, argv, code):
    with pytest.raises(SystemExit) as exit_info:
        DEMO.run(lambda path: None, argv)
    assert exit_info.value.code == code and capsys.readouterr().out == DEMO.help_text()


# CLI module -> the function its main() hands to fire.
CLIS = {"train": "train", "init": "init", "build_dataset": "build_dataset_cli", "plan": "plan",
        "export": "export", "tiny_model": "tiny_model"}


@pytest.mark.parametrize("name", sorted(CLIS))
def test_each_cli_table_matches_the_function_fire_calls(name):
    # A flag in the table that the function lacks (or the reverse) would pass the check and then fail
    # inside fire, or never be accepted: the two must list the same parameters.
    module = importlib.import_module(f"HyperSloth.cli.{name}")
    command: Command = module.COMMAND
    function = getattr(module, CLIS[name])
    params = inspect.signature(function).parameters
    table = [p.name for p in command.positionals] + [f.name for f in command.flags]
    assert sorted(table) == sorted(params)
    for positional in command.positionals:  # required positionals are the parameters without default
        assert positional.required == (params[positional.name].default is inspect.Parameter.empty)
