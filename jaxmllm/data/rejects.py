"""Bad input, counted and logged: the error a record raises and the log every reject goes to.

Every skip or repair has a reason (one of REASONS) and the record's id; `RejectLog` counts them
for the step metrics and appends one JSON line per reject to a `rejects.jsonl`.
"""

from __future__ import annotations

import json
import os
import stat
import textwrap
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

from jaxmllm.config import ConfigError, UserError, printable

REASONS = {
    "malformed_line": "the line is not a JSON object with an id and text or messages",
    "duplicate_id": "another record already has this id",
    "missing_media": "a media file does not exist",
    "path_outside_root": "a media path leads out of data.confine_media_to (default: the folder "
    "relative paths start from; data.allow_outside_paths)",
    "media_too_large": "a media file is larger than data.max_media_bytes (not read)",
    "undecodable_media": "a media file (or inline data) cannot be decoded",
    "placeholder_mismatch": "<image>/<video>/<audio> placeholders differ in number from the media",
    "empty_sample": "nothing to train on: no text, no media, or no assistant turn",
    "audio_too_short": "a clip is shorter than one encoder step (subsample x 10 ms)",
    "image_too_large": "the header's width x height exceeds data.max_image_pixels (not decoded)",
    "image_too_costly": "a progressive JPEG has more scans than data.max_image_scans, or scans x "
    "pixels over data.max_image_scan_pixels (each scan a pass over the whole image; not decoded)",
    "audio_too_long": "the header's length exceeds data.max_audio_seconds (not decoded)",
    "video_too_short": "a video gives fewer sampled frames than one temporal patch",
    "video_too_large": "the header's length, frame size or frames x pixels exceed the data.max_* "
    "caps (not decoded)",
    "changed_since_index": "the media differs from what the index measured; rebuild the index",
    "oversize": "larger than a bucket can hold (see data.on_oversize)",
    "template_error": "the tokenizer directory's chat template fails on the record (or has none)",
    "template_inconsistent": "the chat template's text before an assistant turn changes later",
    "no_encoder": "the record has items of a phase the model has no encoder for (model.<phase>)",
    "over_memory_budget": "reading it (decoding an image or a clip, parsing a line, a row "
    "group) would need more memory than data.worker_memory (not read)",
    "record_failed": "reading the record raised an unexpected error (named in the detail)",
    "record_crashed": "the index's worker process died reading the record (out of memory, an "
    "abort in native code); the build went on without it",
    "pair_missing_side": "a preference pair lacks its 'chosen' or its 'rejected' completion",
    "pair_empty_side": "a preference pair's 'chosen' or 'rejected' completion has no text",
    "pair_identical": "a preference pair's 'chosen' and 'rejected' completions are the same",
    "pair_too_long": "a preference pair's two documents do not fit whole in a bucket's row (a "
    "pair is never cut: see data.on_oversize)",
}


MAX_ID_SHOWN = 200  # characters of a record id a message quotes (a longer one: cut, its length)


def shown_id(record_id: object) -> str:
    """A record id as messages, summaries and examples quote it: whole up to MAX_ID_SHOWN
    characters, else its start and its length (a 20 MB id was printed whole). The rejects
    log keeps it whole."""
    rid = str(record_id)
    if len(rid) <= MAX_ID_SHOWN:
        return rid
    return f"{rid[: MAX_ID_SHOWN // 2]}... ({len(rid)} characters)"


class RecordError(UserError):
    """A record that cannot become a sample; `reason` is one of REASONS. (Counted and skipped
    where a data set is read; a command given one file, `generate --image`, stops on it.)"""

    def __init__(self, reason: str, detail: str, record_id: str = "?"):
        assert reason in REASONS, reason
        # (from the data: a newline or an escape code would act on the terminal and the logs)
        record_id, detail = printable(record_id), printable(detail)
        super().__init__(f"record {shown_id(record_id)}: {reason}: {detail}")
        self.reason, self.detail, self.record_id = reason, detail, record_id

    def to_json(self, **extra) -> dict:
        return {"id": self.record_id, "reason": self.reason, "detail": self.detail, **extra}


def failed(e: BaseException, record_id: str) -> RecordError:
    """An unexpected exception while reading one record, as that record's reject: the index
    and the loader go on (or stop under data.on_error=fail) naming the record and the error."""
    detail = f"{type(e).__name__}: {e}".strip()[:300]
    return RecordError("record_failed", f"{detail} (a bug or an exhausted resource)", record_id)


class DataError(ConfigError):
    """Stops the run on bad input under a `fail` policy; the message names record and option.

    A ConfigError, so the trainer's command line prints it as a one-line error, not a traceback.
    """


