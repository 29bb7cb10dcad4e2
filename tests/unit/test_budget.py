"""The automatic micro-batch budget (budget.py, budget_choice.py, budget_probe.py), with fake memory measurements
(no GPU needed)."""

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

from HyperSloth.launch.rendezvous import host_store
from HyperSloth.plan.run import RunDescription
from HyperSloth.train import dist
from HyperSloth.train.budget import settle as budget
from HyperSloth.train.budget import choice as budget_choice
from HyperSloth.train.budget import probe as budget_probe

GIB = 2**30


def test_fit_memory_recovers_the_line_and_refuses_bad_probes():
    fit = budget_choice.fit_memory([(2048, 10 * GIB + 2048 * 4096), (8192, 10 * GIB + 8192 * 4096)])
    assert fit.base_bytes == pytest.approx(10 * GIB)
    assert fit.per_token_bytes == pytest.approx(4096)
    assert fit.max_tokens(10 * GIB + 4096 * 1000) == 1000
    assert fit.max_tokens(GIB) == 0
    with pytest.raises(ValueError, match="two sizes"):
        budget_choice.fit_memory([(2048, GIB), (2048, 2 * GIB)])
    with pytest.raises(ValueError, match="do not grow"):
        budget_choice.fit_memory([(2048, 2 * GIB), (8192, GIB)])


def test_allocation_limit_subtracts_safety_outside_memory_and_optimizer():
    # 100 GiB GPU, 60 free, torch holds 30: 10 GiB belong to others (context, NCCL, other processes).
    limit = budget_choice.allocation_limit(100 * GIB, 60 * GIB, 30 * GIB, optimizer_bytes=GIB, safety_fraction=0.1)
    assert limit == 100 * GIB - 10 * GIB - 10 * GIB - GIB


