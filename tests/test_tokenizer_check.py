"""One tokenizer per pipeline (DESIGN.md sections 4 and 22), checked on what decides the ids: the
vocabulary, the merges, the added tokens, the special tokens' ids and the ids of a probe text, not the
serialised pipeline. A tokenizer transformers rebuilds otherwise but that encodes alike is taken; one
that encodes otherwise is refused, naming its first difference; every folder AutoTokenizer loads a
tokenizer from is one; and a filesystem that cannot lock runs on with a warning."""

import errno
import json
import os
import re
import shutil
import warnings

import pytest
from datasets import load_from_disk
from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForSequenceClassification, Qwen3Config

from summarize_from_feedback_details.infra import loading, preflight

# the tiny tokenizer's own files (the model folder's weights and configs stay behind)
TOKENIZER_ONLY = shutil.ignore_patterns("*.safetensors", "config.json", "generation_config.json")
TINY = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)


def edited_copy(tokenizer_dir, path, config: dict = None, spec=None) -> str:
    """`tokenizer_dir`'s tokenizer files copied to `path`, tokenizer_config.json updated with `config`
    and tokenizer.json edited in place by `spec` (a function of its parsed JSON)."""
    shutil.copytree(tokenizer_dir, path, ignore=TOKENIZER_ONLY)
    for name, edit in (("tokenizer_config.json", lambda c: c.update(config or {})), ("tokenizer.json", spec)):
        if edit:
            with open(os.path.join(path, name)) as f:
                content = json.load(f)
            edit(content)
            with open(os.path.join(path, name), "w") as f:
                json.dump(content, f)
    return str(path)


def with_tokens(tokenizer_dir, path, **special) -> str:
    """`tokenizer_dir`'s tokenizer with `special` tokens added (add_special_tokens' arguments), saved to `path`."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens(special)
    tokenizer.save_pretrained(path)
    return str(path)


def reward_model(path, rows: int, tokenizer_files: str) -> str:
    """A one-layer GPT-NeoX reward model of `rows` embedding rows, with the tokenizer of `tokenizer_files` beside it."""
    shutil.copytree(tokenizer_files, path, ignore=TOKENIZER_ONLY)
    config = GPTNeoXConfig(vocab_size=rows, num_labels=1, pad_token_id=1, **TINY)
    GPTNeoXForSequenceClassification(config).save_pretrained(path)
    return str(path)


def refusal(path, tokenizer) -> str:
    """check_model_tokenizer's message on the model folder `path` for the run's `tokenizer`."""
    with pytest.raises(ValueError) as refused:
        loading.check_model_tokenizer(str(path), tokenizer)
    return str(refused.value)


def test_a_pythia_tokenizer_rebuilt_as_gpt_neox_tokenizer_is_the_same_tokenizer(tokenizer_dir, tiny_datasets, tmp_path):
    """Pythia's tokenizer_config.json names GPTNeoXTokenizer, which transformers 5 rebuilds with an NFC
    normaliser and empty prefix and suffix strings: the serialised pipeline (the old fingerprint)
    differs, the ids do not, so its reward model and the datasets of the tokenizer as it was saved are
    taken (the old check refused the reward model: "it reads token ids as other text")."""
    ours = loading.load_tokenizer(tokenizer_dir)
    rebuilt_dir = edited_copy(tokenizer_dir, tmp_path / "gpt_neox_tokenizer", {"tokenizer_class": "GPTNeoXTokenizer"})
    rebuilt = loading.load_tokenizer(rebuilt_dir)
    assert type(rebuilt).__name__ == "GPTNeoXTokenizer" and type(ours).__name__ != "GPTNeoXTokenizer"
    assert loading.tokenizer_fingerprint(rebuilt) != loading.tokenizer_fingerprint(ours)
    texts = [row["query"] + row["reference_response"]
             for row in load_from_disk(os.path.join(tiny_datasets[0], "sft"))["validation"]]
    assert rebuilt(texts)["input_ids"] == ours(texts)["input_ids"]

    assert loading.tokenizer_difference(loading.tokenizer_record(rebuilt), loading.tokenizer_record(ours)) is None
    model = loading.load_reward_model(reward_model(tmp_path / "rm", len(ours), rebuilt_dir), ours)
    assert model.get_input_embeddings().num_embeddings == len(ours)
    loading.check_model_tokenizer(reward_model(tmp_path / "rm_ours", len(ours), tokenizer_dir), rebuilt)
    loading.load_tokenizer(rebuilt_dir, *(os.path.join(tiny_datasets[0], name) for name in ("sft", "preference")))


def tokenizer_model(tokenizer_dir) -> dict:
    """The BPE model of the tiny tokenizer's tokenizer.json: its "vocab" (token -> id) and "merges"."""
    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        return json.load(f)["model"]


