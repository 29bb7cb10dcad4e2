"""patches.py: the GQA wrapper Unsloth gets for torch 2.11's varlen_attn must equal grouped-query attention."""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from HyperSloth.outputs import run_files
from HyperSloth.train import patches


def _varlen_without_gqa(query, key, value, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
    """A CPU stand-in for torch 2.11's varlen_attn: (T, H, D) inputs, no GQA, causal when window=(-1, 0)."""
    assert key.shape[1] == query.shape[1], "torch 2.11's varlen_attn has no enable_gqa"
    out = []
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))
        out.append(F.scaled_dot_product_attention(q, k, v, is_causal=window_size == (-1, 0), scale=scale).transpose(0, 1))
    return torch.cat(out)


def test_gqa_wrapper_equals_grouped_query_attention():
    torch.manual_seed(0)
    lengths = [5, 9, 3]
    total, heads, kv_heads, dim = sum(lengths), 8, 2, 16
    q, k, v = torch.randn(total, heads, dim), torch.randn(total, kv_heads, dim), torch.randn(total, kv_heads, dim)
    cu = torch.tensor([0, 5, 14, 17])
    wrapped = patches._gqa_wrapper(_varlen_without_gqa)
    got = wrapped(q, k, v, cu, cu, 9, 9, scale=0.25, window_size=(-1, 0), enable_gqa=True)
    for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = F.scaled_dot_product_attention(
            *(x[start:end].transpose(0, 1) for x in (q, k, v)), is_causal=True, scale=0.25, enable_gqa=True
        ).transpose(0, 1)
        torch.testing.assert_close(got[start:end], ref)


def test_gqa_wrapper_passes_equal_heads_through_unchanged():
    q = k = v = torch.randn(6, 4, 8)
    cu = torch.tensor([0, 6])
    calls = []

    def spy(*args, **kwargs):
        calls.append((args[1].shape, kwargs))
        return args[0]

    patches._gqa_wrapper(spy)(q, k, v, cu, cu, 6, 6, window_size=(-1, 0), enable_gqa=False)
    assert calls == [((6, 4, 8), {"window_size": (-1, 0)})]  # enable_gqa is not forwarded to torch 2.11


def test_patch_is_a_no_op_without_cuda_or_unsloth():
    assert patches.enable_unsloth_torch_varlen() is False


def test_lean_flash_path_is_switched_on_as_unsloth_does_on_newer_torch(monkeypatch):
    import types

    dispatch = types.SimpleNamespace(_LeanFlashVarlen=object, _LEAN_VARLEN=False)
    assert patches.enable_unsloth_lean_varlen(dispatch) is True
    assert dispatch._LEAN_VARLEN is True
    q = torch.zeros(4, 2, 8)  # CPU tensors: never cuDNN
    assert dispatch._varlen_can_use_cudnn(q, q, q, 4, [-1, 0], True) is False
    # Unsloth's own switch still turns it off, and an Unsloth without the lean path is left alone.
    monkeypatch.setenv("UNSLOTH_LEAN_VARLEN", "0")
    off = types.SimpleNamespace(_LeanFlashVarlen=object, _LEAN_VARLEN=False)
    assert patches.enable_unsloth_lean_varlen(off) is False and off._LEAN_VARLEN is False
    monkeypatch.delenv("UNSLOTH_LEAN_VARLEN")
    older = types.SimpleNamespace(_LEAN_VARLEN=False)
    assert patches.enable_unsloth_lean_varlen(older) is False and older._LEAN_VARLEN is False


def _fake_fused_linear(gemm_rows):
    """unsloth_zoo's fused_linear in miniature, with the real one's structure: `_tiled_forward` takes its rows
    and vocabulary tile from `_tiled_layout`, reuses one logits buffer and one accumulator (NaN-filled here:
    torch.empty) for every row chunk, and calls the two GEMM helpers through module globals."""
    import types

    mod = types.SimpleNamespace()

    def _tiled_layout(n_keep, V):
        return min(512, n_keep), 16

    def _logits_into(h, w, out, fp32_logits):
        gemm_rows.append(h.shape[0])
        return torch.mm(h, w.t(), out=out)

    def _dz_w_acc(acc, dz, w):
        gemm_rows.append(dz.shape[0])
        acc.addmm_(dz, w)

    def _tiled_forward(hidden, w):
        (n_keep, H), V = hidden.shape, w.shape[0]
        R, tile = mod._tiled_layout(n_keep, V)
        buf, acc = torch.full((R, tile), float("nan")), torch.full((R, H), float("nan"))
        grad = torch.empty(n_keep, H)
        for a in range(0, n_keep, R):
            b = min(a + R, n_keep)
            n, h = b - a, hidden[a:b]
            acc[:n].zero_()
            for first in range(0, V, tile):
                last = min(first + tile, V)
                x = mod._logits_into(h, w[first:last], buf[:n, : last - first], True)
                x.sigmoid_()  # the kernel that turns the chunk's logits into p in place
                mod._dz_w_acc(acc[:n], buf[:n, : last - first], w[first:last])
            grad[a:b] = acc[:n]
        return grad

    mod._tiled_layout, mod._logits_into, mod._dz_w_acc, mod._tiled_forward = (
        _tiled_layout, _logits_into, _dz_w_acc, _tiled_forward)
    return mod


