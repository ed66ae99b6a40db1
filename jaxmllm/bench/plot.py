"""The balance bench's plot (`python -m jaxmllm.bench.balance --plot OUT.png`): per-device load
of one step, before and after balancing."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def plot_step(plan_items: list, out: Path, title: str, labels=("grain", "orchestrated")) -> bool:
    """Per-device LLM tokens and attention cost of one step: grain's packer vs. the balancer."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install 'jaxmllm[bench]'): no plot written")
        return False
    (before, items_b), (after, items_a) = plan_items
    fig, axes = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for plan, items, label in (
        (before, items_b, f"{labels[0]} (before)"),
        (after, items_a, f"{labels[1]} (after)"),
    ):
        d_n = items.caps.devices
        tok = np.bincount(
            plan.device[plan.micro == 0], items.llm[plan.samples[plan.micro == 0]], minlength=d_n
        )
        q = np.bincount(
            plan.device[plan.micro == 0],
            items.llm[plan.samples[plan.micro == 0]].astype(float) ** 2,
            minlength=d_n,
        )
        axes[0].plot(tok, label=label, drawstyle="steps-mid")
        axes[1].plot(q, label=label, drawstyle="steps-mid")
    axes[0].axhline(items_a.caps.llm_rows * items_a.caps.llm_row_len, color="k", lw=0.5)
    axes[0].set_ylabel("LLM tokens")
    axes[0].set_ylim(bottom=0)
    axes[1].set_ylabel("LLM attention (sum n^2)")
    axes[1].set_xlabel("device (microbatch 0)")
    axes[0].legend()
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return True
