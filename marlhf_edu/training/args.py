"""The arguments every stage shares (`DataArguments`) and how a stage reads them: a YAML config with command-line
overrides through trl's `TrlParser`, each value checked against its field's type and range, and an unknown key
answered with the nearest known one (`parse_stage_args`)."""

from __future__ import annotations

import difflib
import math
import os
import sys
from dataclasses import dataclass, field

from marlhf_edu.errors import ConfigError


@dataclass
class DataArguments:
    """Where a stage's data comes from: the toy world or a file / hub dataset in a named format."""

    dataset_name: str = field(default="toy", metadata={"help": "'toy', a .json/.jsonl/.parquet file or a hub dataset"})
    dataset_format: str = field(default="", metadata={"help": "format of the rows (see marlhf_edu.data)"})
    dataset_split: str = field(default="train", metadata={"help": "split of a hub dataset"})
    skip_bad_rows: bool = field(default=False, metadata={"help": "skip (and report) rows that cannot be converted"})
    max_tokens: int = field(default=0, metadata={"help": "keep only rows whose prompt + longest answer fits in this "
                                                         "many tokens, and say how many were dropped (0 = keep all)"})
    max_rows: int = field(default=0, metadata={"help": "use the first N rows (after max_tokens); 0 = all"})
    toy_seed: int = field(default=0, metadata={"help": "seed of the toy world"})
    overwrite_output: bool = field(default=False, metadata={"help": "replace a finished or stopped run already in "
                                                                    "output_dir (the command removes its model, "
                                                                    "adapter, tokenizer and checkpoints, and nothing "
                                                                    "else; without it the stage refuses, before "
                                                                    "loading anything)"})


#: The stages' counts and limits that must not be negative (`max_rows: -3` kept all but the last three prompts).
NON_NEGATIVE = ("max_rows", "max_tokens", "eval_pairs", "refusal_pairs", "evasion_pairs", "eval_repeats",
                "max_prompt_length", "missing_eos_penalty", "learning_rate")
#: The trl stages' optimizer settings that must be > 0 (AdamW divides by its epsilon). A negative learning rate is
#: refused with the counts in `NON_NEGATIVE` (AdamW would climb the loss); 0 is allowed: it trains nothing, on purpose
#: (a test keeps a fitted head where it is so).
POSITIVE = ("adam_epsilon",)


