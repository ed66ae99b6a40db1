"""Checkpoints: what is saved, how a run resumes, and what it refuses to resume from.

A checkpoint (`<output_dir>/checkpoints/<step>/`, written aside and renamed when complete) holds
three orbax items: `state` (params, frozen params, optimizer state, step), `data` (the pipeline's
iterator state, one file per process) and `meta`, a small JSON stamp of the checkpoint format:

    {"format": 2, "layers": "scanned" | "per_layer"}

A checkpoint without the stamp (written before it existed) or with another one has a parameter
tree this build cannot read: the run stops at start-up and says so (`check_format`) rather than
call it damaged or start over. A checkpoint that carries the right stamp but no longer reads back
is damaged: `restore_latest` moves it aside and resumes from the previous one. Only the
checkpoints a resume would use are judged: an older step half deleted by a kill during orbax's
clean-up of old checkpoints is not mistaken for another format.

A run with LoRA adapters saves no frozen base (its `state` has no `frozen`): the base is read
again from `model.init_from` (or drawn again from `train.seed` where nothing is named) at every
start, and the stamp carries its identity, `"base": {"init_from": {...}, "hash": ...}` (the
sources and a content hash of the base as loaded, `base_identity`), so a resume against another
base is refused naming both (`check_format`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.metadata import array_metadata_store

from jaxmllm.config import AUTO_LADDERS, AUTO_SIZES, Config, ConfigError, to_dict
from jaxmllm.config.phases import ENCODERS
from jaxmllm.loop.base import check_base
from jaxmllm.plan.state import PlanStateError
from jaxmllm.process import distributed, late_io
from jaxmllm.resolve.resumed import context_changed

log = logging.getLogger("jaxmllm")

FORMAT = 2  # 2: the first stamped format (checkpoints before it carry no `meta` item)
# The smallest part of a replicated array orbax's replica-parallel save gives each replica
# (`min_slice_bytes_for_replica_parallel`): below it one replica writes the array whole. Each
# slice is a program of its own (`lax.slice_in_dim`), compiled at a process's first save for
# every shape: ~180 programs, ~3 s, for tiny's few-KB norms and biases, none of which a
# megabyte's transfer (well under a millisecond) needs split. Big replicated arrays (a model's
# weights under plain data parallelism) are still written by every replica in parallel.
REPLICA_SLICE_MIN_BYTES = 1 << 20
# The stamp's count of non-finite steps in a row before its checkpoint (no part of the format)
NONFINITE_KEY = "nonfinite_in_a_row"


def format_stamp(abstract_params: Any) -> dict:
    """The stamp this build writes: the format and how transformer layers are stored.

    `per_layer`: one module per layer (`.../blocks/0/...`); `scanned`: one stacked module with a
    leading layers axis (`.../blocks/...`). The two trees cannot be restored into each other.
    """
    paths = (
        jax.tree_util.keystr(path, simple=True, separator="/")
        for path, _ in jax.tree_util.tree_leaves_with_path(abstract_params)
    )
    per_layer = any(re.search(r"(^|/)blocks/\d+(/|$)", p) for p in paths)
    return {"format": FORMAT, "layers": "per_layer" if per_layer else "scanned"}


def make_checkpoint_manager(cfg: Config) -> ocp.CheckpointManager:
    """Orbax manager for `<output_dir>/checkpoints`; saves are atomic (written aside, renamed).

    A save interrupted by a kill leaves a `*.orbax-checkpoint-tmp*` directory: it is reported
    and cleaned up, and the run resumes from the latest complete checkpoint.
    """
    late_io.install()  # (orbax's abandoned reads and writes: counted, not printed)
    _install_array_handler()
    t = cfg.train
    directory = Path(t.output_dir).absolute() / "checkpoints"
    for tmp in sorted(directory.glob("*.orbax-checkpoint-tmp*")) if directory.exists() else []:
        log.warning(
            "discarding %s: a checkpoint save that was interrupted before it completed", tmp.name
        )
    options = ocp.CheckpointManagerOptions(
        max_to_keep=t.keep_checkpoints,
        save_interval_steps=t.checkpoint_every,
        enable_async_checkpointing=t.async_checkpointing,
        cleanup_tmp_directories=True,
        create=True,
    )
    return ocp.CheckpointManager(directory, options=options)


_array_handler: list = []  # the handler `_install_array_handler` registered, once a process


def _install_array_handler() -> None:
    """Orbax's handler of `jax.Array` leaves, as its default but for `REPLICA_SLICE_MIN_BYTES`
    (orbax reads the handler from its global registry: `StandardSave` takes none). Registered
    once a process; the registry's warning that it replaces the default says nothing to a user.
    The metadata store is orbax's default handler's, imported from orbax's private path (it has
    no public one): test_train's replicated-array test fails if a release moves it."""
    if _array_handler and ocp.type_handlers.get_type_handler(jax.Array) is _array_handler[0]:
        return
    handler = ocp.type_handlers.ArrayHandler(
        array_metadata_store=array_metadata_store.Store(),  # (as orbax's default handler)
        min_slice_bytes_for_replica_parallel=REPLICA_SLICE_MIN_BYTES,
    )
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl.setLevel(level)
    _array_handler[:] = [handler]


