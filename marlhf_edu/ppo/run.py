"""A PPO run from a config, on either backend: what `marlhf-edu ppo` and `ma-ppo` execute.

`run` checks the configuration and the run folder before anything loads (`check_before_loading`: trackers,
reward adapter and its score head, vocabularies, prompts), holds the folder's lock for the whole run, builds
the backend, evaluates the policy before and after training, trains with `PPOTrainer` (one JSONL record per
step in `output_dir/metrics.jsonl`, checkpoints every `save_steps`) and exports the trained policy to
`output_dir/policy` (`export_policy`). Taught in chapter 09.
"""

from __future__ import annotations

import json
import os
import pathlib

from marlhf_edu.data.keyword_judge import NoRequestFits
from marlhf_edu.data.keyword_rewards import canonical_refusal_reward, keyword_reward
from marlhf_edu.data.prompts import load_prompts
from marlhf_edu.data.sentiment_judge import sentiment_reward
from marlhf_edu.data.template import template_for
from marlhf_edu.data.toyworld import ToyWorld, ToyWorldConfig
from marlhf_edu.errors import ConfigError, DataFileError
from marlhf_edu.loading.adapters import RewardAdapter, check_same_vocabulary
from marlhf_edu.loading.sources import load_tokenizer, resolve_zoo, same_model_path
from marlhf_edu.ppo.backends import FourModelBackend, PPOBackend
from marlhf_edu.ppo.distributed import DataParallel
from marlhf_edu.ppo.judging import evaluation_judge, evaluation_table, judge_policy, periodic_evaluation
from marlhf_edu.ppo.run_files import RunLock, check_run_folder, export_policy, set_aside_stopped_run
from marlhf_edu.ppo.trainer import PPOTrainer, check_prompt_lengths


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


def engine_of(backend_factory) -> type[PPOBackend]:
    """The backend class a run builds: `backend_factory` itself when it is one (`MultiAdapterBackend`), the class
    of a bound `from_config`, and the four-model backend for None or any other callable (tests' stand-ins)."""
    if isinstance(backend_factory, type) and issubclass(backend_factory, PPOBackend):
        return backend_factory
    owner = getattr(backend_factory, "__self__", None)
    return owner if isinstance(owner, type) and issubclass(owner, PPOBackend) else FourModelBackend


def print_evaluation(result: dict, config) -> None:
    """What `marlhf-edu ppo` and `ma-ppo` print after a run: the before/after table of the held-out evaluation
    (rank 0, when the run had one) and where its records are."""
    if result["trainer"].dp.is_main and ("before" in result or "after" in result):
        print(evaluation_table(result.get("before", {}), result.get("after", {})))
        print(f"(the held-out evaluation, and the answers it read: {config.output_dir}/eval.json, eval_samples.jsonl)")


def check_before_loading(config, engine: type[PPOBackend] = FourModelBackend
                         ) -> tuple[list[str], object, RewardAdapter]:
    """The user's mistakes a model load would otherwise find first, refused as `ConfigError` before anything
    loads: an unknown tracker, an engine option the chosen engine cannot honour (`engine.check_config`), a reward
    adapter folder that does not exist, whose score head is missing or does not fit the base's width, or that was
    trained on another base (`engine.resolve_reward`, once), a reward model on a base of its own with another
    vocabulary, a prompt file that cannot be read, prompts longer than `max_prompt_length`, and an evaluation the
    keyword judge cannot give (no held-out request fits in `max_prompt_length`). The prompts are read once, here,
    with the policy's tokenizer alone (an SFT adapter's is its base's: nothing is merged); returns them, the
    keyword judge (None when the run has none) and the checked reward adapter, which the backend is built with."""
    if config.report_to not in ("none", "", None):
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS

        if config.report_to not in LOGGER_TYPE_TO_CLASS and config.report_to != "all":
            raise ConfigError(f"report_to: {config.report_to!r} is not a tracker accelerate knows "
                              f"({', '.join(sorted(LOGGER_TYPE_TO_CLASS))}, or 'none')")
    engine.check_config(config)
    reward = engine.resolve_reward(config)
    sft = resolve_zoo(config.sft_model_path)
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
    return prompts, judge, reward


def run(config, backend_factory=None, progress: bool = True) -> dict:
    """Train; return `{"before": eval, "after": eval, "records": [...]}` (evals with a judge: toy or hh-rlhf data).

    The writing process holds a lock on `output_dir` for the whole run (`RunLock`); the folder and, on resume,
    the checkpoint's settings are checked before anything is loaded or written, so a repeated launch cannot
    overwrite the run's evaluation before it is refused. A resume of a run stopped before its first checkpoint
    starts over from step 0 (`check_run_folder`); a resume whose evaluation records are damaged sets them aside
    before training and writes them again (`evaluation_record_problems`), so `policy/` is always exported.

    `backend_factory` is the backend class (`FourModelBackend` when None; `marlhf-edu ma-ppo` passes
    `MultiAdapterBackend`): its checks run before loading, and its `from_config` is given the reward adapter they
    resolved. Any other callable is called as `backend_factory(config, reward=...)` after the four-model checks."""
    import dataclasses

    config.validate()
    if not config.resume:  # a folder that holds a run is refused before the checks below read anything: resolving
        check_run_folder(config)  # the tokenizer can convert a GGUF model (checked again under the lock)
    prompts, judge, reward = check_before_loading(config, engine_of(backend_factory))
    with RunLock(config.output_dir, enabled=int(os.environ.get("RANK", "0")) == 0):
        checked = check_run_folder(config)
        start_over = config.resume and checked is None  # stopped before its first checkpoint: nothing to resume
        if start_over:  # a fresh run from here on, once rank 0 has set the stopped run's records aside
            config = dataclasses.replace(config, resume=False, resume_overrides=[])
        # every rank looks now, before any rank joins the run and rank 0 moves a damaged record aside
        damaged = (evaluation_record_problems(pathlib.Path(config.output_dir)) if config.resume and config.eval_repeats
                   else {})
        return _run(config, backend_factory, progress, checked, prompts, reward, judge, start_over, damaged)


def _run(config, backend_factory, progress: bool, checked, prompts: list[str], reward: RewardAdapter, judge=None,
         start_over=False, damaged=None) -> dict:
    import torch

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
    build = backend_factory.from_config if isinstance(backend_factory, type) else backend_factory
    backend = (build or FourModelBackend.from_config)(config, reward=reward)
    toy = None
    if config.dataset_name == "toy":
        toy = ToyWorld(ToyWorldConfig(seed=config.toy_seed))
    # toy data has a gold judge: every step logs it next to the reward model's score (chapter 11)
    reward_fn = None
    if config.reward not in ("reward_model", "reward_model_shuffled"):  # chapter 13's positive controls: a judge's verdict
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