def test_loss_row_padding_rounds_every_gemm_and_keeps_the_result(monkeypatch):
    monkeypatch.delenv(run_files.ENV_PAD_LOSS_ROWS, raising=False)
    torch.manual_seed(0)
    w = torch.randn(40, 8, dtype=torch.float64)
    for n_keep in (700, 300, 1024):  # a 188-row tail; one chunk smaller than the layout's rows; no tail
        hidden = torch.randn(n_keep, 8, dtype=torch.float64)
        want = sum(torch.sigmoid(hidden @ w[i : i + 16].t()) @ w[i : i + 16] for i in range(0, 40, 16))
        plain_rows, padded_rows = [], []
        plain = _fake_fused_linear(plain_rows)
        padded = _fake_fused_linear(padded_rows)
        assert patches.pad_unsloth_loss_rows(padded) is True
        torch.testing.assert_close(plain._tiled_forward(hidden.float(), w.float()), want.float())
        torch.testing.assert_close(padded._tiled_forward(hidden.float(), w.float()), want.float())
        assert all(rows % 256 == 0 for rows in padded_rows), padded_rows
        assert len(padded_rows) == len(plain_rows)
        assert any(rows % 256 for rows in plain_rows) == (n_keep % 256 != 0)


def test_loss_row_padding_stays_inside_the_tiled_forward(monkeypatch):
    monkeypatch.delenv(run_files.ENV_PAD_LOSS_ROWS, raising=False)
    rows = []
    mod = _fake_fused_linear(rows)
    assert patches.pad_unsloth_loss_rows(mod) is True
    assert patches.pad_unsloth_loss_rows(mod) is False  # applied once
    live = torch.ones(20, 4)  # a caller's tensor whose rows past the slice hold data
    mod._logits_into(torch.ones(5, 3), torch.ones(4, 3), live[:5], True)
    mod._dz_w_acc(live[10:15], torch.zeros(5, 2), torch.ones(2, 4))
    assert rows == [5, 5] and live[5:10].eq(1).all() and live[15:].eq(1).all()
    assert mod._tiled_layout(300, 40) == (300, 16)
    # A window that ends its storage cannot grow; one with room can.
    assert patches._grown(live[15:], 256) is None
    assert patches._grown(torch.empty(512, 4)[:5], 256).shape == (256, 4)


def test_loss_row_padding_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(run_files.ENV_PAD_LOSS_ROWS, "0")
    mod = _fake_fused_linear([])
    assert patches.pad_unsloth_loss_rows(mod) is False
    monkeypatch.delenv(run_files.ENV_PAD_LOSS_ROWS)
    assert patches.pad_unsloth_loss_rows(object()) is False  # an unsloth_zoo without these functions
    assert patches.pad_unsloth_loss_rows() is False  # no unsloth_zoo installed here


def test_unsloths_varlen_routing_for_transformers_attention_is_installed_when_unsloth_has_it(monkeypatch):
    """Unsloth installs hf_packed_attention only with its own padding-free, which HyperSloth turns off."""
    import types

    calls = []
    module = types.ModuleType("unsloth.utils.hf_packed_attention")
    module.enable_hf_packed_attention = lambda: calls.append(1) or True
    monkeypatch.setitem(sys.modules, "unsloth", types.ModuleType("unsloth"))
    monkeypatch.setitem(sys.modules, "unsloth.utils", types.ModuleType("unsloth.utils"))
    monkeypatch.setitem(sys.modules, "unsloth.utils.hf_packed_attention", module)
    assert patches.enable_unsloth_hf_packed_attention() is True and calls == [1]
    monkeypatch.setitem(sys.modules, "unsloth.utils.hf_packed_attention", None)  # an Unsloth without it
    assert patches.enable_unsloth_hf_packed_attention() is False


