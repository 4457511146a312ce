"""`marlhf-edu evaluate`: judge a trained policy (or any model) with a judge that is written down, and score its
answers with a reward model.

    marlhf-edu evaluate --model runs/llama2_7b/ma_ppo/policy --reward_adapter runs/llama2_7b/rm \
        [--judge keyword] [--prompts 64] [--repeats 4] [--output_dir runs/llama2_7b/eval]

`--model` takes every model reference the stages take (a trained policy adapter is merged into its base once).
The judge is the toy world's (`toy`, for the book's tiny models) or chapter 13's keyword judge (`keyword`: held-out
hh-rlhf red-team requests, refusal rate, and benign questions with known answers); `auto` picks `toy` for a model
with the book's toy tokenizer. Every answer is also scored by the reward adapter (its base is the one its
`adapter_config.json` records, unless `--reward_base` says otherwise). Prints the rates; with `--output_dir`,
writes `eval_metrics.json` and every answer to `eval_samples.jsonl`. Both models load on `--device` (a GPU
when there is one, in bf16: two 7B models took 27.8 GiB on an H100, benchmarks/gpu_check.json; `--load_in_4bit
true` keeps their weights in NF4, about 3.6 GiB each, planned). Taught in chapter 15.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from marlhf_edu.data.keyword_judge import KeywordJudge, NoRequestFits
from marlhf_edu.data.toyworld import ToyWorld
from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.adapters import RewardAdapter, check_same_vocabulary
from marlhf_edu.loading.assets import TOKENIZER_DIR
from marlhf_edu.loading.models import load_reward_model, load_sft_model, loading_kwargs
from marlhf_edu.loading.quiet import quiet_loading
from marlhf_edu.loading.sources import load_tokenizer
from marlhf_edu.ppo.backends import ScoredPolicy
from marlhf_edu.ppo.judging import judge_policy
from marlhf_edu.training.args import parse_stage_args

JUDGES = ("auto", "toy", "keyword")


@dataclass
class EvaluateArguments:
    model: str = field(default="zoo", metadata={"help": "any model reference (a trained policy adapter included)"})
    reward_adapter: str = field(default="zoo", metadata={"help": "reward LoRA adapter with its score head; 'zoo' = shipped"})
    reward_base: str = field(default="", metadata={"help": "base of the reward adapter; empty = the base it records"})
    judge: str = field(default="auto", metadata={"help": "'toy', 'keyword' or 'auto' (toy for the toy tokenizer)"})
    prompts: int = field(default=64, metadata={"help": "keyword judge: held-out red-team requests (plus its benign questions)"})
    max_prompt_length: int = field(default=64, metadata={"help": "keyword judge: longer requests are left out"})
    repeats: int = field(default=4, metadata={"help": "answers sampled per prompt"})
    max_new_tokens: int = field(default=48, metadata={"help": "answer length limit (as chapter 13's runs)"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of the answers (> 0)"})
    seed: int = field(default=0, metadata={"help": "sampling seed: the same seed samples the same answers"})
    device: str = field(default="auto", metadata={"help": "'auto' (cuda if available), 'cpu' or 'cuda[:N]'"})
    dtype: str = field(default="auto", metadata={"help": "weights' dtype: 'auto' = bfloat16 on CUDA, the "
                                                          "checkpoint's own on the CPU; or bfloat16, float16, float32"})
    load_in_4bit: bool = field(default=False, metadata={"help": "both models as NF4 bases (7B on a 24 GB card)"})
    output_dir: str = field(default="", metadata={"help": "write eval_metrics.json and eval_samples.jsonl here"})


def main(argv: list[str] | None = None) -> dict:
    import json
    import pathlib

    (args,) = parse_stage_args((EvaluateArguments,), argv)
    if args.judge not in JUDGES:
        raise ConfigError(f"--judge must be one of {JUDGES}, got {args.judge!r}")
    if args.repeats < 1 or args.prompts < 1 or args.max_new_tokens < 1 or args.temperature <= 0:
        raise ConfigError("--repeats, --prompts and --max_new_tokens must be >= 1 and --temperature > 0")
    loading = loading_kwargs(args.device, args.dtype, args.load_in_4bit)  # bad --device/--dtype: before loading
    # the shipped adapter goes on the shipped SFT model (`zoo` in both roles); any other on the base it records
    reward = RewardAdapter.resolve(args.reward_adapter, args.reward_base or ("zoo" if args.reward_adapter == "zoo"
                                                                             else None),
                                   base_named=True, key="--reward_adapter")
    if args.output_dir:  # a folder it cannot write is found now, not after every answer was generated
        out = pathlib.Path(args.output_dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"--output_dir {out} cannot be written ({err.strerror})") from None
        if not os.access(out, os.W_OK):
            raise ConfigError(f"--output_dir {out} cannot be written (permission denied)")
    reward_base, adapter = reward.base, reward.folder
    # the judge and its held-out requests come from the tokenizer alone: a limit no request fits is found now
    tokenizer = load_tokenizer(args.model)
    judge = args.judge
    if judge == "auto":
        judge = "toy" if tokenizer.get_vocab() == load_tokenizer(TOKENIZER_DIR).get_vocab() else "keyword"
    if judge == "toy":
        world = ToyWorld()
    else:
        try:
            world = KeywordJudge(tokenizer, limit=args.prompts, max_prompt_tokens=args.max_prompt_length)
        except NoRequestFits as err:
            raise ConfigError(f"{err}: raise --max_prompt_length") from None
    check_same_vocabulary(tokenizer, load_tokenizer(reward_base))  # the reward model must read the policy's ids
    with quiet_loading():
        policy, tokenizer = load_sft_model(args.model, **loading)
        reward, reward_tokenizer = load_reward_model(reward_base, adapter, **loading)
    backend = ScoredPolicy(policy, reward, tokenizer, reward_tokenizer)
    metrics, samples = judge_policy(backend, world, args.repeats, args.max_new_tokens, args.temperature, args.seed)
    metrics = {"judge": judge, "answers": len(samples), **metrics}
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in metrics.items()}))
    if args.output_dir:
        out = pathlib.Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        (out / "eval_samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    return {**metrics, "samples": samples}
