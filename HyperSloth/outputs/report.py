"""The run report: `report.md` + `report.png` in a run's output_dir, and a short console summary.

It reads files only: `train_summary.json` (required), `hypersloth_config.json` and the ranks'
`final.json` records (optional; names in HyperSloth.outputs.run_files), so any finished run can be reported
again later:
    python -c "from HyperSloth.outputs.report import write_report; write_report('outputs/tiny-demo')"
Every summary key is optional here: a 1-step run, or a summary written by an older version,
still gets a report with the lines it has data for. Every curve and table is numbered by global
optimizer step: after a resume the losses start at `first_step`, and the learning rate and grad norm
are those logged at `log_steps`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from statistics import median
from typing import Any

from loguru import logger

from HyperSloth.outputs import run_files
from HyperSloth.outputs.run_files import CONFIG_FILE, REPORT_MD, REPORT_PNG, SUMMARY_FILE
MAX_TABLE_ROWS = 20  # rows of the per-step table; longer runs show every k-th step


def load_summary(output_dir: str | os.PathLike) -> dict[str, Any]:
    """The run's train_summary.json; FileNotFoundError naming the folder if the run has not finished."""
    path = Path(output_dir) / SUMMARY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the report needs a finished run's output_dir")
    return json.loads(path.read_text())


def format_console(summary: Mapping[str, Any]) -> str:
    """A 5-8 line summary of a run for the terminal."""
    lines = [_headline(summary)]
    rows = [("loss", _loss_text(summary)), ("rewards", _rewards_text(summary)), ("eval", _eval_text(summary)),
            ("throughput", _throughput_text(summary)),
            ("padding", _padding_text(summary)), ("balance", _balance_text(summary)),
            ("time", _time_text(summary)), ("memory", _memory_text(summary))]
    lines += [f"  {label:<12}{text}" for label, text in rows if text]
    return "\n".join(lines)


def write_report(output_dir: str | os.PathLike) -> Path:
    """Write report.md (and report.png when there is a curve to draw) in `output_dir`; return report.md."""
    out = Path(output_dir)
    summary = load_summary(out)
    config = _read_optional_json(out / CONFIG_FILE)
    ranks = _rank_records(out)
    image = _try_plot(summary, config, out / REPORT_PNG)
    return run_files.atomic_write_text(out / REPORT_MD, _markdown(summary, config, ranks, image, out))


# ---------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------
def _num(summary: Mapping[str, Any], key: str) -> float | None:
    """summary[key] as a finite float, or None when missing, null or not a number."""
    value = summary.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _series(summary: Mapping[str, Any], key: str) -> list[float | None]:
    values = summary.get(key) or []
    return [_num({"v": v}, "v") for v in values] if isinstance(values, list) else []


def compute_saved_pct(padding_pct: float, random_padding_pct: float) -> float:
    """Computed tokens saved against random batching, in % of random batching's computed tokens.

    Computed tokens = real / (1 - padding fraction), so the saving is 1 - (1 - r) / (1 - p).
    """
    p, r = padding_pct / 100, random_padding_pct / 100
    return 100 * (1 - (1 - r) / (1 - p)) if p < 1 else 0.0


def _headline(summary: Mapping[str, Any]) -> str:
    steps, world = summary.get("steps", "?"), summary.get("world_size", "?")
    details = [str(summary[k]) for k in ("backend",) if summary.get(k)]
    if summary.get("batching"):
        details.append(f"{summary['batching']} batching")
    if summary.get("global_batch_size"):
        details.append(f"global batch {summary['global_batch_size']}")
    extra = f" ({', '.join(details)})" if details else ""
    return f"HyperSloth run: {steps} step(s) on {world} worker(s){extra}"


def _loss_text(summary: Mapping[str, Any]) -> str | None:
    losses = [v for v in _series(summary, "step_losses") if v is not None]
    first, last = _num(summary, "first_loss"), _num(summary, "last_loss")
    first = losses[0] if first is None and losses else first
    last = losses[-1] if last is None and losses else last
    if first is None or last is None:
        return None
    text = f"{first:.4f} -> {last:.4f}"
    steps = _loss_steps(summary)
    points = [(s, v) for s, v in zip(steps, _series(summary, "step_losses")) if v is not None]
    if len(points) > 2:
        step, best = min(points, key=lambda point: point[1])
        text += f" (min {best:.4f} at step {step})"
    return text


