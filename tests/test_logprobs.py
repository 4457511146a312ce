import pytest
import torch

from marlhf_edu import entropy_from_logits, logprobs_from_logits
from marlhf_edu.math import logprobs as logprobs_module
from marlhf_edu.memory import run_isolated


def naive(logits, labels):
    return torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float64, 1e-10), (torch.bfloat16, 1e-6)])
def test_equals_log_softmax_gather(gen, dtype, atol):
    logits = (torch.randn(3, 7, 50, generator=gen) * 4).to(dtype)
    labels = torch.randint(0, 50, (3, 7), generator=gen)
    assert torch.allclose(logprobs_from_logits(logits, labels), naive(logits, labels).float(), atol=atol)


def test_gradient_matches_naive_across_chunks(gen, monkeypatch):
    monkeypatch.setattr(logprobs_module, "CHUNK_ELEMENTS", 64)  # force many chunks of 2 rows
    logits = torch.randn(2, 5, 30, generator=gen)
    labels = torch.randint(0, 30, (2, 5), generator=gen)
    weights = torch.randn(2, 5, generator=gen)
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    (logprobs_from_logits(a, labels) * weights).sum().backward()
    (naive(b, labels) * weights).sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-6)


def test_gradcheck_double(gen):
    logits = torch.randn(2, 3, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 7, (2, 3), generator=gen)
    # the function computes in fp32 by design; check its backward against autograd's on the same fp32 math
    out = logprobs_from_logits(logits, labels)
    (g,) = torch.autograd.grad(out.sum(), logits)
    ref = torch.autograd.grad(naive(logits, labels).sum(), logits)[0]
    assert torch.allclose(g, ref, atol=1e-6)


def test_large_logits_stay_finite(gen):
    logits = torch.randn(2, 4, 20, generator=gen) * 1e4
    labels = torch.randint(0, 20, (2, 4), generator=gen)
    out = logprobs_from_logits(logits, labels)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, naive(logits, labels), rtol=1e-5)


def test_bad_inputs():
    with pytest.raises(ValueError, match="expected logits"):
        logprobs_from_logits(torch.randn(2, 3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="labels must lie"):
        logprobs_from_logits(torch.randn(1, 2, 5), torch.tensor([[0, 5]]))
    bad = torch.randn(1, 2, 5); bad[0, 1, 3] = float("nan")
    # the check reads the (B, T) result, not the (B, T, V) logits: it still names the position of the bad row
    with pytest.raises(ValueError, match=r"`logits` contains NaN at 1 position\(s\), first at index \(0, 1\)"):
        logprobs_from_logits(bad, torch.zeros(1, 2, dtype=torch.long))  # the label (0) is not the NaN entry
    with pytest.raises(ValueError, match=r"`logits` contains NaN at 1 position\(s\), first at index \(0, 1\)"):
        entropy_from_logits(bad)


def test_entropy_matches_categorical(gen, monkeypatch):
    monkeypatch.setattr(logprobs_module, "CHUNK_ELEMENTS", 100)
    logits = torch.randn(3, 4, 40, generator=gen) * 3
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(entropy_from_logits(logits), expected, atol=1e-5)
    banned = logits.clone(); banned[..., :10] = float("-inf")
    assert torch.allclose(entropy_from_logits(banned), torch.distributions.Categorical(logits=banned).entropy(), atol=1e-5)
    assert torch.allclose(entropy_from_logits(torch.zeros(1, 1, 64)), torch.log(torch.tensor(64.0)))


@pytest.mark.slow
def test_peak_memory_well_below_naive_at_llama_vocab():
    shape = dict(batch=4, tokens=256, vocab=32000)  # 125 MiB of fp32 logits
    naive_peak = run_isolated("marlhf_edu.memory:logprob_workload", method="naive", **shape)
    chunked_peak = run_isolated("marlhf_edu.memory:logprob_workload", method="chunked", **shape)
    assert naive_peak > 100 * 2**20, naive_peak  # the naive version really builds a (B,T,V) copy
    assert chunked_peak < naive_peak / 3, (chunked_peak, naive_peak)
