"""The real-model path (chapter 13): shipped hh-rlhf data and its split, SmolLM2 from its GGUF file, chat templates,
and the library behaviour the QLoRA stages rely on."""

import json
import pathlib

import pytest
import torch

from marlhf_edu.data import BookTemplate, ChatTemplate, load_preferences, load_sft, template_for
from marlhf_edu.data.shipped import SHIPPED_DATASETS, first_request, shipped_rows, split_of


def test_shipped_split_is_by_first_request():
    everything = shipped_rows("hh-rlhf-harmless-base")
    train, test = shipped_rows("hh-rlhf-harmless-base", "train"), shipped_rows("hh-rlhf-harmless-base", "test")
    assert len(everything) == 2312 and len(train) + len(test) == 2312
    assert 0.15 < len(test) / len(everything) < 0.25
    requests = lambda rows: {first_request(r["chosen"]).lower() for r in rows}  # noqa: E731
    assert not requests(train) & requests(test)  # no request on both sides
    assert first_request("\n\nHuman: Hi there \n\nAssistant: Hello") == "Hi there"
    assert split_of("\n\nHuman: Hi there\n\nAssistant: a") == split_of("\n\nHuman: hi there\n\nAssistant: b")
    with pytest.raises(ValueError, match="split must be one of"):
        shipped_rows("hh-rlhf-harmless-base", "validation")
    assert SHIPPED_DATASETS["hh-rlhf-harmless-base"].with_name("LICENSE").exists()


def test_bad_rows_are_reported_not_dropped_silently():
    with pytest.raises(Exception, match="row 71, field 'chosen': empty text"):
        load_sft("hh-rlhf-harmless-base", "hh-rlhf", split="train")
    ds, report = load_sft("hh-rlhf-harmless-base", "hh-rlhf", split="train", skip_bad_rows=True, return_report=True)
    assert report.total == len(ds) + len(report.skipped) and report.skipped
    assert "skipped" in report.summary()


def test_book_template_unchanged_without_chat_template():
    from marlhf_edu.data import build_prompt, render_dialogue
    from marlhf_edu.loading.sources import load_tokenizer

    toy = load_tokenizer()
    assert isinstance(template_for(toy), BookTemplate)
    t = template_for(toy)
    assert t.dialogue([("Is the zorb blue?", None)]) == build_prompt("Is the zorb blue?")
    turns = [("a?", "b."), ("c?", None)]
    assert t.dialogue(turns) == render_dialogue(turns) and t.completion("x ") == " x"


@pytest.fixture(scope="module")
def smol_tokenizer():
    from marlhf_edu.loading.sources import load_tokenizer

    return load_tokenizer("smollm2")  # converts the GGUF file into the cache on first use


def test_smollm2_pad_is_not_eos(smol_tokenizer):
    tok = smol_tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    assert tok.model_max_length == 8192 and len(tok) == 49152


def test_chat_template_rows_and_prefix_property(smol_tokenizer):
    tok = smol_tokenizer
    template = template_for(tok)
    assert isinstance(template, ChatTemplate)
    rows = load_sft("hh-rlhf-harmless-base", "hh-rlhf", split="test", skip_bad_rows=True, tokenizer=tok)
    first = rows[0]
    assert first["prompt"].endswith("<|im_start|>assistant\n") and "<|im_start|>user\n" in first["prompt"]
    assert not first["completion"].startswith(" ")
    # completion-only loss and PPO rollouts need: tokens(prompt) is a prefix of tokens(prompt + completion)
    for row in rows.select(range(100)):
        p = tok(row["prompt"])["input_ids"]
        assert tok(row["prompt"] + row["completion"] + tok.eos_token)["input_ids"][:len(p)] == p
    pairs = load_preferences("hh-rlhf-harmless-base", "hh-rlhf", split="test", skip_bad_rows=True, tokenizer=tok)
    # SFT and preference rows of one dialogue share the rendered prompt; the chosen answer is the SFT completion
    assert (pairs[0]["prompt"], pairs[0]["chosen"]) == (first["prompt"], first["completion"])


@pytest.mark.slow
def test_gguf_conversion_is_faithful(smol_tokenizer):
    """The cached safetensors copy computes what transformers' own GGUF loading computes."""
    from transformers import AutoModelForCausalLM

    from marlhf_edu.loading.sources import SHIPPED_GGUF, resolve_model, shipped_gguf_path

    path = shipped_gguf_path("smollm2")
    direct = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=SHIPPED_GGUF["smollm2"][1],
                                                  dtype=torch.float32)
    cached = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2"))
    assert "quantization_config" not in json.loads((pathlib.Path(resolve_model("smollm2")) / "config.json").read_text())
    ids = smol_tokenizer("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n", return_tensors="pt")
    with torch.no_grad():
        a, b = direct(**ids).logits, cached(**ids).logits
    assert torch.equal(a, b)


