"""Forwards over the columns a chunk of rows uses (`marlhf_edu.ppo.used_columns`), and the rollout that sorts each
chunk's rows by length before cutting: every row's old log-probs, values, reference log-probs and score must still be
its own, equal to a forward over the whole padded batch up to rounding."""

from __future__ import annotations

import pytest
import torch
from conftest import build_trainer

from marlhf_edu.math.scoring import append_missing_eos
from marlhf_edu.ppo import FourModelBackend
from marlhf_edu.ppo import trainer as trainer_module
from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend
from marlhf_edu.ppo.trainer import cuts_policy_forwards
from marlhf_edu.ppo.used_columns import pad_columns, right_aligned, trim_columns, used_span

SMALL = dict(batch_size=8, mini_batch_size=4, micro_batch_size=2, forward_batch_size=8, max_new_tokens=12,
             actor_lora_r=8, actor_lora_alpha=16, device="cpu", eval_repeats=0, learning_rate=1e-3)
#: fp32 rounding of the same rows computed in batches of other shapes (measured below 2e-6 on the tiny model)
TOLERANCE = 1e-4


def test_used_span_cuts_the_padding_every_row_shares():
    # P = 5 prompt columns (left-padded), R = 4 response columns (masked after EOS)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0, 0],
                         [0, 0, 0, 1, 1, 1, 0, 0, 0]])
    assert used_span(mask, 4) == (2, 7)
    ids = torch.arange(18).view(2, 9)
    cut_ids, cut_mask, r = trim_columns(ids, mask, 4)
    assert r == 2 and torch.equal(cut_ids, ids[:, 2:7]) and torch.equal(cut_mask, mask[:, 2:7])
    # the last prompt column and one response column stay even when nothing there is attended to
    assert used_span(torch.tensor([[0, 0, 0, 0, 0, 0]]), 2) == (3, 5)
    assert used_span(torch.tensor([[1, 1, 1, 1, 0, 0]]), 2) == (0, 5)
    # nothing to cut
    assert used_span(torch.ones(2, 6, dtype=torch.long), 2) == (0, 6)
    for bad in (0, 6):
        with pytest.raises(ValueError, match="n_response"):
            used_span(torch.ones(2, 6, dtype=torch.long), bad)


def test_right_aligned_rows_end_in_the_last_column():
    ids = torch.tensor([[0, 0, 5, 6, 7, 0, 0],
                        [0, 0, 0, 8, 9, 3, 0],
                        [0, 4, 4, 4, 4, 4, 4]])
    mask = (ids != 0).long()
    got_ids, got_mask = right_aligned(ids, mask)
    # 7 columns in the prompt/response layout; right-aligned, the longest row needs 6
    assert got_ids.tolist() == [[0, 0, 0, 5, 6, 7], [0, 0, 0, 8, 9, 3], [4, 4, 4, 4, 4, 4]]
    assert torch.equal(got_mask, (got_ids != 0).long())


def test_pad_columns_gives_back_the_batch_width():
    x = torch.tensor([[1.0, 2.0]], requires_grad=True)
    out = pad_columns(x, 4)
    assert out.tolist() == [[1.0, 2.0, 0.0, 0.0]]
    out.sum().backward()
    assert x.grad.tolist() == [[1.0, 1.0]]
    assert pad_columns(None, 4) is None and pad_columns(x, 2) is x


