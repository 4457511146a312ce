"""VADER as chapter 13's labeller and gold judge, the guards it cannot see, and the everyday prompts it judges."""

import json
import math
import re

import pytest
import torch

from marlhf_edu.data.everyday import EVERYDAY_PROMPTS, everyday_prompts, everyday_rows
from marlhf_edu.data.sentiment_judge import (SentimentJudge, answer_mean_logprobs, answer_openings, answer_words,
                                             commonest_opening, distinct_n, ended_with_eos, eos_rate,
                                             gold_by_question, gold_change, mean_tokens, mean_words,
                                             repeated_trigram_share, repeats_trigram, repetition_change,
                                             sentiment_pairs, sentiment_report, sentiment_reward, vader_compound)
from marlhf_edu.errors import DataFileError
from marlhf_edu.loading.sources import load_tokenizer
from marlhf_edu.math.logprobs import logprobs_from_logits

# VADER 3.3.2's compound scores of these sentences, read off once: the lexicon is the judge, so they are pinned
GREAT = "great great great"  # 0.9231: every word positive
PLAIN = "The bus leaves at nine."  # 0.0: no lexicon word
TERRIBLE = "This is terrible."  # -0.4767
OK = "ok"  # 0.296


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import AutoModelForCausalLM

    from marlhf_edu.loading.assets import SFT_DIR

    return AutoModelForCausalLM.from_pretrained(SFT_DIR, dtype=torch.float32).eval()


class WordTokenizer:
    """One token per whitespace-separated word; a BOS token (id 0) only with special tokens."""

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[0] * add_special_tokens + [1] * len(t.split()) for t in texts]}


# ---- the prompts ---------------------------------------------------------------------------------------------


def test_prompt_file_sizes_and_split_by_topic():
    rows = everyday_rows()
    train, held = everyday_prompts("train"), everyday_prompts("held_out")
    assert len(rows) >= 320 and len(train) >= 200 and len(held) >= 100 and len(train) + len(held) == len(rows)
    topics = {split: {r["topic"] for r in rows if r["split"] == split} for split in ("train", "held_out")}
    assert len(topics["train"] | topics["held_out"]) >= 16
    assert not topics["train"] & topics["held_out"]  # no held-out topic is trained on
    assert train == [r["prompt"] for r in rows if r["split"] == "train"]  # file order
    first = json.loads(EVERYDAY_PROMPTS.read_text().splitlines()[0])
    assert train[0] == first["prompt"]
    with pytest.raises(ValueError, match="split must be one of train, held_out"):
        everyday_prompts("test")


def test_prompts_are_distinct_neutral_and_ask_for_a_short_answer():
    prompts = [r["prompt"] for r in everyday_rows()]
    normalised = [" ".join(re.findall(r"\w+", p.lower())) for p in prompts]
    repeated = {p for p in normalised if normalised.count(p) > 1}
    assert not repeated, repeated
    # nothing that asks for an opinion, a feeling, praise or a complaint
    opinion = re.compile(r"\b(think|opinion|favou?rite|best|worst|feel\w*|enjoy\w*|love|hate|prefer\w*|recommend\w*|"
                         r"should|nice|prais\w*|complain\w*|like|happy|sad|good|bad)\b")
    assert not [p for p in prompts if opinion.search(p.lower())]
    assert all(re.search(r"sentence|briefly", p.lower()) for p in prompts)  # each asks for a short answer
    scores = [vader_compound(p) for p in prompts]
    assert max(abs(s) for s in scores) < 0.6 and abs(sum(scores) / len(scores)) < 0.1


@pytest.mark.parametrize("lines, line, message", [
    (['{"prompt": "a", "topic": "t", "split": "train"}', "{not json"], 2, "not JSON"),
    (['["a", "t", "train"]'], 1, "must be a JSON object"),
    (['{"prompt": "", "topic": "t", "split": "train"}'], 1, "'prompt' must be a non-empty string"),
    (['{"prompt": "a", "split": "train"}'], 1, "'topic' must be a non-empty string"),
    (['{"prompt": "a", "topic": "t", "split": "test"}'], 1, "'split' must be one of train, held_out"),
    (['{"prompt": "a", "topic": "t", "split": "train"}', "", '{"prompt": "b", "topic": "t", "split": "held_out"}'],
     3, "topic 't' is 'held_out' here but 'train'"),
])
def test_a_bad_row_is_refused_naming_file_and_line(tmp_path, lines, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataFileError, match=re.escape(f"{path}, line {line}: ") + ".*" + re.escape(message)):
        everyday_prompts("train", path)


