"""Architectures beyond Qwen3 train at defaults through the real CLI (CPU, gloo). lora_args.target_modules is left
unset in every run. Each packed run logs its step-1 loss as every sample alone gives it (no sample saw another).
1 and 2 workers with the same global batch are compared for one model of each kind of packed-row fix: none
(Qwen3-MoE), masks from the position ids (gpt-oss), per-sample linear attention (Qwen3.5-MoE), both masks and
per-sample Mamba layers (Granite 4.0-H); the rest of the equivalence does not depend on the architecture (the
planner, the loss and the gradient sync: tests/integration/test_training.py on Qwen3, both batching modes).
- A tiny Qwen3-MoE with transformers 5's fused experts gets adapters on its experts; 1 and 2 workers give the same
  adapter.
- A tiny gpt-oss (eager attention, biased transposed experts; its decoder builds masks without the position ids, so
  packed rows leak until HyperSloth hands it the masks) logs its step-1 loss as every sample alone gives it; 1 and
  2 workers agree.
- A tiny Qwen3.5-MoE (linear attention, whose state transformers' PyTorch kernels carry across the samples of a
  packed row) trains packed with its linear attention run one sample at a time: step 1 logs every sample's own
  loss, 1 and 2 workers agree. Without that fix (UNFIXABLE_PACKING_INJECTION, as a model HyperSloth cannot make
  exact) it is refused when its config asks for packed rows, with what to change; with batching left unset it
  trains sorted-pad and resumes from its checkpoint (whose run.json says sorted-pad) to
  the uninterrupted run's losses.
- A tiny GLM-4.7-Flash (latent attention, a dense first layer) trains at defaults.
- A tiny multimodal Gemma 3 (Gemma3ForConditionalGeneration, as Gemma 3 4B+ is) trains its language model only.
- A tiny Qwen3.5-MoE as Qwen3.5-35B-A3B is published (Qwen3_5MoeForConditionalGeneration) trains its text model,
  and a tiny dense Qwen3.5 trains packed with the same per-sample linear attention.
- Tiny Gemma 4 and Gemma 4 MoE (26B-A4B's expert block), as published (Gemma4ForConditionalGeneration; their
  full-attention layers' heads twice as wide as the sliding ones': a per-layer config) train their language model.
- A tiny Granite 4.0-H (Mamba-2 layers whose state the PyTorch kernels carry across a packed row's samples, an
  attention layer whose decoder builds its mask without the position ids, MoE) trains packed with both fixes; 1
  and 2 workers agree.
- A tiny LFM2-MoE (short convolutions that read the previous sample's last tokens in a packed row) trains packed with
  them run one sample at a time.
- A tiny Phi-3 gets its fused qkv_proj / gate_up_proj."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from training_fixtures import (
    DATASET,
    SAVE_STEPS,
    expected_step_loss,
    first_step_indices,
    MAX_SEQ_LENGTH,
    MAX_STEPS,
    SAMPLE_CHAT,
    RunSpec,
    flat_adapter,
    needs,
    pool_fixtures,
    relative_error,
)

from HyperSloth.train.tiny_architectures import TINY_EXPERTS

pytestmark = pytest.mark.slow

RTOL = 1e-5
NUM_CONVERSATIONS = 128
SPECS = [
    RunSpec("moe-2w", model_subdir="qwen3_moe", default_targets=True),
    RunSpec("moe-1w", gpus=1, per_device=8, model_subdir="qwen3_moe", default_targets=True),
    RunSpec("phi3-2w", model_subdir="phi3", default_targets=True),
    RunSpec("gptoss-2w", model_subdir="gpt_oss", default_targets=True),
    RunSpec("gptoss-1w", gpus=1, per_device=8, model_subdir="gpt_oss", default_targets=True),
    RunSpec("qwen35-2w", batching=None, model_subdir="qwen3_5_moe", default_targets=True),
    RunSpec("qwen35-1w", gpus=1, per_device=8, batching=None, model_subdir="qwen3_5_moe", default_targets=True),
    RunSpec("leaky-packed", model_subdir="qwen3_5_moe", default_targets=True, unfixable_packing=True),
    RunSpec("leaky-2w", batching=None, model_subdir="qwen3_5_moe", default_targets=True, unfixable_packing=True),
    RunSpec("leaky-resume", batching=None, model_subdir="qwen3_5_moe", default_targets=True, resume_from="leaky-2w",
            unfixable_packing=True),
    RunSpec("qwen35-mm-2w", batching=None, model_subdir="qwen3_5_moe_mm", default_targets=True),
    RunSpec("qwen35-dense-2w", batching=None, model_subdir="qwen3_5", default_targets=True),
    RunSpec("gemma-mm-2w", model_subdir="gemma3_mm", default_targets=True),
    RunSpec("gemma4-2w", model_subdir="gemma4", default_targets=True),
    RunSpec("gemma4-moe-2w", model_subdir="gemma4_moe", default_targets=True),
    RunSpec("granite-2w", model_subdir="granite4_h", default_targets=True),
    RunSpec("granite-1w", gpus=1, per_device=8, model_subdir="granite4_h", default_targets=True),
    RunSpec("lfm2-moe-2w", model_subdir="lfm2_moe", default_targets=True),
    RunSpec("glm-2w", model_subdir="glm4_moe_lite", default_targets=True),
]


def build_models(workdir: Path, tiny_model_dir: Path) -> Path:
    """Tiny Qwen3-MoE and Phi-3 (the tiny Qwen3's tokenizer and shape) and the sample chats built with it."""
    from HyperSloth.data.build import build_dataset
    from HyperSloth.train.tiny_model import build_tiny_model

    models = workdir / "models"
    for architecture in ("qwen3_moe", "phi3", "gpt_oss", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_mm", "glm4_moe_lite",
                         "gemma3_mm", "gemma4", "gemma4_moe", "granite4_h", "lfm2_moe"):
        build_tiny_model(models / architecture, architecture=architecture)
    source = workdir / "chat.jsonl"
    with SAMPLE_CHAT.open() as lines:
        source.write_text("".join(line for _, line in zip(range(NUM_CONVERSATIONS), lines)))
    build_dataset(str(source), name=DATASET, tokenizer=str(models / "qwen3_moe"), data_dir=str(workdir / "data"),
                  max_seq_length=MAX_SEQ_LENGTH, num_proc=1)
    return models


workdir, model_dir, runs, dataset = pool_fixtures("architectures", SPECS, build=build_models)


def resolved_targets(run) -> dict:
    return json.loads((run.out / "run_resolved.json").read_text())["lora_targets"]


def assert_workers_agree(multi, single) -> None:
    """2 workers and 1 worker with the same global batch: the same losses at every step and the same adapter."""
    losses_multi, losses_single = multi.summary["step_losses"], single.summary["step_losses"]
    assert len(losses_multi) == MAX_STEPS
    assert np.max(np.abs(np.subtract(losses_multi, losses_single)) / np.abs(losses_single)) <= RTOL
    error = relative_error(flat_adapter(multi.adapter()), flat_adapter(single.adapter()))
    assert error <= RTOL, f"final adapters differ: relative error {error:.3g}"


def assert_step_one_is_every_sample_alone(run, workdir, model_dir, dataset) -> None:
    """Step 1 (LoRA B = 0): the logged loss is every sample of the step alone, unpacked: no sample saw another."""
    indices = first_step_indices(run.spec, workdir, model_dir, dataset)
    expected = expected_step_loss(model_dir / run.spec.model_subdir, dataset, indices, run.spec.loss_type)
    assert abs(run.summary["step_losses"][0] - expected) <= RTOL * expected, (run.summary["step_losses"], expected)


@needs("moe-2w", "moe-1w")
def test_moe_two_workers_match_one_and_every_expert_is_trained(runs):
    multi, single = runs.get("moe-2w").check_ok(), runs.get("moe-1w").check_ok()
    assert multi.summary["steps"] == single.summary["steps"] == MAX_STEPS
    weights_multi, weights_single = multi.adapter(), single.adapter()
    assert sorted(weights_multi) == sorted(weights_single)
    assert_workers_agree(multi, single)
    experts_b = {name: w for name, w in weights_multi.items() if "experts" in name and "lora_B" in name}
    assert len(experts_b) == 2 * 2  # gate_up_proj and down_proj, in each of the 2 layers
    for name, weight in experts_b.items():  # (out, r * experts): expert e owns columns e, e + E, ...
        per_expert = weight.reshape(weight.shape[0], -1, TINY_EXPERTS)
        assert all(np.abs(per_expert[:, :, e]).max() > 0 for e in range(TINY_EXPERTS)), name
    assert not any(".gate." in name or "lm_head" in name for name in weights_multi)  # the router stays frozen


@needs("moe-2w")
def test_moe_targets_are_recorded_and_logged(runs):
    run = runs.get("moe-2w").check_ok()
    targets = resolved_targets(run)
    assert targets["source"] == "model"
    assert targets["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert targets["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert (targets["adapted_modules"], targets["adapted_expert_tensors"]) == (8, 4)
    log = (run.out / "logs" / "rank0.log").read_text()
    assert "-> 8 modules, 4 expert tensors; trainable" in log
    # the transformers backend's default: the expert adapters beside the base experts, not PEFT's W + BA stack
    assert "expert LoRA: grouped GEMMs beside the base experts in 2 MoE layers (training.expert_lora='auto'" in log


@needs("phi3-2w")
def test_phi3_trains_its_fused_projections_at_defaults(runs):
    run = runs.get("phi3-2w").check_ok()
    targets = resolved_targets(run)
    assert set(targets["target_modules"]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    losses = run.summary["step_losses"]
    assert len(losses) == MAX_STEPS and losses[-1] < losses[0]
    assert any("qkv_proj" in name for name in run.adapter())


@needs("gptoss-2w", "gptoss-1w")
def test_gpt_oss_packed_rows_train_each_sample_as_alone_and_two_workers_match_one(runs, dataset, workdir, model_dir):
    multi, single = runs.get("gptoss-2w").check_ok(), runs.get("gptoss-1w").check_ok()
    packing = json.loads((multi.out / "run_resolved.json").read_text())["packing"]
    assert packing["exact"] and packing["fix"] == "the decoder gets the masks built from the position ids", packing
    assert packing["leaked"] > 0.5 and packing["packed"] < 1e-5
    log = (multi.out / "logs" / "rank0.log").read_text()
    assert "gpt_oss's decoder builds its attention mask without the position ids" in log
    assert_step_one_is_every_sample_alone(multi, workdir, model_dir, dataset)
    assert_workers_agree(multi, single)
    assert any("experts" in name for name in multi.adapter())


@needs("qwen35-2w", "qwen35-1w")
def test_qwen3_5_moe_trains_packed_with_its_linear_attention_per_sample_on_one_or_two_workers(runs, dataset, workdir,
                                                                                            model_dir):
    multi, single = runs.get("qwen35-2w").check_ok(), runs.get("qwen35-1w").check_ok()
    packing = json.loads((multi.out / "run_resolved.json").read_text())["packing"]
    assert packing["exact"] and packing["fix"] == "linear attention runs one sample at a time", packing
    assert multi.summary["batching"] == single.summary["batching"] == "packed"
    log = (multi.out / "logs" / "rank0.log").read_text()
    assert "qwen3_5_moe_text's linear attention carries its state from one sample of a packed row" in log
    assert_step_one_is_every_sample_alone(multi, workdir, model_dir, dataset)
    assert_workers_agree(multi, single)
    assert any("linear_attn.in_proj_qkv" in name for name in multi.adapter())
    assert any("experts" in name for name in multi.adapter())


@needs("qwen35-mm-2w")
def test_qwen3_5_moe_as_published_trains_its_text_model_at_defaults(runs, dataset, workdir, model_dir):
    """Qwen3.5-35B-A3B's checkpoint is the multimodal Qwen3_5MoeForConditionalGeneration; AutoModelForCausalLM
    loads its text model (the vision tower is not loaded), which trains packed as the text-only checkpoint does."""
    run = runs.get("qwen35-mm-2w").check_ok()
    assert run.summary["batching"] == "packed"
    packing = json.loads((run.out / "run_resolved.json").read_text())["packing"]
    assert packing["exact"] and packing["fix"] == "linear attention runs one sample at a time", packing
    assert_step_one_is_every_sample_alone(run, workdir, model_dir, dataset)
    adapter = run.adapter()
    assert any("experts" in name for name in adapter) and not any("visual" in name for name in adapter)


@needs("qwen35-dense-2w")
def test_dense_qwen3_5_trains_packed_with_its_linear_attention_per_sample(runs, dataset, workdir, model_dir):
    run = runs.get("qwen35-dense-2w").check_ok()
    assert run.summary["batching"] == "packed"
    packing = json.loads((run.out / "run_resolved.json").read_text())["packing"]
    assert packing["exact"] and packing["fix"] == "linear attention runs one sample at a time", packing
    assert_step_one_is_every_sample_alone(run, workdir, model_dir, dataset)
    assert any("linear_attn.in_proj_qkv" in name for name in run.adapter())


@needs("leaky-packed", "leaky-2w")
def test_a_model_whose_packed_rows_stay_leaky_is_refused_packed_and_at_defaults_trains_sorted_pad(runs):
    """The tiny Qwen3.5-MoE without the per-sample fix (UNFIXABLE_PACKING_INJECTION), as a model HyperSloth cannot
    make exact."""
    refused = runs.get("leaky-packed")
    assert refused.returncode != 0, refused.output[-2000:]
    assert "qwen3_5_moe_text on the transformers backend lets the samples of a packed row attend to each other" \
        in refused.output and "set training.batching='sorted-pad'" in refused.output
    assert not (refused.out / "train_summary.json").exists()
    run = runs.get("leaky-2w").check_ok()
    packing = json.loads((run.out / "run_resolved.json").read_text())["packing"]
    assert packing["switched_to"] == "sorted-pad" and not packing["exact"], packing
    assert run.summary["batching"] == "sorted-pad" and run.summary["steps"] == MAX_STEPS
    log = (run.out / "logs" / "rank0.log").read_text()
    assert "training.batching is not set, so this run trains sorted-pad" in log


@needs("gemma-mm-2w")
def test_a_multimodal_gemma3_trains_its_language_model_at_defaults(runs, dataset, workdir, model_dir):
    """Gemma 3 4B+ is Gemma3ForConditionalGeneration: packed rows checked on its language model's layers, adapters
    on those only (the vision tower's q/k/v left out), every sample alone at step 1."""
    multi = runs.get("gemma-mm-2w").check_ok()
    resolved = json.loads((multi.out / "run_resolved.json").read_text())
    assert resolved["packing"]["exact"] and resolved["packing"]["fix"] is None, resolved["packing"]
    assert resolved["lora_targets"]["excluded_modules"] and all(
        "vision_tower" in name for name in resolved["lora_targets"]["excluded_modules"])
    assert multi.adapter() and not any("vision" in name for name in multi.adapter())
    assert_step_one_is_every_sample_alone(multi, workdir, model_dir, dataset)


@needs("gemma4-2w", "gemma4-moe-2w")
def test_gemma4_and_its_moe_train_their_language_model_at_defaults(runs, dataset, workdir, model_dir):
    """Gemma 4's config is heterogeneous (transformers raises on reading `head_dim` whole: it differs between the
    sliding and the full-attention layers); before 2026-12-05 the attention setting read it so and every run failed
    at start."""
    for name in ("gemma4-2w", "gemma4-moe-2w"):
        run = runs.get(name).check_ok()
        resolved = json.loads((run.out / "run_resolved.json").read_text())
        assert resolved["packing"]["exact"] and resolved["packing"]["fix"] is None, resolved["packing"]
        assert resolved["lora_targets"]["excluded_modules"], resolved["lora_targets"]  # the vision tower's
        assert run.adapter() and not any("vision" in key for key in run.adapter())
        assert_step_one_is_every_sample_alone(run, workdir, model_dir, dataset)
    moe = runs.get("gemma4-moe-2w")
    assert any("experts" in key for key in moe.adapter()) and not any("router" in key for key in moe.adapter())


@needs("granite-2w", "granite-1w")
def test_granite_4_h_trains_packed_with_its_mamba_layers_per_sample_and_two_workers_match_one(runs, dataset, workdir,
                                                                                            model_dir):
    multi, single = runs.get("granite-2w").check_ok(), runs.get("granite-1w").check_ok()
    packing = json.loads((multi.out / "run_resolved.json").read_text())["packing"]
    assert packing["exact"] and packing["fix"] == ("the decoder gets the masks built from the position ids; "
                                                   "Mamba layers run one sample at a time"), packing
    assert multi.summary["batching"] == single.summary["batching"] == "packed"
    assert_step_one_is_every_sample_alone(multi, workdir, model_dir, dataset)
    assert_workers_agree(multi, single)
    assert any("mamba.in_proj" in key for key in multi.adapter()) and any("experts" in key for key in multi.adapter())


@needs("lfm2-moe-2w")
def test_lfm2_moe_trains_packed_with_its_short_convolutions_per_sample(runs, dataset, workdir, model_dir):
    multi = runs.get("lfm2-moe-2w").check_ok()
    packing = json.loads((multi.out / "run_resolved.json").read_text())["packing"]
    assert packing["exact"] and packing["fix"] == "short convolutions run one sample at a time", packing
    assert multi.summary["batching"] == "packed"
    assert_step_one_is_every_sample_alone(multi, workdir, model_dir, dataset)
    assert any("conv.in_proj" in key for key in multi.adapter()) and any("experts" in key for key in multi.adapter())


@needs("glm-2w")
def test_glm_4_7_flash_trains_at_defaults(runs, dataset, workdir, model_dir):
    multi = runs.get("glm-2w").check_ok()
    assert json.loads((multi.out / "run_resolved.json").read_text())["packing"]["fix"] is None  # keeps samples apart
    assert_step_one_is_every_sample_alone(multi, workdir, model_dir, dataset)
    assert any("kv_b_proj" in name for name in multi.adapter()) and any("experts" in name for name in multi.adapter())


@needs("leaky-2w", "leaky-resume")
def test_a_run_switched_to_sorted_pad_by_itself_resumes_as_it_ran(runs):
    full, resumed = runs.get("leaky-2w").check_ok(), runs.get("leaky-resume").check_ok()
    a, b = full.summary, resumed.summary
    assert b["batching"] == "sorted-pad" and b["steps"] == MAX_STEPS
    assert b["step_losses"][:SAVE_STEPS] == a["step_losses"][:SAVE_STEPS]
    assert np.max(np.abs(np.subtract(b["step_losses"], a["step_losses"])) / np.abs(a["step_losses"])) <= RTOL
    error = relative_error(flat_adapter(full.adapter()), flat_adapter(resumed.adapter()))
    assert error <= RTOL, f"final adapters differ: relative error {error:.3g}"
