import collections
import contextlib
import copy
import dataclasses
import filecmp
import io
import json
import os
import re
import shutil
import sys
import warnings

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tyro
from conftest import FIXTURES, TINY_CNNDM_PARAMS, TINY_TLDR_PARAMS, launched, tiny_dataset_args, tiny_default_array
from datasets import load_from_disk

from summarize_from_feedback_details import tldr_dataset as td

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CharTokenizer:
    """One token per character: makes smart-truncation answers exact and easy to check by hand."""

    pad_token_id = 0

    def encode(self, text):
        return [ord(c) for c in text]


def params(length, format_str="{post}", field="post"):
    return td.TldrParams(length=length, format_str=format_str, truncate_field=field)


# ---------------------------------------------------------------------------------------------
# smart truncation and padding
# ---------------------------------------------------------------------------------------------


def test_smart_truncation_cuts_at_the_last_newline():
    tokens, cuts = td.smart_truncate({"post": "abc\ndef\nghi"}, params(10), CharTokenizer())
    assert "".join(map(chr, tokens)) == "abc\ndef" and cuts == 1
    # repeated cuts, each at the then-last newline
    tokens, cuts = td.smart_truncate({"post": "ab\ncd\nef\ngh"}, params(4), CharTokenizer())
    assert "".join(map(chr, tokens)) == "ab" and cuts == 3
    # nothing to do when it fits, the template counts too
    tokens, cuts = td.smart_truncate({"post": "ab\ncd", "title": "T"}, params(9, "{title}: {post}"), CharTokenizer())
    assert "".join(map(chr, tokens)) == "T: ab\ncd" and cuts == 0


def test_smart_truncation_without_newline_drops_characters():
    tokens, cuts = td.smart_truncate({"post": "abcdefghijkl"}, params(10), CharTokenizer())
    assert "".join(map(chr, tokens)) == "abcdefghij" and cuts == 2
    # a newline early on is used first, then characters go one by one
    tokens, _ = td.smart_truncate({"post": "abcdefgh\nij"}, params(5), CharTokenizer())
    assert "".join(map(chr, tokens)) == "abcde"


def test_smart_truncation_keeps_a_field_cut_to_nothing_when_the_query_then_fits():
    """The paper's rule: a post cut down to whitespace, or to nothing, is kept once the query fits."""
    tokens, cuts = td.smart_truncate({"post": "  \n" + "x" * 20, "title": "ab"}, params(6, "{title}:{post}"),
                                     CharTokenizer())
    assert "".join(map(chr, tokens)) == "ab:  " and cuts == 1
    tokens, cuts = td.smart_truncate({"post": "\nabcdefghijkl"}, params(5), CharTokenizer())
    assert tokens == [] and cuts == 1


def test_smart_truncation_empty_field_with_the_query_still_too_long_is_an_error(tokenizer, tmp_path):
    with pytest.raises(td.FieldError) as e:
        td.smart_truncate({"post": "abc", "title": "x" * 20}, params(10, "{title}{post}"), CharTokenizer())
    assert e.value.column == "post" and "empty" in str(e.value) and "20 tokens > length 10" in str(e.value)
    # through a whole split: the message names the file, the row and the column
    row = {"id": "a", "subreddit": "relationships", "title": "help " * 600, "post": "short post", "summary": "s"}
    ok = dict(row, title="help")
    job = td._RowJob("sft", tokenizer, td.Args())
    with pytest.raises(td.DataError, match=r"^x/train.jsonl: row 1: column 'post': became empty during smart "
                                           r"truncation, and the query is still \d+ tokens > length 512$"):
        td.process_split(td.RawSplit("x/train.jsonl", [ok, row]), job, 1, "sft train")


def test_smart_truncation_with_the_real_tokenizer(tokenizer):
    post = "first paragraph is here.\n\nsecond one.\n\nthird paragraph that is long " + "and long " * 40
    fields = {"subreddit": "relationships", "title": "help", "post": post}
    expected = "SUBREDDIT: r/relationships\n\nTITLE: help\n\nPOST: first paragraph is here.\n\nsecond one.\n\nTL;DR:"
    length = len(tokenizer.encode(expected))
    p = td.TldrParams(length=length)
    out = td.process_query(fields, p, tokenizer)
    assert len(out["query_token"]) == length and tokenizer.pad_token_id not in out["query_token"]
    # cut 1 drops the long paragraph (leaving "second one.\n"), cut 2 the dangling newline
    assert out["query"] == expected and out["query_truncations"] == 2


def test_padding():
    assert td.left_pad([5, 6], 4, 0) == [0, 0, 5, 6]
    assert td.right_pad([5, 6], 4, 0, "c", "--f") == [5, 6, 0, 0]
    with pytest.raises(td.FieldError, match=r"3 tokens > --f 2"):
        td.right_pad([1, 2, 3], 2, 0, "c", "--f")


# ---------------------------------------------------------------------------------------------
# the processed datasets
# ---------------------------------------------------------------------------------------------


