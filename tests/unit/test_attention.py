"""fast_model_args.attention (HyperSloth.train.attention.setting): the resolution rule, what is activated in torch's
flash-impl registry when (a fake registry here), and where the choice is recorded. No flash_attn needed."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest

from HyperSloth.config import FastModelArgs, HyperConfig, TrainingArgsConfig, runtime_problems
from HyperSloth.train.attention import setting as att

# Qwen3-0.6B on an H200 with flash-attn-4 installed, CUDA graphs on, short chats.
H200 = att.AttentionFacts(cuda=True, backend="unsloth", capability_major=9, fa4_installed=True, registry=True,
                          head_dims=(128,), attention_dropout=0.0, sliding_window=False, graphed=True,
                          longest_sample=4096)


def kernel(requested: str, **facts) -> att.AttentionChoice:
    return att.resolve_attention(requested, replace(H200, **facts))


def test_auto_picks_fa4_where_graphs_remove_its_host_time_or_rows_are_long():
    assert kernel("auto").kernel == "fa4" and "CUDA graphs on" in kernel("auto").reason
    long_eager = kernel("auto", graphed=False, longest_sample=att.LONG_ROW_TOKENS)
    assert long_eager.kernel == "fa4" and "16,384-token sample" in long_eager.reason
    short_eager = kernel("auto", graphed=False, longest_sample=att.LONG_ROW_TOKENS - 1)
    assert short_eager.kernel == "flash" and "eager decoder" in short_eager.reason
    assert kernel("auto", capability_major=10).kernel == "fa4"  # Blackwell (B200) too


@pytest.mark.parametrize("facts, why", [
    ({"fa4_installed": False}, "flash-attn-4 is not installed (pip install -e .[fa4])"),
    ({"capability_major": 8}, "SM90/SM100 GPUs, this one is SM8x"),
    ({"registry": False}, "torch >= 2.11"),
    ({"head_dims": (96, 100)}, "head_dim [100]"),
    ({"capability_major": 10, "head_dims": (192,)}, "head_dim [192] is not one FA4 has on SM10x"),
    ({"attention_dropout": 0.1}, "attention dropout 0.1"),
])
def test_where_fa4_cannot_run_auto_keeps_bundled_flash_and_says_why(facts, why):
    choice = kernel("auto", **facts)
    assert choice.kernel == "flash" and why in choice.reason and choice.reason.startswith("FA4 cannot run here")
    named = kernel("fa4", **facts)  # asked for by name: the same fallback, the same reason
    assert (named.kernel, named.reason) == ("flash", choice.reason)


def test_settings_by_name_and_the_machines_without_a_flash_path():
    assert (kernel("flash").kernel, kernel("sdpa").kernel, kernel("fa4").kernel) == ("flash", "sdpa", "fa4")
    cpu = kernel("auto", cuda=False, capability_major=None, fa4_installed=False)
    assert (cpu.kernel, cpu.reason) == ("sdpa", "no CUDA device")
    assert kernel("fa4", cuda=False).kernel == "sdpa"
    transformers = kernel("auto", backend="transformers")
    assert transformers.kernel == "sdpa" and "transformers backend" in transformers.reason
    assert kernel("fa4", backend="transformers").kernel == "fa4"  # torch's flash ops where SDPA picks them
    assert kernel("fa4", backend="transformers", fa4_installed=False).kernel == "sdpa"
    with pytest.raises(ValueError, match="attention='fa3'"):
        kernel("fa3")


def test_fa4_head_dims_per_architecture():
    assert [d for d in (8, 64, 96, 128, 192, 256, 264, 100) if att.head_dim_supported(9, d)] == [8, 64, 96, 128, 192, 256]
    assert [d for d in (64, 128, 192, 256) if att.head_dim_supported(10, d)] == [64, 128, 256]


class FakeRegistry:
    """torch.nn.attention's registry as far as HyperSloth uses it, recording the calls."""

    def __init__(self, fails: Exception | None = None, active: str | None = None):
        self.calls: list[tuple[str, ...]] = []
        self.active, self.fails = active, fails

    def activate_flash_attention_impl(self, impl):
        self.calls.append(("activate", impl))
        if self.fails is not None:
            raise self.fails
        self.active = impl

    def current_flash_attention_impl(self):
        return self.active

    def restore_flash_attention_impl(self, _raise_warn=True):
        self.calls.append(("restore",))
        self.active = None


