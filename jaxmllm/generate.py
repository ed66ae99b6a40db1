"""Generate from a trained model: `python -m jaxmllm.generate --run RUN_DIR --prompt TEXT`.

    python -m jaxmllm.generate --run runs/tiny --image cat.png --prompt "what is this? "
    python -m jaxmllm.generate --run runs/tiny --video clip.mp4 --prompt "which way does it move? "
    python -m jaxmllm.generate --run runs/tiny --prompt "12 13 14" --prompt "3 4" --json
    python -m jaxmllm.generate --run runs/tiny --step 100 --prompt-ids 257,49,50 --json
    python -m jaxmllm.generate --hf Qwen2-VL-2B-Instruct --image cat.png --prompt "What is this?"

A `Generator` (`jaxmllm.step.generate`) holds two compiled programs for fixed shapes
(`jaxmllm.batch.prompts.PromptShapes`):
prefill (the prompts with their images and clips, encoded as in training) and a decode step (one
token per row against the KV cache, `jaxmllm.models.decode`). Greedy at temperature 0 (the
default), else temperature and nucleus (top-p) sampling from `--seed`. Prompts of different
lengths are decoded together, right-padded; each row stops at the template's stop ids (kept as
the last id of `ids`, left out of `text`) or after `--max-new-tokens`. With `--json` each
prompt's answer is printed as one JSON object a line: {"ids": [...], "text": "..."}, with
`--logprobs N` each new id's log-probability and the N likeliest ids' too; `--logits FILE.npz`
saves every new id's logits (what `hf check` compares, on the tokens generation picks).

The run's own config (`<run>/config.json`) rebuilds the model, its checkpoint's parameters are
restored (latest, or `--step`; no optimizer state), and the prompt is rendered by the run's
tokenizer and template (`jaxmllm.data.text.template`): `plain` for the built-in data, `chat` for
`messages` data; `--template` picks one.

`--hf DIR` generates from a HuggingFace checkpoint directory instead (any family `hf import`
reads; `--hf-vision` / `--hf-audio` add encoder checkpoints, a whole LLaVA, Qwen2-VL,
Qwen2.5-VL or Qwen2-Audio brings its own):
the model `hf import` would configure, its weights on one device in fp32, and the directory's
tokenizer (`--tokenizer` for another), whose chat template renders a `--prompt` (`auto`) and
whose end-of-turn and end-of-sequence ids stop the answer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

import jax
import numpy as np

from jaxmllm.batch.prompts import PromptShapes
from jaxmllm.config import Config, ConfigError, from_dict
from jaxmllm.config.command import configure_logging, run
from jaxmllm.config.phases import KINDS
from jaxmllm.data.samples import Sample
from jaxmllm.data.text.template import TEMPLATES, Template, make_template
from jaxmllm.hf.start import run_parameters
from jaxmllm.step.generate import Generator, beyond_memory, check_prompt_ids, prefill_kind
from jaxmllm.step.program import split_frozen

# ----------------------------------------------------------------------------- a run


def load_run(run_dir: str | Path, step: int | None = None) -> tuple[Config, dict, int]:
    """A training run's config and the parameters of its checkpoint `step` (None: the latest):
    (config, {"params": ..., "frozen": ...} on the default device, step).

    Raises:
      ConfigError: no run (config.json) or no such checkpoint there.
    """
    path = Path(run_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except OSError:
        raise ConfigError(f"--run {run_dir}: no config.json (is it a train.output_dir?)") from None
    cfg = from_dict(Config, raw, source=str(path))
    # (a run with LoRA adapters: its base read again, as its training read it)
    step, params, frozen = run_parameters(cfg, Path(run_dir), step)
    return cfg, jax.device_put({"params": params, "frozen": frozen}), step


def load_hf(args) -> tuple[Config, dict]:
    """The model of `--hf` (with `--hf-vision`, `--hf-audio`, `--tokenizer`): its config and
    parameters, as `load_run` gives a run's. A whole checkpoint (LLaVA, Qwen2-VL, Qwen2.5-VL,
    Qwen2-Audio) brings its encoder and projector unless `--hf-vision` / `--hf-audio` name
    another.

    Raises:
      ConfigError: a directory that is no checkpoint jaxmllm reads, or has no tokenizer.
    """
    from jaxmllm.hf.registry import read_hf_config, roles_of
    from jaxmllm.hf.towers import load_model

    try:
        own = roles_of(read_hf_config(args.hf))  # (a whole checkpoint's parts)
        vision = args.hf_vision or (args.hf if "vision" in own else "")
        audio = args.hf_audio or (args.hf if "audio" in own else "")
        tokenizer = Path(args.tokenizer or args.hf)
        if not (tokenizer / "tokenizer.json").is_file():
            raise ConfigError(
                f"--hf: {tokenizer} has no tokenizer.json: name the checkpoint's "
                "tokenizer directory with --tokenizer DIR"
            )
        cfg, model = load_model(args.hf, vision, audio, tokenizer=str(tokenizer))
    except ValueError as e:  # (FamilyError, CheckpointError: they name the file)
        raise ConfigError(f"--hf: {e}") from None
    params, frozen = split_frozen(cfg, model)
    return cfg, {"params": params, "frozen": frozen}


def taking_videos(cfg: Config) -> Config:
    """`cfg` with its vision encoder taking videos (`model.vision.video`: a patch carries
    temporal_patch frames; the parameters are the same)."""
    vision = dataclasses.replace(cfg.model.vision, video=True)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vision=vision))


def answer_prompts(
    cfg: Config, params: dict, template: Template, prompts: list[Sample], args
) -> list[dict]:
    """The CLI's answers: {"ids", "text"} per prompt, all prompts in one batch; with
    `--logprobs N` each new id's log-probability and the N likeliest ids' ("logprobs",
    "top_logprobs"); with `--logits FILE` every new id's logits, saved there."""
    check_prompt_ids(prompts, cfg.model.llm.vocab_size)  # (before anything is compiled)
    shapes = PromptShapes.fit(prompts, cfg, args.max_new_tokens)
    check_memory(cfg, shapes, max(len(p.tokens) for p in prompts), args.max_new_tokens)
    gen = Generator(cfg, shapes, template.specials)
    scores = bool(args.logprobs or args.logits)
    answers = gen.generate(
        params["params"],
        params["frozen"],
        prompts,
        max_new_tokens=args.max_new_tokens,
        stop_ids=frozenset(template.specials.stop),
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        keep_logits=scores,
    )
    out = [{"ids": a.ids, "text": template.decode(a.ids)} for a in answers]
    if args.logprobs:
        for answer, a in zip(out, answers, strict=True):
            answer.update(logprobs(a.ids, a.logits, args.logprobs))
    if args.logits:  # (prompt k's [new ids, vocab] float32 as `answer_<k>`)
        arrays = {f"answer_{k}": np.stack(a.logits) for k, a in enumerate(answers)}
        np.savez(args.logits, **arrays)
    return out


