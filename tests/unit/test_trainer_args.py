"""trainer_args.sft_config_for: HF runs exactly one plan step per optimizer step, whatever SFTConfig defaults to."""

import dataclasses
import types

import torch
from trl import SFTConfig

from HyperSloth.config import TrainingArgsConfig
from HyperSloth.train import trainer_args
from HyperSloth.train.sft import trainer


@dataclasses.dataclass
class _UnslothLikeSFTConfig(SFTConfig):
    gradient_accumulation_steps: int = 2  # Unsloth's patched SFTConfig default (unsloth 2026.10.9, models/rl.py)


def test_one_plan_step_per_optimizer_step_even_where_the_default_is_two(monkeypatch, tmp_path):
    monkeypatch.setattr(trainer_args, "SFTConfig", _UnslothLikeSFTConfig)
    targs = TrainingArgsConfig(output_dir=str(tmp_path), gradient_accumulation_steps=4, report_to="none")
    args = trainer_args.sft_config_for(targs, torch.float32, rank=0)
    assert isinstance(args, _UnslothLikeSFTConfig)
    assert args.gradient_accumulation_steps == 1  # the step's 4 micro-batches run inside training_step


def test_collating_workers_default_to_one_on_gpus_and_none_on_cpu(monkeypatch, tmp_path):
    targs = TrainingArgsConfig(output_dir=str(tmp_path), report_to="none")
    assert targs.dataloader_num_workers is None and targs.optim == "adamw_torch_fused"
    assert trainer_args.sft_config_for(targs, torch.float32, rank=0).dataloader_num_workers == 0  # this CPU machine
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(trainer_args, "SFTConfig", lambda **kwargs: kwargs)  # SFTConfig itself would look for the GPU
    assert trainer_args.sft_config_for(targs, torch.bfloat16, rank=0)["dataloader_num_workers"] == 1
    explicit = targs.model_copy(update={"dataloader_num_workers": 3})
    assert trainer_args.sft_config_for(explicit, torch.bfloat16, rank=0)["dataloader_num_workers"] == 3


def test_mixed_precision_is_the_models_dtype_on_gpus_and_off_on_cpu(monkeypatch, tmp_path):
    targs = TrainingArgsConfig(output_dir=str(tmp_path), report_to="none")
    cpu = trainer_args.sft_config_for(targs, torch.float32, rank=0)
    assert not cpu.bf16 and not cpu.fp16
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(trainer_args, "SFTConfig", lambda **kwargs: kwargs)
    flags = {dtype: (kw["bf16"], kw["fp16"]) for dtype in (torch.bfloat16, torch.float16, torch.float32)
             for kw in [trainer_args.sft_config_for(targs, dtype, rank=0)]}
    assert flags == {torch.bfloat16: (True, False), torch.float16: (False, True), torch.float32: (False, False)}


def test_micro_batch_forwards_run_under_trainings_autocast_also_before_accelerate_wraps_the_model(monkeypatch):
    # the graphs captured ahead of train() (capture_planned_graphs) run their forwards through HF's context hook
    monkeypatch.setattr(trainer, "training_autocast", lambda m: torch.autocast("cpu", dtype=torch.bfloat16))
    fake = types.SimpleNamespace(model=torch.nn.Linear(2, 2))
    fake.autocast_smart_context_manager = types.MethodType(trainer.HyperSlothTrainer.autocast_smart_context_manager,
                                                           fake)
    with trainer.HyperSlothTrainer.compute_loss_context_manager(fake):
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")


def test_garbage_collection_runs_at_fixed_steps_only(monkeypatch):
    import gc

    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(a) or 0)
    state = dataclasses.make_dataclass("State", ["global_step"])(0)
    callback = trainer.StepGarbageCollection(every=3)
    assert gc.isenabled()
    callback.on_train_begin(None, state, None)
    try:
        assert not gc.isenabled() and gc.get_freeze_count() > 0  # what existed before training is frozen
        collected.clear()
        for step in range(1, 8):
            state.global_step = step
            callback.on_step_end(None, state, None)
        assert len(collected) == 2  # steps 3 and 6, the same steps on every rank
    finally:
        callback.on_train_end(None, state, None)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_flop_estimate_is_hfs_with_the_parameter_count_taken_once():
    class CountingModel:
        main_input_name = "input_ids"
        calls = 0

        def num_parameters(self, exclude_embeddings=False):
            assert exclude_embeddings
            CountingModel.calls += 1
            return 1000

    hs = object.__new__(trainer.HyperSlothTrainer)  # the method needs only the model and its cache
    hs.model, hs._flop_parameters = CountingModel(), None
    item = {"micro_batches": [{"input_ids": torch.zeros(1, 7)}, {"input_ids": torch.zeros(1, 5)}]}
    hf = sum(trainer.SFTTrainer.floating_point_ops(hs, mb) for mb in item["micro_batches"])  # HF's own
    calls_by_hf = CountingModel.calls
    assert [hs.floating_point_ops(item) for _ in range(3)] == [hf] * 3 == [6 * 1000 * 12] * 3
    assert CountingModel.calls - calls_by_hf == 1


