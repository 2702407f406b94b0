#!/usr/bin/env bash
# The whole pipeline, data -> sft.py -> reward.py -> ppo_left_padding.py, and dpo.py from the same
# SFT (ALGOS=all: RLOO, GRPO and online DPO too) -> eval plots -> a results table, on whatever
# hardware is here.
#
#   ./hello_world.sh           the embedded default (synthetic TL;DR data, tiny Pythia-architecture
#                              models) on a CPU (13 min on two cores, .venv included); sets up .venv
#                              first if needed; on two cores or more, two chains of stages side by side
#   ./hello_world.sh --force   rerun every stage (otherwise a stage whose output exists is skipped),
#                              discarding the checkpoints of stopped ones (otherwise they resume)
#   ./hello_world.sh --data    only the embedded default's data, base models (every size) and
#                              tokenized datasets (what the sweeps and the sbatch files' TINY=1 mode read)
#   SIDE_BY_SIDE=0 ./hello_world.sh
#                              one stage at a time (another draw: the reward model on every core
#                              throughout); either way a rerun repeats the table to the digit
#   ARCH=llama ./hello_world.sh
#                              the embedded default on a Llama-style model (ARCH=qwen3: Qwen3-style),
#                              with that family's tokenizer conventions; models/tiny_<arch>/,
#                              data/tldr_<arch>, NAME hello_world_<arch>
#   MODEL=EleutherAI/pythia-410m-deduped ./hello_world.sh
#                              the real pipeline with the paper's hyperparameters on this node's
#                              GPUs: hub data and model, DeepSpeed ZeRO-2 (deepspeed.yaml), bf16
#   NAME=lora_hello_world PPO_FLAGS="--use_peft --lr 3e-4" ./hello_world.sh
#                              flags of your own, last on a stage's command line (so they win):
#                              EXTRA_FLAGS for every training stage, SFT_FLAGS (both SFT runs),
#                              REWARD_FLAGS, PPO_FLAGS, DPO_FLAGS, RLOO_FLAGS (rloo, rloo_k4, grpo),
#                              ONLINE_DPO_FLAGS for one; NAME names the models/, runs/ and plot
#                              folders (default hello_world[_<model>])
#   ALGOS=all ./hello_world.sh the methods after the reward model: ALGOS lists them, default
#                              "ppo dpo"; all = every row of summarize_from_feedback_details/methods.tsv:
#                              ppo dpo rloo rloo_k4 grpo online_dpo control null_control (rloo.py with
#                              k=2, k=4 and as GRPO with k=4; online_dpo.py; PPO against an untrained
#                              reward model; PPO with the trained one's scores shuffled, its critic at 0),
#                              each at PPO's episodes;
#                              ALGOS=ppo is the sizes x seeds sweep of scaling.sh, ALGOS=all that of
#                              compare.sh (make compare)
set -euo pipefail
# An array that may be empty is expanded as ${a[@]+"${a[@]}"}: under set -u, bash before 4.4
# (4.2 on older login nodes) aborts on "${a[@]}" of an empty array with "a[@]: unbound variable".
cd "$(dirname "$0")"

SEED=${SEED:-1}
# The embedded default's architecture (tiny_models.py --arch): gpt_neox (Pythia, the paper's), llama
# (Llama 3.2's layout and tokenizer conventions) or qwen3 (Qwen3's); each in its own folders
# (tiny_arch_settings in sbatches/tiny_default.sh: where its models live, its pretraining budget and
# corpus, the facts its base must copy).
ARCH=${ARCH:-gpt_neox}
source sbatches/tiny_default.sh
# shellcheck source=sbatches/methods.sh
source sbatches/methods.sh
tiny_arch_settings "$ARCH" || exit 2
MODEL=${MODEL:-$BASE_MODELS_DIR/$TINY_PREFIX-tiny-m}
FORCE=0
DATA_ONLY=0
for arg in "$@"; do
    case "$arg" in
        --force) FORCE=1 ;;
        --data) DATA_ONLY=1 ;;
        *) echo "usage: [MODEL=<hub name>] $0 [--force] [--data]" >&2; exit 2 ;;
    esac
done

