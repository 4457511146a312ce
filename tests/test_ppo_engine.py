"""The four-model PPO engine: the RLHF-PPO implementation details, checkpoint/resume, config errors."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from marlhf_edu.data.toyworld import ToyWorld
from marlhf_edu.errors import ConfigError
from marlhf_edu.math.scoring import score_texts
from marlhf_edu.ppo import FourModelBackend, PPOConfig, PPOTrainer, read_metrics, response_mask_from_ids
from marlhf_edu.ppo.backends import sequence_logprobs
from marlhf_edu.ppo.run_files import sha256_of
from marlhf_edu.ppo.trainer import TIMING_KEYS

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = dict(batch_size=8, mini_batch_size=4, micro_batch_size=2, forward_batch_size=8, max_new_tokens=12,
             learning_rate=1e-4, device="cpu", eval_repeats=0)


def small_config(tmp_path, **overrides):
    return PPOConfig(output_dir=str(tmp_path / "run"), **{**SMALL, **overrides})


@pytest.fixture(scope="module")
def prompts():
    return [p.prompt for p in ToyWorld().train_prompts]


def make_trainer(tmp_path, prompts, **overrides):
    config = small_config(tmp_path, **overrides)
    torch.manual_seed(config.seed)
    return PPOTrainer(FourModelBackend.from_config(config), config, prompts)


def test_response_mask_keeps_first_eos_only():
    eos, pad = 2, 3
    ids = torch.tensor([[5, 6, eos, pad, pad], [5, eos, 7, eos, 8], [5, 6, 7, 8, 9], [eos, pad, pad, pad, pad]])
    mask = response_mask_from_ids(ids, eos)
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_a_fixed_kl_coefficient_logs_no_target(tmp_path, prompts):
    record = make_trainer(tmp_path, prompts, adaptive_kl=False, total_steps=1).step()
    assert "kl/target" not in record and record["kl/coef"] == small_config(tmp_path).kl_coef


def test_first_step_ratio_one_kl_zero_values_zero(tmp_path, prompts):
    trainer = make_trainer(tmp_path, prompts, ppo_epochs=2)
    record = trainer.step()
    r = trainer.last_rollout
    # policy == reference at step 0, computed the same way: the KL is zero
    assert record["kl/k1"] == pytest.approx(0.0, abs=1e-6) and record["kl/k3"] == pytest.approx(0.0, abs=1e-6)
    assert record["kl/target"] == trainer.config.adaptive_kl_target  # adaptive β: its aim is in every record
    # dropout off and the same temperature in sampling and scoring: the first minibatch's ratio is exactly 1
    first = trainer.minibatch_stats[0]
    assert first["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert first["policy/approxkl"] < 1e-10 and first["policy/clipfrac"] == 0.0
    # the value head starts at zero: every rollout value is exactly 0
    assert torch.equal(r.values, torch.zeros_like(r.values))
    # later minibatches moved the policy
    assert trainer.minibatch_stats[-1]["policy/approxkl"] > first["policy/approxkl"]
    assert record["ppo/epochs"] == 2 and len(trainer.minibatch_stats) == 4


def test_rollout_masks_pad_and_first_eos(tmp_path, prompts):
    trainer = make_trainer(tmp_path, prompts, batch_size=16, mini_batch_size=16, micro_batch_size=16, forward_batch_size=6)
    tok = trainer.tokenizer
    assert tok.pad_token_id != tok.eos_token_id
    r = trainer.rollout(trainer.batch_prompts(0))
    response = r.input_ids[:, -r.n_response:]
    assert r.has_eos.any()
    for i in range(response.shape[0]):
        real = response[i][r.response_mask[i]]
        if r.has_eos[i]:
            assert real[-1] == tok.eos_token_id and (real[:-1] != tok.eos_token_id).all()  # first EOS kept, last
        assert (response[i][~r.response_mask[i]] == tok.pad_token_id).all()
    # the attention mask is the prompt's mask followed by the response mask
    assert torch.equal(r.attention_mask[:, -r.n_response:].bool(), r.response_mask)


def test_left_padded_logprobs_equal_unpadded(tmp_path, prompts):
    trainer = make_trainer(tmp_path, prompts)
    tok, actor = trainer.tokenizer, trainer.backend.actor
    short, long = min(prompts, key=len), max(prompts, key=len)
    response = tok(" The zorb is red.</s>", add_special_tokens=False)["input_ids"]
    R = len(response)
    single = tok([short], return_tensors="pt")["input_ids"]
    single = torch.cat([single, torch.tensor([response])], 1)
    with torch.no_grad():
        alone = sequence_logprobs(actor, single, torch.ones_like(single), R, 0.7)[0]
        enc = tok([short, long], return_tensors="pt", padding=True, padding_side="left")
        ids = torch.cat([enc["input_ids"], torch.tensor([response, response])], 1)
        mask = torch.cat([enc["attention_mask"], torch.ones(2, R, dtype=torch.long)], 1)
        assert enc["attention_mask"][0, 0] == 0  # the short prompt really is left-padded
        batched = sequence_logprobs(actor, ids, mask, R, 0.7)[0]
    torch.testing.assert_close(batched[0], alone[0], atol=1e-5, rtol=1e-5)


def test_only_actor_and_critic_change(tmp_path, prompts):
    trainer = make_trainer(tmp_path, prompts)
    be = trainer.backend
    before = {name: {k: v.clone() for k, v in m.state_dict().items()} for name, m in be.models().items()}
    trainable = {id(p) for group in be.parameter_groups().values() for p in group}
    expected = {id(p) for m in (be.actor, be.critic) for p in m.parameters()}
    assert trainable == expected  # all actor and critic weights (no LoRA here), nothing else
    assert not any(p.requires_grad for m in (be.reference, be.reward) for p in m.parameters())
    trainer.step()
    trainer.step()
    for name in ("reference", "reward"):
        after = be.models()[name].state_dict()
        assert all(torch.equal(before[name][k], after[k]) for k in after), f"the {name} model changed"
    for name in ("actor", "critic"):
        after = be.models()[name].state_dict()
        assert any(not torch.equal(before[name][k], after[k]) for k in after), f"the {name} did not train"


def test_score_equals_direct_reward_model_call(tmp_path, prompts):
    trainer = make_trainer(tmp_path, prompts, batch_size=16, mini_batch_size=16, micro_batch_size=16, forward_batch_size=5)
    r = trainer.rollout(trainer.batch_prompts(0))
    tok = trainer.tokenizer
    texts = []
    for ids, mask in zip(r.input_ids, r.attention_mask.bool()):
        texts.append(tok.decode(ids[mask], skip_special_tokens=False).removeprefix(tok.bos_token))
    # as the reward model was trained: EOS appended where the answer has none (score_texts' add_eos), which the
    # engine does on the ids (append_missing_eos) and score_texts on the text
    direct = score_texts(trainer.backend.reward, tok, texts, batch_size=16, add_eos=True)
    assert 0 < int(r.has_eos.sum()) < len(texts)  # both kinds of answer are compared
    # the same texts re-tokenised give the same ids (up to BPE's canonical form); compare where they do
    same_ids = [tok(t)["input_ids"] == ids[mask].tolist() for t, ids, mask in zip(texts, r.input_ids, r.attention_mask.bool())]
    assert sum(same_ids) >= 12
    sel = torch.tensor(same_ids)
    torch.testing.assert_close(r.raw_scores[sel], direct[sel], atol=1e-4, rtol=1e-4)


def test_missing_eos_penalty_and_score_transforms(tmp_path, prompts):
    trainer = make_trainer(tmp_path, prompts, missing_eos_penalty=5.0, score_baseline=1.0, score_clip=3.0)
    raw = torch.tensor([0.5, 2.0, 10.0, -10.0])
    has_eos = torch.tensor([True, False, True, True])
    assert trainer.transform_scores(raw, has_eos).tolist() == [-0.5, -3.0, 3.0, -3.0]
    trainer.config.whiten_scores, trainer.config.score_clip = True, None
    whitened = trainer.transform_scores(raw, has_eos)
    assert abs(float(whitened.mean())) < 1e-6 and float(whitened.std()) == pytest.approx(1.0, abs=1e-6)


def test_rollouts_per_prompt_and_leave_one_out_baseline(tmp_path, prompts):
    trainer = make_trainer(tmp_path, prompts, rollouts_per_prompt=4, group_baseline=True)
    batch = trainer.batch_prompts(0)
    assert len(batch) == 8 and batch[:4] == [batch[0]] * 4 and batch[4:] == [batch[4]] * 4 and batch[0] != batch[4]
    # two prompts a step, in the same seeded order as without groups: step 1 takes the next two
    plain = make_trainer(tmp_path / "plain", prompts)
    assert [batch[0], batch[4]] + trainer.batch_prompts(1)[::4] == plain.batch_prompts(0)[:4]
    raw = torch.tensor([1.0, 2.0, 3.0, 6.0, 0.0, 0.0, 0.0, 4.0])
    scores = trainer.transform_scores(raw, torch.ones(8, dtype=torch.bool))
    expected = [1 - 11 / 3, 2 - 10 / 3, 3 - 3, 6 - 2, -4 / 3, -4 / 3, -4 / 3, 4]
    assert scores.tolist() == pytest.approx(expected, abs=1e-6)
    # the prompt-level offset is gone: shifting one prompt's scores changes nothing
    shifted = raw + torch.tensor([100.0] * 4 + [0.0] * 4)
    assert trainer.transform_scores(shifted, torch.ones(8, dtype=torch.bool)).tolist() == pytest.approx(expected, abs=1e-4)
    record = trainer.step()  # the whole loop runs on groups
    assert record["ppo/skipped_minibatches"] == 0


def test_early_stopping_checks_once_per_epoch_like_trl(tmp_path, prompts):
    trainer = make_trainer(tmp_path, prompts, ppo_epochs=4, early_stopping=True, early_stopping_target_kl=1e-12)
    record = trainer.step()
    # trl 0.11: the epoch runs to its end (2 minibatches of 4), then its last minibatch's policykl stops the rest
    assert record["ppo/early_stopped"] == 1.0 and record["ppo/epochs"] == 1
    assert len(trainer.minibatch_stats) == 2 and trainer.minibatch_stats[-1]["policy/policykl"] > 1.5e-12


def test_early_stopping_per_minibatch_when_asked(tmp_path, prompts):
    trainer = make_trainer(tmp_path, prompts, ppo_epochs=4, early_stopping=True, early_stopping_target_kl=1e-12,
                           early_stopping_check="minibatch")
    record = trainer.step()
    kls = [m["policy/policykl"] for m in trainer.minibatch_stats]
    # it stops right after the first minibatch whose policykl exceeds 1.5 × target
    assert record["ppo/early_stopped"] == 1.0 and record["ppo/epochs"] == 1
    assert kls[-1] > 1.5e-12 and all(k <= 1.5e-12 for k in kls[:-1]) and len(kls) < 2 * 4


def test_a_skipped_minibatch_takes_no_optimizer_step(tmp_path, prompts):
    """AdamW with zero gradients still moves weights (momentum, weight decay): a skip must not call step()."""
    trainer = make_trainer(tmp_path, prompts, weight_decay=0.1)
    trainer.step()  # a normal step leaves momentum in AdamW
    before = {k: v.clone() for k, v in trainer.backend.trainable_state_dict().items()}
    trainer.config.ratio_threshold = 1e-3  # every minibatch's mean ratio (≈ 1) now exceeds it
    record = trainer.step()
    after = trainer.backend.trainable_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a skipped minibatch moved the weights"
    # 8 rollouts in minibatches of 4 (micro-batches of 2): 2 skipped minibatches, not 4 micro-batches
    assert record["ppo/skipped_minibatches"] == 2


def test_every_minibatch_is_clipped_to_max_grad_norm(tmp_path, prompts):
    """max_grad_norm bounds the gradient of every optimizer step, not only the first. trl 0.11.4 keeps its trainable
    parameters as a `filter` object, which the first `clip_grad_norm_` call exhausts: later minibatches are clipped
    over no parameters at all (site/benchmarks.md)."""
    trainer = make_trainer(tmp_path, prompts, max_grad_norm=1e-3)
    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    norms, real_step = [], trainer.optimizer.step

    def step(*a, **k):
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None]))))
        return real_step(*a, **k)

    trainer.optimizer.step = step
    trainer.step()
    trainer.step()
    assert len(norms) == 4  # 8 rollouts in minibatches of 4, two steps
    assert all(n <= 1e-3 * (1 + 1e-4) for n in norms), norms


def test_evaluation_sampling_restores_every_rng(monkeypatch):
    from marlhf_edu.ppo import trainer as trainer_module

    seen, real_fork_rng = {}, torch.random.fork_rng

    def fake_fork_rng(devices):
        seen["devices"] = list(devices)
        return real_fork_rng(devices=[])

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.random, "fork_rng", fake_fork_rng)
    with trainer_module.fork_all_rngs():
        pass
    assert seen["devices"] == [0, 1]  # manual_seed reseeds every CUDA device, so all of them are restored


def test_rollout_logprobs_are_the_samplers_own_distribution(tmp_path, prompts):
    """At T = 0.7 with left padding, the engine's log-probs of the sampled tokens equal log softmax of the scores
    `generate` sampled from (a temperature applied in sampling but not in scoring would break this)."""
    from marlhf_edu.ppo.backends import sample

    trainer = make_trainer(tmp_path, prompts, temperature=0.7)
    be, tok = trainer.backend, trainer.tokenizer
    enc = tok(trainer.batch_prompts(0), return_tensors="pt", padding=True, padding_side="left")
    assert (enc["attention_mask"] == 0).any()  # really left-padded
    torch.manual_seed(1)
    out = be.actor.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], do_sample=True,
                            temperature=0.7, top_k=0, top_p=1.0, max_new_tokens=12, pad_token_id=tok.pad_token_id,
                            eos_token_id=tok.eos_token_id, output_scores=True, return_dict_in_generate=True)
    torch.manual_seed(1)
    assert torch.equal(out.sequences, sample(be.actor, tok, enc["input_ids"], enc["attention_mask"], max_new_tokens=12,
                                             temperature=0.7))  # the engine's sampler is this generate call
    P = enc["input_ids"].shape[1]
    response = out.sequences[:, P:]
    mask = response_mask_from_ids(response, tok.eos_token_id)
    sampler = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1)
    sampler = sampler.gather(-1, response[..., None]).squeeze(-1)
    attention = torch.cat([enc["attention_mask"].bool(), mask], 1).long()
    with torch.no_grad():
        ours = be.policy_forward(out.sequences, attention, response.shape[1], 0.7)[0]
    torch.testing.assert_close(ours[mask], sampler[mask], atol=2e-5, rtol=1e-5)
    with torch.no_grad():  # scoring at T = 1 instead: visibly off-policy
        wrong = be.policy_forward(out.sequences, attention, response.shape[1], 1.0)[0]
    assert (wrong[mask] - sampler[mask]).abs().max() > 1e-2


def test_critic_can_start_as_the_reward_model(tmp_path, prompts):
    """`critic_init: reward_model`: before any update, V at the last real token is the reward model's score."""
    from marlhf_edu.math.masked import last_valid_index

    trainer = make_trainer(tmp_path, prompts, critic_init="reward_model")
    be = trainer.backend
    r = trainer.rollout(trainer.batch_prompts(0))
    with torch.no_grad():
        values = be.critic(r.input_ids, r.attention_mask)
        read_here = be.scores(r.input_ids, r.attention_mask)  # the reward model read at the same last token
    at_last = values[torch.arange(len(values)), last_valid_index(r.attention_mask)]
    torch.testing.assert_close(at_last, read_here, atol=1e-4, rtol=1e-4)
    # where the answer ended with EOS that is the score PPO optimises (a cut-off one is scored with EOS appended)
    assert bool(r.has_eos.any())
    torch.testing.assert_close(at_last[r.has_eos], r.raw_scores[r.has_eos], atol=1e-4, rtol=1e-4)
    assert all(p.requires_grad for p in be.critic.parameters())  # a full critic, trainable
    assert not any(p.requires_grad for p in be.reward.parameters())  # the reward model itself stays frozen


