"""`marlhf-edu` command line: one sub-command per pipeline stage."""

from __future__ import annotations

import argparse
import sys

import marlhf_edu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="marlhf-edu", description=__doc__)
    parser.add_argument("--version", action="version", version=f"marlhf-edu {marlhf_edu.__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
