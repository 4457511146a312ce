"""Diagrams of the book's ideas, drawn with matplotlib: no data, no randomness, one function per picture.

- `ppo_iteration`: one PPO iteration's seven steps and what flows between them (chapter 09);
- `adapter_switching`: four roles on one base, the adapter each forward switches on (chapter 10);
- `memory_budget`: four full models against one NF4 base with adapters, in GiB from the planner (chapter 10);
- `gae_recursion`: GAE computed from the last token backwards, on a worked example (chapter 05);
- `pipeline_7b`: the 7B pipeline's stages and the folders and files each writes (chapter 15).

Every function returns the `matplotlib.figure.Figure` it drew. In a notebook, call it and then `plt.show()`, as the
book's other figure cells end: the figure is shown once and the Figure object's repr is not stored. Numbers on a diagram
come from the package (`gae_advantages`, the memory planner), never from a second copy of a formula.
"""

from __future__ import annotations

from dataclasses import replace

import matplotlib.pyplot as plt
import torch
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
from matplotlib.text import Text

from marlhf_edu.math.gae import gae_advantages
from marlhf_edu.memory.plan import LLAMA_2_7B, MemorySettings, ModelShape, plan_four_model, plan_multi_adapter

# one palette for every diagram (and the README's picture): a step or stage, data, a frozen part, a trained
# part, the shared base, and an inactive (switched-off) adapter
STEP, DATA, FROZEN, TRAINED, BASE, OFF = "#c6dbef", "#f0f0f0", "#d9d9d9", "#fdd0a2", "#bcbddc", "#ffffff"
INK, MUTED = "#333333", "#666666"
# the q, k, v, o attention projections: the LoRA targets of MA-RLHF's 7B recipe (configs/llama2_7b)
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
GIB = 2**30


def _canvas(width: float, height: float, bottom: float = 0.0):
    """A figure of `width` × (`height` − `bottom`) inches whose one axes spans it, in inch coordinates from
    (0, `bottom`) to (`width`, `height`), without axis or grid."""
    fig = plt.figure(figsize=(width, height - bottom))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(bottom, height)
    ax.axis("off")
    return fig, ax


def _box(ax, x, y, w, h, text="", color=STEP, size=10, weight="normal", ls="-", ha="center", ec=INK, text_color=INK):
    """A rounded box with (x, y) its lower-left corner, and `text` centred in it (or left-aligned: ha="left")."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0,rounding_size=0.06", fc=color, ec=ec, lw=1,
                                ls=ls))
    if text:
        tx = x + w / 2 if ha == "center" else x + 0.1
        ax.text(tx, y + h / 2, text, ha=ha, va="center", fontsize=size, weight=weight, color=text_color,
                linespacing=1.3)


def _arrow(ax, start, end, text="", color=INK, rad=0.0, size=9, ls="-", text_offset=(0.0, 0.0)):
    """An arrow from `start` to `end`; `rad` bends it; `text` sits beside its middle."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=13, lw=1.2, color=color, ls=ls,
                                 connectionstyle=f"arc3,rad={rad}", shrinkA=1, shrinkB=1))
    if text:
        ax.text((start[0] + end[0]) / 2 + text_offset[0], (start[1] + end[1]) / 2 + text_offset[1], text,
                fontsize=size, color=color, ha="center", va="center")


def _title(ax, x, y, text, size=12):
    ax.text(x, y, text, fontsize=size, weight="bold", ha="left", va="center", color=INK)


def figure_texts(fig: Figure) -> list[str]:
    """Every string drawn on `fig` (titles, box labels, tick labels): what a test of a diagram reads."""
    return [t.get_text() for t in fig.findobj(Text) if t.get_text()]




