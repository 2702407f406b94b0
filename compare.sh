#!/usr/bin/env bash
# The methods side by side on the embedded default, at equal episodes: SFT, PPO, DPO, RLOO (k=2 and
# k=4), GRPO (k=4) and online DPO from the same SFT and reward model per seed, at tiny-m x seeds 1 2 3;
# then eval/'s plots of every method and the comparison table (eval/compare_table.py).
#
#   make compare                      (or ./compare.sh): tiny-m x seeds 1 2 3
#   SIZES="m l" ./compare.sh          tiny-l as well (SEEDS chooses the seeds)
#   ARCH=llama ./compare.sh           the Llama-style embedded default (ARCH=qwen3: Qwen3-style), its runs
#                                     scaling_llama_<size>_<seed>, its plots eval/images/compare_llama/
#   ./compare.sh --force              retrain everything
#
# Each (size, seed) is `NAME=scaling_<size>_<seed> MODEL=models/tiny/pythia-tiny-<size> SEED=<seed>
# ALGOS=all ./hello_world.sh`: the folders of `make scaling` (scaling.sh), whose SFT, reward model
# and PPO runs are reused where they exist (a stage whose output exists is skipped; one stopped
# halfway resumes from its checkpoint), so only the missing methods train. Every online method gets PPO's budget: 15 updates of 64 episodes.
# The plots and tables take every seed found in runs/ of these sizes. Plots and tables:
# eval/images/compare/ (docs/compare.md shows them); another ARCH: its own names and folder.
set -euo pipefail
cd "$(dirname "$0")"

SIZES=${SIZES:-m}
SEEDS=${SEEDS:-"1 2 3"}
ARCH=${ARCH:-gpt_neox}
# shellcheck source=sbatches/tiny_default.sh
source sbatches/tiny_default.sh
tiny_arch_settings "$ARCH" || exit 2
# the Pythia-style runs keep make scaling's names (its SFT, reward model and PPO are reused)
RUNS=scaling$ARCH_SUFFIX
OUT=eval/images/compare$ARCH_SUFFIX
# shellcheck source=sweep_args.sh
source ./sweep_args.sh
parse_sweep_args "[ARCH=gpt_neox] [SIZES=\"m\"] [SEEDS=\"1 2 3\"]" "$@"

ARCH=$ARCH SIZES="$SIZES" ./hello_world.sh --data
check_base_models
start=$SECONDS
total=$((${#sizes[@]} * ${#seeds[@]}))
done_runs=0
for size in ${sizes[@]+"${sizes[@]}"}; do
    for seed in ${seeds[@]+"${seeds[@]}"}; do
        echo "=== compare: tiny-$size seed $seed ($((done_runs + 1)) of $total, $((SECONDS - start)) s so far)"
        NAME=${RUNS}_${size}_$seed MODEL=$BASE_MODELS_DIR/$TINY_PREFIX-tiny-$size SEED=$seed ALGOS=all ARCH=$ARCH \
            ./hello_world.sh ${force[@]+"${force[@]}"}
        done_runs=$((done_runs + 1))
    done
done

PY=.venv/bin/python
echo "=== compare: plots and table over methods x seeds in $OUT"
# every seed found of these sizes (those of earlier runs with other SEEDS too)
run_glob="${RUNS}_[${SIZES// /}]_*"
$PY eval/rlhf_scaling_plot.py --run_glob "$run_glob" --judge gold --out $OUT
$PY eval/compare_table.py --run_glob "$run_glob" --out $OUT
echo "=== compare: $total (size, seed) pairs in $((SECONDS - start)) s; the table: $OUT/compare_table.md"
