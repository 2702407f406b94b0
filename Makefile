# Everything installs into .venv; both README commands go through `make install` first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install test clean

# poetry.lock's versions as pip constraints, one line per locked version with its markers, so each
# Python gets the lock's own (lock_constraints.py writes it; `make constraints`).
CONSTRAINTS := constraints.txt
PIP := $(PY) -m pip install -q -c $(CONSTRAINTS)

install: $(STAMP)

# Every pip call takes its versions from the lock: pip first (a new venv's own may predate --group),
# then the build group (poetry-core, setuptools) with torch, then the project and its groups. torch
# goes before the project, pinned by its constraint (pip takes a local CPU build of that version
# where its find-links hold one): an unpinned torch, or one pulled in by deepspeed, would fetch the
# newest CUDA build, hence the grep. --no-build-isolation lets deepspeed's sdist build against that
# torch and the locked setuptools. A relock changes one of the three files, so the next make reinstalls.
$(STAMP): pyproject.toml poetry.lock $(CONSTRAINTS)
	@grep -q '^torch==' $(CONSTRAINTS) || { echo "$(CONSTRAINTS) pins no torch: make constraints" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PIP) pip
	$(PIP) --group build torch
	$(PIP) --no-build-isolation -e . --group dev --group benchmark
	touch $(STAMP)

# After a relock: constraints.txt from poetry.lock (docs/development.md#dependencies-and-poetrylock).
.PHONY: constraints
constraints:
	$(PYTHON) lock_constraints.py

# Two pytest-xdist workers, one test module each at a time (a module's trained models are built once),
# in the order tests/conftest.py gives (the longest modules first), on one torch thread each: the tiny
# models' small ops run faster on one thread than on two, and two workers keep both cores of a CI
# machine busy while the other waits on a launched run.
TEST_WORKERS ?= 2
test: install
	HF_HUB_OFFLINE=1 WANDB_MODE=offline OMP_NUM_THREADS=1 $(PY) -m pytest -q -m "not gpu" -n $(TEST_WORKERS) \
		--dist loadfile --no-loadscope-reorder --durations=20 --cpu-durations=25

# Opt-in, needs CUDA (skipped without; stops where nvidia-smi lists GPUs torch cannot see): sft, reward, PPO and DPO on one GPU with bf16 and DeepSpeed
# ZeRO-2 at Pythia-410m's shape; prints seconds per update and peak GPU memory.
.PHONY: test-gpu
test-gpu: install
	$(PY) -m summarize_from_feedback_details.check_gpu
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(PY) -m pytest -q -s -rs -m gpu

# Opt-in, on a CUDA machine, the first thing to run there: test-gpu, the benchmark rows at Pythia-1B's
# shape (ours, and ours vs TRL 1.12), decode against the bandwidth floor, peak memory per stage and a
# bf16 log-prob drift check, in one report: $(GPU_REPORT)/report.md (benchmarks/gpu_report.py).
# Without CUDA it says so and runs nothing.
GPU_REPORT ?= gpu_report
.PHONY: gpu-report
gpu-report: install
	$(PY) -m summarize_from_feedback_details.check_gpu
	HF_HUB_OFFLINE=1 WANDB_MODE=offline $(PY) benchmarks/gpu_report.py --out $(GPU_REPORT)

clean:
	rm -rf $(VENV) data models runs

# Opt-in, not part of `make test`: the embedded default over tiny-s, -m, -l x seeds 1 2 3 (SFT, reward
# model, PPO; hours on a 2-core CPU, docs/scaling.md has each chain's time), then the scaling plots
# and the results table in eval/images/scaling/. Finished runs are reused, stopped ones resumed;
# SIZES / SEEDS choose others. Where a Slurm cluster answers, it submits the sbatches/ chain with
# TINY=1 instead (SLURM=0: run here; scaling.sh).
.PHONY: scaling
scaling: install
	./scaling.sh

# Opt-in, not part of `make test`: the methods side by side on the embedded default at equal episodes
# (SFT, PPO, DPO, RLOO k=2 and k=4, GRPO, online DPO) at tiny-m x seeds 1 2 3, reusing make scaling's
# SFT, reward model and PPO runs where they exist; then eval/images/compare/ (compare.sh; SIZES="m l"
# adds tiny-l, SEEDS others; `make compare ARCH=llama` (or qwen3) the Llama-style embedded default, into
# eval/images/compare_llama/).
.PHONY: compare
compare: install
	./compare.sh

# Opt-in, not part of `make test`: the staleness study of asynchronous RLHF on the embedded default
# (PPO, RLOO k=2, GRPO k=4 and online DPO at --async_steps 0 1 2 4 8 x seeds 1 2 3, from hello_world's
# SFT and reward model); then eval/images/async/ (async.sh; docs/async.md reads it).
.PHONY: async
async: install
	./async.sh

# Opt-in, not part of `make test`: the sbatches/ chain (TINY=1) and a PPO task stopped twice,
# requeued and resumed, on a throwaway one-node Slurm cluster started on this machine; then one task
# over two nodes (two slurmd in network namespaces on a bridge) stopped, requeued and resumed,
# against one node with two processes (test-slurm-nodes alone); then scaling.sh on Slurm against
# scaling.sh without it, model for model. Needs root: installs slurm + munge
# from Debian if missing; creates and removes network namespaces, veth pairs and a bridge.
.PHONY: test-slurm test-slurm-nodes
test-slurm: install
	tests/slurm/test_sbatch_chain.sh
	tests/slurm/test_two_nodes.sh
	tests/slurm/test_scaling.sh

test-slurm-nodes: install
	tests/slurm/test_two_nodes.sh
