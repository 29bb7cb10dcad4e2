"""A real consumer reads our GGUF files: llama.cpp (through llama-cpp-python) loads each one, tokenises a
chat-formatted text into the Hugging Face tokenizer's ids, and computes the Hugging Face model's logits.

Skipped where `llama_cpp` is not importable: CI does not build llama.cpp (docs/export.md says how it was
built and what these tests measured). Bounds: BOUNDS below.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_models import (CHAT, GEMMA4, GEMMA4_VARIANTS, GRANITE4_H, LFM2, LFM2_MOE, NEMOTRON_H, QWEN3_NEXT, SPM_IDS,
                         SPM_SPECIALS, build_arch_model, build_spm_tokenizer, gemma_style, saved_fused)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from HyperSloth.outputs.gguf import write_gguf  # noqa: E402

ARCHS = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM")
# type -> (largest max |diff| / logit range, smallest share of positions with HF's argmax). f16, f32, q8_0: issue
# 35's bounds. bf16: f16's bound on the difference; llama.cpp also rounds the activations to bf16 in its bf16
# matmuls, and near ties of this random model flip (1 of 79 positions here, top-2 margin 0.04% of the range;
# 2 of 79 on the exported LoRA run). 4/5-bit on this random 64-wide model (measured 0.49-0.81): guards
# against a regression, not a quality claim.
BOUNDS = {"f32": (2e-2, 0.99), "f16": (2e-2, 0.99), "bf16": (2e-2, 0.95), "q8_0": (None, 0.90),
          "q5_1": (None, 0.7), "q5_0": (None, 0.7), "q4_1": (None, 0.4), "q4_0": (None, 0.4)}


def chat_text(model_dir: Path) -> str:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def hf_logits(model_dir: Path, ids: list[int], weights: torch.dtype = torch.float32) -> np.ndarray:
    """The HF model's logits computed in float32, its weights first rounded to `weights` (a bf16 merge's)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.to(weights).to(torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def llama_tokens_and_logits(gguf_file: Path, text: str) -> tuple[list[int], np.ndarray]:
    llm = llama_cpp.Llama(str(gguf_file), n_ctx=512, n_batch=512, logits_all=True, n_threads=2, verbose=False)
    try:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)  # add_bos: as the GGUF says
        llm.eval(ids)
        return ids, np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def compare(model_dir: Path, gguf_file: Path, weights: torch.dtype = torch.float32) -> dict[str, float]:
    """Tokens must be equal; returns max |diff| / logit range and the share of positions with the same argmax."""
    text = chat_text(model_dir)
    hf_ids = AutoTokenizer.from_pretrained(str(model_dir))(text)["input_ids"]
    ids, ours = llama_tokens_and_logits(gguf_file, text)
    assert ids == hf_ids, f"llama.cpp tokens differ from the HF tokenizer's on {text!r}"
    reference = hf_logits(model_dir, hf_ids, weights)
    return {"max_diff_over_range": float(np.abs(ours - reference).max() / np.ptp(reference)),
            "argmax_agreement": float((ours.argmax(-1) == reference.argmax(-1)).mean()),
            "tokens": len(ids)}


def write_tensor_as(monkeypatch, tensor: str, fill) -> None:
    """The GGUF writer writes every tensor whose name ends with `tensor` as `fill` of its data (np.ones_like: a
    neutral scale, np.zeros_like: a neutral bias), to show that llama.cpp reads it."""
    from HyperSloth.outputs.gguf import writer

    loader = writer._loader

    def filled(files, part, config, arch):
        load = loader(files, part, config, arch)
        return (lambda: fill(load())) if part.name.endswith(tensor) else load

    monkeypatch.setattr(writer, "_loader", filled)


def measured_export(model: Path, tmp_path: Path, gguf_type: str, label: str) -> dict[str, float]:
    """`compare` of `model` written as `gguf_type` (tmp_path / m.gguf), printed as "`label` `gguf_type`: ..."."""
    measured = compare(model, write_gguf(model, tmp_path / "m.gguf", gguf_type))
    print(f"{label} {gguf_type}: {measured}")
    return measured


