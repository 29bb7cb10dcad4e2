"""Real training runs for the integration tests: a tiny model, a built dataset, configs and a run pool.

Every run is the real CLI (`hypersloth-train`, torchrun or `--tmux`) in its own process tree, on CPU
over gloo. A run costs ~15-40 s on 2 cores (mostly imports), so the pool starts the runs the selected
tests need at once, two at a time, and each test waits only for the runs it reads.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest

DATASET = "chat"
SAMPLE_CHAT = Path(__file__).resolve().parents[2] / "data" / "sample_chat.jsonl"
NUM_CONVERSATIONS = 256
MAX_SEQ_LENGTH = 512
MAX_STEPS = 6
SAVE_STEPS = 3
RUN_TIMEOUT_S = 420
FAILURE_MARK = "failed_at.txt"  # written by the injected failure just before it raises

# Rank 1 fails inside its 3rd optimizer step. Workers never execute the config file (they read run.json),
# so the failure comes in as a `sitecustomize` module on the run's PYTHONPATH: Python imports it at the
# start of every process, and on rank 1 it wraps the trainer's public `training_step`.
FAILURE_INJECTION = '''
import os as _os, time as _time
from pathlib import Path as _Path
if _os.environ.get("HYPERSLOTH_RANK") == "1":
    from HyperSloth.train.sft.trainer import HyperSlothTrainer as _Trainer
    _step, _calls = _Trainer.training_step, []
    def _failing_step(self, *args, **kwargs):
        _calls.append(1)
        if len(_calls) == 3:
            _Path({mark!r}).write_text(repr(_time.time()))
            raise RuntimeError("injected failure in training step 3")
        return _step(self, *args, **kwargs)
    _Trainer.training_step = _failing_step
'''

# Rank 1 is killed (SIGKILL) halfway through writing its RNG state into the checkpoint of the last step,
# as a preempted machine would be: the save never finishes.
KILL_IN_SAVE_INJECTION = '''
import os as _os, signal as _signal
from pathlib import Path as _Path
if _os.environ.get("HYPERSLOTH_RANK") == "1":
    from HyperSloth.train.sft.trainer import HyperSlothTrainer as _Trainer
    _save = _Trainer._save_rng_state
    def _killed_while_saving(self, output_dir):
        if self.state.global_step == {step}:
            _Path(output_dir, "rng_state_rank1.pth").write_bytes(b"PK\\x03\\x04 half an RNG state")
            _Path({mark!r}).write_text("killed")
            _os.kill(_os.getpid(), _signal.SIGKILL)
        return _save(self, output_dir)
    _Trainer._save_rng_state = _killed_while_saving
'''

# Every worker runs without HyperSloth's per-sample linear attention (train/packing/recurrent.py): a tiny
# Qwen3.5-MoE's packed rows then stay leaky on the CPU, as a model HyperSloth cannot make exact would, so the
# fallback to sorted-pad and the refusal are run end to end.
UNFIXABLE_PACKING_INJECTION = '''
import os as _os
if _os.environ.get("HYPERSLOTH_RANK") is not None:
    import HyperSloth.train.packing.check as _check
    _check.per_sample_recurrent_mixers = lambda model: None
'''


@dataclass(frozen=True)
class RunSpec:
    """One training run. The global batch is per_device x 2 (accumulation) x gpus."""

    name: str
    gpus: int = 2
    per_device: int = 4
    batching: Literal["packed", "sorted-pad"] | None = "packed"  # None: not in the config (the default, packed)
    loss_type: Literal["all", "response_only"] = "response_only"
    launcher: Literal["cli", "torchrun", "tmux"] = "cli"
    resume_from: str | None = None  # copy this run's output dir and resume from its checkpoint-3 in place
    resume_into_new_dir: bool = False  # resume from the other run's own checkpoint-3, into a fresh output dir
    resume_latest: bool = False  # resume_from_checkpoint="latest" (with resume_from: in the copied folder)
    inject_failure: bool = False
    kill_in_save: bool = False  # rank 1 is killed while saving the checkpoint of the last step
    lora_dropout: float = 0.0
    profile: bool = False  # training.profile: phase timing and the kernel profile of steps 4-6
    model_subdir: str | None = None  # a model in this folder of the pool's model_dir (other architectures)
    default_targets: bool = False  # leave lora_args.target_modules unset (read from the model) and dropout out
    unfixable_packing: bool = False  # UNFIXABLE_PACKING_INJECTION

    def hyper_config(self, model_dir: Path) -> dict[str, Any]:
        return {
            "data": {"dataset_name": DATASET, "data_dir": "data"},
            "training": {
                "gpus": list(range(self.gpus)),
                "loss_type": self.loss_type,
                **({} if self.batching is None else {"batching": self.batching}),
                # Smaller than a step's tokens, so every rank accumulates several packed micro-batches.
                "tokens_per_micro_batch": 512,
                "profile": self.profile,
            },
            "fast_model_args": {"model_name": str(model_dir / self.model_subdir if self.model_subdir else model_dir),
                                "max_seq_length": MAX_SEQ_LENGTH, "dtype": "float32", "backend": "transformers"},
            "lora_args": {"r": 8, "lora_alpha": 16} if self.default_targets else
            {"r": 8, "lora_alpha": 16, "lora_dropout": self.lora_dropout},
        }

    def training_config(self) -> dict[str, Any]:
        source = self.resume_from if self.resume_into_new_dir else self.name
        resume = f"outputs/{source}/checkpoint-{SAVE_STEPS}" if self.resume_from else None
        resume = "latest" if self.resume_latest else resume
        return {
            "output_dir": f"outputs/{self.name}",
            "per_device_train_batch_size": self.per_device,
            "gradient_accumulation_steps": 2,
            "max_steps": MAX_STEPS,
            "learning_rate": 3e-3,
            "warmup_steps": 1,
            "max_grad_norm": 0.01,  # far below any norm seen: every step clips, so clipping must see synced grads
            "logging_steps": 1,
            "save_steps": SAVE_STEPS,
            "save_total_limit": None,
            "report_to": "none",
            "seed": 7,
            "resume_from_checkpoint": resume,
        }


@dataclass
class RunResult:
    """What a finished run left: the CLI's exit code and output, and the output folder."""

    spec: RunSpec
    out: Path
    config: Path
    returncode: int
    output: str
    ended_at: float  # time.time() when the CLI exited
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.out / "train_summary.json").read_text())

    def final_records(self) -> list[dict[str, Any]]:
        return [json.loads((self.out / "logs" / f"rank{r}.final.json").read_text()) for r in range(self.spec.gpus)]

    def adapter(self) -> dict[str, np.ndarray]:
        from safetensors.numpy import load_file

        return load_file(str(self.out / "adapter_model.safetensors"))

    def check_ok(self) -> RunResult:
        assert self.returncode == 0, f"run {self.spec.name} exited {self.returncode}:\n{self.output[-4000:]}"
        return self


