"""Where the shipped models live: the toy tokenizer, the tiny SFT model and its reward adapter (`zoo` in a
config) under `marlhf_edu/assets/`. Paths only; `marlhf_edu.loading.sources` resolves references to them."""

from __future__ import annotations

import pathlib


ASSETS = pathlib.Path(__file__).resolve().parent.parent / "assets"


TOKENIZER_DIR = ASSETS / "tokenizer"
SFT_DIR = ASSETS / "tiny_sft"
REWARD_ADAPTER_DIR = ASSETS / "tiny_reward_adapter"
