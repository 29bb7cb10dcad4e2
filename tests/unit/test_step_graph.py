"""CUDA graphs over the bucket shapes: the key/layout logic and the autograd glue, on the CPU.

The capture itself needs CUDA (scripts/graph_check.py checks a replay against eager on the GPU, and
tests/gpu/test_step_graph_gpu.py when CUDA is present); here a stand-in graph runs the same computation in
Python, so `_Replay` and `accumulate` are checked against plain autograd.
"""

import numpy as np
import pytest
import torch

from HyperSloth.train import step_graph
from HyperSloth.train.collate import PAD_SEGMENT_TOKENS, bucket_tokens, padding_segments
from HyperSloth.train.step_graph import (
    GraphLayout,
    accumulate,
    graph_layout,
    graph_unavailable,
    padded_segments,
    rows_to_capture,
    synthetic_row,
)


def test_layout_covers_samples_and_the_padding_of_every_graphed_row():
    layout = graph_layout(samples_per_micro_batch=32, longest_sample=3000, token_budget=98_304)
    assert layout.max_seqlen == 4096  # the longest sample, not the padding: padding segments are short
    assert layout.max_rows == 49_152  # half the budget
    # every row a graph may serve (up to half the budget) fits with its bucket padding
    for real in (1, 700, 12_289, 30_000, 49_152):
        rows = bucket_tokens(real)
        if rows > 98_304 // 2:
            continue
        segments = [700] * 32 + padding_segments(rows - real)
        assert layout.refusal(np.array(segments)) is None, real
    assert graph_layout(8, 100, 16_384).max_seqlen == 1024


def test_the_graph_pool_and_the_longest_eager_row_fit_the_budget_together():
    """A graphed row G and a row R run eagerly beside its pool must satisfy G + R <= budget (memory is linear in
    tokens; the probe proved the budget's row). Qwen3-8B 4-bit: budget 28,416, rows of ~22k tokens. The old
    half-budget rule graphed 6,144-token rows (a 26 GiB pool) beside 22k-token eager rows: out of memory."""
    limit = step_graph.graph_rows_limit
    assert limit(28_416) == limit(28_416, 14_208) == 14_208  # every planned row graphable: half the budget
    assert limit(28_416, 22_528) == 5_888  # the 22k row runs eagerly beside a pool of at most 5,888 tokens
    assert limit(28_416, 28_416) == 0 and limit(100, 400) == 0  # a row at (or over) the budget leaves no room
    layout = graph_layout(32, 4096, 28_416, longest_row=22_528)
    assert layout.max_rows == 5_888
    assert layout.refusal(np.array([3000, 2888])) is None
    assert "graph pool" in layout.refusal(np.array([3000, 2889]))
    for graphed, eager in ((14_208, 14_208), (5_888, 22_528), (2048, 22_528)):
        budget = 28_416
        assert graphed + eager <= budget or graphed > limit(budget, eager)


def test_planned_rows_count_the_first_steps_and_find_the_longest_row_of_the_run(monkeypatch):
    from types import SimpleNamespace

    from HyperSloth.train import trainer_args
    from HyperSloth.train.collate import packed_row_tokens

    lengths = np.array([100, 200, 300, 5000, 40])
    # two epochs of two steps; each step lists rank 0's micro-batches (indices into `lengths`); rank 1 has none
    epochs = {0: [[[0, 1], [2]], [[3], []]], 1: [[[0], [4]], [[1, 2, 3]]]}

    class Steps:
        steps_per_epoch = 2
        cached = None  # the epoch in the loader's one-plan cache (PlanSteps.plan)

        def plan_for_epoch(self, epoch):
            return SimpleNamespace(steps=[SimpleNamespace(ranks=[[np.array(m, dtype=int) for m in step], []])
                                          for step in epochs[epoch]])

        def plan(self, epoch):
            self.cached = epoch
            return self.plan_for_epoch(epoch)

    row = lambda tokens: packed_row_tokens(tokens, 8192)
    steps = Steps()
    counts, longest = trainer_args.planned_rows(steps, lengths, rank=0, total_steps=4, token_budget=8192)
    assert longest == row(5500)  # epoch 1, step 1: samples 1, 2 and 3
    assert steps.cached == 0  # epoch 1 was scanned beside the cache: step 1 finds epoch 0 planned
    assert sum(counts.values()) == 6 and counts[row(300)] == 2  # the empty micro-batch is not a row
    monkeypatch.setattr(trainer_args, "GRAPH_PLAN_STEPS", 1)  # count the first step only
    counts, longest = trainer_args.planned_rows(Steps(), lengths, rank=0, total_steps=4, token_budget=8192)
    assert counts == {row(300): 2} and longest == row(5500)  # the longest row still covers the whole run
    assert trainer_args.planned_rows(Steps(), lengths, rank=1, total_steps=4, token_budget=8192) == ({}, 0)
    monkeypatch.setattr(trainer_args, "ROW_SCAN_STEPS", 2)  # a long run is scanned that far (epoch 0 here)
    assert trainer_args.planned_rows(Steps(), lengths, rank=0, total_steps=4, token_budget=8192)[1] == row(5000)


