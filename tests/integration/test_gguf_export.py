"""`hypersloth-export RUN --gguf TYPE` on a finished tiny-model run (a tiny Qwen3 with a LoRA whose B weights are
random, so the merge changes the model): OUT/adapter, OUT/merged, OUT/gguf/<run>-<TYPE>.gguf and its Modelfile;
the GGUF holds the *merged* weights; a wrong type or an architecture llama.cpp cannot run writes nothing. The same
for a tiny Qwen3-MoE and a tiny gpt-oss whose experts carry adapters (merged into every expert, stacked in the GGUF
per layer; gpt-oss's tied embeddings written as its output too), a tiny Phi-3 with adapters on its fused
projections, a tiny Qwen3.5-MoE with adapters on its linear attention and experts (also as Qwen3.5-35B-A3B is
published, a vision tower around it: its language model is written), a tiny dense Qwen3.5, a tiny GLM-4.7-Flash
with adapters on its latent attention, a tiny Gemma 4 and Gemma 4 MoE as published (multimodal; their language
model is written), a tiny Granite 4.0-H with adapters on its Mamba-2 layer, attention and experts, and a tiny
Nemotron-H MoE likewise (its experts stacked per layer), a tiny LFM2 with adapters on its short convolutions'
projections, attention and MLPs, a tiny LFM2-MoE with adapters on its experts too (stacked per layer), and a tiny
Qwen3-Next with adapters on its linear attention (the fused in_proj_qkvz split in two), attention and experts.
With llama-cpp-python importable, llama.cpp also runs the exported files against the merged models."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf = pytest.importorskip("gguf")

from HyperSloth.cli.export import main as export_main  # noqa: E402
from HyperSloth.config import DataConfig, FastModelArgs, HyperConfig, LoraArgs, TrainingArgsConfig  # noqa: E402
from HyperSloth.train.lora.targets import resolve_targets  # noqa: E402
from HyperSloth.train.tiny_model import build_tiny_model  # noqa: E402

CHAT = [{"role": "user", "content": "Name three colours, please."},
        {"role": "assistant", "content": "Red, green and blue."}]


def make_run(run_dir: Path, base: Path, *, experts: bool = False, without: tuple[str, ...] = ()) -> Path:
    """A run folder as training leaves it: adapter, tokenizer, hypersloth_config.json. `experts`: the targets
    training resolves for an MoE (its linear layers and the experts' fused parameters, but the modules `without`
    names), else all-linear."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if experts:
        targets = resolve_targets(model, None)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=[name for name in targets.modules if name not in without],
                          target_parameters=list(targets.parameters),
                          exclude_modules=list(targets.excluded) or None)  # a multimodal model's tower
    else:
        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    model.save_pretrained(str(run_dir))
    AutoTokenizer.from_pretrained(str(base)).save_pretrained(str(run_dir))
    hyper = HyperConfig(data=DataConfig(dataset_name="sample-chat"), fast_model_args=FastModelArgs(model_name=str(base)),
                        lora_args=LoraArgs(r=4, lora_alpha=8))
    (run_dir / "hypersloth_config.json").write_text(json.dumps({
        "source_path": str(run_dir / "cfg.py"), "hyper_config": hyper.model_dump(),
        "training_config": TrainingArgsConfig(output_dir=str(run_dir)).model_dump()}))
    return run_dir


@pytest.fixture(scope="module")
def exported(tiny_model_dir, tmp_path_factory) -> Path:
    """One CLI export of the run in q8_0 (merged in float32), shared by the tests below."""
    run = make_run(tmp_path_factory.mktemp("runs") / "run", tiny_model_dir)
    out = run.parent / "out"
    export_main([str(run), "--out", str(out), "--gguf", "q8_0", "--dtype", "float32"])
    return out


def export_tiny(tmp_path_factory, architecture: str, name: str) -> tuple[Path, Path]:
    """(base, OUT): one CLI export in f32 of a run of the tiny `architecture` model (`build_tiny_model`) with the
    adapters training puts on it (its experts too), merged in float32, so the GGUF holds the merged weights exactly
    and llama.cpp's routing meets no rounding. The run folder is NAME-run, its base tiny-NAME."""
    root = tmp_path_factory.mktemp(name)
    base = build_tiny_model(root / f"tiny-{name}", architecture=architecture)
    run = make_run(root / f"{name}-run", base, experts=True)
    export_main([str(run), "--out", str(root / "out"), "--gguf", "f32", "--dtype", "float32"])
    return base, root / "out"