# --- memory knobs of the real pipeline (MODEL=<hub name>) -----------------------------------------
# They never change the results. Each stage keeps the paper's batch size by deriving
#   gradient_accumulation_steps = batch / (local_micro_batch_size x NUM_GPUS)
# (SFT 128, RM 64, PPO 512, DPO 64), so on fewer GPUs the same command accumulates more steps, and when a
# stage runs out of memory you halve its micro batch. The defaults fit Pythia 410m and 1b on 80 GB
# GPUs; the sbatch files carry the values for 2.8b and 6.9b.
# NUM_GPUS: the processes of the real pipeline, one per GPU. Default: the GPUs this process may use,
# as CUDA would count them: CUDA_VISIBLE_DEVICES when set (Slurm and shared machines set it; set
# but empty, or starting with an entry that is no GPU index or UUID such as -1, means none),
# otherwise every GPU nvidia-smi lists.
visible_gpus() {
    if [[ -z ${CUDA_VISIBLE_DEVICES+set} ]]; then
        (nvidia-smi -L 2>/dev/null || true) | wc -l
        return
    fi
    local entries entry count=0
    IFS=, read -ra entries <<<"$CUDA_VISIBLE_DEVICES"
    # CUDA ignores the list from the first invalid entry on
    for entry in ${entries[@]+"${entries[@]}"}; do
        [[ $entry =~ ^[[:space:]]*([0-9]+|GPU-.+|MIG-.+)[[:space:]]*$ ]] || break
        count=$((count + 1))
    done
    echo "$count"
}
NUM_GPUS=${NUM_GPUS:-$(visible_gpus)}
SFT_MICRO_BATCH=${SFT_MICRO_BATCH:-16}
RM_MICRO_BATCH=${RM_MICRO_BATCH:-8}
PPO_MICRO_BATCH=${PPO_MICRO_BATCH:-16}
DPO_MICRO_BATCH=${DPO_MICRO_BATCH:-8}   # pairs; the policy trains next to a frozen reference
PPO_ROLLOUT_FORWARD_BATCH=${PPO_ROLLOUT_FORWARD_BATCH:-64}   # rollout generation and scoring
EVAL_BATCH=${EVAL_BATCH:-8}
PPO_OFFLOAD=${PPO_OFFLOAD:-0}    # 1: the frozen reference and reward model live in CPU memory (6.9b)
TRACK=${TRACK:-0}                # 1: log to wandb as well (WANDB_MODE=offline keeps it local)
# the registry's names (summarize_from_feedback_details/methods.tsv): ppo dpo rloo rloo_k4 grpo online_dpo control
# null_control
ALL_ALGOS=$(method_names)
ALGOS=${ALGOS:-ppo dpo}
[[ $ALGOS == all ]] && ALGOS=$ALL_ALGOS
read -ra algos <<<"$ALGOS"
for algo in ${algos[@]+"${algos[@]}"}; do
    [[ " $ALL_ALGOS " == *" $algo "* ]] || { echo "ALGOS: '$algo' is none of: $ALL_ALGOS (or all)" >&2; exit 2; }
done
# wanted ALGO: whether ALGOS lists it
wanted() { [[ " ${algos[*]+"${algos[*]}"} " == *" $1 "* ]]; }
# The win-rate judge of real runs: OPENAI_API_KEY (with OPENAI_BASE_URL for another
# OpenAI-compatible server) and JUDGE_MODEL (gpt-3.5-turbo-0125, the paper's); none: no win rates.

# --- the embedded default ------------------------------------------------------------------------
RAW_DIR=data/raw                  # synthetic raw files in the upstream schemas
# BASE_MODELS_DIR (above): <prefix>-tiny-{s,m,l}, one shared tokenizer; each size built when first used
# the stage settings (sbatches/tiny_default.sh, sourced above) are shared with the sbatch chain's TINY=1
PPO_UPDATES=${PPO_UPDATES:-$TINY_PPO_UPDATES}  # of 64 rollouts (the paper: 1953 of 512; embedded_default.md: why 15)
DPO_PAIRS=${DPO_PAIRS:-$TINY_DPO_PAIRS}        # DPO's one pass over this many pairs (the reward model takes all)

