"""The sentiment experiment through the engine (chapter 13): the everyday prompts as PPO data, VADER as the
held-out judge and as a reward, EOS read from the sampled ids, held-out pairs for the reward stage."""

import json
import math

import pytest
import torch

from marlhf_edu.data.everyday import everyday_prompts
from marlhf_edu.data.sentiment_judge import SentimentJudge, vader_compound
from marlhf_edu.data.shipped import shipped_rows
from marlhf_edu.errors import ConfigError, DataFileError
from marlhf_edu.loading.sources import load_tokenizer
from marlhf_edu.ppo import PPOConfig

ENDED, CUT = "Boil it for nine minutes.", "First you need to find a big pot, fill it with cold water and then"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


class FixedModel(torch.nn.Module):
    """`generate` appends the given answer ids to each prompt row: one that ends with EOS (then padding), one
    that runs to the limit."""

    def __init__(self, answers):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.answers = answers

    def generate(self, input_ids, attention_mask=None, **kwargs):
        return torch.cat([input_ids, self.answers[:len(input_ids)]], dim=1)


def _answers(tok):
    ended = tok(ENDED, add_special_tokens=False)["input_ids"]
    cut = tok(CUT, add_special_tokens=False)["input_ids"]
    width = len(cut)  # the cut answer fills every column: no EOS anywhere
    assert width >= len(ended) + 2
    rows = [ended + [tok.eos_token_id] + [tok.pad_token_id] * (width - len(ended) - 1), cut]
    return torch.tensor(rows)


def test_generate_responses_reads_eos_from_the_sampled_ids(tok):
    from marlhf_edu.loading.generation import generate_responses

    model = FixedModel(_answers(tok))
    texts, finished = generate_responses(model, tok, ["Q1", "Q2"], max_new_tokens=8, with_finished=True)
    assert texts == [ENDED, CUT] and finished == [True, False]
    assert generate_responses(model, tok, ["Q1", "Q2"], max_new_tokens=8) == [ENDED, CUT]  # the old return


def test_sample_toy_records_whether_each_answer_ended(tok):
    from marlhf_edu.ppo.trainer import sample_toy

    class Backend:
        device = torch.device("cpu")
        tokenizer = tok

        def generate(self, ids, mask, max_new_tokens, temperature):
            return torch.cat([ids, _answers(tok)[:len(ids)]], dim=1)

        def scores(self, ids, mask):
            return torch.zeros(len(ids))

    judge = SentimentJudge(tok, limit=1)
    records = sample_toy(Backend(), judge, repeats=2)
    assert [r["finished"] for r in records] == [True, False]
    assert [r["gold"] for r in records] == [vader_compound(ENDED), vader_compound(CUT)]


def test_everyday_prompts_are_a_shipped_dataset_with_their_splits():
    assert [r["prompt"] for r in shipped_rows("everyday-prompts", "held_out")] == everyday_prompts("held_out")
    assert len(shipped_rows("everyday-prompts", "all")) == 340
    with pytest.raises(DataFileError, match="split must be one of train, held_out, all, got 'test'"):
        shipped_rows("everyday-prompts", "test")


def test_sentiment_settings_are_checked():
    PPOConfig(reward="sentiment", dataset_name="mine.jsonl").validate()  # VADER reads any answer
    PPOConfig(dataset_name="everyday-prompts", eval_every=5).validate()  # its held-out questions are the judge's
    with pytest.raises(ConfigError, match="everyday-prompts trains on its train split"):
        PPOConfig(dataset_name="everyday-prompts", dataset_split="held_out").validate()
    with pytest.raises(ConfigError, match="dataset_format: hh-rlhf"):
        PPOConfig(reward="keyword_judge", dataset_name="everyday-prompts").validate()


