"""`python -m jaxmllm.hf {import,export,check}`: HuggingFace checkpoints in and out.

python -m jaxmllm.hf import --model DIR --out CONFIG.yaml      # a whole LLaVA, Qwen2-VL, ...
python -m jaxmllm.hf import --llm DIR [--vision DIR] [--audio DIR] --out CONFIG.yaml
python -m jaxmllm.train --config CONFIG.yaml           # starts from those weights
python -m jaxmllm.hf import --model DIR --adapter PEFT_DIR --out CONFIG.yaml  # + its LoRA
python -m jaxmllm.hf export RUN_DIR --out DIR [--step N] [--merged]
python -m jaxmllm.hf check DIR                          # our model vs transformers
python -m jaxmllm.hf check DIR --data my_records.jsonl  # ... on your own records
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys

from jaxmllm.config.command import configure_logging, run
from jaxmllm.hf.family import FamilyError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.hf",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="write a training config that starts from checkpoints")
    which = imp.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--model",
        default="",
        help="a whole multimodal checkpoint: LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen3-VL(-MoE), "
        "Qwen3.5(-MoE) or Qwen2-Audio (its LLM, encoders, projectors)",
    )
    which.add_argument(
        "--llm",
        default="",
        help="a causal LM directory: Llama, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Qwen3.5(-MoE)",
    )
    imp.add_argument(
        "--vision", default="", help="a SigLIP, CLIP or Qwen2(.5)-VL / Qwen3-VL directory"
    )
    imp.add_argument("--audio", default="", help="a Whisper directory")
    imp.add_argument("--tokenizer", default="", help="the tokenizer directory (default: --llm)")
    imp.add_argument(
        "--adapter",
        default="",
        help="a PEFT LoRA adapter of the checkpoint to start from: model.*.lora and "
        "model.init_from.adapter follow it",
    )
    imp.add_argument("--out", required=True, help="the config YAML to write")
    imp.add_argument(
        "--base",
        default="",
        help="a recipe whose other keys to keep (configs/recipes/stage1.yaml, stage2.yaml)",
    )
    exp = sub.add_parser("export", help="write a run's parameters as HF directories")
    exp.add_argument("run_dir", help="a training run's train.output_dir")
    exp.add_argument(
        "--out",
        required=True,
        help="the directory to write (new or empty): the "
        "whole checkpoint, or llm/, vision/, audio/ for a run built from parts",
    )
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    exp.add_argument("--max-shard-gb", type=float, default=4.0, help="safetensors shard size")
    exp.add_argument(
        "--merged",
        action="store_true",
        help="a run with LoRA adapters: the whole model with them merged (default: PEFT adapters)",
    )
    chk = sub.add_parser(
        "check",
        help="compare our model with transformers, samples packed into one row as training "
        "packs them, each against transformers on it alone (random ones, or --data records)",
    )
    chk.add_argument("directory", help="a HF model directory")
    chk.add_argument(
        "--role",
        choices=("llm", "vision", "audio", "model"),
        default="",
        help="one part's figures (model: a whole checkpoint's, with its media)",
    )
    chk.add_argument("--tokens", type=int, default=64, help="decoder input length")
    chk.add_argument("--tolerance", type=float, default=1e-3, help="exit 1 above this")
    chk.add_argument(
        "--adapter",
        default="",
        help="a PEFT LoRA adapter on both models (ours "
        "as hf import --adapter reads it, transformers' by peft)",
    )
    chk.add_argument(
        "--one-per-row",
        action="store_true",
        help="each sample in a row of its own (default: several packed into one row, as "
        "training packs them, each compared with transformers on it alone)",
    )
    chk.add_argument(
        "--data",
        default="",
        metavar="FILE",
        help="your own records (a data file in any data.format, its media beside it): its "
        "first records preprocessed as hf import's config would, instead of random samples; "
        "preference pairs: each pair's chosen and rejected completion log-prob sums",
    )
    chk.add_argument("--json", action="store_true", help="print the figures as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The command line; its exit code (1: `check` above --tolerance; 2: a checkpoint, run or
    config to fix, said in one line: `jaxmllm.config.command`)."""
    return run(_command, argv)


def _command(argv: list[str] | None) -> int:
    configure_logging(logging.WARNING, ours=logging.INFO)  # (not orbax's and absl's chatter)
    args = parse_args(argv)
    if args.command == "import":
        from jaxmllm.hf.importer import write_config

        if args.model and (args.vision or args.audio):
            raise FamilyError("--model brings its own encoders: leave out --vision / --audio")
        command = shlex.join(
            ["python", "-m", "jaxmllm.hf", *(sys.argv[1:] if argv is None else argv)]
        )
        write_config(
            args.out,
            args.llm,
            args.vision,
            args.audio,
            args.base,
            args.tokenizer,
            model=args.model,
            adapter=args.adapter,
            command=command,
        )
        print(f"wrote {args.out}; train with: python -m jaxmllm.train --config {args.out}")
    elif args.command == "export":
        from jaxmllm.hf.export import export_run

        shard_bytes = int(args.max_shard_gb * (1 << 30))
        written = export_run(args.run_dir, args.out, args.step, shard_bytes, merged=args.merged)
        for role, path in written.items():
            print(f"{role}: {path}")
    else:
        from jaxmllm.hf.check import describe
        from jaxmllm.hf.check_whole import check_all

        results = check_all(
            args.directory,
            args.role,
            args.tokens,
            adapter=args.adapter,
            packed=not args.one_per_row,
            data=args.data,
        )
        for result in results:
            print(json.dumps(result) if args.json else describe(result))
        return 0 if max(r["max_abs_diff"] for r in results) <= args.tolerance else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