def assert_read_by_llama_cpp(model: Path, tmp_path: Path, measured: dict[str, float], label: str) -> None:
    """Written again in f32 with the caller's change in place (a monkeypatch of what the writer writes), llama.cpp's
    logits move away from transformers' by more than 10x the export's own difference (`measured`): llama.cpp reads
    what was changed."""
    changed = compare(model, write_gguf(model, tmp_path / "changed.gguf", "f32"))
    print(f"{label}: {changed} (as written: {measured})")
    assert changed["max_diff_over_range"] > 10 * measured["max_diff_over_range"], (changed, measured)


def check(measured: dict[str, float], gguf_type: str) -> None:
    max_diff, argmax = BOUNDS[gguf_type]
    assert max_diff is None or measured["max_diff_over_range"] <= max_diff, measured
    assert measured["argmax_agreement"] >= argmax, measured


@pytest.mark.parametrize("gguf_type", list(BOUNDS))
def test_llama_cpp_runs_the_tiny_model(tiny_model_dir, tmp_path, gguf_type):
    # bf16 against the model merged in bfloat16 (the export's default), whose weights the file holds exactly;
    # against float32 weights 1 of 79 near-tie positions of this random model flips (measured)
    weights = torch.bfloat16 if gguf_type == "bf16" else torch.float32
    measured = compare(tiny_model_dir, write_gguf(tiny_model_dir, tmp_path / "m.gguf", gguf_type), weights)
    print(f"tiny Qwen3 {gguf_type}: {measured}")
    check(measured, gguf_type)


@pytest.mark.parametrize("arch", [*ARCHS, "Phi3ForCausalLM"])
def test_llama_cpp_runs_each_architecture(tiny_model_dir, tmp_path, arch):
    # not named "phi3": llama.cpp gives a model so named Phi-3's special-token attributes, which needs its vocab's
    # "</s>", "<unk>", "<s>" and "<|endoftext|>" (llama-vocab.cpp); the tiny tokenizer has none of them
    model = build_arch_model(arch, tmp_path / arch.replace("Phi3", "FusedProjections"), tiny_model_dir)
    measured = measured_export(model, tmp_path, "f16", arch)
    check(measured, "f16")


@pytest.mark.parametrize("rotary_share", [1.0, 0.75])
def test_llama_cpp_runs_phi3_longrope_with_its_factors(tiny_model_dir, tmp_path, monkeypatch, rotary_share):
    """Phi-3.5 / Phi-4-mini's RoPE: LongRoPE factors on the rotated share of each head. The chat (79 tokens) is
    longer than the original context (64), so transformers takes the long factors, and llama.cpp does at n_ctx 512;
    written with the two swapped, llama.cpp's logits move away (the factors are read)."""
    from transformers import Phi3Config

    from gguf_models import SHAPE, save_random
    from HyperSloth.outputs.gguf import architectures

    rng, pairs = np.random.default_rng(0), int(16 * rotary_share) // 2
    config = Phi3Config(**SHAPE, original_max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": rotary_share,
        "long_factor": list(1 + 3 * rng.random(pairs)), "short_factor": list(1 + 0.5 * rng.random(pairs))})
    config.architectures, config.bos_token_id, config.eos_token_id, config.pad_token_id = ["Phi3ForCausalLM"], None, 2, 0
    torch.manual_seed(0)
    save_random(AutoModelForCausalLM.from_config(config, dtype=torch.float32), tmp_path / "longrope", tiny_model_dir)
    measured = measured_export(tmp_path / "longrope", tmp_path, "f32", f"Phi-3 LongRoPE, rotary share {rotary_share}")
    check(measured, "f32")
    written = architectures.phi3_longrope_factors
    monkeypatch.setattr(architectures, "phi3_longrope_factors", lambda c: written(c)[::-1])  # (short, long)
    assert_read_by_llama_cpp(tmp_path / "longrope", tmp_path, measured, "Phi-3 LongRoPE with its factors swapped")