# (step, what it does and with which model, package code, timed phase, what it hands on) for each of the seven
# steps of `PPOTrainer.step`, in chapter 09's order and words
PPO_STEPS = (
    ("1. Rollout", "the actor samples answers to the prompts\n(KV cache, temperature T; mask to the first EOS)",
     "PPOTrainer.rollout", "generate", "input_ids (B, P+R)\nresponse_mask (B, R)"),
    ("2. Scores", "the reward model scores each sequence at its\nlast real token (EOS appended if cut off)",
     "backend.scores, transform_scores", "score", "raw_scores (B,) → scores (B,)"),
    ("3. Log-probs and values", "no-grad forwards: actor and critic,\nthen the frozen reference",
     "policy_forward, reference_logprobs", "policy, reference", "logprobs, ref_logprobs,\nvalues (B, R)"),
    ("4. KL-penalised rewards", "−β·KL_t on every token,\nthe score added at the last one",
     "token_level_rewards", "", "rewards, kls (B, R)"),
    ("5. Advantages", "GAE backwards over the answer (γ, λ),\nthen whitened over real tokens",
     "gae_advantages, masked_whiten", "", "advantages, returns (B, R)"),
    ("6. PPO update", "ppo_epochs × shuffled minibatches: clipped\npolicy loss + value loss, one AdamW step each",
     "PPOTrainer.update, ppo_loss", "update", "new actor and critic weights"),
    ("7. KL controller", "sees the batch's mean KL and\nadapts β for the next iteration",
     "kl_controller.update", "", "β for step 4 of the next iteration"),
)


def ppo_iteration() -> Figure:
    """One PPO iteration (`PPOTrainer.step`) as seven steps, top to bottom, each with the model it runs, the package
    code that does it, its timed phase (`time/<phase>_s`) and what it hands to the next step, tensors with shapes
    (B rollouts, P prompt columns, R response columns). The dashed arrows are what loops back: the updated weights
    sample the next rollout, and β weighs the next KL penalty.

    Taught in chapter 09.
    """
    fig, ax = _canvas(11.0, 7.6, bottom=0.4)
    _title(ax, 0.1, 7.35, "One PPO iteration: PPOTrainer.step")
    ax.text(10.45, 7.35, "step [timed phase] · what runs · package code → what it hands on", fontsize=9, color=MUTED,
            ha="right", va="center")
    xs, ws = 1.2, 2.3  # the column of steps
    _box(ax, xs, 6.55, ws, 0.45, "prompts: the next batch (B)", DATA, size=9.5)
    row_h, gap, top = 0.72, 0.13, 6.35
    ys = [top - (i + 1) * row_h - i * gap for i in range(len(PPO_STEPS))]
    for i, (step, what, code, phase, out) in enumerate(PPO_STEPS):
        y = ys[i]
        _box(ax, xs, y, ws, row_h, "", STEP)
        ax.text(xs + ws / 2, y + row_h * (0.62 if phase else 0.5), step, fontsize=10.5, weight="bold", ha="center",
                va="center", color=INK)
        if phase:
            ax.text(xs + ws / 2, y + row_h * 0.24, ", ".join(f"time/{p}_s" for p in phase.split(", ")), fontsize=8,
                    ha="center", va="center", color=MUTED, family="monospace")
        ax.text(xs + ws + 0.15, y + row_h * 0.66, what, fontsize=9, va="center", ha="left", color=INK, linespacing=1.2)
        ax.text(xs + ws + 0.15, y + row_h * 0.13, code, fontsize=8.5, va="center", ha="left", color=MUTED,
                family="monospace")
        _box(ax, 7.55, y + 0.06, 2.9, row_h - 0.12, out, DATA, size=9)
        _arrow(ax, (7.0, y + row_h * 0.5), (7.53, y + row_h * 0.5))
        _arrow(ax, (xs + ws / 2, 6.55 if i == 0 else y + row_h + gap), (xs + ws / 2, y + row_h))
    # what loops back into the next iteration: the updated actor samples, and β weighs the KL penalty
    ax.add_patch(FancyArrowPatch((xs, ys[5] + row_h / 2), (xs, ys[0] + row_h / 2), arrowstyle="-|>",
                                 mutation_scale=13, lw=1.2, color=MUTED, ls="--", connectionstyle="arc3,rad=-0.15",
                                 shrinkA=1, shrinkB=1))
    ax.text(0.05, (ys[0] + ys[5]) / 2 + row_h / 2, "next\niteration:\nthe\nupdated\nactor\nsamples", fontsize=8.5,
            color=MUTED, ha="left", va="center")
    ax.add_patch(FancyArrowPatch((10.45, ys[6] + row_h / 2), (10.45, ys[3] + row_h / 2), arrowstyle="-|>",
                                 mutation_scale=13, lw=1.2, color=MUTED, ls="--", connectionstyle="arc3,rad=0.45",
                                 shrinkA=1, shrinkB=1))
    ax.text(10.95, (ys[3] + ys[6]) / 2 + row_h / 2, "β", fontsize=10, color=MUTED, ha="right", va="center")
    return fig