def test_queries_are_left_padded_to_exactly_the_query_length(tiny_datasets, tokenizer):
    out, _ = tiny_datasets
    pad = tokenizer.pad_token_id
    sft = load_from_disk(os.path.join(out, "sft"))
    pref = load_from_disk(os.path.join(out, "preference"))
    for ds, length in [(sft[s], 160) for s in sft] + [(pref["train"], 160), (pref["validation"], 160),
                                                       (pref["validation_cnndm"], 320)]:
        for row in ds:
            tokens = row["query_token"]
            assert len(tokens) == length
            n_pad = length - row["query_token_len"]
            assert tokens[:n_pad] == [pad] * n_pad and pad not in tokens[n_pad:]
            assert tokenizer.decode(tokens[n_pad:]) == row["query"]
            assert row["query"].endswith("TL;DR:") if length == 160 else row["query"].endswith("TL;DR:\n")


def test_some_tiny_posts_need_smart_truncation(tiny_datasets):
    _, stats = tiny_datasets
    for key in ("sft/train", "preference/train", "preference/validation_cnndm"):
        assert 0 < stats["truncated_queries"][key] < stats["rows"][key] / 2
    assert 140 < stats["max_lengths"]["sft/train"]["query_token_len"] <= 160


def test_sft_reference_response_has_leading_space_and_eos(tiny_datasets, tokenizer):
    out, _ = tiny_datasets
    sft = load_from_disk(os.path.join(out, "sft"))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    for row in sft["train"].select(range(50)):
        assert row["reference_response"] == " " + row["summary"] + "<|endoftext|>"
        tokens = row["reference_response_token"]
        n = row["reference_response_token_len"]
        assert len(tokens) == 32
        assert tokens[n - 1] == eos and tokens[n:] == [pad] * (32 - n) and eos not in tokens[: n - 1]
        assert tokenizer.decode(tokens[:n]) == row["reference_response"]
        assert tokenizer.decode(tokens[:1]).startswith(" ")


def test_preference_responses_get_eos_only(tiny_datasets, tokenizer):
    out, _ = tiny_datasets
    pref = load_from_disk(os.path.join(out, "preference"))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    for row in pref["train"].select(range(50)):
        choice = row["choice"]
        assert row["chosen"] == row["summaries"][choice]["text"] + "<|endoftext|>"
        assert row["rejected"] == row["summaries"][1 - choice]["text"] + "<|endoftext|>"
        assert row["chosen"].startswith(" ") and not row["chosen"].startswith("  ")
        assert row["chosen_policy"] == row["summaries"][choice]["policy"]
        assert row["policies"] == "--".join(sorted(s["policy"] for s in row["summaries"]))
        for name in ("chosen", "rejected"):
            tokens, n = row[f"{name}_token"], row[f"{name}_token_len"]
            assert len(tokens) == 80 and tokens[n - 1] == eos and tokens[n:] == [pad] * (80 - n)


@pytest.mark.parametrize("dataset,split,column,response_column,length", [
    ("sft", "train", "query_reference_response_token", "reference_response",
     TINY_TLDR_PARAMS["max_sft_query_response_length"]),
    ("preference", "train", "query_chosen_token", "chosen", TINY_TLDR_PARAMS["max_rm_query_response_length"]),
    ("preference", "train", "query_rejected_token", "rejected", TINY_TLDR_PARAMS["max_rm_query_response_length"]),
    ("preference", "validation_cnndm", "query_chosen_token", "chosen", TINY_CNNDM_PARAMS["max_rm_query_response_length"]),
])
def test_query_response_is_reencoded_with_response_label_mask(tiny_datasets, tokenizer, dataset, split,
                                                              column, response_column, length):
    out, _ = tiny_datasets
    ds = load_from_disk(os.path.join(out, dataset))[split]
    pad = tokenizer.pad_token_id
    for row in ds.select(range(min(40, len(ds)))):
        expected = tokenizer.encode(row["query"].strip() + row[response_column])
        tokens = row[column]
        assert len(tokens) == length
        assert tokens[0] != pad  # re-encoded: no left padding
        assert tokens[: len(expected)] == expected and tokens[len(expected):] == [pad] * (length - len(expected))
        assert row[f"{column}_len"] == len(expected)
        label = row[f"{column}_response_label"]
        query_len = len(tokenizer.encode(row["query"].strip()))
        assert label[:query_len] == [pad] * query_len
        assert label[query_len:] == tokens[query_len:]
        # what is left unmasked is exactly the response (EOS included)
        response = [t for t in label if t != pad]
        assert tokenizer.decode(response) == row[response_column]


def test_validation_is_split_by_batch_name(tiny_datasets, raw_dir):
    out, stats = tiny_datasets
    pref = load_from_disk(os.path.join(out, "preference"))
    assert set(pref) == {"train", "validation", "validation_cnndm"}
    with open(os.path.join(raw_dir, "comparisons", "validation.jsonl")) as f:
        raw = [json.loads(line) for line in f]
    ood_ids = [r["info"]["id"] for r in raw if r["batch"] in td.CNNDM_BATCHES]
    assert pref["validation_cnndm"]["info"] == [r["info"] for r in raw if r["batch"] in td.CNNDM_BATCHES]
    assert [i["id"] for i in pref["validation_cnndm"]["info"]] == ood_ids
    assert len(pref["validation"]) + len(ood_ids) == len(raw)
    assert set(pref["validation_cnndm"]["batch"]) <= set(td.CNNDM_BATCHES)
    assert not set(pref["validation"]["batch"]) & set(td.CNNDM_BATCHES)
    for row in pref["validation_cnndm"]:
        assert row["query"].startswith("Article:\n")
    assert stats["labels"]["validation_cnndm"]["batch"] == {
        b: sum(1 for r in raw if r["batch"] == b) for b in td.CNNDM_BATCHES if any(r["batch"] == b for r in raw)}


