"""Issue 37, items 2 and 3: a launch into a folder that holds a run is refused before anything is loaded or
written, and a resume refuses settings that differ from the checkpoint's (naming each), applying only the
overrides it is told to."""

import json
import pathlib

import pytest
import torch

from marlhf_edu.errors import ConfigError
from marlhf_edu.ppo import PPOConfig
from marlhf_edu.stages.ppo import main as ppo_main

TINY = ["--batch_size", "8", "--mini_batch_size", "4", "--micro_batch_size", "2", "--forward_batch_size", "8",
        "--max_new_tokens", "8", "--device", "cpu", "--eval_repeats", "1", "--save_steps", "1",
        "--learning_rate", "3e-5"]


def never_loaded(config, reward=None):
    raise AssertionError("a model was loaded before the run folder was checked")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "ppo"
    ppo_main([*TINY, "--total_steps", "2", "--output_dir", str(out)], progress=False)
    return out


def _snapshot(out):
    return {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}


def test_a_repeated_launch_is_refused_before_loading_or_writing_anything(finished_run):
    before = _snapshot(finished_run)
    assert "eval_samples.jsonl" in before and b'"after"' in before["eval_samples.jsonl"]
    with pytest.raises(ConfigError, match="already holds a run"):
        ppo_main([*TINY, "--total_steps", "2", "--output_dir", str(finished_run)], backend_factory=never_loaded,
                 progress=False)
    assert _snapshot(finished_run) == before  # the "after" answers and eval.json untouched


def test_a_repeated_launch_is_refused_before_the_tokenizer_or_the_prompts_are_read(finished_run, monkeypatch):
    # resolving the policy's tokenizer can convert a GGUF file (SmolLM2: about 30 s and 517 MB): not for a run
    # that will be refused anyway
    import marlhf_edu.ppo.run

    def no_tokenizer(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded before the run folder was checked")

    monkeypatch.setattr(marlhf_edu.ppo.run, "load_tokenizer", no_tokenizer)  # the checks before loading read it
    with pytest.raises(ConfigError, match="already holds a run"):
        ppo_main([*TINY, "--total_steps", "2", "--output_dir", str(finished_run)], backend_factory=never_loaded,
                 progress=False)


def test_a_resume_with_unreadable_records_or_another_world_size_is_refused_before_loading(finished_run, monkeypatch):
    """A line in the middle of metrics.jsonl that does not parse (only a last line cut off by a kill is ignored),
    and a resume under another number of ranks, were found after every model had loaded; the first as a bare
    ValueError (issue 37 items 10, 12)."""
    from marlhf_edu.errors import DataFileError

    from marlhf_edu.ppo.distributed import DataParallel

    def no_joining(*args, **kwargs):  # a check that came too late would join a 2-rank run and wait forever
        raise AssertionError("the run tried to join a data-parallel group before refusing the resume")

    monkeypatch.setattr(DataParallel, "from_environment", no_joining)
    resume = [*TINY, "--total_steps", "3", "--output_dir", str(finished_run), "--resume", "true"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"written by a run on 1 rank\(s\), this one has 2"):
        ppo_main(resume, backend_factory=never_loaded, progress=False)
    monkeypatch.delenv("WORLD_SIZE")
    metrics = finished_run / "metrics.jsonl"
    good = metrics.read_text()
    lines = good.splitlines()
    try:
        metrics.write_text("\n".join([lines[0][:-5], *lines[1:]]) + "\n")  # the first record cut short
        with pytest.raises(DataFileError, match=r"metrics.jsonl, line 1: not a JSON record .* repair or remove"):
            ppo_main(resume, backend_factory=never_loaded, progress=False)
    finally:
        metrics.write_text(good)


def test_resume_refuses_changed_settings_naming_each(finished_run):
    before = _snapshot(finished_run)
    with pytest.raises(ConfigError) as err:
        ppo_main([*TINY, "--total_steps", "3", "--output_dir", str(finished_run), "--resume", "true",
                  "--learning_rate", "0.5", "--batch_size", "16", "--mini_batch_size", "8", "--seed", "3",
                  "--toy_seed", "1"], backend_factory=never_loaded, progress=False)
    message = str(err.value)
    for line in ("learning_rate: checkpoint 3e-05, now 0.5 (or name it in resume_overrides)",
                 "batch_size: checkpoint 8, now 16", "seed: checkpoint 0, now 3", "toy_seed: checkpoint 0, now 1"):
        assert line in message
    assert "total_steps" not in message  # may change
    assert _snapshot(finished_run) == before


def test_resume_with_an_override_applies_it_for_real(tmp_path):
    out = tmp_path / "ppo"
    fixed_kl = ["--adaptive_kl", "false", "--eval_repeats", "0"]
    ppo_main([*TINY, *fixed_kl, "--total_steps", "1", "--output_dir", str(out)], progress=False)
    result = ppo_main([*TINY, *fixed_kl, "--total_steps", "2", "--output_dir", str(out),
                       "--resume", "true", "--learning_rate", "1e-4", "--kl_coef", "0.05",
                       "--resume_overrides", "learning_rate", "kl_coef"], progress=False)
    trainer = result["trainer"]
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [1e-4, 1e-4]  # policy and value
    state = json.loads((out / "checkpoints" / "step-000002" / "state.json").read_text())
    assert state["config"]["learning_rate"] == 1e-4 and state["step"] == 2
    assert trainer.kl_controller.value == 0.05  # the checkpoint's controller held 0.2
    with pytest.raises(ConfigError, match="'batch_size' cannot be changed on resume"):
        PPOConfig(resume=True, resume_overrides=["batch_size"]).validate()
    with pytest.raises(ConfigError, match="needs resume: true"):
        PPOConfig(resume_overrides=["kl_coef"]).validate()


def _steps(out):
    from marlhf_edu.ppo import read_metrics
    from marlhf_edu.ppo.trainer import TIMING_KEYS

    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(out / "metrics.jsonl")]


