#!/usr/bin/env bash
# The staleness study of asynchronous RLHF on the embedded default (docs/async.md): PPO, RLOO (k=2),
# GRPO (k=4) and online DPO at --async_steps N for each N of STEPS (the rollouts of update t sampled by
# the policy of update t - N), seeds SEEDS, every run from hello_world's SFT policy and reward model
# (./hello_world.sh first, whose finished stages are skipped) at its 15 updates of 64 episodes; then
# eval/async_table.py: eval/images/async/async_summary.csv and its plots; eval/learner_kl.py: the
# final policies' own KL to SFT (async_learner_kl.csv).
#
#   make async                       (or ./async.sh): STEPS="0 1 2 4 8" x SEEDS="1 2 3"
#   STEPS="0 2" SEEDS=1 ./async.sh   a smaller grid (the table takes every run found)
#   JOBS=1 ./async.sh                one run at a time (default: one per core, each on one thread)
#   ARCH=llama ./async.sh            the Llama-style default (ARCH=qwen3: Qwen3-style): its hello_world's
#                                    models, runs async_llama_n<N>_s<seed>, eval/images/async_llama/
#   ./async.sh --force               retrain the study's runs (never hello_world's models)
#
# Each (N, seed) is NAME=async_n<N>_s<seed> SEED=<seed> ALGOS="ppo rloo grpo online_dpo" ./hello_world.sh
# with --async_steps N for each method, on one thread; its models/ folder links hello_world's SFT policy,
# the reward model's backbone and the reward model, and runs/ its SFT run, so only the four methods
# train (a finished one is skipped, a stopped one resumes). Its output: runs/async_n<N>_s<seed>.log.
set -euo pipefail
cd "$(dirname "$0")"

STEPS=${STEPS:-"0 1 2 4 8"}
SEEDS=${SEEDS:-"1 2 3"}
ARCH=${ARCH:-gpt_neox}
JOBS=${JOBS:-$(nproc)}
# shellcheck source=sbatches/tiny_default.sh
source sbatches/tiny_default.sh
tiny_arch_settings "$ARCH" || exit 2
FORCE=0
for arg in "$@"; do
    case "$arg" in
        --force) FORCE=1 ;;
        *) echo "usage: [ARCH=gpt_neox] [STEPS=\"0 1 2 4 8\"] [SEEDS=\"1 2 3\"] [JOBS=<cores>] $0 [--force]" >&2
           exit 2 ;;
    esac
done
read -ra steps <<<"$STEPS"
read -ra seeds <<<"$SEEDS"
for value in ${steps[@]+"${steps[@]}"} ${seeds[@]+"${seeds[@]}"} "$JOBS"; do
    [[ $value =~ ^[0-9]+$ ]] || { echo "STEPS, SEEDS and JOBS take whole numbers, not '$value'" >&2; exit 2; }
done
if (( ${#steps[@]} == 0 || ${#seeds[@]} == 0 || JOBS < 1 )); then
    echo "STEPS and SEEDS must name at least one value each, JOBS at least 1" >&2; exit 2
fi
BASE=hello_world$ARCH_SUFFIX
METHODS="ppo rloo grpo online_dpo"
OUT=eval/images/async$ARCH_SUFFIX

echo "=== async: hello_world's SFT policy and reward model (models/$BASE)"
ARCH=$ARCH ALGOS=ppo ./hello_world.sh

# study_run N SEED: the four methods at --async_steps N from hello_world's models
study_run() {
    local name=async${ARCH_SUFFIX}_n$1_s$2 part algo
    mkdir -p "models/$name" runs
    for part in sft sft_all_tokens reward_model; do ln -sfn "$PWD/models/$BASE/$part" "models/$name/$part"; done
    ln -sfn "$PWD/runs/${BASE}_sft" "runs/${name}_sft"
    if [[ $FORCE == 1 ]]; then
        for algo in $METHODS; do rm -rf "models/$name/$algo" "runs/${name}_$algo"; done
    fi
    NAME=$name SEED=$2 ARCH=$ARCH ALGOS=$METHODS OMP_NUM_THREADS=1 PPO_FLAGS="--async_steps $1" \
        RLOO_FLAGS="--async_steps $1" ONLINE_DPO_FLAGS="--async_steps $1" ./hello_world.sh >"runs/$name.log" 2>&1
}

start=$SECONDS
total=$((${#steps[@]} * ${#seeds[@]}))
pids=()
labels=()
failed=()
oldest=0  # the first run not yet waited for: at most JOBS run at once
for n in ${steps[@]+"${steps[@]}"}; do
    for seed in ${seeds[@]+"${seeds[@]}"}; do
        echo "=== async: N=$n seed $seed ($((${#pids[@]} + 1)) of $total, $((SECONDS - start)) s so far;" \
             "runs/async${ARCH_SUFFIX}_n${n}_s$seed.log)"
        study_run "$n" "$seed" &
        pids+=("$!")
        labels+=("N=$n seed $seed")
        if (( ${#pids[@]} - oldest >= JOBS )); then
            wait "${pids[oldest]}" || failed+=("${labels[oldest]}")
            oldest=$((oldest + 1))
        fi
    done
done
while (( oldest < ${#pids[@]} )); do
    wait "${pids[oldest]}" || failed+=("${labels[oldest]}")
    oldest=$((oldest + 1))
done
if (( ${#failed[@]} )); then
    for ((i = 0; i < ${#failed[@]}; i++)); do
        echo "error: the run of ${failed[i]} failed (its log: runs/async${ARCH_SUFFIX}_n<N>_s<seed>.log)" >&2
    done
    exit 1
fi

echo "=== async: the table and plots over every async${ARCH_SUFFIX} run in $OUT"
.venv/bin/python eval/async_table.py --run_glob "async${ARCH_SUFFIX}_n*" --sft_run "${BASE}_sft" --out "$OUT"
# the learner's own KL to SFT, which objective/kl (read on the stale rollouts) is not
.venv/bin/python eval/learner_kl.py --run_glob "async${ARCH_SUFFIX}_n*" --queries 200 --out "$OUT"
echo "=== async: $total (N, seed) pairs in $((SECONDS - start)) s; the table: $OUT/async_summary.md"
