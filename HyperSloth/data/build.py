"""Build a dataset: load -> normalise -> render + mask + tokenise -> length policy -> save -> register.

``build_dataset`` is the library entry point (the CLI is a thin layer over it). The output is a
``save_to_disk`` folder ``{data_dir}/built_dataset/{name}`` with the columns fixed by
docs/architecture.md, registered in ``{data_dir}/data_config.json``.

Two kinds, told apart by the records (``pairs.detect_kind``) or ``--kind``: chats (``"sft"``: this
module's mask and columns) and preference pairs (``"preference"``: ``pairs`` normalises, ``preference``
tokenises; docs/dpo.md). Both share the reading, the skip accounting (``records``), the summary, the
save and the registry; the entry records the kind.

Failure safety: the dataset is written to a hidden temp folder beside the target and renamed into
place under the registry lock; the registry entry is written last. Any exception removes the temp
folder and restores a dataset that ``--overwrite`` was replacing, so a failed build leaves neither
an entry nor a half-written folder. (A killed process can leave a hidden ``.NAME.tmp-*`` folder,
which nothing reads.)
"""

from __future__ import annotations

import os
import shutil
import sys
import urllib.error
import urllib.request
import uuid
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import datasets
import numpy as np
from loguru import logger
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from HyperSloth.data import formats, masking, pairs, preference, prompts, records, registry, summary
from HyperSloth.data.formats import DataInputError, RawRecord, RecordError
from HyperSloth.data.records import Collected
from HyperSloth.outputs import run_files

COLUMNS: tuple[str, ...] = ("input_ids", "labels", "length", "num_trainable", "text")
KEPT = ("ok", "truncated")
SAMPLE_INFO: tuple[str, ...] = ("location", "kind", "turn", "turns", "full_length")  # kept rows, not saved
MIN_ROWS_PER_PROC = 500  # below this a worker process costs more to start than it saves
_FEATURES = datasets.Features(
    {
        "input_ids": datasets.List(datasets.Value("int64")),
        "labels": datasets.List(datasets.Value("int64")),
        "length": datasets.Value("int64"),
        "num_trainable": datasets.Value("int64"),
        "text": datasets.Value("string"),
        "status": datasets.Value("string"),
        "error": datasets.Value("string"),
        "location": datasets.Value("string"),
        "kind": datasets.Value("string"),
        "turn": datasets.Value("int64"),
        "turns": datasets.Value("int64"),
        "full_length": datasets.Value("int64"),
    }
)


