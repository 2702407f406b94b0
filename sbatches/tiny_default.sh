# shellcheck shell=bash disable=SC2034  # sourced: hello_world.sh and sbatches/common.sh read it
# The embedded default's stage settings, in one place: ./hello_world.sh on the tiny models and the
# sbatch chain with TINY=1 (what scaling.sh submits to a cluster) both read them, so the two run the
# same stages with the same hyperparameters by construction. Batches are global (over all
# processes): hello_world.sh runs one process, the sbatch files split a batch over the nodes'
# processes. Why each value: the comments at hello_world.sh's stages and docs/embedded_default.md.

# the synthetic data (synthetic_tldr.py, seed 1): 18,000 pretraining posts for the base models (each
# architecture's base reads the first BASE_PRETRAIN_POSTS of them, below), and
# preference pairs of which 60% are minimal pairs, 60% of those a summary against itself with the relation,
# the problem or the feeling swapped, so that the reward model checks those facts against the post
# (docs/embedded_default.md, "The reward model checks the facts"). The relation is named twice, so half
# of the swaps are of the relation: with it named once, GPT-NeoX's reward model on a 2-core Xeon (family 6,
# model 207) checked the relation in 0.611 of the swaps (seed 1; 0.613 and 0.677 on seeds 2 and 3), named
# twice 0.955, 0.885 and 0.949 (docs/real_pipeline.md, "The relation's share of the swapped pairs")
TINY_DATA_FLAGS=(--seed 1 --num_pretrain_posts 18000 --minimal_pair_fraction 0.6 --fact_swap_fraction 0.6
                 --fact_swap_slots relation relation problem feeling)
# the tokenized datasets' lengths (tldr_dataset.py; the paper: 512 / 53 / 562 / 169 / 638 and 1919 / 155 /
# 2021): queries short enough for tiny models on a CPU, some synthetic posts long enough to need smart
# truncation. hello_world.sh's data stage passes them; tests/conftest.py reads them for the tests' datasets
TINY_LENGTHS=(
    --tldr_params.length 160
    --tldr_params.max_sft_response_length 32
    --tldr_params.max_sft_query_response_length 192
    --tldr_params.max_rm_response_length 80
    --tldr_params.max_rm_query_response_length 240
    --cnndm_params.length 320
    --cnndm_params.max_rm_response_length 96
    --cnndm_params.max_rm_query_response_length 416
)
# two SFT runs (all tokens: the reward model's backbone; summary tokens: the policy), one epoch of
# the 6,000 SFT rows each
TINY_SFT_BATCH=32
TINY_SFT_FLAGS=(--lr 3e-3 --response_length 32 --local_eval_batch_size 100)
# the reward model: TINY_RM_EPOCHS epochs of the preference pairs at TINY_RM_LR, every architecture
# alike, from the all-tokens SFT, Adam's epsilon 1e-8
# TINY_RM_LR, the reward model's learning rate: at 1e-3 the Qwen3-style reward model reached 0.657 and 0.700
# validation accuracy over two seeds, at 3e-4 0.725-0.732 over three, and ./hello_world.sh's PPO gained
# +0.536 over SFT instead of +0.083 (docs/real_pipeline.md, "The RMSNorm reward models' learning rate").
# TINY_RM_EPOCHS: the Llama-style reward model's eight at 3e-4: at four epochs and 1e-3 it checked the
# relation in 0.521 and 0.785 of the swaps over two seeds, at four and 3e-4 it checked the relation and
# not the problem and its PPO gained -0.020, at eight and 3e-4 it checked the relation in 0.979-0.980
# (there, "Eight reward-model epochs"). The Qwen3-style one too since 2026-12-07: on the pairs that swap
# the relation in half of the fact swaps, at four epochs it checked the relation in 0.542 of the swaps and
# PPO gained +0.691, at eight 0.961 and +0.781 (there, "The relation's share of the swapped pairs"; on the
# pairs before, at eight its PPO gained +0.144 where four gave +0.536, one draw).
TINY_RM_LR=3e-4
TINY_RM_EPOCHS=8
TINY_RM_BATCH=32
TINY_RM_FLAGS=(--eps 1e-8 --local_eval_batch_size 100)
# PPO: TINY_PPO_UPDATES updates of TINY_PPO_BATCH rollouts in micro-batches of TINY_PPO_MICRO_BATCH;
# RLOO, GRPO and online DPO run at the same budget with the same flags (episodes = queries x samples), then theirs
TINY_PPO_BATCH=64
TINY_PPO_MICRO_BATCH=16
TINY_PPO_UPDATES=15
TINY_PPO_FLAGS=(--lr 1e-4 --response_length 32 --local_eval_batch_size 16 --print_sample_output_freq 10)
# the critic-free methods' optimizer steps per batch, after TINY_PPO_FLAGS (a later flag wins): RLOO and GRPO
# (rloo.py) two epochs over each batch, each step against PPO's clipped ratio; online DPO, which has no epochs,
# twice PPO's lr. At rloo.py's one step and lr 1e-4 they took a quarter of PPO's four steps per batch, and on
# the Qwen3-style candidate base over seeds 1-3 only RLOO k=2 beat SFT (+0.122 [0.050, 0.194]); at two, all
# four did, and each gained more than at one on every seed and architecture measured (docs/compare.md, "The
# critic-free methods' optimizer steps per batch")
TINY_RLOO_FLAGS=(--noptepochs 2)
TINY_ONLINE_DPO_FLAGS=(--lr 2e-4)
# tiny_method_flags SCRIPT: the flags above of a sampled method's script (none for another script)
tiny_method_flags() {
    case $1 in
        rloo.py) echo "${TINY_RLOO_FLAGS[*]}" ;;
        online_dpo.py) echo "${TINY_ONLINE_DPO_FLAGS[*]}" ;;
    esac
}
# DPO: one pass over TINY_DPO_PAIRS of the preference pairs
TINY_DPO_BATCH=32
TINY_DPO_PAIRS=6000
TINY_DPO_FLAGS=(--lr 1e-4 --response_length 32 --local_eval_batch_size 100)

