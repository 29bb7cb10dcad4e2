"""evaluation.py: the eval plan, the exact token-mean loss over ranks, the best adapter and early stopping."""

import json
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from datasets import Dataset
from transformers import Qwen3Config, Qwen3ForCausalLM, TrainerControl, TrainerState

from HyperSloth.outputs.run_files import BEST_ADAPTER_DIR, BEST_EVAL_FILE
from HyperSloth.plan.batching import PlanSpec
from HyperSloth.plan.eval_set import eval_plan_spec, plan_eval
from HyperSloth.train import dist
from HyperSloth.train.collate import IGNORE_INDEX
from HyperSloth.train.evaluation import (
    BestAdapterCallback,
    EarlyStopping,
    Evaluator,
    best_eval,
    eval_history,
    eval_sft_kwargs,
)

VOCAB = 97


def _rows(n: int = 37, seed: int = 0) -> Dataset:
    """Chat-like rows: a prompt part (-100) then a reply part, lengths 4..60."""
    rng = np.random.default_rng(seed)
    cols = {"input_ids": [], "labels": [], "length": [], "num_trainable": []}
    for _ in range(n):
        ids = rng.integers(3, VOCAB, size=int(rng.integers(4, 61)))
        labels = ids.copy()
        labels[: len(ids) // 3 + 1] = IGNORE_INDEX
        cols["input_ids"].append(ids.tolist())
        cols["labels"].append(labels.tolist())
        cols["length"].append(len(ids))
        cols["num_trainable"].append(int((labels[1:] != IGNORE_INDEX).sum()))
    return Dataset.from_dict(cols)


def _inputs(dataset: Dataset, loss_type: str) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.asarray(dataset["length"])
    trainable = lengths - 1 if loss_type == "all" else np.asarray(dataset["num_trainable"])
    return lengths, trainable


def _spec(ranks: int, mode: str = "packed") -> PlanSpec:
    # A small budget, so every rank runs several micro-batches.
    return PlanSpec(num_ranks=ranks, samples_per_step=8 * ranks, mode=mode, micro_batch_size=3, token_budget=90, seed=5)


def _evaluators(dataset, ranks: int, mode: str, loss_type: str) -> list[Evaluator]:
    plan = plan_eval(*_inputs(dataset, loss_type), _spec(ranks, mode))
    return [Evaluator(dataset, plan, rank=r, loss_type=loss_type, pad_token_id=0) for r in range(ranks)]


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         tie_word_embeddings=True)
    return Qwen3ForCausalLM(config).eval()


def _model_loss_sum(model):
    def loss_sum(micro_batch):
        with torch.no_grad():
            return model(**micro_batch, num_items_in_batch=1, use_cache=False).loss
    return loss_sum


def _reference(model, dataset, loss_type: str) -> tuple[float, int]:
    """Token-mean cross-entropy, one unpadded row at a time, written out independently of HyperSloth."""
    total, count = 0.0, 0
    for row in dataset:
        ids = torch.tensor(row["input_ids"])[None]
        labels = ids.clone() if loss_type == "all" else torch.tensor(row["labels"])[None]
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        targets = labels[0, 1:]
        keep = targets != IGNORE_INDEX
        total += float(F.cross_entropy(logits[0, :-1][keep], targets[keep], reduction="sum"))
        count += int(keep.sum())
    return total / count, count


@pytest.mark.parametrize("mode", ["packed", "sorted-pad"])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_eval_plan_holds_every_row_once_with_equal_micro_batch_counts(mode, ranks):
    dataset = _rows(37)
    plan = plan_eval(*_inputs(dataset, "response_only"), _spec(ranks, mode))
    seen = [i for step in plan.steps for mbs in step.ranks for mb in mbs for i in mb]
    assert sorted(seen) == list(range(37))
    for step in plan.steps:
        assert len({len(mbs) for mbs in step.ranks}) == 1  # no rank can wait for another
    assert plan.spec.mode == mode and plan.spec.token_budget == 90 and plan.spec.micro_batch_size == 3
    if mode == "packed":
        lengths = np.asarray(dataset["length"])
        assert max(int(lengths[list(mb)].sum()) for st in plan.steps for mbs in st.ranks for mb in mbs if mb) <= 90


