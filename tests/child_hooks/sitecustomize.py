"""Imported at start-up by every Python process the tests start with `runs.child_env(kill=...)`,
which puts this folder first on PYTHONPATH: installs the kill point named in JAXMLLM_TEST_KILL
(a training run's) or JAXMLLM_TEST_INDEX_KILL (an index build's), or the hang point named in
JAXMLLM_TEST_HANG (a step that blocks).

Test machinery only, never imported by jaxmllm.
"""

import os

if os.environ.get("JAXMLLM_TEST_KILL"):
    import killpoints

    killpoints.install_from_env()

if os.environ.get("JAXMLLM_TEST_HANG"):
    import hangpoints

    hangpoints.install_from_env()

if os.environ.get("JAXMLLM_TEST_INDEX_KILL"):
    import indexkill

    indexkill.install_from_env()
