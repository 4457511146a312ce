"""Issue 37 (item 2's rule, every stage): a user's mistake is refused as a `ConfigError` (or a data error) before
any model loads or anything is written, not after loading, training or generating. Every model load below
raises, so a check that comes too late fails the test with an AssertionError instead of the expected error."""

import pathlib

import pytest
import torch

from marlhf_edu.errors import ConfigError, DataFileError

TINY_PPO = ["--batch_size", "8", "--mini_batch_size", "4", "--micro_batch_size", "2", "--forward_batch_size", "8",
            "--max_new_tokens", "8", "--device", "cpu", "--eval_repeats", "1", "--total_steps", "1"]


def ppo(argv, multi_adapter=False):
    from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend
    from marlhf_edu.stages.ppo import main

    return main(argv, backend_factory=MultiAdapterBackend if multi_adapter else None, progress=False)


def test_ppo_refuses_an_unknown_tracker_before_loading_or_writing(tmp_path, no_loading):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="report_to: 'bogus' is not a tracker"):
        ppo([*TINY_PPO, "--output_dir", str(out), "--report_to", "bogus"])
    assert not out.exists()  # not even the lock: the folder was never made


def test_ppo_refuses_a_missing_prompt_file_before_loading(tmp_path, no_loading):
    with pytest.raises(ConfigError, match="no_such.jsonl"):
        ppo([*TINY_PPO, "--output_dir", str(tmp_path / "run"), "--dataset_name", str(tmp_path / "no_such.jsonl"),
             "--dataset_format", "prompt", "--eval_repeats", "0"])


@pytest.mark.parametrize("multi_adapter", [False, True])
@pytest.mark.parametrize("with_base", [False, True])
def test_a_missing_reward_adapter_is_refused_before_loading(tmp_path, no_loading, multi_adapter, with_base):
    extra = ["--reward_base_path", "zoo"] if with_base and not multi_adapter else []
    with pytest.raises(ConfigError, match="reward_adapter_path: .*no_adapter does not exist"):
        ppo([*TINY_PPO, "--output_dir", str(tmp_path / "run"), "--reward_adapter_path", str(tmp_path / "no_adapter"),
             *extra], multi_adapter=multi_adapter)


def test_engine_options_the_engine_cannot_honour_are_refused_before_loading(tmp_path, no_loading):
    with pytest.raises(ConfigError, match="merged_rollout needs a LoRA policy"):
        ppo([*TINY_PPO, "--output_dir", str(tmp_path / "a"), "--merged_rollout", "true"])
    with pytest.raises(ConfigError, match="critic_init: reward_model needs value_mode: adapter"):
        ppo([*TINY_PPO, "--output_dir", str(tmp_path / "b"), "--critic_init", "reward_model", "--value_mode", "shared"],
            multi_adapter=True)


def test_grpo_checks_its_prompts_and_reward_adapter_before_loading(tmp_path, no_loading):
    from marlhf_edu.stages.grpo import main

    base = ["--config", "configs/tiny_grpo.yaml", "--output_dir", str(tmp_path / "grpo")]
    with pytest.raises(ConfigError, match="drop_long_prompts needs max_prompt_length"):
        main([*base, "--drop_long_prompts", "true"])
    with pytest.raises(ConfigError, match="reward_adapter_path: .*no_adapter does not exist"):
        main([*base, "--reward_adapter_path", str(tmp_path / "no_adapter")])
    with pytest.raises(ConfigError, match="reward_adapter_path"):  # the judge trains; the evaluation needs the adapter
        main([*base, "--reward", "gold", "--reward_adapter_path", str(tmp_path / "no_adapter")])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "' + "word " * 40 + '"}\n')
    with pytest.raises(ConfigError, match="exceed max_prompt_length=8"):
        main([*base, "--dataset_name", str(prompts), "--dataset_format", "prompt", "--max_prompt_length", "8",
              "--eval_repeats", "0"])
    with pytest.raises(DataFileError, match="no_such.jsonl"):
        main([*base, "--dataset_name", str(tmp_path / "no_such.jsonl"), "--dataset_format", "prompt",
              "--eval_repeats", "0"])


