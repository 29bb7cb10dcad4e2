"""What every HyperSloth CLI shares: its flag table, the check of argv before anything runs, the help
text, and a Ctrl-C that ends with one line.

Fire parses a command line only while it calls the function, so an unknown or misspelt flag was
reported *after* the function had run: `hypersloth-init x.py --templat lora-2gpu` wrote x.py from the
default template, then complained. Here each CLI declares its arguments once (`Command`); `run`
checks argv against that table first (unknown flags exit 2 naming the closest valid one, nothing
written), prints our own plain help (no pager, no type noise), normalises argv to `--name=value`
form and only then lets fire make the call, with Ctrl-C ending in one line (HyperSloth.cli.console).
"""

from __future__ import annotations

import difflib
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from HyperSloth.cli.console import interrupts_end_quietly

HELP_FLAGS = ("-h", "--help")
_TRUE, _FALSE = ("true", "yes", "1"), ("false", "no", "0")
_WIDTH = 100  # help text width
_COLUMNS = (20, 28)  # where flag descriptions start: after the longest label, within these bounds


class UsageError(Exception):
    """A command line that does not fit the CLI's table; the message says what to change."""


@dataclass(frozen=True)
class Flag:
    """One option. `value` is the metavar of a flag that takes a value; None makes it a switch
    (`--force`, `--noforce`, `--force=false`). `optional_value`: the value may be left out
    (`--print_samples` or `--print_samples 5`; only a whole number is taken as its value)."""

    name: str  # the function's parameter name, e.g. dry_run
    help: str
    value: str | None = None
    optional_value: bool = False
    short: str | None = None  # e.g. "-n"
    label: str | None = None  # how help spells it, e.g. --dry-run or --noverify (default --name)

    @property
    def shown(self) -> str:
        return self.label or f"--{self.name}"


@dataclass(frozen=True)
class Positional:
    """A positional argument; it may also be given by name (`--config FILE`), as fire allows."""

    name: str
    metavar: str
    help: str
    required: bool = True