@pytest.mark.parametrize("overrides, message", [
    (dict(batch_size=10, mini_batch_size=4), "multiple of mini_batch_size"),
    (dict(mini_batch_size=4, micro_batch_size=3), "multiple of micro_batch_size"),
    (dict(temperature=0.0), "temperature"),
    (dict(kl_estimator="full"), "kl_estimator"),
    (dict(top_k=50), "top_k=50, top_p=1.0: PPO needs the log-probs of the distribution it sampled from"),
    (dict(top_p=0.9), "top_p=0.9"),
    (dict(early_stopping_check="step"), "early_stopping_check"),
    (dict(critic_init="sft"), "critic_init"),
    (dict(rollouts_per_prompt=3), "multiple of rollouts_per_prompt"),
    (dict(group_baseline=True), "group_baseline compares the answers to one prompt"),
])
def test_bad_config_values(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        small_config(tmp_path, **overrides).validate()


def test_unknown_key_is_named(tmp_path):
    from marlhf_edu.training.args import parse_stage_args

    path = tmp_path / "c.yaml"
    path.write_text("batch_size: 8\nmini_batchsize: 4\n")
    with pytest.raises(ConfigError, match="'mini_batchsize' → did you mean 'mini_batch_size'"):
        parse_stage_args((PPOConfig,), ["--config", str(path)])


def test_pad_equal_to_eos_and_vocab_mismatch_are_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = small_config(tmp_path)
    be = FourModelBackend.from_config(config)
    tok = be.tokenizer
    tok_eos_pad = type(tok).from_pretrained(str(pathlib.Path(tok.name_or_path)))
    tok_eos_pad.pad_token = tok_eos_pad.eos_token
    with pytest.raises(ConfigError, match="pad token must exist and differ from EOS"):
        FourModelBackend(be.actor, be.critic, be.reference, be.reward, tok_eos_pad)
    other = LlamaForSequenceClassification(LlamaConfig(vocab_size=600, hidden_size=16, intermediate_size=32,
                                                       num_hidden_layers=1, num_attention_heads=2, num_labels=1))
    with pytest.raises(ConfigError, match=r"reward model's vocabulary \(600\) differs"):
        FourModelBackend(be.actor, be.critic, be.reference, other, tok)


def test_prompts_too_long_and_existing_run_are_refused(tmp_path, prompts):
    config = small_config(tmp_path, max_prompt_length=8)
    with pytest.raises(ConfigError, match="exceed max_prompt_length=8"):
        PPOTrainer(FourModelBackend.from_config(config), config, prompts)
    trainer = make_trainer(tmp_path, prompts, total_steps=1)
    trainer.train(progress=False)
    with pytest.raises(ConfigError, match="already holds a run"):
        make_trainer(tmp_path, prompts, total_steps=1).train(progress=False)


def _cli(out, *extra):
    args = [f"--{k}={v}" for k, v in {**SMALL, "total_steps": 6, "save_steps": 1, "output_dir": out}.items()]
    return [sys.executable, "-m", "marlhf_edu.cli", "ppo", *args, *extra]


def _strip_timing(records):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in records]


