"""packing/check.py: the loaded model is measured to keep the samples of a packed row apart, gpt-oss's decoder
(whose mask ignores the position ids in transformers 5.17) gets the masks built from them, and a model that still
leaks is refused with what to change; Qwen3.5-MoE's linear attention, whose state transformers' PyTorch kernels carry
from one sample to the next, runs one sample at a time (CPU, fp32, tiny models of every architecture). The two
slowest (a Qwen3.5 backward, torch.compile) are in the slow tier."""

import numpy as np
import pytest
import torch

from HyperSloth.config import ConfigError
from HyperSloth.train.packing import check as packing_check
from HyperSloth.train.packing.exactness import packed_vs_alone
from HyperSloth.train.packing.check import ensure_exact_packing, masks_from_positions, measure
from HyperSloth.train.tiny_architectures import ARCHITECTURES, tiny_config, tiny_causal_lm

VOCAB = 128


def _tiny(architecture: str, lora: bool = False):
    """A tiny fp32 model of `architecture`; gpt-oss with a sliding layer (window 8) and a full one, as the real
    model alternates them. `lora`: PEFT adapters with random A and B on the attention, so gradients reach them."""
    config = tiny_config(architecture, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                         initializer_range=0.02, pad_token_id=0, eos_token_id=1)
    if architecture == "gpt_oss":
        config.layer_types, config.sliding_window = ["sliding_attention", "full_attention"], 8
        config._attn_implementation = "eager"  # transformers' only kernel for its attention sinks
    torch.manual_seed(0)
    model = tiny_causal_lm(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    return model


@pytest.mark.parametrize("architecture",  # gpt-oss and Qwen3.5's linear attention: their own tests below
                         [a for a in ARCHITECTURES
                          if a not in ("gpt_oss", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_mm", "granite4_h", "lfm2",
                                       "lfm2_moe")])
def test_architectures_that_pass_the_position_ids_keep_samples_apart(architecture):
    check = ensure_exact_packing(_tiny(architecture), "transformers")
    assert check.exact and check.fix is None
    assert check.packed < 1e-5 and check.rounding < 1e-5 and check.leaked > 0.5, check  # a leak is seen: it can fail
    assert check.layers == 2


def test_gpt_oss_leaks_until_its_decoder_gets_the_masks_built_from_the_positions():
    model = _tiny("gpt_oss", lora=True)
    sample, others = np.arange(2, 42) % VOCAB, [np.arange(50, 80) % VOCAB, np.arange(90, 99)]
    raw = measure(model)
    assert not raw.exact and raw.packed > 0.5 * raw.leaked, raw  # as leaky as the deliberate leak
    before = packed_vs_alone(model, sample, others)
    assert before.loss_diff > 1e-3, before.as_record()  # the loss of a sample inside a packed row is wrong
    check = ensure_exact_packing(model, "transformers")
    assert check.exact and check.packed < 1e-5 and check.fix, check
    after = packed_vs_alone(model, sample, others)  # and now its loss and gradients are the sample's alone
    assert after.grad_max_abs > 1e-4 and after.exact(loss_tol=1e-5, grad_tol=1e-4), after.as_record()


def test_the_masks_hook_leaves_generation_and_unpacked_calls_alone():
    model = _tiny("gpt_oss").eval()
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        padded, plain = model(input_ids=ids, attention_mask=mask).logits, model(input_ids=ids, use_cache=False).logits
        remove = masks_from_positions(model)
        assert remove is not None
        try:
            assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, padded)
            assert torch.equal(model(input_ids=ids, use_cache=False).logits, plain)
        finally:
            remove()


@pytest.mark.parametrize("method, says", [("sft", "set training.batching='sorted-pad'"),
                                          ("dpo", "cannot be trained with DPO here")])
def test_a_model_that_still_leaks_is_refused_with_what_to_change(monkeypatch, method, says):
    model = _tiny("gpt_oss")
    removed = []
    monkeypatch.setattr(packing_check, "masks_from_positions", lambda m: lambda: removed.append(True))
    with pytest.raises(ConfigError, match="lets the samples of a packed row attend to each other") as err:
        ensure_exact_packing(model, "transformers", method)
    assert says in str(err.value) and "gpt_oss on the transformers backend" in str(err.value)
    assert removed == [True]  # the fix that did not help is taken off again