def swap_ids(spec: dict) -> None:
    """The tokens of ids 300 and 301 swap their ids."""
    vocab = spec["model"]["vocab"]
    a, b = (token for token, i in vocab.items() if i in (300, 301))
    vocab[a], vocab[b] = vocab[b], vocab[a]


def test_a_tokenizer_that_encodes_otherwise_is_refused_naming_its_first_difference(tokenizer_dir, tmp_path):
    """A model folder whose tokenizer differs in one part (two tokens' ids swapped, one merge fewer, an
    added token at another id, another EOS) is refused, and the message names that part and where it
    differs, "there" being the folder's tokenizer and "here" the run's (the old message named none)."""
    ours = loading.load_tokenizer(tokenizer_dir)
    vocab, merges = tokenizer_model(tokenizer_dir)["vocab"], tokenizer_model(tokenizer_dir)["merges"]
    a, b = (repr(token) for token in sorted((token for token, i in vocab.items() if i in (300, 301)), key=vocab.get))

    swapped = edited_copy(tokenizer_dir, tmp_path / "swapped", spec=swap_ids)
    message = refusal(swapped, ours)
    assert message.startswith(f"{swapped} was saved with another tokenizer than {tokenizer_dir}'s: it reads token ids "
                              "as other text (the vocabulary differs: ")
    assert re.search(rf"differs: ({re.escape(a)} is 301 there, 300 here|{re.escape(b)} is 300 there, 301 here); "
                     rf"there: {swapped}'s tokenizer, here: {tokenizer_dir}'s\)\. Use models and datasets", message)

    last_merge = edited_copy(tokenizer_dir, tmp_path / "merges", spec=lambda spec: spec["model"]["merges"].pop())
    assert (f"(the merges differ from merge {len(merges) - 1}: none there, {' '.join(merges[-1])!r} here;"
            in refusal(last_merge, ours))

    ab = with_tokens(tokenizer_dir, tmp_path / "ab", additional_special_tokens=["<|a|>", "<|b|>"])
    ba = with_tokens(tokenizer_dir, tmp_path / "ba", additional_special_tokens=["<|b|>", "<|a|>"])
    assert re.search(r"\(the added tokens differ: ('<\|a\|>' is 1025 there, 1024 here|'<\|b\|>' is 1024 there, 1025 "
                     r"here);", refusal(ba, loading.load_tokenizer(ab)))

    end = loading.load_tokenizer(with_tokens(tokenizer_dir, tmp_path / "end", additional_special_tokens=["<|end|>"]))
    end_as_eos = with_tokens(tokenizer_dir, tmp_path / "end_as_eos", eos_token="<|end|>")
    assert "(the EOS id differs: 1024 there, 0 here;" in refusal(end_as_eos, end)


def test_a_tokenizer_in_another_familys_model_folder_is_still_refused(tokenizer_dir, tmp_path):
    """The tiny Pythia tokenizer's files in a Qwen3 model folder whose tokenizer_config.json names Qwen's
    class: transformers loads them as Qwen2Tokenizer, whose pre-tokeniser splits numbers into digits, so
    the folder reads ids as other text and stays refused, at the first probe token that differs."""
    ours = loading.load_tokenizer(tokenizer_dir)
    folder = edited_copy(tokenizer_dir, tmp_path / "qwen3", {"tokenizer_class": "Qwen2Tokenizer"})
    Qwen3Config(vocab_size=len(ours), **TINY).save_pretrained(folder)
    assert type(loading.load_tokenizer(folder)).__name__ == "Qwen2Tokenizer"
    assert re.search(r"it reads token ids as other text \(the probe text encodes differently from token \d+: \d+ "
                     r"'\d', \d+ '\d'.* there, \d+ '\d\d+'", refusal(folder, ours))