@pytest.mark.parametrize("gguf_type", ["f32", "f16"])
def test_llama_cpp_runs_qwen35_moe(tiny_model_dir, tmp_path, gguf_type):
    """Qwen3.5-MoE's gated-delta-rule layers and its full-attention layer, experts with a shared one. f32 against
    the model as it is; f16 with room for one flipped position (measured: 0.51% of the range, 1 of 79 positions;
    not traced to a router near tie)."""
    model = build_arch_model("Qwen3_5MoeForCausalLM", tmp_path / "tiny-linear", tiny_model_dir)
    measured = measured_export(model, tmp_path, gguf_type, "Qwen3.5-MoE")
    if gguf_type == "f32":
        check(measured, "f32")
    else:
        assert measured["max_diff_over_range"] <= 2e-2 and measured["argmax_agreement"] >= 0.95, measured


@pytest.mark.parametrize("gguf_type", ["f32", "f16"])
def test_llama_cpp_runs_dense_qwen35(tiny_model_dir, tmp_path, gguf_type):
    """Qwen3.5 dense (llama.cpp's qwen35): the gated-delta-rule layers, a full-attention layer, a dense MLP."""
    model = build_arch_model("Qwen3_5ForCausalLM", tmp_path / "tiny-dense-linear", tiny_model_dir)
    measured = measured_export(model, tmp_path, gguf_type, "Qwen3.5 dense")
    check(measured, gguf_type)


def test_llama_cpp_runs_a_multimodal_gemma3s_language_model(tiny_model_dir, tmp_path):
    """Gemma3ForConditionalGeneration (Gemma 3 4B+) written as its language model (measured: 0.035% of the range,
    argmax 100%)."""
    from gguf_models import build_gemma3_multimodal

    model = build_gemma3_multimodal(tmp_path / "gemma-mm", tiny_model_dir)
    measured = measured_export(model, tmp_path, "f32", "Gemma 3 multimodal, its language model")
    check(measured, "f32")


@pytest.mark.parametrize("variant, gguf_type", [("dense", "f32"), ("dense", "f16"), ("k_eq_v", "f32"), ("moe", "f32"),
                                                ("e2b", "f32")])
def test_llama_cpp_runs_gemma4(tiny_model_dir, tmp_path, variant, gguf_type):
    """The tiny Gemma 4 (gguf_models.GEMMA4_VARIANTS: a sliding layer of window 8, past which the chat runs, then a
    full-attention layer with heads twice as wide and proportional RoPE on a quarter of them; final logits soft-capped;
    keys as values (attention_k_eq_v), 26B-A4B's expert block; E2B's per-layer embeddings and shared KV layers).
    The MoE not in f16: its near-uniform random router ties on this text closer than f16 rounding moves it (smallest
    gap between the 2nd and 3rd expert 7.9e-5, f16 shift 1.4e-4; measured 29% of the range off at that one token)."""
    model = build_arch_model(GEMMA4, tmp_path / variant, tiny_model_dir, **GEMMA4_VARIANTS[variant])
    measured = measured_export(model, tmp_path, gguf_type, f"Gemma 4 {variant}")
    check(measured, gguf_type)


@pytest.mark.parametrize("tensor", ["rope_freqs", "layer_scalar", "router.scale", "router.per_expert_scale"])
def test_llama_cpp_reads_what_gemma4_writes_beyond_the_weights(tiny_model_dir, tmp_path, monkeypatch, tensor):
    """Each of Gemma 4's own tensors is load-bearing: written as ones (rope_freqs: every pair rotated, as NeoX RoPE
    over the whole head would), llama.cpp's logits move away from transformers' by more than 10x the export's
    difference (measured: 27%, 17%, 30%, 13% of the range)."""
    from HyperSloth.outputs.gguf import gemma4

    model = build_arch_model(GEMMA4, tmp_path / "moe", tiny_model_dir, **GEMMA4_VARIANTS["moe"])
    measured = measured_export(model, tmp_path, "f32", "Gemma 4 MoE")
    if tensor == "rope_freqs":
        monkeypatch.setattr(gemma4, "rope_factors", lambda config: np.ones(16, dtype=np.float32))
    else:
        write_tensor_as(monkeypatch, tensor, np.ones_like)
    assert_read_by_llama_cpp(model, tmp_path, measured, f"Gemma 4 MoE with {tensor} written as ones")