def test_an_empty_prompt_file_is_refused(tmp_path):
    (tmp_path / "p.jsonl").write_text("\n\n")
    with pytest.raises(DataFileError, match="no rows"):
        everyday_rows(tmp_path / "p.jsonl")


# ---- VADER, the judge and the reward -----------------------------------------------------------------------------


def test_vader_known_values_and_no_output(capsys):
    assert vader_compound(GREAT) == pytest.approx(0.9231)  # VADER pays for repetition
    assert vader_compound(PLAIN) == 0.0 and vader_compound("") == 0.0
    assert vader_compound(TERRIBLE) == pytest.approx(-0.4767)
    assert vader_compound(OK) == pytest.approx(0.296)
    vader_compound("Break a leg, it is raining cats and dogs.")  # VADER 3.3.2 has an idiom check that prints
    assert capsys.readouterr() == ("", "")


def test_vader_reads_its_lexicon_offline(monkeypatch):
    import socket

    from marlhf_edu.data import sentiment_judge

    def no_network(*args, **kwargs):
        raise AssertionError("VADER opened a socket")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    sentiment_judge._analyzer.cache_clear()  # a fresh analyzer reads its lexicon files again
    assert vader_compound(GREAT) == pytest.approx(0.9231)


def test_sentiment_judge_has_the_keyword_judges_interface(tok):
    judge = SentimentJudge(tok, limit=3)
    held = everyday_prompts("held_out")[:3]
    assert [p.question for p in judge.eval_prompts] == held
    assert all(p.kind == "everyday" and not p.harmful and p.question in p.prompt for p in judge.eval_prompts)
    assert judge([GREAT, PLAIN, TERRIBLE]) == pytest.approx([0.9231, 0.0, -0.4767])
    p = judge.eval_prompts[0]
    assert [judge.judge(p, r) for r in (GREAT, PLAIN, TERRIBLE)] == ["positive", "neutral", "negative"]
    assert judge.judge(p, "ok") == "positive" and judge.gold_reward(p, TERRIBLE) == pytest.approx(-0.4767)
    assert judge.gold_rewards([q.prompt for q in judge.eval_prompts], [GREAT, PLAIN, OK]) \
        == pytest.approx([0.9231, 0.0, 0.296])
    with pytest.raises(KeyError, match="not one of its prompts"):
        judge.gold_rewards(["What is 2 plus 2?"], [PLAIN])
    answers = iter([GREAT, PLAIN, TERRIBLE, GREAT, GREAT, PLAIN])
    metrics = judge.evaluate(lambda prompts: [next(answers) for _ in prompts], repeats=2)
    assert metrics == pytest.approx({"vader_compound": (3 * 0.9231 - 0.4767) / 6, "positive_rate": 0.5,
                                     "negative_rate": 1 / 6, "n": 6})
    assert len(SentimentJudge(tok, split="train").eval_prompts) == len(everyday_prompts("train"))


def test_sentiment_reward_gives_one_compound_score_per_response():
    reward = sentiment_reward(template=None)
    scores = reward(["p1", "p2", "p3", "p4"], [GREAT, PLAIN, TERRIBLE, OK])
    assert isinstance(scores, list) and all(isinstance(s, float) for s in scores)
    assert scores == pytest.approx([0.9231, 0.0, -0.4767, 0.296])
    with pytest.raises(ValueError):
        reward(["p1"], [GREAT, PLAIN])