def test_a_dataset_of_another_tokenizer_is_refused_naming_its_first_difference(tokenizer_dir, tiny_datasets, tmp_path):
    """tldr_dataset.py writes a small record of what decides the ids (the vocabulary and merges as size
    and digest, the rest whole); a run whose tokenizer differs is refused with the part that differs."""
    ours = loading.load_tokenizer(tokenizer_dir)
    dataset = os.path.join(tiny_datasets[0], "sft")
    with open(os.path.join(dataset, loading.TOKENIZER_RECORD)) as f:
        record = json.load(f)
    assert record == json.loads(json.dumps(loading.dataset_tokenizer_record(ours, tokenizer_dir)))
    assert record["vocabulary"]["size"] == len(ours) and "whole" not in record["vocabulary"]
    assert os.path.getsize(os.path.join(dataset, loading.TOKENIZER_RECORD)) < 20_000

    swapped = edited_copy(tokenizer_dir, tmp_path / "swapped", spec=swap_ids)
    with pytest.raises(ValueError, match=rf"^dataset {dataset} was tokenized with {tokenizer_dir}, whose tokenizer "
                                         rf"differs from {swapped}'s: its token ids would mean other text to this "
                                         rf"model \(the vocabulary differs: as many entries \({len(ours)}\), not the "
                                         rf"same ones; there: the dataset's tokenizer, here: {swapped}'s\)\. "
                                         rf"Rebuild it"):
        loading.load_tokenizer(swapped, dataset)
    end_as_eos = with_tokens(tokenizer_dir, tmp_path / "end_as_eos", eos_token="<|end|>")
    with pytest.raises(ValueError, match=r"\(the added tokens differ: '<\|end\|>' is absent there, 1024 here;"):
        loading.load_tokenizer(end_as_eos, dataset)


def test_a_dataset_built_before_the_record_held_the_ids_is_checked_by_its_fingerprint(tokenizer_dir, tmp_path):
    """A dataset built by the earlier tldr_dataset.py holds only the fingerprint of the serialised
    pipeline: where it matches the run's tokenizer (the same tokenizer, as hello_world.sh reruns it) the
    dataset is taken as before; where it does not, it cannot show whether the ids agree, and the
    message says which folder to delete and how to build it again."""
    ours = loading.load_tokenizer(tokenizer_dir)
    dataset = tmp_path / "tldr" / "sft"
    dataset.mkdir(parents=True)
    (dataset / loading.TOKENIZER_RECORD).write_text(json.dumps(
        {"tokenizer": tokenizer_dir, "fingerprint": loading.tokenizer_fingerprint(ours)}))
    loading.load_tokenizer(tokenizer_dir, str(dataset))
    rebuilt = edited_copy(tokenizer_dir, tmp_path / "gpt_neox_tokenizer", {"tokenizer_class": "GPTNeoXTokenizer"})
    with pytest.raises(ValueError, match=rf"^dataset {dataset} was built by an earlier tldr_dataset.py, whose record "
                                         rf"of its tokenizer \({tokenizer_dir}\) is a hash that does not match "
                                         rf"{rebuilt}'s tokenizer .* Delete {tmp_path}/tldr and build it again: "
                                         rf"tldr_dataset.py --base_model {rebuilt} --output_dir {tmp_path}/tldr "):
        loading.load_tokenizer(rebuilt, str(dataset))


