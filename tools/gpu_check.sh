#!/usr/bin/env bash
# The checks that need a GPU, in one go (a lent GPU comes by the minute): run from the repository
# root on a CUDA machine whose Python has jax with its CUDA plugin.
#
#   tools/gpu_check.sh OUT_DIR [env] [tests] [attention] [small] [long] [recipe]
#
#   env        jax's environment (versions, devices, cuDNN)
#   tests      the GPU-only tests (cuDNN attention against the dense reference, the ragged
#              exchange) and the block-sparse kernel and model tests, on the GPU
#   attention  python -m jaxmllm.bench.attention (dense, block-sparse, cuDNN) in bf16 and fp32
#   small      python -m jaxmllm.bench.throughput on configs/small.yaml: grain and orchestrated
#              with block-sparse, dense and cuDNN attention (tokens/s; MFU = TFLOP/s / peak)
#   long       the same on configs/long.yaml (8192-token rows)
#   recipe     configs/gpu/qwen2vl_2b.yaml's per-GPU shapes on this one GPU (no FSDP; built-in
#              data with images of up to 64 x 64 patches): MFU with cuDNN and block-sparse
#              attention under three remat policies, and each phase's device time
#
# Each part writes OUT_DIR/<part>.log (and the benches their JSON) and is bounded by a timeout
# (PART_TIMEOUT seconds, default 240), so one slow part leaves the others their time.
set -u
out=${1:?usage: tools/gpu_check.sh OUT_DIR [parts...]}
shift
parts=${*:-env tests attention small long}
limit=${PART_TIMEOUT:-240}
mkdir -p "$out"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} PYTHONUNBUFFERED=1 PYTHONPATH=".:${PYTHONPATH:-}"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
py=${PYTHON:-python3}

run() {  # run PART CMD...: the command's output to the screen and OUT_DIR/PART.log
    local part=$1
    shift
    echo "=== $part: $*"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$out/$part.log"
    echo "=== $part: exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
}

for part in $parts; do
    case $part in
    env)
        run env "$py" -c "import jax, flax, optax, orbax.checkpoint as oc, grain; \
jax.print_environment_info(); print('flax', flax.__version__, 'optax', optax.__version__, \
'orbax', oc.__version__); print(jax.devices())"
        ;;
    tests)
        run tests "$py" -m pytest -q -p no:cacheprovider -o addopts="" \
            tests/test_attention.py tests/test_orchestration.py \
            -k "cudnn or ragged or kernel_equals or model_loss"
        ;;
    attention)
        run attention_bf16 "$py" -m jaxmllm.bench.attention --rows 2048,8192,16384,32768 \
            --dtype bfloat16 --dense-max 16384 --repeat 20 --json "$out/attention_bf16.json"
        run attention_fp32 "$py" -m jaxmllm.bench.attention --rows 8192,32768 \
            --dense-max 8192 --repeat 10 --json "$out/attention_fp32.json"
        ;;
    small)
        # grain packs one row a device: one 4096-token row instead of small.yaml's two of 2048.
        # cuDNN in its own run, so that a failure there leaves the other rows.
        # (small.yaml's attention is auto: each policy names its kernel)
        for x in main:grain:block_sparse,orchestrated:block_sparse,orchestrated:dense \
                cudnn:orchestrated:cudnn; do
            run "small_${x%%:*}" "$py" -m jaxmllm.bench.throughput --config configs/small.yaml \
                --policies "${x#*:}" --steps 10 --warmup 2 --no-per-device \
                --json "$out/small_${x%%:*}.json" \
                --set batch.llm_rows=1 --set batch.llm_row_len=4096
        done
        ;;
    long)
        for x in main:grain,orchestrated,orchestrated:dense cudnn:orchestrated:cudnn; do
            run "long_${x%%:*}" "$py" -m jaxmllm.bench.throughput --config configs/long.yaml \
                --policies "${x#*:}" --steps 10 --warmup 2 --no-per-device \
                --json "$out/long_${x%%:*}.json" \
                --set mesh.data=1 --set model.compute_dtype=bfloat16
        done
        ;;
    recipe)
        run recipe "$py" -m jaxmllm.bench.throughput --config configs/gpu/qwen2vl_2b.yaml \
            --policies orchestrated:cudnn,orchestrated:block_sparse \
            --remat save_dots,save_dots_except_mlp,full --phases --steps 5 --warmup 2 \
            --json "$out/recipe.json" --set mesh.fsdp=1 --set batch.microbatches=2 \
            --set data.source=synthetic --set data.tokenizer=byte --set data.workers=8 \
            --set data.synthetic.min_image_side=16 --set data.synthetic.max_image_side=64 \
            --set data.synthetic.max_text_words=1000 --set batch.devices_per_host=-1 \
            --set data.synthetic.audio_fraction=0 --set train.steps=20
        ;;
    *)
        echo "unknown part: $part (env, tests, attention, small, long, recipe)" >&2
        exit 2
        ;;
    esac
done
