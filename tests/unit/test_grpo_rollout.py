"""GRPO's pieces in one process: prompt datasets, reward scoring and its failures, advantages, packing, the loss."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from HyperSloth.config import GrpoArgs
from HyperSloth.data.formats import RecordError
from HyperSloth.data.prompts import looks_like_prompt, to_prompt
from HyperSloth.train.grpo import loss as grpo_loss
from HyperSloth.train.grpo.rollout import RewardFailure, advantages, cut_at_eos, prompt_seed, score


def test_prompt_rows_keep_every_other_column_and_refuse_what_is_not_a_prompt():
    (prompt, columns), shape, _ = to_prompt({"prompt": [{"role": "user", "content": "2+3?"}], "answer": 5, "x": [1]})
    assert shape == "conversational" and prompt == [{"role": "user", "content": "2+3?"}]
    assert columns == {"answer": 5, "x": [1]}
    assert to_prompt({"prompt": "Say hi"})[1] == "text"
    for record, reason in (({"answer": 1}, "missing_fields"), ({"prompt": "  "}, "empty_prompt"),
                           ({"prompt": [{"role": "assistant", "content": "x"}]}, "prompt_not_user_turn"),
                           ({"prompt": 3}, "non_string_content"), ([1], "not_an_object")):
        with pytest.raises(RecordError) as err:
            to_prompt(record)
        assert err.value.reason == reason
    assert looks_like_prompt({"prompt": "q", "answer": "a"})
    assert not looks_like_prompt({"prompt": "q", "completion": "a"})  # TRL's prompt-completion SFT rows
    assert not looks_like_prompt({"prompt": "q", "chosen": "a", "rejected": "b"})


def test_the_builder_detects_prompts_and_drops_prompts_too_long(tmp_path, tiny_model_dir):
    from datasets import load_from_disk

    from HyperSloth.data.build import build_dataset

    source = tmp_path / "p.jsonl"
    rows = [{"prompt": [{"role": "user", "content": "What is two plus three?"}], "answer": "5"},
            {"prompt": "Say hi", "answer": 7, "level": 2},
            {"prompt": [{"role": "user", "content": "word " * 200}], "answer": "long"}]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    entry = build_dataset(str(source), name="p", tokenizer=str(tiny_model_dir), data_dir=str(tmp_path / "data"),
                          max_seq_length=64, num_proc=1)
    assert entry["kind"] == "prompt" and entry["num_samples"] == 2
    assert entry["stats"]["dropped_prompt_too_long"] == 1 and entry["stats"]["reward_columns"] == ["answer", "level"]
    built = load_from_disk(str(tmp_path / "data" / entry["path"]))
    assert [json.loads(c) for c in built["columns_json"]] == [{"answer": "5"}, {"answer": 7, "level": 2}]
    assert json.loads(built["prompt_json"][1]) == "Say hi"
    assert built["prompt_length"] == [len(ids) for ids in built["prompt_input_ids"]] == built["length"]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    rendered = tok.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True)
    assert built["prompt_input_ids"][0] == list(rendered["input_ids"])  # what TRL generates from


def _fmt(prompts, completions, **kwargs):
    return [float(len(c)) for c in completions]


def _answer(prompts, completions, answer, **kwargs):
    return [None if a is None else float(a in c) for c, a in zip(completions, answer)]


def test_scoring_passes_trls_arguments_and_names_a_failing_function_and_the_step():
    scored = score([_fmt, _answer], [1.0, 2.0], prompts=["p"] * 4, completions=["5", "55", "x", "yy"],
                   completion_ids=[[1]] * 4, columns=[{"answer": "5"}] * 2 + [{"answer": None}] * 2, step=3)
    np.testing.assert_allclose(scored.per_func[:, 0], [1, 2, 1, 2])
    assert np.isnan(scored.per_func[2:, 1]).all()
    np.testing.assert_allclose(scored.weighted, [3, 4, 1, 2])  # NaN rewards are left out of the sum (nansum)

    def broken(prompts, completions, **kwargs):
        raise KeyError("solution")

    with pytest.raises(RewardFailure, match=r"^reward function 'broken' raised KeyError at step 3: 'solution'$"):
        score([_fmt, broken], None, prompts=["p"], completions=["c"], completion_ids=[[1]], columns=[{}], step=3)
    with pytest.raises(RewardFailure, match="'short' returned 1 rewards for 2 completions at step 5"):
        score([_named("short")], None, prompts=["p"] * 2, completions=["a", "b"], completion_ids=[[1]] * 2,
              columns=[{}] * 2, step=5)


def _named(name):
    def func(prompts, completions, **kwargs):
        return [1.0]

    func.__name__ = name
    return func


def test_advantages_are_trls_group_and_batch_scaling():
    rewards = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 5.0, 5.0, np.nan], dtype=np.float32)
    adv, zero = advantages(rewards, 4, "group")
    first = (rewards[:4] - rewards[:4].mean()) / (rewards[:4].std(ddof=1) + 1e-4)
    np.testing.assert_allclose(adv[:4], first, rtol=1e-6)
    np.testing.assert_allclose(adv[4:], 0.0)  # equal rewards (and the NaN one) carry no signal
    assert zero.tolist() == [False, True]
    np.testing.assert_allclose(advantages(rewards, 4, "none")[0][:4], rewards[:4] - 2.5)
    np.testing.assert_allclose(advantages(rewards, 4, "batch", 2.0)[0][:4], (rewards[:4] - 2.5) / (2.0 + 1e-4))


def test_sampling_seeds_depend_on_step_and_prompt_only():
    assert prompt_seed(42, 3, 7) == prompt_seed(42, 3, 7)
    assert len({prompt_seed(42, s, r) for s in range(4) for r in range(4)}) == 16
    assert cut_at_eos(np.array([5, 6, 2, 7, 2]), [2]).tolist() == [5, 6, 2]
    assert cut_at_eos(np.array([5, 6]), [2]).tolist() == [5, 6]


def test_packing_and_the_loss_normalisers():
    items = [grpo_loss.Completion(np.arange(3), np.arange(n), 0.5) for n in (4, 5, 20, 1)]
    assert grpo_loss.pack_completions(items, 16) == [[0, 1], [2], [3]]  # 7 + 8 tokens, then 23 alone
    assert grpo_loss.normaliser(GrpoArgs(), 8, 100) == (100.0, "one")
    assert grpo_loss.normaliser(GrpoArgs(loss_type="grpo"), 8, 100) == (8.0, "per_completion")
    assert grpo_loss.normaliser(GrpoArgs(loss_type="dr_grpo", max_completion_length=16), 8, 100) == (128.0, "one")
    batch = grpo_loss.collate_completions(items[:2], "per_completion")
    assert batch["target_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4]  # the completions' tokens only
    np.testing.assert_allclose(batch["target_weight"].numpy(), [0.25] * 4 + [0.2] * 5)


def test_the_clipped_objective_and_its_statistics():
    grpo = GrpoArgs(epsilon=0.2, beta=0.1)
    logps = torch.tensor([-1.0, -1.0, -1.0], requires_grad=True)
    old = torch.tensor([-1.0, -1.5, -0.5])  # ratios 1, e^0.5 (above 1.2), e^-0.5 (below 0.8)
    adv = torch.tensor([1.0, 1.0, -1.0])
    loss, stats = grpo_loss.grpo_token_loss(logps, adv, grpo, old=old, ref=logps.detach())
    np.testing.assert_allclose(loss.detach().numpy(), [-1.0, -1.2, 0.8], rtol=1e-6)  # each ratio clipped
    assert stats[1].tolist() == [0, 0, 1] and stats[2].tolist() == [0, 1, 0] and stats[3].tolist() == [0, 1, 1]
    assert stats[0].abs().max() == 0  # policy == reference: no KL


def test_the_shipped_sample_prompts_are_the_checkouts():
    from pathlib import Path

    from HyperSloth.data import SAMPLE_PROMPTS_PATH

    checkout = Path(__file__).resolve().parents[2] / "data" / "sample_prompts.jsonl"
    assert SAMPLE_PROMPTS_PATH.read_bytes() == checkout.read_bytes()
    rows = [json.loads(line) for line in checkout.read_text().splitlines()]
    assert len(rows) == 48 and all(looks_like_prompt(r) and isinstance(r["answer"], str) for r in rows)


def test_the_report_shows_a_grpo_runs_reward_per_step(tmp_path):
    from HyperSloth.outputs import report

    summary = {"method": "grpo", "reward_funcs": ["fmt", "answer"], "steps": 3, "first_step": 1,
               "step_losses": [0.0, 0.01, -0.02], "step_metrics": {"reward": [0.1, 0.4, 0.3]}}
    (tmp_path / "train_summary.json").write_text(json.dumps(summary))
    assert "reward 0.1000 -> 0.3000 (max 0.4000 at step 2; GRPO" in report.format_console(summary)
    report.write_report(tmp_path)
    assert (tmp_path / "report.png").is_file()


def test_the_seeded_sampler_draws_from_the_filtered_softmax():
    from HyperSloth.train.grpo.rollout import SeededSampler

    scores = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    generator = torch.Generator().manual_seed(0)
    sampler = SeededSampler([generator], 1, GrpoArgs())
    draws = [int(sampler(None, scores).argmax()) for _ in range(4000)]
    np.testing.assert_allclose(np.bincount(draws, minlength=4) / 4000, [0.5, 0.3, 0.15, 0.05], atol=0.025)
    top2 = SeededSampler([torch.Generator().manual_seed(1)], 1, GrpoArgs(top_k=2))
    assert {int(top2(None, scores).argmax()) for _ in range(200)} == {0, 1}
    nucleus = SeededSampler([torch.Generator().manual_seed(2)], 1, GrpoArgs(top_p=0.7))  # 0.5 + 0.3 covers 0.7
    assert {int(nucleus(None, scores).argmax()) for _ in range(200)} == {0, 1}


def test_a_prompts_completions_do_not_depend_on_the_other_prompts_in_the_batch(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from HyperSloth.train.grpo.rollout import generation_config, sample_groups

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    grpo = GrpoArgs(num_generations=3, max_completion_length=6)
    config = generation_config(grpo, pad_token_id=0, eos_token_ids=[2])
    short, long = [5, 6, 7], [8, 9, 10, 11, 12, 13, 14]
    both = sample_groups(model, [long, short], [11, 22], grpo, config)
    alone = sample_groups(model, [short], [22], grpo, config)
    assert [c.tolist() for c in both[1]] == [c.tolist() for c in alone[0]]  # padded beside `long` or not
    assert len({tuple(c.tolist()) for c in both[0]}) > 1  # a group's completions differ from each other
    assert [c.tolist() for c in sample_groups(model, [short], [23], grpo, config)[0]] != [c.tolist() for c in alone[0]]
    # padded further left to a whole multiple of 16 (a static KV cache's few shapes): the same completions
    wide = sample_groups(model, [long, short], [11, 22], grpo, config, width_multiple=16)
    assert [[c.tolist() for c in g] for g in wide] == [[c.tolist() for c in g] for g in both]


class _Layer(torch.nn.Module):
    pass


def _fake_unsloth(monkeypatch, with_graphs: bool = True) -> list[tuple]:
    """`unsloth.FastLanguageModel` and `unsloth.models._decode_graphs` as sampling_mode uses them, recording calls;
    for_training turns checkpointing on or off for every module, whatever the run chose (its own rule)."""
    import sys
    import types
    from contextlib import contextmanager

    calls: list[tuple] = []

    def for_inference(model):
        calls.append(("for_inference",))
        for m in model.modules():
            m.gradient_checkpointing = False
        model.eval()

    def for_training(model, use_gradient_checkpointing=None):
        calls.append(("for_training", use_gradient_checkpointing))
        for m in model.modules():
            m.gradient_checkpointing = use_gradient_checkpointing
        model.train()

    @contextmanager
    def rl_generation():
        calls.append(("graphs on",))
        yield
        calls.append(("graphs off",))

    unsloth = types.ModuleType("unsloth")
    unsloth.FastLanguageModel = types.SimpleNamespace(for_inference=for_inference, for_training=for_training)
    models = types.ModuleType("unsloth.models")
    if with_graphs:
        models._decode_graphs = types.SimpleNamespace(
            rl_generation=rl_generation, release_for_training=lambda model: calls.append(("release",)),
            stats=lambda m: dict(m.__dict__["_unsloth_decode_graphs"]))
    monkeypatch.setitem(sys.modules, "unsloth", unsloth)
    monkeypatch.setitem(sys.modules, "unsloth.models", models)
    return calls


@pytest.mark.parametrize("with_graphs", [True, False])
def test_sampling_on_unsloth_switches_as_its_grpo_does_and_puts_checkpointing_back(monkeypatch, logs, with_graphs):
    from HyperSloth.train.grpo.rollout import sampling_mode

    calls = _fake_unsloth(monkeypatch, with_graphs)
    model = torch.nn.Sequential(_Layer(), _Layer(), _Layer())
    model[2].__dict__["_unsloth_decode_graphs"] = {"captures": 1, "replays": 254, "eager_steps": 1, "disabled": None}
    model[0].gradient_checkpointing = True  # what the budget chose, per module
    model[1].gradient_checkpointing = False
    model.train()
    with sampling_mode(model, "unsloth"):
        assert not model.training and not model[0].gradient_checkpointing
        calls.append(("generate",))
    graphs = [("graphs on",), ("generate",), ("graphs off",), ("release",)] if with_graphs else [("generate",)]
    assert calls == [("for_inference",), *graphs, ("for_training", True)]
    assert model.training and model[0].gradient_checkpointing is True and model[1].gradient_checkpointing is False
    assert "gradient_checkpointing" not in vars(model[2]) and "gradient_checkpointing" not in vars(model)

    calls.clear()  # a failure inside (a CUDA error while sampling) still leaves the model as it trained
    with pytest.raises(RuntimeError), sampling_mode(model, "unsloth"):
        raise RuntimeError("out of memory")
    assert calls[-1] == ("for_training", True) and model.training and model[0].gradient_checkpointing is True
    graph_lines = [line.strip() for line in logs if "CUDA-graph decode" in line]  # the run's first sampling only
    line = "sampling: 254 of 255 token steps replayed from Unsloth's CUDA-graph decode (graph captures: 1)"
    assert graph_lines == ([line] if with_graphs else [])


def test_the_decode_graph_line_says_why_graphs_were_off():
    from HyperSloth.train.grpo.rollout import decode_graph_line

    assert decode_graph_line([{"captures": 0, "replays": 0, "eager_steps": 256, "disabled": "model type"}]) == (
        "sampling: 0 of 256 token steps replayed from Unsloth's CUDA-graph decode (graph captures: 0); graph decode "
        "off: model type")
    assert "did not run" in decode_graph_line([])


def test_sampling_on_transformers_is_eval_mode_and_back(monkeypatch):
    from HyperSloth.train.grpo.rollout import sampling_mode

    calls = _fake_unsloth(monkeypatch)  # present, and not to be used
    model = torch.nn.Linear(2, 2)
    with sampling_mode(model, "transformers"):
        assert not model.training
    assert model.training and calls == []
    model.eval()
    with sampling_mode(model, "transformers"):
        pass
    assert not model.training  # evaluation samples from an eval-mode model and leaves it so


def test_the_stop_check_is_deferred_on_a_gpu_only_where_no_cache_is_returned_and_put_back_after():
    from transformers.generation.utils import DeferredStopCheck

    from HyperSloth.train.grpo.rollout import deferred_stop_check

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    supported = DeferredStopCheck.is_supported
    assert not supported(cuda, None, cache_is_returned=False, is_assistant=False)  # transformers: MPS only
    with deferred_stop_check(cuda):
        assert DeferredStopCheck.is_supported(cuda, None, cache_is_returned=False, is_assistant=False)
        assert not DeferredStopCheck.is_supported(cuda, None, cache_is_returned=True, is_assistant=False)
        assert not DeferredStopCheck.is_supported(cuda, None, cache_is_returned=False, is_assistant=True)
    assert not DeferredStopCheck.is_supported(cuda, None, cache_is_returned=False, is_assistant=False)
    with pytest.raises(KeyError), deferred_stop_check(cuda):
        raise KeyError  # an error inside generate puts it back too
    assert not DeferredStopCheck.is_supported(cuda, None, cache_is_returned=False, is_assistant=False)
    with deferred_stop_check(cpu):  # no device events on the CPU: transformers' own rule stays
        assert not DeferredStopCheck.is_supported(cuda, None, cache_is_returned=False, is_assistant=False)