@pytest.mark.parametrize("variant, gguf_type", [("moe", "f32"), ("moe", "f16"), ("dense", "f32"), ("tied", "f32")])
def test_llama_cpp_runs_granite4_h(tiny_model_dir, tmp_path, variant, gguf_type):
    """The tiny Granite 4.0-H (gguf_models.granite4_h_config: Mamba-2, attention without RoPE, Mamba-2; experts
    beside a shared MLP; Granite's multipliers away from 1), without experts, and with tied embeddings."""
    changes = {"moe": {}, "dense": {"num_local_experts": 0}, "tied": {"tie_word_embeddings": True}}[variant]
    model = build_arch_model(GRANITE4_H, tmp_path / variant, tiny_model_dir, **changes)
    measured = measured_export(model, tmp_path, gguf_type, f"Granite 4.0-H {variant}")
    check(measured, gguf_type)


def set_hook(monkeypatch, family: str, **hooks) -> None:
    """One family's hooks replaced for the test (architectures.FAMILIES holds the functions themselves)."""
    from dataclasses import replace

    from HyperSloth.outputs.gguf.architectures import FAMILIES

    monkeypatch.setitem(FAMILIES, family, replace(FAMILIES[family], **hooks))


@pytest.mark.parametrize("key", ["embedding_scale", "residual_scale", "attention.scale", "logit_scale"])
def test_llama_cpp_reads_granites_multipliers(tiny_model_dir, tmp_path, monkeypatch, key):
    """Each multiplier is load-bearing: written as 1, llama.cpp's logits move away from transformers' by more than
    10x the export's difference."""
    from HyperSloth.outputs.gguf import granite

    model = build_arch_model(GRANITE4_H, tmp_path / "moe", tiny_model_dir)
    measured = measured_export(model, tmp_path, "f32", "Granite 4.0-H")
    add = granite.add_hyperparameters

    def one(writer, config):
        add(writer, config)
        writer.kv_data[0][f"granitehybrid.{key}"].value = 1.0

    set_hook(monkeypatch, "granite", add_hyperparameters=one)
    assert_read_by_llama_cpp(model, tmp_path, measured, f"Granite 4.0-H with {key} written as 1")


@pytest.mark.parametrize("variant, gguf_type", [("dense", "f32"), ("dense", "f16"), ("moe", "f32"), ("moe", "f16"),
                                                ("fused", "f32")])
def test_llama_cpp_runs_nemotron_h(tiny_model_dir, tmp_path, variant, gguf_type):
    """The tiny Nemotron-H (gguf_models.nemotron_h_config: Mamba-2 in 2 groups, MLP, attention without RoPE, MLP),
    as nemotron_h; with expert blocks (sigmoid routing, a random score correction, scaling 2.5, a shared expert) as
    nemotron_h_moe, also saved with its experts fused (as transformers holds them)."""
    model = build_arch_model(NEMOTRON_H, tmp_path / variant, tiny_model_dir, moe=variant != "dense")
    if variant == "fused":
        model = saved_fused(model, tmp_path / "fused-saved")
    measured = measured_export(model, tmp_path, gguf_type, f"Nemotron-H {variant}")
    check(measured, gguf_type)