def write_vocab_and_merges(tokenizer_dir, path) -> None:
    """The tiny tokenizer's vocabulary and merges in the files of a slow BPE tokenizer (GPT-2's format)."""
    model = tokenizer_model(tokenizer_dir)
    os.makedirs(path)
    with open(os.path.join(path, "vocab.json"), "w") as f:
        json.dump(model["vocab"], f)
    with open(os.path.join(path, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "".join(" ".join(merge) + "\n" for merge in model["merges"]))


def test_a_model_folder_with_the_vocabulary_files_of_a_slow_tokenizer_loads(tokenizer_dir, tmp_path):
    """vocab.json and merges.txt beside a config.json (which names the class, GPTNeoXTokenizer):
    AutoTokenizer loads them, and so does load_tokenizer (the old check wanted tokenizer.json or
    tokenizer_config.json and refused the folder), encoding the probe text as the tokenizer they came from."""
    folder = tmp_path / "slow"
    write_vocab_and_merges(tokenizer_dir, folder)
    GPTNeoXConfig(vocab_size=1024, **TINY).save_pretrained(folder)
    tokenizer, ours = loading.load_tokenizer(str(folder)), loading.load_tokenizer(tokenizer_dir)
    assert type(tokenizer).__name__ == "GPTNeoXTokenizer"
    assert tokenizer.encode(loading.PROBE_TEXT) == ours.encode(loading.PROBE_TEXT)
    # without the config nothing names the class: AutoTokenizer fails (saying sentencepiece or tiktoken is
    # missing), and load_tokenizer says what the folder lacks instead
    (folder / "config.json").unlink()
    with pytest.raises(Exception, match="sentencepiece or tiktoken"):
        AutoTokenizer.from_pretrained(str(folder))
    with pytest.raises(FileNotFoundError, match=rf"^tokenizer path {folder} holds a vocabulary but nothing that names "
                                                r"its tokenizer class \(a tokenizer_config.json"):
        loading.load_tokenizer(str(folder))


def test_every_vocabulary_file_autotokenizer_reads_counts_and_a_folder_without_one_is_named(tmp_path):
    """A WordPiece vocab.txt beside a BERT config loads with AutoTokenizer, and passes the file check; a
    model folder without any tokenizer file (from which AutoTokenizer would build an empty tokenizer)
    is named with what it holds."""
    from transformers import BertConfig

    wordpiece = tmp_path / "wordpiece"
    wordpiece.mkdir()
    (wordpiece / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world"]))
    BertConfig(vocab_size=7, **TINY).save_pretrained(wordpiece)
    assert AutoTokenizer.from_pretrained(str(wordpiece)).tokenize("hello world") == ["hello", "world"]
    loading.check_model_path(str(wordpiece), loading.TOKENIZER_FILES)

    weights_only = tmp_path / "weights_only"
    GPTNeoXConfig(vocab_size=1024, **TINY).save_pretrained(weights_only)
    (weights_only / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=rf"^model path {weights_only} holds no tokenizer \(none of tokenizer.json, .*; it holds config.json, "
                                                r"model.safetensors\)"):
        loading.load_tokenizer(str(weights_only))


@pytest.mark.parametrize("code", ["ENOLCK", "EOPNOTSUPP", "EINVAL"])
def test_a_filesystem_that_cannot_lock_runs_on_with_one_warning(tmp_path, monkeypatch, code):
    """lockf fails with ENOLCK, EOPNOTSUPP or EINVAL on some network filesystems: nobody holds the
    folder, so the run goes on, warned once that a second run into it would not be stopped (the old
    check refused it as "in use by a running another process", on every run)."""
    number = getattr(errno, code)

    def unsupported(handle, flags):
        raise OSError(number, os.strerror(number))

    monkeypatch.setattr(preflight.fcntl, "lockf", unsupported)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = preflight.lock_output_dir(str(tmp_path / "out"))
    handle.close()
    assert [w.category for w in caught] == [RuntimeWarning]
    assert str(caught[0].message) == (  # (errorcode: Linux names EOPNOTSUPP by its alias ENOTSUP)
        f"--output_dir {tmp_path}/out: its filesystem cannot lock {tmp_path}/out/.lock ({errno.errorcode[number]}: "
        f"{os.strerror(number)}), so a second run started into this folder would not be stopped, and the two would "
        "overwrite each other's checkpoints and model. Running on without the lock")
    assert (tmp_path / "out" / ".lock").read_text().startswith(f"run (pid {os.getpid()} on ")


@pytest.mark.parametrize("code", ["EAGAIN", "EACCES"])
def test_a_lock_another_process_holds_still_refuses(tmp_path, monkeypatch, code):
    """EAGAIN and EACCES are what lockf raises where another process holds the lock: still refused."""
    def held(handle, flags):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(preflight.fcntl, "lockf", held)
    with pytest.raises(RuntimeError, match=rf"--output_dir {tmp_path} is in use by a running another process"):
        preflight.lock_output_dir(str(tmp_path))