@dataclass(frozen=True)
class Command:
    """The arguments, help and examples of one CLI."""

    prog: str
    summary: str
    positionals: tuple[Positional, ...] = ()
    flags: tuple[Flag, ...] = ()
    examples: tuple[str, ...] = ()
    notes: str = ""

    def help_text(self) -> str:
        """The text `--help` prints."""
        # Wrapped between items only: spaces inside an item are NULs while textwrap runs.
        items = [item.replace(" ", "\0") for item in self._usage_items()]
        usage = textwrap.fill(" ".join(items), _WIDTH, initial_indent="usage: ", break_on_hyphens=False,
                              subsequent_indent=" " * len(f"usage: {self.prog} ")).replace("\0", " ")
        parts = [usage, self.summary.strip()]
        rows = [(p.metavar, p.help) for p in self.positionals]
        options = [(_flag_label(f), f.help) for f in self.flags] + [("-h, --help", "show this help")]
        column = min(max(_COLUMNS[0], *(len(label) + 4 for label, _ in rows + options)), _COLUMNS[1])
        if rows:
            parts.append("arguments:\n" + "\n".join(_entry(label, text, column) for label, text in rows))
        parts.append("options:\n" + "\n".join(_entry(label, text, column) for label, text in options))
        if self.examples:
            parts.append("examples:\n" + "\n".join("  " + line for line in self.examples))
        if self.notes:
            parts.append(self.notes.strip())
        return "\n\n".join(parts) + "\n"

    def usage(self) -> str:
        """One line: the program, its positionals and its flags."""
        return " ".join(self._usage_items())

    def _usage_items(self) -> list[str]:
        words = [self.prog]
        words += [p.metavar if p.required else f"[{p.metavar}]" for p in self.positionals]
        return words + [f"[{_flag_label(f, short=False)}]" for f in self.flags]

    def check(self, argv: Sequence[str]) -> list[str]:
        """argv checked against the table and rewritten for fire (flags as `--name=value`, positionals
        in order); UsageError for anything that does not fit, before anything has run."""
        by_name = self._lookup()
        flags_out: list[str] = []
        positionals: list[str] = []
        named: set[str] = set()
        args = list(argv)
        while args:
            arg = args.pop(0)
            if arg == "--" or not arg.startswith("-") or _is_number(arg):
                if arg == "--":
                    raise UsageError(f"unexpected '--'; see `{self.prog} --help`")
                positionals.append(arg)
                continue
            key, _, inline = arg.lstrip("-").partition("=")
            name, value = self._resolve(arg, key.replace("-", "_"), "=" in arg, inline, args, by_name)
            named.add(name)
            flags_out.append(f"--{name}={value}")
        self._check_positionals(positionals, named)
        return positionals + flags_out

    def run(self, function: Callable, argv: Sequence[str] | None = None) -> None:
        """Print help, or check argv and let fire call `function` with it; usage errors exit 2."""
        argv = list(sys.argv[1:] if argv is None else argv)
        if any(arg in HELP_FLAGS for arg in argv) or (not argv and self._required()):
            print(self.help_text(), end="")
            raise SystemExit(0 if argv else 2)
        try:
            command = self.check(argv)
        except UsageError as err:
            print(f"{self.prog}: error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        import fire  # only once the command line is known to be valid

        with interrupts_end_quietly(self.prog):
            fire.Fire(function, command=command, name=self.prog)

    # ------------------------------------------------------------------ internals

    def _required(self) -> list[Positional]:
        return [p for p in self.positionals if p.required]

    def _lookup(self) -> dict[str, Flag | Positional]:
        table: dict[str, Flag | Positional] = {p.name: p for p in self.positionals}
        table.update({f.name: f for f in self.flags})
        return table

    def _resolve(self, arg: str, key: str, has_inline: bool, inline: str, rest: list[str],
                 by_name: dict[str, Flag | Positional]) -> tuple[str, str]:
        """(parameter name, value) of one flag token, consuming its value from `rest` if needed."""
        short = next((f for f in self.flags if f.short == arg.split("=")[0]), None)
        entry = short or by_name.get(key)
        if entry is None and key.startswith("no") and isinstance(by_name.get(key[2:]), Flag):
            negated = by_name[key[2:]]
            if negated.value is None and not has_inline:
                return negated.name, "False"
        if entry is None or (arg.startswith("-") and not arg.startswith("--") and short is None):
            raise UsageError(self._unknown(arg.split("=")[0]))
        label = entry.shown if isinstance(entry, Flag) else f"--{entry.name}"
        if isinstance(entry, Flag) and entry.value is None:
            return entry.name, _switch_value(label, inline if has_inline else None)
        if has_inline:
            return entry.name, inline
        optional = isinstance(entry, Flag) and entry.optional_value
        if rest and (not optional or rest[0].isdigit()) and (optional or not _looks_like_flag(rest[0])):
            return entry.name, rest.pop(0)
        if optional:
            return entry.name, "True"
        metavar = entry.value if isinstance(entry, Flag) else entry.metavar
        raise UsageError(f"{label} needs a value ({label} {metavar}); see `{self.prog} --help`")

    def _check_positionals(self, given: list[str], named: set[str]) -> None:
        open_slots = [p for p in self.positionals if p.name not in named]
        if len(given) > len(open_slots):
            extra = " ".join(given[len(open_slots):])
            raise UsageError(f"unexpected argument(s): {extra}; see `{self.prog} --help`")
        missing = [p.metavar for p in open_slots[len(given):] if p.required]
        if missing:
            raise UsageError(f"missing {' '.join(missing)}; see `{self.prog} --help`")

    def _unknown(self, flag: str) -> str:
        spellings = {f.shown: f.shown for f in self.flags}
        spellings.update({f"--{f.name}": f.shown for f in self.flags})
        spellings.update({f.short: f.short for f in self.flags if f.short})
        close = difflib.get_close_matches(flag.replace("_", "-"), [s.replace("_", "-") for s in spellings], n=1)
        hint = ""
        if close:
            original = next(s for s in spellings if s.replace("_", "-") == close[0])
            hint = f"; did you mean {spellings[original]}?"
        return f"unknown option {flag}{hint} (see `{self.prog} --help`)"


def _flag_label(flag: Flag, short: bool = True) -> str:
    value = "" if flag.value is None else (f" [{flag.value}]" if flag.optional_value else f" {flag.value}")
    prefix = f"{flag.short}, " if (short and flag.short and flag.short != flag.shown) else ""
    return f"{prefix}{flag.shown}{value}"


def _entry(label: str, text: str, column: int) -> str:
    """`  LABEL   text`, the text wrapped and indented to `column` (a longer label gets its own line)."""
    head = f"  {label}"
    indent = " " * column
    lines = []
    for i, paragraph in enumerate(text.strip().split("\n")):
        first = head.ljust(column) if i == 0 and len(head) < column - 1 else indent
        if i == 0 and len(head) >= column - 1:
            lines.append(head)
        lines.append(textwrap.fill(paragraph.strip(), _WIDTH, initial_indent=first, subsequent_indent=indent))
    return "\n".join(lines)


def _switch_value(label: str, inline: str | None) -> str:
    if inline is None or inline.lower() in _TRUE:
        return "True"
    if inline.lower() in _FALSE:
        return "False"
    raise UsageError(f"{label} is a switch: give it alone, or as {label}=true / {label}=false")


def _is_number(arg: str) -> bool:
    try:
        float(arg)
    except ValueError:
        return False
    return True


def _looks_like_flag(arg: str) -> bool:
    return arg.startswith("-") and not _is_number(arg)