def test_eval_spec_uses_large_steps_and_no_length_grouping():
    train = PlanSpec(num_ranks=2, samples_per_step=16, token_budget=4096, group_by_length=True)
    spec = eval_plan_spec(train, 10_000)
    assert spec.samples_per_step == 512 and not spec.group_by_length and spec.token_budget == 4096
    assert eval_plan_spec(train, 40).samples_per_step == 40


@pytest.mark.parametrize("loss_type", ["all", "response_only"])
@pytest.mark.parametrize("mode", ["packed", "sorted-pad"])
def test_rank_sums_add_up_exactly_to_the_one_rank_sums(mode, loss_type):
    """With a loss that is a known function of each target token, the split over ranks loses nothing."""
    dataset = _rows(37)

    def fake_loss_sum(micro_batch):  # "loss" of a target = its token id, summed like the model's loss
        targets = micro_batch["labels"][..., 1:]
        return targets.where(targets != IGNORE_INDEX, 0).sum().double()

    expected_tokens = int(_inputs(dataset, loss_type)[1].sum())
    for ranks in (1, 2, 3):
        sums = sum(ev.local_sums(fake_loss_sum, "cpu") for ev in _evaluators(dataset, ranks, mode, loss_type))
        assert sums[1] == expected_tokens
        rows = [np.asarray(r["input_ids"] if loss_type == "all" else r["labels"])[1:] for r in dataset]
        assert sums[0] == sum(int(r[r != IGNORE_INDEX].sum()) for r in rows)


@pytest.mark.parametrize("loss_type", ["all", "response_only"])
@pytest.mark.parametrize("mode", ["packed", "sorted-pad"])
def test_eval_loss_is_the_token_mean_cross_entropy_on_any_rank_count(tiny_model, mode, loss_type):
    dataset = _rows(37)
    reference, count = _reference(tiny_model, dataset, loss_type)
    loss_sum = _model_loss_sum(tiny_model)
    one = _evaluators(dataset, 1, mode, loss_type)[0].run(loss_sum, "cpu")
    assert one.tokens == count and abs(one.loss - reference) / reference <= 1e-6
    two = sum(ev.local_sums(loss_sum, "cpu") for ev in _evaluators(dataset, 2, mode, loss_type))
    assert int(two[1]) == count and abs(float(two[0] / two[1]) - one.loss) / one.loss <= 1e-6


def test_response_only_scores_only_assistant_tokens(tiny_model):
    dataset = _rows(37)
    only = _evaluators(dataset, 1, "packed", "response_only")[0].run(_model_loss_sum(tiny_model), "cpu")
    every = _evaluators(dataset, 1, "packed", "all")[0].run(_model_loss_sum(tiny_model), "cpu")
    assert only.tokens == sum(dataset["num_trainable"]) < every.tokens == sum(dataset["length"]) - len(dataset)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank: int, port: int, queue) -> None:
    torch.set_num_threads(1)
    # "torchrun": rank 0 hosts the rendezvous itself (tcp:// init), no launcher-held store needed.
    info = dist.DistInfo(rank=rank, world_size=2, master_port=port, launched_by="torchrun")
    dist.setup(info, backend="gloo", timeout_s=60)
    try:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             head_dim=8, max_position_embeddings=256)).eval()
        evaluator = _evaluators(_rows(37), 2, "packed", "response_only")[rank]
        result = evaluator.run(_model_loss_sum(model), "cpu")
        queue.put((rank, result.loss, result.tokens, sum(1 for _ in evaluator.micro_batches())))
    finally:
        dist.teardown()


