"""The run's rendezvous store, hosted by the launcher (local and tmux) and joined by every worker.

The launcher binds it on a kernel-chosen port before any worker starts and holds it until the workers
are gone; every worker, rank 0 included, joins it as a client (`train.dist.setup`). Nobody chooses a
port and binds it later, so two runs on one machine cannot race for it.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as torch_dist

# How long `host_store` answers a client that waits for a key; the workers' own timeout
# (training.nccl_timeout_s) bounds their waits, this only bounds the host's side of a request.
HOST_STORE_TIMEOUT_S = 1800


def host_store(addr: str = "127.0.0.1") -> torch_dist.TCPStore:
    """The rendezvous store of one run, listening now on a port the kernel picked (`.port`).

    Port 0 makes the kernel choose a free port and bind it in one step; whoever holds the returned
    object owns the port until it is dropped. Workers join with `train.dist.setup` (launched_by="hypersloth").
    """
    return torch_dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=HOST_STORE_TIMEOUT_S))