# the adapters `MultiAdapterBackend` loads on its one base, in the order drawn
ADAPTERS = ("policy", "value", "reward")
# each forward of MA-PPO: (title, the adapter it switches on or None for all off, how, its heads as
# (name, trained), what comes out)
FORWARDS = (
    ("policy forward", "policy", "set_adapter(\"policy\")\n(the default)",
     (("LM head", False), ("value head\nif shared", True)), "log π (B, R), samples;\nvalues (B, R) when shared"),
    ("value forward", "value", "_use_adapter(\"value\")\nvalue_mode: adapter only", (("value head", True),),
     "values (B, R)"),
    ("reward forward", "reward", "_use_adapter(\"reward\")\nfrozen",
     (("score head (read from\nthe adapter file)", False),), "score (B,) at the\nlast real token"),
    ("reference forward", None, "adapters_off()\nevery adapter off", (("LM head", False),),
     "log π_ref (B, R)"),
)


def adapter_switching() -> Figure:
    """MA-PPO's four roles on one base model: each of the four forwards switches one LoRA adapter on (`policy`,
    `value`, `reward`) or all of them off (the reference), on the same frozen base weights, NF4 at 7B. Trained parts
    are orange, frozen ones grey, the base purple; an adapter drawn white and dashed is off in that forward.

    In `value_mode: shared` (the 7B config) there is no `value` adapter: the value head reads the policy forward's
    last hidden state, so one forward gives log-probs and values. In `value_mode: adapter` (the tiny config) the
    critic is its own adapter and a second forward. Every switch goes back to `policy` and restores which
    parameters train (`MultiAdapterBackend._use_adapter`).

    Taught in chapter 10.
    """
    fig, ax = _canvas(10.5, 4.6)
    _title(ax, 0.1, 4.38, "One base, four roles: each forward switches adapters (MultiAdapterBackend)")
    panel_w, panel_gap = 2.45, 0.15
    for i, (title, active, how, heads, out) in enumerate(FORWARDS):
        x = 0.1 + i * (panel_w + panel_gap)
        ax.text(x + panel_w / 2, 4.0, title, ha="center", va="center", fontsize=10.5, weight="bold", color=INK)
        ax.text(x + panel_w / 2, 3.62, how, ha="center", va="center", fontsize=8, color=MUTED, family="monospace",
                linespacing=1.2)
        head_w = (panel_w - 0.4 - 0.08 * (len(heads) - 1)) / len(heads)
        for j, (head, trained) in enumerate(heads):
            _box(ax, x + 0.2 + j * (head_w + 0.08), 2.72, head_w, 0.5, head, TRAINED if trained else FROZEN, size=8.5)
        slot_w = (panel_w - 0.4 - 2 * 0.08) / 3
        for j, name in enumerate(ADAPTERS):
            on = name == active
            color = (TRAINED if name != "reward" else FROZEN) if on else OFF
            _box(ax, x + 0.2 + j * (slot_w + 0.08), 1.85, slot_w, 0.5, name, color, size=8.5,
                 ls="-" if on else "--", ec=INK if on else "#999999", text_color=INK if on else "#999999",
                 weight="bold" if on else "normal")
        _box(ax, x + 0.2, 1.0, panel_w - 0.4, 0.55, "base weights\n(frozen, NF4 at 7B)", BASE, size=8.5)
        _arrow(ax, (x + panel_w / 2, 2.37), (x + panel_w / 2, 2.70))
        _arrow(ax, (x + panel_w / 2, 1.57), (x + panel_w / 2, 1.83))
        ax.text(x + panel_w / 2, 0.55, out, ha="center", va="center", fontsize=8.5, color=INK, linespacing=1.2)
    ax.text(0.1, 0.12, "orange: trained (policy and value adapters, value head); grey: frozen (reward adapter, "
            "score head, LM head); purple: the one base; white, dashed: switched off",
            fontsize=8.5, color=MUTED, ha="left", va="center")
    return fig


