"""FlashAttention-4's wheel set for the GPU machine, cut into two parts that each fit one device call.

One call carries at most 64 MiB, and the CUDA-13 DSL library wheel alone is 92 MB (its largest file,
`_cutlass_ir.cu13...so`, is 193 MB unpacked, 73 MB deflated in the wheel). So that wheel travels unpacked, as
xz archives of its files (`tar.xz`), and every item (those archives, the other wheels as they are) is dealt into
two parts, largest first, each under `--limit` (part 2 also leaves room for what its call carries beside it,
`--beside`, e.g. the 25 MB of .whl/). On the device the first call unpacks part 1 into a git-ignored site folder,
which stays while the machine is warm; the second unpacks part 2 beside it and runs (scripts/fa4_wheels.sh,
docs/benchmarks/2026-12-02-fa4-device-calls.sh).

    python scripts/fa4_pack.py pack WHEEL_DIR --out .fa4 [--limit-mib 60] [--beside .whl]   (this machine)
    python scripts/fa4_pack.py unpack .fa4/part1 --site .fa4/site                            (the device)

`unpack` merges files into the site folder (zip/tar extraction; pip would replace the shared
`nvidia_cutlass_dsl/` folder of one wheel by the next's), and leaves out a wheel whose module the device's
Python already imports (`ALREADY_THERE`: cuda-bindings comes with torch's CUDA build there, say). The DSL's
`.pth` is not processed on PYTHONPATH: put SITE and SITE/nvidia_cutlass_dsl/dsl_packages on it
(scripts/fa4_env.sh).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import io
import json
import re
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

MIB = 2**20
UNPACKED_WHEEL = re.compile(r"nvidia_cutlass_dsl_libs_cu\d+-")  # travels as xz archives of its files
# Wheels left out on the device when its Python imports their module already (distribution prefix -> module).
ALREADY_THERE = {"cuda_bindings": "cuda.bindings", "cuda_pathfinder": "cuda.pathfinder", "protobuf": "google.protobuf",
                 "einops": "einops", "typing_extensions": "typing_extensions"}
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Item:
    name: str  # the file name in its part
    size: int  # bytes as carried


def deal(items: list[Item], limit: int, beside: int = 0) -> tuple[list[Item], list[Item]]:
    """Items into two parts, largest first into part 1 while it stays under `limit` bytes, the rest into part 2,
    which must stay under `limit - beside` (what the second call carries beside it); ValueError naming what does
    not fit."""
    parts: tuple[list[Item], list[Item]] = ([], [])
    room = [limit, limit - beside]
    for item in sorted(items, key=lambda i: (-i.size, i.name)):
        k = 0 if item.size <= room[0] else 1
        if item.size > room[k]:
            raise ValueError(f"{item.name} ({item.size / MIB:.1f} MiB) fits neither part: {room[0] / MIB:.1f} and "
                             f"{room[1] / MIB:.1f} MiB left of {limit / MIB:.0f} MiB (part 2 beside {beside / MIB:.1f} MiB)")
        parts[k].append(item)
        room[k] -= item.size
    return parts


def _xz_archive(members: list[tuple[zipfile.ZipInfo, bytes]]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=6) as tar:
        for info, data in members:
            entry = tarfile.TarInfo(info.filename)
            entry.size, entry.mode, entry.mtime = len(data), 0o755 if info.filename.endswith(".so") else 0o644, 0
            tar.addfile(entry, io.BytesIO(data))
    return buffer.getvalue()


def unpacked_archives(wheel: Path, largest: int = 1) -> dict[str, bytes]:
    """The wheel's `largest` biggest files, each as its own tar.xz, and the rest as one (names say which)."""
    with zipfile.ZipFile(wheel) as z:
        files = sorted((i for i in z.infolist() if not i.is_dir()), key=lambda i: -i.file_size)
        stem = wheel.name.split("-")[0]
        archives = {}
        for k, info in enumerate(files[:largest]):
            archives[f"{stem}.{k}.tar.xz"] = _xz_archive([(info, z.read(info))])
        archives[f"{stem}.rest.tar.xz"] = _xz_archive([(i, z.read(i)) for i in files[largest:]])
    return archives