def test_the_training_patches_are_one_call_that_the_gpu_scripts_share_and_varlen_off_leaves_the_attention_ones_out(
        monkeypatch):
    """The worker and the GPU check scripts apply the same patches (a script without the hf packed-attention route
    profiled cuDNN's SDPA instead of the varlen kernel training runs)."""
    calls = []
    for name in ("enable_unsloth_torch_varlen", "enable_unsloth_hf_packed_attention",
                 "enable_unsloth_packed_sink_attention", "pad_unsloth_loss_rows"):
        monkeypatch.setattr(patches, name, lambda name=name: calls.append(name) or name != "pad_unsloth_loss_rows")
    assert patches.unsloth_training_patches() == {"torch_varlen": True, "hf_packed_attention": True,
                                                  "packed_sink_attention": True, "loss_rows": False}
    assert calls == ["enable_unsloth_torch_varlen", "enable_unsloth_hf_packed_attention",
                     "enable_unsloth_packed_sink_attention", "pad_unsloth_loss_rows"]
    calls.clear()
    applied = patches.unsloth_training_patches(varlen=False)  # fast_model_args.attention='sdpa'
    assert applied["torch_varlen"] is False and applied["hf_packed_attention"] is False
    assert calls == ["enable_unsloth_packed_sink_attention", "pad_unsloth_loss_rows"]
    for script in ("profile_step.py", "reuse_check.py", "graph_check.py"):
        source = (Path(__file__).resolve().parents[2] / "scripts" / script).read_text()
        assert "unsloth_training_patches(" in source, script


def test_unsloths_sink_attention_is_wrapped_once_and_only_with_its_helpers(monkeypatch):
    """gpt-oss's attention with sinks (train/packing/sink_attention.py): the wrapper replaces the package attribute
    Unsloth's gpt-oss patch imports at load, once, and not where a helper it calls is missing."""
    import types

    package = types.ModuleType("unsloth_zoo.flex_attention")
    utils = types.ModuleType("unsloth_zoo.flex_attention.utils")
    original = package.flex_attention_with_sink = lambda *args, **kwargs: "unsloth's"
    utils.flex_attention, utils.compiled_create_block_mask = object(), object()
    utils.FLEX_LSE_KWARGS, utils.flex_output_and_lse = {"return_lse": True}, object()
    package.utils = utils
    monkeypatch.setitem(sys.modules, "unsloth_zoo", types.ModuleType("unsloth_zoo"))
    monkeypatch.setitem(sys.modules, "unsloth_zoo.flex_attention", package)
    monkeypatch.setitem(sys.modules, "unsloth_zoo.flex_attention.utils", utils)
    del utils.flex_output_and_lse
    assert patches.enable_unsloth_packed_sink_attention() is False and package.flex_attention_with_sink is original
    utils.flex_output_and_lse = object()
    assert patches.enable_unsloth_packed_sink_attention() is True
    wrapped = package.flex_attention_with_sink
    assert wrapped is not original and wrapped.hypersloth_packed
    assert patches.enable_unsloth_packed_sink_attention() is False and package.flex_attention_with_sink is wrapped
    attn = torch.nn.Linear(1, 1)
    assert wrapped(attn, torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1), torch.zeros(1, 1, 2, 1)) == "unsloth's"


