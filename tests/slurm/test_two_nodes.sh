#!/usr/bin/env bash
# One task over two nodes, for real: a throwaway Slurm cluster of two nodes on this machine
# (cluster.sh: two slurmd daemons, each in its own network namespace with its own address on a veth
# pair, the other ends on a bridge where slurmctld listens) runs sft.sbatch with TINY=1 and
# `sbatch --nodes=2`: srun starts one accelerate launcher per node (machine ranks 0 and 1, the
# rendezvous at the first node's address), one CPU process each, DDP over gloo across the bridge
# (GLOO_SOCKET_IFNAME=the veth end in each namespace). While it runs, its batch shell gets SIGUSR1
# (what --signal=B:USR1@900 sends before the time limit, here by `scancel --batch --signal=USR1`):
# srun passes it to both launchers, torchrun's agents to their ranks (PET_SIGNALS_TO_HANDLE), the
# ranks save a checkpoint and exit, the task requeues itself and the rerun resumes on both nodes.
# Its metrics and weights must equal those of one node with two processes (the same stage and flags,
# `accelerate launch --multi_gpu --num_processes 2` on this machine), within the tolerances of the
# pytest 1-vs-2-process tests: losses rel 1e-5, weights rtol 1e-4 atol 1e-6.
#
#   make test-slurm-nodes                (or: sudo tests/slurm/test_two_nodes.sh; make test-slurm
#                                        runs it after test_sbatch_chain.sh)
#
# Needs root (cluster.sh: packages, daemons, namespaces, veth pairs and a bridge, all removed on
# every exit). Environment: STOP=0 runs the two-node task without the stop; KEEP=1 keeps the
# temporary folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
START=$SECONDS
LOG_TAG=test-slurm-nodes
# shellcheck source=tests/slurm/cluster.sh
source tests/slurm/cluster.sh
STOP=${STOP:-1}
PY=${PY:-.venv/bin/python}
[[ -x $PY ]] || die "needs the project's .venv (make install)"

cluster_up 2
WORK=$CLUSTER_WORK
log "building the tiny data (./hello_world.sh --data)"
./hello_world.sh --data >"$WORK/hello_world_data.log" 2>&1 ||
    { tail -n 30 "$WORK/hello_world_data.log"; die "./hello_world.sh --data"; }

# 32 updates of 32 examples, 16 per node; a checkpoint every 4 updates (TINY's default for SFT).
# TINY=1's sft.sbatch trains two models one after the other (the reward model's all-tokens backbone,
# then the policy): the stop comes during the first, and the comparison is of the first.
export TINY=1 OUTPUT_ROOT=$WORK/out SBATCH_GPUS_PER_TASK=0 MODELS=models/tiny/pythia-tiny-s SEEDS=1
export SBATCH_ARRAY_INX=0 NODES=2 SFT_FLAGS="--total_episodes 1024" GLOO_SOCKET_IFNAME=$CLUSTER_IFNAME
job=$(sbatch --parsable --nodes=2 sbatches/sft.sbatch)
task=${job}_0
job_log=slurm/logs/sft_${job}_0.out
ckpt_dir=$OUTPUT_ROOT/models/pythia-tiny-s/sft_all_tokens_1/checkpoints
log "submitted sft $task on 2 nodes (NODES=2, sbatch --nodes=2), GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME"
state() { scontrol -o show job "$task" | job_field JobState; }

