"""Supervised fine-tuning with trl's `SFTTrainer` and completion-only loss (`run_sft`; the command is
`marlhf-edu sft`, `marlhf_edu.stages.sft`).

`model_name_or_path: tiny-llama` starts the toy world's tiny Llama from random
weights (it has no pretraining); any other value is loaded with
`from_pretrained`. `load_in_4bit` and `use_peft` (trl's `ModelConfig`) turn the
same stage into QLoRA: a config switch, not another code path.

Taught in chapter 07.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from marlhf_edu.data.formats import load_sft
from marlhf_edu.loading.assets import TOKENIZER_DIR
from marlhf_edu.loading.models import tiny_llama
from marlhf_edu.loading.quantization import keep_nf4_trainable, keep_trainable_dtype
from marlhf_edu.loading.sources import align_pad, load_tokenizer, record_base, resolve_model
from marlhf_edu.training.args import DataArguments
from marlhf_edu.training.policy import quantization_and_device_map, torch_dtype
from marlhf_edu.training.rows import check_lengths, load_sft_data, select_rows, with_file_rows
from marlhf_edu.training.runs import check_output_dir, resume_checkpoint


@dataclass
class SFTScriptArguments(DataArguments):
    dataset_format: str = field(default="prompt-completion", metadata={"help": "'alpaca', 'hh-rlhf', 'pku-saferlhf' or 'prompt-completion'"})
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "defaults to the model's, or the toy tokenizer"})
    extra_rows_file: str = field(default="", metadata={"help": "a local .jsonl of rows in prompt-completion form "
                                                              "(chat-rendered prompts) added after the dataset's "
                                                              "rows (after max_rows), e.g. refusal demonstrations "
                                                              "(tools/experiments/smollm2_refusal_sft/"
                                                              "refusal_demos_smollm2.py); "
                                                              "empty = none"})


def with_extra_rows(dataset, tokenizer, script_args):
    """`dataset` followed by the rows of `extra_rows_file` that fit in `max_tokens` (a bad row is an error naming
    the file, the row and the key).

    Used by chapter 13's refusal experiment (the SFT variants of site/smollm2_run_log.md)."""
    return with_file_rows(dataset, tokenizer, script_args, "extra_rows_file", "file row",
                          lambda path: load_sft(path, "prompt-completion", tokenizer=tokenizer))


def run_sft(script_args: SFTScriptArguments, training_args, model_args, dataset=None):
    """Train and save; returns the trl `SFTTrainer` (its `.model` is the trained model)."""
    import tempfile

    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer, get_peft_config

    import torch

    check_output_dir("sft", script_args, training_args)  # before anything loads
    name = model_args.model_name_or_path
    # pad ≠ EOS, or the model never learns to stop: load_tokenizer picks a distinct pad when the model has none
    tokenizer = load_tokenizer(script_args.tokenizer_name_or_path or (TOKENIZER_DIR if name == "tiny-llama" else name))
    if dataset is None:
        dataset = select_rows(load_sft_data(script_args, tokenizer), tokenizer, script_args, "SFT")
    if script_args.extra_rows_file:
        dataset = with_extra_rows(dataset, tokenizer, script_args)
    check_lengths(dataset, tokenizer, training_args.max_length)  # trl would cut a longer row, EOS and all
    load_kwargs = {**quantization_and_device_map(model_args)}
    if name == "tiny-llama":
        model = tiny_llama(tokenizer, seed=training_args.seed)
        if load_kwargs:  # quantization happens at load time: save the fresh weights, load them back in 4-bit
            tmp = tempfile.mkdtemp(prefix="tiny-llama-init-")
            model.save_pretrained(tmp)
            model = AutoModelForCausalLM.from_pretrained(tmp, **load_kwargs)
    else:
        dtype = torch_dtype(model_args)
        model = AutoModelForCausalLM.from_pretrained(resolve_model(name), **load_kwargs,
                                                     **({"dtype": dtype} if dtype else {}))
    align_pad(model, tokenizer)
    keep_nf4_trainable(model)  # a 4-bit base must stay trainable after trl's no-grad evaluations (chapter 10)
    trainer = SFTTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=get_peft_config(model_args))
    # trl casts QLoRA's trainable weights to bf16: adapters and heads go back to fp32 (see keep_trainable_dtype); a
    # whole model trained in bf16 (no LoRA) is left in the dtype asked for
    if model_args.use_peft or torch_dtype(model_args) is torch.float32:
        keep_trainable_dtype(trainer.model)
    # `--resume_from_checkpoint true`: the newest complete checkpoint-N (transformers read "true" as a folder)
    trainer.train(resume_from_checkpoint=resume_checkpoint("sft", training_args, log=print))  # `pipeline` resumes
    trainer.save_model(training_args.output_dir)  # rank 0 writes (trl); so do we, and every rank waits for it
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(training_args.output_dir)
        if name != "tiny-llama":
            record_base(training_args.output_dir, name)
    trainer.accelerator.wait_for_everyone()
    return trainer