@pytest.mark.parametrize("tensor", ["e_score_correction_bias", "routed_scaling_factor"])
def test_llama_cpp_reads_nemotron_hs_routing(tiny_model_dir, tmp_path, monkeypatch, tensor):
    """The router's score correction (written as zeros) and the routed scaling factor (written as 1) are
    load-bearing: llama.cpp's logits move away from transformers' by more than 10x the export's difference."""
    from HyperSloth.outputs.gguf import nemotron_h

    model = build_arch_model(NEMOTRON_H, tmp_path / "moe", tiny_model_dir, moe=True)
    measured = measured_export(model, tmp_path, "f32", "Nemotron-H MoE")
    if tensor == "routed_scaling_factor":
        add = nemotron_h.add_hyperparameters

        def unscaled(gguf_writer, config):
            add(gguf_writer, config)
            gguf_writer.kv_data[0]["nemotron_h_moe.expert_weights_scale"].value = 1.0

        set_hook(monkeypatch, "nemotron_h", add_hyperparameters=unscaled)
    else:
        write_tensor_as(monkeypatch, tensor, np.zeros_like)
    assert_read_by_llama_cpp(model, tmp_path, measured, f"Nemotron-H MoE with {tensor} neutral")


@pytest.mark.parametrize("variant, gguf_type", [("dense", "f32"), ("dense", "f16"), ("moe", "f32"), ("moe", "f16"),
                                                ("fused", "f32")])
def test_llama_cpp_runs_lfm2(tiny_model_dir, tmp_path, variant, gguf_type):
    """The tiny LFM2 (gguf_models.lfm2_config: short convolution, attention with Q/K norms, short convolution; the
    MLP's width adjusted), as lfm2; LFM2-MoE (a dense layer, then sigmoid-routed experts with a random expert bias)
    as lfm2moe, also saved with its experts fused (as transformers holds them)."""
    model = build_arch_model(LFM2 if variant == "dense" else LFM2_MOE, tmp_path / variant, tiny_model_dir)
    if variant == "fused":
        model = saved_fused(model, tmp_path / "fused-saved")
    measured = measured_export(model, tmp_path, gguf_type, f"LFM2 {variant}")
    check(measured, gguf_type)


@pytest.mark.parametrize("tensor", ["expert_bias", "conv.conv.weight"])
def test_llama_cpp_reads_lfm2s_expert_bias_and_convolution(tiny_model_dir, tmp_path, monkeypatch, tensor):
    """The expert bias (written as zeros) and the short convolution's kernel (written as ones) are load-bearing:
    llama.cpp's logits move away from transformers' by more than 10x the export's difference."""
    model = build_arch_model(LFM2_MOE, tmp_path / "moe", tiny_model_dir)
    measured = measured_export(model, tmp_path, "f32", "LFM2-MoE")
    write_tensor_as(monkeypatch, tensor, np.zeros_like if tensor == "expert_bias" else np.ones_like)
    assert_read_by_llama_cpp(model, tmp_path, measured, f"LFM2-MoE with {tensor} neutral")


@pytest.mark.parametrize("value_heads", [4, 2])
def test_llama_cpp_runs_qwen3_next(tiny_model_dir, tmp_path, value_heads):
    """The tiny Qwen3-Next (gguf_models.qwen3_next_config: 2 gated-delta-rule layers, then gated attention; experts
    beside a gated shared expert), with twice as many value heads as key heads (grouped by key head, as llama.cpp's
    qwen3next takes them: tiled as for qwen35moe, 72% of the range off) and with as many. f32 only: this random
    model's router moves under f16 weights in transformers itself (by 6e-3, against a smallest top-2 gap of 2e-4),
    so an f16 file measures routing flips, not the export (docs/export.md)."""
    model = build_arch_model(QWEN3_NEXT, tmp_path / "next", tiny_model_dir, linear_num_value_heads=value_heads)
    measured = measured_export(model, tmp_path, "f32", f"Qwen3-Next ({value_heads} value heads)")
    check(measured, "f32")


