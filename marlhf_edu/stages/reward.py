"""Stage 2: the reward model, with trl's `RewardTrainer` and a SEQ_CLS LoRA.

    marlhf-edu rm --config configs/tiny_rm.yaml [--key value ...]

The reward model is `AutoModelForSequenceClassification(num_labels=1)` built
from the SFT model: its new scalar `score` head starts random, so it must be
trained in full (`lora_modules_to_save: [score]`) while LoRA adapts the
backbone. The loss is Bradley–Terry with the pair's margin (trl reads the
`margin` column). `load_in_4bit` makes it QLoRA with no other change.

Taught in chapter 08.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from marlhf_edu.stages.common import DataArguments


@dataclass
class RMScriptArguments(DataArguments):
    dataset_format: str = field(default="pku-saferlhf", metadata={"help": "generic, hh-rlhf, pku-saferlhf or trl"})
    eval_pairs: int = field(default=400, metadata={"help": "held-out toy pairs scored after training (toy data only)"})


def load_preference_data(script_args):
    from marlhf_edu.data import load_preferences

    if script_args.dataset_name == "toy":
        from marlhf_edu.toyworld import ToyWorld, ToyWorldConfig

        return ToyWorld(ToyWorldConfig(seed=script_args.toy_seed)).preference_dataset()
    return load_preferences(script_args.dataset_name, script_args.dataset_format, split=script_args.dataset_split,
                            skip_bad_rows=script_args.skip_bad_rows)


def check_lengths(dataset, tokenizer, max_length: int | None):
    """trl drops pairs longer than `max_length` without a word; we refuse to, and say which rows."""
    if max_length is None:
        return
    too_long = [i for i, row in enumerate(dataset)
                if max(len(tokenizer(row["prompt"] + row[k])["input_ids"]) for k in ("chosen", "rejected")) + 1 > max_length]
    if too_long:
        raise ValueError(f"{len(too_long)} preference pair(s) exceed max_length={max_length} tokens "
                         f"(first rows: {too_long[:5]}); raise max_length or filter them explicitly")


def evaluate_reward_model(model, tokenizer, pairs: list[dict], batch_size: int = 64) -> dict:
    """Pairwise accuracy and mean score gap (chosen − rejected), overall and per margin."""
    import torch

    from marlhf_edu.scoring import score_texts

    chosen = score_texts(model, tokenizer, [p["prompt"] + p["chosen"] for p in pairs], batch_size)
    rejected = score_texts(model, tokenizer, [p["prompt"] + p["rejected"] for p in pairs], batch_size)
    gap = chosen - rejected
    out = {"accuracy": float((gap > 0).float().mean()), "mean_gap": float(gap.mean()), "n": len(pairs)}
    if pairs and "margin" in pairs[0]:
        margins = torch.tensor([p["margin"] for p in pairs])
        for m in sorted(set(margins.tolist())):
            sel = margins == m
            out[f"mean_gap_margin_{m:g}"] = float(gap[sel].mean())
            out[f"accuracy_margin_{m:g}"] = float((gap[sel] > 0).float().mean())
    out["chosen_scores"], out["rejected_scores"] = chosen.tolist(), rejected.tolist()
    return out


def run_rm(script_args: RMScriptArguments, training_args, model_args, dataset=None):
    """Train, save the adapter (with the score head), return `(trainer, metrics)`."""
    import json
    import os

    from transformers import AutoModelForSequenceClassification
    from trl import RewardTrainer, get_peft_config

    from marlhf_edu.models import load_tokenizer
    from marlhf_edu.quantization import keep_nf4_trainable
    from marlhf_edu.stages.common import ConfigError, quantization_and_device_map

    peft_config = get_peft_config(model_args)
    if peft_config is not None:
        if str(peft_config.task_type) != "SEQ_CLS":
            raise ConfigError(f"lora_task_type must be SEQ_CLS for a reward model, got {peft_config.task_type}")
        if "score" not in (peft_config.modules_to_save or []):
            raise ConfigError("lora_modules_to_save must include 'score': the new head starts random and is trained in full")
    dataset = load_preference_data(script_args) if dataset is None else dataset
    tokenizer = load_tokenizer(model_args.model_name_or_path)
    check_lengths(dataset, tokenizer, training_args.max_length)
    model = AutoModelForSequenceClassification.from_pretrained(
        model_args.model_name_or_path, num_labels=1, **quantization_and_device_map(model_args))
    model.config.pad_token_id = tokenizer.pad_token_id
    keep_nf4_trainable(model)  # a 4-bit base must stay trainable after trl's no-grad evaluations (chapter 10)
    trainer = RewardTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer,
                            peft_config=peft_config)
    trainer.train()
    trainer.save_model(training_args.output_dir)
    metrics = {}
    if script_args.dataset_name == "toy" and script_args.eval_pairs:
        from marlhf_edu.toyworld import ToyWorld, ToyWorldConfig

        held_out = ToyWorld(ToyWorldConfig(seed=script_args.toy_seed)).eval_pairs(script_args.eval_pairs)
        trainer.model.eval()
        metrics = evaluate_reward_model(trainer.model, tokenizer, held_out)
        summary = {k: v for k, v in metrics.items() if not k.endswith("_scores")}
        with open(os.path.join(training_args.output_dir, "eval_metrics.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print("held-out reward model metrics:", json.dumps(summary))
    return trainer, metrics


def main(argv: list[str] | None = None):
    from trl import ModelConfig, RewardConfig

    from marlhf_edu.stages.common import parse_stage_args

    script_args, training_args, model_args = parse_stage_args((RMScriptArguments, RewardConfig, ModelConfig), argv)
    return run_rm(script_args, training_args, model_args)
