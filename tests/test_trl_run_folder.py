"""Reliability issue: what the trl stages (sft, rm, dpo, grpo) do with their `output_dir` when told to replace a run
(`--overwrite_output true`: nothing of the old model is left for a later stage to load) or to continue one
(`--resume_from_checkpoint true`: the newest complete `checkpoint-N`, which crashed as "Can't find a valid
checkpoint at true" although the stages' own refusal tells the user to pass it)."""

import pathlib
import shutil

import pytest
import transformers

from marlhf_edu.errors import ConfigError

TRL_STAGES = {"sft": ("marlhf_edu.stages.sft", ["--config", "configs/tiny_sft.yaml"]),
              "rm": ("marlhf_edu.stages.reward", ["--config", "configs/tiny_rm.yaml", "--model_name_or_path", "zoo"]),
              "dpo": ("marlhf_edu.stages.dpo", ["--config", "configs/tiny_dpo.yaml"]),
              "grpo": ("marlhf_edu.stages.grpo", ["--config", "configs/tiny_grpo.yaml"])}
SFT = ["--config", "configs/tiny_sft.yaml", "--max_steps", "2"]
LORA = ["--model_name_or_path", "marlhf_edu/assets/tiny_sft", "--use_peft", "true", "--lora_target_modules", "q_proj",
        "v_proj"]


@pytest.mark.slow
def test_overwriting_a_lora_run_with_a_full_one_leaves_only_the_new_model(tmp_path):
    """The LoRA run's `adapter_config.json` stayed beside the full model that replaced it, and a folder with an
    `adapter_config.json` is read as an adapter: every later stage loaded the old model, without a word."""
    import torch

    from marlhf_edu.loading.sources import ModelSource, resolve_model
    from marlhf_edu.stages.pipeline import MARKER
    from marlhf_edu.stages.sft import main

    out = tmp_path / "sft"
    main([*SFT, "--output_dir", str(out), *LORA])
    assert ModelSource.parse(str(out)).kind == "adapter"
    (out / MARKER).write_text("{}\n")  # as the pipeline marks a stage finished: the old run's, not the new one's
    (out / "notes.txt").write_text("the user's, not the run's")
    (out / "data").mkdir()
    (out / "data" / "pairs.jsonl").write_text("{}\n")

    trainer = main([*SFT, "--output_dir", str(out), "--overwrite_output", "true"])
    assert sorted(p.name for p in out.iterdir()) == [".lock", "config.json", "data", "generation_config.json",
                                                      "model.safetensors", "notes.txt", "tokenizer.json",
                                                      "tokenizer_config.json", "training_args.bin"]
    assert (out / "notes.txt").read_text() == "the user's, not the run's" and (out / "data" / "pairs.jsonl").exists()
    # what a later stage loads is the new full model
    assert ModelSource.parse(str(out)).kind == "directory"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(resolve_model(str(out)))
    trained = trainer.model.state_dict()
    assert all(torch.equal(value, trained[name]) for name, value in loaded.state_dict().items())


def test_remove_run_outputs_removes_the_runs_files_by_name_and_nothing_else(tmp_path):
    from marlhf_edu.stages.pipeline import MARKER
    from marlhf_edu.training.runs import RUN_OUTPUT_FILES, remove_run_outputs

    assert MARKER in RUN_OUTPUT_FILES
    out = tmp_path / "run"
    (out / "checkpoint-3").mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "model-00001-of-00002.safetensors",
                 MARKER, "eval_metrics.json"):
        (out / name).write_text("x")
    (out / "README.md").write_text("---\nbase_model: x\nlibrary_name: peft\n---\n# Model Card\n")
    assert sorted(remove_run_outputs(out)) == sorted(["adapter_config.json", "adapter_model.safetensors", "tokenizer.json",
                                                      "model-00001-of-00002.safetensors", MARKER, "eval_metrics.json",
                                                      "README.md", "checkpoint-3"])
    assert list(out.iterdir()) == []
    mine = {"README.md": "# my notes on this run\n", "notes.txt": "mine", "runs": None, "config.json.bak": "kept"}
    for name, text in mine.items():
        (out / name).mkdir() if text is None else (out / name).write_text(text)
    (out / "config.json").mkdir()  # a folder under a file's name is nothing a stage wrote
    assert remove_run_outputs(out) == []
    assert sorted(p.name for p in out.iterdir()) == sorted([*mine, "config.json"])