def test_llama_cpp_runs_a_qwen35_text_model_saved_from_the_multimodal_checkpoint(tiny_model_dir, tmp_path):
    """Qwen3.5's own head shape (128 wide, a quarter rotated, MRoPE sections [11, 11, 10]) and the names a fine-tune
    of the published checkpoint is saved under. Measured: 0.06% of the range; 1 of 79 positions takes another
    argmax (f32 on both sides: a near tie of this random model), so the argmax bound leaves room for one."""
    from gguf_models import build_qwen35_from_multimodal

    model = build_qwen35_from_multimodal(tmp_path / "q35", tiny_model_dir)
    measured = measured_export(model, tmp_path, "f32", "Qwen3.5-MoE from the multimodal checkpoint")
    assert measured["max_diff_over_range"] <= 2e-2 and measured["argmax_agreement"] >= 0.95, measured


@pytest.mark.parametrize("gguf_type", ["f32", "f16"])
def test_llama_cpp_runs_glm_4_7_flash(tiny_model_dir, tmp_path, gguf_type):
    """Latent attention (llama.cpp absorbs the split kv_b_proj), sigmoid routing with a random score correction, a
    dense layer first. Written with softmax gating or without the correction, llama.cpp is 31% / 47% of the range
    off (measured)."""
    model = build_arch_model("Glm4MoeLiteForCausalLM", tmp_path / "tiny-latent", tiny_model_dir)
    measured = measured_export(model, tmp_path, gguf_type, "GLM-4.7-Flash")
    check(measured, gguf_type)


def routing_gap_and_f16_shift(model_dir: Path, ids: list[int], by_logits: bool = False) -> tuple[float, float]:
    """On `ids`: the smallest gap between the k-th and (k+1)-th router probability (k active experts) over every
    token and layer, and the largest change that rounding the weights to f16 makes to any router probability.
    `by_logits`: gpt-oss, which picks its k experts by router logit (then softmaxes the k): logits instead."""
    def router_scores(weights: torch.dtype) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        model.to(weights).to(torch.float32)
        scores = []
        for layer in model.model.layers:
            if by_logits:
                layer.mlp.router.register_forward_hook(lambda module, inputs, out: scores.append(
                    torch.nn.functional.linear(inputs[0], module.weight, module.bias)))
            else:
                layer.mlp.gate.register_forward_hook(lambda module, inputs, out: scores.append(out[0].softmax(-1)))
        with torch.no_grad():
            model(torch.tensor([ids]))
        return torch.stack(scores)

    exact, k = router_scores(torch.float32), AutoConfig.from_pretrained(str(model_dir)).num_experts_per_tok
    ranked = exact.sort(dim=-1, descending=True).values
    return float((ranked[..., k - 1] - ranked[..., k]).min()), float((router_scores(torch.float16) - exact).abs().max())


@pytest.mark.parametrize("gguf_type", ["f32", "f16"])
def test_llama_cpp_runs_qwen3_moe(tiny_model_dir, tmp_path, gguf_type):
    """The tiny Qwen3-MoE (4 experts, 2 active per token): llama.cpp's routing and experts give HF's logits."""
    model = build_arch_model("Qwen3MoeForCausalLM", tmp_path / "moe", tiny_model_dir)
    # A token whose 2nd and 3rd experts nearly tie can pick the other one under any rounding, and its logits then
    # jump (measured with experts 64 wide instead of 96: one token, gap 1.5e-4, 3.9% of the range at f16, while
    # f32 agreed to 0.05%). Here the text's smallest gap exceeds the largest change rounding the weights to f16
    # makes to a router probability, so this measures the export, not a tie (docs/export.md, MoE and rounding).
    ids = AutoTokenizer.from_pretrained(str(model))(chat_text(model))["input_ids"]
    gap, shift = routing_gap_and_f16_shift(model, ids)
    assert gap > shift, f"the router nearly ties on this text (gap {gap:.2e}, f16 shift {shift:.2e})"
    measured = compare(model, write_gguf(model, tmp_path / "m.gguf", gguf_type))
    print(f"Qwen3MoeForCausalLM {gguf_type}: {measured}, router gap {gap:.2e}, f16 shift {shift:.2e}")
    check(measured, gguf_type)


