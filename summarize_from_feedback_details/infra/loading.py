"""Loaders of the stages: tokenizers, datasets and models, and how the frozen ones are held. Nothing
here changes a result that the stage does not name: it loads what the stage asks for, or refuses it.

- `load_tokenizer`, `load_split_dataset`, `load_policy`, `load_reward_model`: local folders or hub
  names, a clear error for a path that does not exist, fp32 master weights, the `[PAD]` row of the
  embedding, dropout off (the N+ detail every stage needs);
- no silent failure: `checked_load` refuses a checkpoint without the head a stage needs,
  `check_model_path` names a folder that a failed run left without a model, `load_tokenizer` and
  `check_model_tokenizer` refuse data and models of another tokenizer, `require_splits` a dataset
  without a split the run will need;
- frozen DeepSpeed engines (`frozen_dtype`, `prepare_frozen`, `describe_frozen`): reference and
  reward models as inference engines, ZeRO-3 with CPU offload under `--offload`;
- `load_policy_reference_reward`: the online stages' policy, reference and reward model (and PPO's critic).
"""

import hashlib
import json
import math
import os
from typing import Optional

import torch
from accelerate import Accelerator
from datasets import load_dataset, load_from_disk
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from summarize_from_feedback_details import packing
from summarize_from_feedback_details.infra.lora import quantization, trainable_parameters, with_lora


def looks_local(path: str) -> bool:
    return os.path.exists(path) or path.startswith((".", "/", "~")) or path.count("/") > 1


# what a local folder must hold to be loaded as a model, or as a tokenizer: a serialised tokenizer,
# a tokenizer config, or the vocabulary files AutoTokenizer builds one from (vocab.json with merges.txt,
# vocab.txt, a sentencepiece tokenizer.model) with the class the folder's config.json or
# tokenizer_config.json names. (From a GPT-NeoX config.json alone it builds an empty tokenizer without
# a word: a folder holding none of these is refused, not loaded.)
MODEL_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model")


def check_model_path(path: str, needs: tuple = MODEL_FILES) -> None:
    """A local `path` that does not exist, or that holds none of the files `needs` (a stage that
    failed or was stopped before its final save leaves its output folder with a `.lock` and perhaps
    checkpoints), is named as such, not as transformers' "Unrecognized model ... model_type"."""
    if not looks_local(path):
        return
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path} does not exist")
    if not any(os.path.isfile(os.path.join(path, name)) for name in needs):
        held = sorted(os.listdir(path))
        listing = ", ".join(held[:8]) + (" ..." if len(held) > 8 else "") if held else "nothing"
        resume = (" Its checkpoints/ can be finished with the same command and --resume." if "checkpoints" in held
                  else "")
        what = "tokenizer" if needs == TOKENIZER_FILES else "model"
        missing = f"no {needs[0]}" if len(needs) == 1 else f"none of {', '.join(needs)}"
        raise FileNotFoundError(f"model path {path} holds no {what} ({missing}; it holds {listing}): a failed or "
                                f"unfinished run?{resume}")
    named = ("tokenizer.json", "tokenizer_config.json", "config.json")
    if needs == TOKENIZER_FILES and not any(os.path.isfile(os.path.join(path, name)) for name in named):
        # (transformers would answer that sentencepiece or tiktoken is missing)
        raise FileNotFoundError(f"tokenizer path {path} holds a vocabulary but nothing that names its tokenizer class "
                                f"(a tokenizer_config.json with tokenizer_class, or the model's config.json), so "
                                "AutoTokenizer cannot build it: add one of them")


# written by tldr_dataset.py into each dataset folder it builds: which tokenizer made its token ids
TOKENIZER_RECORD = "tokenizer_record.json"

# the text whose ids the tokenizer check compares, with what TL;DR posts hold: the data stage's query
# format, ASCII prose, digits, punctuation, double spaces, a tab, newlines, common precomposed letters
# and typography, and the EOS written as text (as the data stage appends it)
PROBE_TEXT = ("SUBREDDIT: r/relationships\n\nTITLE: My [25F] boyfriend (27M) forgot our 3rd anniversary -- "
              "again?\n\nPOST: We've been together since 2019.  He said \"I'll make it up to you!\" but... I paid "
              "$1,200/month & he owes me 50%;\tcafé, naïve, über, jalapeño, Zoë, 10°C, €5, “quoted” ‘it’s’ – — "
              "…\n\nTL;DR: he forgot, again<|endoftext|>")
