"""The standard panel of RLHF-PPO training curves, drawn from a run's `metrics.jsonl`.

Taught in chapter 09; chapter 10 draws the multi-adapter run on the same axes.
"""

from __future__ import annotations

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


def _key_label(key: str, keys) -> str:
    """How a curve is told apart from the others in its panel: 'k1'/'k3' for kl/k1, kl/k3, but 'policy'/'value'
    for policy/clipfrac, value/clipfrac (their last parts are the same)."""
    if len(keys) == 1:
        return ""
    last = [k.split("/")[-1] for k in keys]
    return key.split("/")[0] if len(set(last)) < len(last) else key.split("/")[-1]


def plot_training_curves(runs, panels=PANELS, ncols: int = 5, width: float = 2.6, height: float = 2.1):
    """Draw `panels` for one or several runs; returns the matplotlib figure.

    `runs`: a path to `metrics.jsonl`, a list of records, or a dict `{label: path or records}`
    to overlay runs (e.g. four-model vs multi-adapter). The score panel shades ± one std.
    """
    import matplotlib.pyplot as plt

    from marlhf_edu.ppo.trainer import read_metrics

    if not isinstance(runs, dict):
        runs = {"": runs}
    runs = {label: (read_metrics(r) if not isinstance(r, list) else r) for label, r in runs.items()}
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, panels):
        for i, (label, records) in enumerate(runs.items()):
            steps = [r["step"] for r in records]
            for j, key in enumerate(keys):
                if not records or key not in records[0]:
                    continue
                name = " ".join(x for x in (label, _key_label(key, keys)) if x)
                ys = [r[key] for r in records]
                ax.plot(steps, ys, color=f"C{i}", ls=("-", "--", ":")[j % 3], lw=1.4, label=name or None)
                if key == "score/mean" and "score/std" in records[0]:
                    std = [r["score/std"] for r in records]
                    ax.fill_between(steps, [y - s for y, s in zip(ys, std)], [y + s for y, s in zip(ys, std)],
                                    color=f"C{i}", alpha=0.12)
        ax.set_title(title, fontsize=9)
        ax.tick_params(labelsize=7)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("PPO step", fontsize=8)
    fig.tight_layout()
    return fig