def test_upstream_columns_are_kept(tiny_datasets, raw_dir):
    out, _ = tiny_datasets
    pref = load_from_disk(os.path.join(out, "preference"))
    with open(os.path.join(raw_dir, "comparisons", "train.jsonl")) as f:
        raw = [json.loads(line) for line in f]
    row = pref["train"][0]
    for key in ("info", "summaries", "choice", "worker", "batch", "split", "extra"):
        assert row[key] == raw[0][key]
    assert pref["train"].flatten()["extra.confidence"] == [r["extra"]["confidence"] for r in raw]


def test_visuals_and_stats_are_written(tiny_datasets):
    out, stats = tiny_datasets
    for name in ("sft_token_lengths.png", "preference_token_lengths.png", "label_statistics.png"):
        with open(os.path.join(out, "dataset_visuals", name), "rb") as f:
            data = f.read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    with open(os.path.join(out, "stats.json")) as f:
        saved = json.load(f)
    assert saved["max_lengths"] == stats["max_lengths"]
    assert saved["rows"]["preference/validation_cnndm"] == 40
    assert sum(saved["labels"]["train"]["confidence"].values()) == 300
    assert saved["data_issues"] and not any(saved["data_issues"].values())  # the synthetic data has none


# ---------------------------------------------------------------------------------------------
# bad input and atomic output
# ---------------------------------------------------------------------------------------------


def copy_raw(raw_dir, tmp_path):
    dst = tmp_path / "raw"
    shutil.copytree(raw_dir, dst)
    return str(dst)


def rewrite_row(path, index, edit):
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    edit(rows[index])
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


@pytest.mark.parametrize("dataset,split,index,edit,column,message", [
    ("tldr_sft", "validation", 7, lambda r: r.pop("summary"), "summary", "missing column"),
    ("tldr_sft", "test", 3, lambda r: r.update(post="  \n "), "post", "empty text"),
    ("tldr_sft", "train", 11, lambda r: r.update(title=42), "title", "expected str, got int"),
    ("comparisons", "train", 5, lambda r: r.update(choice="1"), "choice", "expected int, got str"),
    ("comparisons", "train", 9, lambda r: r.update(choice=2), "choice", "expected 0 or 1"),
    ("comparisons", "train", 2, lambda r: r["summaries"].pop(), "summaries", "expected 2 summaries"),
    ("comparisons", "validation", 4, lambda r: r["summaries"][1].update(text=""), "summaries[1].text", "empty text"),
    ("comparisons", "validation", 6, lambda r: r["extra"].update(confidence=12), "extra.confidence", "1-9"),
    ("comparisons", "train", 8, lambda r: r["info"].pop("post"), "info.post", "missing column"),
])
def test_schema_errors_name_file_row_and_column(raw_dir, tokenizer_dir, tmp_path, dataset, split, index, edit,
                                                column, message):
    raw = copy_raw(raw_dir, tmp_path)
    path = os.path.join(raw, dataset, f"{split}.jsonl")
    rewrite_row(path, index, edit)
    out = str(tmp_path / "out")
    with pytest.raises(td.DataError) as e:
        td.run(tiny_dataset_args(raw, tokenizer_dir, out))
    assert str(e.value).startswith(f"{path}: row {index} (line {index + 1}): column '{column}': ")
    assert message in str(e.value)
    assert sorted(os.listdir(tmp_path)) == ["raw"]  # no output, not even a partial one


def test_a_null_comparison_id_is_accepted_a_missing_one_is_not():
    """The upstream loading script fills a missing `info.id` with null: such a row is usable."""
    row = td.read_rows(os.path.join(FIXTURES, "hub_schema", "comparisons", "train.jsonl")).rows[0]
    td.validate_preference_row({**row, "info": {**row["info"], "id": None}})
    with pytest.raises(td.FieldError, match="missing column"):
        td.validate_preference_row({**row, "info": {k: v for k, v in row["info"].items() if k != "id"}})


