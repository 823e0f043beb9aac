"""Errors that map to the exit codes users rely on (docs/architecture.md, "Contracts").

Raised anywhere, caught once at the top of each command, printed as a single line,
never as a traceback.
"""

from __future__ import annotations

from train.core.storage.credentials import redacted

EXIT_OK = 0
EXIT_TRAINING_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_CANNOT_RUN_HERE = 3
EXIT_DIVERGED = 4
EXIT_STORE_LOST = 5
EXIT_RUN_DIR_BUSY = 6
EXIT_ONLY_LOCAL = 7
EXIT_STOPPED_BY_SIGNAL = 143
# Between a worker and its launcher only: this rank stopped (with the checkpoint) because
# the workers of another node were told to stop. torchrun restarts it without counting
# a failure, to train on without that node; the launcher says 143 if the job ends here.
EXIT_PEER_STOPPED = 144
# Every exit code a user can see, in a few words (``--help`` prints them; the README's
# "Exit codes" table says more and is checked against this one).
EXIT_MEANINGS = {
    EXIT_OK: "done",
    EXIT_TRAINING_FAILED: "training failed",
    EXIT_BAD_INPUT: "bad input (config, command line, environment)",
    EXIT_CANNOT_RUN_HERE: "valid input this machine/image cannot run",
    EXIT_DIVERGED: "training diverged (a non-finite loss, gradient or weight)",
    EXIT_STORE_LOST: "the multi-node rendezvous store was lost",
    EXIT_RUN_DIR_BUSY: "the run directory is in use by another job",
    EXIT_ONLY_LOCAL: "finished, but the final checkpoint did not reach checkpoint.remote in "
                     "time (rerun on the same run directory to upload it)",
    EXIT_STOPPED_BY_SIGNAL: "stopped by a signal after checkpointing (rerun the same "
                            "command to resume)",
}
EXIT_CODES = tuple(EXIT_MEANINGS)
# Exit codes a retry cannot change: launchers and Kubernetes should not restart on them.
# The rule that reads them is train.core.run.protocol.restart_can_help.
FINAL_EXIT_CODES = (EXIT_BAD_INPUT, EXIT_CANNOT_RUN_HERE, EXIT_DIVERGED)
# The key of a ConfigError about a config file as a whole, not one of its keys.
WHOLE_FILE = "<file>"


def printable(text: str) -> str:
    """``text`` safe to print to a terminal: control and format characters (ESC, CR,
    bidirectional overrides; from a config key or value, an environment variable) are
    shown escaped (``\\x1b``) instead of acting on the terminal or forging a log line,
    and credentials in it hidden (:func:`~train.core.storage.credentials.redacted`: a URL's
    ``user:token@`` is shown as ``***@``)."""
    return redacted("".join(c if c.isprintable() or c == " " else
                            (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
                            for c in text))


class UserError(Exception):
    """An error the user can fix; carries its exit code and a one-line message."""

    exit_code = EXIT_BAD_INPUT

    def one_line(self) -> str:
        return "error: " + printable(" ".join(str(self).split()))


class ConfigError(UserError):
    """Invalid config, CLI or data on any machine: exit 2.

    The message reads ``<file>: <dotted.key>: <what is wrong; what is allowed>``, or
    ``<file>: <what is wrong>`` when the problem is the file as a whole (``key`` is
    :data:`WHOLE_FILE`: missing, unreadable, too large, not YAML).
    """

    def __init__(self, source: str, key: str, problem: str):
        self.source, self.key, self.problem = source, key, problem
        super().__init__(f"{source}: {problem}" if key == WHOLE_FILE else
                         f"{source}: {key}: {problem}")


class ConfigErrors(ConfigError):
    """Several problems of one config, found together: each is printed on its own line
    (``error: <file>: <dotted.key>: ...``), exit 2. ``source``, ``key`` and ``problem``
    are the first one's; :func:`raise_all` raises a lone problem as itself."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = list(errors)
        first = self.errors[0]
        super().__init__(first.source, first.key, first.problem)

    def one_line(self) -> str:
        """One line per problem (so not one line, unless there is one problem)."""
        return "\n".join(e.one_line() for e in self.errors)

    def __str__(self) -> str:
        return "\n".join(str(e) for e in self.errors)


def raise_all(errors: list[ConfigError]) -> None:
    """Nothing when ``errors`` is empty; the error itself when there is one; else all."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigErrors(errors)


class CannotRunHere(UserError):
    """Valid input that this machine or image cannot run: exit 3."""

    exit_code = EXIT_CANNOT_RUN_HERE


class UnfitNodes(CannotRunHere):
    """A check found nodes unfit to train on (the preflight check, with
    distributed.preflight: fail): exit 3, naming their hosts, which a scheduler that can
    requeue without them (SLURM) is told."""

    def __init__(self, message: str, hosts: tuple[str, ...]):
        super().__init__(message)
        self.hosts = hosts


class RunDirBusy(UserError):
    """Another job's live lease on the run directory, still after waiting: exit 6. A retry
    can succeed (the other job ends, or its lease expires)."""

    exit_code = EXIT_RUN_DIR_BUSY


class Diverged(UserError):
    """Training produced a non-finite loss, gradient or weight: exit 4. Nothing non-finite
    was saved; the message names the last good checkpoint and what to change."""

    exit_code = EXIT_DIVERGED


class BadData(UserError):
    """Data found unusable while training (a token id outside the vocabulary in an
    object read only then): exit 2, one line naming the file.

    Raised in a DataLoader worker process, it reaches the rank re-raised by torch with the
    worker's whole traceback as its message; only the original line is kept."""

    def __init__(self, message: str):
        super().__init__(_original_line(message, type(self).__name__))


class DataChanged(BadData):
    """Data that changed under the run (an object replaced or deleted since the run listed
    it, or a resume onto data whose hash differs from the checkpoint's): exit 2, never a
    restart that trains on other data."""


def _original_line(message: str, name: str) -> str:
    """``message`` itself, or the last ``<name>: ...`` line of a traceback re-raised by
    a DataLoader ("Caught X in DataLoader worker process 0. Original Traceback ...")."""
    if "Original Traceback" not in message:
        return message
    lines = [line.split(f"{name}: ", 1)[1] for line in message.splitlines()
             if f"{name}: " in line]
    return lines[-1] if lines else message

