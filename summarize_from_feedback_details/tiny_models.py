"""Tiny base models for the offline default: a byte-level BPE tokenizer trained on the synthetic
TL;DR corpus and GPT-NeoX (Pythia architecture) models at a few sizes, each briefly pretrained as a
causal LM on raw posts with a budget that grows with its size (tokens proportional to parameters),
so that a larger size is a better base model, as with Pythia. Every model folder loads offline with
plain `AutoTokenizer` / `AutoModelForCausalLM`, no trust_remote_code.

Like Pythia, `<|endoftext|>` is id 0 and is both BOS and EOS; unlike Pythia (whose pad token the
stage scripts add as `[PAD]`), the tokenizer ships a dedicated `[PAD]` token, never equal to EOS.

`--arch` builds the same sizes in the architectures researchers start from today, each with its
tokenizer's conventions (the stages must take tokenizers as they come):
- `llama` (Llama 3.2): RMSNorm, SwiGLU, grouped-query attention, tied embeddings; the tokenizer
  prepends `<|begin_of_text|>` to every encode, ends with `<|end_of_text|>` and has no pad token
  (the stages add `[PAD]`, one embedding row);
- `qwen3` (Qwen3): llama's layout plus QK-norm; the tokenizer pads with its EOS `<|endoftext|>`
  and has no BOS, and the embedding has spare rows beyond the vocabulary, as Qwen's has (the
  `[PAD]` the stages add fits in them).

    python -m summarize_from_feedback_details.tiny_models --corpus data/raw/tldr_sft/train.jsonl --output_dir models/tiny
    python -m summarize_from_feedback_details.tiny_models --arch llama --output_dir models/tiny_llama
"""

import hashlib
import json
import math
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import pandas as pd
import torch
import tyro
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

from summarize_from_feedback_details.evaluation import fact_copy_row, fact_swap_pairs
from summarize_from_feedback_details.gold_judge import FACT_SWAP_SLOTS
from summarize_from_feedback_details.infra.launch import quiet_libraries
from summarize_from_feedback_details.infra.tracking import progress
from summarize_from_feedback_details.synthetic_tldr import atomic_output_dir
from summarize_from_feedback_details.tldr_dataset import TldrParams

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "[PAD]"
LLAMA_BOS, LLAMA_EOS = "<|begin_of_text|>", "<|end_of_text|>"
# the model folders' prefix per architecture: <prefix>-tiny-<size>
FOLDER_PREFIX = {"gpt_neox": "pythia", "llama": "llama", "qwen3": "qwen3"}

# name -> (hidden_size, num_hidden_layers, num_attention_heads); intermediate = 4 * hidden (Pythia)
SIZES = {
    "s": (64, 2, 4),
    "m": (128, 2, 4),
    "l": (192, 3, 6),
}