def _loss_steps(summary: Mapping[str, Any]) -> list[int]:
    """Global step of each entry of step_losses (one per step, from `first_step`, 1 without a resume)."""
    first = _num(summary, "first_step")
    start = int(first) if first is not None and first >= 1 else 1
    return list(range(start, start + len(_series(summary, "step_losses"))))


def _logged_at(summary: Mapping[str, Any], key: str, config: Mapping[str, Any]) -> dict[int, float | None]:
    """learning_rates / grad_norms by the global step they were logged at."""
    values = _series(summary, key)
    steps = summary.get("log_steps")
    if not (isinstance(steps, list) and len(steps) == len(values)):  # summaries of older versions
        total = int(_num(summary, "steps") or 0)
        steps = _logged_steps(len(values), total, _logging_steps(config))
    return dict(zip((int(s) for s in steps), values))


REWARD_KEYS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")  # TRL's names


def _rewards(summary: Mapping[str, Any]) -> dict[str, list[float | None]]:
    """A DPO run's per-step `rewards/*` (summary["step_rewards"]), each as long as step_losses; {} otherwise."""
    rewards = summary.get("step_rewards")
    if not isinstance(rewards, Mapping):
        return {}
    columns = {key: _series(rewards, key) for key in REWARD_KEYS}
    count = len(_series(summary, "step_losses"))
    return columns if all(len(v) == count for v in columns.values()) else {}


def _grpo_reward(summary: Mapping[str, Any]) -> list[tuple[int, float]]:
    """A GRPO run's (step, mean reward over the step's completions) (summary["step_metrics"]["reward"]); [] otherwise."""
    metrics = summary.get("step_metrics")
    rewards = _series(metrics, "reward") if isinstance(metrics, Mapping) else []
    steps = _loss_steps(summary)
    if len(rewards) != len(steps):
        return []
    return [(step, value) for step, value in zip(steps, rewards) if value is not None and math.isfinite(value)]


def _grpo_rewards_text(summary: Mapping[str, Any]) -> str | None:
    points = _grpo_reward(summary)
    if not points:
        return None
    best = max(points, key=lambda p: (p[1], -p[0]))
    return (f"reward {points[0][1]:.4f} -> {points[-1][1]:.4f} (max {best[1]:.4f} at step {best[0]}; GRPO, mean "
            f"over each step's completions, rewards {', '.join(map(str, summary.get('reward_funcs') or []))})")


def _rewards_text(summary: Mapping[str, Any]) -> str | None:
    if summary.get("method") == "grpo":
        return _grpo_rewards_text(summary)
    last = {key.split("/")[1]: values[-1] for key, values in _rewards(summary).items() if values}
    if len(last) != len(REWARD_KEYS) or None in last.values():
        return None
    return (f"last step: chosen {last['chosen']:+.4f}, rejected {last['rejected']:+.4f}, margin "
            f"{last['margins']:+.4f}, accuracy {100 * last['accuracies']:.1f}% (DPO, beta "
            f"{_fmt(_num(summary, 'dpo_beta'), 'g')})")


def _eval_points(summary: Mapping[str, Any]) -> list[tuple[int, float, int | None]]:
    """(step, eval_loss, eval_tokens) of every evaluation in the summary's "eval" list."""
    entries = summary.get("eval") if isinstance(summary.get("eval"), list) else []
    return [(int(e["step"]), float(e["eval_loss"]), e.get("eval_pairs", e.get("eval_tokens"))) for e in entries
            if isinstance(e, Mapping) and isinstance(e.get("step"), int) and _num(e, "eval_loss") is not None]


def _eval_text(summary: Mapping[str, Any]) -> str | None:
    points = _eval_points(summary)
    if not points:
        return None
    step, best, _ = min(points, key=lambda p: (p[1], p[0]))
    last_step, last, _ = points[-1]
    return (f"best eval_loss {best:.4f} at step {step} ({len(points)} evaluation(s); "
            f"last {last:.4f} at step {last_step})")


