"""Real preference data shipped inside the package, usable offline by name.

    hh-rlhf-harmless-base    Anthropic's hh-rlhf, harmless-base test split (Bai et al. 2022; MIT licence,
                             `assets/data/hh-rlhf/LICENSE`): 2,312 multi-turn dialogues, each a `chosen` and a
                             `rejected` transcript that differ only in the last assistant turn.

`dataset_name: hh-rlhf-harmless-base` works wherever a config names a dataset;
`dataset_split` picks `train` (≈ 80 %), `test` (≈ 20 %) or `all`. The split is
by the dialogue's first human request (a hash of its text), so a request and its
rephrasings in other rows never sit on both sides: held-out prompts are unseen.

Online, the same converters read the hub copy (`Anthropic/hh-rlhf`, `data_dir:
harmless-base`); PKU-SafeRLHF (CC-BY-NC-4.0) is not redistributed and is read
from the hub only.

Taught in chapter 13.
"""

from __future__ import annotations

import gzip
import hashlib
import json

from marlhf_edu.errors import DataFileError
from marlhf_edu.models import ASSETS

SHIPPED_DATASETS = {"hh-rlhf-harmless-base": ASSETS / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz"}
SPLITS = ("train", "test", "all")
#: One dialogue in `TEST_BUCKETS` of 100 goes to the test split.
TEST_BUCKETS = 20


def first_request(transcript: str) -> str:
    """The first human turn of an hh-rlhf transcript ("\\n\\nHuman: ... \\n\\nAssistant: ..."), stripped."""
    head = transcript.split("\n\nAssistant:", 1)[0]
    return head.replace("\n\nHuman:", "", 1).strip()


def split_of(transcript: str) -> str:
    """'test' for about one dialogue in five, decided by its first request alone (stable across machines)."""
    bucket = int(hashlib.sha256(first_request(transcript).lower().encode()).hexdigest(), 16) % 100
    return "test" if bucket < TEST_BUCKETS else "train"


def shipped_rows(name: str, split: str = "all") -> list[dict]:
    """The rows of a shipped dataset (`SHIPPED_DATASETS`) in its file order, restricted to `split`."""
    if name not in SHIPPED_DATASETS:
        raise DataFileError(f"no shipped dataset {name!r}; shipped: {', '.join(SHIPPED_DATASETS)}")
    if split not in SPLITS:  # dataset_split / eval_split
        raise DataFileError(f"{name}: split must be one of {', '.join(SPLITS)}, got {split!r}")
    with gzip.open(SHIPPED_DATASETS[name], "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if split == "all" or split_of(r.get("chosen", "")) == split]