class SaveError(RuntimeError):
    """A checkpoint save that failed (a full disk, a lost mount): the run stops, naming the
    directory, the cause and the checkpoint it keeps."""

    exit_code = 5  # (what the command exits with: `jaxmllm.config.command.run`)


_in_flight: dict[int, int] = {}  # id(manager) -> the step of its last save, until checked


def save(mngr: ocp.CheckpointManager, step: int, args, force: bool = False) -> bool:
    """`mngr.save`; its failure, or that of a save before it, is a SaveError."""
    check_saves(mngr)
    if id(mngr) in _in_flight:  # (orbax would wait for it first: its failure is named as its)
        wait_for_saves(mngr)
    with _save_errors(mngr, step):
        saved = mngr.save(step, args=args, force=force)
    if saved:
        _in_flight[id(mngr)] = step
    return saved


def check_saves(mngr: ocp.CheckpointManager) -> None:
    """Raises SaveError if a save running in the background has failed: called every step,
    so a full disk stops the run at the next step rather than `checkpoint_every` later."""
    step = _in_flight.get(id(mngr))
    if step is None:
        return
    with _save_errors(mngr, step):
        mngr.check_for_errors()  # (the writes' errors)
        if not mngr.is_saving_in_progress():  # the finalizing thread's, which the wait raises
            _in_flight.pop(id(mngr), None)
            mngr.wait_until_finished()  # (at once: the save is over)


def wait_for_saves(mngr: ocp.CheckpointManager, close: bool = False) -> None:
    """Waits for the saves in flight (and closes the manager); their failure is a SaveError,
    once: a manager whose failure was reported closes quietly."""
    wait = mngr.close if close else mngr.wait_until_finished
    if close:
        _await_cleanup(mngr)
    if id(mngr) in _failed:
        with contextlib.suppress(Exception):
            wait()
        return
    with _save_errors(mngr, _in_flight.pop(id(mngr), None)):
        wait()


_failed: set[int] = set()  # id(manager) of those whose failed save was reported


def _await_cleanup(mngr: ocp.CheckpointManager) -> None:
    """Waits for the thread in which orbax deletes interrupted saves' folders: it starts with
    the manager, and `close` does not wait for it, so a run that stopped at start-up (a
    config.json whose sizes are not its tensors') exited under it and printed a traceback
    after its one-line error. (Orbax's own attribute; its saves wait on it the same way.)"""
    cleanup = getattr(mngr, "_cleanup_tmp_directory_future", None)
    if cleanup is not None:
        try:
            cleanup.result()
        except Exception as e:  # noqa: BLE001  (closing: the error that stopped the run matters)
            log.warning("clean-up of interrupted checkpoint saves failed: %s", e)


@contextlib.contextmanager
def _save_errors(mngr: ocp.CheckpointManager, step: int | None = None):
    """Turns any error of a save (orbax, tensorstore, the OS) into a SaveError naming the
    checkpoint, the cause and the latest complete step kept, and marks the manager failed."""
    try:
        yield
    except Exception as e:  # orbax, tensorstore and the OS raise many types for a failed write
        _failed.add(id(mngr))
        kept = complete_steps(Path(mngr.directory))
        cause = save_cause(e)
        raise SaveError(
            f"saving {'a checkpoint' if step is None else f'checkpoint {step}'} in "
            f"{mngr.directory} failed ({cause}); training stopped. The latest complete "
            f"checkpoint is {f'step {kept[-1]}' if kept else 'none'}, kept as it was: fix the "
            "cause (free disk space?) and rerun the same command to resume from it"
        ) from e