def test_missing_file_and_bad_json(raw_dir, tokenizer_dir, tmp_path):
    raw = copy_raw(raw_dir, tmp_path)
    os.remove(os.path.join(raw, "tldr_sft", "test.jsonl"))
    with pytest.raises(td.DataError, match=r"tldr_sft: expected exactly one of test.jsonl"):
        td.run(tiny_dataset_args(raw, tokenizer_dir, str(tmp_path / "out")))
    explicit = f"train={raw}/tldr_sft/train.jsonl,validation={raw}/tldr_sft/validation.jsonl,test={raw}/nope.jsonl"
    with pytest.raises(td.DataError, match=rf"{raw}/nope.jsonl: file does not exist"):
        td.run(tiny_dataset_args(raw, tokenizer_dir, str(tmp_path / "out"), sft_dataset=explicit))
    with pytest.raises(td.DataError, match=r"/no/such/folder: file or folder does not exist"):
        td.run(tiny_dataset_args(raw, tokenizer_dir, str(tmp_path / "out"), sft_dataset="/no/such/folder"))
    with open(os.path.join(raw, "comparisons", "train.jsonl"), "a") as f:
        f.write("\n{not json\n")
    with pytest.raises(td.DataError, match=r"comparisons/train.jsonl: row 300 \(line 302\): invalid JSON"):
        td.run(tiny_dataset_args(raw, tokenizer_dir, str(tmp_path / "out"), sft_dataset=os.path.join(raw_dir, "tldr_sft")))
    assert not os.path.exists(tmp_path / "out")


def sft_rows(count):
    return [{"id": str(k), "subreddit": "r", "title": "t", "post": f"post {k}", "summary": "s"} for k in range(count)]


# row 3 of every file below: "café " then the byte 0xff, inside the post (27th character, 28th byte)
BAD_ROW = b'{"id": "3", "post": "caf\xc3\xa9 \xff"}'


@pytest.mark.parametrize("name,lines,row_line", [
    # a blank line after row 1: row 3 is on line 5
    ("train.jsonl", [json.dumps(r).encode() for r in sft_rows(2)] + [b"", b"{}", BAD_ROW, b"{}"], 5),
    ("train.json", [json.dumps(r).encode() for r in sft_rows(3)] + [BAD_ROW], 4),  # (JSON lines in a .json)
    # one array, "[" on line 1, a row per line
    ("train.json", [b"["] + [json.dumps(r).encode() + b"," for r in sft_rows(3)] + [BAD_ROW + b",", b"{}", b"]"], 5),
])
def test_a_byte_that_is_not_utf8_names_file_row_line_and_column(tmp_path, name, lines, row_line):
    path = tmp_path / name
    data = b"\n".join(lines) + b"\n"
    path.write_bytes(data)
    offset = data.index(b"\xff")
    with pytest.raises(td.DataError) as e:
        td.read_rows(str(path))
    assert str(e.value) == (f"{path}: row 3 (line {row_line}, column 27, byte offset {offset}): byte 0xff is not "
                            f"UTF-8 (invalid start byte)")


def write_parquet_with_bad_post(path, row: int) -> None:
    """Four rows (id, post); the post of `row` holds the byte 0xff at byte 4. (pyarrow checks UTF-8 when
    it builds strings from Python, not from raw buffers.)"""
    posts = [f"post{k}".encode() for k in range(4)]
    posts[row] = b"post\xff"
    offsets = pa.array([0, 5, 10, 15, 20], pa.int32()).buffers()[1]
    bad_posts = pa.StringArray.from_buffers(4, offsets, pa.py_buffer(b"".join(posts)))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.table({"id": ["0", "1", "2", "3"], "post": bad_posts}), path)


def test_a_parquet_cell_that_is_not_utf8_names_file_row_and_column(tmp_path):
    path = str(tmp_path / "train.parquet")
    write_parquet_with_bad_post(path, 2)
    with pytest.raises(td.DataError) as e:
        td.read_rows(path)
    assert str(e.value) == (f"{path}: row 2: column 'post': byte 0xff at byte 4 of its text is not UTF-8 "
                            f"(invalid start byte)")
    # a local copy of the hub's parquet export goes through `datasets`: the same message, per split
    export = tmp_path / "export"
    for split, row in (("train", 0), ("validation", 3)):
        write_parquet_with_bad_post(str(export / "comparisons" / split / "0000.parquet"), row)
    with pytest.raises(td.DataError) as e:
        td.load_raw(str(export), td.PREFERENCE_SOURCE_SPLITS, "comparisons")
    assert str(e.value) == (f"{export}/comparisons[train]: row 0: column 'post': byte 0xff at byte 4 of its text is "
                            f"not UTF-8 (invalid start byte)")


def test_a_byte_that_is_not_utf8_stops_the_build_with_file_row_and_line(raw_dir, tokenizer_dir, tmp_path):
    raw = copy_raw(raw_dir, tmp_path)
    path = os.path.join(raw, "comparisons", "train.jsonl")
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    lines[6] = lines[6].replace(b'"post": "', b'"post": "\xff', 1)
    with open(path, "wb") as f:
        f.write(b"\n".join(lines))
    with pytest.raises(td.DataError, match=rf"^{re.escape(path)}: row 6 \(line 7, column \d+, byte offset \d+\): "
                                           r"byte 0xff is not UTF-8 \(invalid start byte\)$"):
        td.run(tiny_dataset_args(raw, tokenizer_dir, str(tmp_path / "out")))
    assert not os.path.exists(tmp_path / "out")


def test_json_lines_end_at_newlines_only(tmp_path):
    """U+2028 and U+0085 may stand unescaped inside a JSON string: they do not end a row."""
    rows = sft_rows(3)
    rows[1]["post"] = "one\u2028two\x85three"
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n", encoding="utf-8")
    read = td.read_rows(str(path))
    assert read.rows == rows and read.line_numbers == [1, 2, 3]


