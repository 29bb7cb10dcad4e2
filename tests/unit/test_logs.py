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


def test_hf_log_lines_go_to_the_progress_bars_stream_not_stdout(capsys):
    """On rank 0 the bar (stderr) passes the launcher's pump while stdout does not: a loss line written to
    stdout could land inside the bar's line. ProgressOnBarStream writes it where the bar is."""
    import io
    import types

    from tqdm.auto import tqdm

    from HyperSloth.train.sft.trainer import ProgressOnBarStream

    stream = io.StringIO()
    callback = ProgressOnBarStream()
    callback.training_bar = tqdm(total=4, file=stream)
    state = types.SimpleNamespace(is_world_process_zero=True)
    callback.on_log(None, state, None, logs={"loss": 1.23456, "total_flos": 9.0, "grad_norm": 0.5})
    assert "{'loss': '1.235', 'grad_norm': '0.5'}" in stream.getvalue()
    assert capsys.readouterr().out == ""
    assert isinstance(callback.training_bar, tqdm)  # the bar itself is back in place
    callback.training_bar.close()


def test_a_disabled_progress_bar_still_shows_the_log_lines(capsys):
    """A bar disabled by TQDM_DISABLE has no stream of its own: the line goes where tqdm.write puts it."""
    import types

    from tqdm.auto import tqdm

    from HyperSloth.train.sft.trainer import ProgressOnBarStream

    callback = ProgressOnBarStream()
    callback.training_bar = tqdm(total=4, disable=True)
    callback.on_log(None, types.SimpleNamespace(is_world_process_zero=True), None, logs={"loss": 2.0})
    assert "{'loss': '2'}" in capsys.readouterr().out
