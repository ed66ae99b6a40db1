"""What the terminal says about a run beside its progress bar.

Per logging window, a line when records failed to load (a media file deleted or replaced since
the index): how many by reason, and the first one whole, each process about its own (its own
rejects file). At the end of a run that finished its steps, process 0's summary: the final
loss, the job's real tokens a second, the rejects of the whole run by stage, where the
checkpoint is and the command that generates from it; a rerun of a finished run says so, with
that summary and how to train on. (The rejects an index made are told
once at start-up, by `jaxmllm.data.source`.)
"""

from __future__ import annotations

import logging
import shlex
import time
from pathlib import Path

import jax

from jaxmllm.config import Config
from jaxmllm.data.datasets import data_sets, index_command, index_dir
from jaxmllm.data.preprocess import Params
from jaxmllm.data.rejects import LoadShare, append_rejects, by_reason, shown_id, wrapped
from jaxmllm.feed.info import StepInfo
from jaxmllm.loop.metrics import logged_step, read_metrics, summed_over_processes
from jaxmllm.step.program import warmup_steps

log = logging.getLogger("jaxmllm")


SHORT_WARMUP = 0.5  # a warm-up over this share of the run: its loss moves little, said


def schedule_note(cfg: Config) -> tuple[int, str]:
    """(log level, line): the learning rate's schedule, said at start-up; a warning when the
    warm-up takes most of the run (a short trial of an imported config, lr 1e-5 after 50
    warm-up steps, looked dead with nothing said)."""
    o, steps, warmup = cfg.optim, cfg.train.steps, warmup_steps(cfg)
    line = (
        f"optim.lr={o.lr:g}: 0 -> {o.lr:g} over {warmup} warm-up steps, cosine to "
        f"{o.lr * o.min_lr_ratio:g} at step {steps}"
    )
    if o.warmup_steps > warmup:
        line += f" (optim.warmup_steps={o.warmup_steps}, held to the run's {steps} steps)"
    if steps > 1 and warmup > SHORT_WARMUP * steps:
        line += (
            f"; the warm-up takes {warmup} of the run's {steps} steps, so its loss moves little "
            f"at first: for a short trial lower optim.warmup_steps (--set optim.warmup_steps="
            f"{max(1, steps // 10)}) or raise train.steps"
        )
        return logging.WARNING, line
    return logging.INFO, line


DISTINCT_KEPT = 1 << 20  # records that failed to load this run, told apart at most


