"""`python -m HyperSloth.launch.node_worker AGENT_PID COMMAND...`: a worker of a multi-node run that dies with
its node's agent.

torch's elastic agent starts each worker in its own session and sets no parent-death signal, so a worker
would outlive an agent that is SIGKILLed (the out-of-memory killer, `kill -9`) and keep its GPU until its
next collective fails, which under NCCL may be `training.nccl_timeout_s` later. The agent starts this
module instead; it sets the parent-death signal (Linux `prctl(PR_SET_PDEATHSIG, SIGKILL)`, as the local
launcher does for its workers), makes sure its parent is still AGENT_PID (an agent that died before the
prctl is caught too), and then becomes COMMAND (`python -m HyperSloth.train.worker OUTPUT_DIR/run.json`)
by exec: the signal is kept across exec, and nothing else of this module stays in the worker.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def pdeathsig_setter(signum: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A function that gives the process calling it `signum` when its parent dies (None off Linux). libc is
    resolved here, so a forked child (a Popen `preexec_fn`, local.die_with_parent_hook) only makes the call."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    return lambda: prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)


def die_with(parent: int, signum: int = signal.SIGKILL) -> None:
    """Get `signum` when the parent dies; when `parent` is already gone (not our parent any more), die now."""
    set_signal = pdeathsig_setter(signum)
    if set_signal is not None:
        set_signal()
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> None:
    if len(argv) < 2 or not argv[0].isdigit():
        sys.exit("usage: python -m HyperSloth.launch.node_worker AGENT_PID COMMAND...")
    die_with(int(argv[0]))
    os.execvp(argv[1], argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
