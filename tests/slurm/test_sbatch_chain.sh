#!/usr/bin/env bash
# End-to-end test of sbatches/ on a throwaway one-node Slurm cluster on this machine (cluster.sh):
#
# 1. the TINY=1 chain sft.sbatch -> reward.sbatch -> ppo_left_padding.sbatch, with dpo.sbatch after
#    sft.sbatch beside reward (sbatch --parsable, --dependency=afterany): every array task
#    COMPLETED, was granted all of the node's memory (--mem=0) and saved its model;
# 2. preemption and the time limit: a longer TINY=1 PPO task (PPO_FLAGS="--total_episodes 768", 12
#    updates, a checkpoint every update) is stopped twice while it runs: by `scontrol requeue`
#    (Slurm's SIGTERM to every process of the job, as a preemption), then by SIGUSR1 to its batch
#    shell only (`scancel --batch --signal=USR1`, what --signal=B:USR1@900 sends before the time
#    limit: the shell passes it on and requeues the task itself). Each time the stage saves a
#    checkpoint and the task is requeued; each rerun says `resumed run ... at update <k>`. The task
#    ends COMPLETED with one run folder, and its model.safetensors is byte-identical to that of an
#    uninterrupted task of the same model, seed and flags (one CPU process: deterministic). Slurm
#    holds a requeued job for about 2 minutes (BeginTime); the test releases it at once
#    (scontrol update StartTime=now).
#
#   make test-slurm                      (or: sudo tests/slurm/test_sbatch_chain.sh)
#
# Opt-in, outside the pytest suite: it needs root (see cluster.sh: packages, munged, slurmctld,
# slurmd, all in one temporary folder, stopped on every exit). Job logs go to the files' default
# slurm/logs/ (job ids are unique per run); they are deleted when the test passes.
#
# Environment: SEEDS (default "1 2") and MODELS (default the tiny small model) of the grid,
# TEST_TIMEOUT seconds to wait for the chain (default 1800), KEEP=1 keeps the temporary folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
START=$SECONDS
LOG_TAG=test-slurm
# shellcheck source=tests/slurm/cluster.sh
source tests/slurm/cluster.sh
TEST_TIMEOUT=${TEST_TIMEOUT:-1800}
export SEEDS=${SEEDS:-"1 2"}
export MODELS=${MODELS:-models/tiny/pythia-tiny-s}
read -ra _models <<<"$MODELS"
read -ra _seeds <<<"$SEEDS"
NTASKS=$((${#_models[@]} * ${#_seeds[@]}))
PY=${PY:-.venv/bin/python}
[[ -x $PY ]] || PY=python3

cluster_up 1
WORK=$CLUSTER_WORK
MEM=$CLUSTER_MEM

# --- 1. data, then the chain exactly as docs/real_pipeline.md shows it ------------------------------
log "building the tiny data (./hello_world.sh --data)"
./hello_world.sh --data >"$WORK/hello_world_data.log" 2>&1 ||
    { tail -n 30 "$WORK/hello_world_data.log"; die "./hello_world.sh --data"; }

export TINY=1 OUTPUT_ROOT=$WORK/out SBATCH_GPUS_PER_TASK=0
# TINY=1 runs hello_world.sh's settings (minutes per stage); a few hundred examples per stage here
export SFT_FLAGS="--total_episodes 512" REWARD_FLAGS="--total_episodes 512" PPO_FLAGS="--total_episodes 128"
export DPO_FLAGS="--total_episodes 256"

# The guard first: an array that does not cover MODELS x SEEDS exactly fails at once, saying why.
guard=$(SBATCH_ARRAY_INX=0-$NTASKS timeout 300 sbatch --parsable --wait sbatches/sft.sbatch 2>/dev/null) ||
    true
guard_log=slurm/logs/sft_${guard}_0.out
grep -q "submit with --array=0-$((NTASKS - 1))" "$guard_log" || { cat "$guard_log"; die "array guard"; }
log "guard ok: a mismatched array fails with: $(grep error: "$guard_log" | head -1 | cut -c1-90)..."
rm -f slurm/logs/sft_"${guard}"_*.out

export SBATCH_ARRAY_INX=0-$((NTASKS - 1))
JOBS=()
sft=$(sbatch --parsable sbatches/sft.sbatch)
JOBS+=("$sft")
rm=$(sbatch --parsable --dependency=afterany:"$sft" sbatches/reward.sbatch)
JOBS+=("$rm")
ppo=$(sbatch --parsable --dependency=afterany:"$rm" sbatches/ppo_left_padding.sbatch)
JOBS+=("$ppo")
dpo=$(sbatch --parsable --dependency=afterany:"$sft" sbatches/dpo.sbatch)
JOBS+=("$dpo")
log "submitted sft $sft -> reward $rm -> ppo $ppo, sft $sft -> dpo $dpo, $NTASKS array tasks each" \
    "(MODELS=$MODELS, SEEDS=$SEEDS)"
wait_jobs "$TEST_TIMEOUT" "$NTASKS" "${JOBS[@]}"
log "all jobs finished"

fail=0
for id in "${JOBS[@]}"; do
    while read -r line; do
        name=$(job_field JobName <<<"$line")
        task=$(job_field ArrayTaskId <<<"$line")
        state=$(job_field JobState <<<"$line")
        exit_code=$(job_field ExitCode <<<"$line")
        out=$(job_field StdOut <<<"$line")
        # --mem=0: the task was granted all of the node's memory (TRES mem=<n>[KMGT], within 1%)
        mem=$(sed -n 's/.* \(Alloc\)\?TRES=[^ ]*mem=\([0-9.]*[KMGT]\?\).*/\2/p' <<<"$line")
        log "$name ${id}_$task: $state (exit $exit_code), memory ${mem:-?} of ${MEM}M, log $out"
        if [[ $state != COMPLETED || $exit_code != 0:0 ]]; then
            fail=1
            echo "----- tail of $out" >&2
            tail -n 40 "$out" >&2 || true
        fi
        awk -v mem="$mem" -v node="$MEM" 'BEGIN {
                unit = substr(mem, length(mem)); mb = mem + 0
                mb *= unit == "K" ? 1 / 1024 : unit == "G" ? 1024 : unit == "T" ? 1048576 : 1
                exit !(mb > 0.99 * node && mb < 1.01 * node) }' ||
            { echo "${id}_$task was granted ${mem:-no} memory, not the node's ${MEM}M" >&2; fail=1; }
    done < <(scontrol -o show job "$id")
done
for m in "${_models[@]}"; do
    for s in "${_seeds[@]}"; do
        for stage in sft_all_tokens sft reward_model ppo dpo; do
            f=$OUTPUT_ROOT/models/$(basename "$m")/${stage}_$s/model.safetensors
            if [[ -s $f ]]; then log "ok: ${f#"$WORK"/}"; else echo "missing: $f" >&2; fail=1; fi
            # a stage that finished deletes its checkpoints (TINY=1 takes one every few updates)
            [[ ! -e ${f%/*}/checkpoints ]] || { echo "checkpoints left in ${f%/*}" >&2; fail=1; }
        done
    done
done
((fail == 0)) || die "see above; logs in slurm/logs/"
CHAIN="$NTASKS x ${#JOBS[@]} array tasks COMPLETED with the node's memory, all models saved"
log "chain ok: $CHAIN"

# --- 2. a PPO task stopped twice, requeued, resumed: the same model as without stops ----------------
m=${_models[0]}
s=${_seeds[0]}
name=$(basename "$m")
for root in stopped straight; do         # the chain's SFT and reward models of (m, s), two outputs
    mkdir -p "$WORK/$root/models/$name"
    ln -s "$OUTPUT_ROOT/models/$name/sft_$s" "$OUTPUT_ROOT/models/$name/reward_model_$s" "$WORK/$root/models/$name/"
done
export MODELS=$m SEEDS=$s SBATCH_ARRAY_INX=0 PPO_FLAGS="--total_episodes 768" PPO_CHECKPOINT_EVERY=1
stopped=$(OUTPUT_ROOT=$WORK/stopped sbatch --parsable sbatches/ppo_left_padding.sbatch)
straight=$(OUTPUT_ROOT=$WORK/straight sbatch --parsable --dependency=afterany:"$stopped" \
    sbatches/ppo_left_padding.sbatch)
JOBS+=("$stopped" "$straight")
task=${stopped}_0
stopped_log=slurm/logs/ppo_left_padding_${stopped}_0.out
ckpt_dir=$WORK/stopped/models/$name/ppo_$s/checkpoints
log "submitted PPO $task (12 updates, a checkpoint every update, to be stopped twice), then the same" \
    "task uninterrupted, ${straight}_0"

state() { scontrol -o show job "$task" | job_field JobState; }
# newest_update: the update of the newest checkpoint of the stopped task (0: none yet)
newest_update() {
    local c=("$ckpt_dir"/update-*)
    [[ -d ${c[${#c[@]} - 1]} ]] || { echo 0; return; }
    echo $((10#${c[${#c[@]} - 1]##*update-}))
}
# until_update K: until the stopped task runs and has a checkpoint of update K or later
until_update() {
    local deadline=$((SECONDS + 600))
    until [[ $(state) == RUNNING ]] && (($(newest_update) >= $1)); do
        ((SECONDS < deadline)) || { tail -n 30 "$stopped_log"; die "$task never reached update $1"; }
        sleep 0.5
    done
}
# requeued N: until the task waits in the queue after its N-th restart; then lets it start at once
requeued() {
    local deadline=$((SECONDS + 300))
    until [[ $(state) == PENDING && $(scontrol -o show job "$task" | job_field Restarts) == "$1" ]]; do
        ((SECONDS < deadline)) || { tail -n 30 "$stopped_log"; die "$task was not requeued"; }
        sleep 1
    done
    log "$task requeued ($(scontrol -o show job "$task" | job_field Reason)); releasing it now"
    scontrol update JobId="$task" StartTime=now
}

until_update 2
log "$task at update $(newest_update): scontrol requeue (SIGTERM to every process of the job)"
scontrol requeue "$task"
requeued 1
until_update $(($(newest_update) + 2))     # the rerun resumed from the stop's checkpoint and went on
log "$task at update $(newest_update): SIGUSR1 to its batch shell (scancel --batch --signal=USR1)"
scancel --batch --signal=USR1 "$task"
requeued 2
wait_jobs 900 1 "$stopped" "$straight"

line=$(scontrol -o show job "$task")
[[ $(job_field JobState <<<"$line") == COMPLETED && $(job_field ExitCode <<<"$line") == 0:0 ]] ||
    { tail -n 60 "$stopped_log"; die "$task: $(job_field JobState <<<"$line") ($(job_field ExitCode <<<"$line"))"; }
[[ $(job_field Restarts <<<"$line") == 2 ]] || die "$task: $(job_field Restarts <<<"$line") restarts, not 2"
line=$(scontrol -o show job "${straight}_0")
[[ $(job_field JobState <<<"$line") == COMPLETED ]] || die "${straight}_0: $(job_field JobState <<<"$line")"
# what the log says: two stops, each followed by a rerun that resumed where the stop saved
"$PY" - "$stopped_log" "$task" <<'EOF' || { tail -n 80 "$stopped_log"; die "the log of $task"; }
import re, sys
text, task = open(sys.argv[1]).read(), sys.argv[2]
saved = [int(k) for k in re.findall(r"checkpoint saved at update (\d+) after a stop signal", text)]
resumed = [(m[0], int(m[2])) for m in re.findall(r"resumed run (\S+)\s+from\s+(.+?)\s+at\s+update\s+(\d+)", text, re.S)]
runs = re.findall(r"== job \S+ \(job id \d+, restart (\d+)\)", text)
print(f"[test-slurm] {task}: runs with restart count {runs}; checkpoints saved after a stop at updates {saved};"
      f" resumed at updates {[k for _, k in resumed]}")
assert runs == ["0", "1", "2"], runs
assert len(saved) == 2 and [k for _, k in resumed] == saved, (saved, resumed)
assert len({name for name, _ in resumed}) == 1, resumed  # the same run continues
assert "SIGTERM (the job is being ended" in text and "SIGUSR1 (Slurm's notice before the time limit)" in text
assert re.search(r"requeueing job \d+ \(\d+_0\): its rerun resumes from \S+update-0*%d\b" % saved[1], text), \
    "no self-requeue after SIGUSR1"
launches = re.findall(r"^\+ .*$", text, re.M)
assert [line.endswith(" --resume") for line in launches] == [False, True, True], launches
EOF
runs=("$WORK"/stopped/runs/*)
((${#runs[@]} == 1)) || die "the stopped task left ${#runs[@]} run folders, not one: ${runs[*]}"
a=$WORK/stopped/models/$name/ppo_$s/model.safetensors
b=$WORK/straight/models/$name/ppo_$s/model.safetensors
if ! cmp -s "$a" "$b"; then
    "$PY" - "$a" "$b" <<'EOF'
import sys, torch
from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
assert a.keys() == b.keys(), "different tensors"
diff = [k for k in a if not torch.equal(a[k], b[k])]
print(f"[test-slurm] files differ; tensors that differ: {diff or 'none'}")
sys.exit(1 if diff else 0)
EOF
    die "the stopped task's model differs from the uninterrupted one's"
fi
[[ ! -e $ckpt_dir ]] || die "the finished task left its checkpoints in $ckpt_dir"
PREEMPT="a PPO task stopped by scontrol requeue and by SIGUSR1 resumed twice and saved a model"
PREEMPT+=" byte-identical to an uninterrupted task's"
log "preemption ok: $PREEMPT"

[[ ${KEEP:-0} == 1 ]] || for id in "${JOBS[@]}"; do rm -f slurm/logs/*_"${id}"_*.out; done
log "PASS: $CHAIN; $PREEMPT; in $((SECONDS - START)) s"
