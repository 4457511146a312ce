"""Converters from public dataset schemas to trl's formats, and loaders.

Preference rows become `{"prompt", "chosen", "rejected"[, "margin"]}`, which
trl's `RewardTrainer` and `DPOTrainer` take directly; SFT rows become
`{"prompt", "completion"}` for `SFTTrainer` with completion-only loss. Every
prompt is rendered with one template (`marlhf_edu.data.template`): the book's
own, or the tokenizer's chat template when the loaders are given a tokenizer
that has one (a real instruction model, chapter 13).

Bad rows raise `BadRowError` naming the row and the field. With
`skip_bad_rows=True` they are skipped instead, and counted and listed in the
returned report and in a warning: nothing is dropped silently.

Taught in chapter 07.
"""

from __future__ import annotations

import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from marlhf_edu.data.shipped import SHIPPED_DATASETS, shipped_rows
from marlhf_edu.data.template import BookTemplate, DEFAULT_SYSTEM, template_for
from marlhf_edu.errors import BadRowError, DataFileError

#: Margins given to PKU-SafeRLHF pairs, by which rule chose the winner.
#: Safety decides (exactly one response safe): the gap must be large.
#: Helpfulness decides between two safe responses: a moderate gap.
#: Two unsafe responses: the safer one wins, with no gap asked for.
PKU_MARGINS = {"one_safe": 3.0, "both_safe": 1.0, "both_unsafe": 0.0}



@dataclass
class LoadReport:
    """What a loader kept and what it skipped (and why)."""

    total: int = 0
    kept: int = 0
    skipped: list[BadRowError] = field(default_factory=list)

    def summary(self) -> str:
        if not self.skipped:
            return f"kept all {self.total} rows"
        reasons = Counter(f"{e.field}: {e.reason}" for e in self.skipped)
        listed = "; ".join(f"{n} × {r}" for r, n in reasons.most_common())
        return f"kept {self.kept} of {self.total} rows, skipped {len(self.skipped)} ({listed})"





