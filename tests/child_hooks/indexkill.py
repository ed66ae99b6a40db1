"""Kill or abort an index build at a known point, for the index tests (not part of the product).

`JAXMLLM_TEST_INDEX_KILL` holds a JSON spec; `install_from_env` patches the process (the build's
driver and every worker it spawns: they share the environment):

  {"record": "boom", "how": "kill"}    a worker SIGKILLs itself as it measures the record whose
  {"record": "boom", "how": "abort"}   line holds `"id": "boom"` (abort: SIGABRT, as an
                                       allocation failure in the Rust tokenizer ends)
  "once": "PATH"                       ... only the first time (PATH created then): a worker
                                       killed for another process's memory
  {"at": "merge"}                      the driver, as the merge of the measured parts starts
  {"at": "publish"}                    the driver, with the new index whole in its staging
                                       folder, before renaming it into place
  {"at": "between_renames"}            the driver, the old index renamed aside, the new one
                                       not yet in its place
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path


def install_from_env() -> None:
    spec = json.loads(os.environ["JAXMLLM_TEST_INDEX_KILL"])
    # (patched where jaxmllm.data.index imports them from: `python -m jaxmllm.data.index` runs
    # a fresh copy of that module, which takes these names when it runs)
    from jaxmllm.data import columnar, index_build

    if "record" in spec:
        measure = index_build.measure

        def measure_or_die(records, pre, k, decode=False):
            obj, _ = records.raw(k)
            if isinstance(obj, dict) and obj.get("id") == spec["record"] and _first(spec):
                die(f"measuring {spec['record']}", spec.get("how", "kill"))
            return measure(records, pre, k, decode)

        index_build.measure = measure_or_die
    elif spec["at"] == "merge":
        merge = index_build.merge_measured
        index_build.merge_measured = lambda *a, **k: die("merging") or merge(*a, **k)
    elif spec["at"] == "publish":
        columnar.publish = lambda staged, out: die("before publishing")
    elif spec["at"] == "between_renames":

        def half_publish(staged, out):
            if out.exists():
                os.rename(out, out.parent / f".{out.name}.old-0-killed")
            die("between the renames")

        columnar.publish = half_publish


def _first(spec: dict) -> bool:
    if "once" not in spec:
        return True
    try:
        Path(spec["once"]).touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


def die(where: str, how: str = "kill") -> None:
    print(f"indexkill: {how} {where}", file=sys.stderr, flush=True)
    if how == "abort":
        os.abort()
    os.kill(os.getpid(), signal.SIGKILL)
