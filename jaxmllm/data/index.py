"""The lengths index of a manifest: one offline pass, then training plans from it.

    python -m jaxmllm.data.index --manifest data/train.jsonl --config configs/manifest_example.yaml

reads every record once (media sizes from file headers: PIL reads the size without decoding,
soundfile the duration), in parallel, and writes to `--out` (default `<manifest>.index/`):

- `lengths.jsonl`: one line per accepted record, in the DESIGN lengths format plus where the
  record is (`id`, `row`, `line`) and its media sizes (`image_sizes`, `audio_samples`), which let
  the oversize policy repair a sample at start-up without touching the media;
- `summary.json`: counts, per-modality percentiles, suggested per-device capacities, the
  preprocessing parameters the counts depend on (training checks them), rejects by reason;
- `rejects.jsonl`: every rejected record with its id, line and reason.

Training's row i is the i-th accepted record; rejected records are never planned.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from jaxmllm.config import Config, ConfigError, load_config
from jaxmllm.data.audio import read_info
from jaxmllm.data.capacity import suggest_capacities
from jaxmllm.data.image import read_size
from jaxmllm.data.manifest import ManifestSource, sizes_of
from jaxmllm.data.preprocess import Limits, Params, Preprocessor, Sizes
from jaxmllm.data.records import open_records, read_record
from jaxmllm.data.rejects import DataError, RecordError, fail_message
from jaxmllm.data.samples import LengthsIndex
from jaxmllm.data.tokenizer import make_tokenizer

# ----------------------------------------------------------------------------- building


def default_index_dir(path: str | Path) -> Path:
    return Path(f"{path}.index")


def measure(records, pre: Preprocessor, k: int, decode: bool = False) -> dict:
    """Record k's index row ({"ok": True, ...counts}) or its reject ({"ok": False, ...})."""
    line = 0
    try:
        obj, line = records.raw(k)
        record = read_record(records, k)
        sizes = Sizes(
            images=[read_size(src, record.id, pre.p.max_image_pixels) for src in record.images],
            audio=[read_info(src, record.id, pre.p.max_audio_seconds) for src in record.audio],
        )
        for j, (samples, rate) in enumerate(sizes.audio):
            if not pre.clip_chunks(samples, rate):
                raise RecordError("audio_too_short", f"clip {j}: {samples / rate:.3f} s", record.id)
        if decode:  # full decode: catches files whose header is fine but whose data is not
            pre.sample(k, record, sizes, Limits())
        counts = pre.layout(record, sizes).counts(pre.p.merge**2)
    except RecordError as e:
        return {"ok": False, **e.to_json(line=line, row=k)}
    return {
        "ok": True,
        **counts,
        "id": record.id,
        "row": k,
        "line": line,
        "image_sizes": [list(s) for s in sizes.images],
        "audio_samples": [list(s) for s in sizes.audio],
    }


_worker: dict = {}


def _init_worker(records, params: Params, decode: bool) -> None:
    _worker.update(records=records, pre=Preprocessor(params), decode=decode)


def _measure_chunk(ks: list[int]) -> list[dict]:
    return [measure(_worker["records"], _worker["pre"], k, _worker["decode"]) for k in ks]


def build_index(
    cfg: Config,
    path: str | Path,
    out: str | Path | None = None,
    *,
    workers: int = 0,
    decode: bool = False,
    progress: bool = True,
) -> dict:
    """Indexes the JSONL manifest or .array_record file at `path`; returns the summary."""
    from tqdm import tqdm

    params = Params.from_config(cfg)
    records = open_records(path)
    out = Path(out) if out else default_index_dir(path)
    chunks = [list(range(a, min(a + 64, len(records)))) for a in range(0, len(records), 64)]
    bar = tqdm(total=len(records), desc="index", unit="rec", disable=not progress)
    results: list[dict] = []
    if workers > 0:
        ctx = multiprocessing.get_context("spawn")  # safe even if JAX threads are running
        with ctx.Pool(workers, _init_worker, (records, params, decode)) as pool:
            for part in pool.imap(_measure_chunk, chunks):
                results += part
                bar.update(len(part))
    else:
        _init_worker(records, params, decode)
        for chunk in chunks:
            results += _measure_chunk(chunk)
            bar.update(len(chunk))
    bar.close()
    rows, rejects = _dedupe(results)
    return _write(cfg, params, Path(path), out, rows, rejects)


def _dedupe(results: list[dict]) -> tuple[list[dict], list[dict]]:
    rows, rejects, seen = [], [], set()
    for r in results:
        ok = r.pop("ok")
        if ok and r["id"] in seen:
            ok, r = (
                False,
                {
                    **RecordError("duplicate_id", "seen on an earlier line", r["id"]).to_json(),
                    "line": r["line"],
                    "row": r["row"],
                },
            )
        if ok:
            seen.add(r["id"])
        (rows if ok else rejects).append(r)
    return rows, rejects