def test_padding_is_cut_into_short_equal_segments():
    assert padding_segments(0) == []
    assert padding_segments(1024) == [1024]
    assert padding_segments(2049) == [683, 683, 683]
    assert max(padding_segments(12_000)) <= PAD_SEGMENT_TOKENS and sum(padding_segments(12_000)) == 12_000


def test_refusal_names_what_does_not_fit():
    layout = GraphLayout(segments=4, max_seqlen=1024, max_rows=2048)
    assert layout.refusal(np.array([10, 1024, 3])) is None
    assert "5 segments" in layout.refusal(np.array([1, 1, 1, 1, 1]))
    assert "1025 tokens" in layout.refusal(np.array([1025]))
    assert "rows over 2048 tokens" in layout.refusal(np.array([1024, 1024, 1]))


def test_padded_segments_repeat_the_final_offset():
    padded, cu = padded_segments(np.array([3, 5, 2]), capacity=6)
    assert padded.tolist() == [3, 5, 2, 0, 0, 0]
    assert cu.tolist() == [0, 3, 8, 10, 10, 10, 10]
    assert padded.dtype == np.int32 and cu.dtype == np.int32
    with pytest.raises(ValueError, match="do not fit"):
        padded_segments(np.array([1, 2, 3]), capacity=2)


def test_rows_to_capture_keeps_half_the_budget_and_the_most_frequent():
    counts = {8192: 5, 9216: 1, 10240: 7, 40960: 9, 60000: 3}
    layout = GraphLayout(33, 8192, max_rows=50_000)
    # 60,000 > 100,000 // 2 is left out; the rest by frequency, capped, then longest first
    assert rows_to_capture(counts, layout, max_graphs=3) == [40960, 10240, 8192]
    assert rows_to_capture(counts, layout, max_graphs=10) == [40960, 10240, 9216, 8192]


@pytest.mark.parametrize("rows", [64, 1000, 8192, 24_576])
def test_synthetic_row_fits_the_layout(rows):
    layout = graph_layout(32, 4096, 49_152)
    batch = synthetic_row(rows, layout, pad_token_id=0)
    lengths = batch["packed_seq_lengths"].numpy()
    assert batch["input_ids"].shape == (1, rows)
    assert lengths.sum() == rows and layout.refusal(lengths) is None
    if len(lengths) > 2:  # lengths vary, so the attention dispatch picks its varlen kernel at capture
        assert len(set(lengths[:-1].tolist())) > 1


def test_synthetic_row_refuses_rows_the_layout_cannot_hold():
    assert synthetic_row(10_000, GraphLayout(segments=3, max_seqlen=1024, max_rows=100_000), pad_token_id=0) is None


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({}, None),
        ({"enabled": False}, "switched off"),
        ({"cuda": False}, "no CUDA"),
        ({"backend": "transformers"}, "Unsloth backend"),
        ({"mode": "sorted-pad"}, "sorted-pad"),
        ({"lora": False}, "full fine-tuning"),
        ({"lora_dropout": 0.1}, "dropout"),
        ({"checkpointing": "unsloth"}, "checkpointing"),
        ({"tiled_mlp": True}, "tiled MLP"),
    ],
)
def test_graph_unavailable_says_why(overrides, reason):
    kwargs = dict(enabled=True, cuda=True, backend="unsloth", mode="packed", lora=True, lora_dropout=0.0,
                  checkpointing=False)
    said = graph_unavailable(**{**kwargs, **overrides})
    assert said is None if reason is None else reason in said


def test_accumulate_adds_and_creates_gradients():
    params = tuple(torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    params[1].grad = torch.ones(3)
    grads = tuple(torch.full((3,), float(i + 1)) for i in range(3))
    accumulate(params, grads)
    assert [p.grad.tolist() for p in params] == [[1.0] * 3, [3.0] * 3, [3.0] * 3]
    assert params[0].grad is not grads[0]  # a copy: the static output is overwritten by the next replay
    accumulate(params, grads)
    assert [p.grad.tolist() for p in params] == [[2.0] * 3, [5.0] * 3, [6.0] * 3]


class _StandInGraph:
    """What `_Graph` holds after a capture, with Python doing what the two replays do on the GPU."""

    def __init__(self, weight: torch.nn.Parameter, x: torch.Tensor):
        self.x, self.weight = x, weight
        self.hidden = torch.zeros(x.shape[0], weight.shape[0])
        self.grad_hidden = torch.zeros_like(self.hidden)
        self.grads = (torch.zeros_like(weight),)
        graph = self

        class Forward:
            def replay(self):
                graph.hidden.copy_(torch.tanh(graph.x @ graph.weight.detach().T))

        class Backward:
            def replay(self):
                local = torch.tanh(graph.x @ graph.weight.detach().T)
                graph.grads[0].copy_(((graph.grad_hidden * (1 - local**2)).T @ graph.x))

        self.forward, self.backward = Forward(), Backward()


def test_replay_glue_matches_autograd_over_micro_batches():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 5))
    batches = [torch.randn(6, 5), torch.randn(6, 5)]
    anchor = torch.zeros((), requires_grad=True)
    for x in batches:  # two micro-batches: gradients accumulate as eager backward() calls do
        graph = _StandInGraph(weight, x)
        hidden = step_graph._Replay.apply(anchor, graph, (weight,))
        (hidden.square().sum() / 7).backward()
    replayed = weight.grad.clone()
    weight.grad = None
    for x in batches:
        (torch.tanh(x @ weight.T).square().sum() / 7).backward()
    torch.testing.assert_close(replayed, weight.grad, rtol=1e-6, atol=1e-6)
    assert anchor.grad is None