if [[ $STOP == 1 ]]; then
    deadline=$((SECONDS + 600))
    until [[ $(state) == RUNNING ]] && compgen -G "$ckpt_dir/update-*" >/dev/null; do
        ((SECONDS < deadline)) || { tail -n 40 "$job_log"; die "$task wrote no checkpoint"; }
        [[ $(state) == @(PENDING|RUNNING|CONFIGURING) ]] || { tail -n 60 "$job_log"; die "$task: $(state)"; }
        sleep 0.3
    done
    log "$task wrote $(basename "$(compgen -G "$ckpt_dir/update-*" | tail -n 1)"):" \
        "SIGUSR1 to its batch shell (scancel --batch --signal=USR1)"
    scancel --batch --signal=USR1 "$task"
    deadline=$((SECONDS + 300))
    until [[ $(state) == PENDING && $(scontrol -o show job "$task" | job_field Restarts) == 1 ]]; do
        ((SECONDS < deadline)) || { tail -n 60 "$job_log"; die "$task did not requeue itself"; }
        sleep 1
    done
    log "$task requeued itself; releasing it now (scontrol update StartTime=now)"
    scontrol update JobId="$task" StartTime=now
fi
wait_jobs 900 1 "$job"
line=$(scontrol -o show job "$task")
log "$task: $(job_field JobState <<<"$line") (exit $(job_field ExitCode <<<"$line")) on" \
    "$(job_field NodeList <<<"$line"), $(job_field Restarts <<<"$line") restart(s)"
[[ $(job_field JobState <<<"$line") == COMPLETED && $(job_field ExitCode <<<"$line") == 0:0 ]] ||
    { tail -n 80 "$job_log"; die "$task did not complete"; }
[[ $(job_field NumNodes <<<"$line") == 2 ]] || die "$task ran on $(job_field NumNodes <<<"$line") node(s)"
# each node's slurmd started its part of the step (job id of the array task, step 0)
id=$(sed -n 's/^JobId=\([0-9]*\) .*/\1/p' <<<"$line")   # (the first field: no blank before it)
for node in "${CLUSTER_NODES[@]}"; do
    grep -q "launch task StepId=$id.0 " "$CLUSTER_WORK/slurmd-$node.log" || die "$node ran no launcher of $task"
done

# the launch line, as the log shows it, and the stage's arguments (after the script)
launch=$(grep -m1 '^+ srun ' "$job_log") || { tail -n 40 "$job_log"; die "no srun line in $job_log"; }
log "launch line: ${launch:0:400}"
for want in "--nodes=2 --ntasks=2 --ntasks-per-node=1" "accelerate launch --multi_gpu --num_processes 2" \
    "--num_machines 2 --machine_rank \$SLURM_NODEID --main_process_ip ${CLUSTER_ADDRS[0]} --main_process_port" \
    "--local_micro_batch_size 16 --gradient_accumulation_steps 1"; do
    [[ $launch == *"$want"* ]] || die "the launch line lacks: $want"
done
# (rich wraps the stages' console lines at 80 columns in a log)
tr -s ' \n' '  ' <"$job_log" |
    grep -q "world_size 2 x local_micro_batch_size 16 x gradient_accumulation_steps 1 = batch_size 32" ||
    die "the stage did not run 2 processes with the batch of 32"
if [[ $STOP == 1 ]]; then
    "$PY" - "$job_log" <<'EOF' || { tail -n 80 "$job_log"; die "the log of the stop and the resume"; }
import re, sys
text = open(sys.argv[1]).read()
saved = [int(k) for k in re.findall(r"checkpoint saved at update (\d+) after a stop signal", text)]
resumed = [int(k) for k in re.findall(r"resumed run \S+\s+from\s+.+?\s+at\s+update\s+(\d+)", text, re.S)]
print(f"[test-slurm-nodes] stopped by SIGUSR1 with a checkpoint of update {saved}, resumed at update {resumed}")
assert len(saved) == 1 and resumed == saved, (saved, resumed)
assert re.search(r"requeueing job \d+ \(\d+_0\): its rerun resumes from \S+update-0*%d\b" % saved[0], text)
launches = re.findall(r"^\+ srun .*$", text, re.M)
# the backbone, its resumed rerun, then the policy's SFT
assert [line.endswith(" --resume") for line in launches] == [False, True, False], launches
EOF
fi

