"""Stage 1: supervised fine-tuning with trl's `SFTTrainer` and completion-only loss.

    marlhf-edu sft --config configs/tiny_sft.yaml [--key value ...]

`model_name_or_path: tiny-llama` starts the toy world's tiny Llama from random
weights (it has no pretraining); any other value is loaded with
`from_pretrained`. `load_in_4bit` and `use_peft` (trl's `ModelConfig`) turn the
same stage into QLoRA: a config switch, not another code path.

Taught in chapter 07.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from marlhf_edu.stages.common import DataArguments


@dataclass
class SFTScriptArguments(DataArguments):
    dataset_format: str = field(default="prompt-completion", metadata={"help": "'alpaca' or 'prompt-completion'"})
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "defaults to the model's, or the toy tokenizer"})


def load_sft_data(script_args):
    from marlhf_edu.data import load_sft

    if script_args.dataset_name == "toy":
        from marlhf_edu.toyworld import ToyWorld, ToyWorldConfig

        return load_sft(ToyWorld(ToyWorldConfig(seed=script_args.toy_seed)).sft_rows(), "prompt-completion")
    return load_sft(script_args.dataset_name, script_args.dataset_format, split=script_args.dataset_split,
                    skip_bad_rows=script_args.skip_bad_rows)


def run_sft(script_args: SFTScriptArguments, training_args, model_args, dataset=None):
    """Train and save; returns the trl `SFTTrainer` (its `.model` is the trained model)."""
    import tempfile

    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer, get_peft_config

    from marlhf_edu.models import TOKENIZER_DIR, load_tokenizer, tiny_llama
    from marlhf_edu.quantization import keep_nf4_trainable
    from marlhf_edu.stages.common import quantization_and_device_map, torch_dtype

    dataset = load_sft_data(script_args) if dataset is None else dataset
    name = model_args.model_name_or_path
    tokenizer = load_tokenizer(script_args.tokenizer_name_or_path or (TOKENIZER_DIR if name == "tiny-llama" else name))
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise ValueError("the tokenizer's pad token must exist and differ from EOS, or the model never learns to stop")
    load_kwargs = {**quantization_and_device_map(model_args)}
    if name == "tiny-llama":
        model = tiny_llama(tokenizer, seed=training_args.seed)
        if load_kwargs:  # quantization happens at load time: save the fresh weights, load them back in 4-bit
            tmp = tempfile.mkdtemp(prefix="tiny-llama-init-")
            model.save_pretrained(tmp)
            model = AutoModelForCausalLM.from_pretrained(tmp, **load_kwargs)
    else:
        dtype = torch_dtype(model_args)
        model = AutoModelForCausalLM.from_pretrained(name, **load_kwargs, **({"dtype": dtype} if dtype else {}))
    keep_nf4_trainable(model)  # a 4-bit base must stay trainable after trl's no-grad evaluations (chapter 10)
    trainer = SFTTrainer(model=model, args=training_args, train_dataset=dataset, processing_class=tokenizer,
                         peft_config=get_peft_config(model_args))
    trainer.train()
    trainer.save_model(training_args.output_dir)
    tokenizer.save_pretrained(training_args.output_dir)
    return trainer


def main(argv: list[str] | None = None):
    from trl import ModelConfig, SFTConfig

    from marlhf_edu.stages.common import parse_stage_args

    script_args, training_args, model_args = parse_stage_args((SFTScriptArguments, SFTConfig, ModelConfig), argv)
    return run_sft(script_args, training_args, model_args)