def _throughput_text(summary: Mapping[str, Any]) -> str | None:
    rate, total, runtime = (_num(summary, k) for k in ("tokens_per_s", "tokens_seen", "train_runtime_s"))
    # The time covers this process's steps only: after a resume, so does the token count set against it.
    part = _num(summary, "tokens_this_run")
    tokens = part if part is not None else total
    if rate is None and tokens is None:
        return None
    parts = [f"{rate:,.0f} tokens/s" if rate is not None else None,
             f"{tokens:,.0f} tokens" + (f" in {runtime:.1f} s of training" if runtime is not None else "")
             if tokens is not None else None]
    if part is not None and total is not None and total != part:
        parts.append(f"{total:,.0f} tokens over the whole run (resumed)")
    return "; ".join(p for p in parts if p)


def _padding_text(summary: Mapping[str, Any]) -> str | None:
    pad, rand = _num(summary, "padding_pct"), _num(summary, "random_padding_pct")
    if pad is None:
        return None
    if rand is None:
        return f"{pad:.1f}% of computed tokens"
    return (f"{pad:.1f}% (random batching: {rand:.1f}%; "
            f"{compute_saved_pct(pad, rand):.1f}% fewer computed tokens)")


def _balance_text(summary: Mapping[str, Any]) -> str | None:
    imbalance = _num(summary, "imbalance")
    return None if imbalance is None else f"imbalance {imbalance:.3f} (max / mean rank load per step; 1.000 = even)"


def _time_text(summary: Mapping[str, Any]) -> str | None:
    wall = _num(summary, "wall_s")
    steps = [v for v in _series(summary, "step_seconds") if v is not None]
    startup = _startup_s(summary)
    parts = [f"wall {wall:.1f} s (model load + training)" if wall is not None else None,
             f"start-up {startup:.1f} s (launch to the end of step 1)" if startup is not None else None,
             f"median step {median(steps):.3f} s" if steps else None]
    return "; ".join(p for p in parts if p) or None


def _startup_s(summary: Mapping[str, Any]) -> float | None:
    """Seconds from `hypersloth-train` starting to the end of step 1 (train_summary.json's `startup`)."""
    startup = summary.get("startup")
    return _num(startup, "total_s") if isinstance(startup, Mapping) else None


def _memory_text(summary: Mapping[str, Any]) -> str | None:
    peak = _num(summary, "peak_gpu_gb")
    return None if peak is None else f"peak {peak:.2f} GiB GPU memory on rank 0"


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------
def _read_optional_json(path: Path) -> dict[str, Any]:
    try:
        content = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return content if isinstance(content, dict) else {}


def _rank_records(out: Path) -> list[dict[str, Any]]:
    """The per-rank final records (rank, sha256, trainable_params, peak_gpu_gb), by rank."""
    records = [_read_optional_json(p) for p in run_files.rank_files(out, "final.json")]
    return sorted((r for r in records if "rank" in r), key=lambda r: r["rank"])


def _logging_steps(config: Mapping[str, Any]) -> int:
    value = config.get("training_config", {}).get("logging_steps", 1)
    return value if isinstance(value, int) and value > 0 else 1


def _logged_steps(count: int, total_steps: int, every: int) -> list[int]:
    """Step numbers of `count` values logged every `every` steps (the trainer's log_history cadence)."""
    if count == total_steps or count * every > max(total_steps, count):
        return list(range(1, count + 1))  # logged every step, or the cadence does not fit: plain order
    return [(i + 1) * every for i in range(count)]


def _try_plot(summary: Mapping[str, Any], config: Mapping[str, Any], path: Path) -> Path | None:
    """Draw the curves; a plotting failure must not fail a finished run, so it is logged and skipped."""
    try:
        return _plot(summary, config, path)
    except Exception as err:  # noqa: BLE001 - any matplotlib problem only costs the picture
        logger.warning(f"report: could not draw {path.name}: {type(err).__name__}: {err}")
        return None


def _plot(summary: Mapping[str, Any], config: Mapping[str, Any], path: Path) -> Path | None:
    # Figure + Agg canvas, not pyplot: no global backend switch in a notebook kernel that imports this.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = []
    for key, title in (("step_losses", "loss"), ("learning_rates", "learning rate"), ("grad_norms", "grad norm")):
        if key == "step_losses":
            by_step = dict(zip(_loss_steps(summary), _series(summary, key)))
        else:
            by_step = _logged_at(summary, key, config)
        points = [(x, v) for x, v in sorted(by_step.items()) if v is not None]
        if points:
            panels.append((title, points))
    if _grpo_reward(summary):
        panels.insert(1, ("reward (GRPO)", _grpo_reward(summary)))
    if not panels:
        return None
    fig = Figure(figsize=(4.2 * len(panels), 3.2), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, (title, points) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, markersize=3)
        ax.set(title=title, xlabel="optimizer step")
        ax.grid(alpha=0.3)
        if title == "loss":
            _plot_eval(ax, summary)
    fig.savefig(path, dpi=110)
    return path


