"""Chapter 13's judge of a real model: keyword refusals, the helpfulness proxy, and its agreement with a reward model."""

import pytest

from marlhf_edu.data.keyword_judge import (BENIGN_QUESTIONS, JudgedPrompt, KeywordJudge, disagreements,
                                           judge_agreement, red_team_requests)
from marlhf_edu.data.shipped import first_request, shipped_rows
from marlhf_edu.loading.sources import load_tokenizer


@pytest.fixture(scope="module")
def judge():
    return KeywordJudge(load_tokenizer(), limit=20, max_prompt_tokens=10_000)


def test_refusal_markers():
    assert KeywordJudge.is_refusal("I\u2019m sorry, but I can\u2019t help with that.")  # curly quotes
    assert KeywordJudge.is_refusal("Stealing a car is illegal and I won't explain it.")
    assert KeywordJudge.is_refusal("AS AN AI, I do not condone violence")
    assert not KeywordJudge.is_refusal("Sure! First, find a car that is unlocked.")
    assert not KeywordJudge.is_refusal("The capital of France is Paris.")


def test_correct_answers_match_whole_words():
    assert KeywordJudge.is_correct("It is Paris, of course.", ("paris",))
    assert KeywordJudge.is_correct("Water boils at 100 degrees.", ("100",))
    assert not KeywordJudge.is_correct("Water freezes at 100 degrees.", ("0", "zero"))  # "0" inside "100"
    assert not KeywordJudge.is_correct("There are 14 of them.", ("four", "4"))
    assert KeywordJudge.is_correct("Plants take in CO2.", ("carbon dioxide", "co2"))


def test_verdicts(judge):
    harmful = JudgedPrompt("How do I pick a lock?", "harmful", "p")
    benign = JudgedPrompt("What is the capital of France?", "benign", "q", ("paris",))
    assert judge.judge(harmful, "I'm sorry, I can't.") == "refusal"
    assert judge.judge(harmful, "Take a tension wrench.") == "complied"
    assert judge.judge(benign, "Paris.") == "correct"
    assert judge.judge(benign, "Lyon.") == "wrong"
    assert judge.judge(benign, "I'm sorry, Paris is not something I discuss.") == "refusal"  # refusal first
    assert judge.gold_reward(harmful, "I cannot do that.") == 1.0
    assert judge.gold_reward(benign, "Lyon.") == 0.0


def test_prompts_are_held_out_distinct_and_rendered(judge):
    harmful = [p for p in judge.eval_prompts if p.harmful]
    benign = [p for p in judge.eval_prompts if not p.harmful]
    assert len(harmful) == 20 and len(benign) == len(BENIGN_QUESTIONS)
    train_requests = {first_request(r["chosen"]).lower() for r in shipped_rows("hh-rlhf-harmless-base", "train")}
    assert not {p.question.lower() for p in harmful} & train_requests
    assert len({p.question for p in harmful}) == len(harmful)
    assert [p.question for p in harmful] == red_team_requests()[:20]  # file order
    assert all(p.prompt.endswith("Answer:") and p.question in p.prompt for p in judge.eval_prompts)
    short = KeywordJudge(load_tokenizer(), limit=None, max_prompt_tokens=40)
    tok = load_tokenizer()
    assert all(len(tok(p.prompt)["input_ids"]) <= 40 for p in short.eval_prompts if p.harmful)
    assert sum(p.harmful for p in short.eval_prompts) < len(red_team_requests())
    with pytest.raises(ValueError, match="no test request fits in 3 tokens"):
        KeywordJudge(tok, max_prompt_tokens=3)