def save_cause(e: BaseException) -> str:
    """A failed write's cause in a line: the OS error first where there is one (tensorstore
    puts it anywhere in a long message, before the spec it appends, as `[os_error_code='28']`),
    then the exception's first line, its middle cut past 300 characters."""
    text = str(e).splitlines()[0] if str(e) else ""
    short = f"{type(e).__name__}: {text}"
    short = short if len(short) <= 300 else f"{short[:140]} ... {short[-140:]}"
    code = re.search(r"os_error_code\W*(\d+)", text)
    chain = [e]
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    errno_ = (
        int(code[1]) if code else next((x.errno for x in chain if isinstance(x, OSError)), None)
    )
    reason = os.strerror(errno_) if errno_ else ""
    return f"{reason}: {short}" if reason and reason not in short else short


def complete_steps(directory: Path) -> list[int]:
    """The steps of the checkpoints saved in `directory` and committed (renamed from aside)."""
    names = (p.name for p in directory.iterdir()) if directory.is_dir() else ()
    return sorted(int(n) for n in names if n.isdigit())


def check_output_dir(out: Path) -> None:
    """Stops the run at start-up, naming train.output_dir, where nothing can be written (a
    read-only folder, a file, no space) rather than fail at the first save."""
    probe = out / f".jaxmllm-write-test-{socket.gethostname()}-{os.getpid()}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"train.output_dir={out}: cannot write there ({e.strerror or e}); set "
            "train.output_dir to a folder this user can write"
        ) from None


def save_args(state, data_iter, stamp: dict) -> ocp.args.Composite:
    """What one checkpoint saves: the train state, the data iterator's state (the planner's
    cursor, so a resume plans the same next step) and the format stamp."""
    return ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=grain.checkpoint.CheckpointSave(data_iter),
        meta=ocp.args.JsonSave(stamp),
    )


def check_format(mngr: ocp.CheckpointManager, step: int, stamp: dict) -> None:
    """Refuses checkpoint `step` if it has no stamp (an older format) or another one, or (a
    run with adapters) was trained on another base than the one read now."""
    found = read_stamp(mngr, step)
    if found is None:  # a stamp that does not read back is damage
        return
    fmt = lambda d: {k: v for k, v in d.items() if k not in ("base", NONFINITE_KEY)}
    if fmt(found) != fmt(stamp):
        was = "no format stamp (written before checkpoints had one)" if found == {} else found
        raise ConfigError(
            f"checkpoint {step} in {mngr.directory} has {was}; this version writes "
            f"{fmt(stamp)} and does not restore another format (its parameter tree may "
            "differ). Use a new train.output_dir to train from scratch, or the jaxmllm version "
            "that wrote it to resume."
        )
    check_base(f"checkpoint {step} in {mngr.directory}", found.get("base"), stamp.get("base"))


def check_shapes(mngr: ocp.CheckpointManager, step: int, abstract_state) -> None:
    """Refuses checkpoint `step` when its tensors' shapes (its metadata, nothing read) are not
    this config's: a model of another size (checkpoints copied without their config.json) is
    not damage. Restoring it instead failed at the first tensor with orbax's reads of the
    others in flight, abandoned when it closed their event loop: each printed an "Exception
    ignored" traceback with a TensorStore spec of ~70 lines after the run's one-line error."""
    try:
        stored = ocp.StandardCheckpointHandler().metadata(
            Path(mngr.directory) / str(step) / "state"
        )
    except Exception:  # noqa: BLE001  (metadata that does not read: damage, the restore's to judge)
        return
    shapes = {_path(p): tuple(m.shape) for p, m in jax.tree_util.tree_leaves_with_path(stored)}
    wrong = [
        (name, shapes[name], tuple(x.shape))
        for name, x in (
            (_path(p), x) for p, x in jax.tree_util.tree_leaves_with_path(abstract_state)
        )
        if name in shapes and shapes[name] != tuple(x.shape)
    ]
    if wrong:  # (a parameter named before its optimizer state)
        name, was, now = min(wrong, key=lambda w: w[0].startswith("opt_state"))
        raise ConfigError(
            f"checkpoint {step} in {mngr.directory} is of a model of another size: its {name} "
            f"is {was}, this config's {now} ({len(wrong)} tensors differ). Resume with the "
            "config that wrote it (model.*), or use a new train.output_dir"
        )