def test_sentiment_pairs_respect_the_margin_and_the_prompt():
    samples = [{"prompt": "A", "response": f" {GREAT} "}, {"prompt": "B", "response": PLAIN},
               {"prompt": "A", "response": PLAIN}, {"prompt": "A", "response": TERRIBLE},
               {"prompt": "B", "response": OK}, {"prompt": "B", "response": TERRIBLE},
               {"prompt": "C", "response": GREAT}]  # one answer: nothing to pair
    score = {a: vader_compound(a) for a in (GREAT, PLAIN, TERRIBLE, OK)}
    pairs = sentiment_pairs(samples, margin=0.4767)  # PLAIN vs TERRIBLE sits exactly at the margin: kept
    as_tuples = [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs]
    assert as_tuples == [("A", GREAT, PLAIN), ("A", GREAT, TERRIBLE), ("A", PLAIN, TERRIBLE),
                         ("B", PLAIN, TERRIBLE), ("B", OK, TERRIBLE)]  # B: PLAIN vs OK differ by 0.296 only
    assert all(set(p) == {"prompt", "chosen", "rejected"} for p in pairs)
    assert all(score[c] - score[r] >= 0.4767 for _, c, r in as_tuples)
    # every pair above the margin is there, and none across prompts
    assert len(sentiment_pairs(samples, margin=0.01)) == 3 + 3
    assert sentiment_pairs(samples, margin=1.5) == []
    capped = sentiment_pairs(samples, margin=0.3, per_prompt=1)
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in capped] == [("A", GREAT, TERRIBLE),
                                                                           ("B", OK, TERRIBLE)]  # largest gaps
    for bad in (0, -0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="margin must be"):
            sentiment_pairs(samples, margin=bad)
    with pytest.raises(ValueError, match="sample 1 has no text 'response'"):
        sentiment_pairs([{"prompt": "A", "response": GREAT}, {"prompt": "A"}])


# ---- the guards ----------------------------------------------------------------------------------------------


def test_answer_words():
    assert answer_words("Don't stop, DON\u2019T!") == ["don't", "stop", "don't"]
    assert answer_words("") == [] and answer_words("...!") == [] and answer_words("Hi") == ["hi"]
    assert answer_words("Bake at 200 degrees.") == ["bake", "at", "200", "degrees"]


def test_repeated_trigram_share():
    assert repeats_trigram("The cat sat, and the cat sat.")
    assert repeats_trigram("a a a a")  # overlapping occurrences count
    assert not repeats_trigram("a a a") and not repeats_trigram("the cat sat on the mat")
    assert not repeats_trigram("") and not repeats_trigram("word")
    assert repeated_trigram_share(["the cat sat and the cat sat", "hello", "", "a b c d"]) == 0.25
    assert repeated_trigram_share(["great great great great"]) == 1.0
    with pytest.raises(ValueError, match="no answers"):
        repeated_trigram_share([])


def test_distinct_2():
    assert distinct_n(["a b a b", "a b"]) == 0.5  # bigrams ab ba ab | ab: 2 distinct of 4
    assert distinct_n(["a b", "c d"]) == 1.0  # "b c" spans two answers: not a bigram
    assert distinct_n(["", "a b"]) == 1.0 and distinct_n(["one", "a b c"]) == 1.0
    assert math.isnan(distinct_n(["one"])) and math.isnan(distinct_n(["", "word"])) and math.isnan(distinct_n([]))
    assert distinct_n(["a a a"], n=1) == pytest.approx(1 / 3)


def test_length_in_words_and_tokens(tok):
    assert mean_words(["", "one", "two words here"]) == pytest.approx(4 / 3)
    assert mean_words(["Stir, then serve \u2014 hot!"]) == 4  # a dash is not a word
    assert mean_tokens(["", "one", "two words here"], WordTokenizer()) == pytest.approx(4 / 3)  # no BOS counted
    n = len(tok("Sort the clothes.", add_special_tokens=False)["input_ids"])
    assert mean_tokens(["Sort the clothes.", ""], tok) == pytest.approx(n / 2)
    with pytest.raises(ValueError, match="no answers"):
        mean_words([])


