# shellcheck shell=bash
# Sourced by tests/slurm/test_*.sh: a throwaway Slurm cluster on this machine, as root.
#
#   cluster_up 1     one node: this machine, on 127.0.0.1 (slurmctld and slurmd in the root network
#                    namespace), named after the host
#   cluster_up 2     two nodes, tnode1 and tnode2: one slurmd each in its own network namespace with
#                    its own address on a veth pair whose other end sits on a bridge in the root
#                    namespace, where slurmctld listens. Inside each namespace the veth end is called
#                    $CLUSTER_IFNAME (for GLOO_SOCKET_IFNAME). Processes of a job on tnode<i> see only
#                    that namespace's network, so two "nodes" talk to each other over the bridge as two
#                    machines would (the filesystem is shared, as on a cluster with shared storage).
#
# It installs slurmctld, slurmd, slurm-client and munge from the Debian archive when they are
# missing (bookworm: Slurm 22.05), starts munged (as user munge), slurmctld and slurmd (as root),
# and writes everything into one temporary folder ($CLUSTER_WORK): its own munge key and socket, a
# slurm.conf pointed to by SLURM_CONF (no accounting, no slurmdbd), state, spool and log files. It
# never writes /etc/slurm or /etc/munge and uses its own ports, so a Slurm already installed here
# is left alone. cluster_cleanup (installed as the EXIT trap by cluster_up) cancels what still runs,
# stops every daemon it started, deletes the namespaces, veth pairs and the bridge it made, and
# removes $CLUSTER_WORK unless KEEP=1 or the test failed.
#
# Slurm's multiple-slurmd mode (several slurmd on one host, --enable-multiple-slurmd) is not what
# this uses: Debian's build lacks it (`strings $(command -v slurmd) | grep -i multiple` finds only
# help texts), and there all "nodes" would share one address anyway.

START=${START:-$SECONDS}
LOG_TAG=${LOG_TAG:-test-slurm}
log() { echo "[$LOG_TAG $((SECONDS - START))s] $*"; }
die() { echo "[$LOG_TAG] FAIL: $*" >&2; exit 1; }

CLUSTER_WORK=""
CLUSTER_PIDS=()          # daemons started here, stopped in this order by cluster_cleanup
CLUSTER_NETNS=()         # network namespaces made here
CLUSTER_LINKS=()         # links made here in the root namespace (veth ends, the bridge: deleted last)
CLUSTER_NODES=()         # node names
CLUSTER_ADDRS=()         # their addresses
CLUSTER_IFNAME=tslurm0   # the veth end inside each node's namespace (two nodes)
CLUSTER_CLEANUP_HOOK=""  # a function cluster_cleanup runs first (e.g. a test's own processes)

cluster_cleanup() {
    local rc=$? pid ns link
    set +e
    trap - EXIT
    [[ -z $CLUSTER_CLEANUP_HOOK ]] || "$CLUSTER_CLEANUP_HOOK"
    if [[ -n ${SLURM_CONF:-} ]] && [[ -n $(squeue -h 2>/dev/null) ]]; then
        scancel --partition=test        # the cluster is this test's own: cancel whatever still runs
        for _ in {1..30}; do [[ -z $(squeue -h 2>/dev/null) ]] && break; sleep 1; done
    fi
    for pid in ${CLUSTER_PIDS[@]+"${CLUSTER_PIDS[@]}"}; do kill "$pid" 2>/dev/null; done
    for pid in ${CLUSTER_PIDS[@]+"${CLUSTER_PIDS[@]}"}; do
        for _ in {1..20}; do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -9 "$pid" 2>/dev/null
    done
    for ns in ${CLUSTER_NETNS[@]+"${CLUSTER_NETNS[@]}"}; do
        # anything a job left running in the namespace would keep it alive: stop it first
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null; done
        ip netns delete "$ns" 2>/dev/null || echo "[$LOG_TAG] could not delete network namespace $ns" >&2
    done
    for link in ${CLUSTER_LINKS[@]+"${CLUSTER_LINKS[@]}"}; do
        ip link show "$link" >/dev/null 2>&1 && ip link delete "$link"
    done
    if [[ -n $CLUSTER_WORK ]]; then
        if [[ ${KEEP:-0} == 1 || $rc != 0 ]]; then
            echo "[$LOG_TAG] daemon logs and outputs kept in $CLUSTER_WORK"
        else
            rm -rf "$CLUSTER_WORK"
        fi
    fi
    exit "$rc"
}

