"""Real runs on one GPU through Unsloth: what the CPU suite (transformers + gloo) cannot reach.

Skipped without CUDA and Unsloth (CI has neither). On the lent GPU machine, from the repository root:

    source scripts/gpu_env.sh && python3 -m pytest -q -x -p no:cacheprovider tests/gpu

(pytest travels as wheels in .whl; see docs/benchmarks/2026-12-01e-device-calls.sh, callW). Each run is the real
CLI on the tiny model (HyperSloth.train.tiny_model) and the shipped sample chats, ~30-60 s, mostly Unsloth's import:
- Unsloth's save path: checkpoints that verify, and a resume from step 3 that gives the uninterrupted run's losses;
- `lora_args.init_adapter_path` under Unsloth: the run starts from the saved adapter;
- 4-bit (bitsandbytes) with CUDA graphs: the graphed run gives the eager run's losses;
- with Unsloth's checkpointing, attention's outputs kept for the recompute (the default) give the plain recompute's
  losses and adapter.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from training_fixtures import (  # noqa: E402
    DATASET,
    MAX_SEQ_LENGTH,
    RUN_TIMEOUT_S,
    RunResult,
    RunSpec,
    _run,
    _script,
    build_inputs,
    flat_adapter,
    relative_error,
    run_env,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("unsloth") is None,
                       reason="needs CUDA and Unsloth"),
]

STEPS, SAVE_AT = 6, 3
# bf16 on the GPU: a resumed run replays the same kernels on the same rows (the plan and the RNG are restored);
# graphed and eager runs differ in launch order only. Both far below the step-to-step change of the loss (~1e-2).
GPU_RTOL = 1e-3
# Graphs need room: a graphed row holds at most half the token budget, and at least MIN_GRAPH_ROWS tokens
# (step_graph.graph_rows_limit, trainer_args.MIN_GRAPH_ROWS). At a 512-token budget the run is eager (measured on
# the H200: "leaves room for graphs of only 0 tokens"), and at 4,096 a 2,304-token row leaves 1,792; at 16,384 no
# step of 16 samples of at most 512 tokens (MAX_SEQ_LENGTH) has a row above half the budget, so the run is graphed.
GRAPHED_BUDGET = 16384


def _config(workdir: Path, model_dir: Path, name: str, *, four_bit: bool = False, graphs: bool = True,
            init_adapter: Path | None = None, steps: int = STEPS, resume: str | None = None,
            checkpointing: bool = False) -> Path:
    hyper: dict[str, Any] = {
        "data": {"dataset_name": DATASET, "data_dir": "data"},
        "training": {"gpus": [0], "loss_type": "response_only", "batching": "packed",
                     "tokens_per_micro_batch": "auto" if checkpointing else GRAPHED_BUDGET, "cuda_graphs": graphs},
        "fast_model_args": {"model_name": str(model_dir), "max_seq_length": MAX_SEQ_LENGTH, "dtype": "bfloat16",
                            "backend": "unsloth", "load_in_4bit": four_bit,
                            "use_gradient_checkpointing": "unsloth" if checkpointing else False},
        "lora_args": {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
                      "init_adapter_path": str(init_adapter) if init_adapter else None},
    }
    training = {"output_dir": f"outputs/{name}", "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
                "max_steps": steps, "learning_rate": 3e-3, "warmup_steps": 1, "logging_steps": 1,
                "save_steps": SAVE_AT, "save_total_limit": None, "report_to": "none", "seed": 7,
                "resume_from_checkpoint": resume}
    path = workdir / "configs" / f"{name}.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"hyper_config = {hyper!r}\ntraining_config = {training!r}\n")
    return path


def _train(workdir: Path, config: Path, name: str, extra_env: dict[str, str] | None = None) -> RunResult:
    # The CPU suite's environment (no outer torchrun, no Hub), with this machine's first GPU in place of none.
    env = {**run_env(), "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
           **(extra_env or {})}
    code, output, ended = _run([*_script("hypersloth-train"), str(config)], workdir, env, RUN_TIMEOUT_S)
    # RunResult's reading helpers only; the spec records the one GPU.
    return RunResult(RunSpec(name=name, gpus=1), workdir / "outputs" / name, config, code, output, ended).check_ok()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, tiny_model_dir) -> Path:
    folder = tmp_path_factory.mktemp("gpu-runs")
    build_inputs(folder, tiny_model_dir)
    return folder


@pytest.fixture(scope="module")
def full_run(workdir, tiny_model_dir) -> RunResult:
    return _train(workdir, _config(workdir, tiny_model_dir, "full"), "full")


def _losses(run: RunResult) -> np.ndarray:
    return np.asarray(run.summary["step_losses"], dtype=np.float64)


def test_unsloth_checkpoints_verify_and_a_resume_gives_the_same_losses(workdir, tiny_model_dir, full_run):
    from HyperSloth.outputs import checkpoints

    summary = full_run.summary
    assert summary["cuda_graphs"]["enabled"], summary["cuda_graphs"]  # the graphed path, the product default
    for step in (SAVE_AT, STEPS):
        check = checkpoints.verify(full_run.out / f"checkpoint-{step}")
        assert check.ok, check
    assert (full_run.out / "adapter_model.safetensors").is_file()
    resumed_dir = workdir / "outputs" / "resumed"
    shutil.copytree(full_run.out, resumed_dir)
    config = _config(workdir, tiny_model_dir, "resumed", resume=f"outputs/resumed/checkpoint-{SAVE_AT}")
    resumed = _train(workdir, config, "resumed")
    a, b = _losses(full_run), _losses(resumed)
    assert len(b) == STEPS and np.array_equal(a[:SAVE_AT], b[:SAVE_AT])  # the steps before come from the checkpoint
    assert np.max(np.abs(a - b) / np.abs(a)) <= GPU_RTOL, (a.tolist(), b.tolist())
    error = relative_error(flat_adapter(full_run.adapter()), flat_adapter(resumed.adapter()))
    assert error <= GPU_RTOL, f"final adapters differ: relative error {error:.3g}"


def test_init_adapter_under_unsloth_starts_from_the_saved_adapter(workdir, tiny_model_dir, full_run):
    """One step whose learning rate is 0 (warm-up step 1 of 1): the saved adapter is the initial one unchanged,
    so it must equal the adapter it was loaded from; its loss is the trained adapter's, below the first run's
    step 1 (where LoRA B was zero)."""
    config = _config(workdir, tiny_model_dir, "from-adapter", init_adapter=full_run.out, steps=1)
    started = _train(workdir, config, "from-adapter")
    assert started.summary["learning_rates"][0] == 0
    error = relative_error(flat_adapter(full_run.adapter()), flat_adapter(started.adapter()))
    assert error <= 1e-6, f"the adapter trained from differs from the one saved: relative error {error:.3g}"
    assert _losses(started)[0] < _losses(full_run)[0] - 1e-2


def test_four_bit_with_cuda_graphs_gives_the_eager_losses(workdir, tiny_model_dir):
    graphed = _train(workdir, _config(workdir, tiny_model_dir, "4bit-graphs", four_bit=True), "4bit-graphs")
    eager = _train(workdir, _config(workdir, tiny_model_dir, "4bit-eager", four_bit=True, graphs=False), "4bit-eager")
    assert graphed.summary["cuda_graphs"]["enabled"], graphed.summary["cuda_graphs"]
    assert not eager.summary["cuda_graphs"]["enabled"]
    a, b = _losses(eager), _losses(graphed)
    assert np.max(np.abs(a - b) / np.abs(a)) <= GPU_RTOL, (a.tolist(), b.tolist())


def test_attention_outputs_kept_through_checkpointing_give_the_plain_recompute_losses_and_adapter(workdir,
                                                                                                  tiny_model_dir):
    """The default for checkpointed SFT on Unsloth (train/attention/recompute.py): every layer's attention output is
    kept from the first pass and reused by the recompute, and the run trains as with the plain recompute
    (HYPERSLOTH_REUSE_ATTENTION=0). The measured budget ("auto") gives the room the kept outputs live in."""
    from HyperSloth.outputs import run_files

    kept = _train(workdir, _config(workdir, tiny_model_dir, "gc-kept", checkpointing=True), "gc-kept")
    plain = _train(workdir, _config(workdir, tiny_model_dir, "gc-plain", checkpointing=True), "gc-plain",
                   extra_env={run_files.ENV_REUSE_ATTENTION: "0"})
    reuse = kept.summary.get("attention_reuse")
    assert reuse and reuse["kept"] > 0 and reuse["reused"] == reuse["kept"] and reuse["dropped"] == 0, reuse
    assert not plain.summary.get("attention_reuse"), plain.summary.get("attention_reuse")
    a, b = _losses(plain), _losses(kept)
    assert np.max(np.abs(a - b) / np.abs(a)) <= GPU_RTOL, (a.tolist(), b.tolist())
    error = relative_error(flat_adapter(plain.adapter()), flat_adapter(kept.adapter()))
    assert error <= GPU_RTOL, f"final adapters differ: relative error {error:.3g}"