def check_memory(cfg: Config, shapes: PromptShapes, longest: int, new: int) -> None:
    """Refuses prompts whose prefill scores and KV cache (`held_bytes`) need more than the
    devices' memory, before allocating any: a long prompt failed in a traceback after trying
    to allocate them (42 GB)."""
    if short := beyond_memory(cfg, shapes):
        need, have = short
        dense = "prefill scores the prompt densely and " if prefill_kind(cfg) == "dense" else ""
        raise ConfigError(
            f"{longest} prompt tokens + --max-new-tokens {new}: {dense}the cache holds "
            f"{shapes.total_len} positions, at least "
            f"{_bytes(need)}, more than the {_bytes(have)} of memory here; shorten the prompt "
            "(or lower --max-new-tokens)"
        )


def _bytes(n: int) -> str:
    """'42.1 GB', '64.0 TB'."""
    return f"{n / 1e12:.1f} TB" if n >= 1e12 else f"{n / 1e9:.1f} GB"


def logprobs(ids: list[int], logits: list[np.ndarray], top: int) -> dict:
    """Each new id's log-probability under its step's logits (their log-softmax, float64),
    and the `top` likeliest ids' at each step ({id: log-probability}, likeliest first)."""
    chosen, best = [], []
    for i, scores in zip(ids, logits, strict=True):
        x = np.asarray(scores, np.float64)
        lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        chosen.append(float(lp[i]))
        order = np.argsort(-lp, kind="stable")[:top]
        best.append({str(int(j)): float(lp[j]) for j in order})
    return {"logprobs": chosen, "top_logprobs": best}


def prompt_ids(text: str) -> list[int]:
    """The ids of one `--prompt-ids` ("257,49,50")."""
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise ConfigError(f"--prompt-ids {text!r}: give comma-separated token ids") from None


