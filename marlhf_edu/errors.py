"""The errors a user's mistake raises, at the bottom of the package: every module may import them and this one
imports nothing of the package, so no module reaches upward (into `stages`) for an error class.

The command line (`marlhf_edu.cli`) prints each of them as one line naming the file, the row or the key, with
exit status 2, instead of a traceback. `marlhf_edu.data` re-exports `DataFileError` and
`BadRowError` with its loaders.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem reported before any work starts."""


class DataFileError(ValueError):
    """A data file that cannot be read as rows: missing, empty, or not JSON where it must be (file and line named)."""


class BadRowError(ValueError):
    """A row that cannot be converted; `row` is its 0-based index, `field` the offending key."""

    def __init__(self, row: int, field: str, reason: str, source: str = "", hint: str = ""):
        self.row, self.field, self.reason, self.source = row, field, reason, source
        super().__init__(f"{source + ': ' if source else ''}row {row}, field {field!r}: {reason}"
                         + (f"; {hint}" if hint else ""))

    def refused_in(self, source, hint: str = "skip_bad_rows: true skips such rows and counts them") -> "BadRowError":
        """The same error naming the file (or dataset) it came from and what to do about it."""
        return BadRowError(self.row, self.field, self.reason, source=str(source), hint=hint)
