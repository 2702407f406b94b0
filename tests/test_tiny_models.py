import filecmp
import hashlib
import json
import os
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from summarize_from_feedback_details import evaluation, synthetic_tldr, tiny_models
from summarize_from_feedback_details.gold_judge import gold_score


def test_tokenizer_has_a_dedicated_pad_token(tokenizer_dir):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 0  # as in Pythia
    assert tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id == 1
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert tokenizer.encode("<|endoftext|>") == [0] and tokenizer.encode("[PAD]") == [1]
    # byte-level: any text round-trips, including text the corpus never had
    text = " Ünïcode, emoji 🙂 and tabs\tround-trip"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    # no BOS is prepended (the EOS of a response must be the last real token)
    assert tokenizer.encode(" my bf")[0] != tokenizer.eos_token_id


def test_models_load_offline_with_plain_transformers(models_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sizes = {}
    for size in ("s", "m"):
        folder = os.path.join(models_dir, f"pythia-tiny-{size}")
        assert "model.safetensors" in os.listdir(folder)
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        assert config["model_type"] == "gpt_neox" and "auto_map" not in config
        assert models_dir not in json.dumps(config)  # no path of the building machine
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert type(model).__name__ == "GPTNeoXForCausalLM"
        assert model.config.attention_dropout == 0.0 and model.config.hidden_dropout == 0.0
        assert model.config.vocab_size == len(AutoTokenizer.from_pretrained(folder))
        sizes[size] = model.num_parameters()
        ids = AutoTokenizer.from_pretrained(folder)(" my boyfriend", return_tensors="pt").input_ids
        assert model(ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert sizes["s"] < sizes["m"]
    with open(os.path.join(models_dir, "models.json")) as f:
        assert json.load(f)["models"]["pythia-tiny-s"]["parameters"] == sizes["s"]


def build(raw_dir, out, **kwargs):
    args = tiny_models.Args(corpus=os.path.join(raw_dir, "tldr_sft", "train.jsonl"), output_dir=str(out),
                            **{"sizes": ["s"], **kwargs})
    return tiny_models.build(args)


def test_build_is_deterministic(raw_dir, tmp_path):
    build(raw_dir, tmp_path / "a", pretrain_steps=3)
    build(raw_dir, tmp_path / "b", pretrain_steps=3)
    build(raw_dir, tmp_path / "c", pretrain_steps=3, seed=2)
    files = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    a, b, c = (os.path.join(tmp_path, x, "pythia-tiny-s") for x in "abc")
    match, mismatch, errors = filecmp.cmpfiles(a, b, files, shallow=False)
    assert match == files, (mismatch, errors)
    assert not filecmp.cmp(os.path.join(a, "model.safetensors"), os.path.join(c, "model.safetensors"), shallow=False)
    assert filecmp.cmp(os.path.join(a, "tokenizer.json"), os.path.join(c, "tokenizer.json"), shallow=False)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c"]


def test_pretraining_lowers_the_loss_on_held_out_posts(raw_dir, tmp_path):
    build(raw_dir, tmp_path / "init", pretrain_steps=0)
    build(raw_dir, tmp_path / "trained", pretrain_steps=40)
    with open(os.path.join(raw_dir, "tldr_sft", "validation.jsonl")) as f:
        posts = [json.loads(line)["post"] for line in f][:16]
    losses = {}
    for name in ("init", "trained"):
        folder = os.path.join(tmp_path, name, "pythia-tiny-s")
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder)
        with torch.no_grad():
            losses[name] = sum(model(ids := torch.tensor([tokenizer.encode(p)[:96]]), labels=ids).loss.item()
                               for p in posts) / len(posts)
    assert losses["trained"] < losses["init"] - 1.0, losses


def test_unknown_size_is_rejected(raw_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown sizes"):
        tiny_models.build(tiny_models.Args(corpus=os.path.join(raw_dir, "tldr_sft", "train.jsonl"),
                                           output_dir=str(tmp_path / "x"), sizes=["xl"]))


def test_pretraining_budget_grows_with_size(raw_dir, tmp_path):
    """Tokens proportional to parameters (docs/scaling.md): steps = ceil(tokens per
    parameter x parameters / (batch x sequence length)); pretrain_steps overrides it for every size."""
    args = tiny_models.Args()
    assert tiny_models.pretrain_steps(231_168, args) == 339  # 3 x 231168 / (16 x 128) = 338.6
    assert tiny_models.pretrain_steps(1_728_192, args) == 2532
    assert tiny_models.pretrain_steps(1_728_192, tiny_models.Args(pretrain_steps=7)) == 7
    args = tiny_models.Args(corpus=os.path.join(raw_dir, "tldr_sft", "train.jsonl"), output_dir=str(tmp_path / "x"),
                            sizes=["s", "m"], pretrain_tokens_per_parameter=0.02)
    summary = tiny_models.build(args)
    steps = {name: info["pretrain_steps"] for name, info in summary.items()}
    assert steps == {"pythia-tiny-s": 3, "pythia-tiny-m": 7}  # 0.02 x 231168 / 2048 = 2.3, 0.02 x 658944 / 2048 = 6.4
    with open(tmp_path / "x" / "models.json") as f:
        recorded = json.load(f)
    assert {name: m["pretrain_steps"] for name, m in recorded["models"].items()} == steps
    assert recorded["recipe"]["pretrain_tokens_per_parameter"] == 0.02
    # the held-out loss on the validation posts next to the corpus: one number per size
    assert all(0 < m["heldout_loss"] < 10 for m in recorded["models"].values())


def test_heldout_loss_is_the_mean_over_windows(raw_dir, tokenizer_dir, models_dir):
    """Windows of the validation posts (never pretrained on), weighted equally across chunks of 16."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    windows = tiny_models.heldout_windows(os.path.join(raw_dir, "tldr_sft", "validation.jsonl"), tokenizer, 32, count=20)
    assert windows.shape == (20, 32)
    with open(os.path.join(raw_dir, "tldr_sft", "validation.jsonl")) as f:
        first = json.loads(f.readline())
    assert windows[0].tolist() == tokenizer(f"{first['title']}\n\n{first['post']}")["input_ids"][:32]
    model = AutoModelForCausalLM.from_pretrained(os.path.join(models_dir, "pythia-tiny-s"))
    with torch.no_grad():
        each = [model(input_ids=w[None], labels=w[None]).loss.item() for w in windows]
    assert tiny_models.heldout_loss(model, windows) == pytest.approx(sum(each) / 20, rel=1e-5)


def test_a_size_joins_those_built_with_the_same_recipe(raw_dir, tmp_path):
    """hello_world.sh builds the size it uses and scaling.sh adds the others: a new size leaves the sizes
    of the same recipe untouched; another recipe (here more pretraining) replaces the folder whole, as
    its tokenizer may differ."""
    out = tmp_path / "tiny"
    build(raw_dir, out, pretrain_steps=2, sizes=["s"])
    small = out / "pythia-tiny-s" / "model.safetensors"
    before = (small.read_bytes(), small.stat().st_mtime_ns)
    build(raw_dir, out, pretrain_steps=2, sizes=["m"])
    assert sorted(os.listdir(out)) == ["models.json", "pythia-tiny-m", "pythia-tiny-s"]
    assert (small.read_bytes(), small.stat().st_mtime_ns) == before
    assert filecmp.cmp(out / "pythia-tiny-s" / "tokenizer.json", out / "pythia-tiny-m" / "tokenizer.json", shallow=False)
    with open(out / "models.json") as f:
        assert sorted(json.load(f)["models"]) == ["pythia-tiny-m", "pythia-tiny-s"]
    build(raw_dir, out, pretrain_steps=3, sizes=["m"])
    assert sorted(os.listdir(out)) == ["models.json", "pythia-tiny-m"]
    with open(out / "models.json") as f:
        recorded = json.load(f)
    assert list(recorded["models"]) == ["pythia-tiny-m"] and recorded["recipe"]["pretrain_steps"] == 3


def test_extra_corpus_is_pretrained_on_and_in_the_recipe(raw_dir, tmp_path):
    """--extra_corpus: its posts (TL;DRs included) follow the corpus's in the pretraining stream and its
    summaries join the tokenizer's texts; its content is part of the recipe, and a build without it
    records the recipe it always did (no extra_corpus key), so folders built before it are kept."""
    extra = tmp_path / "pretrain.jsonl"
    rows = synthetic_tldr.generate_pretrain_posts(random.Random(0), 12, 0.0)
    extra.write_text("".join(json.dumps(row) + "\n" for row in rows))
    corpus = os.path.join(raw_dir, "tldr_sft", "train.jsonl")
    alone, both = tiny_models.corpus_texts(corpus), tiny_models.corpus_texts(corpus, str(extra))
    posts = len(alone) // 2
    assert both[:posts] == alone[:posts] and both[posts:posts + 12] == [f"{r['title']}\n\n{r['post']}" for r in rows]
    assert both[posts + 12:] == alone[posts:] + [" " + r["summary"] for r in rows]
    build(raw_dir, tmp_path / "plain", pretrain_steps=0)
    build(raw_dir, tmp_path / "extra", pretrain_steps=0, extra_corpus=str(extra))
    recipes = {}
    for name in ("plain", "extra"):
        with open(tmp_path / name / "models.json") as f:
            recipes[name] = json.load(f)["recipe"]
    assert "extra_corpus" not in recipes["plain"] and "extra_corpus_sha256" not in recipes["plain"]
    assert recipes["extra"]["extra_corpus_sha256"] == hashlib.sha256(extra.read_bytes()).hexdigest()
    assert {k: v for k, v in recipes["extra"].items() if not k.startswith("extra_corpus")} == recipes["plain"]
    # the pretraining reads the extra posts: the stream grows by exactly their tokens
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "extra" / "pythia-tiny-s")
    grown = len(tiny_models.post_stream(both, tokenizer)) - len(tiny_models.post_stream(alone, tokenizer))
    assert grown == sum(len(tokenizer(f"{r['title']}\n\n{r['post']}")["input_ids"]) + 1 for r in rows)


def test_extra_corpus_rows_builds_the_base_of_that_many_rows(raw_dir, tmp_path):
    """--extra_corpus_rows N reads the first N rows of --extra_corpus: to the byte, the base (tokenizer and
    weights) built from a file of those N rows alone, N in the recipe. N beyond the file, N without an extra
    corpus, a copy check without held-out posts or of an unknown slot: refused before the output folder is
    touched."""
    rows = synthetic_tldr.generate_pretrain_posts(random.Random(0), 12, 0.0)
    longer, first = tmp_path / "longer.jsonl", tmp_path / "first.jsonl"
    longer.write_text("".join(json.dumps(row) + "\n" for row in rows))
    first.write_text("".join(json.dumps(row) + "\n" for row in rows[:5]))
    build(raw_dir, tmp_path / "rows", pretrain_steps=3, extra_corpus=str(longer), extra_corpus_rows=5)
    build(raw_dir, tmp_path / "file", pretrain_steps=3, extra_corpus=str(first))
    build(raw_dir, tmp_path / "all", pretrain_steps=3, extra_corpus=str(longer))
    files = ["model.safetensors", "tokenizer.json"]
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "rows" / "pythia-tiny-s", tmp_path / "file" / "pythia-tiny-s",
                                               files, shallow=False)
    assert match == files, (mismatch, errors)
    assert not filecmp.cmp(tmp_path / "rows" / "pythia-tiny-s" / "model.safetensors",
                           tmp_path / "all" / "pythia-tiny-s" / "model.safetensors", shallow=False)
    recipes = {}
    for name in ("rows", "all"):
        with open(tmp_path / name / "models.json") as f:
            recipes[name] = json.load(f)["recipe"]
    assert recipes["rows"].pop("extra_corpus_rows") == 5 and "extra_corpus_rows" not in recipes["all"]
    assert recipes["rows"] == recipes["all"]
    # into a folder of another recipe, which a build replaces: refused with the folder left as it was
    with pytest.raises(ValueError, match="has 12 rows: cannot read the first 13"):
        build(raw_dir, tmp_path / "rows", pretrain_steps=3, extra_corpus=str(longer), extra_corpus_rows=13)
    with pytest.raises(ValueError, match="--extra_corpus_rows needs --extra_corpus"):
        build(raw_dir, tmp_path / "rows", pretrain_steps=3, extra_corpus_rows=5)
    with pytest.raises(FileNotFoundError, match="--copy_check reads held-out posts from .*missing.jsonl"):
        build(raw_dir, tmp_path / "rows", pretrain_steps=3, copy_check=["feeling"],
              heldout_corpus=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="unknown slots \\['mood'\\]"):
        build(raw_dir, tmp_path / "rows", pretrain_steps=3, copy_check=["mood"])
    assert filecmp.cmp(tmp_path / "rows" / "pythia-tiny-s" / "model.safetensors",
                       tmp_path / "file" / "pythia-tiny-s" / "model.safetensors", shallow=False)


def test_the_copy_probe_swaps_a_fact_of_each_held_out_post(raw_dir, monkeypatch):
    """copy_probe: the held-out posts as the stages' queries, their TL;DRs as references, one wrong fact
    per checked slot; the gold judge, which reads every fact off the post, prefers every reference (so
    each swap is a fact of that post made wrong), and a base that reads nothing sits near 0.5."""
    path = os.path.join(raw_dir, "tldr_sft", "validation.jsonl")
    queries, references, pairs = tiny_models.copy_probe(path, ["feeling", "relation"])
    with open(path) as f:
        first = json.loads(f.readline())
    assert queries[0] == f"SUBREDDIT: r/{first['subreddit']}\n\nTITLE: {first['title']}\n\nPOST: {first['post']}\n\nTL;DR:"
    assert references[0] == " " + first["summary"] and sorted(pairs) == ["feeling", "relation"]
    assert {slot: len(swaps) for slot, swaps in pairs.items()} == {"feeling": 15, "relation": 60}  # of 60 posts
    assert all(swap != references[row] for swaps in pairs.values() for row, swap in swaps)
    monkeypatch.setattr(evaluation, "response_logprobs",
                        lambda model, tokenizer, qs, ts: np.array([gold_score(q, t) for q, t in zip(qs, ts)]))
    row = evaluation.fact_copy_row(None, None, queries, references, pairs)
    assert row["feeling"] == 1.0 and row["relation"] == 1.0
    with pytest.raises(ValueError, match="unknown slots \\['mood'\\]"):
        tiny_models.copy_probe(path, ["feeling", "mood"])


def test_the_copy_check_keeps_the_first_seed_whose_base_copies(raw_dir, tmp_path, monkeypatch):
    """A base that fails the check is pretrained again from the next seed: the kept base is, to the byte,
    the plain build of the first seed that passes, and models.json records every seed tried."""
    feeling = iter([0.5, 0.62, 0.97])
    monkeypatch.setattr(tiny_models, "fact_copy_row", lambda model, tokenizer, queries, texts, pairs: {
        "feeling": next(feeling), "relation": 1.0})
    build(raw_dir, tmp_path / "checked", pretrain_steps=3, copy_check=["feeling", "relation"])
    build(raw_dir, tmp_path / "seed3", pretrain_steps=3, seed=3)
    assert filecmp.cmp(tmp_path / "checked" / "pythia-tiny-s" / "model.safetensors",
                       tmp_path / "seed3" / "pythia-tiny-s" / "model.safetensors", shallow=False)
    with open(tmp_path / "checked" / "models.json") as f:
        recorded = json.load(f)
    assert recorded["models"]["pythia-tiny-s"]["copy_check"] == {"kept_seed": 3, "copies": True, "tries": [
        {"seed": 1, "feeling": 0.5, "relation": 1.0}, {"seed": 2, "feeling": 0.62, "relation": 1.0},
        {"seed": 3, "feeling": 0.97, "relation": 1.0}]}
    assert recorded["recipe"]["copy_check"] == ["feeling", "relation"] and recorded["recipe"]["seed"] == 1
    with open(tmp_path / "seed3" / "models.json") as f:  # no check: the recipe and entries of before
        plain = json.load(f)
    assert "copy_check" not in plain["recipe"] and "copy_check" not in plain["models"]["pythia-tiny-s"]


def test_the_copy_check_keeps_the_closest_base_when_no_seed_copies(raw_dir, tmp_path):
    """A real probe: no 3-step base copies the feeling in every swap, so after copy_check_seeds seeds the
    build warns, naming each seed's score, and keeps the base closest to copying (a size too small to copy
    still builds), recorded as not copying."""
    with pytest.warns(UserWarning, match=r"no base of seeds 4-5 copies \['feeling'\] in 1.0 of the held-out swaps"):
        build(raw_dir, tmp_path / "x", pretrain_steps=3, seed=4, copy_check=["feeling"], copy_check_min=1.0,
              copy_check_seeds=2)
    with open(tmp_path / "x" / "models.json") as f:
        record = json.load(f)["models"]["pythia-tiny-s"]["copy_check"]
    scores = {t["seed"]: t["feeling"] for t in record["tries"]}
    assert sorted(scores) == [4, 5] and all(0.0 < v < 1.0 for v in scores.values()) and not record["copies"]
    assert record["kept_seed"] == max(scores, key=scores.get)
    build(raw_dir, tmp_path / "kept", pretrain_steps=3, seed=record["kept_seed"])
    assert filecmp.cmp(tmp_path / "x" / "pythia-tiny-s" / "model.safetensors",
                       tmp_path / "kept" / "pythia-tiny-s" / "model.safetensors", shallow=False)
