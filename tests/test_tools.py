"""The scripts in `tools/`: each takes the record helpers from the package (`marlhf_edu.records`), never from
another script through `sys.path`; each experiment has a folder of its own whose README names its scripts; and
the index, `tools/README.md`, names every script."""

from __future__ import annotations

import ast
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
EXPERIMENTS = TOOLS / "experiments"
SCRIPTS = sorted(p for p in TOOLS.rglob("*.py") if "__pycache__" not in p.parts)
FOLDERS = sorted(p for p in EXPERIMENTS.iterdir() if p.is_dir() and list(p.glob("*.py")))


#: the one change to `sys.path` a script may make: the repository root first, to import `marlhf_edu` uninstalled
ROOT_FIRST = "sys.path.insert(0, str(ROOT))"


def path_tricks(source: str) -> list[str]:
    """Each call on `sys.path` in `source` (insert, append, extend, ...) other than `ROOT_FIRST`, as written."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and ast.unparse(node.func.value) == "sys.path" and ast.unparse(node) != ROOT_FIRST):
            found.append(ast.unparse(node))
    return found


def imported_modules(source: str) -> set[str]:
    """The top-level names of every module `source` imports."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_the_layout_is_what_this_file_checks():
    assert len(SCRIPTS) >= 20 and len(FOLDERS) >= 6
    assert not list(EXPERIMENTS.glob("*.py")), "a script in tools/experiments/ belongs in a folder of its own"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(TOOLS)))
def test_no_script_puts_more_than_the_repository_root_on_sys_path(script):
    source = script.read_text()
    assert not path_tricks(source), f"{script.relative_to(ROOT)}: {path_tricks(source)}; import marlhf_edu.records"
    # a script imports another only inside its own experiment folder (which running it puts on sys.path)
    others = {p.stem for p in SCRIPTS if p.parent != script.parent}
    assert not imported_modules(source) & others, f"{script.relative_to(ROOT)} imports a script of another folder"


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_every_experiment_folder_has_a_readme_naming_its_scripts(folder):
    readme = folder / "README.md"
    assert readme.is_file(), f"{folder.relative_to(ROOT)} has no README.md"
    text = readme.read_text()
    for script in sorted(folder.glob("*.py")):
        assert script.name in text, f"{readme.relative_to(ROOT)} does not name {script.name}"
        # the usage line in the script's docstring is the command the README and the records give
        assert f"python {script.relative_to(ROOT)}" in script.read_text(), f"{script.name}: usage line"


def test_the_index_names_every_script():
    index = (TOOLS / "README.md").read_text()
    missing = [str(p.relative_to(TOOLS)) for p in SCRIPTS if str(p.relative_to(TOOLS)) not in index]
    assert not missing, f"tools/README.md does not name {missing}"


def test_the_rule_sees_a_path_trick_and_not_the_repository_root():
    assert path_tricks('import sys\nsys.path.insert(0, str(ROOT / "tools"))\n')
    assert path_tricks("import sys\nsys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))\n")
    assert path_tricks("import sys\nsys.path.append(TOOLS_DIR)\n")
    assert not path_tricks("import sys\nsys.path.insert(0, str(ROOT))\n")
    assert imported_modules("from bench_ppo import machine\nimport marlhf_edu.records\n") == {"bench_ppo", "marlhf_edu"}