def read_export(base: Path, out: Path, gguf_name: str, arch: str) -> tuple[dict, dict, dict]:
    """The GGUF's tensors (its architecture checked to be `arch`), the merged and the base weights."""
    reader = gguf.GGUFReader(str(out / "gguf" / gguf_name))
    assert reader.fields["general.architecture"].contents() == arch
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    return tensors, load_file(str(out / "merged" / "model.safetensors")), load_file(str(base / "model.safetensors"))


def assert_folded(tensors: dict, merged: dict, before: dict, hf: str, gguf_name: str | None) -> None:
    """The run's adapters changed the merged tensor `hf` (by more than 1e-3), and the GGUF holds it exactly as merged
    under `gguf_name` (None: the GGUF stores it otherwise, checked apart)."""
    assert np.abs(merged[hf] - before[hf]).max() > 1e-3, hf  # the adapters were folded in
    if gguf_name is not None:
        np.testing.assert_array_equal(tensors[gguf_name], merged[hf], err_msg=gguf_name)


@pytest.fixture(scope="module")
def exported_moe(tmp_path_factory) -> tuple[Path, Path]:
    """(base, OUT): one CLI export of a tiny Qwen3-MoE run with adapters on its experts, in f32 from a float32
    merge, so the GGUF holds the merged weights exactly and llama.cpp's routing meets no rounding."""
    return export_tiny(tmp_path_factory, "qwen3_moe", "moe")


@pytest.fixture(scope="module")
def exported_gpt_oss(tmp_path_factory) -> tuple[Path, Path]:
    """(base, OUT): the same for a tiny gpt-oss (tied embeddings, biased experts stored (in, out))."""
    return export_tiny(tmp_path_factory, "gpt_oss", "gpt-oss")


@pytest.fixture(scope="module")
def exported_phi3(tmp_path_factory) -> tuple[Path, Path]:
    """(base, OUT): the same for a tiny Phi-3, its adapters on the fused qkv_proj and gate_up_proj (the targets
    training resolves). Not named "phi3": llama.cpp looks up Phi-3's own special tokens in a model so named."""
    return export_tiny(tmp_path_factory, "phi3", "fused")


def test_the_phi3_gguf_holds_the_merged_fused_projections(exported_phi3):
    base, out = exported_phi3
    tensors, merged, before = read_export(base, out, "fused-run-f32.gguf", "phi3")
    for layer in (0, 1):
        for hf, name in (("self_attn.qkv_proj", "attn_qkv"), ("mlp.gate_up_proj", "ffn_up")):
            assert_folded(tensors, merged, before, f"model.layers.{layer}.{hf}.weight", f"blk.{layer}.{name}.weight")


def test_llama_cpp_agrees_with_the_merged_phi3(exported_phi3):
    assert_llama_cpp_agrees(exported_phi3[1], "fused-run-f32.gguf", "Phi-3 LoRA run f32")


@pytest.fixture(scope="module")
def exported_qwen35(tmp_path_factory) -> tuple[Path, Path]:
    """(base, OUT): the same for a tiny Qwen3.5-MoE, adapters on its linear attention, attention and experts."""
    return export_tiny(tmp_path_factory, "qwen3_5_moe", "qwen35")


def test_the_qwen35_gguf_holds_the_merged_linear_attention_and_experts(exported_qwen35):
    base, out = exported_qwen35
    tensors, merged, before = read_export(base, out, "qwen35-run-f32.gguf", "qwen35moe")
    z = "model.layers.0.linear_attn.in_proj_z.weight"
    assert np.abs(merged[z] - before[z]).max() > 1e-3  # the adapters were folded in
    config = json.loads((base / "config.json").read_text())
    keys, per_key = config["linear_num_key_heads"], config["linear_num_value_heads"] // config["linear_num_key_heads"]
    assert per_key > 1  # value heads tiled: from grouped by key head (llama.cpp's _reorder_v_heads)
    width = config["linear_value_head_dim"]
    tiled = merged[z].reshape(keys, per_key, width, -1).swapaxes(0, 1).reshape(merged[z].shape)
    np.testing.assert_array_equal(tensors["blk.0.attn_gate.weight"], tiled)
    down = [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(4)]  # saved one tensor per expert
    assert all(np.abs(merged[name] - before[name]).max() > 1e-3 for name in down)
    np.testing.assert_array_equal(tensors["blk.0.ffn_down_exps.weight"], np.stack([merged[name] for name in down]))


