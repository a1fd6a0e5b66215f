"""The hostile new user's cases: every command given bad files, bad flags, bad YAML, missing and damaged
artefacts and unwritable outputs. Each case is (id, argv, what the one sentence must say); ``{run}`` is a copy
of the test session's trained run, ``{in}`` a folder of bad inputs made by :func:`make_inputs`, ``{out}`` a
folder that must stay as it was (every refused command changes nothing on disk).

Categories (docs/training.md lists them): bad flags, bad YAML, bad config fields, missing files, files of the
wrong kind, damaged artefacts, unwritable outputs, interrupted/incomplete runs, bad evaluate blocks.
"""

from __future__ import annotations

import os
from pathlib import Path

SWEEP_BASE = (
    "name: s\nbase: {root}/experiments/cpu/looped-mesh.yaml\n"
    "overrides: {{model.preset: cpu-tiny, model.layout: 1+2R2+1, data.seq_len: 64, data.batch_size: 8, "
    "train.max_steps: 4, train.val_every: 4, train.progress: false}}\n"
    "axes: {{variant: {{a: {{model.topology: base}}}}}}\nseeds: [0]\n"
)


def make_inputs(folder: Path, root: Path) -> None:
    """The bad inputs the cases name."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "text.txt").write_text("just some text, not a checkpoint\n")
    (folder / "empty.txt").write_text("")
    (folder / "bad.yaml").write_text("model: [unclosed\n  layout: 4\n")
    (folder / "list.yaml").write_text("- a\n- b\n")
    (folder / "tabs.yaml").write_text("model:\n\tlayout: 4\n")
    (folder / "empty.yaml").write_text("")
    (folder / "binary.yaml").write_bytes(bytes(range(256)))
    (folder / "binary.bin").write_bytes(bytes(range(256)) * 4)  # a program, an archive: no text
    (folder / "unknown.yaml").write_text("name: x\nmodel: {preset: cpu-tiny}\ntrian: {max_steps: 3}\n")
    (folder / "model-str.yaml").write_text("model: cpu-tiny\n")
    (folder / "noname-field.yaml").write_text("model: {preset: cpu-tiny, widht: 3}\n")
    (folder / "emptydir").mkdir(exist_ok=True)
    (folder / "truncated.ckpt").write_bytes(b"PK\x03\x04" + b"\0" * 64)  # a zip header, then nothing
    (folder / "aplainfile").write_text("x")
    (folder / "tracking.db").write_bytes(b"SQLite format 3\0" + b"\0" * 64)  # a run's mlflow.db, say
    (folder / "model-null.yaml").write_text("name: x\nmodel:\ntrain: {max_steps: 2}\n")
    (folder / "name-path.yaml").write_text("name: ../../escape\nmodel: {preset: cpu-tiny}\n")
    (folder / "name-long.yaml").write_text(f"name: {'n' * 300}\nmodel: {{preset: cpu-tiny}}\n")
    if not (folder / "fifo").exists():  # files of the wrong kind: a named pipe, a symbolic link loop
        os.mkfifo(folder / "fifo")
    for a, b in (("loop-a", "loop-b"), ("loop-b", "loop-a")):
        if not (folder / a).is_symlink():
            (folder / a).symlink_to(folder / b)
    # YAML that PyYAML reads otherwise than it looks: a repeated key (the last one wins), YAML 1.1's octal,
    # base-60 and yes/no/on/off scalars
    mesh = "model: {preset: cpu-tiny, layout: 1+2R2+1, topology: mesh}\n"
    (folder / "dup-section.yaml").write_text("name: x\n" + mesh + "model: {preset: cpu-tiny}\n")
    (folder / "dup-field.yaml").write_text(
        "name: x\nmodel:\n  preset: cpu-tiny\n  layout: 1+2R2+1\n  layout: 4\n"
    )
    (folder / "octal.yaml").write_text("name: x\n" + mesh.replace("}", ", buffer: 010}"))
    (folder / "base60.yaml").write_text("name: x\n" + mesh + "train: {max_steps: 1:30}\n")
    (folder / "norway.yaml").write_text("name: no\n" + mesh)
    (folder / "switch.yaml").write_text("name: x\n" + mesh + "train:\n  progress: off\n")
    (folder / "underscore.yaml").write_text("name: x\n" + mesh + "data: {seq_len: 1_6}\n")
    base = SWEEP_BASE.format(root=root)
    sweeps = {
        "sw-task.yaml": base + "evaluate: {tasks: [embedded_lastwrd], shots: [0]}\n",
        "sw-limit.yaml": base + "evaluate: {tasks: [embedded_lastword], limit: -3}\n",
        "sw-shots.yaml": base + "evaluate: {tasks: [embedded_lastword], shots: [a]}\n",
        "sw-ppl.yaml": base + "evaluate: {ppl: {t: missing.txt}}\n",
        "sw-ctxset.yaml": base + "evaluate: {ppl: {t: text.txt}, context_lengths: [32], ctx_set: other}\n",
        "sw-ctxlen.yaml": base + "evaluate: {ppl: {t: text.txt}, context_lengths: [0]}\n",
        "sw-nothing.yaml": base + "evaluate: {tasks: none}\n",
        "sw-evalkey.yaml": base + "evaluate: {taks: [embedded_lastword]}\n",
        "sw-mode.yaml": base + "evaluate: {ppl: {t: text.txt}, ctx_mode: sideways}\n",
        "sw-include.yaml": base + "evaluate: {tasks: [x], include_path: nowhere}\n",
        "sw-top.yaml": base + "evalute: {tasks: [embedded_lastword]}\n",
        "sw-axis.yaml": base.replace("model.topology: base", "model.topology: warp"),
        "sw-noaxes.yaml": base.replace("axes: {variant: {a: {model.topology: base}}}", "axes: {}"),
        "sw-seeds.yaml": base.replace("seeds: [0]", "seeds: [a]"),
        "sw-seed-neg.yaml": base.replace("seeds: [0]", "seeds: [0, -1]"),
        "sw-workers.yaml": base + "workers: 0\n",
        "sw-baseline.yaml": base + "report: {baseline: nope}\n",
        "sw-ok.yaml": base,
        "sw-dup.yaml": base + "seeds: [1]\n",
        "sw-dup-axis.yaml": base.replace("{a: {model.topology: base}}", "{a: {model.topology: base}, a: {}}"),
        "sw-octal.yaml": base + "workers: 02\n",
        "sw-name.yaml": base.replace("name: s\n", "name: a/../../b\n"),
        "sw-metric.yaml": base + "metric: val/heldout/pppl\n",
        "sw-metric-eval.yaml": base
        + "metric: eval/embedded_lastword/5shot/acc\nevaluate: {tasks: [embedded_lastword]}\n",
        "sw-pruning.yaml": base + "pruning: {enabled: true, warmup: 3}\n",
        "sw-plot.yaml": base + "report: {plot: pie}\n",
        "sw-loops.yaml": base + "evaluate: {ppl: {t: text.txt}, loops: [1, 100000]}\n",
    }
    # a search instead of the grid: a choice, a range and a log range no trial drawing them can train
    grid = "axes: {variant: {a: {model.topology: base}}}\nseeds: [0]\n"
    for name, space in {
        "sw-search-choice.yaml": "{model.topology: {choices: [mesh, mesch]}}",
        "sw-search-range.yaml": "{train.lr: {low: 1.0e-2, high: 1.0e-4}}",
        "sw-search-log.yaml": "{train.lr: {low: 0, high: 1.0e-3, log: true}}",
        "sw-search-value.yaml": "{train.warmup_ratio: {low: 0.0, high: 1.5}}",
    }.items():
        sweeps[name] = base.replace(grid, f"search: {{n_trials: 2, space: {space}}}\n")
    # a text of one document: no train/validation split; a sweep naming it in its overrides, or in one grid point
    (folder / "one-doc.txt").write_text("one single document and nothing else\n")
    one_doc = f"{{data.path: {folder / 'one-doc.txt'}}}"
    sweeps["sw-data.yaml"] = base.replace(
        "overrides: {", f"overrides: {{data.path: {folder / 'one-doc.txt'}, ", 1
    )
    sweeps["sw-data-grid.yaml"] = base.replace("{a: {model.topology: base}}", f"{{a: {{}}, b: {one_doc}}}")
    for name, text in sweeps.items():
        (folder / name).write_text(text)


# (id, argv, the sentence must contain this); exit status 2 for all
CASES: list[tuple[str, list[str], str]] = [
    # ---- describe: bad flags, bad YAML, files of the wrong kind
    ("describe-preset", ["describe", "--preset", "nope"], "nope"),
    ("describe-layout", ["describe", "--layout", "4+x"], "4+x"),
    (
        "describe-seq-len-huge",
        ["describe", "--seq-len", "99999999999999999999"],
        "--seq-len must lie in [1, ",
    ),
    ("describe-batch-size-zero", ["describe", "--batch-size", "0"], "--batch-size must lie in [1, "),
    ("describe-config-missing", ["describe", "--config", "{in}/missing.yaml"], "missing.yaml"),
    ("describe-config-bad-yaml", ["describe", "--config", "{in}/bad.yaml"], "bad.yaml"),
    ("describe-config-list", ["describe", "--config", "{in}/list.yaml"], "list.yaml"),
    ("describe-config-tabs", ["describe", "--config", "{in}/tabs.yaml"], "tabs.yaml"),
    ("describe-config-binary", ["describe", "--config", "{in}/binary.yaml"], "binary.yaml"),
    ("describe-config-dir", ["describe", "--config", "{in}/emptydir"], "emptydir"),
    ("describe-config-model-str", ["describe", "--config", "{in}/model-str.yaml"], "model"),
    ("describe-config-unknown-field", ["describe", "--config", "{in}/noname-field.yaml"], "widht"),
    ("describe-sweep-file", ["describe", "--config", "{in}/sw-ok.yaml"], "is a sweep file"),
    (
        "describe-config-duplicate-section",
        ["describe", "--config", "{in}/dup-section.yaml"],
        "model is given twice in config file '{in}/dup-section.yaml' (lines 2 and 3)",
    ),
    (
        "describe-config-duplicate-field",
        ["describe", "--config", "{in}/dup-field.yaml"],
        "model.layout is given twice in config file '{in}/dup-field.yaml' (lines 4 and 5)",
    ),
    (
        "describe-config-octal",
        ["describe", "--config", "{in}/octal.yaml"],
        "model.buffer: 010 in config file '{in}/octal.yaml', line 2, reads as the octal number 8",
    ),
    ("describe-override-octal", ["describe", "--preset", "cpu-tiny", "--model.buffer", "010"], "octal"),
    (
        "describe-config-unknown-section",
        ["describe", "--config", "{in}/unknown.yaml"],
        "'trian' is not a config section (did you mean 'train'?)",
    ),
    (
        "train-field-in-the-wrong-section",
        ["train", "--model.memory_kernel", "triton", "--run-dir", "{out}/r"],
        "model.memory_kernel is not a model field; it is train.memory_kernel: move it there.",
    ),
    (
        "describe-layout-loop-count",
        ["describe", "--preset", "cpu-tiny", "--layout", "2+4R-1+2"],
        "loop count",
    ),
    ("describe-layout-loops-bound", ["describe", "--layout", "1+2R1000+1"], "more than the 256"),
    ("describe-layout-loops-huge", ["describe", "--layout", "1+2R100000000+1"], "more than the 256"),
    ("describe-layout-layers-huge", ["describe", "--layout", "100000000"], "more than the 4096"),
    ("describe-seq-len-0", ["describe", "--preset", "cpu-tiny", "--seq-len", "0"], "--seq-len"),
    ("describe-seq-len-neg", ["describe", "--preset", "cpu-tiny", "--seq-len", "-4"], "--seq-len"),
    ("describe-batch-0", ["describe", "--preset", "cpu-tiny", "--batch-size", "0"], "--batch-size"),
    ("describe-topology", ["describe", "--preset", "cpu-tiny", "--topology", "warp"], "warp"),
    (
        "describe-buffer-0",
        ["describe", "--preset", "cpu-tiny", "--layout", "1+2R2+1", "--buffer", "0"],
        "buffer",
    ),
    ("describe-field-type", ["describe", "--preset", "cpu-tiny", "--model.d_model", "wide"], "d_model"),
    # ---- train: bad config files and fields, bad data, bad run directories, damaged checkpoints
    (
        "train-config-missing",
        ["train", "--config", "{in}/missing.yaml", "--run-dir", "{out}/r"],
        "missing.yaml",
    ),
    ("train-config-bad-yaml", ["train", "--config", "{in}/bad.yaml", "--run-dir", "{out}/r"], "bad.yaml"),
    ("train-config-list", ["train", "--config", "{in}/list.yaml", "--run-dir", "{out}/r"], "list.yaml"),
    ("train-config-empty-dir", ["train", "--config", "{in}/emptydir", "--run-dir", "{out}/r"], "emptydir"),
    (
        "train-config-duplicate-section",
        ["train", "--config", "{in}/dup-section.yaml", "--run-dir", "{out}/r"],
        "model is given twice in config file '{in}/dup-section.yaml' (lines 2 and 3)",
    ),
    (
        "train-config-octal",
        ["train", "--config", "{in}/octal.yaml", "--run-dir", "{out}/r"],
        "model.buffer: 010 in config file '{in}/octal.yaml', line 2",
    ),
    (
        "train-config-base60",
        ["train", "--config", "{in}/base60.yaml", "--run-dir", "{out}/r"],
        "train.max_steps: 1:30 in config file '{in}/base60.yaml', line 3, reads as a base-60 number",
    ),
    (
        "train-config-norway",
        ["train", "--config", "{in}/norway.yaml", "--run-dir", "{out}/r"],
        "name: no in config file '{in}/norway.yaml', line 1, reads as false",
    ),
    (
        "train-config-off",
        ["train", "--config", "{in}/switch.yaml", "--run-dir", "{out}/r"],
        "train.progress: off in config file '{in}/switch.yaml', line 4, reads as false; write false",
    ),
    (
        "train-config-unknown-section",
        ["train", "--config", "{in}/unknown.yaml", "--run-dir", "{out}/r"],
        "trian",
    ),
    (
        "describe-train-loops-unknown",
        ["describe", "--preset", "cpu-tiny", "--layout", "1+2R2+1", "--train-loops", "gamma:4"],
        "--train-loops 'gamma:4'",
    ),
    (
        "describe-train-backprop-alone",
        ["describe", "--preset", "cpu-tiny", "--layout", "1+2R2+1", "--train-backprop", "2"],
        "--train-backprop needs --train-loops",
    ),
    (
        "train-loops-low-above-high",
        [
            "train",
            "--config",
            "{run}/config.yaml",
            "--train.loops",
            "{distribution: uniform, low: 5, high: 2}",
        ]
        + ["--run-dir", "{out}/r"],
        "train.loops.low 5 exceeds train.loops.high 2",
    ),
    (
        "train-loops-vanilla",
        ["train", "--config", "{run}/config.yaml", "--model.layout", "4", "--model.topology", "base"]
        + ["--train.loops.distribution", "uniform", "--train.loops.low", "1", "--train.loops.high", "3"]
        + ["--run-dir", "{out}/r"],
        "train.loops needs a looped layout",
    ),
    (
        "train-lr-neg",
        ["train", "--config", "{run}/config.yaml", "--train.lr", "-1", "--run-dir", "{out}/r"],
        "lr",
    ),
    (
        "train-max-steps-0",
        ["train", "--config", "{run}/config.yaml", "--max-steps", "0", "--run-dir", "{out}/r"],
        "max_steps",
    ),
    (
        "train-unknown-field",
        ["train", "--config", "{run}/config.yaml", "--train.nope", "1", "--run-dir", "{out}/r"],
        "nope",
    ),
    (
        "train-bad-flag-value",
        ["train", "--config", "{run}/config.yaml", "--data.seq_len", "long", "--run-dir", "{out}/r"],
        "seq_len",
    ),
    (
        "train-seq-len-0",
        ["train", "--config", "{run}/config.yaml", "--data.seq_len", "0", "--run-dir", "{out}/r"],
        "seq_len",
    ),
    (
        "train-batch-0",
        ["train", "--config", "{run}/config.yaml", "--data.batch_size", "0", "--run-dir", "{out}/r"],
        "batch_size",
    ),
    (
        "train-ckpt-every-0",
        ["train", "--config", "{run}/config.yaml", "--checkpoint-every", "0", "--run-dir", "{out}/r"],
        "checkpoint_every",
    ),
    (
        "train-data-missing",
        ["train", "--config", "{run}/config.yaml", "--data", "{in}/missing.txt", "--run-dir", "{out}/r"],
        "missing.txt",
    ),
    (
        "train-data-empty",
        ["train", "--config", "{run}/config.yaml", "--data", "{in}/empty.txt", "--run-dir", "{out}/r"],
        "empty.txt",
    ),
    (
        "train-layout",
        ["train", "--config", "{run}/config.yaml", "--model.layout", "4+x", "--run-dir", "{out}/r"],
        "4+x",
    ),
    (
        "train-run-dir-is-file",
        ["train", "--config", "{run}/config.yaml", "--run-dir", "{in}/aplainfile"],
        "aplainfile",
    ),
    (
        "train-run-dir-under-file",
        ["train", "--config", "{run}/config.yaml", "--run-dir", "{in}/aplainfile/sub"],
        "aplainfile",
    ),
    ("train-resume-missing", ["train", "--resume", "--run-dir", "{out}/nothing-here"], "does not exist"),
    (
        "train-existing-without-resume",
        ["train", "--config", "{run}/config.yaml", "--run-dir", "{run}"],
        "--resume",
    ),
    (
        "train-ckpt-path-text",
        ["train", "--resume", "--run-dir", "{run}", "--ckpt-path", "{in}/text.txt"],
        "text.txt",
    ),
    (
        "train-ckpt-path-truncated",
        ["train", "--resume", "--run-dir", "{run}", "--ckpt-path", "{in}/truncated.ckpt"],
        "truncated.ckpt",
    ),
    (
        "train-run-dir-name-too-long",
        ["train", "--config", "{run}/config.yaml", "--run-dir", "{out}/" + "x" * 300],
        "has a name of 300 bytes, above the 255 a file system allows",
    ),
    (
        "train-run-dir-symlink-loop",
        ["train", "--config", "{run}/config.yaml", "--run-dir", "{in}/loop-a"],
        "'{in}/loop-a' is a symbolic link that leads nowhere",
    ),
    (
        "train-config-fifo",
        ["train", "--config", "{in}/fifo", "--run-dir", "{out}/r"],
        "config file '{in}/fifo' is a named pipe (FIFO), not a file",
    ),
    (
        "train-init-from-text",
        ["train", "--config", "{run}/config.yaml", "--init-from", "{in}/text.txt", "--run-dir", "{out}/r"],
        "neither a checkpoint nor a model directory",
    ),
    (
        "train-init-from-missing",
        ["train", "--config", "{run}/config.yaml", "--init-from", "{in}/gone", "--run-dir", "{out}/r"],
        "does not exist",
    ),
    (
        "train-init-from-empty-dir",
        ["train", "--config", "{run}/config.yaml", "--init-from", "{in}/emptydir", "--run-dir", "{out}/r"],
        "emptydir",
    ),
    (
        "train-init-from-hf-without-weights",
        [
            "train",
            "--config",
            "{run}/config.yaml",
            "--init-from",
            "{broken}/hf-no-weights",
            "--run-dir",
            "{out}/r",
        ],
        "train.init_from '{broken}/hf-no-weights': its weights cannot be read",
    ),
    (
        "train-init-from-hf-cut-weights",
        [
            "train",
            "--config",
            "{run}/config.yaml",
            "--init-from",
            "{broken}/hf-cut-weights",
            "--run-dir",
            "{out}/r",
        ],
        "train.init_from '{broken}/hf-cut-weights': its weights cannot be read",
    ),
    (
        "train-init-from-hf-without-config",
        [
            "train",
            "--config",
            "{run}/config.yaml",
            "--init-from",
            "{broken}/hf-no-config",
            "--run-dir",
            "{out}/r",
        ],
        "holds Hugging Face model weights but no config.json",
    ),
    (
        "train-init-from-looped",
        ["train", "--config", "{run}/config.yaml", "--init-from", "{run}", "--run-dir", "{out}/r"],
        "vanilla",
    ),
    (
        "train-init-strategy",
        ["train", "--config", "{run}/config.yaml", "--init-strategy", "every-other", "--run-dir", "{out}/r"],
        "init_strategy",
    ),
    (
        "train-init-select-empty",
        ["train", "--config", "{run}/config.yaml", "--init-strategy", "select:", "--run-dir", "{out}/r"],
        "lists no source layers",
    ),
    ("train-resume-damaged-last", ["train", "--resume", "--run-dir", "{damaged}"], "last.ckpt"),
    (
        "train-resume-config-deleted",
        ["train", "--resume", "--run-dir", "{broken}/no-config"],
        "--resume: '{broken}/no-config' holds a run but not its config.yaml",
    ),
    (
        "train-resume-garbage-store",
        ["train", "--resume", "--run-dir", "{broken}/garbage-db"],
        "'{broken}/garbage-db/mlflow.db' is not a SQLite database",
    ),
    (  # a directory that is no sharded checkpoint: refused before the run's MLflow status is touched
        "train-ckpt-path-dir",
        ["train", "--resume", "--run-dir", "{run}", "--ckpt-path", "{run}/checkpoints"],
        "not a sharded checkpoint",
    ),
    (
        "train-resume-max-steps-below",
        ["train", "--resume", "--run-dir", "{run}", "--max-steps", "2"],
        "--max-steps",
    ),
    (
        "train-parent-run-missing",
        ["train", "--config", "{run}/config.yaml", "--run-dir", "{out}/r", "--parent-run-id", "0123abcd"],
        "--parent-run-id '0123abcd' is not a run in the tracking store sqlite:///{out}/r/mlflow.db; pass the id",
    ),
    (
        "train-name-too-long",
        ["train", "--config", "{in}/name-long.yaml"],
        "--run-dir 'runs/"
        + "n" * 300
        + "' cannot hold the run: 'runs/"
        + "n" * 300
        + "' has a name of 300 bytes",
    ),
    (
        "train-tag-no-value",
        ["train", "--config", "{run}/config.yaml", "--run-dir", "{out}/r", "--tag", "novalue"],
        "KEY=VALUE",
    ),
    (
        "train-override-no-value",
        ["train", "--run-dir", "{out}/r", "--model.topology", "--train.lr", "3e-3"],
        "--model.topology",
    ),
    (
        "train-name-path",
        ["train", "--config", "{in}/name-path.yaml", "--run-dir", "{out}/r"],
        "one folder name",
    ),
    (
        "train-model-null",
        ["train", "--config", "{in}/model-null.yaml", "--run-dir", "{out}/r"],
        "'model' section",
    ),
    (
        "train-seed-neg",
        ["train", "--config", "{run}/config.yaml", "--seed", "-1", "--run-dir", "{out}/r"],
        "train.seed",
    ),
    (
        "train-seed-big",
        ["train", "--config", "{run}/config.yaml", "--seed", str(2**32), "--run-dir", "{out}/r"],
        "train.seed",
    ),
    (  # resource limits: refused before the run starts (no run directory, no MLflow run)
        "train-model-too-big-for-memory",
        ["train", "--config", "{run}/config.yaml", "--model.d_model", "100000000", "--run-dir", "{out}/r"],
        "parameters, which need at least",
    ),
    (
        "train-threads-above-cores",
        ["train", "--config", "{run}/config.yaml", "--threads", "100000", "--run-dir", "{out}/r"],
        "--threads 100000 is more than the",
    ),
    (
        "train-val-fraction",
        ["train", "--config", "{run}/config.yaml", "--run-dir", "{out}/r", "--data.val_fraction", "1.5"],
        "data.val_fraction",
    ),
    # ---- sweep: bad files, bad evaluate blocks (checked before the first trial), bad flags
    ("sweep-missing", ["sweep", "{in}/missing.yaml", "--run-dir", "{out}/s"], "missing.yaml"),
    (
        "sweep-missing-example",
        ["sweep", "{in}/missing.yaml", "--run-dir", "{out}/s"],
        "ablations/default.yaml",
    ),
    ("sweep-name-path", ["sweep", "{in}/sw-name.yaml", "--run-dir", "{out}/s"], "one folder name"),
    ("sweep-bad-yaml", ["sweep", "{in}/bad.yaml", "--run-dir", "{out}/s"], "bad.yaml"),
    ("sweep-list", ["sweep", "{in}/list.yaml", "--run-dir", "{out}/s"], "list.yaml"),
    ("sweep-empty", ["sweep", "{in}/empty.yaml", "--run-dir", "{out}/s"], "empty.yaml"),
    ("sweep-eval-task", ["sweep", "{in}/sw-task.yaml", "--run-dir", "{out}/s"], "embedded_lastwrd"),
    ("sweep-eval-limit", ["sweep", "{in}/sw-limit.yaml", "--run-dir", "{out}/s"], "evaluate.limit"),
    ("sweep-eval-shots", ["sweep", "{in}/sw-shots.yaml", "--run-dir", "{out}/s"], "evaluate.shots"),
    ("sweep-eval-ppl-missing", ["sweep", "{in}/sw-ppl.yaml", "--run-dir", "{out}/s"], "missing.txt"),
    ("sweep-eval-ctx-set", ["sweep", "{in}/sw-ctxset.yaml", "--run-dir", "{out}/s"], "ctx_set"),
    ("sweep-eval-ctx-len", ["sweep", "{in}/sw-ctxlen.yaml", "--run-dir", "{out}/s"], "context_lengths"),
    ("sweep-eval-nothing", ["sweep", "{in}/sw-nothing.yaml", "--run-dir", "{out}/s"], "nothing to evaluate"),
    ("sweep-eval-key", ["sweep", "{in}/sw-evalkey.yaml", "--run-dir", "{out}/s"], "taks"),
    ("sweep-eval-mode", ["sweep", "{in}/sw-mode.yaml", "--run-dir", "{out}/s"], "ctx_mode"),
    ("sweep-eval-include", ["sweep", "{in}/sw-include.yaml", "--run-dir", "{out}/s"], "include_path"),
    (
        "sweep-duplicate-key",
        ["sweep", "{in}/sw-dup.yaml", "--run-dir", "{out}/s"],
        "seeds is given twice in sweep file '{in}/sw-dup.yaml' (lines 5 and 6)",
    ),
    (
        "sweep-duplicate-axis-value",
        ["sweep", "{in}/sw-dup-axis.yaml", "--run-dir", "{out}/s"],
        "axes.variant.a is given twice",
    ),
    ("sweep-octal", ["sweep", "{in}/sw-octal.yaml", "--run-dir", "{out}/s"], "workers: 02 in sweep file"),
    (
        "sweep-search-choice",
        ["sweep", "{in}/sw-search-choice.yaml", "--run-dir", "{out}/s"],
        "at model.topology=mesch: model.topology 'mesch'",
    ),
    ("sweep-search-range", ["sweep", "{in}/sw-search-range.yaml", "--run-dir", "{out}/s"], "swap them"),
    (
        "sweep-search-log",
        ["sweep", "{in}/sw-search-log.yaml", "--run-dir", "{out}/s"],
        "log range needs low > 0",
    ),
    ("sweep-search-value", ["sweep", "{in}/sw-search-value.yaml", "--run-dir", "{out}/s"], "warmup_ratio"),
    ("sweep-top-key", ["sweep", "{in}/sw-top.yaml", "--run-dir", "{out}/s"], "evalute"),
    ("sweep-axis-value", ["sweep", "{in}/sw-axis.yaml", "--run-dir", "{out}/s"], "warp"),
    ("sweep-seeds", ["sweep", "{in}/sw-seeds.yaml", "--run-dir", "{out}/s"], "seed"),
    ("sweep-seed-neg", ["sweep", "{in}/sw-seed-neg.yaml", "--run-dir", "{out}/s"], "train.seed"),
    ("sweep-eval-loops", ["sweep", "{in}/sw-loops.yaml", "--run-dir", "{out}/s"], "exceeds 256"),
    ("sweep-workers-file", ["sweep", "{in}/sw-workers.yaml", "--run-dir", "{out}/s"], "workers"),
    (
        "sweep-workers-flag",
        ["sweep", "{in}/sw-ok.yaml", "--workers", "0", "--run-dir", "{out}/s"],
        "--workers",
    ),
    ("sweep-baseline", ["sweep", "{in}/sw-baseline.yaml", "--run-dir", "{out}/s"], "baseline"),
    ("sweep-metric", ["sweep", "{in}/sw-metric.yaml", "--run-dir", "{out}/s"], "val/heldout/pppl"),
    ("sweep-metric-shots", ["sweep", "{in}/sw-metric-eval.yaml", "--run-dir", "{out}/s"], "5shot"),
    ("sweep-pruning", ["sweep", "{in}/sw-pruning.yaml", "--run-dir", "{out}/s"], "pruning.warmup"),
    ("sweep-report-plot", ["sweep", "{in}/sw-plot.yaml", "--run-dir", "{out}/s"], "report.plot"),
    (
        "sweep-garbage-study",
        ["sweep", "{in}/sw-ok.yaml", "--run-dir", "{broken}/sweep"],
        "'{broken}/sweep/optuna.db' is a damaged SQLite database",
    ),
    ("sweep-run-dir-file", ["sweep", "{in}/sw-noaxes.yaml", "--run-dir", "{in}/aplainfile"], "aplainfile"),
    # ---- report: missing and wrong directories
    ("report-missing", ["report", "--run-dir", "{out}/nothing"], "nothing"),
    ("report-empty-dir", ["report", "--run-dir", "{in}/emptydir"], "emptydir"),
    ("report-train-run", ["report", "--run-dir", "{run}"], "sweep"),
    ("report-file", ["report", "--run-dir", "{in}/aplainfile"], "aplainfile"),
    (
        "report-garbage-study",
        ["report", "--run-dir", "{broken}/sweep"],
        "'{broken}/sweep/optuna.db' is a damaged SQLite database",
    ),
    # ---- eval: missing / wrong / damaged checkpoints, bad flags, nothing to evaluate, unwritable output
    ("eval-missing", ["eval", "{in}/gone.ckpt", "--no-mlflow"], "gone.ckpt"),
    ("eval-text", ["eval", "{in}/text.txt", "--no-mlflow"], "text.txt"),
    ("eval-truncated", ["eval", "{in}/truncated.ckpt", "--no-mlflow"], "truncated.ckpt"),
    ("eval-empty-dir", ["eval", "{in}/emptydir", "--no-mlflow"], "emptydir"),
    (
        "eval-hf-folder",
        ["eval", "{broken}/hf-no-config", "--no-mlflow"],
        "holds Hugging Face model weights, not a run of this package",
    ),
    ("eval-fifo", ["eval", "{in}/fifo", "--no-mlflow"], "checkpoint '{in}/fifo' is a named pipe"),
    (
        "eval-ppl-fifo",
        ["eval", "{run}", "--ppl", "t={in}/fifo", "--tasks", "none", "--no-mlflow"],
        "perplexity set '{in}/fifo' is a named pipe",
    ),
    (  # a tracking server that does not answer: one sentence in seconds, not MLflow's minutes of retries
        "eval-tracking-server-down",
        [
            "eval",
            "{run}",
            "--ppl",
            "t={in}/text.txt",
            "--tasks",
            "none",
            "--tracking-uri",
            "http://127.0.0.1:1",
        ],
        "cannot reach the MLflow tracking server --tracking-uri 'http://127.0.0.1:1'",
    ),
    (
        "train-tracking-server-down",
        [
            "train",
            "--config",
            "{run}/config.yaml",
            "--run-dir",
            "{out}/r",
            "--tracking-uri",
            "http://127.0.0.1:1",
        ],
        "cannot reach the MLflow tracking server --tracking-uri 'http://127.0.0.1:1'",
    ),
    (  # a run's tracking store that is there but empty, overwritten or cut short
        "eval-empty-store",
        ["eval", "{broken}/empty-db", "--ppl", "t={in}/text.txt", "--tasks", "none"],
        "'{broken}/empty-db/mlflow.db' is empty (0 bytes); pass --no-mlflow",
    ),
    (
        "eval-garbage-store",
        ["eval", "{broken}/garbage-db", "--ppl", "t={in}/text.txt", "--tasks", "none"],
        "'{broken}/garbage-db/mlflow.db' is not a SQLite database",
    ),
    (
        "eval-truncated-store",
        ["eval", "{broken}/truncated-db", "--ppl", "t={in}/text.txt", "--tasks", "none"],
        "'{broken}/truncated-db/mlflow.db' is a damaged SQLite database",
    ),
    (
        "eval-ctx-0",
        ["eval", "{run}", "--ppl", "t={in}/text.txt", "--context-lengths", "0", "--tasks", "none"],
        "--context-lengths",
    ),
    (
        "eval-ctx-neg",
        ["eval", "{run}", "--ppl", "t={in}/text.txt", "--context-lengths", "-1", "--tasks", "none"],
        "--context-lengths",
    ),
    (
        "eval-ctx-empty",
        ["eval", "{run}", "--ppl", "t={in}/text.txt", "--context-lengths", "", "--tasks", "none"],
        "--context-lengths",
    ),
    (
        "eval-ctx-words",
        ["eval", "{run}", "--ppl", "t={in}/text.txt", "--context-lengths", "long", "--tasks", "none"],
        "--context-lengths",
    ),
    ("eval-ctx-no-set", ["eval", "{run}", "--context-lengths", "32", "--tasks", "none"], "--ppl"),
    (
        "eval-ctx-set-unknown",
        [
            "eval",
            "{run}",
            "--ppl",
            "t={in}/text.txt",
            "--context-lengths",
            "32",
            "--ctx-ppl",
            "u",
            "--tasks",
            "none",
        ],
        "--ctx-ppl",
    ),
    ("eval-nothing", ["eval", "{run}", "--tasks", "none"], "nothing to evaluate"),
    (
        "eval-ppl-twice",
        ["eval", "{run}", "--ppl", "a={in}/text.txt", "--ppl", "a={in}/text.txt", "--tasks", "none"],
        "twice",
    ),
    ("eval-shots-neg", ["eval", "{run}", "--tasks", "embedded_lastword", "--shots", "-1"], "shots"),
    ("eval-shots-words", ["eval", "{run}", "--tasks", "embedded_lastword", "--shots", "few"], "--shots"),
    ("eval-limit-0", ["eval", "{run}", "--tasks", "embedded_lastword", "--limit", "0"], "--limit"),
    ("eval-limit-words", ["eval", "{run}", "--tasks", "embedded_lastword", "--limit", "many"], "--limit"),
    ("eval-task-unknown", ["eval", "{run}", "--tasks", "nosuchtask_xyz"], "nosuchtask_xyz"),
    ("eval-ppl-no-name", ["eval", "{run}", "--ppl", "=x", "--tasks", "none"], "NAME=PATH"),
    ("eval-ppl-missing", ["eval", "{run}", "--ppl", "t={in}/gone.txt", "--tasks", "none"], "gone.txt"),
    ("eval-ppl-empty", ["eval", "{run}", "--ppl", "t={in}/empty.txt", "--tasks", "none"], "empty.txt"),
    (
        "eval-ppl-binary",
        ["eval", "{run}", "--ppl", "{in}/binary.bin", "--tasks", "none"],
        "perplexity set '{in}/binary.bin' is not valid UTF-8 text (byte 128); convert it to UTF-8 or pass a "
        ".txt, .jsonl or .json file of text.",
    ),
    ("eval-batch-0", ["eval", "{run}", "--batch-size", "0"], "--batch-size"),
    (
        "eval-max-length-0",
        ["eval", "{run}", "--ppl", "t={in}/text.txt", "--tasks", "none", "--max-length", "0"],
        "max",
    ),
    (
        "eval-stride-0",
        ["eval", "{run}", "--ppl", "t={in}/text.txt", "--tasks", "none", "--stride", "0"],
        "stride",
    ),
    (
        "eval-ctx-block-0",
        [
            "eval",
            "{run}",
            "--ppl",
            "t={in}/text.txt",
            "--context-lengths",
            "32",
            "--tasks",
            "none",
            "--ctx-block",
            "0",
        ],
        "ctx-block",
    ),
    (
        "eval-loops-bound",
        ["eval", "{run}", "--ppl", "t={in}/text.txt", "--tasks", "none", "--loops", "100000"],
        "--loops 100000 exceeds 256",
    ),
    (
        "eval-out-file",
        ["eval", "{run}", "--ppl", "t={in}/text.txt", "--tasks", "none", "--out", "{in}/aplainfile"],
        "aplainfile",
    ),
    (
        "eval-device",
        ["eval", "{run}", "--ppl", "t={in}/text.txt", "--tasks", "none", "--device", "tpu"],
        "tpu",
    ),
    # ---- probe
    ("probe-missing", ["probe", "{in}/gone.ckpt", "--no-mlflow"], "gone.ckpt"),
    ("probe-text", ["probe", "{in}/text.txt", "--no-mlflow"], "text.txt"),
    ("probe-samples-0", ["probe", "{run}", "--samples", "0", "--no-mlflow"], "--samples"),
    ("probe-seq-len-big", ["probe", "{run}", "--seq-len", "100000", "--no-mlflow"], "--seq-len"),
    ("probe-seq-len-0", ["probe", "{run}", "--seq-len", "0", "--no-mlflow"], "--seq-len"),
    ("probe-data-missing", ["probe", "{run}", "--data", "{in}/gone.txt", "--no-mlflow"], "gone.txt"),
    ("probe-data-empty", ["probe", "{run}", "--data", "{in}/empty.txt", "--no-mlflow"], "empty.txt"),
    (
        "probe-out-file",
        ["probe", "{run}", "--out", "{in}/aplainfile", "--no-mlflow", "--samples", "2"],
        "aplainfile",
    ),
    ("probe-batch-0", ["probe", "{run}", "--batch-size", "0", "--no-mlflow"], "--batch-size"),
    # ---- ui
    ("ui-port-big", ["ui", "{run}", "--port", "99999"], "--port"),
    ("ui-port-0", ["ui", "{run}", "--port", "0"], "--port"),
    ("ui-host", ["ui", "{run}", "--host", "no.such.host.invalid"], "--host"),
    ("ui-missing", ["ui", "{out}/nothing"], "nothing"),
    ("ui-no-store", ["ui", "{in}/emptydir"], "emptydir"),
    ("ui-file", ["ui", "{in}/aplainfile"], "aplainfile"),
    (
        "ui-tracking-uri-missing-file",
        ["ui", "--tracking-uri", "sqlite:///{in}/missing.db"],
        "'{in}/missing.db' does not exist; pass the mlflow.db",
    ),
    ("ui-tracking-server-down", ["ui", "--tracking-uri", "http://127.0.0.1:1"], "does not answer"),
    # ---- generate
    ("generate-missing", ["generate", "{in}/gone.ckpt"], "gone.ckpt"),
    ("generate-text", ["generate", "{in}/text.txt"], "text.txt"),
    ("generate-tokens-0", ["generate", "{run}", "--max-new-tokens", "0"], "--max-new-tokens"),
    ("generate-temperature", ["generate", "{run}", "--temperature", "-1"], "--temperature"),
    ("generate-temperature-nan", ["generate", "{run}", "--temperature", "nan"], "--temperature"),
    # bytes the terminal could not decode (Python's surrogate escapes, passed on as the bytes 0xff 0xfe)
    ("generate-prompt-not-utf8", ["generate", "{run}", "--prompt", "\udcff\udcfe"], "--prompt is not UTF-8"),
    ("generate-temperature-inf", ["generate", "{run}", "--temperature", "inf"], "--temperature"),
    ("generate-seed-big", ["generate", "{run}", "--temperature", "0.8", "--seed", str(2**64)], "--seed"),
    (
        "generate-loops-bound",
        ["generate", "{run}", "--loops", "100000"],
        "--loops must be one whole loop count from 1 to 256, not 100000",
    ),
    ("generate-top-k", ["generate", "{run}", "--top-k", "0"], "--top-k"),
    ("generate-top-k-greedy", ["generate", "{run}", "--top-k", "5"], "--temperature"),
    ("generate-wrong-kind", ["generate", "{in}/tracking.db"], "not a checkpoint"),
    ("generate-device", ["generate", "{run}", "--device", "tpu"], "tpu"),
    ("generate-device-cuda", ["generate", "{run}", "--device", "cuda:7"], "cuda:7"),
    # ---- the command itself
    ("unknown-command", ["trian"], "unknown command"),
    # ---- a folder where a file is expected, a path that does not exist, a sweep directory for a run's
    (
        "train-config-dir",
        ["train", "--config", "{in}/emptydir"],
        "config file '{in}/emptydir' is a directory",
    ),
    ("sweep-file-dir", ["sweep", "{in}/emptydir"], "sweep file '{in}/emptydir' is a directory; pass a YAML"),
    (
        "report-missing-dir",
        ["report", "--run-dir", "{out}/nothing"],
        "--run-dir '{out}/nothing' does not exist",
    ),
    (
        "generate-sweep-dir",
        ["generate", "{broken}/sweep"],
        "'{broken}/sweep' is a sweep directory; pass one of its trial run directories",
    ),
    # ---- YAML with a tab among its indentation: the file, the line, the fix
    (
        "describe-config-tab-line",
        ["describe", "--config", "{in}/tabs.yaml"],
        "config file '{in}/tabs.yaml' has a tab on line 2; YAML indents with spaces, so replace the tab",
    ),
    # ---- options that do not fit together, or past what the model can do
    (
        "eval-ctx-ppl-not-a-set",
        ["eval", "{run}", "--ppl", "t={in}/text.txt", "--tasks", "none", "--context-lengths", "32"]
        + ["--ctx-ppl", "zz"],
        "--ctx-ppl 'zz' is not one of the --ppl sets (t); name one of them.",
    ),
    (
        "train-resume-init-from",
        ["train", "--resume", "--run-dir", "{run}", "--init-from", "{run}"],
        "--resume and --init-from exclude each other",
    ),
    (
        "train-ckpt-path-without-resume",
        ["train", "--run-dir", "{out}/r", "--ckpt-path", "{run}/checkpoints/last.ckpt"],
        "names the checkpoint a --resume continues from; add --resume",
    ),
    ("train-data-empty-string", ["train", "--data", "", "--run-dir", "{out}/r"], "data.path is empty"),
    (
        "eval-max-length-above-context",
        ["eval", "{run}", "--ppl", "t={in}/text.txt", "--tasks", "none", "--max-length", "100000"],
        "--max-length 100000 is above the model's context of 128 tokens (model.max_seq_len); pass at most 128",
    ),
    (
        "generate-tokens-huge",
        ["generate", "{run}", "--max-new-tokens", "100000000"],
        "--max-new-tokens must lie in [1, 100000]",
    ),
    # ---- numbers a library would crash on or read otherwise, worker counts above the machine, stores and
    # checkpoints that are not what their names say
    (
        "eval-limit-nan",
        ["eval", "{run}", "--tasks", "embedded_lastword", "--limit", "nan"],
        "--limit must be a whole number of examples >= 1 or a fraction between 0 and 1, not nan",
    ),
    (
        "eval-limit-inf",
        ["eval", "{run}", "--tasks", "embedded_lastword", "--limit", "inf"],
        "--limit must be a whole number of examples >= 1 or a fraction between 0 and 1, not inf",
    ),
    (
        "eval-limit-not-whole",
        ["eval", "{run}", "--tasks", "embedded_lastword", "--limit", "1.5"],
        "not 1.5",
    ),
    (
        "yaml-underscore-number",
        ["train", "--config", "{in}/underscore.yaml", "--run-dir", "{out}/r"],
        "data.seq_len: 1_6 in config file '{in}/underscore.yaml', line 3, reads as the number 16",
    ),
    (
        "sweep-workers-above-cores",
        ["sweep", "{in}/sw-ok.yaml", "--workers", "1000", "--run-dir", "{out}/s"],
        "--workers 1000 (or the sweep file's workers:) is more than the",
    ),
    (
        "train-resume-last-ckpt-folder",
        ["train", "--resume", "--run-dir", "{broken}/ckpt-folder", "--max-steps", "20"],
        "last.ckpt' is a folder but no sharded checkpoint (no .metadata inside); the previous good checkpoint",
    ),
    (
        "eval-store-gone",
        ["eval", "{broken}/store-gone", "--tasks", "none", "--ppl", "t={in}/text.txt"],
        "gone/store.db' that '{broken}/store-gone/mlflow_tracking_uri' names does not exist",
    ),
    (
        "train-resume-store-gone",
        ["train", "--resume", "--run-dir", "{broken}/store-gone", "--max-steps", "20"],
        "names does not exist; put it back, or pass the store the run was logged to with --tracking-uri",
    ),
    # ---- a sweep whose data every trial would fail on: refused before the first trial
    (
        "sweep-data-unsplittable",
        ["sweep", "{in}/sw-data.yaml", "--run-dir", "{out}/s"],
        "data.path: the data {in}/one-doc.txt cannot be split into train and validation",
    ),
    (
        "sweep-data-unsplittable-grid-point",
        ["sweep", "{in}/sw-data-grid.yaml", "--run-dir", "{out}/s"],
        "sweep 's' at variant=b, train.seed=0: data.path: the data {in}/one-doc.txt cannot be split",
    ),
]
