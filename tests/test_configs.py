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
