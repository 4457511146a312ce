"""The standard panel of RLHF-PPO training curves, drawn from a run's `metrics.jsonl`.

Taught in chapter 09; chapter 10 draws the multi-adapter run on the same axes.
"""

from __future__ import annotations

from marlhf_edu.ppo.trainer import read_metrics

#: (title, keys drawn in that panel)
PANELS = (
    ("reward-model score", ("score/mean",)),
    ("KL to reference (per response)", ("kl/k1", "kl/k3")),
    ("KL coefficient β", ("kl/coef",)),
    ("policy entropy (per token)", ("policy/entropy",)),
    ("clipfrac", ("policy/clipfrac", "value/clipfrac")),
    ("approxkl", ("policy/approxkl",)),
    ("policy loss", ("loss/policy",)),
    ("value loss", ("loss/value",)),
    ("explained variance", ("value/explained_variance",)),
    ("response length (tokens)", ("response/length",)),
)


#: the most runs one figure overlays: each run gets a colour of its own (matplotlib's ten "tab10" colours)
MAX_RUNS = 10
#: line styles that tell the keys of one panel apart (kl/k1 solid, kl/k3 dashed)
KEY_STYLES = ("-", "--", ":")


def _key_label(key: str, keys) -> str:
    """How a curve is told apart from the others in its panel: 'k1'/'k3' for kl/k1, kl/k3, but 'policy'/'value'
    for policy/clipfrac, value/clipfrac (their last parts are the same)."""
    if len(keys) == 1:
        return ""
    last = [k.split("/")[-1] for k in keys]
    return key.split("/")[0] if len(set(last)) < len(last) else key.split("/")[-1]


def plot_training_curves(runs, panels=PANELS, ncols: int = 3, width: float = 3.2, height: float = 2.4):
    """Draw `panels` for one or several runs; returns the matplotlib figure.

    `runs`: a path to `metrics.jsonl`, a list of records, or a dict `{label: path or records}` to overlay up to
    `MAX_RUNS` runs (e.g. four-model vs multi-adapter). Each run has its own colour, named once in a legend
    below the panels (not inside any panel, where it would cover the curves); the keys of one panel (kl/k1 and
    kl/k3) differ by line style, named in the panel's title. The score panel shades ± one std.
    """
    import matplotlib.pyplot as plt

    if not isinstance(runs, dict):
        runs = {"": runs}
    if len(runs) > MAX_RUNS:
        raise ValueError(f"plot_training_curves: {len(runs)} runs on one figure; at most {MAX_RUNS} have colours "
                         "a reader can tell apart: pass a subset, or draw several figures")
    runs = {label: (read_metrics(r) if not isinstance(r, list) else r) for label, r in runs.items()}
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels):
        for i, (label, records) in enumerate(runs.items()):
            steps = [r["step"] for r in records]
            for j, key in enumerate(keys):
                if not records or key not in records[0]:
                    continue
                ys = [r[key] for r in records]
                ax.plot(steps, ys, color=f"C{i}", ls=KEY_STYLES[j % len(KEY_STYLES)], lw=1.4, label=label or None)
                if key == "score/mean" and "score/std" in records[0]:
                    std = [r["score/std"] for r in records]
                    ax.fill_between(steps, [y - s for y, s in zip(ys, std)], [y + s for y, s in zip(ys, std)],
                                    color=f"C{i}", alpha=0.12)
        styles = {"-": "solid", "--": "dashed", ":": "dotted"}
        named = [f"{_key_label(k, keys)} {styles[KEY_STYLES[j % len(KEY_STYLES)]]}" for j, k in enumerate(keys)]
        ax.set_title(title + (f"\n({', '.join(named)})" if len(keys) > 1 else ""), fontsize=10)
        ax.tick_params(labelsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("PPO step", fontsize=9)
    fig.tight_layout()
    if any(runs):  # one legend for the figure, below the panels
        handles = [plt.Line2D([], [], color=f"C{i}", lw=2) for i in range(len(runs))]
        fig.legend(handles, list(runs), loc="upper center", bbox_to_anchor=(0.5, 0.0), fontsize=9,
                   ncol=min(len(runs), 3), frameon=False)
    return fig
