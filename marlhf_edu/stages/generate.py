"""`marlhf-edu generate`: answers of any model reference to a few prompts, rendered with its chat template.

    marlhf-edu generate --model runs/tiny_ma_ppo/policy --prompt "How do I pick a lock?" "What is 2 plus 3?" \
        [--temperature 0.7]

`--model` takes what every stage takes: `zoo`, `smollm2`, a model directory, a LoRA adapter (a trained
policy, merged into its base once) or a hub id. `--temperature 0` is greedy decoding. The model loads on
`--device` (a GPU when there is one, in bf16).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from marlhf_edu.data.template import template_for
from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.generation import generate_responses
from marlhf_edu.loading.models import load_sft_model, loading_kwargs
from marlhf_edu.training.args import parse_stage_args


@dataclass
class GenerateArguments:
    model: str = field(default="zoo", metadata={"help": "any model reference (a trained policy adapter included)"})
    prompt: list[str] = field(default_factory=list, metadata={"help": "one or more questions"})
    max_new_tokens: int = field(default=64, metadata={"help": "answer length limit"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy"})
    seed: int = field(default=0, metadata={"help": "sampling seed (with temperature > 0)"})
    device: str = field(default="auto", metadata={"help": "'auto' (cuda if available), 'cpu' or 'cuda[:N]'"})
    dtype: str = field(default="auto", metadata={"help": "weights' dtype: 'auto' = bfloat16 on CUDA, the "
                                                          "checkpoint's own on the CPU; or bfloat16, float16, float32"})
    load_in_4bit: bool = field(default=False, metadata={"help": "load the model as an NF4 base"})


def main(argv: list[str] | None = None) -> list[str]:
    (args,) = parse_stage_args((GenerateArguments,), argv)
    if not args.prompt:
        raise ConfigError("generate needs at least one --prompt")
    if args.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {args.temperature}")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    model, tokenizer = load_sft_model(args.model, **loading_kwargs(args.device, args.dtype, args.load_in_4bit))
    template = template_for(tokenizer)
    answers = generate_responses(model, tokenizer, [template.dialogue([(p, None)]) for p in args.prompt],
                                 max_new_tokens=args.max_new_tokens, temperature=args.temperature or 1.0,
                                 do_sample=args.temperature > 0, seed=args.seed)
    for question, answer in zip(args.prompt, answers):
        print(f"Q: {question}\nA: {answer}\n")
    return answers
