"""run.py: the run is resolved once, every problem reported at once, derived numbers in one place."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

from HyperSloth.config import ConfigError, load_config
from HyperSloth.outputs import checkpoints, run_files
from HyperSloth.plan.batching import PlanSpec
from HyperSloth.plan.inputs import plan_spec_for
from HyperSloth.plan.run import (
    MachineFacts,
    RunDescription,
    attention_coef,
    batch_numbers,
    check_resume,
    rank_seed,
    read_run,
    resolve_run,
    write_run,
)

PACKAGE = Path(__file__).resolve().parents[2] / "HyperSloth"
CPU = MachineFacts(cuda_device_count=0, unsloth_available=False, cpu_count=2)
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128)


def make_dataset(data_dir: Path, *, name: str = "chat", max_tokens: int = 300, fingerprint: str = "abc") -> Path:
    """A registered dataset folder as save_to_disk leaves it (metadata only: the resolver reads no rows)."""
    folder = data_dir / "built_dataset" / name
    folder.mkdir(parents=True, exist_ok=True)
    features = {c: {} for c in ("input_ids", "labels", "length", "num_trainable", "text")}
    (folder / "dataset_info.json").write_text(json.dumps({"features": features}))
    (folder / "state.json").write_text(json.dumps({"_fingerprint": fingerprint}))
    (folder / "data-00000-of-00001.arrow").write_bytes(b"x" * 10)
    entry = {"name": name, "path": f"built_dataset/{name}", "num_samples": 40, "tokenizer": "tok",
             "stats": {"max_tokens": max_tokens}}
    (data_dir / "data_config.json").write_text(json.dumps({"version": 1, "datasets": {name: entry}}))
    return folder


def write_config(tmp_path: Path, *, gpus=(0, 1), batching="packed", per_device=4, accumulation=2, seed=7,
                 max_seq_length=512, model=None, extra="", targs_extra="", name="cfg.py") -> Path:
    model = model or str(tmp_path / "model")
    path = tmp_path / name
    path.write_text(textwrap.dedent(f"""
        from HyperSloth.config import *
        hyper_config_model = HyperConfig(
            data=DataConfig(dataset_name="chat", data_dir={str(tmp_path / 'data')!r}),
            training=TrainingConfig(gpus={list(gpus)!r}{"" if batching is None else f", batching={batching!r}"}{extra}),
            fast_model_args=FastModelArgs(model_name={model!r}, max_seq_length={max_seq_length}),
        )
        training_config_model = TrainingArgsConfig(
            output_dir={str(tmp_path / 'out')!r}, per_device_train_batch_size={per_device},
            gradient_accumulation_steps={accumulation}, seed={seed}, max_steps=5{targs_extra})
    """))
    return path


@pytest.fixture
def setup(tmp_path):
    make_dataset(tmp_path / "data")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(QWEN3_06B))
    return tmp_path


def resolve(path: Path, world_size: int = 2, machine: MachineFacts = CPU) -> RunDescription:
    return resolve_run(load_config(path), world_size=world_size, machine=machine)


def test_resolved_run_holds_every_derived_number(setup):
    run = resolve(write_config(setup))
    assert (run.world_size, run.gpus, run.device, run.backend, run.dtype) == (2, (0, 1), "cpu", "transformers",
                                                                               "float32")
    assert (run.micro_batch_size, run.samples_per_rank_per_step, run.global_batch_size) == (4, 8, 16)
    assert run.micro_batches_per_step is None and run.token_budget == 4 * 512  # packed: budget decides
    assert (run.dataset.name, run.dataset.built_max_length, run.dataset.num_samples) == ("chat", 300, 40)
    assert run.dataset.path == str((setup / "data" / "built_dataset" / "chat").resolve())
    assert run.output_dir == str((setup / "out").resolve()) and run.seed == 7
    assert run.hyper_config.training.gpus == [0, 1] and run.training_config.max_steps == 5
    line = run.batch_line()
    assert "world size 2" in line and "8 samples per rank per step" in line and "global batch 16 samples" in line


def test_one_micro_batch_per_step_is_singular_in_the_batch_line(setup):
    run = resolve(write_config(setup, batching="sorted-pad", per_device=2, accumulation=1), world_size=2)
    assert run.micro_batches_per_step == 1
    assert "1 micro-batch)" in run.batch_line() or "1 micro-batch " in run.batch_line()
    assert "1 micro-batches" not in run.batch_line()


def test_sorted_pad_runs_accumulation_micro_batches_and_world_size_scales_the_step(setup):
    run = resolve(write_config(setup, batching="sorted-pad", per_device=2, accumulation=3), world_size=5)
    assert (run.global_batch_size, run.micro_batches_per_step) == (2 * 3 * 5, 3)
    assert batch_numbers(2, 3, 5, "sorted-pad") == {"micro_batch_size": 2, "samples_per_rank_per_step": 6,
                                                    "global_batch_size": 30, "micro_batches_per_step": 3}


def test_batching_left_unset_is_recorded_and_sorted_pad_recuts_the_same_step(setup):
    """A packed run whose model leaks may train sorted-pad only if its config left batching unset (worker.py)."""
    unset = resolve(write_config(setup, batching=None, per_device=2, accumulation=3), world_size=2)
    assert (unset.batching, unset.batching_from_config) == ("packed", False)
    explicit = resolve(write_config(setup, batching="packed", name="set.py"))
    assert explicit.batching_from_config
    # the start-up line and --dry-run say where the batching may still change, and only there
    assert "packed batching (sorted-pad if the model's packed rows leak: checked at load)" in unset.batch_line()
    assert "packed batching, " in explicit.batch_line()
    padded = unset.with_batching("sorted-pad")
    assert (padded.batching, padded.micro_batches_per_step, padded.global_batch_size) == ("sorted-pad", 3, 12)
    assert padded.samples_per_rank_per_step == unset.samples_per_rank_per_step == 6
    assert padded.model_copy(update={"batching": "packed", "micro_batches_per_step": None}) == unset


def test_cuda_machine_resolves_backend_and_dtype(setup):
    gpu = MachineFacts(cuda_device_count=2, unsloth_available=True, cpu_count=8)
    run = resolve(write_config(setup), machine=gpu)
    assert (run.device, run.backend, run.dtype) == ("cuda", "unsloth", "bfloat16")


def test_plan_spec_comes_from_the_description(setup):
    run = resolve(write_config(setup, gpus=(0, 1, 2)), world_size=3)
    spec = plan_spec_for(run)
    assert (spec.num_ranks, spec.samples_per_step, spec.micro_batch_size, spec.token_budget, spec.seed) == (
        3, 24, 4, 2048, 7)
    assert spec.attention_coef == pytest.approx(attention_coef(str(setup / "model")))
    hub = resolve(write_config(setup, model="org/model", name="hub.py"))
    assert plan_spec_for(hub).attention_coef == PlanSpec(1, 1, mode="sorted-pad").attention_coef  # default


def test_every_problem_is_reported_at_once(setup):
    make_dataset(setup / "data", max_tokens=900)
    config = write_config(setup, targs_extra=", optim='adamw_8bit'")
    text = config.read_text().replace("max_seq_length=512)", "max_seq_length=512, load_in_4bit=True)")
    config.write_text(text)
    with pytest.raises(ConfigError) as info:
        resolve(config)
    message = str(info.value)
    assert "load_in_4bit=True needs CUDA" in message
    assert "optim='adamw_8bit' needs CUDA" in message
    assert "holds samples of up to 900 tokens but fast_model_args.max_seq_length is 512" in message
    assert "set max_seq_length >= 900" in message and "--max_seq_length 512 --overwrite" in message
    assert message.count("\n  - ") == 3


def test_missing_dataset_folder_names_a_working_rebuild_command(setup):
    import shutil

    shutil.rmtree(setup / "data" / "built_dataset")
    with pytest.raises(ConfigError) as info:
        resolve(write_config(setup))
    message = str(info.value)
    assert "registered but its folder" in message
    assert f"--name chat --data_dir {setup / 'data'} --overwrite" in message


def test_unregistered_dataset(setup):
    (setup / "data" / "data_config.json").write_text(json.dumps({"version": 1, "datasets": {}}))
    with pytest.raises(ConfigError, match="dataset 'chat' is not registered"):
        resolve(write_config(setup))


def test_run_json_round_trips_and_is_frozen(setup):
    run = resolve(write_config(setup))
    path = write_run(run)
    assert path == setup / "out" / "run.json"
    again = read_run(path)
    assert again == run
    with pytest.raises(Exception):
        again.world_size = 3  # frozen
    data = json.loads(path.read_text())
    data["surprise"] = 1
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="not a run description"):
        read_run(path)
    with pytest.raises(ConfigError, match="cannot read the run description"):
        read_run(setup / "nope.json")


def test_same_inputs_resolve_to_the_same_description(setup):
    # Under torchrun every rank resolves on its own: it must come out identical.
    config = write_config(setup)
    assert resolve(config) == resolve(config)


def complete_checkpoint(folder: Path, description: RunDescription) -> Path:
    """A checkpoint as a save leaves it (files faked): run.json, trainer state, an RNG state per rank, manifest."""
    write_run(description, run_files.run_file(folder))
    (folder / run_files.TRAINER_STATE_FILE).write_text("{}")
    for rank in range(description.world_size):
        run_files.rank_rng_file(folder, rank).write_bytes(b"rng")
    checkpoints.write_manifest(folder, step=3, world_size=description.world_size)
    return folder


def _checkpoint_of(setup: Path, **config) -> Path:
    return complete_checkpoint(setup / "out" / "checkpoint-3", resolve(write_config(setup, name="first.py", **config)))


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"per_device": 2}, "samples per step 16 -> 8"),
        ({"seed": 8}, "seed 7 -> 8"),
        ({"batching": "sorted-pad"}, "planning mode packed, group_by_length=False, group_window_steps=64 -> "
                                     "sorted-pad"),
    ],
)
def test_resume_with_another_plan_is_refused(setup, change, expected):
    checkpoint = _checkpoint_of(setup)
    with pytest.raises(ConfigError) as info:
        resolve(write_config(setup, targs_extra=f", resume_from_checkpoint={str(checkpoint)!r}", **change))
    message = str(info.value)
    assert f"cannot resume from {checkpoint}" in message and expected in message
    assert "samples would be repeated or skipped" in message


def test_a_run_that_trained_sorted_pad_by_itself_resumes_with_batching_still_unset(setup):
    """Its workers switched packed -> sorted-pad (a model whose packed rows leak) and wrote that into the checkpoint's
    run.json; the resumed run, batching still unset, will switch again. A config that now sets batching is held
    to the checkpoint's mode."""
    switched = resolve(write_config(setup, name="first.py", batching=None)).with_batching("sorted-pad")
    checkpoint = complete_checkpoint(setup / "out" / "checkpoint-3", switched)
    resume = f", resume_from_checkpoint={str(checkpoint)!r}"
    assert resolve(write_config(setup, batching=None, targs_extra=resume)).resume_from_checkpoint == str(checkpoint)
    with pytest.raises(ConfigError, match="planning mode sorted-pad.* -> packed"):
        resolve(write_config(setup, batching="packed", targs_extra=resume, name="set.py"))