MAX_MEDIA_BYTES = 1 << 30  # the default of data.max_media_bytes


def check_media_file(src: object, record_id: str = "?", max_bytes: int = MAX_MEDIA_BYTES) -> None:
    """Raises unless a media path names a regular file of at most `max_bytes` (inline bytes:
    their length), before any byte is read: a FIFO or a device would block or never end, a
    folder cannot be decoded, a 20 GB (sparse) file would be read whole by the converter."""
    if isinstance(src, bytes):
        size = len(src)
    else:
        try:
            st = os.stat(src)
        except (FileNotFoundError, NotADirectoryError, ValueError) as e:  # ValueError: a NUL
            raise RecordError("missing_media", f"no such file: {src} ({e})", record_id) from None
        except OSError as e:
            raise RecordError("undecodable_media", f"{src}: {e}", record_id) from None
        if not stat.S_ISREG(st.st_mode):
            raise RecordError("undecodable_media", f"{src} is not a regular file", record_id)
        size = st.st_size
    if size > max_bytes:
        name = f"<{size} inline bytes>" if isinstance(src, bytes) else str(src)
        raise RecordError(
            "media_too_large", f"{name}: {size} bytes > data.max_media_bytes={max_bytes}", record_id
        )


def fail_message(err: RecordError, option: str, where: str) -> str:
    """The message a `fail` policy stops with: the record, the problem, the option to change."""
    alternative = "skip" if option == "data.on_error" else "shrink, truncate or skip"
    return (
        f"{where}: record {err.record_id!r}: {err.reason} ({err.detail}). "
        f"Fix the record, or set {option} to {alternative}."
    )


class RejectLog:
    """Counts rejects by key and appends them to a JSONL file (when a path is given).

    The load-time and start-up rejects since the last `take_new` are also kept as entries
    (`take_entries`): the trainer's feed loads steps ahead of the one it trains, so it logs
    none itself (no path) and hands each step's entries over with the step, and the trainer
    writes them when it takes the step (`jaxmllm.loop.summary.RunReport`): the log lists what
    the run's counts count, never a step prefetched and not trained."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else None
        self.counts: Counter[str] = Counter()
        self.new: Counter[str] = Counter()  # load-time rejects by reason since `take_new`
        self.first: dict | None = None  # the first of them
        self.entries: list[dict] = []  # load-time and start-up entries since `take_entries`

    def add(self, key: str, entry: dict) -> None:
        """Counts `key` (e.g. "load_missing_media") and writes `entry` as one line."""
        self.counts[key] += 1
        if key.startswith("load_"):
            self.new[key.removeprefix("load_")] += 1
            self.first = self.first or entry
        if key.startswith(("load_", "_startup")):
            self.entries.append(entry)
        if self.path is not None:
            append_rejects(self.path, [entry])

    def take_new(self) -> tuple[dict[str, int], dict | None]:
        """The load-time rejects since the last call, by reason, and the first of them (what
        the terminal shows per logging window); starts anew."""
        new, first = dict(self.new), self.first
        self.new, self.first = Counter(), None
        return new, first

    def take_entries(self) -> list[dict]:
        """The load-time and start-up entries since the last call; starts anew."""
        entries, self.entries = self.entries, []
        return entries


def append_rejects(path: str | Path, entries: list[dict]) -> None:
    """Appends `entries` to the rejects file at `path`, one JSON line each."""
    if not entries:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in entries))


def read_rejects(path: str | Path) -> list[dict]:
    """The entries of a rejects.jsonl ([] when there is none)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


