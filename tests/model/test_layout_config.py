"""Layout grammar and config validation: bad input is one sentence naming the field."""

from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from recursive_lightning.errors import ConfigError
from recursive_lightning.model.config import ModelConfig, preset
from recursive_lightning.model.layout import layout_from_ratio, parse_layout, schedule


def test_layout_forms():
    v = parse_layout("24")
    assert (v.kind, v.n_layers, v.n_loop, v.n_compute) == ("vanilla", 24, 0, 24)
    lp = parse_layout("4+8R2+4")
    assert (lp.kind, lp.prelude, lp.cores, lp.coda, lp.n_loop, lp.n_compute) == ("looped", 4, (8,), 4, 2, 24)
    un = parse_layout("4+8+8+4")
    assert (un.kind, un.cores, un.core_index, un.n_layers) == ("unshared", (8, 8), (0, 1), 24)
    mr = parse_layout("4+8x{1/8,1/4,1/2,1}+4")
    assert (mr.kind, mr.chunk, mr.n_compute) == ("multires", (8, 4, 2, 1), 40)
    assert parse_layout("2+4×{1/8, 1/4,1/2,1}+2").chunk == (8, 4, 2, 1)
    assert parse_layout("8+8x{1/16,1/8,1/4,1/2}+8").resolutions[0] == Fraction(1, 16)


@pytest.mark.parametrize(
    "layout, needle",
    [
        ("4+8R0+4", "R1 or more"),
        ("4+8R2", "two blocks"),
        ("8R2", "prelude and a coda"),
        ("4+8x{1/3.5}+4", "fraction"),
        ("4+8x{2}+4", "1/g"),
        ("4+8x{}+4", "empty"),
        ("4+a+4", "whole number"),
        ("", "empty"),
        ("4+8R2+8R2+4", "cannot be combined"),
    ],
)
def test_bad_layouts_are_one_sentence(layout, needle):
    with pytest.raises(ConfigError) as e:
        parse_layout(layout)
    msg = str(e.value)
    assert needle in msg and "model.layout" in msg and "\n" not in msg


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"topology": "meshh"}, "model.topology"),
        ({"layout": "4+8R0+4"}, "model.layout"),
        ({"layout": "4+8R2"}, "model.layout"),
        ({"layout": "4+8R2+4", "topology": "mesh", "buffer": 0}, "model.buffer"),
        ({"layout": "12", "topology": "mesh"}, "model.topology"),
        ({"layout": "4+8x{1/8,1}+4", "shift": 5}, "model.shift"),
        ({"layout": "4+8x{1/8,1}+4", "offset": 9}, "model.offset"),
        ({"layout": "4+8x{1/8,1}+4", "shift": [7]}, "model.shift"),
        ({"n_heads": 5}, "model.d_model"),
        ({"topolgy": "mesh"}, "model.topolgy"),
    ],
)
def test_bad_model_configs(overrides, field):
    with pytest.raises(ConfigError) as e:
        preset("pythia-160m", **overrides)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_preset_typo_suggests():
    with pytest.raises(ConfigError, match="did you mean 'pythia-1.4b'"):
        preset("pythia-14b")


def test_shift_rule_cites_proposition():
    with pytest.raises(ConfigError, match="Proposition 1"):
        preset("cpu-tiny", layout="1+1x{1/4}+1", shift=2)
    preset("cpu-tiny", layout="1+1x{1/4}+1", shift=2, allow_noncausal=True)  # allowed for demonstrations


def test_yaml_round_trip(tmp_path):
    cfg = preset(
        "pythia-410m", layout="4+8x{1/8,1/4,1/2,1}+4", topology="mesh", offset="zero", shift="parallel"
    )
    p = tmp_path / "m.yaml"
    p.write_text(cfg.to_yaml())
    assert ModelConfig.from_yaml(p) == cfg
    assert yaml.safe_load(cfg.to_yaml())["d_model"] == 1024
    assert cfg.offsets() == [0, 0, 0, 0] and cfg.shifts() == [8, 4, 2, 1]
    dflt = preset("pythia-410m", layout="4+8x{1/8,1/4,1/2,1}+4")
    assert dflt.offsets() == [4, 2, 1, 0] and dflt.shifts() == [7, 3, 1, 0]
    assert dflt.gains() == pytest.approx([8**0.5, 2, 2**0.5, 1])