class BuildOptions(BaseModel):
    """Validated build flags (everything except the source)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$", description="registry name (letters, digits, . _ -)")
    tokenizer: str = Field(min_length=1, description="tokenizer folder or hub id")
    data_dir: str = Field("data", description="folder holding data_config.json and built_dataset/")
    max_seq_length: int = Field(2048, gt=1, description="longest sample in tokens")
    n: int | None = Field(None, gt=0, description="take a seeded sample of n conversations")
    seed: int = Field(42, description="seed of the -n sample")
    split: str = Field("train", description="split of a hub dataset or saved DatasetDict")
    fmt: Literal["auto", "sharegpt", "openai", "alpaca"] = Field("auto", description="input format")
    chat_template: str | None = Field(None, description="Jinja file overriding the tokenizer's template")
    overlength: Literal["truncate", "drop"] = Field("truncate", description="policy for samples over max_seq_length")
    strict: bool = Field(False, description="any bad record is fatal")
    overwrite: bool = Field(False, description="replace an existing dataset of the same name")
    num_proc: int | None = Field(None, ge=1, description="tokenising processes (default: all cores)")
    print_samples: int = Field(0, ge=0, description="rendered samples to print with the mask marked")
    history_rewrite: Literal["split", "last", "skip"] = Field(
        "split", description="a template that rewrites earlier replies: one sample per reply, the last reply, or skip"
    )
    kind: Literal["auto", "sft", "preference", "prompt"] = Field(
        "auto", description="what the rows are: chats (sft), chosen/rejected pairs, or prompts (GRPO); auto detects it"
    )


def build_dataset(
    source: str,
    *,
    name: str,
    tokenizer: str,
    data_dir: str = "data",
    max_seq_length: int = 2048,
    n: int | None = None,
    seed: int = 42,
    split: str = "train",
    fmt: str = "auto",
    chat_template: str | None = None,
    overlength: str = "truncate",
    strict: bool = False,
    overwrite: bool = False,
    num_proc: int | None = None,
    print_samples: int = 0,
    history_rewrite: str = "split",
    kind: str = "auto",
    source_type: Literal["auto", "local", "hf"] = "auto",
) -> dict[str, Any]:
    """Build ``source`` into ``{data_dir}/built_dataset/{name}`` and register it; return the entry.

    ``source`` is a local ``.jsonl``/``.json``/``.parquet`` file or saved dataset folder, or a
    Hugging Face Hub dataset id (``source_type='auto'`` picks local when the path exists).
    Raises DataInputError for every user mistake (bad path, flag, tokenizer, existing name, ...).
    """
    opts = _options(locals())
    if not overwrite:
        _refuse_existing(opts.name, opts.data_dir)
    _check_local_paths(opts)  # cheap checks first: the source load below can take minutes
    where, source = _resolve_source(source, source_type)
    raw = formats.read_local(source, opts.split) if where == "local" else load_hub_dataset(source, opts.split)
    kind = _detect_kind(raw) if opts.kind == "auto" else opts.kind
    if kind == prompts.PROMPT_KIND and opts.fmt != "auto":
        raise DataInputError(f"--format {opts.fmt} applies to chats, but these are prompts (docs/grpo.md): leave "
                             "--format out, or pass --kind sft")
    if opts.kind == "auto" and kind == prompts.PROMPT_KIND:
        logger.info("the records have a 'prompt' and no answer: building prompts for GRPO (--kind sft overrides)")
    if kind == "preference" and opts.fmt != "auto":
        raise DataInputError(f"--format {opts.fmt} applies to chats, but these are preference pairs, read per row "
                             "(docs/dpo.md): leave --format out, or pass --kind sft")  # fmt: skip
    if opts.kind == "auto" and kind == "preference":
        logger.info("the records have 'chosen' and 'rejected': building preference pairs (--kind sft overrides)")
    # Text preference pairs need no chat template (checked per shape once the rows are read).
    tok = load_tokenizer(opts.tokenizer, opts.chat_template, require_template=kind == "sft")
    built, kept, collected, statuses, stats = _build_rows(kind, raw, tok, opts, source)
    entry = _entry(opts, source, tok, len(built), stats, kind)
    _save_and_register(built, entry, opts)
    unit = {"preference": "pair", prompts.PROMPT_KIND: "prompt"}.get(kind, "sample")
    summary.log_summary(collected, statuses, stats, unit=unit)
    logger.info(f"built {opts.name}: {len(built)} {unit}s -> {registry.entry_dir(entry, opts.data_dir)}"
                f"{_truncated_note(stats, unit, opts.max_seq_length)}")
    if opts.print_samples:
        show = {"preference": preference.show_pairs, prompts.PROMPT_KIND: prompts.show_prompts}.get(
            kind, summary.show_samples)
        show(kept, tok, opts.print_samples, color=sys.stdout.isatty())
    return entry


def _truncated_note(stats: dict[str, Any], unit: str, max_seq_length: int) -> str:
    """The build line's word on truncated samples: how many, and that each lost its end (end-of-turn included)."""
    cut = int(stats.get("truncated") or 0)
    if not cut:
        return ""
    return (f" ({cut} of them cut to {max_seq_length:,} tokens, without the end of their reply and its end-of-turn: "
            "the model is not taught to stop there; --overlength drop leaves them out, a larger --max_seq_length "
            "keeps them whole)")


