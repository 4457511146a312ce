import pytest
import torch


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def right_padded_mask(gen, B, T, min_len=1):
    lengths = torch.randint(min_len, T + 1, (B,), generator=gen)
    lengths[0] = T
    return (torch.arange(T)[None, :] < lengths[:, None]).long()