@dataclass
class Args:
    corpus: str = "data/raw/tldr_sft/train.jsonl"
    """JSONL rows with `title`, `post` and `summary` (the SFT schema): the text the tokenizer and
    the pretraining see"""
    output_dir: str = "models/tiny"
    """receives `pythia-tiny-<size>/` folders (model + tokenizer; `llama-tiny-<size>/`, `qwen3-tiny-<size>/`
    with --arch); replaced as a whole"""
    arch: Literal["gpt_neox", "llama", "qwen3"] = "gpt_neox"
    """the architecture and its tokenizer's conventions (module docstring): gpt_neox (Pythia), llama
    (Llama 3.2-style), qwen3 (Qwen3-style)"""
    sizes: list = field(default_factory=lambda: list(SIZES))
    """which of the sizes in SIZES to build"""
    vocab_size: int = 1024
    """size of the BPE vocabulary trained on the corpus, its special tokens ([PAD], EOS) included"""
    seed: int = 1
    """seed of every model's initialisation and of the pretraining batches"""
    pretrain_tokens_per_parameter: float = 3.0
    """the pretraining budget of each size: this many tokens per parameter (Chinchilla-style budgets
    grow with size; 20 would be compute-optimal, far beyond a CPU minute). With one budget for all,
    the larger sizes were no better than tiny-m; at 1.5 with the --extra_corpus of TL;DR posts,
    tiny-m's SFT lost the relation (docs/scaling.md)"""
    pretrain_steps: Optional[int] = None
    """the same number of causal-LM steps for every size instead (0: random init); None: the budget
    of pretrain_tokens_per_parameter"""
    extra_corpus: Optional[str] = None
    """more rows in --corpus's schema that the tokenizer and the pretraining read after --corpus's
    (synthetic_tldr --num_pretrain_posts writes pretrain/train.jsonl: posts that end in a TL;DR)"""
    extra_corpus_rows: Optional[int] = None
    """read only the first this many rows of --extra_corpus (None: all). synthetic_tldr's pretraining posts
    are one random stream, so the first N of a longer file are the file of N: one data folder serves
    architectures whose bases read different amounts of it (sbatches/tiny_default.sh, BASE_PRETRAIN_POSTS)"""
    heldout_corpus: Optional[str] = None
    """posts the pretraining never sees, for each model's held-out loss in models.json; None:
    `validation.jsonl` next to --corpus (skipped when there is none)"""
    pretrain_batch_size: int = 16
    """token windows per pretraining step"""
    pretrain_seq_len: int = 128
    """tokens per window, in the pretraining and in the held-out loss"""
    pretrain_lr: float = 3e-3
    """AdamW learning rate of the pretraining, cosine-decayed to 0 over its steps"""
    copy_check: list = field(default_factory=list)
    """slots of the synthetic task (gold_judge.FACT_SWAP_SLOTS: relation problem ask duration feeling)
    a base must copy from a post, as a hub base does, before it is kept: on the held-out posts, it must
    find their TL;DR likelier than the TL;DR with that fact swapped (eval/fact_copy.py's pairs) in
    copy_check_min of them, or it is pretrained again from the next seed (seed + 1, ...). Whether a tiny
    Llama-style base copies the feeling is a draw of its seed (2 of 7; docs/real_pipeline.md). Empty: no
    check, the base of --seed"""
    copy_check_min: float = 0.9
    """the share of a checked slot's swaps a base must get right: of the Llama-style bases, those blind to
    the feeling sat at 0.44-0.63 on eval/fact_copy.py's pairs, those that copy it at 0.94-1.00"""
    copy_check_seeds: int = 8
    """how many seeds, from --seed on, a size may try; when none copies, the closest is kept, with a
    warning (models.json records every seed's scores)"""


def corpus_texts(*paths: str, last_rows: Optional[int] = None) -> list:
    """Every post (title and body) of the JSONL files `paths`, then every summary (with its leading space);
    of the last file only its first `last_rows` rows (None: all)."""
    rows = []
    for i, path in enumerate(paths):
        with open(path) as f:
            read = [json.loads(line) for line in f if line.strip()]
        if i == len(paths) - 1 and last_rows is not None:
            if not 0 < last_rows <= len(read):
                raise ValueError(f"{path} has {len(read)} rows: cannot read the first {last_rows}")
            read = read[:last_rows]
        rows += read
    return [f"{r['title']}\n\n{r['post']}" for r in rows] + [" " + r["summary"] for r in rows]


def train_tokenizer(texts: list, vocab_size: int, arch: str = "gpt_neox") -> PreTrainedTokenizerFast:
    """A byte-level BPE of `vocab_size` tokens (special tokens included) with `arch`'s conventions:
    Pythia's (EOS id 0 also the BOS, a dedicated [PAD] id 1), Llama 3's (BOS id 0 prepended to every
    encode, EOS id 1, no pad token) or Qwen's (EOS id 0, which is also the pad token; no BOS)."""
    special = {"gpt_neox": [EOS_TOKEN, PAD_TOKEN], "llama": [LLAMA_BOS, LLAMA_EOS], "qwen3": [EOS_TOKEN]}[arch]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,  # ids 0, 1, ...
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if arch == "llama":
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{LLAMA_BOS} $A", pair=f"{LLAMA_BOS} $A {LLAMA_BOS} $B", special_tokens=[(LLAMA_BOS, 0)])
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=LLAMA_BOS, eos_token=LLAMA_EOS,
                                       model_max_length=2048)
    if arch == "qwen3":
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                       model_max_length=2048)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=2048,
    )