def test_prompts_from_hh_rlhf(smol_tokenizer):
    from marlhf_edu.data.prompts import load_prompts
    from marlhf_edu.ppo import PPOConfig

    config = PPOConfig(dataset_name="hh-rlhf-harmless-base", dataset_format="hh-rlhf", dataset_split="test",
                       skip_bad_rows=True, drop_long_prompts=True, max_prompt_length=64)
    prompts = load_prompts(config, smol_tokenizer)
    assert len(prompts) == len(set(prompts)) > 50
    assert max(len(ids) for ids in smol_tokenizer(prompts)["input_ids"]) <= 64
    assert all(p.endswith("<|im_start|>assistant\n") for p in prompts)
    with pytest.raises(Exception, match="row .*, field 'chosen'"):
        load_prompts(PPOConfig(dataset_name="hh-rlhf-harmless-base", dataset_format="hh-rlhf", dataset_split="all"),
                     smol_tokenizer)


def test_trl_casts_qlora_trainables_to_bf16_and_we_cast_back():
    """Pins trl 1.16's behaviour the stages undo: `RewardTrainer` casts a quantized model's trainable
    parameters (LoRA and the score head) to bf16, whatever `bf16` says; `keep_trainable_dtype` restores fp32."""
    from peft import LoraConfig
    from transformers import AutoModelForSequenceClassification
    from trl import RewardConfig, RewardTrainer

    from marlhf_edu.data.toyworld import ToyWorld, ToyWorldConfig
    from marlhf_edu.loading.assets import SFT_DIR
    from marlhf_edu.loading.quantization import keep_nf4_trainable, keep_trainable_dtype, nf4_loading_kwargs
    from marlhf_edu.loading.sources import load_tokenizer

    tok = load_tokenizer()
    model = AutoModelForSequenceClassification.from_pretrained(str(SFT_DIR), num_labels=1, dtype=torch.float32,
                                                               **nf4_loading_kwargs("cpu"))
    model.config.pad_token_id = tok.pad_token_id
    keep_nf4_trainable(model)
    data = ToyWorld(ToyWorldConfig(seed=0)).preference_dataset().select(range(8))
    args = RewardConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to="none", max_length=128)
    trainer = RewardTrainer(model=model, args=args, train_dataset=data, processing_class=tok,
                            peft_config=LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj"],
                                                   modules_to_save=["score"]))
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.bfloat16 for p in trainable)  # what trl does
    assert keep_trainable_dtype(trainer.model) == len(trainable)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters() if p.requires_grad)


def test_select_rows_filters_by_tokens_and_counts():
    from types import SimpleNamespace

    import datasets

    from marlhf_edu.errors import ConfigError
    from marlhf_edu.loading.sources import load_tokenizer
    from marlhf_edu.training.rows import select_rows

    tok = load_tokenizer()
    ds = datasets.Dataset.from_list([{"prompt": "a", "chosen": " b", "rejected": " c d e f g h"},
                                     {"prompt": "a", "chosen": " b", "rejected": " c"},
                                     {"prompt": "a b", "chosen": " b", "rejected": " c"}])
    n = lambda text, special=True: len(tok(text, add_special_tokens=special)["input_ids"])  # noqa: E731
    limit = n("a") + n(" b", False) + 1  # fits row 1 only if its longest answer is one token
    assert n(" c", False) == 1 and n(" c d e f g h", False) > 1 and n("a b") > n("a")
    kept = select_rows(ds, tok, SimpleNamespace(max_tokens=limit, max_rows=0), "preference")
    assert kept["rejected"] == [" c"] and kept["prompt"] == ["a"]
    assert len(select_rows(ds, tok, SimpleNamespace(max_tokens=0, max_rows=2), "preference")) == 2
    with pytest.raises(ConfigError, match="no rows left"):
        select_rows(ds, tok, SimpleNamespace(max_tokens=1, max_rows=0), "preference")


def test_length_baseline_and_record_base(tmp_path):
    from marlhf_edu.loading.sources import load_tokenizer, record_base
    from marlhf_edu.training.reward import length_baseline

    tok = load_tokenizer()
    pairs = [{"chosen": " a b c d", "rejected": " a"}, {"chosen": " a", "rejected": " a b c"},
             {"chosen": " a b", "rejected": " b a"}]
    assert length_baseline(tok, pairs)["longer_is_chosen"] == pytest.approx((1 + 0 + 0.5) / 3)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/root/.cache/x", "r": 8}))
    record_base(tmp_path, "smollm2")
    assert json.loads((tmp_path / "adapter_config.json").read_text()) == {"base_model_name_or_path": "smollm2", "r": 8}


