"""The one place where HyperSloth changes a library's behaviour from outside. Each patch names what it
replaces and the versions it was checked against, and returns whether it applied.

`enable_unsloth_torch_varlen`
    Replaces: `unsloth.utils.attention_dispatch._TORCH_VARLEN_ATTN` (a module global, None when unset).
    Why: Unsloth runs packed (padding-free) rows through torch's flash varlen kernel only when
    `torch.nn.attention.varlen.varlen_attn` takes `enable_gqa` (torch >= 2.12). On torch 2.11 it falls
    back to one SDPA call per run of equal sample lengths, per layer, which for Qwen3's grouped-query
    attention turns a packed step into hundreds of small launches. torch 2.11's `varlen_attn` has the
    same kernel, just no GQA flag: we give Unsloth a wrapper that expands the key/value heads (what
    `enable_gqa` does inside the kernel) and otherwise calls torch's function unchanged.
    Also replaces: `attention_dispatch._LEAN_VARLEN` (and `_varlen_can_use_cudnn` when missing). Unsloth
    decides at its import, from `_TORCH_VARLEN_ATTN`, whether eager packed calls that torch would send to
    flash anyway skip `varlen_attn`'s custom-op dispatch and go straight to aten's flash kernels through a
    plain autograd.Function (`_LeanFlashVarlen`); on torch 2.11 that global was None then, so the lean
    path stayed off. The aten flash kernel takes fewer key/value heads than query heads (what torch
    2.12's `enable_gqa` passes it), so on the lean path the key/value heads are not expanded either: no
    per-layer copy of K and V forward, no reduction of their gradients backward. We turn it on exactly as
    Unsloth does on torch >= 2.12 (its `UNSLOTH_LEAN_VARLEN=0` still turns it off), flash only (what
    torch 2.11's `varlen_attn` ran for these rows).
    Checked with: unsloth 2026.10.9, torch 2.11.0+cu130 (H200). A no-op when torch already has
    `enable_gqa`, when flash attention is unavailable, or when Unsloth's global is missing or already set.

`pad_unsloth_loss_rows`
    Replaces: `unsloth_zoo.fused_losses.fused_linear`'s `_tiled_forward`, `_tiled_layout`, `_logits_into` and
    `_dz_w_acc` (module globals), each with a wrapper that calls the original.
    Why: Unsloth's fused loss for a frozen LM head (`_tiled_forward`) cuts the kept rows into chunks of up to
    4,096 and runs two GEMMs per vocabulary tile on each. The last chunk's row count is whatever is left, new
    almost every step, and cuBLAS spends ~2.7 ms of host time choosing an algorithm for a row count it has not
    seen (0.08 ms for a repeat; `scripts/gemm_shapes.py` on an H200): two tile widths times two GEMMs, four
    stalls per step, the GPU idle through them (a profile of steps 4-6 on Qwen3-0.6B: ~13 ms per step). Inside
    `_tiled_forward` only, the wrappers round the chunk's row count up to a multiple of 256 for those GEMMs:
    zero rows in, rows past the chunk's own written into the chunk buffer's unused tail and never read. So
    cuBLAS meets at most 16 row counts per tile width, once each. The rows that count are computed as before
    (each output row depends only on its own input row); the layout asks for buffers of the rounded size.
    Checked with: unsloth_zoo 2026.10.9 (`_tiled_forward` allocates its logits buffer and accumulator with
    `_tiled_layout`'s rows and reads only the chunk's rows of them). `run_files.ENV_PAD_LOSS_ROWS` = 0 turns it off;
    a no-op when any of the four functions is missing.

`enable_unsloth_packed_sink_attention`
    Replaces: `unsloth_zoo.flex_attention.flex_attention_with_sink` (a package attribute), with a wrapper that calls
    it unchanged unless the packed-row check switched document masks on (train/packing/sink_attention.py).
    Why: Unsloth's gpt-oss attention patch binds that function when the model loads and trains gpt-oss's attention
    with sinks through it; it builds a causal BlockMask over the whole row and takes no mask, so the samples of a
    packed row attend to each other (measured on an H200, docs/models.md). The wrapper gives the same flex attention
    and sink scaling a mask that keeps each sample to itself, with Unsloth's own compiled flex attention, block-mask
    builder, kernel options and logsumexp convention.
    Checked with: unsloth_zoo 2026.10.9 (`patch_GptOssAttention` imports the function from the package inside the
    patch, at load; `flex_attention_with_sink(self_attn, query, key, value, attention_mask=None, ...)`). A no-op when
    the function or the helpers are missing; inert until the check installs its pre-hook, and kept by the check only
    where packing then measures exact.

`unsloth_folded_gqa_decode` (a context manager: `scripts/sampling_bench.py`'s `-folded` engines, until measured)
    Replaces: `_decode_attention_core` in `unsloth.models.llama` and `unsloth.models.qwen3` (module globals; the
    attention of one decode token step that Unsloth's CUDA-graph decode runs between its captured segments), with
    `folded_gqa_decode_attention` for a batch of rows with one new token each, the original otherwise.
    Why: for a batch with a padding mask (GRPO's left-padded prompts), Unsloth's Qwen3 decode expands K and V to
    every query head ("Avoid SDPA GQA drift for batched masked decode") and copies the expanded cache, every layer
    and token step: on one H200 a third of the decode's GPU time was copies (docs/grpo.md, 2026-12-05). The folded
    form reads the cache once, unexpanded: a KV head's query heads become that many query rows of one SDPA call over
    the KV head's keys, under the same mask (every row sees the same keys; nothing is causal within one token
    step). The same softmax(Q K^T) V per query head, without the copy; no `enable_gqa` either.
    Checked with: unsloth 2026.10.9 (`_decode_attention_core(self, Qn, kv_seq_len, attention_mask, bsz,
    sdpa_gqa_with_batch_mask)` -> (A, K, V), the cache as `paged_attention_K[:kv_seq_len]` of shape (L, B, H_kv, D),
    `from .llama import _decode_attention_core` in qwen3.py), against an expanded reference on the CPU (fp32);
    not yet on a GPU. A no-op where either module or the function is missing.

`enable_unsloth_attention_reuse` (checkpointed SFT at defaults; `run_files.ENV_REUSE_ATTENTION` = 0 leaves it out)
    Replaces: `unsloth.utils.attention_dispatch._LeanFlashVarlen` (a module global, looked up at every packed call by
    `_varlen_attn_call`) with `attention.recompute.reusing` around it, and puts a forward pre-hook and hook on the
    decoder.
    Why: with gradient checkpointing the backward recomputes every layer's forward, attention's included: on one
    262,144-token sample of Qwen3-0.6B with FA4 (one H100) the step took 51.9 s kept against 64.2 s plain. The first pass
    keeps each layer's attention output and log-sum-exp within the memory the budget left (train/attention/
    recompute.py), and the recompute returns them; the backward is Unsloth's own (`_LeanFlashVarlen.backward`).
    Checked with: unsloth 2026.10.9 (`_LeanFlashVarlen.forward(ctx, query, key, value, cu_seqlens, max_seqlen,
    is_causal, scale, window_left, window_right)` saves (query, key, value, cu_seqlens, out, lse, philox_seed,
    philox_offset); `_varlen_attn_call` calls `_LeanFlashVarlen.apply` when `_LEAN_VARLEN`), unsloth_zoo 2026.10.9
    (`gradient_checkpointing.in_gradient_checkpoint_recompute`); on the CPU with a stand-in kernel and checkpointer
    (tests), and once with `_LeanFlashVarlen`'s own source, aten's two flash ops stood in by CPU attention: the same
    gradients with 3 attention forwards instead of 6 on 3 checkpointed layers. Not yet on a GPU. Not installed where
    either is missing, where the lean path is off, or where a decoder layer has more or fewer than one attention
    module (the kept outputs are a stack, one entry a layer).

`unsloth_static_packed_rows` (a context manager, used only while a CUDA graph is captured)
    Replaces: the entries of `unsloth.utils.packing._PACKED_INFO_CACHE` and `_PACKED_HOST_LENGTHS_CACHE`
    for the row's device (module-level dicts Unsloth fills on every packed forward), for the duration of
    the capture, and removes them after.
    Why: Unsloth turns `packed_seq_lengths` into device offsets and reads the lengths back to the host
    (`tolist()`), which no CUDA graph can capture. Both caches are keyed by the identity of the lengths
    tensor, so filling them with the graph's static device tensors (and their host copy) makes every layer
    take its cache-hit branch: attention reads the static `cu_seqlens`, and `max_seqlen` is the graph's
    fixed bound (HyperSloth.train.step_graph).
    Checked with: unsloth 2026.10.9 (`get_packed_info_from_kwargs`, `_cached_host_lengths`,
    `cover_padded_cu_seqlens`), torch 2.11.0+cu130 on an H200: replays gave eager's loss exactly
    (scripts/graph_check.py). Raises if those caches are missing (another Unsloth version): the capture
    then fails and training goes on eagerly, saying why.
    Also replaces, for the same duration (`unsloth_capture_safe_mask_checks`): `_mask_is_block_causal` in
    `unsloth.utils.hf_packed_attention` and `_mask_is_plain_band` in
    `unsloth_zoo.temporary_patches.gemma4_flash_sliding` (module globals).
    Why: on the transformers modeling path (Gemma 4, Qwen2, Gemma 3, Phi-3 under Unsloth) each attention call checks
    on the host that transformers' mask is the packed row's block-causal mask (`.item()`, `bool()`; the verdict
    cached on the mask object, which is new every forward), and Gemma 4's sliding-window router first checks whether
    it is a plain band. A host sync fails a capture ("called a synchronizing CUDA operation": Gemma 4, one H200,
    2026-12-05), and transformers' own mask code skips its syncs while a stream captures (CPU, every tiny
    architecture: none left). So the warm-up, the eager call just before each capture on the same row, asks
    `_mask_is_block_causal` as usual and the capture reuses its verdict per row length and window; the graph keeps
    that branch for every replay, right for every row it serves: the mask is built from the row's restarting
    position ids, block-causal by construction, and the varlen kernel reads the replayed `cu_seqlens`. A mask is
    never a plain band inside warm-up and capture: a one-sample row would take the band kernel, which knows no
    sample boundaries, and a replay of that graph may carry several samples; the other path is exact for both.
    Checked with: unsloth 2026.10.9 and unsloth_zoo 2026.10.9 (signatures `_mask_is_block_causal(attention_mask,
    cu_seqlens, total, window=None)`, `_mask_is_plain_band(mask, S, w, _block=1024, packed_seq_lengths=None)`; the
    callers look both names up at call time); on the CPU with stand-ins (tests), and once with Unsloth's own two
    functions loaded from its source: on a packed row's mask each made host reads (2, and 1), and inside the context
    under a simulated capture, after a warm-up, none, with the same verdicts. On one H200 (2026-12-05, fifth
    session, `callR`): Gemma 4, Gemma 3 and Qwen2 capture with it, their graphed losses those of eager.
    And replaces `_maskless_causal_arguments` in `unsloth_zoo.temporary_patches.misc` (a module global, looked up at
    call time by Unsloth's wrapper of transformers' `create_causal_mask`) with "keep the mask" (None) for the same
    duration.
    Why: Unsloth drops the causal mask of a row whose position ids never restart (one sample, no padding), checked on
    the host (`bool((position_ids.diff(dim=-1) == 1).all())`, misc.py:925 in unsloth_zoo 2026.10.9): Phi-3's capture
    failed there (one H200, 2026-12-05, fifth session). Inside warm-up and capture the mask is always built, from the
    row's position ids, as for every packed row of several samples: exact for a row of one sample too, and a graph
    captured on a one-sample row without its mask would be wrong for the rows of several samples it replays.
    Checked with: unsloth_zoo 2026.10.9 (`_maskless_causal_arguments(signature, args, kwargs)`, None meaning "call
    transformers' mask function as usual"); on the CPU with a stand-in (tests); on one H100 (2026-12-05, sixth
    session, `callS` and `callPE`): Phi-3 captures, its graphed losses within 1.4e-5 of eager. A no-op where a
    module is not loaded or a function is missing.
"""