def test_grpo_honours_max_rows_and_refuses_max_tokens(tmp_path, no_loading, capsys):
    """Issue 37 item 6: GRPO inherited max_rows and max_tokens from the data arguments and ignored both."""
    from marlhf_edu.stages.grpo import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "question {i}"}}\n' for i in range(5)))
    base = ["--config", "configs/tiny_grpo.yaml", "--output_dir", str(tmp_path / "grpo"), "--dataset_name",
            str(prompts), "--dataset_format", "prompt", "--eval_repeats", "0"]
    with pytest.raises(ConfigError, match="max_tokens keeps preference or SFT rows.*max_prompt_length"):
        main([*base, "--max_tokens", "64"])
    with pytest.raises(AssertionError, match="a model was loaded"):  # the checks passed; loading is the next step
        main([*base, "--max_rows", "2"])
    assert "prompts: using the first 2 of 5 (max_rows)" in capsys.readouterr().out


@pytest.fixture
def foreign_reward_adapter(tmp_path):
    """The shipped tiny reward adapter, but recording another base than the one it would be put on."""
    import json
    import shutil

    from marlhf_edu.loading.assets import REWARD_ADAPTER_DIR

    adapter = tmp_path / "foreign_rm"
    shutil.copytree(REWARD_ADAPTER_DIR, adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "someone/other"}))
    return adapter


@pytest.mark.parametrize("stage", ["grpo", "dpo"])
def test_grpo_and_dpo_refuse_a_reward_model_of_another_base_or_vocabulary_before_loading(
        stage, tmp_path, no_loading, foreign_reward_adapter, monkeypatch):
    """Issue 37 item 4: GRPO's reward (and the evaluation after DPO or GRPO) scored with a reward adapter on any
    base and any vocabulary; PPO refused both."""
    import importlib

    from marlhf_edu.loading.assets import SFT_DIR, TOKENIZER_DIR
    from marlhf_edu.loading.sources import load_tokenizer
    from marlhf_edu.training import policy

    main = importlib.import_module(f"marlhf_edu.stages.{stage}").main
    base = ["--config", f"configs/tiny_{stage}.yaml", "--output_dir", str(tmp_path / stage)]
    with pytest.raises(ConfigError, match=r"trained on 'hf:someone/other' .* set reward_base_path"):
        main([*base, "--reward_adapter_path", str(foreign_reward_adapter)])

    class OtherVocabulary:
        def get_vocab(self):
            return {"a": 0}

        def __len__(self):
            return 1

    other = tmp_path / "other_base"
    # the reward base's tokenizer, as `check_reward_vocabulary` loads it
    monkeypatch.setattr(policy, "load_tokenizer", lambda ref=TOKENIZER_DIR, *a, **k:
                        OtherVocabulary() if str(ref) == str(other) else load_tokenizer(ref, *a, **k))
    import shutil

    shutil.copytree(SFT_DIR, other)  # the same width: only the vocabulary differs
    with pytest.raises(ConfigError, match="reward model's tokenizer .* differs from the policy's"):
        main([*base, "--reward_base_path", str(other)])


def test_ppo_and_evaluate_refuse_a_reward_base_of_another_vocabulary_before_loading(tmp_path, no_loading,
                                                                                     monkeypatch):
    """Issue 37 item 4: PPO with a reward model on a base of its own, and `marlhf-edu evaluate`, compared the two
    vocabularies only after loading both models."""
    import shutil

    from marlhf_edu.loading.assets import SFT_DIR, TOKENIZER_DIR
    from marlhf_edu.loading.sources import load_tokenizer
    from marlhf_edu.ppo import run
    from marlhf_edu.stages import evaluate as evaluate_stage
    from marlhf_edu.stages.evaluate import main as evaluate

    class OtherVocabulary:
        def get_vocab(self):
            return {"a": 0}

        def __len__(self):
            return 1

    other = tmp_path / "other_base"
    shutil.copytree(SFT_DIR, other)  # the same width: only the vocabulary differs
    for module in (run, evaluate_stage):  # each loads the tokenizers itself: PPO's checks before loading, evaluate
        monkeypatch.setattr(module, "load_tokenizer", lambda ref=TOKENIZER_DIR, *a, **k:
                            OtherVocabulary() if str(ref) == str(other) else load_tokenizer(ref, *a, **k))
    with pytest.raises(ConfigError, match="reward model's tokenizer .* differs from the policy's"):
        ppo([*TINY_PPO, "--output_dir", str(tmp_path / "run"), "--reward_base_path", str(other)])
    with pytest.raises(ConfigError, match="reward model's tokenizer .* differs from the policy's"):
        evaluate(["--model", "zoo", "--reward_base", str(other), "--reward_adapter", "zoo"])


