"""Distributed set-up in one place: who am I, the process group, and the gradient all-reduce.

HyperSloth owns the distribution. The launcher (or torchrun) tells each worker its rank; this module
reads that from the environment (the only place besides the launcher that does), scrubs torchrun's
variables so that transformers/accelerate see one ordinary single-process run (no DDP wrapper, no
sampler sharding), and creates the process group.

Rendezvous: under the HyperSloth launcher the run's TCPStore is hosted by the launcher
(`launch.rendezvous.host_store`), bound on a kernel-chosen port before any worker starts and held until
the workers are gone; every worker, rank 0 included, joins it as a client. Nobody chooses a port and
binds it later, so two runs on one machine cannot race for it. Under torchrun, torchrun's own
rendezvous is used (tcp:// init).

Gradients are summed, never averaged: every micro-batch loss is already divided by the step's *global*
trainable-token count, so the sum over ranks is exactly the gradient one process would compute on the
whole global batch.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, MutableMapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as torch_dist

# TORCHRUN_VARS: variables torchrun sets. HF/accelerate switch to their own DDP mode when they see
# them, so the worker removes them after reading (HyperSloth syncs gradients itself).
from HyperSloth.outputs.run_files import (
    ENV_LOCAL_RANK,
    ENV_MASTER_ADDR,
    ENV_MASTER_PORT,
    ENV_RANK,
    ENV_WORLD_SIZE,
    TORCHRUN_VARS,
)


@dataclass(frozen=True)
class DistInfo:
    """Rank, world size and rendezvous of this worker; passed explicitly to whoever needs them."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launched_by: str = "single"  # "hypersloth", "torchrun" or "single"
    local_world_size: int = 1  # ranks on this host (they share its memory)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | None = None) -> DistInfo:
        """Read HyperSloth's launcher variables, else torchrun's, else a single process."""
        env = os.environ if env is None else env
        if ENV_RANK in env:
            return cls(
                rank=int(env[ENV_RANK]),
                world_size=int(env[ENV_WORLD_SIZE]),
                local_rank=int(env.get(ENV_LOCAL_RANK, env[ENV_RANK])),
                master_addr=env.get(ENV_MASTER_ADDR, "127.0.0.1"),
                master_port=int(env.get(ENV_MASTER_PORT, "29500")),
                launched_by="hypersloth",
                local_world_size=int(env[ENV_WORLD_SIZE]),  # HyperSloth's launcher starts every rank here
            )
        if all(k in env for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
            return cls(
                rank=int(env["RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env["LOCAL_RANK"]),
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(env.get("MASTER_PORT", "29500")),
                launched_by="torchrun",
                local_world_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            )
        return cls()


def isolate_process(info: DistInfo, env: MutableMapping[str, str] | None = None) -> None:
    """Make this process look like a plain single-device run to HF, before CUDA is initialised.

    Under torchrun every process sees all local GPUs; HF's Trainer would then pick `nn.DataParallel`.
    We narrow CUDA_VISIBLE_DEVICES to this rank's GPU (the HyperSloth launcher already does) and drop
    torchrun's variables so accelerate does not wrap the model in DDP or shard the data loader.
    """
    env = os.environ if env is None else env
    if info.launched_by == "torchrun":
        visible = env.get("CUDA_VISIBLE_DEVICES")
        if visible:
            ids = [v for v in visible.split(",") if v.strip()]
            if info.local_rank < len(ids):
                env["CUDA_VISIBLE_DEVICES"] = ids[info.local_rank]
        else:
            env["CUDA_VISIBLE_DEVICES"] = str(info.local_rank)
    for name in TORCHRUN_VARS:
        env.pop(name, None)


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def setup(info: DistInfo, *, backend: str | None = None, timeout_s: int = 1800) -> None:
    """Create the default process group (nothing to do for one process)."""
    if info.world_size == 1 or torch_dist.is_initialized():
        return
    backend = backend or default_backend()
    kwargs = {}
    if backend == "nccl":
        torch.cuda.set_device(0)  # each worker sees exactly one GPU
        kwargs["device_id"] = torch.device("cuda", 0)
    timeout = timedelta(seconds=timeout_s)
    if info.launched_by == "hypersloth":  # the launcher hosts the store: join it, bind nothing
        kwargs["store"] = torch_dist.TCPStore(info.master_addr, info.master_port, is_master=False, timeout=timeout)
    else:
        kwargs["init_method"] = f"tcp://{info.master_addr}:{info.master_port}"
    torch_dist.init_process_group(backend=backend, rank=info.rank, world_size=info.world_size, timeout=timeout,
                                  **kwargs)


def teardown() -> None:
    """Destroy the process group if one exists; safe to call twice."""
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def all_ranks_ok(ok: bool) -> bool:
    """True when `ok` is True on every rank: one all-reduce (MIN) of a flag; `ok` itself for one process.
    Every rank must call it the same number of times (it is a collective)."""
    if not torch_dist.is_initialized():
        return ok
    device = torch.device("cuda", torch.cuda.current_device()) if torch_dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MIN)
    return bool(flag.item())


def exchange(key: str, value: str) -> list[str]:
    """Every rank's `value` for `key`, by rank (`[value]` for one process), through the run's rendezvous
    store; every rank calls it, and it returns once every rank has set its value (a barrier).

    The store, not a collective, because it is the last exchange before the ranks tear down: its requests
    are synchronous, while a gloo collective can leave a send in flight on a rank that leaves it first, and
    that rank then aborted in teardown ("terminate called without an active exception", seen in 4 of ~10
    resumed 2-worker CPU runs with an all-reduce or all_gather_object there, in none of 9 without)."""
    if not torch_dist.is_initialized():
        return [value]
    store = torch_dist.distributed_c10d._get_default_store()  # the store the process group was created with
    keys = [f"hypersloth/{key}/{rank}" for rank in range(torch_dist.get_world_size())]
    store.set(keys[torch_dist.get_rank()], value)
    store.wait(keys)
    return [store.get(k).decode() for k in keys]


class GradientSync:
    """Sum the gradients of the trainable parameters (and a few scalars) over all ranks.

    One flat buffer per dtype and device, cut into buckets of at most `bucket_mb`: LoRA adapters fit in
    a single bucket, so a step costs one concatenation and one collective. Afterwards every gradient is
    a view of the reduced buffer (assigned, not copied back: for Qwen3 with LoRA on all seven
    projections that saves 392 copy launches per step). Parameters whose gradient is None on this
    rank (a rank whose micro-batches were empty) contribute zeros, and afterwards hold the summed
    gradient, so every rank steps its optimizer on identical gradients.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], world_size: int, bucket_mb: int = 256):
        self.params = [p for p in params if p.requires_grad]
        self.world_size = world_size
        self.bucket_bytes = bucket_mb * 2**20

    def _groups(self) -> dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]]:
        groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p in self.params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        return groups

    def all_reduce(self, scalars: torch.Tensor) -> torch.Tensor:
        """Sum gradients in place across ranks; return `scalars` (a 1-D float tensor) summed too."""
        if self.world_size == 1:
            return scalars
        scalars = scalars.detach().to(torch.float32)
        reduced_scalars = None
        for (dtype, device), params in self._groups().items():
            carry = scalars.to(device) if reduced_scalars is None and dtype == torch.float32 else None
            out = self._reduce_group(params, carry)
            if carry is not None:
                reduced_scalars = out
        if reduced_scalars is None:  # no fp32 gradients: reduce the scalars on their own
            reduced_scalars = scalars.to(self._scalar_device())
            torch_dist.all_reduce(reduced_scalars, op=torch_dist.ReduceOp.SUM)
        return reduced_scalars

    def _scalar_device(self) -> torch.device:
        return self.params[0].device if self.params else torch.device("cpu")

    def _reduce_group(self, params: list[torch.nn.Parameter], carry: torch.Tensor | None) -> torch.Tensor | None:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        buckets = self._buckets(params)
        reduced_carry = None
        for i, bucket in enumerate(buckets):
            extra = [carry] if (carry is not None and i == 0) else []
            flat = torch.cat([p.grad.reshape(-1) for p in bucket] + extra)
            torch_dist.all_reduce(flat, op=torch_dist.ReduceOp.SUM)
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p)
                offset += n
            if extra:
                reduced_carry = flat[offset:]
        return reduced_carry

    def _buckets(self, params: list[torch.nn.Parameter]) -> list[list[torch.nn.Parameter]]:
        buckets: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in params:
            nbytes = p.numel() * p.element_size()
            if buckets[-1] and size + nbytes > self.bucket_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += nbytes
        return buckets
