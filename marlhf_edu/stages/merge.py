"""`marlhf-edu merge`: fold a trained LoRA adapter into its base and save a plain model, checked.

    marlhf-edu merge --adapter runs/llama2_7b/ma_ppo/policy --output_dir runs/llama2_7b/merged [--dtype bfloat16]

The adapter's own `base_model_name_or_path` names the base (every stage records it: `zoo`, `smollm2`, a directory,
a hub id, or another adapter). The base is loaded in fp32 and the adapter applied (the reference), then merged,
cast to `--dtype` and saved as safetensors with the tokenizer. Before it writes, the merged model must agree
with the reference on a few prompts: the same most likely next token at (nearly) every position, and in fp32 the
same log-probabilities within 1e-3. A merged model that quietly differs from what was trained would be worse
than none. Merge into a full-precision base, never into the NF4 one: rounding the merged weights to 4 bits
again would change the model (chapter 10). The work happens on `--device`, a GPU when there is one: the fp32
base of a 7B model took 25.6 GiB there on an H100 (benchmarks/gpu_check.json; `--device cpu` on a smaller card:
about as much host RAM, and slower).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

from marlhf_edu.data.keyword_judge import BENIGN_QUESTIONS
from marlhf_edu.data.template import template_for
from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.device import resolve_device
from marlhf_edu.loading.models import loading_kwargs
from marlhf_edu.loading.quiet import quiet_loading
from marlhf_edu.loading.sources import ModelSource, adapter_base, adapter_fits, align_pad, load_tokenizer, resolve_model
from marlhf_edu.training.args import parse_stage_args

DTYPES = ("bfloat16", "float16", "float32")


@dataclass
class MergeArguments:
    adapter: str = field(default="", metadata={"help": "a causal-LM LoRA adapter directory (a policy or SFT adapter)"})
    output_dir: str = field(default="", metadata={"help": "where to write the merged model and tokenizer"})
    dtype: str = field(default="bfloat16", metadata={"help": "dtype of the saved weights: " + ", ".join(DTYPES)})
    check_prompts: int = field(default=4, metadata={"help": "prompts the merged and unmerged models are compared on"})
    min_agreement: float = field(default=0.95, metadata={"help": "required fraction of positions with the same "
                                                                  "most likely next token"})
    device: str = field(default="auto", metadata={"help": "'auto' (cuda if available), 'cpu' or 'cuda[:N]': where "
                                                          "the fp32 base is loaded, merged and checked"})
    overwrite: bool = field(default=False, metadata={"help": "replace a non-empty output_dir (never the adapter or "
                                                             "its base); without it such a folder is refused"})


def _sample_batch(tokenizer, n: int):
    template = template_for(tokenizer)
    texts = [template.dialogue([(q, None)]) + template.completion(answers[0].capitalize() + ".")
             for q, answers in BENIGN_QUESTIONS[:n]]
    return tokenizer(texts, return_tensors="pt", padding=True)


def merge_inputs(adapter: pathlib.Path) -> set[pathlib.Path]:
    """Every local folder or file a merge of `adapter` reads: the adapter, the base it records wherever that
    reference points (`zoo`, `zoo/NAME`, a shipped GGUF, a path), and that base's own base when it is an adapter
    too (an SFT adapter under a policy adapter). A hub base is downloaded to the hub's cache, not read in place."""
    found = {adapter.resolve()}
    source = ModelSource.parse(adapter_base(adapter))
    while source.kind != "hub":
        location = pathlib.Path(source.location).resolve()
        if location in found:  # an adapter that records itself: nothing more to read
            break
        found.add(location)
        if source.kind != "adapter":
            break
        source = ModelSource.parse(adapter_base(location))
    return found


def merge(args: MergeArguments) -> dict:
    """Merge, check, save; returns the check's numbers."""
    import json
    import os

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if not args.adapter or not args.output_dir:
        raise ConfigError("merge needs --adapter and --output_dir")
    if args.dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {DTYPES}, got {args.dtype!r}")
    if args.check_prompts < 1 or not 0 < args.min_agreement <= 1:
        raise ConfigError(f"--check_prompts must be >= 1 and --min_agreement in (0, 1], got {args.check_prompts} and "
                          f"{args.min_agreement}")
    device = resolve_device(args.device)
    adapter = pathlib.Path(args.adapter)
    if not (adapter / "adapter_config.json").exists():
        raise ConfigError(f"{adapter}: no adapter_config.json (a fully trained policy is already a plain model)")
    config = json.loads((adapter / "adapter_config.json").read_text())
    if config.get("task_type") != "CAUSAL_LM":
        raise ConfigError(f"{adapter}: a {config.get('task_type')} adapter is not a language model")
    base_ref = adapter_base(adapter)  # a bare hub id peft recorded reads as hf:owner/name
    out = pathlib.Path(args.output_dir)
    # never write over what the merge reads: the base would then carry the delta, and the adapter apply it twice
    protected = merge_inputs(adapter)
    if any(out.resolve() == p or p in out.resolve().parents or out.resolve() in p.parents for p in protected):
        raise ConfigError(f"--output_dir {out} is the adapter or its base, inside one or holds one: choose another "
                          "folder")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        raise ConfigError(f"--output_dir {out} exists and is not empty; pass --overwrite true to replace it")
    parent = next((p for p in out.resolve().parents if p.exists()), None)  # where the merged folder will be made
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ConfigError(f"--output_dir {out} cannot be created: {parent} is not a folder this user can write")
    tokenizer = load_tokenizer(adapter if (adapter / "tokenizer_config.json").exists() else base_ref)
    with quiet_loading():
        base = align_pad(AutoModelForCausalLM.from_pretrained(resolve_model(base_ref),
                                                              **loading_kwargs(device, "float32")), tokenizer)
        with adapter_fits(adapter, base_ref):
            model = PeftModel.from_pretrained(base, str(adapter)).eval()
    batch = _sample_batch(tokenizer, args.check_prompts).to(device)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        reference = torch.log_softmax(model(**batch).logits.float(), -1)
        merged = model.merge_and_unload().to(getattr(torch, args.dtype)).eval()
        got = torch.log_softmax(merged(**batch).logits.float(), -1)
    agreement = float((reference.argmax(-1) == got.argmax(-1))[real].float().mean())
    gap = float((reference - got).abs().amax(-1)[real].max())
    print(f"merged ({args.dtype}) vs adapter on its base (fp32), {int(real.sum())} positions of {args.check_prompts} "
          f"prompts: same most likely next token at {agreement:.1%}, largest |log-prob difference| {gap:.2e}")
    if agreement < args.min_agreement or (args.dtype == "float32" and gap > 1e-3):
        raise ConfigError(f"the merged model disagrees with the adapter it came from (agreement {agreement:.1%}, "
                          f"largest log-prob gap {gap:.2e}); nothing was written")
    # written beside the target, then renamed: an interrupted merge leaves the old folder (or none), never half
    import shutil
    import tempfile

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        merged.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "marlhf_source.json").write_text(
            json.dumps({"adapter": str(adapter), "base": base_ref, "dtype": args.dtype}) + "\n")
        old = None
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"wrote {args.output_dir}")
    return {"agreement": agreement, "max_logprob_gap": gap}


def main(argv: list[str] | None = None):
    (args,) = parse_stage_args((MergeArguments,), argv)
    return merge(args)
