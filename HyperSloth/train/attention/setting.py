"""Which kernel packed rows attend with: `fast_model_args.attention`, resolved once per run by the worker.

    auto   per run, one log line saying which and why (`resolve_attention`)
    fa4    FlashAttention-4 (`flash-attn-4`, CuTe DSL, compiled at first call): torch's flash ops, the varlen
           ones included, routed to it through torch's flash-impl registry (torch >= 2.11)
    flash  torch's bundled flash kernels (FlashAttention-2), what HyperSloth ran before this setting
    sdpa   torch's SDPA dispatch as it is: no varlen shim for Unsloth (train/patches.py), no FA4

Why FA4 pays for us where stock Unsloth cannot use it: Unsloth 2026.10.9 measured FA3/FA4 costing 60-110 us more
host time per forward on Hopper (unsloth/utils/flash_impl.py: 2-7% slower at hidden 1024, 0.3-1.8% faster at
2048-4096), so its `auto` turns FA4 on there only for hidden_size >= 2048. Host time per launch is what our CUDA
graphs remove (train/step_graph.py); and on long rows attention is most of the step, where a faster kernel pays
whatever its launch costs.

How: `torch.nn.attention.activate_flash_attention_impl("FA4")` re-registers aten's `_flash_attention_forward` /
`_flash_attention_backward` (and SDPA's flash ops) for CUDA. Every path HyperSloth runs packed rows through calls
those ops: torch's `varlen_attn` (Unsloth's varlen dispatch, our GQA shim on torch 2.11) and Unsloth's lean path
(`_LeanFlashVarlen`, aten's flash ops directly, fewer K/V heads than query heads, which FA4 takes as they are).
The worker activates it once, after the model is loaded and the budget settled, before the trainer captures any
CUDA graph, and only after checking it (train/attention/fa4.agreement_check): one packed row in the model's head
layout, forward and backward, must agree with bundled flash, and under `auto` FA4 must also time at least
FA4_MIN_GAIN faster there; the first FA4 call of each shape compiles (JIT), kept on disk in the HyperSloth cache
(`FLASH_ATTENTION_CUTE_DSL_CACHE_DIR`), so a second run of the same shapes on the same GPU skips it. Unsloth's own
switch (`UNSLOTH_FLASH_ATTENTION_IMPL`) is turned off in the worker: the setting here decides, not Unsloth's rule.

On CPU, and wherever the rule does not pick FA4, nothing imports `flash_attn`. The package is optional
(`pip install -e .[fa4]`).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from loguru import logger

from HyperSloth.train.model_config import attention_heads, layer_attention_heads, text_config

ATTENTION_SETTINGS = ("auto", "fa4", "flash", "sdpa")
# Compute capabilities torch's FA4 registration accepts (torch/nn/attention/_fa4.py, `_fa4_common_support_error`).
FA4_MAJORS = (9, 10)
# "Long rows": a sample this long spends most of its step in attention (Qwen3-0.6B: attention FLOP = linear FLOP
# near 8k tokens per sample, Qwen3-8B near 48k; HyperSloth.plan.run.attention_coef), so a faster kernel pays there
# even without graphs. The rule's threshold until a measurement moves it.
LONG_ROW_TOKENS = 16_384
# What `auto` asks of FA4 on the worker's own timing of both kernels (train/attention/fa4.agreement_check): this
# much faster than bundled flash, or bundled flash it is (measured 2026-12-02 on the H200, 0.6B heads: 44% eager,
# 54% graphed; 8B heads: 34% / 40%).
FA4_MIN_GAIN = 0.05
UNSLOTH_IMPL_ENV = "UNSLOTH_FLASH_ATTENTION_IMPL"  # Unsloth's own FA3/FA4 switch (unsloth/utils/flash_impl.py)
FA4_CACHE_ENABLED_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"  # read by flash_attn.cute.cache_utils at import
FA4_CACHE_DIR_ENV = "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"


@dataclass(frozen=True)
class AttentionFacts:
    """What the rule decides from (the worker gathers them: `gather_facts`; tests pass them)."""

    cuda: bool
    backend: str  # "unsloth" or "transformers"
    capability_major: int | None  # the GPU's compute capability major (9 = Hopper), None without CUDA
    fa4_installed: bool  # flash_attn.cute is on the path (found, not imported)
    registry: bool  # torch has the flash-impl registry (>= 2.11)
    head_dims: tuple[int, ...]  # the model's attention head dims
    attention_dropout: float  # FA4 raises on dropout instead of falling back
    sliding_window: bool  # the model has sliding-window attention layers (Gemma 3, gpt-oss, Mistral v0.1)
    graphed: bool  # the decoder replays CUDA graphs (`step_graph.graph_unavailable` is None)
    longest_sample: int  # tokens


@dataclass(frozen=True)
class AttentionChoice:
    """The kernel a run attends with, what was asked and why (logged once, recorded in run_resolved.json,
    the train summary and every benchmark record)."""

    requested: str
    kernel: str  # "fa4", "flash" or "sdpa"
    reason: str

    def as_record(self) -> dict[str, str]:
        return {"requested": self.requested, "kernel": self.kernel, "reason": self.reason}

    def line(self) -> str:
        return f"attention: {self.kernel} (attention={self.requested!r}: {self.reason})"


def head_dim_supported(major: int, head_dim: int) -> bool:
    """FA4's head dims (flash_attn.cute's `_validate_head_dims`, as Unsloth 2026.10.9 mirrors it): multiples of
    8 from 8, up to 256 on SM90; on SM100 up to 128, or 256."""
    if head_dim % 8 or head_dim < 8:
        return False
    return head_dim <= 256 if major == 9 else head_dim <= 128 or head_dim == 256


def fa4_problem(facts: AttentionFacts) -> str | None:
    """Why FA4 cannot run this model here (None: it can)."""
    if not facts.cuda:
        return "no CUDA device"
    if not facts.registry:
        return "this torch has no flash-attention impl registry (torch >= 2.11 has)"
    if facts.capability_major not in FA4_MAJORS:
        return f"FA4 runs on SM90/SM100 GPUs, this one is SM{facts.capability_major}x"
    if not facts.fa4_installed:
        return "flash-attn-4 is not installed (pip install -e .[fa4])"
    unsupported = sorted({d for d in facts.head_dims if not head_dim_supported(facts.capability_major, d)})
    if unsupported:
        return f"head_dim {unsupported} is not one FA4 has on SM{facts.capability_major}x"
    if facts.attention_dropout > 0:
        return f"attention dropout {facts.attention_dropout} (FA4 has none)"
    if facts.sliding_window:
        return ("sliding-window attention layers (torch 2.11's FA4 backward refuses windows, and the check at start "
                "tries plain causal rows only)")
    return None


def resolve_attention(requested: str, facts: AttentionFacts) -> AttentionChoice:
    """The kernel `requested` stands for on these facts: no CUDA, or the transformers backend (packed rows reach
    attention through its attn_implementation), is SDPA unless FA4 is asked for by name; `auto` picks FA4 where
    it can run and the run is CUDA-graphed or has long rows, else torch's bundled flash."""
    if requested not in ATTENTION_SETTINGS:
        raise ValueError(f"attention={requested!r}: expected one of {ATTENTION_SETTINGS}")
    if not facts.cuda:
        return AttentionChoice(requested, "sdpa", "no CUDA device")
    problem = fa4_problem(facts)
    if requested == "fa4":
        if problem is None:
            return AttentionChoice(requested, "fa4", "asked for by name")
        fallback = "flash" if facts.backend == "unsloth" else "sdpa"
        return AttentionChoice(requested, fallback, f"FA4 cannot run here: {problem}")
    if requested == "sdpa" or facts.backend != "unsloth":
        why = "asked for by name" if requested == "sdpa" else f"the {facts.backend} backend attends through attn_implementation"
        return AttentionChoice(requested, "sdpa", why)
    if requested == "flash":
        return AttentionChoice(requested, "flash", "asked for by name")
    if problem is not None:
        return AttentionChoice(requested, "flash", f"FA4 cannot run here: {problem}")
    if facts.graphed:
        return AttentionChoice(requested, "fa4", "CUDA graphs on (their replays remove FA4's extra host time per launch)")
    if facts.longest_sample >= LONG_ROW_TOKENS:
        return AttentionChoice(requested, "fa4", f"long rows (a {facts.longest_sample:,}-token sample: attention "
                                                 "is most of the step)")
    return AttentionChoice(requested, "flash", f"eager decoder and samples under {LONG_ROW_TOKENS:,} tokens "
                                               "(FA4's extra host time per launch would not pay)")