def test_fa4_is_activated_only_when_chosen_and_bundled_flash_restored_otherwise():
    registry = FakeRegistry()
    fa4 = kernel("auto")
    assert att.apply_attention(fa4, registry) == fa4 and registry.calls == [("activate", "FA4")]
    assert registry.active == "FA4"
    flash = kernel("flash")
    assert att.apply_attention(flash, registry) == flash and registry.calls[-1] == ("restore",)
    quiet = FakeRegistry()
    att.apply_attention(flash, quiet)
    assert quiet.calls == []  # nothing active: nothing to restore
    assert att.apply_attention(fa4, None) == fa4  # a torch without the registry (resolve_attention said so first)


def test_a_failed_activation_trains_on_bundled_flash_and_says_why_in_one_line():
    registry = FakeRegistry(fails=ImportError("libcute_dsl_runtime.so: cannot open shared object file\nmore"))
    choice = att.apply_attention(kernel("fa4"), registry)
    assert choice.kernel == "flash" and choice.requested == "fa4" and registry.active is None
    assert choice.reason == "FA4 activation failed (ImportError: libcute_dsl_runtime.so: cannot open shared object file)"
    assert "\n" not in choice.line()
    silent = FakeRegistry()
    silent.activate_flash_attention_impl = lambda impl: None  # returns, but nothing became active
    assert "reports None active" in att.apply_attention(kernel("auto"), silent).reason


def _description(attention: str) -> types.SimpleNamespace:
    fast = types.SimpleNamespace(attention=attention)
    return types.SimpleNamespace(hyper_config=types.SimpleNamespace(fast_model_args=fast, lora_args=None))


def _loaded(**config) -> types.SimpleNamespace:
    config = {"hidden_size": 1024, "num_attention_heads": 16, "head_dim": 128, "attention_dropout": 0.0, **config}
    return types.SimpleNamespace(model=types.SimpleNamespace(config=types.SimpleNamespace(**config)), backend="transformers")


def test_on_cpu_the_worker_resolves_sdpa_and_never_imports_flash_attn(monkeypatch):
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setenv(att.UNSLOTH_IMPL_ENV, "fa4")
    registry = FakeRegistry()
    choice = att.settle_attention(_description("auto"), _loaded(), 512, registry=registry)
    assert choice.as_record() == {"requested": "auto", "kernel": "sdpa", "reason": "no CUDA device"}
    assert registry.calls == [] and "flash_attn" not in sys.modules
    assert att.os.environ[att.UNSLOTH_IMPL_ENV] == "off"  # Unsloth's own rule never flips the choice in train()


