#!/usr/bin/env bash
# The embedded default as a miniature of the paper's scaling experiment: SFT -> reward model -> PPO
# for each tiny size x seed with hello_world.sh's one set of stage hyperparameters (DPO left out),
# then eval/'s scaling plots with the seed spread and the results table (eval/scaling_table.py).
#
#   make scaling                      (or ./scaling.sh): tiny-s, -m, -l x seeds 1 2 3, one run after
#                                     another on this machine
#   SIZES="m l" SEEDS="1 2 3 4" ./scaling.sh
#
# Each (size, seed) is `NAME=scaling_<size>_<seed> MODEL=models/tiny/pythia-tiny-<size> SEED=<seed>
# DPO=0 ./hello_world.sh`: its models go to models/scaling_<size>_<seed>/, its runs to
# runs/scaling_<size>_<seed>_<stage>/. A stage whose output exists is skipped, so a rerun (or a run
# stopped halfway and started again) only trains what is missing; --force retrains everything.
# Plots and tables: eval/images/scaling/.
set -euo pipefail
cd "$(dirname "$0")"

SIZES=${SIZES:-"s m l"}
SEEDS=${SEEDS:-"1 2 3"}
OUT=eval/images/scaling
force=()
for arg in "$@"; do
    case "$arg" in
        --force) force=(--force) ;;
        *) echo "usage: [SIZES=\"s m l\"] [SEEDS=\"1 2 3\"] $0 [--force]" >&2; exit 2 ;;
    esac
done
read -ra sizes <<<"$SIZES"
read -ra seeds <<<"$SEEDS"
for size in ${sizes[@]+"${sizes[@]}"}; do
    [[ $size =~ ^[a-z]+$ ]] || { echo "SIZES: '$size' is not a tiny size name (s, m, l)" >&2; exit 2; }
done
for seed in ${seeds[@]+"${seeds[@]}"}; do
    [[ $seed =~ ^[0-9]+$ ]] || { echo "SEEDS: '$seed' is not a seed" >&2; exit 2; }
done
if (( ${#sizes[@]} == 0 || ${#seeds[@]} == 0 )); then
    echo "SIZES and SEEDS must name at least one size and one seed" >&2; exit 2
fi

./hello_world.sh --data
for size in ${sizes[@]+"${sizes[@]}"}; do
    [[ -d models/tiny/pythia-tiny-$size ]] ||
        { echo "no base model models/tiny/pythia-tiny-$size (the tiny sizes are those of tiny_models.SIZES)" >&2; exit 2; }
done
start=$SECONDS
total=$((${#sizes[@]} * ${#seeds[@]}))
done_runs=0
for size in ${sizes[@]+"${sizes[@]}"}; do
    model=models/tiny/pythia-tiny-$size
    for seed in ${seeds[@]+"${seeds[@]}"}; do
        echo "=== scaling: tiny-$size seed $seed ($((done_runs + 1)) of $total, $((SECONDS - start)) s so far)"
        NAME=scaling_${size}_$seed MODEL=$model SEED=$seed DPO=0 ./hello_world.sh ${force[@]+"${force[@]}"}
        done_runs=$((done_runs + 1))
    done
done

PY=.venv/bin/python
echo "=== scaling: plots and table over sizes x seeds in $OUT"
$PY eval/sft_rm_scale.py --run_glob "scaling_*" --out $OUT
$PY eval/rlhf_scaling_plot.py --run_glob "scaling_*" --judge gold --out $OUT
$PY eval/scaling_table.py --plots_dir $OUT
echo "=== scaling: $total runs in $((SECONDS - start)) s"
