"""The output folder of a trl stage (SFT, reward model, DPO, GRPO): refused when it holds a finished run or a
checkpoint the options do not resume (`check_output_dir`), cleared of an earlier run's files when asked, and held
under a lock while the stage runs (`run_trl_stage`)."""

from __future__ import annotations

import os

from marlhf_edu.errors import ConfigError
from marlhf_edu.ppo.run_files import RunLock


#: What a finished trl stage leaves at the top of its `output_dir`: the saved model or adapter, its metrics.
FINISHED_RUN_FILES = ("adapter_model.safetensors", "adapter_config.json", "model.safetensors",
                      "model.safetensors.index.json", "pytorch_model.bin", "eval_metrics.json")

#: Every file a trl stage (or the pipeline, for it) writes at the top of its `output_dir`, by name: the model or
#: adapter and its configs, sharded weights, the tokenizer, the training arguments, the metrics and the pipeline's
#: completion marker (`pipeline.MARKER`). `--overwrite_output` removes these, the `checkpoint-N` folders and a
#: generated model card (`README.md`), and nothing else: a LoRA run replaced by a full one left its
#: `adapter_config.json` beside the new weights, and every later stage loaded the old adapter
#: (`ModelSource._local` reads an adapter first).
RUN_OUTPUT_FILES = FINISHED_RUN_FILES + (
    "adapter_model.bin", "config.json", "generation_config.json", "pytorch_model.bin.index.json", "training_args.bin",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json", "tokenizer.model", "vocab.json", "vocab.txt", "merges.txt", "pipeline_stage.json")
RUN_OUTPUT_PATTERNS = ("model-*-of-*.safetensors", "pytorch_model-*-of-*.bin")


def remove_run_outputs(output_dir) -> list[str]:
    """Remove a replaced run's outputs from `output_dir`: the files named in `RUN_OUTPUT_FILES` or matching
    `RUN_OUTPUT_PATTERNS`, `README.md` when it is a model card (YAML front matter naming a `library_name`, as peft
    and trl write it) and the `checkpoint-N` folders; returns the names removed. Only these go: anything else the
    folder holds (a user's notes or data, trackers' logs, the lock) is kept."""
    import pathlib
    import shutil

    out = pathlib.Path(output_dir)
    files = [out / name for name in RUN_OUTPUT_FILES] + sorted(p for pattern in RUN_OUTPUT_PATTERNS
                                                                for p in out.glob(pattern))
    card = out / "README.md"
    if card.is_file() and not card.is_symlink():
        text = card.read_text(errors="replace")
        if text.startswith("---\n") and "\nlibrary_name:" in text.split("\n---", 1)[0]:
            files.append(card)
    removed = []
    for path in files:
        if path.is_symlink() or path.is_file():
            path.unlink()
            removed.append(path.name)
    for folder in sorted(out.glob("checkpoint-*")):
        if folder.is_dir() and not folder.is_symlink():
            shutil.rmtree(folder)
            removed.append(folder.name)
    return removed


def trl_checkpoint_problem(folder) -> str | None:
    """None when a trl `checkpoint-N` folder is complete, else what is missing. The Trainer writes the weights,
    then the optimizer, scheduler and RNG state, and `trainer_state.json` last: a stage killed while saving leaves
    a folder without it (or with it cut short), which a resume would load half of."""
    import json
    import pathlib

    folder = pathlib.Path(folder)
    if not folder.is_dir():
        return "no such folder"
    try:
        json.loads((folder / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return "no complete trainer_state.json (killed while saving)"
    if not any((folder / name).exists() for name in ("adapter_model.safetensors", "model.safetensors",
                                                     "model.safetensors.index.json")):
        return "no model weights"
    return None


def unwritable_folder(path):
    """None when this user can create or write `path`; else the nearest existing folder on its way (itself or a
    parent) that blocks it: not a folder, or not writable."""
    import pathlib

    existing = pathlib.Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return None if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK) else existing


def resume_checkpoint(stage: str, training_args, log=None) -> str | None:
    """The checkpoint folder a trl stage resumes from (what its `trainer.train(resume_from_checkpoint=...)` gets),
    or None: unset, empty or `false` is no resume; `true` is the newest complete `checkpoint-N` in `output_dir`
    (an incomplete newer one, left by a kill while saving, is passed over, and said to `log`); anything else is a
    checkpoint folder, which must be complete. The option arrives as the text `"true"`, which transformers read
    as a folder's name (`Can't find a valid checkpoint at true`), and transformers' own `True` would take the
    highest-numbered folder, complete or not. A resume that cannot be is a `ConfigError` naming the folder."""
    import pathlib

    resume = training_args.resume_from_checkpoint
    if resume is None or resume is False or str(resume).strip().lower() in ("", "false"):
        return None
    if resume is True or str(resume).strip().lower() == "true":
        out = pathlib.Path(training_args.output_dir)
        numbered = sorted((c for c in out.glob("checkpoint-*") if c.name[len("checkpoint-"):].isdigit()),
                          key=lambda c: int(c.name[len("checkpoint-"):]), reverse=True)
        for folder in numbered:
            problem = trl_checkpoint_problem(folder)
            if problem is None:
                return str(folder)
            if log is not None:
                log(f"{stage}: {folder} is incomplete ({problem}); not resuming from it")
        raise ConfigError(f"{stage}: resume_from_checkpoint is true, but {out} holds no complete "
                          "checkpoint-N folder to resume from")
    if problem := trl_checkpoint_problem(resume):
        raise ConfigError(f"{stage}: resume_from_checkpoint {resume} cannot be resumed from: {problem}")
    return str(resume)


def check_output_dir(stage: str, script_args, training_args) -> None:
    """What a trl stage (sft, rm, dpo, grpo) checks of its `output_dir` before any data or model loads, as the
    PPO stage does: it can be written; it does not already hold a finished run (`FINISHED_RUN_FILES`) unless
    `overwrite_output` (trl would overwrite it silently); and a `resume_from_checkpoint` names a complete
    checkpoint (`true`: `output_dir` holds one; `resume_checkpoint`). Each problem is a `ConfigError` naming the
    folder."""
    import pathlib

    out = pathlib.Path(training_args.output_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{stage}: output_dir {out} is a file, not a folder")
    resuming = resume_checkpoint(stage, training_args) is not None  # a resume that cannot be is refused in there
    if not resuming and not script_args.overwrite_output:
        found = [name for name in FINISHED_RUN_FILES if (out / name).exists()]
        if found:
            raise ConfigError(f"{stage}: output_dir {out} already holds a finished run ({found[0]}); choose another "
                              "output_dir, pass --overwrite_output true to replace it, or --resume_from_checkpoint "
                              "to continue a stopped one (nothing was loaded or written)")
        stopped = sorted(c.name for c in out.glob("checkpoint-*"))
        if stopped:  # trl would write beside them, and a later resume could continue the old run's newest one
            raise ConfigError(f"{stage}: output_dir {out} holds checkpoints of a stopped run ({', '.join(stopped)}); "
                              "pass --resume_from_checkpoint true to continue it, --overwrite_output true to start "
                              "again (they are removed), or choose another output_dir (nothing was loaded or written)")
    if (blocked := unwritable_folder(out)) is not None:
        raise ConfigError(f"{stage}: output_dir {out} cannot be written ({blocked} is not writable by this user); "
                          "choose another output_dir")


def run_trl_stage(stage: str, run, script_args, training_args, model_args):
    """What the command of a trl stage (sft, rm, dpo, grpo) does around `run(script_args, training_args,
    model_args)`: check the output folder first (`check_output_dir`: a launch refused for its folder writes
    nothing; one refused by `run`'s own checks takes away the lock and folder it made), then hold its lock for the whole run
    (`RunLock`, rank 0), so that a second launch into it is refused instead of interleaving with it; with
    `overwrite_output` and no resume, the replaced run's outputs are removed first (`remove_run_outputs`: its
    model, adapter, tokenizer, marker and `checkpoint-N` folders, by name), so that neither a later load reads the
    old model beside the new one nor a later resume continues the old run. `run_sft` and the like called from
    Python do neither."""
    import os

    check_output_dir(stage, script_args, training_args)
    main_rank = int(os.environ.get("RANK", "0")) == 0
    resuming = resume_checkpoint(stage, training_args) is not None
    with RunLock(training_args.output_dir, enabled=main_rank):
        if script_args.overwrite_output and main_rank and not resuming:
            if removed := remove_run_outputs(training_args.output_dir):
                print(f"{stage}: overwrite_output: removed the replaced run's {', '.join(removed)} from "
                      f"{training_args.output_dir}")
        return run(script_args, training_args, model_args)
