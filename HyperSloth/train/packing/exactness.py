"""Proof that packing is exact at length: a sample inside a packed row trains as it would alone.

A packed micro-batch is one row of several samples with restarting position ids (`collate.collate_packed`);
varlen attention (Unsloth) or the block-diagonal mask transformers builds from the position ids (SDPA)
keeps every sample to itself. If either leaked, or positions did not restart, or the loss counted a
boundary token, the long sample's loss and gradient inside the row would differ from the same sample
fed alone as an ordinary unpacked [1, L] sequence. `packed_vs_alone` measures that difference on any
model (the CPU test at the tiny model's longest length in fp32; the benchmark on the GPU at 32k-262k).
In bf16 that difference is never zero; `packing_controls` measures the two numbers it is judged between: the
same row's rounding with nothing to leak (the sample first in the row) and a real leak (the sample in the
middle of the row fed as one causal sequence).

`sample_losses` gives the other half of the benchmark's check: the summed token loss of each sample
alone, unpacked, without gradients, from which the exact loss of a whole step follows (the reference a
system's logged step-1 loss is compared with: a system that cut a long sample reports another number).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from HyperSloth.train.collate import IGNORE_INDEX, collate_packed
from HyperSloth.train.model import training_autocast


@dataclass(frozen=True)
class PackedVsAlone:
    """The long sample's mean token loss and its gradient on the trainable parameters, packed and alone."""

    sample_tokens: int
    row_tokens: int  # the packed row: the sample and the others around it
    position: int  # the sample's index among the row's segments
    loss_packed: float
    loss_alone: float
    grad_max_abs_diff: float  # max over trainable parameters of |grad packed - grad alone|
    grad_max_abs: float  # max |grad alone|, the scale the difference is judged against

    @property
    def loss_diff(self) -> float:
        return abs(self.loss_packed - self.loss_alone)

    @property
    def grad_rel_diff(self) -> float:
        return self.grad_max_abs_diff / max(self.grad_max_abs, 1e-30)

    def exact(self, loss_tol: float, grad_tol: float) -> bool:
        """Loss within `loss_tol` (absolute) and gradient within `grad_tol` (relative to its largest entry)."""
        return self.loss_diff <= loss_tol and self.grad_rel_diff <= grad_tol

    def as_record(self) -> dict[str, Any]:
        return {**asdict(self), "loss_diff": self.loss_diff, "grad_rel_diff": self.grad_rel_diff}


def _on_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    # Unsloth reads the packed lengths on the host (as the trainer passes them).
    return {k: v if k == "packed_seq_lengths" else v.to(device) for k, v in batch.items()}


def _loss_and_grad(model, batch: dict[str, torch.Tensor], targets: int) -> tuple[float, list[torch.Tensor]]:
    """Mean token loss over `targets` (as the trainer scales it: sum / count) and the trainable gradients."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    with training_autocast(model):  # the forward training runs (the backward outside, as HF's training step)
        loss = model(**batch, num_items_in_batch=targets, use_cache=False).loss
    loss.backward()
    grads = [p.grad.detach().float().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32)
             for p in params]
    for p in params:
        p.grad = None
    return float(loss.detach().float()), grads


def _sample_and_others(sample: np.ndarray, others: Sequence[np.ndarray]) -> tuple[np.ndarray, list]:
    """The sample as int64, and the others as (ids, all -100 labels) segments: only the sample is scored."""
    sample = np.asarray(sample, dtype=np.int64)
    if sample.size < 2:
        raise ValueError(f"the sample needs two tokens or more to have a target; got {sample.size}")
    return sample, [(o, np.full_like(o, IGNORE_INDEX)) for o in (np.asarray(o, dtype=np.int64) for o in others)]


def _alone_and_rows(model, sample: np.ndarray, rows: Sequence[dict[str, torch.Tensor]]
                    ) -> tuple[tuple[float, list[torch.Tensor]], list[tuple[float, list[torch.Tensor]]]]:
    """(loss, grads) of `sample` alone, unpacked, and of each packed row (host tensors), in training mode;
    every pass scores the sample's len - 1 tokens."""
    device = next(model.parameters()).device
    row = torch.from_numpy(sample)[None]
    alone = {"input_ids": row, "labels": row.clone()}  # a loss that shifts labels in place must not touch inputs
    targets = int(sample.size - 1)
    was_training = model.training
    model.train()
    try:
        results = [_loss_and_grad(model, _on_device(batch, device), targets) for batch in (alone, *rows)]
    finally:
        model.train(was_training)
    return results[0], results[1:]


def _max_abs(grads: Sequence[torch.Tensor]) -> float:
    return max((float(g.abs().max()) for g in grads), default=0.0)


