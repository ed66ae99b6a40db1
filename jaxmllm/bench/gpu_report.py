"""The GPU campaign's report (`jaxmllm.bench.gpu`): its rows as Markdown tables, one a part, and
what each case took."""

from __future__ import annotations

import copy

from jaxmllm.bench import profile
from jaxmllm.bench.attention import extrapolate
from jaxmllm.bench.table import cell


def report(rows: list[dict]) -> str:
    """Every part that has rows, in the campaign's order; then each case's time and end."""
    measured = [r for r in rows if r.get("kind") != "case"]
    by_part = {p: [r for r in measured if r["part"] == p] for p in PARTS}
    sections = [f(by_part[p]) for p, f in SECTIONS.items() if by_part[p]]
    ended = [r for r in rows if r.get("kind") == "case"]
    if ended:
        sections.append(cases(ended))
    return "\n\n".join(["# GPU campaign", *sections]) + "\n"


def cases(rows: list[dict]) -> str:
    """The report's table of cases: each one's seconds and how it ended (done, its error or why
    it was skipped)."""
    lines = ["case | seconds | end", "--- | --- | ---"]
    for r in rows:
        end = r.get("error") or r.get("skip") or "done"
        lines.append(f"{r['case']} | {r.get('seconds', '-')} | {end}")
    return "## Cases\n\n" + "\n".join(lines)


def env(rows: list[dict]) -> str:
    """The report's environment section from the env case's row: Python, jax and jaxlib, the
    devices and their memory, XLA_FLAGS, the peak TFLOP/s MFU is taken against, and the modules
    this Python lacks."""
    r = rows[-1]
    lines = [
        f"- Python {r.get('python', '?')}, jax {r['jax']} (jaxlib {r.get('jaxlib', '?')}) on "
        f"{r['devices']} x {r['device_kind']} ({r['backend']}), {r['memory_gib']:.1f} GiB for "
        f"JAX ({r.get('memory_fraction') or 'no memory share set'}), dense bf16 peak "
        f"{r['peak_tflops'] or '-'} TFLOP/s",
        f"- XLA_FLAGS: `{r['xla_flags'] or '(none)'}`",
        f"- missing here (carry as wheels): {', '.join(r['missing']) or 'nothing'}",
    ]
    return "## Environment\n\n" + "\n".join(lines)


def tests(rows: list[dict]) -> str:
    """The report's kernel-test section: per pytest run its passed, failed and skipped counts,
    and each failure."""
    lines = []
    for r in rows:
        counts = [f"{r.get(k, 0)} {k}" for k in ("passed", "failed", "skipped")]
        lines.append(f"- `pytest {r['tests']}` on {r['platform']}: {', '.join(counts)}")
        lines += [f"  - {failure}" for failure in r.get("failures", [])]
    return "## Kernel tests\n\n" + "\n".join(lines)