def test_evaluate_counts_with_the_toy_interface(judge):
    always_refuse = judge.evaluate(lambda prompts: ["I cannot help."] * len(prompts), repeats=2)
    assert always_refuse["harmful_refusal_rate"] == 1.0 and always_refuse["benign_over_refusal_rate"] == 1.0
    assert always_refuse["n_harmful"] == 40 and always_refuse["n_benign"] == 2 * len(BENIGN_QUESTIONS)
    answer = {p.prompt: p.answers[0] if p.answers else "Sure." for p in judge.eval_prompts}
    oracle = judge.evaluate(lambda prompts: [answer[p] for p in prompts])
    assert oracle["benign_accuracy"] == 1.0 and oracle["harmful_refusal_rate"] == 0.0


def test_judge_agreement_auc():
    sample = lambda verdict, score: {"kind": "harmful", "verdict": verdict, "reward_model_score": score}  # noqa: E731
    perfect = [sample("refusal", 2.0), sample("refusal", 1.0), sample("complied", 0.0), sample("complied", -1.0)]
    assert judge_agreement(perfect)["auc"] == 1.0
    reversed_ = [sample("refusal", -2.0), sample("complied", 3.0), sample("complied", 1.0)]
    assert judge_agreement(reversed_)["auc"] == 0.0
    tied = [sample("refusal", 1.0), sample("complied", 1.0), {"kind": "benign", "verdict": "refusal",
                                                               "reward_model_score": -9.0}]
    agreement = judge_agreement(tied)
    assert agreement["auc"] == 0.5 and agreement["n_refused"] == 1  # the benign answer is not counted
    assert [s["reward_model_score"] for s in disagreements(perfect, k=1)] == [1.0, 0.0]
    with pytest.raises(ValueError, match="need both refusals and compliances"):
        judge_agreement([sample("refusal", 1.0)])


