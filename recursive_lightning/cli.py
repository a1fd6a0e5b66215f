"""``python -m recursive_lightning <command>``: the dispatcher. It takes the global options (``--threads``), finds
the command's module in ``recursive_lightning/commands/`` and runs its ``main``, and turns what stops a command
(a user's error, SIGTERM, Ctrl-C) into its one line and exit status."""

from __future__ import annotations

import functools
import importlib
import os
import signal
import sys
import threading
from types import FrameType

from recursive_lightning import faults, interrupts
from recursive_lightning import threads as thread_policy
from recursive_lightning.errors import Terminated, UserError
from recursive_lightning.uris import mask_url

# command -> its module, whose ``main(argv)`` parses, runs and returns the exit status (imported on use: a
# command's start loads only what it needs)
COMMANDS = {
    "describe": "recursive_lightning.commands.describe",
    "generate": "recursive_lightning.commands.generate",
    "train": "recursive_lightning.commands.train",
    "sweep": "recursive_lightning.commands.sweep",
    "report": "recursive_lightning.commands.report",
    "eval": "recursive_lightning.commands.eval",
    "probe": "recursive_lightning.commands.probe",
    "ui": "recursive_lightning.commands.ui",
}

USAGE = """usage: python -m recursive_lightning <command> [options]

commands:
  describe   parameters and forward FLOPs of a model (meta device, no weights allocated)
  train      train one config (Lightning + litdata + MLflow), resumable
  sweep      run an ablation sweep (Optuna study + MLflow parent/child runs); default ablations/default.yaml
  report     tables and plots of a sweep's results
  eval       perplexity and lm-eval downstream accuracy of a checkpoint
  probe      the papers' diagnostic probes of a checkpoint, as figures and JSON
  generate   continuation of a prompt by a checkpoint (greedy or sampled, cached decoding)
  ui         the MLflow UI of a run or sweep directory (moved or copied ones too), on 127.0.0.1

`python -m recursive_lightning <command> --help` for the options of each command.

--threads N (before or after the command): CPU threads of torch (and of the processes a command starts);
default: one for models narrower than d_model 512 and for any model while the other cores are busy
(OMP_NUM_THREADS, when set, is respected as well). See "CPU threads" in docs/training.md.

With no command at all, `python -m recursive_lightning` runs `sweep`: the full default sweep
(ablations/default.yaml, about 5 minutes on 2 CPU cores) into runs/sweeps/default under the current
directory; it says so before it starts."""


GLOBAL_OPTIONS = (
    "\nglobal options (any command, anywhere on the line):\n"
    "  --threads N           CPU threads for torch (default: chosen per command and model size; see "
    '"CPU threads" in docs/training.md)'
)


def _pop_threads(argv: list[str]) -> tuple[list[str], int | None]:
    """The global ``--threads N`` / ``--threads=N`` taken out of ``argv`` (anywhere in it)."""
    out, threads, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--threads" or a.startswith("--threads="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 1 if "=" in a else 2
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"--threads must be a whole number of CPU threads >= 1, not {value!r}.")
            threads = int(value)
            if threads > thread_policy.cores():  # thousands of OpenMP threads crash torch before any work
                raise UserError(
                    f"--threads {threads} is more than the {thread_policy.cores()} CPU core(s) this process may "
                    f"run on; pass --threads {thread_policy.cores()} or fewer."
                )
            continue
        out.append(a)
        i += 1
    return out, threads


# the commands with a SIGTERM handler of their own (a resumable run, a sweep's parent run and workers, a server)
HANDLE_SIGTERM = frozenset({"train", "sweep", "ui"})


def _stopped_by_sigterm(command: str, signum: int, frame: FrameType | None) -> None:
    """SIGTERM (a scheduler's pre-emption) of a command that writes only finished results: one line, exit 143."""
    if interrupts.defer_in_hook(signum, frame):
        return
    raise Terminated(f"{command}: stopped by SIGTERM before it finished; run the same command again.")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # text the terminal cannot encode (a prompt on an ASCII terminal): printed escaped, not a crash
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    try:
        argv, threads = _pop_threads(argv)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not argv or argv[0] in ("-h", "--help"):
        if not argv:
            # the package's main job: the embedded default sweep
            print(
                "no command given: running `sweep`, the default ablation sweep (ablations/default.yaml) into "
                "runs/sweeps/default; `--help` lists the commands.",
                file=sys.stderr,
                flush=True,
            )
            argv = ["sweep"]
        else:
            print(USAGE)
            return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command '{command}'; choose one of: {', '.join(COMMANDS)}.", file=sys.stderr)
        return 2
    os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")
    previous = signal.getsignal(signal.SIGTERM) or signal.SIG_DFL  # None: a handler set outside Python
    handle = command not in HANDLE_SIGTERM and threading.current_thread() is threading.main_thread()
    unraisable = sys.unraisablehook
    sys.unraisablehook = functools.partial(interrupts.unraisable_hook, unraisable)
    try:
        if handle:
            signal.signal(signal.SIGTERM, functools.partial(_stopped_by_sigterm, command))
        faults.point("command_started")  # tests: a pre-emption while the command starts
        with thread_policy.for_command(threads):
            return int(importlib.import_module(COMMANDS[command]).main(rest) or 0)
    except UserError as e:
        print(f"error: {mask_url(str(e))}", file=sys.stderr)  # a database URL in it: its password masked
        return 2
    except Terminated as e:  # SIGTERM (pre-emption): resumable, and not a finished run
        print(str(e), file=sys.stderr)
        return e.EXIT_CODE
    except KeyboardInterrupt as e:  # its sentence, where the command gave one (train: how to resume)
        print(str(e) or "interrupted", file=sys.stderr)
        return getattr(e, "EXIT_CODE", 130)  # 143: SIGTERM, turned into a stop like Ctrl-C (sweep)
    except SystemExit as e:  # after Terminated, which is one
        if e.code == 0 and {"-h", "--help"} & set(rest):  # the command's own help: the global option too
            print(GLOBAL_OPTIONS)
        raise
    finally:
        sys.unraisablehook = unraisable
        if handle:
            signal.signal(signal.SIGTERM, previous)  # a caller's own (main() called in-process)


if __name__ == "__main__":
    raise SystemExit(main())
