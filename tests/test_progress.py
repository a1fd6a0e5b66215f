"""Progress of long work (recursive_lightning/progress.py): plain lines at most every 30 s when
the output is not a terminal, a tqdm bar when it is; time is driven by an injected clock, never by sleeps."""

from __future__ import annotations

import io

import pytest
import torch

from recursive_lightning import progress
from recursive_lightning.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_plain_line_every_30_seconds_and_one_at_the_end():
    out, clock = io.StringIO(), Clock()
    p = Progress("eval perplexity heldout", 1000, stream=out, clock=clock)
    for t, n in ((10, 100), (31, 100), (45, 100), (61, 100), (100, 600)):
        clock.now = 1000.0 + t
        p.update(n)
    p.close()
    lines = out.getvalue().splitlines()
    assert lines == [
        "eval perplexity heldout: 200/1,000 tok (20%), 6 tok/s, 2m04s left",  # 800 tok at 200/31 tok/s
        "eval perplexity heldout: 400/1,000 tok (40%), 7 tok/s, 1m32s left",
        "eval perplexity heldout: 1,000/1,000 tok (100%), 10 tok/s, 0s left",
        "eval perplexity heldout: 1,000 tok in 1m40s (10 tok/s)",
    ]
    assert "\r" not in out.getvalue()


def test_work_shorter_than_the_first_line_prints_nothing():
    out, clock = io.StringIO(), Clock()
    with Progress("probe run", 500, stream=out, clock=clock) as p:
        for _ in range(5):
            clock.now += 5.0
            p.update(100)
    assert out.getvalue() == ""


def test_a_terminal_gets_a_bar_with_rate_and_time_left(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    out = Terminal()
    with Progress("eval perplexity heldout", 1000, stream=out) as p:
        assert p._bar is not None
        p.update(400)
        p._bar.refresh()
        shown = out.getvalue()
    assert "\r" in shown and "eval perplexity heldout" in shown and "400/1.00k" in shown
    assert "tok/s" in shown and "<" in shown  # tqdm's elapsed<remaining


def test_eval_perplexity_reports_its_tokens_in_a_log(monkeypatch, capsys):
    """document_logprobs with a label (what ``eval`` passes): plain lines on stderr whose token total is the
    number of tokens scored; the clock moves 31 s per reading, so every batch is due a line."""
    from recursive_lightning.evaluation.perplexity import document_logprobs
    from recursive_lightning.model.build import build_model
    from recursive_lightning.model.config import preset

    ticks = iter(range(0, 10_000, 31))
    monkeypatch.setattr(progress.time, "monotonic", lambda: float(next(ticks)))
    torch.manual_seed(0)
    model = build_model(preset("cpu-tiny", max_seq_len=32)).eval()
    docs = [list(range(1, 60)), list(range(5, 45))]
    scores = document_logprobs(model, docs, 0, max_length=32, batch_size=1, label="eval perplexity x")
    err = capsys.readouterr().err.splitlines()
    total = sum(n for _, n in scores)
    assert total == 59 + 40
    assert len(err) >= 3 and all(line.startswith("eval perplexity x: ") for line in err)
    assert f"/{total} tok" in err[0] and err[-1].startswith(f"eval perplexity x: {total} tok in ")
    assert scores == document_logprobs(model, docs, 0, max_length=32, batch_size=1)  # same numbers without


@pytest.mark.parametrize("seconds, text", [(5, "5s"), (75, "1m15s"), (3725, "1h02m")])
def test_durations(seconds, text):
    assert progress._duration(seconds) == text