@pytest.mark.slow
def test_killed_and_resumed_run_matches_uninterrupted(tmp_path):
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONWARNINGS": "ignore"}
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    subprocess.run(_cli(straight), check=True, env=env, capture_output=True, timeout=300)

    proc = subprocess.Popen(_cli(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    latest = killed / "checkpoints" / "latest"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if latest.exists() and latest.read_text().strip() >= "step-000003":
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)  # no chance to clean up: whatever was on disk is what resume gets
    proc.wait()
    assert len(read_metrics(killed / "metrics.jsonl")) < 6
    subprocess.run(_cli(killed, "--resume=true"), check=True, env=env, capture_output=True, timeout=300)

    a, b = _strip_timing(read_metrics(straight / "metrics.jsonl")), _strip_timing(read_metrics(killed / "metrics.jsonl"))
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    assert all("gold/mean" in r for r in a + b)  # toy data: the stage hands the loop the world's judge
    for ra, rb in zip(a, b):
        for key in ra:
            assert rb[key] == pytest.approx(ra[key], rel=1e-5, abs=1e-7), (ra["step"], key)
    # the checkpoint holds what a resume needs
    ckpt = straight / "checkpoints" / (straight / "checkpoints" / "latest").read_text()
    assert {p.name for p in ckpt.iterdir()} == {"trainable.safetensors", "optimizer.pt", "rng.pt", "state.json",
                                                "policy"}
    state = json.loads((ckpt / "state.json").read_text())
    assert state["step"] == 6 and state["data_position"] == 48 and "value" in state["kl_controller"]


@pytest.mark.slow
def test_training_curves_plot(tmp_path, prompts):
    import matplotlib

    matplotlib.use("Agg")
    from marlhf_edu.ppo.plotting import PANELS, plot_training_curves

    trainer = make_trainer(tmp_path, prompts, total_steps=2)
    records = trainer.train(progress=False)
    assert len(read_metrics(trainer.metrics_path)) == 2 and all(torch.isfinite(torch.tensor(
        [v for v in records[-1].values()])))
    fig = plot_training_curves({"a": trainer.metrics_path, "b": records})
    drawn = [ax for ax in fig.axes if ax.lines]
    assert len(drawn) == len(PANELS)
    assert len(fig.axes[0].lines) == 2  # both runs on the score panel
    # issue 36: no legend inside a panel (one covered the curves in each of ten panels); one legend for the
    # figure, below every panel, naming each run once
    assert not any(ax.get_legend() for ax in fig.axes)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["a", "b"]
    fig.canvas.draw()
    box = legend.get_window_extent()
    assert all(box.y1 <= ax.get_window_extent().y0 for ax in drawn)
    # the two keys of a panel: one style each, named in its title (policy/clipfrac and value/clipfrac apart)
    clip = next(ax for ax in fig.axes if ax.get_title().startswith("clipfrac"))
    assert clip.get_title() == "clipfrac\n(policy solid, value dashed)"
    assert [line.get_linestyle() for line in clip.lines] == ["-", "--", "-", "--"]
    assert len({line.get_color() for line in clip.lines}) == 2
    with pytest.raises(ValueError, match="at most 10"):
        plot_training_curves({str(i): records for i in range(11)})


class _Payload:
    """A pickle that, when loaded without weights_only, creates a file: the proof that code from a checkpoint ran."""

    def __init__(self, proof):
        self.proof = str(proof)

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.proof),))