def test_llama_style_block_is_one_config_away():
    cfg = preset(
        "cpu-small",
        norm="rmsnorm",
        mlp="swiglu",
        n_kv_heads=2,
        bias=False,
        parallel_residual=False,
        rotary_pct=1.0,
    )
    import torch

    from recursive_lightning.model.recursive.model import RecursiveLM

    m = RecursiveLM(cfg)
    assert m(torch.randint(0, 100, (1, 9))).shape == (1, 9, cfg.vocab_size)


def test_schedules_and_ratio():
    assert schedule("coarse-to-fine", "1/8", 4) == [
        Fraction(1, 8),
        Fraction(1, 4),
        Fraction(1, 2),
        Fraction(1),
    ]
    assert schedule("fine-to-coarse", "1", 4) == [Fraction(1), Fraction(1, 2), Fraction(1, 4), Fraction(1, 8)]
    with pytest.raises(ConfigError):
        schedule("coarse-to-fine", "1/2", 3)
    assert layout_from_ratio(24, 0.0) == "24"
    assert layout_from_ratio(24, 1 / 3) == "8+8R2+8"
    lay = layout_from_ratio(24, 1 / 3, [Fraction(1, 16), Fraction(1, 8), Fraction(1, 4), Fraction(1, 2)])
    assert lay == "8+8x{1/16,1/8,1/4,1/2}+8"
    p = parse_layout(lay)
    assert p.prelude == p.coda and p.n_layers == 24


@pytest.mark.parametrize("value", ["layer", 3, "everything"])
def test_unknown_compile_scope_is_one_sentence(value):
    from recursive_lightning.config import RunConfig

    with pytest.raises(ConfigError) as e:
        RunConfig.from_dict({"model": {"preset": "cpu-tiny"}, "train": {"compile": value}})
    assert "train.compile" in str(e.value) and "\n" not in str(e.value)
    for ok in (False, True, "layers", "glue", "model"):
        assert (
            RunConfig.from_dict({"model": {"preset": "cpu-tiny"}, "train": {"compile": ok}}).train.compile
            == ok
        )


def test_a_model_file_with_a_repeated_key_is_one_sentence(tmp_path):
    """`ModelConfig.from_yaml` of a file giving d_model twice names the key, the file and both lines (the second
    silently won)."""
    p = tmp_path / "model.yaml"
    p.write_text("preset: cpu-tiny\nd_model: 64\nd_model: 128\n")
    with pytest.raises(
        ConfigError, match=r"d_model is given twice in model file '.*model.yaml' \(lines 2 and 3\)"
    ):
        ModelConfig.from_yaml(p)


@pytest.mark.parametrize(
    "layout, what",
    [
        ("2R2", "is a looped core"),
        ("2x{1,1}", "is a looped core"),
        ("0+2R2+0", "is a prelude-core-coda layout"),
        ("1+2+1", "is a prelude-core-coda layout"),
        ("abc", "is not a layer count"),
    ],
)
def test_mela_layout_that_is_not_a_layer_count_gets_the_mela_sentence(layout, what, monkeypatch, capsys):
    """For model.arch mela every non-integer layout gets the Mela sentence, before the recursive grammar's hints
    (a prelude and a coda), which would send the user to another layout Mela refuses; one sentence, exit 2."""
    from recursive_lightning.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the config path as a user types it
    assert main(["describe", "--config", "experiments/cpu/mela.yaml", "--model.layout", layout]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: model.layout '{layout}' {what}, but a Mela decoder is a plain stack: give its depth as a "
        "whole number of layers, e.g. 12."
    )


def test_mela_layer_count_still_validates():
    assert preset("cpu-mela", layout="4").parsed_layout.n_layers == 4
    with pytest.raises(ConfigError, match="has no layers"):
        preset("cpu-mela", layout="0")
