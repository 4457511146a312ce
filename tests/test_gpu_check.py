"""tools/gpu_check.py, the check a GPU owner runs first (issue 34), on CPU at a reduced shape so that it cannot rot.

Its numbers here check the tool, not a GPU; the record of the run on an H100 is benchmarks/gpu_check.json.
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check

    tmp = tmp_path_factory.mktemp("gpu_check")
    out = tmp / "record.json"
    gpu_check.main(["ppo", "ppo_merged", "ppo_fast", "sampling", "stages", "pipeline", "--device", "cpu", "--reduced",
                    "--rows", "64",
                    "--work", str(tmp / "work"), "--out", str(out)])
    return json.loads(out.read_text())


#: a check whose outcome on this reduced CPU model depends on the CPU, so the tool's test cannot require it: the
#: bf16 merged copy's share of the policy's move sits at its 90 % line here (0.892 on an AMD EPYC without AVX-512,
#: above 0.9 on an Intel Xeon: their bf16 kernels sum in different orders). On the H100 both copies fell below
#: it (bf16 0.786, fp32 0.770; benchmarks/gpu_check.json): there it is a finding the record reports
ROUNDING_CHECKS = {"bf16 merged copy keeps >= 90 % of the policy's move"}


@pytest.mark.slow
def test_every_part_runs_and_passes_its_checks(record):
    for part in ("ppo", "ppo_merged", "ppo_fast", "sampling", "stages", "pipeline"):
        assert "error" not in record[part], record[part].get("traceback")
        checks = {k: v for k, v in record[part]["checks"].items() if k not in ROUNDING_CHECKS}
        assert all(ok in (True, None) for ok in checks.values()), (part, record[part]["checks"])
    assert ROUNDING_CHECKS <= set(record["sampling"]["checks"])
    assert record["model"]["checkpoint_dtype"] == "float16"  # saved as the real Llama-2-7b-hf is


@pytest.mark.slow
def test_the_ppo_part_measures_what_issue_34_asks(record):
    ppo = record["ppo"]
    assert ppo["steps"] == 3 and len(ppo["seconds"]["time/generate_s"]) == 3
    assert ppo["first_minibatch"]["policy/ratio_mean"] == 1.0  # one process, fp32 on CPU: exactly 1
    assert ppo["dtypes"]["trainable"] == ["torch.float32"]
    # lora_B starts at 0, so lora_A's first gradient is exactly 0: the tool reports the two apart
    assert ppo["policy_lora_grad_zero_share"][0]["lora_A"] == 1.0
    assert ppo["policy_lora_grad_zero_share"][-1]["lora_A"] < 1.0
    assert ppo["planned"]["peak_gib"] > 0


@pytest.mark.slow
def test_the_merged_part_plans_and_runs_the_dense_copy(record):
    merged, plain = record["ppo_merged"], record["ppo"]
    assert merged["merged_rollout"] is True and plain["merged_rollout"] is False
    # the plan counts the dense copy: the whole model once more in the compute dtype
    assert merged["planned"]["parts_gib"]["weights"] > plain["planned"]["parts_gib"]["weights"]
    assert merged["first_minibatch"]["policy/ratio_mean"] == 1.0
    # on CPU there is no device memory to read: recorded as unknown, not as 0
    assert merged["phase_memory"] == {} and merged["memory_peak"]["outside_allocator_gib"] is None


@pytest.mark.slow
def test_the_fast_part_runs_the_static_cache_at_the_planned_micro_batch(record):
    """ppo_fast: the merged copy with a static KV cache and TIS, at the micro-batch preflight picks (the whole
    minibatch of 2 fits the nominal 80 GiB at this reduced shape); per-step log-prob gaps and TIS weights; the
    compiled-vs-eager comparison (nothing is compiled on a CPU: exactly 0); the step target is a GPU check."""
    fast = record["ppo_fast"]
    assert fast["merged_rollout"] is True and fast["rollout_cache"] == "static"
    assert fast["micro_batch_size"] == 2 and fast["overrides"][-2:] == ["--micro_batch_size", "2"]
    assert len(fast["logprob_gap"]) == fast["steps"] == 3 and all(0 <= g < 1e-2 for g in fast["logprob_gap"])
    assert all(abs(w - 1) < 1e-2 for w in fast["tis_weight_mean"])
    assert fast["compiled_vs_eager"]["tokens"] > 0 and fast["compiled_vs_eager"]["max_abs"] == 0.0
    later = fast["seconds"]["time/step_s"][1:]  # two steps after the first: their mean is the median
    assert fast["median_step_after_first_s"] == pytest.approx(sum(later) / 2)
    assert fast["checks"]["step <= 10 s (median after the first)"] is None  # a GPU's check


@pytest.mark.slow
def test_a_part_leaves_no_model_alive_for_the_next(tmp_path, monkeypatch):
    """Reference cycles (hooks, the step-counting closure) kept a finished part's trainer allocated until some
    later collection: on the H100, ppo after ppo_merged started with 17.1 GiB left over. main() collects between
    parts, so the first part's backend is gone when the next part builds its trainer."""
    import weakref

    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check

    built, alive_at_next, real = [], [], gpu_check.new_trainer

    def tracking(config):
        alive_at_next.append([ref() is not None for ref in built])
        trainer = real(config)
        built.append(weakref.ref(trainer.backend))
        return trainer

    monkeypatch.setattr(gpu_check, "new_trainer", tracking)
    gpu_check.main(["ppo_merged", "ppo", "--device", "cpu", "--reduced", "--rows", "64", "--steps", "1",
                    "--work", str(tmp_path / "w"), "--out", str(tmp_path / "r.json")])
    assert alive_at_next == [[], [False]]