class RunReport:
    """Collects what the terminal is told: `step` every step, `logged` at a logged step (the
    window's rejects line), `finish` after the last step (the summary).

    It also writes each step's load-time rejects to the rejects file when the loop takes the
    step (the feed loads steps ahead: those never trained are in no log), tells the records
    that failed apart from their draws (a missing image drawn in 32 epochs is one record),
    and stops the run when too many of the samples drawn failed (data.max_load_rejects, over
    all the job's processes)."""

    def __init__(self, cfg: Config, out: Path, start: int, rejects_file: Path):
        """The report of a run starting at step `start` (0 fresh, else resumed) writing into
        `out`, its load-time rejects logged to `rejects_file`."""
        self.cfg, self.out, self.start, self.rejects_file = cfg, out, start, rejects_file
        self.began = time.perf_counter()
        self.first_step = start + 1  # the first step of the current logging window
        self.new: dict[str, int] = {}  # this window's load-time rejects here, by reason
        self.first: dict | None = None  # and the first of them
        # this run's draws and failures, judged over the job's processes
        self.loads = LoadShare(cfg.data.max_load_rejects, summed_over_processes)
        self.failed: set[int] = set()  # the samples that failed to load here this run

    def step(self, info: StepInfo) -> None:
        """The step the trainer just took: its load-time rejects written to the log and counted
        for the window and the run; the share of failed samples judged (DataError when over
        data.max_load_rejects)."""
        append_rejects(self.rejects_file, info.reject_entries)
        for entry in info.reject_entries:
            if entry.get("stage") == "load" and len(self.failed) < DISTINCT_KEPT:
                self.failed.add(int(entry.get("index", -1)))
        for reason, n in info.new_rejects.items():
            self.new[reason] = self.new.get(reason, 0) + n
        self.first = self.first or info.first_reject
        self.loads.add(len(info.parts.get("read", ())), info.new_rejects, info.first_reject)
        done = info.step + 1
        # (several processes: judged at the logged steps, where every process is anyway in
        # the metrics' collective; a collective each step would stall the steps in flight)
        if jax.process_count() == 1 or logged_step(done, self.cfg.train):
            steps = f"steps {self.start + 1}-{done}" if done > self.start + 1 else f"step {done}"
            self.loads.check(steps, done >= self.cfg.train.steps, index_command(self.cfg))

    def logged(self, done: int) -> None:
        """At a logged step: one line about the window's load-time rejects, if there were any;
        the window starts anew."""
        if self.new:
            lines = window_lines(self.first_step, done, self.new, self.first, self.rejects_file)
            log.warning("\n".join(lines))
        self.first_step, self.new, self.first = done + 1, {}, None

    def finish(self, done: int, row: dict, window, checkpoint: Path) -> None:
        """The end-of-run summary (process 0): `row`, the last logged step's metrics (the job's
        cumulative reject counts); `window`, the metrics window (the run's totals)."""
        if jax.process_index() == 0:
            print("\n".join(self.summary(done, row, window, checkpoint)), flush=True)

    def finished(self, done: int, checkpoint: Path) -> dict:
        """A rerun of a run whose checkpoint is at or past train.steps (process 0 says so):
        nothing trains; its summary from the last logged step in metrics.jsonl, and how to
        train on. Returns that step's metrics ({} when none was logged)."""
        rows = [r for r in read_metrics(self.out) if "loss" in r and r["step"] <= done]
        row = rows[-1] if rows else {}
        if jax.process_index() == 0:
            print("\n".join(self.finished_lines(done, row, checkpoint)), flush=True)
        return row

    def finished_lines(self, done: int, row: dict, checkpoint: Path) -> list[str]:
        """The lines of `finished`: steps and the last logged loss, rejects, the checkpoint, the
        command that generates from it and the key that trains on."""
        steps = self.cfg.train.steps
        loss = f"; final loss {row['loss']:.4f} (step {row['step']})" if row else ""
        lines = [
            f"already done: the checkpoint is at step {done} of train.steps={steps}, nothing to "
            f"train{loss}"
        ]
        lines += wrapped(f"  rejects: {self.rejects(row)}", " " * 4)
        lines.append(f"  checkpoint: {_shown(checkpoint)}")
        lines.append(f"  generate from it: {self.generate_command()}")
        lines.append(
            f"  to train on: raise train.steps past {done} (--set train.steps={2 * done}; the "
            "learning rate's cosine then runs to the new last step) and rerun this command, or "
            "start afresh in a new train.output_dir"
        )
        return lines

    def summary(self, done: int, row: dict, window, checkpoint: Path) -> list[str]:
        """The end-of-run lines: steps and time, final loss, throughput past the first
        (compiling) window, a preference run's pair metrics, the rejects by stage, the checkpoint
        and the command that generates from it."""
        steps = f"{done} steps" if self.start == 0 else f"steps {self.start + 1}-{done}"
        took = _duration(time.perf_counter() - self.began)
        loss = row.get("loss", float("nan"))
        lines = [
            f"done: {steps} in {took} (compiling and evaluating included); final loss {loss:.4f}"
        ]
        if window.run_steps:
            per_device = window.run_flops / window.run_seconds / window.n_devices / 1e12
            lines.append(
                f"  throughput: {window.run_tokens / window.run_seconds:,.0f} real tokens/s over "
                f"steps {done - window.run_steps + 1}-{done} (the first window compiles), "
                f"{per_device:.3g} TFLOP/s a device"
            )
        if "rewards/accuracies" in row:  # (a preference run: TRL's metrics of its pairs)
            lines.append(
                f"  pairs of the last logged step: reward accuracy "
                f"{row['rewards/accuracies']:.3f}, margin {row['rewards/margins']:.3f}, chosen "
                f"log-prob {row['logps/chosen']:.2f}, rejected {row['logps/rejected']:.2f} "
                "(held-out: eval/rewards/* in metrics.jsonl)"
            )
        lines += wrapped(f"  rejects: {self.rejects(row)}", " " * 4)
        lines.append(f"  checkpoint: {_shown(checkpoint)}")
        lines.append(f"  generate from it: {self.generate_command()}")
        return lines

    def rejects(self, row: dict) -> str:
        """The run's rejects by stage (the job's), and the files that list them."""
        stages = []
        for stage, prefix in (("at indexing", "index_"), ("at load time", "load_")):
            total = row.get(f"rejects/{prefix}total", 0.0)
            if total:
                what = by_reason(_counts(row, prefix))
                if prefix == "load_" and self._distinct(total):
                    what += f"; {self._distinct(total)}"
                stages.append(f"{int(total)} {stage} ({what})")
        oversize = _counts(row, "oversize_")
        if oversize:
            stages.append(f"{int(sum(oversize.values()))} oversize ({by_reason(oversize)})")
        if not stages:
            return "none"
        files = [str(self.rejects_file)] if row.get("rejects/load_total") else []
        if row.get("rejects/index_total"):
            files += [str(self._index_folder(ds) / "rejects.jsonl") for ds in data_sets(self.cfg)]
        where = f"; listed in {', '.join(files)}" if files else ""
        return ", ".join(stages) + where

    def _distinct(self, draws: float) -> str:
        """'1 record, drawn 32 times' where this run's load-time rejects are fewer records
        than draws (a run of one process from its start: the others' records are theirs)."""
        records = len(self.failed)
        if self.start or jax.process_count() > 1 or not records or records >= draws:
            return ""
        more = "+" if records >= DISTINCT_KEPT else ""
        return f"{records}{more} record{'s' * (records != 1)}, drawn {int(draws)} times"

    def _index_folder(self, ds) -> Path:
        """The index folder of a data set the run reads (where its index's rejects.jsonl is)."""
        return index_dir(ds, Params.from_config(self.cfg).counted())

    def generate_command(self) -> str:
        """The command that generates from the run's checkpoint, with a prompt like its data's."""
        run = ["python", "-m", "jaxmllm.generate", "--run", str(self.out)]
        if self.cfg.data.source == "synthetic":
            return shlex.join([*run, "--prompt", "12 13 14"])
        image = ["--image", "IMAGE"] if self.cfg.model.vision.enabled else []
        return shlex.join([*run, *image, "--prompt", "PROMPT"])


