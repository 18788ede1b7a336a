#!/usr/bin/env bash
# The accelerator figures in one pass that fits a short job slot (about 9 minutes by default),
# every result written under OUT as it is made, so a slot cut short keeps what it finished:
#
#     bash benchmarks/gpu_check.sh DATA OUT [STATE]
#
# DATA: the CIFAR-10 archive or folder; OUT: an empty folder for the results; STATE: an earlier
# pass's OUT (its train.safetensors.state.pt), to resume that training where it stopped (bit for
# bit: `lofast train --resume`).
#
#   1. benchmarks/bench_train.py on lofast-s: images/s of plain and certified steps
#      (OUT/bench_train.json);
#   2. lofast certify of the shipped default on the whole DATA test split, exact guarantee,
#      with its end-to-end wall time (OUT/certify_default.json, OUT/certify_default.seconds);
#   3. lofast train for TRAIN_SECONDS (default 300) with TRAIN_ARGS (default: a wider lofast-s,
#      certified at eps 0.15), resumed from STATE when given (OUT/train.safetensors, its
#      .state.pt for the next pass, OUT/train.log).
#
# Environment: DEVICE (default cuda), BENCH_ARGS (more options of bench_train.py), LIMIT
# (certify only the first LIMIT test images; default all), TRAIN_SECONDS, TRAIN_ARGS. With DEVICE=cpu and small LIMIT and TRAIN_SECONDS it runs
# anywhere, which is how it is tested. Needs python3 with torch and lofast's dependencies;
# installs lofast itself (no network) when it is not importable.
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: bash benchmarks/gpu_check.sh DATA OUT [STATE]" >&2
    exit 2
fi
data=$1
out=$2
state=${3:-}
device=${DEVICE:-cuda}
seconds=${TRAIN_SECONDS:-300}
train_args=${TRAIN_ARGS:-"--preset lofast-s --model-option depth=6 --model-option width=256 \
--model-option position_bias=true --loss certified --train-eps 0.15 --power-iterations 1 \
--temperature 0.25 --lr 2e-3 --batch-size 1024 --epochs 200 --eps-ramp-epochs 5"}
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
mkdir -p "$out"
if ! python3 -c "import lofast" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
fi
python3 -c "import torch; print('torch', torch.__version__, 'device', '$device',
    torch.cuda.get_device_name() if '$device'.startswith('cuda') else 'cpu')"

echo "== 1. training throughput"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
python3 benchmarks/bench_train.py --preset lofast-s --device "$device" ${BENCH_ARGS:-} \
    --out "$out/bench_train.json"

echo "== 2. certifying the default"
limit=()
if [ -n "${LIMIT:-}" ]; then limit=(--limit "$LIMIT"); fi
start=$(date +%s.%N)
python3 -m lofast certify --data "$data" --device "$device" "${limit[@]}" --eps 0.02 --eps 0.05 \
    --eps 0.1 --eps 36/255 --json > "$out/certify_default.json"
python3 -c "print(round($(date +%s.%N) - $start, 2))" | tee "$out/certify_default.seconds"

echo "== 3. training for ${seconds} s"
resume=()
if [ -n "$state" ]; then
    cp "$state"/train.safetensors* "$out/"  # the state, and the checkpoint once written
    resume=(--resume)
fi
# shellcheck disable=SC2086  # TRAIN_ARGS is a list of options
python3 -m lofast train --dataset cifar10 --data "$data" --device "$device" $train_args \
    --time-limit "$seconds" --out "$out/train.safetensors" "${resume[@]}" 2>&1 | tee "$out/train.log"
