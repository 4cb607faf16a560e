"""Errors that reach the user as one line, never a traceback: exit code 2 for what the user must fix,
1 for a failure of the machines that a restart may not meet again."""

from __future__ import annotations

USAGE_EXIT_CODE = 2
FAILURE_EXIT_CODE = 1  # not 2: the end of a Slurm job step treats it as a crash, restarted or requeued


class UserError(Exception):
    """Bad input from the user: a config key, a missing file, an impossible layout.

    The CLI prints ``relaytrain: error: <message>`` and exits with code 2. The message must
    name what is wrong and how to fix it.
    """


class ConfigError(UserError):
    """A config file or override that cannot be accepted."""


class InfrastructureError(UserError):
    """A failure of the cluster, not of the user's input: a rank that never joined, a peer that reset the
    connection in the first all-reduce. One line like a UserError, but exit code 1, so that the end of a
    job step retries it as a crash (bounded by the crash budget and the rule against repeated errors)
    instead of failing the run as a config mistake."""

    exit_code = FAILURE_EXIT_CODE