from __future__ import annotations

import inspect
import os
from contextlib import contextmanager
from typing import Any


def _gqa_wrapper(varlen_attn):
    def varlen_attn_gqa(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, enable_gqa=False, **kwargs):
        if enable_gqa and key.shape[-2] != query.shape[-2]:
            groups = query.shape[-2] // key.shape[-2]
            # (T, H_kv, D) -> (T, H, D): query head h reads kv head h // groups, as enable_gqa does.
            key = key.repeat_interleave(groups, dim=-2)
            value = value.repeat_interleave(groups, dim=-2)
        return varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs)

    return varlen_attn_gqa


def enable_unsloth_torch_varlen() -> bool:
    """Let Unsloth use torch's varlen flash kernel for packed rows on torch 2.11 (see module docstring)."""
    import torch

    try:
        from torch.nn.attention.varlen import varlen_attn
        from unsloth.utils import attention_dispatch
    except ImportError:
        return False
    params = inspect.signature(varlen_attn).parameters
    if "enable_gqa" in params or "window_size" not in params:
        return False
    if not torch.cuda.is_available() or not torch.backends.cuda.is_flash_attention_available():
        return False
    if getattr(attention_dispatch, "_TORCH_VARLEN_ATTN", "missing") is not None:
        return False
    attention_dispatch._TORCH_VARLEN_ATTN = _gqa_wrapper(varlen_attn)
    enable_unsloth_lean_varlen(attention_dispatch)
    return True


