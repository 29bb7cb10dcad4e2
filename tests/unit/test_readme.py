"""What a new user copies from README.md works as written: the names it builds are the names its configs use,
every template is listed, the shell is told where the commands are (issue 37)."""

from __future__ import annotations

import re
from pathlib import Path

from HyperSloth.cli.build_dataset import COMMAND as BUILD_COMMAND
from HyperSloth.cli.init import TEMPLATES
from HyperSloth.config import load_config

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_every_dataset_a_readme_config_names_is_built_with_that_name_in_the_readme():
    built = set(re.findall(r"--name ([\w.-]+)", README))
    named = set(re.findall(r'dataset_name="([\w.-]+)"', README))
    assert named and named <= built, f"configs name {sorted(named - built)}, which no command builds"
    # The quick start's FineTome build, as the README and `hypersloth-build-dataset --help` spell it.
    finetome = r"FineTome-100k[^\n]*\n[^\n]*--name ([\w.-]+)"
    help_text = "\n".join(BUILD_COMMAND.examples)
    assert re.search(finetome, help_text).group(1) == re.search(finetome, README).group(1) in named


def test_the_template_list_names_every_template():
    listed = re.search(r"from a template \(([^)]*)\)", README).group(1)
    assert sorted(name.strip() for name in listed.split(",")) == sorted(TEMPLATES)
    examples = (ROOT / "examples" / "README.md").read_text()
    assert all(name in examples for name in TEMPLATES), "examples/README.md lists the templates too"


def test_the_commands_are_said_to_live_in_the_venv():
    assert "source .venv/bin/activate" in README.split("## Quick start")[0]  # before the first hypersloth-* command
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    closing = demo.split("demo done")[1]
    assert "source .venv/bin/activate" in closing and closing.index("activate") < closing.index("hypersloth-export")


def test_the_cpu_recipes_build_what_their_templates_train():
    for template in ("tiny-cpu", "tiny-dpo-cpu"):
        config = load_config(ROOT / "HyperSloth" / "templates" / TEMPLATES[template])
        name, model = config.hyper.data.dataset_name, config.hyper.fast_model_args.model_name
        assert f"--name {name} \\\n    --tokenizer {model}" in README, template
        assert template == "tiny-cpu" or f"--template {template}" in README
        assert config.training_args.output_dir != "outputs/tiny-demo"  # make demo's folder


def test_ci_runs_the_readmes_test_command_and_the_slow_tier():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    commands = [line.split("#")[0].strip() for line in ci if line.startswith("make ")]
    assert commands == ["make test", "make test-slow"]
    assert "make test " in README.split("## Set-up")[1].split("##")[0]  # the README's own command
    makefile = (ROOT / "Makefile").read_text()
    assert '$(PYTEST) -m "not slow"' in makefile.split("\ntest:")[1].split("\n\n")[0]
    assert "$(PYTEST) -m slow" in makefile.split("\ntest-slow:")[1].split("\n\n")[0]