def _write(cfg, params, path: Path, out: Path, rows, rejects) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "lengths.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    with open(out / "rejects.jsonl", "w") as f:
        for r in rejects:
            f.write(json.dumps(r) + "\n")
    summary = summarize(cfg, rows, rejects)
    summary.update(
        data=str(path.absolute()),
        data_bytes=path.stat().st_size,
        params=params.counted(),
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def summarize(cfg: Config, rows: list[dict], rejects: list[dict]) -> dict:
    """Counts, percentiles per modality and suggested per-device capacities."""
    index = LengthsIndex.from_records(rows)
    merge_area, sub = cfg.model.vision.merge**2, cfg.model.audio.subsample
    llm = index.llm_tokens(merge_area, sub)
    stats = {
        "text_tokens": index.text,
        "llm_tokens": llm,
        "patches_per_image": index.images,
        "images_per_sample": np.diff(index.images_ptr),
        "frames_per_clip": index.audio,
        "clips_per_sample": np.diff(index.audio_ptr),
    }
    b = cfg.batch
    suggestion = (
        suggest_capacities(index, b.llm_rows * b.llm_row_len, merge_area, sub, max_row_len=None)
        if len(index)
        else None
    )
    return {
        "records": len(rows) + len(rejects),
        "accepted": len(rows),
        "rejected": len(rejects),
        "rejects": dict(Counter(r["reason"] for r in rejects)),
        "percentiles": {k: _percentiles(v) for k, v in stats.items()},
        "suggested_capacities": suggestion.batch_overrides() if suggestion else {},
    }


def _percentiles(v: np.ndarray) -> dict:
    if not len(v):
        return {"count": 0}
    q = np.percentile(v, [50, 90, 99])
    return {
        "count": int(len(v)),
        "total": int(v.sum()),
        "mean": round(float(v.mean()), 2),
        "p50": float(q[0]),
        "p90": float(q[1]),
        "p99": float(q[2]),
        "max": int(v.max()),
    }


# ----------------------------------------------------------------------------- loading


def index_command(cfg: Config, out: Path) -> str:
    return (
        f"python -m jaxmllm.data.index --manifest {cfg.data.path} --out {out} "
        "--config <this config>"
    )


def load_index(cfg: Config) -> tuple[list[dict], dict]:
    """The index rows and summary for data.path, checked against the config and the file."""
    d = cfg.data
    out = Path(d.index_dir) if d.index_dir else default_index_dir(d.path)
    if not Path(d.path).exists():
        raise ConfigError(f"data.path: no such file {d.path!r}")
    if not (out / "summary.json").exists():
        raise ConfigError(
            f"no lengths index for {d.path} in {out}/ (data.index_dir). Build it once with:\n"
            f"  {index_command(cfg, out)}"
        )
    summary = json.loads((out / "summary.json").read_text())
    want = Params.from_config(cfg).counted()
    diff = [f"{k}: index {summary['params'].get(k)!r}, config {v!r}" for k, v in want.items()
            if summary["params"].get(k) != v]  # fmt: skip
    if diff:
        raise ConfigError(
            f"the index in {out}/ was built with other preprocessing settings ({'; '.join(diff)})."
            f" Rebuild it:\n  {index_command(cfg, out)}"
        )
    if summary.get("data_bytes") != Path(d.path).stat().st_size:
        raise ConfigError(
            f"{d.path} changed since its index in {out}/ was built. Rebuild it:\n"
            f"  {index_command(cfg, out)}"
        )
    with open(out / "lengths.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return rows, summary


def open_source(cfg: Config) -> ManifestSource:
    """The training source of data.path: index loaded and checked, oversize policy applied."""
    tokenizer = make_tokenizer(cfg.data.tokenizer)
    if cfg.model.llm.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.llm.vocab_size={cfg.model.llm.vocab_size} is smaller than the tokenizer "
            f"({cfg.data.tokenizer}: {tokenizer.vocab_size} ids incl. the 8 reserved specials); "
            f"raise model.llm.vocab_size to at least {tokenizer.vocab_size}"
        )
    rows, summary = load_index(cfg)
    if cfg.data.on_error == "fail" and summary.get("rejected"):
        out = Path(cfg.data.index_dir) if cfg.data.index_dir else default_index_dir(cfg.data.path)
        first = json.loads((out / "rejects.jsonl").read_text().splitlines()[0])
        err = RecordError(first["reason"], first["detail"], first["id"])
        raise DataError(
            fail_message(err, "data.on_error", f"line {first['line']}")
            + f" ({summary['rejected']} rejected records in all: {out}/rejects.jsonl)"
        )
    pre = Preprocessor(Params.from_config(cfg), tokenizer)
    records = open_records(cfg.data.path)
    kept, limits, startup = apply_oversize(cfg, rows, records, pre)
    source = ManifestSource(records, pre, kept, limits)
    source.startup_rejects = startup
    source.index_rejects = dict(summary.get("rejects", {}))
    return source


# ----------------------------------------------------------------------------- oversize


def bucket_limits(cfg: Config) -> Limits:
    """What one sample may use: the LLM row always; encoder buckets when their size is fixed
    (`batch.capacity: auto` sizes them from the data, so they always fit)."""
    b, m = cfg.batch, cfg.model
    fixed = b.capacity == "fixed"
    return Limits(
        max_tokens=b.llm_row_len,
        max_patches=b.vision_patches if fixed and m.vision.enabled else None,
        max_frames=b.audio_frames if fixed and m.audio.enabled else None,
    )


def apply_oversize(cfg: Config, rows: list[dict], records, pre: Preprocessor):
    """Applies data.on_oversize to rows no bucket can hold.

    Returns (kept rows, their repairs by new row number, reject entries). shrink lowers the
    image pixel budget until the sample fits, then trims audio and cuts the sequence; truncate
    only trims and cuts; skip drops the record; fail stops naming it.
    """
    caps, policy = bucket_limits(cfg), cfg.data.on_oversize
    need = _needs(LengthsIndex.from_records(rows), pre)
    over = np.zeros(len(rows), bool)
    for key, values in need.items():
        cap = getattr(caps, key)
        if cap is not None:
            over |= values > cap
    kept, limits, rejects = [], {}, []
    for i, row in enumerate(rows):
        if not over[i]:
            kept.append(row)
            continue
        what = ", ".join(
            f"{need[k][i]} {k[4:]} > batch.{_KEYS[k]}={getattr(caps, k)}"
            for k in need
            if getattr(caps, k) is not None and need[k][i] > getattr(caps, k)
        )
        err = RecordError("oversize", what, row["id"])
        if policy == "fail":
            raise DataError(fail_message(err, "data.on_oversize", f"line {row['line']}"))
        repaired = None if policy == "skip" else _repair(row, records, pre, caps, policy)
        if repaired is None:
            rejects.append(err.to_json(line=row["line"], action="skip"))
            continue
        lim, new_row = repaired
        limits[len(kept)] = lim
        kept.append(new_row)
        rejects.append(err.to_json(line=row["line"], action=policy, limits=lim.to_json()))
    return kept, limits, rejects


_KEYS = {"max_tokens": "llm_row_len", "max_patches": "vision_patches", "max_frames": "audio_frames"}


def _needs(index: LengthsIndex, pre: Preprocessor) -> dict[str, np.ndarray]:
    return {
        "max_tokens": index.llm_tokens(pre.p.merge**2, pre.p.subsample),
        "max_patches": index.per_sample_sum(index.images, index.images_ptr),
        "max_frames": index.per_sample_sum(index.audio, index.audio_ptr),
    }


def _repair(row: dict, records, pre: Preprocessor, caps: Limits, policy: str):
    """(limits, repaired row) or None when nothing learnable is left."""
    record = read_record(records, int(row["row"]))
    sizes = sizes_of(row)
    budget = pre.p.image_max_pixels if policy == "shrink" and sizes.images else None
    unit = (pre.p.patch_size * pre.p.merge) ** 2
    while True:
        lim = dataclasses.replace(caps, max_pixels=budget)
        layout = pre.layout(record, sizes, lim)
        if budget is None or not layout.cut or budget <= unit:
            break
        budget = max(unit, int(budget * 0.8))  # shrink the images until nothing is cut
    if layout.loss_tokens() == 0:
        return None
    counts = layout.counts(pre.p.merge**2)
    return lim, {**row, **counts}


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxmllm.data.index",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--manifest", help="JSONL manifest or .array_record file (default: data.path)")
    p.add_argument("--out", help="index folder (default: data.index_dir, else <manifest>.index)")
    p.add_argument("--config", help="the training config (tokenizer, patch size, budgets)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    p.add_argument("--decode", action="store_true", help="fully decode media (slower, stricter)")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
        path = args.manifest or cfg.data.path
        if not path:
            raise ConfigError("give --manifest, or a --config with data.path")
        out = args.out or cfg.data.index_dir or default_index_dir(path)
        summary = build_index(cfg, path, out, workers=args.workers, decode=args.decode)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: summary[k] for k in ("records", "accepted", "rejected", "rejects")}))
    print(f"suggested capacities: {summary['suggested_capacities']}")
    print(f"wrote {out}/lengths.jsonl, summary.json, rejects.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
