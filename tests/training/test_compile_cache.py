"""A compiled run says what its first step cost and keeps inductor's cache where the next run finds it
(``training/parallel.py``: ``persistent_compile_cache``, ``first_step_line``)."""

from __future__ import annotations

import os
import re

import pytest
import yaml
from conftest import ENV, command_output, run_of
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from recursive_lightning.config import TrainConfig
from recursive_lightning.training import parallel

LINE = re.compile(
    r"\[train\] first step ready in ([\d.]+) s; train\.compile layers: (\d+) graph\(s\) compiled, (\d+) of them "
    r"from inductor's cache \((.+)\)"
)


@pytest.mark.slow
def test_a_compiled_run_prints_its_first_step_and_the_next_run_loads_its_graphs(tmp_path, tiny_run):
    """Two ``train --train.compile layers`` of one config in fresh processes, with no TORCHINDUCTOR_CACHE_DIR
    of the user's: both print the first step's seconds and graphs; the cache is in the package's cache folder,
    empty for the first run (every graph built) and read by the second (every graph loaded); the first
    step's seconds are an MLflow metric of each run."""
    cfg = tiny_run(layout="1+1R2+1", topology="base", max_seq_len=64)
    cfg["data"].update(seq_len=32, batch_size=2, val_batches=1)
    cfg["train"].update(max_steps=1, val_every=1, checkpoint_every=1, compile="layers")
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    cache = tmp_path / "rl-cache"
    env = {k: v for k, v in ENV.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["RECURSIVE_LIGHTNING_CACHE"] = str(cache)  # data.cache_dir stays the session's
    seen = []
    for run in ("cold", "warm"):
        code, out = command_output(
            "train", "--config", tmp_path / "cfg.yaml", "--run-dir", tmp_path / run, env=env
        )
        assert code == 0, out
        (match,) = LINE.findall(out)
        seconds, made, loaded, where = float(match[0]), int(match[1]), int(match[2]), match[3]
        assert where == str(cache / "inductor") and seconds > 0
        seen.append((made, loaded))
        assert run_of(tmp_path / run).data.metrics["train/first_step_sec"] == pytest.approx(seconds, abs=0.06)
    (cold_made, cold_loaded), (warm_made, warm_loaded) = seen
    assert cold_made >= 1 and cold_loaded == 0, seen
    assert warm_made == cold_made and warm_loaded == warm_made, seen
    assert (cache / "inductor" / "fxgraph").is_dir()


def test_a_cache_directory_the_user_set_wins(tmp_path, monkeypatch):
    """Unset, or at torch's own default (which importing ``torch._dynamo`` writes into the environment), the
    variable is pointed at the package's cache folder; a directory the user chose is kept."""
    monkeypatch.setenv("RECURSIVE_LIGHTNING_CACHE", str(tmp_path / "ours"))
    for before in (None, default_cache_dir()):
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        assert parallel.persistent_compile_cache() == str(tmp_path / "ours" / "inductor")
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "ours" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "theirs"))
    assert parallel.persistent_compile_cache() == str(tmp_path / "theirs")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "theirs")


def test_a_cache_folder_that_cannot_be_written_leaves_torchs_default(tmp_path, monkeypatch):
    """A read-only home (as on some compute nodes) must not stop a compiled run: torch's own default is kept."""
    from conftest import read_only

    home = tmp_path / "home"
    home.mkdir()
    read_only(monkeypatch, home)
    monkeypatch.setenv("RECURSIVE_LIGHTNING_CACHE", str(home / "rl"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert parallel.persistent_compile_cache() == os.path.abspath(default_cache_dir())
    assert not (home / "rl").exists()


def test_the_first_step_line_names_what_was_compiled_or_captured():
    compiled = parallel.first_step_line(41.25, TrainConfig(compile=True), (6, 4), "/c")
    assert compiled == (
        "[train] first step ready in 41.2 s; train.compile layers: 6 graph(s) compiled, 4 of them from "
        "inductor's cache (/c)"
    )
    captured = parallel.first_step_line(3.0, TrainConfig(cuda_graphs=True), (0, 0), None)
    assert captured == "[train] first step ready in 3.0 s; train.cuda_graphs: the step captured"
    fused = parallel.first_step_line(5.0, TrainConfig(memory_kernel="triton"), (0, 0), None)
    assert fused == (
        "[train] first step ready in 5.0 s; train.memory_kernel triton: its four kernels compiled and tuned (Triton's cache "
        "keeps them)"
    )