def test_choose_tokens_rounds_down_caps_and_has_a_floor():
    fit = budget_choice.MemoryFit(base_bytes=GIB, per_token_bytes=1000)
    assert budget_choice.choose_tokens(fit, GIB + 1000 * 5000, cap=10**6) == 4864  # 5000 rounded down to 256s
    assert budget_choice.choose_tokens(fit, GIB + 1000 * 5000, cap=1000) == 1024  # cap rounded up to 256s
    assert budget_choice.choose_tokens(fit, GIB // 2, cap=10**6) == budget_choice.MIN_BUDGET


def test_useful_cap_is_the_longest_samples_of_one_step():
    assert budget_choice.useful_cap([5, 100, 7, 50, 1], samples_per_step=2) == 150
    assert budget_choice.useful_cap([5, 100], samples_per_step=8) == 105


def test_measure_with_a_linear_fake_picks_the_largest_fitting_budget():
    calls = []

    def peak(tokens):
        calls.append(tokens)
        return 4 * GIB + 2**20 * tokens  # 1 MiB per token

    out = budget_choice.measure(peak, limit_bytes=4 * GIB + 2**20 * 30000, cap=10**6)
    assert out["tokens"] == 29952  # 30000 rounded down to a multiple of 256
    assert calls == [2048, 8192, 29952]  # two probes, then the verification at the chosen size
    assert out["verified_peak_bytes"] <= 4 * GIB + 2**20 * 30000
    assert out["fit"].per_token_bytes == pytest.approx(2**20)


def test_measure_shrinks_when_the_real_peak_grows_faster_than_the_fit():
    def peak(tokens):  # superlinear beyond the probes: the line under-predicts large sizes
        return GIB + 2**20 * tokens + (2**20 * (tokens - 8192) ** 2 // 20000 if tokens > 8192 else 0)

    limit = GIB + 2**20 * 40000
    out = budget_choice.measure(peak, limit_bytes=limit, cap=10**6)
    assert peak(out["tokens"]) <= limit
    assert out["verified_peak_bytes"] == peak(out["tokens"])
    assert out["tokens"] % budget_choice.ROUND_TO == 0 and out["tokens"] < 40000


class FakeOOM(RuntimeError):
    pass


def test_measure_halves_on_out_of_memory_and_reraises_other_errors():
    def peak(tokens):
        if tokens > 20000:
            raise FakeOOM("out of memory")
        return GIB + 1000 * tokens

    out = budget_choice.measure(peak, limit_bytes=GIB + 1000 * 50000, cap=10**6,
                                is_oom=lambda e: isinstance(e, FakeOOM))
    assert out["tokens"] <= 20000 and out["verified_peak_bytes"] == GIB + 1000 * out["tokens"]
    with pytest.raises(FakeOOM):
        budget_choice.measure(peak, limit_bytes=GIB + 1000 * 50000, cap=10**6)  # not recognised as OOM: raised


def test_measure_with_a_small_cap_probes_within_it():
    seen = []
    out = budget_choice.measure(lambda t: seen.append(t) or GIB + t, limit_bytes=2 * GIB, cap=1000)
    assert seen[:2] == [256, 1000] and out["tokens"] == 1024


def test_needs_checkpointing_when_the_longest_sample_exceeds_the_budget():
    assert budget_choice.longest_does_not_fit(budget_tokens=30000, longest_sample=65536)
    assert not budget_choice.longest_does_not_fit(budget_tokens=30000, longest_sample=30000)


def test_probe_batch_is_a_packed_row_of_the_requested_tokens():
    batch = budget_probe.probe_batch(1000, longest=[300, 300, 300, 300], vocab_size=50)
    assert batch["input_ids"].shape == (1, 1000)
    assert batch["packed_seq_lengths"].tolist() == [300, 300, 300, 100]
    assert batch["position_ids"][0, 300].item() == 0 and batch["position_ids"][0, 299].item() == 299
    assert int(batch["input_ids"].max()) < 50


def test_probe_rows_are_the_longest_samples_longest_first():
    """The heaviest micro-batch the plan can form: no probe pass costs more than a real one (a row of
    131k + 52k, as the old probe built for a 183k budget, cost more attention than any real step)."""
    assert budget_probe.probe_segments([131072, 4096, 700], 2048) == [2048]
    assert budget_probe.probe_segments([131072, 4096, 700], 140000) == [131072, 4096, 700, 4132]  # repeats when short
    assert budget_probe.probe_segments([500, 300], 800) == [500, 300]
    with pytest.raises(ValueError, match="lengths >= 1"):
        budget_probe.probe_segments([], 10)


def test_probe_forward_backward_leaves_the_model_unchanged():
    torch.manual_seed(0)
    model = _TinyLM()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = budget_probe.probe_batch(64, longest=[16], vocab_size=11)
    batch.pop("packed_seq_lengths")
    budget_probe.forward_backward(model, batch, 64)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    budget_probe.release_memory(model)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_probe_forwards_under_trainings_autocast_and_backwards_outside_it(monkeypatch):
    from HyperSloth.train import model as model_lib

    monkeypatch.setattr(model_lib, "training_autocast", lambda m: torch.autocast("cpu", dtype=torch.bfloat16))
    model, seen = _TinyLM(), []
    model.register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    model.head.register_full_backward_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    batch = budget_probe.probe_batch(64, longest=[16], vocab_size=11)
    batch.pop("packed_seq_lengths")
    budget_probe.forward_backward(model, batch, 64)
    assert seen == [True, False]  # as HF's training_step: the forward inside accelerate's autocast, backward out
    assert model.head.weight.grad.dtype == torch.float32


class _TinyLM(torch.nn.Module):
    """Embedding + linear head with HF's output shape (`.loss`), enough to run a probe on CPU."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)

    def forward(self, input_ids, labels, position_ids, num_items_in_batch, use_cache):
        logits = self.head(self.emb(input_ids))[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 11), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100, reduction="sum") / num_items_in_batch
        return type("Out", (), {"loss": loss})()


def _agree_worker(rank: int, port: int, values: list[int], queue) -> None:
    info = dist.DistInfo(rank=rank, world_size=2, master_port=port, launched_by="hypersloth")
    dist.setup(info, backend="gloo", timeout_s=60)
    try:
        queue.put((rank, budget_probe.agree_min(values[rank])))
    finally:
        dist.teardown()


# slow tier (make test-slow; CI runs it): spawned gloo processes, ~9 s
@pytest.mark.slow
def test_agree_min_gives_every_rank_the_smallest_measurement():
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    values = [48128, 31744]
    store = host_store()  # as the launcher does: held here, both ranks join as clients
    port = store.port
    procs = [ctx.Process(target=_agree_worker, args=(r, port, values, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert results == {0: 31744, 1: 31744}
    assert budget_probe.agree_min(7) == 7  # no process group: the value itself


def test_decision_summary_names_value_and_inputs():
    d = budget_choice.BudgetDecision(tokens=30720, source="auto", local_tokens=31744, points=[(2048, 10 * GIB)],
                                     fit={"base_bytes": 6 * GIB, "per_token_bytes": 4 * 2**20}, limit_bytes=120 * GIB,
                                     total_bytes=140 * GIB, safety_fraction=0.08, optimizer_bytes=GIB, cap_tokens=10**5,
                                     verified_peak_bytes=118 * GIB, longest_sample=4096, gradient_checkpointing=False,
                                     probe_seconds=3.0)
    line = d.summary()
    assert "auto -> 30,720" in line and "this rank 31,744" in line and "4.000 MiB x tokens" in line
    assert d.as_record()["points"] == [(2048, 10 * GIB)]
    assert np.isfinite(d.as_record()["fit"]["base_bytes"])


class _Description:
    """The few fields of a RunDescription that settle reads, with pydantic's model_copy(update=...)."""

    token_budget_auto = RunDescription.token_budget_auto  # the real property: source == "auto"

    def __init__(self, source: str, budget=4096, gc=False, batching="packed", micro_batch_size=4, tiled_mlp="auto"):
        self.token_budget, self.token_budget_source, self.global_batch_size = budget, source, 32
        self.gradient_checkpointing, self.batching, self.micro_batch_size = gc, batching, micro_batch_size
        self.tiled_mlp = tiled_mlp

    def model_copy(self, update):
        copy = _Description(self.token_budget_source)
        copy.__dict__.update({**self.__dict__, **update})
        return copy


def _fake_measure(budgets, heaviest=None, tile_auto=True):
    """measure_auto stand-in: the budget measured for each checkpointing mode (key (mode, "tiled") with
    Unsloth's tiled MLP)."""
    def measure_auto(model, *, lengths, samples_per_step, gradient_checkpointing, with_lengths, must_fit, can_switch,
                     setup, tiled_mlp):
        # A heaviest micro-batch that does not fit switches on the next memory saver while one is left
        # (checkpointing, then the tiled MLP); after the last it must be proven.
        assert must_fit == (heaviest or int(max(lengths)))
        assert can_switch == (not gradient_checkpointing or (tile_auto and not tiled_mlp))
        assert setup is None or setup.fast["tiled_mlp"] is tiled_mlp  # the probe cache tells the two apart
        key = (gradient_checkpointing, "tiled") if tiled_mlp else gradient_checkpointing
        return budget_choice.BudgetDecision(tokens=budgets[key], source="auto", longest_sample=int(max(lengths)),
                                            gradient_checkpointing=gradient_checkpointing, tiled_mlp=tiled_mlp,
                                            probe_seconds=2.0, probe_passes=3, cache="measured")
    return measure_auto


def _recorder(loads):
    """settle's `load`: records the checkpointing asked for, as (mode, "tiled") with the tiled MLP."""
    def load(gc, tiled_mlp=False):
        loads.append((gc, "tiled") if tiled_mlp else gc)
        return _Loaded()
    return load


class _Loaded:
    backend = "unsloth"
    model = None


def test_settle_keeps_explicit_and_cpu_budgets_without_measuring(monkeypatch):
    monkeypatch.setattr(budget, "measure_auto", lambda *a, **k: pytest.fail("nothing to measure"))
    loads = []
    for source in ("explicit", "auto-cpu"):
        d, loaded, decision = budget.settle(_Description(source, budget=2048), _recorder(loads), [10, 20])
        assert (d.token_budget, decision.tokens, decision.source) == (2048, 2048, source)
    assert loads == [None, None]


def test_settle_plans_with_the_measured_budget(monkeypatch):
    monkeypatch.setattr(budget, "measure_auto", _fake_measure({False: 30720, "unsloth": 300000}))
    loads = []
    d, _, decision = budget.settle(_Description("auto"), _recorder(loads), [100, 4096])
    assert (d.token_budget, decision.tokens, decision.checkpointing_switched_on) == (30720, 30720, False)
    assert loads == [None] and d.gradient_checkpointing is False


def test_settle_turns_checkpointing_on_when_the_longest_sample_does_not_fit(monkeypatch):
    monkeypatch.setattr(budget, "measure_auto", _fake_measure({False: 30720, "unsloth": 300000}))
    loads = []
    d, _, decision = budget.settle(_Description("auto"), _recorder(loads), [100, 65536])
    assert loads == [None, "unsloth"]  # loaded again, with Unsloth's checkpointing
    assert (d.token_budget, decision.checkpointing_switched_on, decision.gradient_checkpointing) == (300000, True, "unsloth")
    assert d.gradient_checkpointing == "unsloth"
    assert (decision.probe_seconds, decision.probe_passes) == (4.0, 6)  # both probes counted
    assert decision.reload_seconds is not None and "6 forward+backward pass(es), 4.0 s" in decision.probe_line()


def test_sorted_pad_auto_must_fit_its_padded_micro_batch_of_the_longest_samples(monkeypatch):
    # 4 samples of up to 9,000 tokens padded to the longest: 36,000 tokens, more than the 30,720 that fit.
    monkeypatch.setattr(budget, "measure_auto", _fake_measure({False: 30720, "unsloth": 300000}, heaviest=36000))
    loads = []
    sorted_pad = _Description("auto", batching="sorted-pad", micro_batch_size=4)
    d, _, decision = budget.settle(sorted_pad, _recorder(loads), [100, 9000, 8000, 7000, 50])
    assert loads == [None, "unsloth"] and d.gradient_checkpointing == "unsloth"
    # Packed, the same data fits: a row never holds more than the budget, only one sample can exceed it.
    monkeypatch.setattr(budget, "measure_auto", _fake_measure({False: 30720, "unsloth": 300000}))
    loads.clear()
    d, _, _ = budget.settle(_Description("auto"), _recorder(loads), [100, 9000, 8000, 7000, 50])
    assert loads == [None] and d.gradient_checkpointing is False
    # A per-device batch larger than the dataset is capped by the dataset.
    assert budget.heaviest_micro_batch(_Description("auto", batching="sorted-pad", micro_batch_size=8), [5, 7]) == 14


def test_settle_tiles_the_mlp_when_checkpointing_alone_leaves_no_room(monkeypatch, logs):
    """The third saver: a 200,000-token sample fits neither without checkpointing (30,720) nor with it (100,000);
    with Unsloth's tiled MLP it does (300,000). Each saver is one more load and one more probe."""
    from HyperSloth.train.budget.cache import ProbeSetup

    budgets = {False: 30720, "unsloth": 100000, ("unsloth", "tiled"): 300000}
    monkeypatch.setattr(budget, "measure_auto", _fake_measure(budgets))
    monkeypatch.setattr(budget, "cached_needs_checkpointing", lambda setup, lengths, samples_per_step: False)
    monkeypatch.setattr(budget, "shape_says_checkpointing", lambda setup, tokens: False)
    setup = ProbeSetup(fast={"tiled_mlp": "auto"}, lora=None, backend="unsloth")
    loads = []
    d, _, decision = budget.settle(_Description("auto"), _recorder(loads), [100, 200000], setup)
    assert loads == [None, "unsloth", ("unsloth", "tiled")]
    assert (d.token_budget, d.gradient_checkpointing, d.tiled_mlp) == (300000, "unsloth", True)
    assert decision.checkpointing_switched_on and decision.tiled_mlp_switched_on and decision.tiled_mlp
    assert (decision.probe_seconds, decision.probe_passes) == (6.0, 9)  # three probes, two reloads counted
    assert "tiled MLP (switched on: the longest sample did not fit with checkpointing alone)" in decision.summary()
    assert any("does not fit even with gradient checkpointing (measured budget 100,000 tokens): turning on "
               "Unsloth's tiled MLP" in line for line in logs)
    # Checkpointing set in the config: only the tiling is switched on
    loads.clear()
    d, _, decision = budget.settle(_Description("auto", gc="unsloth"), _recorder(loads), [100, 200000], setup)
    assert loads == [None, ("unsloth", "tiled")] and d.tiled_mlp is True
    assert not decision.checkpointing_switched_on and decision.tiled_mlp_switched_on
    # A sample that fits with checkpointing alone never tiles (its cost on short rows is not measured)
    loads.clear()
    d, _, decision = budget.settle(_Description("auto"), _recorder(loads), [100, 65536], setup)
    assert loads == [None, "unsloth"] and d.tiled_mlp is False and not decision.tiled_mlp


def test_settle_never_tiles_against_the_config_or_off_unsloth(monkeypatch):
    budgets = {False: 30720, "unsloth": 100000, (False, "tiled"): 40960, ("unsloth", "tiled"): 300000}
    loads = []
    # tiled_mlp=False: checkpointing is the last saver, so its probe must prove the longest sample
    monkeypatch.setattr(budget, "measure_auto", _fake_measure(budgets, tile_auto=False))
    d, _, _ = budget.settle(_Description("auto", tiled_mlp=False), _recorder(loads), [100, 200000])
    assert loads == [None, "unsloth"] and d.tiled_mlp is False
    # tiled_mlp=True: tiled from the first load, nothing left to switch on but checkpointing
    loads.clear()
    d, _, decision = budget.settle(_Description("auto", tiled_mlp=True), _recorder(loads), [100, 200000])
    assert loads == [(None, "tiled"), ("unsloth", "tiled")]
    assert d.tiled_mlp is True and decision.tiled_mlp and not decision.tiled_mlp_switched_on
    # an explicit budget keeps the configured value ("auto" settles to off)
    loads.clear()
    d, _, decision = budget.settle(_Description("explicit", tiled_mlp=True), _recorder(loads), [100, 200000])
    assert loads == [(None, "tiled")] and d.tiled_mlp is True and decision.tiled_mlp
    d, _, _ = budget.settle(_Description("explicit"), _recorder(loads), [100, 200000])
    assert d.tiled_mlp is False

    # The transformers backend has no tiled MLP: "auto" stays off there
    class LoadedTransformers(_Loaded):
        backend = "transformers"

    monkeypatch.setattr(budget, "measure_auto", _fake_measure({False: 30720, True: 100000}, tile_auto=False))
    transformers_loads = []
    d, _, _ = budget.settle(_Description("auto"), lambda gc, tiled_mlp=False: transformers_loads.append((gc, tiled_mlp))
                            or LoadedTransformers(), [100, 200000])
    assert transformers_loads == [(None, False), (True, False)] and d.tiled_mlp is False


def test_the_probe_shrinks_unsloths_checkpointing_buffers(monkeypatch):
    """After the probe of a checkpointed model, release_memory resets unsloth_zoo's offload buffers when they
    exist, and it never imports Unsloth itself (the transformers backend and CPU have none)."""
    import sys
    import types

    import torch

    from HyperSloth.train.budget import probe as budget_probe
    from HyperSloth.train.model import release_checkpointing_buffers

    monkeypatch.delitem(sys.modules, "unsloth_zoo.gradient_checkpointing", raising=False)
    assert release_checkpointing_buffers() is False
    assert "unsloth_zoo.gradient_checkpointing" not in sys.modules
    calls = []
    fake = types.ModuleType("unsloth_zoo.gradient_checkpointing")
    fake.reset_unsloth_gradient_checkpointing_buffers = lambda: calls.append("reset")
    monkeypatch.setitem(sys.modules, "unsloth_zoo.gradient_checkpointing", fake)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    model = torch.nn.Linear(2, 2)
    model.weight.grad = torch.ones(2, 2)
    budget_probe.release_memory(model)  # between probe passes: the buffers stay (training keeps them too)
    assert calls == [] and model.weight.grad is None
    budget_probe.release_memory(model, checkpointing_buffers=True)
    assert calls == ["reset"]


def test_settle_loads_with_checkpointing_at_once_when_the_cache_knows(monkeypatch):
    from HyperSloth.train.budget.cache import ProbeSetup

    monkeypatch.setattr(budget, "measure_auto", _fake_measure({False: 30720, "unsloth": 300000}))
    monkeypatch.setattr(budget, "cached_needs_checkpointing", lambda setup, lengths, samples_per_step: True)
    loads = []
    setup = ProbeSetup(fast={}, lora=None, backend="unsloth")
    d, _, decision = budget.settle(_Description("auto"), _recorder(loads), [100, 65536],
                                   setup)
    assert loads == ["unsloth"]  # one load, no probe without checkpointing
    assert decision.checkpointing_switched_on and decision.reload_seconds is None and decision.probe_passes == 3
    assert d.gradient_checkpointing == "unsloth"


def test_settle_loads_with_checkpointing_at_once_when_the_models_shape_says_so(monkeypatch, logs):
    from HyperSloth.train.budget.cache import ProbeSetup

    monkeypatch.setattr(budget, "measure_auto", _fake_measure({False: 30720, "unsloth": 300000}))
    monkeypatch.setattr(budget, "cached_needs_checkpointing", lambda setup, lengths, samples_per_step: False)
    asked = []
    monkeypatch.setattr(budget, "shape_says_checkpointing", lambda setup, tokens: asked.append(tokens) or True)
    loads = []
    setup = ProbeSetup(fast={}, lora=None, backend="unsloth")
    d, _, decision = budget.settle(_Description("auto"), _recorder(loads), [100, 262144],
                                   setup)
    assert asked == [262144] and loads == ["unsloth"]  # one load: no probe without checkpointing, no reload
    assert decision.checkpointing_switched_on and decision.reload_seconds is None
    assert any(line.startswith("the model's shape says the heaviest micro-batch (the longest sample, 262,144 tokens)")
               for line in logs)
    # an explicit budget or checkpointing already on never asks
    asked.clear()
    budget.settle(_Description("auto", gc="unsloth"), lambda gc, tiled_mlp=False: _Loaded(), [100, 262144], setup)
    budget.settle(_Description("explicit"), lambda gc, tiled_mlp=False: _Loaded(), [100, 262144], setup)
    assert asked == []


def test_the_shape_floor_is_below_the_measured_peaks_and_decides_only_when_far_over_the_gpu():
    """The floor counts each layer's input and the MLP's gate and up outputs (16-bit): Qwen3-8B 2.06 MB per token
    against 4.2 MB measured on the H200 (docs/benchmarks.md), Qwen3-0.6B 0.40 MB against 1.36 MB."""
    from types import SimpleNamespace

    qwen3_8b = SimpleNamespace(num_hidden_layers=36, hidden_size=4096, intermediate_size=12288)
    qwen3_06b = SimpleNamespace(num_hidden_layers=28, hidden_size=1024, intermediate_size=3072)
    per_token_8b = budget_choice.activation_floor_bytes(qwen3_8b, 1)
    assert per_token_8b == 36 * (4096 + 2 * 12288) * 2 < 4_425_926  # the measured slope (bytes per token)
    assert budget_choice.activation_floor_bytes(qwen3_06b, 1) < 1_355_145
    h200 = 150_109_880_320
    assert budget_choice.shape_needs_checkpointing(qwen3_8b, 131_072, h200)  # 270 GB of activations at least
    assert not budget_choice.shape_needs_checkpointing(qwen3_8b, 32_768, h200)  # 68 GB: measure instead
    assert not budget_choice.shape_needs_checkpointing(qwen3_06b, 262_144, h200)  # 105 GB: measure instead
    assert budget_choice.activation_floor_bytes(SimpleNamespace(hidden_size=8), 10) is None
    assert not budget_choice.shape_needs_checkpointing(SimpleNamespace(), 10**9, h200)
    text = SimpleNamespace(get_text_config=lambda: qwen3_8b)  # a multimodal config: its text part decides
    assert budget_choice.activation_floor_bytes(text, 2) == 2 * per_token_8b


def _linear(calls, base=4 * GIB, per_token=2**20):
    def peak(tokens):
        calls.append(tokens)
        return base + per_token * tokens
    return peak


def test_a_large_budget_is_verified_by_a_bounded_pass_and_extrapolated_with_slack():
    calls = []
    limit = 4 * GIB + 2**20 * 100_000
    out = budget_choice.measure(_linear(calls), limit_bytes=limit, cap=10**6, verify_at_most=32768)
    assert calls == [2048, 8192, 32768]  # never a pass at the whole budget
    assert out["verified_tokens"] == 32768 and out["verified_peak_bytes"] == 4 * GIB + 2**20 * 32768
    # The line through the verified point, 10% steeper: 32768 + (100000 - 32768) / 1.1 tokens, rounded down.
    assert out["tokens"] == (int(32768 + 67232 / 1.1) // 256) * 256
    assert out["fit"].predict(out["tokens"]) <= limit


def test_the_bounded_pass_takes_the_steeper_slope_and_small_budgets_are_verified_at_the_budget():
    calls = []

    def convex(tokens):  # 1 MiB per token up to 8192, 2 MiB per token beyond
        calls.append(tokens)
        return GIB + 2**20 * tokens + 2**20 * max(0, tokens - 8192)

    limit = GIB + 2**20 * 150_000
    out = budget_choice.measure(convex, limit_bytes=limit, cap=10**6, verify_at_most=32768)
    assert out["fit"].per_token_bytes == pytest.approx(2 * 2**20 * 1.1)
    assert convex(out["tokens"]) <= limit  # the steeper local slope kept the real peak inside the limit
    calls.clear()
    out = budget_choice.measure(_linear(calls), limit_bytes=4 * GIB + 2**20 * 20000, cap=10**6, verify_at_most=32768)
    assert calls == [2048, 8192, 19968] and out["verified_tokens"] == out["tokens"] == 19968


def test_a_bounded_pass_over_the_limit_falls_back_to_verifying_below_it():
    calls = []

    def jump(tokens):  # linear for the probes, then far steeper: 32768 tokens already overshoot
        calls.append(tokens)
        return GIB + 2**20 * tokens + (40 * 2**20 * (tokens - 16384) if tokens > 16384 else 0)

    limit = GIB + 2**20 * 200_000
    out = budget_choice.measure(jump, limit_bytes=limit, cap=10**6, verify_at_most=32768)
    assert calls[:3] == [2048, 8192, 32768] and max(calls[3:]) < 32768
    assert out["verified_peak_bytes"] <= limit and out["verified_tokens"] == out["tokens"] < 32768


def test_when_the_longest_sample_cannot_fit_nothing_is_verified():
    calls = []
    out = budget_choice.measure(_linear(calls), limit_bytes=4 * GIB + 2**20 * 30000, cap=10**6, must_fit=65536,
                                verify_at_most=32768)
    assert calls == [2048, 8192] and out["verified_peak_bytes"] is None and out["tokens"] < 65536
    out = budget_choice.measure(_linear([]), limit_bytes=4 * GIB + 2**20 * 30000, cap=10**6, must_fit=4096)
    assert out["verified_peak_bytes"] is not None  # it fits: verified as usual


def test_with_checkpointing_on_the_longest_sample_is_proven_by_one_pass_or_refused():
    calls = []
    limit = 4 * GIB + 2**20 * 30000

    def flatter_beyond_the_probes(tokens):  # the line says 30k tokens fit; a 40k sample really does
        calls.append(tokens)
        return 4 * GIB + 2**20 * min(tokens, 8192) + 2**19 * max(0, tokens - 8192)

    out = budget_choice.measure(flatter_beyond_the_probes, limit_bytes=limit, cap=10**6, must_fit=40000, can_switch=False,
                                verify_at_most=32768)
    assert out["tokens"] == out["verified_tokens"] == 40192 and calls == [2048, 8192, 40192]  # one pass at it
    with pytest.raises(RuntimeError, match=r"heaviest micro-batch \(65,536 tokens: .* does not fit .* --max_seq_length 29952"):
        budget_choice.measure(_linear([]), limit_bytes=limit, cap=10**6, must_fit=65536, can_switch=False)
    # What was tried, and the saver left to try: the tiled MLP where Unsloth has one (None: no hint)
    said = {}
    for tiled in (None, False, True):
        with pytest.raises(RuntimeError) as err:
            budget_choice.measure(_linear([]), limit_bytes=limit, cap=10**6, must_fit=65536, can_switch=False,
                                  tiled_mlp=tiled)
        said[tiled] = str(err.value)
    assert "tiled" not in said[None]
    assert "set fast_model_args.tiled_mlp='auto'" in said[False] and "checkpointing and" not in said[False]
    assert "even with gradient checkpointing and Unsloth's tiled MLP:" in said[True] and "set fast_model" not in said[True]

    def oom(tokens):
        if tokens > 8192:
            raise FakeOOM("out of memory")
        return 4 * GIB + 2**20 * tokens

    with pytest.raises(RuntimeError, match="ran out of memory"):
        budget_choice.measure(oom, limit_bytes=limit, cap=10**6, must_fit=65536, can_switch=False,
                              is_oom=lambda e: isinstance(e, FakeOOM))


def test_a_long_sample_whose_offloaded_checkpoints_exceed_host_memory_is_warned_about(monkeypatch, logs):
    """Qwen3-8B's shape (36 layers, hidden 4096) at 262,144 tokens offloads 72 GiB of layer inputs to host memory."""
    from types import SimpleNamespace

    class Loaded8B(_Loaded):
        model = SimpleNamespace(config=SimpleNamespace(num_hidden_layers=36, hidden_size=4096))

    assert budget_choice.offload_host_bytes(Loaded8B.model.config, 262144) == 36 * 4096 * 2 * 262144
    assert budget_choice.offload_host_bytes(SimpleNamespace(), 262144) is None
    monkeypatch.setattr(budget, "measure_auto", _fake_measure({False: 30720, "unsloth": 300000}))
    for available_gib, warned in ((31, True), (200, False)):
        monkeypatch.setattr(budget, "host_memory_available", lambda: available_gib * 2**30)
        logs.clear()
        budget.settle(_Description("auto"), lambda gc, tiled_mlp=False: Loaded8B(), [100, 262144])
        said = [line for line in logs if "host memory" in line]
        assert bool(said) == warned
        if warned:  # this rank's share: 80% of the 31 GiB available
            assert "72 GiB" in said[0] and "25 GiB" in said[0] and "262,144 tokens" in said[0]
    # Without checkpointing (the sample fits on the GPU) nothing is offloaded, so nothing is said.
    monkeypatch.setattr(budget, "host_memory_available", lambda: 2**30)
    logs.clear()
    budget.settle(_Description("auto"), lambda gc, tiled_mlp=False: Loaded8B(), [100, 4096])
    assert not [line for line in logs if "host memory" in line]
    assert budget.host_memory_available() is None or budget.host_memory_available() > 0


def test_the_budget_is_lowered_until_offloaded_checkpoints_fit_host_memory(monkeypatch, logs):
    """Measured on one H200 (2026-12-01): Qwen3-8B 4-bit, a 262,144-token chat among 31 short ones. The GPU budget
    (283,136 tokens) packed all 32 into one micro-batch; Unsloth pinned each layer's input in a 4 GiB block
    (2.15 GiB rounded up to a power of two), 36 of them against 124 GiB of host memory, and the kernel killed the
    worker in step 1. A budget of 262,144 keeps every block at 2 GiB (72 GiB): the long chat trains alone."""
    from types import SimpleNamespace

    config = SimpleNamespace(num_hidden_layers=36, hidden_size=4096)

    class Loaded8B(_Loaded):
        model = SimpleNamespace(config=config)

    assert budget_choice.pinned_block_bytes(4096 * 2 * 282000) == 4 * 2**30
    assert budget_choice.offload_host_bytes(config, 282000) == 36 * 4 * 2**30
    assert budget_choice.host_token_cap(config, 0.8 * 124 * 2**30) == 262144
    assert budget_choice.host_token_cap(config, 36 * 2**20) == 0  # not even 256 tokens
    assert budget_choice.host_token_cap(SimpleNamespace(), 2**40) is None
    monkeypatch.setattr(budget, "measure_auto", _fake_measure({False: 30720, "unsloth": 283136}))
    monkeypatch.setattr(budget, "host_memory_available", lambda: 124 * 2**30)
    settled, _, decision = budget.settle(_Description("auto"), lambda gc, tiled_mlp=False: Loaded8B(), [100, 262144])
    assert settled.token_budget == decision.tokens == decision.host_cap_tokens == 262144
    assert "lowered to 262,144 so that Unsloth's offloaded checkpoints fit host memory" in decision.summary()
    assert not [line for line in logs if "pinned host memory" in line]  # lowered, so no warning
    # Two ranks on this host share it: 1 GiB blocks hold 131,072 tokens, shorter than the long chat, so the
    # budget stays and the run is warned (with what to change).
    logs.clear()
    settled, _, decision = budget.settle(_Description("auto"), lambda gc, tiled_mlp=False: Loaded8B(), [100, 262144], local_ranks=2)
    assert decision.tokens == 283136 and decision.host_cap_tokens is None
    said = [line for line in logs if "pinned host memory" in line]
    assert len(said) == 1 and "UNSLOTH_GC_PINNED_MAX_GB" in said[0] and "50 GiB" in said[0]
    # An explicit budget is kept, and the user is told the size that fits.
    logs.clear()
    explicit = _Description("explicit", budget=283136, gc="unsloth")
    settled, _, decision = budget.settle(explicit, lambda gc, tiled_mlp=False: Loaded8B(), [100, 262144])
    assert settled.token_budget == decision.tokens == 283136
    said = [line for line in logs if "pinned host memory" in line]
    assert len(said) == 1 and "144 GiB" in said[0] and "Set tokens_per_micro_batch to 262,144 or less" in said[0]
    logs.clear()
    budget.settle(_Description("explicit", budget=131072, gc="unsloth"), lambda gc, tiled_mlp=False: Loaded8B(), [100, 131072])
    assert not [line for line in logs if "pinned host memory" in line]
    # Plenty of host memory: the GPU's budget stands.
    monkeypatch.setattr(budget, "host_memory_available", lambda: 400 * 2**30)
    assert budget.settle(_Description("auto"), lambda gc, tiled_mlp=False: Loaded8B(), [100, 262144])[2].tokens == 283136