def enable_unsloth_hf_packed_attention() -> bool:
    """Packed rows on the transformers modeling path through a varlen flash kernel, not SDPA over a dense mask.

    Models whose attention Unsloth leaves to transformers (Qwen3-MoE under transformers 5, unsloth 2026.10.9) see a
    packed row's restarting position ids, and transformers' SDPA path builds a block-causal mask over the whole row:
    cuDNN's masked kernel, quadratic in the row. Unsloth's `enable_hf_packed_attention`
    (unsloth/utils/hf_packed_attention.py) routes such calls that carry `packed_seq_lengths` (our collate sends
    them) to a varlen kernel; Unsloth itself installs it only when its trainer turns padding-free on
    (utils/packing.py, `enable_padding_free_metadata`), which HyperSloth switches off because it plans the batches.
    Measured on the H200 (Qwen3-30B-A3B's shape, 12 layers, packed rows of up to 43k tokens): without it a step spent
    1.6 s of GPU time in cuDNN's masked attention, stock Unsloth + TRL 0.07 s in flash (docs/models.md)."""
    try:
        from unsloth.utils.hf_packed_attention import enable_hf_packed_attention
    except ImportError:
        return False
    return bool(enable_hf_packed_attention())


def enable_unsloth_packed_sink_attention() -> bool:
    """Wrap Unsloth's gpt-oss sink attention so packed rows can keep their samples apart (see module docstring)."""
    try:
        import unsloth_zoo.flex_attention as zoo_flex
        from unsloth_zoo.flex_attention import utils as zoo_utils
    except Exception:  # noqa: BLE001 - absent, or failing on this machine: Unsloth's own path stays as it is
        return False
    from HyperSloth.train.packing.sink_attention import packed_sink_attention

    original = getattr(zoo_flex, "flex_attention_with_sink", None)
    helpers = [getattr(zoo_utils, name, None) for name in ("flex_attention", "compiled_create_block_mask",
                                                           "FLEX_LSE_KWARGS", "flex_output_and_lse")]
    if original is None or getattr(original, "hypersloth_packed", False) or any(h is None for h in helpers):
        return False
    flex, create_block_mask, lse_kwargs, output_and_lse = helpers
    zoo_flex.flex_attention_with_sink = packed_sink_attention(
        original, flex=flex, create_block_mask=create_block_mask, lse_kwargs=lse_kwargs, output_and_lse=output_and_lse,
        kernel_options=getattr(zoo_utils, "PREFILL_KERNEL_OPTIONS", None))
    return True


