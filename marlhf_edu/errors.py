"""The errors a user's mistake raises, at the bottom of the package: every module may import them and this one
imports nothing of the package, so no module reaches upward (into `stages`) for an error class.

The command line (`marlhf_edu.cli`) prints each of them as one line naming the file, the row or the key, with
exit status 2, instead of a traceback. `stages.common.ConfigError` and `data.formats.DataFileError` /
`BadRowError` are these same classes, re-exported where they were first defined.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem reported before any work starts."""


class DataFileError(ValueError):
    """A data file that cannot be read as rows: missing, empty, or not JSON where it must be (file and line named)."""


class BadRowError(ValueError):
    """A row that cannot be converted; `row` is its 0-based index, `field` the offending key."""

    def __init__(self, row: int, field: str, reason: str):
        self.row, self.field, self.reason = row, field, reason
        super().__init__(f"row {row}, field {field!r}: {reason}")
