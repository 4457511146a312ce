"""What the stages share: argument parsing, model loading with optional 4-bit + LoRA, toy data."""

from __future__ import annotations

import difflib
import math
import os
import sys
from dataclasses import dataclass, field

from marlhf_edu.errors import ConfigError  # noqa: F401 (defined at the bottom of the package; public here too)


@dataclass
class DataArguments:
    """Where a stage's data comes from: the toy world or a file / hub dataset in a named format."""

    dataset_name: str = field(default="toy", metadata={"help": "'toy', a .json/.jsonl/.parquet file or a hub dataset"})
    dataset_format: str = field(default="", metadata={"help": "format of the rows (see marlhf_edu.data)"})
    dataset_split: str = field(default="train", metadata={"help": "split of a hub dataset"})
    skip_bad_rows: bool = field(default=False, metadata={"help": "skip (and report) rows that cannot be converted"})
    max_tokens: int = field(default=0, metadata={"help": "keep only rows whose prompt + longest answer fits in this "
                                                         "many tokens, and say how many were dropped (0 = keep all)"})
    max_rows: int = field(default=0, metadata={"help": "use the first N rows (after max_tokens); 0 = all"})
    toy_seed: int = field(default=0, metadata={"help": "seed of the toy world"})
    overwrite_output: bool = field(default=False, metadata={"help": "replace a finished or stopped run already in "
                                                                    "output_dir (the command removes its model, "
                                                                    "adapter, tokenizer and checkpoints, and nothing "
                                                                    "else; without it the stage refuses, before "
                                                                    "loading anything)"})


#: The stages' counts and limits that must not be negative (`max_rows: -3` kept all but the last three prompts).
NON_NEGATIVE = ("max_rows", "max_tokens", "eval_pairs", "refusal_pairs", "evasion_pairs", "eval_repeats",
                "max_prompt_length", "missing_eos_penalty", "learning_rate")
#: The trl stages' optimizer settings that must be > 0 (AdamW divides by its epsilon). A negative learning rate is
#: refused with the counts in `NON_NEGATIVE` (AdamW would climb the loss); 0 is allowed: it trains nothing, on purpose
#: (a test keeps a fitted head where it is so).
POSITIVE = ("adam_epsilon",)