def test_a_response_longer_than_its_max_length_is_an_error(raw_dir, tokenizer_dir, tmp_path):
    args = tiny_dataset_args(raw_dir, tokenizer_dir, str(tmp_path / "out"))
    args.tldr_params.max_sft_response_length = 12
    with pytest.raises(td.DataError, match=r"column 'reference_response_token': \d+ tokens > "
                                           r"--tldr_params.max_sft_response_length 12"):
        td.run(args)
    args = tiny_dataset_args(raw_dir, tokenizer_dir, str(tmp_path / "out"))
    args.cnndm_params.max_rm_query_response_length = 300
    with pytest.raises(td.DataError, match=r"comparisons/validation.jsonl: row \d+ \(line \d+\): column 'query_\w+_token': "
                                           r"\d+ tokens > --cnndm_params.max_rm_query_response_length 300"):
        td.run(args)
    assert not os.path.exists(tmp_path / "out")


def test_an_empty_split_file_is_named(raw_dir, tokenizer_dir, tmp_path):
    raw = copy_raw(raw_dir, tmp_path)
    open(os.path.join(raw, "tldr_sft", "validation.jsonl"), "w").close()
    with pytest.raises(td.DataError, match=rf"{raw}/tldr_sft/validation.jsonl: no rows \(the validation split is empty\)"):
        td.run(tiny_dataset_args(raw, tokenizer_dir, str(tmp_path / "out")))
    assert not os.path.exists(tmp_path / "out")


def test_overlap_duplicates_and_identical_pairs_are_counted_and_refused_on_request(raw_dir, tokenizer_dir, tmp_path):
    """Data that passes the row checks but misleads: a validation post seen in training (inflates
    validation ROUGE), a repeated id, a pair of one text twice (counts as wrong in reward-model
    accuracy), a train comparison again in validation. A warning with the counts, the counts in
    stats.json; --strict_data refuses."""
    raw = copy_raw(raw_dir, tmp_path)

    def rows(path):
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]

    def append(path, new_rows):
        with open(path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in new_rows)

    sft_train = rows(os.path.join(raw, "tldr_sft", "train.jsonl"))
    append(os.path.join(raw, "tldr_sft", "validation.jsonl"), sft_train[:3])  # 3 ids in train and validation
    append(os.path.join(raw, "tldr_sft", "train.jsonl"), sft_train[5:7])  # 2 ids twice in train
    comparisons = rows(os.path.join(raw, "comparisons", "train.jsonl"))
    same = copy.deepcopy(comparisons[0])
    same["summaries"][1]["text"] = same["summaries"][0]["text"]
    append(os.path.join(raw, "comparisons", "train.jsonl"), [same])
    swapped = copy.deepcopy(comparisons[1])
    swapped["summaries"].reverse()
    swapped["choice"] = 1 - swapped["choice"]
    append(os.path.join(raw, "comparisons", "validation.jsonl"), [comparisons[2], swapped])  # either order
    console = td.Console(file=io.StringIO(), width=400)
    stats = td.run(tiny_dataset_args(raw, tokenizer_dir, str(tmp_path / "out")), console)
    found = {name: count for name, count in stats["data_issues"].items() if count}
    assert found == {"sft ids in both train and validation": 3, "sft ids repeated within train": 2,
                     "preference train pairs with identical chosen and rejected": 1,
                     "preference comparisons in both train and validation": 2}
    assert ("WARNING: the data passes the row checks, but sft ids in both train and validation: 3; sft ids repeated "
            "within train: 2; preference train pairs with identical chosen and rejected: 1; preference comparisons "
            "in both train and validation: 2 (counts in stats.json under data_issues; --strict_data refuses such "
            "data)") in console.file.getvalue()
    with open(tmp_path / "out" / "stats.json") as f:
        assert json.load(f)["data_issues"] == stats["data_issues"]
    with pytest.raises(td.DataError, match=r"^--strict_data: sft ids in both train and validation: 3; .* "
                                           r"preference comparisons in both train and validation: 2$"):
        td.run(tiny_dataset_args(raw, tokenizer_dir, str(tmp_path / "strict"), strict_data=True))
    assert not os.path.exists(tmp_path / "strict")