@pytest.mark.parametrize("damage", ["zeroed 4 KiB in the weights", "truncated optimizer", "broken state.json"])
@pytest.mark.slow
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage, capsys):
    """Issue 37 item 10: every file carries a sha256; a damaged latest checkpoint is skipped (said so) and the run
    resumes from the one before, ending exactly where the undamaged run ends."""
    args = [*TINY, "--eval_repeats", "0", "--total_steps", "3"]
    straight, damaged = tmp_path / "straight", tmp_path / "damaged"
    ppo_main([*args, "--output_dir", str(straight)], progress=False)
    ppo_main([*args, "--output_dir", str(damaged)], progress=False)
    latest = damaged / "checkpoints" / "step-000003"
    state = json.loads((latest / "state.json").read_text())
    assert {"trainable.safetensors", "optimizer.pt", "rng.pt"} <= set(state["sha256"])
    if damage.startswith("zeroed"):
        data = bytearray((latest / "trainable.safetensors").read_bytes())
        data[-6000:-6000 + 4096] = bytes(4096)  # inside the tensor data: the file still loads, with wrong values
        (latest / "trainable.safetensors").write_bytes(bytes(data))
    elif damage.startswith("truncated"):
        (latest / "optimizer.pt").write_bytes((latest / "optimizer.pt").read_bytes()[:100])
    else:
        (latest / "state.json").write_text("{\"step\": 3,")
    with open(damaged / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "score/me')  # a line half-written by a kill
    ppo_main([*args, "--output_dir", str(damaged), "--resume", "true"], progress=False)
    assert "skipping damaged checkpoint step-000003" in capsys.readouterr().out
    a, b = _steps(straight), _steps(damaged)
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        for key in ra:
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)