def _build_rows(
    kind: str, raw: Any, tok: Any, opts: BuildOptions, source: str
) -> tuple[datasets.Dataset, datasets.Dataset, Collected, Counter, dict[str, Any]]:
    """Normalise, tokenise and apply the length policy: (saved rows, kept rows with their sample
    info, what was collected, row statuses, stats)."""
    if kind == prompts.PROMPT_KIND:
        collected = prompts.collect_prompts(raw, n=opts.n, seed=opts.seed, strict=opts.strict)
        _check_records(collected, source, "prompt")
        kept, statuses = prompts.encode_dataset(collected, tok, max_seq_length=opts.max_seq_length, strict=opts.strict)
        _check_kept(kept, collected, statuses, source, "prompt")
        stats = prompts.compute_stats(kept, collected, statuses) | _build_settings(opts)
        return kept.select_columns(list(prompts.COLUMNS)), kept, collected, statuses, stats
    if kind == "preference":
        collected = pairs.collect_pairs(raw, n=opts.n, seed=opts.seed, strict=opts.strict)
        _check_records(collected, source, "pair")
        _check_pair_tokenizer(tok, collected, opts.tokenizer)
        kept, statuses = preference.encode_dataset(
            collected, tok, max_seq_length=opts.max_seq_length, overlength=opts.overlength,
            num_proc=_workers(opts, len(collected.items)), strict=opts.strict,
        )  # fmt: skip
        _check_kept(kept, collected, statuses, source, "pair")
        stats = preference.compute_stats(kept, collected, statuses) | _build_settings(opts)
        return kept.select_columns(list(preference.COLUMNS)), kept, collected, statuses, stats
    collected = collect_conversations(raw, fmt=opts.fmt, n=opts.n, seed=opts.seed, strict=opts.strict)
    _check_records(collected, source, "conversation")
    kept, statuses = encode_dataset(collected, tok, opts)
    _check_kept(kept, collected, statuses, source, "conversation")
    stats = compute_stats(kept, collected, statuses, opts)
    return kept.select_columns(list(COLUMNS)), kept, collected, statuses, stats


def _detect_kind(raw: Any) -> str:
    """What the records hold: preference pairs (chosen/rejected), prompts (a prompt, nothing answering it), or chats."""
    kind = pairs.detect_kind(raw)
    return prompts.PROMPT_KIND if kind == "sft" and prompts.detect_prompts(raw) else kind


def _check_records(collected: Collected, source: str, unit: str) -> None:
    if not collected.records_read:
        raise DataInputError(f"{source} holds no records (it is empty or has only blank lines): nothing to build")
    if not collected.items:
        summary.log_summary(collected, Counter(), {})
        raise DataInputError(f"no usable {unit}s in {source} (see the skip summary above)")


def _check_kept(kept: datasets.Dataset, collected: Collected, statuses: Counter, source: str, unit: str) -> None:
    if not len(kept):
        summary.log_summary(collected, statuses, {}, unit=unit)
        raise DataInputError(f"every {unit} of {source} was dropped (see the summary above)")


def _check_pair_tokenizer(tok: Any, collected: Collected, name: str) -> None:
    """Chat pairs need a chat template, text pairs an eos token (it ends every completion)."""
    shapes = collected.formats
    if (shapes["conversational"] or shapes["implicit_prompt"]) and not getattr(tok, "chat_template", None):
        raise DataInputError(f"tokenizer {name!r} has no chat template and the pairs are chat messages: "
                             "pass --chat_template FILE.jinja")  # fmt: skip
    if (shapes["text"] or shapes["implicit_text"]) and not tok.eos_token:
        raise DataInputError(f"tokenizer {name!r} has no eos token, which ends every completion of text pairs")


