"""The error a user can fix: a config value, data file, mesh or launch setting that cannot run.

Raised with the offending value and what would be valid; `run.py` prints it as one line and exits 1.
Anything else that escapes is a bug of ours and keeps its traceback.
"""


class ConfigError(ValueError):
    """A config value that cannot run, with the key and the fix in the message."""


class MissingFileError(ConfigError, FileNotFoundError):
    """A file the config points to does not exist (catchable as either base)."""