@pytest.mark.slow
def test_gguf_metadata_is_read_from_the_header_as_gguf_reads_it():
    """`gguf_metadata` parses the key-value header itself (GGUFReader maps every tensor and takes seconds); the
    values it reads are the library's."""
    from gguf import GGUFReader

    from marlhf_edu.loading.sources import gguf_metadata, gguf_special_tokens, shipped_gguf_path

    path = shipped_gguf_path("smollm2")
    ours, reader = gguf_metadata(path), GGUFReader(str(path))
    assert set(ours) == {key for key in reader.fields if not key.startswith("GGUF.")}  # the reader's own header
    for key in ("general.architecture", "llama.block_count", "llama.embedding_length", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.bos_token_id"):
        field = reader.fields[key]
        expected = bytes(field.parts[-1]).decode() if key == "general.architecture" else int(field.parts[-1][0])
        assert ours[key] == expected
    tokens = reader.fields["tokenizer.ggml.tokens"]
    assert len(ours["tokenizer.ggml.tokens"]) == len(tokens.data) == 49152
    assert ours["tokenizer.ggml.tokens"][:3] == [bytes(tokens.parts[i]).decode() for i in tokens.data[:3]]
    assert gguf_special_tokens(path) == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


def test_a_misread_eos_is_set_back_to_the_files(smol_tokenizer):
    """transformers 5.17 reads SmolLM2's GGUF EOS as <|im_start|> (seen on a GPU machine): sampling then stops a
    turn late and the reward model reads tokens it never saw. The conversion takes BOS and EOS from the file."""
    import copy

    from transformers import LlamaConfig

    from marlhf_edu.loading.sources import use_gguf_special_tokens

    tok, config = copy.deepcopy(smol_tokenizer), LlamaConfig(bos_token_id=1, eos_token_id=1)
    tok.eos_token = "<|im_start|>"
    changed = use_gguf_special_tokens(tok, config, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    assert changed == ["eos_token '<|im_start|>' -> '<|im_end|>'"]
    assert (tok.eos_token, tok.eos_token_id, config.eos_token_id, config.bos_token_id) == ("<|im_end|>", 2, 2, 1)
    assert use_gguf_special_tokens(tok, config, {"eos_token": "<|im_end|>"}) == []


def test_a_cached_conversion_with_another_eos_is_rebuilt(tmp_path, monkeypatch, capsys):
    """A conversion cached by a transformers that misread EOS is built again, for the GGUF base and for an SFT
    adapter merged into it; one that agrees with the file is used as it is."""
    from marlhf_edu.loading import sources

    calls = []

    def fake_publish(build, target):  # the first entry carries the misread EOS, a rebuilt one the file's
        folder = tmp_path / f"entry{len(calls)}"
        folder.mkdir()
        eos = "<|im_start|>" if not calls else "<|im_end|>"
        (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>", "eos_token": eos}))
        calls.append(target)
        return folder

    monkeypatch.setattr(sources, "publish", fake_publish)
    gguf = sources.shipped_gguf_path("smollm2")
    assert sources.materialize_gguf(gguf) == tmp_path / "entry1" and len(calls) == 2 and calls[0] == calls[1]
    assert "disagrees with SmolLM2-135M-Instruct.Q4_1.gguf (eos_token '<|im_start|>'" in capsys.readouterr().out
    assert not (tmp_path / "entry0").exists()
    assert sources.materialize_gguf(gguf) == tmp_path / "entry2" and len(calls) == 3  # agrees: built once
    calls.clear()
    for folder in tmp_path.iterdir():
        folder.rename(tmp_path / f"old_{folder.name}")
    from marlhf_edu.loading.assets import ASSETS

    assert sources.materialize_adapter(ASSETS / "smollm2_sft_adapter") == tmp_path / "entry1"
    assert len(calls) == 2 and "disagrees with its base SmolLM2-135M-Instruct.Q4_1.gguf" in capsys.readouterr().out


def test_the_conversion_saves_the_files_eos_whatever_transformers_reads(tmp_path, monkeypatch, smol_tokenizer):
    """The conversion itself, with transformers' GGUF loaders replaced by a misreading tokenizer and a tiny model of
    the same family: the saved tokenizer, model config and generation config carry the file's EOS."""
    import copy

    import transformers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from marlhf_edu.loading import sources

    misread = copy.deepcopy(smol_tokenizer)
    misread.eos_token = "<|im_start|>"
    tiny = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, bos_token_id=1, eos_token_id=1,
                                        tie_word_embeddings=True))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: copy.deepcopy(misread))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: tiny)
    built = tmp_path / "entry"

    def build_once(build, target):
        if not built.exists():
            built.mkdir()
            build(built)
        return built

    monkeypatch.setattr(sources, "publish", build_once)
    folder = sources.materialize_gguf(sources.shipped_gguf_path("smollm2"))
    assert json.loads((folder / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == 2
    assert GenerationConfig.from_pretrained(folder).eos_token_id == 2