def test_every_forward_of_the_check_runs_under_trainings_autocast(monkeypatch):
    # Granite 4.0-H through Unsloth raised a dtype error in a plain forward (H200, 2026-12-05): the check runs the
    # forward training runs, under the Trainer's autocast (CUDA bf16 there; CPU bf16 stands in for it here)
    model = _tiny("qwen3")
    monkeypatch.setattr(packing_check, "training_autocast", lambda m: torch.autocast("cpu", dtype=torch.bfloat16))
    seen = []
    model.register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_enabled("cpu")))
    measure(model)
    assert len(seen) == 4 and all(seen)  # the sample alone, packed, packed the other way round, leaked
    assert not torch.is_autocast_enabled("cpu")


def test_the_check_leaves_dropout_and_the_mode_as_they_were():
    model = _tiny("qwen3")
    model.model.layers[0].self_attn.attention_dropout = 0.3
    model.eval()
    model.model.embed_dropout = torch.nn.Dropout(0.2)  # a registered dropout module (no effect on the forward)
    check = measure(model)
    assert check.exact
    assert not model.training
    assert model.model.embed_dropout.p == 0.2 and model.model.layers[0].self_attn.attention_dropout == 0.3


def test_a_models_functional_dropout_rates_are_off_during_the_check():
    """Seed-OSS applies `residual_dropout` (0.1 in its published config) with nn.functional.dropout: left on, the
    three passes differ by chance, the rounding control reads 0.1-0.5, and a real leak could pass as exact."""
    from transformers import SeedOssConfig

    config = SeedOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_dropout=0.1,
                           residual_dropout=0.1, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    model = tiny_causal_lm(config)
    check = measure(model)
    assert check.exact and check.rounding < 1e-5 and check.packed < 1e-5 and check.leaked > 0.5, check
    assert model.model.layers[0].self_attn.residual_dropout == 0.1 and model.model.layers[0].mlp.residual_dropout == 0.1


