# shellcheck shell=bash disable=SC2034  # sourced: the .sbatch files read its variables
# Sourced by sbatches/*.sbatch: the (model, seed) of this array task, where the four stages put
# their models, and how a stage is launched. One copy, so the four files always agree.
#
# Environment (all optional; sbatch passes the submitting shell's environment to the job):
#   MODELS       base models, space-separated    default: pythia 6.9b 2.8b 1b deduped (TINY: tiny-s)
#   SEEDS        seeds, space-separated          default: 44413 55513 66613 77713  (TINY: 1 2)
#                array task i runs model i / len(SEEDS), seed i % len(SEEDS)
#   OUTPUT_ROOT  models go to OUTPUT_ROOT/models/<model basename>/<stage>_<seed> (stage: sft,
#                reward_model, ppo, dpo, rloo (or RLOO_METHOD), online_dpo),
#                run folders to OUTPUT_ROOT/runs/ (the jobs run there)   default: the repository
#   TINY=1       the embedded default on CPU: tiny models, local synthetic data (built by
#                ./hello_world.sh --data) and hello_world.sh's stage settings (its two SFT runs
#                included), one process (per node); scaling.sh submits this chain
#   TRACK=1      log every stage to wandb as well (--track, runs tagged sbatch,<commit> unless
#                WANDB_TAGS is set; WANDB_MODE=offline keeps them local). Off by default, so a
#                cluster without a wandb login or network runs as it is
#   EXTRA_FLAGS  appended to every stage's command line, e.g. "--push_to_hub --hf_entity me";
#                SFT_FLAGS / REWARD_FLAGS / PPO_FLAGS / DPO_FLAGS / RLOO_FLAGS / ONLINE_DPO_FLAGS come
#                after it, for one stage only
#   RLOO_METHOD  what rloo.sbatch runs, as hello_world.sh's ALGOS names it: a row of the registry
#                (summarize_from_feedback_details/methods.tsv) trained by rloo.py: rloo (default; k=2),
#                rloo_k4 (k=4) or grpo (GRPO, k=4); the name is its exp_name and model folder
#   ACCELERATE_CONFIG  default deepspeed.yaml; the process count is NODES x the task's GPU count
#   LAUNCHER     replaces the whole launcher, e.g. "accelerate launch --config_file my.yaml" (with
#                NODES > 1 it runs once per node through srun; SLURM_NODEID is the node's index)
#
# Checkpoints, the time limit and requeue (the stages keep checkpoints in
# <output_dir>/checkpoints/update-<k>/, e.g. models/pythia-1b-deduped/ppo_44413/checkpoints/):
#   CHECKPOINT_EVERY   updates between checkpoints of every stage (--checkpoint_every; 0: only when
#                stopped by a signal); SFT_CHECKPOINT_EVERY, REWARD_CHECKPOINT_EVERY,
#                PPO_CHECKPOINT_EVERY, DPO_CHECKPOINT_EVERY for one stage. Defaults, so that a hard
#                kill loses at most a few percent of a run (the paper's runs have SFT 911, RM 1450,
#                PPO 1953, DPO 1450 updates) while a 6.9b checkpoint (~110 GB, PPO's policy and
#                critic ~200 GB) is written rarely: SFT 100, RM 100, PPO 25, DPO 100; TINY=1: 4 4 1 2
#   RESUME       auto (default): a task that Slurm runs again (requeued by itself, by `scontrol
#                requeue`, by preemption or a node failure: SLURM_RESTART_COUNT >= 1) passes
#                --resume when its output dir has a checkpoint; a first run that finds one stops and
#                says so (it is left from an earlier submission that did not finish):
#                RESUME=1 continues it (--resume whenever a checkpoint exists), RESUME=0 deletes the
#                checkpoints and starts over. A stage that finishes deletes its checkpoints (its
#                model is saved; they only serve to resume): KEEP_FINISHED_CHECKPOINTS=1 keeps them
#   The files ask for --requeue and --signal=B:USR1@900: Slurm sends SIGUSR1 to this batch shell
#   15 minutes before the time limit (time to finish an update and write a 6.9b checkpoint; sbatch's
#   SBATCH_SIGNAL=B:USR1@<seconds> overrides it). The shell passes it on to the stage (to the
#   launcher, or to srun, which passes it to every node's launcher), waits for the stage to write a
#   checkpoint and exit, and requeues its own task (`scontrol requeue $SLURM_JOB_ID`); the rerun
#   resumes. A preemption, `scontrol requeue` or scancel instead sends SIGTERM to every process of
#   the job at once (the stage's processes included) and SIGKILL KillWait seconds later (the
#   cluster's setting, often 30 s): the shell passes nothing on (torchrun's agent, signalled twice,
#   stops waiting for its ranks), waits for the stage, and never requeues; Slurm requeues
#   (preemption, scontrol requeue) or cancels. A stage finishes its update and saves on SIGTERM too
#   if KillWait leaves time; otherwise the rerun resumes from the last --checkpoint_every
#   checkpoint. (Clusters with PreemptParameters=send_user_signal send the USR1 at preemption.)
#   Requeued jobs wait about 2 minutes before they are eligible again (Slurm's BeginTime); the
#   task's log continues (--open-mode=append).
#   Under accelerate launch with several processes or DeepSpeed the launcher is torchrun's agent,
#   which passes on only the signals of PET_SIGNALS_TO_HANDLE (here SIGTERM,SIGINT,SIGHUP,SIGQUIT,
#   SIGUSR1; its default lacks SIGUSR1) and gives the ranks PET_SHUTDOWN_TIMEOUT seconds before
#   SIGKILL (here the signal's lead time, 900; its default is 30).
#
# Several nodes (DESIGN section 16):
#   NODES        nodes of one task; it is the job's node count (sbatch --nodes=N: sbatch 22.05 reads
#                no variable for it), and set by hand it must match (a guard against forgetting
#                --nodes). With NODES > 1 each node runs one launcher through
#                `srun --ntasks-per-node=1`, with accelerate's --num_machines NODES --machine_rank
#                <SLURM_NODEID> --main_process_ip <the first node's address> --main_process_port
#                MAIN_PROCESS_PORT (default 20000 + job id % 10000); processes = NODES x GPUs per
#                node, and the accumulation is derived over all of them (the paper's global batch
#                stays). The first node's address is its NodeAddr in Slurm (MAIN_PROCESS_IP
#                overrides). TINY=1 with NODES > 1: one CPU process per node over gloo (set
#                GLOO_SOCKET_IFNAME to the interface between the nodes where hostnames do not
#                resolve to it)
# An array that may be empty is expanded as ${a[@]+"${a[@]}"}: under set -u, bash before 4.4
# (4.2 on older login nodes) aborts on "${a[@]}" of an empty array with "a[@]: unbound variable".
set -euo pipefail
die() { echo "error: $*" >&2; exit 2; }