def _gib(nbytes: int) -> str:
    """Bytes in GiB with two decimals, or in KiB or MiB when that would print 0.00."""
    if nbytes >= 0.005 * GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / 2**20:.2f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.0f} KiB"


def memory_budget_plans(shape: ModelShape = LLAMA_2_7B, ma_lora_r: int = 64, reward_lora_r: int = 32,
                        targets=QKVO) -> dict:
    """The two plans `memory_budget` draws: four-model PPO with four bf16 copies, actor and critic trained in full,
    against MA-PPO on one NF4 base (double quantization) with LoRA `ma_lora_r` on `targets` and the value head
    shared; both with AdamW and a reward LoRA of rank `reward_lora_r` on `targets`. Returns
    `{"four full models": MemoryPlan, "MA-PPO": MemoryPlan}`."""
    targets = tuple(targets)
    common = MemorySettings(weight_dtype="bfloat16", reward_lora_r=reward_lora_r, reward_targets=targets,
                            policy_targets=targets, value_targets=targets, optimizer="adamw")
    four = plan_four_model(shape, replace(common, policy_lora_r=0, value_lora_r=0))
    ma = plan_multi_adapter(shape, replace(common, load_in_4bit=True, double_quant=True, policy_lora_r=ma_lora_r,
                                           value_lora_r=ma_lora_r, value_mode="shared"))
    return {"four full models": four, "MA-PPO": ma}


def memory_segments(plan) -> list[tuple[str, int, str]]:
    """`(label, bytes, colour)` of each part of `plan`'s model state, in the order drawn: what each role holds
    (`MemoryPlan.per_model`: weights and adapters), then gradients and optimizer state. They add up to
    `plan.model_state`."""
    colors = {"actor": TRAINED, "critic": TRAINED, "reference": FROZEN, "reward": FROZEN,
              "base (and reference)": BASE, "policy": TRAINED, "value": TRAINED}
    # MA-PPO with a shared value head: its `value` is the head alone, no adapter
    shared = plan.architecture.startswith("MA-PPO") and plan.settings.value_mode == "shared"
    segments = [("value head" if shared and name == "value" else name, nbytes, colors.get(name, DATA))
                for name, nbytes in plan.per_model.items() if nbytes]
    return segments + [("gradients", plan.parts["gradients"], "#9ecae1"), ("optimizer", plan.parts["optimizer"],
                                                                           "#6baed6")]