def test_no_usable_checkpoint_is_a_clear_error(tmp_path):
    out = tmp_path / "ppo"
    ppo_main([*TINY, "--eval_repeats", "0", "--total_steps", "1", "--output_dir", str(out)], progress=False)
    (out / "checkpoints" / "step-000001" / "rng.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="(?s)no usable checkpoint.*rng.pt does not match its recorded sha256"):
        ppo_main([*TINY, "--eval_repeats", "0", "--total_steps", "2", "--output_dir", str(out), "--resume", "true"],
                 backend_factory=never_loaded, progress=False)


def test_a_second_writer_is_refused_while_the_first_holds_the_folder(tmp_path):
    """Issue 37 item 7: two processes must not write one run folder."""
    import fcntl
    import os

    out = tmp_path / "ppo"
    out.mkdir()
    fd = os.open(out / ".lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a running run holds
    try:
        with pytest.raises(ConfigError, match="being written by another process"):
            ppo_main([*TINY, "--total_steps", "1", "--output_dir", str(out)], backend_factory=never_loaded,
                     progress=False)
    finally:
        os.close(fd)
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing written by the refused launch


def test_the_lock_is_held_for_the_whole_run_and_checkpoints_reach_the_disk_before_their_renames(tmp_path,
                                                                                                  monkeypatch):
    """Issue 37 items 7, 13: the folder is locked while the run trains and writes (checked from inside the run,
    at its last write), and every file of a checkpoint, and the `latest` pointer, is fsynced before the rename
    that publishes it, the folder after."""
    import os

    from conftest import held_by_another

    import marlhf_edu.ppo.run_files as run_files
    import marlhf_edu.ppo.trainer as trainer_module
    import marlhf_edu.ppo.run as ppo_stage

    out = tmp_path / "ppo"
    events, seen = [], {}
    real_fsync, real_replace, real_export = run_files.fsync_path, os.replace, ppo_stage.export_policy

    def fsync(path):
        events.append(("fsync", pathlib.Path(path).name))
        real_fsync(path)

    def replace(src, dst):
        events.append(("replace", pathlib.Path(src).name, pathlib.Path(dst).name))
        real_replace(src, dst)

    def export(*args, **kwargs):  # the run's last write
        seen["held"] = held_by_another(out / ".lock")
        return real_export(*args, **kwargs)

    monkeypatch.setattr(run_files, "fsync_path", fsync)
    monkeypatch.setattr(trainer_module, "fsync_path", fsync)
    monkeypatch.setattr(trainer_module.os, "replace", replace)
    monkeypatch.setattr(ppo_stage, "export_policy", export)
    ppo_main([*TINY, "--total_steps", "1", "--eval_repeats", "0", "--output_dir", str(out)], progress=False)
    assert seen == {"held": True}
    publish = events.index(("replace", "step-000001.tmp", "step-000001"))
    files = {"trainable.safetensors", "optimizer.pt", "rng.pt", "state.json"}
    assert files | {"step-000001.tmp"} <= {e[1] for e in events[:publish] if e[0] == "fsync"}
    pointer = events.index(("replace", "latest.tmp", "latest"))
    assert ("fsync", "latest.tmp") in events[publish:pointer] and ("fsync", "checkpoints") in events[pointer:]


@pytest.mark.parametrize("line, message", [
    ("total_steps: [2]", "total_steps: expected a whole number, got [2]"),
    ("eval_repeats: null", "eval_repeats: expected a whole number, got None"),
    ("save_steps: 1.5", "save_steps: expected a whole number, got 1.5"),
    ("temperature: .inf", "temperature: expected a finite number"),
    ("lora_target_modules: q_proj", "lora_target_modules: expected a list, got str 'q_proj' (write [q_proj])"),
    ("load_in_4bit: 'yes'", "load_in_4bit: expected true or false"),
    ("max_grad_norm: -1", "max_grad_norm must be > 0 or null"),
    ("score_clip: -1", "score_clip must be > 0 or null"),
    ("critic_learning_rate: -1", "critic_learning_rate must be > 0 or null"),
    ("adam_eps: 0", "need adam_eps > 0 and weight_decay >= 0"),
    ("weight_decay: -0.1", "need adam_eps > 0 and weight_decay >= 0"),
    ("adaptive_kl_horizon: 0", "adaptive_kl_target and adaptive_kl_horizon must be > 0"),
    ("adaptive_kl_target: -1", "adaptive_kl_target and adaptive_kl_horizon must be > 0"),
    ("early_stopping_target_kl: 0", "early_stopping_target_kl must be > 0"),
])
def test_yaml_values_are_checked_against_the_field_types_and_ranges(tmp_path, line, message):
    """Issue 37 item 11: values the parser passed through unconverted, or accepted out of range."""
    from marlhf_edu.training.args import parse_stage_args

    config = tmp_path / "bad.yaml"
    config.write_text(f"device: cpu\n{line}\n")
    with pytest.raises(ConfigError, match=__import__("re").escape(message)):
        (parsed,) = parse_stage_args((PPOConfig,), ["--config", str(config)])
        parsed.validate()


def test_an_output_folder_that_cannot_be_written_is_refused_at_the_start(tmp_path):
    """Issue 37 item 13: found before any model loads, not at the first checkpoint after all the training."""
    import os

    if os.geteuid() == 0:
        target = pathlib.Path("/proc/marlhf_edu_cannot_write_here")  # root may write anywhere on disk, not in /proc
    else:
        (tmp_path / "ro").mkdir(mode=0o555)
        target = tmp_path / "ro" / "ppo"
    with pytest.raises(ConfigError, match="cannot be written"):
        ppo_main([*TINY, "--total_steps", "1", "--output_dir", str(target)], backend_factory=never_loaded,
                 progress=False)


def test_a_resume_verifies_its_checkpoint_once(tmp_path, monkeypatch):
    """`ppo.run.run` checks the run folder before loading any model; the trainer reuses that check instead of
    hashing every checkpoint file a second time (issue 37)."""
    import marlhf_edu.ppo.run_files as run_files

    out = tmp_path / "ppo"
    ppo_main([*TINY, "--total_steps", "1", "--eval_repeats", "0", "--output_dir", str(out)], progress=False)
    calls = []
    real = run_files.verify_checkpoint
    monkeypatch.setattr(run_files, "verify_checkpoint", lambda folder: calls.append(folder) or real(folder))
    ppo_main([*TINY, "--total_steps", "2", "--eval_repeats", "0", "--output_dir", str(out), "--resume", "true"],
             progress=False)
    assert len(calls) == 1 and (out / "checkpoints" / "step-000002").exists()


@pytest.mark.parametrize("text, argv_tail, message", [
    ("device: cpu\ntotal_steps: [1\n", [], r"bad.yaml: not valid YAML \(.*, line 3\)"),
    ("- device\n- cpu\n", [], "bad.yaml: the config must be a YAML mapping"),
    ("device: cpu\n", None, "--config needs a YAML file after it"),
])
def test_a_malformed_stage_config_is_one_error_naming_the_file(tmp_path, capsys, text, argv_tail, message):
    """Issue 37 item 12: malformed YAML and `--config` without a value gave tracebacks."""
    import re

    from marlhf_edu import cli

    config = tmp_path / "bad.yaml"
    config.write_text(text)
    argv = ["ppo", "--config"] + ([str(config)] if argv_tail is not None else []) + ["--device", "cpu"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