def _workers(opts: BuildOptions, rows: int) -> int:
    """Tokenising processes: --num_proc (default all cores), fewer for a small dataset."""
    return min(opts.num_proc or os.cpu_count() or 1, max(1, rows // MIN_ROWS_PER_PROC))


def _options(params: dict[str, Any]) -> BuildOptions:
    fields = {k: v for k, v in params.items() if k in BuildOptions.model_fields}
    try:
        return BuildOptions(**fields)
    except ValidationError as err:
        problems = "; ".join(f"--{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise DataInputError(problems.replace("--fmt", "--format")) from None


def _refuse_existing(name: str, data_dir: str) -> None:
    if name in registry.read_registry(data_dir)["datasets"]:
        raise DataInputError(
            f"dataset {name!r} already exists in {registry.registry_path(data_dir)}: "
            "pass --overwrite to rebuild it, or choose another --name"
        )


def _check_local_paths(opts: BuildOptions) -> None:
    if _looks_local(opts.tokenizer) and not Path(opts.tokenizer).expanduser().exists():
        raise DataInputError(f"--tokenizer {opts.tokenizer}: no such folder")
    if opts.chat_template and not Path(opts.chat_template).expanduser().is_file():
        raise DataInputError(f"--chat_template {opts.chat_template}: no such file")


def _looks_local(name_or_path: str) -> bool:
    """A path rather than a hub id ("org/name"): it exists, it starts or nests like a path, or its "org" is a
    local folder (``build/nosuch`` after ``build/tiny-qwen3`` was made: "no such folder" at once, rather than
    seconds spent asking the Hub; launch/model_source.py decides models the same way)."""
    path = Path(name_or_path).expanduser()
    nested = name_or_path.count("/") > 1 or (name_or_path.count("/") == 1 and path.parent.is_dir())
    return path.exists() or name_or_path.startswith((".", "/", "~")) or nested


def _resolve_source(source: str, source_type: str) -> tuple[str, str]:
    if not source:
        raise DataInputError("give a source: --local_path FILE_OR_DIR or --hf_dataset ID")
    source = str(source)
    if source_type == "auto":
        source_type = "local" if Path(source).exists() or Path(source).suffix in formats.LOCAL_SUFFIXES else "hf"
    if source_type == "local":
        return "local", str(Path(source).expanduser().resolve())
    return "hf", source


# ---------------------------------------------------------------------------------------------
# Tokenizer and hub
# ---------------------------------------------------------------------------------------------
def hub_reachable(timeout: float = 5.0) -> bool:
    """Whether the Hugging Face Hub answers an HTTP request (any status) within ``timeout``.

    Without this check an unreachable Hub costs a minute of retries before the error.
    urllib honours the *_PROXY variables, as the hub client does.
    """
    from huggingface_hub import constants

    try:
        urllib.request.urlopen(urllib.request.Request(constants.ENDPOINT, method="HEAD"), timeout=timeout)
    except urllib.error.HTTPError:
        return True  # an error status is still an answer
    except (urllib.error.URLError, OSError):
        return False
    return True


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def load_hub_dataset(name: str, split: str) -> datasets.Dataset:
    """``datasets.load_dataset(name, split=split)``, failing fast and clearly when offline."""
    offline = _hub_offline()
    hint = (
        "download it where the Hub is reachable (datasets' save_to_disk, or .jsonl/.parquet) "
        "and pass --local_path FILE_OR_DIR"
    )
    if not offline and not hub_reachable():
        raise DataInputError(
            f"cannot load {name!r}: the Hugging Face Hub is not reachable (no network?). "
            f"If it is in your HF cache, rerun with HF_HUB_OFFLINE=1; otherwise {hint}"
        )
    try:
        return datasets.load_dataset(name, split=split)
    except Exception as err:  # the hub client raises many types; all mean "cannot load"
        why = "offline mode (HF_HUB_OFFLINE=1) and not in the local cache" if offline else str(err).splitlines()[0]
        raise DataInputError(f"cannot load {name!r} from the Hugging Face Hub: {why}; {hint}") from None


def load_tokenizer(name_or_path: str, chat_template: str | None = None, require_template: bool = True) -> Any:
    """A fast tokenizer with a chat template (``chat_template``: a Jinja file overriding it; without
    ``require_template`` the template may be missing)."""
    from transformers import AutoTokenizer

    path = Path(name_or_path).expanduser()
    looks_local = _looks_local(name_or_path)
    if looks_local and not path.exists():
        raise DataInputError(f"--tokenizer {name_or_path}: no such folder")
    local_only = not looks_local and not _hub_offline() and not hub_reachable()
    try:
        tok = AutoTokenizer.from_pretrained(str(path) if looks_local else name_or_path, local_files_only=local_only)
    except Exception as err:
        why = "the Hub is not reachable and it is not cached; " if local_only else ""
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataInputError(f"cannot load tokenizer {name_or_path!r}: {why}{first}") from None
    if chat_template:
        template_path = Path(chat_template).expanduser()
        if not template_path.is_file():
            raise DataInputError(f"--chat_template {chat_template}: no such file")
        tok.chat_template = template_path.read_text(encoding="utf-8")
    if require_template and not getattr(tok, "chat_template", None):
        raise DataInputError(f"tokenizer {name_or_path!r} has no chat template: pass --chat_template FILE.jinja")
    if not tok.is_fast:
        raise DataInputError(f"tokenizer {name_or_path!r} is not a fast tokenizer; the mask needs offset mappings")
    return tok


# ---------------------------------------------------------------------------------------------
# Normalise
# ---------------------------------------------------------------------------------------------
def collect_conversations(
    raw: list[RawRecord] | datasets.Dataset, *, fmt: str, n: int | None, seed: int, strict: bool
) -> Collected:
    """Normalise records to conversations in order (or a seeded sample of ``n``), counting every
    skipped record by reason (HyperSloth.data.records.collect)."""

    def normalise(record: Any) -> tuple[list[formats.Message], str, bool]:
        record_fmt = formats.detect_format(record) if fmt == "auto" and isinstance(record, dict) else fmt
        messages, cut = formats.trim_trailing_turns(formats.to_messages(record, record_fmt))
        return messages, record_fmt, bool(cut)

    return records.collect(raw, normalise, n=n, seed=seed, strict=strict)


# ---------------------------------------------------------------------------------------------
# Tokenise + mask + length policy
# ---------------------------------------------------------------------------------------------
class _Encoder:
    """The ``datasets.map`` function (a class so it pickles to worker processes)."""

    def __init__(self, tokenizer: Any, max_seq_length: int, overlength: str, history_rewrite: str = "split") -> None:
        self.tokenizer = tokenizer
        self.specials = masking.special_token_strings(tokenizer)
        self.max_seq_length = max_seq_length
        self.overlength = overlength
        self.history_rewrite = history_rewrite

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        """One row per sample (a conversation split by a history rewrite gives several) or error."""
        encoded = masking.encode_conversations(self.tokenizer, batch["messages"], self.specials, self.history_rewrite)
        out: dict[str, list] = {k: [] for k in _FEATURES}
        for location, item in zip(batch["location"], encoded):
            for row in [self.apply_policy(item)] if isinstance(item, RecordError) else map(self.apply_policy, item):
                for key, value in row.items():
                    out[key].append(value)
                out["location"].append(location)
        return out

    def apply_policy(self, item: masking.Encoded | RecordError) -> dict[str, Any]:
        """One output row: the sample after the over-length policy, with its status."""
        empty = {"input_ids": [], "labels": [], "length": 0, "num_trainable": 0, "text": "", "error": ""}
        empty |= {"kind": "", "turn": 0, "turns": 0, "full_length": 0}
        if isinstance(item, RecordError):
            return {**empty, "status": item.reason, "error": item.detail}
        empty |= {"kind": item.kind, "turn": item.turn, "turns": item.turns, "full_length": len(item.input_ids)}
        status = "ok"
        ids, labels, text = item.input_ids, item.labels, item.text
        if len(ids) > self.max_seq_length:
            if self.overlength == "drop":
                return {**empty, "status": "dropped_overlength"}
            status, cut = "truncated", self.max_seq_length
            ids, labels, text = ids[:cut], labels[:cut], text[: item.offsets[cut - 1][1]]
        # Position 0 is never predicted by a causal LM, so it never counts as trainable.
        num_trainable = sum(label != masking.IGNORE_INDEX for label in labels[1:])
        if num_trainable == 0:
            return {**empty, "status": "dropped_no_trainable"}
        row = {**empty, "input_ids": ids, "labels": labels, "length": len(ids), "num_trainable": num_trainable}
        return {**row, "text": text, "status": status}


def encode_dataset(collected: Collected, tok: Any, opts: BuildOptions) -> tuple[datasets.Dataset, Counter]:
    """Tokenise every conversation (batched, multi-process); return the kept rows (``COLUMNS`` plus
    ``SAMPLE_INFO``) and the rows' status counts. Skips, history rewrites and over-length samples
    are recorded in ``collected``."""
    table = datasets.Dataset.from_dict({"messages": collected.items, "location": collected.locations})
    num_proc = _workers(opts, len(table))
    mapped = table.map(
        _Encoder(tok, opts.max_seq_length, opts.overlength, opts.history_rewrite),
        batched=True,
        num_proc=num_proc if num_proc > 1 else None,
        remove_columns=["messages", "location"],  # re-emitted per sample: a split conversation gives several
        features=_FEATURES,
        new_fingerprint=uuid.uuid4().hex,  # hashing a large tokenizer is slow and caching is unwanted
        desc="Tokenising",
    )
    status_list = mapped["status"][:]
    statuses = Counter(status_list)
    for i, status in enumerate(status_list):
        if status not in KEPT and status in formats.SKIP_REASONS:
            err = RecordError(status, mapped[i]["error"])
            collected.skip(mapped[i]["location"], err, opts.strict)
    keep = [i for i, status in enumerate(status_list) if status in KEPT]
    summary.record_samples(collected, mapped, status_list, keep)
    kept = mapped.select(keep) if len(keep) < len(mapped) else mapped
    return kept.select_columns([*COLUMNS, *SAMPLE_INFO]), statuses


# ---------------------------------------------------------------------------------------------
# Stats, entry, save
# ---------------------------------------------------------------------------------------------
def compute_stats(built: datasets.Dataset, collected: Collected, statuses: Counter, opts: BuildOptions) -> dict:
    """Token statistics of the built dataset plus every count the summary reports."""
    lengths = np.asarray(built["length"][:], dtype=np.int64)
    trainable = np.asarray(built["num_trainable"][:], dtype=np.int64)
    return {
        "total_tokens": int(lengths.sum()),
        **summary.length_stats(lengths),
        "trainable_tokens": int(trainable.sum()),
        "fraction_trainable": round(float(trainable.sum() / lengths.sum()), 4),
        "truncated": statuses["truncated"],
        "dropped_overlength": statuses["dropped_overlength"],
        "dropped_no_trainable": statuses["dropped_no_trainable"],
        "overlength_examples": {k: v for k, v in collected.overlength.items() if v},
        "trailing_turn_dropped": len(collected.trimmed),
        "history_rewrite": opts.history_rewrite,
        "conversations_split": collected.rewritten["split"],
        "samples_from_split": collected.rewritten["split_samples"],
        "conversations_last_reply_only": collected.rewritten["last"],
        "skipped": dict(sorted(collected.skipped.items())),
        "records_read": collected.records_read,
        "formats": dict(collected.formats),
        **_build_settings(opts),
    }


def _build_settings(opts: BuildOptions) -> dict[str, Any]:
    """The flags a rebuild repeats (HyperSloth.plan.run.rebuild_command reads them from the entry's stats)."""
    return {
        "overlength": opts.overlength,
        # The template file a rebuild needs (the entry's fingerprint alone cannot restore it).
        "chat_template": str(Path(opts.chat_template).expanduser().resolve()) if opts.chat_template else None,
        "n": opts.n,
        "seed": opts.seed,
    }


def _entry(opts: BuildOptions, source: str, tok: Any, num_samples: int, stats: dict, kind: str) -> dict[str, Any]:
    return {
        "name": opts.name,
        "kind": kind,  # "sft" or "preference"; an entry without it (older HyperSloth) is "sft"
        "path": f"{registry.BUILT_DIR}/{opts.name}",
        "source": source,
        "split": opts.split,
        "num_samples": num_samples,
        # A local tokenizer is recorded absolute so the trainer finds it from any working directory.
        "tokenizer": str(Path(opts.tokenizer).expanduser().resolve()) if _looks_local(opts.tokenizer) else opts.tokenizer,
        "template_fingerprint": masking.template_fingerprint(tok.chat_template or ""),  # none: text pairs
        "max_seq_length": opts.max_seq_length,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "stats": stats,
    }


def _save_and_register(built: datasets.Dataset, entry: dict[str, Any], opts: BuildOptions) -> None:
    """Write to a temp folder beside the target, then swap it in and register, under the lock."""
    built_dir = Path(opts.data_dir) / registry.BUILT_DIR
    built_dir.mkdir(parents=True, exist_ok=True)
    tmp = built_dir / f".{opts.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        built.save_to_disk(str(tmp))
        with registry.registry_lock(opts.data_dir):
            _swap_in(tmp, built_dir / opts.name, entry, opts)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _swap_in(tmp: Path, target: Path, entry: dict[str, Any], opts: BuildOptions) -> None:
    """Rename ``tmp`` to ``target`` and register ``entry``; restore everything if that fails."""
    current = registry.read_registry(opts.data_dir)
    if target.exists() and not opts.overwrite:
        where = "is registered" if opts.name in current["datasets"] else "exists (unregistered)"
        raise DataInputError(f"{target} {where}: pass --overwrite to replace it, or choose another --name")
    if opts.name in current["datasets"] and not opts.overwrite:
        raise DataInputError(f"dataset {opts.name!r} is already registered: pass --overwrite")
    backup = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}") if target.exists() else None
    if backup:
        run_files.replace_path(target, backup)
    try:
        run_files.replace_path(tmp, target)
        current["datasets"][opts.name] = entry
        registry.write_registry_unlocked(current, opts.data_dir)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        if backup:
            run_files.replace_path(backup, target)
        raise
    if backup:
        shutil.rmtree(backup, ignore_errors=True)