def test_eos_rate():
    assert eos_rate([{"finished": True}, {"finished": False}, {"finished": True}]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="record 1 has no bool 'finished'"):
        eos_rate([{"finished": True}, {"response": "x"}])
    with pytest.raises(ValueError, match="record 0 has no bool 'finished'"):
        eos_rate([{"finished": 1}])
    # under a limit of 5 tokens and slack 2, an answer of 2 tokens ended with EOS, one of 3 may have been cut off
    assert ended_with_eos(["", "a b", "a b c", "a b c d e"], WordTokenizer(), max_new_tokens=5) \
        == [True, True, False, False]
    assert ended_with_eos(["a b c"], WordTokenizer(), max_new_tokens=5, slack=0) == [True]
    with pytest.raises(ValueError, match="max_new_tokens - slack"):
        ended_with_eos(["a"], WordTokenizer(), max_new_tokens=2)


def test_answer_mean_logprobs_are_the_packages_logprobs(tok, tiny_model):
    from marlhf_edu.data.template import template_for

    judge = SentimentJudge(tok, limit=3)
    prompts = [p.prompt for p in judge.eval_prompts]
    answers = ["Sort them by colour and fabric.", "Read the label.", "Wash the white clothes on their own, at 40."]
    got = answer_mean_logprobs(tiny_model, tok, prompts, answers, batch_size=2)  # the second batch unpadded
    for prompt, answer, value in zip(prompts, answers, got):
        p = tok(prompt)["input_ids"]
        a = tok(template_for(tok).completion(answer), add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p + a])
        with torch.no_grad():
            logprobs = logprobs_from_logits(tiny_model(input_ids=ids).logits[:, :-1], ids[:, 1:])[0]
        assert value == pytest.approx(logprobs[-len(a):].mean().item(), abs=1e-4)
    assert answer_mean_logprobs(tiny_model, tok, prompts, answers, batch_size=3) == pytest.approx(got, abs=1e-4)
    assert math.isnan(answer_mean_logprobs(tiny_model, tok, prompts[:1], ["  "])[0])
    with pytest.raises(ValueError, match="2 prompts for 1 answers"):
        answer_mean_logprobs(tiny_model, tok, prompts[:2], answers[:1])


def test_sentiment_report_gives_vader_and_every_guard(tok, tiny_model):
    prompts = [p.prompt for p in SentimentJudge(tok, limit=2).eval_prompts]
    samples = [{"prompt": prompts[0], "response": GREAT + " " + GREAT, "finished": False},
               {"prompt": prompts[0], "response": PLAIN, "finished": True},
               {"prompt": prompts[1], "response": TERRIBLE, "finished": True},
               {"prompt": prompts[1], "response": "", "finished": True}]
    answers = [s["response"] for s in samples]
    scores = [vader_compound(a) for a in answers]
    mean = sum(scores) / 4
    report = sentiment_report(samples)
    assert report == pytest.approx({
        "n": 4, "vader_compound": mean, "vader_compound_std": math.sqrt(sum((s - mean) ** 2 for s in scores) / 4),
        "positive_rate": 0.25, "repeated_trigram_share": 0.25, "distinct_2": 7 / 11, "mean_words": 14 / 4,
        "mean_tokens": None, "eos_rate": 0.75, "mean_logprob": None}, nan_ok=True)
    assert report["vader_compound"] > 0.0 and report["distinct_2"] < 1.0
    full = sentiment_report([{k: v for k, v in s.items() if k != "finished"} for s in samples], tok, tiny_model,
                            max_new_tokens=12)
    lengths = [len(tok(a, add_special_tokens=False)["input_ids"]) for a in answers]
    assert full["mean_tokens"] == pytest.approx(sum(lengths) / 4)
    assert full["eos_rate"] == pytest.approx(sum(n < 10 for n in lengths) / 4)
    logprobs = answer_mean_logprobs(tiny_model, tok, [s["prompt"] for s in samples], answers)[:3]  # "" has none
    assert full["mean_logprob"] == pytest.approx(sum(logprobs) / 3, abs=1e-5)
    with pytest.raises(ValueError, match="sample 0 has none"):
        sentiment_report([{"response": PLAIN}], tok, tiny_model)


def _rows(question_scores: dict[str, tuple[list[float], list[float]]]) -> list[dict]:
    """Evaluation rows as eval_samples.jsonl holds them: (before, after) gold scores per question."""
    return [{"question": q, "when": when, "gold": g} for q, sides in question_scores.items()
            for when, golds in zip(("before", "after"), sides) for g in golds]