SPECIAL_TOKENS = {"bos": "BOS", "eos": "EOS", "pad": "pad", "unk": "UNK"}


def sha256(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def tokenizer_record(tokenizer) -> dict:
    """What decides which ids a text becomes, part by part in the order a difference is named: the
    vocabulary (token -> id) and the merges in their order (each "whole", with its size and digest),
    the added tokens and their ids, the special tokens' ids, and PROBE_TEXT's (id, token) pairs without
    and with the special tokens encoding adds. Not the serialised pipeline: transformers 5 rebuilds a
    tokenizer whose config names GPTNeoXTokenizer with an NFC normaliser and empty prefix and suffix
    strings, and it encodes every text as before."""
    vocabulary = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)
    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]  # (older files: "a b")

    def pairs(ids: list) -> list:
        return [[i, token] for i, token in zip(ids, tokenizer.convert_ids_to_tokens(ids))]

    return {
        "vocabulary": {"size": len(vocabulary), "sha256": sha256(sorted(vocabulary.items(), key=lambda kv: kv[1])),
                       "whole": vocabulary},
        "merges": {"size": len(merges), "sha256": sha256(merges), "whole": merges},
        "added_tokens": {token.content: i for i, token in sorted(tokenizer.added_tokens_decoder.items())},
        "special_ids": {name: getattr(tokenizer, f"{name}_token_id") for name in SPECIAL_TOKENS},
        "probe": pairs(tokenizer.encode(PROBE_TEXT, add_special_tokens=False)),
        "probe_with_special_tokens": pairs(tokenizer.encode(PROBE_TEXT)),
    }


def dataset_tokenizer_record(tokenizer, name: str) -> dict:
    """What tldr_dataset.py writes as TOKENIZER_RECORD beside each dataset: the tokenizer's `name` and
    its tokenizer_record, the vocabulary and merges kept as size and digest only (Pythia's vocabulary
    would take a megabyte)."""
    record = tokenizer_record(tokenizer)
    for part in ("vocabulary", "merges"):
        record[part] = {"size": record[part]["size"], "sha256": record[part]["sha256"]}
    return {"tokenizer": name, **record}


def first_difference(there: list, here: list) -> int:
    """The first position where two lists differ (the end of the shorter one where it is the other's start)."""
    return next(i for i, (a, b) in enumerate(zip(there + [None], here + [None])) if a != b)


def first_id_difference(there: dict, here: dict) -> str:
    """The token of lowest id whose id differs between two token -> id maps, in words."""
    tokens = sorted(there.keys() | here.keys(), key=lambda t: (min(there.get(t, math.inf), here.get(t, math.inf)), t))
    token = next(t for t in tokens if there.get(t) != here.get(t))
    return f"{token!r} is {there.get(token, 'absent')} there, {here.get(token, 'absent')} here"


def probe_excerpt(pairs: list, count: int = 4) -> str:
    """A probe's encoding from where it differs: its first `count` tokens as "19 '2', 24 '7' ..."."""
    text = ", ".join(f"{i} {token!r}" for i, token in pairs[:count]) or "nothing"
    return text + (" ..." if len(pairs) > count else "")


def tokenizer_difference(there: dict, here: dict) -> Optional[str]:
    """The first part of two tokenizer records (tokenizer_record or dataset_tokenizer_record) that
    differs, in words ("there": `there`'s value, "here": `here`'s), or None where the two turn every
    text into the same ids. Where one record holds only the digest (a dataset's), the sizes are named."""
    for part, what in (("vocabulary", "the vocabulary differs"), ("merges", "the merges differ")):
        a, b = there[part], here[part]
        if (a["size"], a["sha256"]) == (b["size"], b["sha256"]):
            continue
        if "whole" not in a or "whole" not in b:  # (a dataset's record)
            return (f"{what}: {a['size']} entries there, {b['size']} here" if a["size"] != b["size"]
                    else f"{what}: as many entries ({a['size']}), not the same ones")
        if part == "vocabulary":
            return f"{what}: {first_id_difference(a['whole'], b['whole'])}"
        i = first_difference(a["whole"], b["whole"])
        merge_there, merge_here = (repr(m[i]) if i < len(m) else "none" for m in (a["whole"], b["whole"]))
        return f"{what} from merge {i}: {merge_there} there, {merge_here} here"
    if there["added_tokens"] != here["added_tokens"]:
        return f"the added tokens differ: {first_id_difference(there['added_tokens'], here['added_tokens'])}"
    for name, label in SPECIAL_TOKENS.items():
        if there["special_ids"][name] != here["special_ids"][name]:
            return f"the {label} id differs: {there['special_ids'][name]} there, {here['special_ids'][name]} here"
    for part, what in (("probe", "the probe text"),
                       ("probe_with_special_tokens", "the probe text with special tokens")):
        a, b = there[part], here[part]
        if a != b:
            i = first_difference(a, b)
            return (f"{what} encodes differently from token {i}: {probe_excerpt(a[i:])} there, "
                    f"{probe_excerpt(b[i:])} here")
    return None


