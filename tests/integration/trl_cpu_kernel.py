"""TRL 1.15's fused LM head on CPU, for the tests that run TRL's DPOTrainer as the reference.

TRL's DPOTrainer computes per-token log-probabilities through `add_fused_lm_head`, whose kernel
(`trl.kernels.ChunkedLogProbFunction`) is Triton, GPU only: on a CPU-only machine TRL sets it to None
and its DPO loss cannot run. `ReferenceLogProbFunction` computes the same five outputs from their
definitions (full logits, log_softmax, gather), differentiably; the tests put it where TRL looks the
kernel up at call time (`trl.trainer.utils._ChunkedLogProbFunction`). Everything else in the loss -
collation, reference adapter, sigmoid loss, mean, optimizer step - stays TRL's own code.
"""

from __future__ import annotations

import torch


class ReferenceLogProbFunction:
    """The outputs of `ChunkedLogProbFunction.apply`, by definition (checked against TRL 1.15.0)."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0,
              outputs=("log_probs",)):
        logits = (hidden @ weight.t()).float()
        if bias is not None:
            logits = logits + bias.float()
        logits = logits * logit_scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits / temperature
        logp = logits.log_softmax(-1)
        log_probs = logp.gather(1, targets[:, None]).squeeze(1)
        with torch.no_grad():
            probs = logp.exp()
            entropy = -(probs * logp).sum(-1) if "entropy" in outputs else None
            log_sum_sq = torch.log((probs * probs).sum(-1)) if "log_sum_sq_probs" in outputs else None
            mean_logits = logits.mean(-1) if "mean_logits" in outputs else None
            is_top1 = logits.argmax(-1) == targets if "is_top1" in outputs else None
        return log_probs, entropy, log_sum_sq, mean_logits, is_top1

