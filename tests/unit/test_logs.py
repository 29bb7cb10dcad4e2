"""outputs/logs.py: what rank 0's console shows."""

from __future__ import annotations

import io
import re
import sys

from loguru import logger
from tqdm import tqdm

from HyperSloth.outputs import logs


def test_a_log_line_never_lands_on_a_progress_bars_line(tmp_path, monkeypatch):
    console = io.StringIO()
    monkeypatch.setattr(sys, "stderr", console)
    logs.configure(0, tmp_path)
    try:
        bar = tqdm(total=10, file=sys.stderr, desc="Training", mininterval=0)
        bar.update(3)
        logger.info("step 3 done")
        bar.update(3)
        bar.close()
    finally:
        logger.remove()
    line = next(line for line in console.getvalue().split("\n") if "step 3 done" in line)
    # What the terminal shows of that line: the text after its last carriage return.
    assert re.match(r"\d\d:\d\d:\d\d \[rank 0\] INFO +step 3 done$", line.split("\r")[-1]), repr(line)
    assert "Training" in console.getvalue().split("step 3 done")[1]  # the bar is drawn again below
