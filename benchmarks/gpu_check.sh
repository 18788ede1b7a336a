#!/usr/bin/env bash
# The accelerator figures in one pass that fits a short job slot (about 9 minutes by default),
# every result written under OUT as it is made, so a slot cut short keeps what it finished:
#
#     bash benchmarks/gpu_check.sh DATA OUT [STATE]
#
# DATA: the CIFAR-10 archive or folder; OUT: an empty folder for the results; STATE: an earlier
# pass's OUT (its train.safetensors.state.pt), to resume that training where it stopped (bit for
# bit: `lofast train --resume`). INIT=CHECKPOINT instead starts a new schedule from a trained
# model (`lofast train --init`, the way the shipped default was trained, in stages).
#
# A slot of 15 minutes (the machine's start included) takes two or three calls. Training the
# default on: `INIT=checkpoints/lofast-default.safetensors TEMPERATURE=0.03125 LR=4e-3
# BENCH_BATCHES= COMPILE= PASS_SECONDS=510 bash ... DATA OUT` (7 minutes on an H100; its last
# stage ran at that temperature and lr, on a CPU), then shorter stages from
# OUT/train.safetensors with EPOCHS=N and a smaller PASS_SECONDS while time is left (the
# default's stages 2-4 were one slot, checkpoints/README.md). The figures alone:
# `PASS_SECONDS=0 BENCH_BATCHES=1024 bash ... DATA OUT2` (about 4 minutes, most of it compiling).
#
#   1. benchmarks/bench_train.py on lofast-s: images/s of plain and certified steps at each
#      batch size of BENCH_BATCHES (default "1024 4096"; OUT/bench_train_bB.json), and a
#      torch.profiler table of certified steps at the first (OUT/profile.txt);
#   2. lofast certify of the shipped default on the whole DATA test split, exact guarantee,
#      with its end-to-end wall time (OUT/certify_default.json; the time in OUT/log.txt);
#      2b. the plain and certified steps at the first batch size under torch.compile in each
#      mode of COMPILE (default "cudagraphs": CUDA graphs against the launch overhead, as
#      `lofast train --compile`; Inductor's Triton build of the loss's backward failed on an
#      H200 in modes default and reduce-overhead; COMPILE= skips it;
#      OUT/bench_train_compiled.json);
#      2c. with TOKENS (e.g. "64 256"), benchmarks/bench_tokens.py at those token counts:
#      fresh width-128 models of depth TOKENS_DEPTH (default 6) with position biases, both
#      guarantees, ms a sample, once-per-model seconds and peak device memory, within
#      TOKENS_SECONDS (default 300; OUT/bench_tokens.json), with TOKENS_ARGS (more options of
#      bench_tokens.py, e.g. "--large 48 --profile 25"). The 64- and 256-token figures
#      alone: `TOKENS="64 256" PASS_SECONDS=0 BENCH_BATCHES= COMPILE= bash ... DATA OUT`;
#      2d. with LIVE=K, benchmarks/bench_certify.py on the default with live attention K
#      (`--live-attention K`, the shape of the ||A_l|| / s = K models the CPU figures use):
#      ms a sample over the first LIVE_N (default 512) bundled images in batches of
#      LIVE_BATCH (default 1024), exact guarantee (OUT/bench_live.json);
#      2e. with FORWARD=1, benchmarks/bench_forward.py: the default's forward pass at batch
#      1024 against a plain ViT of its shape (OUT/bench_forward.json);
#      2f. with ATTACK=N, lofast certify --attack of the default on the first N test images at
#      the four eps (float64 minimum-norm attack and l2 PGD, ATTACK_STEPS default 100,
#      ATTACK_RESTARTS default 2), with its wall time (OUT/attack_default.json; the time in
#      OUT/log.txt): the attack pass of the GPU issue (ATTACK=10000, within ATTACK_SECONDS,
#      default 240);
#      2g. with CHECKPOINTS (files, e.g. checkpoints/candidates/lofast-p4.safetensors, the
#      trained 64-token candidate), for each of
#      them and each guarantee of CHECKPOINT_GUARANTEES (default "probabilistic exact"),
#      benchmarks/bench_certify.py on the first CHECKPOINT_N (default 500) bundled images in
#      one batch: the per-model proofs (setup_seconds) apart from ms a sample, and the 25
#      operators with the most device time in one certification of that batch
#      (OUT/bench_NAME_GUARANTEE.json, within CHECKPOINT_SECONDS each, default 150);
#      2h. with NORMS=1, benchmarks/bench_small_norms.py: the per-sample matrix norms of 256
#      samples at 17, 65 and 257 tokens by the dense eigensolver, by the Cholesky proof an
#      accelerator takes above 32 x 32 and by the factors' r x r problems, Lanczos
#      tridiagonals' top eigenvalues on the device and the host, and the 288 x 288 deflation
#      eigensolver by the default backend and MAGMA (OUT/bench_small_norms.json);
#      2i. with TESTS (pytest arguments, e.g. "-m integration"), the test suite on the device,
#      whose `auto` device is then the GPU (OUT/tests.txt, within TESTS_SECONDS, default 240;
#      pytest and pytest-xdist from runs/pylib, `pip install --target runs/pylib pytest
#      pytest-xdist` carried in, where the device lacks them);
#   3. lofast train with TRAIN_ARGS until PASS_SECONDS (default 520) after the start of the
#      pass (none when less than a minute of it is left: PASS_SECONDS=0 gives the figures
#      only), resumed from STATE when given (OUT/train.safetensors, and its .state.pt for the
#      next pass). The default TRAIN_ARGS: the shipped default's recipe (lofast-s at depth 6
#      and width 256 with position biases, certified loss at eps 0.15, float32, no
#      augmentation, batch 250: it divides the 50,000 images, so no smaller last batch
#      compiles a second graph), each step captured in CUDA graphs (--compile; without it if
#      the compiled run fails), for as many epochs as fit; with INIT, a further stage of that
#      recipe, as the default's stages 2-4 (checkpoints/README.md): from INIT's weights and
#      architecture, the radius at 0.15 from the start, half an epoch of warm-up. A
#      state over 15 MiB is written in parts of 15 MiB, as a file that comes back from the
#      device may have at most 16 MiB. With EPOCHS=auto (the default; not with STATE) a
#      two-epoch probe on a quarter of the training set times an epoch (and the compilation)
#      first and the run gets as many epochs as fit, so that its schedule ends inside the
#      pass; a resuming pass takes the epochs from STATE.
#   4. lofast certify of the model trained so far, as in 2 (OUT/certify_train.json; at most 50 s
#      after the pass).
#
# Each step runs whatever became of the one before; everything printed goes to OUT/log.txt.
# Environment: DEVICE (default cuda), BENCH_BATCHES (set but empty: no step 1), BENCH_ARGS
# (more options of bench_train.py), COMPILE, TOKENS, TOKENS_DEPTH, TOKENS_SECONDS, TOKENS_ARGS,
# LIVE, LIVE_N, LIVE_BATCH, FORWARD, ATTACK, ATTACK_STEPS, ATTACK_RESTARTS, ATTACK_SECONDS,
# CHECKPOINTS, CHECKPOINT_GUARANTEES, CHECKPOINT_N, CHECKPOINT_SECONDS, NORMS, TESTS,
# TESTS_SECONDS, LR (the recipe's learning rate, default 2e-3; a CPU ablation favoured 1.6e-2
# to 3.2e-2), TEMPERATURE (the certified loss's, default 0.25; a CPU ablation favoured 0.0625
# at lr 1.6e-2; 6 epochs at 0.0625, four times 6 at 0.03125, then four times 12, took the
# default from 43.11 to 45.12, 45.76, 46.38, 46.63, 46.82, 47.38, 47.79, 47.94, then 47.92 % at
# 36/255: stalled at lr 4e-3 and batch 250, so a GPU slot should try lr 1.6e-2 and batch 500+
# for many epochs: 12 of them on a CPU, from the default, fell to 52.8 % test accuracy after
# the first and came back only to 47.53 % at 36/255; 10 at lr 4e-3: 47.60 %),
# BATCH (its batch size, default 250; 500 and 1000 also divide the training set;
# at equal steps and lr 1.6e-2 x BATCH / 250 a CPU screen certified 1.2 / 1.6 points more),
# LIMIT (certify only the first LIMIT test images; default all), PASS_SECONDS, TRAIN_ARGS, INIT,
# EPOCHS, PART_MIB (default 15). With DEVICE=cpu and a small LIMIT and PASS_SECONDS it runs
# anywhere, as tests/test_gpu_check.py runs it. Needs python3 with torch and lofast's
# dependencies; lofast itself is taken from this checkout.
set -uo pipefail
if [ $# -lt 2 ]; then
    echo "usage: bash benchmarks/gpu_check.sh DATA OUT [STATE]" >&2
    exit 2
fi
data=$1
out=$2
state=${3:-}
device=${DEVICE:-cuda}
pass_seconds=${PASS_SECONDS:-520}
epochs=${EPOCHS:-auto}
recipe="--lr ${LR:-2e-3} --batch-size ${BATCH:-250} --temperature ${TEMPERATURE:-0.25} --loss certified --train-eps 0.15 \
--power-iterations 1 --no-amp --no-augment --compile"
# a slot lost to a typo is lost for good: what the pass reads is checked before any work
if [ ! -e "$data" ]; then
    echo "no data at $data (DATA: the CIFAR-10 archive or folder)" >&2
    exit 2
fi
if [ -n "$state" ] && ! compgen -G "$state/train.safetensors.state.pt*" > /dev/null; then
    echo "no training state in $state (STATE: an earlier pass's OUT)" >&2
    exit 2
fi
if [ -n "${INIT:-}" ] && [ ! -f "$INIT" ]; then
    echo "no checkpoint at $INIT (INIT)" >&2
    exit 2
fi
if [ -n "${INIT:-}" ] && [ -n "$state" ]; then
    echo "INIT starts a new schedule and STATE resumes one: give one of them" >&2
    exit 2
elif [ -n "${INIT:-}" ]; then
    train_args=${TRAIN_ARGS:-"--init $INIT --warmup-epochs 0.5 $recipe"}
else
    train_args=${TRAIN_ARGS:-"--preset lofast-s --model-option depth=6 --model-option width=256 \
--model-option position_bias=true --warmup-epochs 2 --eps-ramp-epochs 5 $recipe"}
fi
export PYTHONUNBUFFERED=1
begin=$(date +%s)
cd "$(dirname "$0")/.."
mkdir -p "$out"
exec > >(tee -a "$out/log.txt") 2>&1
elapsed() { echo $(($(date +%s) - begin)); }
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the benchmarks import this checkout's lofast
python3 -c "import torch; print('torch', torch.__version__, 'device', '$device',
    torch.cuda.get_device_name() if '$device'.startswith('cuda') else 'cpu')"