def memory_budget(shape: ModelShape = LLAMA_2_7B, ma_lora_r: int = 64, reward_lora_r: int = 32,
                  targets=QKVO) -> Figure:
    """Model state (weights, adapters, gradients, AdamW's two moments) of four-model PPO with four full bf16 models
    against MA-PPO's one NF4 base with adapters (`memory_budget_plans`), as bars in GiB computed by the planner
    (`plan_four_model`, `plan_multi_adapter`); the lower bar draws MA-PPO again on a scale of its own. The KV cache
    and activations of a step come on top of both.

    Taught in chapter 10.
    """
    plans = memory_budget_plans(shape, ma_lora_r, reward_lora_r, targets)
    four, ma = plans["four full models"], plans["MA-PPO"]
    names = ",".join(t.removesuffix("_proj") for t in targets)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10.5, 4.6), gridspec_kw={"height_ratios": [1.25, 1]})
    fig.suptitle(f"Model state of {shape.name} in GiB (planned): four full models against one base with adapters",
                 x=0.01, ha="left", fontsize=12, weight="bold")

    def bar(ax, y, plan, min_label):
        left = 0.0
        for label, nbytes, color in memory_segments(plan):
            width = nbytes / GIB
            ax.barh(y, width, left=left, height=0.6, color=color, edgecolor=INK, lw=0.8)
            if width >= min_label:
                ax.text(left + width / 2, y, f"{label}\n{width:.1f}" if width >= 2 * min_label else f"{width:.1f}",
                        ha="center", va="center", fontsize=8.5, color=INK)
            left += width
        ax.text(left + ax.get_xlim()[1] * 0.01, y, f"{plan.model_state / GIB:.1f} GiB", ha="left", va="center",
                fontsize=10, weight="bold", color=INK)
        return left

    top.set_xlim(0, four.model_state / GIB * 1.1)
    bar(top, 1, four, min_label=4.0)
    bar(top, 0, ma, min_label=1e9)
    top.set_yticks([1, 0], ["four full models\n(bf16, actor and critic\ntrained in full)",
                            f"MA-PPO\n(NF4 base, LoRA r={ma_lora_r},\nshared value head)"], fontsize=9)
    ma_gib = ma.model_state / GIB
    bottom.set_xlim(0, ma_gib * 1.15)
    bottom.set_ylim(-0.75, 0.75)
    segments, left, thin = memory_segments(ma), 0.0, []
    for label, nbytes, color in segments:
        width = nbytes / GIB
        bottom.barh(0, width, left=left, height=0.6, color=color, edgecolor=INK, lw=0.8)
        if width > ma_gib * 0.3:
            bottom.text(left + width / 2, 0, f"{label}\n{_gib(nbytes)}", ha="center", va="center", fontsize=8.5)
        else:
            thin.append((label, nbytes, left + width / 2))
        left += width
    # thin segments: labelled above and below in turn, spread leftwards from the last one so no two labels meet
    spacing = ma_gib * 0.17
    for side in (1, -1):
        labels = [t for k, t in enumerate(thin) if (k % 2 == 0) == (side == 1)]
        x_text = None
        for label, nbytes, mid in reversed(labels):
            x_text = mid if x_text is None else min(mid, x_text - spacing)
            bottom.annotate(f"{label} {_gib(nbytes)}", (mid, 0.3 * side), (x_text, 0.62 * side), ha="center",
                            va="center", fontsize=8.5, color=INK, arrowprops=dict(arrowstyle="-", color=MUTED, lw=0.8))
    bottom.text(left + ma_gib * 0.01, 0, f"{ma_gib:.2f} GiB", ha="left", va="center", fontsize=10, weight="bold")
    bottom.set_yticks([0], ["MA-PPO,\nenlarged"], fontsize=9)
    for ax in (top, bottom):
        ax.grid(False)
        ax.spines[["top", "right"]].set_visible(False)
        ax.tick_params(axis="x", labelsize=8.5)
    bottom.set_xlabel(f"GiB; AdamW; reward LoRA r={reward_lora_r}, LoRA on {names}; without the KV cache and "
                      "activations of a step", fontsize=9)
    fig.tight_layout()
    return fig




