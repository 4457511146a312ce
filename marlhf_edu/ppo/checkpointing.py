"""Gradient (activation) checkpointing for the PPO update, in a loop whose models stay in eval mode.

Without it, a training forward keeps every decoder layer's intermediate tensors
until the backward: about (7h + 3i) values per token and layer for a frozen
Llama layer, L layers deep. With it, each layer keeps only its input (h values
per token) and is run a second time in the backward, one layer at a time:
activations drop roughly L-fold for one more forward's worth of compute.

We use transformers' own mechanism (`activation_checkpointing_enable`, with
`torch.utils.checkpoint`'s non-reentrant variant), with two traps handled here:

1. transformers checkpoints a decoder layer only when that layer is in
   training mode, and the PPO engine keeps every model in eval mode (no
   dropout: a recomputed log-prob must equal the rollout's). `checkpointed`
   sets the `training` flag of the decoder layers alone, not of their
   submodules, for the length of one training forward: attention dropout and
   every other mode-dependent piece stay in eval mode.
2. The recomputation runs in the backward, long after the forward, with the
   model as it is *then*. A multi-adapter critic computes values with the
   `value` adapter active and switches back to `policy` before the backward:
   replayed naively, the value layers would be recomputed through the policy
   adapter and the value adapter would get the policy's gradients, silently.
   `enable_checkpointing` takes a `recompute_context`: a function called at
   each layer's forward that returns a context manager to replay it under
   (the multi-adapter backend restores the adapter that was active).

Taught in chapter 10; the memory it saves is planned in `marlhf_edu.memory.plan`.
"""

from __future__ import annotations

import contextlib
from typing import Callable

from torch import nn

from marlhf_edu.errors import ConfigError


def decoder_layers_of(model: nn.Module) -> list[nn.Module]:
    """Every module of `model` that transformers can checkpoint (its decoder layers)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def enable_checkpointing(model: nn.Module, recompute_context: Callable[[], contextlib.AbstractContextManager] | None = None):
    """Turn on non-reentrant checkpointing of every decoder layer of `model` (a transformers model, or a peft
    wrapper of one). It takes effect only inside `checkpointed(model)`.

    `recompute_context()` is called when a layer runs forward; the context manager it returns wraps that layer's
    recomputation in the backward. Returns `model`.
    """

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False) or not decoder_layers_of(base):
        raise ConfigError(f"{type(base).__name__} does not support gradient checkpointing")
    kwargs = {"use_reentrant": False}
    if recompute_context is not None:
        kwargs["context_fn"] = lambda: (contextlib.nullcontext(), recompute_context())
    if hasattr(base, "activation_checkpointing_enable"):  # newer transformers (the old name warns there)
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # older ones inside pyproject's range (5.17 on a GPU image)
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # transformers also makes the embeddings' output require grad, which only the reentrant variant needs;
    # without the hook the autograd graph is the same as without checkpointing
    base.disable_input_require_grads()
    return model


@contextlib.contextmanager
def checkpointed(*models: nn.Module):
    """Inside: the decoder layers of `models` that `enable_checkpointing` prepared are recomputed in the
    backward instead of keeping their activations. Only the layers' own `training` flag is set (transformers
    checks it); their submodules stay in the mode they were in."""
    layers = [layer for m in models for layer in decoder_layers_of(m) if layer.gradient_checkpointing]
    modes = [layer.training for layer in layers]
    for layer in layers:
        layer.training = True  # not layer.train(): that would switch its dropout on too
    try:
        yield
    finally:
        for layer, mode in zip(layers, modes):
            layer.training = mode