# tiny_arch_settings ARCH: the embedded default's settings that differ by architecture (tiny_models.py
# --arch): TINY_PREFIX (its base models are $BASE_MODELS_DIR/$TINY_PREFIX-tiny-<size>), BASE_MODELS_DIR,
# ARCH_SUFFIX (empty for GPT-NeoX, the paper's, else _<arch>: what its runs', models' and datasets' names
# end in), BASE_BUDGET, BASE_PRETRAIN_POSTS and BASE_COPY_CHECK.
# BASE_BUDGET, the base model's pretraining in tokens per parameter: at 3, the policy's SFT
# on a Llama-style tiny-m named the post's relation right in 0.09 / 0.97 / 0.16 / 0.10 of its summaries
# over base seeds 1-4 (GPT-NeoX: 1.00), a Qwen3-style one in 0.33 / 1.00 / 1.00 / 0.56; at 6, Llama
# 0.30 / 1.00 / 1.00 / 1.00 and Qwen3 1.00 on all four; at 12, Llama 1.00 on all four
# (docs/real_pipeline.md, "What makes the tiny Llama- and Qwen3-style bases copy the facts").
# GPT-NeoX takes Llama's recipe whole (12 tokens per parameter, eight epochs at 3e-4) since 2026-12-05:
# over seeds 1-3 its reward model then checked the relation in 0.930 / 0.885 / 0.855 of the swaps and PPO
# gained +1.548 [1.076, 2.019] over SFT; at 3 tokens and four epochs at 1e-3, 0.641 / 0.527 / 0.956 and
# +0.795 [0.428, 1.163]; the budget or the epochs alone fell short of one or the other (there, "GPT-NeoX's
# pretraining budget and its reward model's relation check").
# BASE_PRETRAIN_POSTS: how many of the data's pretraining posts (each ending in a TL;DR that states every
# fact) the base reads besides the SFT posts (tiny_models --extra_corpus_rows). GPT-NeoX and Qwen3-style:
# 6,000, their bases of before to the byte. Llama-style: 18,000, with which its seed-1 base copies the
# duration and the feeling (0.959 / 0.959 of the swaps), which no Llama-style base of 6,000 measured does
# (docs/real_pipeline.md, "A base that copies the duration").
# BASE_COPY_CHECK: the facts of a post the base must copy before it is kept (tiny_models --copy_check:
# else it is pretrained again from the next seed); empty: the base of seed 1. Whether a Llama-style base
# copies the feeling or the duration is a draw of its seed (GPT-NeoX's copies the feeling on seeds 1-3
# and the duration on seed 1, all measured), and a PPO whose base cannot copy one states a random value
# when it learns to state it (docs/real_pipeline.md, "The copy check").
# An unknown ARCH: a message on stderr and status 2.
tiny_arch_settings() {
    case $1 in
        gpt_neox) TINY_PREFIX=pythia BASE_MODELS_DIR=models/tiny ARCH_SUFFIX= BASE_BUDGET=12
                  BASE_PRETRAIN_POSTS=6000 BASE_COPY_CHECK= ;;
        llama) TINY_PREFIX=llama BASE_MODELS_DIR=models/tiny_llama ARCH_SUFFIX=_llama BASE_BUDGET=12
               BASE_PRETRAIN_POSTS=18000 BASE_COPY_CHECK="feeling duration" ;;
        qwen3) TINY_PREFIX=qwen3 BASE_MODELS_DIR=models/tiny_qwen3 ARCH_SUFFIX=_qwen3 BASE_BUDGET=6
               BASE_PRETRAIN_POSTS=6000 BASE_COPY_CHECK= ;;
        *) echo "ARCH: '$1' is none of: gpt_neox llama qwen3" >&2; return 2 ;;
    esac
}