def test_dpo_checks_the_reward_adapter_of_its_evaluation_before_training(tmp_path, no_loading):
    from marlhf_edu.stages.dpo import main

    with pytest.raises(ConfigError, match="reward_adapter_path: .*no_adapter does not exist"):
        main(["--config", "configs/tiny_dpo.yaml", "--output_dir", str(tmp_path / "dpo"),
              "--reward_adapter_path", str(tmp_path / "no_adapter")])


def test_evaluate_generate_and_merge_refuse_bad_arguments_before_loading(tmp_path, no_loading):
    from marlhf_edu.stages import evaluate, generate, merge

    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(ConfigError, match="--output_dir .* cannot be written"):
        evaluate.main(["--model", "zoo", "--output_dir", str(a_file / "eval")])
    with pytest.raises(ConfigError, match="--reward_adapter: .*no_adapter does not exist"):
        evaluate.main(["--model", "zoo", "--reward_base", "zoo", "--reward_adapter", str(tmp_path / "no_adapter")])
    with pytest.raises(ConfigError, match="--max_new_tokens must be >= 1"):
        generate.main(["--model", "zoo", "--prompt", "Hello", "--max_new_tokens", "0"])
    adapter = pathlib.Path("marlhf_edu/assets/smollm2_sft_adapter")
    assert (adapter / "adapter_config.json").exists()
    for flags, message in ((["--check_prompts", "0"], "--check_prompts must be >= 1"),
                           (["--min_agreement", "1.5"], "--min_agreement in \\(0, 1\\]"),
                           ([], "cannot be created")):
        out = a_file / "merged" if not flags else tmp_path / "merged"
        with pytest.raises(ConfigError, match=message):
            merge.main(["--adapter", str(adapter), "--output_dir", str(out), *flags])


def test_a_config_class_refusing_its_values_is_a_config_error(tmp_path):
    from marlhf_edu.stages.sft import main

    with pytest.raises(ConfigError, match="invalid configuration"):
        main(["--config", "configs/tiny_sft.yaml", "--output_dir", str(tmp_path / "sft"), "--fp16", "true",
              "--bf16", "true"])


def test_an_unknown_data_format_is_a_data_error_naming_the_key(tmp_path):
    from marlhf_edu.data.formats import load_preferences

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    with pytest.raises(DataFileError, match="unknown preference format 'bogus' \\(dataset_format\\)"):
        load_preferences(str(pairs), "bogus")


TRL_STAGES = {"sft": ("marlhf_edu.stages.sft", "configs/tiny_sft.yaml"), "rm": ("marlhf_edu.stages.reward", "configs/tiny_rm.yaml"),
              "dpo": ("marlhf_edu.stages.dpo", "configs/tiny_dpo.yaml"), "grpo": ("marlhf_edu.stages.grpo", "configs/tiny_grpo.yaml")}


