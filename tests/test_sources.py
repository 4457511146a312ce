"""Model references (`marlhf_edu.sources`): classification, GGUF conversion, adapter merging, the pad choice."""

import json
import os
import pathlib

import pytest
import torch

from marlhf_edu.sources import ModelSource, align_pad, choose_pad_token, load_tokenizer, resolve_model
from marlhf_edu.stages.common import ConfigError


def test_references_are_classified(tmp_path):
    from marlhf_edu.models import SFT_DIR

    assert ModelSource.parse("zoo") == ModelSource("zoo", "zoo", str(SFT_DIR))
    assert ModelSource.parse("zoo/tiny_reward_adapter").kind == "adapter"
    assert ModelSource.parse("zoo/tiny_sft").kind == "directory"
    assert ModelSource.parse("HuggingFaceTB/SmolLM2-135M-Instruct").kind == "hub"
    with pytest.raises(ConfigError, match="no shipped asset 'nope'.*tiny_sft"):
        ModelSource.parse("zoo/nope")
    with pytest.raises(ConfigError, match="no such GGUF file"):
        ModelSource.parse(str(tmp_path / "model.gguf"))
    with pytest.raises(ConfigError, match="no such directory"):
        ModelSource.parse("./not/here")
    with pytest.raises(ConfigError, match="neither config.json"):
        ModelSource.parse(str(tmp_path))


def test_seq_cls_adapter_is_not_a_language_model():
    with pytest.raises(ConfigError, match="SEQ_CLS adapter is not a language model"):
        resolve_model("zoo/tiny_reward_adapter")


class _Tok:
    """The few tokenizer attributes `choose_pad_token` reads."""

    def __init__(self, vocab, pad=None, eos="</s>", bos="<s>"):
        self.vocab = vocab
        self.pad_token, self.pad_token_id = pad, vocab.get(pad)
        self.eos_token_id, self.bos_token_id = vocab[eos], vocab.get(bos)

    def get_vocab(self):
        return self.vocab


