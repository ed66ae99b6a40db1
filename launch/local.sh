#!/usr/bin/env bash
# N training processes on this machine, one job (CPU: gloo between them; GPUs: add --gpus).
#
#   bash launch/local.sh 2 --config configs/tiny.yaml [--set key=value ...]
#   bash launch/local.sh 8 --gpus --config configs/small.yaml     # one process per GPU
#
# mesh.cpu_devices counts devices in all and is shared out between the processes, so the same
# config runs as 1 x 8, 2 x 4 or 4 x 2. If a process dies the launcher stops the others and
# says so; rerun the same command to resume from the latest checkpoint.
set -euo pipefail
n=${1:?usage: bash launch/local.sh PROCESSES [--gpus] --config FILE [--set key=value ...]}
shift
exec python -m jaxmllm.launch --processes "$n" "$@"