# slow tier (make test-slow; CI runs it): two spawned processes importing torch, ~20 s
@pytest.mark.slow
def test_two_processes_get_the_same_loss_as_one(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_gloo_worker, args=(_free_port(), queue), nprocs=2, start_method="spawn")
    results = sorted(queue.get(timeout=60) for _ in range(2))
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         max_position_embeddings=256)).eval()
    reference, count = _reference(model, _rows(37), "response_only")
    (_, loss0, tokens0, mbs0), (_, loss1, tokens1, mbs1) = results
    assert loss0 == loss1 and tokens0 == tokens1 == count  # identical on every rank
    assert abs(loss0 - reference) / reference <= 1e-6
    assert mbs0 > 0 and mbs1 > 0


@pytest.fixture
def peft_model(tiny_model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    base = Qwen3ForCausalLM(tiny_model.config)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))


def _evaluate(callbacks, state, losses, control=None):
    """Feed eval losses through the callbacks in HF's order: on_evaluate, then best_metric is updated."""
    control = control or TrainerControl()
    for step, loss in losses:
        state.global_step = step
        for callback in callbacks:
            control = callback.on_evaluate(_Args(), state, control, metrics={"eval_loss": loss, "eval_tokens": 50},
                                           model=callbacks[0].model if hasattr(callbacks[0], "model") else None) or control
        if state.best_metric is None or loss < state.best_metric:  # evaluate_in_trainer, after the callbacks
            state.best_metric = loss
        if control.should_training_stop:
            return control, step
    return control, None


class _Args:
    metric_for_best_model, greater_is_better, eval_strategy = None, None, "steps"  # as eval_sft_kwargs leaves them


def test_best_adapter_is_the_lowest_eval_loss_and_loads_with_peft(peft_model, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file

    callback = BestAdapterCallback(tmp_path)
    state = TrainerState()
    saved = {}
    for step, loss in [(2, 3.0), (4, 2.5), (6, 2.7), (8, 2.5)]:
        with torch.no_grad():
            next(p for n, p in peft_model.named_parameters() if "lora_B" in n).fill_(step)  # weights of this step
        state.global_step = step
        callback.on_evaluate(_Args(), state, TrainerControl(), metrics={"eval_loss": loss, "eval_tokens": 50},
                             model=peft_model)
        state.best_metric = min(loss, state.best_metric or float("inf"))
        saved[step] = json.loads((tmp_path / BEST_ADAPTER_DIR / BEST_EVAL_FILE).read_text())["step"]
    assert saved == {2: 2, 4: 4, 6: 4, 8: 4}  # a tie is not an improvement
    record = json.loads((tmp_path / BEST_ADAPTER_DIR / BEST_EVAL_FILE).read_text())
    assert record == {"step": 4, "eval_loss": 2.5, "eval_tokens": 50}
    weights = load_file(str(tmp_path / BEST_ADAPTER_DIR / "adapter_model.safetensors"))
    assert any(torch.all(w == 4) for n, w in weights.items() if "lora_B" in n)
    loaded = PeftModel.from_pretrained(Qwen3ForCausalLM(peft_model.base_model.model.config), str(tmp_path / BEST_ADAPTER_DIR))
    assert any(torch.all(p == 4) for n, p in loaded.named_parameters() if "lora_B" in n)
    assert sorted(p.name for p in tmp_path.iterdir()) == [BEST_ADAPTER_DIR]  # no staging folder left


@pytest.mark.parametrize(("patience", "stop_step"), [(1, 6), (2, 8), (3, None)])
def test_early_stopping_stops_after_patience_evaluations_without_improvement(patience, stop_step):
    losses = [(2, 3.0), (4, 2.5), (6, 2.6), (8, 2.5), (10, 2.4), (12, 2.45)]
    control, stopped = _evaluate([EarlyStopping(patience)], TrainerState(), losses)
    assert stopped == stop_step and control.should_training_stop == (stop_step is not None)


def test_early_stopping_without_an_eval_set_is_refused():
    class NoEval(_Args):
        eval_strategy = "no"

    with pytest.raises(ValueError, match="data.eval_fraction or data.eval_dataset_name"):
        EarlyStopping(2).on_train_begin(NoEval(), TrainerState(), TrainerControl())


def test_eval_history_and_best():
    log = [{"loss": 3.0, "step": 1}, {"eval_loss": 2.0, "eval_tokens": 9, "eval_runtime": 0.1, "step": 2},
           {"eval_loss": 1.5, "eval_tokens": 9, "step": 4}, {"eval_loss": 1.5, "eval_tokens": 9, "step": 6}]
    history = eval_history(log)
    assert history == [{"step": 2, "eval_loss": 2.0, "eval_tokens": 9}, {"step": 4, "eval_loss": 1.5, "eval_tokens": 9},
                       {"step": 6, "eval_loss": 1.5, "eval_tokens": 9}]
    assert best_eval(history) == {"step": 4, "eval_loss": 1.5, "eval_tokens": 9} and best_eval([]) is None


@pytest.mark.parametrize(("eval_steps", "expected"), [(5, 5), (None, 2**31 - 1)])
def test_sft_arguments_evaluate_every_n_steps_and_track_the_lowest_loss(tmp_path, eval_steps, expected):
    from trl import SFTConfig

    args = SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **eval_sft_kwargs(eval_steps))
    assert args.eval_strategy == "steps" and args.eval_steps == expected
    # No HF "best checkpoint" bookkeeping: it would change which checkpoints save_total_limit keeps.
    assert args.metric_for_best_model is None and not args.load_best_model_at_end


