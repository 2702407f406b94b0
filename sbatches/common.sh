# shellcheck shell=bash disable=SC2034  # sourced: the .sbatch files read its variables
# Sourced by sbatches/*.sbatch: the (model, seed) of this array task, where the four stages put
# their models, and how a stage is launched. One copy, so the four files always agree.
#
# Environment (all optional; sbatch passes the submitting shell's environment to the job):
#   MODELS       base models, space-separated    default: pythia 6.9b 2.8b 1b deduped (TINY: tiny-s)
#   SEEDS        seeds, space-separated          default: 44413 55513 66613 77713  (TINY: 1 2)
#                array task i runs model i / len(SEEDS), seed i % len(SEEDS)
#   OUTPUT_ROOT  models go to OUTPUT_ROOT/models/<model basename>/{sft,reward_model,ppo,dpo}_<seed>,
#                run folders to OUTPUT_ROOT/runs/ (the jobs run there)   default: the repository
#   TINY=1       the embedded default on CPU: tiny models, local synthetic data (built by
#                ./hello_world.sh --data), small episode counts, one process
#   TRACK=1      log every stage to wandb as well (--track, runs tagged sbatch,<commit> unless
#                WANDB_TAGS is set; WANDB_MODE=offline keeps them local). Off by default, so a
#                cluster without a wandb login or network runs as it is
#   EXTRA_FLAGS  appended to every stage's command line, e.g. "--push_to_hub --hf_entity me";
#                SFT_FLAGS / REWARD_FLAGS / PPO_FLAGS / DPO_FLAGS come after it, for one stage only
#   ACCELERATE_CONFIG  default deepspeed.yaml; the process count is the task's GPU count
#   LAUNCHER     replaces the whole launcher, e.g. "accelerate launch --config_file my.yaml"
# The project's .venv is used when it exists (make install); otherwise python/accelerate on PATH.
# Logs: slurm/logs/<job name>_<array job id>_<task id>.out under the repository (SBATCH_OUTPUT
# overrides). `make test-slurm` runs the TINY=1 chain on a throwaway one-node cluster.
#
# An array that may be empty is expanded as ${a[@]+"${a[@]}"}: under set -u, bash before 4.4
# (4.2 on older login nodes) aborts on "${a[@]}" of an empty array with "a[@]: unbound variable".
set -euo pipefail
die() { echo "error: $*" >&2; exit 2; }

REPO=${SLURM_SUBMIT_DIR:-$PWD}
TINY=${TINY:-0}
if [[ $TINY == 1 ]]; then
    MODELS=${MODELS:-models/tiny/pythia-tiny-s}
    SEEDS=${SEEDS:-"1 2"}
