"""Errors that reach the user as one line and exit code 2, never a traceback."""

from __future__ import annotations

USAGE_EXIT_CODE = 2


class UserError(Exception):
    """Bad input from the user: a config key, a missing file, an impossible layout.

    The CLI prints ``relaytrain: error: <message>`` and exits with code 2. The message must
    name what is wrong and how to fix it.
    """


class ConfigError(UserError):
    """A config file or override that cannot be accepted."""