def test_eval_summary_holds_the_issue_format_seconds_and_best():
    from HyperSloth.train.evaluation import eval_summary

    log = [{"loss": 3.0, "step": 1}, {"eval_loss": 2.0, "eval_tokens": 9, "eval_runtime": 0.25, "step": 2},
           {"eval_loss": 1.5, "eval_tokens": 9, "eval_runtime": 0.5, "step": 4}]
    summary = eval_summary(log, None)
    assert summary == {"eval": [{"step": 2, "eval_loss": 2.0, "eval_tokens": 9}, {"step": 4, "eval_loss": 1.5, "eval_tokens": 9}],
                       "eval_seconds": [0.25, 0.5], "best_eval": {"step": 4, "eval_loss": 1.5, "eval_tokens": 9},
                       "eval_set": None}


def test_bucketed_packed_rows_give_the_same_loss(tiny_model):
    dataset = _rows(37)
    plan = plan_eval(*_inputs(dataset, "response_only"), _spec(1))
    plain = Evaluator(dataset, plan, rank=0, loss_type="response_only", pad_token_id=0)
    bucketed = Evaluator(dataset, plan, rank=0, loss_type="response_only", pad_token_id=0, bucket=True)
    assert any(a["input_ids"].shape != b["input_ids"].shape for a, b in zip(plain.micro_batches(), bucketed.micro_batches()))
    a, b = (ev.run(_model_loss_sum(tiny_model), "cpu") for ev in (plain, bucketed))
    assert a.tokens == b.tokens and abs(a.loss - b.loss) / a.loss <= 1e-6


class _FakeTrainer:
    """What evaluate_in_trainer uses of HF's Trainer: model, args.device, state, control, log, callbacks."""

    def __init__(self, model):
        from contextlib import nullcontext
        from types import SimpleNamespace

        self.model, self.args = model, SimpleNamespace(device="cpu")
        self.state, self.control, self.logged, self.seen = TrainerState(), TrainerControl(), [], []
        self.prepared, self.lengths_seen = [], []
        self.callback_handler = SimpleNamespace(on_evaluate=self._on_evaluate)
        self.compute_loss_context_manager = nullcontext

    def _on_evaluate(self, args, state, control, metrics):
        self.seen.append((state.best_metric, dict(metrics)))
        return control

    def _prepare_inputs(self, batch):
        self.prepared.append(set(batch))  # what HF's Trainer would move to the device
        return dict(batch)

    def micro_batch_terms(self, model, batch, denominator):
        assert denominator == 1 and not torch.is_grad_enabled() and not model.training
        self.lengths_seen.append(batch.pop("packed_seq_lengths", None))
        return model(**batch, num_items_in_batch=denominator, use_cache=False).loss, None

    def log(self, logs):
        self.logged.append(logs)