else
    MODELS=${MODELS:-"EleutherAI/pythia-6.9b-deduped EleutherAI/pythia-2.8b-deduped
                      EleutherAI/pythia-1b-deduped"}
    SEEDS=${SEEDS:-"44413 55513 66613 77713"}
fi
read -r -d '' -a models <<<"$MODELS" || true   # split on blanks and newlines
read -r -d '' -a seeds <<<"$SEEDS" || true
n=$((${#models[@]} * ${#seeds[@]}))
# The array must be exactly the grid: a stale --array would silently skip or repeat (model, seed)
# pairs. To rerun one pair, set MODELS and SEEDS to it and submit with --array=0.
if [[ -z ${SLURM_ARRAY_TASK_ID:-} || ${SLURM_ARRAY_TASK_COUNT:-} != "$n"
      || ${SLURM_ARRAY_TASK_MAX:-} != $((n - 1)) ]]; then
    die "MODELS x SEEDS = ${#models[@]} x ${#seeds[@]} = $n runs, but this job's array is" \
        "${SLURM_ARRAY_TASK_MIN:-?}-${SLURM_ARRAY_TASK_MAX:-?} (${SLURM_ARRAY_TASK_COUNT:-no array});" \
        "submit with --array=0-$((n - 1)) (or SBATCH_ARRAY_INX=0-$((n - 1)))"
fi
MODEL=${models[SLURM_ARRAY_TASK_ID / ${#seeds[@]}]}
SEED=${seeds[SLURM_ARRAY_TASK_ID % ${#seeds[@]}]}
BASE_MODEL=$MODEL                                  # a hub name, or a path relative to the repository
[[ -e $REPO/$MODEL ]] && BASE_MODEL=$REPO/$MODEL
OUTPUT_ROOT=$(realpath -m "${OUTPUT_ROOT:-$REPO}")
MODEL_DIR=$OUTPUT_ROOT/models/$(basename "$MODEL")
SFT_DIR=$MODEL_DIR/sft_$SEED
RM_DIR=$MODEL_DIR/reward_model_$SEED
PPO_DIR=$MODEL_DIR/ppo_$SEED
DPO_DIR=$MODEL_DIR/dpo_$SEED
# flags of every stage, after its own: --track when TRACK=1 (wandb is opt-in), then EXTRA_FLAGS
TRACK=${TRACK:-0}
track=""
if [[ $TRACK == 1 ]]; then
    track=--track
    commit=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo no-git)
    export WANDB_TAGS=${WANDB_TAGS:-sbatch,$commit}
fi
read -ra extra_flags <<<"$track ${EXTRA_FLAGS:-}"

if [[ -x $REPO/.venv/bin/python ]]; then export PATH=$REPO/.venv/bin:$PATH; fi
if [[ $TINY == 1 ]]; then
    for need in "$REPO/data/tldr/sft" "$REPO/data/tldr/preference" "$BASE_MODEL"; do
        [[ -e $need ]] || die "TINY=1 needs the embedded default's data and tiny models:" \
            "run ./hello_world.sh --data first (missing: $need)"
    done
    export HF_HUB_OFFLINE=1
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}}
    NGPUS=1                                        # one CPU process: world size 1
    launcher=(python)
else
    NGPUS=${SLURM_GPUS_PER_TASK:-0}
    NGPUS=${NGPUS##*:}                             # "a100:8" -> 8
    ((NGPUS > 0)) || die "real runs need GPUs (--gpus-per-task, SBATCH_GPUS_PER_TASK); TINY=1 runs on CPU"
    config=${ACCELERATE_CONFIG:-deepspeed.yaml}
    [[ $config == /* ]] || config=$REPO/$config
    launcher=(accelerate launch --config_file "$config" --num_processes "$NGPUS")
fi
[[ -z ${LAUNCHER:-} ]] || read -ra launcher <<<"$LAUNCHER"
((${#launcher[@]})) || die "LAUNCHER is blank: unset it for the default launcher"

# accumulation BATCH MICRO: keeps the paper's global batch,
#   BATCH = local_micro_batch_size (MICRO) x gradient_accumulation_steps x NGPUS processes
accumulation() {
    (($1 % ($2 * NGPUS) == 0)) || die "batch $1 is not a multiple of micro batch $2 x $NGPUS GPUs"
    echo $(($1 / ($2 * NGPUS)))
}

# need_model DIR WHAT: a clear error when an earlier stage of this (model, seed) left no model
need_model() {
    [[ -f $1/config.json ]] || die "no $2 at $1: did array task $SLURM_ARRAY_TASK_ID of its job fail?"
}

# launch SCRIPT ARGS...: runs a stage script of the repository from OUTPUT_ROOT (runs/ lands there)
launch() {
    local script=$REPO/summarize_from_feedback_details/$1
    shift
    mkdir -p "$OUTPUT_ROOT"
    cd "$OUTPUT_ROOT"
    echo "== job ${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID on $(hostname) at $(date -Is): model $MODEL," \
        "seed $SEED, TINY=$TINY, $NGPUS process(es)${OMP_NUM_THREADS:+, OMP_NUM_THREADS=$OMP_NUM_THREADS}"
    echo "+ ${launcher[*]} $script $*"
    "${launcher[@]}" "$script" "$@"
}
