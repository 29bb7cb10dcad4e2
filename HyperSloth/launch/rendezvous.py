"""The run's rendezvous store, hosted by the launcher (local and tmux) and joined by every worker.

The launcher binds it on a kernel-chosen port before any worker starts and holds it until the workers
are gone; every worker, rank 0 included, joins it as a client (`train.dist.setup`). Nobody chooses a
port and binds it later, so two runs on one machine cannot race for it.

The local launcher splits the binding from the store: `reserve_port` binds and listens with the standard
library before the workers start, and `host_store(listener=...)` serves the store on that socket once they
run. Importing torch for the store (0.75 s on the 2-core CPU machine) then overlaps the workers' own imports
instead of delaying them; a worker that connects first waits in the socket's backlog.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as torch_dist

# How long `host_store` answers a client that waits for a key; the workers' own timeout
# (training.nccl_timeout_s) bounds their waits, this only bounds the host's side of a request.
HOST_STORE_TIMEOUT_S = 1800
# torch's libuv store (the default since torch 2.4) serves a socket it is given from torch 2.8 on (pytorch#150215);
# before that only the older backend does.
_LIBUV_TAKES_A_SOCKET = (2, 8)


def reserve_port(addr: str = "127.0.0.1") -> socket.socket:
    """A socket bound to a port the kernel picked and listening: the port is the caller's from now on, and
    clients may connect before the store serves it (`host_store(listener=...)`)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((addr, 0))
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        raise
    return listener


def host_store(addr: str = "127.0.0.1", listener: socket.socket | None = None) -> torch_dist.TCPStore:
    """The rendezvous store of one run, listening on a port the kernel picked (`.port`): `listener`'s
    (`reserve_port`; the store takes the socket over), or a new one.

    Port 0 makes the kernel choose a free port and bind it in one step; whoever holds the returned
    object owns the port until it is dropped. Workers join with `train.dist.setup` (launched_by="hypersloth").
    """
    import torch
    import torch.distributed as torch_dist

    timeout = timedelta(seconds=HOST_STORE_TIMEOUT_S)
    if listener is None:
        return torch_dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=timeout)
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    port = listener.getsockname()[1]
    return torch_dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, timeout=timeout,
                               master_listen_fd=listener.detach(), use_libuv=version >= _LIBUV_TAKES_A_SOCKET)
