"""Data-parallel PPO (marlhf_edu/ppo/distributed.py), proven on CPU: 2 gloo processes launched by `accelerate launch`.

* A 2-rank run equals a 1-process run on the same global batch: rollout statistics, losses and every logged
  number of 2 steps, and the trainable weights after them. Tolerance: 1e-6 relative on the logged numbers,
  1e-6 absolute on weights. (With one thread per process they agree to the bit on the machines we tried; the
  tolerance leaves room for a different summation order of the two ranks' gradients on other CPUs. Without the
  gradient all-reduce the weights differ by ~1e-3 and the losses by 1e-4: see `test_ranks_take_the_mean_gradient`.)
* A 2-rank run killed after a checkpoint and resumed equals one that was never interrupted.
* Resuming with another number of ranks is refused, naming both.
* The four-model engine (full fine-tuning, a separate critic) on 2 ranks equals 1 process too, and the whole
  pipeline (trl's SFT and reward trainers, then MA-PPO) runs on 2 ranks.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
ACCELERATE = pathlib.Path(sys.executable).with_name("accelerate")
# the tiny world on an NF4 base with policy, value and reward adapters: MA-PPO as the 7B run does it
SHAPE = ["--config", "configs/tiny_ma_ppo.yaml", "--batch_size", "8", "--mini_batch_size", "4",
         "--micro_batch_size", "2", "--forward_batch_size", "4", "--max_new_tokens", "12", "--eval_repeats", "0",
         "--rollout_seeding", "per_chunk"]


def _env() -> dict:
    # one thread per process on both sides, as torch.distributed.run gives each rank
    return {**os.environ, "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error", "OMP_NUM_THREADS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(*args, command="ma-ppo", shape=SHAPE) -> list[str]:
    return [str(ACCELERATE), "launch", "--config_file", "configs/accelerate/cpu_2proc.yaml",
            "--main_process_port", str(_free_port()), "-m", "marlhf_edu.cli", command, *shape, *args]


def _one_process(*args, command="ma-ppo", shape=SHAPE) -> list[str]:
    return [sys.executable, "-m", "marlhf_edu.cli", command, *shape, *args]


def _run(cmd, timeout=300):
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def _records(out: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _weights(out: pathlib.Path, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "checkpoints" / f"step-{step:06d}" / "trainable.safetensors"))


def _assert_same_records(a: list[dict], b: list[dict]):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        keys = {k for k in ra if not k.startswith("time/")}
        assert keys == {k for k in rb if not k.startswith("time/")}
        for k in keys:
            assert rb[k] == pytest.approx(ra[k], rel=1e-6, abs=1e-9), (ra["step"], k)


def _assert_same_weights(a: dict, b: dict):
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """4 steps on 2 ranks, checkpoints after steps 2 and 4 (both kept)."""
    out = tmp_path_factory.mktemp("ddp") / "two_ranks"
    _run(_two_ranks("--total_steps", "4", "--save_steps", "2", "--output_dir", str(out)))
    return out


@pytest.mark.slow
def test_two_ranks_equal_one_process_on_the_same_global_batch(two_rank_run, tmp_path):
    one = tmp_path / "one"
    _run(_one_process("--total_steps", "2", "--save_steps", "2", "--output_dir", str(one)))
    two = _records(two_rank_run)
    assert len(two) == 4  # rank 0 alone writes: one record per step, not one per rank
    _assert_same_records(_records(one), two[:2])
    _assert_same_weights(_weights(one, 2), _weights(two_rank_run, 2))
    ckpt = two_rank_run / "checkpoints" / "step-000002"
    assert json.loads((ckpt / "state.json").read_text())["world_size"] == 2
    assert {p.name for p in ckpt.glob("rng*.pt")} == {"rng-rank0.pt", "rng-rank1.pt"}
    assert (two_rank_run / "policy" / "adapter_config.json").exists()


@pytest.mark.slow
def test_the_engine_guides_two_process_command_runs_as_written(tmp_path):
    """site/engine.md's CPU data-parallel line, as printed there, for one step (a free port, the step count and an
    output folder added): a documented command that the config refuses would fail here, as the guide's line did
    (`mini_batch_size (16) ... whole micro-batches of micro_batch_size (16)`)."""
    import re
    import shlex

    guide = (ROOT / "site" / "engine.md").read_text()
    lines = [line for block in re.findall(r"```bash\n(.*?)```", guide, re.S)
             for line in block.replace("\\\n", " ").splitlines() if "cpu_2proc.yaml" in line and "ma-ppo" in line]
    assert len(lines) == 1, lines
    cmd = shlex.split(lines[0])
    assert cmd[:4] == ["accelerate", "launch", "--config_file", "configs/accelerate/cpu_2proc.yaml"]
    cmd = [str(ACCELERATE), *cmd[1:4], "--main_process_port", str(_free_port()), *cmd[4:],
           "--total_steps", "1", "--eval_repeats", "0", "--output_dir", str(tmp_path / "run")]
    _run(cmd, timeout=600)
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.slow
def test_old_logprobs_from_the_sampler_on_two_ranks_equal_one_process(tmp_path):
    """`old_logprobs: sampler`: each rank keeps what its sampler recorded for its shard, and the gap its part of the
    first minibatch measured is gathered, so 2 ranks log what 1 process logs, the gap included."""
    shape = [*SHAPE, "--old_logprobs", "sampler", "--value_mode", "shared", "--merged_rollout", "true",
             "--total_steps", "1", "--save_steps", "1"]
    one, two = tmp_path / "one", tmp_path / "two"
    _run(_one_process("--output_dir", str(one), shape=shape))
    _run(_two_ranks("--output_dir", str(two), shape=shape))
    records = _records(one)
    assert "rollout/logprob_gap" in records[0] and records[0]["time/policy_s"] == 0.0
    _assert_same_records(records, _records(two))
    _assert_same_weights(_weights(one, 1), _weights(two, 1))


@pytest.mark.slow
def test_four_model_full_fine_tuning_on_two_ranks_equals_one_process(tmp_path):
    """The other engine: four models, every weight of the actor and the separate critic trained (no LoRA)."""
    shape = ["--config", "configs/tiny_ppo.yaml", *SHAPE[2:], "--total_steps", "1", "--save_steps", "1"]
    one, two = tmp_path / "one", tmp_path / "two"
    _run(_one_process("--output_dir", str(one), command="ppo", shape=shape))
    _run(_two_ranks("--output_dir", str(two), command="ppo", shape=shape))
    _assert_same_records(_records(one), _records(two))
    weights = _weights(one, 1)
    assert len(weights) > 50 and any(k.startswith("critic.") for k in weights)  # actor and critic, in full
    _assert_same_weights(weights, _weights(two, 1))


@pytest.mark.slow
def test_the_whole_pipeline_runs_on_two_ranks(tmp_path):
    """`marlhf-edu pipeline` under `accelerate launch`: trl's SFT and reward trainers and the PPO engine each run
    data-parallel on the same two processes; rank 0 writes the stage markers. The SFT stage trains a LoRA on the
    shipped tiny model, as the 7B recipe does, so the reward and PPO stages load it merged into its base: one merge
    (rank 0's, issue 34) in the model cache, and the adapter's recorded base intact."""
    import yaml

    out = tmp_path / "run"
    spec = {"stages": {"sft": "configs/tiny_sft.yaml", "rm": "configs/tiny_rm.yaml", "ma-ppo": "configs/tiny_ma_ppo.yaml"},
            "overrides": {
                "sft": {"max_steps": 2, "per_device_train_batch_size": 4, "output_dir": str(out / "sft"),
                        "model_name_or_path": "zoo", "use_peft": True, "lora_r": 4, "lora_alpha": 8,
                        "lora_target_modules": ["q_proj", "v_proj"], "learning_rate": 1e-3},
                "rm": {"max_steps": 2, "per_device_train_batch_size": 4, "eval_pairs": 8, "output_dir": str(out / "rm")},
                "ma-ppo": {"total_steps": 1, "batch_size": 8, "mini_batch_size": 4, "micro_batch_size": 2,
                           "forward_batch_size": 4, "max_new_tokens": 8, "eval_repeats": 0,
                           "rollout_seeding": "per_chunk", "output_dir": str(out / "ma_ppo")}}}
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    cache = tmp_path / "cache"
    done = subprocess.run([str(ACCELERATE), "launch", "--config_file", "configs/accelerate/cpu_2proc.yaml",
                           "--main_process_port", str(_free_port()), "-m", "marlhf_edu.cli", "pipeline", "--config",
                           str(path)], cwd=ROOT, env={**_env(), "MARLHF_EDU_CACHE": str(cache)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    for stage, sub in (("sft", "sft"), ("rm", "rm"), ("ma-ppo", "ma_ppo")):
        assert json.loads((out / sub / "pipeline_stage.json").read_text())["stage"] == stage
    assert done.stdout.count("pipeline: sft starts") == 2  # both ranks ran every stage
    assert json.loads((out / "sft" / "adapter_config.json").read_text())["base_model_name_or_path"] == "zoo"
    merged = [p.name for p in (cache / "merged").iterdir()]
    assert len([m for m in merged if m.startswith("sft-") and not m.endswith(".lock")]) == 1, merged
    state = json.loads((out / "ma_ppo" / "checkpoints" / "step-000001" / "state.json").read_text())
    assert state["world_size"] == 2 and len(_records(out / "ma_ppo")) == 1


@pytest.mark.slow
def test_a_killed_two_rank_run_resumes_to_the_uninterrupted_one(two_rank_run, tmp_path):
    out = tmp_path / "killed"
    cmd = _two_ranks("--total_steps", "4", "--save_steps", "2", "--output_dir", str(out))
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not (latest.exists() and latest.read_text().strip() == "step-000002"):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks, mid-run
    proc.wait()
    assert not (out / "checkpoints" / "step-000004").exists()
    _run(_two_ranks("--total_steps", "4", "--save_steps", "2", "--output_dir", str(out), "--resume", "true"))
    _assert_same_records(_records(two_rank_run), _records(out))
    _assert_same_weights(_weights(two_rank_run, 4), _weights(out, 4))


@pytest.mark.slow
def test_resuming_with_another_number_of_ranks_is_refused(two_rank_run, tmp_path):
    import shutil

    out = tmp_path / "copy"
    shutil.copytree(two_rank_run, out)
    done = subprocess.run(_one_process("--total_steps", "6", "--output_dir", str(out), "--resume", "true"),
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "2 rank(s)" in done.stderr and "this one has 1" in done.stderr


# ---- the collectives, on 2 gloo processes without models --------------------------------------

def _mean_gradient_worker(rank: int, port: int, results):
    import torch.distributed as dist

    from marlhf_edu.ppo import distributed

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    distributed.BUCKET_ELEMENTS = 5  # several buckets, one parameter larger than a bucket
    dp = distributed.DataParallel(rank, 2)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 4, 7, 1)]
    for i, p in enumerate(params):
        if not (i == 3 and rank == 0):  # the last parameter has a gradient on rank 1 only
            p.grad = torch.full_like(p, 10.0 * i + rank)
    dp.average_gradients(params)
    gathered = dp.gather(torch.tensor([[rank, 1], [rank, 2]]))
    results[rank] = ([p.grad.tolist() for p in params], gathered.tolist(), dp.max_int(rank + 3), dp.any(rank == 1),
                     dp.shard(list(range(6))))
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_take_the_mean_gradient():
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_mean_gradient_worker, args=(_free_port(), results), nprocs=2)
        results = dict(results)
    # mean over ranks; the last parameter's missing gradient on rank 0 counts as zero: (0 + 31) / 2
    mean = [[10.0 * i + 0.5] * n for i, n in enumerate((3, 4, 7))] + [[15.5]]
    for rank in (0, 1):
        got, gathered, biggest, anyone, shard = results[rank]
        assert got == mean
        assert gathered == [[0, 1], [0, 2], [1, 1], [1, 2]]  # rank 0's rows first
        assert biggest == 4 and anyone is True
        assert shard == ([0, 1, 2] if rank == 0 else [3, 4, 5])


# ---- one process: what the data-parallel path adds ------------------------------------------

def test_data_parallel_shapes_are_checked():
    from marlhf_edu.errors import ConfigError
    from marlhf_edu.ppo import PPOConfig

    ok = PPOConfig(batch_size=8, mini_batch_size=4, micro_batch_size=2, forward_batch_size=4, rollout_seeding="per_chunk")
    ok.validate_data_parallel(2)
    PPOConfig().validate_data_parallel(1)  # one process: anything goes
    with pytest.raises(ConfigError, match="rollout_seeding: per_chunk"):
        PPOConfig(batch_size=8, mini_batch_size=4, micro_batch_size=2).validate_data_parallel(2)
    with pytest.raises(ConfigError, match=r"batch_size \(6\) is global"):
        PPOConfig(batch_size=6, mini_batch_size=2, micro_batch_size=1, rollout_seeding="per_chunk").validate_data_parallel(4)
    with pytest.raises(ConfigError, match=r"mini_batch_size \(4\) is global.*micro_batch_size \(4\)"):
        PPOConfig(batch_size=8, mini_batch_size=4, micro_batch_size=4, rollout_seeding="per_chunk").validate_data_parallel(2)
    with pytest.raises(ConfigError, match="rollout_seeding must be"):
        PPOConfig(rollout_seeding="per_rank").validate()
    # per_chunk seeds forward chunks of the global batch: a rank's 4 rows of a 16-row chunk would be seeded as a chunk
    # one process never forms (the 7B config, batch 16 and forward_batch_size 16, on 4 GPUs), so it is refused
    with pytest.raises(ConfigError, match=r"forward_batch_size \(16\) must divide each rank's share of the batch \(4 rows"):
        PPOConfig(batch_size=16, mini_batch_size=4, micro_batch_size=1, forward_batch_size=16,
                  rollout_seeding="per_chunk").validate_data_parallel(4)
    PPOConfig(batch_size=64, mini_batch_size=4, micro_batch_size=1, forward_batch_size=16,
              rollout_seeding="per_chunk").validate_data_parallel(4)  # 16 rows a rank: one whole chunk


def test_each_rank_trains_on_its_own_gpu(monkeypatch):
    from marlhf_edu.ppo import PPOConfig

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert PPOConfig(device="cuda").resolved_device == "cuda:3"
    assert PPOConfig(device="cpu").resolved_device == "cpu"
    assert PPOConfig(device="cuda:0").resolved_device == "cuda:0"  # an explicit GPU is taken as given
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert PPOConfig(device="cuda").resolved_device == "cuda"


def test_left_padding_to_the_global_width():
    from marlhf_edu.ppo.distributed import left_pad_to

    ids, mask = torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]])
    wide_ids, wide_mask = left_pad_to(ids, mask, 5, pad_id=0)
    assert wide_ids.tolist() == [[0, 0, 0, 5, 6], [0, 0, 7, 8, 9]]
    assert wide_mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]
    assert left_pad_to(ids, mask, 3, 0)[0] is ids


def test_per_chunk_sampling_depends_only_on_seed_step_and_chunk(tmp_path, prompts):
    """What makes the shards' samples independent of the number of ranks: the random stream of the rest of
    the run (here: drawn from between two rollouts) does not change them; the step does."""
    from conftest import build_trainer

    from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend

    base = dict(batch_size=8, mini_batch_size=4, micro_batch_size=2, forward_batch_size=4, max_new_tokens=12,
                device="cpu", rollout_seeding="per_chunk")
    trainer = build_trainer(tmp_path, MultiAdapterBackend, prompts, base)
    batch = trainer.batch_prompts(0)
    first = trainer.rollout(batch).input_ids
    torch.rand(1000)
    assert torch.equal(trainer.rollout(batch).input_ids, first)
    trainer.step_index = 1
    assert not torch.equal(trainer.rollout(batch).input_ids, first)
    stream = build_trainer(tmp_path / "stream", MultiAdapterBackend, prompts, {**base, "rollout_seeding": "stream"})
    one = stream.rollout(batch).input_ids
    assert not torch.equal(stream.rollout(batch).input_ids, one)  # the default: one stream, it moves on