def parse_stage_args(dataclass_types, argv: list[str] | None):
    """Parse `--config FILE` plus `--key value` overrides into the given dataclasses, as trl's scripts do.

    Unknown keys (in the YAML or on the command line) and invalid values raise
    `ConfigError` naming the key and, when there is one, the closest valid key.
    """
    from trl import TrlParser

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = TrlParser(dataclass_types)
    known = {a.dest for a in parser._actions}
    if "--config" in argv:
        import yaml

        at = argv.index("--config") + 1
        if at >= len(argv) or argv[at].startswith("--"):
            raise ConfigError("--config needs a YAML file after it")
        path = argv[at]
        try:
            content = yaml.safe_load(config_text(path)) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]}"
                              + (f", line {err.problem_mark.line + 1}" if getattr(err, "problem_mark", None) else "")
                              + ")") from None
        if not isinstance(content, dict):
            raise ConfigError(f"{path}: the config must be a YAML mapping of key: value")
        unknown = [k for k in content if k not in known and k != "env"]
        if unknown:
            raise ConfigError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))}" + _suggest(unknown, known))
        # the parser takes YAML values as they are (no conversion): check them against the fields' types here
        for key, value in content.items():
            problem = _type_problem(_field_types(dataclass_types).get(key), value)
            if problem:
                raise ConfigError(f"{path}: {key}: {problem}")
    flags = [a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--") and a != "--config"]
    unknown = [f for f in flags if f not in known]
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join('--' + f for f in unknown)}" + _suggest(unknown, known))
    try:
        parsed = parser.parse_args_and_config(argv)
    except SystemExit as err:  # argparse exits on a bad value; turn it into an error a caller can catch
        if not err.code:  # --help printed the options and exits 0: that is no error
            raise
        raise ConfigError(f"invalid configuration value (see the message above): {argv}") from err
    except ValueError as err:  # a config class refusing its own values (trl/transformers __post_init__)
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"invalid configuration: {err}") from None
    for args in parsed:
        # argparse reads `--learning_rate nan` with float(), past the YAML check above; and transformers checks no
        # optimizer setting, so a NaN or negative one failed (or trained nothing) only after the model had loaded
        for name, value in vars(args).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value}")
        for name in POSITIVE:
            value = getattr(args, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
                raise ConfigError(f"{name} must be > 0, got {value}")
        for name in NON_NEGATIVE:  # counts and limits where a negative number would silently mean something else
            value = getattr(args, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
                raise ConfigError(f"{name} must be >= 0 (0 = off or none), got {value}")
        # a trl stage told to train for nothing would save its untrained model and exit 0
        epochs, steps = getattr(args, "num_train_epochs", None), getattr(args, "max_steps", None)
        if epochs is not None and steps is not None and epochs <= 0 and steps <= 0:
            raise ConfigError(f"num_train_epochs={epochs} and max_steps={steps}: nothing would be trained; "
                              "set num_train_epochs > 0 (or max_steps > 0)")
    return parsed


def config_text(path: str, what: str = "config file") -> str:
    """The text of a YAML config file, or a `ConfigError` naming it: missing, a folder (`--config configs/`), not
    readable, or not UTF-8 (the line of the bad byte). Python's own errors (`IsADirectoryError`,
    `UnicodeDecodeError`) were tracebacks that named neither the option nor the line."""
    if not os.path.exists(path):
        raise ConfigError(f"{what} not found: {path}")
    if os.path.isdir(path):
        raise ConfigError(f"{what} {path} is a folder; --config takes a YAML file in it (see `ls {path}`)")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as err:
        raise ConfigError(f"{what} {path} cannot be read ({err.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise ConfigError(f"{path}, line {line}: not UTF-8 text (byte {data[err.start]:#04x}); save the {what} "
                          "as UTF-8") from None


def _field_types(dataclass_types) -> dict:
    """name → type hint of every field of the given dataclasses (types whose hints cannot be resolved are skipped)."""
    import typing

    out = {}
    for cls in dataclass_types:
        try:
            out.update(typing.get_type_hints(cls))
        except Exception:  # noqa: BLE001 - a library's forward reference: its fields go unchecked
            continue
    return out


def _type_problem(hint, value) -> str | None:
    """Why `value` (as YAML gave it) cannot be a field of type `hint`, or None. Only plain hints are judged:
    bool, int, float, str, their Optional forms and list[str]/list[int]; anything else is left to the library."""
    import math
    import types
    import typing

    if hint is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            return None
        return _type_problem(rest[0], value) if value is not None else "must be set (null is not allowed here)"
    if origin is list:
        if not isinstance(value, list):
            return (f"expected a list, got {type(value).__name__} {value!r}"
                    + (f" (write [{value}])" if isinstance(value, str) else ""))
        inner = args[0] if args else None
        bad = [v for v in value if _type_problem(inner, v)]
        return f"every entry must be {getattr(inner, '__name__', inner)}, got {bad[0]!r}" if bad else None
    if hint is bool:
        return None if isinstance(value, bool) else f"expected true or false, got {value!r}"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else f"expected a whole number, got {value!r}"
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"expected a number, got {value!r}"
        return None if math.isfinite(value) else f"expected a finite number, got {value!r}"
    if hint is str:
        return None if isinstance(value, str) else f"expected text, got {type(value).__name__} {value!r}"
    return None


def _suggest(unknown: list[str], known: set[str]) -> str:
    hints = [f"{k!r} → did you mean {m[0]!r}?" for k in unknown if (m := difflib.get_close_matches(k, known, 1))]
    return ("; " + "; ".join(hints)) if hints else ""


def quantization_and_device_map(model_args):
    """trl's own helpers: a `BitsAndBytesConfig` when `load_in_4bit`/`load_in_8bit`, else None."""
    import torch
    from trl import get_quantization_config

    quantization = get_quantization_config(model_args)
    if quantization is None:
        return {}
    # one process, one device: the whole model on it (accelerate's multi-GPU launch sets the rank's device)
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    return {"quantization_config": quantization, "device_map": {"": device}}


def torch_dtype(model_args):
    import torch

    name = model_args.dtype
    if name in (None, "auto"):
        return None if name is None else "auto"
    return getattr(torch, name)


def select_rows(dataset, tokenizer, script_args, kind: str):
    """Apply `max_tokens` and `max_rows` to a prompt/completion or preference dataset, and print what was kept:
    a filter the user asked for, reported, so nothing is dropped silently."""
    total = len(dataset)
    if script_args.max_tokens:
        answers = [k for k in ("completion", "chosen", "rejected") if k in dataset.column_names]
        prompt = [len(ids) for ids in tokenizer(list(dataset["prompt"]))["input_ids"]]
        longest = [0] * total
        for key in answers:  # tokenized in one batched call per column
            longest = [max(n, len(ids)) for n, ids in
                       zip(longest, tokenizer(list(dataset[key]), add_special_tokens=False)["input_ids"])]
        keep = [i for i in range(total) if prompt[i] + longest[i] + 1 <= script_args.max_tokens]  # + EOS
        dataset = dataset.select(keep)
    if script_args.max_rows:
        dataset = dataset.select(range(min(script_args.max_rows, len(dataset))))
    if len(dataset) < total:
        print(f"{kind} data: using {len(dataset)} of {total} rows (max_tokens={script_args.max_tokens or 'off'}, "
              f"max_rows={script_args.max_rows or 'off'})")
    if not len(dataset):
        raise ConfigError(f"{kind} data: no rows left after max_tokens={script_args.max_tokens}")
    return dataset


def append_rows(dataset, extra: list[dict], tokenizer, script_args, what: str, detail: str):
    """`dataset` + the `extra` rows that fit in `max_tokens`, with how many were added printed (preference pairs
    get margin 0 where there is a `margin` column: the pair's rating was for another answer)."""
    from dataclasses import replace

    import datasets

    if "margin" in dataset.column_names:
        extra = [{**p, "margin": 0.0} for p in extra]  # a margin rated another answer
    extra = [{k: p[k] for k in dataset.column_names} for p in extra]
    before = len(extra)
    extra = select_rows(datasets.Dataset.from_list(extra, features=dataset.features), tokenizer,
                        replace(script_args, max_rows=0), what)  # max_rows counted the dataset's rows, not these
    unit = "pairs" if "chosen" in dataset.column_names else "rows"
    print(f"{what}s: added {len(extra)} of {before} candidates ({detail}) to {len(dataset)} {unit}")
    return datasets.concatenate_datasets([dataset, extra])


def with_file_rows(dataset, tokenizer, script_args, key: str, what: str, load):
    """`dataset` followed by the rows of the local file named by `script_args.<key>` (read by `load(path)`) that
    fit in `max_tokens` (those that do not are left out as the dataset's are, and counted in the printed line).
    A bad row is an error naming the key, the file, the row and the field: these rows were written on purpose,
    so `skip_bad_rows` does not apply to them."""
    from marlhf_edu.errors import BadRowError

    path = getattr(script_args, key)
    try:
        extra = load(path).to_list()
    except BadRowError as err:
        raise err.refused_in(f"{key} {path}", hint="fix the row: these rows are never skipped") from None
    return append_rows(dataset, extra, tokenizer, script_args, what, f"from {path}")


def record_base(output_dir, model_ref: str) -> None:
    """Write the model reference a saved adapter was trained on into its `adapter_config.json`, so the adapter
    resolves anywhere (`smollm2`, `zoo`, a hub id) instead of naming this machine's cache directory."""
    import json
    import pathlib

    from marlhf_edu.sources import ModelSource

    path = pathlib.Path(output_dir) / "adapter_config.json"
    if path.exists():
        config = json.loads(path.read_text())
        # a hub model without a pinned revision is recorded as peft writes it (owner/name), so other tools read it
        try:
            source = ModelSource.parse(model_ref)
        except ConfigError:  # after training, a reference that no longer parses is still recorded as written
            source = None
        hub = source is not None and source.kind == "hub" and not source.revision
        config["base_model_name_or_path"] = source.location if hub else str(model_ref)
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


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

    from marlhf_edu.ppo.run_files import RunLock

    check_output_dir(stage, script_args, training_args)
    main_rank = int(os.environ.get("RANK", "0")) == 0
    resuming = resume_checkpoint(stage, training_args) is not None
    with RunLock(training_args.output_dir, enabled=main_rank):
        if script_args.overwrite_output and main_rank and not resuming:
            if removed := remove_run_outputs(training_args.output_dir):
                print(f"{stage}: overwrite_output: removed the replaced run's {', '.join(removed)} from "
                      f"{training_args.output_dir}")
        return run(script_args, training_args, model_args)


def resolve_zoo(path: str, shipped) -> str:
    """`zoo` stands for the shipped tiny model (or adapter) `shipped`; any other path is kept as given."""
    return str(shipped) if path == "zoo" else path


def evaluate_trained_policy(policy, tokenizer, *, toy_seed: int, reward_base: str, reward_adapter: str, repeats: int,
                            max_new_tokens: int, seed: int, output_dir: str | None = None) -> dict:
    """Chapter 11's held-out toy evaluation of a policy trained by trl (DPO, GRPO): refusal rate, accuracy,
    reward-model score, and every answer (`sample_toy` records) under `"samples"`. Written to
    `output_dir/eval_metrics.json` (without the samples) when given."""
    import json

    from marlhf_edu.models import load_reward_model
    from marlhf_edu.ppo import ScoredPolicy, sample_toy
    from marlhf_edu.ppo.backends import quiet_loading
    from marlhf_edu.ppo.trainer import toy_metrics
    from marlhf_edu.toyworld import ToyWorld, ToyWorldConfig

    world = ToyWorld(ToyWorldConfig(seed=toy_seed))
    with quiet_loading():
        reward, reward_tokenizer = load_reward_model(reward_base, reward_adapter)
    backend = ScoredPolicy(policy, reward.to(next(policy.parameters()).device), tokenizer, reward_tokenizer)
    samples = sample_toy(backend, world, repeats, max_new_tokens, seed=seed)
    metrics = toy_metrics(world, samples, repeats)
    metrics["gold"] = sum(s["gold"] for s in samples) / len(samples)
    if output_dir:
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "eval_metrics.json"), "w") as f:
            json.dump(metrics, f, indent=2)
    return {**metrics, "samples": samples}