# the worked example `gae_recursion` draws: a five-token answer, a small KL charge on every token and the
# reward model's score (+1) added at the last one, and a critic's values
GAE_EXAMPLE = {"rewards": (-0.02, -0.01, -0.03, -0.02, 0.98), "values": (0.3, 0.4, 0.5, 0.7, 0.9),
               "gamma": 1.0, "lam": 0.95}


def gae_example() -> dict[str, list[float]]:
    """`GAE_EXAMPLE` run through `gae_advantages`: the TD errors δ_t (GAE with λ = 0 is δ_t), the advantages A_t
    and the returns R_t = A_t + V_t, one list of T floats each."""
    ex = GAE_EXAMPLE
    values, rewards = torch.tensor([ex["values"]]), torch.tensor([ex["rewards"]])
    mask = torch.ones_like(values, dtype=torch.bool)
    deltas, _ = gae_advantages(values, rewards, mask, gamma=ex["gamma"], lam=0.0)
    advantages, returns = gae_advantages(values, rewards, mask, gamma=ex["gamma"], lam=ex["lam"])
    return {"deltas": deltas[0].tolist(), "advantages": advantages[0].tolist(), "returns": returns[0].tolist()}


def gae_recursion() -> Figure:
    r"""GAE's backward recursion on a five-token answer (`GAE_EXAMPLE`):

    .. math:: \delta_t = r_t + \gamma V_{t+1} - V_t, \qquad A_t = \delta_t + \gamma\lambda A_{t+1}, \qquad V_T = A_T = 0

    Each token's TD error needs the next token's value; each advantage needs the next token's advantage, so the
    advantages are computed from the last token backwards (the numbered order). Every number drawn comes from
    `gae_advantages` (`gae_example`).

    Taught in chapter 05.
    """
    ex, out = GAE_EXAMPLE, gae_example()
    T = len(ex["rewards"])
    fig, ax = _canvas(10.5, 4.3, bottom=0.1)
    _title(ax, 0.1, 4.1, f"GAE, computed from the last token backwards (γ = {ex['gamma']:g}, λ = {ex['lam']:g})")
    col_w, x0, w = 1.45, 1.75, 1.1  # column pitch, first column, box width
    half = (w - 0.08) / 2
    y_in, y_delta, y_adv = 2.95, 1.95, 0.95
    ax.text(0.1, y_in + 0.22, "value $V_t$,\nreward $r_t$", fontsize=10, va="center", ha="left", color=INK)
    ax.text(0.1, y_delta + 0.22, "TD error $\\delta_t$", fontsize=10, va="center", ha="left", color=INK)
    ax.text(0.1, y_adv + 0.22, "advantage $A_t$", fontsize=10, va="center", ha="left", color=INK)
    order = ("1st", "2nd", "3rd") + tuple(f"{k}th" for k in range(4, T + 1))
    for t in range(T):
        x = x0 + t * col_w
        ax.text(x + w / 2, 3.72, f"t = {t}", ha="center", va="center", fontsize=9.5, color=INK)
        ax.text(x + half / 2, 3.5, "$V_t$", ha="center", va="center", fontsize=8.5, color=MUTED)
        ax.text(x + w - half / 2, 3.5, "$r_t$", ha="center", va="center", fontsize=8.5, color=MUTED)
        _box(ax, x, y_in, half, 0.44, f"{ex['values'][t]:g}", DATA, size=9.5)
        _box(ax, x + w - half, y_in, half, 0.44, f"{ex['rewards'][t]:g}", DATA, size=9.5)
        _box(ax, x, y_delta, w, 0.44, f"{out['deltas'][t]:+.3f}", STEP, size=9.5)
        _box(ax, x, y_adv, w, 0.44, f"{out['advantages'][t]:+.3f}", TRAINED, size=9.5)
        # δ_t reads V_t and r_t above it, and V_{t+1} of the next column (times γ)
        _arrow(ax, (x + half / 2, y_in - 0.02), (x + half / 2, y_delta + 0.46), color=MUTED)
        _arrow(ax, (x + w - half / 2, y_in - 0.02), (x + w - half / 2, y_delta + 0.46), color=MUTED)
        _arrow(ax, (x + col_w + half / 2, y_in - 0.02), (x + w - 0.05, y_delta + 0.46), color=MUTED,
               text="γ", text_offset=(0.1, 0.1))
        _arrow(ax, (x + w / 2, y_delta - 0.02), (x + w / 2, y_adv + 0.46))  # A_t = δ_t + ...
        # ... + γλ A_{t+1}: the recursion runs right to left
        _arrow(ax, (x + col_w - 0.01, y_adv + 0.22), (x + w + 0.01, y_adv + 0.22), color="#d94801", text="γλ",
               text_offset=(0.0, 0.17))
        ax.text(x + w / 2, y_adv - 0.22, f"computed {order[T - 1 - t]}", ha="center", va="center", fontsize=8.5,
                color="#d94801")
    # the terminal column: past the last token nothing is owed
    xt = x0 + T * col_w
    ax.text(xt + w / 2, 3.72, "past the end", ha="center", va="center", fontsize=9, color=MUTED)
    _box(ax, xt, y_in, half, 0.44, "$V_T$ = 0", OFF, size=9, ls="--", ec="#999999")
    _box(ax, xt, y_adv, w, 0.44, "$A_T$ = 0", OFF, size=9.5, ls="--", ec="#999999")
    ax.text(0.1, 0.28, "$\\delta_t = r_t + \\gamma V_{t+1} - V_t$        $A_t = \\delta_t + \\gamma\\lambda A_{t+1}$"
            "        return $R_t = A_t + V_t$ (the critic's target): "
            + ", ".join(f"{v:.3f}" for v in out["returns"]), fontsize=10, va="center", ha="left", color=INK)
    return fig