def test_checkpointing_is_the_loaders_not_trls_default(tmp_path):
    """TRL's SFTConfig defaults gradient_checkpointing to True, which made HF checkpoint every layer of a
    transformers-backend model configured without it (the loader applies use_gradient_checkpointing)."""
    targs = TrainingArgsConfig(output_dir=str(tmp_path), report_to="none")
    assert SFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).gradient_checkpointing is True  # the cause
    assert trainer_args.sft_config_for(targs, torch.float32, rank=0).gradient_checkpointing is False
    # Unsloth's trainer restores the mode the model was loaded with: its arguments stay TRL's.
    assert trainer_args.sft_config_for(targs, torch.float32, rank=0, backend="unsloth").gradient_checkpointing is True
    forced = targs.model_copy(update={"extra_args": {"gradient_checkpointing": True}})
    assert trainer_args.sft_config_for(forced, torch.float32, rank=0).gradient_checkpointing is True


def test_step_history_is_kept_in_the_checkpoint_state_and_read_back_on_resume():
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    from HyperSloth.train.sft.trainer import StepHistory

    def trainer(losses, rewards):
        return SimpleNamespace(step_series_this_run=lambda: {"losses": losses, "rewards": rewards})

    first = StepHistory(trainer([3.0, 2.5, 2.25], [[0.1], [0.2], [0.3]]))
    state = TrainerState(stateful_callbacks=[first])  # what HF writes into checkpoint-3's trainer_state.json
    assert state.stateful_callbacks["StepHistory"]["attributes"]["series"]["losses"] == [3.0, 2.5, 2.25]
    state.global_step = 3
    resumed = StepHistory(trainer([2.0], [[0.4]]))
    resumed.on_train_begin(None, state, TrainerControl())
    assert resumed.earlier == {"losses": [3.0, 2.5, 2.25], "rewards": [[0.1], [0.2], [0.3]]}
    series = resumed.state()["attributes"]["series"]  # saved again at the next checkpoint
    assert series == {"losses": [3.0, 2.5, 2.25, 2.0], "rewards": [[0.1], [0.2], [0.3], [0.4]]}
    older = StepHistory(trainer([], []))
    older.on_train_begin(None, TrainerState(global_step=3), TrainerControl())  # an older checkpoint: no record
    assert older.earlier == {}


def test_trl_never_adds_the_moe_router_loss(tmp_path):
    """TRL 1.15 turns an MoE model's load-balancing loss on with the architecture's coefficient unless told 0."""
    args = trainer_args.sft_config_for(TrainingArgsConfig(output_dir=str(tmp_path)), torch.float32, rank=0)
    assert args.router_aux_loss_coef == 0.0


def test_the_graph_pool_is_the_token_budget_less_the_longest_planned_row_which_runs_eagerly_beside_it(monkeypatch):
    # long-0.6b's shape: a 114,176-token budget, steps of ~40-60k tokens: the longest planned row shrinks the graphs'
    # reach below half the budget, and the rows past it run eagerly (capping rows at the reach was measured twice on
    # an H100, 2026-12-05, and did not pay: docs/benchmarks.md)
    import numpy as np

    from HyperSloth.plan.batching import PlanSpec, adaptive_partition_batches
    from HyperSloth.train.step_graph import graph_rows_limit

    monkeypatch.setattr(trainer_args, "run_graph_refusal", lambda *args: None)
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(7.5, 0.8, size=256), 64, 6_900).astype(np.int64)
    budget = 114_176
    decoder = torch.nn.Linear(2, 2)
    loaded = types.SimpleNamespace(backend="unsloth", model=types.SimpleNamespace(
        config=None, parameters=decoder.parameters, get_base_model=lambda: types.SimpleNamespace(model=decoder)))
    monkeypatch.setattr(trainer_args, "trainable_parameters", lambda model: list(decoder.parameters()))
    plan = adaptive_partition_batches(lengths, lengths - 1, PlanSpec(
        num_ranks=1, samples_per_step=32, mode="packed", token_budget=budget, seed=0))
    steps = types.SimpleNamespace(plan=lambda epoch: plan, steps_per_epoch=len(plan.steps))
    description = types.SimpleNamespace(token_budget=budget, training_config=types.SimpleNamespace(
        max_steps=len(plan.steps), num_train_epochs=1))
    made = trainer_args.decoder_graphs(description, loaded, steps, lengths, rank=0)
    counts, longest = trainer_args.planned_rows(steps, lengths, 0, len(plan.steps), budget)
    reach = made["graphs"].layout.max_rows
    assert reach == graph_rows_limit(budget, longest) < budget // 2
    assert sum(n for r, n in counts.items() if r > reach) > 0  # the longest rows run eagerly
