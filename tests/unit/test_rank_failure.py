"""How the launcher names the rank that failed first (HyperSloth.launch.local.RankFailure)."""

import signal
from pathlib import Path

from HyperSloth.launch.local import RankFailure


def _failure(exit_code: int, error: str | None = None) -> RankFailure:
    return RankFailure(rank=1, gpu=3, exit_code=exit_code, stderr_tail=["last line"], stderr_path=Path("r1.stderr"),
                       error=error)


def test_a_rank_that_raised_is_named_with_its_error_and_the_rest_follows():
    failure = _failure(1, "OutOfMemoryError: CUDA out of memory.\nTried to allocate 2 GiB")
    assert failure.describe() == "rank 1 (gpu 3) failed with OutOfMemoryError: CUDA out of memory."
    assert failure.details() == ["Tried to allocate 2 GiB"]


def test_a_sigkilled_rank_is_pointed_at_host_memory_and_other_ends_are_plain():
    """A worker killed by SIGKILL leaves no Python error (the 262k-token run on the H200): the line says where
    to look. Other signals and exit codes are named as they are."""
    killed = _failure(-signal.SIGKILL)
    assert killed.describe().startswith("rank 1 (gpu 3) was killed by SIGKILL (not by HyperSloth: most often the "
                                        "kernel's out-of-memory killer")
    assert killed.details() == ["last line"]
    assert _failure(-signal.SIGSEGV).describe() == "rank 1 (gpu 3) was killed by SIGSEGV"
    assert _failure(3).describe() == "rank 1 (gpu 3) failed with exit code 3"
