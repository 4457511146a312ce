"""The toy world's tokenizer and tiny Llama models, and loaders for the shipped ones.

The tiny models are `LlamaForCausalLM` / `LlamaForSequenceClassification`
with a few million parameters, so every line that later runs on Llama-2-7B
runs here unchanged. The tokenizer is a byte-level BPE trained on the toy
corpus, with a pad token distinct from EOS.

Taught in chapter 07 (tokenizer, SFT model) and chapter 08 (reward model).
"""

from __future__ import annotations

import pathlib

from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.assets import REWARD_ADAPTER_DIR, SFT_DIR
from marlhf_edu.loading.device import resolve_device
from marlhf_edu.loading.quantization import keep_nf4_trainable, nf4_loading_kwargs
from marlhf_edu.loading.sources import adapter_fits, align_pad, load_tokenizer, local_path, resolve_model


SPECIAL_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}

#: Architecture of the tiny models (Llama-2's design at 1/1000 of its width).
TINY_LLAMA = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, attention_dropout=0.0)


def train_tokenizer(texts, vocab_size: int = 512, out_dir: pathlib.Path | str | None = None):
    """Train a byte-level BPE on `texts`; return a `PreTrainedTokenizerFast` (saved to `out_dir` if given).

    Byte-level pre-tokenisation makes decode(encode(text)) == text for any text.
    Every sequence starts with `<s>` (as Llama's tokenizer does); `</s>` ends a
    response and `<pad>` pads, never the same token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS.values())
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS, padding_side="right",
                                   model_max_length=TINY_LLAMA["max_position_embeddings"])
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def tiny_llama(tokenizer, seed: int = 0, **overrides):
    """A freshly initialised tiny `LlamaForCausalLM` for `tokenizer` (seeded)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         **{**TINY_LLAMA, **overrides})
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


LOAD_DTYPES = ("auto", "bfloat16", "float16", "float32")


def loading_kwargs(device: str = "auto", dtype: str = "auto", load_in_4bit: bool = False) -> dict:
    """`from_pretrained` arguments that load a model for inference where a GPU user expects it.

    On CUDA the whole model goes to that one GPU (`device_map`), in bf16 under `dtype='auto'` whatever the
    checkpoint says (Llama-2-7b-hf is saved in float16), or as an NF4 base with bf16 compute under
    `load_in_4bit` (chapter 10; `quantization.nf4_loading_kwargs`). On the CPU, `dtype='auto'` keeps the
    checkpoint's own dtype and adds nothing: the book's CPU models load exactly as before. Used by
    `marlhf-edu evaluate` and `generate` (chapter 15).
    """
    import torch

    if dtype not in LOAD_DTYPES:
        raise ConfigError(f"--dtype must be one of {LOAD_DTYPES}, got {dtype!r}")
    device = resolve_device(device)
    if load_in_4bit:
        return nf4_loading_kwargs(device)
    kwargs = {} if device == "cpu" else {"device_map": {"": device}}
    if dtype != "auto":
        kwargs["dtype"] = getattr(torch, dtype)
    elif device != "cpu":
        kwargs["dtype"] = torch.bfloat16
    return kwargs


def load_sft_model(path: pathlib.Path | str = SFT_DIR, **from_pretrained_kwargs):
    """The shipped tiny SFT model and its tokenizer: `(LlamaForCausalLM, tokenizer)`, in eval mode.

    Pass `quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...)` for a
    4-bit NF4 base (runs on CPU with bitsandbytes >= 0.48).
    """
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(path)
    model = align_pad(AutoModelForCausalLM.from_pretrained(resolve_model(path), **from_pretrained_kwargs), tokenizer)
    keep_nf4_trainable(model)  # see marlhf_edu.loading.quantization: eval mode must not repack a 4-bit base
    return model.eval(), tokenizer


def load_reward_model(sft_path: pathlib.Path | str = SFT_DIR, adapter_path: pathlib.Path | str = REWARD_ADAPTER_DIR,
                      **from_pretrained_kwargs):
    """The shipped tiny reward model: SFT backbone + score head + the reward LoRA adapter.

    Returns `(PeftModel wrapping LlamaForSequenceClassification, tokenizer)`, in eval mode.
    """
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    tokenizer = load_tokenizer(sft_path)
    base = AutoModelForSequenceClassification.from_pretrained(resolve_model(sft_path), num_labels=1,
                                                              **from_pretrained_kwargs)
    keep_nf4_trainable(base)
    align_pad(base, tokenizer)  # the score is read at the last non-pad token
    with adapter_fits(local_path(adapter_path), sft_path):
        model = PeftModel.from_pretrained(base, str(local_path(adapter_path)), is_trainable=False)
    return model.eval(), tokenizer
