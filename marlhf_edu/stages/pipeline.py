"""`marlhf-edu pipeline`: SFT → reward model → (MA-)PPO in order, each stage in its own directory, resumable.

    marlhf-edu pipeline --config configs/llama2_7b/pipeline.yaml [--stages sft rm] [--sft.max_steps 10 ...]

The pipeline file names each stage's own config, and optionally overrides for it:

    stages:                 # run in this order; the PPO stage is `ppo` (four models) or `ma-ppo`
      sft: configs/llama2_7b/sft.yaml
      rm: configs/llama2_7b/rm.yaml
      ma-ppo: configs/llama2_7b/ma_ppo.yaml
    overrides:              # optional: any key of that stage's config
      sft: {max_steps: 10}

`--STAGE.KEY VALUE` on the command line overrides on top (`--ma-ppo.total_steps 5`). What it does:

1. wires the stages: the reward model starts from the SFT stage's output, the PPO stage takes both (a stage's
   own path is replaced, and the pipeline says so);
2. parses and validates every stage's config before any work, so a typo in the last stage fails in seconds;
3. runs the stages in order. A finished stage leaves `pipeline_stage.json` in its output directory and is
   skipped next time; a stage that was stopped resumes from its last checkpoint (trl's `checkpoint-N` for SFT
   and the reward model, `checkpoints/latest` for PPO); the others start.

Under `accelerate launch` every rank runs every stage (trl's trainers and the PPO engine are data-parallel
alike). The ranks wait for each other between stages, so none starts the next stage while rank 0 still writes
the last one's files; rank 0 alone writes the markers, and rank 0 alone merges an SFT adapter into its base
for the next stage (the model cache) while the others wait, then they load the merged copy. Taught in chapter 15.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

from marlhf_edu.data.formats import load_preferences, load_sft
from marlhf_edu.data.prompts import load_prompts
from marlhf_edu.errors import BadRowError, ConfigError, DataFileError
from marlhf_edu.loading.cpu_products import fp32_products_where_needed
from marlhf_edu.loading.sources import resolve_model
from marlhf_edu.training.pipeline_file import Stage, load_pipeline, wire
from marlhf_edu.training.runs import FINISHED_RUN_FILES, trl_checkpoint_problem, unwritable_folder


MARKER = "pipeline_stage.json"
#: Written into a trl stage's output_dir when the pipeline starts it: the folder is the pipeline's own from then on,
#: so a run killed after saving its model but before `MARKER` is restarted (`--overwrite_output`), while a folder
#: holding another finished model, which the pipeline never started, is refused (`foreign_run`).
STARTED = "pipeline_stage.started"


def resume_argv(stage: Stage, out: pathlib.Path, log=print) -> list[str]:
    """The options that continue a stopped stage from its last complete checkpoint in `out` (none if it has
    none); an incomplete newer one is named and passed over."""
    if stage.kind == "ppo":  # whatever a fresh launch would refuse as a run: the resume finds its newest good
        # checkpoint (with or without `latest`), or starts a run stopped before its first one over
        return ["--resume", "true"] if (out / "metrics.jsonl").exists() or (out / "checkpoints").exists() else []
    checkpoints = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1])
                         if p.name.split("-")[-1].isdigit() else -1)

    for folder in reversed(checkpoints):
        problem = trl_checkpoint_problem(folder)
        if problem is None:
            return ["--resume_from_checkpoint", str(folder)]
        log(f"pipeline: {stage.name}: {folder} is incomplete ({problem}); not resuming from it")
    return []


def run_pipeline(stages: list[Stage], only: list[str] | None = None, log=print, progress: bool = True) -> list[dict]:
    """Run the stages (all, or those named in `only`), skipping finished ones; one record per stage. `log`
    receives the pipeline's own lines; `progress=False` turns off the PPO stage's progress bar."""
    import importlib

    for name in only or []:
        if name not in {s.name for s in stages}:
            raise ConfigError(f"--stages: {name!r} is not a stage of this pipeline ({', '.join(s.name for s in stages)})")
    wiring = wire(stages)
    for target, value in wiring.items():
        log(f"pipeline: {target} = {value}")
    parsed = {s.name: s.parse() for s in stages}  # every config checked before any work
    for stage in stages:  # and every output folder this run will write, so the last stage's is not found last
        out = stage.output_dir(parsed[stage.name])
        if (only and stage.name not in only) or (out / MARKER).exists():
            continue
        if (blocked := unwritable_folder(out)) is not None:
            raise ConfigError(f"pipeline: {stage.name}'s output_dir {out} cannot be written ({blocked} is not a "
                              "writable folder); nothing was run")
        if stage.kind != "ppo" and (found := foreign_run(out)):
            raise ConfigError(f"pipeline: {stage.name}'s output_dir {out} holds a finished run the pipeline did not "
                              f"start ({found}, and no {MARKER} or {STARTED}); choose another output_dir "
                              f"(--{stage.name}.output_dir DIR) or remove {out} yourself; nothing was run")
        check_stage_data(stage.name, parsed[stage.name])  # a later stage's data file, read now, not after SFT
    main_rank = int(os.environ.get("RANK", "0")) == 0
    wired = {}  # stage name → the models of earlier stages it loads (an SFT adapter is merged into its base first)
    for target, value in wiring.items():
        if not target.endswith(".reward_adapter_path"):  # an adapter loaded as one, on a base named elsewhere
            wired.setdefault(target.split(".", 1)[0], []).append(value)
    records = []
    for stage in stages:
        out = stage.output_dir(parsed[stage.name])
        if only and stage.name not in only:
            continue
        if (out / MARKER).exists():
            log(f"pipeline: {stage.name} finished earlier ({out / MARKER}), skipped")
            records.append({"stage": stage.name, "status": "skipped", "output_dir": str(out)})
            continue
        if wired.get(stage.name):  # rank 0 builds the merged SFT model the stage reads; the others wait for it
            if main_rank:
                for value in wired[stage.name]:
                    resolve_model(value)
            synchronize()
        resume = resume_argv(stage, out, log)
        log(f"pipeline: {stage.name} " + (f"resumes from {resume[-1] if stage.kind != 'ppo' else out / 'checkpoints'}"
                                               if resume else "starts") + f" -> {out}")
        start = time.perf_counter()
        # a trl stage the pipeline starts again (no marker, no checkpoint) may hold the files of a run killed after
        # saving; `foreign_run` above let it through only as the pipeline's own folder (its STARTED file, or no
        # finished model), so it is replaced rather than refused
        fresh = ["--overwrite_output", "true"] if stage.kind != "ppo" and not resume else []
        if stage.kind != "ppo" and main_rank:  # claimed before the stage writes anything of its own
            out.mkdir(parents=True, exist_ok=True)
            (out / STARTED).write_text(json.dumps({"stage": stage.name, "config": stage.config}) + "\n")
        argv = ["--config", stage.config, *stage.argv, *resume, *fresh]
        module = importlib.import_module(stage.module)
        with fp32_products_where_needed():  # a CPU without bf16 kernels: the recipe's bf16 products, computed in fp32
            module.main(argv, progress=progress) if stage.kind == "ppo" else module.main(argv)
        release_memory()
        record = {"stage": stage.name, "status": "resumed" if resume else "ran", "output_dir": str(out),
                  "config": stage.config, "argv": stage.argv, "seconds": round(time.perf_counter() - start, 1)}
        if main_rank:
            out.mkdir(parents=True, exist_ok=True)
            (out / MARKER).write_text(json.dumps(record, indent=2) + "\n")
        synchronize()  # no rank reads this stage's output (or its marker) before rank 0 has written all of it
        records.append(record)
    return records


def foreign_run(out: pathlib.Path) -> str | None:
    """The first finished-run file (`FINISHED_RUN_FILES`: a model, an adapter, its metrics) in a trl stage's
    output folder that the pipeline cannot tell is its own, or None. Its own: the folder holds `STARTED` (the
    pipeline began this stage there) or `checkpoint-N` folders (resumed, never replaced). The pipeline passes
    `--overwrite_output` to the stages it restarts, which bypassed the refusal a stage gives alone: a folder
    holding another model, named by mistake, was overwritten."""
    if (out / STARTED).exists() or any(out.glob("checkpoint-*")):
        return None
    return next((name for name in FINISHED_RUN_FILES if (out / name).exists()), None)


#: The settings through which a stage reads data files of its own (not written by an earlier stage).
DATA_KEYS = ("dataset_name", "extra_pairs_file", "extra_rows_file")


def check_stage_data(name: str, parsed) -> None:
    """Read each local data file a stage will read (`.jsonl`, `.json`, `.parquet` under `DATA_KEYS`) and convert
    its rows as the stage will (`stage_rows`), before the pipeline runs anything: a missing file, or one whose rows
    have the wrong keys (a reward-model file in another format), is found now, not after the SFT and reward-model
    stages have trained (hours at 7B). Hub datasets and the shipped ones are read by the stage."""
    for args in parsed:
        for key in DATA_KEYS:
            value = getattr(args, key, "")
            if isinstance(value, str) and value.endswith((".jsonl", ".json", ".parquet")):
                try:
                    stage_rows(args, key, value)
                except (DataFileError, BadRowError, ConfigError) as err:
                    raise ConfigError(f"pipeline: {name}.{key}: {err}; nothing was run") from None


def stage_rows(args, key: str, path: str) -> None:
    """Convert the rows of `path` (the stage's setting `key`) with the converter the stage uses on them: its
    `dataset_format` for `dataset_name` (preference pairs for the reward model, `{prompt, completion}` for SFT,
    prompts for PPO), trl's pair format for `extra_pairs_file`, prompt-completion for `extra_rows_file`. The book's
    template renders them (the stage may use the tokenizer's): the keys and values are checked, not the text."""
    import copy
    import warnings

    with warnings.catch_warnings():  # rows skip_bad_rows skips are reported by the stage, when it reads them
        warnings.simplefilter("ignore")
        if key == "extra_pairs_file":
            load_preferences(path, "trl")
        elif key == "extra_rows_file":
            load_sft(path, "prompt-completion")
        elif hasattr(args, "total_steps"):  # a PPO config: its prompts (without the tokenizer's length filter)
            config = copy.copy(args)
            config.drop_long_prompts, config.max_prompts, config.helpful_prompt_share = False, 0, 0.0
            load_prompts(config)
        elif hasattr(args, "extra_pairs_file"):  # the reward model's script arguments
            load_preferences(path, args.dataset_format, split=args.dataset_split, skip_bad_rows=args.skip_bad_rows)
        else:
            load_sft(path, args.dataset_format, split=args.dataset_split, skip_bad_rows=args.skip_bad_rows)


def synchronize() -> None:
    """Wait until every rank of an `accelerate launch` run gets here (accelerate's `wait_for_everyone`, opening the
    process group if no stage has yet); nothing on one process. The PPO stage closes the group when it ends, and
    nothing runs after it, so a closed group is not reopened."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    import torch
    from accelerate import PartialState

    if not torch.distributed.is_initialized() and PartialState._shared_state:  # opened once, then closed
        return
    PartialState(cpu=not torch.cuda.is_available()).wait_for_everyone()


def release_memory() -> None:
    """Free what a finished stage left behind before the next one loads its model. A trl trainer and its model sit
    in reference cycles (callbacks, accelerate's state), so they outlive the stage until Python's cyclic collector
    happens to run: measured on an H100 with the 7B recipe, the reward stage started with 3.8 GiB still allocated by
    SFT and the PPO stage with 3.5 GiB left by the reward model (its peak 10.0 GiB instead of 7.1 GiB in a process of
    its own; benchmarks/gpu_check.json). Collect them now and hand the cached blocks back to the driver."""
    import gc

    gc.collect()
    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:  # the module's docstring is the command's help
        print("usage: " + __doc__.split("\n\n", 2)[1].strip() + "\n\n" + __doc__.split("\n\n", 2)[2])
        return None
    if "--config" not in argv or argv.index("--config") + 1 >= len(argv):
        raise ConfigError("pipeline: pass --config PIPELINE.yaml (a file listing the stages' configs)")
    i = argv.index("--config")
    path, cli = argv[i + 1], argv[:i] + argv[i + 2:]
    stages, rest = load_pipeline(path, cli)
    only = None
    if rest:
        if rest[0] != "--stages" or len(rest) < 2 or any(t.startswith("--") for t in rest[1:]):
            raise ConfigError(f"pipeline: unknown option(s) {rest}; its own option is --stages NAME ..., "
                              "and --STAGE.KEY VALUE overrides a stage's config")
        only = rest[1:]
    return run_pipeline(stages, only)