def _text(row: dict, i: int, key: str, allow_empty: bool = False) -> str:
    if key not in row:
        raise BadRowError(i, key, "missing key")
    value = row[key]
    if not isinstance(value, str):
        raise BadRowError(i, key, f"expected a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise BadRowError(i, key, "empty text")
    return value


def _flag(row: dict, i: int, key: str) -> bool:
    if key not in row:
        raise BadRowError(i, key, "missing key")
    if not isinstance(row[key], bool):
        raise BadRowError(i, key, f"expected true/false, got {row[key]!r}")
    return row[key]


def _response_id(row: dict, i: int, key: str) -> int:
    if key not in row:
        raise BadRowError(i, key, "missing key")
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRowError(i, key, f"expected 0 or 1, got {value!r}")
    if value not in (0, 1):
        raise BadRowError(i, key, f"id out of range: {value} (must be 0 or 1)")
    return value


def _margin(row: dict, i: int) -> float | None:
    """The row's margin as a float, or None without one. NaN and ±inf are refused: JSON's `NaN` and `Infinity`
    reach here as floats (Python's json module reads them), and one such pair made every weight of the reward
    model NaN, with the stage exiting 0."""
    import math

    if row.get("margin") is None:
        return None
    value = row["margin"]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRowError(i, "margin", f"expected a number, got {value!r}")
    if not math.isfinite(value):
        raise BadRowError(i, "margin", f"expected a finite number, got {value!r}")
    return float(value)


def _pair(i: int, prompt: str, chosen: str, rejected: str, margin: float | None, rejected_field: str,
          template) -> dict:
    if chosen.strip() == rejected.strip():
        raise BadRowError(i, rejected_field, "identical to the chosen response")
    out = {"prompt": prompt, "chosen": template.completion(chosen), "rejected": template.completion(rejected)}
    if margin is not None:
        out["margin"] = margin
    return out





def generic_to_preference(row: dict, i: int = 0, system: str = DEFAULT_SYSTEM, template=None) -> dict:
    """`question`, `response_chosen`, `response_rejected` [, `margin`] → trl preference row."""
    template = template or BookTemplate(system)
    question = _text(row, i, "question")
    chosen, rejected = _text(row, i, "response_chosen"), _text(row, i, "response_rejected")
    return _pair(i, template.dialogue([(question, None)]), chosen, rejected, _margin(row, i), "response_rejected",
                 template)


_TURN = re.compile(r"\n\n(Human|Assistant):")


def _parse_transcript(text: str, i: int, key: str) -> list[tuple[str, str]]:
    if not text.startswith("\n\nHuman:"):
        raise BadRowError(i, key, "transcript must start with '\\n\\nHuman:'")
    marks = list(_TURN.finditer(text))
    turns = []
    for k, m in enumerate(marks):
        end = marks[k + 1].start() if k + 1 < len(marks) else len(text)
        turns.append((m.group(1), text[m.end():end].strip()))
    for k, (role, _) in enumerate(turns):
        if role != ("Human" if k % 2 == 0 else "Assistant"):
            raise BadRowError(i, key, f"turn {k} should be {'Human' if k % 2 == 0 else 'Assistant'}, got {role}")
    if turns[-1][0] != "Assistant":
        raise BadRowError(i, key, "transcript must end with an Assistant turn")
    return turns


def _hh_history(turns: list[tuple[str, str]]) -> list[tuple[str, str | None]]:
    """Alternating (Human, Assistant) turns before the last assistant turn → (question, answer) pairs, last open."""
    history = turns[:-1]
    return [(history[k][1], history[k + 1][1] if k + 1 < len(history) else None) for k in range(0, len(history), 2)]


def hh_rlhf_to_preference(row: dict, i: int = 0, system: str = DEFAULT_SYSTEM, template=None) -> dict:
    """Anthropic hh-rlhf `chosen`/`rejected` transcripts → trl preference row.

    The prompt is the dialogue both transcripts share up to the last assistant
    turn, rendered with the template (earlier turns as Question/Answer pairs);
    chosen and rejected are the two last assistant turns.
    """
    chosen_turns = _parse_transcript(_text(row, i, "chosen"), i, "chosen")
    rejected_turns = _parse_transcript(_text(row, i, "rejected"), i, "rejected")
    if chosen_turns[:-1] != rejected_turns[:-1]:
        raise BadRowError(i, "rejected", "the dialogue before the last assistant turn differs from 'chosen'")
    chosen, rejected = chosen_turns[-1][1], rejected_turns[-1][1]
    if not chosen:
        raise BadRowError(i, "chosen", "empty text (last assistant turn)")
    if not rejected:
        raise BadRowError(i, "rejected", "empty text (last assistant turn)")
    template = template or BookTemplate(system)
    return _pair(i, template.dialogue(_hh_history(chosen_turns)), chosen, rejected, None, "rejected", template)


def pku_saferlhf_to_preference(row: dict, i: int = 0, system: str = DEFAULT_SYSTEM, template=None) -> dict:
    """PKU-SafeRLHF row → trl preference row, safety first.

    Exactly one response safe: it is chosen (margin `PKU_MARGINS["one_safe"]` = 3).
    Both safe: `better_response_id` decides (margin 1). Both unsafe:
    `safer_response_id` decides (margin 0).
    """
    template = template or BookTemplate(system)
    prompt = template.dialogue([(_text(row, i, "prompt"), None)])
    responses = [_text(row, i, "response_0"), _text(row, i, "response_1")]
    safe = [_flag(row, i, "is_response_0_safe"), _flag(row, i, "is_response_1_safe")]
    better, safer = _response_id(row, i, "better_response_id"), _response_id(row, i, "safer_response_id")
    if safe[0] != safe[1]:
        winner, case = (0 if safe[0] else 1), "one_safe"
    elif safe[0]:
        winner, case = better, "both_safe"
    else:
        winner, case = safer, "both_unsafe"
    return _pair(i, prompt, responses[winner], responses[1 - winner], PKU_MARGINS[case], f"response_{1 - winner}",
                 template)


def pku_saferlhf_to_sft(row: dict, i: int = 0, system: str = DEFAULT_SYSTEM, template=None) -> dict:
    """PKU-SafeRLHF row → `{"prompt", "completion"}`: the response `pku_saferlhf_to_preference` prefers, when it is
    safe. SFT imitates its target, and the safer of two unsafe answers is still unsafe: such rows are bad rows
    (`skip_bad_rows` counts and skips them). Used by the 7B recipe's SFT stage (configs/llama2_7b/sft.yaml)."""
    pair = pku_saferlhf_to_preference(row, i, system, template)
    if not (_flag(row, i, "is_response_0_safe") or _flag(row, i, "is_response_1_safe")):
        raise BadRowError(i, "is_response_0_safe", "neither response is safe: no answer to imitate")
    return {"prompt": pair["prompt"], "completion": pair["chosen"]}


def trl_preference(row: dict, i: int = 0, system: str = DEFAULT_SYSTEM, template=None) -> dict:
    """Rows already in trl's format (`prompt`, `chosen`, `rejected` [, `margin`]): validated, passed through."""
    out = {"prompt": _text(row, i, "prompt"), "chosen": _text(row, i, "chosen"), "rejected": _text(row, i, "rejected")}
    if out["chosen"].strip() == out["rejected"].strip():
        raise BadRowError(i, "rejected", "identical to the chosen response")
    margin = _margin(row, i)
    if margin is not None:
        out["margin"] = margin
    return out


def alpaca_to_sft(row: dict, i: int = 0, system: str = DEFAULT_SYSTEM, template=None) -> dict:
    """Alpaca `instruction`, `input`, `output` → `{"prompt", "completion"}`; a non-empty input follows the instruction."""
    template = template or BookTemplate(system)
    instruction = _text(row, i, "instruction")
    extra = _text(row, i, "input", allow_empty=True) if "input" in row and row["input"] is not None else ""
    question = instruction.strip() + (f"\n{extra.strip()}" if extra.strip() else "")
    return {"prompt": template.dialogue([(question, None)]), "completion": template.completion(_text(row, i, "output"))}


def hh_rlhf_to_sft(row: dict, i: int = 0, system: str = DEFAULT_SYSTEM, template=None) -> dict:
    """hh-rlhf row → `{"prompt", "completion"}`: the dialogue before the last assistant turn, and that turn of the
    `chosen` transcript (SFT on the preferred answers, as MA-RLHF's SFT stage does with its data)."""
    template = template or BookTemplate(system)
    turns = _parse_transcript(_text(row, i, "chosen"), i, "chosen")
    if not turns[-1][1]:
        raise BadRowError(i, "chosen", "empty text (last assistant turn)")
    return {"prompt": template.dialogue(_hh_history(turns)), "completion": template.completion(turns[-1][1])}


def trl_prompt_completion(row: dict, i: int = 0, system: str = DEFAULT_SYSTEM, template=None) -> dict:
    """Rows already in `{"prompt", "completion"}` form: validated, passed through."""
    return {"prompt": _text(row, i, "prompt"), "completion": _text(row, i, "completion")}


PREFERENCE_FORMATS: dict[str, Callable] = {
    "generic": generic_to_preference,
    "hh-rlhf": hh_rlhf_to_preference,
    "pku-saferlhf": pku_saferlhf_to_preference,
    "trl": trl_preference,
}
SFT_FORMATS: dict[str, Callable] = {"alpaca": alpaca_to_sft, "hh-rlhf": hh_rlhf_to_sft,
                                    "pku-saferlhf": pku_saferlhf_to_sft, "prompt-completion": trl_prompt_completion}





def read_rows(source: Any, split: str) -> Iterable[dict]:
    """Rows of a shipped dataset (`marlhf_edu.data.shipped`), a local JSON/JSONL/Parquet file, a hub dataset
    name, a `datasets.Dataset` or a list of dicts."""
    if isinstance(source, list):
        return source

    if isinstance(source, str) and source in SHIPPED_DATASETS:
        return shipped_rows(source, split)
    import datasets

    if isinstance(source, datasets.Dataset):
        return source
    path = str(source)
    if path.endswith((".jsonl", ".json")):
        return read_json_rows(path)
    if path.endswith(".parquet"):
        import os

        import pyarrow.parquet

        if not os.path.exists(path):
            raise DataFileError(f"no such data file: {path}")
        # read directly: datasets.load_dataset would write a cache under ~/.cache, failing where HOME is read-only
        try:
            return pyarrow.parquet.read_table(path).to_pylist()
        except Exception as error:  # pyarrow's own errors name neither the file nor what to do
            raise DataFileError(f"{path}: not a readable Parquet file ({error})") from None
    try:
        return datasets.load_dataset(path, split=split)
    except Exception as error:  # offline, unknown, private or without that split: datasets' own traceback
        raise DataFileError(  # names neither the key nor what else the name could have been
            f"dataset {path!r} (split {split!r}) could not be read: it is not a shipped dataset "
            f"({', '.join(sorted(SHIPPED_DATASETS))}), not a local .jsonl/.json/.parquet file, and the hub did not give "
            f"it here ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). Give a local "
            "file, or download the dataset where the hub is reachable") from None


def read_json_rows(path: str) -> list[dict]:
    """The rows of a local `.jsonl` (one JSON object per line) or `.json` (a list of objects) file, read here
    rather than through `datasets` (no cache directory needed). Errors name the file and the line or row:
    a missing file, an empty one, a line that is not JSON, a row that is not an object."""
    import json
    import pathlib

    file = pathlib.Path(path)
    if not file.is_file():
        raise DataFileError(f"no such data file: {path}")
    text = read_utf8(file)
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except ValueError as err:
            raise DataFileError(f"{path}: not valid JSON ({err})") from None
        where, numbers = "row", range(1, len(rows) + 1) if isinstance(rows, list) else []
    else:
        rows, where, numbers = [], "line", []
        for i, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except ValueError as err:
                raise DataFileError(f"{path}, line {i}: not a JSON object ({err.msg}); each line must hold one "
                                  "row") from None
            numbers.append(i)  # the file's own line number: blank lines are not rows, but they are lines
    if not rows:
        raise DataFileError(f"{path}: the file holds no rows")
    for i, row in zip(numbers, rows):
        if not isinstance(row, dict):
            raise DataFileError(f"{path}, {where} {i}: expected an object with named fields, got "
                              f"{type(row).__name__}")
    return rows


def read_utf8(path) -> str:
    """The text of `path`, which must be UTF-8. A bad byte is a `DataFileError` naming the file, the line and the
    byte's offset, where Python's `UnicodeDecodeError` named neither file nor line."""
    import pathlib

    data = pathlib.Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DataFileError(f"{path}, line {line}: not UTF-8 text (byte {data[err.start]:#04x} at offset "
                            f"{err.start}); save the file as UTF-8") from None


def _convert(source, fmt: str, table: dict, split: str, skip_bad_rows: bool, system: str | None, kind: str,
             tokenizer=None):
    if fmt not in table:
        raise DataFileError(f"{source}: unknown {kind} format {fmt!r} (dataset_format); choose one of {', '.join(table)}")
    convert = table[fmt]
    template = template_for(tokenizer, system)
    report, out = LoadReport(), []
    for i, row in enumerate(read_rows(source, split)):
        report.total += 1
        try:
            if not isinstance(row, dict):
                raise BadRowError(i, "<row>", f"expected a mapping, got {type(row).__name__}")
            out.append(convert(row, i, template=template))
        except BadRowError as err:
            if not skip_bad_rows:  # a file or dataset is named; rows handed over in Python are not
                raise (err.refused_in(source) if isinstance(source, (str, os.PathLike)) else err) from None
            report.skipped.append(err)
    report.kept = len(out)
    with_margin = [("margin" in r) for r in out]
    if any(with_margin) and not all(with_margin):
        first = with_margin.index(False)
        raise BadRowError(first, "margin", "some rows have a margin and this one has none",
                          source=str(source) if isinstance(source, (str, os.PathLike)) else "")
    if not out:
        raise DataFileError(f"no usable rows in {source!r}: {report.summary()}")
    if report.skipped:
        warnings.warn(f"{kind} data: {report.summary()}", stacklevel=3)
    import datasets

    return datasets.Dataset.from_list(out), report


def load_preferences(source, format: str = "generic", *, split: str = "train", skip_bad_rows: bool = False,
                     system: str | None = None, return_report: bool = False, tokenizer=None):
    """Load preference data into a `datasets.Dataset` of `prompt`, `chosen`, `rejected` [, `margin`].

    `source`: a .json/.jsonl/.parquet path, a hub dataset name (read through
    `datasets`, with `split`), a `datasets.Dataset` or a list of dicts.
    `format`: "generic", "hh-rlhf", "pku-saferlhf" or "trl". A bad row raises
    `BadRowError`; `skip_bad_rows=True` skips it and reports it. With
    `return_report=True` returns `(dataset, LoadReport)`. Prompts are rendered
    with `template_for(tokenizer, system)`: the tokenizer's chat template if it
    has one, else the book's template (system prompt `DEFAULT_SYSTEM` unless given).
    """
    ds, report = _convert(source, format, PREFERENCE_FORMATS, split, skip_bad_rows, system, "preference", tokenizer)
    return (ds, report) if return_report else ds


def load_sft(source, format: str = "alpaca", *, split: str = "train", skip_bad_rows: bool = False,
             system: str | None = None, return_report: bool = False, tokenizer=None):
    """Load SFT data into a `datasets.Dataset` of `prompt`, `completion` (formats: "alpaca", "hh-rlhf",
    "prompt-completion"); prompts rendered as in `load_preferences`."""
    ds, report = _convert(source, format, SFT_FORMATS, split, skip_bad_rows, system, "SFT", tokenizer)
    return (ds, report) if return_report else ds
