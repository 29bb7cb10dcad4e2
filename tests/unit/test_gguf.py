"""The GGUF writer (HyperSloth/outputs/gguf) read back with the gguf package's own GGUFReader: every tensor
under llama.cpp's name with the model's values, every key (hyperparameters, the whole tokenizer, the chat
template), for each supported architecture (Qwen3-MoE's experts in both layouts transformers writes); the refusals;
the Modelfile; nothing half-written."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_models import (GEMMA4, GEMMA4_VARIANTS, GRANITE4_H, LFM2, LFM2_MOE, NEMOTRON_H, QWEN3_NEXT, SPM_IDS,
                         SPM_SPECIALS, build_arch_model, build_spm_tokenizer, saved_fused)
from safetensors.numpy import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

gguf = pytest.importorskip("gguf")  # the optional extra (installed by .[dev])

from HyperSloth.outputs.export import ExportError  # noqa: E402
from HyperSloth.outputs.gguf import architectures, export_gguf, write_gguf  # noqa: E402
from HyperSloth.outputs.gguf.experts import tensor_parts  # noqa: E402
from HyperSloth.outputs.gguf.modelfile import chat_format, modelfile_text  # noqa: E402
from HyperSloth.outputs.gguf.spm_vocab import space_prefix  # noqa: E402
from HyperSloth.outputs.gguf.vocab import QWEN2_REGEX, pre_tokenizer_name  # noqa: E402
from HyperSloth.outputs.gguf.writer import tensor_type  # noqa: E402

ARCHS = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM",
         "Qwen3MoeForCausalLM", "GptOssForCausalLM", "Phi3ForCausalLM")
MOE = "Qwen3MoeForCausalLM"
GPT_OSS = "GptOssForCausalLM"
# Largest |written - HF| per type for weights of std 0.1 (f16/bf16 rounding; q8_0: half a step of max/127).
TOLERANCE = {"f32": 0.0, "f16": 1e-3, "bf16": 4e-3, "q8_0": 3e-3}


@pytest.fixture(scope="module")
def arch_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-archs")
    return {arch: build_arch_model(arch, root / arch, tiny_model_dir) for arch in ARCHS}


def stacked_experts(experts: dict[str, dict[int, np.ndarray]]) -> dict[str, np.ndarray]:
    """Per-expert tensors gathered as {GGUF name: {expert index: data}}, each stacked in expert order (llama.cpp's
    `*_exps` tensors); every index from 0 on must be there."""
    stacked = {}
    for name, by_expert in experts.items():
        assert sorted(by_expert) == list(range(len(by_expert))), (name, sorted(by_expert))
        stacked[name] = np.stack([by_expert[index] for index in range(len(by_expert))])
    return stacked


def read(path: Path) -> tuple[dict, dict[str, gguf.ReaderTensor]]:
    reader = gguf.GGUFReader(str(path))
    return ({name: field.contents() for name, field in reader.fields.items()},
            {tensor.name: tensor for tensor in reader.tensors})


def values(tensor: gguf.ReaderTensor) -> np.ndarray:
    """A tensor as float32 in numpy (HF) order."""
    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape(tuple(reversed([int(n) for n in tensor.shape])))


def expected_tensors(model_dir: Path, arch: str) -> dict[str, np.ndarray]:
    """The HF weights under their GGUF names, changed as llama.cpp expects (written independently of the code)."""
    config = json.loads((model_dir / "config.json").read_text())
    names = gguf.get_tensor_name_map(architectures.ARCHITECTURES[arch].model_arch, config["num_hidden_layers"])
    out, experts = {}, {}
    for hf_name, data in load_file(str(model_dir / "model.safetensors")).items():
        data = data.astype(np.float32)
        if arch in ("LlamaForCausalLM", "MistralForCausalLM") and ("q_proj" in hf_name or "k_proj" in hf_name):
            heads = config["num_attention_heads"] if "q_proj" in hf_name else config["num_key_value_heads"]
            half = data.shape[0] // heads // 2  # [h0 first half | h0 second half ...] -> pairs interleaved
            data = data.reshape(heads, 2, half, -1).transpose(0, 2, 1, 3).reshape(data.shape)
        if arch == "Gemma3ForCausalLM" and hf_name.endswith("norm.weight"):
            data = data + 1
        if match := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight", hf_name):
            layer, expert, proj = match.groups()
            experts.setdefault(f"blk.{layer}.ffn_{proj}_exps.weight", {})[int(expert)] = data
            continue
        gpt_oss_experts = r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj(_bias)?"
        if arch == GPT_OSS and (match := re.fullmatch(gpt_oss_experts, hf_name)):
            layer, proj, bias = match.groups()  # weights (experts, in, out), gate and up interleaved in the columns
            kind = "bias" if bias else "weight"
            flip = (lambda a: a) if bias else (lambda a: a.transpose(0, 2, 1))
            if proj == "down":
                out[f"blk.{layer}.ffn_down_exps.{kind}"] = flip(data)
            else:
                out[f"blk.{layer}.ffn_gate_exps.{kind}"] = flip(data[..., 0::2])
                out[f"blk.{layer}.ffn_up_exps.{kind}"] = flip(data[..., 1::2])
            continue
        if arch == GPT_OSS and hf_name.endswith("self_attn.sinks"):  # llama.cpp's converter adds ".weight"
            out[names.get_name(hf_name) + ".weight"] = data
            continue
        if match := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj", hf_name):
            layer, proj = match.groups()
            if proj == "down":
                out[f"blk.{layer}.ffn_down_exps.weight"] = data
            else:  # transformers: gate, up = (x @ gate_up_proj[e].T).chunk(2, dim=-1)
                out[f"blk.{layer}.ffn_gate_exps.weight"] = data[:, : data.shape[1] // 2]
                out[f"blk.{layer}.ffn_up_exps.weight"] = data[:, data.shape[1] // 2:]
            continue
        out[names.get_name(hf_name, try_suffixes=(".weight", ".bias"))] = data
    return {**out, **stacked_experts(experts)}


@pytest.mark.parametrize("arch", ARCHS)
def test_every_tensor_round_trips_under_llama_cpp_names(arch_dirs, tmp_path, arch):
    path = write_gguf(arch_dirs[arch], tmp_path / "m.gguf", "f32")
    _, tensors = read(path)
    expected = expected_tensors(arch_dirs[arch], arch)
    assert sorted(tensors) == sorted(expected)
    for name, want in expected.items():
        np.testing.assert_array_equal(values(tensors[name]), want, err_msg=name)


@pytest.fixture(scope="module")
def moe_fused(arch_dirs, tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE saved as transformers 5 holds it (save_original_format=False): fused
    mlp.experts.gate_up_proj (experts, 2 x 96, 64) and down_proj, where arch_dirs has one tensor per expert."""
    out = saved_fused(arch_dirs[MOE], tmp_path_factory.mktemp("moe-fused"))
    assert load_file(str(out / "model.safetensors"))["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 192, 64)
    return out


def test_fused_experts_round_trip_split_as_transformers_splits_them(arch_dirs, moe_fused, tmp_path):
    """Gate rows [:I], up rows [I:]: against the expectation above, and against transformers' own split (its
    per-expert save of the same model), so halves swapped fail both."""
    _, fused = read(write_gguf(moe_fused, tmp_path / "fused.gguf", "f32"))
    expected = expected_tensors(moe_fused, MOE)
    assert sorted(fused) == sorted(expected)
    for name, want in expected.items():
        np.testing.assert_array_equal(values(fused[name]), want, err_msg=name)
    _, per_expert = read(write_gguf(arch_dirs[MOE], tmp_path / "per-expert.gguf", "f32"))
    for name, tensor in per_expert.items():
        np.testing.assert_array_equal(values(fused[name]), values(tensor), err_msg=name)


def test_experts_spread_over_shards_are_stacked(arch_dirs, tmp_path):
    """A published MoE checkpoint is sharded, and one layer's experts can sit in several files."""
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(arch_dirs[MOE]), dtype=torch.float32).save_pretrained(
        str(sharded), max_shard_size="100KB")
    AutoTokenizer.from_pretrained(str(arch_dirs[MOE])).save_pretrained(str(sharded))
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    layer0 = {file for name, file in weight_map.items() if name.startswith("model.layers.0.mlp.experts.")}
    assert len(layer0) > 1
    _, tensors = read(write_gguf(sharded, tmp_path / "sharded.gguf", "f32"))
    _, whole = read(write_gguf(arch_dirs[MOE], tmp_path / "whole.gguf", "f32"))
    assert sorted(tensors) == sorted(whole)
    for name, tensor in whole.items():
        np.testing.assert_array_equal(values(tensors[name]), values(tensor), err_msg=name)


def test_the_gguf_experts_compute_what_transformers_experts_compute(moe_fused, tmp_path):
    """llama.cpp's MoE FFN is down @ (silu(gate @ x) * (up @ x)) per expert (build_moe_ffn, LLM_FFN_SILU): from
    the GGUF's three tensors it equals transformers' Qwen3MoeExperts routing every token to that expert."""
    experts = AutoModelForCausalLM.from_pretrained(str(moe_fused), dtype=torch.float32).model.layers[1].mlp.experts
    _, tensors = read(write_gguf(moe_fused, tmp_path / "m.gguf", "f32"))
    gate, up, down = (torch.tensor(values(tensors[f"blk.1.ffn_{proj}_exps.weight"]))
                      for proj in ("gate", "up", "down"))
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    for expert in range(4):
        with torch.no_grad():
            want = experts(x, torch.full((5, 1), expert), torch.ones(5, 1))
        ours = (torch.nn.functional.silu(x @ gate[expert].T) * (x @ up[expert].T)) @ down[expert].T
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-6)


