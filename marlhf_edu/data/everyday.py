"""Everyday prompts for the sentiment experiment, shipped inside the package.

    everyday_prompts.jsonl   340 neutral everyday questions written for this book (Apache-2.0, as the project;
                             `assets/data/everyday-prompts/README.md`), one JSON object a line:
                             {"prompt": str, "topic": str, "split": "train" | "held_out"}.

The questions ask how to do an everyday task (boil an egg, renew a library book) and ask for a one- or
two-sentence answer; none asks for an opinion, a feeling, praise or a complaint, so the sentiment of an answer is
the model's, not the prompt's. The split is by topic: 14 topics train, 6 other topics are held out, so a
held-out question is on a subject no training prompt touched.

Taught in chapter 13.
"""

from __future__ import annotations

import json
import pathlib

from marlhf_edu.errors import DataFileError
from marlhf_edu.loading.assets import ASSETS

EVERYDAY_PROMPTS = ASSETS / "data" / "everyday-prompts" / "everyday_prompts.jsonl"
PROMPT_SPLITS = ("train", "held_out")


def everyday_rows(path: pathlib.Path | str = EVERYDAY_PROMPTS) -> list[dict]:
    """Every row of the prompt file, `{"prompt", "topic", "split"}`, in file order (blank lines skipped).

    Raises `DataFileError` naming the file and the 1-based line of the first bad row: not a JSON object, a
    `prompt` or `topic` that is not a non-empty string, a `split` not in `PROMPT_SPLITS`, or a topic that
    already appeared under the other split (a held-out topic must never be trained on).
    """
    path = pathlib.Path(path)
    rows, split_of_topic = [], {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            row = json.loads(line)
        except ValueError as err:
            raise DataFileError(f"{where}: not JSON ({err})") from None
        if not isinstance(row, dict):
            raise DataFileError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
        for key in ("prompt", "topic"):
            if not isinstance(row.get(key), str) or not row[key].strip():
                raise DataFileError(f"{where}: {key!r} must be a non-empty string, got {row.get(key)!r}")
        if row.get("split") not in PROMPT_SPLITS:
            raise DataFileError(f"{where}: 'split' must be one of {', '.join(PROMPT_SPLITS)}, got {row.get('split')!r}")
        first = split_of_topic.setdefault(row["topic"], row["split"])
        if first != row["split"]:
            raise DataFileError(f"{where}: topic {row['topic']!r} is {row['split']!r} here but {first!r} on an "
                                "earlier line; a topic belongs to one split")
        rows.append({"prompt": row["prompt"], "topic": row["topic"], "split": row["split"]})
    if not rows:
        raise DataFileError(f"{path}: no rows")
    return rows


def everyday_prompts(split: str = "train", path: pathlib.Path | str = EVERYDAY_PROMPTS) -> list[str]:
    """The questions of one split, `"train"` (238) or `"held_out"` (102), in file order, as plain text (render
    each with a chat template before sampling: `template_for(tokenizer).dialogue([(q, None)])`)."""
    if split not in PROMPT_SPLITS:
        raise ValueError(f"everyday_prompts: split must be one of {', '.join(PROMPT_SPLITS)}, got {split!r}")
    return [row["prompt"] for row in everyday_rows(path) if row["split"] == split]