def test_unsloths_mask_checks_are_answered_without_the_gpu_inside_a_capture(monkeypatch):
    """The warm-up asks Unsloth's host-side mask check; the capture after it reuses that verdict (a host sync fails a
    capture); a mask is never a plain band there (the band kernel knows no sample boundaries)."""
    import types

    calls, answers = [], {(8, 4): True, (8, None): False, (16, 4): True}
    packed = types.ModuleType("unsloth.utils.hf_packed_attention")
    packed._mask_is_block_causal = lambda mask, cu, total, window=None: (calls.append(("block", total, window))
                                                                         or answers[total, window])
    sliding = types.ModuleType("unsloth_zoo.temporary_patches.gemma4_flash_sliding")
    sliding._mask_is_plain_band = lambda mask, S, w, _block=1024, packed_seq_lengths=None: (calls.append(("band", S, w))
                                                                                              or True)
    misc = types.ModuleType("unsloth_zoo.temporary_patches.misc")
    misc._maskless_causal_arguments = lambda signature, args, kwargs: calls.append("maskless") or dict(kwargs)
    monkeypatch.setitem(sys.modules, packed.__name__, packed)
    monkeypatch.setitem(sys.modules, sliding.__name__, sliding)
    monkeypatch.setitem(sys.modules, misc.__name__, misc)
    monkeypatch.setattr(patches, "_BLOCK_CAUSAL_VERDICTS", {})
    originals = packed._mask_is_block_causal, sliding._mask_is_plain_band, misc._maskless_causal_arguments
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    with patches.unsloth_capture_safe_mask_checks():  # the warm-up: Unsloth's checks run
        assert packed._mask_is_block_causal(mask, None, 8, 4) is True
        assert packed._mask_is_block_causal(mask, None, 8) is False
        assert sliding._mask_is_plain_band(mask, 8, 4) is False
        assert sliding._mask_is_plain_band(None, 8, 4) is True  # mask-free: Unsloth's answer (no GPU read)
        # the mask is kept, never dropped on a host check of the position ids (Phi-3's failed capture)
        assert misc._maskless_causal_arguments(None, (), {"position_ids": mask}) is None
    assert calls == [("block", 8, 4), ("block", 8, None), ("band", 8, 4)]
    with patches.unsloth_capture_safe_mask_checks():
        capturing[0] = True
        assert packed._mask_is_block_causal(mask, None, 8, 4) is True  # the warm-up's verdicts, unchecked
        assert packed._mask_is_block_causal(mask, None, 8) is False
        assert sliding._mask_is_plain_band(mask, 8, 4) is False
        assert misc._maskless_causal_arguments(None, (), {"position_ids": mask}) is None
        assert packed._mask_is_block_causal(mask, None, 16, 4) is True  # no warm-up of this row: Unsloth's check
    assert calls[3:] == [("block", 16, 4)]
    assert (packed._mask_is_block_causal, sliding._mask_is_plain_band, misc._maskless_causal_arguments) == originals
    assert misc._maskless_causal_arguments(None, (), {}) == {}  # outside: Unsloth's shortcut as before
    monkeypatch.delitem(sys.modules, sliding.__name__)  # an Unsloth without the router: the other check alone
    with patches.unsloth_capture_safe_mask_checks():
        assert packed._mask_is_block_causal is not originals[0]


def test_attention_reuse_is_installed_on_unsloths_lean_varlen_path_only_where_it_can_be_exact(monkeypatch):
    import types

    class LeanFlashVarlen(torch.autograd.Function):  # the name and protocol only: no call is made here
        pass

    class FakeAttention(torch.nn.Module):
        pass

    def decoder(attention_modules: int):
        layer = torch.nn.Module()
        for i in range(attention_modules):
            layer.add_module(f"attn{i}", FakeAttention())
        model = torch.nn.Module()
        model.layers = torch.nn.ModuleList([layer])
        return model

    dispatch = types.ModuleType("unsloth.utils.attention_dispatch")
    dispatch._LeanFlashVarlen, dispatch._LEAN_VARLEN = LeanFlashVarlen, False
    marker = types.ModuleType("unsloth_zoo.gradient_checkpointing")
    marker.in_gradient_checkpoint_recompute = lambda: False
    monkeypatch.setitem(sys.modules, "unsloth", types.ModuleType("unsloth"))
    utils = types.ModuleType("unsloth.utils")
    utils.attention_dispatch = dispatch
    monkeypatch.setitem(sys.modules, "unsloth.utils", utils)
    monkeypatch.setitem(sys.modules, "unsloth.utils.attention_dispatch", dispatch)
    monkeypatch.setitem(sys.modules, "unsloth_zoo", types.ModuleType("unsloth_zoo"))
    monkeypatch.setitem(sys.modules, "unsloth_zoo.gradient_checkpointing", marker)
    from HyperSloth.train.attention.recompute import install_on_unsloth

    assert install_on_unsloth(decoder(1), 2**30) == (None, "Unsloth's lean varlen attention is off")
    dispatch._LEAN_VARLEN = True
    kept, why = install_on_unsloth(decoder(2), 2**30)
    assert kept is None and "one attention module" in why and dispatch._LeanFlashVarlen is LeanFlashVarlen
    model = decoder(1)
    kept, why = install_on_unsloth(model, 2**30)
    assert why is None and kept.cap_bytes == 2**30 and dispatch._LeanFlashVarlen.wrapped is LeanFlashVarlen
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1  # armed and disarmed by its forward
    assert install_on_unsloth(decoder(1), 2**30) == (None, "already installed")