# the 7B pipeline as `configs/llama2_7b/pipeline.yaml` runs it: (stage, command, what it reads, its output_dir,
# what it writes there)
PIPELINE_STAGES = (
    ("sft", "marlhf-edu sft\nconfigs/llama2_7b/sft.yaml", "hf:meta-llama/Llama-2-7b-hf\nPKU-SafeRLHF answers",
     "runs/llama2_7b/sft/",
     "adapter_model.safetensors\n  (LoRA r=64)\nadapter_config.json (its base)\ntokenizer files\ncheckpoint-N/ (trl)"),
    ("rm", "marlhf-edu rm\nconfigs/llama2_7b/rm.yaml", "sft/, merged into its base once\n(model cache); "
     "PKU-SafeRLHF pairs", "runs/llama2_7b/rm/",
     "adapter_model.safetensors\n  (LoRA r=32 + score head)\neval_metrics.json\ntokenizer files\ncheckpoint-N/ (trl)"),
    ("ma-ppo", "marlhf-edu ma-ppo\nconfigs/llama2_7b/ma_ppo.yaml", "sft/ (merged) as the base, rm/ as\n"
     "the reward adapter; PKU-SafeRLHF prompts", "runs/llama2_7b/ma_ppo/",
     "metrics.jsonl (a record a step)\ncheckpoints/ (the newest two)\npolicy/ (the trained adapter)"),
)
# what runs after the pipeline, on its trained policy: (command, output_dir, what it writes)
AFTER_PIPELINE = (
    ("marlhf-edu evaluate", "runs/llama2_7b/eval/", "eval_metrics.json\neval_samples.jsonl"),
    ("marlhf-edu merge", "runs/llama2_7b/merged/", "the merged policy (bf16\nsafetensors) and tokenizer"),
)


