"""Every shipped experiment and ablation file loads and validates; bad sweep files fail in one sentence."""

from pathlib import Path

import pytest
import yaml

from recursive_lightning.config import load_run_config
from recursive_lightning.errors import ConfigError
from recursive_lightning.sweep.spec import load_sweep

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "path", sorted((ROOT / "experiments").rglob("*.yaml")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_experiment_configs_load(path):
    cfg = load_run_config(path)
    assert cfg.name == yaml.safe_load(path.read_text())["name"]


@pytest.mark.parametrize(
    "path", sorted((ROOT / "ablations").rglob("*.yaml")), ids=lambda p: str(p.relative_to(ROOT))
)
def test_ablation_files_validate(path):
    spec = load_sweep(path)
    assert spec.grid()


_TABLE4 = ["full", "no-newton-schulz", "no-memstack", "no-gating", "fusion-weighted-sum", "fusion-none",
           "no-hmm-attention", "no-neural-memory", "transformerpp"]  # fmt: skip
# sweep file -> (axis, rows in order, seeds, the field(s) each row changes from the first row's config)
MELA_SWEEPS = {
    "mela-ablations.yaml": ("ablation", _TABLE4, 1),
    "cpu/mela-ablations.yaml": ("ablation", _TABLE4, 1),
    "mela-cycles.yaml": ("variant", ["default", "l-cycles-1", "l-cycles-2", "h-cycles-2", "h-layers-2",
                                     "l-layers-2", "l-layers-8", "transformerpp"], 1),
    "cpu/mela-cycles.yaml": ("variant", ["default", "l-cycles-1", "l-cycles-4", "h-cycles-4", "h-layers-8",
                                         "l-layers-2", "l-layers-8", "transformerpp"], 1),
    "cpu/mela-context.yaml": ("model", ["mela", "transformerpp"], 2),
}  # fmt: skip
ROW_CHANGES = {
    "no-newton-schulz": {"model.memory_update": "forgetting"}, "no-memstack": {"model.memstack": False},
    "no-gating": {"model.hmm_gate": False}, "fusion-weighted-sum": {"model.fusion": "weighted_sum"},
    "fusion-none": {"model.fusion": "none"}, "no-hmm-attention": {"model.hmm_attention": False},
    "no-neural-memory": {"model.neural_memory": False},
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(MELA_SWEEPS))
def test_mela_sweep_files_expand_to_their_grids(name):
    """Mela Tables 2-4 and the context-length study: the intended rows, each a Mela model with only its own
    field changed from the first row (Transformer++ rows: the LLaMA-style decoder alone), every point buildable."""
    from recursive_lightning.model.describe import describe

    axis, rows, seeds = MELA_SWEEPS[name]
    spec = load_sweep(ROOT / "ablations" / name)
    grid = spec.grid()
    assert len(grid) == len(rows) * seeds
    assert list(dict.fromkeys(p[axis] for p in grid)) == rows
    first = spec.trial_config(grid[0]).flat()
    for point in grid:
        cfg = spec.trial_config(point)
        row = point[axis]
        if row == "transformerpp":
            assert cfg.model.arch == "recursive" and cfg.model.preset.startswith(
                ("transformerpp", "cpu-transformerpp")
            )
            continue
        assert cfg.model.arch == "mela"
        flat = cfg.flat()
        changed = {k: flat[k] for k in flat if k.startswith("model.") and flat[k] != first.get(k)}
        if row in ROW_CHANGES:
            assert changed == ROW_CHANGES[row], row
        elif "-" in row and row.split("-")[0] in ("l", "h"):  # l-cycles-4, h-layers-8, ...
            level, what, n = row.split("-")
            assert changed == {f"model.{level}_{what}": int(n)}, row
        else:
            assert changed == {}, row
        assert describe(cfg.model, seq_len=cfg.data.seq_len)["params_total"] > 0  # builds (meta device)


@pytest.mark.parametrize("name", ["cpu/mela-ablations.yaml", "cpu/mela-cycles.yaml", "cpu/mela-context.yaml"])
def test_a_mela_point_and_the_transformerpp_point_of_each_cpu_sweep_train(name, tmp_path, data_cache):
    """One Mela grid point (not the first: it changes a field) and the Transformer++ point train two steps
    with the file's recipe and validate to a finite loss."""
    import math

    from recursive_lightning.config import RunConfig
    from recursive_lightning.training.run import train

    axis, rows, _ = MELA_SWEEPS[name]
    spec = load_sweep(ROOT / "ablations" / name)
    grid = [p for p in spec.grid() if p["train.seed"] == 0]
    for point in (grid[1] if len(rows) > 2 else grid[0], grid[-1]):
        raw = spec.trial_config(point).to_dict()
        raw["data"].update(batch_size=2, val_batches=1, cache_dir=data_cache)
        raw["train"].update(max_steps=2, warmup_steps=1, val_every=2, checkpoint_every=2)
        r = train(RunConfig.from_dict(raw), tmp_path / point[axis])
        assert r.steps == 2 and math.isfinite(r.metrics["val/heldout/loss"]), point


def test_table4_buffer_grid():
    spec = load_sweep(ROOT / "ablations" / "mesh-buffer.yaml")
    assert [spec.trial_config(p).model.buffer_slots for p in spec.grid()] == [3, 4, 5, 6]  # N_loop + 1 + k


def test_topology_size_vanilla_rows_use_the_preset_depth():
    spec = load_sweep(ROOT / "ablations" / "topology-size.yaml")
    layouts = {(p["size"], p["variant"]): spec.trial_config(p).model.layout for p in spec.grid()}
    assert layouts[("1b", "vanilla")] == "16" and layouts[("1b", "mesh")] == "3+5R2+3"


def test_dotted_overrides_and_errors():
    cfg = load_run_config(
        ROOT / "experiments/cpu/looped-mesh.yaml", ["--model.topology", "anchor", "--train.lr=3e-4"]
    )
    assert cfg.model.topology == "anchor" and cfg.train.lr == 3e-4
    for bad, field in [
        (["--train.lrr", "1"], "train.lrr"),
        (["--train.max_steps", "abc"], "train.max_steps"),
        (["--model.buffer", "x"], "model.buffer"),
        (["--nope.x", "1"], "--nope.x"),
        (["--train.beta2", "1.5"], "train.beta2 must lie in [0, 1)"),
        (["--train.beta1", "-0.1"], "train.beta1 must lie in [0, 1)"),
        (["--train.weight_decay", "-1"], "train.weight_decay and train.grad_clip must be >= 0"),
        (["--train.grad_clip", "-1"], "train.weight_decay and train.grad_clip must be >= 0"),
        (["--train.devices", "0"], "train.devices must be a count >= 1"),
        (["--train.devices", "-2"], "train.devices must be a count >= 1"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_run_config(ROOT / "experiments/cpu/looped-mesh.yaml", bad)
        assert field in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "body, needle",
    [
        ({"axes": {"model.topolgy": ["mesh"]}}, "model.topolgy"),
        ({"axes": {"model.buffer": []}}, "empty"),
        ({"axes": {"model.buffer": ["five"]}}, "model.buffer"),
        ({"axes": {"train.lr": [{"a": 1}]}}, "train.lr"),
        ({"axess": {}}, "axess"),
        ({"base": "nope.yaml"}, "nope.yaml"),
        ({"axes": [{"model.topology": ["mesh"]}]}, "axes must be a mapping"),
    ],
)
def test_bad_sweep_files(tmp_path, body, needle):
    data = {"name": "bad", "base": str(ROOT / "experiments/cpu/looped-mesh.yaml"), **body}
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError) as e:
        load_sweep(p)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_warmup_in_steps_overrides_the_ratio():
    """Mela Sec. 5.1: 500 warm-up steps, cosine to 10 % (train.warmup_steps)."""
    import math

    import pytest

    from recursive_lightning.config import RunConfig
    from recursive_lightning.errors import ConfigError
    from recursive_lightning.training.optim import cosine_with_warmup

    assert [cosine_with_warmup(s, 2000, 0.01, 0.1, warmup_steps=500) for s in (0, 249, 499)] == [
        1 / 500,
        0.5,
        1.0,
    ]
    assert math.isclose(cosine_with_warmup(1999, 2000, 0.01, 0.1, warmup_steps=500), 0.1, rel_tol=1e-5)
    assert cosine_with_warmup(19, 2000, 0.01, 0.1) == 1.0  # the ratio: 1 % of 2000 = 20 steps
    with pytest.raises(ConfigError, match=r"train.warmup_steps 300 must lie in \[0, train.max_steps\)"):
        RunConfig.from_dict({"train": {"max_steps": 300, "warmup_steps": 300}})


# the papers' orderings at CPU scale (docs/orderings.md): each study runs end to end from its file
STUDIES = {
    "cpu/mesh-ordering.yaml": ("base", ["anchor", "mesh"]),
    "cpu/spiral-ordering.yaml": ("looped", ["spiral-b"]),
    "cpu/mela-ordering.yaml": ("mela", ["no-memstack", "transformerpp"]),
}


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_each_ordering_study_runs_end_to_end_at_smoke_size(name, tmp_path, data_cache):
    """The study's own file, cut to 2 steps and 2 seeds: the sweep finishes, and its report states, for every
    row against the baseline, the paired interval and whether it excludes 0 (with context lengths: at each
    length and on the change between the shortest and the longest)."""
    from conftest import sweep_output

    baseline, rows = STUDIES[name]
    raw = yaml.safe_load((ROOT / "ablations" / name).read_text())
    raw["base"] = str((ROOT / "ablations" / name).parent / raw["base"])
    raw["overrides"].update(
        {"train.max_steps": 2, "train.warmup_steps": 1, "train.val_every": 2, "train.checkpoint_every": 2}
    )
    raw["overrides"].update({"data.batch_size": 2, "data.val_batches": 1, "data.cache_dir": data_cache})
    raw["seeds"] = [0, 1]
    lengths = (raw.get("evaluate") or {}).get("context_lengths")
    if lengths:  # the shortest and the longest length, over few tokens
        raw["evaluate"].update({"context_lengths": [lengths[0], lengths[-1]], "ctx_max_tokens": lengths[-1]})
    spec = tmp_path / "study.yaml"
    spec.write_text(yaml.safe_dump(raw))
    code, out = sweep_output(spec, "--run-dir", tmp_path / "run")
    assert code == 0, out[-3000:]
    report = (tmp_path / "run" / "report.md").read_text()
    sections = [report.split(f"## Paired difference to `{baseline}`", 1)[1].split("\n## ", 1)[0]]
    if lengths:
        sections.append(report.split("## Perplexity by context length", 1)[1].split("\n## ", 1)[0])
    for section in sections:
        for row in rows:
            line = next(r for r in section.splitlines() if r.startswith(f"| {row} | 2 |"))
            assert line.endswith(("excludes 0 |", "includes 0 |")), line
    if lengths:
        assert f"| change {lengths[0]} → {lengths[-1]} |" in sections[1]
