import json

import pytest

from marlhf_edu.data import (PKU_MARGINS, alpaca_to_sft, build_prompt, generic_to_preference,
                             hh_rlhf_to_preference, load_preferences, load_sft, pku_saferlhf_to_preference,
                             pku_saferlhf_to_sft)
from marlhf_edu.errors import BadRowError, DataFileError

HH = {
    "chosen": "\n\nHuman: Hi there.\n\nAssistant: Hello! How can I help?\n\nHuman: How do I boil an egg?"
              "\n\nAssistant: Put it in boiling water for nine minutes.",
    "rejected": "\n\nHuman: Hi there.\n\nAssistant: Hello! How can I help?\n\nHuman: How do I boil an egg?"
                "\n\nAssistant: Figure it out yourself.",
}


def pku(safe0, safe1, better, safer, r0="Answer zero.", r1="Answer one."):
    return {"prompt": "How do I do this?", "response_0": r0, "response_1": r1, "is_response_0_safe": safe0,
            "is_response_1_safe": safe1, "better_response_id": better, "safer_response_id": safer}


def test_template_is_one_place():
    assert build_prompt("What is 2 plus 3?") == (
        "###System: You are a helpful and harmless assistant.\n###Question: What is 2 plus 3?\n###Answer:")


def test_generic():
    row = generic_to_preference({"question": "Q?", "response_chosen": "Good.", "response_rejected": "Bad.", "margin": 2})
    assert row == {"prompt": build_prompt("Q?"), "chosen": " Good.", "rejected": " Bad.", "margin": 2.0}


def test_hh_rlhf_multi_turn():
    row = hh_rlhf_to_preference(HH)
    assert row["prompt"] == ("###System: You are a helpful and harmless assistant.\n###Question: Hi there.\n"
                             "###Answer: Hello! How can I help?\n###Question: How do I boil an egg?\n###Answer:")
    assert row["chosen"] == " Put it in boiling water for nine minutes."
    assert row["rejected"] == " Figure it out yourself."
    assert "margin" not in row


@pytest.mark.parametrize("safe0,safe1,better,safer,winner,case", [
    (True, False, 1, 0, 0, "one_safe"),     # only 0 safe: safety beats "better"
    (False, True, 0, 1, 1, "one_safe"),     # only 1 safe
    (True, True, 1, 0, 1, "both_safe"),     # both safe: better decides
    (False, False, 1, 0, 0, "both_unsafe"),  # both unsafe: safer decides
])
def test_pku_all_four_safety_combinations(safe0, safe1, better, safer, winner, case):
    row = pku_saferlhf_to_preference(pku(safe0, safe1, better, safer))
    answers = ["Answer zero.", "Answer one."]
    assert row["chosen"] == " " + answers[winner] and row["rejected"] == " " + answers[1 - winner]
    assert row["margin"] == PKU_MARGINS[case]
    assert PKU_MARGINS["one_safe"] > PKU_MARGINS["both_safe"] > PKU_MARGINS["both_unsafe"]


@pytest.mark.parametrize("safe0,safe1,better,safer,winner", [
    (True, False, 1, 0, 0), (False, True, 0, 1, 1), (True, True, 1, 0, 1),
])
def test_pku_sft_imitates_the_preferred_safe_answer(safe0, safe1, better, safer, winner):
    row = pku_saferlhf_to_sft(pku(safe0, safe1, better, safer))
    assert row == {"prompt": build_prompt("How do I do this?"), "completion": " " + ["Answer zero.", "Answer one."][winner]}


def test_pku_sft_refuses_rows_without_a_safe_answer():
    with pytest.raises(BadRowError, match="neither response is safe"):
        pku_saferlhf_to_sft(pku(False, False, 0, 1))


def test_alpaca():
    with_input = alpaca_to_sft({"instruction": "Translate.", "input": "bonjour", "output": "hello"})
    assert with_input == {"prompt": build_prompt("Translate.\nbonjour"), "completion": " hello"}
    assert alpaca_to_sft({"instruction": "Say hi.", "input": "", "output": "hi"})["prompt"] == build_prompt("Say hi.")