def test_evaluate_in_trainer_logs_calls_back_and_counts_an_evaluation_before_training(tiny_model):
    from HyperSloth.train.evaluation import evaluate_in_trainer

    tiny_model.train()
    trainer = _FakeTrainer(tiny_model)
    evaluator = _evaluators(_rows(37), 1, "packed", "response_only")[0]
    metrics = evaluate_in_trainer(trainer, evaluator)
    assert tiny_model.training  # restored
    assert set(metrics) == {"eval_loss", "eval_tokens", "eval_runtime"} and trainer.logged == [metrics]
    assert trainer.seen == [(None, metrics)]  # callbacks see the best of the earlier evaluations
    assert trainer.state.best_metric == metrics["eval_loss"]  # then it is updated (checkpointed with the state)
    trainer.state.global_step, trainer.state.best_metric = 2, 9.0
    evaluate_in_trainer(trainer, evaluator)
    assert trainer.seen[-1][0] == 9.0 and trainer.state.best_metric == metrics["eval_loss"]
    trainer.state.best_metric = 1.0
    evaluate_in_trainer(trainer, evaluator)
    assert trainer.state.best_metric == 1.0  # not an improvement: kept
    tiny_model.eval()


def test_evaluation_keeps_packed_lengths_on_the_host_as_training_does(tiny_model):
    from HyperSloth.train.evaluation import evaluate_in_trainer

    trainer = _FakeTrainer(tiny_model)
    dataset = _rows(37)
    plan = plan_eval(*_inputs(dataset, "response_only"), _spec(1))
    evaluator = Evaluator(dataset, plan, rank=0, loss_type="response_only", pad_token_id=0, packed_lengths=True)
    with_lengths = evaluate_in_trainer(trainer, evaluator)
    plain = Evaluator(dataset, plan, rank=0, loss_type="response_only", pad_token_id=0)
    assert evaluate_in_trainer(_FakeTrainer(tiny_model), plain)["eval_loss"] == with_lengths["eval_loss"]
    # Never given to _prepare_inputs (to the GPU: a sync per micro-batch), yet passed to the model's forward.
    assert trainer.prepared and all("packed_seq_lengths" not in keys for keys in trainer.prepared)
    assert len(trainer.lengths_seen) == len(trainer.prepared)
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.int32 for t in trainer.lengths_seen)


def test_a_resumed_run_continues_the_early_stopping_count():
    from HyperSloth.train.evaluation import evaluations_without_improvement

    assert [evaluations_without_improvement(x) for x in ([], [3.0], [3, 2, 2.5], [3, 2, 2.5, 2.0], [3, 2, 1])] == [0, 0, 1, 2, 0]
    state = TrainerState()
    # The checkpoint's history, then this process's first evaluation (logged before the callbacks run).
    state.log_history = [{"loss": 3.0, "step": 1}, {"eval_loss": 2.0, "step": 2}, {"eval_loss": 2.2, "step": 4},
                         {"eval_loss": 2.1, "step": 6}]
    state.best_metric = 2.0
    stopper = EarlyStopping(2)
    stopper.on_train_begin(_Args(), state, TrainerControl())
    control = stopper.on_evaluate(_Args(), state, TrainerControl(), metrics={"eval_loss": 2.1})
    assert control.should_training_stop  # the second evaluation without improvement, across the resume
    fresh = EarlyStopping(2)
    assert not fresh.on_evaluate(_Args(), state, TrainerControl(), metrics={"eval_loss": 1.9}).should_training_stop