def test_qwen3_moe_keys_and_tensor_types(arch_dirs, tmp_path):
    fields, tensors = read(write_gguf(arch_dirs[MOE], tmp_path / "m.gguf", "q8_0"))
    assert fields["general.architecture"] == "qwen3moe"
    assert {key: fields[f"qwen3moe.{key}"] for key in ("expert_count", "expert_used_count",
            "expert_feed_forward_length", "feed_forward_length", "block_count")} == {
        "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 96, "feed_forward_length": 128,
        "block_count": 2}
    q8 = gguf.GGMLQuantizationType.Q8_0
    for layer in (0, 1):  # ggml order (llama.cpp's create_tensor): gate/up {H, I, experts}, down {I, H, experts}
        assert tensors[f"blk.{layer}.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        for proj, shape in (("gate", [64, 96, 4]), ("up", [64, 96, 4]), ("down", [96, 64, 4])):
            tensor = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
            assert (tensor.tensor_type, [int(n) for n in tensor.shape]) == (q8, shape), proj


QWEN35 = "Qwen3_5MoeForCausalLM"


# What the tiny linear-attention MoEs (Qwen3.5-MoE, Qwen3-Next) hold under llama.cpp's keys: hidden 64, 2 key heads
# and 4 value heads of 16, kernel 4, 4 experts of width 96 (2 active) beside a shared one of 96, a full-attention
# layer every 4th; their rotated dimensions differ (MRoPE or not) and are checked per model.
LINEAR_MOE_KEYS = {"ssm.conv_kernel": 4, "ssm.state_size": 16, "ssm.group_count": 2, "ssm.time_step_rank": 4,
                   "ssm.inner_size": 64, "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 96,
                   "expert_shared_feed_forward_length": 96, "full_attention_interval": 4}


def linear_moe_keys(fields: dict, arch: str) -> dict:
    """The file's values of LINEAR_MOE_KEYS and the rotated dimensions, under `arch`'s prefix."""
    return {key: fields[f"{arch}.{key}"] for key in [*LINEAR_MOE_KEYS, "rope.dimension_count"]}


@pytest.fixture(scope="module")
def qwen35_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return build_arch_model(QWEN35, tmp_path_factory.mktemp("qwen35") / "tiny-linear", tiny_model_dir)


def test_qwen35_moe_keys_and_tensors_as_llama_cpps_loader_reads_them(qwen35_dir, tmp_path):
    """Shapes in ggml order, as llama.cpp's qwen35moe create_tensor asks for them (src/models/qwen35moe.cpp):
    hidden 64, 2 key heads and 4 value heads of 16 (key_dim 32, value_dim 64, conv_dim 128), kernel 4."""
    fields, tensors = read(write_gguf(qwen35_dir, tmp_path / "m.gguf", "q8_0"))
    assert fields["general.architecture"] == "qwen35moe"
    assert linear_moe_keys(fields, "qwen35moe") == {**LINEAR_MOE_KEYS, "rope.dimension_count": 8}
    assert list(fields["qwen35moe.attention.recurrent_layers"]) == [True, True, False]
    assert list(fields["qwen35moe.rope.dimension_sections"]) == [2, 1, 1, 0]
    shape = lambda name: [int(n) for n in tensors[name].shape]  # noqa: E731
    assert shape("blk.0.attn_qkv.weight") == [64, 128] and shape("blk.0.attn_gate.weight") == [64, 64]
    assert shape("blk.0.ssm_conv1d.weight") == [4, 128] and shape("blk.0.ssm_out.weight") == [64, 64]
    assert shape("blk.0.ssm_a") == shape("blk.0.ssm_dt.bias") == [4] and shape("blk.0.ssm_norm.weight") == [16]
    assert shape("blk.0.ssm_alpha.weight") == shape("blk.0.ssm_beta.weight") == [64, 4]
    assert shape("blk.2.attn_q.weight") == [64, 128]  # query and its output gate: 4 heads x 16 x 2
    f32 = gguf.GGMLQuantizationType.F32
    for name in ("blk.0.ssm_conv1d.weight", "blk.0.ffn_gate_inp.weight", "blk.0.ffn_gate_inp_shexp.weight"):
        assert tensors[name].tensor_type == f32, name  # convert_hf_to_gguf.py keeps them F32
    assert tensors["blk.0.ffn_gate_shexp.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0


def test_qwen35_moe_values_a_norms_and_the_value_heads_tiled(qwen35_dir, tmp_path):
    """A = -exp(A_log); every norm + 1 but the linear attention's gated one; value heads from grouped by key head
    to tiled (llama.cpp's _reorder_v_heads: [k0 v0, k0 v1, k1 v0, k1 v1] -> [k0 v0, k1 v0, k0 v1, k1 v1])."""
    _, tensors = read(write_gguf(qwen35_dir, tmp_path / "m.gguf", "f32"))
    hf = load_file(str(qwen35_dir / "model.safetensors"))
    tiled = [0, 2, 1, 3]  # value head order in the GGUF
    a_log = hf["model.layers.0.linear_attn.A_log"]
    np.testing.assert_allclose(values(tensors["blk.0.ssm_a"]), -np.exp(a_log[tiled]), rtol=1e-6)
    np.testing.assert_array_equal(values(tensors["blk.0.ssm_dt.bias"]), hf["model.layers.0.linear_attn.dt_bias"][tiled])
    for gguf_name, hf_name, shift in (("blk.0.ssm_norm.weight", "model.layers.0.linear_attn.norm.weight", 0),
                                      ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight", 1),
                                      ("blk.2.attn_q_norm.weight", "model.layers.2.self_attn.q_norm.weight", 1)):
        np.testing.assert_array_equal(values(tensors[gguf_name]), hf[hf_name] + shift, err_msg=gguf_name)
    out = hf["model.layers.0.linear_attn.out_proj.weight"].reshape(64, 4, 16)  # columns: value heads of 16
    np.testing.assert_array_equal(values(tensors["blk.0.ssm_out.weight"]), out[:, tiled].reshape(64, 64))
    qkv = hf["model.layers.0.linear_attn.in_proj_qkv.weight"]  # rows: q (32), k (32), then v (4 heads of 16)
    want = np.concatenate([qkv[:64], qkv[64:].reshape(4, 16, 64)[tiled].reshape(64, 64)])
    np.testing.assert_array_equal(values(tensors["blk.0.attn_qkv.weight"]), want)
    conv = hf["model.layers.0.linear_attn.conv1d.weight"][:, 0]  # (channels, kernel), the same channel order
    want = np.concatenate([conv[:64], conv[64:].reshape(4, 16, 4)[tiled].reshape(64, 4)])
    np.testing.assert_array_equal(values(tensors["blk.0.ssm_conv1d.weight"]), want)


def test_dense_qwen35_is_written_as_llama_cpps_qwen35(tiny_model_dir, tmp_path):
    """Qwen3.5 dense (0.8B to 27B): the MoE's linear attention and norms, its MLP as ffn_gate / ffn_up / ffn_down."""
    model = build_arch_model("Qwen3_5ForCausalLM", tmp_path / "dense", tiny_model_dir)
    fields, tensors = read(write_gguf(model, tmp_path / "m.gguf", "f32"))
    assert fields["general.architecture"] == "qwen35"
    assert list(fields["qwen35.attention.recurrent_layers"]) == [True, True, False]
    assert fields["qwen35.feed_forward_length"] == 128 and "qwen35.expert_count" not in fields
    hf = load_file(str(model / "model.safetensors"))
    for layer in range(3):
        for proj, name in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
            np.testing.assert_array_equal(values(tensors[f"blk.{layer}.{name}.weight"]),
                                          hf[f"model.layers.{layer}.mlp.{proj}.weight"])
    np.testing.assert_array_equal(values(tensors["blk.0.attn_norm.weight"]), hf["model.layers.0.input_layernorm.weight"] + 1)
    tiled = [0, 2, 1, 3]  # value heads from grouped by key head to tiled, as for the MoE
    np.testing.assert_allclose(values(tensors["blk.0.ssm_a"]), -np.exp(hf["model.layers.0.linear_attn.A_log"][tiled]),
                               rtol=1e-6)


@pytest.fixture(scope="module")
def qwen3_next_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return build_arch_model(QWEN3_NEXT, tmp_path_factory.mktemp("qwen3-next") / "tiny", tiny_model_dir)


def test_qwen3_next_keys_and_tensors_as_llama_cpps_loader_reads_them(qwen3_next_dir, tmp_path):
    """Qwen3.5-MoE's keys (no MRoPE: the rotated quarter of a 16-wide head), the fused in_proj_qkvz split into attn_qkv
    (every key head's q, then k, then v, the value heads grouped by key head as transformers orders them: llama.cpp's
    qwen3next takes them so, unlike qwen35moe) and attn_gate, in_proj_ba as ssm_ba as it is."""
    fields, tensors = read(write_gguf(qwen3_next_dir, tmp_path / "m.gguf", "f32"))
    assert fields["general.architecture"] == "qwen3next"
    assert linear_moe_keys(fields, "qwen3next") == {**LINEAR_MOE_KEYS, "rope.dimension_count": 4}
    hf = load_file(str(qwen3_next_dir / "model.safetensors"))
    stem = "model.layers.0.linear_attn."
    qkvz = hf[stem + "in_proj_qkvz.weight"].reshape(2, 16 + 16 + 32 + 32, 64)  # per key head: q, k, 2 v, 2 z
    want = np.concatenate([qkvz[:, :16].reshape(32, 64), qkvz[:, 16:32].reshape(32, 64),
                           qkvz[:, 32:64].reshape(64, 64)])
    np.testing.assert_array_equal(values(tensors["blk.0.attn_qkv.weight"]), want)
    np.testing.assert_array_equal(values(tensors["blk.0.attn_gate.weight"]), qkvz[:, 64:].reshape(64, 64))
    np.testing.assert_array_equal(values(tensors["blk.0.ssm_ba.weight"]), hf[stem + "in_proj_ba.weight"])
    np.testing.assert_array_equal(values(tensors["blk.0.ssm_out.weight"]), hf[stem + "out_proj.weight"])
    np.testing.assert_array_equal(values(tensors["blk.0.ssm_conv1d.weight"]), hf[stem + "conv1d.weight"][:, 0])
    np.testing.assert_allclose(values(tensors["blk.0.ssm_a"]), -np.exp(hf[stem + "A_log"]), rtol=1e-6)
    np.testing.assert_array_equal(values(tensors["blk.0.ssm_dt.bias"]), hf[stem + "dt_bias"])
    for gguf_name, hf_name, shift in (("blk.0.ssm_norm.weight", stem + "norm.weight", 0),
                                      ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight", 1),
                                      ("blk.2.attn_k_norm.weight", "model.layers.2.self_attn.k_norm.weight", 1),
                                      ("output_norm.weight", "model.norm.weight", 1)):
        np.testing.assert_array_equal(values(tensors[gguf_name]), hf[hf_name] + shift, err_msg=gguf_name)
    np.testing.assert_array_equal(values(tensors["blk.2.attn_q.weight"]), hf["model.layers.2.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(values(tensors["blk.1.ffn_gate_inp_shexp.weight"]),
                                  hf["model.layers.1.mlp.shared_expert_gate.weight"])
    np.testing.assert_array_equal(values(tensors["blk.1.ffn_up_exps.weight"]),
                                  np.stack([hf[f"model.layers.1.mlp.experts.{e}.up_proj.weight"] for e in range(4)]))
    assert not any("ssm_in" in name or "ssm_alpha" in name for name in tensors)


@pytest.mark.parametrize("change, message", [
    ({"mlp_only_layers": [1]}, "some dense"),
    ({"norm_topk_prob": False}, "norm_topk_prob false"),
    ({"linear_value_head_dim": 32}, "16 and 32"),
    ({"linear_num_value_heads": 3}, "not a multiple"),
])
def test_a_qwen3_next_llama_cpp_would_compute_otherwise_is_refused(qwen3_next_dir, change, message):
    config = json.loads((qwen3_next_dir / "config.json").read_text())
    architectures.architecture_of(config)
    with pytest.raises(ExportError, match=message):
        architectures.architecture_of({**config, **change})


def test_a_qwen35_text_model_saved_under_the_multimodal_names_is_written(tiny_model_dir, tmp_path):
    """A fine-tune of Qwen3.5-35B-A3B (published multimodal) merges into `model.language_model.*` names: written
    under llama.cpp's names as the text model's."""
    from gguf_models import build_qwen35_from_multimodal

    model = build_qwen35_from_multimodal(tmp_path / "q35", tiny_model_dir)
    hf = load_file(str(model / "model.safetensors"))
    assert any(name.startswith("model.language_model.layers.0.") for name in hf)
    _, tensors = read(write_gguf(model, tmp_path / "m.gguf", "f32"))
    np.testing.assert_array_equal(values(tensors["token_embd.weight"]), hf["model.language_model.embed_tokens.weight"])
    np.testing.assert_array_equal(values(tensors["blk.1.attn_q.weight"]),
                                  hf["model.language_model.layers.1.self_attn.q_proj.weight"])
    assert "blk.0.ssm_a" in tensors and "blk.0.ffn_gate_exps.weight" in tensors


def test_a_multimodal_gemma3_is_written_as_its_language_model(tiny_model_dir, tmp_path):
    """Gemma 3 4B and larger are Gemma3ForConditionalGeneration: the GGUF holds the language model (its
    `language_model.model...` tensors under llama.cpp's gemma3 names, the text config's keys), not the towers."""
    from gguf_models import build_gemma3_multimodal

    model = build_gemma3_multimodal(tmp_path / "gemma-mm", tiny_model_dir)
    hf = load_file(str(model / "model.safetensors"))
    assert any(name.startswith("vision_tower.") for name in hf)
    fields, tensors = read(write_gguf(model, tmp_path / "m.gguf", "f32"))
    assert fields["general.architecture"] == "gemma3" and fields["gemma3.block_count"] == 2
    assert fields["gemma3.attention.sliding_window"] == 8
    assert not any("vision" in name or "mm" in name.split(".")[0] for name in tensors)
    np.testing.assert_array_equal(values(tensors["blk.1.attn_q.weight"]),
                                  hf["language_model.model.layers.1.self_attn.q_proj.weight"])
    np.testing.assert_array_equal(values(tensors["blk.0.attn_norm.weight"]),
                                  hf["language_model.model.layers.0.input_layernorm.weight"] + 1)
    config = json.loads((model / "config.json").read_text())  # a quantized one is refused, as a text model is
    with pytest.raises(ExportError, match="quantization_config"):
        architectures.architecture_of({**config, "quantization_config": {"quant_method": "bitsandbytes"}})


# Every Hugging Face tensor of a Gemma 4 text model -> llama.cpp's gemma4 name (conversion/gemma.py Gemma4Model,
# llama-arch.cpp), each written as it is (Gemma4RMSNorm scales by its weight: no + 1)
GEMMA4_MODEL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight", "model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
                "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
                "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight"}
GEMMA4_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight", "layer_scalar": "layer_output_scale.weight",
    # 26B-A4B's expert block: the router, its two scales, the fused experts (gate rows first, as llama.cpp splits them)
    "router.proj.weight": "ffn_gate_inp.weight", "router.scale": "ffn_gate_inp.scale",
    "router.per_expert_scale": "ffn_down_exps.scale", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
    "experts.down_proj": "ffn_down_exps.weight", "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
    "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight",
    "post_feedforward_layernorm_2.weight": "post_ffw_norm_2.weight",
    # E2B's and E4B's per-layer embeddings
    "per_layer_input_gate.weight": "inp_gate.weight", "per_layer_projection.weight": "proj.weight",
    "post_per_layer_input_norm.weight": "post_norm.weight"}


@pytest.fixture(scope="module")
def gemma4_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4")
    return {name: build_arch_model(GEMMA4, root / name, tiny_model_dir, **changes)
            for name, changes in GEMMA4_VARIANTS.items()}


@pytest.mark.parametrize("variant", list(GEMMA4_VARIANTS))
def test_every_gemma4_tensor_lands_under_llama_cpps_name_as_it_is(gemma4_dirs, tmp_path, variant):
    """Each tensor under its gemma4 name with the model's values (no norm shift, the layer scalars and the router's
    scales too), plus `rope_freqs`: 1 for the 4 pairs of the full layers' 32-wide heads proportional RoPE rotates (a
    quarter), 1e30 for the other 12."""
    model = gemma4_dirs[variant]
    _, tensors = read(write_gguf(model, tmp_path / "m.gguf", "f32"))
    expected = {}
    for hf_name, data in load_file(str(model / "model.safetensors")).items():
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
        expected[f"blk.{layer[1]}.{GEMMA4_LAYER[layer[2]]}" if layer else GEMMA4_MODEL[hf_name]] = data
    assert sorted(tensors) == sorted([*expected, "rope_freqs.weight"])
    for name, want in expected.items():
        np.testing.assert_array_equal(values(tensors[name]), want.astype(np.float32), err_msg=name)
    np.testing.assert_array_equal(values(tensors["rope_freqs.weight"]), np.float32([1.0] * 4 + [1e30] * 12))


def test_gemma4_keys_llama_cpp_reads_heads_per_layer_kind(gemma4_dirs, tmp_path):
    """The MoE: the full layer's heads 32 wide over 1 KV head (attention_k_eq_v: no v_proj), the sliding
    layer's 16 wide over 2; each kind's RoPE base and dimensions; the window and which layer slides; the experts."""
    fields, tensors = read(write_gguf(gemma4_dirs["moe"], tmp_path / "m.gguf", "q8_0"))
    assert fields["general.architecture"] == "gemma4"
    keys = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv",
            "attention.key_length", "attention.value_length", "attention.key_length_swa", "attention.value_length_swa",
            "rope.dimension_count", "rope.dimension_count_swa", "rope.freq_base", "rope.freq_base_swa",
            "attention.sliding_window", "attention.sliding_window_pattern", "final_logit_softcapping",
            "attention.shared_kv_layers", "embedding_length_per_layer_input", "expert_count", "expert_used_count",
            "expert_feed_forward_length")
    assert {key: fields[f"gemma4.{key}"] for key in keys} == {
        "block_count": 2, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4,
        "attention.head_count_kv": [2, 1], "attention.key_length": 32, "attention.value_length": 32,
        "attention.key_length_swa": 16, "attention.value_length_swa": 16, "rope.dimension_count": 32,
        "rope.dimension_count_swa": 16, "rope.freq_base": 1e6, "rope.freq_base_swa": 1e4, "attention.sliding_window": 8,
        "attention.sliding_window_pattern": [True, False], "final_logit_softcapping": 30.0,
        "attention.shared_kv_layers": 0, "embedding_length_per_layer_input": 0, "expert_count": 4,
        "expert_used_count": 2, "expert_feed_forward_length": 96}
    assert "blk.1.attn_v.weight" not in tensors and "blk.0.attn_v.weight" in tensors  # keys as values: llama.cpp too
    shape = lambda name: [int(n) for n in tensors[name].shape]  # noqa: E731  (ggml order)
    assert shape("blk.1.attn_q.weight") == [64, 128] and shape("blk.1.attn_k.weight") == [64, 32]
    assert shape("blk.0.ffn_gate_up_exps.weight") == [64, 192, 4] and shape("blk.0.ffn_down_exps.weight") == [96, 64, 4]
    f32, q8 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
    assert tensors["blk.0.ffn_gate_up_exps.weight"].tensor_type == q8
    for name in ("ffn_gate_inp.weight", "ffn_gate_inp.scale", "ffn_down_exps.scale", "layer_output_scale.weight"):
        assert tensors[f"blk.0.{name}"].tensor_type == f32, name
    e2b, _ = read(write_gguf(gemma4_dirs["e2b"], tmp_path / "e2b.gguf", "f32"))
    assert {key: e2b[f"gemma4.{key}"] for key in ("attention.shared_kv_layers", "embedding_length_per_layer_input",
                                                  "feed_forward_length", "attention.sliding_window_pattern")} == {
        "attention.shared_kv_layers": 2, "embedding_length_per_layer_input": 8,
        "feed_forward_length": [128, 128, 256, 256], "attention.sliding_window_pattern": [True, False, True, False]}