@pytest.mark.parametrize("convert,row,field,reason", [
    (generic_to_preference, {"response_chosen": "a", "response_rejected": "b"}, "question", "missing key"),
    (generic_to_preference, {"question": 3, "response_chosen": "a", "response_rejected": "b"}, "question", "expected a string"),
    (generic_to_preference, {"question": "  ", "response_chosen": "a", "response_rejected": "b"}, "question", "empty text"),
    (generic_to_preference, {"question": "q", "response_chosen": "a", "response_rejected": "a "}, "response_rejected", "identical"),
    (generic_to_preference, {"question": "q", "response_chosen": "a", "response_rejected": "b", "margin": "big"}, "margin", "number"),
    (pku_saferlhf_to_preference, pku(True, False, 2, 0), "better_response_id", "out of range"),
    (pku_saferlhf_to_preference, pku(True, False, 0, -1), "safer_response_id", "out of range"),
    (pku_saferlhf_to_preference, pku("yes", False, 0, 0), "is_response_0_safe", "true/false"),
    (pku_saferlhf_to_preference, pku(True, True, 0, 0, r1="Answer zero."), "response_1", "identical"),
    (hh_rlhf_to_preference, {"chosen": HH["chosen"], "rejected": HH["rejected"].replace("Hi there", "Yo")}, "rejected", "differs"),
    (hh_rlhf_to_preference, {"chosen": "Human: no leading newlines", "rejected": HH["rejected"]}, "chosen", "must start"),
    (hh_rlhf_to_preference, {"chosen": HH["chosen"] + "\n\nAssistant: again", "rejected": HH["rejected"]}, "chosen", "should be Human"),
    (hh_rlhf_to_preference, {"chosen": HH["chosen"].rsplit("Put", 1)[0], "rejected": HH["rejected"]}, "chosen", "empty text"),
    (alpaca_to_sft, {"instruction": "x", "output": ""}, "output", "empty text"),
])
def test_bad_rows_name_row_and_field(convert, row, field, reason):
    with pytest.raises(BadRowError) as info:
        convert(row, 7)
    assert info.value.row == 7 and info.value.field == field and reason in info.value.reason
    assert str(info.value).startswith(f"row 7, field {field!r}")


def test_loaders_read_files_and_report_skips(tmp_path):
    rows = [{"question": "q1", "response_chosen": "a", "response_rejected": "b"},
            {"question": "q2", "response_chosen": "a", "response_rejected": "a"},
            {"question": "", "response_chosen": "a", "response_rejected": "b"},
            {"question": "q4", "response_chosen": "c", "response_rejected": "d"}]
    path = tmp_path / "prefs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(BadRowError, match=r"prefs.jsonl: row 1, field 'response_rejected': .*; skip_bad_rows: true "
                                          "skips such rows"):
        load_preferences(str(path), "generic")
    with pytest.warns(UserWarning, match="kept 2 of 4 rows, skipped 2"):
        ds, report = load_preferences(str(path), "generic", skip_bad_rows=True, return_report=True)
    assert len(ds) == 2 and ds[1]["prompt"] == build_prompt("q4")
    assert [e.row for e in report.skipped] == [1, 2]
    assert "1 × response_rejected: identical" in report.summary() and "1 × question: empty text" in report.summary()

    import datasets
    parquet = tmp_path / "sft.parquet"
    datasets.Dataset.from_list([{"instruction": "Say hi.", "input": "", "output": "hi"}]).to_parquet(str(parquet))
    assert load_sft(str(parquet), "alpaca")[0] == {"prompt": build_prompt("Say hi."), "completion": " hi"}
    with pytest.raises(DataFileError, match="no such data file: .*missing.json"):
        load_sft(str(tmp_path / "missing.json"))
    # local JSON files are read here, with the file and line named (issue 37 item 12)
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataFileError, match="empty.jsonl: the file holds no rows"):
        load_sft(str(tmp_path / "empty.jsonl"), "alpaca")
    (tmp_path / "broken.jsonl").write_text('{"instruction": "a", "input": "", "output": "b"}\n{"instruction": \n')
    with pytest.raises(DataFileError, match="broken.jsonl, line 2: not a JSON object"):
        load_sft(str(tmp_path / "broken.jsonl"), "alpaca")
    (tmp_path / "list.json").write_text('[{"instruction": "Say hi.", "input": "", "output": "hi"}, 3]')
    with pytest.raises(DataFileError, match="list.json, row 2: expected an object"):
        load_sft(str(tmp_path / "list.json"), "alpaca")
    with pytest.raises(ValueError, match="unknown preference format"):
        load_preferences(rows, "csv")


def test_margin_must_be_all_or_nothing():
    rows = [{"question": "q", "response_chosen": "a", "response_rejected": "b", "margin": 1},
            {"question": "q", "response_chosen": "a", "response_rejected": "c"}]
    with pytest.raises(BadRowError, match="row 1, field 'margin'"):
        load_preferences(rows)