def test_replayed_output_keeps_the_decoders_class_for_multimodal_gemma3():
    """Gemma 3 4B+ (Gemma3ForConditionalGeneration) reads `image_hidden_states` from its inner model's output: the
    graphed decoder's output must be that model's class, not BaseModelOutputWithPast (found on the GPU, callT)."""
    import transformers

    from HyperSloth.train.tiny_architectures import tiny_config

    config = tiny_config("gemma3_mm", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=16, max_position_embeddings=64, initializer_range=0.02,
                         pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    ids = torch.randint(2, 64, (1, 8))
    inner, original = model.model, model.model.forward
    output_type = type(original(input_ids=ids))
    hidden = original(input_ids=ids)[0]
    inner.forward = lambda *args, **kwargs: step_graph._output(hidden, output_type)
    logits = model(input_ids=ids).logits  # the outer forward reads image_hidden_states of the replayed output
    inner.forward = lambda *args, **kwargs: step_graph._output(hidden)
    with pytest.raises(AttributeError, match="image_hidden_states"):
        model(input_ids=ids)
    inner.forward = original
    torch.testing.assert_close(logits, model(input_ids=ids).logits)


def test_a_failed_capture_says_which_line_outside_torch_synchronised():
    import transformers.utils.generic as library  # any module outside torch, standing in for the model's

    def model_forward(x):
        return torch.nn.functional.relu(x).view(3)  # raises inside torch (as a host sync does in "error" mode)

    try:
        model_forward(torch.ones(2))
        raise AssertionError("nothing raised")
    except RuntimeError as error:
        where = step_graph.failed_at(error)
    assert where and where[-1].endswith("in model_forward") and "test_step_graph.py" in where[-1], where
    assert all("/torch/" not in frame for frame in where)
    assert step_graph._package_path(library.__file__) == "transformers/utils/generic.py"
    assert step_graph._package_path("/work/main/unsloth_compiled_cache_rank0/unsloth_compiled_module_gemma4.py") \
        == "unsloth_compiled_cache_rank0/unsloth_compiled_module_gemma4.py"


def test_warm_up_and_capture_cast_the_weights_afresh_under_autocast():
    # Under autocast a cast weight is cached for the rest of the region: a capture after its warm-up would
    # read the warm-up's copy (freed when the region ends, stale after an optimizer step)
    weight = torch.nn.Parameter(torch.ones(2, 2))
    x = torch.ones(1, 2, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        warm_up = torch.nn.functional.linear(x, weight)
        with torch.no_grad():
            weight.mul_(2)
        assert torch.equal(torch.nn.functional.linear(x, weight), warm_up)  # the cache's stale copy
        with step_graph.without_autocast_cache():
            assert torch.equal(torch.nn.functional.linear(x, weight), 2 * warm_up)
        assert torch.is_autocast_cache_enabled()


class _HostReads:
    """Every read of a tensor's value back to the host (`.item()`, `bool()`, `nonzero`): inside a CUDA graph
    capture each one fails the capture ("called a synchronizing CUDA operation")."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        reads = self.reads = []
        syncing = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in syncing:
                    import traceback

                    frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename][-3:-1]
                    reads.append(" <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[::-1]))
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


@pytest.mark.parametrize("architecture",
                         ["qwen3", "llama", "mistral", "qwen2", "phi3", "gemma3", "gemma3_mm", "gemma4"])
def test_the_decoders_packed_forward_and_backward_read_nothing_back_while_a_stream_captures(monkeypatch, architecture):
    # What a graph captures (the decoder body, forward and backward) must not read a value back to the host.
    # transformers skips its own reads while a stream captures (is_cuda_stream_capturing); without that, packing's
    # boundary search reads one back. Unsloth's reads are answered by patches.unsloth_capture_safe_mask_checks.
    from HyperSloth.train.collate import collate_packed
    from HyperSloth.train.tiny_architectures import tiny_config, tiny_causal_lm

    config = tiny_config(architecture, vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                         initializer_range=0.02, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    decoder = tiny_causal_lm(config).train().model  # what DecoderGraphs.install wraps
    rng = np.random.default_rng(0)
    batch = collate_packed([(ids, ids.copy()) for ids in (rng.integers(2, 128, 20), rng.integers(2, 128, 12))],
                           with_lengths=True)
    batch.pop("labels")

    def host_reads() -> list[str]:
        probe = _HostReads()
        with probe.mode:
            decoder(**batch, use_cache=False).last_hidden_state.sum().backward()
        return probe.reads

    assert host_reads(), "the control: outside a capture transformers reads the packed boundaries back"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert host_reads() == []