def build_inputs(workdir: Path, model_dir: Path) -> Path:
    """Dataset `chat` registered in workdir/data, tokenised with the tiny model in `model_dir` (the session's
    `tiny_model_dir`, built once per test run); returns the model folder."""
    from HyperSloth.data.build import build_dataset

    source = workdir / "chat.jsonl"
    with SAMPLE_CHAT.open() as lines:
        source.write_text("".join(line for _, line in zip(range(NUM_CONVERSATIONS), lines)))
    build_dataset(str(source), name=DATASET, tokenizer=str(model_dir), data_dir=str(workdir / "data"),
                  max_seq_length=MAX_SEQ_LENGTH, num_proc=1)
    return model_dir


def write_config(spec: RunSpec, workdir: Path, model_dir: Path) -> Path:
    """The config file of a run; plain dicts, which load_config validates like the models."""
    path = workdir / "configs" / f"{spec.name}.py"
    path.parent.mkdir(exist_ok=True)
    text = f"hyper_config = {spec.hyper_config(model_dir)!r}\ntraining_config = {spec.training_config()!r}\n"
    path.write_text(text)
    return path


def injection_dir(spec: RunSpec, workdir: Path) -> Path:
    """A folder holding the `sitecustomize.py` that makes rank 1 fail or die, or the packing unfixable (put it on
    PYTHONPATH)."""
    folder = workdir / "inject" / spec.name
    folder.mkdir(parents=True, exist_ok=True)
    mark = str(workdir / "outputs" / spec.name / FAILURE_MARK)
    code = (UNFIXABLE_PACKING_INJECTION if spec.unfixable_packing
            else KILL_IN_SAVE_INJECTION.format(mark=mark, step=MAX_STEPS) if spec.kill_in_save
            else FAILURE_INJECTION.format(mark=mark))
    (folder / "sitecustomize.py").write_text(code)
    return folder