def test_gemma4_heads_read_from_a_published_config_as_from_transformers_5_17s(gemma4_dirs):
    """The published configs name the full layers' heads `global_head_dim` / `num_global_key_value_heads` (the
    latter with attention_k_eq_v only, as transformers reads it); transformers 5.17 saves them as per_layer_config."""
    from HyperSloth.outputs.gguf import gemma4

    saved = json.loads((gemma4_dirs["moe"] / "config.json").read_text())
    assert saved["per_layer_config"] == {"1": {"head_dim": 32, "num_key_value_heads": 1}}
    published = {key: value for key, value in saved.items() if key != "per_layer_config"}
    published.update(global_head_dim=32, num_global_key_value_heads=1)
    assert gemma4.layer_heads(saved) == gemma4.layer_heads(published) == [(2, 16), (1, 32)]
    assert gemma4.layer_heads({**published, "attention_k_eq_v": False}) == [(2, 16), (2, 32)]
    default = {key: value for key, value in published.items() if key not in ("global_head_dim", "layer_types")}
    default.update(num_hidden_layers=7)  # five sliding layers to one full, the last full; global heads 512 wide
    assert gemma4.layer_types(default) == ["sliding_attention"] * 5 + ["full_attention", "full_attention"]
    assert gemma4.head_lengths(default) == ([2] * 5 + [1, 1], 512, 512, 512)