def test_existing_output_needs_overwrite(raw_dir, tokenizer_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(FileExistsError):
        td.run(tiny_dataset_args(raw_dir, tokenizer_dir, str(out)))
    assert (out / "old.txt").exists()
    td.run(tiny_dataset_args(raw_dir, tokenizer_dir, str(out), overwrite=True))
    assert sorted(os.listdir(out)) == ["dataset_visuals", "preference", "sft", "stats.json"]
    assert sorted(os.listdir(tmp_path)) == ["out"]


def word_tokenizer(**special):
    """A word-level tokenizer of a few words, built here (its vocabulary holds no [PAD])."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<|endoftext|>", "<|begin_of_text|>", "a", "b", "c"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="c"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", **special)


def with_template(tokenizer, template: str):
    """`tokenizer` with a post-processor that frames every encode (`<|begin_of_text|> $A`: Llama 3's BOS)."""
    from tokenizers import processors

    tokenizer.add_special_tokens({"additional_special_tokens": ["<|begin_of_text|>"]})
    specials = [(t, tokenizer.convert_tokens_to_ids(t)) for t in ("<|begin_of_text|>", "<|endoftext|>")]
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=template, pair=template + " $B", special_tokens=specials)
    return tokenizer


def test_tokenizer_with_pad_equal_to_eos_gets_a_dedicated_pad_token(tmp_path):
    """Qwen's base models pad with their EOS: padding would mask every EOS out of the losses, so a
    [PAD] is added (one new id: the one embedding row a loader may add)."""
    word_tokenizer(pad_token="<|endoftext|>").save_pretrained(tmp_path / "qwen_style")
    tokenizer = td.load_tokenizer(str(tmp_path / "qwen_style"))
    assert tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id == 5 and tokenizer.eos_token_id == 0
    assert tokenizer.added_pad and len(tokenizer) == 6


def test_a_prepended_bos_is_kept_before_the_query_only(raw_dir, tokenizer_dir, tmp_path):
    """Llama 3's tokenizer prepends a BOS to every encode: the data stage keeps it at the start of
    each query (and of each re-encoded query+response row) and never puts one before a response or
    the EOS."""
    from transformers import AutoTokenizer

    bos_first = with_template(AutoTokenizer.from_pretrained(tokenizer_dir), "<|begin_of_text|> $A")
    bos_first.bos_token = "<|begin_of_text|>"
    bos_first.save_pretrained(tmp_path / "llama3_style")
    tokenizer = td.load_tokenizer(str(tmp_path / "llama3_style"))
    bos, pad = tokenizer.bos_token_id, tokenizer.pad_token_id
    assert tokenizer.encode("a b")[0] == bos and tokenizer.encode(tokenizer.eos_token, add_special_tokens=False) == [0]
    td.run(tiny_dataset_args(raw_dir, str(tmp_path / "llama3_style"), str(tmp_path / "out")))
    sft = load_from_disk(str(tmp_path / "out" / "sft"))["train"].select(range(50))
    preference = load_from_disk(str(tmp_path / "out" / "preference"))["train"].select(range(50))
    for row in sft:
        query = [t for t in row["query_token"] if t != pad]
        assert query[0] == bos and query.count(bos) == 1 and not row["query"].startswith("<|begin")
        assert bos not in row["reference_response_token"]
        assert row["query_reference_response_token"][0] == bos and row["query_reference_response_token"].count(bos) == 1
    for row in preference:
        assert bos not in row["chosen_token"] and bos not in row["rejected_token"]
        assert row["query_chosen_token"].count(bos) == 1 and row["query_chosen_token"][0] == bos


def test_a_model_the_reward_model_cannot_be_built_on_is_refused_before_any_training(raw_dir, tokenizer_dir, tmp_path):
    """The data stage, the first to run, refuses an architecture with no sequence-classification class
    in transformers (here FalconMamba), which reward.py would refuse only after SFT's hours."""
    from transformers import AutoTokenizer, FalconMambaConfig

    FalconMambaConfig(vocab_size=1024, hidden_size=16, num_hidden_layers=1).save_pretrained(tmp_path / "mamba")
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp_path / "mamba")
    with pytest.raises(ValueError, match="no sequence-classification class .* 'falcon_mamba'"):
        td.run(tiny_dataset_args(raw_dir, str(tmp_path / "mamba"), str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("template, added", [("$A <|endoftext|>", r"\[\] before and \['<\|endoftext\|>'\] after"),
                                              ("<|endoftext|> $A", r"\['<\|endoftext\|>'\] before")])
def test_a_tokenizer_that_frames_texts_otherwise_is_refused(template, added, tmp_path):
    """Anything but the tokenizer's BOS before the text (an EOS after it, a token before it that is not
    its BOS) is refused, naming what it adds."""
    with_template(word_tokenizer(), template).save_pretrained(tmp_path / "framing")
    with pytest.raises(ValueError, match=added):
        td.load_tokenizer(str(tmp_path / "framing"))


def test_tokenizer_without_pad_gets_a_dedicated_pad_token(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    no_pad = AutoTokenizer.from_pretrained(tokenizer_dir)
    no_pad.pad_token = None
    no_pad.save_pretrained(tmp_path / "nopad")
    tokenizer = td.load_tokenizer(str(tmp_path / "nopad"))
    assert tokenizer.pad_token == "[PAD]" and tokenizer.pad_token_id != tokenizer.eos_token_id


# ---------------------------------------------------------------------------------------------
# determinism, processes, sources
# ---------------------------------------------------------------------------------------------


def tree_files(root):
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


def assert_same_tree(a, b):
    files = tree_files(a)
    assert files == tree_files(b)
    match, mismatch, errors = filecmp.cmpfiles(a, b, files, shallow=False)
    assert not mismatch and not errors, mismatch


def test_output_is_identical_across_runs_and_process_counts(raw_dir, tokenizer_dir, tiny_datasets, tmp_path):
    first, _ = tiny_datasets
    td.run(tiny_dataset_args(raw_dir, tokenizer_dir, str(tmp_path / "again")))
    assert_same_tree(first, str(tmp_path / "again"))
    td.run(tiny_dataset_args(raw_dir, tokenizer_dir, str(tmp_path / "two"), num_proc=2))
    assert_same_tree(first, str(tmp_path / "two"))


def test_hub_schema_fixtures_take_the_same_code_path(tokenizer_dir, tmp_path, monkeypatch):
    """Hand-written rows in the real hub schemas (nulls included), with the paper's lengths."""
    import datasets
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("the hub was contacted")

    monkeypatch.setattr(datasets, "load_dataset", no_network)
    monkeypatch.setattr(huggingface_hub, "HfApi", no_network)
    out = str(tmp_path / "out")
    args = td.Args(base_model=tokenizer_dir, sft_dataset=os.path.join(FIXTURES, "hub_schema", "tldr_sft"),
                   preference_dataset=os.path.join(FIXTURES, "hub_schema", "comparisons"), output_dir=out)
    # the tiny tokenizer spends more tokens on real English than Pythia's: longer responses allowed
    args.tldr_params.max_sft_response_length = args.tldr_params.max_rm_response_length = 160
    args.tldr_params.max_sft_query_response_length = args.tldr_params.max_rm_query_response_length = 672
    args.cnndm_params.max_rm_response_length, args.cnndm_params.max_rm_query_response_length = 160, 2079
    stats = td.run(args)
    assert stats["rows"] == {"sft/train": 3, "sft/validation": 2, "sft/test": 2, "preference/train": 3,
                             "preference/validation": 2, "preference/validation_cnndm": 3}
    pref = load_from_disk(os.path.join(out, "preference"))
    cnndm = pref["validation_cnndm"]
    assert cnndm["batch"] == ["cnndm0", "cnndm2", "batch0_cnndm"]
    assert all(len(t) == 1919 for t in cnndm["query_token"]) and all(len(t) == 512 for t in pref["train"]["query_token"])
    assert all(len(t) == 672 for t in pref["train"]["query_chosen_token"])
    assert cnndm[1]["info"]["title"] is None and cnndm[1]["info"]["site"] == "cnn"
    assert cnndm[0]["query"].startswith("Article:\nThe town council voted 5-2")
    assert pref["train"][1]["extra"]["confidence"] is None and pref["train"][0]["summaries"][1]["note"] == "too short"
    assert pref["train"][1]["chosen_policy"] == "sup4_6b" and pref["train"][1]["rejected_policy"] == "ref"
    sft = load_from_disk(os.path.join(out, "sft"))
    assert sft["train"][1]["reference_response"] == \
        " Car loan is gone, $400/month freed up. Emergency fund, Roth IRA, or more 401k?<|endoftext|>"
    assert sft["test"][1]["query"].startswith("SUBREDDIT: r/legaladvice\n\nTITLE: [CA] Landlord kept")
    assert all(len(t) == 512 for t in sft["validation"]["query_token"])
    assert all(len(t) == 672 for t in sft["validation"]["query_reference_response_token"])


def write_parquet_export(root: str) -> str:
    """The hub_schema comparison fixtures as parquet files laid out like the hub's parquet export
    of openai/summarize_from_feedback (`comparisons/<split>/0000.parquet`), with the nested
    features of its loading script (info and extra structs, summaries a list of structs)."""
    from datasets import Dataset, Features, List, Value

    features = Features({
        "info": {k: Value("string") for k in ("id", "post", "title", "subreddit", "site", "article")},
        "summaries": List({"text": Value("string"), "policy": Value("string"), "note": Value("string")}),
        "choice": Value("int32"), "worker": Value("string"), "batch": Value("string"), "split": Value("string"),
        "extra": {"confidence": Value("int32")},
    })
    for split in td.PREFERENCE_SOURCE_SPLITS:
        rows = td.read_rows(os.path.join(FIXTURES, "hub_schema", "comparisons", f"{split}.jsonl")).rows
        rows = [{**row, "info": {k: row["info"].get(k) for k in features["info"]},
                 "summaries": [{k: s.get(k) for k in ("text", "policy", "note")} for s in row["summaries"]]}
                for row in rows]
        os.makedirs(os.path.join(root, "comparisons", split))
        Dataset.from_list(rows, features=features).to_parquet(os.path.join(root, "comparisons", split, "0000.parquet"))
    return root


def test_hub_preference_source_is_read_from_its_parquet_export(tmp_path, monkeypatch):
    """The exact call made for the default hub source (the hub stubbed: the call is served from a
    local folder laid out like the export branch), and the rows it gives."""
    import datasets

    export = write_parquet_export(str(tmp_path / "export"))
    real_load_dataset, calls = datasets.load_dataset, []

    def hub(path, *args, **kwargs):
        calls.append((path, args, kwargs))
        assert path == "openai/summarize_from_feedback"
        return real_load_dataset(export, *args, **{**kwargs, "revision": None})

    monkeypatch.setattr(datasets, "load_dataset", hub)
    raw = td.load_raw(td.Args().preference_dataset, td.PREFERENCE_SOURCE_SPLITS, td.Args().preference_config)
    assert calls == [("openai/summarize_from_feedback", (), {
        "data_files": {"train": "comparisons/train/*.parquet", "validation": "comparisons/validation/*.parquet"},
        "revision": "refs/convert/parquet"})]
    expected = {s: td.read_rows(os.path.join(FIXTURES, "hub_schema", "comparisons", f"{s}.jsonl")).rows
                for s in td.PREFERENCE_SOURCE_SPLITS}
    for split in td.PREFERENCE_SOURCE_SPLITS:
        assert raw[split].source == f"hub:openai/summarize_from_feedback@refs/convert/parquet/comparisons[{split}]"
        assert len(raw[split].rows) == len(expected[split])
        for got, want in zip(raw[split].rows, expected[split]):
            assert got["summaries"] == [{k: s.get(k) for k in ("text", "policy", "note")} for s in want["summaries"]]
            assert (got["choice"], got["batch"], got["extra"]) == (want["choice"], want["batch"], want["extra"])
            assert got["info"] == {k: want["info"].get(k) for k in got["info"]}


def test_local_copy_of_the_parquet_export_builds_the_datasets(tokenizer_dir, tmp_path, monkeypatch):
    """A folder laid out like the export branch, through the same load_parquet_export call, without
    the hub; the result equals the build from the same rows as JSON lines."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", lambda *a, **k: pytest.fail("the hub was contacted"))
    export = write_parquet_export(str(tmp_path / "export"))
    built = {}
    for name, source in (("parquet", export), ("jsonl", os.path.join(FIXTURES, "hub_schema", "comparisons"))):
        args = td.Args(base_model=tokenizer_dir, sft_dataset=os.path.join(FIXTURES, "hub_schema", "tldr_sft"),
                       preference_dataset=source, output_dir=str(tmp_path / name))
        args.tldr_params.max_sft_response_length = args.tldr_params.max_rm_response_length = 160
        args.tldr_params.max_sft_query_response_length = args.tldr_params.max_rm_query_response_length = 672
        args.cnndm_params.max_rm_response_length, args.cnndm_params.max_rm_query_response_length = 160, 2079
        built[name] = td.run(args)
        built[name].pop("args")
    assert built["parquet"] == built["jsonl"]
    a, b = (load_from_disk(str(tmp_path / name / "preference")) for name in ("parquet", "jsonl"))
    for split in a:
        assert a[split].to_list() == b[split].to_list()


def test_cli_runs_and_reports_bad_input(raw_dir, tokenizer_dir, tmp_path):
    script = os.path.join(REPO, "summarize_from_feedback_details", "tldr_dataset.py")
    cmd = [sys.executable, script, "--base_model", tokenizer_dir, "--sft_dataset", f"{raw_dir}/tldr_sft",
           "--preference_dataset", f"{raw_dir}/comparisons", "--output_dir", str(tmp_path / "cli")]
    cmd += tiny_default_array("TINY_LENGTHS")  # hello_world.sh's flags as they are
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    bad = copy_raw(raw_dir, tmp_path)
    rewrite_row(os.path.join(bad, "tldr_sft", "train.jsonl"), 4, lambda r: r.update(post=""))
    bad_cmd = list(cmd)
    bad_cmd[cmd.index("--sft_dataset") + 1] = f"{bad}/tldr_sft"
    bad_cmd[cmd.index("--output_dir") + 1] = str(tmp_path / "cli2")
    result = launched(cmd, tmp_path, env, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "observed maximum lengths" in result.stdout
    assert sorted(os.listdir(tmp_path / "cli")) == ["dataset_visuals", "preference", "sft", "stats.json"]
    result = launched(bad_cmd, tmp_path, env, timeout=300)
    assert result.returncode == 1
    assert f"error: {bad}/tldr_sft/train.jsonl: row 4 (line 5): column 'post': empty text" in result.stderr
    assert not os.path.exists(tmp_path / "cli2")


# ---------------------------------------------------------------------------------------------
# --help
# ---------------------------------------------------------------------------------------------


def help_by_flag(args_class) -> dict:
    """--flag -> the help tyro gives it, without the "(default: ...)" it appends. (tyro's get_parser is
    deprecated, but it is the API that hands out each flag's help.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        parser = tyro.extras.get_parser(args_class)
    return {action.option_strings[0]: " ".join(action.help.replace("%%", "%").split("(default:")[0].split())
            for action in parser._actions if "--help" not in action.option_strings}


def test_every_flag_has_a_help_of_its_own(monkeypatch):
    helps = help_by_flag(td.Args)
    flags = set()
    for f in dataclasses.fields(td.Args):
        nested = dataclasses.is_dataclass(f.type)
        names = [f"{f.name}.{g.name}" for g in dataclasses.fields(f.type)] if nested else [f.name]
        flags |= {"--" + name.replace("_", "-") for name in names}
    assert set(helps) == flags
    assert [flag for flag, text in helps.items() if not text] == []
    shared = collections.Counter(helps.values())
    assert [flag for flag, text in helps.items() if shared[text] > 1] == []
    # and --help prints them (box borders and line breaks undone)
    monkeypatch.setenv("COLUMNS", "120")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        tyro.cli(td.Args, args=["--help"])
    printed = " ".join(out.getvalue().replace("│", " ").split())
    assert [flag for flag, text in helps.items() if text not in printed] == []