@pytest.mark.parametrize("victim", ["rng.pt", "optimizer.pt"])
def test_resume_refuses_a_crafted_pickle_without_running_it(tmp_path, prompts, victim):
    make_trainer(tmp_path, prompts, total_steps=1, save_steps=1).train(progress=False)
    ckpt = tmp_path / "run" / "checkpoints" / (tmp_path / "run" / "checkpoints" / "latest").read_text()
    proof = tmp_path / "payload-ran"
    torch.save({"torch": _Payload(proof)}, ckpt / victim)  # what an attacker would plant in a shared run folder
    # First layer: the checkpoint's seal (sha256 per file) no longer matches, so the checkpoint is not used.
    with pytest.raises(ConfigError, match=f"{victim} does not match its recorded sha256"):
        make_trainer(tmp_path, prompts, total_steps=2, resume=True).train(progress=False)
    assert not proof.exists(), "resuming ran code from the checkpoint"
    # Second layer: an attacker who also rewrites the seal is stopped by loading with weights_only=True.
    state = json.loads((ckpt / "state.json").read_text())
    state["sha256"][victim] = sha256_of(ckpt / victim)
    (ckpt / "state.json").write_text(json.dumps(state))
    with pytest.raises(ConfigError, match=f"{victim} is not plain checkpoint data"):
        make_trainer(tmp_path, prompts, total_steps=2, resume=True).train(progress=False)
    assert not proof.exists(), "resuming ran code from the checkpoint"