def tokenizer_fingerprint(tokenizer) -> str:
    """The tokenizer record tldr_dataset.py wrote before dataset_tokenizer_record: a hash of the
    serialised pipeline (normaliser, pre-tokeniser, decoder ... included), which also differs where the
    ids do not. Read only to check a dataset built then, whose record holds nothing else."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec = {k: v for k, v in spec.items() if k not in ("padding", "truncation", "added_tokens", "version")}
    spec["added_tokens"] = sorted((t.content, i) for i, t in tokenizer.added_tokens_decoder.items())
    spec["special"] = [tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token]
    return sha256(spec)


def check_dataset_tokenizer(tokenizer, dataset: str) -> None:
    """Refuses a dataset whose token ids another tokenizer made (its TOKENIZER_RECORD; a dataset
    without one, such as a hub dataset, is taken as it is), naming the first difference. A dataset built
    before the record held the parts of tokenizer_record is checked as it was then (its fingerprint),
    and told to be built again where that fingerprint cannot vouch for it."""
    path = os.path.join(dataset, TOKENIZER_RECORD)
    if not (looks_local(dataset) and os.path.isfile(path)):
        return
    with open(path) as f:
        record = json.load(f)
    name = tokenizer.name_or_path
    if "vocabulary" not in record:
        if record["fingerprint"] == tokenizer_fingerprint(tokenizer):
            return
        folder = os.path.dirname(os.path.normpath(dataset)) or "."
        raise ValueError(f"dataset {dataset} was built by an earlier tldr_dataset.py, whose record of its tokenizer "
                         f"({record['tokenizer']}) is a hash that does not match {name}'s tokenizer and cannot show "
                         f"whether the two read its token ids alike. Delete {folder} and build it again: "
                         f"tldr_dataset.py --base_model {name} --output_dir {folder} (hello_world.sh builds it when "
                         "it is missing)")
    difference = tokenizer_difference(record, dataset_tokenizer_record(tokenizer, name))
    if difference:
        raise ValueError(f"dataset {dataset} was tokenized with {record['tokenizer']}, whose tokenizer differs from "
                         f"{name}'s: its token ids would mean other text to this model ({difference}; there: the "
                         f"dataset's tokenizer, here: {name}'s). Rebuild it with tldr_dataset.py --base_model {name}, "
                         "or use the models of that tokenizer")


def load_tokenizer(name: str, *datasets: str):
    """`name`'s tokenizer, right-padding, with a dedicated pad token that is never EOS: `[PAD]` is added
    where there is none (Pythia; id 50277 fits in its 50304-row embedding) or where it is the EOS
    (Qwen's base models), which padding would otherwise mask out of every loss, so that EOS could never
    be learned. The EOS text must encode to the EOS id (the datasets append it as text). Encoding may
    prepend a BOS (Llama 3): queries keep it, responses and the EOS are encoded without it
    (`add_special_tokens=False`); a tokenizer that adds anything else is refused. Refused too where one
    of the `datasets` (folders) was tokenized by another tokenizer."""
    check_model_path(name, TOKENIZER_FILES)
    tokenizer = AutoTokenizer.from_pretrained(name, padding_side="right")
    if tokenizer.eos_token is None:
        raise ValueError(f"tokenizer {name} has no EOS token")
    # (the one embedding row a loader may add: fit_embeddings)
    tokenizer.added_pad = tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id
    if tokenizer.added_pad:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    if tokenizer.encode(tokenizer.eos_token, add_special_tokens=False) != [tokenizer.eos_token_id]:
        raise ValueError(f"tokenizer {name}: EOS text {tokenizer.eos_token!r} does not encode to its id")
    added = special_tokens_added(tokenizer)
    if added["after"] or added["before"] not in ([], [tokenizer.bos_token_id]):
        raise ValueError(f"tokenizer {name} adds {tokenizer.convert_ids_to_tokens(added['before'])} before and "
                         f"{tokenizer.convert_ids_to_tokens(added['after'])} after every text it encodes: only a BOS "
                         "before it is supported (queries and responses are encoded apart and joined)")
    for dataset in datasets:
        check_dataset_tokenizer(tokenizer, dataset)
    return tokenizer


def check_architecture(name: str) -> None:
    """Refuses, before any training (the data stage calls it), a base model the pipeline cannot take
    end to end: transformers needs a causal-LM class for it (the policies) and a sequence-classification
    class (the reward model and the critic). A local folder holding only a tokenizer is not checked."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)
    if looks_local(name) and not os.path.isfile(os.path.join(name, "config.json")):
        return
    model_type = AutoConfig.from_pretrained(name).model_type
    missing = [role for role, classes in (("causal-LM class (the policies)", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                                          ("sequence-classification class (the reward model and the critic)",
                                           MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES))
               if model_type not in classes]
    if missing:
        raise ValueError(f"{name}: transformers has no {' and no '.join(missing)} for its architecture "
                         f"{model_type!r}, so the pipeline cannot run on it; nothing was trained")


def special_tokens_added(tokenizer) -> dict:
    """{"before": ids, "after": ids}: what `tokenizer.encode` adds around a text's own tokens."""
    plain = tokenizer.encode("a b", add_special_tokens=False)
    framed = tokenizer.encode("a b")
    start = next((i for i in range(len(framed) - len(plain) + 1) if framed[i: i + len(plain)] == plain), None)
    if start is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path}: its special tokens change how a text itself is encoded")
    return {"before": framed[:start], "after": framed[start + len(plain):]}


def load_split_dataset(name: str, columns: tuple, kind: str = "SFT"):
    if looks_local(name):
        if not os.path.isdir(name):
            raise FileNotFoundError(f"dataset {name} does not exist (build it with tldr_dataset.py)")
        dataset = load_from_disk(name)
    else:
        dataset = load_dataset(name)
    for split, ds in dataset.items():
        missing = [c for c in columns if c not in ds.column_names]
        if missing:
            raise ValueError(f"dataset {name} split {split} lacks columns {missing}; is it the {kind} dataset "
                             "written by tldr_dataset.py?")
    return dataset


def require_splits(dataset, name: str, splits: tuple, why: str) -> None:
    """Stops at the start, not after training, where `dataset` lacks a split the run will need."""
    missing = [s for s in splits if s not in dataset]
    if missing:
        raise ValueError(f"{name} has no {' or '.join(repr(s) for s in missing)} split, which {why} needs "
                         f"(it has {', '.join(repr(s) for s in dataset)})")


def disable_dropout(model: torch.nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def frozen_dtype(mixed_precision: str) -> torch.dtype:
    """The dtype of the reference policy and reward model, which never train: the mixed-precision
    dtype when there is one (DeepSpeed would cast an fp32 copy to it anyway, after the host had held
    it: 4 bytes per parameter per process instead of 2), else fp32."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision, torch.float32)


def checked_load(model_class, path: str, expected: str, new_head: Optional[str] = None, **kwargs):
    """`model_class.from_pretrained(path, **kwargs)`, refused where the checkpoint is not `expected`
    ("causal LM" or "reward model"): transformers loads a causal LM as a sequence classifier (and the
    reverse) with a freshly initialised head and only a load report to say so, and a run would then
    train against a random reward or sample from a random LM head. `new_head`: the name of the head
    the caller initialises itself (reward.py's score head over an SFT model), allowed to be missing."""
    model, info = model_class.from_pretrained(path, output_loading_info=True, **kwargs)
    missing = sorted(k for k in info["missing_keys"] if not (new_head and k.split(".")[0] == new_head))
    architectures = getattr(model.config, "architectures", None) or []
    suffix = {"causal LM": "ForCausalLM", "reward model": "ForSequenceClassification"}[expected]
    wrong_kind = new_head is None and architectures and not any(a.endswith(suffix) for a in architectures)
    if missing or wrong_kind:
        found = f"a {', '.join(architectures)} checkpoint" if architectures else "a checkpoint of unnamed architecture"
        lacks = f", without {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}" if missing else ""
        hint = (" (a reward model from reward.py)" if expected == "reward model"
                else " (a base model or a policy from sft.py, ppo or dpo)")
        raise ValueError(f"{path}: expected a {expected}{hint}, found {found}{lacks}: loading it would start "
                         "those weights from random values")
    return model


def check_model_tokenizer(path: str, tokenizer) -> None:
    """Refuses a model folder saved with another tokenizer than `tokenizer`, naming the first difference
    (every stage saves its model's tokenizer beside it; a folder without one, or a hub name, is taken as
    it is). The folder's tokenizer is what transformers loads from it: a tokenizer.json in another
    family's model folder loads as that family's class, and may encode otherwise."""
    if not looks_local(path) or not any(os.path.isfile(os.path.join(path, n)) for n in TOKENIZER_FILES):
        return
    if os.path.abspath(path) == os.path.abspath(tokenizer.name_or_path):
        return
    difference = tokenizer_difference(tokenizer_record(load_tokenizer(path)), tokenizer_record(tokenizer))
    if difference:
        raise ValueError(f"{path} was saved with another tokenizer than {tokenizer.name_or_path}'s: it reads token "
                         f"ids as other text ({difference}; there: {path}'s tokenizer, here: "
                         f"{tokenizer.name_or_path}'s). Use models and datasets built on one tokenizer")


def fit_embeddings(model, path: str, tokenizer) -> None:
    """Grows the embedding by the `[PAD]` row load_tokenizer added, and by nothing else: a model with
    fewer rows than the tokenizer has tokens was built on another tokenizer, and a grown row reads one
    mean embedding for every id it never saw."""
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) <= rows:
        return
    if not (getattr(tokenizer, "added_pad", False) and len(tokenizer) == rows + 1):
        raise ValueError(f"{path} has {rows} embedding rows, fewer than the {len(tokenizer)} tokens of "
                         f"{tokenizer.name_or_path}'s tokenizer: it was built on another tokenizer (only the [PAD] "
                         "row this project adds is ever added to an embedding)")
    model.resize_token_embeddings(len(tokenizer))


def load_policy(path: str, tokenizer, dtype: torch.dtype = torch.float32, **quantized):
    """A causal LM in `dtype` whatever the checkpoint's (fp32 master weights for the trained policy;
    mixed precision is accelerate's job); `quantized`: from `quantization`. Refused where it was saved
    with another tokenizer than `tokenizer`."""
    check_model_path(path)
    check_model_tokenizer(path, tokenizer)
    model = checked_load(AutoModelForCausalLM, path, "causal LM", dtype=dtype, **quantized)
    fit_embeddings(model, path, tokenizer)
    disable_dropout(model)
    return model


def load_reward_model(path: str, tokenizer, dtype: torch.dtype = torch.float32, new_head: bool = False,
                      **quantized):
    """A saved reward model (reward.py), head and normalisation included, in `dtype`; with `new_head`,
    any backbone (an SFT model) under a score head that the caller initialises."""
    check_model_path(path)
    check_model_tokenizer(path, tokenizer)
    model = checked_load(AutoModelForSequenceClassification, path, "reward model", "score" if new_head else None,
                         num_labels=1, dtype=dtype, **quantized)
    fit_embeddings(model, path, tokenizer)
    # HF's pooling reads the rightmost token that is not config.pad_token_id: the EOS
    model.config.pad_token_id = tokenizer.pad_token_id
    disable_dropout(model)
    add_reward_offset(model)
    return model


def add_reward_offset(model) -> None:
    """Adds `config.reward_offset` (where reward.py stores the reward normalisation of an architecture
    whose final norm has no bias to fold it into: RMSNorm in Llama, Qwen, Gemma, OLMo-2, SmolLM) to
    the `score` head's output at every position, by a forward hook on the head: padded, packed and
    per-position (critic) reads all get it, and the saved weights stay a plain transformers model.
    The hook reads the config at every call (reward.py sets the offset after training); added once."""
    if getattr(model, "reward_offset_hook", None) is None:
        config = model.config

        def shifted(module, args, output):
            offset = getattr(config, "reward_offset", 0.0)
            return output + offset if offset else None

        model.reward_offset_hook = model.score.register_forward_hook(shifted)


def enable_gradient_checkpointing(model) -> None:
    """Activation checkpointing of every layer, non-reentrant: the backward recomputes exactly the
    forward it replaces (dropout is off), and no input needs requires_grad. transformers 5.23 renamed
    the method; older 5.x only has the first name."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# ---------------------------------------------------------------------------------------------
# frozen models under DeepSpeed
# ---------------------------------------------------------------------------------------------


def prepare_frozen(model, args, accelerator: Accelerator):
    """Reference policy and reward model: no gradients, eval mode. Under DeepSpeed they become
    inference engines in the trainable model's precision (as the paper); with --offload, ZeRO-3
    engines whose parameters live on the CPU and are gathered layer by layer for each forward.
    None (a LoRA run's reference, the policy itself) stays None."""
    if model is None:
        return None
    model.requires_grad_(False)
    if accelerator.state.deepspeed_plugin is None:
        return model.to(accelerator.device).eval()
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": args.local_micro_batch_size,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": accelerator.mixed_precision == "bf16"},
        "fp16": {"enabled": accelerator.mixed_precision == "fp16"},
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }
    if args.offload:
        config["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 1e4,
                                       "offload_param": {"device": "cpu"}}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()
    return engine


def describe_frozen(model) -> str:
    """How a frozen model is held (printed at startup, so a run shows its dtype and where --offload
    put it); None is a LoRA run's reference."""
    if model is None:
        return "the policy, its LoRA adapter disabled"
    dtype = next(model.parameters()).dtype
    if not hasattr(model, "zero_optimization_stage"):
        return f"plain module on {next(model.parameters()).device}, {dtype}"
    offload = model.zero_offload_param()
    device = getattr(offload.device, "value", offload.device) if offload is not None else "none"
    local = sum(p.numel() for p in model.module.parameters())
    total = sum(getattr(p, "ds_numel", p.numel()) for p in model.module.parameters())
    return (f"DeepSpeed ZeRO-{model.zero_optimization_stage()} engine, {dtype}, parameter offload {device}, "
            f"{local} of {total} parameters resident on this rank")


def load_policy_reference_reward(run, tokenizer, with_critic: bool = False, share_prefixes: bool = True) -> tuple:
    """The online stages' models: (policy, critic, reference, reward model). Policy and reference from the SFT
    checkpoint, the reward model from reward.py's and, `with_critic` (PPO), the critic from it too, head included
    (the paper's; else None). The trained ones in fp32 master weights (4-bit NF4 bases under --load_in_4bit), the
    frozen ones in the mixed-precision dtype; with --use_peft the reference is the policy with its adapter disabled
    (None: no second copy). `share_prefixes`: packed forwards compute a prefix that rows share once (rloo.py and
    online_dpo.py sample each query several times; the same result to float noise)."""
    args, accelerator = run.args, run.accelerator
    quantized, frozen = quantization(args, accelerator.device), frozen_dtype(accelerator.mixed_precision)
    policy = load_policy(args.sft_model_path, tokenizer, **quantized)
    critic = load_reward_model(args.reward_model_path, tokenizer, **quantized) if with_critic else None
    reward_model = load_reward_model(args.reward_model_path, tokenizer, frozen)
    if args.use_peft:
        policy, ref_policy = with_lora(policy, args), None
        critic = with_lora(critic, args, head="score") if with_critic else None
    else:
        ref_policy = load_policy(args.sft_model_path, tokenizer, frozen)
    trained = [model for model in (policy, critic) if model is not None]
    for model in trained if args.gradient_checkpointing else ():
        enable_gradient_checkpointing(model)
    packing.enable(args.packing, *trained, reward_model, ref_policy, share_prefixes=share_prefixes)
    packing.compile_for_training(args.compile_train, run.print, *trained)
    run.print("; ".join(f"{name}: {trainable_parameters(model)}" for name, model in zip(("policy", "critic"), trained)))
    return policy, critic, ref_policy, reward_model
