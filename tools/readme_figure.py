"""The README's picture: the RLHF pipeline, and four models against one base with adapters (chapters 00, 10).

    python tools/readme_figure.py        # writes docs/figures/pipeline.png

Drawn with matplotlib (no data), so anyone can change it. The PNG is committed and no test runs this script:
after a change, run it and commit the new file. `tests/test_readme.py` checks that the README links to the file
and that it exists; `tests/test_site.py` that the site's front page shows the same file.
"""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "figures" / "pipeline.png"

STAGE, DATA, FROZEN, TRAINED, BASE = "#c6dbef", "#f0f0f0", "#d9d9d9", "#fdd0a2", "#bcbddc"


def box(ax, x, y, w, h, text, color, size=10, weight="normal"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08", fc=color, ec="#333333",
                                lw=1))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=size, weight=weight)


def arrow(ax, x0, y0, x1, y1):
    ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=14, lw=1.3, color="#333333"))


def draw() -> plt.Figure:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.2), gridspec_kw={"height_ratios": [1, 1.35]})
    for ax in (top, bottom):
        ax.set_xlim(0, 10), ax.set_ylim(0, 3), ax.axis("off")

    top.set_title("The pipeline (chapters 07, 08, 09-10)", loc="left", fontsize=12, weight="bold")
    stages = [(0.2, "1. SFT\nimitate good answers", "demonstrations"), (3.5, "2. Reward model\nscore an answer",
                                                                        "preference pairs\n(chosen, rejected)"),
              (6.8, "3. PPO or MA-PPO\nraise the score,\nstay near the SFT model", "prompts")]
    for i, (x, stage, data) in enumerate(stages):
        box(top, x, 0.25, 3.0, 1.45, stage, STAGE, size=10.5, weight="bold")
        box(top, x + 0.45, 2.15, 2.1, 0.7, data, DATA, size=9)
        arrow(top, x + 1.5, 2.13, x + 1.5, 1.72)
        if i:
            arrow(top, x - 0.28, 0.97, x - 0.02, 0.97)

    bottom.set_title("PPO holds four models; MA-PPO holds one base and switches LoRA adapters (chapter 10)",
                     loc="left", fontsize=12, weight="bold")
    for i, (name, color) in enumerate([("actor (policy)\ntrained", TRAINED), ("critic (value)\ntrained", TRAINED),
                                       ("reward model\nfrozen", FROZEN), ("reference\nfrozen", FROZEN)]):
        box(bottom, 0.2 + (i % 2) * 2.05, 1.55 - (i // 2) * 1.35, 1.9, 1.15, name, color, size=9.5)
    bottom.text(2.25, 0.02, "four copies of the weights", ha="center", fontsize=9.5, style="italic")
    box(bottom, 5.0, 0.35, 4.8, 0.8, "one base model, frozen (NF4-quantized at 7B)", BASE, size=10)
    for i, (name, color) in enumerate([("policy\nLoRA", TRAINED), ("value\nLoRA", TRAINED),
                                       ("reward\nLoRA", FROZEN)]):
        box(bottom, 5.15 + i * 1.6, 1.55, 1.35, 1.0, name, color, size=9.5)
        arrow(bottom, 5.82 + i * 1.6, 1.53, 5.82 + i * 1.6, 1.17)
    bottom.text(7.4, 2.8, "reference = the base with the adapters switched off", ha="center", fontsize=9.5,
                style="italic")
    bottom.text(7.4, 0.02, "trained: orange; frozen: grey, and the base in purple", ha="center", fontsize=9,
                color="#555555")
    fig.tight_layout()
    return fig


def main() -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    fig = draw()
    fig.savefig(OUT, dpi=110, metadata={"Software": None})
    print(f"{OUT.relative_to(ROOT)}: written")


if __name__ == "__main__":
    main()