@pytest.mark.slow
def test_the_command_prints_one_bar_a_table_and_no_library_warnings(tmp_path):
    """Issue 36: `marlhf-edu ma-ppo` printed transformers' "Loading weights" bars, a FutureWarning that peft
    triggers inside transformers, and its before/after evaluation as raw JSON lines."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "TQDM_DISABLE")}
    args = [f"--{k}={v}" for k, v in {**SMALL, "total_steps": 1, "eval_repeats": 1, "output_dir": tmp_path / "run"}.items()]
    proc = subprocess.run([sys.executable, "-m", "marlhf_edu.cli", "ma-ppo", *args], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr and "Loading weights" not in proc.stderr, proc.stderr
    assert "ppo: 100%" in proc.stderr  # the run's own bar
    table = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("held-out evaluation"))
    assert table[header].split()[-3:] == ["before", "after", "change"]
    rows = {line.split()[0]: line.split()[1:] for line in table[header + 1:] if line and not line.startswith("(")}
    assert {"harmful_refusal_rate", "benign_accuracy", "reward_model_score"} <= set(rows), rows
    assert rows["n_harmful"][0] == rows["n_harmful"][1] and rows["n_harmful"][0].isdigit()  # a count, no change
    assert rows["reward_model_score"][2].startswith(("+", "-"))
    assert "eval.json" in proc.stdout and "{" not in proc.stdout


def test_the_shuffled_reward_is_the_reward_models_scores_permuted_within_each_chunk(tmp_path, prompts):
    """`reward: reward_model_shuffled` (chapter 13's negative control): PPO gets the reward model's scores of the
    same answers, each forward chunk's permuted by its own generator; nothing else of the rollout changes (the same
    answers are drawn), and the unpermuted scores are logged."""
    from marlhf_edu.ppo.trainer import shuffled_order

    plain = make_trainer(tmp_path / "plain", prompts, forward_batch_size=4)
    a = plain.rollout(plain.batch_prompts(0))
    shuffled = make_trainer(tmp_path / "shuffled", prompts, forward_batch_size=4, reward="reward_model_shuffled")
    b = shuffled.rollout(shuffled.batch_prompts(0))
    assert torch.equal(a.input_ids, b.input_ids)  # the permutation draws nothing from the sampling generators
    assert torch.equal(b.reward_model_scores, a.raw_scores)
    order = torch.cat([4 * k + shuffled_order(4, shuffled.config.seed, 0, k) for k in range(len(a.raw_scores) // 4)])
    assert torch.equal(b.raw_scores, a.raw_scores[order]) and not torch.equal(b.raw_scores, a.raw_scores)
    record = shuffled.rollout_stats(b)
    assert record["score/reward_model_mean"] == pytest.approx(record["score/mean"], abs=1e-6)  # the same scores
    assert shuffled_order(4, 0, 1, 0).tolist() != shuffled_order(4, 0, 2, 0).tolist()  # a new order each step
