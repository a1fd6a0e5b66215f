"""User-facing errors: one clear sentence naming the field or file and what would fix it.

The CLI prints ``str(error)`` of these and exits with status 2 instead of a stack trace.
"""


class UserError(ValueError):
    """Base class of every error caused by the user's input."""


class ConfigError(UserError):
    """A configuration field has an unknown name, a bad value or a bad combination."""