def test_llama_cpp_agrees_with_the_merged_qwen35(exported_qwen35):
    assert_llama_cpp_agrees(exported_qwen35[1], "qwen35-run-f32.gguf", "Qwen3.5-MoE LoRA run f32")


@pytest.fixture(scope="module")
def exported_qwen35_dense(tmp_path_factory) -> tuple[Path, Path]:
    """(base, OUT): the same for a tiny dense Qwen3.5 (Qwen3.5-0.8B to 27B), adapters on its linear attention,
    attention and MLP."""
    return export_tiny(tmp_path_factory, "qwen3_5", "qwen35-dense")


def test_the_dense_qwen35_gguf_holds_the_merged_linear_attention_and_mlp(exported_qwen35_dense):
    base, out = exported_qwen35_dense
    tensors, merged, before = read_export(base, out, "qwen35-dense-run-f32.gguf", "qwen35")
    for hf, name in (("linear_attn.out_proj", None), ("mlp.down_proj", "ffn_down")):
        assert_folded(tensors, merged, before, f"model.layers.0.{hf}.weight", name and f"blk.0.{name}.weight")


def test_llama_cpp_agrees_with_the_merged_dense_qwen35(exported_qwen35_dense):
    assert_llama_cpp_agrees(exported_qwen35_dense[1], "qwen35-dense-run-f32.gguf", "Qwen3.5 dense LoRA run f32")


@pytest.fixture(scope="module")
def exported_qwen35_mm(tmp_path_factory) -> tuple[Path, Path]:
    """(base, OUT): the same for a tiny Qwen3.5-MoE as it is published (Qwen3_5MoeForConditionalGeneration: a
    vision tower around the text model), trained as its text model (AutoModelForCausalLM loads that part)."""
    return export_tiny(tmp_path_factory, "qwen3_5_moe_mm", "qwen35-mm")