def attention(rows: list[dict]) -> str:
    """The report's attention table: per shape and row length, the block-sparse kernel's time,
    TFLOP/s and memory beside dense (extrapolated as T^2 past the rows it was measured at) and
    cuDNN, with cuDNN's error against it; a hybrid's linear layers' rows apart."""
    layers = [r for r in rows if "mixer" in r]  # (bench.linear's rows: a hybrid's two layers)
    rows = [r for r in rows if "mixer" not in r]
    cols = ["shape", "row", "docs", "tiles", "doc tiles", "sparse ms", "TFLOP/s", "sparse MiB"]
    cols += ["dense ms", "cudnn ms", "cudnn MiB", "cudnn err"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    ms = lambda s: "-" if s is None else f"{1e3 * s:.2f}"
    mib = lambda b: cell(b, ".0f", unit=2**20)
    rows = copy.deepcopy(rows)
    for shape in dict.fromkeys(r["shape"] for r in rows):
        extrapolate([r for r in rows if r["shape"] == shape])  # (dense past its measured rows)
    for r in rows:
        dense = ms(r.get("dense_s")) + ("" if r.get("dense_measured") else " (T^2 est.)")
        err = r.get("cudnn_err")
        cells = [r["shape"], str(r["row_len"]), str(r["docs"]), str(r["tiles"])]
        cells += [str(r["doc_tiles"]), ms(r["sparse_s"]), f"{r['tflops']:.1f}"]
        cells += [mib(r["sparse_bytes"]), dense, ms(r.get("cudnn_s")), mib(r.get("cudnn_bytes"))]
        lines.append(" | ".join([*cells, "-" if err is None else f"{err:.1e}"]))
    note = "Forward + backward of one bf16 row; TFLOP/s of the documents' own tiles, block-sparse."
    out = "## Attention kernels\n\n" + note + "\n\n" + "\n".join(lines)
    if layers:
        from jaxmllm.bench.linear import table

        note = (
            f"A {layers[0]['shape']}'s training step, one document a row, bf16: Gated DeltaNet "
            "(linear) against full attention (block-sparse)."
        )
        out += "\n\n### Linear against full attention\n\n" + note + "\n\n" + table(layers)
    return out


def recipe(rows: list[dict]) -> str:
    """The report's step table: per case the step time, real tokens/s, TFLOP/s a device, MFU,
    bucket fill, peak memory, recompute share, the profile's time by kernel category and the fp32
    x fp32 dots the step lowers to."""
    steps = [r for r in rows if r.get("kind") == "step"]
    profiles = {r["case"]: r for r in rows if r.get("kind") == "profile"}
    if not steps:
        return "## Recipe step\n\n(no step measured)"
    phases = sorted({p for r in steps for p in r.get("fill", {})})
    cats = [c for c, _ in profile.CATEGORIES] + ["other"]
    cols = ["case", "step s", "tokens/s", "TFLOP/s/dev", "MFU", *(f"fill {p}" for p in phases)]
    cols += ["peak GiB", "recompute %", *(f"{c} %" for c in cats), "f32 x f32 dots"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in steps:
        mfu, peak, fill = r.get("mfu"), r.get("peak_memory_gib"), r.get("fill", {})
        prof = profiles.get(r["case"])
        share = prof["profile"]["category_share"] if prof else {}
        cells = [r["case"], f"{r['step_time_s']:.3f}", f"{r['tokens_per_s']:.0f}"]
        cells += [f"{r['tflops_per_device']:.1f}", "-" if mfu is None else f"{mfu:.1%}"]
        cells += [f"{fill[p]:.0%}" if p in fill else "-" for p in phases]
        cells += ["-" if peak is None else f"{peak:.1f}", f"{100 * r['recompute_share']:.1f}"]
        cells += [f"{100 * share[c]:.1f}" if c in share else "-" for c in cats]
        cells.append(str(prof["hlo"]["dots"].get("f32 x f32 -> f32", 0)) if prof else "-")
        lines.append(" | ".join(cells))
    best = max(steps, key=lambda r: r["tflops_per_device"])
    head = (
        f"The recipe's per-GPU shapes on one {best['device_kind']}; MFU: model TFLOP/s of the "
        "real tokens and items over the device's dense bf16 peak; fill: each phase's real share "
        "of its buckets (`.../mixes`: samples of ChartQA's and AI2D's lengths, else the "
        "built-in data); the shares: device time per kernel category over a profile of two "
        "steps ('-': no profile)."
    )
    text = "## Recipe step\n\n" + head + "\n\n" + "\n".join(lines)
    best_profile = profiles.get(best["case"])
    if best_profile:
        text += f"\n\nTop kernels of {best['case']} (ms a step):\n\n"
        text += profile.table(best_profile["profile"])
    return text


def moe(rows: list[dict]) -> str:
    """The mixtures of experts' per-GPU steps: the recipe table's columns."""
    text = recipe(rows).replace("## Recipe step", "## Mixture-of-experts steps", 1)
    return text.replace(
        "The recipe's per-GPU shapes",
        "configs/gpu/qwen3_30b_a3b.yaml's (`moe/.../full`: 12 of 48 layers) and "
        "gemma4_26b_a4b.yaml's (30 layers, windows of 1024, LoRA) per-GPU expert work (16 "
        "experts, top-8)",
        1,
    )


def host(rows: list[dict]) -> str:
    """The report's host table: per data.workers the feed's seconds a step (plan, load, serial,
    overlapped) against the device's step, and the workers it would take to keep up."""
    cols = ["workers", "plan s", "load s", "serial s", "overlapped s", "device s", "workers needed"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        lines.append(
            " | ".join(
                [
                    str(r.get("workers", "-")),
                    f"{r['plan_s']:.3f}",
                    f"{r['load_s']:.3f}",
                    f"{r['serial_s']:.3f}",
                    f"{r['overlapped_s']:.3f}",
                    f"{r['device_s']:.3f}",
                    f"{r['workers_needed']:.1f}",
                ]
            )
        )
    return "## Host against the step (8-GPU host)\n\n" + "\n".join(lines)


def vlm(rows: list[dict]) -> str:
    """The vision-language recipes' per-GPU steps: the recipe table's columns."""
    text = recipe(rows).replace("## Recipe step", "## Vision-language recipes' steps", 1)
    return text.replace(
        "The recipe's per-GPU shapes",
        "configs/gpu/qwen3_vl_8b.yaml's (3 of its LLM's 36 layers), qwen3_vl_30b_a3b.yaml's "
        "(12 of 48 layers, 16 experts, top-8) and gemma3_4b.yaml's (6 of 34 layers, windows of "
        "1024) per-GPU shapes with images",
        1,
    )


SECTIONS = {
    "env": env,
    "tests": tests,
    "recipe": recipe,
    "attention": attention,
    "moe": moe,
    "vlm": vlm,
    "host": host,
}
PARTS = tuple(SECTIONS)