@pytest.mark.slow
def test_the_sampling_part_sees_bf16_rounding_of_the_lora_update(record):
    """A merged bf16 copy loses a large part of an early LoRA update (RMS 1e-4 on weights of scale 0.02); fp32 none."""
    s = record["sampling"]
    assert abs(s["perturbation_rms"] - 1e-4) < 1e-6
    assert s["merged_bf16"]["delta_relative_error_in_weights"] > 0.1
    assert s["merged_fp32"]["delta_relative_error_in_weights"] == 0.0
    assert 0.5 < s["merged_bf16"]["share_of_policy_move_kept"] < 1.5  # measured (its 90 % line: see ROUNDING_CHECKS)
    assert set(s["generate"]) == {"adapter", "merged"} and set(s["update"]) == {"micro_batch_1", "micro_batch_2"}


@pytest.mark.slow
def test_the_stage_parts_run_every_stage(record):
    assert set(record["stages"]["stages"]) == {"sft", "merge", "rm", "ma-ppo", "evaluate", "export_merge"}
    assert record["stages"]["stages"]["merge"]["disk_gib"] > 0
    assert [s["stage"] for s in record["pipeline"]["stages"]] == ["sft", "rm", "ma-ppo"]
    after = record["stages"]["stages"]
    assert after["evaluate"]["code"] == 0 and after["export_merge"]["code"] == 0
    assert after["export_merge"]["agreement"] == 1.0 and after["export_merge"]["max_logprob_gap"] < 1e-3


def test_the_committed_gpu_record_is_whole():
    """The H100 record has every part, its machine, and each part's command."""
    gpu = json.loads((ROOT / "benchmarks" / "gpu_check.json").read_text())
    assert gpu["machine"]["gpu"].startswith("NVIDIA") and gpu["model"]["reduced"] is False
    for part in ("ppo", "sampling", "stages", "pipeline", "sampling_before_fix", "pipeline_before_fix"):
        assert "error" not in gpu[part] and gpu[part]["command"].startswith("python tools/gpu_check.py")
    assert gpu["sampling"]["old_vs_update_gap"] == 0.0  # the rollout's rows equal the update's
    assert all(c for part in ("ppo", "stages", "pipeline") for c in gpu[part]["checks"].values())
    assert {"evaluate", "export_merge"} <= set(gpu["stages"]["stages"])  # both ran on the GPU
    # third session: merged_rollout's steps, the device as the driver sees it, and the allocator's slack
    for part in ("ppo_merged", "ppo_merged_expandable", "ppo_expandable", "stages_sft_rm"):
        assert "error" not in gpu[part] and all(gpu[part]["checks"].values()), part
        assert gpu[part]["machine"]["gpu"].startswith("NVIDIA")
    assert gpu["ppo_expandable"]["memory_after_load"]["allocated_gib"] < 4.5  # nothing left by the part before
    assert gpu["ppo_merged_expandable"]["memory_peak"]["max_reserved_gib"] < gpu["ppo_merged"]["memory_peak"][
        "max_reserved_gib"] / 1.5
    assert {s: gpu["stages_sft_rm"]["stages"][s]["saved_trainable_dtypes"] for s in ("sft", "rm")} == {
        "sft": ["F32"], "rm": ["F32"]}  # item 5 on the GPU: adapters (and the score head) trained and saved in fp32


