#!/usr/bin/env bash
# The embedded default end to end, on whatever hardware is here (a CPU is enough):
#   synthetic TL;DR data + tiny Pythia-architecture base models -> tldr_dataset.py
# (sft.py, reward.py and ppo_left_padding.py join as they land.)
#
#   ./hello_world.sh           set up .venv if needed, run every stage that has no output yet
#   ./hello_world.sh --force   rerun every stage
set -euo pipefail
cd "$(dirname "$0")"

SEED=${SEED:-1}
FORCE=0
for arg in "$@"; do
    case "$arg" in
        --force) FORCE=1 ;;
        *) echo "usage: $0 [--force]" >&2; exit 2 ;;
    esac
done

RAW_DIR=data/raw                  # synthetic raw files in the upstream schemas
BASE_MODELS_DIR=models/tiny       # pythia-tiny-{s,m,l}, one shared tokenizer
BASE_MODEL=$BASE_MODELS_DIR/pythia-tiny-s
DATASET_DIR=data/tldr             # tokenized sft/ and preference/ datasets

# Lengths of the tiny default (the paper: 512 / 53 / 562 / 169 / 638 and 1919 / 155 / 2021).
TINY_LENGTHS=(
    --tldr_params.length 160
    --tldr_params.max_sft_response_length 32
    --tldr_params.max_sft_query_response_length 192
    --tldr_params.max_rm_response_length 80
    --tldr_params.max_rm_query_response_length 240
    --cnndm_params.length 320
    --cnndm_params.max_rm_response_length 80
    --cnndm_params.max_rm_query_response_length 400
)

make install
PY=.venv/bin/python
export HF_HUB_OFFLINE=1

# run_stage NAME OUTPUT COMMAND...: skipped when OUTPUT exists (each stage writes it atomically)
run_stage() {
    local name=$1 output=$2
    shift 2
    if [[ -e $output && $FORCE == 0 ]]; then
        echo "== $name: $output exists, skipping (--force reruns)"
        return
    fi
    echo "== $name"
    local start=$SECONDS
    "$@"
    echo "== $name done in $((SECONDS - start)) s"
}

run_stage "synthetic TL;DR data" $RAW_DIR \
    $PY -m summarize_from_feedback_details.synthetic_tldr --output_dir $RAW_DIR --seed "$SEED"
run_stage "tiny base models" $BASE_MODELS_DIR \
    $PY -m summarize_from_feedback_details.tiny_models --corpus $RAW_DIR/tldr_sft/train.jsonl \
        --output_dir $BASE_MODELS_DIR --seed "$SEED"
run_stage "tldr_dataset.py" $DATASET_DIR \
    $PY summarize_from_feedback_details/tldr_dataset.py --base_model $BASE_MODEL \
        --sft_dataset $RAW_DIR/tldr_sft --preference_dataset $RAW_DIR/comparisons \
        --output_dir $DATASET_DIR --overwrite "${TINY_LENGTHS[@]}"

echo
echo "datasets: $DATASET_DIR/sft, $DATASET_DIR/preference (plots in $DATASET_DIR/dataset_visuals)"
echo "base models: $BASE_MODELS_DIR/pythia-tiny-{s,m,l}"
echo "label statistics of the synthetic data: $RAW_DIR/label_stats.json"
