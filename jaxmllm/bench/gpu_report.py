"""The GPU campaign's report (`jaxmllm.bench.gpu`): its rows as Markdown tables, one a part."""

from __future__ import annotations

from jaxmllm.bench import profile


def report(rows: list[dict]) -> str:
    """Every part that has rows, in the campaign's order; failed cases listed last."""
    by_part = {p: [r for r in rows if r["part"] == p and "error" not in r] for p in PARTS}
    sections = [f(by_part[p]) for p, f in SECTIONS.items() if by_part[p]]
    failed = [r for r in rows if "error" in r]
    if failed:
        sections.append("## Failed\n\n" + "\n".join(f"- {r['case']}: {r['error']}" for r in failed))
    return "\n\n".join(["# GPU campaign", *sections]) + "\n"


def env(rows: list[dict]) -> str:
    r = rows[-1]
    lines = [
        f"- jax {r['jax']} on {r['devices']} x {r['device_kind']} ({r['backend']}), "
        f"{r['memory_gib']:.1f} GiB, dense bf16 peak {r['peak_tflops'] or '-'} TFLOP/s",
        f"- XLA_FLAGS: `{r['xla_flags'] or '(none)'}`",
        f"- missing here (carry as wheels): {', '.join(r['missing']) or 'nothing'}",
    ]
    return "## Environment\n\n" + "\n".join(lines)


def attention(rows: list[dict]) -> str:
    cols = ["shape", "row", "docs", "tiles", "doc tiles", "sparse ms", "TFLOP/s", "sparse MiB"]
    cols += ["dense ms", "cudnn ms", "cudnn MiB", "cudnn err"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    ms = lambda s: "-" if s is None else f"{1e3 * s:.2f}"
    mib = lambda b: "-" if b is None else f"{b / 2**20:.0f}"
    for r in rows:
        dense = ms(r.get("dense_s")) + ("" if r.get("dense_measured") else " (T^2 est.)")
        err = r.get("cudnn_err")
        lines.append(
            " | ".join(
                [
                    r["shape"],
                    str(r["row_len"]),
                    str(r["docs"]),
                    str(r["tiles"]),
                    str(r["doc_tiles"]),
                    ms(r["sparse_s"]),
                    f"{r['tflops']:.1f}",
                    mib(r["sparse_bytes"]),
                    dense,
                    ms(r.get("cudnn_s")),
                    mib(r.get("cudnn_bytes")),
                    "-" if err is None else f"{err:.1e}",
                ]
            )
        )
    note = "Forward + backward of one bf16 row; TFLOP/s of the documents' own tiles, block-sparse."
    return "## Attention kernels\n\n" + note + "\n\n" + "\n".join(lines)


def recipe(rows: list[dict]) -> str:
    cols = ["case", "step s", "tokens/s", "TFLOP/s/dev", "MFU", "peak GiB", "recompute %"]
    cats = [c for c, _ in profile.CATEGORIES] + ["other"]
    cols += [f"{c} %" for c in cats] + ["f32 x f32 dots"]
    lines = [" | ".join(cols), " | ".join("---" for _ in cols)]
    for r in rows:
        share = r["profile"]["category_share"]
        dots = r["hlo"]["dots"].get("f32 x f32 -> f32", 0)
        mfu, peak = r.get("mfu"), r.get("peak_memory_gib")
        lines.append(
            " | ".join(
                [
                    r["case"],
                    f"{r['step_time_s']:.3f}",
                    f"{r['tokens_per_s']:.0f}",
                    f"{r['tflops_per_device']:.1f}",
                    "-" if mfu is None else f"{mfu:.1%}",
                    "-" if peak is None else f"{peak:.1f}",
                    f"{100 * r['recompute_share']:.1f}",
                    *(f"{100 * share[c]:.1f}" for c in cats),
                    str(dots),
                ]
            )
        )
    best = max(rows, key=lambda r: r["tflops_per_device"])
    head = (
        f"The recipe's per-GPU shapes on one {best['device_kind']}; MFU: model TFLOP/s of the "
        "real tokens and items over the device's dense bf16 peak; the shares: device time per "
        "kernel category over a profile of two steps."
    )
    top = f"Top kernels of {best['case']} (ms a step):\n\n" + profile.table(best["profile"])
    return "## Recipe step\n\n" + head + "\n\n" + "\n".join(lines) + "\n\n" + top


def moe(rows: list[dict]) -> str:
    """The mixture of experts' per-GPU step: the recipe table's columns."""
    text = recipe(rows).replace("## Recipe step", "## Mixture-of-experts step", 1)
    return text.replace(
        "The recipe's per-GPU shapes",
        "configs/gpu/qwen3_30b_a3b.yaml's per-GPU expert work (16 experts, top-8, 12 layers)",
        1,
    )


def host(rows: list[dict]) -> str:
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


def qwen3_vl(rows: list[dict]) -> str:
    """The Qwen3-VL recipes' per-GPU steps: the recipe table's columns."""
    text = recipe(rows).replace("## Recipe step", "## Qwen3-VL steps", 1)
    return text.replace(
        "The recipe's per-GPU shapes",
        "configs/gpu/qwen3_vl_8b.yaml's (6 of its LLM's 36 layers) and qwen3_vl_30b_a3b.yaml's "
        "(12 of 48 layers, 16 experts, top-8) per-GPU shapes with images, DeepStack",
        1,
    )


SECTIONS = {
    "env": env,
    "attention": attention,
    "recipe": recipe,
    "moe": moe,
    "qwen3_vl": qwen3_vl,
    "host": host,
}
PARTS = tuple(SECTIONS)
