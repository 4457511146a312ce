import pytest
import torch

from marlhf_edu import last_valid_index, masked_mean, masked_var, masked_whiten
from tests.conftest import right_padded_mask


def test_masked_mean_matches_selection(gen):
    x = torch.randn(5, 9, generator=gen)
    m = right_padded_mask(gen, 5, 9)
    assert torch.allclose(masked_mean(x, m), x[m.bool()].mean())
    per_row = masked_mean(x, m, dim=1)
    for b in range(5):
        assert torch.allclose(per_row[b], x[b][m[b].bool()].mean())


def test_masked_entries_never_matter(gen):
    x = torch.randn(4, 7, generator=gen)
    m = right_padded_mask(gen, 4, 7, min_len=2)
    for fill in (1e9, -1e9, float("nan"), float("inf")):
        y = torch.where(m.bool(), x, torch.tensor(fill))
        assert torch.equal(masked_mean(x, m), masked_mean(y, m))
        assert torch.equal(masked_var(x, m), masked_var(y, m))
        assert torch.equal(masked_whiten(x, m), masked_whiten(y, m))


def test_masked_var_bessel(gen):
    x = torch.randn(3, 6, generator=gen)
    m = right_padded_mask(gen, 3, 6, min_len=2)
    sel = x[m.bool()]
    assert torch.allclose(masked_var(x, m), sel.var(unbiased=True))
    assert torch.allclose(masked_var(x, m, unbiased=False), sel.var(unbiased=False))


def test_masked_whiten_statistics(gen):
    x = 3 + 2 * torch.randn(4, 50, generator=gen)
    m = right_padded_mask(gen, 4, 50, min_len=10)
    w = masked_whiten(x, m)
    assert abs(w[m.bool()].mean().item()) < 1e-5
    assert abs(w[m.bool()].std().item() - 1) < 1e-4
    assert torch.all(w[~m.bool()] == 0)
    kept = masked_whiten(x, m, shift_mean=False)
    assert torch.allclose(kept[m.bool()].mean(), x[m.bool()].mean(), atol=1e-5)


def test_degenerate_inputs_raise():
    x = torch.randn(2, 3)
    with pytest.raises(ValueError, match="selects no element"):
        masked_mean(x, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="at least 2"):
        masked_var(x, torch.tensor([[1, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="at least 2"):
        masked_whiten(x, torch.tensor([[1, 0, 0], [0, 0, 0]]))
    assert masked_var(x, torch.tensor([[1, 0, 0], [0, 0, 0]]), unbiased=False).item() == 0.0
    nan = x.clone(); nan[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"NaN .*index \(1, 2\)"):
        masked_mean(nan, torch.ones(2, 3))
    with pytest.raises(ValueError, match="only 0 and 1"):
        masked_mean(x, torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="selects no element along dim 1"):
        masked_mean(x, torch.tensor([[1, 1, 0], [0, 0, 0]]), dim=1)


def test_last_valid_index_both_paddings():
    right = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])
    assert last_valid_index(right).tolist() == [1, 3, 0]
    assert last_valid_index(left).tolist() == [3, 3, 3]
    with pytest.raises(ValueError, match="row 1"):
        last_valid_index(torch.tensor([[1, 0], [0, 0]]))


def _trl_011_masked_mean(values, mask, axis=None):
    """trl 0.11's masked_mean (trl/core.py), as written there: 0/0 = NaN where the mask selects nothing."""
    if axis is not None:
        return (values * mask).sum(axis=axis) / mask.sum(axis=axis)
    return (values * mask).sum() / mask.sum()


def test_masked_mean_empty_slices_nan_on_request(gen):
    x = torch.randn(4, 6, generator=gen)
    lengths = torch.tensor([3, 1, 4, 2])
    m = (torch.arange(6)[None, :] < lengths[:, None]).float()  # positions 4 and 5: no answer reaches them
    with pytest.raises(ValueError, match="selects no element along dim 0"):
        masked_mean(x, m, dim=0)  # the default still raises
    per_position = masked_mean(x, m, dim=0, empty="nan")
    assert per_position.shape == (6,)
    assert torch.isnan(per_position).tolist() == [False] * 4 + [True] * 2
    for t in range(4):
        assert torch.allclose(per_position[t], x[:, t][m[:, t].bool()].mean())
    assert torch.allclose(per_position, _trl_011_masked_mean(x, m, axis=0), equal_nan=True)
    # rows, and the whole tensor, the same way
    m[1] = 0
    per_row = masked_mean(x, m, dim=1, empty="nan")
    assert torch.isnan(per_row).tolist() == [False, True, False, False]
    assert torch.allclose(per_row, _trl_011_masked_mean(x, m, axis=1), equal_nan=True)
    assert torch.isnan(masked_mean(x, torch.zeros(4, 6), empty="nan"))
    assert torch.isnan(_trl_011_masked_mean(x, torch.zeros(4, 6)))
    assert masked_mean(x, m, empty="nan") == masked_mean(x, m)  # nothing empty: the same as the default
    # a NaN in a selected entry still raises; NaN in padding still does not matter
    dirty = torch.where(m.bool(), x, torch.tensor(float("nan")))
    assert torch.equal(masked_mean(dirty, m, dim=0, empty="nan").isnan(), per_position.isnan() | (m.sum(0) == 0))
    dirty[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"NaN .*index \(0, 0\)"):
        masked_mean(dirty, m, dim=0, empty="nan")
    with pytest.raises(ValueError, match="`empty` must be one of"):
        masked_mean(x, m, empty="zero")