def run_env(**extra: str) -> dict[str, str]:
    """CPU only, one thread per worker (so 1 and 2 workers do the same float math, and no run
    oversubscribes the cores), no Hub, and nothing inherited from an outer torchrun."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TMUX")}
    env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               **extra)
    return env


def _script(name: str) -> list[str]:
    """A console script of this virtualenv (what users run), else its module."""
    script = Path(sys.executable).with_name(name)
    modules = {"hypersloth-train": "HyperSloth.cli.train", "torchrun": "torch.distributed.run"}
    return [str(script)] if script.is_file() else [sys.executable, "-m", modules[name]]


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    """Run to completion in its own session; on timeout SIGTERM (the launcher stops its workers), then KILL."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        output += f"\n[test: killed after {timeout} s]".encode()
    return proc.returncode, output.decode(errors="replace"), time.time()


def _tmux_run(config: Path, out: Path, cwd: Path) -> tuple[int, str, float]:
    """`hypersloth-train CONFIG --tmux S` on a private tmux server (TMUX_TMPDIR), waited for via the
    exit-code files the rank windows write; the server is killed afterwards."""
    socket_dir = tempfile.mkdtemp(prefix="hs-tmux-")  # short: unix socket paths are limited to ~100 bytes
    env = run_env(TMUX_TMPDIR=socket_dir)
    try:
        code, output, _ = _run([*_script("hypersloth-train"), str(config), "--tmux", "hs-train"], cwd, env, 120)
        codes = [out / "logs" / f"rank{r}.exitcode" for r in range(2)]
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while code == 0 and not all(c.is_file() for c in codes) and time.monotonic() < deadline:
            time.sleep(0.5)
        found = {c.name: c.read_text().strip() for c in codes if c.is_file()}
        output += f"\n[test: rank exit codes {found}]"
        code = code or (0 if list(found.values()) == ["0", "0"] else 1)
        return code, output, time.time()
    finally:
        subprocess.run(["tmux", "kill-server"], env=env, capture_output=True)
        shutil.rmtree(socket_dir, ignore_errors=True)


class RunPool:
    """Starts runs in the background (two at a time: 2-3 worker processes share the cores) and hands
    back their results; a run named in `resume_from` is waited for before its resume starts."""

    def __init__(self, workdir: Path, model_dir: Path, specs: Iterable[RunSpec], parallel: int = 2):
        self.workdir, self.model_dir = workdir, model_dir
        self.specs = {spec.name: spec for spec in specs}
        self._executor = ThreadPoolExecutor(max_workers=parallel)
        self._futures: dict[str, Future] = {}

    def submit(self, names: Iterable[str]) -> None:
        for name in names:
            spec = self.specs[name]
            if spec.resume_from:
                self.submit([spec.resume_from])  # queued first, so it never waits behind its resume
            if name not in self._futures:
                self._futures[name] = self._executor.submit(self._execute, spec)

    def get(self, name: str) -> RunResult:
        self.submit([name])
        return self._futures[name].result()

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _execute(self, spec: RunSpec) -> RunResult:
        out = self.workdir / "outputs" / spec.name
        if spec.resume_from:
            source = self.get(spec.resume_from)
            source = (source if self.specs[spec.resume_from].kill_in_save else source.check_ok()).out
            if not spec.resume_into_new_dir:  # the whole earlier run: its results must not survive the resume
                shutil.copytree(source, out)
        config = write_config(spec, self.workdir, self.model_dir)
        env = run_env()
        if spec.inject_failure or spec.kill_in_save or spec.unfixable_packing:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(injection_dir(spec, self.workdir)),
                                                              env.get("PYTHONPATH")]))
        if spec.launcher == "tmux":
            code, output, ended = _tmux_run(config, out, self.workdir)
        else:
            argv = [*_script("hypersloth-train"), str(config)]
            if spec.launcher == "torchrun":
                argv = [*_script("torchrun"), "--nproc_per_node", str(spec.gpus), "--master_port", str(_free_port()),
                        "-m", "HyperSloth.cli.train", str(config)]
            code, output, ended = _run(argv, self.workdir, env, RUN_TIMEOUT_S)
        return RunResult(spec, out, config, code, output, ended)