def _tiny_qwen3_5():
    """Qwen3.5-MoE: 3 linear-attention layers (2 key heads, 4 value heads), then a full one."""
    config = tiny_config("qwen3_5_moe", vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_layers=4,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.02,
                         pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    return tiny_causal_lm(config)


@pytest.mark.slow
def test_qwen3_5_linear_attention_leaks_until_it_runs_one_sample_at_a_time():
    """transformers' PyTorch fallbacks of the gated delta rule and its causal conv ignore the packed row's
    boundaries: the second sample starts from the first one's state (part of a deliberate leak's difference, which
    no mask can stop). Run one sample at a time, its loss and gradients are the sample's alone."""
    model = _tiny_qwen3_5()
    raw = measure(model)
    assert raw.layers == 4 and raw.rounding < 1e-5  # the three linear-attention mixers are compared too
    assert not raw.exact and raw.leaking == 5, raw  # the three linear layers, the full one, the decoder's output
    sample, others = np.arange(2, 42) % VOCAB, [np.arange(50, 80) % VOCAB, np.arange(90, 99)]
    assert packed_vs_alone(model, sample, others).loss_diff > 1e-4
    check = ensure_exact_packing(model, "transformers")
    assert check.exact and check.packed < 1e-5 and check.fix == "linear attention runs one sample at a time", check
    after = packed_vs_alone(model, sample, others)
    assert after.grad_max_abs > 1e-4 and after.exact(loss_tol=1e-5, grad_tol=1e-4), after.as_record()
    # under gradient checkpointing the backward recomputes each layer after the decoder returned: split as before
    for reentrant in (True, False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        checkpointed = packed_vs_alone(model, sample, others)
        assert checkpointed.exact(loss_tol=1e-5, grad_tol=1e-4), (reentrant, checkpointed.as_record())
    # not on the Unsloth backend, whose compiled blocks would trace the split: there packed rows are not tried
    unsloth = packing_check.settle_packing(_tiny_qwen3_5(), "unsloth")
    assert not unsloth.exact and unsloth.fix is None and unsloth.unchecked, unsloth


@pytest.mark.parametrize("method, says", [("sft", "set training.batching='sorted-pad'"),
                                          ("grpo", "cannot be trained with GRPO here")])
def test_on_unsloth_recurrent_mixers_are_not_tried_packed_and_no_forward_runs(monkeypatch, method, says):
    """On one H200 the check's first forward through Unsloth stopped Qwen3.5 with an illegal memory access, which no
    process survives: on that backend a model with recurrent mixers is not measured at all, and says why."""
    model = _tiny_qwen3_5()
    monkeypatch.setattr(packing_check, "measure", lambda *a, **k: pytest.fail("the check ran a forward"))
    check = packing_check.settle_packing(model, "unsloth")
    assert not check.exact and check.layers == 0 and check.as_record()["unchecked"] == check.unchecked
    with pytest.raises(ConfigError) as err:
        ensure_exact_packing(model, "unsloth", method)
    message = str(err.value)
    assert "qwen3_5_moe_text's linear attention would carry state" in message, message
    assert "fast_model_args.backend='transformers'" in message and says in message, message


def test_on_unsloth_a_model_without_recurrent_mixers_is_measured(monkeypatch):
    measured = []
    real = packing_check.measure
    monkeypatch.setattr(packing_check, "measure", lambda *a, **k: measured.append(k) or real(*a, **k))
    check = packing_check.settle_packing(_tiny("qwen3"), "unsloth")
    assert check.exact and check.unchecked is None and measured == [{"with_lengths": True}], (check, measured)


@pytest.mark.parametrize("architecture, seed", [("qwen3_5", 1), ("qwen3_5_moe", 3)])
def test_a_small_state_carry_is_a_leak_in_its_own_layer(architecture, seed):
    """At transformers' initialisation (0.02) the linear attention's carried state moved the second sample's outputs,
    as a median over its tokens, by only 4.2% and 2.1% (these two) of what the attention layers' deliberate leak
    moves them: judged as the largest over the layers against the largest leak, before 2026-12-05, that passed as
    exact. A recurrent layer is now judged on its own: at its worst token (the first ones, nearest the carried state)
    and without the leak's share of slack, since it reads no positions."""
    config = tiny_config(architecture, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.02,
                         pad_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = tiny_causal_lm(config)
    raw = measure(model)
    assert not raw.exact and raw.leaking >= 1, raw
    check = ensure_exact_packing(model, "transformers")
    assert check.exact and check.packed < 1e-5 and check.fix == "linear attention runs one sample at a time", check


def _hybrid(name: str):
    """Tiny hybrid models of transformers 5.17, Mamba-2 or delta-rule layers beside attention (fp32, CPU: the
    PyTorch fallbacks, which take no sample boundaries)."""
    import transformers

    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                pad_token_id=0, eos_token_id=1, bos_token_id=None)
    mamba2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16)
    granite = dict(base, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
                   **mamba2)
    configs = {
        "granite4-h": lambda: transformers.GraniteMoeHybridConfig(**granite, layer_types=["mamba", "attention"]),
        "granite4-h-mamba-last": lambda: transformers.GraniteMoeHybridConfig(**granite,
                                                                             layer_types=["attention", "mamba"]),
        "bamba": lambda: transformers.BambaConfig(**base, num_hidden_layers=2, attn_layer_indices=[1], **mamba2),
        "falcon-h1": lambda: transformers.FalconH1Config(**base, num_hidden_layers=2, mamba_d_ssm=128, head_dim=16,
                                                        **mamba2),
        "jamba": lambda: transformers.JambaConfig(**base, num_hidden_layers=2, num_experts=4, attn_layer_period=2,
                                                  attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1,
                                                  use_mamba_kernels=False),
        "nemotron-h": lambda: transformers.NemotronHConfig(
            **base, head_dim=16, layers_block_type=["mamba", "attention", "moe"], mamba_num_heads=4, mamba_head_dim=32,
            ssm_state_size=16, chunk_size=16, n_routed_experts=4, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32, use_mamba_kernels=False, n_groups=1),
        # LFM2: short convolutions (no state: each token reads the 2 before it) beside attention
        "lfm2": lambda: transformers.Lfm2Config(**base, num_hidden_layers=3,
                                                layer_types=["conv", "full_attention", "conv"]),
        # Kimi-Linear: delta-rule linear attention under `self_attn` in its "linear_attention" layers, then MLA
        "kimi-linear": lambda: transformers.KimiLinearConfig(
            **{**base, "num_key_value_heads": 4}, num_hidden_layers=2, head_dim=16, kv_lora_rank=32,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, layer_types=["linear_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse"]),
    }
    torch.manual_seed(0)
    return tiny_causal_lm(configs[name]())


@pytest.mark.parametrize("name, fix", [
    ("granite4-h", "the decoder gets the masks built from the position ids; Mamba layers run one sample at a time"),
    ("granite4-h-mamba-last", "the decoder gets the masks built from the position ids; "
                              "Mamba layers run one sample at a time"),
    ("bamba", "Mamba layers run one sample at a time"),
    ("falcon-h1", "Mamba layers run one sample at a time"),
    ("jamba", "Mamba layers run one sample at a time"),
    ("nemotron-h", "Mamba layers run one sample at a time"),
    ("lfm2", "short convolutions run one sample at a time"),
    pytest.param("kimi-linear", "linear attention runs one sample at a time", marks=pytest.mark.slow)])  # 8 s
def test_hybrid_models_train_packed_rows_as_the_samples_alone(name, fix):
    """A Mamba layer carries its state (and its convolution's last tokens) from one sample of a packed row into the
    next. Before 2026-12-05 the check compared attention only: Falcon-H1 and Jamba passed as exact with their losses
    8e-6 and 3e-5 off and gradients 0.2-0.9% off, and so did LFM2 (its short convolutions read the previous
    sample's last tokens: 9e-6 and 0.3%); Granite 4.0-H, Bamba, Nemotron-H and Kimi-Linear (its delta rule kept
    under `self_attn`) were refused. Granite 4.0-H also builds its masks without the position ids, so it needs
    both fixes together."""
    model = _hybrid(name)
    sample, others = np.arange(2, 42) % VOCAB, [np.arange(50, 80) % VOCAB, np.arange(90, 99)]
    before = packed_vs_alone(model, sample, others)
    assert not before.exact(loss_tol=1e-6, grad_tol=1e-5), before.as_record()
    assert not measure(model).exact
    check = ensure_exact_packing(model, "transformers")
    assert check.exact and check.fix == fix, check
    after = packed_vs_alone(model, sample, others)
    assert after.grad_max_abs > 1e-4 and after.exact(loss_tol=1e-5, grad_tol=1e-4), after.as_record()


def test_the_per_sample_recurrent_mixers_leave_other_calls_alone_and_come_off():
    """Generation (a cache), several rows, one sample per row: the linear attention runs whole, as before; undone,
    the class's own forward is back."""
    from HyperSloth.train.packing.recurrent import per_sample_recurrent_mixers, sample_spans

    assert sample_spans(torch.tensor([[0, 1, 2, 0, 1, 0]])) == [(0, 3), (3, 5), (5, 6)]
    assert sample_spans(torch.tensor([[3, 4, 0, 1]])) == [(0, 2), (2, 4)]  # a row that starts mid-sample
    model = _tiny_qwen3_5().eval()
    ids = torch.arange(2, 14)[None]
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    remove = per_sample_recurrent_mixers(model)
    mixers = [layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn")]
    assert mixers and all("forward" in mixer.__dict__ for mixer in mixers)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, whole)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), generated)
        two_rows = model(input_ids=ids.repeat(2, 1), position_ids=torch.arange(12).repeat(2, 1)).logits
        assert torch.allclose(two_rows[0], whole[0], atol=1e-6)
    remove()
    assert not any("forward" in mixer.__dict__ for mixer in mixers)
    assert per_sample_recurrent_mixers(_tiny("qwen3")) is None  # no linear attention: nothing to do


