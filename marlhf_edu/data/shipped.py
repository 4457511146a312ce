"""Real preference data shipped inside the package, usable offline by name.

    hh-rlhf-harmless-base    Anthropic's hh-rlhf, harmless-base test split (Bai et al. 2022; MIT licence,
                             `assets/data/hh-rlhf/LICENSE`): 2,312 multi-turn dialogues, each a `chosen` and a
                             `rejected` transcript that differ only in the last assistant turn.
    everyday-prompts         340 neutral everyday questions written for this book (`marlhf_edu.data.everyday`),
                             one `prompt` column: the prompts of chapter 13's sentiment experiment.

`dataset_name: hh-rlhf-harmless-base` works wherever a config names a dataset;
`dataset_split` picks `train` (≈ 80 %), `test` (≈ 20 %) or `all`; for `everyday-prompts`, `train` (238),
`held_out` (102, on topics no training question touches) or `all`. The hh-rlhf split is
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

from marlhf_edu.data.everyday import everyday_rows
from marlhf_edu.errors import DataFileError
from marlhf_edu.loading.assets import ASSETS

SHIPPED_DATASETS = {"hh-rlhf-harmless-base": ASSETS / "data" / "hh-rlhf" / "harmless-base-test.jsonl.gz",
                    "everyday-prompts": ASSETS / "data" / "everyday-prompts" / "everyday_prompts.jsonl"}
SPLITS = ("train", "test", "all")
#: The splits of each shipped dataset (`dataset_split`).
DATASET_SPLITS = {"hh-rlhf-harmless-base": SPLITS, "everyday-prompts": ("train", "held_out", "all")}
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
    if split not in DATASET_SPLITS[name]:  # dataset_split / eval_split
        raise DataFileError(f"{name}: split must be one of {', '.join(DATASET_SPLITS[name])}, got {split!r}")
    if name == "everyday-prompts":
        return [r for r in everyday_rows(SHIPPED_DATASETS[name]) if split == "all" or r["split"] == split]
    with gzip.open(SHIPPED_DATASETS[name], "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if split == "all" or split_of(r.get("chosen", "")) == split]