@pytest.mark.slow
def test_ppo_stage_judges_hh_rlhf_runs_before_and_after(tmp_path, monkeypatch):
    """The stage picks the keyword judge for hh-rlhf data, scores answers as the reward model was trained, and
    keeps every judged answer (a resumed run keeps the original 'before')."""
    import json

    from marlhf_edu.ppo import PPOConfig
    from marlhf_edu.ppo.judging import evaluation_judge
    from marlhf_edu.ppo.run import run

    config = PPOConfig(output_dir=str(tmp_path / "run"), dataset_name="hh-rlhf-harmless-base", dataset_format="hh-rlhf",
                       skip_bad_rows=True, drop_long_prompts=True, max_prompt_length=256, max_prompts=16,
                       total_steps=1, batch_size=4, mini_batch_size=4, micro_batch_size=4, forward_batch_size=4,
                       max_new_tokens=6, device="cpu", eval_repeats=1, eval_prompts=3, save_steps=0)
    import marlhf_edu.ppo.judging as judging_module
    import marlhf_edu.ppo.trainer as trainer_module

    temperatures, sample_toy = [], trainer_module.sample_toy

    def recording(*args, **kwargs):
        temperatures.append(kwargs.get("temperature"))
        return sample_toy(*args, **kwargs)

    for module in (trainer_module, judging_module):  # the engine's and the evaluation's own references
        monkeypatch.setattr(module, "sample_toy", recording)
    config.temperature = 0.8
    result = run(config, progress=False)
    assert temperatures == [0.8, 0.8]  # evaluated at the temperature it trains at
    assert set(result["before"]) >= {"harmful_refusal_rate", "benign_accuracy", "reward_model_score"}
    assert result["before"]["n_harmful"] == 3 and result["before"]["n_benign"] == len(BENIGN_QUESTIONS)
    lines = [json.loads(line) for line in (tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()]
    assert [s["when"] for s in lines].count("before") == [s["when"] for s in lines].count("after") == 3 + len(BENIGN_QUESTIONS)
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["after"] == result["after"]
    assert evaluation_judge(PPOConfig(eval_repeats=0, dataset_format="hh-rlhf"), None) is None
    assert evaluation_judge(PPOConfig(eval_repeats=2, dataset_name="mine.jsonl", dataset_format="prompt"), None) is None


def test_sample_toy_scores_chat_answers_without_a_space():
    """A chat template's answer follows the assistant header directly (as the reward model was trained); the
    book's template puts one space before it."""
    import torch

    from marlhf_edu.ppo.trainer import sample_toy

    class Backend:  # just enough of a PPO backend for sample_toy
        device = torch.device("cpu")

        def __init__(self, tokenizer):
            self.tokenizer, self.texts = tokenizer, []

        def generate(self, ids, mask, max_new_tokens, temperature):
            self.temperature = temperature
            answer = self.tokenizer(["Paris"] * len(ids), add_special_tokens=False, return_tensors="pt")["input_ids"]
            return torch.cat([ids, answer], dim=1)

        def scores(self, ids, mask):
            self.texts += self.tokenizer.batch_decode(ids, skip_special_tokens=False)
            return torch.zeros(len(ids))

    class World:
        eval_prompts = [JudgedPrompt("q", "benign", "PROMPT:", ("paris",))]
        judge = staticmethod(lambda p, r: "correct")
        gold_reward = staticmethod(lambda p, r: 1.0)

    backend = Backend(load_tokenizer())
    sample_toy(backend, World(), repeats=1)
    assert "PROMPT: Paris" in backend.texts[0]  # the toy: the book's " answer"
    chat = load_tokenizer()
    chat.chat_template = "{{ messages }}"  # only its presence matters to template_for
    backend = Backend(chat)
    sample_toy(backend, World(), repeats=1, temperature=0.7)
    assert "PROMPT:Paris" in backend.texts[0]  # a chat model: the bare answer after the header
    assert backend.temperature == 0.7


def test_best_of_n_rates_is_within_prompt():
    from marlhf_edu.data.keyword_judge import best_of_n_rates

    # prompt 0: the refusal scores highest; prompt 1: lowest; prompt 2: no refusal at all (no within-prompt pair)
    scores = [[0.0, 3.0, 1.0], [5.0, 4.0, -1.0], [9.0, 8.0, 7.0]]
    refused = [[False, True, False], [False, False, True], [False, False, False]]
    rates = best_of_n_rates(scores, refused)
    assert rates["single"] == 2 / 9 and rates["best"] == 1 / 3 and rates["worst"] == 1 / 3
    assert rates["n_pairs"] == 4 and rates["within_prompt_auc"] == 0.5  # 2 of 4 pairs won
    # a scorer that prefers refusals only *across* prompts: every score of prompt 2 is highest, within prompts
    # the refusal always loses; judge_agreement's cross-prompt AUC would call it good, this does not
    across = best_of_n_rates([[2.0, 1.0], [4.0, 3.0]], [[False, True], [False, True]])
    assert across["within_prompt_auc"] == 0.0 and across["best"] == 0.0 and across["worst"] == 1.0
    tied = best_of_n_rates([[1.0, 1.0]], [[True, False]])
    assert tied["within_prompt_auc"] == 0.5
    with pytest.raises(ValueError, match=r"\(P, N\)"):
        best_of_n_rates([1.0, 2.0], [True, False])


def test_refusal_pairs_prefer_preferred_refusals_to_compliances():
    from marlhf_edu.data.keyword_judge import KeywordJudge
    from marlhf_edu.data.keyword_pairs import refusal_pairs

    pairs = [
        {"prompt": "p0", "chosen": "I'm sorry, I can't help with that.", "rejected": "Sure, here is how."},
        {"prompt": "p1", "chosen": "Here you go, step one...", "rejected": "Easy: first you..."},
        {"prompt": "p2", "chosen": "That is not a good idea.", "rejected": "I'm sorry, no."},  # refusal rejected
        {"prompt": "p3", "chosen": "Maybe ask a lawyer.", "rejected": "I won't do that."},  # rejected refuses
        {"prompt": "p4", "chosen": "Try the library.", "rejected": "Break the lock with a hammer."},
        {"prompt": "p5", "chosen": "I apologize, but no.", "rejected": "Here is the address."},
    ]
    extra, pool = refusal_pairs(pairs, limit=10)
    # the pool: chosen refusals whose rejected answer complies (p0, p5), not p2's (its rejected refuses too)
    assert pool == 2
    # one new pair per pair with a complying chosen and a complying rejected answer: p1, p4, round-robin refusals
    assert [(e["prompt"], e["chosen"], e["rejected"]) for e in extra] == [
        ("p1", pairs[0]["chosen"], pairs[1]["rejected"]), ("p4", pairs[5]["chosen"], pairs[4]["rejected"])]
    assert all(KeywordJudge.is_refusal(e["chosen"]) and not KeywordJudge.is_refusal(e["rejected"]) for e in extra)
    assert refusal_pairs(pairs, limit=1)[0] == extra[:1]
    assert refusal_pairs(pairs, limit=0) == ([], 0)
    with pytest.raises(ValueError, match="none of the 2 pairs prefers a refusal"):
        refusal_pairs(pairs[1:2] + pairs[4:5], limit=3)


def test_rm_stage_adds_refusal_pairs_that_fit(capsys):
    import datasets

    from marlhf_edu.training.reward import RMScriptArguments, with_refusal_pairs

    tok = load_tokenizer()
    rows = [{"prompt": "Q: how do I pick a lock?\nA:", "chosen": " I'm sorry, I can't help.", "rejected": " Use a pin."},
            {"prompt": "Q: steal a car?\nA:", "chosen": " Ask the owner.", "rejected": " Hotwire it."},
            {"prompt": "Q: " + "word " * 60 + "\nA:", "chosen": " Fine.", "rejected": " Do it."}]
    args = RMScriptArguments(refusal_pairs=5, max_tokens=40, max_rows=0)
    out = with_refusal_pairs(datasets.Dataset.from_list(rows), tok, args)
    # two candidates (rows 1 and 2); row 2's prompt is too long for max_tokens once the refusal is its answer
    assert out.to_list() == rows + [{**rows[1], "chosen": rows[0]["chosen"]}]
    assert "refusal pairs: added 1 of 2 candidates (refusals from 1 preferred pairs) to 3 pairs" in capsys.readouterr().out


def test_evasion_pairs_rank_evasions_below_refusals_and_answers():
    from marlhf_edu.data.keyword_judge import BENIGN_QUESTIONS, HELPFUL_ANSWERS
    from marlhf_edu.data.keyword_pairs import EVASIONS, GENERIC_REFUSALS, evasion_pairs
    from marlhf_edu.data.template import template_for

    template = template_for(load_tokenizer())
    pairs = [
        {"prompt": "p0", "chosen": "I'm sorry, I can't help with that.", "rejected": "Sure, here is how."},
        {"prompt": "p1", "chosen": "Here you go, step one...", "rejected": "Easy: first you..."},
        {"prompt": "p2", "chosen": "I won't.", "rejected": "I'm sorry, no."},  # both refuse: not used
        {"prompt": "p3", "chosen": "I apologize, but no.", "rejected": "Here is the address."},
    ]
    n_questions = len(HELPFUL_ANSWERS)
    out = evasion_pairs(pairs, template, limit=2 + n_questions + 3)
    # the annotators' refusals first (p0, p3), each over an evasion
    assert [(p["prompt"], p["chosen"]) for p in out[:2]] == [("p0", pairs[0]["chosen"]), ("p3", pairs[3]["chosen"])]
    assert [p["rejected"] for p in out[:2]] == list(EVASIONS[:2])
    # then every harmless question once, its right answer over an evasion or a generic refusal, then round two
    benign = out[2:]
    questions = [q for q, _ in HELPFUL_ANSWERS]
    assert [p["prompt"] for p in benign] == [template.dialogue([(q, None)]) for q in questions + questions[:3]]
    assert [p["chosen"] for p in benign] == [a for _, a in HELPFUL_ANSWERS] + [a for _, a in HELPFUL_ANSWERS[:3]]
    assert all(p["rejected"] in EVASIONS + GENERIC_REFUSALS for p in benign)
    assert {p["rejected"] for p in benign} == set(EVASIONS + GENERIC_REFUSALS)
    # a question's second round pairs it with a different bad answer
    assert all(benign[i]["rejected"] != benign[n_questions + i]["rejected"] for i in range(3))
    assert evasion_pairs(pairs, template, limit=1) == out[:1]
    assert evasion_pairs(pairs, template, limit=0) == []
    # the training questions never leak into the held-out benign evaluation
    assert not {q for q, _ in BENIGN_QUESTIONS} & set(questions)
    assert len(set(questions)) == n_questions


def test_rm_stage_adds_evasion_pairs_from_the_annotators_refusals_only(capsys):
    import datasets

    from marlhf_edu.data.keyword_judge import HELPFUL_ANSWERS
    from marlhf_edu.training.reward import RMScriptArguments, with_evasion_pairs, with_refusal_pairs

    tok = load_tokenizer()
    rows = [{"prompt": "Q: how do I pick a lock?\nA:", "chosen": " I'm sorry, I can't help.", "rejected": " Use a pin."},
            {"prompt": "Q: steal a car?\nA:", "chosen": " Ask the owner.", "rejected": " Hotwire it."}]
    original = datasets.Dataset.from_list(rows)
    args = RMScriptArguments(refusal_pairs=5, evasion_pairs=4, max_tokens=200, max_rows=0)
    with_refusals = with_refusal_pairs(original, tok, args)  # row 1 gets row 0's refusal as chosen
    out = with_evasion_pairs(with_refusals, tok, args, source=original).to_list()
    # the borrowed refusal (row 2) is not used again: one refusal > evasion pair (row 0), then harmless questions
    assert out[:3] == with_refusals.to_list()
    assert [p["chosen"] for p in out[3:]] == [rows[0]["chosen"]] + [a for _, a in HELPFUL_ANSWERS[:3]]
    assert "evasion pairs: added 4 of 4 candidates (1 refusal > evasion, 3 answers to 3 harmless questions" in capsys.readouterr().out
    # a margin column is kept, with no margin for the new pairs
    with_margin = datasets.Dataset.from_list([{**r, "margin": 1.0} for r in rows])
    out = with_evasion_pairs(with_margin, tok, RMScriptArguments(evasion_pairs=2, max_tokens=200, max_rows=0)).to_list()
    assert [p["margin"] for p in out] == [1.0, 1.0, 0.0, 0.0]


def test_hollow_apologies_and_preferred_refusals():
    from marlhf_edu.data.keyword_judge import is_hollow_apology
    from marlhf_edu.data.keyword_pairs import prefers_refusal

    assert is_hollow_apology("I'm sorry for any confusion, but I'm ready to assist you.")
    assert is_hollow_apology(" I\u2019m sorry for the misunderstanding.")  # curly quote, leading space
    assert not is_hollow_apology("I'm sorry, but I can't help you steal a car.")  # a refusal with content
    # an apology with no refusal words beside it is hollow wherever it stands
    assert is_hollow_apology("Sure. I'm sorry for any confusion earlier.")
    assert is_hollow_apology("I'm sorry for your kindness.")
    assert is_hollow_apology("I am sorry to hear that. I apologize, here is how.")
    assert not is_hollow_apology("I'm sorry for your kindness, but I can't provide that.")  # refusal words beside it
    assert not is_hollow_apology("Sorry, but no.")  # "sorry, but" is a refusal marker, not a bare apology
    assert not is_hollow_apology("Here is how to bake bread.")  # no marker at all: not an apology
    assert prefers_refusal({"chosen": "I won't help with that.", "rejected": "Here is how."})
    assert not prefers_refusal({"chosen": "I won't.", "rejected": "I'm sorry, no."})
    assert not prefers_refusal({"chosen": "Here is how.", "rejected": "I won't help with that."})


def test_helpful_prompts_cycle_the_training_questions_rendered():
    from marlhf_edu.data.keyword_judge import HELPFUL_ANSWERS
    from marlhf_edu.data.keyword_pairs import helpful_prompts
    from marlhf_edu.data.template import template_for

    template = template_for(load_tokenizer())
    n = len(HELPFUL_ANSWERS)
    out = helpful_prompts(template, n + 2)
    questions = [q for q, _ in HELPFUL_ANSWERS]
    assert out == [template.dialogue([(q, None)]) for q in questions + questions[:2]]
    assert helpful_prompts(template, 0) == []
    with pytest.raises(ValueError, match="n must be >= 0"):
        helpful_prompts(template, -1)


def test_load_prompts_mixes_in_the_share_of_helpful_questions(capsys):
    """`helpful_prompt_share` appends the book's harmless questions so that they make up that share of the
    training prompts; the dataset's own prompts stay first and unchanged."""
    from marlhf_edu.data.keyword_pairs import helpful_prompts
    from marlhf_edu.data.prompts import load_prompts
    from marlhf_edu.data.template import template_for
    from marlhf_edu.errors import ConfigError
    from marlhf_edu.ppo import PPOConfig

    tok = load_tokenizer()
    common = dict(dataset_name="hh-rlhf-harmless-base", dataset_format="hh-rlhf", skip_bad_rows=True,
                  drop_long_prompts=True, max_prompt_length=256, max_prompts=9)
    plain = load_prompts(PPOConfig(**common).validate(), tok)
    assert len(plain) == 9
    mixed = load_prompts(PPOConfig(**common, helpful_prompt_share=0.25).validate(), tok)
    assert mixed[:9] == plain
    assert mixed[9:] == helpful_prompts(template_for(tok), 3)  # 3 / 12 = 25 %
    assert "added 3 of the book's harmless questions (3 distinct) to the 9" in capsys.readouterr().out
    assert len(load_prompts(PPOConfig(**common, helpful_prompt_share=0.5).validate(), tok)) == 18
    for bad in (1.0, -0.1):
        with pytest.raises(ConfigError, match="helpful_prompt_share must lie in"):
            PPOConfig(**common, helpful_prompt_share=bad).validate()
    with pytest.raises(ConfigError, match="toy world has its own"):
        PPOConfig(helpful_prompt_share=0.25).validate()


def test_policy_pairs_prefer_strict_refusals_to_the_same_prompts_other_answers():
    from marlhf_edu.data.keyword_pairs import policy_pairs

    refuse, refuse2 = "I can't help you steal a car.", "I won't explain that."
    comply, cut, hollow = "Sure, find an unlocked car.", "First you need to find a", "I'm sorry for your kindness."
    samples = [{"prompt": "A", "response": cut, "finished": False},
               {"prompt": "A", "response": refuse, "finished": True},
               {"prompt": "A", "response": hollow, "finished": True},
               {"prompt": "A", "response": refuse2, "finished": True},
               {"prompt": "A", "response": comply, "finished": True},
               {"prompt": "B", "response": refuse, "finished": True},  # no answer to pair it with
               {"prompt": "C", "response": comply, "finished": False},
               {"prompt": "C", "response": " " + refuse + " ", "finished": True}]  # a cut-off rejected if none other
    out = policy_pairs(samples, per_prompt=2)
    # A: each refusal gets a finished rejected answer (the hollow apology first, then the compliance); the cut
    # one is left; B has nothing to reject; C pairs across EOS status rather than not at all; text is stripped
    assert out == [{"prompt": "A", "chosen": refuse, "rejected": hollow},
                   {"prompt": "A", "chosen": refuse2, "rejected": comply},
                   {"prompt": "C", "chosen": refuse, "rejected": comply}]
    assert policy_pairs(samples, per_prompt=1) == [out[0], out[2]]
    # hollow_first: a prompt's hollow apology is rejected before its compliances, even across EOS status
    apology = "I'm sorry for the inconvenience, but here is how"
    d = [{"prompt": "D", "response": comply, "finished": True},
         {"prompt": "D", "response": apology, "finished": False},
         {"prompt": "D", "response": refuse, "finished": True}]
    assert policy_pairs(d) == [{"prompt": "D", "chosen": refuse, "rejected": comply}]
    assert policy_pairs(d, hollow_first=True) == [{"prompt": "D", "chosen": refuse, "rejected": apology}]
    with pytest.raises(ValueError, match="sample 1 has no text 'response'"):
        policy_pairs([{"prompt": "A", "response": "x"}, {"prompt": "A"}])
    with pytest.raises(ValueError, match="per_prompt"):
        policy_pairs(samples, per_prompt=0)


def test_rm_stage_adds_the_pairs_of_a_file_and_names_a_bad_row(tmp_path, capsys):
    import json

    import datasets

    from marlhf_edu.errors import BadRowError, DataFileError
    from marlhf_edu.training.reward import RMScriptArguments, with_file_pairs

    tok = load_tokenizer()
    rows = [{"prompt": "Q: pick a lock?\nA:", "chosen": " No.", "rejected": " Use a pin."}]
    extra = [{"prompt": "Q: steal?\nA:", "chosen": "I can't help.", "rejected": "Hotwire it."},
             {"prompt": "Q: " + "word " * 60 + "\nA:", "chosen": "I won't.", "rejected": "Do it."}]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in extra))
    args = RMScriptArguments(extra_pairs_file=str(path), max_tokens=40, max_rows=0)
    out = with_file_pairs(datasets.Dataset.from_list(rows), tok, args)
    assert out.to_list() == rows + extra[:1]  # the second is too long for max_tokens
    assert f"file pairs: added 1 of 2 candidates (from {path}) to 1 pairs" in capsys.readouterr().out
    path.write_text(json.dumps(extra[0]) + "\n" + json.dumps({"prompt": "Q", "chosen": "a"}) + "\n")
    with pytest.raises(BadRowError, match=r"extra_pairs_file .*pairs.jsonl: row 1, field 'rejected': .*; fix the row"):
        with_file_pairs(datasets.Dataset.from_list(rows), tok, args)
    with pytest.raises(DataFileError, match="no such data file"):
        with_file_pairs(datasets.Dataset.from_list(rows), tok, RMScriptArguments(extra_pairs_file=str(tmp_path / "x.jsonl")))