def test_the_worker_activates_fa4_with_its_compile_cache_in_the_hypersloth_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("HYPERSLOTH_CACHE_DIR", str(tmp_path))
    for name in (att.FA4_CACHE_ENABLED_ENV, att.FA4_CACHE_DIR_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(att, "gather_facts", lambda description, loaded, longest: H200)
    registry = FakeRegistry()
    choice = att.settle_attention(_description("auto"), _loaded(), 512, registry=registry)
    assert choice.kernel == "fa4" and registry.calls == [("activate", "FA4")]
    assert att.os.environ[att.FA4_CACHE_DIR_ENV] == str(tmp_path / "fa4")
    assert att.os.environ[att.FA4_CACHE_ENABLED_ENV] == "1"
    monkeypatch.setenv(att.FA4_CACHE_DIR_ENV, "/mine")  # the user's own setting wins
    att.fa4_cache_env(tmp_path)
    assert att.os.environ[att.FA4_CACHE_DIR_ENV] == "/mine"


def test_model_head_dims_from_the_config():
    assert att.model_head_dims(_loaded().model.config) == ((128,), 0.0)
    derived = types.SimpleNamespace(hidden_size=4096, num_attention_heads=32, attention_dropout=0.1)
    assert att.model_head_dims(derived) == ((128,), 0.1)


def test_a_per_layer_config_is_read_layer_by_layer():
    """Gemma 4's sliding layers have heads of head_dim, its full-attention ones twice that (a heterogeneous config,
    whose `head_dim` transformers refuses to read whole)."""
    from HyperSloth.train.model_config import attention_heads, layer_attention_heads
    from HyperSloth.train.tiny_architectures import tiny_config

    config = tiny_config("gemma4", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.02,
                         pad_token_id=0, eos_token_id=1)
    assert layer_attention_heads(config) == [(4, 2, 16), (4, 2, 16), (4, 2, 32)]
    assert attention_heads(config) == (4, 2, 32)  # the widest layer's
    assert att.model_head_dims(config) == ((16, 32), 0.0)


def test_fa4_installed_finds_flash_attn_cute_without_importing_it(monkeypatch, tmp_path):
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    fa2 = tmp_path / "fa2" / "flash_attn"
    fa2.mkdir(parents=True)
    (fa2 / "__init__.py").write_text("raise ImportError('FlashAttention-2 would load its CUDA extension here')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "fa2"))
    assert att.fa4_installed() is False and "flash_attn" not in sys.modules
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path / "fa2")])
    fa4 = tmp_path / "fa4" / "flash_attn" / "cute"  # flash-attn-4: a namespace package holding cute/
    fa4.mkdir(parents=True)
    (fa4 / "interface.py").write_text("raise ImportError('not imported by the check')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "fa4"))
    assert att.fa4_installed() is True and "flash_attn" not in sys.modules


def test_the_setting_in_the_config(tmp_path):
    assert FastModelArgs(model_name="m").attention == "auto"
    with pytest.raises(ValueError, match="attention"):
        FastModelArgs(model_name="m", attention="fa3")
    hyper = HyperConfig(data={"dataset_name": "d"}, fast_model_args={"model_name": "m", "attention": "fa4"})
    problems = runtime_problems(hyper, TrainingArgsConfig(), cuda_device_count=0, unsloth_available=False)
    assert any("attention='fa4' needs CUDA" in p for p in problems)
    assert not runtime_problems(hyper, TrainingArgsConfig(), cuda_device_count=1, unsloth_available=True)


def test_benchmark_records_carry_the_attention_choice(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import bench_systems
    import benchmark

    record = {"requested": "fa4", "kernel": "fa4", "reason": "asked for by name"}
    out = tmp_path / "out_hypersloth-1-fa4"
    (out / "logs").mkdir(parents=True)
    (out / "train_summary.json").write_text(json.dumps({"step_seconds": [0.3], "step_losses": [1.0],
                                                        "attention": record}))
    (out / "logs" / "rank0.final.json").write_text(json.dumps({"peak_gpu_gb": 1.0}))
    raw = bench_systems.hypersloth_result(out, 1)
    a = types.SimpleNamespace(warmup=0, long_tokens=131072)
    data = {"step_tokens": [1000], "order": list(range(32)), "lengths": [10] * 32}
    assert benchmark.record_for("hypersloth-1-fa4", "short-0.6b", raw, data, a, 0.0, 1.0)["attention"] == record
    run = types.SimpleNamespace(ckpt_dir=None, work="/w", token_budget="auto", warmup=3, steps=20, long_tokens=131072,
                                exactness=False)
    argv = benchmark.system_argv("hypersloth-1-flash", "short-0.6b", run, tmp_path, "0.6b")
    assert argv[argv.index("--attention") + 1] == "flash"
    argv = benchmark.system_argv("hypersloth-1-fa4", "short-0.6b", run, tmp_path, "0.6b")
    args = benchmark.parser().parse_args(argv[2:])
    config = bench_systems.hypersloth_config(args, out)  # the system's process parses what it was started with
    assert "attention='fa4'" in config.read_text()


def test_graphed_means_what_the_trainer_checks_before_capturing(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    lora = types.SimpleNamespace(lora_dropout=0.0)
    run = types.SimpleNamespace(cuda_graphs=True, batching="packed", gradient_checkpointing=False, tiled_mlp="auto",
                                hyper_config=types.SimpleNamespace(lora_args=lora))
    assert att.decoder_graphed(run, "unsloth") is True
    assert att.decoder_graphed(run, "transformers") is False
    assert att.decoder_graphed(run, "unsloth", types.SimpleNamespace(num_experts=128)) is False  # MoE runs eager
    assert att.decoder_graphed(replace_ns(run, gradient_checkpointing="unsloth"), "unsloth") is False
    assert att.decoder_graphed(replace_ns(run, cuda_graphs=False), "unsloth") is False


def replace_ns(namespace: types.SimpleNamespace, **changes) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{**vars(namespace), **changes})


def test_the_stock_rows_record_what_unsloths_own_rule_chose(monkeypatch):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import bench_systems

    state = {"reason": "auto keeps torch's bundled flash on sm90 below hidden_size 2048 (model: 1024); ..."}
    module = types.ModuleType("unsloth.utils.flash_impl")
    module.FLASH_IMPL_STATE = state
    for name, value in (("unsloth", types.ModuleType("unsloth")), ("unsloth.utils", types.ModuleType("unsloth.utils")),
                        ("unsloth.utils.flash_impl", module)):
        monkeypatch.setitem(sys.modules, name, value)
    monkeypatch.delenv(att.UNSLOTH_IMPL_ENV, raising=False)
    assert bench_systems.unsloth_attention() == {"requested": "unsloth auto", "kernel": "flash", "reason": state["reason"]}
    state["reason"] = "FA4 active"
    assert bench_systems.unsloth_attention()["kernel"] == "fa4"
    monkeypatch.setitem(sys.modules, "unsloth.utils.flash_impl", None)  # an Unsloth without the switch
    assert bench_systems.unsloth_attention()["reason"] == "this Unsloth has no flash-impl switch"


def test_torch_fa4_entry_unpacks_what_newer_flash_attn_4_wheels_return(monkeypatch):
    """flash-attn-4 4.0.0b36 returns five values forward and four backward (with a sink); torch's FA4 entry
    unpacks two and three. Routed through HyperSloth.train.attention.fa4, torch's own run functions get theirs."""
    torch = pytest.importorskip("torch")
    fa4 = pytest.importorskip("torch.nn.attention._fa4")
    from torch.nn.attention import _registry

    from HyperSloth.train.attention import fa4 as ours

    out, lse, dq, dk, dv = (torch.full((2,), float(i)) for i in range(5))
    calls = []

    def fwd(q, k, v, **kwargs):
        calls.append(("fwd", kwargs["return_lse"], kwargs["cu_seqlens_q"]))
        assert kwargs.get("window_size_left") is None  # aten's -1: FA4 would read causal + (-1, 0) as local
        return out, lse, None, None, None

    def bwd(q, k, v, o, do, lse_, **kwargs):
        calls.append(("bwd", kwargs["causal"]))
        return dq, dk, dv, torch.zeros(1)

    monkeypatch.setitem(sys.modules, ours.FA4_MODULE, types.SimpleNamespace(_flash_attn_fwd=fwd, _flash_attn_bwd=bwd))
    monkeypatch.setitem(_registry._FLASH_ATTENTION_IMPLS, "FA4", _registry._FLASH_ATTENTION_IMPLS.get("FA4"))
    assert ours.route_torch_fa4_here()
    assert _registry._FLASH_ATTENTION_IMPLS["FA4"] is ours._register  # activation stays torch's own
    registered = {}

    def torch_registration(module_path):
        registered.update(module_path=module_path, backward=fa4._fa4_flash_attention_backward_impl)
        return "handle"

    original_backward = fa4._fa4_flash_attention_backward_impl
    monkeypatch.setattr(fa4, "register_flash_attention_fa4", torch_registration)
    assert ours._register() == "handle" and registered["module_path"] == "HyperSloth.train.attention.fa4"
    assert registered["backward"] is not original_backward and fa4._fa4_flash_attention_backward_impl is original_backward
    monkeypatch.setattr(fa4, "_FA4_MODULE_PATH", "HyperSloth.train.attention.fa4")  # what that activation sets
    q = torch.zeros(3, 2, 4)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    got = fa4._fa4_run_forward(q, q, q, cu, cu, 3, 3, None, True, -1, 0, None)
    assert [t.tolist() for t in got] == [out.tolist(), lse.tolist()]
    grads = fa4._fa4_run_backward(q, q, q, q, q, lse, cu, cu, None, True, -1, 0)
    assert [t.tolist() for t in grads] == [dq.tolist(), dk.tolist(), dv.tolist()]
    assert calls == [("fwd", True, cu), ("bwd", True)]
    # torch 2.11 hands the module aten's window as it is (2.13 turns -1 into None first): the module turns it
    ours._flash_attn_fwd(q, q, q, return_lse=True, cu_seqlens_q=cu, window_size_left=-1, window_size_right=0)
    assert len(calls) == 3  # the fake forward asserted window_size_left is None


@pytest.mark.parametrize("is_causal, window, passed", [
    (True, (-1, 0), (None, None)),  # aten's causal: torch 2.11's FA4 backward refused it as "windowed"
    (False, (-1, -1), (None, None)),  # full attention
    (True, (None, None), (None, None)),
    (True, (4096, 0), (4096, 0)),  # a real sliding window reaches torch's check as it is
])
def test_fa4_backward_gets_plain_causal_windows_as_none(is_causal, window, passed):
    from HyperSloth.train.attention.fa4 import plain_causal_windows_as_none

    seen = []
    backward = plain_causal_windows_as_none(lambda *a, **k: seen.append((a[11], k["window_size_left"], k["window_size_right"])))
    backward(*range(11), is_causal, 0, 0, scale=None, window_size_left=window[0], window_size_right=window[1])
    assert seen == [(is_causal, *passed)]


def test_aten_no_limit_window_reaches_fa4_as_none():
    from HyperSloth.train.attention.fa4 import fa4_windows

    assert fa4_windows({"window_size_left": -1, "window_size_right": 0}) == {"window_size_left": None, "window_size_right": 0}
    assert fa4_windows({"window_size_left": -1, "window_size_right": -1}) == {"window_size_left": None, "window_size_right": None}
    assert fa4_windows({"window_size_left": 128, "window_size_right": 0}) == {"window_size_left": 128, "window_size_right": 0}


def checked(found):
    """A check as train/attention/fa4.agreement_check behaves: FA4 activated, `found` returned."""
    def check(registry):
        registry.activate_flash_attention_impl("FA4")
        return found
    return check


def test_fa4_that_disagrees_with_bundled_flash_trains_on_bundled_flash_and_says_why():
    from HyperSloth.train.attention.fa4 import FA4Check

    registry = FakeRegistry()
    wrong = checked(FA4Check("FA4's dq differs by 2.01e+03 (bf16 allows 0.2)"))
    choice = att.apply_attention(att.AttentionChoice("fa4", "fa4", "asked for by name"), registry, wrong)
    assert choice.kernel == "flash" and "dq differs by 2.01e+03" in choice.reason
    assert registry.calls == [("activate", "FA4"), ("restore",)] and registry.current_flash_attention_impl() is None


@pytest.mark.parametrize("requested, fa4_ms, kernel", [
    ("auto", 0.76, "fa4"),  # the H200's 0.6B heads, graphed: 2.2x
    ("auto", 1.60, "flash"),  # 3% faster is not enough for auto
    ("auto", 2.00, "flash"),
    ("fa4", 2.00, "fa4"),  # asked for by name: timed and said, not overruled
])
def test_auto_keeps_fa4_only_where_it_measured_faster_here(requested, fa4_ms, kernel):
    from HyperSloth.train.attention.fa4 import FA4Check

    registry = FakeRegistry()
    found = FA4Check(None, flash_ms=1.65, fa4_ms=fa4_ms, row_tokens=8192, graphed=True, segments=40)
    choice = att.apply_attention(att.AttentionChoice(requested, "fa4", "CUDA-graphed decoder"), registry, checked(found))
    assert choice.kernel == kernel
    assert f"FA4 {fa4_ms:.2f} ms against bundled flash 1.65 ms" in choice.reason
    assert "a packed row of 8,192 tokens, graphed" in choice.reason
    assert registry.current_flash_attention_impl() == ("FA4" if kernel == "fa4" else None)


def test_the_timed_row_is_chat_segments_of_the_asked_size():
    from HyperSloth.train.attention.fa4 import CHECK_LENGTHS, timed_lengths

    row = timed_lengths(CHECK_LENGTHS, 8192)
    assert sum(row) == 8192 and all(n > 0 for n in row) and row[:5] == list(CHECK_LENGTHS)
    assert timed_lengths((1000,), 2500) == [1000, 1000, 500]


@pytest.mark.parametrize("graphed, longest, row", [
    (True, 900, "chats"),  # short chats, graphed: a packed row as the graphs replay
    (True, 40_000, "chats"),  # graphed rows hold packed samples whatever the longest one
    (False, 900, "chats"),
    (False, 262_144, [32_768]),  # one long sample, eager: one sample, capped
    (False, 20_000, [20_000]),
])
def test_the_check_times_the_row_the_run_will_attend(graphed, longest, row):
    """The H200 gave FA4 0.60 / 1.07 / 0.95 ms eager on an 8k chat row in three runs, 0.41 graphed; one 131k
    sample 2x faster: the check times the regime and the row the run has."""
    from HyperSloth.train.attention.fa4 import timed_lengths, timed_row

    assert timed_row(graphed, longest, att.LONG_ROW_TOKENS) == (timed_lengths() if row == "chats" else row)


def test_attention_heads_from_the_config():
    from HyperSloth.train.model_config import attention_heads

    gqa = types.SimpleNamespace(hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    assert attention_heads(gqa) == (16, 8, 128)
    mha = types.SimpleNamespace(hidden_size=4096, num_attention_heads=32)
    assert attention_heads(mha) == (32, 32, 128)


def test_fa4_on_one_rank_only_is_bundled_flash_on_every_rank(monkeypatch, tmp_path):
    monkeypatch.setenv("HYPERSLOTH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(att, "gather_facts", lambda description, loaded, longest: H200)
    registry = FakeRegistry()
    asked = []
    choice = att.settle_attention(_description("auto"), _loaded(), 512, registry=registry,
                                  every_rank=lambda ok: asked.append(ok) or False)
    assert asked == [True] and choice.kernel == "flash" and "not chosen on every rank" in choice.reason
    assert registry.calls == [("activate", "FA4"), ("restore",)]
    agreed = att.settle_attention(_description("auto"), _loaded(), 512, registry=FakeRegistry(), every_rank=lambda ok: ok)
    assert agreed.kernel == "fa4"


def test_sliding_window_models_keep_bundled_flash():
    """torch 2.11's FA4 backward refuses any window: a model with sliding-window layers would fail its first
    backward, and the check at start tries plain causal rows only."""
    choice = att.resolve_attention("auto", replace(H200, sliding_window=True))
    assert choice.kernel == "flash" and "sliding-window attention layers" in choice.reason
    by_name = att.resolve_attention("fa4", replace(H200, sliding_window=True))
    assert by_name.kernel == "flash" and "FA4 cannot run here" in by_name.reason
    gemma = types.SimpleNamespace(layer_types=["sliding_attention", "full_attention"], sliding_window=512)
    qwen = types.SimpleNamespace(layer_types=["full_attention"] * 2, sliding_window=4096, use_sliding_window=False)
    mistral = types.SimpleNamespace(sliding_window=4096)
    assert [att.has_sliding_window(c) for c in (gemma, qwen, mistral, types.SimpleNamespace())] == [True, False, True, False]