def pipeline_7b() -> Figure:
    """The 7B pipeline (`marlhf-edu pipeline --config configs/llama2_7b/pipeline.yaml`): SFT → reward model →
    MA-PPO, each stage with its config, what it reads and the folder and files it writes, then `evaluate` and
    `merge` on the trained policy. The SFT and reward-model folders also hold `pipeline_stage.started` (the pipeline
    started the stage there); every stage folder holds `pipeline_stage.json` (the stage finished, with its options)
    and `.lock` (held while it runs). Orange arrows: the folders the pipeline wires into a later stage's config
    (rm and ma-ppo read sft/, ma-ppo reads rm/).

    Taught in chapter 15.
    """
    fig, ax = _canvas(10.5, 6.75, bottom=0.1)
    _title(ax, 0.1, 6.55, "The 7B pipeline: marlhf-edu pipeline --config configs/llama2_7b/pipeline.yaml")
    col_w, gap, x0 = 3.0, 0.6, 0.15
    for i, (stage, command, reads, folder, writes) in enumerate(PIPELINE_STAGES):
        x = x0 + i * (col_w + gap)
        _box(ax, x, 5.0, col_w, 0.62, reads, DATA, size=8.5)
        _arrow(ax, (x + col_w / 2, 4.98), (x + col_w / 2, 4.66))
        _box(ax, x, 3.86, col_w, 0.78, "", STEP)
        ax.text(x + col_w / 2, 4.45, f"{i + 1}. {stage}", ha="center", va="center", fontsize=11, weight="bold")
        ax.text(x + col_w / 2, 4.07, command, ha="center", va="center", fontsize=8, family="monospace", color=INK,
                linespacing=1.15)
        _arrow(ax, (x + col_w / 2, 3.84), (x + col_w / 2, 3.5))
        _box(ax, x, 1.95, col_w, 1.53, "", "#fff7ec")
        ax.text(x + 0.1, 3.3, folder, ha="left", va="center", fontsize=9, weight="bold", family="monospace")
        ax.text(x + 0.1, 3.12, writes, ha="left", va="top", fontsize=8.3, family="monospace", linespacing=1.25)
        if i:  # the pipeline wires the stages: the previous stage's folder into this stage's config
            _arrow(ax, (x - gap + 0.02, 3.2), (x - 0.02, 4.25), color="#d94801")
    # and SFT's folder into MA-PPO's too (its base), over the reward model's column
    _arrow(ax, (x0 + col_w / 2, 5.64), (x0 + 2 * (col_w + gap) + col_w / 2, 5.64), rad=-0.07, color="#d94801")
    ax.text(x0 + col_w + gap + col_w / 2, 6.15, "sft/ is MA-PPO's base too", fontsize=8, color="#d94801",
            ha="center", va="bottom")
    ax.text(x0, 1.62, "sft/ and rm/ also hold\npipeline_stage.started (begun here);\nevery stage folder: "
            "pipeline_stage.json\n(finished, with its options), .lock", fontsize=8.5, color=MUTED, ha="left",
            va="top", linespacing=1.25)
    # after the pipeline: evaluate and merge read the trained policy
    x_ppo = x0 + 2 * (col_w + gap)
    for j, (command, folder, writes) in enumerate(AFTER_PIPELINE):
        x = x0 + (j + 1) * (col_w + gap)
        _box(ax, x, 0.2, col_w, 1.05, "", "#fff7ec")
        ax.text(x + 0.1, 1.07, command, ha="left", va="center", fontsize=9, weight="bold", family="monospace")
        ax.text(x + 0.1, 0.85, folder, ha="left", va="center", fontsize=8.5, family="monospace")
        ax.text(x + 0.1, 0.67, writes, ha="left", va="top", fontsize=8.3, family="monospace", linespacing=1.25)
        _arrow(ax, (x_ppo + col_w / 2, 1.93), (x + col_w / 2, 1.27), rad=0.0 if j else 0.15)
    ax.text(x_ppo + col_w / 2 + 0.1, 1.62, "after the pipeline,\non ma_ppo/policy/", fontsize=8.5, ha="left",
            va="center", color=INK)
    return fig