def test_ppo_on_everyday_prompts_optimises_vader_and_reports_the_guards(tmp_path, tok):
    """The positive control end to end on the tiny model: train prompts rendered from the train split, VADER the
    reward (the reward model logged beside it), the sentiment judge on held-out questions before and after and
    every update, with the guards, and each answer's EOS flag kept."""
    from marlhf_edu.data.prompts import load_prompts
    from marlhf_edu.data.template import template_for
    from marlhf_edu.ppo.run import run

    config = PPOConfig(output_dir=str(tmp_path / "run"), dataset_name="everyday-prompts", reward="sentiment",
                       max_prompt_length=256, max_prompts=8, total_steps=1, batch_size=4, mini_batch_size=4,
                       micro_batch_size=4, forward_batch_size=4, max_new_tokens=6, device="cpu", eval_repeats=1,
                       eval_prompts=3, eval_every=1, eval_every_prompts=2, save_steps=0).validate()
    template = template_for(tok)
    assert load_prompts(config, tok) == [template.dialogue([(q, None)]) for q in everyday_prompts("train")[:8]]
    result = run(config, progress=False)
    for when in ("before", "after"):
        assert result[when]["n"] == 3
        assert {"vader_compound", "positive_rate", "repeated_trigram_share", "distinct_2", "mean_words",
                "mean_tokens", "eos_rate", "reward_model_score"} <= set(result[when])
    lines = [json.loads(line) for line in (tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all(isinstance(s["finished"], bool) for s in lines)
    assert [s["question"] for s in lines[:3]] == everyday_prompts("held_out")[:3]
    assert all(s["gold"] == vader_compound(s["response"]) for s in lines)
    before = [s for s in lines if s["when"] == "before"]
    assert result["before"]["vader_compound"] == pytest.approx(sum(s["gold"] for s in before) / 3)
    assert result["before"]["eos_rate"] == sum(s["finished"] for s in before) / 3
    # the log-prob guard is the SFT model's (the frozen reference), as answer_mean_logprobs reads a plain model
    from marlhf_edu.data.sentiment_judge import answer_mean_logprobs
    from marlhf_edu.ppo.judging import reference_mean_logprobs

    backend = result["trainer"].backend
    prompts = [template.dialogue([(s["question"], None)]) for s in before] + ["Q: x\nA:"]
    answers = [s["response"] for s in before] + [""]
    engine = reference_mean_logprobs(backend, prompts, answers, batch_size=2)
    plain = answer_mean_logprobs(backend.reference, tok, prompts, answers)
    assert engine[:-1] == pytest.approx(plain[:-1], abs=1e-5) and math.isnan(engine[-1]) and math.isnan(plain[-1])
    assert result["before"]["sft_mean_logprob"] == pytest.approx(
        sum(x for x in engine[:-1] if not math.isnan(x)) / sum(not math.isnan(x) for x in engine[:-1]), abs=1e-5)
    record = result["records"][-1]
    assert "score/reward_model_mean" in record and "eval/vader_compound" in record
    curve = [json.loads(line) for line in (tmp_path / "run" / "eval_curve.jsonl").read_text().splitlines()]
    assert len(curve) == 2 and len(curve[0]["reward_model_scores"]) == 2


def test_rm_stage_scores_held_out_pairs_from_a_file(tmp_path, capsys):
    """`eval_pairs_file`: held-out pairs read before any model loads (a bad row names the file, the row, the key),
    scored after training; it and `eval_split` cannot both be given."""
    from marlhf_edu import cli

    pairs = [{"prompt": "Q: how do you boil an egg?\nA:", "chosen": " Boil it, lovely.", "rejected": " Boil it."},
             {"prompt": "Q: how do you peel a carrot?\nA:", "chosen": " Gently, great.", "rejected": " Peel it."}]
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps(p) + "\n" for p in pairs * 4))
    held.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    common = ["rm", "--config", "configs/tiny_rm.yaml", "--model_name_or_path", "zoo", "--dataset_name", str(train),
              "--dataset_format", "trl", "--max_tokens", "0"]
    assert cli.main([*common, "--eval_pairs_file", str(held), "--eval_split", "test",
                     "--output_dir", str(tmp_path / "both")]) == 2
    assert "both name held-out pairs" in capsys.readouterr().err
    held.write_text(json.dumps(pairs[0]) + "\n" + json.dumps({"prompt": "Q", "chosen": "a"}) + "\n")
    assert cli.main([*common, "--eval_pairs_file", str(held), "--output_dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert f"eval_pairs_file {held}: row 1, field 'rejected'" in err and "Traceback" not in err
    held.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    assert cli.main([*common, "--eval_pairs_file", str(held), "--eval_pairs", "1", "--num_train_epochs", "1",
                     "--output_dir", str(tmp_path / "rm")]) == 0
    metrics = json.loads((tmp_path / "rm" / "eval_metrics.json").read_text())
    assert metrics["n"] == 1 and "untrained_head_accuracy" in metrics and "length_baseline" in metrics


def test_best_of_n_kl_and_table():
    import math

    from marlhf_edu.math.evaluation import best_of_n_kl, best_of_n_table

    assert best_of_n_kl(1) == 0.0 and best_of_n_kl(4) == pytest.approx(math.log(4) - 0.75)
    # the exact KL of best-of-n over n distinct equally likely answers: the pick is answer k (in score order)
    # with probability (k/n)^n - ((k-1)/n)^n, against 1/n under the policy; it tends to the formula as answers grow
    n, m = 4, 400
    exact = sum(p * math.log(p * m) for k in range(1, m + 1) if (p := (k / m) ** n - ((k - 1) / m) ** n) > 0)
    assert exact == pytest.approx(best_of_n_kl(n), abs=0.01)
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        best_of_n_kl(0)
    proxy = [[0.1, 0.9, 0.5, 0.2], [0.3, 0.3, 0.8, 0.1]]
    gold = [[0.0, 1.0, 0.0, 0.0], [0.5, 0.0, 0.2, 0.9]]
    one, two, four = best_of_n_table(proxy, gold, ns=(1, 2, 4))
    assert one["gold_pick"] == one["gold_random"] == pytest.approx(0.25) and one["gain"] == 0.0
    # n = 2: prompt 0 picks answer 1 (gold 1.0), prompt 1 ties at 0.3 and keeps the first (gold 0.5)
    assert two["gold_pick"] == pytest.approx(0.75) and two["gold_random"] == pytest.approx((0.5 + 0.25) / 2)
    assert two["gold_worst"] == pytest.approx((0.0 + 0.5) / 2)  # a tie's worst is its first answer too
    # n = 4: picks 1 and 2; the gold's own best is 1.0 and 0.9; the proxy's worst 0 and 3
    assert four["gold_pick"] == pytest.approx(0.6) and four["gold_best"] == pytest.approx(0.95)
    assert four["gold_worst"] == pytest.approx(0.45) and four["proxy_pick"] == pytest.approx(0.85)
    assert four["gain"] == pytest.approx(0.6 - (0.25 + 0.4) / 2)
    with pytest.raises(ValueError, match=r"each n must lie in \[1, 4\]"):
        best_of_n_table(proxy, gold, ns=(8,))
    with pytest.raises(ValueError, match="same number of answers"):
        best_of_n_table(proxy, [[0.0], [1.0]])