@pytest.mark.parametrize("gguf_type", ["f32", "f16"])
def test_llama_cpp_runs_gpt_oss(tiny_model_dir, tmp_path, gguf_type):
    """The tiny gpt-oss (4 biased experts, 2 active, a sliding layer of window 8 before a full one, attention sinks,
    YaRN at factor 1): llama.cpp's gpt-oss graph gives HF's logits on the 79-token chat, past the window."""
    model = build_arch_model("GptOssForCausalLM", tmp_path / "gpt-oss", tiny_model_dir)
    ids = AutoTokenizer.from_pretrained(str(model))(chat_text(model))["input_ids"]
    gap, shift = routing_gap_and_f16_shift(model, ids, by_logits=True)
    assert gap > shift, f"the router nearly ties on this text (gap {gap:.2e}, f16 shift {shift:.2e})"
    measured = compare(model, write_gguf(model, tmp_path / "m.gguf", gguf_type))
    print(f"GptOssForCausalLM {gguf_type}: {measured}, router gap {gap:.2e}, f16 shift {shift:.2e}")
    check(measured, gguf_type)


UNICODE = ("<|im_start|>user\nCafé naïve — “quotes” 😀🦙 日本語テキスト 123456 3.14 it's I'M they'll\n\n\n  \t x   y\r\n"
           "Über 10 000 Ärzte… ¿qué?<|im_end|>\n<|im_start|>assistant\n😀😀 ok<|im_end|>\n")