def model_config(size: str, vocab_size: int, tokenizer: PreTrainedTokenizerFast, arch: str = "gpt_neox"):
    hidden, layers, heads = SIZES[size]
    if arch != "gpt_neox":
        # Llama 3.2's layout: SwiGLU of about 8/3 the width (a multiple of 8), half as many key/value
        # heads as query heads, tied input and output embeddings; Qwen3 adds RMSNorm on queries and keys
        layout = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads // 2, intermediate_size=8 * math.ceil(hidden * 8 / 3 / 8),
                      max_position_embeddings=2048, tie_word_embeddings=True, attention_bias=False,
                      attention_dropout=0.0, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        # RoPE bases of the released models (Llama 3.2: 500,000, Qwen3: 1,000,000; transformers' config
        # default is 10,000): with 10,000 the Llama-style tiny-m's SFT loss ended at 1.02, with 500,000 at
        # 0.93 (docs/real_pipeline.md)
        if arch == "llama":
            return LlamaConfig(rms_norm_eps=1e-5, mlp_bias=False,
                               rope_parameters=dict(rope_type="default", rope_theta=500_000.0), **layout)
        # Qwen's embedding has rows beyond its vocabulary (151,936 for 151,665 tokens): a multiple of 64
        # past it, so that the [PAD] the stages add needs no new row
        layout["vocab_size"] = 64 * math.ceil((vocab_size + 1) / 64)
        return Qwen3Config(rms_norm_eps=1e-6, head_dim=hidden // heads, use_sliding_window=False,
                           rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0), **layout)
    return GPTNeoXConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=2048,
        rotary_pct=0.25,
        use_parallel_residual=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        # the pad id of the model config stays unset, like Pythia's: padding is the stage scripts' job
    )


def pretrain_steps(parameters: int, args: Args) -> int:
    """Causal-LM steps of a model with `parameters` parameters (batches of batch_size x seq_len tokens)."""
    if args.pretrain_steps is not None:
        return args.pretrain_steps
    return math.ceil(args.pretrain_tokens_per_parameter * parameters / (args.pretrain_batch_size * args.pretrain_seq_len))


