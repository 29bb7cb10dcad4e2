"""What is alive at the peak of a CUDA memory snapshot, grouped by where it was allocated.

    python scripts/memory_peak.py out/logs/rank0.memory_snapshot.pickle [--top 15] [--json peak.json]

The snapshot is torch's (`torch.cuda.memory._dump_snapshot`): a training run writes one with
HYPERSLOTH_MEMORY_SNAPSHOT=N (HyperSloth.train.profiling.MemorySnapshot), scripts/memory_gap.py writes one of its
passes. Its trace holds every allocation and free since recording began; the blocks allocated before (the
weights, the optimizer state of earlier steps) appear only in its segments. So the bytes alive at any point
are: what was alive when recording began (the blocks alive at the dump, minus the trace's net allocations)
plus the trace's running sum. At the highest point the allocations of the trace still alive are grouped by
their allocation site: the innermost Python frame outside torch itself (e.g. unsloth/kernels/fast_lora.py:418
forward), with the outermost such frame for context (the script, or the layer a backward recomputes).
"""

from __future__ import annotations

import argparse
import json
import pickle
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# Frames in these files are machinery, not the code that asked for the memory.
_MACHINERY = ("/torch/", "/site-packages/torch/", "<frozen", "/contextlib.py", "/functools.py")


@dataclass
class Peak:
    peak_bytes: int  # allocated bytes at the highest point
    baseline_bytes: int  # allocated when recording began (alive before the trace)
    at_us: int  # the trace time of the peak (microseconds)
    sites: dict[str, dict] = field(default_factory=dict)  # site -> {"bytes", "count", "context"}

    def as_record(self, top: int) -> dict:
        ranked = sorted(self.sites.items(), key=lambda kv: -kv[1]["bytes"])[:top]
        return {"peak_gib": self.peak_bytes / 2**30, "baseline_gib": self.baseline_bytes / 2**30,
                "in_trace_gib": (self.peak_bytes - self.baseline_bytes) / 2**30, "at_us": self.at_us,
                "sites": [{"site": site, "gib": v["bytes"] / 2**30, "count": v["count"], "context": v["context"]}
                          for site, v in ranked]}


def _python_frames(frames: list[dict]) -> list[dict]:
    return [f for f in frames if str(f.get("filename", "")).endswith(".py")]


def site_of(frames: list[dict]) -> tuple[str, str]:
    """(innermost, outermost) Python frame outside torch of an allocation's stack (frames run innermost
    first), each as `path-tail:line name`; ("unknown", "") without Python frames."""
    python = _python_frames(frames)
    if not python:
        return "unknown", ""

    def name(f: dict) -> str:
        tail = "/".join(str(f["filename"]).split("/")[-3:]).lstrip("/")
        return f"{tail}:{f.get('line', 0)} {f.get('name', '?')}"

    ours = [f for f in python if not any(m in str(f["filename"]) for m in _MACHINERY)] or python
    return name(ours[0]), name(ours[-1])


def alive_at_dump(snapshot: dict, device: int) -> int:
    """Bytes of the blocks allocated when the snapshot was dumped, on `device`."""
    return sum(block["size"] for segment in snapshot.get("segments", []) if segment.get("device", 0) == device
               for block in segment.get("blocks", []) if block.get("state") == "active_allocated")


def find_peak(snapshot: dict, device: int = 0) -> Peak:
    """The highest point of allocated bytes in the snapshot's trace of `device`, and what is alive there."""
    trace = snapshot["device_traces"][device]
    signed = {"alloc": 1, "free_completed": -1}  # free_requested: the block is still allocated until completed
    current = best = 0
    best_index = -1
    for index, event in enumerate(trace):
        current += signed.get(event["action"], 0) * event["size"]
        if current > best:
            best, best_index = current, index
    baseline = alive_at_dump(snapshot, device) - current  # current: the trace's net allocations by the dump
    live: dict[int, dict] = {}
    for event in trace[:best_index + 1]:  # replayed up to the peak: the trace's allocations alive there
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    sites: dict[str, dict] = defaultdict(lambda: {"bytes": 0, "count": 0, "context": ""})
    for event in live.values():
        site, context = site_of(event.get("frames", []))
        entry = sites[site]
        entry["bytes"] += event["size"]
        entry["count"] += 1
        entry["context"] = entry["context"] or context
    at_us = trace[best_index]["time_us"] if best_index >= 0 else 0
    return Peak(peak_bytes=baseline + best, baseline_bytes=baseline, at_us=at_us, sites=dict(sites))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("snapshot", help="a .pickle written by torch.cuda.memory._dump_snapshot")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--top", type=int, default=15, help="how many allocation sites to list")
    p.add_argument("--json", help="also write the result to this file")
    a = p.parse_args()
    with open(a.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    if not snapshot.get("device_traces") or a.device >= len(snapshot["device_traces"]):
        raise SystemExit(f"{a.snapshot} has no trace for device {a.device}: was the history recorded on it?")
    record = find_peak(snapshot, a.device).as_record(a.top)
    print(f"peak {record['peak_gib']:.2f} GiB allocated: {record['baseline_gib']:.2f} GiB alive before recording "
          f"began (weights, optimizer state), {record['in_trace_gib']:.2f} GiB allocated in the trace")
    for s in record["sites"]:
        context = f"   [{s['context']}]" if s["context"] else ""
        print(f"  {s['gib']:8.3f} GiB  {s['count']:6d}x  {s['site']}{context}")
    if a.json:
        Path(a.json).write_text(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
