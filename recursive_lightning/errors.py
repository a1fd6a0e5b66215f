"""User-facing errors: one clear sentence naming the field or file and what would fix it.

The CLI prints ``str(error)`` of these and exits with status 2 instead of a stack trace.
"""

from __future__ import annotations

import argparse
from typing import NoReturn


class UserError(ValueError):
    """Base class of every error caused by the user's input."""


class ConfigError(UserError):
    """A configuration field has an unknown name, a bad value or a bad combination."""


class DiskFull(UserError):
    """A file could not be written: its file system has no space left."""

    def __init__(self, path: object) -> None:
        super().__init__(
            f"no space left on the device to write '{path}'; free space on its file system (or choose another "
            "folder), then run the command again."
        )


class Terminated(SystemExit):
    """A run stopped by SIGTERM (a scheduler's pre-emption) at a step boundary; it resumes with --resume.

    The exit status is 143 (128 + SIGTERM), distinct from a finished run (0) and from a user error (2)."""

    EXIT_CODE = 143

    def __init__(self, message: str) -> None:
        super().__init__(self.EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ArgumentParser(argparse.ArgumentParser):
    """The commands' argument parser: a command line it refuses (an unknown option, a value of the wrong type,
    a missing argument) is one sentence naming the option (a :class:`UserError`, exit status 2 through the
    CLI), as every other bad input is, instead of argparse's whole usage block."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{self.prog}: {message}; `python -m {self.prog} --help` lists the options.")