@pytest.mark.parametrize("stage", sorted(TRL_STAGES))
def test_trl_stages_refuse_a_finished_run_and_a_bad_resume_before_loading(tmp_path, no_loading, stage):
    """trl's trainers overwrite a finished run's folder without a word (transformers 5 has no
    overwrite_output_dir): the stages refuse it as PPO does, before anything loads, unless asked to replace it."""
    import importlib

    module, config = TRL_STAGES[stage]
    main = importlib.import_module(module).main
    out = tmp_path / "run"
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes(b"a finished run's weights")
    with pytest.raises(ConfigError, match=f"{stage}: output_dir .*run already holds a finished run "
                                          r"\(adapter_model.safetensors\)"):
        main(["--config", config, "--output_dir", str(out)])
    assert (out / "adapter_model.safetensors").read_bytes() == b"a finished run's weights"
    assert sorted(p.name for p in out.iterdir()) == ["adapter_model.safetensors"]  # nothing written
    # asked to replace it, the check lets the run go on (and the pipeline asks, for a stage it restarts)
    from types import SimpleNamespace

    from marlhf_edu.training.runs import check_output_dir

    check_output_dir(stage, SimpleNamespace(overwrite_output=True),
                     SimpleNamespace(output_dir=str(out), resume_from_checkpoint=None))
    with pytest.raises(ConfigError, match="holds no complete checkpoint-N"):
        main(["--config", config, "--output_dir", str(tmp_path / "empty"), "--resume_from_checkpoint", "true"])
    half = tmp_path / "run2" / "checkpoint-5"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"x")  # killed before trainer_state.json
    with pytest.raises(ConfigError, match="cannot be resumed from: no complete trainer_state.json"):
        main(["--config", config, "--output_dir", str(tmp_path / "run2"), "--resume_from_checkpoint", str(half)])


@pytest.mark.parametrize("stage", sorted(TRL_STAGES))
def test_trl_stages_hold_their_folder_for_the_whole_run_and_refuse_a_stopped_runs_checkpoints(
        tmp_path, no_loading, stage, monkeypatch):
    """Issue 37 items 2, 7: a trl stage took no lock (two launches into one folder both ran), and a folder holding
    a stopped run's checkpoint-N was reused without a word (a later resume could continue the old run's newest
    checkpoint). --overwrite_output removes them; a refused launch writes nothing."""
    import fcntl
    import importlib
    import os

    from conftest import held_by_another

    module, config = TRL_STAGES[stage]
    stage_module = importlib.import_module(module)
    out = tmp_path / "run"
    (out / "checkpoint-4").mkdir(parents=True)
    with pytest.raises(ConfigError, match=rf"{stage}: output_dir .* holds checkpoints of a stopped run "
                                          r"\(checkpoint-4\); pass --resume_from_checkpoint true"):
        stage_module.main(["--config", config, "--output_dir", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4"]  # nothing written, not even the lock

    seen = {}

    def run(script_args, training_args, model_args):  # in place of the training: is the folder held meanwhile?
        seen["held"] = held_by_another(out / ".lock")
        seen["left"] = sorted(p.name for p in out.iterdir())
        return "trained"

    run_name = {"sft": "run_sft", "rm": "run_rm", "dpo": "run_dpo", "grpo": "run_grpo"}[stage]
    monkeypatch.setattr(stage_module, run_name, run)
    assert stage_module.main(["--config", config, "--output_dir", str(out), "--overwrite_output", "true"]) == "trained"
    assert seen == {"held": True, "left": [".lock"]}  # held during the run; the stopped run's checkpoint removed
    fd = os.open(out / ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a running launch holds
    try:
        with pytest.raises(ConfigError, match="being written by another process"):
            stage_module.main(["--config", config, "--output_dir", str(out), "--overwrite_output", "true"])
    finally:
        os.close(fd)


@pytest.fixture
def locked(tmp_path, monkeypatch):
    """A folder this user may not write: read-only, and refused by `os.access` even to root (CI runs as root,
    whom permissions do not stop)."""
    import os

    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(0o500)
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if pathlib.Path(path) == folder and mode & os.W_OK
                        else real(path, mode, **kw))
    yield folder
    folder.chmod(0o700)


def test_an_output_dir_that_cannot_be_written_is_refused_before_loading(locked, no_loading):
    from marlhf_edu.stages.sft import main

    with pytest.raises(ConfigError, match="cannot be written .*locked is not writable"):
        main(["--config", "configs/tiny_sft.yaml", "--output_dir", str(locked / "sft")])


def test_the_pipeline_refuses_an_unwritable_later_stage_before_running_the_first(tmp_path, locked, no_loading):
    from marlhf_edu.stages.pipeline import run_pipeline
    from marlhf_edu.training.pipeline_file import Stage

    stages = [Stage("sft", "configs/tiny_sft.yaml", ["--output_dir", str(tmp_path / "sft")]),
              Stage("rm", "configs/tiny_rm.yaml", ["--output_dir", str(locked / "rm")])]
    with pytest.raises(ConfigError, match="rm's output_dir .* cannot be written"):
        run_pipeline(stages, log=lambda line: None, progress=False)
    assert not (tmp_path / "sft").exists()


@pytest.mark.parametrize("multi_adapter", [False, True])
def test_ppo_refuses_prompts_over_max_prompt_length_before_loading(tmp_path, no_loading, multi_adapter):
    with pytest.raises(ConfigError, match=r"prompt\(s\) exceed max_prompt_length=4 tokens"):
        ppo([*TINY_PPO, "--output_dir", str(tmp_path / "run"), "--max_prompt_length", "4"], multi_adapter=multi_adapter)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text, message", [
    ("stages:\n  sft: [configs/tiny_sft.yaml\n", r"line \d+: not valid YAML"),
    ("- sft\n- rm\n", "a pipeline file is a mapping .* not a list"),
    ("stages:\n  sft: configs/tiny_sft.yaml\noverrides: [max_steps]\n", "'overrides' maps each stage"),
    ("stages:\n  sft: configs/tiny_sft.yaml\noverrides:\n  sft: 10\n", "'overrides' maps each stage"),
    ("stages:\n  sft: {max_steps: 1}\n", r"stage\(s\) \['sft'\] need a config file path"),
])
def test_a_malformed_pipeline_file_is_a_config_error_naming_it(tmp_path, text, message):
    from marlhf_edu.training.pipeline_file import load_pipeline

    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"{path}.*{message}"):
        load_pipeline(str(path), [])