def request_prompts(template: Template, args) -> list[Sample]:
    """The prompts of the command line, with their media files (see `--help`)."""
    texts = args.prompt or []
    ids = [prompt_ids(s) for s in args.prompt_ids or []]
    media = {k.name: list(getattr(args, k.item)) for k in KINDS}  # (--image, --audio, --video)
    several = len(texts) + len(ids) > 1
    if several and any(media.values()):
        flags = " / ".join(f"--{k.item}" for k in KINDS)
        marks = " / ".join(k.placeholder for k in KINDS)
        if ids:
            raise ConfigError(
                f"{flags} go with one --prompt-ids, or with --prompt texts that "
                f"place them with {marks}"
            )
        if any(sum(t.count(k.placeholder) for t in texts) != len(media[k.name]) for k in KINDS):
            raise ConfigError(
                f"with several prompts, place each of {flags} with a {marks} placeholder in the "
                "prompt it belongs to (they are handed out in order)"
            )
    prompts = []
    for text in texts:
        take = {k.name: text.count(k.placeholder) if several else len(media[k.name]) for k in KINDS}
        prompts.append(template.prompt(text, {k: files[: take[k]] for k, files in media.items()}))
        media = {k: files[take[k] :] for k, files in media.items()}
    every = {k.name: list(getattr(args, k.item)) for k in KINDS}
    prompts += [template.prompt_ids(i, every) for i in ids]
    return prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line of `python -m jaxmllm.generate`: the model (a run or a HF checkpoint),
    prompts, media and sampling options."""
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--run", help="a training run's train.output_dir")
    model.add_argument("--hf", metavar="DIR", help="a HuggingFace checkpoint directory (its LLM)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--hf-vision", default="", metavar="DIR", help="with --hf: a vision tower")
    p.add_argument("--hf-audio", default="", metavar="DIR", help="with --hf: an audio encoder")
    p.add_argument(
        "--tokenizer",
        default="",
        metavar="DIR",
        help="with --hf: its tokenizer directory (default: the --hf one)",
    )
    for kind in KINDS:  # --image, --audio, --video: each kind of media's files
        p.add_argument(
            f"--{kind.item}",
            action="extend",
            nargs="+",
            default=[],
            metavar="PATH",
            help=f"{kind.item} file(s), in order of the {kind.placeholder} placeholders",
        )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="a prompt (repeat for a batch); without placeholders the media come first",
    )
    what.add_argument(
        "--prompt-ids",
        action="append",
        metavar="IDS",
        help="a prompt as comma-separated token ids, used as is (repeat for a "
        "batch); image / audio placeholder ids: one per encoder row",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's mass")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument(
        "--template",
        choices=TEMPLATES,
        default="auto",
        help="how a --prompt is rendered: chat (user turn, assistant marker), "
        "plain (the text to continue); auto: as the run's data",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per prompt: ids, text")
    p.add_argument(
        "--logprobs",
        type=int,
        default=0,
        metavar="N",
        help="with --json: each new id's log-probability and the N likeliest ids' at each step",
    )
    p.add_argument(
        "--logits",
        default="",
        metavar="FILE.npz",
        help="save each prompt's logits of every new id there ([new ids, vocab] float32)",
    )
    args = p.parse_args(argv)
    if args.run and (args.hf_vision or args.hf_audio or args.tokenizer):
        p.error("--hf-vision, --hf-audio and --tokenizer go with --hf (a run has its own)")
    if args.hf and args.step is not None:
        p.error("--step goes with --run")
    if args.logprobs < 0 or (args.logprobs and not args.json):
        p.error("--logprobs N (N >= 1) goes with --json")
    if args.max_new_tokens < 1 or args.temperature < 0 or not 0 < args.top_p <= 1:
        p.error("--max-new-tokens must be >= 1, --temperature >= 0, --top-p in (0, 1]")
    return args


def main(argv: list[str] | None = None) -> int:
    """The command line; its exit code (2: a run, checkpoint, prompt or file to fix, said in
    one line: `jaxmllm.config.command`)."""
    return run(_command, argv)


def _command(argv: list[str] | None) -> None:
    """Generates and prints the answers (one JSON object each with --json) to the prompts asked,
    from a run's checkpoint or a HF checkpoint; errors are `main`'s to report."""
    configure_logging(logging.WARNING)  # (record ids and file names in messages: escaped)
    args = parse_args(argv)
    if args.hf:
        cfg, params = load_hf(args)
    else:
        cfg, params, _ = load_run(args.run, args.step)
    if args.video:
        cfg = taking_videos(cfg)
    template = make_template(cfg, args.template, pretrained=bool(args.hf))
    answers = answer_prompts(cfg, params, template, request_prompts(template, args), args)
    for i, answer in enumerate(answers):
        if args.json:
            print(json.dumps(answer))
        else:
            print(answer["text"] if len(answers) == 1 else f"[{i}] {answer['text']}")


if __name__ == "__main__":
    sys.exit(main())