def test_pad_choice():
    # its own distinct pad is kept
    assert choose_pad_token(_Tok({"<s>": 1, "</s>": 2, "<pad>": 3}, pad="<pad>")) == "<pad>"
    # pad = EOS (SmolLM2): the first candidate it has that is neither EOS nor BOS
    assert choose_pad_token(_Tok({"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}, pad="<|im_end|>",
                                 eos="<|im_end|>", bos="<|im_start|>")) == "<|endoftext|>"
    # no pad at all (Llama-2): <unk>
    assert choose_pad_token(_Tok({"<unk>": 0, "<s>": 1, "</s>": 2})) == "<unk>"
    # nothing usable
    assert choose_pad_token(_Tok({"<s>": 1, "</s>": 2}, pad="</s>")) is None


def test_toy_tokenizer_unchanged_through_sources():
    from marlhf_edu.models import load_tokenizer as load_toy

    toy, via_sources = load_toy(), load_tokenizer("zoo")
    assert via_sources.pad_token == toy.pad_token == "<pad>"
    assert via_sources.get_vocab() == toy.get_vocab()


def test_causal_adapter_merges_into_its_base(tmp_path, monkeypatch):
    """An SFT adapter as a model reference = its base with the adapter merged (cached by content)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from marlhf_edu.models import SFT_DIR

    monkeypatch.setenv("MARLHF_EDU_CACHE", str(tmp_path / "cache"))
    base = AutoModelForCausalLM.from_pretrained(str(SFT_DIR))
    torch.manual_seed(0)
    peft = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False))
    peft.save_pretrained(str(tmp_path / "sft_adapter"))
    config = json.loads((tmp_path / "sft_adapter" / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "zoo"  # how a shipped adapter names its base
    (tmp_path / "sft_adapter" / "adapter_config.json").write_text(json.dumps(config))

    merged_dir = resolve_model(tmp_path / "sft_adapter")
    assert merged_dir.startswith(str(tmp_path / "cache" / "merged"))
    assert resolve_model(tmp_path / "sft_adapter") == merged_dir  # built once
    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    ids = torch.tensor([[1, 20, 30, 40, 50]])
    with torch.no_grad():
        expected, got = peft(input_ids=ids).logits, merged(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(str(SFT_DIR))(input_ids=ids).logits
    assert (expected - plain).abs().max() > 1e-2  # the adapter does something
    assert torch.allclose(got, expected, atol=1e-4)
    assert load_tokenizer(tmp_path / "sft_adapter").get_vocab() == load_tokenizer("zoo").get_vocab()


def test_merged_adapters_keep_their_base_dtype_and_never_share_a_cache_entry(tmp_path, monkeypatch):
    """The same adapter weights on two bases (fp32 and a bf16 copy) give two merged models, each in its base's dtype:
    the cache key covers the base, and a bf16 7B base is not blown up to fp32 on disk."""
    import shutil

    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from marlhf_edu.models import SFT_DIR

    monkeypatch.setenv("MARLHF_EDU_CACHE", str(tmp_path / "cache"))
    AutoModelForCausalLM.from_pretrained(str(SFT_DIR)).to(torch.bfloat16).save_pretrained(tmp_path / "bf16_base")
    load_tokenizer("zoo").save_pretrained(tmp_path / "bf16_base")
    torch.manual_seed(0)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(str(SFT_DIR)),
                          LoraConfig(task_type="CAUSAL_LM", r=4, target_modules=["q_proj"], init_lora_weights=False))
    peft.save_pretrained(str(tmp_path / "a" / "policy"))  # two runs' exported policies: same name, same weights
    shutil.copytree(tmp_path / "a" / "policy", tmp_path / "b" / "policy")
    for run, base in (("a", "zoo"), ("b", str(tmp_path / "bf16_base"))):
        config = json.loads((tmp_path / run / "policy" / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = base
        (tmp_path / run / "policy" / "adapter_config.json").write_text(json.dumps(config))
    fp32_dir, bf16_dir = resolve_model(tmp_path / "a" / "policy"), resolve_model(tmp_path / "b" / "policy")
    assert fp32_dir != bf16_dir  # equal weights, different bases
    dtypes = {d: {t.dtype for t in load_file(str(pathlib.Path(d) / "model.safetensors")).values()}
              for d in (fp32_dir, bf16_dir)}
    assert dtypes == {fp32_dir: {torch.float32}, bf16_dir: {torch.bfloat16}}


def test_align_pad():
    from transformers import AutoModelForCausalLM

    from marlhf_edu.models import SFT_DIR

    model = AutoModelForCausalLM.from_pretrained(str(SFT_DIR))
    model.config.pad_token_id = model.generation_config.pad_token_id = 2
    tok = load_tokenizer("zoo")
    align_pad(model, tok)
    assert model.config.pad_token_id == model.generation_config.pad_token_id == tok.pad_token_id != 2


def test_ship_adapter_casts_and_records_its_base(tmp_path):
    """`zoo rebuild --model smollm2` stores the SFT adapter in fp16: loaded into an fp32 model it must give the
    fp32 adapter's outputs to fp16 precision, and name a base that resolves anywhere."""
    import json

    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file

    from marlhf_edu.models import load_sft_model
    from marlhf_edu.zoo import ship_adapter

    model, tok = load_sft_model()
    torch.manual_seed(0)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "q_proj", "o_proj"],
                                            init_lora_weights=False))
    peft.save_pretrained(tmp_path / "run")
    ids = tok(["How many legs does a spider have?"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        reference = peft(ids).logits
    shipped = ship_adapter(tmp_path / "run", tmp_path / "shipped", "zoo", dtype=torch.float16)
    assert {v.dtype for v in load_file(shipped / "adapter_model.safetensors").values()} == {torch.float16}
    config = json.loads((shipped / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "zoo"
    assert config["target_modules"] == ["o_proj", "q_proj", "v_proj"]  # sorted, not peft's set order
    fresh, _ = load_sft_model()
    with torch.no_grad():
        got = PeftModel.from_pretrained(fresh, str(shipped))(ids).logits
    assert got.dtype == torch.float32
    assert (got - reference).abs().max() < 1e-2 * reference.abs().max()
    assert not torch.equal(got, reference)  # the weights really were rounded


def test_shipped_smollm2_adapters_name_resolvable_bases():
    import json

    from marlhf_edu.models import ASSETS
    from marlhf_edu.sources import ModelSource

    sft = json.loads((ASSETS / "smollm2_sft_adapter" / "adapter_config.json").read_text())
    rm = json.loads((ASSETS / "smollm2_reward_adapter" / "adapter_config.json").read_text())
    assert sft["base_model_name_or_path"] == "smollm2" and sft["task_type"] == "CAUSAL_LM"
    assert rm["base_model_name_or_path"] == "zoo/smollm2_sft_adapter" and rm["task_type"] == "SEQ_CLS"
    assert "score" in rm["modules_to_save"]
    assert ModelSource.parse(rm["base_model_name_or_path"]).kind == "adapter"
    metrics = json.loads((ASSETS / "smollm2_metrics.json").read_text())["reward_model"]
    low, high = metrics["wilson_95"]
    assert low < metrics["held_out_accuracy"] < high and metrics["n_pairs"] > 100


def test_cache_at_redirects_the_cache_and_restores_it(monkeypatch, tmp_path):
    from marlhf_edu.sources import cache_at, cache_dir

    monkeypatch.setenv("MARLHF_EDU_CACHE", str(tmp_path / "outer"))
    with cache_at(tmp_path / "inner") as inner:
        assert cache_dir() == inner == tmp_path / "inner"
    assert cache_dir() == tmp_path / "outer"
    monkeypatch.delenv("MARLHF_EDU_CACHE")
    with pytest.raises(RuntimeError), cache_at(tmp_path / "inner"):
        raise RuntimeError("restored even when the block fails")
    assert "MARLHF_EDU_CACHE" not in os.environ
