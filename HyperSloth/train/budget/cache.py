"""A small on-disk cache of the budget probe's measurements, so a second start of the same setup on the
same GPU skips most of the probe (issue 18.3).

What is cached: the probe's points, (tokens, peak allocated bytes) of one forward+backward, per key. The key
is everything the peak depends on: the model (name, and the sha256 of its config.json when it is a local
folder), dtype and quantisation, max_seq_length (RoPE scaling, Unsloth's buffers), the LoRA settings,
gradient checkpointing, backend and the packed-row path, the probe rows' segment lengths, the GPU (name,
total memory, compute capability) and the versions of torch, transformers, peft, trl, unsloth,
unsloth_zoo, bitsandbytes and HyperSloth. An entry is used only when every field matches, and only after
one live pass at the smallest probe size lands within `REVERIFY_TOLERANCE` of the cached value
(`HyperSloth.train.budget.probe.measure_on_gpu`); otherwise the probe measures as if there were no cache.
The allocation limit is always measured live (free memory changes between runs); only peaks are reused.

Where: `budget-probes.json` in the folder named by the cache variable (`run_files.ENV_CACHE_DIR`), else in
`$XDG_CACHE_HOME/hypersloth/`, else in `~/.cache/hypersloth/`; the variable set to `off` turns the cache off.
A file that cannot be read or written is ignored with a warning: the cache never fails a run. Ranks on one
machine may write at the same time; each write is atomic, so the worst case is a lost entry, measured again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from HyperSloth.outputs import run_files

CACHE_VERSION = 3  # bump when the probe's rows or what it measures change (3: forwards under training's autocast)
CACHE_FILE = "budget-probes.json"
MAX_ENTRIES = 64  # oldest dropped first
REVERIFY_TOLERANCE = (0.02, 128 * 2**20)  # relative, absolute bytes: the re-verified pass may differ by the larger
_LIBRARIES = ("torch", "transformers", "peft", "trl", "unsloth", "unsloth_zoo", "bitsandbytes", "HyperSloth")


def cache_dir(env: Mapping[str, str] = os.environ) -> Path | None:
    """The cache folder, or None when the cache variable (`run_files.ENV_CACHE_DIR`) says `off`."""
    explicit = env.get(run_files.ENV_CACHE_DIR)
    if explicit is not None:
        return None if explicit.strip().lower() in ("off", "0", "false", "") else Path(explicit).expanduser()
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "hypersloth"


def library_versions() -> dict[str, str | None]:
    versions = {}
    for name in _LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def model_identity(model_name: str) -> dict[str, str | None]:
    """The model's name and, for a local folder, the sha256 of its config.json (a rebuilt folder at the same
    path with another shape gets another key). Weights are not hashed: memory depends on shapes."""
    config = Path(model_name).expanduser() / "config.json"
    digest = hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None
    return {"name": model_name, "config_sha256": digest}


def device_identity(device) -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(device)
    return {"gpu": props.name, "total_bytes": int(props.total_memory), "capability": f"{props.major}.{props.minor}"}


def probe_key(*, fast: Mapping[str, Any], lora: Mapping[str, Any] | None, gradient_checkpointing: bool | str,
              backend: str, with_lengths: bool, probe_rows: Mapping[int, list[int]], device: Mapping[str, Any],
              versions: Mapping[str, str | None] | None = None) -> dict[str, Any]:
    """Every input the probe's peaks depend on (see the module docstring), as one JSON-able dict."""
    lora_fields = ("r", "lora_alpha", "lora_dropout", "target_modules", "bias", "use_rslora", "init_adapter_path")
    return {
        "version": CACHE_VERSION,
        "model": model_identity(str(fast["model_name"])),
        "load": {k: fast.get(k) for k in ("dtype", "load_in_4bit", "load_in_8bit", "full_finetuning",
                                          "max_seq_length", "attn_implementation")},
        "lora": None if lora is None else {k: lora.get(k) for k in lora_fields},
        "gradient_checkpointing": gradient_checkpointing,
        "backend": backend,
        "packed_lengths": with_lengths,
        "probe_rows": {str(t): list(map(int, rows)) for t, rows in sorted(probe_rows.items())},
        "device": dict(device),
        "versions": dict(versions if versions is not None else library_versions()),
    }


