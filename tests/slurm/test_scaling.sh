#!/usr/bin/env bash
# scaling.sh's Slurm path for real, on a throwaway one-node Slurm cluster on this machine
# (cluster.sh), against its path without Slurm:
#
# 1. `SLURM=1 SIZES=s SEEDS="1 2" ./scaling.sh` submits the TINY=1 chain (sft -> reward -> ppo, one
#    array task per seed), waits for it and draws the plots and the table from its runs;
# 2. `SLURM=0` with the same sizes, seeds and flags trains the same through hello_world.sh, one run
#    after another: every model (both SFTs, the reward model, PPO) is byte-identical to the chain's
#    (one CPU process each, the same flags: the same computation);
# 3. `SLURM=1` again submits nothing: every (size, seed) finished.
#
#   make test-slurm                      (or: sudo tests/slurm/test_scaling.sh)
#
# Short stages (SFT_FLAGS, REWARD_FLAGS, PPO_FLAGS reach both paths): a few minutes in all. It runs in
# a copy of the repository in the cluster's temporary folder (the data, the tiny base models and
# .venv linked), so models/, runs/ and eval/images/scaling/ here are left alone.
set -euo pipefail
cd "$(dirname "$0")/../.."
START=$SECONDS
LOG_TAG=test-slurm-scaling
# shellcheck source=tests/slurm/cluster.sh
source tests/slurm/cluster.sh
PY=${PY:-.venv/bin/python}
[[ -x $PY ]] || PY=python3

cluster_up 1
WORK=$CLUSTER_WORK
log "building the tiny data (./hello_world.sh --data)"
./hello_world.sh --data >"$WORK/hello_world_data.log" 2>&1 ||
    { tail -n 30 "$WORK/hello_world_data.log"; die "./hello_world.sh --data"; }

# the working tree (tracked and untracked files, modification times kept: make sees .venv as
# installed), with the data, the tiny base models and .venv linked
copy=$WORK/repo
mkdir -p "$copy/models"
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$copy"
ln -s "$PWD/.venv" "$copy/.venv"
ln -s "$PWD/data" "$copy/data"
ln -s "$PWD/models/tiny" "$copy/models/tiny"
cd "$copy"

export SIZES=s SEEDS="1 2" POLL_SECONDS=3
export SFT_FLAGS="--total_episodes 512" REWARD_FLAGS="--total_episodes 512" PPO_FLAGS="--total_episodes 128"
log "1. SLURM=1 ./scaling.sh (SIZES=$SIZES SEEDS=\"$SEEDS\", $SFT_FLAGS / $REWARD_FLAGS / $PPO_FLAGS)"
SLURM=1 ./scaling.sh >"$WORK/slurm.log" 2>&1 || { tail -n 60 "$WORK/slurm.log"; die "scaling.sh on Slurm"; }
grep -q "submitted sft" "$WORK/slurm.log" || die "scaling.sh submitted nothing"
grep "=== scaling" "$WORK/slurm.log" | sed 's/^/    /'
[[ -s eval/images/scaling/scaling_table.md ]] || die "no table from the chain's runs"
cp eval/images/scaling/scaling_table.md "$WORK/slurm_table.md"

log "2. SLURM=0 ./scaling.sh: the same through hello_world.sh"
SLURM=0 ./scaling.sh >"$WORK/local.log" 2>&1 || { tail -n 60 "$WORK/local.log"; die "scaling.sh without Slurm"; }
for seed in $SEEDS; do
    for stage in sft_all_tokens sft reward_model ppo; do
        a=slurm/scaling/models/pythia-tiny-s/${stage}_$seed/model.safetensors
        b=models/scaling_s_$seed/$stage/model.safetensors
        [[ -s $a && -s $b ]] || die "missing $a or $b"
        cmp -s "$a" "$b" || die "tiny-s seed $seed $stage: the chain's model differs from hello_world.sh's"
    done
done
cmp -s eval/images/scaling/scaling_table.md "$WORK/slurm_table.md" ||
    { diff "$WORK/slurm_table.md" eval/images/scaling/scaling_table.md; die "the two tables differ"; }
log "every model of both seeds byte-identical on both paths, and the same table"

log "3. SLURM=1 ./scaling.sh again: nothing to submit"
SLURM=1 ./scaling.sh >"$WORK/again.log" 2>&1 || { tail -n 60 "$WORK/again.log"; die "the rerun"; }
! grep -q "submitted sft" "$WORK/again.log" || die "the rerun submitted jobs again"
[[ $(grep -c "finished before" "$WORK/again.log") == 2 ]] || die "the rerun did not reuse both runs"

log "PASS: scaling.sh on Slurm (the TINY=1 chain) equals scaling.sh without it, model for model; a rerun" \
    "submits nothing; in $((SECONDS - START)) s"
