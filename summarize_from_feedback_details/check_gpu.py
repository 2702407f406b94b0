"""Exits non-zero, saying why, where nvidia-smi lists GPUs that torch cannot see (a CPU build of torch,
or a CUDA build newer than the driver): a GPU run would otherwise run on the CPU without a word.
hello_world.sh and `make test-gpu` run it first; every stage refuses to start in that case too
(infra.launch.start_run), unless ACCELERATE_USE_CPU=1 asks for the CPU.

    python -m summarize_from_feedback_details.check_gpu
"""

import sys

from summarize_from_feedback_details.infra.preflight import cuda_problem

if __name__ == "__main__":
    problem = cuda_problem()
    if problem:
        print(problem, file=sys.stderr)
    sys.exit(1 if problem else 0)
