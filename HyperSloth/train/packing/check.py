"""Packed rows checked on the loaded model before training: a sample in a packed row attends only to itself.

A packed micro-batch is one row of several samples with restarting position ids (`collate.collate_packed`). The
model has to keep the samples apart: Unsloth runs varlen attention over the packed lengths, transformers derives a
block-diagonal mask from the restarting position ids. A model whose mask ignores the position ids lets every sample
attend to the samples before it in its row, and nothing fails: the loss is just wrong. transformers 5.17's gpt-oss
is one (`GptOssModel.forward` builds its masks without `position_ids`), and so is any decoder whose code does not
pass them on; the rows of a DPO pair (prompt + chosen, prompt + rejected) would then see each other.

`measure` runs two short random samples through the model four ways, in training mode without gradients and with
dropout off: the second sample alone; packed after the first (as training packs them); first in its row with the
first sample after it (nothing to leak: only the longer row's rounding); and after the first as one causal
sequence (a deliberate leak, positions running on). It compares the second sample's outputs with the alone ones in
every token mixer (attention; linear attention, Mamba and short convolutions: recurrent.py) and at the decoder's
output: per module the median over its tokens of each token's relative difference (a recurrent mixer's at its worst
token). Packing is exact when every module's packed difference is within `NOISE_FACTOR` times its rounding one plus
a share of its leak's (`LEAK_SHARE` in 16-bit, `FP32_LEAK_SHARE` in float32, none for a recurrent mixer), and the
check can judge at all: a deliberate leak that moves nothing (`BLIND`) or a rounding control that moves a lot
(`NOISY`) vouches for nothing. The constants below say what each was measured against. Every causal-LM architecture
of transformers 5.17 that built at tiny shapes was run through it on the CPU (2026-12-05): where it says exact, a packed
sample's loss and gradients are the sample's alone (docs/models.md).

`settle_packing` runs it once per load (worker.py, packed runs only), except on Unsloth for a model with recurrent
mixers, whose packed rows are not tried there at all (`unsupported_on_backend`: its forward crashed Qwen3.5 on an
H200, and the per-sample fix exists on the transformers backend only). Where packing leaks it tries each fix
(`_fixes`) and measures again after it: the masks transformers builds from the position ids handed to the decoder
(`masks_from_positions`, a forward pre-hook: `create_causal_mask` / `create_sliding_window_causal_mask` with
`position_ids`, the masks a decoder that passes them would build); then, on the transformers backend, linear
attention and Mamba layers run one sample at a time (recurrent.py), and on Unsloth, gpt-oss's flex attention with
sinks given a mask per sample (sink_attention.py; Unsloth's builds one causal mask over the row); where none works
alone, all that apply together (Granite 4.0-H needs the masks and its Mamba layers per sample). Still leaking: the
worker refuses the run with what to change (`refusal`, a PackedRowsLeak), or, for an SFT run whose config left
training.batching unset, trains it sorted-pad instead (one log line).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
from loguru import logger

from HyperSloth.config import ConfigError
from HyperSloth.train.collate import collate_packed
from HyperSloth.train.packing.exactness import decoder_and_head
from HyperSloth.train.packing.recurrent import kind_of, layer_mixers, per_sample_recurrent_mixers, recurrent_mixers
from HyperSloth.train.packing.sink_attention import document_masks_for_sink_attention
from HyperSloth.train.lora.install import decoder_layers
from HyperSloth.train.model import training_autocast

# Packing is exact when, in every layer, the packed difference is within NOISE_FACTOR x that layer's rounding
# difference of a row that cannot leak, plus LEAK_SHARE of its deliberate leak's. Measured on every tiny architecture
# (CPU, fp32 and bf16): packed and rounding 0, a leak 0.98-1.27. Per layer, not the largest over the layers against
# the largest: a linear-attention layer's state carried across the boundary (transformers' PyTorch fallback) is its
# whole deliberate leak there, but only 0.02-0.05 of the attention layers' leak on random Qwen3.5, Qwen3.5-MoE and
# Qwen3-Next at transformers' initialisation (12 seeds each), which the largest against the largest let pass as exact
# before 2026-12-05. LEAK_SHARE leaves room for bf16 rounding on a GPU where the rounding control shows none (about
# 4e-3 per token, 8 bits of mantissa). A recurrent mixer (linear attention, Mamba) gets none: it reads no positions, so
# its own carried state is in the deliberate leak only mixed with the attention layers' leak upstream (Granite
# 4.0-H with its Mamba layer after the attention one: the masks fixed, its carry passed under LEAK_SHARE and the loss
# stayed 3e-3 off); its rounding control alone bounds its noise, and running it one sample at a time gives exactly
# the sample alone.
NOISE_FACTOR, LEAK_SHARE = 4.0, 0.05
# In float32 the rounding control reads every numeric difference there is (0 on every model measured), so the leak's
# share of slack is for 16-bit only: Inkling's short convolutions on its keys and values moved its attention
# outputs by 2.4% of a deliberate leak and passed within 5% (loss 2e-6, gradients 0.8% off) before 2026-12-05.
FP32_LEAK_SHARE = 1e-3
# A deliberate leak that moves the outputs less than this: the check did not see the token mixers at work (a
# layer it does not know how to hook), so it cannot vouch for packing. Every model measured moves them 0.2-7.6.
BLIND = 1e-3
# A sample first in its row that differs from itself alone by more than this: something besides the sample before it
# moves its outputs (the tokens after it, the row's length, randomness), and that difference would hide a leak. The
# rounding control reads 0 in fp32 and at most 0.016 in bf16 on the GPU (2026-12-03); Doge's attention, which reads
# the whole row, reads 0.86-1.0 and passed as exact with its loss 5e-3 off before 2026-12-05.
NOISY = 0.1
FIRST_TOKENS, SECOND_TOKENS = 32, 16  # the two samples: the second is the one that could see the first
SEED = 20261203
# The layer types `masks_from_positions` builds masks for (a recurrent layer's is its padding mask: none for a packed
# row), and those that take none (Nemotron-H's MoE / MLP blocks)
_MASK_TYPES = ("full_attention", "sliding_attention", "linear_attention", "moe", "mlp")
ATTENTION = ("self_attn", "mixer")  # a decoder layer's attention (Nemotron-H names every block's module `mixer`)


@dataclass(frozen=True)
class PackingCheck:
    """The second sample's outputs against it alone, per measured module (`measure`); the largest over the modules,
    and how many leak (`leaking`)."""

    packed: float  # packed after the first sample, positions restarting (how training packs)
    rounding: float  # first in the row, the first sample after it: nothing to leak, only the longer row's rounding
    leaked: float  # after the first sample as one causal sequence (a deliberate leak)
    layers: int  # token mixers compared (1: the decoder's output alone, where no mixer runs as a module)
    leaking: int = 0  # modules whose packed difference is past NOISE_FACTOR x rounding + their share of the leak
    fix: str | None = None  # what was done to make packing exact, None where the model needed nothing
    unchecked: str | None = None  # why packed rows were not tried at all (`not_tried`); the numbers above are then 0

    @classmethod
    def not_tried(cls, why: str) -> "PackingCheck":
        """A check that ran no forward: packed rows are not tried on this model and backend, for the reason given."""
        return cls(packed=0.0, rounding=0.0, leaked=0.0, layers=0, unchecked=why)

    @property
    def blind(self) -> bool:
        return self.leaked < BLIND

    @property
    def noisy(self) -> bool:
        return self.rounding > NOISY

    @property
    def exact(self) -> bool:
        return self.unchecked is None and self.leaking == 0 and not self.blind and not self.noisy

    def as_record(self) -> dict[str, Any]:
        record = {**asdict(self), "exact": self.exact}
        if self.unchecked is None:  # the usual case: measured
            del record["unchecked"]
        return record


def _token_mixers(model) -> list[tuple[torch.nn.Module, bool]]:
    """Each decoder layer's token mixers, each with whether it is recurrent: its recurrent mixers (linear attention,
    Mamba, short convolutions: recurrent.py, which may sit under an attention name: Kimi-Linear's `self_attn`) and
    its attention (`ATTENTION`); or the layers themselves where none is found."""
    layers = decoder_layers(model) or []
    mixers: list[tuple[torch.nn.Module, bool]] = []
    for layer in layers:
        recurrent = [module for _, module in layer_mixers(layer)]
        attention = [getattr(layer, name, None) for name in ATTENTION]
        mixers += [(module, True) for module in recurrent]
        mixers += [(module, False) for module in attention
                   if isinstance(module, torch.nn.Module) and not any(module is known for known in recurrent)]
    return mixers or [(layer, False) for layer in layers]


@contextmanager
def _quiet_dropout(model):
    """Training mode with every dropout off (no randomness between the passes), as it was afterwards: dropout
    modules, and the rates modules keep for functional dropout (`attention_dropout`; Seed-OSS's
    `residual_dropout`, 0.1 in its config: left on, the check measured its randomness) and for noise on the router's
    input (PhiMoE's `input_jitter_noise` / `router_jitter_noise`)."""
    was_training = model.training
    dropouts = [(m, m.p) for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    rates = [(m, name, value) for m in model.modules() for name, value in vars(m).items()
             if name.endswith(("dropout", "jitter_noise")) and isinstance(value, float)]
    model.train()
    for m, _ in dropouts:
        m.p = 0.0
    for m, name, _ in rates:
        setattr(m, name, 0.0)
    try:
        yield
    finally:
        for m, p in dropouts:
            m.p = p
        for m, name, rate in rates:
            setattr(m, name, rate)
        model.train(was_training)


def _outputs(model, modules: Sequence[torch.nn.Module], batch: dict[str, torch.Tensor],
             rows: slice) -> list[torch.Tensor] | None:
    """Positions `rows` of every module's output (its first tensor, or a model output's last hidden state) in one
    forward: per module [tokens, width], fp32; None where a module's hook did not run (a forward that bypasses them).
    A module called more than once in the forward keeps its last output: Unsloth's compiled decoder blocks run a
    gradient-mode trial of a block before its first call without gradients (same inputs, same outputs)."""
    kept: dict[int, torch.Tensor] = {}

    def keeper(index: int):
        def keep(_module, _args, output):
            tensor = getattr(output, "last_hidden_state", None)
            if tensor is None:  # a causal LM as its own decoder (Llama 4's get_decoder) gives its logits
                tensor = getattr(output, "logits", None)
            if tensor is None:
                tensor = output[0] if isinstance(output, (tuple, list)) else output
            kept[index] = tensor.detach().reshape(-1, tensor.shape[-1])[rows].float().cpu()
        return keep

    device = next(model.parameters()).device
    batch = {k: v if k == "packed_seq_lengths" else v.to(device) for k, v in batch.items()}
    hooks = [m.register_forward_hook(keeper(i)) for i, m in enumerate(modules)]
    try:
        with torch.no_grad(), training_autocast(model):  # training's forward, not a plain one
            model(**batch, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return [kept[i] for i in range(len(modules))] if len(kept) == len(modules) else None


# Unsloth's block compile (unsloth/models/_block_compile.py) remembers per decoder layer which gradient modes it has
# compiled (and whether a compile failed, to retry another way). The check runs the blocks eagerly: what they
# remember is put back afterwards, so training's first call still compiles with Unsloth's fallbacks armed.
_COMPILE_STATE = ("_unsloth_block_checked", "_unsloth_block_mode")


@contextmanager
def _eager(model):
    """torch.compile'd code (Unsloth's compiled decoder blocks) runs eagerly: the check's hooks would otherwise be
    traced into graphs and their recompiles counted against the limit training needs. Each layer's compile state
    is as it was afterwards."""
    layers = decoder_layers(model) or []
    saved = [{key: layer.__dict__[key] for key in _COMPILE_STATE if key in layer.__dict__} for layer in layers]
    try:
        with torch.compiler.set_stance("force_eager"):
            yield
    finally:
        for layer, state in zip(layers, saved):
            for key in _COMPILE_STATE:
                layer.__dict__.pop(key, None)
            layer.__dict__.update(state)


def _difference(x: list[torch.Tensor], reference: list[torch.Tensor], recurrent: torch.Tensor) -> torch.Tensor:
    """Per module, the median over tokens of |x - reference| / |reference| (each token's vector); the largest where
    `recurrent`. An attention leak moves every token of the sample, and a token whose MoE routing a rounding flips
    moves alone. A recurrent mixer's carried state moves the sample's first tokens most (its convolution looks back
    a few tokens, its state decays): on a tiny Granite 4.0-H the median showed 1.6e-7 where the loss was 3e-3 off."""
    per_token = [torch.linalg.vector_norm(a - b, dim=-1) / torch.linalg.vector_norm(b, dim=-1).clamp_min(1e-30)
                 for a, b in zip(x, reference)]  # modules of different widths: a decoder's output, a mixer's
    return torch.stack([t.max() if worst else t.median() for t, worst in zip(per_token, recurrent.tolist())])


def measure(model, *, with_lengths: bool = False) -> PackingCheck:
    """`PackingCheck` of two seeded random samples (`FIRST_TOKENS`, then `SECOND_TOKENS`, token ids drawn from the
    input embeddings' rows) on `model`; `with_lengths` adds `packed_seq_lengths` to the packed rows (Unsloth's
    varlen path), as training does."""
    vocab_size = model.get_input_embeddings().weight.shape[0]
    rng = np.random.default_rng(SEED)
    first, second = (rng.integers(0, vocab_size, n, dtype=np.int64) for n in (FIRST_TOKENS, SECOND_TOKENS))
    segment = lambda ids: (ids, ids.copy())  # noqa: E731
    alone = collate_packed([segment(second)], with_lengths=with_lengths)
    packed = collate_packed([segment(first), segment(second)], with_lengths=with_lengths)
    front = collate_packed([segment(second), segment(first)], with_lengths=with_lengths)
    leaked = collate_packed([segment(first), segment(second)])
    del leaked["position_ids"]  # one causal sequence: positions run on and nothing marks the boundary
    mixers = _token_mixers(model)
    if not mixers:
        raise ConfigError("packed rows cannot be checked on this model: no decoder layers found "
                          "(model.model.layers); set training.batching='sorted-pad'")
    # The decoder's output too, judged as attention's: a leak in a part of a layer the mixers do not cover shows
    # there (ProphetNet's attention outputs looked exact)
    decoder = decoder_and_head(model)[0]
    last, head = slice(-SECOND_TOKENS, None), slice(0, SECOND_TOKENS)
    with _quiet_dropout(model), _eager(model), warnings.catch_warnings():
        # reentrant gradient checkpointing under no_grad says so once per layer; nothing here needs gradients
        warnings.filterwarnings("ignore", message="None of the inputs have requires_grad")
        reference = _outputs(model, [*(module for module, _ in mixers), decoder], alone, last)
        if reference is None:  # the layers' mixers are not called as modules: the decoder's output alone
            mixers = []
            reference = _outputs(model, [decoder], alone, last)
        modules = [*(module for module, _ in mixers), decoder]
        inside, rounding, leak = (_outputs(model, modules, batch, rows)
                                  for batch, rows in ((packed, last), (front, head), (leaked, last)))
    recurrent = torch.tensor([is_recurrent for _, is_recurrent in mixers] + [False])  # the decoder's output: no
    packed, rounding, leaked = (_difference(x, reference, recurrent) for x in (inside, rounding, leak))
    fp32 = model.get_input_embeddings().weight.dtype == torch.float32
    share = torch.where(recurrent, 0.0, FP32_LEAK_SHARE if fp32 else LEAK_SHARE)
    leaking = int((packed > NOISE_FACTOR * rounding + share * leaked).sum())
    return PackingCheck(packed=float(packed.max()), rounding=float(rounding.max()), leaked=float(leaked.max()),
                        layers=len(mixers) or 1, leaking=leaking)


def masks_from_positions(model) -> Callable[[], None] | None:
    """A forward pre-hook on the decoder that, for a call without an attention mask or a cache but with position
    ids (a packed training row), passes the decoder `{"full_attention": ..., "sliding_attention": ...}`: the masks
    transformers builds when given the position ids (block-diagonal over the restarting positions, windowed for
    sliding layers). Returns the hook's `remove`, or None where the decoder has layer types it cannot build masks
    for. Decoders that take a prepared mask mapping (as from `generate`) use it; others ignore it. Hybrid decoders
    (Granite 4.0-H, Nemotron-H) read a "linear_attention" entry for their Mamba layers: a packed row has no padding,
    so it is None, as transformers builds it for an unpadded row."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    decoder = decoder_and_head(model)[0]
    config = decoder.config
    if any(kind not in _MASK_TYPES for kind in (getattr(config, "layer_types", None) or ["full_attention"])):
        return None
    dtype = next(decoder.parameters()).dtype

    def hook(_module, args, kwargs):
        positions = kwargs.get("position_ids")
        if args or positions is None or kwargs.get("attention_mask") is not None \
                or kwargs.get("past_key_values") is not None:
            return None
        shape_of = kwargs.get("inputs_embeds")
        if shape_of is None:
            shape_of = torch.empty((*kwargs["input_ids"].shape, 1), dtype=dtype, device=positions.device)
        masks = {"full_attention": create_causal_mask(config=config, inputs_embeds=shape_of, attention_mask=None,
                                                      past_key_values=None, position_ids=positions)}
        masks["linear_attention"] = None
        if getattr(config, "sliding_window", None):
            masks["sliding_attention"] = create_sliding_window_causal_mask(
                config=config, inputs_embeds=shape_of, attention_mask=None, past_key_values=None,
                position_ids=positions)
        return args, {**kwargs, "attention_mask": masks}

    return decoder.register_forward_pre_hook(hook, with_kwargs=True).remove


def _arch(model) -> str:
    return getattr(getattr(model, "config", None), "model_type", "this model")


class PackedRowsLeak(ConfigError):
    """Packed rows that still leak on this model: the message says what to change, `what` what the model does
    (`leak_text`), `check` what was measured, `loaded` the loaded model where the worker may train it otherwise."""

    def __init__(self, message: str, check: PackingCheck, what: str, loaded: Any = None):
        super().__init__(message)
        self.check, self.what, self.loaded = check, what, loaded

    @classmethod
    def on(cls, model, backend: str, method: str, check: PackingCheck, loaded: Any = None) -> "PackedRowsLeak":
        """The refusal of a `method` run on `model` whose last check is `check` (`refusal`, `leak_text`)."""
        return cls(refusal(model, backend, method, check), check, leak_text(model, backend, check), loaded)


def leak_text(model, backend: str, check: PackingCheck) -> str:
    """What a leaking model does, in one clause."""
    if check.unchecked:
        return check.unchecked
    if check.blind:
        return (f"HyperSloth cannot check that {_arch(model)} on the {backend} backend keeps the samples of a packed "
                f"row apart (a deliberate leak moved the {check.layers} token mixers it found by "
                f"{check.leaked:.0e}: it does not see the layers at work)")
    if check.noisy:
        return (f"HyperSloth cannot check that {_arch(model)} on the {backend} backend keeps the samples of a packed "
                f"row apart (a sample first in its row already differs from itself alone by {check.rounding:.0%}: "
                f"its outputs depend on more than the tokens before it, or on chance)")
    return (f"{_arch(model)} on the {backend} backend lets the samples of a packed row attend to each other (in a "
            f"packed row a sample's attention outputs differ from the sample alone by {check.packed:.0%}; a "
            f"deliberate leak: {check.leaked:.0%})")


def refusal(model, backend: str, method: str, check: PackingCheck) -> str:
    """What to change, for a run whose packed rows leak."""
    if method in ("dpo", "grpo"):
        other = " (fast_model_args.backend='transformers' may keep them apart)" if backend == "unsloth" else ""
        return (f"{leak_text(model, backend, check)}, and method={method!r} trains packed rows only: this model "
                f"cannot be trained with {method.upper()} here{other}")
    return f"{leak_text(model, backend, check)}: set training.batching='sorted-pad' (padded rows, one sample each)"


def settle_packing(model, backend: str) -> PackingCheck:
    """Measure packing on the loaded model (`measure`); where it leaks, try each fix (`_fixes`): hand the decoder
    the masks built from the position ids (`masks_from_positions`; on Unsloth too, whose varlen routing for
    transformers' attention reads a block-diagonal mask), then, on the transformers backend, run the recurrent mixers
    (linear attention, Mamba) one sample at a time (`per_sample_recurrent_mixers`); measure again after each, keeping
    a fix only where it made packing exact, and where none does alone, all that apply together. Logs one line where
    packing is exact; returns the last measurement (`exact` False: packed rows still leak). A model whose packed rows
    are not tried on this backend (`unsupported_on_backend`) runs no forward at all."""
    unsupported = unsupported_on_backend(model, backend)
    if unsupported:
        return PackingCheck.not_tried(unsupported)
    with_lengths = backend == "unsloth"
    check = measure(model, with_lengths=with_lengths)
    if check.exact:
        logger.info(f"packed rows checked: samples stay apart (attention outputs within {check.packed:.1e} of each "
                    f"sample alone, over {check.layers} layers)")
        return check
    applicable = []
    for install, fix, said in _fixes(model, backend, check):
        remove = install(model)
        if remove is None:
            continue
        applicable.append((install, fix, said))
        try:
            fixed = measure(model, with_lengths=with_lengths)
        except Exception as err:  # a decoder that cannot take what the fix hands it (Doge: no mask mapping)
            logger.debug(f"packed rows: {fix} does not apply to {_arch(model)} ({type(err).__name__}: {err})")
            applicable.pop()
            remove()
            continue
        if fixed.exact:
            logger.info(said(fixed))
            return replace(fixed, fix=fix)
        remove()
    if len(applicable) > 1:  # some models need more than one: Granite 4.0-H's decoder builds its masks without the
        removes = [install(model) for install, _, _ in applicable]  # position ids, and its Mamba layers carry state
        fixed = measure(model, with_lengths=with_lengths)  # each applied alone ran: together they do too
        if fixed.exact:
            for _, _, said in applicable:
                logger.info(said(fixed))
            return replace(fixed, fix="; ".join(fix for _, fix, _ in applicable))
        for remove in reversed(removes):
            remove()
    return check


def unsupported_on_backend(model, backend: str) -> str | None:
    """Why packed rows of `model` are not even tried on `backend` (None: measure them). On Unsloth, a model with
    recurrent mixers (linear attention, Mamba, short convolutions): HyperSloth's per-sample fix for them runs on the
    transformers backend only (`_fixes`), and on one H200 (2026-12-05, docs/models.md) the check's first forward on
    such models through Unsloth did harm: Qwen3.5's stopped the process with an illegal memory access (a CUDA error
    the process cannot recover from, so no check may risk it) and Granite 4.0-H's raised a dtype error, while LFM2's
    measured leaking anyway. Their sorted-pad rows trained (Qwen3.5-MoE: 6 steps)."""
    if backend != "unsloth" or not recurrent_mixers(model):
        return None
    return (f"{_arch(model)}'s {kind_of(model)} would carry state from one sample of a packed row to the next, and "
            "HyperSloth runs them one sample at a time on the transformers backend only (fast_model_args.backend="
            "'transformers'), so on the unsloth backend its packed rows are not tried")


def _fixes(model, backend: str, check: PackingCheck) -> list[tuple[Callable[[Any], Callable[[], None] | None], str,
                                                                   Callable[[PackingCheck], str]]]:
    """What settle_packing tries, in order: (install -> its undo or None where it does not apply, what it does, the
    log line once it made packing exact)."""
    arch = _arch(model)
    masks = (masks_from_positions, "the decoder gets the masks built from the position ids",
             lambda fixed: f"packed rows: {arch}'s decoder builds its attention mask without the position ids (samples "
                           f"would see each other: {check.packed:.0%} off); HyperSloth passes it the block-diagonal "
                           f"masks transformers builds from them (checked: within {fixed.packed:.1e})")
    kind = kind_of(model)  # "linear attention", "Mamba layers", "short convolutions" (and combinations)
    one = kind == "linear attention"
    carry = ("read the last tokens of one sample of a packed row in the next" if kind == "short convolutions" else
             f"{'carries its' if one else 'carry their'} state from one sample of a packed row to the next")
    per_sample = (per_sample_recurrent_mixers, f"{kind} {'runs' if one else 'run'} one sample at a time",
                  lambda fixed: f"packed rows: {arch}'s {kind} {carry} on the {backend} backend ({check.packed:.0%} "
                                f"off); HyperSloth runs {'it' if one else 'them'} one sample at a time (checked: "
                                f"within {fixed.packed:.1e})")
    documents = (document_masks_for_sink_attention, "attention with sinks gets a mask per sample",
                 lambda fixed: f"packed rows: Unsloth's flex attention with sinks builds one causal mask over a packed "
                               f"row of {arch} ({check.packed:.0%} off); HyperSloth gives it a mask per sample from the "
                               f"position ids (checked: within {fixed.packed:.1e})")
    # Per-sample recurrent mixers not on Unsloth: its compiled decoder blocks would trace the split, one graph per
    # set of spans. The sinks' document masks only there: the transformers backend takes the masks of the first fix.
    return [masks, documents] if backend == "unsloth" else [masks, per_sample]


def ensure_exact_packing(model, backend: str, method: str = "sft") -> PackingCheck:
    """`settle_packing`, and a PackedRowsLeak saying what to change where packed rows still leak."""
    check = settle_packing(model, backend)
    if not check.exact:
        raise PackedRowsLeak.on(model, backend, method, check)
    return check