def _tool(name: str):
    """tools/<name>.py as a module (the scripts are not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_trl_summarises_repeats_by_their_median():
    """`compare_trl.py --repeats N`: per case and label, every repeat's trl ÷ ours, the median, and the repeat
    whose ratio is the median (the run whose phases the chapter draws)."""
    module = _tool("compare_trl")

    def run(case, label, repeat, ours, trl):
        return {"case": case, "repeat": repeat, "ours": {"label": label, "step_s": ours}, "trl": {"step_s": trl},
                "trl_s_over_ours_s": round(trl / ours, 3)}

    results = [run("lora", "a", 1, 1.0, 1.2), run("lora", "b", 1, 2.0, 1.2), run("lora", "a", 2, 1.0, 0.9),
               run("lora", "b", 2, 2.0, 0.9), run("lora", "a", 3, 1.0, 1.0), run("lora", "b", 3, 2.0, 1.0)]
    summary = {s["label"]: s for s in module.summarise_repeats(results)}
    assert list(summary) == ["a", "b"]
    assert summary["a"]["trl_s_over_ours_s"] == [1.2, 0.9, 1.0] and summary["a"]["median_trl_s_over_ours_s"] == 1.0
    assert summary["a"]["median_repeat"] == 3 and summary["b"]["median_repeat"] == 3
    assert summary["b"]["ours_step_s"] == [2.0, 2.0, 2.0] and summary["b"]["trl_step_s"] == [1.2, 0.9, 1.0]


def test_every_setting_compare_trl_times_is_a_config_its_engine_accepts(tmp_path):
    """Each (label, command, overrides) of `compare_trl.OURS`, the CPU-options rows included, parses with the tiny
    config, validates, and passes its backend's `check_config`: a setting the engine refuses would fail only
    after trl's run, in the middle of a comparison."""
    from marlhf_edu.ppo import FourModelBackend, PPOConfig
    from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend
    from marlhf_edu.training.args import parse_stage_args

    module = _tool("compare_trl")
    backends = {"ppo": FourModelBackend, "ma-ppo": MultiAdapterBackend}
    settings = [s for case in module.OURS.values() for s in case]
    assert sum(label.endswith("CPU options") for label, _, _ in settings) == 2
    for label, command, overrides in settings:
        (config,) = parse_stage_args((PPOConfig,), ["--config", str(ROOT / module.CONFIG), *overrides,
                                                    "--output_dir", str(tmp_path)])
        backends[command].check_config(config.validate())
        if label.endswith("CPU options"):
            assert (config.old_logprobs, config.onednn_matmuls, config.token_draw) == ("sampler", True, "inverse_cdf")


def _speed_targets():
    return _tool("speed_targets")


def test_speed_targets_names_the_cpu_kind_by_its_widest_vector_set():
    module = _speed_targets()

    def cpuinfo(name, flags):
        return f"processor\t: 0\nmodel name\t: {name}\nflags\t\t: {flags}\n\nprocessor\t: 1\nmodel name\t: x\n"

    assert module.cpu_kind(cpuinfo("AMD EPYC 7B13", "fpu sse avx avx2 fma")) == "amd_epyc_avx2"
    assert module.cpu_kind(cpuinfo("Intel(R) Xeon(R) Processor", "avx2 avx512f avx512bw")) == "intel_xeon_avx512"
    assert module.cpu_kind(cpuinfo("AMD EPYC 9R14", "avx2 avx512f avx512_bf16")) == "amd_epyc_avx512bf16"
    assert module.cpu_kind(cpuinfo("Some Other CPU 3", "sse sse2")) == "some_other_sse"
    assert module.record_suffix("amd_epyc_avx512bf16", "avx2") == "amd_epyc_avx512bf16_as_avx2"
    assert module.record_suffix("intel_xeon_avx512", "native") == "intel_xeon_avx512"
    with pytest.raises(ValueError, match="no 'flags' line"):
        module.cpu_kind("model name : ARM\n")
    with pytest.raises(ValueError, match="kernels must be one of"):
        module.record_suffix("x", "avx10")


def test_speed_targets_judges_each_target_by_its_rule():
    """The trl targets by the median of the CPU-options rows, SmolLM2 by every round."""
    module = _speed_targets()
    speed = {"summary": [
        {"case": "lora", "label": "LoRA, merged_rollout", "trl_s_over_ours_s": [2.0], "median_trl_s_over_ours_s": 2.0},
        {"case": "lora", "label": "LoRA, CPU options", "trl_s_over_ours_s": [1.2, 1.04, 1.06],
         "median_trl_s_over_ours_s": 1.06},
        {"case": "full", "label": "shared head, CPU options", "trl_s_over_ours_s": [0.99, 0.98, 1.2],
         "median_trl_s_over_ours_s": 0.99}]}
    smollm2 = {"ratios": {"shipped_over_7b49006": [0.55, 0.61, 0.58]}}
    got = {v["target"]: v for v in module.verdicts(speed, smollm2)}
    assert got["tiny LoRA MA-PPO, CPU options"]["met"] and got["tiny LoRA MA-PPO, CPU options"]["median"] == 1.06
    assert not got["tiny four-model, CPU options"]["met"]
    assert not got["SmolLM2, shipped config"]["met"]  # one round of three above 0.6
    smollm2["ratios"]["shipped_over_7b49006"][1] = 0.6
    assert {v["target"]: v for v in module.verdicts(speed, smollm2)}["SmolLM2, shipped config"]["met"]