def _plot_eval(ax, summary: Mapping[str, Any]) -> None:
    """The eval curve on the training-loss axes (both are token means), its lowest point starred."""
    points = _eval_points(summary)
    if not points:
        return
    ax.lines[0].set_label("train loss")
    ax.plot([p[0] for p in points], [p[1] for p in points], marker="s", markersize=4, label="eval loss (held out)")
    step, best, _ = min(points, key=lambda p: (p[1], p[0]))
    ax.plot([step], [best], linestyle="none", marker="*", markersize=12, color="tab:red", label=f"best (step {step})")
    ax.legend(fontsize=8)


# ---------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------
def _markdown(summary: Mapping[str, Any], config: Mapping[str, Any], ranks: Sequence[Mapping[str, Any]],
              image: Path | None, out: Path) -> str:
    created = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = [f"# HyperSloth run report\n\n`{out.resolve()}` — written {created}\n",
             "```\n" + format_console(summary) + "\n```\n", _metrics_table(summary)]
    if image is not None:
        parts.append(f"## Curves\n\n![loss and learning rate per step]({image.name})\n")
    parts += [_eval_table(summary), _steps_table(summary, config), _rewards_table(summary), _phase_table(summary),
              _ranks_section(ranks),
              _config_section(config)]
    return "\n".join(p for p in parts if p)


def _eval_table(summary: Mapping[str, Any]) -> str:
    points = _eval_points(summary)
    if not points:
        return ""
    best_step = min(points, key=lambda p: (p[1], p[0]))[0]
    stride = max(1, math.ceil(len(points) / MAX_TABLE_ROWS))
    picked = sorted(set(range(0, len(points), stride)) | {len(points) - 1} | {[p[0] for p in points].index(best_step)})
    rows = "".join(f"| {points[i][0]} | {points[i][1]:.4f} | {_fmt(points[i][2], ',')} | "
                   f"{'best' if points[i][0] == best_step else ''} |\n" for i in picked)
    best = summary.get("best_eval") if isinstance(summary.get("best_eval"), Mapping) else {}
    kept = f"; its adapter is in `{best['adapter']}`" if best.get("step") == best_step and best.get("adapter") else ""
    pairs = bool(_rewards(summary))  # a DPO run: the loss is the mean DPO loss over the held-out pairs
    unit, what = ("pairs", "Mean DPO loss on the held-out pairs") if pairs else ("tokens", "Token-mean loss on the held-out rows")
    return (f"## Evaluation\n\n{what}, over all ranks. Lowest at step {best_step}"
            f"{kept}.\n\n| step | eval loss | eval {unit} | |\n|---|---|---|---|\n{rows}")