@pytest.mark.parametrize("change, message", [
    ({"attention_bias": True}, "no attention biases"),
    ({"use_bidirectional_attention": "all"}, "attends causally"),
    ({"per_layer_config": {"1": {"head_dim": 32, "intermediate_size": 64}}}, r"changes \['intermediate_size'\]"),
    ({"per_layer_config": {"0": {"head_dim": 8}, "2": {"head_dim": 32}}, "num_hidden_layers": 3,
      "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
     r"sliding_attention layers.*\[8, 16\]"),
    ({"rope_parameters": {"full_attention": {"rope_type": "proportional", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "sliding layers' RoPE is 'linear'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
     "full-attention layers' RoPE is 'yarn'"),
    ({"hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 256}, "vocab_size_per_layer_input 256"),
])
def test_a_gemma4_llama_cpp_would_compute_otherwise_is_refused(gemma4_dirs, change, message):
    config = json.loads((gemma4_dirs["moe"] / "config.json").read_text())
    with pytest.raises(ExportError, match=message):
        architectures.architecture_of({**config, **change})


def test_a_qwen35_moe_llama_cpp_cannot_run_is_refused(qwen35_dir):
    config = json.loads((qwen35_dir / "config.json").read_text())
    with pytest.raises(ExportError, match="one head width for the linear attention's keys and values.*16 and 32"):
        architectures.architecture_of({**config, "linear_value_head_dim": 32})
    # transformers' default sections on this model's 8 rotated dimensions: llama.cpp would abort on its assert
    rope = {**config["rope_parameters"], "mrope_section": [11, 11, 10]}
    with pytest.raises(ExportError, match=r"sections \[11, 11, 10, 0\] hold 32 frequencies.*8 rotated dimensions"):
        architectures.architecture_of({**config, "rope_parameters": rope})


# Every Hugging Face tensor of a Granite 4.0-H -> llama.cpp's granitehybrid name(s) and the change llama.cpp's
# converter makes (conversion/granite.py GraniteHybridModel, conversion/mamba.py Mamba2Model), written independently
GRANITE_MODEL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}


def _llama_permuted(data: np.ndarray, heads: int) -> np.ndarray:
    """conversion/llama.py's permute: each head's rows from [first halves | second halves] to interleaved pairs."""
    rows = data.shape[0] // heads
    return np.concatenate([np.stack([head[: rows // 2], head[rows // 2:]], axis=1).reshape(head.shape)
                           for head in np.split(data, heads)])


def granite_expected(model: Path) -> dict[str, np.ndarray]:
    config = json.loads((model / "config.json").read_text())
    moe, shared = config["num_local_experts"] > 0, config["shared_intermediate_size"]
    out = {}
    for hf_name, data in load_file(str(model / "model.safetensors")).items():
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
        if not layer:
            out[GRANITE_MODEL[hf_name]] = data
            continue
        blk, name = f"blk.{layer[1]}.", layer[2]
        if name == "block_sparse_moe.input_linear.weight":  # (experts, 2 * width, hidden): gate rows first
            half = data.shape[1] // 2
            out[blk + "ffn_gate_exps.weight"], out[blk + "ffn_up_exps.weight"] = data[:, :half], data[:, half:]
        elif name == "shared_mlp.input_linear.weight":
            suffix = "_shexp" if moe else ""
            out[f"{blk}ffn_gate{suffix}.weight"], out[f"{blk}ffn_up{suffix}.weight"] = data[:shared], data[shared:]
        elif name == "mamba.A_log":
            out[blk + "ssm_a"] = -np.exp(data)[:, None]
        elif name == "self_attn.q_proj.weight":
            out[blk + "attn_q.weight"] = _llama_permuted(data, config["num_attention_heads"])
        elif name == "self_attn.k_proj.weight":
            out[blk + "attn_k.weight"] = _llama_permuted(data, config["num_key_value_heads"])
        else:
            gguf_name, change = {
                "input_layernorm.weight": ("attn_norm.weight", None),
                "post_attention_layernorm.weight": ("ffn_norm.weight", None),
                "self_attn.v_proj.weight": ("attn_v.weight", None),
                "self_attn.o_proj.weight": ("attn_output.weight", None),
                "block_sparse_moe.router.layer.weight": ("ffn_gate_inp.weight", None),
                "block_sparse_moe.output_linear.weight": ("ffn_down_exps.weight", None),
                "shared_mlp.output_linear.weight": ("ffn_down_shexp.weight" if moe else "ffn_down.weight", None),
                "mamba.in_proj.weight": ("ssm_in.weight", None), "mamba.out_proj.weight": ("ssm_out.weight", None),
                "mamba.conv1d.weight": ("ssm_conv1d.weight", lambda x: x[:, 0, :]),  # (channels, kernel)
                "mamba.conv1d.bias": ("ssm_conv1d.bias", None), "mamba.dt_bias": ("ssm_dt.bias", None),
                "mamba.D": ("ssm_d", lambda x: x[:, None]),  # (heads, 1)
                "mamba.norm.weight": ("ssm_norm.weight", lambda x: x[None, :])}[name]  # (groups 1, inner)
            out[blk + gguf_name] = change(data) if change else data
    return out


@pytest.fixture(scope="module")
def granite_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """The tiny Granite 4.0-H (gguf_models.granite4_h_config), and without experts (its shared MLP the layers' MLP)."""
    root = tmp_path_factory.mktemp("granite")
    return {"moe": build_arch_model(GRANITE4_H, root / "moe", tiny_model_dir),
            "dense": build_arch_model(GRANITE4_H, root / "dense", tiny_model_dir, num_local_experts=0)}


@pytest.mark.parametrize("variant", ["moe", "dense"])
def test_every_granite4_h_tensor_lands_under_llama_cpps_name_as_its_converter_changes_it(granite_dirs, tmp_path,
                                                                                         variant):
    _, tensors = read(write_gguf(granite_dirs[variant], tmp_path / "m.gguf", "f32"))
    expected = granite_expected(granite_dirs[variant])
    assert sorted(tensors) == sorted(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(values(tensors[name]), want.astype(np.float32), rtol=1e-6, err_msg=name)


def test_granite4_h_keys_llama_cpp_reads(granite_dirs, tmp_path):
    """Granite's multipliers, the Mamba-2 sizes, KV heads 0 where a layer is recurrent (llama.cpp's test for it),
    RoPE off; the router, the conv, A and D in F32."""
    fields, tensors = read(write_gguf(granite_dirs["moe"], tmp_path / "m.gguf", "q8_0"))
    assert fields["general.architecture"] == "granitehybrid"
    keys = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv",
            "attention.key_length", "attention.value_length", "attention.scale", "embedding_scale", "residual_scale",
            "logit_scale", "expert_count", "expert_used_count", "expert_shared_feed_forward_length",
            "ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.inner_size", "ssm.time_step_rank",
            "rope.scaling.finetuned")
    written = {key: fields[f"granitehybrid.{key}"] for key in keys}
    scales = {key: written.pop(key) for key in ("attention.scale", "embedding_scale", "residual_scale", "logit_scale")}
    assert scales == pytest.approx({"attention.scale": 1 / 16, "embedding_scale": 12.0, "residual_scale": 0.22,
                                    "logit_scale": 6.0})  # float32 keys
    assert written == {
        "block_count": 3, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
        "attention.head_count_kv": [0, 2, 0], "attention.key_length": 16, "attention.value_length": 16,
        "expert_count": 4, "expert_used_count": 2, "expert_shared_feed_forward_length": 64, "ssm.conv_kernel": 4,
        "ssm.state_size": 16, "ssm.group_count": 1, "ssm.inner_size": 128, "ssm.time_step_rank": 8,
        "rope.scaling.finetuned": False}
    f32, q8 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
    for name in ("ffn_gate_inp.weight", "ssm_conv1d.weight", "ssm_a", "ssm_d", "ssm_dt.bias", "ssm_norm.weight"):
        assert tensors[f"blk.0.{name}"].tensor_type == f32, name
    assert tensors["blk.0.ssm_in.weight"].tensor_type == tensors["blk.0.ffn_gate_exps.weight"].tensor_type == q8
    dense, _ = read(write_gguf(granite_dirs["dense"], tmp_path / "dense.gguf", "f32"))
    assert dense["granitehybrid.feed_forward_length"] == 64 and "granitehybrid.expert_count" not in dense


def test_granite4_h_layers_read_from_a_published_config_as_from_transformers_5_17s(granite_dirs):
    """The published configs name the layers mamba / attention (older ones under `layers_block_type`);
    transformers 5.17 saves linear_attention / full_attention."""
    from HyperSloth.outputs.gguf import granite

    saved = json.loads((granite_dirs["moe"] / "config.json").read_text())
    assert saved["layer_types"] == ["linear_attention", "full_attention", "linear_attention"]
    published = {key: value for key, value in saved.items() if key != "layer_types"}
    for key in ("layer_types", "layers_block_type"):
        assert granite.layer_kinds({**published, key: ["mamba", "attention", "mamba"]}) == [True, False, True]
    assert granite.layer_kinds(saved) == [True, False, True]


@pytest.mark.parametrize("change, message", [
    ({"position_embedding_type": "rope"}, "use RoPE"),
    ({"layer_types": ["attention"] * 3}, "no Mamba layer"),
    ({"mamba_n_groups": 2}, "mamba_n_groups 2.*per group"),
    ({"time_step_limit": [0.001, 100.0]}, r"clamps the Mamba time step to \(0.001, 100.0\)"),
    ({"mamba_proj_bias": True}, "no bias on in_proj"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"layer_types": ["mamba", "cross_attention", "mamba"]}, "layer_types"),
])
def test_a_granite4_h_llama_cpp_would_compute_otherwise_is_refused(granite_dirs, change, message):
    config = json.loads((granite_dirs["moe"] / "config.json").read_text())
    architectures.architecture_of(config)  # as saved: time_step_limit (0, inf) with inf as {"__float__": ...}
    with pytest.raises(ExportError, match=message):
        architectures.architecture_of({**config, **change})


def nemotron_h_expected(model: Path) -> dict[str, np.ndarray]:
    """A Nemotron-H's tensors under llama.cpp's nemotron_h(_moe) names, changed as its converter changes them
    (conversion/nemotron.py NemotronHModel), written independently."""
    config = json.loads((model / "config.json").read_text())
    out, experts = {}, {}
    for hf_name, data in load_file(str(model / "model.safetensors")).items():
        layer = re.fullmatch(r"backbone\.layers\.(\d+)\.(.+)", hf_name)
        if not layer:
            out[{"backbone.embeddings.weight": "token_embd.weight", "backbone.norm_f.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[hf_name]] = data
            continue
        blk, name = f"blk.{layer[1]}.", layer[2].removeprefix("mixer.")
        if layer[2] == "norm.weight":  # the block's norm; `mixer.norm.weight` is the Mamba mixer's gated one
            out[blk + "attn_norm.weight"] = data
        elif layer[2] == "mixer.norm.weight":  # in its groups
            out[blk + "ssm_norm.weight"] = data.reshape(config["n_groups"], -1)
        elif expert := re.fullmatch(r"experts\.(\d+)\.(up|down)_proj\.weight", name):
            experts.setdefault(f"{blk}ffn_{expert[2]}_exps.weight", {})[int(expert[1])] = data
        elif name == "q_proj.weight":
            out[blk + "attn_q.weight"] = _llama_permuted(data, config["num_attention_heads"])
        elif name == "k_proj.weight":
            out[blk + "attn_k.weight"] = _llama_permuted(data, config["num_key_value_heads"])
        else:
            gguf_name, change = {
                "v_proj.weight": ("attn_v.weight", None), "o_proj.weight": ("attn_output.weight", None),
                "up_proj.weight": ("ffn_up.weight", None), "down_proj.weight": ("ffn_down.weight", None),
                "gate.weight": ("ffn_gate_inp.weight", None),
                "gate.e_score_correction_bias": ("exp_probs_b.bias", None),
                "shared_experts.up_proj.weight": ("ffn_up_shexp.weight", None),
                "shared_experts.down_proj.weight": ("ffn_down_shexp.weight", None),
                "in_proj.weight": ("ssm_in.weight", None), "out_proj.weight": ("ssm_out.weight", None),
                "conv1d.weight": ("ssm_conv1d.weight", lambda x: x[:, 0, :]), "conv1d.bias": ("ssm_conv1d.bias", None),
                "dt_bias": ("ssm_dt.bias", None), "A_log": ("ssm_a", lambda x: -np.exp(x)[:, None]),
                "D": ("ssm_d", lambda x: x[:, None])}[name]
            out[blk + gguf_name] = change(data) if change else data
    return {**out, **stacked_experts(experts)}


@pytest.fixture(scope="module")
def nemotron_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """The tiny Nemotron-H (gguf_models.nemotron_h_config) and its MoE, the latter also saved with fused experts."""
    root = tmp_path_factory.mktemp("nemotron-h")
    dirs = {"dense": build_arch_model(NEMOTRON_H, root / "dense", tiny_model_dir),
            "moe": build_arch_model(NEMOTRON_H, root / "moe", tiny_model_dir, moe=True)}
    saved_fused(dirs["moe"], root / "fused")
    assert load_file(str(root / "fused" / "model.safetensors"))["model.layers.1.mixer.experts.up_proj"].shape == (
        4, 96, 64)
    return {**dirs, "fused": root / "fused"}


@pytest.mark.parametrize("variant, arch", [("dense", "nemotron_h"), ("moe", "nemotron_h_moe")])
def test_every_nemotron_h_tensor_lands_under_llama_cpps_name_as_its_converter_changes_it(nemotron_dirs, tmp_path,
                                                                                         variant, arch):
    fields, tensors = read(write_gguf(nemotron_dirs[variant], tmp_path / "m.gguf", "f32"))
    assert fields["general.architecture"] == arch
    expected = nemotron_h_expected(nemotron_dirs[variant])
    assert sorted(tensors) == sorted(expected)
    for name, want in expected.items():
        np.testing.assert_allclose(values(tensors[name]), want.astype(np.float32), rtol=1e-6, err_msg=name)


def test_nemotron_h_fused_experts_are_written_as_the_per_expert_ones(nemotron_dirs, tmp_path):
    _, fused = read(write_gguf(nemotron_dirs["fused"], tmp_path / "fused.gguf", "f32"))
    _, per_expert = read(write_gguf(nemotron_dirs["moe"], tmp_path / "per-expert.gguf", "f32"))
    assert sorted(fused) == sorted(per_expert)
    for name, tensor in per_expert.items():
        np.testing.assert_array_equal(values(fused[name]), values(tensor), err_msg=name)


def test_nemotron_h_keys_tell_llama_cpp_each_blocks_kind(nemotron_dirs, tmp_path):
    """KV heads only in the attention block, a feed-forward width only in the MLP / MoE blocks (llama.cpp takes a
    block with neither as Mamba); the Mamba-2 sizes; the experts' routing."""
    keys = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv",
            "attention.key_length", "attention.value_length", "attention.layer_norm_epsilon", "ssm.conv_kernel",
            "ssm.state_size", "ssm.group_count", "ssm.inner_size", "ssm.time_step_rank", "rope.scaling.finetuned")
    common = {"block_count": 4, "embedding_length": 64, "attention.head_count": 4,
              "attention.head_count_kv": [0, 0, 2, 0], "attention.key_length": 16, "attention.value_length": 16,
              "ssm.conv_kernel": 4, "ssm.state_size": 16, "ssm.group_count": 2, "ssm.inner_size": 128,
              "ssm.time_step_rank": 8, "rope.scaling.finetuned": False}
    dense, _ = read(write_gguf(nemotron_dirs["dense"], tmp_path / "dense.gguf", "f32"))
    written = {key: dense[f"nemotron_h.{key}"] for key in keys}
    assert written.pop("attention.layer_norm_epsilon") == pytest.approx(1e-6)
    assert written == {**common, "feed_forward_length": [0, 128, 0, 128]}
    assert "nemotron_h.expert_count" not in dense
    moe, tensors = read(write_gguf(nemotron_dirs["moe"], tmp_path / "moe.gguf", "q8_0"))
    moe_keys = ("feed_forward_length", "expert_count", "expert_used_count", "expert_feed_forward_length",
                "expert_shared_feed_forward_length", "expert_shared_count", "expert_weights_norm",
                "expert_weights_scale", "expert_group_count")
    assert {key: moe[f"nemotron_h_moe.{key}"] for key in moe_keys} == {
        "feed_forward_length": [0, 96, 0, 96], "expert_count": 4, "expert_used_count": 2,
        "expert_feed_forward_length": 96, "expert_shared_feed_forward_length": 64, "expert_shared_count": 1,
        "expert_weights_norm": True, "expert_weights_scale": 2.5, "expert_group_count": 1}
    f32 = gguf.GGMLQuantizationType.F32
    for name in ("ffn_gate_inp.weight", "exp_probs_b.bias"):
        assert tensors[f"blk.1.{name}"].tensor_type == f32, name
    assert tensors["blk.1.ffn_up_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0


def test_nemotron_h_layers_read_from_a_published_pattern(nemotron_dirs):
    """The published configs name the blocks `hybrid_override_pattern` (M, -, *, E) and hold num_hidden_layers;
    transformers 5.17 saves `layers_block_type` without it."""
    from HyperSloth.outputs.gguf import nemotron_h

    saved = json.loads((nemotron_dirs["moe"] / "config.json").read_text())
    assert saved["layers_block_type"] == ["linear_attention", "moe", "full_attention", "moe"]
    assert "num_hidden_layers" not in saved
    published = {key: value for key, value in saved.items() if key != "layers_block_type"}
    published.update(hybrid_override_pattern="ME*E", num_hidden_layers=4)
    assert nemotron_h.layer_kinds(published) == nemotron_h.layer_kinds(saved) == ["linear_attention", "moe",
                                                                                   "full_attention", "moe"]
    assert architectures.architecture_of(published).arch_name == "nemotron_h_moe"
    assert architectures.architecture_of({**published, "hybrid_override_pattern": "M-*-"}).arch_name == "nemotron_h"


@pytest.mark.parametrize("change, message", [
    ({"layers_block_type": ["mamba", "mlp", "attention", "moe"]}, "both MLP and MoE"),
    ({"moe_latent_size": 32}, "latent space"),
    ({"n_group": 2}, "within groups"),
    ({"sliding_window": 8}, "sliding window"),
    ({"time_step_limit": [0.0, 10.0]}, "clamps the Mamba time step"),
    ({"mlp_bias": True}, "mlp_bias True"),
    ({"mlp_hidden_act": "silu"}, "mlp_hidden_act 'silu'"),
    ({"layers_block_type": ["mamba", "moe", "cross", "moe"]}, r"\['cross'\]"),
])
def test_a_nemotron_h_llama_cpp_would_compute_otherwise_is_refused(nemotron_dirs, change, message):
    config = json.loads((nemotron_dirs["moe"] / "config.json").read_text())
    architectures.architecture_of(config)
    with pytest.raises(ExportError, match=message):
        architectures.architecture_of({**config, **change})


def lfm2_expected(model: Path) -> dict[str, np.ndarray]:
    """An LFM2's tensors under llama.cpp's lfm2(moe) names, changed as its converter changes them
    (conversion/lfm2.py LFM2Model, LFM2MoeModel), written independently."""
    out, experts = {}, {}
    for hf_name, data in load_file(str(model / "model.safetensors")).items():
        layer = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf_name)
        if not layer:
            out[{"model.embed_tokens.weight": "token_embd.weight", "model.embedding_norm.weight":
                 "token_embd_norm.weight", "lm_head.weight": "output.weight"}[hf_name]] = data
            continue
        blk, name = f"blk.{layer[1]}.", layer[2]
        if expert := re.fullmatch(r"feed_forward\.experts\.(\d+)\.(w\d)\.weight", name):
            proj = {"w1": "gate", "w2": "down", "w3": "up"}[expert[2]]
            experts.setdefault(f"{blk}ffn_{proj}_exps.weight", {})[int(expert[1])] = data
            continue
        gguf_name, change = {
            "operator_norm.weight": ("attn_norm.weight", None), "ffn_norm.weight": ("ffn_norm.weight", None),
            "conv.conv.weight": ("shortconv.conv.weight", lambda x: x[:, 0, :]),
            "conv.in_proj.weight": ("shortconv.in_proj.weight", None),
            "conv.out_proj.weight": ("shortconv.out_proj.weight", None),
            "self_attn.q_proj.weight": ("attn_q.weight", None), "self_attn.k_proj.weight": ("attn_k.weight", None),
            "self_attn.v_proj.weight": ("attn_v.weight", None),
            "self_attn.out_proj.weight": ("attn_output.weight", None),
            "self_attn.q_layernorm.weight": ("attn_q_norm.weight", None),
            "self_attn.k_layernorm.weight": ("attn_k_norm.weight", None),
            "feed_forward.w1.weight": ("ffn_gate.weight", None), "feed_forward.w3.weight": ("ffn_up.weight", None),
            "feed_forward.w2.weight": ("ffn_down.weight", None),
            "feed_forward.gate.weight": ("ffn_gate_inp.weight", None),
            "feed_forward.expert_bias": ("exp_probs_b.bias", None)}[name]
        out[blk + gguf_name] = change(data) if change else data
    return {**out, **stacked_experts(experts)}


@pytest.fixture(scope="module")
def lfm2_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    """The tiny LFM2 and LFM2-MoE (gguf_models.lfm2_config), the latter also saved with fused experts."""
    root = tmp_path_factory.mktemp("lfm2")
    dirs = {"dense": build_arch_model(LFM2, root / "dense", tiny_model_dir),
            "moe": build_arch_model(LFM2_MOE, root / "moe", tiny_model_dir)}
    saved_fused(dirs["moe"], root / "fused")
    assert load_file(str(root / "fused" / "model.safetensors"))[
        "model.layers.1.feed_forward.experts.gate_up_proj"].shape == (4, 192, 64)
    return {**dirs, "fused": root / "fused"}


@pytest.mark.parametrize("variant, arch", [("dense", "lfm2"), ("moe", "lfm2moe")])
def test_every_lfm2_tensor_lands_under_llama_cpps_name_as_its_converter_changes_it(lfm2_dirs, tmp_path, variant,
                                                                                   arch):
    fields, tensors = read(write_gguf(lfm2_dirs[variant], tmp_path / "m.gguf", "f32"))
    assert fields["general.architecture"] == arch
    expected = lfm2_expected(lfm2_dirs[variant])
    assert sorted(tensors) == sorted(expected)
    for name, want in expected.items():
        np.testing.assert_array_equal(values(tensors[name]), want.astype(np.float32), err_msg=name)


def test_lfm2_moe_fused_experts_are_written_as_the_per_expert_ones(lfm2_dirs, tmp_path):
    _, fused = read(write_gguf(lfm2_dirs["fused"], tmp_path / "fused.gguf", "f32"))
    _, per_expert = read(write_gguf(lfm2_dirs["moe"], tmp_path / "per-expert.gguf", "f32"))
    assert sorted(fused) == sorted(per_expert)
    for name, tensor in per_expert.items():
        np.testing.assert_array_equal(values(fused[name]), values(tensor), err_msg=name)


def test_lfm2_keys_llama_cpp_reads(lfm2_dirs, tmp_path):
    """KV heads 0 in the convolution layers (llama.cpp's recurrent ones), the convolution's taps, the MLP's width as
    transformers adjusts it (160 from 144); for the MoE the experts, the dense layer in front, sigmoid gating; the
    convolution kept F32 (and the router, the expert bias) where the rest is q8_0."""
    keys = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
            "attention.head_count_kv", "attention.key_length", "shortconv.l_cache", "rope.freq_base")
    common = {"block_count": 3, "embedding_length": 64, "attention.head_count": 4, "attention.head_count_kv": [0, 2, 0],
              "attention.key_length": 16, "shortconv.l_cache": 3}
    dense, _ = read(write_gguf(lfm2_dirs["dense"], tmp_path / "dense.gguf", "f32"))
    written = {key: dense[f"lfm2.{key}"] for key in keys}
    assert written.pop("rope.freq_base") == pytest.approx(1e6)
    assert written == {**common, "feed_forward_length": 160}
    assert dense["lfm2.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert "lfm2.expert_count" not in dense
    moe, tensors = read(write_gguf(lfm2_dirs["moe"], tmp_path / "moe.gguf", "q8_0"))
    moe_keys = ("expert_count", "expert_used_count", "expert_feed_forward_length", "leading_dense_block_count",
                "expert_gating_func")
    assert {key: moe[f"lfm2moe.{key}"] for key in (*keys[:-1], *moe_keys)} == {
        **common, "feed_forward_length": 128, "expert_count": 4, "expert_used_count": 2,
        "expert_feed_forward_length": 96, "leading_dense_block_count": 1,
        "expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID)}
    f32 = gguf.GGMLQuantizationType.F32
    for name in ("blk.0.shortconv.conv.weight", "blk.1.ffn_gate_inp.weight", "blk.1.exp_probs_b.bias"):
        assert tensors[name].tensor_type == f32, name
    assert tensors["blk.1.ffn_up_exps.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0


def test_lfm2_read_from_a_published_config_as_from_transformers_5_17s(lfm2_dirs):
    """The published configs name the MLP's width `block_ff_dim`, the tying `tie_embedding`, the attention layers
    `full_attn_idxs`; the RMS eps is `norm_eps` in both."""
    from HyperSloth.outputs.gguf import lfm2

    saved = json.loads((lfm2_dirs["dense"] / "config.json").read_text())
    published = {key: value for key, value in saved.items()
                 if key not in ("layer_types", "intermediate_size", "tie_word_embeddings")}
    published.update(full_attn_idxs=[1], block_ff_dim=144, tie_embedding=False)
    for config in (saved, published):
        normalised = architectures.text_config(config)
        assert normalised["layer_types"] == ["conv", "full_attention", "conv"]
        assert (normalised["intermediate_size"], normalised["tie_word_embeddings"]) == (144, False)
        assert normalised["rms_norm_eps"] == pytest.approx(1e-6)
        assert lfm2.feed_forward_length(normalised) == 160
        assert architectures.architecture_of(config).arch_name == "lfm2"


@pytest.mark.parametrize("variant, change, message", [
    ("dense", {"conv_bias": True}, "conv_bias"),
    ("dense", {"layer_types": ["conv", "sliding_attention", "conv"]}, r"\['sliding_attention'\]"),
    ("moe", {"norm_topk_prob": False}, "norm_topk_prob false"),
    ("moe", {"routed_scaling_factor": 2.0}, "routed_scaling_factor 2.0"),
    ("moe", {"use_expert_bias": False}, "use_expert_bias false"),
    ("moe", {"tie_word_embeddings": False}, "tie_word_embeddings false"),
])
def test_an_lfm2_llama_cpp_would_compute_otherwise_is_refused(lfm2_dirs, variant, change, message):
    config = json.loads((lfm2_dirs[variant] / "config.json").read_text())
    architectures.architecture_of(config)
    with pytest.raises(ExportError, match=message):
        architectures.architecture_of({**config, **change})


GLM = "Glm4MoeLiteForCausalLM"


@pytest.fixture(scope="module")
def glm_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return build_arch_model(GLM, tmp_path_factory.mktemp("glm") / "tiny-latent", tiny_model_dir)


def test_glm_4_7_flash_keys_and_its_latent_attention_split_as_llama_cpp_absorbs_it(glm_dir, tmp_path):
    """4 heads of nope 16 + rope 8, v 16, kv rank 32, q rank 32; a dense layer, then 2 MoE layers of 4 experts (96
    wide, 2 active) with a shared expert. kv_b_proj (heads x (nope + v), rank) becomes k_b (heads, rank, nope) and
    v_b (heads, v, rank): conversion/deepseek.py's split."""
    fields, tensors = read(write_gguf(glm_dir, tmp_path / "m.gguf", "f32"))
    assert fields["general.architecture"] == "deepseek2"
    keys = ("attention.head_count_kv", "attention.key_length", "attention.value_length", "attention.key_length_mla",
            "attention.value_length_mla", "attention.q_lora_rank", "attention.kv_lora_rank", "rope.dimension_count",
            "leading_dense_block_count", "expert_count", "expert_shared_count", "expert_used_count",
            "expert_feed_forward_length", "feed_forward_length", "expert_gating_func")
    assert {key: fields[f"deepseek2.{key}"] for key in keys} == {
        "attention.head_count_kv": 1, "attention.key_length": 40, "attention.value_length": 32,
        "attention.key_length_mla": 24, "attention.value_length_mla": 16, "attention.q_lora_rank": 32,
        "attention.kv_lora_rank": 32, "rope.dimension_count": 8, "leading_dense_block_count": 1, "expert_count": 4,
        "expert_shared_count": 1, "expert_used_count": 2, "expert_feed_forward_length": 96, "feed_forward_length": 128,
        "expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID)}
    assert fields["deepseek2.expert_weights_scale"] == pytest.approx(1.8) and fields["deepseek2.expert_weights_norm"]
    hf = load_file(str(glm_dir / "model.safetensors"))
    kv_b = hf["model.layers.1.self_attn.kv_b_proj.weight"].reshape(4, 16 + 16, 32)  # per head: nope rows, then v
    np.testing.assert_array_equal(values(tensors["blk.1.attn_k_b.weight"]), kv_b[:, :16].transpose(0, 2, 1))
    np.testing.assert_array_equal(values(tensors["blk.1.attn_v_b.weight"]), kv_b[:, 16:])
    assert "blk.1.attn_kv_b.weight" not in tensors
    np.testing.assert_array_equal(values(tensors["blk.1.exp_probs_b.bias"]),
                                  hf["model.layers.1.mlp.gate.e_score_correction_bias"])
    assert "blk.0.ffn_gate.weight" in tensors and "blk.0.ffn_gate_exps.weight" not in tensors  # the dense layer
    assert [int(n) for n in tensors["blk.1.ffn_gate_exps.weight"].shape] == [64, 96, 4]


@pytest.mark.parametrize("change, message", [
    ({"rope_interleave": False}, "rotates interleaved pairs, and its config has rope_interleave false"),
    ({"n_group": 2, "topk_group": 1}, "within 2 groups"),
    ({"mlp_layer_types": ["dense", "sparse", "dense"]}, "dense layers first only"),
])
def test_a_glm_llama_cpp_would_run_otherwise_is_refused(glm_dir, change, message):
    config = json.loads((glm_dir / "config.json").read_text())
    with pytest.raises(ExportError, match=message):
        architectures.architecture_of({**config, **change})


def test_the_gguf_gpt_oss_experts_compute_what_transformers_experts_compute(arch_dirs, tmp_path):
    """llama.cpp's gpt-oss MoE FFN per expert (build_moe_ffn, LLM_FFN_SWIGLU_OAI_MOE; ggml's swiglu_oai with alpha
    1.702, limit 7): g = min(gate @ x + b_g, 7), u = clamp(up @ x + b_u, -7, 7), down @ (g sigmoid(1.702 g) (u + 1))
    + b_d. From the GGUF's six tensors it equals transformers' GptOssExperts routing every token to that expert, so
    swapped gate / up columns or a missing transpose fail."""
    model = AutoModelForCausalLM.from_pretrained(str(arch_dirs[GPT_OSS]), dtype=torch.float32)
    experts = model.model.layers[1].mlp.experts
    _, tensors = read(write_gguf(arch_dirs[GPT_OSS], tmp_path / "m.gguf", "f32"))
    (gate, up, down), (b_gate, b_up, b_down) = (
        [torch.tensor(values(tensors[f"blk.1.ffn_{proj}_exps.{kind}"])) for proj in ("gate", "up", "down")]
        for kind in ("weight", "bias"))
    x = 3 * torch.randn(5, 64, generator=torch.Generator().manual_seed(0))  # some gates and ups past the clamp
    for expert in range(4):
        with torch.no_grad():
            want = experts(x, torch.full((5, 1), expert), torch.ones(5, 1))
        g = (x @ gate[expert].T + b_gate[expert]).clamp(max=7.0)
        u = (x @ up[expert].T + b_up[expert]).clamp(-7.0, 7.0)
        ours = (g * torch.sigmoid(1.702 * g) * (u + 1)) @ down[expert].T + b_down[expert]
        torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)


def test_gpt_oss_keys_sinks_and_an_output_even_when_tied(arch_dirs, tmp_path):
    fields, tensors = read(write_gguf(arch_dirs[GPT_OSS], tmp_path / "m.gguf", "q8_0"))
    assert fields["general.architecture"] == "gpt-oss"
    assert {key: fields[f"gpt-oss.{key}"] for key in ("expert_count", "expert_used_count", "expert_feed_forward_length",
                                                      "attention.sliding_window", "attention.sliding_window_pattern",
                                                      "rope.scaling.type", "rope.scaling.factor")} == {
        "expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 96, "attention.sliding_window": 8,
        "attention.sliding_window_pattern": [True, False], "rope.scaling.type": "yarn", "rope.scaling.factor": 1.0}
    f32, q8 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0
    for layer in (0, 1):  # ggml order (llama.cpp's create_tensor): gate/up {H, I, experts}, down {I, H, experts}
        for proj, shape in (("gate", [64, 96, 4]), ("up", [64, 96, 4]), ("down", [96, 64, 4])):
            tensor = tensors[f"blk.{layer}.ffn_{proj}_exps.weight"]
            assert (tensor.tensor_type, [int(n) for n in tensor.shape]) == (q8, shape), proj
            bias = tensors[f"blk.{layer}.ffn_{proj}_exps.bias"]
            assert (bias.tensor_type, [int(n) for n in bias.shape]) == (f32, [shape[1], 4]), proj
        assert [int(n) for n in tensors[f"blk.{layer}.attn_sinks.weight"].shape] == [4]
    tied = tmp_path / "tied"
    shutil.copytree(arch_dirs[GPT_OSS], tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    _, tied_tensors = read(write_gguf(tied, tmp_path / "tied.gguf", "f32"))  # llama.cpp's gpt-oss requires output
    np.testing.assert_array_equal(values(tied_tensors["output.weight"]), values(tied_tensors["token_embd.weight"]))
    # llama.cpp's gpt-oss asserts a sliding layer: all full gets a window of the whole context (no pattern, so its
    # default slides every other layer, over everything); no layer_types is transformers' alternation
    (tied / "config.json").write_text(json.dumps({**config, "layer_types": ["full_attention"] * 2}))
    full, _ = read(write_gguf(tied, tmp_path / "full.gguf", "f32"))
    assert full["gpt-oss.attention.sliding_window"] == 256 and "gpt-oss.attention.sliding_window_pattern" not in full
    (tied / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "layer_types"}))
    default, _ = read(write_gguf(tied, tmp_path / "default.gguf", "f32"))
    assert default["gpt-oss.attention.sliding_window_pattern"] == [True, False]


def test_a_gpt_oss_with_other_layer_types_is_refused(arch_dirs):
    config = json.loads((arch_dirs[GPT_OSS] / "config.json").read_text())
    with pytest.raises(ExportError, match=r"full and sliding-window attention layers only.*chunked_attention"):
        architectures.architecture_of({**config, "layer_types": ["chunked_attention", "full_attention"]})


@pytest.mark.parametrize("change, message", [
    ({"norm_topk_prob": False}, "norm_topk_prob false"),
    ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2")])
def test_a_qwen3_moe_llama_cpp_would_route_differently_is_refused(arch_dirs, change, message):
    config = json.loads((arch_dirs[MOE] / "config.json").read_text())
    with pytest.raises(ExportError, match=message):
        architectures.architecture_of({**config, **change})


def test_a_layer_missing_an_expert_is_refused():
    shapes = {f"model.layers.0.mlp.experts.{expert}.{proj}_proj.weight": (96, 64)
              for expert in (0, 1, 3) for proj in ("gate", "up", "down")}
    with pytest.raises(ExportError, match=r"experts \[0, 1, 3\], but config.json names 4"):
        tensor_parts(shapes, 4)


@pytest.mark.parametrize("gguf_type", ["f16", "bf16", "q8_0"])
def test_types_round_trip_within_their_rounding(tiny_model_dir, tmp_path, gguf_type):
    path = write_gguf(tiny_model_dir, tmp_path / "m.gguf", gguf_type)
    fields, tensors = read(path)
    qtype = getattr(gguf.GGMLQuantizationType, gguf_type.upper())
    assert fields["general.file_type"] == {"f16": 1, "bf16": 32, "q8_0": 7}[gguf_type]
    for name, want in expected_tensors(tiny_model_dir, "Qwen3ForCausalLM").items():
        tensor = tensors[name]
        assert tensor.tensor_type == (gguf.GGMLQuantizationType.F32 if want.ndim == 1 else qtype), name
        assert np.abs(values(tensor) - want).max() <= TOLERANCE[gguf_type] * max(1.0, np.abs(want).max()), name


def test_hyperparameters_and_the_whole_tokenizer_are_written(tiny_model_dir, tmp_path):
    fields, _ = read(write_gguf(tiny_model_dir, tmp_path / "m.gguf", "f16", name="tiny"))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert fields["general.architecture"] == "qwen3" and fields["general.name"] == "tiny"
    assert {key: fields[f"qwen3.{key}"] for key in ("block_count", "embedding_length", "feed_forward_length",
            "attention.head_count", "attention.head_count_kv", "attention.key_length", "context_length")} == {
        "block_count": 2, "embedding_length": 64, "feed_forward_length": 128, "attention.head_count": 4,
        "attention.head_count_kv": 2, "attention.key_length": 16, "context_length": config["max_position_embeddings"]}
    assert fields["qwen3.rope.freq_base"] == 10000.0
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    by_id = {index: text for text, index in tokenizer.get_vocab().items()}
    assert fields["tokenizer.ggml.tokens"] == [by_id[i] for i in range(config["vocab_size"])]
    types = fields["tokenizer.ggml.token_type"]
    assert [i for i, kind in enumerate(types) if kind == gguf.TokenType.CONTROL] == [0, 1, 2]  # the specials
    assert all(kind == gguf.TokenType.NORMAL for kind in types[3:])
    merges = json.loads((tiny_model_dir / "tokenizer.json").read_text())["model"]["merges"]
    assert fields["tokenizer.ggml.merges"] == [" ".join(pair) for pair in merges]
    assert fields["tokenizer.ggml.eos_token_id"] == tokenizer.eos_token_id == 2
    assert fields["tokenizer.ggml.padding_token_id"] == tokenizer.pad_token_id == 0
    assert "tokenizer.ggml.bos_token_id" not in fields and fields["tokenizer.ggml.add_bos_token"] is False
    assert fields["tokenizer.chat_template"] == tokenizer.chat_template


def test_a_sentencepiece_style_tokenizer_is_written_as_llama_cpp_spm(tmp_path):
    """Mistral v0.3's kind of tokenizer.json (BPE + byte_fallback, Metaspace): llama.cpp's `llama` vocabulary, each
    token scored by its merge's rank (llama.cpp merges the best-scored pair first), bytes as BYTE tokens."""
    model = build_arch_model("MistralForCausalLM", tmp_path / "mistral", build_spm_tokenizer(tmp_path / "spm"),
                             special_ids=SPM_IDS)
    fields, tensors = read(write_gguf(model, tmp_path / "m.gguf", "f32"))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    assert fields["tokenizer.ggml.model"] == "llama" and fields["tokenizer.ggml.pre"] == "default"
    by_id = {index: text for text, index in tokenizer.get_vocab().items()}
    tokens = fields["tokenizer.ggml.tokens"]
    assert tokens == [by_id[i] for i in range(512)] and tokens[5:261] == [f"<0x{b:02X}>" for b in range(256)]
    types = fields["tokenizer.ggml.token_type"]
    assert types[:5] == [gguf.TokenType.CONTROL] * len(SPM_SPECIALS)  # [INST] too, though not in all_special_ids
    assert set(types[5:261]) == {gguf.TokenType.BYTE} and set(types[261:]) == {gguf.TokenType.NORMAL}
    merges = json.loads((model / "tokenizer.json").read_text())["model"]["merges"]
    scores = dict(zip(tokens, fields["tokenizer.ggml.scores"]))
    first_rank = {}
    for rank, (left, right) in enumerate(merges):
        first_rank.setdefault(left + right, rank)
    assert {token: -scores[token] for token in first_rank} == first_rank and len(first_rank) > 150
    assert {scores[token] for token in tokens if token not in first_rank} == {0.0}
    assert "tokenizer.ggml.merges" not in fields and fields["tokenizer.ggml.add_space_prefix"] is True
    assert [fields[f"tokenizer.ggml.{key}_token_id"] for key in ("bos", "eos", "unknown")] == [1, 2, 0]
    assert fields["tokenizer.ggml.add_bos_token"] is True and fields["tokenizer.ggml.add_eos_token"] is False
    assert fields["tokenizer.chat_template"] == tokenizer.chat_template
    expected = expected_tensors(model, "MistralForCausalLM")
    assert set(tensors) == set(expected)
    assert all(np.array_equal(values(tensors[name]), data) for name, data in expected.items())


def test_the_space_prefix_of_a_sentencepiece_style_tokenizer():
    def metaspace(**options):
        return {"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "split": False, **options}}

    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    assert space_prefix(metaspace(prepend_scheme="first")) is True  # Mistral v0.3
    assert space_prefix(metaspace(prepend_scheme="never")) is False
    assert space_prefix({"normalizer": replace}) is False  # Gemma: spaces replaced, none prepended
    inert_split = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}
    assert space_prefix({"normalizer": replace, "pre_tokenizer": inert_split}) is False  # as GemmaTokenizer loads it
    prepend = {"type": "Prepend", "prepend": "▁"}  # Llama 2, Mistral v0.1
    assert space_prefix({"normalizer": {"type": "Sequence", "normalizers": [prepend, replace]}}) is True
    with pytest.raises(ExportError, match="pre-tokenizer Metaspace with split"):
        space_prefix(metaspace(split=True))  # one word at a time: llama.cpp merges across spaces
    with pytest.raises(ExportError, match="and a NFKC normalizer"):
        space_prefix({**metaspace(prepend_scheme="first"), "normalizer": {"type": "NFKC"}})


def test_the_pre_tokenizer_is_the_loaded_tokenizers(arch_dirs, tmp_path):
    """The same tokenizer.json next to a qwen2 config loads as Qwen2Tokenizer, with Qwen's regex (transformers 5):
    the GGUF must name the split HF really uses."""
    for arch, pre in (("Qwen3ForCausalLM", "gpt-2"), ("Qwen2ForCausalLM", "qwen2")):
        fields, _ = read(write_gguf(arch_dirs[arch], tmp_path / f"{arch}.gguf", "f16"))
        assert fields["tokenizer.ggml.pre"] == pre, arch


def test_ids_beyond_the_tokenizer_are_unused_pad_tokens(tiny_model_dir):
    """Qwen's config.vocab_size (151936) exceeds its tokenizer (151669): llama.cpp needs a token per row."""
    from HyperSloth.outputs.gguf.vocab import token_list

    tokens, types = token_list(AutoTokenizer.from_pretrained(str(tiny_model_dir)), 520)
    assert len(tokens) == len(types) == 520
    assert tokens[512:] == [f"[PAD{i}]" for i in range(512, 520)]
    assert set(types[512:]) == {gguf.TokenType.UNUSED}
    with pytest.raises(ExportError, match="vocab_size is 500"):
        token_list(AutoTokenizer.from_pretrained(str(tiny_model_dir)), 500)


def test_llama3_rope_writes_the_rope_freqs_tensor(arch_dirs, tmp_path):
    model = tmp_path / "llama31"
    shutil.copytree(arch_dirs["LlamaForCausalLM"], model)
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    (model / "config.json").write_text(json.dumps(config))
    _, tensors = read(write_gguf(model, tmp_path / "m.gguf", "f16"))
    factors = values(tensors["rope_freqs.weight"])
    assert factors.shape == (8,) and factors[0] == 1.0 and factors[-1] == 8.0  # fast dims kept, slow ones scaled


def phi3_config(model: Path, **changes) -> Path:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **changes}))
    return model


def test_phi3_keys_the_fused_projections_as_they_are_and_the_sliding_window(arch_dirs, tmp_path, logs):
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}  # as transformers 5 saves
    model = phi3_config(shutil.copytree(arch_dirs["Phi3ForCausalLM"], tmp_path / "fused"), sliding_window=8,
                        rope_parameters=rope, original_max_position_embeddings=4096)
    fields, tensors = read(write_gguf(model, tmp_path / "m.gguf", "f16"))
    assert fields["general.architecture"] == "phi3"
    assert fields["phi3.rope.dimension_count"] == 12  # 0.75 of the head's 16
    assert fields["phi3.rope.scaling.original_context_length"] == 4096  # as config.json says (Phi3Config's default)
    assert fields["phi3.attention.sliding_window"] == 8
    assert fields["phi3.feed_forward_length"] == 128 and tensors["blk.0.ffn_up.weight"].shape.tolist() == [64, 256]
    assert tensors["blk.0.attn_qkv.weight"].shape.tolist() == [64, 128]  # 4 query + 2 x 2 KV heads of 16
    assert not any(name.startswith("rope_factors") for name in tensors)
    assert any("switches Phi-3's sliding window off" in line and "beyond 8 tokens" in line for line in logs)


def test_phi3_longrope_writes_both_factor_tensors_and_the_attention_factor(arch_dirs, tmp_path, logs):
    long, short = [1.0, 1.5, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0], [1.0, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6]
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "long_factor": long, "short_factor": short}
    model = phi3_config(shutil.copytree(arch_dirs["Phi3ForCausalLM"], tmp_path / "longrope"), rope_parameters=rope,
                        original_max_position_embeddings=64)
    fields, tensors = read(write_gguf(model, tmp_path / "m.gguf", "f32"))
    np.testing.assert_array_equal(values(tensors["rope_factors_long.weight"]), np.float32(long))
    np.testing.assert_array_equal(values(tensors["rope_factors_short.weight"]), np.float32(short))
    assert fields["phi3.rope.scaling.original_context_length"] == 64
    # transformers' LongRoPE attention factor for a context 4x the original: sqrt(1 + ln 4 / ln 64)
    assert fields["phi3.rope.scaling.attn_factor"] == pytest.approx(np.sqrt(1 + np.log(4) / np.log(64)))
    assert "rope.scaling.type" not in " ".join(fields)
    assert any("long factors by the context it is started with (-c above 64)" in line for line in logs)
    phi3_config(model, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ExportError, match="Phi-3 in llama.cpp takes no RoPE scaling or LongRoPE.*'linear'"):
        write_gguf(model, tmp_path / "linear.gguf", "f32")


def test_an_unsupported_architecture_is_refused_by_name(tiny_model_dir, tmp_path):
    model = tmp_path / "next"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "architectures": ["FalconH1ForCausalLM"]}))
    with pytest.raises(ExportError, match="FalconH1ForCausalLM.*Qwen3ForCausalLM, Qwen2ForCausalLM, "
                                          "LlamaForCausalLM, MistralForCausalLM, Gemma3ForCausalLM, "
                                          "Gemma4ForCausalLM, Qwen3MoeForCausalLM, GptOssForCausalLM, "
                                          "Phi3ForCausalLM, Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, "
                                          "Qwen3NextForCausalLM, "
                                          "Glm4MoeLiteForCausalLM, GraniteMoeHybridForCausalLM, "
                                          "NemotronHForCausalLM, Lfm2ForCausalLM, Lfm2MoeForCausalLM, "
                                          "Gemma3ForConditionalGeneration, "
                                          "Gemma4ForConditionalGeneration, Qwen3_5ForConditionalGeneration, "
                                          "Qwen3_5MoeForConditionalGeneration"):
        write_gguf(model, tmp_path / "out" / "m.gguf", "f16")
    assert not (tmp_path / "out").exists()


def test_an_unknown_rope_scaling_is_refused(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    with pytest.raises(ExportError, match="longrope"):
        architectures.architecture_of(config)


def test_pre_tokenizer_named_from_the_regex():
    byte_level = {"model": {"type": "BPE"}, "decoder": {"type": "ByteLevel"}}
    assert pre_tokenizer_name({**byte_level, "pre_tokenizer": {"type": "ByteLevel", "use_regex": True}}) == "gpt-2"
    qwen = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN2_REGEX}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}
    assert pre_tokenizer_name({**byte_level, "pre_tokenizer": qwen}) == "qwen2"
    # gpt-oss's o200k regex as its tokenizer.json spells it (the "original regex" of llama-vocab.cpp's GPT4O)
    o200k = json.loads(r'"[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+'
                       r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+"
                       r"[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
                       r'[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"')
    gpt_oss = json.loads(json.dumps(qwen))
    gpt_oss["pretokenizers"][0]["pattern"]["Regex"] = o200k
    assert pre_tokenizer_name({**byte_level, "pre_tokenizer": gpt_oss}) == "gpt-4o"
    other = json.loads(json.dumps(qwen))
    other["pretokenizers"][0]["pattern"]["Regex"] = r"\p{N}{1,2}|\s+"
    with pytest.raises(ExportError, match=r"regex '\\\\p\{N\}\{1,2\}\|\\\\s\+' is none of those llama.cpp knows"):
        pre_tokenizer_name({**byte_level, "pre_tokenizer": other})
    with pytest.raises(ExportError, match="SentencePiece-style BPE with byte_fallback.*this one is a Unigram model"):
        pre_tokenizer_name({"model": {"type": "Unigram"}, "decoder": {"type": "Metaspace"}})


def test_tensor_types_follow_llama_cpp_converter():
    q8, f16, f32 = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32)
    assert tensor_type("blk.0.attn_q.weight", (64, 64), q8) == q8
    assert tensor_type("blk.0.attn_q.weight", (64, 48), q8) == f16  # a row of 48 is no whole number of 32-blocks
    assert tensor_type("blk.0.attn_q_norm.weight", (16,), q8) == f32
    assert tensor_type("blk.0.attn_q.bias", (64,), q8) == f32
    assert tensor_type("token_embd.weight", (512, 64), gguf.GGMLQuantizationType.BF16) == gguf.GGMLQuantizationType.BF16


def test_a_failure_mid_write_leaves_no_file(tiny_model_dir, tmp_path, monkeypatch):
    calls = []

    def failing(data, qtype):
        calls.append(qtype)
        if len(calls) == 5:
            raise OSError("disk full")
        return original(data, qtype)

    original = gguf.quants.quantize
    monkeypatch.setattr(gguf.quants, "quantize", failing)
    with pytest.raises(OSError, match="disk full"):
        write_gguf(tiny_model_dir, tmp_path / "m.gguf", "q8_0")
    assert list(tmp_path.iterdir()) == []  # neither the GGUF nor its temporary file


def test_export_gguf_writes_the_file_and_a_modelfile(tiny_model_dir, tmp_path):
    result = export_gguf(tiny_model_dir, tmp_path / "gguf", "q8_0", name="run")
    assert result.gguf_file == tmp_path / "gguf" / "run-q8_0.gguf"
    text = result.modelfile.read_text()
    assert "FROM ./run-q8_0.gguf\n" in text and 'PARAMETER stop "<|im_end|>"' in text
    assert "<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n" in text
    assert sorted(path.name for path in (tmp_path / "gguf").iterdir()) == ["Modelfile", "run-q8_0.gguf"]


def test_modelfile_formats():
    assert chat_format("{{ '<|start_header_id|>' + role }}").name == "llama3"
    assert chat_format("<start_of_turn>user").name == "gemma"
    assert chat_format("[INST] {{ m }} [/INST]").name == "mistral"
    unknown = modelfile_text("m.gguf", "{{ messages }}", "<eos>")
    assert "TEMPLATE" not in unknown and "tokenizer.chat_template" in unknown
    assert unknown.endswith('PARAMETER stop "<eos>"\n')
    llama3 = modelfile_text("m.gguf", "<|start_header_id|>", "<|end_of_text|>")
    assert 'PARAMETER stop "<|eot_id|>"\nPARAMETER stop "<|end_of_text|>"' in llama3


def test_without_the_gguf_package_the_error_says_what_to_install(monkeypatch):
    from HyperSloth.outputs.gguf import require_gguf

    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # as if not installed
    with pytest.raises(ExportError, match=r"pip install 'HyperSloth\[gguf\]'"):
        require_gguf()