def test_speed_targets_never_overwrites_a_record(tmp_path, monkeypatch):
    module = _speed_targets()
    kind = module.cpu_kind(pathlib.Path("/proc/cpuinfo").read_text())
    (tmp_path / f"speed_vs_trl_{kind}_as_avx2.json").write_text("{}")
    monkeypatch.setattr(module.subprocess, "run", lambda *a, **k: pytest.fail("ran something before refusing"))
    with pytest.raises(SystemExit, match="exists; move it aside"):
        module.main(["--trl-python", "python", "--kernels", "avx2", "--out-dir", str(tmp_path)])


def test_speed_targets_floor_record_never_overwritten_and_trl_python_needed_otherwise(tmp_path, monkeypatch):
    module = _speed_targets()
    kind = module.cpu_kind(pathlib.Path("/proc/cpuinfo").read_text())
    (tmp_path / f"smollm2_step_floor_{kind}.json").write_text("{}")
    monkeypatch.setattr(module.subprocess, "run", lambda *a, **k: pytest.fail("ran something before refusing"))
    with pytest.raises(SystemExit, match="exists; move it aside"):
        module.main(["--smollm2-floor", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_:  # the comparison with trl needs trl's python
        module.main(["--out-dir", str(tmp_path)])
    assert exit_.value.code == 2


def test_speed_targets_floor_is_paired_with_the_engines_of_its_own_round(tmp_path, monkeypatch):
    """Each round's floor is divided by that round's 7b49006 step and divides that round's shipped step."""
    import json

    module = _speed_targets()
    baseline = tmp_path / "7b49006"
    steps = {("floor", 1): 20.0, ("old", 1): 30.0, ("new", 1): 24.0,
             ("floor", 2): 15.0, ("old", 2): 25.0, ("new", 2): 18.0}
    rounds = iter([1, 1, 1, 2, 2, 2])

    def fake_run(args, **kwargs):
        round_, out = next(rounds), pathlib.Path(args[args.index("--out") + 1])
        if args[1].endswith("bench_floor.py"):
            out.write_text(json.dumps({"floor_step_s": steps[("floor", round_)], "phases_s": {}, "per_step": [],
                                       "generate_tokens_per_s": 1.0, "measured_on": "x", "machine": {}}))
        else:
            engine = "old" if args[1].startswith(str(baseline)) else "new"
            out.write_text(json.dumps({"step_s": steps[(engine, round_)], "phases_s": {}, "response_length": 1.0,
                                       "generate_tokens_per_s": 1.0, "steps_averaged": [2, 3], "fp32_products": "off",
                                       "per_step": [], "measured_on": "x", "machine": {}}))

    monkeypatch.setattr(module.subprocess, "run", fake_run)
    got = module.side_by_side(baseline, 2, {}, "native", floor=True)
    assert got["ratios"]["shipped_over_7b49006"] == [0.8, 0.72]
    assert got["ratios"]["floor_over_7b49006"] == [round(20 / 30, 4), 0.6]
    assert got["ratios"]["shipped_over_floor"] == [1.2, 1.2]
    assert [f["round"] for f in got["floors"]] == [1, 2]


def test_bench_floor_compares_with_trl_on_the_tiny_work_only():
    module = _tool("bench_floor")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--work", "smollm2", "--compare", "benchmarks/speed_vs_trl.json"])
    assert exit_.value.code == 2


def test_speed_targets_other_config_runs_on_this_side_only_and_is_named_apart(tmp_path, monkeypatch):
    """`--config` changes what this checkout runs, never 7b49006's config, and names its record after the file;
    a config outside configs/smollm2/ or with the trl comparison is refused before anything runs."""
    import json

    module = _speed_targets()
    baseline = tmp_path / "7b49006"
    ran = []

    def fake_run(args, **kwargs):
        out = pathlib.Path(args[args.index("--out") + 1])
        ran.append((args[1], args[args.index("--config") + 1] if "--config" in args else None))
        out.write_text(json.dumps({"step_s": 10.0, "floor_step_s": 5.0, "phases_s": {}, "response_length": 1.0,
                                   "generate_tokens_per_s": 1.0, "steps_averaged": [2, 3], "fp32_products": "off",
                                   "per_step": [], "measured_on": "x", "machine": {}}))

    monkeypatch.setattr(module.subprocess, "run", fake_run)
    module.side_by_side(baseline, 1, {}, "native", floor=True, config="configs/smollm2/ma_ppo_bf16.yaml")
    steps = [config for tool, config in ran if tool.endswith("bench_step.py")]
    assert steps == [str(baseline / module.SMOLLM2_CONFIG), str(module.ROOT / "configs/smollm2/ma_ppo_bf16.yaml")]
    assert module.config_suffix(module.SMOLLM2_CONFIG) == ""
    assert module.config_suffix("configs/smollm2/ma_ppo_bf16.yaml") == "_ma_ppo_bf16"
    assert module.config_suffix("./configs/smollm2/ma_ppo.yaml") == ""  # the same file, however it is written
    assert module.config_suffix(str(module.ROOT / "configs/smollm2/ma_ppo_bf16.yaml")) == "_ma_ppo_bf16"
    with pytest.raises(SystemExit, match="not a file under configs/smollm2/"):
        module.config_suffix("configs/smollm2/../tiny_ppo.yaml")
    monkeypatch.setattr(module.subprocess, "run", lambda *a, **k: pytest.fail("ran something before refusing"))
    with pytest.raises(SystemExit, match="not a file under configs/smollm2/"):
        module.main(["--smollm2-floor", "--config", "configs/tiny_ppo.yaml", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_:
        module.main(["--trl-python", "python", "--config", "configs/smollm2/ma_ppo_bf16.yaml",
                     "--out-dir", str(tmp_path)])
    assert exit_.value.code == 2


def test_records_name_the_cpu_features_that_pick_kernels():
    """`cpu_features`: the vector flags of VECTOR_FLAGS the first CPU lists, in VECTOR_FLAGS' order, and its reported
    clock; `machine()` stores them where /proc/cpuinfo exists, so two VMs of one cpu_kind can be told apart."""
    from marlhf_edu.records import VECTOR_FLAGS, cpu_features, machine

    text = ("processor : 0\nmodel name : Intel(R) Xeon(R) Processor\ncpu MHz : 2600.000\n"
            "flags : fpu sse2 avx2 avx512f amx_bf16 avx512_bf16 fma\nprocessor : 1\ncpu MHz : 1200.0\n"
            "flags : fpu avx2 avx512_fp16\n")
    assert cpu_features(text) == {"cpu_flags": ["avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"],
                                  "cpu_mhz_reported": 2600.0}
    assert cpu_features("model name : ARM\n") == {"cpu_flags": [], "cpu_mhz_reported": None}
    here = machine()
    if pathlib.Path("/proc/cpuinfo").exists():
        assert set(here["cpu_flags"]) <= set(VECTOR_FLAGS) and "cpu_mhz_reported" in here


def test_bench_step_matmul_precision_rounds_products_keeps_attention_and_restores():
    """`--matmul-precision bf16`: inside the block a product equals the fp32 product of bf16-rounded inputs (not the
    fp32 one), attention is computed as outside it, and torch's setting and function are restored after (also on
    an error). Where this CPU's PyTorch has no bf16 kernels only the restoring is checked."""
    import torch
    import torch.nn.functional as F

    from marlhf_edu.loading.cpu_products import native_low_precision_products

    module = _tool("bench_step")
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=g), torch.randn(128, 256, generator=g)
    # SmolLM2's heads over 112 positions: at 16 positions attention came out the same under bf16 on the AMX Xeon
    q, k, v = (torch.randn(2, 9, 112, 64, generator=g) for _ in range(3))
    plain, plain_attention = F.linear(x, w), F.scaled_dot_product_attention(q, k, v, is_causal=True)
    rounded = F.linear(x.bfloat16().float(), w.bfloat16().float())
    before, attention = torch.backends.mkldnn.matmul.fp32_precision, F.scaled_dot_product_attention
    with module.matmul_precision("bf16"):
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
        inside, inside_attention = F.linear(x, w), F.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"  # the attention wrapper put it back
    assert torch.backends.mkldnn.matmul.fp32_precision == before and F.scaled_dot_product_attention is attention
    with pytest.raises(RuntimeError), module.matmul_precision("bf16"):
        raise RuntimeError("a step failed")
    assert torch.backends.mkldnn.matmul.fp32_precision == before and F.scaled_dot_product_attention is attention
    with module.matmul_precision("bf16_with_attention"):
        assert F.scaled_dot_product_attention is attention
        all_bf16_attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.backends.mkldnn.matmul.fp32_precision == before
    with pytest.raises(ValueError, match="one of"), module.matmul_precision("tf32"):
        pass
    if not native_low_precision_products(torch.bfloat16):
        pytest.skip("this CPU's PyTorch has no bf16 matrix kernels: the setting changes nothing to check")
    assert torch.equal(inside_attention, plain_attention) and not torch.equal(all_bf16_attention, plain_attention)
    assert (inside - rounded).abs().max() < 1e-3 < (inside - plain).abs().max()


def test_speed_targets_passes_the_precision_to_this_side_only(tmp_path, monkeypatch):
    """`--matmul-precision`: this checkout's bench_step gets it with old_logprobs: recompute, 7b49006's does not; the
    record says so and is named apart; without --smollm2-floor it is refused."""
    import json

    module = _speed_targets()
    baseline = tmp_path / "7b49006"
    ran = []

    def fake_run(args, **kwargs):
        ran.append(args)
        out = pathlib.Path(args[args.index("--out") + 1])
        out.write_text(json.dumps({"step_s": 10.0, "floor_step_s": 5.0, "phases_s": {}, "response_length": 1.0,
                                   "generate_tokens_per_s": 1.0, "steps_averaged": [2, 3], "fp32_products": "off",
                                   "per_step": [], "measured_on": "x", "machine": {},
                                   **({"matmul_precision": "bf16"} if "--matmul-precision" in args else {})}))

    monkeypatch.setattr(module.subprocess, "run", fake_run)
    got = module.side_by_side(baseline, 1, {}, "native", floor=True, precision="bf16")
    old, new = [a for a in ran if a[1].endswith("bench_step.py")]
    assert "--matmul-precision" not in old and "--old_logprobs" not in old
    assert new[new.index("--matmul-precision"):] == ["--matmul-precision", "bf16", "--", "--old_logprobs", "recompute"]
    assert [r["matmul_precision"] for r in got["runs"]] == ["ieee", "bf16"]
    record = module.smollm2_record("x", "cpu", "native", "cmd", got, precision="bf16")
    ours = record["engines"]["shipped"]
    assert "old_logprobs: recompute" in ours and "attention in fp32" in ours
    monkeypatch.setattr(module, "with_baseline", lambda measure: measure(baseline))
    monkeypatch.setattr(module, "cpu_kind", lambda text: "cpu")
    module.main(["--smollm2-floor", "--rounds", "1", "--matmul-precision", "bf16", "--out-dir", str(tmp_path)])
    written = json.loads((tmp_path / "smollm2_step_floor_cpu_bf16_products.json").read_text())
    assert written["command"].endswith("--matmul-precision bf16")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--trl-python", "python", "--matmul-precision", "bf16", "--out-dir", str(tmp_path)])
    assert exit_.value.code == 2


def test_bench_step_refuses_bf16_precision_before_loading(monkeypatch):
    """`--matmul-precision bf16` with old_logprobs: sampler, or on a CPU that lists neither AVX512-BF16 nor AMX-BF16
    (PyTorch's own check passes plain AVX-512), exits before any model loads."""
    module = _tool("bench_step")
    config = str(ROOT / "configs" / "smollm2" / "ma_ppo.yaml")  # old_logprobs: sampler; loading it would take seconds
    with pytest.raises(SystemExit, match="old_logprobs: sampler"):
        module.bench_steps("ma-ppo", config, 1, [], "bf16")
    flags = "processor : 0\nflags : fpu avx2 avx512f avx512bw avx512vl {}\n"
    assert not module.bf16_instructions(flags.format(""))
    assert module.bf16_instructions(flags.format("avx512_bf16")) and module.bf16_instructions(flags.format("amx_bf16"))
    monkeypatch.setattr(module, "bf16_instructions", lambda: False)
    with pytest.raises(SystemExit, match="AVX512-BF16 or AMX"):
        module.bench_steps("ma-ppo", config, 1, ["--old_logprobs", "recompute"], "bf16")


def test_replay_check_groups_runs_by_their_whole_record_sequence_across_cases():
    replay = _tool("replay_check")
    a = [{"step": 1, "kl/k1": 1e-4, "rollout/logprob_gap": 6e-6, "score/mean": 3.0}, {"step": 2, "kl/k1": 0.05}]
    b = [dict(a[0]), {"step": 2, "kl/k1": 0.050001}]  # step 1 equal, step 2 not: another sequence
    sequences = []
    groups = replay.variants([{"hash_seed": 0, "records": a}, {"hash_seed": 1, "records": b},
                              {"hash_seed": 2, "records": [dict(r) for r in a]}], sequences)
    assert [(g["sequence"], g["hash_seeds"]) for g in groups] == [(0, [0, 2]), (1, [1])]
    assert groups[0]["step1"] == {"kl/k1": 1e-4, "rollout/logprob_gap": 6e-6, "score/mean": 3.0}
    assert sequences == [a, b]
    # a second case's runs are numbered against the same sequences: equal to the first case's, or new
    c = [dict(a[0], **{"kl/k1": 3e-4}), a[1]]
    control = replay.variants([{"hash_seed": 0, "records": b}, {"hash_seed": 1, "records": c}], sequences)
    assert [(g["sequence"], g["hash_seeds"]) for g in control] == [(1, [0]), (2, [1])]


def _fake_stage_run(seen, records_text='{"step": 1, "kl/k1": 0.1, "time/step_s": 20.0}\n'):
    def fake_run(argv, env, capture_output, text):
        out = pathlib.Path(argv[argv.index("--output_dir") + 1])
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text(records_text)
        seen.append((argv, env))
        return type("Done", (), {"returncode": 0, "stderr": ""})()
    return fake_run


def test_replay_check_runs_fresh_processes_without_timings_and_sets_the_control_switch(tmp_path, monkeypatch):
    replay = _tool("replay_check")
    seen = []
    monkeypatch.setattr(replay.subprocess, "run", _fake_stage_run(seen))
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    (python.parent / "marlhf-edu").write_text("")  # the console script an install puts next to its Python
    monkeypatch.setattr(replay.sys, "executable", str(python))
    monkeypatch.setenv("MARLHF_EDU_VML_WARMUP", "0")  # a caller's own setting never reaches the shipped case
    assert replay.run_once("ma-ppo", "c.yaml", 1, 3, True, ["--seed", "1"]) == [{"step": 1, "kl/k1": 0.1}]
    argv, env = seen[-1]
    assert env["PYTHONHASHSEED"] == "3" and "MARLHF_EDU_VML_WARMUP" not in env
    assert argv[0] == str(python.parent / "marlhf-edu")  # the console script, as a user starts a run
    assert argv[argv.index("--total_steps") + 1] == "1" and argv[-2:] == ["--seed", "1"]
    assert argv[argv.index("--eval_repeats") + 1] == "0" and argv[argv.index("--eval_every") + 1] == "0"
    replay.run_once("ma-ppo", "c.yaml", 1, 0, False, [], launcher="module")
    assert seen[-1][1]["MARLHF_EDU_VML_WARMUP"] == "0"
    assert seen[-1][0][1:4] == ["-m", "marlhf_edu.cli", "ma-ppo"]
    with pytest.raises(SystemExit, match="wrote 1 step records, not 2"):  # a run that stopped early
        replay.run_once("ma-ppo", "c.yaml", 2, 0, True, [])
    (python.parent / "marlhf-edu").unlink()
    with pytest.raises(SystemExit, match="no console script"):
        replay.run_once("ma-ppo", "c.yaml", 1, 0, True, [])


def test_replay_check_records_each_case_against_shared_sequences_and_refuses_its_own_options(tmp_path, monkeypatch):
    replay = _tool("replay_check")
    config = tmp_path / "c.yaml"
    config.write_text("seed: 0\n")

    def fake_run_once(command, config, steps, hash_seed, warmup, extra, launcher):
        k1 = 1e-4 if warmup or hash_seed < 2 else 3e-4  # the control loses the race from hash seed 2 on
        return [{"step": s, "kl/k1": k1} for s in range(1, steps + 1)]

    monkeypatch.setattr(replay, "run_once", fake_run_once)
    out = tmp_path / "r.json"
    replay.main(["--config", str(config), "--runs", "3", "--steps", "2", "--control", "--out", str(out)])
    record = json.loads(out.read_text())
    assert record["cases"]["shipped"]["replayed"] is True
    assert record["cases"]["vml_warmup_off"]["replayed"] is False
    assert [(g["sequence"], g["hash_seeds"]) for g in record["cases"]["vml_warmup_off"]["variants"]] == [(0, [0, 1]),
                                                                                                       (1, [2])]
    assert len(record["sequences"]) == 2 and record["launcher"] == "marlhf-edu"
    assert record["command"].startswith("python tools/replay_check.py --config ")
    assert set(record["run_environment"]) == {"OMP_NUM_THREADS", "MKL_NUM_THREADS"}
    for bad, why in ((["--runs", "0"], "at least 1"), (["--steps", "0"], "at least 1"),
                     (["--output_dir", "x"], "set by the tool itself"), (["--total-steps=3"], "set by the tool itself"),
                     (["--output-dir=x"], "set by the tool itself")):
        with pytest.raises(SystemExit, match=why):
            replay.main(["--config", str(config), *bad])
    # a value that reads like an option's name is passed on, not refused
    replay.main(["--config", str(config), "--runs", "1", "--steps", "1", "--dataset_name", "output_dir"])


def test_speed_targets_tag_files_a_second_record_of_one_cpu_kind_beside_the_first(tmp_path, monkeypatch):
    """`--tag` ends every record's name (after the config and precision parts) and the command it stores; a tag that
    is not a file-name part is refused before anything runs; the record holds this machine's vector flags."""
    import json

    module = _speed_targets()
    kind = module.cpu_kind(pathlib.Path("/proc/cpuinfo").read_text())
    (tmp_path / f"smollm2_step_floor_{kind}.json").write_text("{}")  # the first machine's record stays untouched

    def fake_run(args, **kwargs):
        out = pathlib.Path(args[args.index("--out") + 1])
        out.write_text(json.dumps({"step_s": 10.0, "floor_step_s": 5.0, "phases_s": {}, "response_length": 1.0,
                                   "generate_tokens_per_s": 1.0, "steps_averaged": [2, 3], "fp32_products": "off",
                                   "per_step": [], "measured_on": "x", "machine": {}}))

    monkeypatch.setattr(module.subprocess, "run", fake_run)
    monkeypatch.setattr(module, "with_baseline", lambda work: work(tmp_path / "7b49006"))
    module.main(["--smollm2-floor", "--rounds", "1", "--config", "configs/smollm2/ma_ppo_bf16.yaml",
                 "--tag", "xeon_b", "--out-dir", str(tmp_path)])
    record = json.loads((tmp_path / f"smollm2_step_floor_{kind}_ma_ppo_bf16_xeon_b.json").read_text())
    assert record["command"].endswith("--config configs/smollm2/ma_ppo_bf16.yaml --tag xeon_b")
    assert record["cpu_flags"] == module.cpu_features(pathlib.Path("/proc/cpuinfo").read_text())["cpu_flags"]
    assert (tmp_path / f"smollm2_step_floor_{kind}.json").read_text() == "{}"
    assert module.tag_suffix(None) == "" and module.tag_suffix("b2") == "_b2"
    monkeypatch.setattr(module.subprocess, "run", lambda *a, **k: pytest.fail("ran something before refusing"))
    for bad in ("Xeon", "a/b", "a__b", "_a", ""):
        with pytest.raises(SystemExit) as exit_:
            module.main(["--smollm2-floor", "--tag", bad, "--out-dir", str(tmp_path)])
        assert exit_.value.code == 2, bad
