"""Model references (`marlhf_edu.loading.sources`): classification, GGUF conversion, adapter merging, the pad choice."""

import json
import os
import pathlib

import pytest
import torch

from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.sources import ModelSource, align_pad, choose_pad_token, load_tokenizer, resolve_model


def test_references_are_classified(tmp_path):
    from marlhf_edu.loading.assets import SFT_DIR

    assert ModelSource.parse("zoo") == ModelSource("zoo", "zoo", str(SFT_DIR))
    assert ModelSource.parse("zoo/tiny_reward_adapter").kind == "adapter"
    assert ModelSource.parse("zoo/tiny_sft").kind == "directory"
    assert ModelSource.parse("hf:HuggingFaceTB/SmolLM2-135M-Instruct") == ModelSource(
        "hub", "hf:HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct", None)
    assert ModelSource.parse("hf:owner/name@v1.0").revision == "v1.0"
    for bad in ("hf:", "hf:owner/", "hf:a/b/c", "hf:owner/name@"):
        with pytest.raises(ConfigError, match="hf:owner/name or hf:owner/name@revision"):
            ModelSource.parse(bad)
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
    from marlhf_edu.loading.sources import load_tokenizer as load_toy

    toy, via_sources = load_toy(), load_tokenizer("zoo")
    assert via_sources.pad_token == toy.pad_token == "<pad>"
    assert via_sources.get_vocab() == toy.get_vocab()


def test_causal_adapter_merges_into_its_base(tmp_path, monkeypatch):
    """An SFT adapter as a model reference = its base with the adapter merged (cached by content)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from marlhf_edu.loading.assets import SFT_DIR

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

    from marlhf_edu.loading.assets import SFT_DIR

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

    from marlhf_edu.loading.assets import SFT_DIR

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

    from marlhf_edu.loading.models import load_sft_model
    from marlhf_edu.stages.zoo import ship_adapter

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

    from marlhf_edu.loading.assets import ASSETS
    from marlhf_edu.loading.sources import ModelSource

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
    from marlhf_edu.loading.model_cache import cache_at, cache_dir

    monkeypatch.setenv("MARLHF_EDU_CACHE", str(tmp_path / "outer"))
    with cache_at(tmp_path / "inner") as inner:
        assert cache_dir() == inner == tmp_path / "inner"
    assert cache_dir() == tmp_path / "outer"
    monkeypatch.delenv("MARLHF_EDU_CACHE")
    with pytest.raises(RuntimeError), cache_at(tmp_path / "inner"):
        raise RuntimeError("restored even when the block fails")
    assert "MARLHF_EDU_CACHE" not in os.environ


def test_a_missing_local_folder_is_never_looked_up_on_the_hub(tmp_path, monkeypatch):
    """`runs/tiny_sft` before SFT has written it: an error naming the fix, not a download of whatever the hub holds
    under that name (issue 37). A bare owner/name is a hub id only as an adapter's recorded base."""
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("looked up on the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for call in (ModelSource.parse, resolve_model, load_tokenizer):
        with pytest.raises(ConfigError, match=r"'runs/tiny_sft': no such folder \(runs/ exists here: .*run that "
                                              r"stage first\)$"):  # no hub hint: runs/ is where the stages write
            call("runs/tiny_sft")
    with pytest.raises(ConfigError, match="no such folder or model; .* hf:HuggingFaceTB/SmolLM2-135M-Instruct"):
        ModelSource.parse("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert ModelSource.parse("meta-llama/Llama-2-7b-hf", recorded=True).kind == "hub"


def test_a_recorded_local_base_gone_missing_is_never_looked_up_on_the_hub(tmp_path, monkeypatch):
    """`runs/tiny_rm` records `runs/tiny_sft` (configs/tiny_rm.yaml). With that folder gone, or from another working
    directory, the recorded base is an error naming the adapter's config, not a download of `runs/tiny_sft` from
    the hub (issue 37). A recorded owner/name whose first component is no folder here is still peft's hub id."""
    import huggingface_hub

    from marlhf_edu.loading.sources import adapter_base

    def no_network(*args, **kwargs):
        raise AssertionError("looked up on the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    monkeypatch.chdir(tmp_path)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (tmp_path / "mine").mkdir()
    for recorded in ("runs/tiny_sft", "mine/sft"):  # a config's output folder; a folder whose parent is here
        (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": recorded, "task_type": "CAUSAL_LM"}))
        with pytest.raises(ConfigError, match=rf"adapter_config.json records its base as '{recorded}', which is "
                                              r"not here: .*no such folder"):
            adapter_base(adapter)  # what merging the adapter into its base (materialize_adapter) asks first
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "meta-llama/Llama-2-7b-hf"}))
    assert adapter_base(adapter) == "hf:meta-llama/Llama-2-7b-hf"


def test_adapter_base_reads_a_recorded_hub_id_as_one(tmp_path):
    from marlhf_edu.loading.sources import adapter_base, record_base

    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "meta-llama/Llama-2-7b-hf"}))
    assert adapter_base(tmp_path) == "hf:meta-llama/Llama-2-7b-hf"
    record_base(tmp_path, "hf:meta-llama/Llama-2-7b-hf")  # recorded as peft writes it, so other tools read it
    assert json.loads((tmp_path / "adapter_config.json").read_text())["base_model_name_or_path"] == "meta-llama/Llama-2-7b-hf"
    record_base(tmp_path, "hf:meta-llama/Llama-2-7b-hf@abc123")  # a pinned revision keeps the book's form
    assert adapter_base(tmp_path) == "hf:meta-llama/Llama-2-7b-hf@abc123"
    record_base(tmp_path, "zoo")
    assert adapter_base(tmp_path) == "zoo"
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="names no base_model_name_or_path"):
        adapter_base(tmp_path)


