"""The lengths index of a manifest: one offline pass, then training plans from it.

    python -m jaxmllm.data.index --manifest data/train.jsonl --config configs/manifest_example.yaml

reads every record once (media sizes from file headers: PIL reads the size without decoding,
soundfile the duration), in parallel, and writes to `--out` (default `<manifest>.index/`):

- `lengths.jsonl`: one line per accepted record, in the DESIGN lengths format plus where the
  record is (`id`, `row`, `line`) and its media sizes (`image_sizes`, `audio_samples`), which let
  the oversize policy repair a sample at start-up without touching the media;
- `summary.json`: counts, per-modality percentiles, the
  preprocessing parameters the counts depend on (training checks them), rejects by reason;
- `rejects.jsonl`: every rejected record with its id, line and reason.

Training's row i is the i-th accepted record; rejected records are never planned. Training reads
the index back with `jaxmllm.data.source.open_source`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from jaxmllm.config import Config, ConfigError, load_config
from jaxmllm.config.phases import ENCODERS
from jaxmllm.data.lengths import LengthsIndex
from jaxmllm.data.preprocess import MEDIA, Limits, Params, Preprocessor
from jaxmllm.data.records import open_records, read_record
from jaxmllm.data.rejects import RecordError
from jaxmllm.data.source import default_index_dir

# ----------------------------------------------------------------------------- building


def measure(records, pre: Preprocessor, k: int, decode: bool = False) -> dict:
    """Record k's index row ({"ok": True, ...counts}) or its reject ({"ok": False, ...})."""
    line = 0
    try:
        obj, line = records.raw(k)
        record = read_record(records, k)
        sizes = pre.sizes(record)
        pre.check(record, sizes)
        if decode:  # full decode: catches files whose header is fine but whose data is not
            pre.sample(k, record, sizes, Limits())
        counts = pre.layout(record, sizes).counts()
    except RecordError as e:
        return {"ok": False, **e.to_json(line=line, row=k)}
    return {
        "ok": True,
        **counts,
        "id": record.id,
        "row": k,
        "line": line,
        **{media.size_key: [list(s) for s in sizes.media[p]] for p, media in MEDIA.items()},
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
    """Counts and percentiles per modality (training sizes its buckets from the index itself:
    `batch.capacity: auto`)."""
    index = LengthsIndex.from_records(rows)
    llm = index.llm_tokens({p.name: p.per_token(cfg.model) for p in ENCODERS})
    stats = {"text_tokens": index.text, "llm_tokens": llm}
    for p in ENCODERS:
        stats[f"{p.unit}_per_{p.item}"] = index.items[p.name].sizes
        stats[f"{p.items}_per_sample"] = index.items[p.name].count()
    return {
        "records": len(rows) + len(rejects),
        "accepted": len(rows),
        "rejected": len(rejects),
        "rejects": dict(Counter(r["reason"] for r in rejects)),
        "percentiles": {k: _percentiles(v) for k, v in stats.items()},
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
    print("bucket sizes: batch.capacity: auto sizes the encoder buckets from it at start-up")
    print(f"wrote {out}/lengths.jsonl, summary.json, rejects.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