def test_a_forward_that_bypasses_the_mixer_modules_is_measured_on_the_decoder_output(monkeypatch):
    """Where no layer's attention runs as a module (a backend that calls its functions directly), the decoder's
    last hidden state is compared instead: gpt-oss's leak still shows."""
    model = _tiny("gpt_oss")
    monkeypatch.setattr(packing_check, "decoder_layers", lambda m: [torch.nn.Identity()])  # never called
    check = measure(model)
    assert check.layers == 1 and not check.exact and check.packed > 0.5 * check.leaked, check
    assert measure(_tiny("qwen3")).exact


def test_a_check_that_sees_no_deliberate_leak_vouches_for_nothing(monkeypatch):
    """Where the hooked modules do not move under a deliberate leak (here the embeddings, standing in for the
    mixers and the decoder of a model the check does not know how to read), packed 0 proves nothing: the run is
    refused or falls back, saying so."""
    model = _tiny("qwen3")
    monkeypatch.setattr(packing_check, "_token_mixers", lambda m: [(m.model.embed_tokens, False)])
    monkeypatch.setattr(packing_check, "decoder_and_head", lambda m: (m.model.embed_tokens, None))
    monkeypatch.setattr(packing_check, "_fixes", lambda *args: [])  # nothing to try: the verdict alone
    check = measure(model)
    assert check.blind and not check.exact and check.packed == check.leaked == 0.0, check
    with pytest.raises(ConfigError, match="HyperSloth cannot check that qwen3 on the transformers backend keeps"):
        ensure_exact_packing(model, "transformers")


def _transformers_tiny(name: str):
    import transformers

    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    config = {"doge": lambda: transformers.DogeConfig(**base),
              "inkling": lambda: transformers.InklingTextConfig(**base, head_dim=16)}[name]()
    torch.manual_seed(0)
    return tiny_causal_lm(config)