def test_a_pinned_hub_revision_downloads_that_revision_as_safetensors(monkeypatch, tmp_path):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, revision=None, allow_patterns=None):
        calls.append((repo_id, revision, allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    # the hub reachable (the suite runs with HF_HUB_OFFLINE=1, under which an uncached hub model is refused)
    from huggingface_hub import constants

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert resolve_model("hf:owner/name@0123abc") == str(tmp_path)
    (repo_id, revision, patterns), = calls
    assert (repo_id, revision) == ("owner/name", "0123abc")
    assert "*.safetensors" in patterns and not any("bin" in p or "pt" in p.split(".")[-1] for p in patterns)
    assert resolve_model("hf:owner/name") == "owner/name" and len(calls) == 1  # unpinned: from_pretrained's own


def test_a_reward_adapter_on_a_base_it_was_not_trained_on_is_refused(tmp_path):
    """A random model as `sft_model_path` with the zoo reward adapter once trained to the end (issue 37): the
    adapter's recorded base must be the base it is put on, checked before any model loads."""
    import shutil

    from marlhf_edu.loading.adapters import check_reward_adapter_base
    from marlhf_edu.loading.assets import REWARD_ADAPTER_DIR, SFT_DIR
    from marlhf_edu.ppo import PPOConfig
    from marlhf_edu.ppo.backends import FourModelBackend
    from marlhf_edu.ppo.multi_adapter import MultiAdapterBackend

    check_reward_adapter_base(REWARD_ADAPTER_DIR, SFT_DIR)  # recorded as ../tiny_sft, relative to the adapter
    check_reward_adapter_base(REWARD_ADAPTER_DIR, "zoo")
    other = tmp_path / "random_llama"
    other.mkdir()
    shutil.copy(SFT_DIR / "config.json", other / "config.json")  # never loaded: the check comes first
    for backend in (MultiAdapterBackend, FourModelBackend):
        with pytest.raises(ConfigError, match=r"trained on .*tiny_sft.* but would be put on .*random_llama"):
            backend.from_config(PPOConfig(sft_model_path=str(other), reward_adapter_path="zoo"))
    # the adapter, moved: naming the base explicitly says it belongs to it
    moved = tmp_path / "rm"
    shutil.copytree(REWARD_ADAPTER_DIR, moved)
    with pytest.raises(ConfigError, match="reward_base_path: "):
        check_reward_adapter_base(moved, SFT_DIR)


def test_a_scorer_refuses_a_reward_model_with_another_vocabulary():
    """`marlhf-edu evaluate` once scored toy-tokenizer ids with SmolLM2's reward model and printed a score."""
    from marlhf_edu.loading.models import load_reward_model, load_sft_model
    from marlhf_edu.ppo import ScoredPolicy

    policy, tokenizer = load_sft_model()
    reward, reward_tokenizer = load_reward_model()
    ScoredPolicy(policy, reward, tokenizer, reward_tokenizer)  # the shipped pair: accepted

    class OtherVocabulary:
        def get_vocab(self):
            return {"a": 0}

        def __len__(self):
            return 1

    with pytest.raises(ConfigError, match="reward model's tokenizer .* differs from the policy's"):
        ScoredPolicy(policy, reward, tokenizer, OtherVocabulary())
    reward.get_input_embeddings().num_embeddings = 3  # an embedding table smaller than the policy's vocabulary
    with pytest.raises(ConfigError, match="embeds only 3"):
        ScoredPolicy(policy, reward, tokenizer)


def test_an_adapter_of_another_width_is_one_error_not_a_wall_of_mismatches(tmp_path):
    """Issue 37 item 12: a mismatched reward adapter printed 49 `size mismatch` lines inside a traceback."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from marlhf_edu.loading.assets import REWARD_ADAPTER_DIR, SFT_DIR
    from marlhf_edu.loading.models import load_reward_model

    config = LlamaConfig.from_pretrained(SFT_DIR)
    wider = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "hidden_size": config.hidden_size * 2,
                                           "intermediate_size": config.intermediate_size * 2}))
    wider.save_pretrained(tmp_path / "wider")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (SFT_DIR / name).exists():
            (tmp_path / "wider" / name).write_bytes((SFT_DIR / name).read_bytes())
    with pytest.raises(ConfigError, match=r"tiny_reward_adapter: its weights do not fit the base .*wider.* \(\d+ "
                                          r"size mismatches; first: size mismatch for") as caught:
        load_reward_model(tmp_path / "wider", REWARD_ADAPTER_DIR)
    assert str(caught.value).count("size mismatch for") == 1


def test_gguf_conversion_draws_no_progress_bar():
    """transformers' per-tensor tqdm bar is a notebook widget no stdout redirect catches: a chapter's stored
    output would then depend on a warm cache. `_no_progress_bar` silences it through the module's own `tqdm`
    name, which this pins."""
    import transformers.modeling_gguf_pytorch_utils as gguf_loading

    from marlhf_edu.loading.quiet import no_progress_bar as _no_progress_bar

    original = gguf_loading.tqdm
    with _no_progress_bar("transformers.modeling_gguf_pytorch_utils"):
        assert gguf_loading.tqdm([1, 2]).disable
    assert gguf_loading.tqdm is original


def test_pad_choice_for_the_qwen_and_mistral_substitutes():
    """Issue 34 item 3. Qwen2.5-7B (base): pad = EOS = <|endoftext|>, no <pad>/<unk>: its <|fim_pad|>. Mistral-7B-v0.1:
    no pad, <unk> at id 0."""
    qwen = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|fim_pad|>": 151662}
    assert choose_pad_token(_Tok(qwen, pad="<|endoftext|>", eos="<|endoftext|>", bos="<|im_start|>")) == "<|fim_pad|>"
    assert choose_pad_token(_Tok({"<unk>": 0, "<s>": 1, "</s>": 2})) == "<unk>"


@pytest.fixture
def unmergeable_adapter(tmp_path, monkeypatch):
    """An untrained LoRA on the shipped SFT model, saved as peft saves one (weights and adapter_config.json, no
    tokenizer files), whose merge into its base raises."""
    import json

    from marlhf_edu.loading import sources

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from marlhf_edu.loading.assets import SFT_DIR

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(SFT_DIR),
                           LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    model.save_pretrained(tmp_path / "adapter")
    config = tmp_path / "adapter" / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "base_model_name_or_path": str(SFT_DIR)}))
    assert not (tmp_path / "adapter" / "tokenizer_config.json").exists()

    def merged(*args, **kwargs):
        raise AssertionError("the adapter was merged")

    monkeypatch.setattr(sources, "materialize_adapter", merged)
    return tmp_path / "adapter"

def test_an_adapter_without_a_tokenizer_gives_its_bases_without_merging(unmergeable_adapter):
    """Issue 37: the reward stage read its tokenizer from an SFT adapter by merging it into its base first (a 7B
    merge: tens of seconds and 13.5 GB, before the data was even checked). The base's tokenizer is the same."""
    from marlhf_edu.loading import sources
    from marlhf_edu.loading.assets import SFT_DIR

    adapter = unmergeable_adapter
    tok = sources.load_tokenizer(str(adapter))
    base = sources.load_tokenizer(str(SFT_DIR))
    assert tok.get_vocab() == base.get_vocab() and tok.pad_token == base.pad_token


def test_the_memory_planner_reads_an_adapters_shape_from_its_base_without_merging(unmergeable_adapter):
    """Issue 37: `marlhf-edu memory` / `preflight` with an SFT adapter merged it into its base to read a shape."""
    from marlhf_edu.loading.assets import SFT_DIR
    from marlhf_edu.memory.plan import ModelShape

    adapter = unmergeable_adapter
    shape = ModelShape.resolve(str(adapter))
    base = ModelShape.resolve(str(SFT_DIR))
    assert (shape.hidden_size, shape.num_layers, shape.vocab_size) == (base.hidden_size, base.num_layers, base.vocab_size)


def _adapter_on(folder: pathlib.Path, base, tokenizer: bool = True) -> pathlib.Path:
    """A tiny causal-LM adapter folder recording `base` (what merging reads first: its config, its weights file
    for the cache key and, with `tokenizer`, the zoo tokenizer as its own), without training or peft."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base),
                                                            "task_type": "CAUSAL_LM", "peft_type": "LORA"}))
    (folder / "adapter_model.safetensors").write_bytes(b"not read before the base is resolved")
    if tokenizer:
        load_tokenizer("zoo").save_pretrained(str(folder))
    return folder


def _resolve_in_a_child(ref, cache: pathlib.Path, timeout: int = 90):
    """`resolve_model(ref)` in a child process with its own cache, killed after `timeout` s (a hang fails the
    test instead of stalling the suite); a `ConfigError` exits 2 with its message on stdout."""
    import subprocess
    import sys

    code = ("import sys\nfrom marlhf_edu.errors import ConfigError\nfrom marlhf_edu.loading.sources import resolve_model\n"
            "try:\n    resolve_model(sys.argv[1])\nexcept ConfigError as err:\n    print(err)\n    sys.exit(2)\n")
    return subprocess.run([sys.executable, "-c", code, str(ref)], env={**os.environ, "MARLHF_EDU_CACHE": str(cache)},
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("cycle", ["itself", "A on B on A"])
def test_an_adapter_that_is_its_own_base_is_refused_naming_the_chain_not_a_hang(tmp_path, cycle):
    """Reliability audit item 5: an adapter recording itself as its base (or A on B, B on A) hung every command
    that resolved it: merging A resolved its base, A again, whose build waited on the cache lock this process
    held for A; a `.lock` and a `.tmp-` folder were left in the cache. Refused before any lock, naming the chain."""
    a = tmp_path / "a"
    if cycle == "itself":
        _adapter_on(a, a)
        chain = f"{a} -> {a}"
    else:
        _adapter_on(a, tmp_path / "b")
        _adapter_on(tmp_path / "b", a)
        chain = f"{a} -> {tmp_path / 'b'} -> {a}"
    cache = tmp_path / "cache"
    proc = _resolve_in_a_child(a, cache)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "leads back to an adapter already on the way" in proc.stdout and chain in proc.stdout, proc.stdout
    assert "base_model_name_or_path in" in proc.stdout and "Traceback" not in proc.stderr
    left = sorted(str(p.relative_to(cache)) for p in cache.rglob("*")) if cache.exists() else []
    assert left == [], f"left in the cache: {left}"


def test_an_adapter_on_itself_without_a_tokenizer_is_refused_not_a_recursion(tmp_path):
    """Reading such an adapter's tokenizer follows its base to the same folder: a RecursionError before the fix."""
    from marlhf_edu.loading.sources import check_adapter_chain

    a = _adapter_on(tmp_path / "a", tmp_path / "a", tokenizer=False)
    with pytest.raises(ConfigError, match="leads back to an adapter already on the way"):
        load_tokenizer(a)
    ok = _adapter_on(tmp_path / "ok", "zoo", tokenizer=False)
    assert check_adapter_chain(_adapter_on(tmp_path / "on_ok", ok, tokenizer=False)) == [str(tmp_path / "on_ok"), str(ok)]