# one node, two processes: the same stage and arguments on this machine (root namespace)
read -r -a args <<<"${launch#*summarize_from_feedback_details/sft.py }"
ref_out=$WORK/ref/sft_all_tokens_1
for ((i = 0; i < ${#args[@]}; i++)); do
    [[ ${args[i]} != --output_dir ]] || args[i + 1]=$ref_out
    [[ ${args[i]} != --resume ]] || unset 'args[i]'
done
threads=$(sed -n 's/.*OMP_NUM_THREADS=\([0-9]*\).*/\1/p' "$job_log" | head -n 1)
mkdir -p "$WORK/ref"
log "the same on one node with two processes: accelerate launch --multi_gpu --num_processes 2 sft.py" \
    "${args[*]:0:6} ..."
(cd "$WORK/ref" && env -u GLOO_SOCKET_IFNAME ACCELERATE_USE_CPU=1 HF_HUB_OFFLINE=1 OMP_NUM_THREADS="${threads:-1}" \
    "$OLDPWD/.venv/bin/accelerate" launch --multi_gpu --num_processes 2 --main_process_port 0 \
    "$OLDPWD/summarize_from_feedback_details/sft.py" "${args[@]}") >"$WORK/ref.log" 2>&1 ||
    { tail -n 40 "$WORK/ref.log"; die "the one-node run failed"; }

"$PY" - "$OUTPUT_ROOT" "$WORK/ref" "$OUTPUT_ROOT/models/pythia-tiny-s/sft_all_tokens_1" "$ref_out" <<'EOF' ||
import glob, json, math, os, sys
import torch
from safetensors.torch import load_file
two_nodes, one_node, model_two, model_one = sys.argv[1:]

def metrics(root):
    """the metrics of the backbone SFT run (exp_name sft_all_tokens) under root/runs/"""
    def exp_name(run):
        with open(os.path.join(run, "args.json")) as f:
            return json.load(f)["exp_name"]
    (run,) = [r for r in glob.glob(os.path.join(root, "runs", "*")) if exp_name(r) == "sft_all_tokens"]
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]

a, b = metrics(two_nodes), metrics(one_node)
assert [r["step"] for r in a] == [r["step"] for r in b] and [sorted(r) for r in a] == [sorted(r) for r in b]
losses = [k for r in a for k in r if k.endswith("/loss")]
worst = 0.0
for ra, rb in zip(a, b):
    for k in ra:
        if k.endswith("/loss"):
            assert math.isclose(ra[k], rb[k], rel_tol=1e-5), (ra["step"], k, ra[k], rb[k])
            worst = max(worst, abs(ra[k] - rb[k]) / abs(rb[k]))
        elif k.endswith(("/lr", "/episode")) or k == "step":
            assert ra[k] == rb[k], (ra["step"], k, ra[k], rb[k])
wa, wb = load_file(os.path.join(model_two, "model.safetensors")), load_file(os.path.join(model_one, "model.safetensors"))
assert wa.keys() == wb.keys()
for k in wa:
    assert torch.allclose(wa[k], wb[k], rtol=1e-4, atol=1e-6), k
same = all(torch.equal(wa[k], wb[k]) for k in wa)
print(f"[test-slurm-nodes] {len(a)} metric lines, {len(losses)} losses within rel {worst:.1e}; {len(wa)} weight tensors"
      f" {'bit-identical' if same else 'within rtol 1e-4, atol 1e-6'}")
EOF
    die "two nodes x 1 process differ from one node x 2 processes"
[[ ${KEEP:-0} == 1 ]] || rm -f "$job_log"
stopped=""
[[ $STOP != 1 ]] || stopped=", stopped by SIGUSR1 (srun -> both launchers -> ranks), requeued and resumed,"
log "PASS: sft (the backbone) on 2 nodes x 1 CPU process (srun, machine ranks 0/1, gloo over veth)$stopped equals 1 node x 2" \
    "processes, in $((SECONDS - START)) s"
