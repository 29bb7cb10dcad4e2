"""How many CUDA devices the workers will see: torch's answer, without importing torch where it is certain.

The launcher needs the count before it starts a worker (CUDA or CPU workers, `training.gpus` checked), and
importing torch only for it kept every worker waiting (0.75 s on the 2-core CPU machine with a warm page
cache; the workers import torch again anyway).

`torch.cuda.device_count()` (torch 2.4-2.13, torch/cuda/__init__.py) answers 0 for a build without CUDA;
otherwise NVML's device count filtered by CUDA_VISIBLE_DEVICES (`_device_count_nvml`: a list of ordinals
keeps its entries up to the first one past the count; a repeated ordinal gives 0), and initialises CUDA only
when NVML fails or the list holds UUIDs. `count_without_torch` gives the same answer from the same sources
in the common cases (a build without CUDA; NVML with CUDA_VISIBLE_DEVICES unset, empty or plain ordinals),
and None otherwise (UUIDs, MIG, ROCm, an NVML that fails, odd entries), when `cuda_device_count` asks torch.
"""

from __future__ import annotations

import ast
import ctypes
import importlib.util
import os
from collections.abc import Callable, Mapping
from pathlib import Path


def torch_build() -> dict[str, str | None] | None:
    """{"cuda": ..., "hip": ...}: what the installed torch was built for, read from torch/version.py (a file
    torch's build writes: `cuda: Optional[str] = '12.8'`) without importing torch; None when unknown."""
    spec = importlib.util.find_spec("torch")  # a top-level name: finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    found: dict[str, str | None] = {}
    try:
        tree = ast.parse((Path(list(spec.submodule_search_locations)[0]) / "version.py").read_text())
        for node in tree.body:
            target = node.target if isinstance(node, ast.AnnAssign) else (
                node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
            if isinstance(target, ast.Name) and target.id in ("cuda", "hip") and node.value is not None:
                found[target.id] = ast.literal_eval(node.value)
    except (OSError, SyntaxError, ValueError):
        return None
    return found if set(found) == {"cuda", "hip"} else None


def nvml_device_count() -> int | None:
    """The devices NVML sees (all of the machine's, whatever CUDA_VISIBLE_DEVICES says); None when the
    library is missing or fails (no NVIDIA driver)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    try:
        if nvml.nvmlInit_v2() != 0:
            return None
        count = ctypes.c_uint(0)
        ok = nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
        nvml.nvmlShutdown()
    except AttributeError:  # an NVML without these symbols
        return None
    return int(count.value) if ok else None


def count_without_torch(env: Mapping[str, str], build: dict[str, str | None] | None,
                        nvml_count: Callable[[], int | None] = nvml_device_count) -> int | None:
    """torch.cuda.device_count() in the cases it is certain without torch (see the module docstring), else None."""
    if build is None or build["hip"] is not None:
        return None
    if build["cuda"] is None:
        return 0  # torch built without CUDA sees none
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return 0
    entries = None if visible is None else [entry.strip() for entry in visible.split(",")]
    if entries is not None and not all(entry.isascii() and entry.isdigit() for entry in entries):
        return None  # UUIDs, MIG instances, torch's strtoul cases: torch decides
    raw = nvml_count()
    if raw is None:
        return None  # torch would initialise CUDA to count
    if entries is None:
        return raw
    ordinals = [int(entry) for entry in entries]
    if len(set(ordinals)) < len(ordinals):
        return 0  # a repeated ordinal makes CUDA see no device
    return next((i for i, ordinal in enumerate(ordinals) if ordinal >= raw), len(ordinals))


def cuda_device_count() -> int:
    """Number of CUDA devices torch would see in this process; imports torch only when it must."""
    known = count_without_torch(os.environ, torch_build())
    if known is not None:
        return known
    import torch

    return torch.cuda.device_count()