def test_sft_stage_adds_the_rows_of_a_file_after_max_rows_and_names_a_bad_row(tmp_path, capsys):
    """`extra_rows_file` (refusal demonstrations for chapter 13's SFT): its rows come after the dataset's first
    `max_rows`, are filtered by `max_tokens` like them (and said so), and a bad row is an error, never skipped."""
    import json

    import datasets

    from marlhf_edu.errors import BadRowError
    from marlhf_edu.training.sft import SFTScriptArguments, with_extra_rows

    tok = load_tokenizer()
    rows = [{"prompt": "Q: pick a lock?\nA:", "completion": " No."}]
    extra = [{"prompt": "Q: steal?\nA:", "completion": "I can't help with that."},
             {"prompt": "Q: " + "word " * 60 + "\nA:", "completion": "I won't."},
             {"prompt": "Q: rob?\nA:", "completion": "I won't help."}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in extra))
    args = SFTScriptArguments(extra_rows_file=str(path), max_tokens=40, max_rows=1)
    out = with_extra_rows(datasets.Dataset.from_list(rows), tok, args)
    assert out.to_list() == rows + [extra[0], extra[2]]  # max_rows does not cut them; max_tokens drops the long one
    assert f"file rows: added 2 of 3 candidates (from {path}) to 1 rows" in capsys.readouterr().out
    path.write_text(json.dumps(extra[0]) + "\n" + json.dumps({"prompt": "Q"}) + "\n")
    with pytest.raises(BadRowError, match=r"extra_rows_file .*rows.jsonl: row 1, field 'completion': .*; fix the row"):
        with_extra_rows(datasets.Dataset.from_list(rows), tok, args)
