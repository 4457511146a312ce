"""Reliability audit (items 4, 7, 12, 13, 14): each mistake is one error naming the file, the line or row and the
key, raised before any model loads or any stage trains, and a refused launch leaves nothing behind."""

import json
import os
import pathlib

import pytest

from marlhf_edu.errors import ConfigError, DataFileError

TINY_PPO = ["--batch_size", "8", "--mini_batch_size", "4", "--micro_batch_size", "2", "--forward_batch_size", "8",
            "--max_new_tokens", "8", "--device", "cpu", "--eval_repeats", "0", "--total_steps", "1"]


@pytest.fixture
def sft_never_runs(no_loading, monkeypatch):
    """The pipeline's first stage raises if it is run (the tiny SFT trains from random weights, loading nothing)."""
    import marlhf_edu.stages.sft as sft

    def ran(*args, **kwargs):
        raise AssertionError("the SFT stage ran before the mistake was refused")

    monkeypatch.setattr(sft, "main", ran)


# ---- item 4: the pipeline never overwrites a finished run that is not its own -------------------------------

def test_the_pipeline_refuses_a_folder_holding_another_finished_model(tmp_path, sft_never_runs):
    from marlhf_edu.stages.pipeline import STARTED, foreign_run, run_pipeline
    from marlhf_edu.training.pipeline_file import Stage

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "adapter_model.safetensors").write_text("somebody's model")
    stages = [Stage("sft", "configs/tiny_sft.yaml", ["--output_dir", str(tmp_path / "sft")]),
              Stage("rm", "configs/tiny_rm.yaml", ["--output_dir", str(mine)])]
    with pytest.raises(ConfigError, match=rf"rm's output_dir {mine} holds a finished run the pipeline did not start "
                                          r"\(adapter_model.safetensors.*choose another output_dir .* or remove"):
        run_pipeline(stages, log=lambda line: None, progress=False)
    assert (mine / "adapter_model.safetensors").read_text() == "somebody's model"
    assert not (tmp_path / "sft").exists()  # refused before the first stage
    # the pipeline's own folder (it started the stage there; or it holds checkpoints to resume) is restarted
    (mine / STARTED).write_text("{}\n")
    assert foreign_run(mine) is None
    (mine / STARTED).unlink()
    (mine / "checkpoint-2").mkdir()
    assert foreign_run(mine) is None and foreign_run(tmp_path / "empty") is None


# ---- item 7: every stage's rows are converted before the first stage runs ----------------------------------

def test_a_reward_file_with_a_wrong_key_is_refused_before_sft_runs(tmp_path, sft_never_runs):
    from marlhf_edu.stages.pipeline import run_pipeline
    from marlhf_edu.training.pipeline_file import Stage

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "q", "chosen": "a", "rejected": "b"}) + "\n"
                     + json.dumps({"prompt": "q", "chosen": "a", "rejectd": "b"}) + "\n")
    stages = [Stage("sft", "configs/tiny_sft.yaml", ["--output_dir", str(tmp_path / "sft")]),
              Stage("rm", "configs/tiny_rm.yaml", ["--output_dir", str(tmp_path / "rm"), "--dataset_name", str(pairs),
                                                   "--dataset_format", "trl"])]
    with pytest.raises(ConfigError, match=r"pipeline: rm.dataset_name: .*pairs\.jsonl: row 1, field 'rejected': "
                                          r"missing key.*nothing was run"):
        run_pipeline(stages, log=lambda line: None, progress=False)
    assert not (tmp_path / "sft").exists()


# ---- item 12: bad bytes and blank lines --------------------------------------------------------------------

def test_a_data_file_with_a_bad_byte_names_the_file_and_line(tmp_path):
    from marlhf_edu.data.formats import load_sft

    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "b"}\n')
    with pytest.raises(DataFileError, match=r"rows\.jsonl, line 2: not UTF-8 text \(byte 0xe9"):
        load_sft(str(path), "prompt-completion")


def test_a_bad_jsonl_row_after_blank_lines_names_the_files_own_line(tmp_path):
    from marlhf_edu.data.formats import read_json_rows

    path = tmp_path / "rows.jsonl"
    path.write_text('{"prompt": "a"}\n\n\n["not", "an", "object"]\n')
    with pytest.raises(DataFileError, match=r"rows\.jsonl, line 4: expected an object"):
        read_json_rows(str(path))


