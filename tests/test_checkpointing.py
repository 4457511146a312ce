"""Gradient checkpointing changes memory, never the numbers: same gradients, same run, far fewer saved bytes."""

import contextlib

import pytest
import torch

from marlhf_edu.data.toyworld import ToyWorld
from marlhf_edu.memory.measure import saved_tensor_bytes
from marlhf_edu.ppo import FourModelBackend, PPOConfig, PPOTrainer
from marlhf_edu.ppo.checkpointing import checkpointed, decoder_layers_of
from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend

SMALL = dict(batch_size=8, mini_batch_size=4, micro_batch_size=4, forward_batch_size=8, max_new_tokens=12,
             device="cpu", eval_repeats=0, learning_rate=1e-3)
CASES = [(FourModelBackend, {}), (FourModelBackend, {"actor_lora_r": 8}),
         (MultiAdapterBackend, {"value_mode": "shared", "load_in_4bit": True}),
         (MultiAdapterBackend, {"value_mode": "adapter", "actor_lora_r": 4})]
IDS = ["four-full", "four-lora", "ma-shared-nf4", "ma-adapter"]


@pytest.fixture(scope="module")
def prompts():
    return [p.prompt for p in ToyWorld().train_prompts]


def build(tmp_path, backend_cls, prompts, checkpointing, **overrides):
    config = PPOConfig(output_dir=str(tmp_path / f"run-{checkpointing}"), gradient_checkpointing=checkpointing,
                       **{**SMALL, **overrides})
    torch.manual_seed(0)
    return PPOTrainer(backend_cls.from_config(config), config, prompts)


def perturb(backend):
    """Move every LoRA B and the value head off zero, so that every trainable tensor gets a gradient (a zero
    head sends none into the critic) and policy and value adapters differ."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for prefix, model in backend.models().items():
            for name, p in model.named_parameters(prefix=prefix):
                if p.requires_grad and ("lora_B" in name or "value_head.weight" in name):
                    p.add_(0.05 * torch.randn(p.shape, generator=gen))


def gradients(trainer, rollout):
    """(gradient of every trainable tensor, bytes saved for the backward) of one micro-batch of the update."""
    be = trainer.backend
    trainer.optimizer.zero_grad(set_to_none=True)
    (loss, _), saved = saved_tensor_bytes(lambda: trainer.micro_batch_loss(rollout, slice(0, 4)),
                                          *be.models().values())
    loss.backward()
    out = {f"{prefix}.{n}": p.grad.clone() for prefix, m in be.models().items() for n, p in m.named_parameters()
           if p.requires_grad}
    trainer.optimizer.zero_grad(set_to_none=True)
    return out, saved


def rollout_pair(tmp_path, backend_cls, prompts, overrides):
    plain, ckpt = (build(tmp_path, backend_cls, prompts, c, **overrides) for c in (False, True))
    for t in (plain, ckpt):
        perturb(t.backend)
    torch.manual_seed(1)
    rollout = plain.rollout(plain.batch_prompts(0))
    return plain, ckpt, rollout


@pytest.mark.parametrize("backend_cls, overrides", CASES, ids=IDS)
@pytest.mark.slow
def test_same_gradients_with_far_fewer_saved_activations(tmp_path, prompts, backend_cls, overrides):
    plain, ckpt, rollout = rollout_pair(tmp_path, backend_cls, prompts, overrides)
    g_plain, saved_plain = gradients(plain, rollout)
    g_ckpt, saved_ckpt = gradients(ckpt, rollout)
    assert g_plain.keys() == g_ckpt.keys()
    assert sum(float(g.abs().sum() > 0) for g in g_plain.values()) > 0.9 * len(g_plain)
    for name in g_plain:  # the recomputation replays the same kernels on the same inputs
        torch.testing.assert_close(g_ckpt[name], g_plain[name], rtol=1e-5, atol=1e-7, msg=name)
    assert saved_ckpt < saved_plain / 5  # tiny model: 4 layers' activations → 4 layer inputs


def test_value_adapter_layers_are_recomputed_under_the_value_adapter(tmp_path, prompts, monkeypatch):
    """The recomputation runs in the backward, when `policy` is active again. Replayed under whatever adapter is
    active, the value adapter's gradients are computed through the policy adapter: they must then differ (so the
    replay in `MultiAdapterBackend._replay_adapter` is what makes the equality above hold)."""
    monkeypatch.setattr(MultiAdapterBackend, "_replay_adapter", lambda self: contextlib.nullcontext())
    plain, ckpt, rollout = rollout_pair(tmp_path, MultiAdapterBackend, prompts, {"value_mode": "adapter",
                                                                                 "actor_lora_r": 4})
    g_plain, _ = gradients(plain, rollout)
    g_ckpt, _ = gradients(ckpt, rollout)
    wrong = [n for n in g_plain if not torch.allclose(g_ckpt[n], g_plain[n], rtol=1e-3, atol=1e-6)]
    assert wrong and all(".value." in n or "value_head" in n for n in wrong)
    assert all(torch.equal(g_ckpt[n], g_plain[n]) or n in wrong for n in g_plain if ".policy." in n)


def test_only_the_layers_switch_mode_and_only_inside_the_context(tmp_path, prompts):
    trainer = build(tmp_path, MultiAdapterBackend, prompts, True, value_mode="shared", actor_lora_r=4)
    model = trainer.backend.model
    layers = decoder_layers_of(model)
    assert layers and all(layer.gradient_checkpointing for layer in layers)
    with checkpointed(model):
        assert all(layer.training for layer in layers)
        assert not any(m.training for layer in layers for m in layer.modules() if m is not layer)  # dropout stays off
        assert not model.training
    assert not any(m.training for m in model.modules())
    # enabled but outside the context (rollouts, reference, scores): nothing is checkpointed
    torch.manual_seed(1)
    rollout = trainer.rollout(trainer.batch_prompts(0))
    be = trainer.backend
    _, outside = saved_tensor_bytes(lambda: be.policy_forward(rollout.input_ids[:4], rollout.attention_mask[:4],
                                                              rollout.n_response, 1.0), *be.models().values())
    _, inside = saved_tensor_bytes(lambda: trainer.micro_batch_loss(rollout, slice(0, 4)), *be.models().values())
    assert inside < outside / 5


def test_a_checkpointed_run_equals_a_plain_one(tmp_path, prompts):
    """Two PPO steps of two minibatches each, MA-PPO with a value adapter: same records, same weights."""
    runs = {c: build(tmp_path, MultiAdapterBackend, prompts, c, value_mode="adapter", actor_lora_r=4)
            for c in (False, True)}
    for step in range(2):
        records = {}
        for c, trainer in runs.items():
            torch.manual_seed(10 + step)
            records[c] = trainer.step()
        for key, value in records[False].items():
            if not key.startswith("time/"):
                assert records[True][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
    plain, ckpt = (runs[c].backend.trainable_state_dict() for c in (False, True))
    for name in plain:
        torch.testing.assert_close(ckpt[name], plain[name], rtol=1e-5, atol=1e-7, msg=name)
