"""The thread policy (recursive_lightning/threads.py): the global --threads option, the default
by model width and idle cores, and a command leaving the process's threads as it found them."""

from __future__ import annotations

import os

import pytest
import torch

from recursive_lightning import cli, threads
from recursive_lightning.model.config import preset


@pytest.fixture
def no_thread_env(monkeypatch):
    monkeypatch.delenv(threads.ENV, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "cores", lambda: 2)


@pytest.mark.parametrize(
    "argv, rest, n",
    [
        (["--threads", "2", "describe", "--preset", "cpu-tiny"], ["describe", "--preset", "cpu-tiny"], 2),
        (["describe", "--preset", "cpu-tiny", "--threads=3"], ["describe", "--preset", "cpu-tiny"], 3),
        (["describe", "--preset", "cpu-tiny"], ["describe", "--preset", "cpu-tiny"], None),
    ],
)
def test_threads_option_is_taken_out_anywhere(argv, rest, n, monkeypatch):
    monkeypatch.setattr(threads, "cores", lambda: 4)
    assert cli._pop_threads(argv) == (rest, n)


@pytest.mark.parametrize("value", ["0", "two", "-1", ""])
def test_bad_threads_value_exits_2_naming_the_option(value, capsys):
    argv = ["describe", "--preset", "cpu-tiny", "--threads"] + ([value] if value else [])
    assert cli.main(argv) == 2
    assert "--threads must be a whole number of CPU threads >= 1" in capsys.readouterr().err


def test_default_is_one_thread_below_the_width_threshold_and_the_idle_cores_above(no_thread_env):
    assert threads.model_width(preset("cpu-base")) == 256 < threads.WIDE
    assert threads.default_threads(256, idle=2.0) == 1  # small matrices: one thread even on an idle machine
    assert threads.default_threads(768, idle=2.0) == 2
    assert threads.default_threads(768, idle=1.75) == 2  # a core 75 % idle counts
    assert threads.default_threads(768, idle=1.0) == 1  # one busy process beside it: one thread
    assert threads.default_threads(768, idle=0.1) == 1  # never zero
    assert threads.default_threads(4096, idle=8.0) == 2  # never more than this process's cores
    assert threads.model_width(preset("cpu-mela", hmm_d_model=768)) == 768  # Mela's HMM width counts


def test_user_counts_win_threads_option_first(no_thread_env, monkeypatch):
    assert threads.requested() is None
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.requested() == 2 and threads.threads_for(64) == 2
    monkeypatch.setenv(threads.ENV, "1")
    assert threads.requested() == 1 and threads.threads_for(4096) == 1


def test_idle_cores_from_proc_stat_with_an_injected_clock(monkeypatch):
    """(idle, total) jiffies 100 apart of which 50 idle on a machine of 4 CPUs: 2 idle cores; no sleep."""
    samples = iter([(1000, 5000), (1050, 5100)])
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    slept = []
    assert threads.idle_cores(0.2, sleep=slept.append) == pytest.approx(2.0)
    assert slept == [0.2]
    monkeypatch.setattr(threads, "_cpu_times", lambda: None)
    assert threads.idle_cores(0.0, sleep=slept.append) is None


def test_policy_acts_only_inside_a_command_and_restores_torch_threads(no_thread_env, monkeypatch):
    before = torch.get_num_threads()
    other = 1 if before != 1 else 2
    monkeypatch.setenv(threads.ENV, str(other))
    assert threads.apply_for(preset("cpu-tiny")) == before  # a library call: left as it is
    monkeypatch.delenv(threads.ENV)
    with threads.for_command(other):
        assert os.environ[threads.ENV] == str(other)  # inherited by the processes a command starts
        assert threads.apply_for(preset("cpu-tiny")) == other == torch.get_num_threads()
    assert torch.get_num_threads() == before and threads.ENV not in os.environ
    with threads.for_command(None):
        assert threads.apply_for(preset("cpu-tiny")) == 1  # d_model 64: one thread by default
    assert torch.get_num_threads() == before


def test_threads_option_reaches_the_command(no_thread_env, monkeypatch, capsys):
    seen = []
    from recursive_lightning.commands import describe

    monkeypatch.setattr(describe, "main", lambda rest: seen.append((rest, os.environ.get(threads.ENV))) or 0)
    assert cli.main(["--threads", "1", "describe", "--preset", "cpu-tiny"]) == 0
    assert seen == [(["--preset", "cpu-tiny"], "1")]
    assert threads.ENV not in os.environ


@pytest.mark.parametrize("command", ["describe", "report"])
def test_every_commands_help_lists_the_global_threads_option(command, capsys):
    """`--threads` is taken out before the command parses its flags, yet the command's own --help lists it, as
    every command takes it (docs/getting-started.md, docs/training.md)."""
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and "--threads N" in out.split("global options", 1)[1]