def _switched_off(variable: str) -> bool:
    """True when the environment variable turns a patch off ("0", "false", "no", "off"; on when unset)."""
    return os.environ.get(variable, "1").lower() in ("0", "false", "no", "off")


def _flash_only(query, key, value, max_q, window_size, enable_gqa=False) -> bool:
    """Unsloth's `_varlen_can_use_cudnn` for torch 2.11: varlen_attn never took cuDNN for packed rows."""
    return False


def enable_unsloth_lean_varlen(attention_dispatch) -> bool:
    """Turn on Unsloth's lean flash path for packed rows as its import does on torch >= 2.12 (see the
    module docstring); False when this Unsloth has no such path or `UNSLOTH_LEAN_VARLEN` turns it off."""
    if _switched_off("UNSLOTH_LEAN_VARLEN"):
        return False
    if not hasattr(attention_dispatch, "_LeanFlashVarlen") or not hasattr(attention_dispatch, "_LEAN_VARLEN"):
        return False
    if not hasattr(attention_dispatch, "_varlen_can_use_cudnn"):
        # The lean path runs torch's flash kernel; Unsloth skips it where varlen_attn would pick cuDNN. torch
        # 2.11's varlen_attn always ran flash for these rows (an H200 trace shows only flash kernels), but its
        # per-device cuDNN check does not say so: asking it (as Unsloth does on 2.12/2.13) kept the lean path
        # off on the H200. So: never cuDNN, which is the kernel the shim's own varlen_attn calls ran.
        attention_dispatch._varlen_can_use_cudnn = _flash_only
    attention_dispatch._LEAN_VARLEN = True
    return True


