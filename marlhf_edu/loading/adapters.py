"""Checks of a reward adapter and of the tokenizers, made before any model loads.

A reward adapter must hold exactly one score head whose width fits the base it goes on (`check_reward_head`
reads only the safetensors header and the base's `config.json`), and it must be put on the base it was trained
on (`check_reward_adapter_base`). A policy and its reward model must share a vocabulary
(`check_same_vocabulary`), and the tokenizer's pad token must differ from EOS (`check_pad_token`).
`RewardAdapter.resolve` makes the first two checks once and returns what they found (the folder, the base, the
head's key), which the engines are given instead of the reference; `load_score_head` reads the head itself for
the multi-adapter engine.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import torch
from torch import nn

from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.sources import (HUB_PREFIX, adapter_base, local_path, readable_checkpoint,
                                        require_adapter_folder, resolve_zoo, same_model_path)


def check_pad_token(tokenizer):

    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ConfigError("the tokenizer's pad token must exist and differ from EOS: with pad = EOS the response mask "
                          "cannot tell the end of an answer from padding")


def check_same_vocabulary(tokenizer, reward_tokenizer, reward=None, policy=None) -> None:
    """Refuse a reward model that reads the policy's token ids as other tokens: its tokenizer must have the policy's
    vocabulary, and its embedding rows must cover every id the policy can emit. A scorer fed ids from another
    vocabulary returns numbers, not an error (`marlhf-edu evaluate` once scored toy ids with SmolLM2's reward
    model), so this runs before any model is asked anything."""

    if reward_tokenizer is not None and reward_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"the reward model's tokenizer ({len(reward_tokenizer)} tokens) differs from the policy's "
                          f"({len(tokenizer)}): its scores of the policy's token ids would be meaningless (train the "
                          "reward model on the policy's base, or pass the reward adapter that belongs to it)")
    if reward is not None and policy is not None:
        rows = reward.get_input_embeddings().num_embeddings
        ids = policy.get_output_embeddings().out_features
        if ids > rows:
            raise ConfigError(f"the policy can emit {ids} token ids but the reward model embeds only {rows}: "
                              "they do not share a vocabulary")


def _score_head_key(adapter_dir, keys, hidden_size: int | None, shape_of) -> str:
    """The one score-head weight among the adapter file's `keys`, checked to be (1, hidden_size)."""
    found = [k for k in keys if k.split(".")[-2] == "score" or ".score." in k]
    if len(found) != 1:
        raise ValueError(f"{adapter_dir}: expected one score-head weight in the adapter (modules_to_save: [score]), "
                         f"found {found}")
    shape = tuple(shape_of(found[0]))
    if hidden_size is not None and shape != (1, hidden_size):
        raise ValueError(f"{adapter_dir}: score head has shape {shape}, expected (1, {hidden_size})")
    return found[0]


def load_score_head(adapter_dir, hidden_size: int, key: str | None = None) -> nn.Linear:
    """The reward adapter's score head (hidden → 1), read from its safetensors file and frozen. Only that tensor is
    read: `key` names it (as `RewardAdapter.resolve` found it, checked), or it is found and checked here."""
    from safetensors import safe_open

    with safe_open(str(pathlib.Path(adapter_dir) / "adapter_model.safetensors"), framework="pt") as f:
        key = key or _score_head_key(adapter_dir, f.keys(), hidden_size, lambda k: f.get_slice(k).get_shape())
        weight = f.get_tensor(key)
    head = nn.Linear(hidden_size, 1, bias=False)
    with torch.no_grad():
        head.weight.copy_(weight)
    return head.requires_grad_(False)