# --- stop signals ------------------------------------------------------------------------------
# Trapped from the start, so that a signal never kills this shell while the stage runs (Slurm
# would then kill the stage with it). USR1 is passed on to the stage; TERM is not (see above).
stop_signal=""                                     # USR1 or TERM, once one came
terminated=0                                       # a SIGTERM came: the job is being ended
signals=0
stage_pid=""
on_stop_signal() {
    signals=$((signals + 1))
    if [[ $1 == TERM ]]; then
        terminated=1
        stop_signal=${stop_signal:-TERM}
        echo "== $(date -Is): SIGTERM (the job is being ended: requeue, preemption, scancel or the" \
            "time limit); the stage's processes got it from Slurm too; waiting for the stage"
        return 0
    fi
    stop_signal=USR1
    if [[ -n $stage_pid ]]; then
        echo "== $(date -Is): SIGUSR1 (Slurm's notice before the time limit); passed on to the stage" \
            "(pid $stage_pid), which saves a checkpoint after its current update"
        kill -USR1 "$stage_pid" 2>/dev/null || true
    fi
}
trap 'on_stop_signal USR1' USR1
trap 'on_stop_signal TERM' TERM
# torchrun's agent: pass SIGUSR1 on to the ranks, and wait for them as long as the lead time lasts
SIGNAL_LEAD=${SBATCH_SIGNAL:-B:USR1@900}
SIGNAL_LEAD=${SIGNAL_LEAD##*@}
[[ $SIGNAL_LEAD =~ ^[0-9]+$ ]] || SIGNAL_LEAD=900
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
export PET_SHUTDOWN_TIMEOUT=${PET_SHUTDOWN_TIMEOUT:-$SIGNAL_LEAD}
RESUME=${RESUME:-auto}
[[ $RESUME == auto || $RESUME == 0 || $RESUME == 1 ]] || die "RESUME must be auto, 0 or 1, got '$RESUME'"

REPO=${SLURM_SUBMIT_DIR:-$PWD}
TINY=${TINY:-0}
# shellcheck source=sbatches/tiny_default.sh
source "$REPO/sbatches/tiny_default.sh"  # TINY=1's stage settings, hello_world.sh's own
# shellcheck source=sbatches/methods.sh
source "$REPO/sbatches/methods.sh"  # the registry of methods (rloo.sbatch's RLOO_METHOD)
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
# the reward model's backbone: the SFT model (the paper); TINY=1 trains a second SFT for it, with the
# loss over every token, as hello_world.sh does (sft.sbatch)
RM_BACKBONE_DIR=$SFT_DIR
[[ $TINY != 1 ]] || RM_BACKBONE_DIR=$MODEL_DIR/sft_all_tokens_$SEED
RM_DIR=$MODEL_DIR/reward_model_$SEED
PPO_DIR=$MODEL_DIR/ppo_$SEED
DPO_DIR=$MODEL_DIR/dpo_$SEED
RLOO_METHOD=${RLOO_METHOD:-rloo}
RLOO_DIR=$MODEL_DIR/${RLOO_METHOD}_$SEED
ONLINE_DPO_DIR=$MODEL_DIR/online_dpo_$SEED
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

NODES=${NODES:-${SLURM_JOB_NUM_NODES:-1}}
[[ $NODES =~ ^[1-9][0-9]*$ ]] || die "NODES must be a number of nodes, got '$NODES'"
if [[ -n ${SLURM_JOB_NUM_NODES:-} && $SLURM_JOB_NUM_NODES != "$NODES" ]]; then
    die "NODES=$NODES, but this job has $SLURM_JOB_NUM_NODES node(s): submit with sbatch --nodes=$NODES"
fi
if [[ $TINY == 1 ]]; then
    for need in "$REPO/data/tldr/sft" "$REPO/data/tldr/preference" "$BASE_MODEL"; do
        [[ -e $need ]] || die "TINY=1 needs the embedded default's data and tiny models:" \
            "run ./hello_world.sh --data first (missing: $need)"
    done
    export HF_HUB_OFFLINE=1
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}}
    NGPUS=1                                        # one CPU process per node
    if ((NODES == 1)); then
        launcher=(python)                          # world size 1: no torchrun
    else
        export ACCELERATE_USE_CPU=1                # DDP over gloo between the nodes' CPU processes
        launcher=(accelerate launch --multi_gpu --num_processes "$NODES")
    fi