_LOSS_ROW_QUANTUM = 256  # cuBLAS then meets at most 4096 / 256 = 16 row counts per vocabulary tile width


def _rows_up(n: int) -> int:
    return -(-n // _LOSS_ROW_QUANTUM) * _LOSS_ROW_QUANTUM


def _grown(view, rows: int):
    """`view` (a row-major [n, c] window on a larger buffer) widened to `rows` rows, or None where the
    buffer's storage ends before that."""
    if view.dim() != 2 or view.stride(1) != 1:
        return None
    end = view.storage_offset() + (rows - 1) * view.stride(0) + view.shape[1]
    if end * view.element_size() > view.untyped_storage().nbytes():
        return None
    return view.as_strided((rows, view.shape[1]), view.stride(), view.storage_offset())


def pad_unsloth_loss_rows(fused_linear=None) -> bool:
    """Round the fused loss's last row chunk up to a multiple of 256 rows for its GEMMs (see the module
    docstring); False when it is turned off, already applied, or this unsloth_zoo lacks the functions."""
    from HyperSloth.outputs import run_files

    if _switched_off(run_files.ENV_PAD_LOSS_ROWS):
        return False
    if fused_linear is None:
        try:
            from unsloth_zoo.fused_losses import fused_linear
        except ImportError:
            return False
    names = ("_tiled_forward", "_tiled_layout", "_logits_into", "_dz_w_acc")
    if not all(hasattr(fused_linear, name) for name in names):
        return False
    if getattr(fused_linear._tiled_forward, "hypersloth_padded", False):
        return False
    tiled_forward, tiled_layout, logits_into, dz_w_acc = (getattr(fused_linear, name) for name in names)
    scope = {"inside": False, "padded_h": None}  # the wrappers pad only inside _tiled_forward

    def padded_tiled_forward(*args, **kwargs):
        outer = scope["inside"]
        scope["inside"] = True
        try:
            return tiled_forward(*args, **kwargs)
        finally:
            scope["inside"], scope["padded_h"] = outer, None

    def padded_tiled_layout(n_keep, *args, **kwargs):
        return tiled_layout(_rows_up(n_keep) if scope["inside"] else n_keep, *args, **kwargs)

    def padded_logits_into(h, w, out, *args, **kwargs):
        n = h.shape[0]
        grown = _grown(out, _rows_up(n)) if scope["inside"] and n % _LOSS_ROW_QUANTUM else None
        if grown is None:
            return logits_into(h, w, out, *args, **kwargs)
        cached = scope["padded_h"]  # one chunk's rows meet every vocabulary tile: pad them once
        if cached is None or cached[0] is not h or cached[1] != h._version:
            padded = h.new_zeros((grown.shape[0], h.shape[1]))
            padded[:n] = h
            cached = scope["padded_h"] = (h, h._version, padded)  # holding h: its address is not reused
        logits_into(cached[2], w, grown, *args, **kwargs)
        return out

    def padded_dz_w_acc(acc, dz, w):
        rows = _rows_up(dz.shape[0])
        if scope["inside"] and rows != dz.shape[0]:
            acc_grown, dz_grown = _grown(acc, rows), _grown(dz, rows)
            if acc_grown is not None and dz_grown is not None:
                return dz_w_acc(acc_grown, dz_grown, w)
        return dz_w_acc(acc, dz, w)

    padded_tiled_forward.hypersloth_padded = True
    fused_linear._tiled_forward = padded_tiled_forward
    fused_linear._tiled_layout = padded_tiled_layout
    fused_linear._logits_into = padded_logits_into
    fused_linear._dz_w_acc = padded_dz_w_acc
    return True


def unsloth_training_patches(varlen: bool = True) -> dict[str, bool]:
    """The patches a worker applies once Unsloth is imported, in its order: {patch: whether it applied}. `varlen`:
    packed rows through torch's varlen flash kernel (off for fast_model_args.attention='sdpa'). The GPU check scripts
    call it too, so that they attend as training does: without `enable_unsloth_hf_packed_attention` a Qwen3 row went
    to SDPA (cuDNN's kernel, on one H100) and never reached the lean varlen path (scripts/profile_step.py, 2026-12-05)."""
    applied = {"torch_varlen": varlen and enable_unsloth_torch_varlen()}
    applied["hf_packed_attention"] = varlen and enable_unsloth_hf_packed_attention()
    applied["packed_sink_attention"] = enable_unsloth_packed_sink_attention()  # inert until the packed-row check
    applied["loss_rows"] = pad_unsloth_loss_rows()
    return applied


def enable_unsloth_attention_reuse(decoder, wrap) -> str | None:
    """Put `wrap(base, in_recompute)` (attention.recompute.reusing, bound to its KeptAttention) in place of Unsloth's
    lean varlen Function (see module docstring): None when installed, else why not."""
    try:
        from unsloth.utils import attention_dispatch
        from unsloth_zoo.gradient_checkpointing import in_gradient_checkpoint_recompute
    except ImportError:
        return "this Unsloth has no lean varlen attention or no recompute marker"
    base = getattr(attention_dispatch, "_LeanFlashVarlen", None)
    if base is None or not getattr(attention_dispatch, "_LEAN_VARLEN", False):
        return "Unsloth's lean varlen attention is off"
    if getattr(base, "wrapped", None) is not None:
        return "already installed"
    layers = list(getattr(decoder, "layers", []))
    counts = {sum(type(m).__name__.endswith("Attention") for m in layer.modules()) for layer in layers}
    if not layers or counts != {1}:
        return "its decoder layers do not each have one attention module"
    attention_dispatch._LeanFlashVarlen = wrap(base, in_gradient_checkpoint_recompute)
    return None


@contextmanager
def unsloth_static_packed_rows(lengths, cu_seqlens, host_lengths: tuple[int, ...], max_seqlen: int):
    """Make Unsloth's packed attention read these device tensors for the row's segments (see module docstring)."""
    from unsloth.utils import packing

    info = getattr(packing, "_PACKED_INFO_CACHE", None)
    hosts = getattr(packing, "_PACKED_HOST_LENGTHS_CACHE", None)
    if not isinstance(info, dict) or not isinstance(hosts, dict):
        raise RuntimeError("this Unsloth has no packed-info caches (checked with unsloth 2026.10.9)")
    device = lengths.device
    info[device] = {"seq_lengths": lengths, "result": (lengths, cu_seqlens, int(max_seqlen)), "inference": False}
    hosts[device] = (lengths, cu_seqlens, tuple(host_lengths))
    try:
        with unsloth_capture_safe_mask_checks():
            yield
    finally:
        info.pop(device, None)
        hosts.pop(device, None)


# The warm-up's `_mask_is_block_causal` verdicts by (row length, window), for the capture that follows it.
_BLOCK_CAUSAL_VERDICTS: dict[tuple[int, Any], bool] = {}


@contextmanager
def unsloth_capture_safe_mask_checks():
    """Unsloth's host-side mask checks, answered without a host sync inside a capture (module docstring)."""
    import sys

    import torch

    def remembered_block_causal(original):
        def check(attention_mask, cu_seqlens, total, window=None):
            key = (int(total), window)
            if torch.cuda.is_current_stream_capturing() and key in _BLOCK_CAUSAL_VERDICTS:
                return _BLOCK_CAUSAL_VERDICTS[key]
            verdict = original(attention_mask, cu_seqlens, total, window)
            _BLOCK_CAUSAL_VERDICTS[key] = verdict
            return verdict
        return check

    def no_plain_band(original):
        def check(mask, S, w, _block=1024, packed_seq_lengths=None):
            if mask is not None:  # a mask-free call is checked without touching the GPU
                return False
            return original(mask, S, w, _block, packed_seq_lengths=packed_seq_lengths)
        return check

    def mask_kept(original):
        def check(signature, args, kwargs):
            return None  # "keep the mask": transformers builds it from the row's position ids, no host read
        return check

    # only the modules Unsloth loaded: nothing else can call them
    with _wrapped_attributes([
            (sys.modules.get("unsloth.utils.hf_packed_attention"), "_mask_is_block_causal", remembered_block_causal),
            (sys.modules.get("unsloth_zoo.temporary_patches.gemma4_flash_sliding"), "_mask_is_plain_band",
             no_plain_band),
            (sys.modules.get("unsloth_zoo.temporary_patches.misc"), "_maskless_causal_arguments", mask_kept)]):
        yield


@contextmanager
def _wrapped_attributes(targets):
    """Inside the block, each (owner, name, wrap) whose owner has `name` set and whose `wrap(value)` is not None holds
    that wrapped value; after it, the value it had. Yields how many attributes were replaced."""
    replaced = []
    for owner, name, wrap in targets:
        original = getattr(owner, name, None)
        wrapped = wrap(original) if original is not None else None
        if wrapped is not None:
            setattr(owner, name, wrapped)
            replaced.append((owner, name, original))
    try:
        yield len(replaced)
    finally:
        for owner, name, original in reversed(replaced):
            setattr(owner, name, original)


def folded_gqa_decode_attention(self, Qn, kv_seq_len: int, attention_mask):
    """softmax(Q K^T / sqrt(D)) V of one decode token per row over the first `kv_seq_len` cache rows, as Unsloth's
    `_decode_attention_core` returns it ((A [B, H, 1, D], K, V)), with grouped-query heads folded: the G query heads
    of a KV head are G query rows against that head's keys (module docstring). Qn: [B, H, 1, D]; the cache
    `self.paged_attention_K / _V`: (L, B, H_kv, D); attention_mask: None, [B, L] (1 keep) or [B, 1, 1, L] (bool
    keep, or additive 0 / -inf)."""
    import torch

    bsz, n_heads, _, head_dim = Qn.shape
    n_kv = self.paged_attention_K.shape[2]
    Kn = self.paged_attention_K[:kv_seq_len].permute(1, 2, 0, 3)
    Vn = self.paged_attention_V[:kv_seq_len].permute(1, 2, 0, 3)
    Knn, Vnn = Kn, Vn
    sliding_window = getattr(self.config, "sliding_window", None)
    if sliding_window is not None and kv_seq_len > sliding_window:  # as Unsloth's: the last sliding_window keys
        start = kv_seq_len - sliding_window
        Knn, Vnn = Kn[:, :, start:, :], Vn[:, :, start:, :]
        if attention_mask is not None:
            attention_mask = attention_mask[..., start:]
    if attention_mask is not None and attention_mask.dim() == 2:
        attention_mask = attention_mask[:, None, None, :].to(torch.bool)
    elif attention_mask is not None and attention_mask.dim() == 4 and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask.eq(0)
    folded = Qn.reshape(bsz, n_kv, n_heads // n_kv, head_dim)  # head h = kv * G + g, as repeat_kv expands
    A = torch.nn.functional.scaled_dot_product_attention(folded, Knn, Vnn, attn_mask=attention_mask)
    return A.reshape(bsz, n_heads, 1, head_dim), Kn, Vn


def _folded_core(original):
    def decode_attention_core(self, Qn, kv_seq_len, attention_mask, bsz, sdpa_gqa_with_batch_mask):
        plain = ("_unsloth_tp_heads" not in self.__dict__ and bsz != 1 and Qn.shape[-2] == 1
                 and self.num_key_value_groups != 1 and self.paged_attention_K.shape[2] * self.num_key_value_groups
                 == Qn.shape[1] and (attention_mask is None or attention_mask.dim() in (2, 4)))
        if not plain:
            return original(self, Qn, kv_seq_len, attention_mask, bsz, sdpa_gqa_with_batch_mask)
        return folded_gqa_decode_attention(self, Qn, kv_seq_len, attention_mask)

    decode_attention_core.hypersloth_folded = True
    return decode_attention_core


@contextmanager
def unsloth_folded_gqa_decode(modules=None):
    """Inside the block, Unsloth's decode attention with grouped-query heads folded (see the module docstring);
    `modules` (tests): the modules whose `_decode_attention_core` is replaced, else Unsloth's llama and qwen3."""
    if modules is None:
        try:
            from unsloth.models import llama, qwen3
        except ImportError:
            modules = []
        else:
            modules = [llama, qwen3]
    def folded(original):  # a core already folded (an enclosing block) stays as it is
        return None if getattr(original, "hypersloth_folded", False) else _folded_core(original)

    with _wrapped_attributes([(module, "_decode_attention_core", folded) for module in modules]) as replaced:
        yield replaced > 0