def folder_bytes(path: Path | None) -> int:
    if path is None or not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def pack(wheel_dir: Path, out: Path, limit: int, beside: int) -> dict:
    """Write out/part1 and out/part2 (each holding its items and a manifest with their sha256) and return the manifest."""
    blobs: dict[str, bytes] = {}
    for wheel in sorted(wheel_dir.glob("*.whl")):
        if UNPACKED_WHEEL.match(wheel.name):
            blobs.update(unpacked_archives(wheel))
        else:
            blobs[wheel.name] = wheel.read_bytes()
    parts = deal([Item(name, len(data)) for name, data in blobs.items()], limit, beside)
    manifest = {"limit_bytes": limit, "beside_bytes": beside, "parts": {}}
    for k, items in enumerate(parts, start=1):
        folder = out / f"part{k}"
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.iterdir():
            stale.unlink()
        for item in items:
            (folder / item.name).write_bytes(blobs[item.name])
        entry = {"files": {i.name: hashlib.sha256(blobs[i.name]).hexdigest() for i in items},
                 "bytes": sum(i.size for i in items)}
        (folder / MANIFEST).write_text(json.dumps(entry, indent=1))
        manifest["parts"][f"part{k}"] = entry
    return manifest


def already_there(wheel_name: str) -> str | None:
    """The module that makes this wheel unnecessary on this Python (None: install it)."""
    module = ALREADY_THERE.get(wheel_name.split("-")[0])
    try:
        return module if module and importlib.util.find_spec(module) is not None else None
    except (ImportError, ValueError):
        return None


def unpack(part: Path, site: Path) -> list[str]:
    """Merge the part's items into `site` after checking their sha256; returns one line per item."""
    entry = json.loads((part / MANIFEST).read_text())
    site.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, sha in sorted(entry["files"].items()):
        path = part / name
        if hashlib.sha256(path.read_bytes()).hexdigest() != sha:
            raise SystemExit(f"{path}: sha256 differs from the manifest (a cut transfer?): build the parts again")
        there = already_there(name) if name.endswith(".whl") else None
        if there:
            lines.append(f"{name}: left out ({there} is already importable)")
            continue
        started = time.perf_counter()
        if name.endswith(".whl"):
            with zipfile.ZipFile(path) as z:
                z.extractall(site)
        else:
            with tarfile.open(path, mode="r:xz") as tar:
                tar.extractall(site, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        lines.append(f"{name} ({path.stat().st_size / MIB:.1f} MiB carried): unpacked in {time.perf_counter() - started:.1f} s")
    (site / f".{part.name}.done").write_text(json.dumps(entry["files"]))
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    packing = sub.add_parser("pack", help="cut a folder of wheels into OUT/part1 and OUT/part2")
    packing.add_argument("wheel_dir", type=Path)
    packing.add_argument("--out", type=Path, default=Path(".fa4"))
    packing.add_argument("--limit-mib", type=float, default=60.0, help="most MiB one part may hold")
    packing.add_argument("--beside", type=Path, help="a folder the second call carries too (its size is kept free)")
    unpacking = sub.add_parser("unpack", help="merge one part into a site folder (on the device)")
    unpacking.add_argument("part", type=Path)
    unpacking.add_argument("--site", type=Path, default=Path(".fa4/site"))
    a = p.parse_args(argv)
    if a.command == "pack":
        manifest = pack(a.wheel_dir, a.out, int(a.limit_mib * MIB), folder_bytes(a.beside))
        for name, entry in manifest["parts"].items():
            print(f"{name}: {entry['bytes'] / MIB:.1f} MiB: {', '.join(entry['files'])}")
        print(f"part2 travels beside {manifest['beside_bytes'] / MIB:.1f} MiB ({a.beside}); limit {a.limit_mib} MiB")
        return
    for line in unpack(a.part, a.site):
        print(line, flush=True)


if __name__ == "__main__":
    main()