def fa4_installed() -> bool:
    """flash_attn.cute is on the path. `flash_attn` is a namespace package in flash-attn-4: its folders are
    searched for cute/interface.py, nothing is imported (FlashAttention-2's `flash_attn` would load its CUDA
    extension on import)."""
    try:
        spec = importlib.util.find_spec("flash_attn")
    except (ImportError, ValueError):
        return False
    folders = spec.submodule_search_locations if spec is not None else None
    return any((Path(folder) / "cute" / "interface.py").is_file() for folder in folders or ())


def has_sliding_window(config: Any) -> bool:
    """Whether some attention layer of the model (its text config) is sliding-window: layer_types naming one, or a
    sliding_window size the model uses (Qwen2/Qwen3 carry one with use_sliding_window=False)."""
    text = text_config(config)
    layer_types = getattr(text, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and layer_types:
        return any("sliding" in str(kind) for kind in layer_types)
    return bool(getattr(text, "sliding_window", None)) and getattr(text, "use_sliding_window", True) is not False


def model_head_dims(config: Any) -> tuple[tuple[int, ...], float]:
    """The attention head dims (every layer's, where they differ) and attention dropout of a transformers config
    (its text config where it has one)."""
    dropout = getattr(text_config(config), "attention_dropout", 0.0)
    head_dims = tuple(sorted({head_dim for _, _, head_dim in layer_attention_heads(config)}))
    return head_dims, float(dropout) if isinstance(dropout, (int, float)) else 0.0


class FlashImplRegistry(Protocol):
    """The three functions of torch.nn.attention's flash-impl registry that are used here (tests fake them)."""

    def activate_flash_attention_impl(self, impl: str) -> None: ...
    def current_flash_attention_impl(self) -> str | None: ...
    def restore_flash_attention_impl(self, _raise_warn: bool = True) -> None: ...


def torch_registry() -> FlashImplRegistry | None:
    """torch.nn.attention itself where it has the registry (torch >= 2.11), else None."""
    import torch.nn.attention as attention

    return attention if hasattr(attention, "activate_flash_attention_impl") else None


def fa4_cache_env(cache_root: Path | None, env: MutableMapping[str, str] = os.environ) -> None:
    """FA4's compiled kernels kept on disk under the HyperSloth cache (`cache_root`/fa4; its key holds the GPU
    arch, the shapes and a fingerprint of the sources), unless the user set the variables or the cache is off."""
    if cache_root is None:
        return
    env.setdefault(FA4_CACHE_ENABLED_ENV, "1")
    env.setdefault(FA4_CACHE_DIR_ENV, str(cache_root / "fa4"))


def apply_attention(choice: AttentionChoice, registry: FlashImplRegistry | None,
                    check: Callable[[FlashImplRegistry], Any] | None = None) -> AttentionChoice:
    """Make torch's flash ops run `choice`: FA4 activated in the registry, or whatever was active restored to
    torch's bundled kernels. `check`, where given, activates FA4 itself after comparing it with bundled flash
    and timing both on this GPU (train/attention/fa4.agreement_check, an FA4Check). A failed activation or check
    falls back to bundled flash, and so does `auto` where FA4 was not at least FA4_MIN_GAIN faster; the choice
    then says why."""
    if registry is None:
        return choice
    if choice.kernel != "fa4":
        if registry.current_flash_attention_impl() is not None:
            registry.restore_flash_attention_impl(_raise_warn=False)
        return choice
    try:
        if check is None:
            registry.activate_flash_attention_impl("FA4")
        else:
            found = check(registry)
            slower = (choice.requested == "auto" and found.error is None
                      and found.fa4_ms > (1 - FA4_MIN_GAIN) * found.flash_ms)
            if found.error is not None or slower:
                return back_to_bundled_flash(registry, choice.requested, (
                    f"FA4 disagrees with bundled flash on this model's heads: {found.error}" if found.error
                    else f"{found.timing()}: not {FA4_MIN_GAIN:.0%} faster"))
            choice = AttentionChoice(choice.requested, "fa4", f"{choice.reason}; {found.timing()}")
        active = registry.current_flash_attention_impl()
        if active != "FA4":
            raise RuntimeError(f"the registry reports {active!r} active")
    except Exception as err:  # an import error in flash_attn.cute, a missing CUDA library: say it, train on flash
        return back_to_bundled_flash(registry, choice.requested, f"FA4 activation failed ({type(err).__name__}: "
                                                                 f"{str(err).splitlines()[0] if str(err) else ''})")
    return choice


def back_to_bundled_flash(registry: FlashImplRegistry, requested: str, why: str) -> AttentionChoice:
    """Torch's bundled flash kernels active again (a restore that raises changes nothing: the run trains on them
    either way) and the choice that says why."""
    try:
        registry.restore_flash_attention_impl(_raise_warn=False)
    except Exception:
        pass
    return AttentionChoice(requested, "flash", why)


def decoder_graphed(description, backend: str, config: Any = None) -> bool:
    """Whether the run's decoder will replay CUDA graphs (the conditions `trainer_args.decoder_graphs` checks
    first, an MoE model's included; a layout too small for graphs is found later and leaves the choice made)."""
    from HyperSloth.train.step_graph import run_graph_refusal

    return run_graph_refusal(description, backend, config) is None


def gather_facts(description, loaded_model, longest_sample: int) -> AttentionFacts:
    """This worker's facts for the rule: its GPU, the installed packages, the loaded model's heads."""
    import torch

    cuda = torch.cuda.is_available()
    head_dims, dropout = model_head_dims(loaded_model.model.config)
    return AttentionFacts(
        cuda=cuda, backend=loaded_model.backend,
        capability_major=torch.cuda.get_device_capability()[0] if cuda else None,
        fa4_installed=cuda and fa4_installed(), registry=torch_registry() is not None,
        head_dims=head_dims, attention_dropout=dropout, sliding_window=has_sliding_window(loaded_model.model.config),
        graphed=cuda and decoder_graphed(description, loaded_model.backend, loaded_model.model.config),
        longest_sample=int(longest_sample))


def one_kernel_for_all_ranks(choice: AttentionChoice, every_rank_fa4: bool,
                             registry: FlashImplRegistry | None) -> AttentionChoice:
    """FA4 on this rank but not on every rank (another rank's check failed or timed it slower): bundled flash
    everywhere, so that every rank attends with the same kernel."""
    if choice.kernel != "fa4" or every_rank_fa4:
        return choice
    why = ("FA4 was not chosen on every rank (each rank's line says why): every rank attends with bundled flash, "
           "one kernel for all")
    if registry is None:  # nothing was activated (a torch without the registry never gets here with "fa4")
        return AttentionChoice(choice.requested, "flash", why)
    return back_to_bundled_flash(registry, choice.requested, why)


def settle_attention(description, loaded_model, longest_sample: int, registry: FlashImplRegistry | None = None,
                     every_rank: Callable[[bool], bool] | None = None) -> AttentionChoice:
    """The worker's one call, before the trainer captures graphs: resolve `fast_model_args.attention` on this
    machine and model, make torch's flash ops run it, agree on one kernel over the ranks, log one line.
    `registry`: torch's (default) or a fake; `every_rank`: whether a flag holds on every rank (a collective,
    `dist.all_ranks_ok` by default; every rank calls it once)."""
    from HyperSloth.train.budget.cache import cache_dir
    from HyperSloth.train.dist import all_ranks_ok

    os.environ[UNSLOTH_IMPL_ENV] = "off"  # the setting here decides; Unsloth's rule would flip it inside train()
    requested = description.hyper_config.fast_model_args.attention
    facts = gather_facts(description, loaded_model, longest_sample)
    choice = resolve_attention(requested, facts)
    if choice.kernel == "fa4":
        fa4_cache_env(cache_dir())  # before flash_attn.cute is imported: its cache reads them at import
    check = None
    if choice.kernel == "fa4" and registry is None:
        from HyperSloth.train.attention.fa4 import agreement_check, route_torch_fa4_here, timed_row

        route_torch_fa4_here()  # torch's FA4 entry unpacks fewer values than flash-attn-4 4.0.0b3x returns
        # checked and timed before use: a wrong kernel trains fast, on NaN
        check = agreement_check(*attention_heads(loaded_model.model.config), graphed=facts.graphed,
                                segments=timed_row(facts.graphed, facts.longest_sample, LONG_ROW_TOKENS))
    registry = registry if registry is not None else torch_registry()
    choice = apply_attention(choice, registry, check)
    choice = one_kernel_for_all_ranks(choice, (every_rank or all_ranks_ok)(choice.kernel == "fa4"), registry)
    (logger.warning if requested == "fa4" and choice.kernel != "fa4" else logger.info)(choice.line())
    return choice