def pretrain(model, token_stream: np.ndarray, steps: int, args: Args, name: str, seed: int):
    """Plain causal-LM training on random windows of the concatenated, EOS-separated posts."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.pretrain_lr, eps=1e-5, weight_decay=0.01)
    stream = torch.from_numpy(token_stream)
    last = {}  # the newest batch loss, for the progress display
    model.train()
    for step in progress(range(steps), steps, f"pretrain {name}", status=lambda: f"loss {last['loss']:.3f}"):
        lr = args.pretrain_lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(stream) - args.pretrain_seq_len, (args.pretrain_batch_size,), generator=generator)
        batch = torch.stack([stream[s : s + args.pretrain_seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        last["loss"] = loss.item()
    model.eval()
    return loss.item()


def post_stream(texts: list, tokenizer: PreTrainedTokenizerFast) -> np.ndarray:
    """The posts of `corpus_texts` (not the summaries, which start with a space) tokenized and
    concatenated, each followed by EOS: the text pretraining sees."""
    ids = tokenizer([t for t in texts if not t.startswith(" ")])["input_ids"]
    return np.array([tok for seq in ids for tok in seq + [tokenizer.eos_token_id]], dtype=np.int64)


def heldout_windows(path: str, tokenizer: PreTrainedTokenizerFast, seq_len: int, count: int = 64) -> torch.Tensor:
    """The first `count` non-overlapping windows of `seq_len` tokens of the EOS-separated posts of
    `path` (the same text form as the pretraining stream)."""
    stream = post_stream(corpus_texts(path), tokenizer)
    windows = min(count, len(stream) // seq_len)
    return torch.from_numpy(stream[: windows * seq_len]).view(windows, seq_len)


@torch.no_grad()
def heldout_loss(model, windows: torch.Tensor) -> float:
    """Mean causal-LM loss per token on held-out windows: the base model's quality, comparable
    across sizes (the last pretraining batch's loss is one noisy batch)."""
    model.eval()
    # windows of equal length: each chunk's mean loss weighs by its rows
    return sum(model(input_ids=w, labels=w).loss.item() * len(w) for w in windows.split(16)) / len(windows)


def copy_probe(path: str, slots: list) -> tuple:
    """(queries, references, pairs) of the held-out posts of `path` (rows in the SFT schema) for
    `fact_copy_row`: each post as the stages' query (tldr_dataset's template, untruncated), its TL;DR as
    the reference, and the reference with one fact swapped for each of `slots` (evaluation.fact_swap_pairs,
    the reward model's and eval/fact_copy.py's pairs). Only the posts some checked slot swaps are kept:
    fact_copy_row scores every reference it is given, one forward each."""
    unknown = sorted(set(slots) - set(FACT_SWAP_SLOTS))
    if unknown:
        raise ValueError(f"copy_check: unknown slots {unknown}; choose from {list(FACT_SWAP_SLOTS)}")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    template = TldrParams().format_str
    table = pd.DataFrame({"query": [template.format(**row) for row in rows],
                          "reference_responses": [" " + row["summary"] for row in rows]})
    queries, references, pairs = fact_swap_pairs(table)
    empty = [slot for slot in slots if not pairs[slot]]
    if empty:
        raise ValueError(f"copy_check: no TL;DR of {path} states the {', '.join(empty)}")
    used = sorted({row for slot in slots for row, _ in pairs[slot]})
    position = {row: i for i, row in enumerate(used)}
    return ([queries[row] for row in used], [references[row] for row in used],
            {slot: [(position[row], swapped) for row, swapped in pairs[slot]] for slot in slots})


def pretrain_until_it_copies(config, token_stream: np.ndarray, steps: int, args: Args, name: str,
                             tokenizer, probe) -> tuple:
    """(model, last batch loss, record): the base of `config` pretrained from --seed, and again from each
    next seed until it copies the --copy_check slots (`probe`: copy_probe's pairs; None: the first is
    kept, record None). The record lists each seed tried with its score per slot, the seed kept and
    whether it copies: after copy_check_seeds seeds that all fail, the base closest to copying (the
    best worst slot) is kept with a warning, so that a size too small to copy (tiny-s) still builds."""
    tries, closest = [], None
    for seed in range(args.seed, args.seed + (args.copy_check_seeds if probe else 1)):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        loss = pretrain(model, token_stream, steps, args, name, seed) if steps > 0 else None
        if probe is None:
            return model, loss, None
        row = fact_copy_row(model, tokenizer, *probe)
        tries.append({"seed": seed, **{slot: round(row[slot], 3) for slot in args.copy_check}})
        print(f"{name} seed {seed} copies " + ", ".join(f"{slot} {row[slot]:.3f}" for slot in args.copy_check),
              flush=True)
        worst = min(row[slot] for slot in args.copy_check)
        if worst >= args.copy_check_min:
            return model, loss, {"kept_seed": seed, "copies": True, "tries": tries}
        if closest is None or worst > closest[0]:
            closest = (worst, seed, model, loss)
    _, seed, model, loss = closest
    warnings.warn(f"{name}: no base of seeds {args.seed}-{tries[-1]['seed']} copies {args.copy_check} in "
                  f"{args.copy_check_min} of the held-out swaps ({tries}); kept seed {seed}, the closest")
    return model, loss, {"kept_seed": seed, "copies": False, "tries": tries}


def recipe(args: Args) -> dict:
    """What decides a size's weights and the shared tokenizer: the Args but the output folder, and the
    corpus and any extra corpus by their content (a regenerated corpus trains another tokenizer under the
    same path)."""
    def sha256(path: str) -> str:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    # (the defaults of arch, the extra corpus and its rows, and the copy check are left out: folders built
    # before they existed keep their recipe)
    defaults = (("arch", "gpt_neox"), ("extra_corpus", None), ("extra_corpus_rows", None), ("copy_check", []),
                ("copy_check_min", 0.9), ("copy_check_seeds", 8))
    wanted = {k: v for k, v in vars(args).items() if k not in ("output_dir", "sizes") and (k, v) not in defaults}
    if args.extra_corpus:
        wanted["extra_corpus_sha256"] = sha256(args.extra_corpus)
    return wanted | {"corpus_sha256": sha256(args.corpus)}


def built_before(output_dir: str, wanted: dict) -> dict:
    """The models.json entries of `output_dir` when they were built with the recipe `wanted` (more sizes
    may join them, sharing their tokenizer); {} otherwise (none yet, or another recipe)."""
    path = os.path.join(output_dir, "models.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        recorded = json.load(f)
    return recorded["models"] if recorded.get("recipe") == wanted else {}


def build(args: Args) -> dict:
    """Builds every requested size into `args.output_dir`, each size folder atomically, and returns a
    summary. Sizes built before with the same recipe stay (hello_world.sh builds the size it uses,
    scaling.sh adds the others); a folder of another recipe is replaced as a whole, since its tokenizer
    may differ."""
    unknown = sorted(set(args.sizes) - set(SIZES))
    if unknown:
        raise ValueError(f"unknown sizes {unknown}; choose from {sorted(SIZES)}")
    if args.extra_corpus_rows is not None and not args.extra_corpus:
        raise ValueError("--extra_corpus_rows needs --extra_corpus")
    # read before the output folder is touched: a corpus or held-out file that cannot be read leaves the
    # models built before
    texts = (corpus_texts(args.corpus, args.extra_corpus, last_rows=args.extra_corpus_rows) if args.extra_corpus
             else corpus_texts(args.corpus))
    heldout_path = args.heldout_corpus or os.path.join(os.path.dirname(args.corpus), "validation.jsonl")
    if args.copy_check and not os.path.isfile(heldout_path):
        raise FileNotFoundError(f"--copy_check reads held-out posts from {heldout_path}: no such file")
    probe = copy_probe(heldout_path, args.copy_check) if args.copy_check else None
    wanted = recipe(args)
    prefix = FOLDER_PREFIX[args.arch]
    kept = {name: info for name, info in built_before(args.output_dir, wanted).items()
            if name not in {f"{prefix}-tiny-{size}" for size in args.sizes}}
    if not kept and os.path.exists(args.output_dir):
        shutil.rmtree(args.output_dir)  # another recipe's models (or none finished): nothing to share with
    os.makedirs(args.output_dir, exist_ok=True)
    random.seed(args.seed)
    np.random.seed(args.seed)
    tokenizer = train_tokenizer(texts, args.vocab_size, args.arch)
    vocab_size = len(tokenizer)
    token_stream = post_stream(texts, tokenizer)

    heldout = heldout_windows(heldout_path, tokenizer, args.pretrain_seq_len) if os.path.isfile(heldout_path) else None

    summary = {}
    for size in args.sizes:
        name = f"{prefix}-tiny-{size}"
        config = model_config(size, vocab_size, tokenizer, args.arch)
        with torch.device("meta"):  # the count alone, before any seed's weights
            parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        steps = pretrain_steps(parameters, args)
        start = time.time()
        model, loss, copy_check = pretrain_until_it_copies(config, token_stream, steps, args, name, tokenizer, probe)
        with atomic_output_dir(os.path.join(args.output_dir, name)) as folder:
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        summary[name] = {
            "parameters": parameters,
            "pretrain_steps": steps,
            "final_pretrain_loss": None if loss is None else round(loss, 4),
            "heldout_loss": None if heldout is None else round(heldout_loss(model, heldout), 4),
            "seconds": round(time.time() - start, 1),
            **({"copy_check": copy_check} if copy_check else {}),
        }
    recorded = ("parameters", "pretrain_steps", "final_pretrain_loss", "heldout_loss", "copy_check")
    models = kept | {k: {key: v[key] for key in recorded if key in v} for k, v in summary.items()}
    path = os.path.join(args.output_dir, "models.json")
    with open(path + ".partial", "w") as f:  # replaced whole: a crash leaves the old list or the new one
        json.dump({"recipe": wanted, "models": dict(sorted(models.items()))}, f, indent=2, sort_keys=True)
    os.replace(path + ".partial", path)
    return summary


def copy_check_note(record: Optional[dict], slots: list) -> str:
    """What the build line says of a size's copy check (pretrain_until_it_copies's record; None: none)."""
    if record is None:
        return ""
    kept = "the first that copies" if record["copies"] else f"none of {len(record['tries'])} copies; the closest to"
    return f" (seed {record['kept_seed']}: {kept} {slots})"


def main(args: Args) -> None:
    quiet_libraries()
    summary = build(args)
    for name, info in summary.items():
        print(f"{name}: {info['parameters']:,} parameters, {info['pretrain_steps']} pretraining steps, "
              f"last batch loss {info['final_pretrain_loss']}, held-out loss {info['heldout_loss']}, "
              f"{info['seconds']} s -> {os.path.join(args.output_dir, name)}"
              + copy_check_note(info.get("copy_check"), args.copy_check))


if __name__ == "__main__":
    main(tyro.cli(Args))