@pytest.mark.parametrize("backend_cls", [MultiAdapterBackend, FourModelBackend])
def test_rollout_rows_keep_their_own_forwards(tmp_path, prompts, backend_cls):
    """The rollout sorts each chunk's rows by length and cuts each micro-batch to its columns; each row's results must
    come back to that row: equal, where the mask is 1, to one forward over the whole padded batch."""
    trainer = build_trainer(tmp_path, backend_cls, prompts, SMALL)
    be, cfg = trainer.backend, trainer.config
    widths, real = [], be.policy_forward

    def recording(input_ids, *a, **k):
        widths.append(tuple(input_ids.shape))
        return real(input_ids, *a, **k)

    be.policy_forward = recording
    torch.manual_seed(1)
    r = trainer.rollout(trainer.batch_prompts(0))
    be.policy_forward = real
    B, T = r.input_ids.shape
    R = r.n_response
    lengths = r.attention_mask.sum(1)
    assert len(set(lengths.tolist())) > 2  # rows of different lengths, else nothing here is tested
    assert sum(b * t for b, t in widths) < B * T  # the micro-batches saw fewer columns than the padded batch

    with torch.no_grad():
        logprobs, values, _ = be.policy_forward(r.input_ids, r.attention_mask, R, cfg.temperature)
        ref = be.reference_logprobs(r.input_ids, r.attention_mask, R, cfg.temperature)
        ids, mask = append_missing_eos(r.input_ids, r.attention_mask, r.has_eos, be.tokenizer.eos_token_id,
                                       be.tokenizer.pad_token_id)
        scores = be.scores(ids, mask)
    m = r.response_mask
    for name, got, want in (("logprobs", r.logprobs, logprobs), ("values", r.values, values),
                            ("ref_logprobs", r.ref_logprobs, ref)):
        assert (got[m] - want[m].float()).abs().max() < TOLERANCE, name
    assert (r.raw_scores - scores).abs().max() < TOLERANCE


def test_the_updates_cut_forward_has_the_whole_batchs_gradient(tmp_path, prompts):
    trainer = build_trainer(tmp_path, MultiAdapterBackend, prompts, SMALL)
    be, cfg = trainer.backend, trainer.config
    torch.manual_seed(1)
    r = trainer.rollout(trainer.batch_prompts(0))
    rows = torch.argsort(r.attention_mask.sum(1))[:4]  # the four shortest: columns to cut on both sides
    ids, mask, R = r.input_ids[rows], r.attention_mask[rows], r.n_response
    assert trim_columns(ids, mask, R)[0].shape[1] < ids.shape[1]
    params = [p for group in be.parameter_groups().values() for p in group if p.requires_grad]
    m = r.response_mask[rows]

    def grads(forward):
        for p in params:
            p.grad = None
        lp, v, ent = forward(ids, mask, R)
        (lp[m].sum() + v[m].sum() + ent[m].sum()).backward()
        return lp.detach(), [p.grad.clone() for p in params]

    cut_lp, cut_grads = grads(lambda i, a, n: trainer._policy_forward(i, a, n, with_entropy=True))
    full_lp, full_grads = grads(lambda i, a, n: be.policy_forward(i, a, n, cfg.temperature, with_entropy=True))
    assert cut_lp.shape == full_lp.shape
    assert (cut_lp[m] - full_lp[m]).abs().max() < TOLERANCE
    for a, b in zip(cut_grads, full_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_policy_forwards_are_cut_only_where_rollout_and_update_stay_alike(tmp_path, prompts, monkeypatch):
    """On a GPU, kernels round by batch shape: with several rows per forward the update's micro-batch (other rows,
    so another cut) would not reproduce the rollout's old log-probs, so the policy keeps the batch's width there.
    One row per forward is cut alike in both; a CPU's fp32 rounds alike enough (the test above)."""
    assert cuts_policy_forwards(2, torch.device("cpu")) and cuts_policy_forwards(1, "cuda")
    assert not cuts_policy_forwards(2, "cuda")
    for cut in (True, False):
        monkeypatch.setattr(trainer_module, "cuts_policy_forwards", lambda micro, device: cut)
        trainer = build_trainer(tmp_path / str(cut), MultiAdapterBackend, prompts, SMALL)
        be = trainer.backend
        widths, real = [], be.policy_forward

        def recording(input_ids, *a, **k):
            widths.append(input_ids.shape[1])
            return real(input_ids, *a, **k)

        be.policy_forward = recording
        torch.manual_seed(1)
        r = trainer.rollout(trainer.batch_prompts(0))
        trainer.update(r)
        assert len(widths) == 2 * 8 // 2  # the rollout's forwards and the update's (one epoch), two rows each
        assert (min(widths) < r.input_ids.shape[1]) == cut