def test_a_sample_that_moves_without_a_sample_before_it_is_not_vouched_for():
    """Doge's attention reads the whole row: first in its row, a sample's outputs already differ from it alone by
    100%, which hid its leak (packed 1.0 within 4 x that); it passed as exact with its loss 5e-3 off."""
    model = _transformers_tiny("doge")
    check = measure(model)
    assert check.noisy and not check.exact and check.rounding > 0.5, check
    with pytest.raises(ConfigError, match="a sample first in its row already differs from itself alone by"):
        ensure_exact_packing(model, "transformers")


@pytest.mark.slow  # 10 s: Inkling's PyTorch convolution fallback
def test_in_float32_a_small_attention_leak_is_a_leak():
    """Inkling's short convolutions over its keys and values reach 3 tokens back across a sample boundary: its
    attention outputs move by 2% of a deliberate leak's, within the 5% bf16 needs but far above float32's rounding
    (0 here); it passed as exact with its gradients 0.8% off."""
    model = _transformers_tiny("inkling")
    sample, others = np.arange(2, 42) % VOCAB, [np.arange(50, 80) % VOCAB, np.arange(90, 99)]
    assert packed_vs_alone(model, sample, others).grad_rel_diff > 1e-3  # a real leak
    check = measure(model)
    assert check.packed < packing_check.LEAK_SHARE * check.leaked and not check.exact, check


def test_a_causal_lm_that_is_its_own_decoder_is_measured_on_its_body():
    """transformers 5.17's Llama4ForCausalLM.get_decoder() returns the causal LM itself: its body (`model`) is the
    decoder whose output is measured beside the mixers (its logits, 128 wide, once broke the check's stacking)."""
    import transformers

    from HyperSloth.train.packing.exactness import decoder_and_head

    config = transformers.Llama4TextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                           intermediate_size_mlp=128, num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=16, num_local_experts=4, pad_token_id=0,
                                           eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    model = tiny_causal_lm(config)
    assert model.get_decoder() is model and decoder_and_head(model)[0] is model.model
    check = ensure_exact_packing(model, "transformers")
    assert check.exact and check.layers == 2 and check.leaked > 0.5, check


def test_reentrant_gradient_checkpointing_measures_quietly():
    """Under no_grad, reentrant checkpointing warns once per layer that gradients will be None: not in the log."""
    import warnings

    model = _tiny("qwen3")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert measure(model).exact
    assert not [w for w in caught if "requires_grad" in str(w.message)]


@pytest.mark.slow
def test_compiled_blocks_with_a_gradient_trial_are_measured_once_per_layer_and_left_uncompiled(monkeypatch):
    """Unsloth compiles each decoder block (unsloth/models/_block_compile.py) and, before a block's first call
    without gradients, runs it once with gradients: every attention ran twice per forward and the check compared 4
    outputs with 2 (the GPU failure of 2026-12-03). The check keeps each module's last output, runs the blocks
    eagerly (nothing compiled with its hooks in), and leaves the blocks' compile state as it found it."""
    from torch._dynamo.utils import counters

    model = _tiny("qwen3")
    layers = packing_check.decoder_layers(model)
    layer_class = type(layers[0])
    compiled = torch.compile(layer_class.forward, backend="eager")

    def forward(self, hidden_states, *args, **kwargs):  # Unsloth's _wrap, in short
        checked = self.__dict__.get("_unsloth_block_checked", 0)
        if not torch.is_grad_enabled() and not checked & 2:
            with torch.enable_grad():
                forward(self, hidden_states.detach().requires_grad_(), *args, **kwargs)
        bit = 2 if torch.is_grad_enabled() else 1
        self.__dict__["_unsloth_block_checked"] = self.__dict__.get("_unsloth_block_checked", 0) | bit
        return compiled(self, hidden_states, *args, **kwargs)

    monkeypatch.setattr(layer_class, "forward", forward)
    layers[1].__dict__["_unsloth_block_mode"] = "split"  # state a block had before the check stays
    counters.clear()
    check = measure(model)
    assert check.exact and check.layers == 2 and check.leaked > 0.5, check
    assert counters["stats"]["unique_graphs"] == 0  # the hooks were not traced into a graph
    assert all("_unsloth_block_checked" not in layer.__dict__ for layer in layers)
    assert layers[1].__dict__["_unsloth_block_mode"] == "split" and "_unsloth_block_mode" not in layers[0].__dict__
    with torch.no_grad():  # and the compiled blocks still compile for training
        model(input_ids=torch.arange(2, 10)[None])
    assert counters["stats"]["unique_graphs"] > 0