def _path(path) -> str:
    """A tree path as '/'-joined names, alike for a dict's keys, a list's indices and a named
    tuple's fields (orbax's metadata stores the optimizer's named tuples as dicts)."""
    names = (getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
    return "/".join(str(n) for n in names)


def read_stamp(mngr: ocp.CheckpointManager, step: int) -> dict | None:
    """A checkpoint's stamp; {} when it has none; None when it is there but does not read."""
    if not (Path(mngr.directory) / str(step) / "meta").is_dir():
        return {}
    try:
        restored = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"])
    except Exception:  # damaged: restore_latest reports it and falls back
        return None


def restore_latest(mngr: ocp.CheckpointManager, abstract_state, data_iter, stamp: dict):
    """Restores the newest checkpoint that reads back; None if there is none.

    A newer checkpoint that cannot be restored (damaged after it was committed) is reported and
    moved aside, never deleted or overwritten, once an older one restores; if none restores the
    run stops and says why rather than start over. A checkpoint of another format than `stamp`
    stops the run before anything is restored or moved (`check_format`): it is not damage.
    """
    steps = sorted(mngr.all_steps(), reverse=True)
    failed = []
    for step in steps:
        check_format(mngr, step, stamp)
        check_shapes(mngr, step, abstract_state)
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state),
            data=grain.checkpoint.CheckpointRestore(data_iter),
            meta=ocp.args.JsonRestore(),
        )
        try:
            restored = mngr.restore(step, args=args)
        except PlanStateError:  # a state that does not fit the index: not damage, stop
            raise
        except Exception as e:  # orbax/tensorstore raise many types for a damaged checkpoint
            log.warning(
                "checkpoint %d cannot be restored (%s: %s)",
                step,
                type(e).__name__,
                str(e).splitlines()[0][:200] if str(e) else "",
            )
            failed.append(step)
            continue
        for bad in failed:  # out of the way of the saves that will reuse these step numbers
            path = Path(mngr.directory) / str(bad)
            aside = path.with_name(f"{bad}.unreadable-{int(time.time())}")
            path.rename(aside)
            log.warning(
                "moved unreadable checkpoint %d to %s; resuming from step %d", bad, aside.name, step
            )
        if failed:
            mngr.reload()
        return restored["state"]
    if failed:
        raise ConfigError(
            f"no checkpoint in {mngr.directory} could be restored (steps {failed}; see the "
            "warnings above). Fix or move them, or use a new train.output_dir"
        )
    return None


def check_process_count(mngr: ocp.CheckpointManager) -> None:
    """A checkpoint's data state is one file per process: resume with the same process count."""
    latest = mngr.latest_step()
    if latest is None:
        return
    files = list((Path(mngr.directory) / str(latest) / "data").glob("process_*-of-*.json"))
    counts = {int(f.stem.rsplit("-of-", 1)[1]) for f in files}
    if counts and jax.process_count() not in counts:
        raise ConfigError(
            f"checkpoint {latest} in {mngr.directory} was written by {counts.pop()} processes "
            f"but this run has {jax.process_count()}; relaunch with the same number of processes"
        )


# What a resumed run must share with the run that wrote its checkpoints: the parameters' shapes
# and split, the bucket shapes and planner (their state is in the checkpoint), the sample stream.
# The mesh, optimizer settings and step count may change between runs.
RESUME_KEYS = (
    "model",
    "batch",
    "data.source",
    "data.path",
    "data.sources",  # (a mixture's sources, weights and order make its stream)
    "data.seed",
    "data.synthetic",
)
# ... but not how the step recomputes activations (model.remat, model.<tower>.remat, and the
# remat_policy of configs written before the policies had names): it changes no state.
free_to_change = lambda key: key == "model.remat_policy" or key.rsplit(".", 1)[-1] == "remat"