else
    NGPUS=${SLURM_GPUS_PER_TASK:-0}
    NGPUS=${NGPUS##*:}                             # "a100:8" -> 8
    ((NGPUS > 0)) || die "real runs need GPUs (--gpus-per-task, SBATCH_GPUS_PER_TASK); TINY=1 runs on CPU"
    config=${ACCELERATE_CONFIG:-deepspeed.yaml}
    [[ $config == /* ]] || config=$REPO/$config
    launcher=(accelerate launch --config_file "$config" --num_processes $((NODES * NGPUS)))
    # under srun, DeepSpeed's own multi-node launcher (pdsh by default) must not start anything
    ((NODES == 1)) || launcher+=(--deepspeed_multinode_launcher standard)
fi
NPROCS=$((NODES * NGPUS))                          # processes of the task, over all its nodes
if ((NODES > 1)); then
    # the rendezvous: the first node of the allocation, at the address Slurm reaches it by
    hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
    first=${hosts%%$'\n'*}
    addr=$(scontrol -o show node "$first" | sed -n 's/.* NodeAddr=\([^ ]*\) .*/\1/p')
    MAIN_PROCESS_IP=${MAIN_PROCESS_IP:-${addr:-$first}}
    MAIN_PROCESS_PORT=${MAIN_PROCESS_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 10000))}
    # '$SLURM_NODEID' is replaced by each node's index where srun starts it (see launch)
    launcher+=(--num_machines "$NODES" --machine_rank '$SLURM_NODEID' --main_process_ip "$MAIN_PROCESS_IP"
               --main_process_port "$MAIN_PROCESS_PORT")
fi
[[ -z ${LAUNCHER:-} ]] || read -ra launcher <<<"$LAUNCHER"
((${#launcher[@]})) || die "LAUNCHER is blank: unset it for the default launcher"

# accumulation BATCH MICRO: keeps the paper's global batch,
#   BATCH = local_micro_batch_size (MICRO) x gradient_accumulation_steps x NPROCS processes
accumulation() {
    (($1 % ($2 * NPROCS) == 0)) ||
        die "batch $1 is not a multiple of micro batch $2 x $NPROCS processes ($NODES node(s) x $NGPUS)"
    echo $(($1 / ($2 * NPROCS)))
}

# fit_micro BATCH MICRO: the micro batch MICRO, or less where BATCH / NPROCS is smaller (more nodes:
# each process takes a smaller share of the same batch; memory knobs never change the results)
fit_micro() {
    (($1 % NPROCS == 0)) || die "batch $1 does not split over $NPROCS processes"
    local share=$(($1 / NPROCS))
    echo $(($2 < share ? $2 : share))
}

# per_process BATCH: BATCH split over the task's processes (the TINY=1 micro batches)
per_process() {
    (($1 % NPROCS == 0)) || die "batch $1 does not split over $NPROCS processes"
    echo $(($1 / NPROCS))
}

# need_model DIR WHAT: a clear error when an earlier stage of this (model, seed) left no model
need_model() {
    [[ -f $1/config.json ]] || die "no $2 at $1: did array task $SLURM_ARRAY_TASK_ID of its job fail?"
}

# checkpoint_every STAGE: --checkpoint_every of SFT, REWARD, PPO, DPO, RLOO or ONLINE_DPO (see above)
checkpoint_every() {
    local var=${1}_CHECKPOINT_EVERY default
    case $TINY/$1 in
        0/PPO | 0/RLOO | 0/ONLINE_DPO) default=25 ;;
        0/*) default=100 ;;
        1/SFT | 1/REWARD) default=4 ;;
        1/PPO | 1/RLOO | 1/ONLINE_DPO) default=1 ;;
        1/DPO) default=2 ;;
    esac
    local every=${!var:-${CHECKPOINT_EVERY:-$default}}
    [[ $every =~ ^[0-9]+$ ]] || die "$var / CHECKPOINT_EVERY must be a number of updates, got '$every'"
    echo "$every"
}

# newest_checkpoint DIR: the newest complete checkpoint in DIR/checkpoints (or nothing)
newest_checkpoint() {
    local found=("$1"/checkpoints/update-*)
    [[ -d ${found[${#found[@]} - 1]} ]] && echo "${found[${#found[@]} - 1]}"
    return 0
}

# launch SCRIPT ARGS...: runs a stage script of the repository from OUTPUT_ROOT (runs/ lands there),
# in the background so that the traps run while it does; --checkpoint_every first (the stage's
# own flags may override it), --resume last when it continues a checkpoint. Returns when the stage
# finished; otherwise exits with the stage's status, after requeueing the task when SIGUSR1 stopped it.
launch() {
    local name=$1 script=$REPO/summarize_from_feedback_details/$1 stage out="" prev="" arg
    shift
    for arg in "$@"; do
        [[ $prev != --output_dir ]] || out=$arg
        prev=$arg
    done
    [[ -n $out ]] || die "launch $name: no --output_dir"
    case $name in
        sft.py) stage=SFT ;;
        reward.py) stage=REWARD ;;
        ppo_left_padding.py) stage=PPO ;;
        dpo.py) stage=DPO ;;
        rloo.py) stage=RLOO ;;
        online_dpo.py) stage=ONLINE_DPO ;;
        *) die "launch: unknown stage $name" ;;
    esac
    local every checkpoint resume=() restarts=${SLURM_RESTART_COUNT:-0}
    every=$(checkpoint_every "$stage")
    checkpoint=$(newest_checkpoint "$out")
    if [[ -n $checkpoint ]]; then
        if [[ $RESUME == 1 ]] || [[ $RESUME == auto && $restarts -gt 0 ]]; then
            resume=(--resume)
        elif [[ $RESUME == 0 ]]; then
            echo "== RESUME=0: deleting the checkpoints of an earlier run in $out/checkpoints"
            rm -rf "$out/checkpoints"
        else
            die "$out/checkpoints holds $(basename "$checkpoint") of an earlier submission of this task" \
                "that did not finish: RESUME=1 continues it, RESUME=0 deletes it and starts over"
        fi
    fi
    mkdir -p "$OUTPUT_ROOT"
    cd "$OUTPUT_ROOT"
    local cmd=("${launcher[@]}" "$script" --checkpoint_every "$every" "$@" ${resume[@]+"${resume[@]}"})
    local where
    where="$(hostname)"
    if ((NODES > 1)); then
        where="$NODES nodes ($SLURM_JOB_NODELIST), rendezvous $MAIN_PROCESS_IP:$MAIN_PROCESS_PORT"
        # one launcher per node; '$SLURM_NODEID' (the machine rank) becomes the node's index there
        local on_node='for w; do [[ $w != "\$SLURM_NODEID" ]] || w=$SLURM_NODEID; set -- "$@" "$w"; shift; done; exec "$@"'
        local cpus=()
        [[ -z ${SLURM_CPUS_ON_NODE:-} ]] || cpus=(--cpus-per-task="$SLURM_CPUS_ON_NODE")
        cmd=(srun --nodes="$NODES" --ntasks="$NODES" --ntasks-per-node=1 --kill-on-bad-exit=1
             ${cpus[@]+"${cpus[@]}"} bash -c "$on_node" node "${cmd[@]}")
    fi
    echo "== job ${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID (job id ${SLURM_JOB_ID:-?}, restart $restarts)" \
        "on $where at $(date -Is): model $MODEL, seed $SEED, TINY=$TINY," \
        "$NPROCS process(es)${OMP_NUM_THREADS:+, OMP_NUM_THREADS=$OMP_NUM_THREADS}"
    if [[ -n $stop_signal ]]; then                  # before the stage started: start nothing
        echo "== SIG$stop_signal before the stage started"
        [[ $stop_signal == USR1 && $terminated == 0 ]] && requeue "$out"
        exit 75
    fi
    echo "+ ${cmd[*]}"
    "${cmd[@]}" &
    stage_pid=$!
    local rc seen
    while :; do                                    # a trap interrupts the wait: wait again
        seen=$signals
        rc=0
        wait "$stage_pid" || rc=$?
        ((signals != seen)) || break
    done
    stage_pid=""
    if ((rc == 0)); then
        if [[ ${KEEP_FINISHED_CHECKPOINTS:-0} != 1 && -d $out/checkpoints ]]; then
            echo "== the stage finished: deleting its checkpoints in $out/checkpoints"
            rm -rf "$out/checkpoints"
        fi
        return 0
    fi
    echo "== the stage exited with status $rc at $(date -Is)"
    [[ $stop_signal == USR1 && $terminated == 0 ]] && requeue "$out"
    exit "$rc"
}

# requeue DIR: puts this task back into the queue, to continue from DIR's newest checkpoint
requeue() {
    local checkpoint
    checkpoint=$(newest_checkpoint "$1")
    if [[ -z $checkpoint ]]; then
        echo "== no checkpoint in $1/checkpoints: not requeueing" >&2
        return 0
    fi
    echo "== requeueing job $SLURM_JOB_ID (${SLURM_ARRAY_JOB_ID}_$SLURM_ARRAY_TASK_ID): its rerun resumes from" \
        "$checkpoint"
    scontrol requeue "$SLURM_JOB_ID" || echo "== scontrol requeue $SLURM_JOB_ID failed" >&2
}