def _free_port() -> int:
    # torchrun's own --master_port (HyperSloth's launcher holds its port itself and needs none).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def processes_mentioning(text: str) -> list[tuple[int, str]]:
    """Live (non-zombie) processes whose command line contains `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state not in ("Z", "X"):
            found.append((int(entry.name), cmdline))
    return found


def describe_run(spec: RunSpec, workdir: Path, model_dir: Path, loss_type: str | None = None):
    """The run description the launcher resolves for `spec` (with `loss_type`, default the spec's) on 2 CPU
    workers."""
    import contextlib
    from dataclasses import replace

    from HyperSloth.config import load_config
    from HyperSloth.plan.run import MachineFacts, resolve_run

    loss_type = loss_type or spec.loss_type
    variant = replace(spec, name=f"{spec.name}-{spec.batching}-{loss_type}", loss_type=loss_type)
    with contextlib.chdir(workdir):  # the config's data_dir is relative, as the runs see it
        loaded = load_config(write_config(variant, workdir, model_dir))
        return resolve_run(loaded, world_size=spec.gpus, machine=MachineFacts(0, False, 2))


def first_step_indices(spec: RunSpec, workdir: Path, model_dir: Path, dataset) -> list[int]:
    """The dataset rows of `spec`'s first optimizer step, every rank's, sorted (the planner's own plan)."""
    from HyperSloth.plan.batching import adaptive_partition_batches
    from HyperSloth.plan.inputs import dataset_lengths, plan_spec_for

    described = describe_run(spec, workdir, model_dir)
    lengths, trainable = dataset_lengths(dataset, spec.loss_type, described.max_seq_length)
    first = adaptive_partition_batches(lengths, trainable, plan_spec_for(described)).steps[0]
    return sorted(int(i) for rank in first.ranks for mb in rank for i in mb)


def expected_step_loss(model_dir: Path, dataset, indices, loss_type: str) -> float:
    """Mean token cross-entropy of the untrained model (LoRA B = 0) over the step's targets, every sample fed
    alone and unpacked (attention as transformers chooses it: SDPA, or eager where the model has no SDPA)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in indices:
            row = dataset[int(i)]
            ids = torch.tensor(row["input_ids"])
            targets = ids[1:] if loss_type == "all" else torch.tensor(row["labels"][1:])
            logits = model(ids[None], use_cache=False).logits[0, :-1].double()
            keep = targets != -100
            total += float(torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum"))
            count += int(keep.sum())
    return total / count


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||a||."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(a))


def flat_adapter(weights: dict[str, np.ndarray]) -> np.ndarray:
    """All adapter tensors as one vector, in name order."""
    return np.concatenate([weights[name].astype(np.float64).ravel() for name in sorted(weights)])


def needs(*names: str):
    """Declare the runs a test reads, so the pool can start them all before the first test waits."""
    def mark(test):
        test.runs_needed = names
        return test
    return mark


def pool_fixtures(name: str, specs, build=None) -> tuple:
    """The module-scoped fixtures `workdir`, `model_dir`, `runs` and `dataset` of a test module whose
    tests read runs of `specs`: assign them to those names at module level. `build(workdir, tiny_model_dir)`
    writes the module's data and returns the model folder (default: `build_inputs`, the sample chats)."""

    @pytest.fixture(scope="module")
    def workdir(tmp_path_factory):
        return tmp_path_factory.mktemp(name)

    @pytest.fixture(scope="module")
    def model_dir(workdir, tiny_model_dir):
        return (build or build_inputs)(workdir, tiny_model_dir)

    @pytest.fixture(scope="module")
    def runs(request, workdir, model_dir):
        """The pool, already running every run that the selected tests of this module need."""
        pool = RunPool(workdir, model_dir, specs)
        selected = [item for item in request.session.items if getattr(item, "module", None) is request.module]
        pool.submit(run for item in selected for run in getattr(item.function, "runs_needed", ()))
        yield pool
        pool.close()

    @pytest.fixture(scope="module")
    def dataset(workdir, model_dir):
        from datasets import load_from_disk

        return load_from_disk(str(workdir / "data" / "built_dataset" / "chat"))

    return workdir, model_dir, runs, dataset