def test_resume_refuses_other_data_and_accepts_another_world_size_with_the_same_step(setup):
    checkpoint = _checkpoint_of(setup)
    resume = f", resume_from_checkpoint={str(checkpoint)!r}"
    # 4 workers x 2 samples x 2 = 16 samples per step, as the checkpoint's 2 x 4 x 2: the same steps.
    ok = resolve(write_config(setup, gpus=(0, 1, 2, 3), per_device=2, targs_extra=resume), world_size=4)
    assert check_resume(ok) is None
    make_dataset(setup / "data", fingerprint="rebuilt")
    with pytest.raises(ConfigError, match="dataset fingerprint"):
        resolve(write_config(setup, targs_extra=resume))


def test_resume_from_a_missing_folder(setup):
    with pytest.raises(ConfigError, match="is not a folder"):
        resolve(write_config(setup, targs_extra=f", resume_from_checkpoint={str(setup / 'nope')!r}"))


def test_every_setting_the_workers_act_on_is_a_typed_field(setup):
    extra = ", group_by_length=True, group_window_steps=8, nccl_timeout_s=60, profile=True, cuda_graphs=False"
    run = resolve(write_config(setup, extra=extra, targs_extra=", save_best_adapter=False"))
    assert (run.group_by_length, run.group_window_steps, run.nccl_timeout_s, run.profile, run.cuda_graphs) == (
        True, 8, 60, True, False)
    assert (run.gradient_checkpointing, run.eval_steps, run.early_stopping_patience, run.save_best_adapter) == (
        False, None, None, False)
    spec = plan_spec_for(run)
    assert (spec.group_by_length, spec.group_window_steps) == (True, 8)
    again = read_run(write_run(run, setup / "run.json"))  # validated once, typed on the way back
    assert again == run and again.hyper_config.training.nccl_timeout_s == 60
    assert again.resolved_config() == {"source_path": str(setup / "cfg.py"),
                                       "hyper_config": json.loads(run.hyper_config.model_dump_json()),
                                       "training_config": json.loads(run.training_config.model_dump_json())}