def _ordinal(n: int) -> str:
    """2nd, 3rd, 4th, 11th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{unit}"


def _metrics_table(summary: Mapping[str, Any]) -> str:
    n = lambda key: _num(summary, key)  # noqa: E731 - a local shorthand keeps the table readable
    pad, rand = n("padding_pct"), n("random_padding_pct")
    saved = compute_saved_pct(pad, rand) if pad is not None and rand is not None else None
    rows = [
        ("optimizer steps", _fmt(n("steps"), ".0f")), ("workers (world size)", _fmt(n("world_size"), ".0f")),
        ("backend", str(summary.get("backend", "—"))), ("batching", str(summary.get("batching", "—"))),
        ("global batch (samples/step)", _fmt(n("global_batch_size"), ".0f")),
        ("first loss", _fmt(n("first_loss"), ".4f")), ("last loss", _fmt(n("last_loss"), ".4f")),
        ("tokens seen", _fmt(n("tokens_seen"), ",.0f")), ("tokens/s", _fmt(n("tokens_per_s"), ",.1f")),
        ("training time", _fmt(n("train_runtime_s"), ".2f", " s")),
        ("wall time (load + train)", _fmt(n("wall_s"), ".2f", " s")),
        ("start-up (launch to end of step 1)", _fmt(_startup_s(summary), ".2f", " s")),
        ("padding", _fmt(pad, ".2f", "%")), ("padding with random batching", _fmt(rand, ".2f", "%")),
        ("computed tokens saved vs random", _fmt(saved, ".2f", "%")),
        ("rank load imbalance (max/mean)", _fmt(n("imbalance"), ".4f")),
        ("peak GPU memory (rank 0)", _fmt(n("peak_gpu_gb"), ".2f", " GiB")),
    ]
    return "## Summary\n\n| metric | value |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


def _steps_table(summary: Mapping[str, Any], config: Mapping[str, Any]) -> str:
    losses, seconds = _series(summary, "step_losses"), _series(summary, "step_seconds")
    if not losses:
        return ""
    steps = _loss_steps(summary)
    lrs, norms = _logged_at(summary, "learning_rates", config), _logged_at(summary, "grad_norms", config)
    stride = max(1, math.ceil(len(losses) / MAX_TABLE_ROWS))
    picked = sorted(set(range(0, len(losses), stride)) | {len(losses) - 1})
    # After a resume the step times cover only the steps this process ran: the last len(seconds) steps.
    timed = dict(zip(range(steps[-1] - len(seconds) + 1, steps[-1] + 1), seconds)) if seconds else {}
    second = lambda i: timed.get(steps[i])  # noqa: E731
    rows = "".join(f"| {steps[i]} | {_fmt(losses[i], '.4f')} | {_fmt(lrs.get(steps[i]), '.3g')} | "
                   f"{_fmt(norms.get(steps[i]), '.4f')} | {_fmt(second(i), '.3f')} |\n" for i in picked)
    note = f" (every {_ordinal(stride)})" if stride > 1 else ""
    return (f"## Steps{note}\n\n| step | loss | learning rate | grad norm | seconds |\n|---|---|---|---|---|\n"
            + rows)


def _rewards_table(summary: Mapping[str, Any]) -> str:
    rewards = _rewards(summary)
    if not rewards:
        return ""
    steps = _loss_steps(summary)
    count = len(steps)
    stride = max(1, math.ceil(count / MAX_TABLE_ROWS))
    picked = sorted(set(range(0, count, stride)) | {count - 1})
    rows = "".join(f"| {steps[i]} | " + " | ".join(_fmt(rewards[k][i], ".4f") for k in REWARD_KEYS) + " |\n"
                   for i in picked)
    note = f" (every {_ordinal(stride)} step)" if stride > 1 else ""
    return (f"## Preference rewards{note}\n\nMeans over each step's pairs, all ranks: reward = beta x (policy - "
            "reference) log-probability of the completion; accuracy = share of pairs whose chosen reward is higher."
            f"\n\n| step | {' | '.join(REWARD_KEYS)} |\n|---|---|---|---|---|\n{rows}")


def _phase_table(summary: Mapping[str, Any]) -> str:
    phases = summary.get("phase_seconds_per_step") or {}
    timed = {k: _num(phases, k) for k in phases} if isinstance(phases, dict) else {}
    timed = {k: v for k, v in timed.items() if v is not None}
    if not timed:
        return ""
    total = sum(timed.values()) or 1.0
    rows = "".join(f"| {k} | {v:.4f} | {100 * v / total:.1f}% |\n" for k, v in timed.items())
    return "## Time per step by phase\n\n| phase | seconds | share |\n|---|---|---|\n" + rows


def _ranks_section(ranks: Sequence[Mapping[str, Any]]) -> str:
    if not ranks:
        return ""
    digests = {r.get("sha256") for r in ranks}
    verdict = ("every rank ended with identical trained weights" if len(digests) == 1
               else f"WARNING: ranks ended with {len(digests)} different sets of trained weights")
    rows = "".join(f"| {r['rank']} | {_fmt(_num(r, 'trainable_params'), ',.0f')} | "
                   f"`{str(r.get('sha256', '—'))[:12]}` | {_fmt(_num(r, 'peak_gpu_gb'), '.2f', ' GiB')} |\n"
                   for r in ranks)
    return (f"## Ranks\n\n{verdict}.\n\n| rank | trainable params | weights sha256 | peak GPU memory |\n"
            f"|---|---|---|---|\n{rows}")


def _config_section(config: Mapping[str, Any]) -> str:
    if not config:
        return ""
    return f"## Resolved config\n\n```json\n{json.dumps(config, indent=2, default=str)}\n```\n"
