#!/usr/bin/env bash
# End-to-end test of sbatches/: a throwaway one-node Slurm cluster on this machine runs the TINY=1
# chain sft.sbatch -> reward.sbatch -> ppo_left_padding.sbatch, with dpo.sbatch after sft.sbatch
# beside reward (sbatch --parsable, --dependency=afterany) and checks that every array task
# COMPLETED, was granted all of the node's memory (--mem=0) and saved its model.
#
#   make test-slurm                      (or: sudo tests/slurm/test_sbatch_chain.sh)
#
# Opt-in, outside the pytest suite: it needs root, because it installs slurmctld, slurmd,
# slurm-client and munge from the Debian archive when they are missing (bookworm: Slurm 22.05) and
# starts munged (as user munge), slurmctld and slurmd (as root). Everything it creates lives in one
# temporary folder: its own munge key and socket, a slurm.conf pointed to by SLURM_CONF (no
# accounting, no slurmdbd), state and spool folders, and the models (OUTPUT_ROOT). It never writes
# /etc/slurm or /etc/munge and uses its own ports, so a Slurm already installed here is left alone.
# The daemons it started are stopped on every exit. Job logs go to the files' default slurm/logs/
# (job ids are unique per run); they are deleted when the test passes.
#
# Environment: SEEDS (default "1 2") and MODELS (default the tiny small model) of the grid,
# TEST_TIMEOUT seconds to wait for the chain (default 1800), KEEP=1 keeps the temporary folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
START=$SECONDS
TEST_TIMEOUT=${TEST_TIMEOUT:-1800}
export SEEDS=${SEEDS:-"1 2"}
export MODELS=${MODELS:-models/tiny/pythia-tiny-s}
read -ra _models <<<"$MODELS"
read -ra _seeds <<<"$SEEDS"
NTASKS=$((${#_models[@]} * ${#_seeds[@]}))

log() { echo "[test-slurm $((SECONDS - START))s] $*"; }
die() { echo "[test-slurm] FAIL: $*" >&2; exit 1; }

[[ $EUID == 0 ]] || die "needs root (installs packages, starts munged/slurmctld/slurmd): sudo $0"

# --- 1. packages ---------------------------------------------------------------------------------
missing=()
for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge; do
    command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
done
if ((${#missing[@]})); then
    log "installing ${missing[*]} from the Debian archive"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
        >/dev/null
fi

# --- 2. a throwaway cluster: munge, slurm.conf, slurmctld, slurmd -----------------------------------
WORK=$(mktemp -d /tmp/test-slurm.XXXXXX)
chmod 755 "$WORK"                       # munged runs as user munge and must reach $WORK/munge
PIDS=()                                 # daemons started here, stopped in this order by cleanup
JOBS=()                                 # the chain's four array jobs
cleanup() {
    local rc=$?
    set +e
    if [[ -n ${SLURM_CONF:-} ]] && [[ -n $(squeue -h 2>/dev/null) ]]; then
        scancel --partition=test        # the cluster is this test's own: cancel whatever still runs
        for _ in {1..30}; do [[ -z $(squeue -h 2>/dev/null) ]] && break; sleep 1; done
    fi
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null; done
    for pid in "${PIDS[@]}"; do
        for _ in {1..20}; do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -9 "$pid" 2>/dev/null
    done
    if [[ ${KEEP:-0} == 1 || $rc != 0 ]]; then
        echo "[test-slurm] daemon logs and outputs kept in $WORK"
    else
        rm -rf "$WORK"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# free TCP ports for slurmctld and slurmd (bash probes them with /dev/tcp)
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
CTLD_PORT=16817
while ! port_free $CTLD_PORT || ! port_free $((CTLD_PORT + 1)); do CTLD_PORT=$((CTLD_PORT + 2)); done

mkdir -p "$WORK"/{etc,state,spool,out} "$WORK/munge"
chown munge:munge "$WORK/munge"
chmod 755 "$WORK/munge"                 # munged wants its socket folder reachable by all
runuser -u munge -- mungekey --create --keyfile "$WORK/munge/munge.key"
runuser -u munge -- munged --socket "$WORK/munge/munge.socket" --key-file "$WORK/munge/munge.key" \
    --pid-file "$WORK/munge/munged.pid" --log-file "$WORK/munge/munged.log" \
    --seed-file "$WORK/munge/munged.seed"
for _ in {1..20}; do [[ -s $WORK/munge/munged.pid ]] && break; sleep 0.5; done
PIDS+=("$(cat "$WORK/munge/munged.pid")")

# One node = this machine, with the CPUs and memory slurmd detects. Memory is a consumable resource
# (CR_CPU_Memory), as on the GPU clusters, so the files' --mem=0 (all of the node's memory) is
# granted and checked as there. Unique job ids per run, so the logs under slurm/logs/ of two runs
# never collide; finished jobs stay queryable for an hour.
NODE=$(hostname -s)
read -r CPUS MEM < <(slurmd -C | sed -n 's/.* CPUs=\([0-9]*\) .* RealMemory=\([0-9]*\).*/\1 \2/p')
export SLURM_CONF=$WORK/etc/slurm.conf
cat >"$SLURM_CONF" <<EOF
ClusterName=testslurm
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$((CTLD_PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$WORK/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
ReturnToService=2
MinJobAge=3600
FirstJobId=$((($(date +%s) % 100000) * 100 + 1000))
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=test Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
slurmctld -D -i >"$WORK/slurmctld.out" 2>&1 &
PIDS=("$!" "${PIDS[@]}")
slurmd -D -N "$NODE" >"$WORK/slurmd.out" 2>&1 &
PIDS=("$!" "${PIDS[@]}")
for _ in {1..60}; do
    [[ $(sinfo -h -n "$NODE" -o %t 2>/dev/null) == idle ]] && break
    sleep 1
done
[[ $(sinfo -h -n "$NODE" -o %t 2>/dev/null) == idle ]] || {
    tail -n 20 "$WORK"/slurmctld.log "$WORK"/slurmd.log "$WORK"/*.out 2>/dev/null
    die "node $NODE did not come up idle"
}
log "$(sbatch --version), $(munged --version 2>&1 | head -1)"
log "cluster up: node $NODE, $CPUS CPUs, ${MEM} MB, slurmctld port $CTLD_PORT, config $SLURM_CONF"

# --- 3. data, then the chain exactly as the README shows it ------------------------------------------
log "building the tiny data (./hello_world.sh --data)"
./hello_world.sh --data >"$WORK/hello_world_data.log" 2>&1 ||
    { tail -n 30 "$WORK/hello_world_data.log"; die "./hello_world.sh --data"; }

export TINY=1 OUTPUT_ROOT=$WORK/out SBATCH_GPUS_PER_TASK=0

# The guard first: an array that does not cover MODELS x SEEDS exactly fails at once, saying why.
guard=$(SBATCH_ARRAY_INX=0-$NTASKS timeout 300 sbatch --parsable --wait sbatches/sft.sbatch 2>/dev/null) ||
    true
guard_log=slurm/logs/sft_${guard}_0.out
grep -q "submit with --array=0-$((NTASKS - 1))" "$guard_log" || { cat "$guard_log"; die "array guard"; }
log "guard ok: a mismatched array fails with: $(grep error: "$guard_log" | head -1 | cut -c1-90)..."
rm -f slurm/logs/sft_"${guard}"_*.out

export SBATCH_ARRAY_INX=0-$((NTASKS - 1))
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

# --- 4. wait: every array task of the four jobs in a final state ----------------------------------
# `scontrol -o show job ID` prints one line per array task (one line for the tasks still pending).
states() { scontrol -o show job "$1" | sed -n 's/.*JobState=\([A-Z_]*\) .*/\1/p'; }
finished() {
    local id st
    for id in "${JOBS[@]}"; do
        [[ $(states "$id" | wc -l) == "$NTASKS" ]] || return 1
        for st in $(states "$id"); do
            case $st in
                PENDING | RUNNING | CONFIGURING | COMPLETING | SUSPENDED | REQUEUED*) return 1 ;;
            esac
        done
    done
}
deadline=$((SECONDS + TEST_TIMEOUT))
last=""
until finished; do
    ((SECONDS < deadline)) || { squeue; die "the chain did not finish within $TEST_TIMEOUT s"; }
    now=$(squeue -h -o "%i %j %T" | tr '\n' ' ')
    [[ $now != "$last" ]] && log "queue: ${now:-empty}"
    last=$now
    sleep 5
done
log "all jobs finished"

# --- 5. checks -------------------------------------------------------------------------------------
fail=0
for id in "${JOBS[@]}"; do
    while read -r line; do
        name=$(sed -n 's/.* JobName=\([^ ]*\) .*/\1/p' <<<"$line")
        task=$(sed -n 's/.* ArrayTaskId=\([^ ]*\) .*/\1/p' <<<"$line")
        state=$(sed -n 's/.* JobState=\([^ ]*\) .*/\1/p' <<<"$line")
        exit_code=$(sed -n 's/.* ExitCode=\([^ ]*\) .*/\1/p' <<<"$line")
        out=$(sed -n 's/.* StdOut=\([^ ]*\).*/\1/p' <<<"$line")
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
        for stage in sft reward_model ppo dpo; do
            f=$OUTPUT_ROOT/models/$(basename "$m")/${stage}_$s/model.safetensors
            if [[ -s $f ]]; then log "ok: ${f#"$WORK"/}"; else echo "missing: $f" >&2; fail=1; fi
        done
    done
done
((fail == 0)) || die "see above; logs in slurm/logs/"
[[ ${KEEP:-0} == 1 ]] || for id in "${JOBS[@]}"; do rm -f slurm/logs/*_"${id}"_*.out; done
log "PASS: $NTASKS x ${#JOBS[@]} array tasks COMPLETED with the node's memory, all models saved, in" \
    "$((SECONDS - START)) s"