def test_train_reads_the_config_only_to_load_the_model_and_to_pass_trl_its_arguments():
    """What the workers act on is a field of the run (resolved once); in train/ the config dump serves only
    the model loader (fast_model_args, lora_args) and TRL's arguments (training_config)."""
    pattern = re.compile(r"hyper_config(?!\.(fast_model_args|lora_args)\b)|\.hyper\(\)|training_args\(\)")
    offenders = [f"{path.name}:{n}: {line.strip()}" for path in sorted((PACKAGE / "train").glob("*.py"))
                 for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []
    assert pattern.search('description.hyper_config["training"]') and pattern.search("run.hyper().training")
    assert not pattern.search("description.hyper_config.lora_args")


def test_rank_seeds_are_distinct_and_rank0_keeps_the_seed():
    seeds = [rank_seed(42, r) for r in range(8)]
    assert seeds[0] == 42 and len(set(seeds)) == 8
    assert seeds == [rank_seed(42, r) for r in range(8)]  # deterministic
    assert rank_seed(43, 1) != seeds[1]


def test_token_budget_auto_is_fixed_on_cpu_and_measured_on_gpus(setup):
    gpus = MachineFacts(cuda_device_count=2, unsloth_available=True, cpu_count=2)
    cpu_auto, gpu_auto = resolve(write_config(setup)), resolve(write_config(setup), machine=gpus)
    assert (cpu_auto.token_budget, cpu_auto.token_budget_source) == (4 * 512, "auto-cpu")  # per_device x max_seq
    assert (gpu_auto.token_budget, gpu_auto.token_budget_source) == (4 * 512, "auto")  # a stand-in until measured
    assert (cpu_auto.token_budget_auto, gpu_auto.token_budget_auto) == (False, True)
    assert "automatic budget" in gpu_auto.batch_line()
    explicit = resolve(write_config(setup, extra=", tokens_per_micro_batch=1000"), machine=gpus)
    assert (explicit.token_budget, explicit.token_budget_source, explicit.token_budget_auto) == (1000, "explicit", False)
    with pytest.raises(ConfigError, match="tokens_per_micro_batch"):
        resolve(write_config(setup, extra=", tokens_per_micro_batch=0"))


def test_extra_args_typos_and_a_missing_report_to_package_are_refused_before_workers_start(setup, monkeypatch):
    from HyperSloth.plan import trl_args

    real_find_spec = trl_args.importlib.util.find_spec
    monkeypatch.setattr(trl_args.importlib.util, "find_spec",
                        lambda name: None if name == "wandb" else real_find_spec(name))
    config = write_config(setup, targs_extra=", report_to='wandb', extra_args={'gradient_checkpointin': True, "
                                             "'adam_beta2': 0.95, 'zzz_unknown': 1}")
    with pytest.raises(ConfigError) as info:
        resolve(config)
    message = str(info.value)
    assert ("extra_args: 'gradient_checkpointin' is not an argument of TRL's SFTConfig — did you mean "
            "'gradient_checkpointing'?") in message
    assert "'zzz_unknown' is not an argument" in message and "adam_beta2" not in message
    assert "report_to 'wandb' needs the 'wandb' package, which is not installed" in message
    assert message.count("\n  - ") == 3
    typo = write_config(setup, targs_extra=", report_to=['tensorbord']")
    with pytest.raises(ConfigError, match="report_to 'tensorbord' is not an integration — did you mean 'tensorboard'"):
        resolve(typo)


def test_the_extra_args_names_read_from_the_sources_are_sft_configs_fields():
    import dataclasses

    from trl import SFTConfig

    from HyperSloth.plan.trl_args import sft_config_fields

    assert sft_config_fields() == {f.name for f in dataclasses.fields(SFTConfig) if f.init}
