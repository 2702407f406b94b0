#!/usr/bin/env bash
# The embedded default as a miniature of the paper's scaling experiment: SFT -> reward model -> PPO
# for each tiny size x seed with hello_world.sh's one set of stage hyperparameters (DPO left out),
# then eval/'s scaling plots with the seed spread and the results table (eval/scaling_table.py).
#
#   make scaling                      (or ./scaling.sh): tiny-s, -m, -l x seeds 1 2 3
#   SIZES="m l" SEEDS="1 2 3 4" ./scaling.sh
#   ./scaling.sh --force              retrain everything
#
# Where it runs (SLURM): auto (default) submits the sbatches/ chain when a Slurm cluster answers
# (`sinfo`), otherwise runs one (size, seed) after another on this machine; SLURM=1 insists on the
# cluster, SLURM=0 runs here.
#
# Here: each (size, seed) is `NAME=scaling_<size>_<seed> MODEL=models/tiny/pythia-tiny-<size>
# SEED=<seed> ALGOS=ppo ./hello_world.sh`: its models go to models/scaling_<size>_<seed>/, its runs to
# runs/scaling_<size>_<seed>_<stage>/. A stage whose output exists is skipped and a stage stopped
# halfway (Ctrl-C, a failure) resumes from its checkpoint, so a rerun only trains what is missing.
#
# On Slurm: per size, the TINY=1 chain sft.sbatch -> reward.sbatch -> ppo_left_padding.sbatch
# (--dependency=afterany), one array task per seed: hello_world.sh's stages with the same flags
# (tests/test_shell_scripts.py checks they agree). Models go to
# $OUTPUT_ROOT/models/pythia-tiny-<size>/<stage>_<seed>/, runs to $OUTPUT_ROOT/runs/ (OUTPUT_ROOT:
# default slurm/scaling), job logs to slurm/logs/. A (size, seed) whose PPO model exists is not
# submitted again; a task stopped halfway continues from its checkpoint (RESUME=1; --force: RESUME=0,
# starting over). The script waits for the jobs (squeue every POLL_SECONDS, default 30), checks that
# every PPO model was saved, then draws the plots. Slurm options through sbatch's own variables
# (SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_TIMELIMIT, ...); SFT_FLAGS, REWARD_FLAGS, PPO_FLAGS,
# EXTRA_FLAGS reach the stages on both paths.
#
# Plots and tables: eval/images/scaling/.
set -euo pipefail
cd "$(dirname "$0")"

SIZES=${SIZES:-"s m l"}
SEEDS=${SEEDS:-"1 2 3"}
SLURM=${SLURM:-auto}
OUT=eval/images/scaling
# shellcheck source=sweep_args.sh
source ./sweep_args.sh
parse_sweep_args "[SIZES=\"s m l\"] [SEEDS=\"1 2 3\"] [SLURM=auto|0|1]" "$@"
case $SLURM in
    auto) if command -v sinfo >/dev/null && sinfo -h >/dev/null 2>&1; then SLURM=1; else SLURM=0; fi ;;
    1) command -v sinfo >/dev/null && sinfo -h >/dev/null ||
           { echo "SLURM=1, but no Slurm cluster answers sinfo here" >&2; exit 2; } ;;
    0) ;;
    *) echo "SLURM must be auto, 0 or 1, got '$SLURM'" >&2; exit 2 ;;
esac