def test_an_evaluation_the_keyword_judge_cannot_give_is_refused_before_loading(tmp_path, no_loading, monkeypatch):
    """The keyword judge is built from the tokenizer alone, before any model loads (it used to be built after
    loading, so a judge without prompts failed a run that had already loaded its models), and the run reuses it."""
    from marlhf_edu.data import keyword_judge

    def no_request_fits(self, tokenizer, limit=None, max_prompt_tokens=64, **kwargs):
        raise keyword_judge.NoRequestFits(f"KeywordJudge: no test request fits in {max_prompt_tokens} tokens")

    monkeypatch.setattr(keyword_judge.KeywordJudge, "__init__", no_request_fits)
    with pytest.raises(ConfigError, match="no test request fits in 64 tokens: raise max_prompt_length"):
        ppo([*TINY_PPO, "--output_dir", str(tmp_path / "run"), "--dataset_name", "hh-rlhf-harmless-base",
             "--dataset_format", "hh-rlhf", "--max_prompt_length", "64", "--drop_long_prompts", "true",
             "--skip_bad_rows", "true"])
    assert not (tmp_path / "run").exists()



@pytest.fixture(scope="module")
def bad_reward_adapters(tmp_path_factory):
    """The shipped reward adapter copied twice: without its score head, and with a head one size too wide;
    `(name, folder, message expected)`."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from marlhf_edu.loading.assets import REWARD_ADAPTER_DIR, SFT_DIR

    hidden = json.loads((SFT_DIR / "config.json").read_text())["hidden_size"]
    state = load_file(str(REWARD_ADAPTER_DIR / "adapter_model.safetensors"))
    (score,) = [k for k in state if ".score." in k or k.split(".")[-2] == "score"]
    assert tuple(state[score].shape) == (1, hidden)  # the shipped adapter passes the check (as every PPO test shows)
    out = []
    for name, change, message in [
            ("no_head", lambda s: s.pop(score), r"expected one score-head weight in the adapter .* found \[\]"),
            ("wide_head", lambda s: s.__setitem__(score, state[score].new_zeros(1, hidden + 8)),
             rf"score head has shape \(1, {hidden + 8}\), expected \(1, {hidden}\) \(the width of "),
    ]:
        adapter = tmp_path_factory.mktemp("adapters") / name
        shutil.copytree(REWARD_ADAPTER_DIR, adapter)
        changed = dict(state)
        change(changed)
        save_file(changed, str(adapter / "adapter_model.safetensors"))
        out.append((name, adapter, message))
    return out


@pytest.mark.parametrize("multi_adapter", [False, True])
def test_a_reward_adapter_without_a_fitting_score_head_is_refused_before_loading(tmp_path, no_loading, multi_adapter,
                                                                                bad_reward_adapters):
    """A causal-LM adapter given as the reward model, or a score head of another width, is found from the
    safetensors header before anything loads (it used to be found by `load_score_head`, after loading)."""
    for name, adapter, message in bad_reward_adapters:
        with pytest.raises(ConfigError, match="reward_adapter_path: .*" + message):
            ppo([*TINY_PPO, "--output_dir", str(tmp_path / f"run_{name}"), "--reward_adapter_path", str(adapter)],
                multi_adapter=multi_adapter)
        assert not (tmp_path / f"run_{name}").exists()


@pytest.mark.parametrize("multi_adapter", [False, True])
def test_a_run_resolves_and_checks_its_reward_adapter_once_and_builds_with_it(tmp_path, monkeypatch, multi_adapter):
    """`reward_adapter_path` is resolved and checked once, before loading (`RewardAdapter.resolve`: the folder, the
    score head's header, the base it records), and the backend is built from that object, not from the reference
    again. A multi-adapter run's reward head is the adapter file's, read by the key the check found."""
    from safetensors.torch import load_file

    from marlhf_edu.loading import adapters
    from marlhf_edu.ppo import run as ppo_run

    calls = {}

    def counted(name, original):
        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return original(*args, **kwargs)
        return wrapper

    for name in ("check_reward_head", "check_reward_adapter_base", "adapter_base"):
        monkeypatch.setattr(adapters, name, counted(name, getattr(adapters, name)))
    monkeypatch.setattr(adapters.RewardAdapter, "resolve",
                        classmethod(counted("resolve", adapters.RewardAdapter.resolve.__func__)))
    built = {}

    class Built(Exception):
        pass

    def trainer(backend, *args, **kwargs):  # the backend is built: stop before training
        built["backend"] = backend
        raise Built

    monkeypatch.setattr(ppo_run, "PPOTrainer", trainer)
    with pytest.raises(Built):
        ppo([*TINY_PPO, "--output_dir", str(tmp_path / "run"), "--load_in_4bit", "false"], multi_adapter=multi_adapter)
    assert calls == {"resolve": 1, "check_reward_head": 1, "check_reward_adapter_base": 1, "adapter_base": 1}
    if multi_adapter:
        from marlhf_edu.loading.assets import REWARD_ADAPTER_DIR

        state = load_file(str(REWARD_ADAPTER_DIR / "adapter_model.safetensors"))
        (head,) = [v for k, v in state.items() if ".score." in k]
        assert torch.equal(built["backend"].reward_head.weight.detach(), head)


def test_multi_adapter_ppo_refuses_a_reward_base_other_than_its_own_before_loading(tmp_path, no_loading):
    import shutil

    from marlhf_edu.loading.assets import SFT_DIR

    other = tmp_path / "other_base"
    shutil.copytree(SFT_DIR, other)
    with pytest.raises(ConfigError, match="reward_base_path=.*differs from sft_model_path"):
        ppo([*TINY_PPO, "--output_dir", str(tmp_path / "run"), "--reward_base_path", str(other)], multi_adapter=True)
    assert not (tmp_path / "run").exists()


def test_every_stage_that_scores_with_a_reward_adapter_checks_its_head_before_loading(tmp_path, no_loading,
                                                                                      bad_reward_adapters):
    from marlhf_edu.loading.assets import SFT_DIR
    from marlhf_edu.stages import dpo, evaluate, grpo

    # the copies record their base relative to where they were written ("../tiny_sft"): the base is named
    for name, adapter, message in bad_reward_adapters:
        with pytest.raises(ConfigError, match="reward_adapter_path: .*" + message):
            grpo.main(["--config", "configs/tiny_grpo.yaml", "--output_dir", str(tmp_path / f"grpo_{name}"),
                       "--reward_adapter_path", str(adapter)])
        with pytest.raises(ConfigError, match="reward_adapter_path: .*" + message):
            dpo.main(["--config", "configs/tiny_dpo.yaml", "--output_dir", str(tmp_path / f"dpo_{name}"),
                      "--reward_adapter_path", str(adapter)])
        with pytest.raises(ConfigError, match="--reward_adapter: .*" + message):
            evaluate.main(["--model", "zoo", "--reward_adapter", str(adapter), "--reward_base", str(SFT_DIR)])


@pytest.mark.parametrize("command", ["sft", "rm", "ppo", "ma-ppo", "dpo", "grpo", "pipeline", "merge", "evaluate",
                                     "generate", "memory", "preflight", "zoo", "cache"])
def test_a_commands_help_is_no_error(command, capsys, no_loading):
    """`marlhf-edu COMMAND --help` prints the command's options and exits 0 (argparse's exit after help was once
    reported as an invalid configuration value, rc 2)."""
    from marlhf_edu.cli import main

    assert main([command, "--help"]) == 0
    captured = capsys.readouterr()
    assert "usage:" in captured.out and "invalid" not in captured.err


def test_mistakes_that_were_bare_value_errors_are_named_errors_before_loading(tmp_path, no_loading, capsys):
    """Issue 37 item 12: a split the shipped dataset does not have, refusal pairs from data with no refusal to
    borrow, and an evaluation limit no request fits reached the command line as tracebacks (the last after both
    models had loaded)."""
    import datasets

    from marlhf_edu import cli
    from marlhf_edu.stages.evaluate import main as evaluate
    from marlhf_edu.training.reward import RMScriptArguments, with_refusal_pairs

    assert cli.main(["ppo", *TINY_PPO, "--output_dir", str(tmp_path / "run"), "--dataset_name",
                     "hh-rlhf-harmless-base", "--dataset_format", "hh-rlhf", "--dataset_split", "validation"]) == 2
    err = capsys.readouterr().err
    assert "split must be one of" in err and "Traceback" not in err, err
    no_refusals = datasets.Dataset.from_list([{"prompt": "Q", "chosen": "Sure, here it is.", "rejected": "No."}])
    with pytest.raises(ConfigError, match="refusal_pairs: .*set refusal_pairs: 0 for this data"):
        with_refusal_pairs(no_refusals, None, RMScriptArguments(refusal_pairs=4))
    with pytest.raises(ConfigError, match="no test request fits in 1 tokens: raise --max_prompt_length"):
        evaluate(["--model", "zoo", "--judge", "keyword", "--max_prompt_length", "1"])


@pytest.mark.parametrize("stage, key", [("grpo", "max_rows"), ("sft", "max_tokens"), ("rm", "refusal_pairs"),
                                        ("dpo", "eval_repeats"), ("grpo", "missing_eos_penalty")])
def test_the_trl_stages_counts_and_limits_are_never_negative(stage, key, tmp_path, no_loading):
    """Issue 37 item 11: `max_rows: -3` made GRPO keep all but the last three prompts, silently."""
    import importlib

    module = {"sft": "sft", "rm": "reward", "dpo": "dpo", "grpo": "grpo"}[stage]
    with pytest.raises(ConfigError, match=f"{key} must be >= 0"):
        importlib.import_module(f"marlhf_edu.stages.{module}").main(["--config", f"configs/tiny_{stage}.yaml",
                                                                      "--output_dir", str(tmp_path / stage),
                                                                      f"--{key}", "-3"])
