"""Every command the documentation shows is run as written, so that a documented command cannot rot (issue: the
engine guide's two-process `accelerate launch` line failed at once, its config not splitting over 2 ranks).

The commands are the lines of the ```bash blocks of README.md, site/*.md, chapters/*.md and chapters/problems/*.md
(backslash continuations joined, `# comments` dropped, leading `VAR=value` / `env -u VAR` and a block's `export`s
applied to the lines after them) that invoke `marlhf-edu ...`, `python -m marlhf_edu.cli ...`,
`accelerate launch ... -m marlhf_edu.cli ...` or `python tools/[experiments/<name>/]<script>.py ...`. Each is a
test of its own, named `file:line`. Every other line of a bash block must be out of scope (`OUT_OF_SCOPE`, with
the reason), so a new kind of command is not passed over silently; a command with a placeholder (`FILE`, `...`)
must be in `SKIPPED`, with the reason.

How each is checked, the strongest way that is cheap (the whole file: well under two minutes on 2 cores):

* `preflight`: run for real (it builds a meta-device model: seconds on a CPU), exit code 0.
* `ppo` / `ma-ppo`: the command as written goes through `marlhf-edu` up to the point where a model would load:
  the config parses and validates (`PPOConfig.validate`), the global batch splits over the launch's ranks
  (`validate_data_parallel`, the world size from `accelerate launch`'s config file or `--num_processes`), and on
  a tiny config (configs/tiny_*.yaml: the shipped zoo models, toy data) `check_before_loading` reads its
  tokenizer, reward adapter and prompts. A one-process command on a tiny config then runs for real, for one short
  step (`SHORT_PPO`; a `--resume true` line resumes a run made just before it).
* `pipeline`: the pipeline file loads, its stages are wired, every stage's config parses and validates and every
  data file and output folder is checked (`run_pipeline`, stopped where the first stage would start); the PPO
  stage's batch splits over the launch's ranks. On a machine without a GPU, `--STAGE.use_cpu true` is added to the
  trl stages (transformers refuses `bf16` where no GPU is visible; nothing it plans depends on it).
* `sft` / `rm`, `evaluate`, `generate`, `merge` on models that are not here (the gated 7B, `runs/...` folders an
  earlier step writes): the real command, stopped where it would first read a model (`STOP_AT`); every check of
  its arguments before that runs. `zoo rebuild`: the real command, stopped before it trains, then the configs the
  rebuild reads parse.
* `python tools/X.py ...`: the script exists and its own argparse parser accepts the arguments (stopped right
  after parsing).
* any other `marlhf-edu` command: `COMMAND --help` succeeds and names every option the line passes.

The two-process command is run for real by tests/test_distributed.py; here it is checked as above, with world size 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCUMENTS = ["README.md", "site/*.md", "chapters/*.md", "chapters/problems/*.md"]
SHELL_FENCES = ("bash", "sh", "shell", "console")

#: First word of a bash line that is not a command this file checks → why not.
OUT_OF_SCOPE = {
    "make": "a Makefile target (installs the stack, builds the book, runs the whole suite: minutes to hours); "
            "tests/test_readme.py checks that every target the README names exists",
    ".": "activates the virtual environment these tests already run in",
    "source": "activates the virtual environment these tests already run in",
    "hf": "downloads from the Hugging Face hub: needs the network (and, for Llama-2, a gated-model licence)",
    "huggingface-cli": "downloads from the Hugging Face hub: needs the network",
}
#: Documented commands (exact text, comments dropped, continuations joined) not run → why. Only for a line that
#: cannot be run as written (a placeholder such as FILE, DIR, NAME, `...`, `[--flag]`).
SKIPPED: dict[str, str] = {}
PLACEHOLDER = re.compile(r"^(\.\.\.|FILE|DIR|NAME|PATH|MODEL|CONFIG|\[.*|.*\.\.\..*|<.+>)$")

#: What makes a one-process PPO command on a tiny config a one-step run of a few seconds (the shapes of
#: tests/test_checks_before_loading.py); the command as written is validated before, without these.
SHORT_PPO = ["--batch_size", "8", "--mini_batch_size", "4", "--micro_batch_size", "2", "--forward_batch_size", "8",
             "--max_new_tokens", "8", "--eval_repeats", "0", "--eval_every", "0", "--total_steps", "1"]


@dataclasses.dataclass
class Command:
    where: str             # file:line of the command's first line
    text: str              # as documented, continuations joined, comment dropped
    kind: str              # "cli", "launch" or "tool"
    argv: list[str]        # the cli's argv (after `marlhf-edu`), the launcher's or the tool's arguments
    env: dict              # name → value (None: unset) from leading assignments, `env -u` and the block's exports


class Reached(Exception):
    """Raised where a command would load a model or start its work: everything before it has checked out."""


def strip_comment(line: str) -> str:
    """`line` without its `# comment` (a `#` at the start or after a space, outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def bash_lines(path: pathlib.Path) -> list[tuple[int, str, int]]:
    """`(line number, command text, block number)` of every non-empty line of `path`'s shell code blocks."""
    out, block, inside, pending, start = [], 0, False, "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("```"):
            if inside:
                inside = False
            elif stripped[3:].strip().split()[:1] and stripped[3:].strip().split()[0] in SHELL_FENCES:
                inside, block = True, block + 1
            continue
        if not inside:
            continue
        text = strip_comment(raw).rstrip()
        if not pending:
            start = number
        if text.endswith("\\"):
            pending += text[:-1].strip() + " "
            continue
        text = (pending + text.strip()).strip()
        pending = ""
        if text:
            out.append((start, text, block))
    return out


def classify(text: str, exports: dict):
    """`("command", Command fields)`, `("export", {name: value})`, `("out of scope", reason)` or `("unknown", text)`."""
    tokens = shlex.split(text)
    env = dict(exports)
    if tokens[0] == "export":
        return "export", dict(t.split("=", 1) for t in tokens[1:] if "=" in t)
    while tokens and (re.match(r"^[A-Za-z_]\w*=", tokens[0]) or tokens[0] == "env"):
        if tokens[0] == "env":
            tokens.pop(0)
            while tokens and tokens[0] == "-u":
                env[tokens[1]] = None
                del tokens[:2]
            continue
        name, value = tokens.pop(0).split("=", 1)
        env[name] = value
    python = ("python", "python3")
    if tokens[0] == "marlhf-edu":
        return "command", ("cli", tokens[1:], env)
    if tokens[0] in python and tokens[1:3] == ["-m", "marlhf_edu.cli"]:
        return "command", ("cli", tokens[3:], env)
    if tokens[:2] == ["accelerate", "launch"]:
        return "command", ("launch", tokens[2:], env)
    if tokens[0] in python and len(tokens) > 1 and re.match(r"^tools/[\w/-]+\.py$", tokens[1]):
        return "command", ("tool", tokens[1:], env)
    if tokens[0] in OUT_OF_SCOPE:
        return "out of scope", OUT_OF_SCOPE[tokens[0]]
    return "unknown", text


def documented():
    """`(commands, unknown lines)` of every document, in order."""
    commands, unknown = [], []
    files = [p for pattern in DOCUMENTS for p in sorted(ROOT.glob(pattern))]
    for path in files:
        exports, current = {}, 0
        for number, text, block in bash_lines(path):
            if block != current:
                exports, current = {}, block
            where = f"{path.relative_to(ROOT)}:{number}"
            what, value = classify(text, exports)
            if what == "export":
                exports.update(value)
            elif what == "command":
                commands.append(Command(where, text, *value))
            elif what == "unknown":
                unknown.append(f"{where}: {text}")
    return commands, unknown


COMMANDS, UNKNOWN = documented()


# ---------------------------------------------------------------------------------------------------------- helpers

def option(argv: list[str], name: str, default=None):
    return argv[argv.index(name) + 1] if name in argv and argv.index(name) + 1 < len(argv) else default


def without(argv: list[str], name: str, values: int = 1) -> list[str]:
    if name not in argv:
        return list(argv)
    i = argv.index(name)
    return argv[:i] + argv[i + 1 + values:]


def stop_at(monkeypatch, module: str, name: str, wrap=None):
    """Replace `module.name` (or `module.Class.method` for a `name` with a dot) by a function that raises `Reached`
    (after calling `wrap(*args)` when given)."""
    def stop(*args, **kwargs):
        if wrap is not None:
            wrap(*args, **kwargs)
        raise Reached(f"{module}.{name}")

    owner, _, attribute = name.rpartition(".")
    target = importlib.import_module(module)
    monkeypatch.setattr(getattr(target, owner) if owner else target, attribute, stop)


def cli_until_reached(command: Command, argv: list[str], capsys) -> None:
    """Run `marlhf-edu argv` and require it to reach the stop (`Reached`) with no error before it."""
    from marlhf_edu import cli

    try:
        code = cli.main(argv)
    except Reached:
        return
    except SystemExit as err:
        pytest.fail(f"{command.where}: `{command.text}` exits ({err.code}) before loading anything:\n"
                    f"{capsys.readouterr().err[-3000:]}")
    err = capsys.readouterr().err
    pytest.fail(f"{command.where}: `{command.text}` "
                + (f"is refused (exit code {code}):\n{err[-3000:]}" if code else "ran to the end without reaching "
                   "the point where it loads a model (this test's stop is out of date)"))


def cli_runs(command: Command, argv: list[str], capsys) -> None:
    from marlhf_edu import cli

    try:
        code = cli.main(argv)
    except SystemExit as err:
        code = err.code
    if code:
        pytest.fail(f"{command.where}: `{command.text}` failed (exit code {code}; run as marlhf-edu "
                    f"{shlex.join(argv)}):\n{capsys.readouterr().err[-3000:]}")


def refuse(command: Command, what: str):
    pytest.fail(f"{command.where}: `{command.text}`: {what}")


def tiny_config(argv: list[str]) -> bool:
    """A config of the tiny runs (configs/tiny_*.yaml): the shipped zoo models and the toy world, all here."""
    config = option(argv, "--config", "")
    return bool(re.match(r"^configs/tiny_\w+\.yaml$", config))


# ----------------------------------------------------------------------------------------------------- the checks

def check_ppo(command, argv, world_size, tmp_path, monkeypatch, capsys):
    from marlhf_edu.ppo import run as ppo_run

    local = tiny_config(argv)
    original = ppo_run.check_before_loading
    seen = {}

    def checked(config, engine=ppo_run.FourModelBackend):
        seen["config"] = config
        config.validate_data_parallel(world_size)  # what `_run` checks once the ranks have joined
        if not local:  # its models and data are not here: stop before reading them
            raise Reached("check_before_loading")
        return original(config, engine)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ppo_run, "check_before_loading", checked)
        stop_at(mp, "marlhf_edu.ppo.run", "RunLock")  # past every check before loading, nothing written
        cli_until_reached(command, [*argv, "--output_dir", str(tmp_path / "as_written")], capsys)
    assert "config" in seen, f"{command.where}: the PPO stage never reached check_before_loading"
    if not local or world_size > 1:  # a data-parallel launch runs in tests/test_distributed.py
        return
    out = ["--output_dir", str(tmp_path / "run")]
    if option(argv, "--resume") == "true":  # a run to resume first
        cli_runs(command, [*without(argv, "--resume"), *SHORT_PPO, *out], capsys)
    cli_runs(command, [*argv, *SHORT_PPO, *out], capsys)
    assert (tmp_path / "run" / "policy").is_dir()


def check_pipeline(command, argv, world_size, tmp_path, monkeypatch, capsys):
    import torch

    from marlhf_edu.training import pipeline_file as pipeline

    path = option(argv, "--config")
    if path is None:
        refuse(command, "no --config PIPELINE.yaml")
    rest = without(argv[1:], "--config")
    stages, _ = pipeline.load_pipeline(path, [])
    extra = []
    for stage in stages:  # its output folders here, so that nothing in the repository is read as a run
        extra += [f"--{stage.name}.output_dir", str(tmp_path / stage.name)]
        if stage.kind != "ppo" and not torch.cuda.is_available():
            extra += [f"--{stage.name}.use_cpu", "true"]
    with pytest.MonkeyPatch.context() as mp:
        stop_at(mp, "marlhf_edu.stages.pipeline", "resume_argv")  # where the first stage would start
        cli_until_reached(command, [*argv, *extra], capsys)
    stages, _ = pipeline.load_pipeline(path, [*rest, *extra])
    pipeline.wire(stages)
    for stage in stages:
        if stage.kind == "ppo":
            try:
                stage.parse()[0].validate_data_parallel(world_size)
            except Exception as err:  # noqa: BLE001 - named with the line
                refuse(command, f"its {stage.name} stage cannot run on {world_size} ranks: {err}")


def check_trl_stage(command, argv, world_size, tmp_path, monkeypatch, capsys):
    import torch

    extra = ["--output_dir", str(tmp_path / "out")]
    if not torch.cuda.is_available():
        extra += ["--use_cpu", "true"]
    for module in ("marlhf_edu.training.sft", "marlhf_edu.training.reward"):  # the first thing run_sft / run_rm load
        stop_at(monkeypatch, module, "load_tokenizer")
    cli_until_reached(command, [*argv, *extra], capsys)


def check_zoo(command, argv, world_size, tmp_path, monkeypatch, capsys):
    import torch
    from trl import ModelConfig, RewardConfig, SFTConfig

    from marlhf_edu.training.args import parse_stage_args
    from marlhf_edu.training.reward import RMScriptArguments
    from marlhf_edu.training.sft import SFTScriptArguments

    seen = {}
    for name in ("rebuild", "rebuild_smollm2"):
        stop_at(monkeypatch, "marlhf_edu.stages.zoo", name, wrap=lambda configs, out, work, name=name:
                seen.update(which=name, configs=configs))
    cli_until_reached(command, argv, capsys)
    sub = "smollm2" if seen["which"] == "rebuild_smollm2" else ""
    cpu = [] if torch.cuda.is_available() else ["--use_cpu", "true"]
    for types, config in (((SFTScriptArguments, SFTConfig, ModelConfig), "sft"),
                          ((RMScriptArguments, RewardConfig, ModelConfig), "rm")):
        path = seen["configs"] / sub / (f"{config}.yaml" if sub else f"tiny_{config}.yaml")
        if path.exists() or sub:
            parse_stage_args(types, ["--config", str(path), "--output_dir", str(tmp_path / config), *cpu])


#: The first model read of a command on models that are not here: the command runs up to it.
STOP_AT = {
    "evaluate": ("marlhf_edu.stages.evaluate", "RewardAdapter.resolve"),  # after its arguments, device and dtype
    "generate": ("marlhf_edu.stages.generate", "load_sft_model"),
    "merge": ("marlhf_edu.stages.merge", "resolve_device"),  # after its arguments, before the adapter folder is read
}


def check_stopped(command, argv, world_size, tmp_path, monkeypatch, capsys):
    stop_at(monkeypatch, *STOP_AT[argv[0]])
    cli_until_reached(command, argv, capsys)


def check_preflight(command, argv, world_size, tmp_path, monkeypatch, capsys):
    cli_runs(command, argv, capsys)


def check_by_help(command, argv, world_size, tmp_path, monkeypatch, capsys):
    from marlhf_edu import cli

    if argv[0] not in cli.COMMANDS:
        refuse(command, f"marlhf-edu has no command {argv[0]!r} (its commands: {', '.join(cli.COMMANDS)})")
    assert cli.main([argv[0], "--help"]) == 0
    shown = capsys.readouterr().out
    missing = [a for a in argv[1:] if a.startswith("--") and a.split("=")[0] not in shown]
    if missing:
        refuse(command, f"`marlhf-edu {argv[0]} --help` names no {', '.join(missing)}")


CHECKS = {"ppo": check_ppo, "ma-ppo": check_ppo, "pipeline": check_pipeline, "sft": check_trl_stage,
          "rm": check_trl_stage, "zoo": check_zoo, "preflight": check_preflight,
          **{name: check_stopped for name in STOP_AT}}


def check_cli(command, argv, world_size, tmp_path, monkeypatch, capsys):
    if not argv:
        refuse(command, "no marlhf-edu command")
    CHECKS.get(argv[0], check_by_help)(command, argv, world_size, tmp_path, monkeypatch, capsys)


def check_launch(command, tmp_path, monkeypatch, capsys):
    """`accelerate launch`'s own parser takes the launcher's options; its config file loads; the module is the cli."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    try:
        args = launch_command_parser().parse_args(command.argv)
    except SystemExit:
        refuse(command, f"`accelerate launch` refuses its options:\n{capsys.readouterr().err[-2000:]}")
    if not (args.module and args.training_script == "marlhf_edu.cli"):
        refuse(command, "launches something other than `-m marlhf_edu.cli`")
    world_size = args.num_processes
    if args.config_file:
        if not (ROOT / args.config_file).is_file():
            refuse(command, f"no accelerate config file {args.config_file}")
        world_size = world_size or load_config_from_file(args.config_file).num_processes
    check_cli(command, list(args.training_script_args), world_size or 1, tmp_path, monkeypatch, capsys)


def check_tool(command, monkeypatch, capsys):
    """The script exists and its argparse parser accepts the arguments (the tool stops right after parsing)."""
    script = ROOT / command.argv[0]
    if not script.is_file():
        refuse(command, f"no {command.argv[0]}")
    monkeypatch.syspath_prepend(str(script.parent))
    module = importlib.import_module(script.stem)
    if not hasattr(module, "main"):
        refuse(command, f"{command.argv[0]} has no main(argv) to check its arguments with")
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        parse(self, args, namespace)
        raise Reached("parse_args")

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    try:
        module.main(command.argv[1:])
    except Reached:
        return
    except SystemExit as err:
        refuse(command, f"its arguments are refused (exit {err.code}):\n{capsys.readouterr().err[-2000:]}")
    refuse(command, f"{command.argv[0]} ran to the end without parsing arguments with argparse")


def check(command: Command, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(ROOT)  # the documented paths are relative to the repository
    for name, value in command.env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    placeholders = [t for t in shlex.split(command.text) if PLACEHOLDER.match(t)]
    if placeholders:
        refuse(command, f"placeholder(s) {placeholders}: make the line runnable, or add it to SKIPPED with the reason")
    try:
        if command.kind == "launch":
            check_launch(command, tmp_path, monkeypatch, capsys)
        elif command.kind == "tool":
            check_tool(command, monkeypatch, capsys)
        else:
            check_cli(command, command.argv, 1, tmp_path, monkeypatch, capsys)
    except (Exception, SystemExit) as err:  # noqa: BLE001 - whatever refused it, named with the line
        refuse(command, f"{err.__class__.__name__}: {err}")


# ------------------------------------------------------------------------------------------------------ the tests

@pytest.mark.parametrize("command", [c for c in COMMANDS if c.text not in SKIPPED], ids=lambda c: c.where)
def test_documented_command_runs_as_written(command, tmp_path, monkeypatch, capsys):
    check(command, tmp_path, monkeypatch, capsys)


def test_every_shell_line_is_checked_or_out_of_scope():
    assert not UNKNOWN, ("bash lines that are neither a command this file checks nor out of scope (OUT_OF_SCOPE): "
                         + "; ".join(UNKNOWN))


def test_the_collector_finds_the_documented_commands():
    assert len(COMMANDS) >= 20
    kinds = {c.kind for c in COMMANDS}
    assert kinds == {"cli", "launch", "tool"}
    two_process = [c for c in COMMANDS if "cpu_2proc.yaml" in c.text]
    assert two_process and two_process[0].where.startswith("site/engine.md:")
    assert "--micro_batch_size 8" in two_process[0].text  # continuation joined
    readme_pipeline = [c for c in COMMANDS if c.where.startswith("README.md") and c.argv[:1] == ["pipeline"]]
    assert readme_pipeline and readme_pipeline[0].env == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    exported = [c for c in COMMANDS if c.where.startswith("site/engine.md") and c.argv[:1] == ["evaluate"]]
    assert exported[0].env.get("PYTORCH_CUDA_ALLOC_CONF") == "expandable_segments:True"  # the block's export
    assert not [t for t in SKIPPED if t not in {c.text for c in COMMANDS}], "SKIPPED names a line no document has"


@pytest.mark.parametrize("text,because", [
    # the engine guide's line before its fix: 16-row minibatches of micro_batch_size 16 do not split over 2 ranks
    ("accelerate launch --config_file configs/accelerate/cpu_2proc.yaml -m marlhf_edu.cli ma-ppo "
     "--config configs/tiny_ma_ppo.yaml --rollout_seeding per_chunk", "mini_batch_size"),
    ("marlhf-edu ma-ppo --config configs/llama2_7b/ma_ppo.yaml --totl_steps 5", "totl_steps"),
    ("accelerate launch --config_file configs/accelerate/ddp_4gpu.yaml -m marlhf_edu.cli pipeline "
     "--config configs/llama2_7b/pipeline.yaml --ma-ppo.batch_size 66", "batch_size"),
    ("marlhf-edu merge --adapter runs/x/policy --output_dir runs/x/merged --dtype bf16", "dtype"),
    ("python tools/gpu_check.py ppo --outt my_gpu.json", "--outt"),
])
def test_a_broken_command_fails_naming_its_line(text, because, tmp_path, monkeypatch, capsys):
    (what, value) = classify(text, {})
    command = Command("doc.md:7", text, *value)
    with pytest.raises(pytest.fail.Exception) as failed:
        check(command, tmp_path, monkeypatch, capsys)
    message = str(failed.value)
    assert message.startswith(f"doc.md:7: `{text}`")  # names where the command is documented
    assert because in message.replace(text, "")  # and why it is refused