def with_split(model_dir: Path, out: Path, pre: str) -> Path:
    """The model with its tokenizer's pre-tokenizer swapped for Llama 3's regex split (and, as Llama 3's,
    ignore_merges: `pre` "llama-bpe") or GPT-4o's / gpt-oss's o200k split ("gpt-4o"), so llama.cpp's name for it is
    checked too."""
    import json
    import shutil

    from HyperSloth.outputs.gguf.vocab import GPT4O_REGEX, LLAMA3_REGEX

    shutil.copytree(model_dir, out)
    spec = json.loads((out / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_REGEX if pre == "llama-bpe" else GPT4O_REGEX},
         "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    spec["model"]["ignore_merges"] = pre == "llama-bpe"
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


@pytest.mark.parametrize("arch, pre", [("Qwen3ForCausalLM", "gpt-2"), ("Qwen2ForCausalLM", "qwen2"),
                                       ("Qwen3ForCausalLM", "llama-bpe"), ("GptOssForCausalLM", "gpt-4o")])
def test_llama_cpp_splits_unicode_as_hf_does(tiny_model_dir, tmp_path, arch, pre):
    """Each pre-tokenizer name llama.cpp gets: accents, emoji, CJK, digit runs, contractions, \\r\\n, tabs."""
    import gguf

    model = build_arch_model(arch, tmp_path / arch, tiny_model_dir)
    if pre in ("llama-bpe", "gpt-4o"):
        model = with_split(model, tmp_path / f"{pre}-split", pre)
    gguf_file = write_gguf(model, tmp_path / "m.gguf", "f16")
    assert gguf.GGUFReader(str(gguf_file)).fields["tokenizer.ggml.pre"].contents() == pre
    hf_ids = AutoTokenizer.from_pretrained(str(model))(UNICODE)["input_ids"]
    ids, _ = llama_tokens_and_logits(gguf_file, UNICODE)
    assert ids == hf_ids


PLAIN = "What's 12 + 30? Answer in   three words, then say 'done'.\n\tThanks! Café naïve — 😀 日本語 x  y\r\n"


def llama_cpp_run(gguf_file: Path, text: str, add_bos: bool,
                  ids: list[int] | None = None) -> tuple[list[int], np.ndarray]:
    """llama.cpp's tokens of `text`, and its logits on `ids` (on its own tokens when None)."""
    llm = llama_cpp.Llama(str(gguf_file), n_ctx=512, n_batch=512, logits_all=True, n_threads=2, verbose=False)
    try:
        tokens = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
        llm.eval(ids or tokens)
        return tokens, np.array(llm.scores[: len(ids or tokens)], dtype=np.float32)
    finally:
        llm.close()


def space_after_specials(text: str) -> str:
    """`text` with a space after each special token that text follows: what llama.cpp's SPM tokenizer encodes."""
    pattern = "(" + "|".join(re.escape(token) for token in SPM_SPECIALS) + ")"
    pieces = [piece for piece in re.split(pattern, text) if piece]
    return "".join(piece + " " if piece in SPM_SPECIALS and index + 1 < len(pieces)
                   and pieces[index + 1] not in SPM_SPECIALS else piece for index, piece in enumerate(pieces))


def test_llama_cpp_runs_a_sentencepiece_style_tokenizer(tmp_path):
    """Mistral v0.3's kind of tokenizer (BPE with byte_fallback, Metaspace) as llama.cpp's `llama` vocabulary."""
    model = build_arch_model("MistralForCausalLM", tmp_path / "mistral", build_spm_tokenizer(tmp_path / "spm"),
                             special_ids=SPM_IDS)
    gguf_file = write_gguf(model, tmp_path / "m.gguf", "f16")
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    # a plain text with BOS added as the GGUF says; characters outside the vocabulary as <0xXX> byte tokens
    assert llama_cpp_run(gguf_file, PLAIN, add_bos=True)[0] == tokenizer(PLAIN)["input_ids"]
    # the chat (its BOS from the template): llama.cpp writes a space before every text that follows a special
    # token (HF before the text's start only), so one more "▁" token after [INST] and [/INST], nothing else
    text = chat_text(model)
    hf_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    ids, ours = llama_cpp_run(gguf_file, text, add_bos=False, ids=hf_ids)
    assert ids == tokenizer(space_after_specials(text), add_special_tokens=False)["input_ids"]
    space, specials = tokenizer.convert_tokens_to_ids("▁"), set(tokenizer.convert_tokens_to_ids(list(SPM_SPECIALS)))
    extra = [i for i in range(1, len(ids)) if ids[i - 1] in specials and ids[i] == space]
    assert len(extra) == 2 and [token for i, token in enumerate(ids) if i not in extra] == hf_ids
    reference = hf_logits(model, hf_ids)  # both on HF's tokens
    measured = {"max_diff_over_range": float(np.abs(ours - reference).max() / np.ptp(reference)),
                "argmax_agreement": float((ours.argmax(-1) == reference.argmax(-1)).mean()), "tokens": len(hf_ids)}
    print(f"Mistral, SentencePiece-style tokenizer, f16: {measured}")
    check(measured, "f16")


@pytest.mark.parametrize("arch", ["Gemma3ForCausalLM", GEMMA4])
def test_llama_cpp_tokenizes_a_gemma_style_tokenizer_as_hf(tmp_path, arch):
    """Gemma 3's kind (no "▁" prepended: add_space_prefix false), Gemma 4's too: llama.cpp's tokens equal HF's on
    the chat too. Logits are not compared here: the Gemma 3 and 4 mappings are checked above, and on this text one
    position of 77 of the Gemma 3 is a near tie (top-2 margin 0.001% of the range) that f16 flips (docs/export.md)."""
    import gguf

    tokenizer_dir = gemma_style(build_spm_tokenizer(tmp_path / "spm"))
    model = build_arch_model(arch, tmp_path / "gemma", tokenizer_dir, special_ids=SPM_IDS)
    gguf_file = write_gguf(model, tmp_path / "m.gguf", "f16")
    assert gguf.GGUFReader(str(gguf_file)).fields["tokenizer.ggml.add_space_prefix"].contents() is False
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    for text in (PLAIN, chat_text(model)):
        hf_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert llama_cpp_run(gguf_file, text, add_bos=False)[0] == hf_ids