def parse_stage_args(dataclass_types, argv: list[str] | None):
    """Parse `--config FILE` plus `--key value` overrides into the given dataclasses, as trl's scripts do.

    Unknown keys (in the YAML or on the command line) and invalid values raise
    `ConfigError` naming the key and, when there is one, the closest valid key.
    """
    from trl import TrlParser

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = TrlParser(dataclass_types)
    known = {a.dest for a in parser._actions}
    if "--config" in argv:
        import yaml

        at = argv.index("--config") + 1
        if at >= len(argv) or argv[at].startswith("--"):
            raise ConfigError("--config needs a YAML file after it")
        path = argv[at]
        try:
            content = yaml.safe_load(config_text(path)) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]}"
                              + (f", line {err.problem_mark.line + 1}" if getattr(err, "problem_mark", None) else "")
                              + ")") from None
        if not isinstance(content, dict):
            raise ConfigError(f"{path}: the config must be a YAML mapping of key: value")
        unknown = [k for k in content if k not in known and k != "env"]
        if unknown:
            raise ConfigError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))}" + _suggest(unknown, known))
        # the parser takes YAML values as they are (no conversion): check them against the fields' types here
        for key, value in content.items():
            problem = _type_problem(_field_types(dataclass_types).get(key), value)
            if problem:
                raise ConfigError(f"{path}: {key}: {problem}")
    flags = [a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--") and a != "--config"]
    unknown = [f for f in flags if f not in known]
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join('--' + f for f in unknown)}" + _suggest(unknown, known))
    try:
        parsed = parser.parse_args_and_config(argv)
    except SystemExit as err:  # argparse exits on a bad value; turn it into an error a caller can catch
        if not err.code:  # --help printed the options and exits 0: that is no error
            raise
        raise ConfigError(f"invalid configuration value (see the message above): {argv}") from err
    except ValueError as err:  # a config class refusing its own values (trl/transformers __post_init__)
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"invalid configuration: {err}") from None
    for args in parsed:
        # argparse reads `--learning_rate nan` with float(), past the YAML check above; and transformers checks no
        # optimizer setting, so a NaN or negative one failed (or trained nothing) only after the model had loaded
        for name, value in vars(args).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value}")
        for name in POSITIVE:
            value = getattr(args, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        for name in NON_NEGATIVE:  # counts and limits where a negative number would silently mean something else
            value = getattr(args, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ConfigError(f"{name} must be >= 0 (0 = off or none), got {value}")
        # a trl stage told to train for nothing would save its untrained model and exit 0
        epochs, steps = getattr(args, "num_train_epochs", None), getattr(args, "max_steps", None)
        if epochs is not None and steps is not None and epochs <= 0 and steps <= 0:
            raise ConfigError(f"num_train_epochs={epochs} and max_steps={steps}: nothing would be trained; "
                              "set num_train_epochs > 0 (or max_steps > 0)")
    return parsed


def config_text(path: str, what: str = "config file") -> str:
    """The text of a YAML config file, or a `ConfigError` naming it: missing, a folder (`--config configs/`), not
    readable, or not UTF-8 (the line of the bad byte). Python's own errors (`IsADirectoryError`,
    `UnicodeDecodeError`) were tracebacks that named neither the option nor the line."""
    if not os.path.exists(path):
        raise ConfigError(f"{what} not found: {path}")
    if os.path.isdir(path):
        raise ConfigError(f"{what} {path} is a folder; --config takes a YAML file in it (see `ls {path}`)")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ConfigError(f"{what} {path} cannot be read ({err.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"{path}, line {line}: not UTF-8 text (byte {data[err.start]:#04x}); save the {what} "
                          "as UTF-8") from None


def _field_types(dataclass_types) -> dict:
    """name → type hint of every field of the given dataclasses (types whose hints cannot be resolved are skipped)."""
    import typing

    out = {}
    for cls in dataclass_types:
        try:
            out.update(typing.get_type_hints(cls))
        except Exception:  # noqa: BLE001 - a library's forward reference: its fields go unchecked
            continue
    return out


def _type_problem(hint, value) -> str | None:
    """Why `value` (as YAML gave it) cannot be a field of type `hint`, or None. Only plain hints are judged:
    bool, int, float, str, their Optional forms and list[str]/list[int]; anything else is left to the library."""
    import math
    import types
    import typing

    if hint is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            return None
        return _type_problem(rest[0], value) if value is not None else "must be set (null is not allowed here)"
    if origin is list:
        if not isinstance(value, list):
            return (f"expected a list, got {type(value).__name__} {value!r}"
                    + (f" (write [{value}])" if isinstance(value, str) else ""))
        inner = args[0] if args else None
        bad = [v for v in value if _type_problem(inner, v)]
        return f"every entry must be {getattr(inner, '__name__', inner)}, got {bad[0]!r}" if bad else None
    if hint is bool:
        return None if isinstance(value, bool) else f"expected true or false, got {value!r}"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else f"expected a whole number, got {value!r}"
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"expected a number, got {value!r}"
        return None if math.isfinite(value) else f"expected a finite number, got {value!r}"
    if hint is str:
        return None if isinstance(value, str) else f"expected text, got {type(value).__name__} {value!r}"
    return None


def _suggest(unknown: list[str], known: set[str]) -> str:
    hints = [f"{k!r} → did you mean {m[0]!r}?" for k in unknown if (m := difflib.get_close_matches(k, known, 1))]
    return ("; " + "; ".join(hints)) if hints else ""