# the batch sizes timed: a certified step waits for kernel launches, whose count does not
# grow with the batch, so a larger batch buys images/s until the device's own work dominates
read -r -a batches <<< "${BENCH_BATCHES-1024 4096}"  # set but empty: none
profile=(--profile "$out/profile.txt")
for batch in "${batches[@]}"; do
    echo "== 1. training throughput at batch $batch ($(elapsed) s)"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    timeout 150 python3 benchmarks/bench_train.py --preset lofast-s --device "$device" \
        --power-iterations 1 --batch-size "$batch" ${BENCH_ARGS:-} \
        --out "$out/bench_train_b$batch.json" "${profile[@]}" || echo "bench_train: exit $?"
    profile=()  # the profile at the first batch size only
done

echo "== 2. certifying the default ($(elapsed) s)"
limit=()
if [ -n "${LIMIT:-}" ]; then limit=(--limit "$LIMIT"); fi
start=$(date +%s.%N)
timeout 150 python3 -m lofast certify --data "$data" --device "$device" "${limit[@]}" --eps 0.02 \
    --eps 0.05 --eps 0.1 --eps 36/255 --json > "$out/certify_default.json" \
    || echo "certify: exit $?"
python3 -c "print('certify_default seconds', round($(date +%s.%N) - $start, 2))"

