"""The pipeline file (`marlhf-edu pipeline --config FILE`): its stages in order, each with its own config and
overrides (`load_pipeline`, `Stage`), the command line's `--STAGE.KEY VALUE` split per stage (`split_cli`), and
the wiring of each stage's output into the next (`wire`). `marlhf-edu preflight` reads the same files."""

from __future__ import annotations

import os
import pathlib

from marlhf_edu.errors import ConfigError
from marlhf_edu.ppo.config import PPOConfig
from marlhf_edu.training.args import config_text, parse_stage_args
from marlhf_edu.training.reward import RMScriptArguments
from marlhf_edu.training.sft import SFTScriptArguments

#: stage name → (module with `main(argv)`, the kind of config it parses: `_config_types`)
STAGES = {
    "sft": ("marlhf_edu.stages.sft", "sft"),
    "rm": ("marlhf_edu.stages.reward", "rm"),
    "ppo": ("marlhf_edu.stages.ppo", "ppo"),
    "ma-ppo": ("marlhf_edu.stages.ma_ppo", "ppo"),
}


def _config_types(kind: str):
    if kind == "ppo":
        return (PPOConfig,)
    from trl import ModelConfig

    if kind == "sft":
        from trl import SFTConfig

        return (SFTScriptArguments, SFTConfig, ModelConfig)
    from trl import RewardConfig

    return (RMScriptArguments, RewardConfig, ModelConfig)


def _as_argv(overrides: dict) -> list[str]:
    argv = []
    for key, value in overrides.items():
        if value is None:
            raise ConfigError(f"override {key}: null cannot be passed on; set it in the stage's own config")
        if isinstance(value, (list, tuple)):
            argv += [f"--{key}", *map(str, value)]
        elif isinstance(value, bool):
            argv += [f"--{key}", "true" if value else "false"]
        else:
            argv += [f"--{key}", str(value)]
    return argv


def split_cli(argv: list[str], names) -> tuple[dict[str, list[str]], list[str]]:
    """`--STAGE.KEY V...` → {STAGE: ["--KEY", "V", ...]}; the rest is returned for the pipeline's own options."""

    per_stage, rest, current = {}, [], None
    for token in argv:
        if token.startswith("--") and "." in token:
            stage, key = token[2:].split(".", 1)
            if stage not in names:
                raise ConfigError(f"{token}: no stage {stage!r} in this pipeline (its stages: {', '.join(names)})")
            current = per_stage.setdefault(stage, [])
            current.append(f"--{key}")
        elif token.startswith("--"):
            current = rest
            rest.append(token)
        elif current is None:
            raise ConfigError(f"pipeline: unexpected argument {token!r}")
        else:
            current.append(token)
    return per_stage, rest


class Stage:
    """One stage of a pipeline: its name, command, config file and the argv it runs with."""

    def __init__(self, name: str, config: str, argv: list[str]):
        self.name, self.config, self.argv = name, config, argv
        self.module, self.kind = STAGES[name]

    def parse(self):
        parsed = parse_stage_args(_config_types(self.kind), ["--config", self.config, *self.argv])
        if self.kind == "ppo":
            # under `accelerate launch` the split over ranks is known before any stage runs: refuse a bad one now,
            # not after hours of SFT and reward-model training
            parsed[0].validate().validate_data_parallel(int(os.environ.get("WORLD_SIZE", "1")))
        return parsed

    def output_dir(self, parsed) -> pathlib.Path:
        """Where the stage writes: `output_dir` of its PPOConfig, or of its trl training arguments."""
        return pathlib.Path(parsed[0 if self.kind == "ppo" else 1].output_dir)

    def set(self, key: str, value: str) -> None:
        self.argv += [f"--{key}", value]


def load_pipeline(path: str, cli: list[str]) -> tuple[list[Stage], list[str]]:
    """The stages of pipeline file `path` with the file's and the command line's overrides, and the remaining
    command-line options."""
    import yaml

    try:
        spec = yaml.safe_load(config_text(path, "pipeline file")) or {}
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        raise ConfigError(f"{path}{f', line {where.line + 1}' if where else ''}: not valid YAML "
                          f"({getattr(err, 'problem', None) or err})") from None
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: a pipeline file is a mapping with 'stages' (and optionally 'overrides'), "
                          f"not a {type(spec).__name__}")
    unknown = set(spec) - {"stages", "overrides"}
    if unknown or not isinstance(spec.get("stages"), dict) or not spec["stages"]:
        raise ConfigError(f"{path}: a pipeline file has a 'stages' mapping (stage: config file) and optionally "
                          f"'overrides'; got keys {sorted(spec)}")
    names = list(spec["stages"])
    bad = [n for n in names if n not in STAGES]
    if bad:
        raise ConfigError(f"{path}: unknown stage(s) {bad}; stages are {', '.join(STAGES)}")
    if sum(n in ("ppo", "ma-ppo") for n in names) > 1:
        raise ConfigError(f"{path}: one PPO stage per pipeline (ppo or ma-ppo)")
    order = [n for n in STAGES if n in names]
    if names != order:
        raise ConfigError(f"{path}: stages run in the order sft, rm, ppo/ma-ppo; got {names}")
    file_overrides = spec.get("overrides") or {}
    if not isinstance(file_overrides, dict) or any(not isinstance(v, (dict, type(None))) for v in file_overrides.values()):
        raise ConfigError(f"{path}: 'overrides' maps each stage to its keys and values (sft: {{max_steps: 10}}); "
                          f"got {file_overrides!r}")
    bad_config = [n for n in names if not isinstance(spec["stages"][n], str)]
    if bad_config:
        raise ConfigError(f"{path}: stage(s) {bad_config} need a config file path, as in 'sft: configs/tiny_sft.yaml'")
    extra = set(file_overrides) - set(names)
    if extra:
        raise ConfigError(f"{path}: overrides for stage(s) {sorted(extra)} that the pipeline does not run")
    per_stage, rest = split_cli(cli, names)
    stages = [Stage(n, str(spec["stages"][n]), _as_argv(file_overrides.get(n) or {}) + per_stage.get(n, []))
              for n in names]
    return stages, rest


def wire(stages: list[Stage]) -> dict[str, str]:
    """Point each stage at the outputs of the stages before it; returns {"stage.key": path} of what was set."""
    by_name = {s.name: s for s in stages}
    outputs = {s.name: str(s.output_dir(s.parse())) for s in stages}
    wiring = {}
    if "sft" in by_name and "rm" in by_name:
        wiring["rm.model_name_or_path"] = outputs["sft"]
    for ppo in ("ppo", "ma-ppo"):
        if ppo in by_name:
            if "sft" in by_name:
                wiring[f"{ppo}.sft_model_path"] = outputs["sft"]
                if ppo == "ppo":  # four models: the reward adapter's base is loaded on its own
                    wiring["ppo.reward_base_path"] = outputs["sft"]
            if "rm" in by_name:
                wiring[f"{ppo}.reward_adapter_path"] = outputs["rm"]
    for target, value in wiring.items():
        name, key = target.split(".", 1)
        by_name[name].set(key, value)
    return wiring
