"""The package's import rules, read from the source (every import: module level, inside functions and
under `if TYPE_CHECKING:`), so a new module or a lazy import cannot break them unnoticed.

- plan/ imports no model library (torch, transformers, trl, peft, unsloth, bitsandbytes): `hypersloth-plan`
  previews a run with the planner's own code and no GPU stack (checked per module: an eval dataset built
  with another tokenizer is compared through data/tokenizer_check.py, which loads both tokenizers);
- launch/ imports nothing from train/ (no model code in the launcher);
- imports follow the stage order (config <- outputs <- data <- plan <- launch, train <- cli), never upward;
- no import cycles between modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "HyperSloth"
MODEL_LIBRARIES = {"torch", "transformers", "trl", "peft", "unsloth", "unsloth_zoo", "bitsandbytes"}
# Top-level modules kept as documented re-exports of an old import path, counted in the stage they re-export.
REEXPORTS = {"HyperSloth.batching": "plan"}
# What each stage may import besides itself. cli is the top: it may import every stage.
ALLOWED = {
    "config": set(),
    "templates": {"config"},
    "outputs": {"config"},
    "data": {"config", "outputs"},
    "plan": {"config", "outputs", "data"},
    "launch": {"config", "outputs", "data", "plan"},
    "train": {"config", "outputs", "data", "plan"},
    "cli": {"config", "outputs", "data", "plan", "launch", "train"},
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted(root.rglob("*.py"))}


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Every module `path` imports (ours resolved to the module, not the package, when one is named;
    others by their top-level name), wherever the import statement sits."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upward
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in modules else base)
    return {m if m.startswith("HyperSloth") else m.split(".")[0] for m in found}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    modules = package_modules(root)
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def stage(module: str) -> str:
    """config, templates, data, plan, launch, train, outputs or cli; "" for the package's own __init__."""
    if module in REEXPORTS:
        return REEXPORTS[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def ours(graph: dict[str, set[str]], module: str) -> set[str]:
    return {m for m in graph[module] if m.startswith("HyperSloth") and m != "HyperSloth"}


def model_library_imports(graph: dict[str, set[str]], stage_name: str) -> list[str]:
    return sorted(f"{m} imports {lib}" for m in graph if stage(m) == stage_name
                  for lib in graph[m] & MODEL_LIBRARIES)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a stage its rules do not allow (train from launch included)."""
    bad = []
    for module in graph:
        if not stage(module):
            continue
        allowed = ALLOWED[stage(module)] | {stage(module)}
        bad += [f"{module} -> {dep}" for dep in sorted(ours(graph, module)) if stage(dep) not in allowed]
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (or a module importing itself), Tarjan's way."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in ours(graph, node):
            if dep not in graph:
                continue
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == node:
                    break
            if len(members) > 1 or node in ours(graph, node):
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


# ---------------------------------------------------------------- the rules, on HyperSloth


def test_every_module_belongs_to_a_stage():
    graph = import_graph()
    assert {stage(m) for m in graph} - {""} <= set(ALLOWED), "a folder outside the stages: add it to ALLOWED"
    assert {"plan", "launch", "train", "outputs", "data", "cli", "config"} <= {stage(m) for m in graph}


def test_plan_imports_no_model_library():
    assert model_library_imports(import_graph(), "plan") == []


def test_launch_imports_nothing_from_train():
    graph = import_graph()
    bad = [f"{m} -> {dep}" for m in graph if stage(m) == "launch" for dep in ours(graph, m) if stage(dep) == "train"]
    assert bad == []


def test_imports_follow_the_stage_order():
    assert upward_imports(import_graph()) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_importing_plan_and_the_entry_points_loads_no_model_library():
    """At run time too, through every module-level import: the preview and hypersloth-train start without
    the GPU stack (torch's import alone takes seconds). launch.rendezvous imports torch.distributed, and is
    imported only when the launcher binds the store."""
    import subprocess
    import sys

    names = sorted(m for m in import_graph() if stage(m) == "plan") + [
        "HyperSloth.cli.plan", "HyperSloth.cli.train", "HyperSloth.launch.local", "HyperSloth.launch.tmux"]
    code = (f"import importlib, sys\nfor name in {names!r}:\n    importlib.import_module(name)\n"
            f"print(sorted(sys.modules.keys() & {sorted(MODEL_LIBRARIES)!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_trainable_rule_and_ignore_index_are_written_once():
    """One trainable-token rule (plan.batching.sample_token_counts) and one IGNORE_INDEX (data.masking)."""
    def length_minus_one(node: ast.AST) -> bool:  # `length(s) - 1`, the rule's arithmetic
        return (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and isinstance(node.left, ast.Name)
                and "length" in node.left.id and isinstance(node.right, ast.Constant) and node.right.value == 1)

    sources = {p: p.read_text() for p in PACKAGE.rglob("*.py")}
    rule = [p.name for p, text in sources.items() for node in ast.walk(ast.parse(text)) if length_minus_one(node)]
    assert rule == ["batching.py"]
    assert length_minus_one(ast.parse("max(length - 1, 0)").body[0].value.args[0])
    assert [p.name for p, text in sources.items() if "IGNORE_INDEX = " in text] == ["masking.py"]


# ---------------------------------------------------------------- the checker finds what it forbids


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "HyperSloth"
    for rel, text in {"__init__.py": "", "config.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_checker_sees_lazy_and_type_checking_imports(tmp_path):
    root = _package(tmp_path, {
        "plan/__init__.py": "",
        "plan/run.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch.nn\n",
        "plan/inputs.py": "def f():\n    from transformers import AutoTokenizer\n",
        "launch/__init__.py": "",
        "launch/local.py": "def g():\n    from HyperSloth.train import dist\n",
        "train/__init__.py": "",
        "train/dist.py": "",
    })
    graph = import_graph(root)
    assert model_library_imports(graph, "plan") == ["HyperSloth.plan.inputs imports transformers",
                                                    "HyperSloth.plan.run imports torch"]
    assert upward_imports(graph) == ["HyperSloth.launch.local -> HyperSloth.train.dist"]


def test_the_checker_finds_cycles_and_relative_imports(tmp_path):
    root = _package(tmp_path, {
        "data/__init__.py": "",
        "data/build.py": "from . import summary\n",
        "data/summary.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from HyperSloth.data.build import X\n",
        "outputs/__init__.py": "",
        "outputs/report.py": "from ..plan import run\n",
        "plan/__init__.py": "",
        "plan/run.py": "",
    })
    graph = import_graph(root)
    assert cycles(graph) == [["HyperSloth.data.build", "HyperSloth.data.summary"]]
    assert upward_imports(graph) == ["HyperSloth.outputs.report -> HyperSloth.plan.run"]


def test_a_reexport_holds_only_the_names_of_its_module():
    """HyperSloth.batching (the planner's documented old path) re-exports plan.batching's objects, nothing else."""
    import HyperSloth.batching as old
    import HyperSloth.plan.batching as new

    assert old.__all__ and all(getattr(old, name) is getattr(new, name) for name in old.__all__)
    assert ours(import_graph(), "HyperSloth.batching") == {"HyperSloth.plan.batching"}


@pytest.mark.parametrize("module, expected", [("HyperSloth.config", "config"), ("HyperSloth.plan.run", "plan"),
                                              ("HyperSloth.batching", "plan"), ("HyperSloth", "")])
def test_stage_of_a_module(module, expected):
    assert stage(module) == expected
