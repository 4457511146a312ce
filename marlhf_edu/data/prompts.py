"""The prompts a PPO or GRPO run trains on (`load_prompts`): the toy world's questions, or a dataset's prompts
rendered with the policy's template, with a share of the book's harmless questions mixed in when asked. Taught in chapter 09 (toy) and chapter 13 (real data)."""

from __future__ import annotations

from marlhf_edu.data.formats import hh_rlhf_to_preference, read_rows
from marlhf_edu.data.keyword_pairs import helpful_prompts
from marlhf_edu.data.template import template_for
from marlhf_edu.data.toyworld import ToyWorld, ToyWorldConfig
from marlhf_edu.errors import BadRowError, ConfigError


def load_prompts(config, tokenizer=None) -> list[str]:
    """Rendered prompts: the toy world's training prompts, or a dataset's.

    `dataset_format: prompt` reads a `prompt` column (rendered when `apply_template`); `hh-rlhf` takes the
    dialogue before the last assistant turn, rendered, each distinct prompt once. The template is the
    tokenizer's chat template when it has one (a real model), else the book's. With `drop_long_prompts`,
    prompts over `max_prompt_length` tokens are dropped and counted; `max_prompts` keeps the first N. Then
    `helpful_prompt_share` appends the book's harmless questions (`keyword_pairs.helpful_prompts`) so that they
    make up that share of the whole; the trainer's per-epoch permutation mixes them in (chapter 13).
    """
    if config.dataset_name == "toy":
        return [p.prompt for p in ToyWorld(ToyWorldConfig(seed=config.toy_seed)).train_prompts]

    # GRPO's script arguments share these names; settings a stage does not have are off
    drop_long = getattr(config, "drop_long_prompts", False)
    max_prompts = getattr(config, "max_prompts", 0)
    share = getattr(config, "helpful_prompt_share", 0.0)
    if drop_long and tokenizer is None:
        raise ConfigError("drop_long_prompts needs the tokenizer to count prompt tokens: load_prompts(config, tokenizer)")
    template = template_for(tokenizer)
    prompts, skipped = [], []
    for i, row in enumerate(read_rows(config.dataset_name, config.dataset_split)):
        if config.dataset_format == "hh-rlhf":
            try:
                prompts.append(hh_rlhf_to_preference(row, i, template=template)["prompt"])
            except BadRowError as err:
                if not config.skip_bad_rows:
                    raise err.refused_in(config.dataset_name) from None
                skipped.append(err)
            continue
        text = row.get("prompt") if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise ConfigError(f"{config.dataset_name}: row {i}, field 'prompt': missing or empty")
        prompts.append(template.dialogue([(text, None)]) if config.apply_template else text)
    if skipped:
        print(f"prompts: skipped {len(skipped)} bad row(s) (first: {skipped[0]})")
    if config.dataset_format == "hh-rlhf":
        prompts = list(dict.fromkeys(prompts))
    total = len(prompts)
    if drop_long:
        prompts = [p for p, ids in zip(prompts, tokenizer(prompts)["input_ids"]) if len(ids) <= config.max_prompt_length]
    if max_prompts:
        prompts = prompts[:max_prompts]
    if len(prompts) < total:
        print(f"prompts: using {len(prompts)} of {total} (drop_long_prompts={drop_long} at "
              f"{config.max_prompt_length} tokens, max_prompts={max_prompts or 'off'})")
    if share:
        extra = helpful_prompts(template, round(len(prompts) * share / (1 - share)))
        print(f"prompts: added {len(extra)} of the book's harmless questions ({len(set(extra))} distinct) to the "
              f"{len(prompts)} from {config.dataset_name}: {len(extra) / (len(prompts) + len(extra)):.1%} of the whole")
        prompts = prompts + extra
    return prompts