def _max_abs_diff(grads: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> float:
    return max((float((a - b).abs().max()) for a, b in zip(grads, reference)), default=0.0)


def packed_vs_alone(model, sample: np.ndarray, others: Sequence[np.ndarray], *, position: int | None = None,
                    with_lengths: bool = False) -> PackedVsAlone:
    """Loss and gradient of `sample` inside a packed row with `others` (at segment `position`, default the
    middle, so samples sit before and after it) against `sample` alone, unpacked.

    In the packed row only the sample's own labels are targets (the others' are -100), so both passes
    score the same len(sample) - 1 tokens; the others still flow through every layer, which is what could
    leak. `with_lengths` adds `packed_seq_lengths` (Unsloth's varlen path). Leaves no gradient behind.
    """
    position = len(others) // 2 if position is None else position
    if not 0 <= position <= len(others):
        raise ValueError(f"position must be in [0, {len(others)}] (segments around the sample); got {position}")
    sample, ignored = _sample_and_others(sample, others)
    packed = collate_packed([*ignored[:position], (sample, sample.copy()), *ignored[position:]],
                            with_lengths=with_lengths)
    (loss_alone, grads_alone), [(loss_packed, grads_packed)] = _alone_and_rows(model, sample, [packed])
    return PackedVsAlone(sample_tokens=int(sample.size), row_tokens=int(packed["input_ids"].shape[1]),
                         position=position, loss_packed=loss_packed, loss_alone=loss_alone,
                         grad_max_abs_diff=_max_abs_diff(grads_packed, grads_alone), grad_max_abs=_max_abs(grads_alone))


@dataclass(frozen=True)
class PackingControls:
    """The long sample's loss and gradient against it alone, in two packed rows whose outcome is known:

    - `front`: the sample first in the row, the others after it. Causal attention never looks forward and
      its positions start at 0 as alone, so even a row with no segment boundaries could not change it: what
      separates it from alone is only the rounding of the longer row's kernels (other GEMM shapes, other
      attention tiling). That is the noise a correct packed row shows, in the same precision.
    - `leaked`: the sample in the middle, the row fed as one causal sequence (no segment lengths, positions
      running on): every earlier sample is visible. That is the size of the error a leak makes.
    """

    sample_tokens: int
    row_tokens: int
    loss_alone: float
    front_loss_diff: float
    front_grad_rel_diff: float
    leaked_loss_diff: float
    leaked_grad_rel_diff: float

    def as_record(self) -> dict[str, Any]:
        return asdict(self)


def packing_controls(model, sample: np.ndarray, others: Sequence[np.ndarray], *,
                     with_lengths: bool = False) -> PackingControls:
    """`PackingControls` of `sample` among `others` (three forward+backward passes: alone, front, leaked).
    `with_lengths` gives the front row `packed_seq_lengths` (Unsloth's varlen path), as `packed_vs_alone`."""
    if not len(others):
        raise ValueError("the controls need other samples to pack the long one with")
    sample, ignored = _sample_and_others(sample, others)
    front = collate_packed([(sample, sample.copy()), *ignored], with_lengths=with_lengths)
    middle = len(ignored) // 2
    leaked = collate_packed([*ignored[:middle], (sample, sample.copy()), *ignored[middle:]])
    del leaked["position_ids"]  # positions run on and nothing marks the boundaries: one causal sequence
    (loss_alone, grads_alone), [(loss_front, grads_front), (loss_leaked, grads_leaked)] = _alone_and_rows(
        model, sample, [front, leaked])
    scale = max(_max_abs(grads_alone), 1e-30)  # as PackedVsAlone.grad_rel_diff
    return PackingControls(sample_tokens=int(sample.size), row_tokens=int(front["input_ids"].shape[1]),
                           loss_alone=loss_alone, front_loss_diff=abs(loss_front - loss_alone),
                           front_grad_rel_diff=_max_abs_diff(grads_front, grads_alone) / scale,
                           leaked_loss_diff=abs(loss_leaked - loss_alone),
                           leaked_grad_rel_diff=_max_abs_diff(grads_leaked, grads_alone) / scale)


def decoder_and_head(model):
    """The transformer body (hidden states after the final norm) and the output projection of a causal LM,
    under PEFT's wrapper or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder()
    if decoder is base and isinstance(getattr(base, "model", None), torch.nn.Module):  # Llama 4's get_decoder
        decoder = base.model
    return decoder, base.get_output_embeddings()


@torch.no_grad()
def sample_losses(model, samples: Sequence[np.ndarray], chunk_tokens: int = 8192) -> list[float]:
    """Summed token loss of each sample alone, unpacked (all tokens targets but the first), no gradients.

    The logits are built `chunk_tokens` rows at a time (fp32 cross-entropy), so a 262k-token sample never
    holds a [tokens, vocab] tensor. The exact loss of a step whose samples train on all tokens is
    sum(sample_losses) / sum(len - 1).
    """
    config = model.config
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
        raise ValueError("sample_losses computes plain logits (hidden @ lm_head); this model scales or caps them")
    decoder, head = decoder_and_head(model)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()  # no dropout: the reference of a step's first loss, where LoRA B is still zero
    try:
        sums = []
        for ids in samples:
            row = torch.as_tensor(np.asarray(ids, dtype=np.int64))[None].to(device)
            hidden = decoder(input_ids=row, use_cache=False).last_hidden_state[0, :-1]
            targets = row[0, 1:]
            total = 0.0
            for start in range(0, targets.numel(), chunk_tokens):
                logits = head(hidden[start:start + chunk_tokens]).float()
                total += float(torch.nn.functional.cross_entropy(logits, targets[start:start + chunk_tokens],
                                                                 reduction="sum"))
            sums.append(total)
        return sums
    finally:
        model.train(was_training)


def step_loss_reference(model, samples: Sequence[np.ndarray]) -> float:
    """The exact loss of one step of `samples` (loss on all tokens): every sample alone, summed, divided by
    the step's target count (what HyperSloth and a correct padding-free trainer both log at step 1)."""
    total = sum(sample_losses(model, samples))
    return total / sum(int(len(s)) - 1 for s in samples)