def check_reward_adapter_base(adapter_dir, base_in_use) -> None:
    """Refuse a reward adapter on a base it was not trained on: the base its `adapter_config.json` records must be
    the one it is about to be put on. A LoRA and a score head on another base still return a number for every
    answer, so a run with the wrong base trains to the end on noise. Setting `reward_base_path` to the base in
    use says that the adapter belongs to it under another name (a folder moved since), and skips this check."""
    require_adapter_folder(adapter_dir, "reward_adapter_path")
    recorded = adapter_base(adapter_dir)
    if not same_model_path(recorded, base_in_use):
        raise ConfigError(f"the reward adapter {adapter_dir} was trained on {recorded!r} (its adapter_config.json) "
                          f"but would be put on {str(base_in_use)!r}: its scores would be noise. Use the reward model "
                          f"trained on this base, or, if it was trained on this very model under another name, set "
                          f"reward_base_path: {base_in_use}")


def check_reward_head(adapter_ref, base_ref=None, key: str = "reward_adapter_path") -> str | None:
    """Refuse, before anything loads, a reward adapter without exactly one score head, or whose score head does not
    fit the width of the base it will be put on (`base_ref`'s `config.json`, where it can be read here without
    building anything; by default the base the adapter records). Only the safetensors header is read. Without
    this, a causal-LM adapter given as the reward model, or one trained on a base of another width, is found only
    after the models are loaded. Returns the head's key in the file; a hub reference is checked when it loads
    (None)."""
    from safetensors import safe_open

    if str(adapter_ref).startswith(HUB_PREFIX):
        return None
    adapter_dir = local_path(adapter_ref)
    weights = adapter_dir / "adapter_model.safetensors"
    if not weights.is_file():
        raise ConfigError(f"{key}: {adapter_dir} has no adapter_model.safetensors (a reward adapter written by "
                          "`marlhf-edu rm` holds its LoRA and its score head there)")
    base_ref = adapter_base(adapter_dir) if base_ref is None else base_ref
    folder = readable_checkpoint(base_ref)
    config = folder / "config.json" if folder is not None else None
    hidden = json.loads(config.read_text()).get("hidden_size") if config is not None and config.is_file() else None
    with safe_open(str(weights), framework="pt") as f:
        try:
            return _score_head_key(adapter_dir, f.keys(), hidden, lambda k: f.get_slice(k).get_shape())
        except ValueError as err:
            raise ConfigError(f"{key}: {err}"
                              + (f" (the width of {base_ref})" if "shape" in str(err) else "")) from None


@dataclass(frozen=True)
class RewardAdapter:
    """A reward adapter reference, resolved and checked once, before anything loads, and then passed down.

    `folder` is the adapter's local folder (`zoo` read as the shipped reward adapter), `base` the model it is put
    on and `head_key` its score head's weight in `adapter_model.safetensors` (None for a hub reference, which is
    checked when it loads). `resolve` has checked that the folder is a LoRA adapter with exactly one score head
    that fits `base`'s width, and, unless the user named the base (`base_named`: a `reward_base_path` says the
    adapter belongs there, under whatever name it recorded), that `base` is the one its `adapter_config.json`
    records."""

    folder: pathlib.Path
    base: str
    head_key: str | None

    @classmethod
    def resolve(cls, ref, base=None, *, base_named: bool = False, key: str = "reward_adapter_path"
                ) -> "RewardAdapter":
        """`ref` as a config or command line gives it (`key` names it in errors), put on `base` (None: the base the
        adapter records, which it is then trained on by definition)."""
        ref = resolve_zoo(ref, "reward_adapter")
        require_adapter_folder(ref, key)
        if base is None:
            base, base_named = adapter_base(local_path(ref)), True
        base = resolve_zoo(base)
        head_key = check_reward_head(ref, base, key=key)
        if not base_named:
            check_reward_adapter_base(local_path(ref), base)
        return cls(local_path(ref), base, head_key)

    def score_head(self, hidden_size: int) -> nn.Linear:
        """The frozen score head (`load_score_head`), read by the key found when the adapter was checked."""
        return load_score_head(self.folder, hidden_size, self.head_key)