if [[ $MODEL == "$BASE_MODELS_DIR"/* ]]; then
    TINY=1
    NUM_PROCESSES=1               # one CPU process
    NAME=${NAME:-hello_world$ARCH_SUFFIX}   # models/$NAME/<stage>, runs/${NAME}_<stage>
    DATASET_DIR=data/tldr$ARCH_SUFFIX       # tokenized sft/ and preference/ datasets
else
    TINY=0
    NUM_PROCESSES=$NUM_GPUS
    NAME=${NAME:-hello_world_$(basename "$MODEL")}
    DATASET_DIR=data/$(basename "$MODEL")
    if [[ $DATA_ONLY == 1 ]]; then
        echo "--data builds the embedded default; leave MODEL unset" >&2; exit 2
    fi
    if (( NUM_GPUS < 1 )); then
        echo "MODEL=$MODEL runs the real pipeline, which needs GPUs (none found by nvidia-smi -L or in" \
             "CUDA_VISIBLE_DEVICES; set NUM_GPUS)" >&2; exit 2
    fi
fi
OUT_DIR=models/$NAME
PLOTS_DIR=eval/images/$NAME

make install
PY=.venv/bin/python
if [[ $TINY == 1 ]]; then
    export HF_HUB_OFFLINE=1
fi
# GPUs that nvidia-smi lists but torch cannot see (a CPU build of torch, or a CUDA build newer than
# the driver) would turn a GPU run into a CPU run: the real pipeline stops and says why; the embedded
# default runs on the CPU, saying so
if ! gpu_problem=$($PY -m summarize_from_feedback_details.check_gpu 2>&1); then
    if [[ $TINY == 0 ]]; then
        echo "error: $gpu_problem" >&2
        exit 2
    fi
    echo "warning: $gpu_problem; the embedded default runs on the CPU"
    export ACCELERATE_USE_CPU=1
fi

# The embedded default on a CPU of two cores or more runs two chains side by side, each on half the
# cores: the policy's SFT and DPO beside the reward model's SFT and the reward model; PPO and what
# follows run after both, on all of them. The tiny models' small ops gain less from a second thread
# than from a second job: 100 reward-model updates took 74 s on two threads, 108 s on one, and two
# one-thread runs side by side 109 s (a two-thread run beside a one-thread run: 138 s and 135 s). The
# thread count changes only the order of float sums (the reward loss after those 100 updates:
# 0.633293 on one thread, 0.633277 on two), but that noise grows over a run like a seed's: which
# updates run on how many threads is fixed in advance (REWARD_TAKES_CORES_AT below), never timing's.
# SIDE_BY_SIDE=0, or OMP_NUM_THREADS set (the sweeps' parallel runs, make test): one stage at a time.
SIDE_BY_SIDE=${SIDE_BY_SIDE:-1}
if [[ $TINY == 0 || ($NUM_GPUS -gt 0 && -z ${ACCELERATE_USE_CPU:-}) || -n ${OMP_NUM_THREADS:-} ]] \
        || (($(nproc) < 2)); then
    SIDE_BY_SIDE=0
fi
SIDE_PID=
MARKERS=
# a failed or interrupted run stops the chain beside it too (a background job ignores Ctrl-C): its
# stage, stopped by SIGTERM, writes a checkpoint at the end of its update, which the next run
# resumes, and no stage after it starts; waiting for the chain keeps the rerun from finding that
# folder still in use, and lets the chain log where its stage stopped
stop_side_chain() {
    if [[ -n $SIDE_PID ]]; then
        local stages
        stages=$(pgrep -P "$SIDE_PID" || true)
        if [[ -n $stages ]]; then
            echo "== stopping the stage beside (pid ${stages//$'\n'/, }): it writes a checkpoint first" >&2
        fi
        kill -TERM "$SIDE_PID" $stages 2>/dev/null || true
        wait "$SIDE_PID" 2>/dev/null || true
    fi
    if [[ -n $MARKERS ]]; then rm -rf "$MARKERS"; fi
}
trap stop_side_chain EXIT
# beside UPDATE SIDE_STAGE... -- STAGE...: the SIDE_STAGEs in the background (their output in
# runs/${NAME}_side_by_side.log) and the STAGEs here, each chain on half the cores; the last STAGE
# takes every core at the end of its update UPDATE, waiting there for the side chain to end if it
# has not (TAKE_CORES_AT, infra/cores.py: it watches the side chain's marker file). Returns when both
# chains are done, and fails, showing the side chain's last lines, when either did.
beside() {
    local side=() cores threads log=runs/${NAME}_side_by_side.log stage names hand_off=$1
    cores=$(nproc)
    threads=$((cores / 2))
    shift
    while [[ $1 != -- ]]; do side+=("$1"); shift; done
    shift
    names=${side[*]+"${side[*]}"}
    MARKERS=$(mktemp -d)
    touch "$MARKERS/side"
    mkdir -p runs
    # the last run's log is kept beside (a stopped run's says where its stages stopped)
    if [[ -f $log ]]; then mv "$log" "${log%.log}.previous.log"; fi
    echo "== two chains side by side, each on $threads of $cores cores: ${names//stage_/} in the background" \
         "(output: $log), the stages below here"
    (
        trap 'rm -f "$MARKERS/side"' EXIT
        # stop_side_chain's SIGTERM (its stage gets one of its own): no later stage starts
        stopping=
        trap 'stopping=1' TERM
        export OMP_NUM_THREADS=$threads
        for stage in ${side[@]+"${side[@]}"}; do
            if [[ -n $stopping ]]; then exit 75; fi
            $stage
        done
    ) >"$log" 2>&1 &
    SIDE_PID=$!
    export OMP_NUM_THREADS=$threads
    while (($# > 1)); do $1; shift; done
    TAKE_CORES_AT="$cores $MARKERS/side $hand_off" $1
    unset OMP_NUM_THREADS
    if ! wait "$SIDE_PID"; then
        SIDE_PID=
        tail -n 40 "$log" >&2
        echo "error: the stages beside failed; their output: $log" >&2
        exit 1
    fi
    SIDE_PID=
    rm -rf "$MARKERS"
    MARKERS=
    echo "== beside: done ($log)"
    grep '^== ' "$log" | sed 's/^== /==   /'
}

# run_stage NAME OUTPUT COMMAND...: skipped when OUTPUT exists (each stage writes it last or atomically)
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
# newest_checkpoint DIR: the newest checkpoint in DIR/checkpoints (or nothing)
newest_checkpoint() {
    local found=("$1"/checkpoints/update-*)
    [[ -d ${found[${#found[@]} - 1]} ]] && echo "${found[${#found[@]} - 1]}"
    return 0
}
# run_training STAGE SCRIPT ARGS...: a training stage in a fresh run folder runs/${NAME}_STAGE
# (metrics.jsonl is appended to, so a rerun must not inherit the last run's), or, where an earlier
# run of it was stopped (Ctrl-C, a failure in the other chain) and left a checkpoint in its
# --output_dir, that run resumed in its own run folder (the stage refuses a checkpoint of other
# settings, naming them); --force discards the checkpoint instead. A finished stage's checkpoints
# are deleted, as in the sbatch chain: its model is saved, and they only served to resume
# (KEEP_FINISHED_CHECKPOINTS=1 keeps them).
run_training() {
    local stage=$1 script=summarize_from_feedback_details/$2 own out="" prev="" arg checkpoint resume=() status=0
    shift 2
    for arg in "$@"; do
        [[ $prev != --output_dir ]] || out=$arg
        prev=$arg
    done
    checkpoint=$(newest_checkpoint "$out")
    if [[ -n $checkpoint && $FORCE == 1 ]]; then
        echo "== --force: discarding the checkpoints of an earlier run in $out/checkpoints (newest: ${checkpoint##*/})"
        rm -rf "$out/checkpoints"
    elif [[ -n $checkpoint ]]; then
        echo "== resuming the run stopped at $checkpoint (--force starts over)"
        resume=(--resume)
    fi
    case $stage in
        sft*) own=${SFT_FLAGS:-} ;;
        reward*) own=${REWARD_FLAGS:-} ;;
        ppo*) own=${PPO_FLAGS:-} ;;
        dpo) own=${DPO_FLAGS:-} ;;
        online_dpo) own=${ONLINE_DPO_FLAGS:-} ;;
        *) own=${RLOO_FLAGS:-} ;;
    esac
    local extra=() run_eval=(--run_eval)
    read -ra extra <<<"${EXTRA_FLAGS:-} $own"
    # the reward model's backbone is never sampled from: sampling its validation summaries for a
    # ROUGE no later stage or report reads costs the tiny default 25 s (SFT_FLAGS=--run_eval: it runs)
    if [[ $stage == sft_all_tokens ]]; then run_eval=(); fi
    ((${#resume[@]})) || rm -rf "runs/${NAME}_$stage"
    if [[ $TINY == 1 ]]; then
        $PY "$script" "$@" --run_name "${NAME}_$stage" --seed "$SEED" ${run_eval[@]+"${run_eval[@]}"} \
            ${extra[@]+"${extra[@]}"} ${resume[@]+"${resume[@]}"} || status=$?
    else
        local track=()
        if [[ $TRACK == 1 ]]; then track=(--track); fi
        .venv/bin/accelerate launch --config_file deepspeed.yaml --num_processes "$NUM_GPUS" "$script" "$@" \
            --run_name "${NAME}_$stage" --seed "$SEED" --run_eval --deepspeed ${track[@]+"${track[@]}"} \
            ${extra[@]+"${extra[@]}"} ${resume[@]+"${resume[@]}"} || status=$?
    fi
    if ((status == 75)); then    # (CHECKPOINT_EXIT_CODE: stopped by a signal, its checkpoint written)
        echo "== $stage stopped with a checkpoint in $out/checkpoints: rerun the same command to resume it" >&2
    elif ((status != 0 && ${#resume[@]})); then
        echo "== $stage failed resuming $checkpoint; --force discards that checkpoint and starts over" >&2
    fi
    ((status == 0)) || exit "$status"
    if [[ ${KEEP_FINISHED_CHECKPOINTS:-0} != 1 && -d $out/checkpoints ]]; then
        echo "== $stage finished: deleting its checkpoints in $out/checkpoints"
        rm -rf "$out/checkpoints"
    fi
}
# accumulation BATCH MICRO: the gradient_accumulation_steps that keep the paper's BATCH
accumulation() {
    if (( $1 % ($2 * NUM_GPUS) != 0 )); then
        echo "batch $1 is not a multiple of micro batch $2 x $NUM_GPUS GPUs: change the memory knobs" >&2
        exit 2
    fi
    echo $(($1 / ($2 * NUM_GPUS)))
}
# The critic-free and online-preference methods of ALGOS (the registry's rows with a number of samples): each its
# own run folder, model folder and exp_name (eval/ tells the methods apart by it), its script and flags its row's.
# run_online_methods EPISODES_PER_UPDATE ROLLOUT_QUERIES FLAGS...: every method of ALGOS but ppo and
# dpo with FLAGS (then, on the tiny default, its script's tiny_method_flags), generating
# min(ROLLOUT_QUERIES, the process's queries) queries per chunk
run_online_methods() {
    local episodes=$1 rollout=$2 algo script k own chunk tiny_own
    shift 2
    for algo in $(sampled_method_names); do
        wanted $algo || continue
        read -r script k own <<<"$(method_row $algo)"
        read -ra own <<<"$own"
        tiny_own=()
        if [[ $TINY == 1 ]]; then read -ra tiny_own <<<"$(tiny_method_flags "$script")"; fi
        chunk=$((episodes / NUM_PROCESSES / k))
        ((rollout < chunk)) && chunk=$rollout
        run_stage "$script ($algo)" $OUT_DIR/$algo/model.safetensors \
            run_training $algo $script --base_model "$MODEL" --sft_model_path $OUT_DIR/sft \
                --reward_model_path $OUT_DIR/reward_model --query_dataset $DATASET_DIR/sft \
                --output_dir $OUT_DIR/$algo --local_rollout_forward_batch_size $chunk \
                ${own[@]+"${own[@]}"} "$@" ${tiny_own[@]+"${tiny_own[@]}"}
    done
}

if [[ $TINY == 1 ]]; then
    if [[ -e $RAW_DIR && $FORCE == 0 ]]; then  # data of an earlier default is named, not silently kept
        $PY -c 'import sys; from summarize_from_feedback_details import synthetic_tldr as s; s.check_recorded_args(sys.argv[1:])' \
            --output_dir $RAW_DIR "${TINY_DATA_FLAGS[@]}" || exit 2
    fi
    run_stage "synthetic TL;DR data" $RAW_DIR \
        $PY -m summarize_from_feedback_details.synthetic_tldr --output_dir $RAW_DIR "${TINY_DATA_FLAGS[@]}"
    # the size MODEL names; with --data every size (what scaling.sh and the sbatch chain read) or those
    # SIZES lists (compare.sh: the sizes it compares). All sizes share one tokenizer; a size built before
    # is kept (tiny_models.build). The base models also read the first BASE_PRETRAIN_POSTS (the
    # architecture's) of the posts that end in their author's TL;DR, as real base models have: tiny-l then
    # copies every fact of a post into a summary before fine-tuning, tiny-m at 3 tokens per parameter not
    # the feeling and the duration (the size effect of docs/scaling.md).
    sizes=("${MODEL##*/$TINY_PREFIX-tiny-}")
    if [[ $DATA_ONLY == 1 ]]; then read -ra sizes <<<"${SIZES:-s m l}"; fi
    # BASE_COPY_CHECK (the architecture's): the facts its base must copy from a post, or it is pretrained
    # again from the next seed (tiny_models --copy_check)
    copy_check=()
    if [[ -n $BASE_COPY_CHECK ]]; then read -ra copy_check <<<"--copy_check $BASE_COPY_CHECK"; fi
    for size in ${sizes[@]+"${sizes[@]}"}; do
        run_stage "tiny base model $TINY_PREFIX-tiny-$size" $BASE_MODELS_DIR/$TINY_PREFIX-tiny-$size \
            $PY -m summarize_from_feedback_details.tiny_models --corpus $RAW_DIR/tldr_sft/train.jsonl \
                --extra_corpus $RAW_DIR/pretrain/train.jsonl --extra_corpus_rows "$BASE_PRETRAIN_POSTS" \
                --output_dir $BASE_MODELS_DIR --sizes "$size" \
                --seed 1 --arch "$ARCH" --pretrain_tokens_per_parameter "$BASE_BUDGET" ${copy_check[@]+"${copy_check[@]}"}
    done
    run_stage "tldr_dataset.py" $DATASET_DIR \
        $PY summarize_from_feedback_details/tldr_dataset.py --base_model "$MODEL" \
            --sft_dataset $RAW_DIR/tldr_sft --preference_dataset $RAW_DIR/comparisons \
            --output_dir $DATASET_DIR --overwrite --num_proc "$(nproc)" "${TINY_LENGTHS[@]}"
    if [[ $DATA_ONLY == 1 ]]; then
        exit 0
    fi
    # Two SFT runs of one epoch over the 6000 SFT rows at batch 32 (tiny models learn at a much
    # higher lr than the paper's 3e-6 for Pythia):
    # - the paper's SFT, loss over every token (posts included): the reward model's backbone.
    #   Having modelled the posts, it catches wrong facts a little more often (reference preferred
    #   over a one-wrong-fact summary 0.57 vs 0.53; PPO's gold win rate 0.253 vs 0.228 from the other);
    # - the policy's SFT, loss over the summary only: a tiny model then spends its capacity on
    #   copying the post's facts (ROUGE-L 0.55 vs 0.47, gold-judge score 2.7 vs 0.4).
    TINY_SFT=(--base_model "$MODEL" --query_dataset $DATASET_DIR/sft "${TINY_SFT_FLAGS[@]}"
              --local_micro_batch_size "$TINY_SFT_BATCH" --gradient_accumulation_steps 1)
    stage_sft_all_tokens() {
        run_stage "sft.py (all tokens: the reward model's backbone)" $OUT_DIR/sft_all_tokens/model.safetensors \
            run_training sft_all_tokens sft.py "${TINY_SFT[@]}" --exp_name sft_all_tokens --output_dir $OUT_DIR/sft_all_tokens
    }
    stage_sft_policy() {
        run_stage "sft.py (summary tokens: the policy)" $OUT_DIR/sft/model.safetensors \
            run_training sft sft.py "${TINY_SFT[@]}" --response_only_loss --output_dir $OUT_DIR/sft
    }
    # Several epochs of the preference pairs at batch 32: with two, the reward model checks the problem and
    # not the relation, the feeling or the duration, even where the pairs swap them (docs/embedded_default.md,
    # "The reward model checks the facts"); with one, one reward model in three that make compare
    # trained let PPO state wrong optional facts. The epochs and the learning rate are TINY_RM_EPOCHS and
    # TINY_RM_LR (eight at 3e-4, every architecture alike; sbatches/tiny_default.sh says why). Adam's epsilon is torch's 1e-8, not the
    # paper's 1e-5: a tiny model's last-layer gradients are near 1e-5 (tiny-l's median sqrt(v) 1.3e-5
    # to 1.7e-5), so 1e-5 would halve the larger sizes' steps and undo the scaling (docs/scaling.md,
    # "What sets the reward model's accuracy"); Pythia runs keep the paper's 1e-5.
    RM_ARGS=(--base_model "$MODEL" --sft_model_path $OUT_DIR/sft_all_tokens --label_dataset $DATASET_DIR/preference
             --query_dataset $DATASET_DIR/sft "${TINY_RM_FLAGS[@]}" --lr "$TINY_RM_LR" --num_train_epochs "$TINY_RM_EPOCHS"
             --local_micro_batch_size "$TINY_RM_BATCH" --gradient_accumulation_steps 1)
    stage_reward() {
        run_stage "reward.py" $OUT_DIR/reward_model/model.safetensors \
            run_training reward reward.py "${RM_ARGS[@]}" --output_dir $OUT_DIR/reward_model
    }
    # DPO from PPO's SFT on the reward model's pairs: one epoch at batch 32, the paper's beta 0.05.
    # Learning rates 3e-4 and 1e-3 raise the implicit-reward accuracy but lower the gold-judge win
    # rate (1e-3: 0.07, below SFT); 1e-4 beat SFT.
    stage_dpo() {
        ! wanted dpo || run_stage "dpo.py" $OUT_DIR/dpo/model.safetensors \
            run_training dpo dpo.py --base_model "$MODEL" --sft_model_path $OUT_DIR/sft \
                --label_dataset $DATASET_DIR/preference --query_dataset $DATASET_DIR/sft \
                --output_dir $OUT_DIR/dpo "${TINY_DPO_FLAGS[@]}" --local_micro_batch_size "$TINY_DPO_BATCH" \
                --gradient_accumulation_steps 1 --total_episodes "$DPO_PAIRS"
    }
    # PPO_UPDATES updates of 64 rollouts, otherwise the paper's settings. The longest reference
    # summary of the tiny default is 24 tokens, hence 32 new tokens instead of 53.
    PPO_BUDGET=(--total_episodes $((PPO_UPDATES * TINY_PPO_BATCH)) --local_micro_batch_size "$TINY_PPO_MICRO_BATCH"
                --gradient_accumulation_steps $((TINY_PPO_BATCH / TINY_PPO_MICRO_BATCH)) "${TINY_PPO_FLAGS[@]}")
    PPO_ARGS=(--base_model "$MODEL" --sft_model_path $OUT_DIR/sft --query_dataset $DATASET_DIR/sft
              --local_rollout_forward_batch_size "$TINY_PPO_BATCH" "${PPO_BUDGET[@]}")
    stage_ppo() {
        ! wanted ppo || run_stage "ppo_left_padding.py" $OUT_DIR/ppo/model.safetensors \
            run_training ppo ppo_left_padding.py "${PPO_ARGS[@]}" --reward_model_path $OUT_DIR/reward_model \
                --output_dir $OUT_DIR/ppo
    }
    # Side by side, the reward model takes the policy chain's core at the end of its update
    # REWARD_TAKES_CORES_AT, waiting there if the policy's SFT and DPO still run: an update fixed in
    # advance, so that a rerun prints the same table to the digit. About where that chain ends: after
    # two reward-model updates per DPO update (on two cores the Qwen3-style reward model had done 416
    # when the 187 of DPO ended; GPT-NeoX's reached 375 first and waited); without DPO, at its start.
    REWARD_TAKES_CORES_AT=0
    if wanted dpo; then REWARD_TAKES_CORES_AT=$((2 * DPO_PAIRS / TINY_DPO_BATCH)); fi
    if [[ $SIDE_BY_SIDE == 1 ]]; then
        side=(stage_sft_policy)
        ! wanted dpo || side+=(stage_dpo)
        beside "$REWARD_TAKES_CORES_AT" ${side[@]+"${side[@]}"} -- stage_sft_all_tokens stage_reward
        stage_ppo
    else
        stage_sft_all_tokens
        stage_sft_policy
        stage_reward
        stage_ppo
        stage_dpo
    fi
    # RLOO, GRPO and online DPO at PPO's budget: PPO_UPDATES updates of 64 episodes (a query with its
    # k samples: 32 queries x 2 or 16 x 4), PPO's lr, lengths and micro batches.
    run_online_methods "$TINY_PPO_BATCH" "$TINY_PPO_BATCH" "${PPO_BUDGET[@]}"
else
    # The paper's pipeline: hub data tokenized for MODEL with the paper's lengths, one SFT (loss
    # over every token) that is both the policy and the reward model's backbone, lr 3e-6 everywhere.
    SFT_ACCUMULATION=$(accumulation 128 "$SFT_MICRO_BATCH")
    RM_ACCUMULATION=$(accumulation 64 "$RM_MICRO_BATCH")
    PPO_ACCUMULATION=$(accumulation 512 "$PPO_MICRO_BATCH")
    DPO_ACCUMULATION=$(accumulation 64 "$DPO_MICRO_BATCH")
    run_stage "tldr_dataset.py" $DATASET_DIR \
        $PY summarize_from_feedback_details/tldr_dataset.py --base_model "$MODEL" --output_dir "$DATASET_DIR" \
            --num_proc "$(nproc)"
    run_stage "sft.py" $OUT_DIR/sft/model.safetensors \
        run_training sft sft.py --base_model "$MODEL" --query_dataset "$DATASET_DIR/sft" \
            --output_dir $OUT_DIR/sft --local_micro_batch_size "$SFT_MICRO_BATCH" \
            --gradient_accumulation_steps "$SFT_ACCUMULATION" \
            --local_eval_batch_size "$EVAL_BATCH"
    RM_ARGS=(--base_model "$MODEL" --sft_model_path $OUT_DIR/sft --label_dataset "$DATASET_DIR/preference"
             --query_dataset "$DATASET_DIR/sft" --local_micro_batch_size "$RM_MICRO_BATCH"
             --gradient_accumulation_steps "$RM_ACCUMULATION" --local_eval_batch_size "$EVAL_BATCH")
    run_stage "reward.py" $OUT_DIR/reward_model/model.safetensors \
        run_training reward reward.py "${RM_ARGS[@]}" --output_dir $OUT_DIR/reward_model
    ppo_offload=()
    if [[ $PPO_OFFLOAD == 1 ]]; then ppo_offload=(--offload); fi
    PPO_ARGS=(--base_model "$MODEL" --sft_model_path $OUT_DIR/sft --query_dataset "$DATASET_DIR/sft"
              --local_micro_batch_size "$PPO_MICRO_BATCH" --gradient_accumulation_steps "$PPO_ACCUMULATION"
              --local_rollout_forward_batch_size "$PPO_ROLLOUT_FORWARD_BATCH" --local_eval_batch_size "$EVAL_BATCH"
              ${ppo_offload[@]+"${ppo_offload[@]}"})
    ! wanted ppo || run_stage "ppo_left_padding.py" $OUT_DIR/ppo/model.safetensors \
        run_training ppo ppo_left_padding.py "${PPO_ARGS[@]}" --reward_model_path $OUT_DIR/reward_model \
            --output_dir $OUT_DIR/ppo
    ! wanted dpo || run_stage "dpo.py" $OUT_DIR/dpo/model.safetensors \
        run_training dpo dpo.py --base_model "$MODEL" --sft_model_path $OUT_DIR/sft \
            --label_dataset "$DATASET_DIR/preference" --query_dataset "$DATASET_DIR/sft" \
            --output_dir $OUT_DIR/dpo --local_micro_batch_size "$DPO_MICRO_BATCH" \
            --gradient_accumulation_steps "$DPO_ACCUMULATION" --local_eval_batch_size "$EVAL_BATCH" \
            ${ppo_offload[@]+"${ppo_offload[@]}"}
    # RLOO, GRPO and online DPO with the paper's settings at PPO's batch of 512 episodes and PPO's
    # memory knobs (no critic: they need less); online DPO's micro batch holds a chosen and a
    # rejected sample, so it is even
    ONLINE_MICRO_BATCH=$((PPO_MICRO_BATCH + PPO_MICRO_BATCH % 2))
    ONLINE_ACCUMULATION=$(accumulation 512 "$ONLINE_MICRO_BATCH")
    run_online_methods 512 "$PPO_ROLLOUT_FORWARD_BATCH" --local_micro_batch_size "$ONLINE_MICRO_BATCH" \
        --gradient_accumulation_steps "$ONLINE_ACCUMULATION" \
        --local_eval_batch_size "$EVAL_BATCH" ${ppo_offload[@]+"${ppo_offload[@]}"}
fi
# The negative control: the same PPO against a reward model that knows nothing (the reward model's
# backbone under its seeded random head, no training, normalised as usual). It must not beat SFT.
if wanted control; then
    run_stage "reward.py (control: no training)" $OUT_DIR/reward_model_control/model.safetensors \
        run_training reward_control reward.py "${RM_ARGS[@]}" --total_episodes 0 --exp_name reward_control \
            --output_dir $OUT_DIR/reward_model_control
    run_stage "ppo_left_padding.py (control)" $OUT_DIR/ppo_control/model.safetensors \
        run_training ppo_control ppo_left_padding.py "${PPO_ARGS[@]}" \
            --reward_model_path $OUT_DIR/reward_model_control --exp_name ppo_control --output_dir $OUT_DIR/ppo_control
fi
# The null control: the same PPO against the trained reward model with its information withheld (each update's
# scores dealt to its responses at random, the critic's values held at 0; the registry's flags). A random head is
# still a reward, one that can favour what the gold judge favours (docs/compare.md); this one carries nothing.
if wanted null_control; then
    read -r _ _ null_flags <<<"$(method_row null_control)"
    read -ra null_flags <<<"$null_flags"
    run_stage "ppo_left_padding.py (null control)" $OUT_DIR/ppo_null_control/model.safetensors \
        run_training ppo_null_control ppo_left_padding.py "${PPO_ARGS[@]}" \
            --reward_model_path $OUT_DIR/reward_model ${null_flags[@]+"${null_flags[@]}"} --output_dir $OUT_DIR/ppo_null_control
fi

# The eval plots (eval/, reruns in seconds, so never skipped): SFT ROUGE-L and RM accuracy vs model
# size, win rate against the reference summaries vs model size and response length. One model and
# one seed give single points; eval/ on more runs fills the plots in.
echo "== eval/ plots"
$PY eval/sft_rm_scale.py --run_glob "${NAME}_*" --out "$PLOTS_DIR"
if [[ $TINY == 1 ]]; then
    $PY eval/rlhf_scaling_plot.py --run_glob "${NAME}_*" --judge gold --out "$PLOTS_DIR"
elif [[ -n ${OPENAI_API_KEY:-} ]]; then
    # the paper's judge; any OpenAI-compatible server through OPENAI_BASE_URL
    $PY eval/rlhf_scaling_plot.py --run_glob "${NAME}_*" --judge chat --chat.model "${JUDGE_MODEL:-gpt-3.5-turbo-0125}" \
        --out "$PLOTS_DIR"
else
    echo "no win-rate plot: the gold judge exists only for the synthetic data; set OPENAI_API_KEY (and" \
         "OPENAI_BASE_URL, JUDGE_MODEL) for the chat judge"
fi

echo
if [[ $TINY == 1 ]]; then
    echo "datasets: $DATASET_DIR/sft, $DATASET_DIR/preference (plots in $DATASET_DIR/dataset_visuals)"
    echo "label statistics of the synthetic data: $RAW_DIR/label_stats.json"
fi
gold_judge=()
if [[ $TINY == 0 ]]; then gold_judge=(--no_gold_judge); fi
$PY -m summarize_from_feedback_details.hello_world_report --runs_dir runs --prefix "${NAME}_" \
    --models_dir $OUT_DIR --plots_dir "$PLOTS_DIR" ${gold_judge[@]+"${gold_judge[@]}"}