read -r -a compile_modes <<< "${COMPILE-cudagraphs}"  # set but empty: skipped
if [ ${#compile_modes[@]} -gt 0 ]; then
    echo "== 2b. training throughput under torch.compile ($(elapsed) s)"
    compile_options=()
    for mode in "${compile_modes[@]}"; do compile_options+=(--compile "$mode"); done
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    timeout 240 python3 benchmarks/bench_train.py --preset lofast-s --device "$device" \
        --power-iterations 1 --batch-size "${batches[0]:-1024}" ${BENCH_ARGS:-} \
        "${compile_options[@]}" \
        --out "$out/bench_train_compiled.json" || echo "bench_train --compile: exit $?"
fi

read -r -a token_counts <<< "${TOKENS-}"  # e.g. "64 256"; unset or empty: skipped
if [ ${#token_counts[@]} -gt 0 ]; then
    echo "== 2c. the certifier against the token count ($(elapsed) s)"
    # shellcheck disable=SC2086  # TOKENS_ARGS is a list of options
    timeout "${TOKENS_SECONDS:-300}" python3 benchmarks/bench_tokens.py \
        --tokens "$(IFS=,; echo "${token_counts[*]}")" --guarantees exact,probabilistic \
        --position-bias --models 1 --depth "${TOKENS_DEPTH:-6}" --device "$device" \
        ${TOKENS_ARGS:-} --out "$out/bench_tokens.json" || echo "bench_tokens: exit $?"
fi

if [ -n "${LIVE:-}" ]; then
    echo "== 2d. the default with live attention K = $LIVE ($(elapsed) s)"
    timeout 200 python3 benchmarks/bench_certify.py --live-attention "$LIVE" \
        --n "${LIVE_N:-512}" --batch-sizes "${LIVE_BATCH:-1024}" --device "$device" \
        --out "$out/bench_live.json" || echo "bench_certify --live-attention: exit $?"
fi

if [ -n "${FORWARD:-}" ]; then
    echo "== 2e. the default's forward pass against a plain ViT ($(elapsed) s)"
    timeout 120 python3 benchmarks/bench_forward.py --batch 1024 --device "$device" \
        --out "$out/bench_forward.json" || echo "bench_forward: exit $?"
fi

if [ -n "${ATTACK:-}" ]; then
    echo "== 2f. certify --attack of the default on $ATTACK test images ($(elapsed) s)"
    start=$(date +%s.%N)
    timeout "${ATTACK_SECONDS:-240}" python3 -m lofast certify --data "$data" --device "$device" \
        --limit "$ATTACK" \
        --eps 0.02 --eps 0.05 --eps 0.1 --eps 36/255 --attack \
        --attack-steps "${ATTACK_STEPS:-100}" --attack-restarts "${ATTACK_RESTARTS:-2}" \
        --json > "$out/attack_default.json" || echo "certify --attack: exit $?"
    python3 -c "print('attack_default seconds', round($(date +%s.%N) - $start, 2))"
fi

read -r -a checkpoints <<< "${CHECKPOINTS-}"  # unset or empty: skipped
for checkpoint in "${checkpoints[@]}"; do
    for guarantee in ${CHECKPOINT_GUARANTEES:-probabilistic exact}; do
        echo "== 2g. $checkpoint, $guarantee guarantee ($(elapsed) s)"
        timeout "${CHECKPOINT_SECONDS:-150}" python3 benchmarks/bench_certify.py \
            --checkpoint "$checkpoint" --guarantee "$guarantee" --n "${CHECKPOINT_N:-500}" \
            --batch-sizes "${CHECKPOINT_N:-500}" --device "$device" --profile 25 \
            --out "$out/bench_$(basename "$checkpoint" .safetensors)_$guarantee.json" \
            || echo "bench_certify $checkpoint: exit $?"
    done
done

if [ -n "${NORMS:-}" ]; then
    echo "== 2h. per-sample matrix norms: eigensolver, proof and factors ($(elapsed) s)"
    timeout 90 python3 benchmarks/bench_small_norms.py --device "$device" --batch 256 \
        --out "$out/bench_small_norms.json" || echo "bench_small_norms: exit $?"
fi

if [ -n "${TESTS:-}" ]; then
    echo "== 2i. the test suite on the device: pytest $TESTS ($(elapsed) s)"
    # the tests' `auto` device is the GPU here: the paths CI (CPU only) never takes; pytest
    # and pytest-xdist from runs/pylib (pip install --target) where the device has none
    if ! python3 -c "import pytest, xdist" 2>/dev/null; then
        export PYTHONPATH="$PYTHONPATH:$PWD/runs/pylib"
    fi
    # shellcheck disable=SC2086  # TESTS is a list of pytest arguments
    timeout "${TESTS_SECONDS:-240}" python3 -m pytest -q -p no:cacheprovider -n 8 $TESTS \
        > "$out/tests.txt" 2>&1 || echo "pytest: exit $?"
    tail -15 "$out/tests.txt"
fi

if [ "$pass_seconds" -le $(($(elapsed) + 60)) ]; then  # PASS_SECONDS=0: the figures only
    echo "== no training: the pass ends at ${pass_seconds} s ($(elapsed) s)"
    exit 0
fi
resume=()
if [ -n "$state" ]; then
    cp "$state"/train.safetensors "$out/" 2>/dev/null  # the checkpoint once written
    cat "$state"/train.safetensors.state.pt* > "$out/train.safetensors.state.pt"  # or its parts
    resume=(--resume)
    if [ "$epochs" = auto ]; then  # a resume needs the epochs that the first pass chose
        epochs=$(python3 -c "import torch; print(torch.load('$out/train.safetensors.state.pt',
            weights_only=False)['train_config']['epochs'])")
    fi
elif [ "$epochs" = auto ]; then
    # two epochs of a quarter of the training set (12,500 of 50,000 images): the second's
    # time, scaled, is an epoch's; the first's excess is a compiled run's compilation, which
    # the run pays again (once with the recipe's batch of 250, which divides both sets;
    # twice, for the smaller last batch, with a TRAIN_ARGS batch that does not)
    echo "== 3a. two-epoch probe ($(elapsed) s)"
    probe=$(mktemp -d)
    probe_run() {
        # shellcheck disable=SC2086  # TRAIN_ARGS is a list of options
        python3 -m lofast train --dataset cifar10 --data "$data" --device "$device" $train_args \
            --epochs 2 --limit 12500 --out "$probe/probe.safetensors" --overwrite \
            > "$probe/log" 2>&1 || tail -3 "$probe/log"
    }
    probe_run
    if [ ! -f "$probe/probe.safetensors" ] && [[ " $train_args " == *" --compile "* ]]; then
        echo "== the compiled probe failed: training without --compile ($(elapsed) s)"
        train_args=${train_args/--compile/}
        probe_run
    fi
    # 30 s for loading the data and the last write; 1 s an epoch for its test and state write
    # (0.75 s with width 256's 42 MB state on an H100: 24 epochs of 7.7 s in 224 s, 2026-11-26)
    batch=$(grep -oE -- '--batch-size [0-9]+' <<< "$train_args" | grep -oE '[0-9]+$' || echo 256)
    left=$((pass_seconds - $(elapsed) - 30))
    epochs=$(python3 -c "import torch; h = torch.load('$probe/probe.safetensors.state.pt',
        weights_only=False)['history']; epoch = h[1]['seconds'] * 50000 / 12500
graphs = 1 if 50000 % $batch == 0 and 12500 % $batch == 0 else 2
compiling = graphs * max(0.0, h[0]['seconds'] - h[1]['seconds'])
print(max(1, int(0.9 * ($left - compiling) / (epoch + 1))))")
    echo "probe: $(python3 -c "import torch; print(torch.load('$probe/probe.safetensors.state.pt',
        weights_only=False)['history'])"); $left s left: $epochs epochs"
fi
epoch_option=()
if [ "$epochs" != auto ]; then epoch_option=(--epochs "$epochs"); fi
echo "== 3. training until ${pass_seconds} s ($(elapsed) s)"
train() {
    # shellcheck disable=SC2086  # TRAIN_ARGS is a list of options
    python3 -m lofast train --dataset cifar10 --data "$data" --device "$device" $train_args \
        "${epoch_option[@]}" --time-limit $((pass_seconds - $(elapsed))) \
        --out "$out/train.safetensors" "$@"
}
train "${resume[@]}"
code=$?
if [ $code -ne 0 ] && [ $code -ne 75 ] && [[ " $train_args " == *" --compile "* ]]; then
    train_args=${train_args/--compile/}
    if [ -f "$out/train.safetensors.state.pt" ]; then
        echo "== train: exit $code; going on without --compile from its last state ($(elapsed) s)"
        train --resume --overwrite
    else  # it failed before its first state: the run from its start
        echo "== train: exit $code; training without --compile ($(elapsed) s)"
        train "${resume[@]}" --overwrite
    fi
    code=$?
fi
[ $code -eq 0 ] || echo "train: exit $code"
if [ -f "$out/train.safetensors" ]; then
    echo "== 4. certifying the trained model ($(elapsed) s)"
    timeout 50 python3 -m lofast certify --checkpoint "$out/train.safetensors" --data "$data" \
        --device "$device" "${limit[@]}" --eps 0.02 --eps 0.05 --eps 0.1 --eps 36/255 --json \
        > "$out/certify_train.json" || echo "certify: exit $?"
fi
# a file that comes back from the device has at most 16 MiB: a wider model's state comes back in
# parts (train.safetensors.state.pt.part0, ...), which a resuming pass joins again
state_file="$out/train.safetensors.state.pt"
part_bytes=$((${PART_MIB:-15} * 1024 * 1024))
if [ -f "$state_file" ] && [ "$(stat -c %s "$state_file")" -gt "$part_bytes" ]; then
    split -b "$part_bytes" -d -a 1 "$state_file" "$state_file.part" && rm "$state_file"
fi
echo "== done ($(elapsed) s)"