./hello_world.sh --data
check_base_models
start=$SECONDS
total=$((${#sizes[@]} * ${#seeds[@]}))
runs_dir=runs
run_glob=("--run_glob" "scaling_*")

if [[ $SLURM == 0 ]]; then
    done_runs=0
    for size in ${sizes[@]+"${sizes[@]}"}; do
        model=models/tiny/pythia-tiny-$size
        for seed in ${seeds[@]+"${seeds[@]}"}; do
            echo "=== scaling: tiny-$size seed $seed ($((done_runs + 1)) of $total, $((SECONDS - start)) s so far)"
            NAME=scaling_${size}_$seed MODEL=$model SEED=$seed ALGOS=ppo ./hello_world.sh ${force[@]+"${force[@]}"}
            done_runs=$((done_runs + 1))
        done
    done
else
    export OUTPUT_ROOT=${OUTPUT_ROOT:-slurm/scaling}
    export TINY=1 SBATCH_GPUS_PER_TASK=0 RESUME=1
    if (( ${#force[@]} )); then RESUME=0; fi
    # ppo_model SIZE SEED: where the chain leaves the PPO model of (SIZE, SEED)
    ppo_model() { echo "$OUTPUT_ROOT/models/pythia-tiny-$1/ppo_$2/model.safetensors"; }
    jobs=()
    submitted=()                                   # "size seed job" of each submitted pair
    for size in ${sizes[@]+"${sizes[@]}"}; do
        todo=()
        for seed in ${seeds[@]+"${seeds[@]}"}; do
            if [[ -f $(ppo_model "$size" "$seed") && ${#force[@]} == 0 ]]; then
                echo "=== scaling: tiny-$size seed $seed finished before: $(ppo_model "$size" "$seed") (--force retrains)"
            else
                todo+=("$seed")
            fi
        done
        ((${#todo[@]})) || continue
        # the grid of the chain: this size x the seeds it lacks (sbatches/common.sh)
        export MODELS=models/tiny/pythia-tiny-$size SEEDS="${todo[*]}" SBATCH_ARRAY_INX=0-$((${#todo[@]} - 1))
        sft=$(sbatch --parsable sbatches/sft.sbatch)
        sft=${sft%%;*}                             # (--parsable: "<id>[;<cluster>]")
        rm=$(sbatch --parsable --dependency=afterany:"$sft" sbatches/reward.sbatch)
        rm=${rm%%;*}
        ppo=$(sbatch --parsable --dependency=afterany:"$rm" sbatches/ppo_left_padding.sbatch)
        ppo=${ppo%%;*}
        jobs+=("$sft" "$rm" "$ppo")
        for i in "${!todo[@]}"; do submitted+=("$size ${todo[i]} $sft $rm $ppo $i"); done
        echo "=== scaling: tiny-$size seeds ${todo[*]}: submitted sft $sft -> reward $rm -> ppo $ppo" \
             "(logs: slurm/logs/<stage>_<job>_<task>.out)"
    done
    # wait until none of the jobs' array tasks is queued or running (%F: a task's array job id)
    last=""
    ids=" ${jobs[*]+"${jobs[*]}"} "
    while [[ $ids != "  " ]]; do
        if ! queue=$(squeue -h -o "%F %j %a %T"); then
            echo "=== scaling: squeue failed; asking again" >&2
            sleep "${POLL_SECONDS:-30}"
            continue
        fi
        mine=$(awk -v ids="$ids" 'index(ids, " " $1 " ") { print $2 " " $4 }' <<<"$queue" | sort | uniq -c |
               awk '{ printf "%s%s %s: %d", sep, $2, tolower($3), $1; sep = ", " }')
        [[ -n $mine ]] || break
        [[ $mine == "$last" ]] || echo "=== scaling: $mine ($((SECONDS - start)) s)"
        last=$mine
        sleep "${POLL_SECONDS:-30}"
    done
    failed=0
    for pair in ${submitted[@]+"${submitted[@]}"}; do
        read -r size seed sft rm ppo task <<<"$pair"
        [[ -f $(ppo_model "$size" "$seed") ]] && continue
        failed=$((failed + 1))
        echo "=== scaling: tiny-$size seed $seed saved no PPO model; its logs: slurm/logs/sft_${sft}_$task.out," \
             "slurm/logs/reward_${rm}_$task.out, slurm/logs/ppo_left_padding_${ppo}_$task.out" >&2
    done
    ((failed == 0)) || { echo "=== scaling: $failed of ${#submitted[@]} submitted runs failed" >&2; exit 1; }
    runs_dir=$OUTPUT_ROOT/runs
    run_glob=()                                    # every run of the chain's folder
fi

PY=.venv/bin/python
echo "=== scaling: plots and table over sizes x seeds in $OUT"
$PY eval/sft_rm_scale.py --runs_dir "$runs_dir" ${run_glob[@]+"${run_glob[@]}"} --out $OUT
$PY eval/rlhf_scaling_plot.py --runs_dir "$runs_dir" ${run_glob[@]+"${run_glob[@]}"} --judge gold --out $OUT
$PY eval/scaling_table.py --plots_dir $OUT
echo "=== scaling: $total runs in $((SECONDS - start)) s"
