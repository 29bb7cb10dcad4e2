"""The CPU-checkable parts of the FlashAttention-4 device recipe: scripts/fa4_pack.py (the two parts each under a
call's carry limit, unpacked into one merged site folder) and scripts/fa4_smoke.py (arguments, verdicts)."""

from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import fa4_pack  # noqa: E402
import fa4_smoke  # noqa: E402

MIB = fa4_pack.MIB


def test_items_are_dealt_largest_first_and_part_two_keeps_room_for_what_travels_beside_it():
    items = [fa4_pack.Item(name, int(mib * MIB)) for name, mib in
             [("ir.tar.xz", 52.0), ("rt.tar.xz", 14.0), ("bindings.whl", 11.6), ("tvm.whl", 3.2), ("base.whl", 2.9),
              ("core.whl", 1.6), ("fa4.whl", 0.5)]]
    part1, part2 = fa4_pack.deal(items, limit=60 * MIB, beside=25 * MIB)
    assert [i.name for i in part1] == ["ir.tar.xz", "tvm.whl", "base.whl", "core.whl"]  # 59.7 MiB: no room for 0.5
    assert [i.name for i in part2] == ["rt.tar.xz", "bindings.whl", "fa4.whl"]
    assert sum(i.size for i in part1) <= 60 * MIB and sum(i.size for i in part2) <= 35 * MIB
    with pytest.raises(ValueError, match=r"ir.tar.xz \(61.0 MiB\) fits neither part"):
        fa4_pack.deal([fa4_pack.Item("ir.tar.xz", 61 * MIB)], limit=60 * MIB)
    with pytest.raises(ValueError, match="rt.tar.xz"):  # part 1 full, and part 2's room taken by .whl/
        fa4_pack.deal(items[:2], limit=60 * MIB, beside=50 * MIB)


def _wheel(folder: Path, name: str, files: dict[str, bytes]) -> None:
    with zipfile.ZipFile(folder / name, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in files.items():
            z.writestr(path, data)


def test_pack_then_unpack_merges_both_parts_into_one_site(tmp_path):
    wheels, out, site = tmp_path / "wheels", tmp_path / ".fa4", tmp_path / "site"
    wheels.mkdir()
    compiler = os.urandom(400_000)  # incompressible: its archive alone fills part 1
    _wheel(wheels, "nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl", {
        "nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.so": compiler,
        "nvidia_cutlass_dsl/cu13/lib/libcute_dsl_runtime.so": os.urandom(100_000),  # with it: over one part
        "nvidia_cutlass_dsl_libs_cu13-4.8.1.dist-info/METADATA": b"Name: nvidia-cutlass-dsl-libs-cu13\n"})
    _wheel(wheels, "nvidia_cutlass_dsl_libs_base-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl",
           {"nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py": b"__version__ = '4.8.1'\n"})
    _wheel(wheels, "typing_extensions-4.12.2-py3-none-any.whl", {"typing_extensions.py": b"broken = True\n"})
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "unsloth.whl").write_bytes(b"x" * 100_000)
    manifest = fa4_pack.pack(wheels, out, limit=450_000, beside=fa4_pack.folder_bytes(tmp_path / ".whl"))
    part1, part2 = (set(manifest["parts"][k]["files"]) for k in ("part1", "part2"))
    assert "nvidia_cutlass_dsl_libs_cu13.0.tar.xz" in part1 and "nvidia_cutlass_dsl_libs_cu13.rest.tar.xz" in part2
    assert part1 | part2 == {"nvidia_cutlass_dsl_libs_cu13.0.tar.xz", "nvidia_cutlass_dsl_libs_cu13.rest.tar.xz",
                             "nvidia_cutlass_dsl_libs_base-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl",
                             "typing_extensions-4.12.2-py3-none-any.whl"} and not part1 & part2
    for name, entry in manifest["parts"].items():
        assert fa4_pack.folder_bytes(out / name) - (out / name / fa4_pack.MANIFEST).stat().st_size == entry["bytes"]
    assert manifest["parts"]["part1"]["bytes"] <= 450_000 and manifest["parts"]["part2"]["bytes"] <= 450_000 - 100_000
    lines = fa4_pack.unpack(out / "part1", site)  # the first call
    lines += fa4_pack.unpack(out / "part2", site)  # the next: merged beside it, not replacing nvidia_cutlass_dsl/
    dsl = site / "nvidia_cutlass_dsl"
    assert (dsl / "dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.so").read_bytes() == compiler
    assert (dsl / "cu13/lib/libcute_dsl_runtime.so").stat().st_mode & 0o111  # tar keeps the libraries' mode
    assert (dsl / "dsl_packages/cutlass/__init__.py").exists()
    assert not (site / "typing_extensions.py").exists()  # this Python imports it already: left out, said so
    assert "typing_extensions-4.12.2-py3-none-any.whl: left out (typing_extensions is already importable)" in lines
    assert json.loads((site / ".part2.done").read_text()) == manifest["parts"]["part2"]["files"]


def test_a_cut_transfer_is_refused_by_its_checksum(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "flash_attn_4-4.0.0b36-py3-none-any.whl", {"flash_attn/cute/interface.py": b"x = 1\n"})
    fa4_pack.pack(wheels, tmp_path / ".fa4", limit=MIB, beside=0)
    carried = tmp_path / ".fa4" / "part1" / "flash_attn_4-4.0.0b36-py3-none-any.whl"
    carried.write_bytes(carried.read_bytes()[:-10])
    with pytest.raises(SystemExit, match="sha256 differs"):
        fa4_pack.unpack(tmp_path / ".fa4" / "part1", tmp_path / "site")


def test_smoke_arguments_and_verdicts():
    a = fa4_smoke.parse(["--layout", "8b", "--lengths", "1, 7,4000"])
    assert (a.layout, a.lengths, fa4_smoke.LAYOUTS[a.layout]) == ("8b", [1, 7, 4000], (32, 8, 128))
    assert fa4_smoke.offsets([1, 7, 4000]) == [0, 1, 8, 4008]
    with pytest.raises(SystemExit):
        fa4_smoke.parse(["--lengths", "0,5"])
    chats = fa4_smoke.parse(["--row-tokens", "22528"]).lengths  # attn_bench's row of short chats
    assert sum(chats) == 22528 and 32 <= max(chats) <= 4096 and len(chats) > 10
    assert fa4_smoke.within(0.03, noise=0.01, scale=4.0) and not fa4_smoke.within(0.031, noise=0.01, scale=4.0)
    assert fa4_smoke.within(0.004, noise=0.0, scale=4.0)  # exact reference: a thousandth of the values' size
    ran = {"ran": True, "accurate": True, "graph_ok": True}
    assert [fa4_smoke.exit_code(r) for r in (ran, {**ran, "graph_ok": False}, {"ran": False})] == [0, 1, 2]
    failed = {"layout": "0.6b", "lengths": [5], "ran": False, "error": "ImportError: no cutlass"}
    assert fa4_smoke.summary_line(failed) == "fa4 smoke DID NOT RUN: ImportError: no cutlass"


def test_the_device_calls_stay_under_the_command_limit():
    """Each prepared call is one short command (the run tool takes 2,000 characters); the calls exist."""
    script = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "2026-12-02-fa4-device-calls.sh"
    text = script.read_text()
    for call in ("callA", "callB", "callC"):
        assert f"\n{call}() {{" in text
        assert len(f"bash {script.relative_to(script.parents[2])} {call}") < 2000
