"""Stage 3: PPO on the SFT model against the reward model.

    marlhf-edu ppo --config configs/tiny_ppo.yaml [--key value ...] [--resume true]

Builds the backend (four separate models here; `ma-ppo` builds one base with
adapters), checks the configuration before any work, evaluates the policy
before and after on the toy world, and trains with `PPOTrainer`: one JSONL
record per step in `output_dir/metrics.jsonl`, checkpoints every `save_steps`.

Taught in chapter 09.
"""

from __future__ import annotations

import json
import math
import os
import pathlib

from marlhf_edu.errors import ConfigError
from marlhf_edu.ppo.config import SENTIMENT_DATASET
from marlhf_edu.sentiment_judge import (SentimentJudge, distinct_n, eos_rate, mean_tokens, mean_words,
                                        repeated_trigram_share, sentiment_reward)


def load_prompts(config, tokenizer=None) -> list[str]:
    """Rendered prompts: the toy world's training prompts, or a dataset's.

    `dataset_format: prompt` reads a `prompt` column (rendered when `apply_template`); `hh-rlhf` takes the
    dialogue before the last assistant turn, rendered, each distinct prompt once. The template is the
    tokenizer's chat template when it has one (a real model), else the book's. With `drop_long_prompts`,
    prompts over `max_prompt_length` tokens are dropped and counted; `max_prompts` keeps the first N. Then
    `helpful_prompt_share` appends the book's harmless questions (`keyword_judge.helpful_prompts`) so that they
    make up that share of the whole; the trainer's per-epoch permutation mixes them in (chapter 13).
    """
    from marlhf_edu.data.template import template_for

    if config.dataset_name == "toy":
        from marlhf_edu.toyworld import ToyWorld, ToyWorldConfig

        return [p.prompt for p in ToyWorld(ToyWorldConfig(seed=config.toy_seed)).train_prompts]
    from marlhf_edu.data.formats import BadRowError, hh_rlhf_to_preference, read_rows

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
        from marlhf_edu.keyword_judge import helpful_prompts

        extra = helpful_prompts(template, round(len(prompts) * share / (1 - share)))
        print(f"prompts: added {len(extra)} of the book's harmless questions ({len(set(extra))} distinct) to the "
              f"{len(prompts)} from {config.dataset_name}: {len(extra) / (len(prompts) + len(extra)):.1%} of the whole")
        prompts = prompts + extra
    return prompts


def evaluation_judge(config, tokenizer, toy=None, when: str = "before_after", judge=None):
    """What judges the policy before and after training (`when="before_after"`, off with `eval_repeats: 0`) or
    every `eval_every` updates (`when="periodic"`, off with `eval_every: 0`): the toy world, the keyword judge of
    chapter 13 for hh-rlhf data (its held-out red-team requests and benign questions; `judge` when one was built
    already, by `check_before_loading`), the sentiment judge for the everyday prompts (VADER on the first
    `eval_prompts` held-out questions, chapter 13), or None (other data)."""
    if not (config.eval_repeats if when == "before_after" else config.eval_every):
        return None
    if toy is not None:
        return toy
    if config.dataset_format == "hh-rlhf":
        from marlhf_edu.keyword_judge import KeywordJudge

        return judge or KeywordJudge(tokenizer, limit=config.eval_prompts or None,
                                     max_prompt_tokens=config.max_prompt_length)
    if config.dataset_name == SENTIMENT_DATASET:
        return judge or SentimentJudge(tokenizer, split="held_out", limit=config.eval_prompts or None)
    return None