cluster_install() {
    local missing=() pair
    for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge; do
        command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
    done
    if ((${#missing[@]})); then
        log "installing ${missing[*]} from the Debian archive"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
            >/dev/null
    fi
    if [[ ${1:-1} -gt 1 ]] && ! command -v ip >/dev/null; then
        log "installing iproute2 from the Debian archive (network namespaces)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2 >/dev/null
    fi
}

# free TCP ports for slurmctld and slurmd (bash probes them with /dev/tcp)
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# cluster_network N: a bridge in the root namespace (CTL_ADDR) and N namespaces on it (CLUSTER_ADDRS)
cluster_network() {
    local n=$1 tag=ts$$ net i ns
    # a 10.231.<x>.0/24 that no route of this machine covers
    for ((x = $$ % 200 + 20; ; x = x % 250 + 1)); do
        net=10.231.$x
        ip -4 route | grep -q "^$net\." || ip -4 addr | grep -q " $net\." || break
    done
    CTL_ADDR=$net.1
    ip link add "${tag}br" type bridge
    CLUSTER_LINKS+=("${tag}br")
    ip addr add "$CTL_ADDR/24" dev "${tag}br"
    ip link set "${tag}br" up
    for ((i = 1; i <= n; i++)); do
        ns=${tag}n$i
        ip netns add "$ns"
        CLUSTER_NETNS+=("$ns")
        ip link add "${tag}h$i" type veth peer name "${tag}p$i"
        CLUSTER_LINKS=("${tag}h$i" "${CLUSTER_LINKS[@]}")
        ip link set "${tag}h$i" master "${tag}br" up
        ip link set "${tag}p$i" netns "$ns"
        ip -n "$ns" link set "${tag}p$i" name "$CLUSTER_IFNAME"
        ip -n "$ns" addr add "$net.$((10 + i))/24" dev "$CLUSTER_IFNAME"
        ip -n "$ns" link set "$CLUSTER_IFNAME" up
        ip -n "$ns" link set lo up
        CLUSTER_NODES+=("tnode$i")
        CLUSTER_ADDRS+=("$net.$((10 + i))")
    done
    # each namespace reaches slurmctld and the other namespace over the bridge
    for ((i = 1; i <= n; i++)); do
        nsenter --net="/run/netns/${tag}n$i" "${PYTHON:-python3}" - "$CTL_ADDR" "${CLUSTER_ADDRS[@]}" <<'EOF' ||
import socket, sys
for addr in sys.argv[1:]:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((addr, 9))  # routing only: no packet is sent
    s.close()
EOF
            die "no route from namespace ${tag}n$i to the bridge"
    done
}

# cluster_up NODES: the cluster, idle and ready for sbatch (SLURM_CONF exported)
cluster_up() {
    local n=${1:-1} i host cpus mem
    [[ $EUID == 0 ]] || die "needs root (installs packages, starts munged/slurmctld/slurmd): sudo $0"
    cluster_install "$n"
    CLUSTER_WORK=$(mktemp -d /tmp/test-slurm.XXXXXX)
    chmod 755 "$CLUSTER_WORK"           # munged runs as user munge and must reach $WORK/munge
    trap cluster_cleanup EXIT
    trap 'exit 130' INT TERM

    CTLD_PORT=16817
    while ! port_free $CTLD_PORT || ! port_free $((CTLD_PORT + 1)); do CTLD_PORT=$((CTLD_PORT + 2)); done

    mkdir -p "$CLUSTER_WORK"/{etc,state,spool,out} "$CLUSTER_WORK/munge"
    chown munge:munge "$CLUSTER_WORK/munge"
    chmod 755 "$CLUSTER_WORK/munge"     # munged wants its socket folder reachable by all
    runuser -u munge -- mungekey --create --keyfile "$CLUSTER_WORK/munge/munge.key"
    runuser -u munge -- munged --socket "$CLUSTER_WORK/munge/munge.socket" \
        --key-file "$CLUSTER_WORK/munge/munge.key" --pid-file "$CLUSTER_WORK/munge/munged.pid" \
        --log-file "$CLUSTER_WORK/munge/munged.log" --seed-file "$CLUSTER_WORK/munge/munged.seed"
    for _ in {1..20}; do [[ -s $CLUSTER_WORK/munge/munged.pid ]] && break; sleep 0.5; done
    CLUSTER_PIDS+=("$(cat "$CLUSTER_WORK/munge/munged.pid")")

    host=$(hostname -s)
    read -r cpus mem < <(slurmd -C | sed -n 's/.* CPUs=\([0-9]*\) .* RealMemory=\([0-9]*\).*/\1 \2/p')
    CLUSTER_CPUS=$cpus CLUSTER_MEM=$mem
    if ((n == 1)); then
        CTL_ADDR=127.0.0.1
        CLUSTER_NODES=("$host")
        CLUSTER_ADDRS=(127.0.0.1)
    else
        cluster_network "$n"
    fi
    # Memory is a consumable resource (CR_CPU_Memory), as on the GPU clusters, so the files' --mem=0
    # (all of the node's memory) is granted and checked as there; every node has this machine's CPUs
    # and memory. Unique job ids per run, so the logs under slurm/logs/ of two runs never collide;
    # finished jobs stay queryable for an hour. %n: one spool folder, pid and log file per slurmd.
    export SLURM_CONF=$CLUSTER_WORK/etc/slurm.conf
    cat >"$SLURM_CONF" <<EOF
ClusterName=testslurm
SlurmctldHost=$host($CTL_ADDR)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$((CTLD_PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$CLUSTER_WORK/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$CLUSTER_WORK/state
SlurmdSpoolDir=$CLUSTER_WORK/spool/%n
SlurmctldPidFile=$CLUSTER_WORK/slurmctld.pid
SlurmdPidFile=$CLUSTER_WORK/slurmd-%n.pid
SlurmctldLogFile=$CLUSTER_WORK/slurmctld.log
SlurmdLogFile=$CLUSTER_WORK/slurmd-%n.log
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
KillWait=30
FirstJobId=$((($(date +%s) % 100000) * 100 + 1000))
EOF
    for ((i = 0; i < ${#CLUSTER_NODES[@]}; i++)); do
        echo "NodeName=${CLUSTER_NODES[i]} NodeAddr=${CLUSTER_ADDRS[i]} CPUs=$cpus RealMemory=$mem" \
            "State=UNKNOWN" >>"$SLURM_CONF"
    done
    local IFS=,
    echo "PartitionName=test Nodes=${CLUSTER_NODES[*]} Default=YES MaxTime=INFINITE State=UP" >>"$SLURM_CONF"
    unset IFS

    slurmctld -D -i >"$CLUSTER_WORK/slurmctld.out" 2>&1 &
    CLUSTER_PIDS=("$!" "${CLUSTER_PIDS[@]}")
    for ((i = 0; i < ${#CLUSTER_NODES[@]}; i++)); do
        mkdir -p "$CLUSTER_WORK/spool/${CLUSTER_NODES[i]}"
        if ((n == 1)); then
            slurmd -D -N "${CLUSTER_NODES[i]}" >"$CLUSTER_WORK/slurmd-${CLUSTER_NODES[i]}.out" 2>&1 &
        else
            # nsenter, not `ip netns exec`: that one also remounts /sys for the namespace, which hides
            # /sys/fs/cgroup, and slurmd 22.05 will not start without its cgroup plugin
            nsenter --net="/run/netns/${CLUSTER_NETNS[i]}" slurmd -D -N "${CLUSTER_NODES[i]}" \
                >"$CLUSTER_WORK/slurmd-${CLUSTER_NODES[i]}.out" 2>&1 &
        fi
        CLUSTER_PIDS=("$!" "${CLUSTER_PIDS[@]}")
    done
    local node up
    for _ in {1..60}; do
        up=1
        for node in "${CLUSTER_NODES[@]}"; do
            [[ $(sinfo -h -n "$node" -o %t 2>/dev/null) == idle ]] || up=0
        done
        ((up)) && break
        sleep 1
    done
    ((up)) || {
        sinfo -N -l || true
        tail -n 20 "$CLUSTER_WORK"/*.log "$CLUSTER_WORK"/*.out 2>/dev/null
        die "the node(s) ${CLUSTER_NODES[*]} did not come up idle"
    }
    log "$(sbatch --version), $(munged --version 2>&1 | head -1)"
    log "cluster up: node(s) ${CLUSTER_NODES[*]} at ${CLUSTER_ADDRS[*]}, $cpus CPUs and ${mem} MB each," \
        "slurmctld at $CTL_ADDR:$CTLD_PORT, config $SLURM_CONF"
}

# job_lines ID: `scontrol -o show job ID`, one line per array task (one for the tasks still pending)
job_field() { sed -n "s/.* $1=\\([^ ]*\\).*/\\1/p"; }
job_states() { scontrol -o show job "$1" | job_field JobState; }

# wait_jobs TIMEOUT NTASKS ID...: until every array task of the jobs is in a final state
wait_jobs() {
    local timeout=$1 ntasks=$2 deadline last="" now
    shift 2
    deadline=$((SECONDS + timeout))
    until jobs_finished "$ntasks" "$@"; do
        ((SECONDS < deadline)) || { squeue; die "the jobs $* did not finish within $timeout s"; }
        now=$(squeue -h -o "%i %j %T" | tr '\n' ' ')
        [[ $now != "$last" ]] && log "queue: ${now:-empty}"
        last=$now
        sleep 3
    done
}
jobs_finished() {
    local ntasks=$1 id st
    shift
    for id in "$@"; do
        [[ $(job_states "$id" | wc -l) == "$ntasks" ]] || return 1
        for st in $(job_states "$id"); do
            case $st in
                PENDING | RUNNING | CONFIGURING | COMPLETING | SUSPENDED | REQUEUED* | RESIZING) return 1 ;;
            esac
        done
    done
}