def test_gold_change_is_paired_by_question():
    """Every question moved by exactly +0.3 while the questions differ widely: paired, the interval is the shift
    itself (an unpaired interval would be as wide as the questions' spread)."""
    run = _rows({f"q{i}": ([x, x + 0.2], [x + 0.3, x + 0.5]) for i, x in enumerate((-0.9, -0.4, 0.0, 0.5, 0.6))})
    change, low, high = gold_change([run])
    assert change == pytest.approx(0.3) and low == pytest.approx(0.3) and high == pytest.approx(0.3)
    assert list(gold_by_question(run, "after")) == [f"q{i}" for i in range(5)]


def test_gold_change_pools_runs_per_question():
    """Two runs with the same answers before: each question's after-answers from both runs count, so the pooled
    change is the mean after over both runs minus the shared before; the interval is a bootstrap over questions."""
    before = {"a": [0.0, 0.2], "b": [0.5, 0.5], "c": [-0.2, 0.0]}
    one = _rows({q: (b, [x + 0.1 for x in b]) for q, b in before.items()})
    two = _rows({q: (b, [x + 0.5 for x in b]) for q, b in before.items()})
    assert gold_change([one])[0] == pytest.approx(0.1) and gold_change([two])[0] == pytest.approx(0.5)
    change, low, high = gold_change([one, two])
    assert change == pytest.approx(0.3) and low == pytest.approx(0.3) and high == pytest.approx(0.3)
    uneven = _rows({"a": ([0.0], [1.0]), "b": ([0.0], [0.0]), "c": ([0.0], [0.0]), "d": ([0.0], [0.0])})
    change, low, high = gold_change([uneven])
    # a replicate's change is (draws of a) / 4: none in 32 % of replicates, 3 or more in 5 %, all 4 in 0.4 %
    assert change == pytest.approx(0.25) and low == pytest.approx(0.0) and high == pytest.approx(0.75)


def test_gold_change_refuses_runs_over_other_questions():
    one = _rows({"a": ([0.1], [0.2]), "b": ([0.1], [0.3])})
    other = _rows({"a": ([0.1], [0.2]), "c": ([0.1], [0.3])})
    with pytest.raises(ValueError, match="run 1's before answers cover other questions.*'b'"):
        gold_change([one, other])
    with pytest.raises(ValueError, match="run 0's after answers"):
        gold_change([[r for r in one if not (r["question"] == "b" and r["when"] == "after")]])
    with pytest.raises(ValueError, match="sample 0 has no 'gold'"):
        gold_change([[{"question": "a", "when": "before"}]])
    with pytest.raises(ValueError, match="when='during'"):
        gold_change([[{"question": "a", "when": "during", "gold": 0.1}]])
    with pytest.raises(ValueError, match="no runs"):
        gold_change([])


def test_repetition_change_pairs_each_answers_repeat_flag_by_question():
    """Answers that loop after training on two questions of three: the repeated-3-gram share rises by 2/3; the
    VADER scores in "gold" are ignored; with a second run that stopped looping the pooled change is 1/3."""
    loop, plain = "so good so good so good", "a short plain answer"
    rows = lambda after: [{"question": q, "when": w, "gold": 0.9, "response": r}  # noqa: E731
                          for q, a in zip("abc", after) for w, r in (("before", plain), ("after", a))]
    looped = rows([loop, loop, plain])
    change, low, high = repetition_change([looped])
    assert change == pytest.approx(2 / 3) and low == pytest.approx(0.0) and high == pytest.approx(1.0)
    assert repetition_change([looped, rows([plain] * 3)])[0] == pytest.approx(1 / 3)
    assert gold_change([looped])[0] == pytest.approx(0.0)  # the same rows' own gold did not move


def test_commonest_opening_and_its_share():
    samples = [{"response": r} for r in ("I'm thrilled to help.", "I'm thrilled to say", "Sure, here it is",
                                         "I'm  thrilled to\nhelp")]
    assert commonest_opening(samples) == ("I'm thrilled to", 0.75)
    assert answer_openings(samples, words=1) == {"I'm": 3, "Sure,": 1}
    with pytest.raises(ValueError, match="no answers"):
        commonest_opening([])