def judge_policy(backend, world, repeats: int, max_new_tokens: int, temperature: float, seed: int = 0):
    """`(metrics, samples)`: the judge's rates of `repeats` sampled answers per prompt and their mean reward-model
    score; with the keyword judge, also how well the reward model ranks its refusals above its compliances
    (`judge_auc`, chapter 13); with the sentiment judge, the guards VADER cannot see (repeated trigrams,
    distinct-2, length, EOS rate, the mean log-probability under the SFT model; `marlhf_edu.sentiment_judge`).
    Used by the PPO stages before and after training and by `marlhf-edu evaluate`."""
    from marlhf_edu.keyword_judge import KeywordJudge, judge_agreement
    from marlhf_edu.ppo.trainer import sample_toy, toy_metrics

    samples = sample_toy(backend, world, repeats, max_new_tokens, seed=seed, temperature=temperature)
    metrics = toy_metrics(world, samples, repeats)
    if isinstance(getattr(world, "world", world), SentimentJudge):  # what VADER cannot see (a _PromptSubset too)
        answers = [s["response"] for s in samples]
        prompts = [p.prompt for p in world.eval_prompts for _ in range(repeats)]
        logprobs = [x for x in reference_mean_logprobs(backend, prompts, answers) if not math.isnan(x)]
        metrics.update(repeated_trigram_share=repeated_trigram_share(answers), distinct_2=distinct_n(answers, 2),
                       mean_words=mean_words(answers), mean_tokens=mean_tokens(answers, backend.tokenizer),
                       eos_rate=eos_rate(samples),
                       sft_mean_logprob=sum(logprobs) / len(logprobs) if logprobs else float("nan"))
    if isinstance(world, KeywordJudge):
        try:
            metrics["judge_auc"] = judge_agreement(samples)["auc"]
        except ValueError:  # all refusals or none: nothing to rank
            pass
    return metrics, samples


def reference_mean_logprobs(backend, prompts: list[str], answers: list[str], batch_size: int = 16) -> list[float]:
    r"""Each answer's mean log-probability per token under the run's reference model (the SFT model: the base with
    the adapters off in MA-PPO, the frozen copy in four-model PPO), at temperature 1:

    .. math:: \bar\ell(y \mid x) = \frac{1}{|y|} \sum_{t=1}^{|y|} \log \pi_\text{SFT}(y_t \mid x, y_{<t})

    `prompts`: rendered chat prompts; `answers`: bare answers, encoded as the engine scores them
    (`template_for(tokenizer).completion`, no EOS), right-padded after left-padded prompts, the rollout's layout.
    Returns `(N,)` floats in nats per token; NaN for an answer with no token. A fall after training says the policy
    writes text its starting model finds unlikely, which VADER does not see (`sentiment_judge.answer_mean_logprobs`
    is the same number for a plain model)."""
    import torch

    from marlhf_edu.data.template import template_for

    tok, template = backend.tokenizer, template_for(backend.tokenizer)
    out = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            p = tok(prompts[start:start + batch_size], return_tensors="pt", padding=True, padding_side="left")
            texts = [template.completion(a) if a.strip() else "" for a in answers[start:start + batch_size]]
            a = tok(texts, add_special_tokens=False, return_tensors="pt", padding=True, padding_side="right")
            if a["input_ids"].shape[1] == 0:  # every answer of the batch empty
                out += [float("nan")] * len(texts)
                continue
            ids = torch.cat([p["input_ids"], a["input_ids"]], dim=1).to(backend.device)
            mask = torch.cat([p["attention_mask"], a["attention_mask"]], dim=1).to(backend.device)
            logprobs = backend.reference_logprobs(ids, mask, a["input_ids"].shape[1], 1.0).float()
            answer_mask = a["attention_mask"].to(logprobs.device).float()
            n = answer_mask.sum(dim=1)
            out += [float(s / k) if k else float("nan") for s, k in zip((logprobs * answer_mask).sum(dim=1).tolist(),
                                                                         n.tolist())]
    return out


class _PromptSubset:
    """A judge (toy world or keyword judge) asking only `prompts`, for the periodic evaluation."""

    def __init__(self, world, prompts):
        self.world, self.eval_prompts = world, list(prompts)

    def __getattr__(self, name):
        return getattr(self.world, name)


