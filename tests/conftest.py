import re

import pytest
import torch

#: a chapter's code cell, fence to fence (MyST: ```{code-cell} ... ```)
CODE_CELL = re.compile(r"```\{code-cell\}.*?```", re.S)


def without_code_cells(markdown: str) -> str:
    """A chapter's text with its code cells removed: its prose, for the checks that read prose only."""
    return CODE_CELL.sub("", markdown)


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(1234)


def right_padded_mask(gen, B, T, min_len=1):
    lengths = torch.randint(min_len, T + 1, (B,), generator=gen)
    lengths[0] = T
    return (torch.arange(T)[None, :] < lengths[:, None]).long()


@pytest.fixture(scope="module")
def prompts():
    """The toy world's training prompts, rendered."""
    from marlhf_edu.data.toyworld import ToyWorld

    return [p.prompt for p in ToyWorld().train_prompts]


def build_trainer(tmp_path, backend_cls, prompts, base: dict, **overrides):
    """A `PPOTrainer` on `backend_cls` with config `base` + `overrides`, seeded, writing under `tmp_path`."""
    from marlhf_edu.ppo import PPOConfig, PPOTrainer

    config = PPOConfig(output_dir=str(tmp_path / backend_cls.__name__), **{**base, **overrides})
    torch.manual_seed(0)
    return PPOTrainer(backend_cls.from_config(config), config, prompts)


def held_by_another(lock_file) -> bool:
    """Whether some open file description holds an exclusive `flock` on `lock_file` (a run's `.lock`): tried from a
    descriptor of its own, so a lock this very process holds elsewhere counts too."""
    import fcntl
    import os

    fd = os.open(lock_file, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing it releases a lock it took


@pytest.fixture
def no_loading(monkeypatch):
    """Every way the stages load a model or an adapter raises."""
    import peft
    import transformers

    def loaded(*args, **kwargs):
        raise AssertionError("a model was loaded (or a stage ran) before the mistake was refused")

    for name in ("AutoModelForCausalLM", "AutoModel", "AutoModelForSequenceClassification"):
        monkeypatch.setattr(getattr(transformers, name), "from_pretrained", loaded)
    monkeypatch.setattr(peft.PeftModel, "from_pretrained", loaded)


def nf4_lora_pair(double_quant: bool = True, compute_dtype: str = "float32", onednn: bool = False):
    """Two LoRA models on the same NF4 base of the tiny SFT model (quantization is deterministic): bitsandbytes' own
    layers, and the same layers under `dequantize_once` (with `onednn`, multiplied by oneDNN, the LM head too)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from marlhf_edu.loading.assets import SFT_DIR
    from marlhf_edu.loading.onednn import use_onednn
    from marlhf_edu.loading.quantization import dequantize_once, keep_nf4_trainable, nf4_loading_kwargs

    models = []
    for once in (False, True):
        base = AutoModelForCausalLM.from_pretrained(str(SFT_DIR), **nf4_loading_kwargs("cpu", double_quant, compute_dtype))
        assert (dequantize_once(base, onednn=onednn) if once else keep_nf4_trainable(base)) == 28
        if once and onednn:
            assert use_onednn(base) == 1  # the LM head
        torch.manual_seed(0)
        model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, lora_dropout=0.0,
                                                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                                "up_proj", "down_proj"]))
        with torch.no_grad():  # B = 0 at start would hide gradients that flow through the LoRA branches
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
        models.append(model.eval())
    return models