@pytest.mark.slow
def test_resume_from_checkpoint_true_continues_the_newest_complete_checkpoint(tmp_path, monkeypatch, capsys):
    """SFT, 2 steps saved every step, then `--resume_from_checkpoint true` to 4 steps: it starts from checkpoint-2
    (not from scratch, and not from checkpoint-3, which a kill while saving left without its trainer_state.json)."""
    from marlhf_edu.stages.sft import main

    out = tmp_path / "sft"
    argv = ["--config", "configs/tiny_sft.yaml", "--output_dir", str(out), "--save_strategy", "steps", "--save_steps",
            "1", "--logging_steps", "1"]
    main([*argv, "--max_steps", "2"])
    (out / "checkpoint-3").mkdir()
    shutil.copy(out / "checkpoint-2" / "model.safetensors", out / "checkpoint-3")
    first = (out / "checkpoint-1" / "trainer_state.json").stat().st_mtime_ns
    seen, real = [], transformers.Trainer.train

    def train(self, resume_from_checkpoint=None, **kwargs):
        seen.append(resume_from_checkpoint)
        return real(self, resume_from_checkpoint=resume_from_checkpoint, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "train", train)
    capsys.readouterr()
    trainer = main([*argv, "--max_steps", "4", "--resume_from_checkpoint", "true"])
    assert seen == [str(out / "checkpoint-2")]
    assert f"sft: {out / 'checkpoint-3'} is incomplete" in capsys.readouterr().out
    assert trainer.state.global_step == 4
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3, 4]  # 1, 2 from checkpoint-2
    assert (out / "checkpoint-1" / "trainer_state.json").stat().st_mtime_ns == first  # steps 1, 2 not run again
    assert (out / "checkpoint-4" / "trainer_state.json").exists()


@pytest.mark.parametrize("stage", sorted(TRL_STAGES))
@pytest.mark.slow
def test_every_trl_stage_reads_true_as_the_newest_complete_checkpoint(tmp_path, monkeypatch, stage):
    """The four stages hand trl the newest complete checkpoint-N (by number: checkpoint-10 after checkpoint-9),
    not the text "true"; trl's training is stopped there, before it starts."""
    import importlib

    module, argv = TRL_STAGES[stage]
    out = tmp_path / "run"
    for step in (9, 10, 11):
        (out / f"checkpoint-{step}").mkdir(parents=True)
        (out / f"checkpoint-{step}" / "adapter_model.safetensors").write_bytes(b"weights")
        if step != 11:  # checkpoint-11: killed while saving
            (out / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")

    class Resumed(Exception):
        pass

    def train(self, resume_from_checkpoint=None, **kwargs):
        raise Resumed(resume_from_checkpoint)

    monkeypatch.setattr(transformers.Trainer, "train", train)
    with pytest.raises(Resumed) as info:
        importlib.import_module(module).main([*argv, "--output_dir", str(out), "--resume_from_checkpoint", "true"])
    assert info.value.args[0] == str(out / "checkpoint-10")


@pytest.mark.parametrize("value", [None, False, "", "false", "False", "true", "TRUE", True, "checkpoint-9"])
def test_resume_checkpoint_reads_each_form_of_the_option(tmp_path, value):
    from types import SimpleNamespace

    from marlhf_edu.training.runs import resume_checkpoint

    out = tmp_path / "run"
    (out / "checkpoint-9").mkdir(parents=True)
    (out / "checkpoint-9" / "model.safetensors").write_bytes(b"weights")
    (out / "checkpoint-9" / "trainer_state.json").write_text("{}")
    given = str(out / value) if value == "checkpoint-9" else value
    got = resume_checkpoint("sft", SimpleNamespace(output_dir=str(out), resume_from_checkpoint=given))
    assert got == (None if value in (None, False, "", "false", "False") else str(out / "checkpoint-9"))
    (out / "checkpoint-9" / "trainer_state.json").unlink()
    if got is not None:
        with pytest.raises(ConfigError, match="holds no complete checkpoint-N|cannot be resumed from"):
            resume_checkpoint("sft", SimpleNamespace(output_dir=str(out), resume_from_checkpoint=given))


def test_true_without_a_checkpoint_names_the_folder(tmp_path):
    from marlhf_edu.stages.sft import main

    with pytest.raises(ConfigError, match=rf"sft: resume_from_checkpoint is true, but {tmp_path / 'none'} holds no "
                                          "complete checkpoint-N folder"):
        main(["--config", "configs/tiny_sft.yaml", "--output_dir", str(tmp_path / "none"), "--resume_from_checkpoint",
              "true"])
    assert not pathlib.Path(tmp_path / "none").exists()