def test_a_config_with_a_bad_byte_names_the_file_and_line(tmp_path, no_loading):
    from marlhf_edu.stages.reward import main
    from marlhf_edu.training.pipeline_file import load_pipeline

    config = tmp_path / "rm.yaml"
    config.write_bytes(b"max_steps: 2\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"rm\.yaml, line 2: not UTF-8 text"):
        main(["--config", str(config), "--output_dir", str(tmp_path / "rm")])
    pipeline = tmp_path / "pipeline.yaml"
    pipeline.write_bytes(b"stages:\n  rm: configs/tiny_rm.yaml # \xff\n")
    with pytest.raises(ConfigError, match=r"pipeline\.yaml, line 2: not UTF-8 text"):
        load_pipeline(str(pipeline), [])


# ---- item 13: the trl stages' learning rate ----------------------------------------------------------------

@pytest.mark.parametrize("stage, config", [("sft", "configs/tiny_sft.yaml"), ("reward", "configs/tiny_rm.yaml"),
                                           ("dpo", "configs/tiny_dpo.yaml"), ("grpo", "configs/tiny_grpo.yaml")])
def test_a_nan_or_negative_learning_rate_is_refused_before_loading(tmp_path, no_loading, stage, config):
    import importlib

    main = importlib.import_module(f"marlhf_edu.stages.{stage}").main
    base = ["--config", config, "--output_dir", str(tmp_path / "out")]
    with pytest.raises(ConfigError, match="learning_rate must be a finite number, got nan"):
        main([*base, "--learning_rate", "nan"])
    negative = tmp_path / "negative.yaml"
    negative.write_text(pathlib.Path(config).read_text() + "\nlearning_rate: -1.0e-4\n")
    with pytest.raises(ConfigError, match=r"learning_rate must be >= 0 .*, got -0\.0001"):
        main(["--config", str(negative), "--output_dir", str(tmp_path / "out")])
    with pytest.raises(ConfigError, match="max_grad_norm must be a finite number, got inf"):
        main([*base, "--max_grad_norm", "inf"])
    assert not (tmp_path / "out").exists()


# ---- item 14: tracebacks turned into errors ----------------------------------------------------------------

def test_config_given_a_folder_is_refused(tmp_path, no_loading):
    from marlhf_edu.stages.pipeline import main as pipeline
    from marlhf_edu.training.args import parse_stage_args
    from marlhf_edu.training.sft import SFTScriptArguments

    with pytest.raises(ConfigError, match="config file configs is a folder"):
        parse_stage_args((SFTScriptArguments,), ["--config", "configs"])
    with pytest.raises(ConfigError, match="pipeline file configs/llama2_7b is a folder"):
        pipeline(["--config", "configs/llama2_7b"])


def test_cache_clean_refuses_a_symlinked_entry_and_a_cache_that_is_a_file(tmp_path, monkeypatch, capsys):
    from marlhf_edu.cli import main

    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    (cache / "merged").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "model.safetensors").write_text("not the cache's")
    (cache / "merged" / "linked-1").symlink_to(elsewhere)
    monkeypatch.setenv("MARLHF_EDU_CACHE", str(cache))
    assert main(["cache", "clean"]) == 2
    assert "merged/linked-1 is a symbolic link" in capsys.readouterr().err
    assert (elsewhere / "model.safetensors").exists() and (cache / "merged" / "linked-1").is_symlink()
    afile = tmp_path / "cache.txt"
    afile.write_text("")
    monkeypatch.setenv("MARLHF_EDU_CACHE", str(afile))
    assert main(["cache", "list"]) == 2
    assert f"MARLHF_EDU_CACHE={afile} is a file, not a folder" in capsys.readouterr().err


def test_a_hub_model_offline_and_not_cached_is_a_clear_error(tmp_path, monkeypatch):
    from marlhf_edu.loading.sources import resolve_model

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for ref in ("hf:nobody-here/no-such-model", "hf:nobody-here/no-such-model@0123abc"):
        with pytest.raises(ConfigError, match="hf:nobody-here/no-such-model.*HF_HUB_OFFLINE.*local hub cache"):
            resolve_model(ref)


def test_a_refused_ppo_resume_leaves_no_folder_and_no_lock(tmp_path):
    from marlhf_edu.stages.ppo import main

    out = tmp_path / "runs" / "ppo"

    def never_loaded(config, reward=None):
        raise AssertionError("a model was loaded before the resume was refused")

    with pytest.raises(ConfigError):
        main([*TINY_PPO, "--output_dir", str(out), "--resume", "true"], backend_factory=never_loaded, progress=False)
    assert not (tmp_path / "runs").exists()
    # a refused resume of an existing folder takes away the lock it made, and nothing else
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError):
        main([*TINY_PPO, "--output_dir", str(out), "--resume", "true"], backend_factory=never_loaded, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
