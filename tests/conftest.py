import pytest
import torch


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def right_padded_mask(gen, B, T, min_len=1):
    lengths = torch.randint(min_len, T + 1, (B,), generator=gen)
    lengths[0] = T
    return (torch.arange(T)[None, :] < lengths[:, None]).long()


@pytest.fixture(scope="module")
def prompts():
    """The toy world's training prompts, rendered."""
    from marlhf_edu.toyworld import ToyWorld

    return [p.prompt for p in ToyWorld().train_prompts]


def build_trainer(tmp_path, backend_cls, prompts, base: dict, **overrides):
    """A `PPOTrainer` on `backend_cls` with config `base` + `overrides`, seeded, writing under `tmp_path`."""
    from marlhf_edu.ppo import PPOConfig, PPOTrainer

    config = PPOConfig(output_dir=str(tmp_path / backend_cls.__name__), **{**base, **overrides})
    torch.manual_seed(0)
    return PPOTrainer(backend_cls.from_config(config), config, prompts)