def rejects_file(out: Path) -> Path:
    """This process's load-time rejects file: <out>/rejects.jsonl (process N > 0:
    rejects.processN.jsonl)."""
    rank = jax.process_index()
    return out / ("rejects.jsonl" if rank == 0 else f"rejects.process{rank}.jsonl")


def window_lines(first: int, last: int, new: dict, example: dict | None, where) -> list[str]:
    """The terminal's lines about one logging window's load-time rejects (wrapped, whole)."""
    process = f"process {jax.process_index()}: " if jax.process_count() > 1 else ""
    text = (
        f"{process}load-time rejects in steps {first}-{last}: {sum(new.values())} "
        f"({by_reason(new)}), skipped (their slots are padding)"
    )
    if example is not None:  # (its `step` is the plan's, from 0: the training step before it)
        step = example["step"] + 1 if isinstance(example.get("step"), int) else "?"
        text += (
            f"; the first: record {shown_id(example.get('id'))} (step {step}): "
            f"{example.get('reason')}: {example.get('detail')}"
        )
    return wrapped(f"{text}. Each one is listed in {where}.", " " * 4)


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it is inside it, else as it is."""
    path = Path(path)
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def _counts(row: dict, prefix: str) -> dict[str, float]:
    """{reason: count} of a row's `rejects/<prefix><reason>` keys (totals left out)."""
    keys = [k for k in row if k.startswith(f"rejects/{prefix}") and not k.endswith("_total")]
    return {k.removeprefix(f"rejects/{prefix}"): row[k] for k in keys}


def _duration(seconds: float) -> str:
    """'2 min 24 s', '1 h 03 min', '9.4 s'."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"