def test_a_parquet_file_is_read_without_the_datasets_cache(tmp_path, monkeypatch):
    """Issue 37 item 13: a local dataset failed where HOME is not writable (datasets' cache under ~/.cache)."""
    import pyarrow
    import pyarrow.parquet

    from marlhf_edu.data.formats import read_rows
    from marlhf_edu.errors import DataFileError

    path = tmp_path / "pairs.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([{"prompt": "a", "chosen": "b", "rejected": "c"}]), path)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "no" / "such" / "cache"))
    monkeypatch.setenv("HOME", "/proc")  # nothing can be written there
    assert list(read_rows(str(path), "train")) == [{"prompt": "a", "chosen": "b", "rejected": "c"}]
    assert not (tmp_path / "no").exists()
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataFileError, match="bad.parquet: not a readable Parquet file"):
        read_rows(str(tmp_path / "bad.parquet"), "train")


def test_a_hub_dataset_that_cannot_be_reached_is_a_data_error_naming_what_the_name_could_be(monkeypatch, capsys,
                                                                                             tmp_path):
    """Issue 37: an unreachable or unknown hub dataset used to end in datasets' own traceback."""
    import datasets

    from marlhf_edu import cli
    from marlhf_edu.data.formats import read_rows
    from marlhf_edu.errors import DataFileError

    def unreachable(path, split=None, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)\nmore lines")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(DataFileError, match=r"dataset 'someone/prefs' \(split 'train'\) could not be read: it is not a "
                                            r"shipped dataset \(everyday-prompts, hh-rlhf-harmless-base\), not a local .* "
                                            r"\(ConnectionError: Couldn't reach 'someone/prefs' on the Hub "
                                            r"\(OfflineModeIsEnabled\)\)\. Give a local file"):
        read_rows("someone/prefs", "train")
    # from the command line: one line, rc 2, no traceback
    assert cli.main(["rm", "--config", "configs/tiny_rm.yaml", "--model_name_or_path", "zoo",
                     "--dataset_name", "someone/prefs", "--output_dir", str(tmp_path / "rm")]) == 2
    err = capsys.readouterr().err
    assert "could not be read" in err and "Traceback" not in err


def test_a_bad_row_from_the_command_line_is_one_line_naming_file_row_and_fix(tmp_path, capsys):
    """Issue 37 item 12: a bad row reached the command line inside a traceback, naming neither the file nor the fix."""
    from marlhf_edu import cli

    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps({"question": "q", "response_chosen": "a", "response_rejected": "b"}) + "\n"
                    + json.dumps({"question": "q", "response_chosen": "", "response_rejected": "b"}) + "\n")
    assert cli.main(["rm", "--config", "configs/tiny_rm.yaml", "--model_name_or_path", "zoo", "--dataset_name",
                     str(path), "--dataset_format", "generic", "--output_dir", str(tmp_path / "rm")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert f"{path}: row 1, field 'response_chosen'" in err and "skip_bad_rows: true" in err


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_a_margin_that_is_not_a_finite_number_is_refused_naming_file_row_and_key(tmp_path, token):
    """Reliability issue: a pair with `"margin": NaN` (JSON tokens Python's json module reads) trained a reward model
    whose adapter was all NaN, and the stage exited 0. The row is refused as any bad row is: file, row, key."""
    good = json.dumps({"prompt": "q", "chosen": "a", "rejected": "b", "margin": 1.0})
    path = tmp_path / "pairs.jsonl"
    path.write_text(good + "\n" + f'{{"prompt": "q", "chosen": "a", "rejected": "c", "margin": {token}}}\n')
    with pytest.raises(BadRowError, match=rf"pairs.jsonl: row 1, field 'margin': expected a finite number, got "
                                          rf"-?(nan|inf)"):
        load_preferences(str(path), "trl")
    generic = tmp_path / "generic.json"  # every format's margin goes through the same check
    generic.write_text(f'[{{"question": "q", "response_chosen": "a", "response_rejected": "b", "margin": {token}}}]')
    with pytest.raises(BadRowError, match=r"generic.json: row 0, field 'margin': expected a finite number"):
        load_preferences(str(generic), "generic")


def test_a_non_finite_margin_stops_the_reward_stage_before_any_model_loads(tmp_path, monkeypatch, capsys):
    """From the command line: one line naming the file, the row and `margin`, exit status 2, nothing loaded."""
    import transformers

    from marlhf_edu import cli

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad margin was refused")

    monkeypatch.setattr(transformers.AutoModelForSequenceClassification, "from_pretrained", loaded)
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"prompt": "q", "chosen": "a", "rejected": "b", "margin": NaN}\n')
    assert cli.main(["rm", "--config", "configs/tiny_rm.yaml", "--model_name_or_path", "zoo", "--dataset_name",
                     str(path), "--dataset_format", "trl", "--output_dir", str(tmp_path / "rm")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{path}: row 0, field 'margin': expected a finite number, got nan" in err
    assert not (tmp_path / "rm" / "adapter_model.safetensors").exists()
