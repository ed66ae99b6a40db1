#!/usr/bin/env bash
# Prints the path of a Python of the version asked for (default 3.12, the GPU image's) that runs
# here, or nothing and exit 1: python3.12 on the PATH (a pyenv shim counts only where it runs),
# else pyenv's newest 3.12 ($PYENV_ROOT, `pyenv root` or ~/.pyenv). CI's Python 3.12 leg
# (.ci/run) and tests/test_gpu_image.py use it.
#
#   tools/python.sh [3.12]
set -u
want=${1:-3.12}
candidates=()
if command -v "python$want" >/dev/null 2>&1; then
    candidates+=("$(command -v "python$want")")
fi
root=${PYENV_ROOT:-$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")}
while IFS= read -r found; do
    candidates+=("$found")
done < <(ls -d "$root"/versions/"$want"*/bin/"python$want" 2>/dev/null | sort -V -r)
for python in "${candidates[@]}"; do
    if "$python" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" 2>/dev/null; then
        echo "$python"
        exit 0
    fi
done
exit 1