def test_a_run_on_the_published_qwen35_layout_exports_its_language_model(exported_qwen35_mm):
    """Before, --gguf refused such a run by the base model's class name; the merge keeps the checkpoint's own
    names (`model.language_model.layers...`) and leaves the vision tower out, and the GGUF is the text model."""
    base, out = exported_qwen35_mm
    tensors, merged, before = read_export(base, out, "qwen35-mm-run-f32.gguf", "qwen35moe")
    assert any(name.startswith("model.visual.") for name in before) and not any("visual" in name for name in merged)
    assert not any(name.startswith(("v.", "mm.")) for name in tensors)  # llama.cpp's vision tensors: an mmproj's
    z = "model.language_model.layers.0.linear_attn.in_proj_z.weight"
    assert np.abs(merged[z] - before[z]).max() > 1e-3  # the adapters were folded in
    np.testing.assert_array_equal(tensors["token_embd.weight"], merged["model.language_model.embed_tokens.weight"])
    down = [f"model.language_model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(4)]
    np.testing.assert_array_equal(tensors["blk.0.ffn_down_exps.weight"], np.stack([merged[name] for name in down]))


def test_llama_cpp_agrees_with_the_merged_published_qwen35(exported_qwen35_mm):
    assert_llama_cpp_agrees(exported_qwen35_mm[1], "qwen35-mm-run-f32.gguf", "Qwen3.5-MoE (published layout) f32")


@pytest.fixture(scope="module")
def exported_gemma4(tmp_path_factory) -> tuple[Path, Path]:
    """(base, OUT): the same for a tiny Gemma 4 as it is published (Gemma4ForConditionalGeneration: a vision tower
    around the text model), adapters on its attention and MLP (the tower's own linears excluded, as training does)."""
    return export_tiny(tmp_path_factory, "gemma4", "gemma4")


def test_a_run_on_the_published_gemma4_layout_exports_its_language_model(exported_gemma4):
    """Before, --gguf refused a run on Gemma 4 by the base model's class name. The merge keeps the tower (and the
    `model.language_model.*` names); the GGUF is llama.cpp's gemma4, the language model alone."""
    base, out = exported_gemma4
    tensors, merged, before = read_export(base, out, "gemma4-run-f32.gguf", "gemma4")
    assert any(name.startswith("model.vision_tower.") for name in merged)
    assert not any(name.startswith(("v.", "mm.")) for name in tensors)  # llama.cpp's vision tensors: an mmproj's
    for layer in (0, 1):  # a sliding layer, then a full-attention one with heads twice as wide
        for hf, name in (("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("mlp.down_proj", "ffn_down")):
            assert_folded(tensors, merged, before, f"model.language_model.layers.{layer}.{hf}.weight",
                          f"blk.{layer}.{name}.weight")
        np.testing.assert_array_equal(tensors[f"blk.{layer}.layer_output_scale.weight"],
                                      merged[f"model.language_model.layers.{layer}.layer_scalar"])
    assert tensors["blk.1.attn_q.weight"].shape == (2 * tensors["blk.0.attn_q.weight"].shape[0], 64)


def test_llama_cpp_agrees_with_the_merged_published_gemma4(exported_gemma4):
    assert_llama_cpp_agrees(exported_gemma4[1], "gemma4-run-f32.gguf", "Gemma 4 (published layout) LoRA run f32")


@pytest.fixture(scope="module")
def exported_gemma4_moe(tmp_path_factory) -> tuple[Path, Path]:
    """(base, OUT): the same for a tiny Gemma 4 MoE as published (26B-A4B's layout), adapters on its experts too."""
    return export_tiny(tmp_path_factory, "gemma4_moe", "gemma4-moe")


def test_the_gemma4_moe_gguf_holds_the_merged_fused_experts(exported_gemma4_moe):
    base, out = exported_gemma4_moe
    tensors, merged, before = read_export(base, out, "gemma4-moe-run-f32.gguf", "gemma4")
    for layer in (0, 1):
        stem = f"model.language_model.layers.{layer}"
        for hf, name in (("experts.gate_up_proj", "ffn_gate_up_exps.weight"),
                         ("experts.down_proj", "ffn_down_exps.weight")):
            assert_folded(tensors, merged, before, f"{stem}.{hf}", f"blk.{layer}.{name}")
        np.testing.assert_array_equal(tensors[f"blk.{layer}.ffn_gate_inp.scale"], merged[f"{stem}.router.scale"])
        np.testing.assert_array_equal(tensors[f"blk.{layer}.ffn_down_exps.scale"],
                                      merged[f"{stem}.router.per_expert_scale"])


def test_llama_cpp_agrees_with_the_merged_gemma4_moe(exported_gemma4_moe):
    assert_llama_cpp_agrees(exported_gemma4_moe[1], "gemma4-moe-run-f32.gguf",
                            "Gemma 4 MoE (published layout) LoRA run f32")


@pytest.fixture(scope="module")
def exported_granite(tmp_path_factory) -> tuple[Path, Path]:
    """(base, OUT): the same for a tiny Granite 4.0-H (a Mamba-2 layer, then attention without RoPE; experts beside a
    shared MLP), adapters on its Mamba input projection, attention, shared MLP and fused experts."""
    return export_tiny(tmp_path_factory, "granite4_h", "granite")


def test_a_run_on_granite4_h_exports_the_merged_mamba_attention_and_experts(exported_granite):
    """Before, --gguf refused a run on Granite 4.0-H by the base model's class name. The GGUF is llama.cpp's
    granitehybrid; the merged Mamba projections as they are, the merged fused experts and shared MLP split into gate
    and up, the conv and A as llama.cpp reads them."""
    base, out = exported_granite
    tensors, merged, before = read_export(base, out, "granite-run-f32.gguf", "granitehybrid")
    config = json.loads((base / "config.json").read_text())
    assert config["layer_types"] == ["linear_attention", "full_attention"]
    # the Mamba layer's out_proj has no adapter (its kernel takes the weight directly): written as it is
    np.testing.assert_array_equal(tensors["blk.0.ssm_out.weight"], merged["model.layers.0.mamba.out_proj.weight"])
    for hf, name in (("layers.0.mamba.in_proj.weight", "blk.0.ssm_in.weight"),
                     ("layers.1.self_attn.v_proj.weight", "blk.1.attn_v.weight"),
                     ("layers.1.self_attn.o_proj.weight", "blk.1.attn_output.weight"),
                     ("layers.0.block_sparse_moe.output_linear.weight", "blk.0.ffn_down_exps.weight"),
                     ("layers.1.shared_mlp.output_linear.weight", "blk.1.ffn_down_shexp.weight")):
        assert_folded(tensors, merged, before, f"model.{hf}", name)
    for layer in (0, 1):
        experts = merged[f"model.layers.{layer}.block_sparse_moe.input_linear.weight"]
        shared = merged[f"model.layers.{layer}.shared_mlp.input_linear.weight"]
        assert np.abs(experts - before[f"model.layers.{layer}.block_sparse_moe.input_linear.weight"]).max() > 1e-3
        width, shared_width = experts.shape[1] // 2, shared.shape[0] // 2
        np.testing.assert_array_equal(tensors[f"blk.{layer}.ffn_gate_exps.weight"], experts[:, :width])
        np.testing.assert_array_equal(tensors[f"blk.{layer}.ffn_up_exps.weight"], experts[:, width:])
        np.testing.assert_array_equal(tensors[f"blk.{layer}.ffn_gate_shexp.weight"], shared[:shared_width])
        np.testing.assert_array_equal(tensors[f"blk.{layer}.ffn_up_shexp.weight"], shared[shared_width:])
    conv = merged["model.layers.0.mamba.conv1d.weight"]  # (channels, 1, kernel)
    np.testing.assert_array_equal(tensors["blk.0.ssm_conv1d.weight"], conv[:, 0])
    np.testing.assert_allclose(tensors["blk.0.ssm_a"], -np.exp(merged["model.layers.0.mamba.A_log"])[:, None],
                               rtol=1e-6)


def test_llama_cpp_agrees_with_the_merged_granite4_h(exported_granite):
    assert_llama_cpp_agrees(exported_granite[1], "granite-run-f32.gguf", "Granite 4.0-H LoRA run f32")


@pytest.fixture(scope="module")
def exported_nemotron_h(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(base, OUT): the same for a tiny Nemotron-H MoE (blocks of Mamba-2 in 2 groups, experts, attention without
    RoPE, experts; built here, as hypersloth-tiny-model has no Nemotron-H), adapters on its Mamba projections,
    attention, shared expert and experts."""
    from transformers import NemotronHConfig

    root = tmp_path_factory.mktemp("nemotron-h")
    config = NemotronHConfig(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             max_position_embeddings=256, layers_block_type=["mamba", "moe", "attention", "moe"],
                             mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16,
                             n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                             moe_shared_expert_intermediate_size=64, layer_norm_epsilon=1e-6, eos_token_id=2,
                             pad_token_id=0, bos_token_id=None)
    config.architectures = ["NemotronHForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(root / "tiny-nemotron-h"))
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(str(root / "tiny-nemotron-h"))
    # PEFT refuses adapters on a Nemotron-H's Mamba out_proj (and conv1d), which resolve_targets names
    run = make_run(root / "nemotron-h-run", root / "tiny-nemotron-h", experts=True, without=("out_proj", "conv1d"))
    export_main([str(run), "--out", str(root / "out"), "--gguf", "f32", "--dtype", "float32"])
    return root / "tiny-nemotron-h", root / "out"


def test_a_run_on_nemotron_h_exports_the_merged_mixers_and_stacked_experts(exported_nemotron_h):
    base, out = exported_nemotron_h
    tensors, merged, before = read_export(base, out, "nemotron-h-run-f32.gguf", "nemotron_h_moe")
    for hf, name in (("layers.0.mixer.in_proj.weight", "blk.0.ssm_in.weight"),
                     ("layers.2.mixer.q_proj.weight", None), ("layers.2.mixer.v_proj.weight", "blk.2.attn_v.weight"),
                     ("layers.1.mixer.shared_experts.up_proj.weight", "blk.1.ffn_up_shexp.weight")):
        assert_folded(tensors, merged, before, f"backbone.{hf}", name)
    for layer in (1, 3):
        for proj in ("up", "down"):
            stacked = np.stack([merged[f"backbone.layers.{layer}.mixer.experts.{expert}.{proj}_proj.weight"]
                                for expert in range(4)])
            first = f"backbone.layers.{layer}.mixer.experts.0.{proj}_proj.weight"
            assert np.abs(merged[first] - before[first]).max() > 1e-3
            np.testing.assert_array_equal(tensors[f"blk.{layer}.ffn_{proj}_exps.weight"], stacked)


def test_llama_cpp_agrees_with_the_merged_nemotron_h(exported_nemotron_h):
    assert_llama_cpp_agrees(exported_nemotron_h[1], "nemotron-h-run-f32.gguf", "Nemotron-H MoE LoRA run f32")


@pytest.fixture(scope="module")
def exported_lfm2(tmp_path_factory) -> tuple[Path, Path]:
    """(base, OUT): the same for a tiny LFM2 (a short-convolution layer, then attention), adapters on the
    convolution's in_proj / out_proj, the attention and the MLPs."""
    return export_tiny(tmp_path_factory, "lfm2", "lfm2")


@pytest.fixture(scope="module")
def exported_lfm2_moe(tmp_path_factory) -> tuple[Path, Path]:
    """(base, OUT): the same for a tiny LFM2-MoE (its first layer dense, the second's experts), adapters on its
    experts too."""
    return export_tiny(tmp_path_factory, "lfm2_moe", "lfm2-moe")


def test_a_run_on_lfm2_exports_the_merged_convolution_attention_and_mlp(exported_lfm2):
    """Before, --gguf refused a run on LFM2 by the base model's class name. The GGUF is llama.cpp's lfm2; the merged
    projections as they are, the convolution's kernel (no adapter: a Conv1d) as (channels, taps)."""
    base, out = exported_lfm2
    tensors, merged, before = read_export(base, out, "lfm2-run-f32.gguf", "lfm2")
    for hf, name in (("layers.0.conv.in_proj.weight", "blk.0.shortconv.in_proj.weight"),
                     ("layers.0.conv.out_proj.weight", "blk.0.shortconv.out_proj.weight"),
                     ("layers.0.feed_forward.w1.weight", "blk.0.ffn_gate.weight"),
                     ("layers.1.self_attn.q_proj.weight", "blk.1.attn_q.weight"),
                     ("layers.1.self_attn.out_proj.weight", "blk.1.attn_output.weight"),
                     ("layers.1.feed_forward.w2.weight", "blk.1.ffn_down.weight")):
        assert_folded(tensors, merged, before, f"model.{hf}", name)
    np.testing.assert_array_equal(tensors["blk.0.shortconv.conv.weight"],
                                  merged["model.layers.0.conv.conv.weight"][:, 0])


def test_llama_cpp_agrees_with_the_merged_lfm2(exported_lfm2):
    assert_llama_cpp_agrees(exported_lfm2[1], "lfm2-run-f32.gguf", "LFM2 LoRA run f32")


def test_a_run_on_lfm2_moe_exports_the_merged_stacked_experts(exported_lfm2_moe):
    base, out = exported_lfm2_moe
    tensors, merged, before = read_export(base, out, "lfm2-moe-run-f32.gguf", "lfm2moe")
    stem = "model.layers.1.feed_forward"
    for proj, name in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
        experts = [merged[f"{stem}.experts.{e}.{proj}.weight"] for e in range(4)]
        assert np.abs(experts[0] - before[f"{stem}.experts.0.{proj}.weight"]).max() > 1e-3, proj
        np.testing.assert_array_equal(tensors[f"blk.1.ffn_{name}_exps.weight"], np.stack(experts))
    np.testing.assert_array_equal(tensors["blk.1.ffn_gate_inp.weight"], merged[f"{stem}.gate.weight"])
    np.testing.assert_array_equal(tensors["blk.1.exp_probs_b.bias"], merged[f"{stem}.expert_bias"])
    np.testing.assert_array_equal(tensors["blk.0.ffn_up.weight"], merged["model.layers.0.feed_forward.w3.weight"])


def test_llama_cpp_agrees_with_the_merged_lfm2_moe(exported_lfm2_moe):
    assert_llama_cpp_agrees(exported_lfm2_moe[1], "lfm2-moe-run-f32.gguf", "LFM2-MoE LoRA run f32")


@pytest.fixture(scope="module")
def exported_qwen3_next(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(base, OUT): the same for a tiny Qwen3-Next (2 gated-delta-rule layers with 2 key and 4 value heads, then
    gated attention; experts beside a gated shared expert; built here, as hypersloth-tiny-model has no Qwen3-Next),
    adapters on its linear attention, attention and experts (the targets training resolves)."""
    from transformers import Qwen3NextConfig

    root = tmp_path_factory.mktemp("qwen3-next")
    config = Qwen3NextConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                             linear_value_head_dim=16, layer_types=["linear_attention", "linear_attention",
                                                                    "full_attention"],
                             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                             shared_expert_intermediate_size=96, eos_token_id=2, pad_token_id=0, bos_token_id=None)
    config.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(root / "tiny-qwen3-next"))
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(str(root / "tiny-qwen3-next"))
    run = make_run(root / "qwen3-next-run", root / "tiny-qwen3-next", experts=True)
    export_main([str(run), "--out", str(root / "out"), "--gguf", "f32", "--dtype", "float32"])
    return root / "tiny-qwen3-next", root / "out"


def test_a_run_on_qwen3_next_exports_the_merged_linear_attention_and_experts(exported_qwen3_next):
    base, out = exported_qwen3_next
    tensors, merged, before = read_export(base, out, "qwen3-next-run-f32.gguf", "qwen3next")
    qkvz = merged["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    assert np.abs(qkvz - before["model.layers.0.linear_attn.in_proj_qkvz.weight"]).max() > 1e-3
    grouped = qkvz.reshape(2, 96, 64)  # per key head: q 16, k 16, v 32, z 32
    np.testing.assert_array_equal(tensors["blk.0.attn_gate.weight"], grouped[:, 64:].reshape(64, 64))
    np.testing.assert_array_equal(tensors["blk.0.attn_qkv.weight"][:32], grouped[:, :16].reshape(32, 64))
    for hf, name in (("layers.2.self_attn.q_proj.weight", "blk.2.attn_q.weight"),
                     ("layers.0.linear_attn.out_proj.weight", "blk.0.ssm_out.weight"),
                     ("layers.2.self_attn.o_proj.weight", "blk.2.attn_output.weight")):
        assert_folded(tensors, merged, before, f"model.{hf}", name)
    stacked = np.stack([merged[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"] for e in range(4)])
    assert np.abs(stacked[0] - before["model.layers.1.mlp.experts.0.gate_proj.weight"]).max() > 1e-3
    np.testing.assert_array_equal(tensors["blk.1.ffn_gate_exps.weight"], stacked)


def test_llama_cpp_agrees_with_the_merged_qwen3_next(exported_qwen3_next):
    assert_llama_cpp_agrees(exported_qwen3_next[1], "qwen3-next-run-f32.gguf", "Qwen3-Next LoRA run f32")


@pytest.fixture(scope="module")
def exported_glm(tmp_path_factory) -> tuple[Path, Path]:
    """(base, OUT): the same for a tiny GLM-4.7-Flash (tied embeddings), adapters on its latent attention, dense
    and shared MLPs and experts."""
    return export_tiny(tmp_path_factory, "glm4_moe_lite", "glm")


def test_the_glm_gguf_holds_the_merged_latent_attention_split(exported_glm):
    base, out = exported_glm
    tensors, merged, before = read_export(base, out, "glm-run-f32.gguf", "deepseek2")
    config = json.loads((base / "config.json").read_text())
    heads, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    assert np.abs(merged[name] - before[name]).max() > 1e-3  # the adapter was folded in
    kv_b = merged[name].reshape(heads, nope + config["v_head_dim"], -1)
    np.testing.assert_array_equal(tensors["blk.1.attn_k_b.weight"], kv_b[:, :nope].transpose(0, 2, 1))
    np.testing.assert_array_equal(tensors["blk.1.attn_v_b.weight"], kv_b[:, nope:])


def test_llama_cpp_agrees_with_the_merged_glm(exported_glm):
    assert_llama_cpp_agrees(exported_glm[1], "glm-run-f32.gguf", "GLM-4.7-Flash LoRA run f32")


def test_the_gpt_oss_gguf_holds_every_experts_merged_weights(exported_gpt_oss):
    base, out = exported_gpt_oss
    tensors, merged, before = read_export(base, out, "gpt-oss-run-f32.gguf", "gpt-oss")
    for layer in (0, 1):
        stem = f"model.layers.{layer}.mlp.experts"
        gate_up, down = merged[f"{stem}.gate_up_proj"], merged[f"{stem}.down_proj"]  # (E, H, 2I), (E, I, H)
        assert np.abs(gate_up - before[f"{stem}.gate_up_proj"]).max() > 1e-3  # the adapters were folded in
        for proj, want in (("gate", gate_up[..., 0::2]), ("up", gate_up[..., 1::2]), ("down", down)):
            np.testing.assert_array_equal(tensors[f"blk.{layer}.ffn_{proj}_exps.weight"], want.transpose(0, 2, 1))
        sinks = merged[f"model.layers.{layer}.self_attn.sinks"]
        np.testing.assert_array_equal(tensors[f"blk.{layer}.attn_sinks.weight"], sinks)
    np.testing.assert_array_equal(tensors["output.weight"], merged["model.embed_tokens.weight"])  # tied


def test_llama_cpp_agrees_with_the_merged_gpt_oss(exported_gpt_oss):
    assert_llama_cpp_agrees(exported_gpt_oss[1], "gpt-oss-run-f32.gguf", "gpt-oss LoRA run f32")


def test_the_moe_gguf_holds_every_experts_merged_weights(exported_moe):
    base, out = exported_moe
    assert sorted(p.name for p in (out / "gguf").iterdir()) == ["Modelfile", "moe-run-f32.gguf"]
    tensors, merged, before = read_export(base, out, "moe-run-f32.gguf", "qwen3moe")  # merged: one tensor per expert
    for layer in (0, 1):
        for proj in ("gate", "up", "down"):
            names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight" for e in range(4)]
            written = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"].reshape(4, *merged[names[0]].shape)
            np.testing.assert_array_equal(written, np.stack([merged[name] for name in names]))
            moved = [np.abs(merged[name] - before[name]).max() for name in names]
            assert min(moved) > 1e-3, (layer, proj, moved)  # each expert's own adapter was folded in


def test_llama_cpp_agrees_with_the_merged_moe(exported_moe):
    assert_llama_cpp_agrees(exported_moe[1], "moe-run-f32.gguf", "MoE LoRA run f32")


def assert_llama_cpp_agrees(out: Path, gguf_name: str, label: str) -> None:
    """llama.cpp on OUT/gguf/`gguf_name` against the merged model in float32: within 2% of the logits' range,
    the same argmax at >= 99% of the positions (skipped without llama_cpp)."""
    pytest.importorskip("llama_cpp")
    ids, ours = llama_logits(out / "gguf" / gguf_name, out / "merged")
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(str(out / "merged")).eval()(torch.tensor([ids])).logits[0]
    reference = reference.numpy()
    print(f"{label}: max |diff| / range {np.abs(ours - reference).max() / np.ptp(reference):.2e}, "
          f"argmax {(ours.argmax(-1) == reference.argmax(-1)).mean():.3f}")
    assert np.abs(ours - reference).max() <= 2e-2 * np.ptp(reference)
    assert (ours.argmax(-1) == reference.argmax(-1)).mean() >= 0.99


def test_the_cli_writes_adapter_merged_gguf_and_modelfile(exported):
    assert sorted(p.name for p in exported.iterdir()) == ["adapter", "gguf", "merged"]
    assert sorted(p.name for p in (exported / "gguf").iterdir()) == ["Modelfile", "run-q8_0.gguf"]
    modelfile = (exported / "gguf" / "Modelfile").read_text()
    assert "FROM ./run-q8_0.gguf" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile


def test_the_gguf_holds_the_merged_weights(exported, tiny_model_dir):
    reader = gguf.GGUFReader(str(exported / "gguf" / "run-q8_0.gguf"))
    tensors = {t.name: t for t in reader.tensors}
    merged = load_file(str(exported / "merged" / "model.safetensors"))
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    for gguf_name, hf_name in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                               ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight")):
        written = gguf.quants.dequantize(tensors[gguf_name].data, tensors[gguf_name].tensor_type)
        written = written.reshape(merged[hf_name].shape)
        step = np.abs(merged[hf_name]).max() / 127  # one q8_0 step at most
        assert np.abs(written - merged[hf_name]).max() <= step
        assert np.abs(merged[hf_name] - base[hf_name]).max() > 2 * step  # the merged weights, not the base's


def test_a_misspelt_type_exits_2_with_a_suggestion_and_writes_nothing(exported, tmp_path, capsys):
    run = exported.parent / "run"
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(run), "--out", str(tmp_path / "out"), "--gguf", "q8"])
    assert exit_info.value.code == 2
    assert "did you mean q8_0?" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_unsupported_architecture_is_refused_before_the_merge(exported, tiny_model_dir, tmp_path, capsys):
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "architectures": ["FalconH1ForCausalLM"]}))
    with pytest.raises(SystemExit) as exit_info:
        export_main([str(exported.parent / "run"), "--out", str(tmp_path / "out"), "--gguf", "f16", "--base", str(base)])
    assert exit_info.value.code == 2
    assert "FalconH1ForCausalLM" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def llama_logits(gguf_file: Path, merged: Path) -> tuple[list[int], np.ndarray]:
    """The HF tokenizer's ids of the chat (llama.cpp must tokenise it the same) and llama.cpp's logits on them."""
    import llama_cpp

    tokenizer = AutoTokenizer.from_pretrained(str(merged))
    text = tokenizer.apply_chat_template(CHAT, tokenize=False)
    ids = tokenizer(text)["input_ids"]
    llm = llama_cpp.Llama(str(gguf_file), n_ctx=256, logits_all=True, verbose=False)
    try:
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == ids
        llm.eval(ids)
        return ids, np.array(llm.scores[: len(ids)])
    finally:
        llm.close()


def test_llama_cpp_agrees_with_the_merged_model(exported):
    pytest.importorskip("llama_cpp")
    merged = exported / "merged"
    ids, ours = llama_logits(exported / "gguf" / "run-q8_0.gguf", merged)
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(str(merged)).eval()(torch.tensor([ids])).logits[0].numpy()
    assert (ours.argmax(-1) == reference.argmax(-1)).mean() >= 0.9