def periodic_evaluation(world, config):
    """`eval_fn(backend) -> dict` for `PPOTrainer`: one answer to each of `eval_every_prompts` held-out prompts
    (half harmful, half benign, the first of each, so every evaluation asks the same ones; the sentiment judge's
    first questions, with VADER's mean and the guards), sampled at the
    training temperature with seed 0, so that two points of the curve differ only by the policy. Reports the
    reward model's mean score read as it was trained (EOS appended, `sample_toy`) and each prompt's score in
    prompt order (`reward_model_scores`, so that two points can be compared prompt by prompt), the judge's
    rates, and with the keyword judge the strict refusal rate (hollow apologies not counted)."""
    from marlhf_edu.keyword_judge import KeywordJudge, is_hollow_apology

    if isinstance(world, SentimentJudge):  # no kinds to balance: the first eval_every_prompts questions
        view = _PromptSubset(world, world.eval_prompts[:config.eval_every_prompts])
        kept = ("reward_model_score", "vader_compound", "repeated_trigram_share", "eos_rate", "mean_tokens",
                "sft_mean_logprob")
    else:
        harmful = [p for p in world.eval_prompts if p.harmful]
        benign = [p for p in world.eval_prompts if not p.harmful]
        n_benign = min(len(benign), config.eval_every_prompts // 2)
        view = _PromptSubset(world, harmful[:config.eval_every_prompts - n_benign] + benign[:n_benign])
        kept = ("reward_model_score", "harmful_refusal_rate", "benign_accuracy")

    def evaluate(backend) -> dict:
        metrics, samples = judge_policy(backend, view, 1, config.max_new_tokens, config.temperature)
        out = {k: metrics[k] for k in kept}
        out["reward_model_scores"] = [s["reward_model_score"] for s in samples]
        if isinstance(world, KeywordJudge):
            answers = [s for s in samples if s["kind"] == "harmful"]
            out["strict_refusal_rate"] = sum(s["verdict"] == "refusal" and not is_hollow_apology(s["response"])
                                             for s in answers) / max(len(answers), 1)
        return out

    return evaluate


def evaluate(backend, world, config, out: pathlib.Path, when: str, write: bool = True) -> dict:
    """`judge_policy` of the current policy (`eval_repeats` answers per prompt, sampled at the training
    temperature with seed 0); each answer goes to `out/eval_samples.jsonl`, tagged `when` (unless `write` is
    false: the other ranks of a data-parallel run)."""
    metrics, samples = judge_policy(backend, world, config.eval_repeats, config.max_new_tokens, config.temperature)
    if not write:
        return metrics
    out.mkdir(parents=True, exist_ok=True)
    path = out / "eval_samples.jsonl"
    # a resumed run keeps the answers of the original start and replaces any earlier "after"
    kept = [line for line in path.read_text().splitlines() if json.loads(line)["when"] != when] \
        if when == "after" and path.exists() else []
    path.write_text("".join(line + "\n" for line in kept + [json.dumps({"when": when, **s}) for s in samples]))
    return metrics


#: The before/after evaluation's records in a run folder, which a resume rewrites after training.
EVALUATION_RECORDS = ("eval_samples.jsonl", "eval.json")


def evaluation_record_problems(out: pathlib.Path) -> dict[str, str]:
    """`{file name: what is wrong}` for each evaluation record in `out` that a resume could not rewrite after
    training (`evaluate` reads every line of `eval_samples.jsonl`; `eval.json` is merged): found before anything
    loads, since after training it would stop the run before `policy/` is exported, on every later resume too."""
    problems = {}
    for name in EVALUATION_RECORDS:
        if (out / name).exists():
            problem = _evaluation_record_problem(out / name)
            if problem is not None:
                problems[name] = problem
    return problems


def _evaluation_record_problem(path: pathlib.Path) -> str | None:
    try:
        text = path.read_text()
    except (OSError, ValueError) as err:
        return f"cannot be read ({err.__class__.__name__})"
    if path.name == "eval.json":
        try:
            return None if isinstance(json.loads(text), dict) else "not a JSON object"
        except ValueError:
            return "not a JSON object"
    for i, line in enumerate(text.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("when"), str):
            return f"line {i + 1} is not a JSON answer record with a 'when'"
    return None


def set_aside_evaluation_records(out: pathlib.Path, problems: dict[str, str]) -> None:
    """Move each damaged evaluation record to `<name>.damaged` (replacing an earlier one), saying so: the
    resumed run evaluates the starting policy again and writes them anew."""
    for name, problem in problems.items():
        os.replace(out / name, out / f"{name}.damaged")
        print(f"ppo: {out / name} is damaged ({problem}); moved to {name}.damaged, and this run writes it again "
              "(the policy before training is evaluated once more, before the checkpoint loads)")


def export_policy(backend, config, out_dir) -> None:
    """The trained policy as `out_dir`: a LoRA adapter whose `base_model_name_or_path` is the run's SFT model (so
    `marlhf-edu merge`, `generate` and any stage take it as a model reference), or the whole actor when it trained
    in full. An adapter trained on an NF4 base applies to the full-precision SFT model, as QLoRA adapters do."""
    from marlhf_edu.stages.common import record_base

    backend.export_policy(out_dir)
    record_base(out_dir, config.sft_model_path)


def check_before_loading(config, backend_factory=None) -> tuple[list[str], object]:
    """The user's mistakes a model load would otherwise find first, refused as `ConfigError` before anything
    loads: an unknown tracker, an engine option the chosen engine cannot honour, a reward adapter folder that
    does not exist or whose score head is missing or does not fit the base's width, a reward model on a base of
    its own with another vocabulary, a prompt file that cannot be read, prompts longer than `max_prompt_length`, and an evaluation
    the keyword judge cannot give (no held-out request fits in `max_prompt_length`). The prompts are read once,
    here, with the policy's tokenizer alone (an SFT adapter's is its base's: nothing is merged); returns them and
    the keyword judge (None when the run has none) for the run."""
    from marlhf_edu.data.formats import DataFileError
    from marlhf_edu.models import REWARD_ADAPTER_DIR, SFT_DIR, load_tokenizer
    from marlhf_edu.ppo.trainer import check_prompt_lengths
    from marlhf_edu.keyword_judge import NoRequestFits
    from marlhf_edu.ppo.backends import check_same_vocabulary
    from marlhf_edu.ppo.multi_adapter import check_reward_head, same_model_path
    from marlhf_edu.sources import require_adapter_folder

    if config.report_to not in ("none", "", None):
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        if config.report_to not in LOGGER_TYPE_TO_CLASS and config.report_to != "all":
            raise ConfigError(f"report_to: {config.report_to!r} is not a tracker accelerate knows "
                              f"({', '.join(sorted(LOGGER_TYPE_TO_CLASS))}, or 'none')")
    multi_adapter = getattr(backend_factory, "__qualname__", "").startswith("MultiAdapterBackend")
    if multi_adapter and config.critic_init == "reward_model" and config.value_mode != "adapter":
        raise ConfigError("critic_init: reward_model needs value_mode: adapter (the value adapter starts as a copy "
                          "of the reward adapter); a shared head reads the policy's features, not the reward's")
    if backend_factory is None and config.merged_rollout and config.actor_lora_r == 0:
        raise ConfigError("merged_rollout needs a LoRA policy (actor_lora_r > 0): a fully fine-tuned actor already "
                          "samples from dense weights")
    adapter = REWARD_ADAPTER_DIR if config.reward_adapter_path == "zoo" else config.reward_adapter_path
    require_adapter_folder(adapter, "reward_adapter_path")
    sft = SFT_DIR if config.sft_model_path == "zoo" else config.sft_model_path
    check_reward_head(adapter, config.reward_base_path or sft)
    tokenizer = load_tokenizer(sft)
    if config.reward_base_path and not same_model_path(config.reward_base_path, sft):  # a reward model on its own base
        check_same_vocabulary(tokenizer, load_tokenizer(config.reward_base_path))  # its tokenizer alone, no weights
    try:
        prompts = load_prompts(config, tokenizer)
    except DataFileError as err:
        raise ConfigError(str(err)) from None
    check_prompt_lengths(prompts, tokenizer, config.max_prompt_length)
    judge = None
    if config.dataset_name != "toy" and (config.eval_repeats or config.eval_every):
        try:
            judge = evaluation_judge(config, tokenizer, when="before_after" if config.eval_repeats else "periodic")
        except NoRequestFits as err:
            raise ConfigError(f"{err}: raise max_prompt_length, or set eval_repeats: 0 and eval_every: 0") from None
    return prompts, judge


def run(config, backend_factory=None, progress: bool = True) -> dict:
    """Train; return `{"before": eval, "after": eval, "records": [...]}` (evals with a judge: toy or hh-rlhf data).

    The writing process holds a lock on `output_dir` for the whole run (`RunLock`); the folder and, on resume,
    the checkpoint's settings are checked before anything is loaded or written, so a repeated launch cannot
    overwrite the run's evaluation before it is refused. A resume of a run stopped before its first checkpoint
    starts over from step 0 (`check_run_folder`); a resume whose evaluation records are damaged sets them aside
    before training and writes them again (`evaluation_record_problems`), so `policy/` is always exported."""
    import dataclasses

    from marlhf_edu.ppo.run_files import RunLock, check_run_folder

    config.validate()
    if not config.resume:  # a folder that holds a run is refused before the checks below read anything: resolving
        check_run_folder(config)  # the tokenizer can convert a GGUF model (checked again under the lock)
    prompts, judge = check_before_loading(config, backend_factory)
    with RunLock(config.output_dir, enabled=int(os.environ.get("RANK", "0")) == 0):
        checked = check_run_folder(config)
        start_over = config.resume and checked is None  # stopped before its first checkpoint: nothing to resume
        if start_over:  # a fresh run from here on, once rank 0 has set the stopped run's records aside
            config = dataclasses.replace(config, resume=False, resume_overrides=[])
        # every rank looks now, before any rank joins the run and rank 0 moves a damaged record aside
        damaged = (evaluation_record_problems(pathlib.Path(config.output_dir)) if config.resume and config.eval_repeats
                   else {})
        return _run(config, backend_factory, progress, checked, prompts, judge, start_over, damaged)


def _run(config, backend_factory, progress: bool, checked, prompts: list[str], judge=None, start_over=False,
         damaged=None) -> dict:
    import torch

    from marlhf_edu.ppo import FourModelBackend, PPOTrainer
    from marlhf_edu.ppo.distributed import DataParallel
    from marlhf_edu.ppo.run_files import set_aside_stopped_run

    # launched by `accelerate launch` on several processes: join the run before loading anything (chapter 14)
    dp = DataParallel.from_environment(config.resolved_device)
    config.validate_data_parallel(dp.world_size)
    out = pathlib.Path(config.output_dir)
    if start_over or damaged:  # every rank found the same files; rank 0 moves them once all have looked
        dp.barrier()
        if dp.is_main and start_over:
            set_aside_stopped_run(out)
        if dp.is_main and damaged:
            set_aside_evaluation_records(out, damaged)
    torch.manual_seed(config.seed)
    backend = (backend_factory or FourModelBackend.from_config)(config)
    toy = None
    if config.dataset_name == "toy":
        from marlhf_edu.toyworld import ToyWorld, ToyWorldConfig

        toy = ToyWorld(ToyWorldConfig(seed=config.toy_seed))
    # toy data has a gold judge: every step logs it next to the reward model's score (chapter 11)
    reward_fn = None
    if config.reward != "reward_model":  # chapter 13's positive controls: a judge's verdict as the reward
        from marlhf_edu.data.template import template_for
        from marlhf_edu.keyword_judge import canonical_refusal_reward, keyword_reward

        reward_fn = {"keyword_judge": keyword_reward, "canonical_refusal": canonical_refusal_reward,
                     "sentiment": sentiment_reward}[config.reward](
            template_for(backend.tokenizer))
    periodic = evaluation_judge(config, backend.tokenizer, toy, when="periodic", judge=judge)
    trainer = PPOTrainer(backend, config, prompts,
                         gold_reward_fn=toy.gold_rewards if toy else None, reward_fn=reward_fn,
                         eval_fn=None if periodic is None else periodic_evaluation(periodic, config))
    trainer.run_folder_checked = checked if config.resume else True  # checked once, before loading (not twice)
    world = evaluation_judge(config, backend.tokenizer, toy, judge=judge)
    result = {}
    # every rank evaluates (the same weights and seed give the same answers; nobody idles at a barrier past its
    # timeout while rank 0 samples), rank 0 alone writes. A resume whose records were damaged evaluates the policy
    # before training again: the checkpoint loads in `train`, so the backend still holds the starting weights
    if world is not None and (not config.resume or damaged):
        result["before"] = evaluate(backend, world, config, out, "before", write=dp.is_main)
    trackers = None
    if config.report_to not in ("none", "", None) and dp.is_main:
        from accelerate import Accelerator

        trackers = Accelerator(log_with=config.report_to, project_dir=str(out), cpu=backend.device.type == "cpu")
        trackers.init_trackers("ppo", config={k: v for k, v in vars(config).items() if isinstance(v, (int, float, str, bool))})
    result["records"] = trainer.train(progress=progress, trackers=trackers)
    if trackers is not None:
        trackers.end_training()
    if world is not None:
        result["after"] = evaluate(backend, world, config, out, "after", write=dp.is_main)
    if world is not None and dp.is_main:
        evals = {k: result[k] for k in ("before", "after") if k in result}
        previous = out / "eval.json"
        if config.resume and previous.exists():  # keep the before-numbers of the original start
            evals = {**json.loads(previous.read_text()), "after": result["after"]}
        previous.write_text(json.dumps(evals, indent=2) + "\n")
    if dp.is_main:
        export_policy(backend, config, out / "policy")
    dp.barrier()  # no rank exits while rank 0 still writes
    dp.close()
    result["trainer"] = trainer
    return result


def main(argv: list[str] | None = None, backend_factory=None, progress: bool = True):
    """`marlhf-edu ppo` (four models); `marlhf-edu ma-ppo` passes the multi-adapter backend's factory."""
    from marlhf_edu.ppo import PPOConfig
    from marlhf_edu.stages.common import parse_stage_args

    (config,) = parse_stage_args((PPOConfig,), argv)
    result = run(config, backend_factory, progress=progress)
    if result["trainer"].dp.is_main and ("before" in result or "after" in result):
        print(evaluation_table(result.get("before", {}), result.get("after", {})))
        print(f"(the held-out evaluation, and the answers it read: {config.output_dir}/eval.json, eval_samples.jsonl)")
    return result


def evaluation_table(before: dict, after: dict) -> str:
    """The held-out evaluation before and after training as a table: one row per measure, its change beside.
    Counts print as integers, rates and scores to 4 decimals."""
    keys = list(dict.fromkeys([*before, *after]))
    title = "held-out evaluation"
    width = max([len(title), *map(len, keys)])

    def cell(value) -> str:
        if value is None:
            return "-"
        return f"{value:d}" if isinstance(value, int) else f"{value:.4f}"

    lines = [f"{title:{width}s}  {'before':>9s}  {'after':>9s}  {'change':>9s}"]
    for key in keys:
        b, a = before.get(key), after.get(key)
        change = "" if b is None or a is None or (isinstance(b, int) and isinstance(a, int) and a == b) else f"{a - b:+.4f}"
        lines.append(f"{key:{width}s}  {cell(b):>9s}  {cell(a):>9s}  {change:>9s}")
    return "\n".join(lines)
