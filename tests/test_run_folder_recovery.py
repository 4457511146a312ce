"""Reliability audit items 6, 8, 10 and 11: a PPO run folder the engine cannot trust as it stands is either
recovered from (a run stopped before its first checkpoint starts over; damaged evaluation records are set aside
and written again; a missing `latest` falls back to the newest checkpoint that verifies) or refused naming the
file, the field or the line, never with a traceback after the models have loaded, and a `latest` leading out of
the run is never followed."""

import json
import shutil

import pytest

from marlhf_edu.errors import ConfigError, DataFileError
from marlhf_edu.ppo import read_metrics
from marlhf_edu.ppo.run_files import STOPPED_RUN, usable_checkpoint
from marlhf_edu.stages.ppo import main as ppo_main

BASE = ["--batch_size", "8", "--mini_batch_size", "4", "--micro_batch_size", "2", "--forward_batch_size", "8",
        "--max_new_tokens", "8", "--device", "cpu", "--eval_repeats", "1", "--learning_rate", "3e-5"]
TINY = [*BASE, "--save_steps", "1", "--total_steps", "3"]


class Killed(Exception):
    """What a kill does to the run, here: it stops in the middle of a step."""


def never_loaded(config, reward=None):
    raise AssertionError("a model was loaded before the run folder was checked")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 3-step run that checkpointed every step (the newest two kept: step-000002 and step-000003)."""
    out = tmp_path_factory.mktemp("finished") / "ppo"
    ppo_main([*TINY, "--output_dir", str(out)], progress=False)
    return out


@pytest.fixture
def run(finished, tmp_path):
    """A copy of the finished run to damage."""
    out = tmp_path / "ppo"
    shutil.copytree(finished, out)
    return out


def _steps(out):
    return [r["step"] for r in read_metrics(out / "metrics.jsonl")]


# ---- item 10: `checkpoints/latest` ------------------------------------------------------------------------------

def test_without_latest_the_resume_takes_the_newest_intact_checkpoint(run, capsys):
    """`latest` deleted with two intact checkpoints beside it: "no checkpoint" before the fix."""
    (run / "checkpoints" / "latest").unlink()
    ckpt, _, notes = usable_checkpoint(run / "checkpoints")
    assert ckpt.name == "step-000003" and "latest is missing" in notes[0]
    (run / "checkpoints" / "step-000003" / "optimizer.pt").write_bytes(b"")  # and the newest damaged: the one before
    assert usable_checkpoint(run / "checkpoints")[0].name == "step-000002"
    shutil.rmtree(run / "policy")
    ppo_main([*TINY, "--output_dir", str(run), "--resume", "true"], progress=False)
    said = capsys.readouterr().out
    assert "latest is missing" in said and "skipping damaged checkpoint step-000003" in said
    assert "resuming from step-000002" in said
    assert _steps(run) == [1, 2, 3] and any((run / "policy").iterdir())
    assert (run / "checkpoints" / "latest").read_text() == "step-000003"


@pytest.mark.parametrize("pointer", ["../../other_run/checkpoints/step-000009", "absolute", "a link"])
def test_a_latest_leading_out_of_the_run_is_never_followed(run, tmp_path, pointer):
    """A `latest` naming `../../other_run/...` (or an absolute path) was followed: another run's weights resumed
    here. Now it is passed over, said so, and the run's own newest checkpoint is used; a `step-*` link leading out
    of the run is not a checkpoint of it either."""
    other = tmp_path / "other_run" / "checkpoints" / "step-000009"
    shutil.copytree(run / "checkpoints" / "step-000003", other)  # intact: it would verify if it were followed
    root = run / "checkpoints"
    if pointer == "a link":
        (root / "latest").unlink()
        (root / "step-000009").symlink_to(other)
    else:
        (root / "latest").write_text(str(other) if pointer == "absolute" else pointer)
    ckpt, _, notes = usable_checkpoint(root)
    assert ckpt == root / "step-000003", ckpt
    if pointer != "a link":
        assert "not a checkpoint folder of this run: not followed" in notes[0]
    for folder in [p for p in root.iterdir() if p.name != "latest"]:
        if folder.is_symlink():
            folder.unlink()
        else:
            shutil.rmtree(folder)
    with pytest.raises(ConfigError, match="no checkpoint in"):
        usable_checkpoint(root)  # nothing of its own left: an error, still not the other run's checkpoint


# ---- item 11: a state.json the resume cannot use ---------------------------------------------------------------

@pytest.mark.parametrize("change, said", [
    (lambda s: s.pop("sha256"), "field 'sha256' is missing"),
    (lambda s: s["sha256"].pop("optimizer.pt"), "field 'sha256' has no checksum for optimizer.pt"),
    (lambda s: s.update(step="6"), "field 'step' is '6' (str), not a whole number"),
    (lambda s: s.pop("kl_controller"), "field 'kl_controller' is missing"),
    (lambda s: s.update(kl_controller={"value": "0.2", "target": 6, "horizon": 10000}), "field 'kl_controller'"),
    (lambda s: s["kl_controller"].pop("horizon"), "field 'kl_controller' has no 'horizon'"),
    (lambda s: s.update(world_size=None), "field 'world_size' is None"),
    (lambda s: s.pop("config"), "field 'config' is missing"),
    (lambda s: s.clear() or s.update(step=3), "field 'world_size' is missing"),
    # a checksum's name leading out of the folder: verifying it would read (hash) a file of another run
    (lambda s: s["sha256"].update({"../step-000002/optimizer.pt": "0" * 64}), "field 'sha256' is {"),
    (lambda s: s["sha256"].update({"/etc/hostname": "0" * 64}), "by its path inside the checkpoint"),
])
def test_a_state_without_checksums_or_with_a_field_missing_or_mistyped_is_not_used(run, change, said):
    """Such a checkpoint is passed over like a damaged one (naming state.json and the field), for the one before."""
    path = run / "checkpoints" / "step-000003" / "state.json"
    state = json.loads(path.read_text())
    change(state)
    path.write_text(json.dumps(state))
    ckpt, _, notes = usable_checkpoint(run / "checkpoints")
    assert ckpt.name == "step-000002"
    assert notes[0].startswith("skipping damaged checkpoint step-000003: state.json: ") and said in notes[0], notes


def test_a_truncated_optimizer_without_checksums_falls_back_instead_of_a_traceback(run, capsys):
    """With `sha256` removed every checksum was skipped: the truncated optimizer file gave a traceback after the
    models had loaded, on every resume. Now the previous checkpoint is used and the run ends as it should."""
    latest = run / "checkpoints" / "step-000003"
    state = json.loads((latest / "state.json").read_text())
    del state["sha256"]
    (latest / "state.json").write_text(json.dumps(state))
    (latest / "optimizer.pt").write_bytes((latest / "optimizer.pt").read_bytes()[:100])
    ppo_main([*TINY, "--output_dir", str(run), "--resume", "true"], progress=False)
    said = capsys.readouterr().out
    assert "skipping damaged checkpoint step-000003: state.json: field 'sha256' is missing" in said
    assert _steps(run) == [1, 2, 3]


def test_a_metrics_line_without_a_step_is_refused_naming_the_file_and_line(run):
    """A `metrics.jsonl` record without `step` was a KeyError after the models had loaded."""
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    record = json.loads(lines[1])
    del record["step"]
    metrics.write_text("\n".join([lines[0], json.dumps(record), *lines[2:]]) + "\n")
    with pytest.raises(DataFileError, match=r"metrics.jsonl, line 2: a record without a whole-number 'step'.*"
                                            r"repair or remove that line"):
        ppo_main([*TINY, "--output_dir", str(run), "--resume", "true"], backend_factory=never_loaded, progress=False)


# ---- item 8: damaged evaluation records ------------------------------------------------------------------------

@pytest.mark.parametrize("victim", ["eval_samples.jsonl", "eval.json"])
def test_a_damaged_evaluation_record_is_set_aside_and_the_policy_is_still_exported(run, capsys, victim):
    """A truncated JSON line in `eval_samples.jsonl` (or a cut `eval.json`) crashed the resume after training,
    before `policy/` was exported, and every later resume again. Now it is found before training, moved to
    `<name>.damaged` (said so), the policy before training is evaluated again, and the policy is exported."""
    path = run / victim
    good = path.read_text()
    path.write_text(good[:len(good) // 2])  # cut mid-record, as a kill during its write leaves it
    shutil.rmtree(run / "policy")
    result = ppo_main([*TINY, "--output_dir", str(run), "--resume", "true"], progress=False)
    said = capsys.readouterr().out
    assert f"{path} is damaged" in said and f"moved to {victim}.damaged" in said
    assert (run / f"{victim}.damaged").read_text() == good[:len(good) // 2]
    assert any((run / "policy").iterdir())
    samples = [json.loads(line) for line in (run / "eval_samples.jsonl").read_text().splitlines()]
    assert {s["when"] for s in samples} == {"before", "after"}
    evals = json.loads((run / "eval.json").read_text())
    assert set(evals) == {"before", "after"} and evals["after"] == result["after"]


# ---- item 6: a run stopped before its first checkpoint ---------------------------------------------------------

@pytest.mark.slow
def test_a_run_stopped_before_its_first_checkpoint_starts_over_on_resume(tmp_path, monkeypatch, capsys):
    """Killed in the first `save_steps` steps, a run could be neither continued ("no checkpoint") nor restarted
    ("pass --resume true"). Now `--resume true` starts it over from step 0, saying so, with the stopped run's
    records moved aside: the new records hold each step once."""
    from marlhf_edu.ppo.trainer import PPOTrainer

    out = tmp_path / "ppo"
    args = [*BASE, "--total_steps", "2", "--save_steps", "5"]  # no checkpoint before the last step
    real_step = PPOTrainer.step

    def killed_after_one_step(self):
        if self.step_index == 1:
            raise Killed  # in the middle of step 2
        return real_step(self)

    monkeypatch.setattr(PPOTrainer, "step", killed_after_one_step)
    with pytest.raises(Killed):
        ppo_main([*args, "--output_dir", str(out)], progress=False)
    monkeypatch.setattr(PPOTrainer, "step", real_step)
    (out / "checkpoints" / "step-000002.tmp").mkdir(parents=True)  # and one killed mid-save
    assert _steps(out) == [1] and not (out / "checkpoints" / "latest").exists()
    stopped_metrics = (out / "metrics.jsonl").read_text()

    with pytest.raises(ConfigError, match=r"stopped before its first checkpoint: pass --resume true to start it "
                                          r"over from step 0"):
        ppo_main([*args, "--output_dir", str(out)], backend_factory=never_loaded, progress=False)
    result = ppo_main([*args, "--output_dir", str(out), "--resume", "true"], progress=False)
    said = capsys.readouterr().out
    assert "there is nothing to resume, so this run starts over from step 0" in said and STOPPED_RUN in said
    assert _steps(out) == [1, 2] and [r["step"] for r in result["records"]] == [1, 2]
    assert (out / STOPPED_RUN / "metrics.jsonl").read_text() == stopped_metrics
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-000002"]
    assert {"before", "after"} <= set(json.loads((out / "eval.json").read_text()))
    assert (out / "policy").is_dir()
    # the started-over run is an ordinary one: a later resume continues it from its checkpoint
    ppo_main([*BASE, "--total_steps", "3", "--save_steps", "5", "--output_dir", str(out), "--resume", "true"],
             progress=False)
    assert _steps(out) == [1, 2, 3]


def test_the_trainer_alone_starts_a_stopped_run_over_on_resume(tmp_path, prompts):
    """`PPOTrainer.train` with `resume` (no stage around it) does the same: nothing loaded, records moved aside."""
    import torch

    from marlhf_edu.ppo import FourModelBackend, PPOConfig, PPOTrainer

    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "score/mean": 0.0}\n{"step": 2, "sco')  # killed in step 2
    config = PPOConfig(output_dir=str(out), batch_size=8, mini_batch_size=4, micro_batch_size=2,
                       forward_batch_size=8, max_new_tokens=8, device="cpu", total_steps=1, save_steps=5,
                       resume=True)
    torch.manual_seed(0)
    records = PPOTrainer(FourModelBackend.from_config(config), config, prompts).train(progress=False)
    assert [r["step"] for r in records] == [1] and _steps(out) == [1]
    assert (out / STOPPED_RUN / "metrics.jsonl").exists() and (out / "checkpoints" / "latest").exists()