class LoadShare:
    """The samples a run drew and those of them that failed to load; `check` stops the run
    (DataError) when the failed share passes `bound` (data.max_load_rejects), judged once
    JUDGED_AFTER samples were drawn, and at the run's last step.

    Each process counts its own draws and failures (`add`); `check` judges the job's, summed
    over the processes by `combine` (a vector of this process's counts -> the job's; the
    identity with one process). With several it is a collective: every process calls `check`
    at the same steps, so all of them see the same share and stop together, where a process
    judging its own share alone stopped while the others waited on it in the next step."""

    JUDGED_AFTER = 32

    def __init__(self, bound: float, combine: Callable[[np.ndarray], np.ndarray] | None = None):
        self.bound, self.drawn, self.failed = bound, 0, 0
        self.combine = combine or (lambda mine: mine)
        self.reasons: Counter[str] = Counter()
        self.first: dict | None = None

    def add(self, drawn: int, failed: dict[str, int], first: dict | None) -> None:
        """A step's samples drawn here, its load-time rejects by reason and the first."""
        self.drawn += drawn
        self.failed += sum(failed.values())
        self.reasons.update(failed)
        self.first = self.first or first

    def totals(self) -> tuple[int, int, Counter[str]]:
        """(samples drawn, of them failed, failed by reason) over every process: this
        process's counts as one vector [drawn, failed, each of REASONS], combined."""
        mine = [self.drawn, self.failed, *(self.reasons.get(r, 0) for r in REASONS)]
        job = np.asarray(self.combine(np.asarray(mine, np.float64)))
        reasons = Counter({r: int(n) for r, n in zip(REASONS, job[2:], strict=True) if n})
        return int(job[0]), int(job[1]), reasons

    def check(self, steps: str, last: bool, rebuild: str) -> None:
        """Raises DataError when too many failed over the job (`steps`: the steps counted, for
        the message; `rebuild`: the command that rebuilds the index)."""
        drawn, failed, reasons = self.totals()
        over = failed > self.bound * drawn
        if not over or (drawn < self.JUDGED_AFTER and not last):
            return
        example = ""
        first = self.first
        if first is not None:
            example = (
                f"; the first: record {shown_id(first.get('id'))}: {first.get('reason')}: "
                f"{first.get('detail')}"
            )
        raise DataError(
            f"{steps}: {failed} of the {drawn} samples drawn failed to load "
            f"({by_reason(reasons)}{example}), more than data.max_load_rejects="
            f"{self.bound:g} of them: the run stops rather than train on padding. Media "
            "missing on this host (an index built on another machine, a media folder not "
            "mounted here) fail them all: make the media reachable where the index says they "
            f"are, or rebuild the index where they changed ({rebuild}), or raise "
            "data.max_load_rejects"
        )


# ----------------------------------------------------------------------------- on the terminal

WIDTH = 100  # the lines rejects are wrapped to (never cut: a path is the clue)


# What starts each continued line of a reject's example: the example holds a record's own id,
# path and detail, escaped (`printable`) but with their spaces, so a break at one of those
# spaces could start a line with the record's text, which then reads as the summary's own
# ("rejected, by reason: none" forged in an id). Where the break falls hangs on the length of
# the data's path.
CONTINUED = "| "


def wrapped(text: str, indent: str = "", width: int = WIDTH) -> list[str]:
    """`text` whole on lines of about `width`, the second and later indented by `indent`
    (words and paths never split: a line holds a longer path whole)."""
    return textwrap.wrap(
        text, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    ) or [""]


def example_lines(reason: str, count: int, example: str) -> list[str]:
    """A reason's line of a rejects table, `example` (a record's id, place and detail) after its
    count; a longer line continued under it after `CONTINUED`, so no line starts with what a
    record wrote."""
    return wrapped(f"    {reason:<22} {count:>7}  {example}", " " * 8 + CONTINUED)


def by_reason(counts: dict[str, float]) -> str:
    """'missing_media 12, undecodable_media 1', most first."""
    ordered = sorted(((int(n), r) for r, n in counts.items() if n), key=lambda x: (-x[0], x[1]))
    return ", ".join(f"{r} {n}" for n, r in ordered)


def index_line(path: str, fmt: str, summary: dict, out: str | Path) -> str:
    """What training says at start-up about a data set's index: its format, how many records
    it accepted, and the rejects by reason with the file that lists them."""
    how = summary.get("detected") or "data.format"
    line = f"{path}: {fmt} ({how}); the index accepted {summary['accepted']} of "
    line += f"{summary['records']} records"
    if summary.get("rejected"):
        line += f"; {summary['rejected']} rejected ({by_reason(summary['rejects'])}), each "
        line += f"listed in {Path(out) / 'rejects.jsonl'}"
    return line


def media_hint(summary: dict, base: str | Path) -> str:
    """For an index most of whose rejects are missing_media: where the media paths start and
    where the first missing one would be, and the setting that moves the start."""
    rejects = summary.get("rejects", {})
    if not rejects or max(rejects, key=rejects.get) != "missing_media":
        return ""
    detail = str(summary.get("examples", {}).get("missing_media", {}).get("detail", ""))
    missing = detail[len("no such file: ") :].split(" (")[0] if detail.startswith("no such") else ""
    return (
        f"Relative media paths start from {base} (data.media_root, else the data file's "
        f"folder){f', so the first missing one would be {missing}' if missing else ''}: if "
        "the media are in another folder, set data.media_root to the folder their paths "
        "start from (LLaVA's --image_folder) and index again"
    )