def test_the_committed_fast_launch_record_meets_the_step_target():
    """The fast launch on the H100: every check true (the 10 s step among them), at the micro-batch preflight picks
    for 80 GB, sampled from the static-cache copy; the baseline from the same call samples without it and is slower;
    the H200 record of the same call is a record of its own machine."""
    gpu = json.loads((ROOT / "benchmarks" / "gpu_check.json").read_text())
    fast, plain = gpu["ppo_fast"], gpu["ppo_merged_beside_fast"]
    assert fast["machine"]["gpu"] == plain["machine"]["gpu"] == "NVIDIA H100 80GB HBM3"
    assert fast["rollout_cache"] == "static" and fast["micro_batch_size"] == 4 and fast["steps"] == 5
    assert all(fast["checks"].values()) and fast["median_step_after_first_s"] <= 10.0
    assert plain["rollout_cache"] == "dynamic" and min(plain["seconds"]["time/step_s"][1:]) > 10.0
    for name in ("gpu_check_h200.json", "gpu_check_h200_second.json"):
        h200 = json.loads((ROOT / "benchmarks" / name).read_text())
        assert h200["machine"]["gpu"] == "NVIDIA H200" and all(h200["ppo_fast"]["checks"].values())
        assert h200["ppo_fast"]["rollout_cache"] == "static" and h200["ppo_merged"]["rollout_cache"] == "dynamic"
    third = json.loads((ROOT / "benchmarks" / "gpu_check_h200_third.json").read_text())
    assert third["machine"]["gpu"] == "NVIDIA H200" and all(third["ppo_fast"]["checks"].values())
    assert third["ppo_fast"]["rollout_cache"] == "static" and third["ppo_fast"]["median_step_after_first_s"] <= 10.0
    # the first record whose gap comes from the decode itself: present at step 1 already (the LoRA still zero),
    # where the records from full forwards of the copy saw under 0.01
    fourth = json.loads((ROOT / "benchmarks" / "gpu_check_h200_fourth.json").read_text())
    run = fourth["ppo_fast"]
    assert fourth["machine"]["gpu"] == "NVIDIA H200" and all(run["checks"].values())
    assert run["rollout_cache"] == "static" and run["median_step_after_first_s"] <= 10.0
    assert run["logprob_gap"][0] > 0.05 and third["ppo_fast"]["logprob_gap"][0] < 0.01
    assert all(abs(w - 1) < 0.01 for w in run["tis_weight_mean"])
    # the packed engine on a GPU: the fast launch and the recipe's own sampler (the policy packed at one row per
    # forward), every check true
    packed = json.loads((ROOT / "benchmarks" / "gpu_check_h200_packed.json").read_text())
    assert packed["machine"]["gpu"] == "NVIDIA H200"
    assert all(packed["ppo_fast"]["checks"].values()) and all(packed["ppo"]["checks"].values())
    assert packed["ppo_fast"]["median_step_after_first_s"] <= 10.0 and packed["ppo"]["merged_rollout"] is False
    sixth = json.loads((ROOT / "benchmarks" / "gpu_check_h200_sixth.json").read_text())  # the same engine again
    assert sixth["machine"]["gpu"] == "NVIDIA H200" and all(sixth["ppo_fast"]["checks"].values())
    assert sixth["ppo_fast"]["median_step_after_first_s"] <= 10.0


def test_a_record_from_another_machine_is_not_merged(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check

    out = tmp_path / "record.json"
    out.write_text(json.dumps({"machine": {"gpu": "elsewhere"}, "about": "a note", "ppo": {"checks": {}}}))
    gpu_check.main(["ppo", "--device", "cpu", "--reduced", "--rows", "64", "--work", str(tmp_path / "w"),
                    "--out", str(out)])
    record = json.loads(out.read_text())
    assert "about" not in record and record["machine"].get("gpu") is None and "error" not in record["ppo"]
