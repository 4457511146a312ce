"""The reward model, with trl's `RewardTrainer` and a SEQ_CLS LoRA (`run_rm`; the command is `marlhf-edu rm`,
`marlhf_edu.stages.reward`).

The reward model is `AutoModelForSequenceClassification(num_labels=1)` built
from the SFT model: its new scalar `score` head starts random, so it must be
trained in full (`lora_modules_to_save: [score]`) while LoRA adapts the
backbone. The loss is Bradley–Terry with the pair's margin (trl reads the
`margin` column). `load_in_4bit` makes it QLoRA with no other change.

Taught in chapter 08.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from marlhf_edu.data.formats import load_preferences
from marlhf_edu.data.keyword_judge import HELPFUL_ANSWERS
from marlhf_edu.data.keyword_pairs import evasion_pairs, refusal_pairs
from marlhf_edu.data.template import template_for
from marlhf_edu.data.toyworld import ToyWorld, ToyWorldConfig
from marlhf_edu.errors import BadRowError, ConfigError
from marlhf_edu.loading.quantization import keep_nf4_trainable, keep_trainable_dtype
from marlhf_edu.loading.sources import align_pad, load_tokenizer, record_base, resolve_model
from marlhf_edu.math.reward_probe import probe_score_head
from marlhf_edu.math.scoring import score_texts
from marlhf_edu.training.args import DataArguments
from marlhf_edu.training.policy import quantization_and_device_map, torch_dtype
from marlhf_edu.training.rows import append_rows, check_lengths, load_preference_data, select_rows, with_file_rows
from marlhf_edu.training.runs import check_output_dir, resume_checkpoint


@dataclass
class RMScriptArguments(DataArguments):
    dataset_format: str = field(default="pku-saferlhf", metadata={"help": "generic, hh-rlhf, pku-saferlhf or trl"})
    eval_pairs: int = field(default=400, metadata={"help": "held-out pairs scored after training (toy data: drawn "
                                                           "fresh; other data: the first N of eval_split)"})
    eval_split: str = field(default="", metadata={"help": "held-out split of a dataset, scored before and after "
                                                          "training, with a length-only baseline; empty = none"})
    score_head_init: str = field(default="random", metadata={"help": "'random' (the new head as transformers "
                                                                      "makes it) or 'probe': fit it first on the "
                                                                      "frozen backbone's features (LP-FT, "
                                                                      "marlhf_edu.math.reward_probe)"})
    refusal_pairs: int = field(default=0, metadata={"help": "add up to N pairs preferring a refusal (another pair's "
                                                            "preferred refusal) to a compliant rejected answer "
                                                            "(marlhf_edu.data.keyword_pairs.refusal_pairs, chapter 13)"})
    evasion_pairs: int = field(default=0, metadata={"help": "add up to N pairs ranking evasive non-answers below "
                                                            "real answers: refusals to harmful requests, right "
                                                            "answers to harmless questions "
                                                            "(marlhf_edu.data.keyword_pairs.evasion_pairs, chapter 13)"})
    eval_pairs_file: str = field(default="", metadata={"help": "a local .jsonl of held-out pairs in trl's format "
                                                              "(prompt, chosen, rejected), scored before and after "
                                                              "training like eval_split's (the first eval_pairs); "
                                                              "for pairs made from a model's own answers to "
                                                              "held-out prompts (chapter 13); empty = none"})
    extra_pairs_file: str = field(default="", metadata={"help": "a local .jsonl of pairs in trl's format (prompt, "
                                                               "chosen, rejected; chat-rendered prompts) added to the "
                                                               "training pairs, e.g. the policy's own answers "
                                                               "(tools/experiments/smollm2_reward/"
                                                               "policy_pairs_smollm2.py, chapter 13); empty = none"})


def length_baseline(tokenizer, pairs: list[dict]) -> dict:
    """The reward model that only counts tokens: how often the longer answer is the chosen one (ties count ½).

    A learned reward model that does not beat this (or 1 − this) has learned length, not preference."""
    longer = 0.0
    for p in pairs:
        n_chosen, n_rejected = (len(tokenizer(p[k], add_special_tokens=False)["input_ids"]) for k in ("chosen", "rejected"))
        longer += 1.0 if n_chosen > n_rejected else 0.5 if n_chosen == n_rejected else 0.0
    return {"longer_is_chosen": longer / len(pairs), "n": len(pairs)}


def evaluate_reward_model(model, tokenizer, pairs: list[dict], batch_size: int = 64) -> dict:
    """Pairwise accuracy and mean score gap (chosen − rejected), overall and per margin."""
    import torch

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


def with_refusal_pairs(dataset, tokenizer, script_args):
    """`dataset` followed by up to `refusal_pairs` pairs from `keyword_pairs.refusal_pairs` (those that fit in
    `max_tokens`), with what was added printed."""
    try:
        extra, pool = refusal_pairs(dataset.to_list(), script_args.refusal_pairs)
    except ValueError as err:  # no pair of this data prefers a refusal: a fact about the data, said as such
        raise ConfigError(f"{err} (set refusal_pairs: 0 for this data)") from None
    if not extra:
        raise ConfigError(f"refusal_pairs: no pair of {len(dataset)} has a compliant rejected answer to pair a "
                          "refusal with (set refusal_pairs: 0 for this data)")
    return append_rows(dataset, extra, tokenizer, script_args, "refusal pair",
                       f"refusals from {pool} preferred pairs")


def with_evasion_pairs(dataset, tokenizer, script_args, source=None):
    """`dataset` followed by up to `evasion_pairs` pairs from `keyword_pairs.evasion_pairs` over the pairs of
    `source` (default: `dataset`; pass the data before `with_refusal_pairs` so that only the annotators' own
    refusals are used), those that fit in `max_tokens`, with what was added printed."""
    source = dataset if source is None else source
    extra = evasion_pairs(source.to_list(), template_for(tokenizer), script_args.evasion_pairs)
    prompts = set(source["prompt"])
    harmful = sum(p["prompt"] in prompts for p in extra)
    return append_rows(dataset, extra, tokenizer, script_args, "evasion pair",
                       f"{harmful} refusal > evasion, {len(extra) - harmful} answers to "
                       f"{min(len(extra) - harmful, len(HELPFUL_ANSWERS))} harmless questions > evasion or refusal")


def with_file_pairs(dataset, tokenizer, script_args):
    """`dataset` followed by the pairs of `extra_pairs_file` that fit in `max_tokens` (a bad row is an error naming
    the file, the row and the key: these pairs were made on purpose, so `skip_bad_rows` does not apply to them)."""
    return with_file_rows(dataset, tokenizer, script_args, "extra_pairs_file", "file pair",
                          lambda path: load_preferences(path, "trl", tokenizer=tokenizer))


def run_rm(script_args: RMScriptArguments, training_args, model_args, dataset=None):
    """Train, save the adapter (with the score head), return `(trainer, metrics)`."""
    import json
    import os
    from dataclasses import replace

    from transformers import AutoModelForSequenceClassification
    from trl import RewardTrainer, get_peft_config

    import torch

    check_output_dir("rm", script_args, training_args)  # before anything loads
    if script_args.eval_pairs_file and script_args.eval_split:
        raise ConfigError(f"eval_split: {script_args.eval_split} and eval_pairs_file: {script_args.eval_pairs_file} "
                          "both name held-out pairs: give one")
    peft_config = get_peft_config(model_args)
    if script_args.score_head_init not in ("random", "probe"):
        raise ConfigError(f"score_head_init must be 'random' or 'probe', got {script_args.score_head_init!r}")
    if peft_config is not None:
        if str(peft_config.task_type) != "SEQ_CLS":
            raise ConfigError(f"lora_task_type must be SEQ_CLS for a reward model, got {peft_config.task_type}")
        if "score" not in (peft_config.modules_to_save or []):
            raise ConfigError("lora_modules_to_save must include 'score': the new head starts random and is trained in full")
    tokenizer = load_tokenizer(model_args.model_name_or_path)  # pad ≠ EOS (marlhf_edu.loading.sources)
    if dataset is None:
        dataset = select_rows(load_preference_data(script_args, tokenizer), tokenizer, script_args, "preference")
    original = dataset
    if script_args.refusal_pairs:
        dataset = with_refusal_pairs(dataset, tokenizer, script_args)
    if script_args.evasion_pairs:
        dataset = with_evasion_pairs(dataset, tokenizer, script_args, source=original)
    if script_args.extra_pairs_file:
        dataset = with_file_pairs(dataset, tokenizer, script_args)
    check_lengths(dataset, tokenizer, training_args.max_length)
    held_out = None
    eval_batch = training_args.per_device_eval_batch_size  # the held-out scoring's rows per forward
    if script_args.dataset_name != "toy" and script_args.eval_split:
        held_out = load_preference_data(script_args, tokenizer, split=script_args.eval_split)
        if script_args.max_tokens:
            held_out = select_rows(held_out, tokenizer, replace(script_args, max_rows=0), "held-out preference")
        held_out = held_out.select(range(min(script_args.eval_pairs or len(held_out), len(held_out)))).to_list()
    if script_args.eval_pairs_file:  # read before the model loads: a bad row names the file, the row and the key
        try:
            held_out = load_preferences(script_args.eval_pairs_file, "trl", tokenizer=tokenizer)
        except BadRowError as err:
            raise err.refused_in(f"eval_pairs_file {script_args.eval_pairs_file}",
                                 hint="fix the row: these rows are never skipped") from None
        held_out = held_out.to_list()[:script_args.eval_pairs or None]
        check_lengths(held_out, tokenizer, training_args.max_length)
    dtype = torch_dtype(model_args)
    model = AutoModelForSequenceClassification.from_pretrained(
        resolve_model(model_args.model_name_or_path), num_labels=1, **quantization_and_device_map(model_args),
        **({"dtype": dtype} if dtype else {}))
    align_pad(model, tokenizer)  # the score is read at the last non-pad token: pad must not be EOS
    keep_nf4_trainable(model)  # a 4-bit base must stay trainable after trl's no-grad evaluations (chapter 10)
    before = probe = probe_eval = None
    if held_out:  # the untrained score head on the same backbone: the chance-level reference
        model.eval()
        print(f"scoring {len(held_out)} held-out pairs with the untrained score head", flush=True)
        before = evaluate_reward_model(model, tokenizer, held_out, eval_batch)
    if script_args.score_head_init == "probe":  # before peft wraps the model, so `score`'s trained copy starts here
        print(f"fitting the score head on the frozen backbone's features of {len(dataset)} pairs", flush=True)
        probe = probe_score_head(model, tokenizer, dataset.to_list())
        print(f"score head probed on {len(dataset)} pairs: L2 {probe.l2:g} (cross-validated), "
              f"train accuracy {probe.train_accuracy:.3f}")
        if held_out:
            probe_eval = evaluate_reward_model(model, tokenizer, held_out, eval_batch)
    trainer = RewardTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer,
                            peft_config=peft_config)
    # trl casts QLoRA's trainable weights to bf16: adapters and heads go back to fp32 (see keep_trainable_dtype); a
    # whole model trained in bf16 (no LoRA) is left in the dtype asked for
    if model_args.use_peft or dtype is torch.float32:
        keep_trainable_dtype(trainer.model)
    # `--resume_from_checkpoint true`: the newest complete checkpoint-N (transformers read "true" as a folder)
    trainer.train(resume_from_checkpoint=resume_checkpoint("rm", training_args, log=print))  # `pipeline` resumes
    trainer.save_model(training_args.output_dir)  # rank 0 writes (trl); so do we, and every rank waits for it
    if trainer.is_world_process_zero():
        record_base(training_args.output_dir, model_args.model_name_or_path)
    trainer.accelerator.wait_for_everyone()
    if script_args.dataset_name == "toy" and script_args.eval_pairs:
        held_out = ToyWorld(ToyWorldConfig(seed=script_args.toy_seed)).eval_pairs(script_args.eval_pairs)
    metrics = {}
    if held_out:
        trainer.model.eval()
        metrics = evaluate_reward_model(trainer.model, tokenizer, held_out, eval_batch)
        if before is not None:
            metrics.update(untrained_head_accuracy=before["accuracy"],
                           length_baseline=length_baseline(tokenizer, held_out)["longer_is_chosen"])
        if probe_eval is not None:
            metrics.update(probe_accuracy=probe_eval["accuracy"], probe_l2=probe.l2,
                           probe_cv_accuracy={f"{k:g}": v for k, v in probe.cv_accuracy.items()})
        summary = {k: v for k, v in metrics.items() if not k.endswith("_scores")}
        if trainer.is_world_process_zero():
            with open(os.path.join(training_args.output_dir, "eval_metrics.json"), "w") as f:
                json.dump(summary, f, indent=2)
        print("held-out reward model metrics:", json.dumps(summary))
    return trainer, metrics
