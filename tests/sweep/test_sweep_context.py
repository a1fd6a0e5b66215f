"""A sweep whose ``evaluate:`` asks for context lengths: every trial's perplexity by context length in its
metrics, and one plot across trials in the report (Mela Fig. 4 for a whole ablation grid)."""

import os

import yaml
from conftest import command_output, run_sweep, sweep_file
from test_sweep import study_trials


def test_sweep_report_plots_perplexity_by_context_length(tmp_path, data_cache):
    text = tmp_path / "heldout.txt"
    text.write_text("The quick brown fox jumps over the lazy dog, and then it sleeps. " * 60)
    rows = {"mesh": {"model.topology": "mesh"}, "base": {"model.topology": "base"}}
    spec = sweep_file(tmp_path, data_cache, rows, steps=4)
    raw = yaml.safe_load(spec.read_text())
    raw["evaluate"] = {
        "ppl": {"heldout": "heldout.txt"},
        "context_lengths": [16, 64, 256],
        "ctx_max_tokens": 512,
    }
    raw["base"] = os.path.relpath(
        raw["base"], tmp_path
    )  # relative paths resolve from the sweep file's folder
    spec.write_text(yaml.safe_dump(raw))
    run_dir = tmp_path / "runs" / "sweep"
    p = run_sweep([spec, "--run-dir", run_dir])
    out, _ = p.communicate(timeout=900)
    assert p.returncode == 0, out
    trials = study_trials(run_dir)
    assert len(trials) == 2
    for t in trials:
        assert {f"eval/ppl_ctx/{L}" for L in (16, 64, 256)} <= set(t.user_attrs["metrics"])
    report = (run_dir / "report.md").read_text()
    assert "## Perplexity by context length" in report and "| mesh |" in report and "| base |" in report
    png = run_dir / "report_ppl_by_context.png"
    assert png.read_bytes()[:4] == b"\x89PNG"

    def report(directory):
        code, out = command_output("report", "--run-dir", directory, timeout=300)
        assert code == 0, out
        return (directory / "report.md").read_text()

    # `report` of the directory: its kept sweep.yaml resolves the relative base from the original folder
    report(run_dir)
    # a moved sweep directory reports from its own stores (sweep.json keeps them relative to it)
    moved = tmp_path / "elsewhere" / "sweep"
    moved.parent.mkdir()
    run_dir.rename(moved)
    text = report(moved)
    assert "2 finished trials" in text and "| mesh |" in text


def test_context_lengths_need_a_text_set(tmp_path, data_cache):
    from recursive_lightning.errors import ConfigError
    from recursive_lightning.sweep.spec import load_sweep

    spec = sweep_file(tmp_path, data_cache, {"mesh": {"model.topology": "mesh"}})
    raw = yaml.safe_load(spec.read_text())
    for evaluate, message in (
        ({"context_lengths": [64]}, "needs a text set"),
        ({"ppl": {"a": "x"}, "context_lengths": [0]}, "positive token counts"),
        ({"ppl": {"a": "x"}, "context_length": [64]}, "evaluate.context_length is not an evaluate field"),
        ({"ppl": {"a": "x"}, "loops": [1, 0]}, "evaluate.loops must be whole counts >= 1, not 0"),
        ({"ppl": {"a": "x"}, "h_cycles": 2}, "evaluate.h_cycles must be a non-empty list"),
        ({"ppl": {"a": "x"}, "exit_kl": [5e-4, -1]}, "evaluate.exit_kl must be finite KL thresholds >= 0"),
        ({"ppl": {"a": "x"}, "exit_kl": "5e-4"}, "evaluate.exit_kl must be a non-empty list"),
        ({"exit_kl": [5e-4]}, "evaluate.exit_kl scores text sets"),
        ({"ppl": {"a": "x"}, "exit_kl": [0], "exit_max_tokens": 0}, "evaluate.exit_max_tokens must be"),
    ):
        raw["evaluate"] = evaluate
        spec.write_text(yaml.safe_dump(raw))
        try:
            load_sweep(spec)
        except ConfigError as e:
            assert message in str(e)
        else:
            raise AssertionError(evaluate)


def test_embedded_heldout_is_the_validation_split():
    from recursive_lightning.data.corpus import embedded_corpus_documents
    from recursive_lightning.data.shards import split_documents
    from recursive_lightning.evaluation.perplexity import read_texts

    train, val = split_documents(embedded_corpus_documents())
    got = read_texts("embedded:heldout")
    assert got == val and got and not set(got) & set(train)


def test_paired_context_table_names_each_length_and_the_widening_gap():
    """Row − baseline at each context length over seed pairs, and the change of that gap from the shortest to
    the longest length, each with its t-interval and whether it excludes 0 (Mela Fig. 4's direction)."""
    from recursive_lightning.sweep.context_lengths import paired_lines
    from recursive_lightning.sweep.rows import Row

    def trial(seed, ppl):
        return {"params": {"train.seed": seed}, "metrics": {f"eval/ppl_ctx/{L}": v for L, v in ppl.items()}}

    jitter = [0.0, 1.5, -1.0]
    mela = Row("mela", {}, [trial(s, {256: 100 + j, 4096: 100 + j}) for s, j in enumerate(jitter)])
    tpp = Row("tpp", {}, [trial(s, {256: 120 + j + s, 4096: 150 + j - s}) for s, j in enumerate(jitter)])
    same = Row(
        "same", {}, [trial(s, {256: 100 + j + (-1) ** s, 4096: 100 + j}) for s, j in enumerate(jitter)]
    )
    lines = paired_lines([mela, tpp, same], "mela", [256, 4096])
    assert lines[2] == "| row | pairs | 256 | 4096 | change 256 → 4096 |"
    tpp_cells = next(x for x in lines if x.startswith("| tpp |")).split(" | ")
    assert tpp_cells[1] == "3"
    assert tpp_cells[2].startswith("**+21.00 [") and tpp_cells[2].endswith("excludes 0")  # 20 + mean seed 1
    assert tpp_cells[3].startswith("**+49.00 [") and tpp_cells[3].endswith("excludes 0")
    assert tpp_cells[4].startswith("**+28.00 [") and "excludes 0" in tpp_cells[4]  # 49 − 21: the gap widens
    same_cells = next(x for x in lines if x.startswith("| same |")).split(" | ")
    assert same_cells[2].endswith("includes 0") and same_cells[3] == "0.00 [0.00, 0.00] includes 0"
    assert paired_lines([tpp], "mela", [256, 4096]) == []  # no baseline row: no table