def check_resumable(cfg: Config, out: Path) -> None:
    """Refuses an output dir whose checkpoints come from an incompatible config.

    A run may resume with another `mesh.context`: the parameters do not depend on it, and the
    planner's state (its cursor in the sample stream and the samples it deferred) plans the
    new groups' buckets as well, so every sample is still trained once per epoch; the steps
    after the resume are planned for the new groups (not the batches the old ones would have
    had), and the batch sizes resolved from the data (`resolved_keys`) are resolved anew.
    """
    saved_path = out / "config.json"
    ckpts = out / "checkpoints"
    if not saved_path.exists() or not ckpts.exists() or not any(ckpts.iterdir()):
        return
    saved = distributed.flatten(json.loads(saved_path.read_text()))
    now = distributed.flatten(to_dict(cfg))
    free = set(resolved_keys(cfg)) if context_changed(cfg, saved) else set()
    changed = [
        k
        for k in sorted(set(saved) | set(now))
        if k.startswith(RESUME_KEYS)
        and _saved(saved, k, now) != now.get(k)
        and k not in free
        and not free_to_change(k)
    ]
    if changed:
        diffs = ", ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed[:6])
        raise ConfigError(
            f"train.output_dir={out} holds checkpoints of a run with a different config "
            f"({diffs}{', ...' if len(changed) > 6 else ''}); it cannot be resumed with this "
            f"one. Use a new train.output_dir, or the config in {saved_path}."
        )


def _saved(saved: dict, key: str, now: dict):
    """A saved config's value; a key it lacks (written before the key existed) is taken as the
    current value where that is empty (the key's default: nothing changed)."""
    if key not in saved and not now.get(key):
        return now.get(key)
    return saved.get(key)


def resolved_keys(cfg: Config) -> list[str]:
    """The `batch.*` keys a run resolves from the data (`-1` sizes, `capacity: auto`'s encoder
    buckets): what depends on the context groups besides the planner's plans."""
    keys = [f"batch.{k}" for k in (*AUTO_SIZES, *AUTO_LADDERS)]
    if cfg.batch.capacity == "auto":
        keys += [f"batch.{p.capacity}" for p in ENCODERS]
    return keys


def write_config(cfg: Config, out: Path) -> None:
    """`<output_dir>/config.json`, what `check_resumable` compares the next run against."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"config.json.tmp{os.getpid()}"  # other processes may be reading it
    tmp.write_text(json.dumps(to_dict(cfg), indent=2))
    tmp.replace(out / "config.json")


def run_stamp(out: Path, step: int) -> dict | None:
    """The stamp of a run's checkpoint `step` (`read_stamp`)."""
    directory = Path(out).absolute() / "checkpoints"
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False)) as m:
        return read_stamp(m, step)


def restore_params(out: Path, abstract_params: dict, step: int | None = None) -> tuple[int, dict]:
    """The trained and frozen parameters of a run's checkpoint, nothing else (no optimizer
    state, no data state): what export, generation and `model.init_from.run` read.

    Args:
      out: the run's train.output_dir.
      abstract_params: {"params": ..., "frozen": ...} shape trees (jax.ShapeDtypeStruct), any
        subset of the checkpoint's; leaves with a `.sharding` are restored as jax Arrays in it,
        the others as host numpy arrays.
      step: the checkpoint step; None = the latest.

    Returns:
      (step, {"params": ..., "frozen": ...}).

    Raises:
      ConfigError: no checkpoint (at that step) in the run.
    """
    directory = Path(out).absolute() / "checkpoints"
    steps = sorted(int(p.name) for p in directory.glob("*") if p.name.isdigit())
    if not steps or (step is not None and step not in steps):
        have = f"steps {steps}" if steps else "none"
        raise ConfigError(f"no checkpoint {'' if step is None else step} in {directory} ({have})")
    step = steps[-1] if step is None else step
    item = {k: v for k, v in abstract_params.items() if v}  # (orbax refuses empty subtrees)
    restore = jax.tree.map(_restore_args, item)
    with ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(create=False)) as m:
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore, partial_restore=True)
        restored = dict(m.restore(step, args=ocp.args.Composite(state=args))["state"])
    # A partial restore hands back the template for what the checkpoint lacks: refuse it.
    for path, leaf in jax.tree_util.tree_leaves_with_path(restored):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            name = jax.tree_util.keystr(path, simple=True, separator="/")
            raise ConfigError(f"checkpoint {step} in {directory} has no parameter {name}")
    return step, {k: restored.get(k, {}) for k in abstract_params}


def _restore_args(leaf) -> ocp.RestoreArgs:
    """How orbax restores one leaf: into its sharding and dtype when the template leaf has one,
    else as a host numpy array."""
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return ocp.RestoreArgs(restore_type=np.ndarray)
    return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=leaf.shape, dtype=leaf.dtype)