def key_digest(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


def close_enough(live: int, cached: int) -> bool:
    relative, absolute = REVERIFY_TOLERANCE
    return abs(live - cached) <= max(relative * cached, absolute)


class ProbeCache:
    """The cache file: `get(key)` -> {tokens: peak bytes} or None; `put(key, points)` merges and writes."""

    def __init__(self, folder: Path | None):
        self.path = None if folder is None else Path(folder) / CACHE_FILE

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def _read(self) -> dict[str, Any]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError) as err:
            logger.warning(f"budget probe cache {self.path} is unreadable ({err}); measuring without it")
            return {}

    def get(self, key: Mapping[str, Any]) -> dict[int, int] | None:
        entry = self._read().get(key_digest(key))
        if not isinstance(entry, dict) or entry.get("key") != json.loads(json.dumps(key)):
            return None  # absent, or a digest collision / hand-edited entry: never trusted
        return {int(t): int(b) for t, b in entry.get("points", {}).items()}

    def put(self, key: Mapping[str, Any], points: Mapping[int, int]) -> None:
        if self.path is None or not points:
            return
        data = self._read()
        digest = key_digest(key)
        known = {int(t): int(b) for t, b in (data.get(digest) or {}).get("points", {}).items()}
        known.update({int(t): int(b) for t, b in points.items()})
        data[digest] = {"key": key, "points": {str(t): b for t, b in sorted(known.items())}, "saved": time.time()}
        for old in sorted(data, key=lambda d: data[d].get("saved", 0))[:-MAX_ENTRIES]:
            del data[old]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            run_files.atomic_write_json(self.path, data)
        except OSError as err:
            logger.warning(f"budget probe cache {self.path} is not writable ({err}); the next start measures again")


@dataclass(frozen=True)
class ProbeSetup:
    """The model as the probe's key names it (besides checkpointing and the rows), and the cache to use."""

    fast: dict[str, Any]  # the resolved fast_model_args
    lora: dict[str, Any] | None  # the resolved lora_args (None: full fine-tuning)
    backend: str
    cache: ProbeCache | None = None  # None: no cache

    def key(self, device, gradient_checkpointing: bool | str, with_lengths: bool,
            probe_rows: Mapping[int, list[int]]) -> dict[str, Any]:
        return probe_key(fast=self.fast, lora=self.lora, gradient_checkpointing=gradient_checkpointing,
                         backend=self.backend, with_lengths=with_lengths, probe_rows=probe_rows,
                         device=device_identity(device))


class CachedPeaks:
    """The probe's measuring function (tokens -> peak bytes) over a cache entry: cached sizes answer from
    the entry, others run live and are recorded.

    `reverify()` runs the entry's smallest size live first; if it disagrees (`probe_cache.close_enough`)
    the entry is dropped and everything runs live ("re-measured")."""

    def __init__(self, live: Callable[[int], int], cached: dict[int, int] | None):
        self.live, self.cached = live, dict(cached or {})
        self.measured: dict[int, int] = {}
        self.status = "cached" if self.cached else "measured"

    def reverify(self) -> None:
        if not self.cached:
            return
        size = min(self.cached)
        if not close_enough(self(size, live=True), self.cached[size]):
            self.cached, self.status = {}, "re-measured"

    def __call__(self, tokens: int, live: bool = False) -> int:
        if not live and tokens in self.cached:
            return self.cached[tokens]
        if not live and tokens in self.measured:  # the re-verifying pass, reused when measuring again
            return self.measured[tokens]
        self.measured[tokens] = int(self.live(tokens))
        return self.measured[tokens]
