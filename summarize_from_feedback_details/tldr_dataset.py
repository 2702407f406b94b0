"""Raw TL;DR data -> the tokenized SFT and preference datasets every later stage reads.

Sources are the hub datasets by default, or local JSON/JSONL/parquet files in the same schemas:

    python summarize_from_feedback_details/tldr_dataset.py                # hub, paper lengths
    python summarize_from_feedback_details/tldr_dataset.py \\
        --sft_dataset data/raw/tldr_sft --preference_dataset data/raw/comparisons \\
        --base_model models/tiny/pythia-tiny-s --output_dir data/tldr --tldr_params.length 160 ...

The preference data comes from the hub's parquet export of `openai/summarize_from_feedback`
(revision `refs/convert/parquet`, files `comparisons/{train,validation}/*.parquet`): its main branch
holds a loading script, which `datasets` 4 and later refuse to run. A local source is a folder
holding `<split>.jsonl` (or `.json` / `.parquet`) per split, a local copy of that parquet export, or
an explicit list `train=a.jsonl,validation=b.jsonl,...`. Output: `<output_dir>/sft` and
`<output_dir>/preference` (`save_to_disk`; each with `tokenizer_record.json`, which tokenizer made its
token ids, checked by every stage that reads it), `<output_dir>/dataset_visuals/*.png` and
`<output_dir>/stats.json`. The output folder appears only once complete. No hub call happens unless
a source is a hub name or `--push_to_hub` is given.
"""

import itertools
import json
import os
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from multiprocessing import Pool
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import tyro  # noqa: E402
from datasets import Dataset, DatasetDict, Features, List, Value, disable_progress_bars  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from summarize_from_feedback_details.infra.launch import quiet_libraries  # noqa: E402
from summarize_from_feedback_details.infra.loading import (TOKENIZER_RECORD, check_architecture,  # noqa: E402
                                                           dataset_tokenizer_record, load_tokenizer)
from summarize_from_feedback_details.infra.tracking import progress  # noqa: E402

CNNDM_BATCHES = ("batch0_cnndm", "cnndm0", "cnndm2")
SFT_SPLITS = ("train", "validation", "test")
PREFERENCE_SOURCE_SPLITS = ("train", "validation")
# the hub's automatic parquet conversion of a dataset repo, one folder per config and split
PARQUET_EXPORT_REVISION = "refs/convert/parquet"


@dataclass
class TldrParams:
    length: int = 512
    """TL;DR query length in tokens: longer queries are smart-truncated, shorter ones left-padded"""
    format_str: str = "SUBREDDIT: r/{subreddit}\n\nTITLE: {title}\n\nPOST: {post}\n\nTL;DR:"
    """TL;DR query template, filled from the row's columns (`info`'s for preference rows); no trailing
    space, as in the paper"""
    truncate_field: str = "post"
    """the column of TL;DR rows that smart truncation cuts"""
    truncate_text: str = "\n"
    """smart truncation cuts `truncate_field` of TL;DR rows at its last occurrence of this text"""
    max_sft_response_length: int = 53
    """SFT reference tokens (EOS included), right-padded to this; a longer reference is an error"""
    max_sft_query_response_length: int = 562
    """SFT query + reference tokens, re-encoded and right-padded to this; a longer pair is an error"""
    max_rm_response_length: int = 169
    """TL;DR preference summary tokens (EOS included), right-padded to this; a longer one is an error"""
    max_rm_query_response_length: int = 638
    """TL;DR preference query + summary tokens, re-encoded and right-padded to this; longer is an error"""


@dataclass
class CnndmParams:
    length: int = 2047 - 128
    """CNN/DM query length in tokens: longer queries are smart-truncated, shorter ones left-padded"""
    format_str: str = "Article:\n{article}\n\nTL;DR:\n"
    """CNN/DM query template, filled from the row's `info` columns"""
    truncate_field: str = "article"
    """the column of CNN/DM rows that smart truncation cuts"""
    truncate_text: str = "\n"
    """smart truncation cuts `truncate_field` of CNN/DM rows at its last occurrence of this text"""
    max_rm_response_length: int = 155
    """CNN/DM preference summary tokens (EOS included), right-padded to this; a longer one is an error"""
    max_rm_query_response_length: int = 2021
    """CNN/DM preference query + summary tokens, re-encoded and right-padded to this; longer is an error"""


# what the query functions read: either task's settings (CNN/DM rows have no SFT lengths)
TaskParams = TldrParams | CnndmParams


@dataclass
class Args:
    base_model: str = "EleutherAI/pythia-1b-deduped"
    """tokenizer source (all Pythia sizes share it, so one dataset serves every size)"""
    sft_dataset: str = "vwxyzjn/summarize_from_feedback_tldr_3_filtered"
    """hub name, local folder with train/validation/test files, or `split=file,...`"""
    preference_dataset: str = "openai/summarize_from_feedback"
    """hub name (read from its parquet export, folder `preference_config`), local folder with
    train/validation files or with a copy of that export, or `split=file,...`"""
    preference_config: str = "comparisons"
    """the preference data's folder in the hub's parquet export (and in a local copy of it)"""
    output_dir: str = "data/tldr"
    """where `sft/`, `preference/`, `dataset_visuals/` and `stats.json` are written"""
    overwrite: bool = False
    """replace an existing `output_dir` (the new one is built aside first)"""
    num_proc: int = 1
    """worker processes for tokenization (the output does not depend on it)"""
    strict_data: bool = False
    """refuse, instead of warning, data that passes the row checks but would mislead: SFT ids shared
    between splits or repeated in one, comparisons whose two summaries are the same text, and the same
    comparison in the preference train and validation splits"""
    push_to_hub: bool = False
    """also upload both datasets, the plots and this script to the hub (needs a login)"""
    hf_entity: Optional[str] = None
    """hub user or org to push to (only asked of the hub with --push_to_hub when unset)"""
    tldr_params: TldrParams = field(default_factory=TldrParams)
    """how TL;DR rows are tokenized (SFT rows and preference rows)"""
    cnndm_params: CnndmParams = field(default_factory=CnndmParams)
    """how the CNN/DM rows of the preference validation data are tokenized"""


class DataError(ValueError):
    """Bad input: the message names the file (or hub split), the row and the column."""


class FieldError(ValueError):
    """A problem with one column of one row; the caller adds the file and row."""

    def __init__(self, column: str, message: str):
        super().__init__(message)
        self.column = column


# ---------------------------------------------------------------------------------------------
# Reading and validating raw rows
# ---------------------------------------------------------------------------------------------


@dataclass
class RawSplit:
    source: str
    """a file path or `hub:<name>[<split>]`, for messages"""
    rows: list
    line_numbers: Optional[list] = None
    """1-based line of each row for JSON lines files"""

    def where(self, index: int) -> str:
        line = f" (line {self.line_numbers[index]})" if self.line_numbers else ""
        return f"{self.source}: row {index}{line}"


def read_rows(path: str) -> RawSplit:
    if not os.path.isfile(path):
        raise DataError(f"{path}: file does not exist")
    if path.endswith(".parquet"):
        return read_parquet_rows(path)
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: {where_undecodable(path, data, e.start)}: byte 0x{data[e.start]:02x} is not "
                        f"UTF-8 ({e.reason})") from None
    if is_json_array(path, text):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: invalid JSON: {e}") from None
        return RawSplit(path, rows)
    rows, lines = [], []
    # JSON lines end at "\n" only: str.splitlines would also end one at a U+2028 or U+0085 inside a string
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: row {len(rows)} (line {number}): invalid JSON: {e}") from None
        lines.append(number)
    return RawSplit(path, rows, lines)


def is_json_array(path: str, text: str) -> bool:
    """A .json file holding one array of rows (any other .json or .jsonl file holds a row per line)."""
    return path.endswith(".json") and text.lstrip().startswith("[")


def where_undecodable(path: str, data: bytes, offset: int) -> str:
    """Where the byte at `offset` of the file is, the first that is not UTF-8 (so all before it decodes):
    `row k (line n, column c, byte offset b)`, rows and lines counted as read_rows counts them."""
    head = data[:offset].decode("utf-8")
    lines = head.split("\n")
    place = f"line {len(lines)}, column {len(lines[-1]) + 1}, byte offset {offset}"
    if is_json_array(path, head):
        row = json_array_element_at(data.decode("utf-8", errors="replace"), len(head))
    else:
        row = sum(1 for line in lines[:-1] if line.strip())
    return place if row is None else f"row {row} ({place})"


JSON_SEPARATORS = re.compile(r"[ \t\n\r,]*")


def json_array_element_at(text: str, offset: int) -> Optional[int]:
    """Index of the element of the JSON array `text` that holds character `offset`, or None when the
    array does not parse as far as that."""
    decoder = json.JSONDecoder()
    position = JSON_SEPARATORS.match(text, text.index("[") + 1).end()
    for index in itertools.count():
        try:
            end = decoder.raw_decode(text, position)[1]
        except json.JSONDecodeError:
            return None
        if offset < end:
            return index
        position = JSON_SEPARATORS.match(text, end).end()


def read_parquet_rows(path: str) -> RawSplit:
    table = pq.read_table(path)
    try:
        return RawSplit(path, table.to_pylist())
    except UnicodeDecodeError:
        raise undecodable_cell_error(table, path) from None


def dataset_rows(dataset, where: str) -> RawSplit:
    """The rows of a `datasets` split (from the hub or a local parquet export)."""
    try:
        return RawSplit(where, list(dataset))
    except UnicodeDecodeError:
        raise undecodable_cell_error(dataset.data.table, where) from None


def undecodable_cell_error(table, where: str) -> DataError:
    """The error for a pyarrow table holding text that is not UTF-8 (pyarrow checks it only when it
    makes Python strings, and its message names neither row nor column): the first such cell."""
    for index in range(table.num_rows):
        for name in table.column_names:
            try:
                table.column(name)[index].as_py()
            except UnicodeDecodeError as e:
                return DataError(f"{where}: row {index}: column '{name}': byte 0x{e.object[e.start]:02x} at byte "
                                 f"{e.start} of its text is not UTF-8 ({e.reason})")


def is_local(source: str) -> bool:
    return "=" in source or os.path.exists(source) or source.startswith((".", "/", "~")) or source.count("/") > 1


def load_parquet_export(path: str, config: str, splits: tuple, revision: Optional[str], where: str) -> dict:
    """Split name -> RawSplit from the files `<config>/<split>/*.parquet` of `path`: a hub dataset at
    its parquet-export revision, or a local folder laid out like it (one call for both)."""
    from datasets import load_dataset

    dataset = load_dataset(path, data_files={split: f"{config}/{split}/*.parquet" for split in splits},
                           revision=revision)
    return {split: dataset_rows(dataset[split], f"{where}[{split}]") for split in splits}


def load_raw(source: str, splits: tuple, hub_config: Optional[str] = None) -> dict:
    """Split name -> RawSplit, from a hub name, a local folder, or `split=file,...`. With a
    `hub_config` (the preference data), a hub source is read from its parquet export and a local
    folder may be a copy of that export (`<folder>/<config>/<split>/*.parquet`)."""
    if not is_local(source):  # a hub source: the only reads of the hub in this module
        if hub_config:
            # openai/summarize_from_feedback keeps a loading script on its main branch, which
            # datasets >= 4 refuses to run; the hub's parquet export holds the same rows
            return load_parquet_export(source, hub_config, splits, PARQUET_EXPORT_REVISION,
                                       f"hub:{source}@{PARQUET_EXPORT_REVISION}/{hub_config}")
        from datasets import load_dataset

        return {split: dataset_rows(load_dataset(source, split=split), f"hub:{source}[{split}]") for split in splits}
    if "=" in source:
        files = dict(item.split("=", 1) for item in source.split(","))
    elif hub_config and os.path.isdir(os.path.join(source, hub_config)):
        return load_parquet_export(source, hub_config, splits, None, os.path.join(source, hub_config))
    elif os.path.isdir(source):
        files = {}
        for split in splits:
            found = [os.path.join(source, split + ext) for ext in (".jsonl", ".json", ".parquet")
                     if os.path.isfile(os.path.join(source, split + ext))]
            if len(found) != 1:
                raise DataError(f"{source}: expected exactly one of {split}.jsonl, {split}.json, "
                                f"{split}.parquet, found {len(found)}")
            files[split] = found[0]
    else:
        raise DataError(f"{source}: file or folder does not exist")
    missing = [s for s in splits if s not in files]
    if missing:
        raise DataError(f"{source}: no file given for split(s) {missing}")
    return {split: read_rows(os.path.expanduser(files[split])) for split in splits}


def require_rows(raw: dict) -> dict:
    """`raw` (split -> RawSplit), refused where a split has no rows: an empty file would otherwise
    surface later as a `datasets` schema error that names no file."""
    for split, rows in raw.items():
        if not rows.rows:
            raise DataError(f"{rows.source}: no rows (the {split} split is empty)")
    return raw


def _get(row: dict, column: str):
    value = row
    for key in column.split("."):
        if not isinstance(value, dict):
            raise FieldError(column, f"expected an object, got {type(value).__name__}")
        if key not in value:
            raise FieldError(column, "missing column")
        value = value[key]
    return value


def _require(row: dict, column: str, kind, nonempty: bool = False, nullable: bool = False):
    value = _get(row, column)
    if value is None and nullable:
        return None
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise FieldError(column, f"expected {kind.__name__}, got {type(value).__name__} ({value!r:.40})")
    if nonempty and not value.strip():
        raise FieldError(column, "empty text")
    return value


def validate_sft_row(row) -> None:
    if not isinstance(row, dict):
        raise FieldError("<row>", f"expected an object, got {type(row).__name__}")
    for column in ("id", "subreddit", "title"):
        _require(row, column, str)
    for column in ("post", "summary"):
        _require(row, column, str, nonempty=True)


def validate_preference_row(row) -> None:
    if not isinstance(row, dict):
        raise FieldError("<row>", f"expected an object, got {type(row).__name__}")
    _require(row, "info.id", str, nullable=True)  # (the upstream loader fills a missing id with null)
    batch = _require(row, "batch", str)
    if batch in CNNDM_BATCHES:
        _require(row, "info.article", str, nonempty=True)
    else:
        _require(row, "info.post", str, nonempty=True)
        _require(row, "info.title", str)
        _require(row, "info.subreddit", str)
    summaries = _require(row, "summaries", list)
    if len(summaries) != 2:
        raise FieldError("summaries", f"expected 2 summaries, got {len(summaries)}")
    for k, summary in enumerate(summaries):
        if not isinstance(summary, dict):
            raise FieldError(f"summaries[{k}]", f"expected an object, got {type(summary).__name__}")
        for key, nonempty in (("text", True), ("policy", False)):
            try:
                _require(summary, key, str, nonempty=nonempty)
            except FieldError as e:
                raise FieldError(f"summaries[{k}].{e.column}", str(e)) from None
    if _require(row, "choice", int) not in (0, 1):
        raise FieldError("choice", f"expected 0 or 1, got {row['choice']}")
    _require(row, "worker", str)
    _require(row, "split", str)
    confidence = _require(row, "extra.confidence", int, nullable=True)
    if confidence is not None and not 1 <= confidence <= 9:
        raise FieldError("extra.confidence", f"expected 1-9 or null, got {confidence}")


# ---------------------------------------------------------------------------------------------
# Tokenization (pure functions of a row; tests import these)
# ---------------------------------------------------------------------------------------------


# Cutting the field usually shortens the query, but not always: a word cut in its middle can take more
# tokens than the whole word. Smart truncation assumes that a query after fewer cuts is never more than
# this many tokens shorter than one after more cuts. Measured: at most 4, on posts, code, URLs, emoji,
# CJK and runs of one character, with the tiny tokenizer and with a 50k-token byte-level BPE trained on
# code and posts. The wide margin costs little: the walk re-encodes the cuts within it, queries of about
# `length` tokens.
TRUNCATION_SLACK = 64


def truncation_ends(text: str, truncate_text: str) -> list:
    """Where smart truncation ends the field after 0, 1, 2, ... cuts (it keeps `text[:end]`): at the
    last `truncate_text` while there is one, then one character shorter each time, down to 0."""
    if not truncate_text:
        raise ValueError("truncate_text is empty: smart truncation would never shorten the field")
    ends = [len(text)]
    index = text.rfind(truncate_text)
    while index != -1:
        ends.append(index)
        index = text.rfind(truncate_text, 0, index)
    return ends + list(range(ends[-1] - 1, -1, -1))


def smart_truncate(fields: dict, params: TaskParams, tokenizer) -> tuple:
    """OpenAI's smart truncation: while the formatted query exceeds `params.length` tokens, cut the
    truncate field at its last `truncate_text` (dropping it and all after), or drop its last
    character when none is left. As in the paper, only a field that is already empty while the query
    is still too long is an error: a field cut down to whitespace (or nothing) whose query then fits
    is kept. Returns (query tokens, number of cuts).

    Re-encoding the query after every cut, as the paper does, is quadratic in the length of the field
    (754 s for a 65k-character post without newlines). So a bisection first finds a cut whose query is
    longer than `length + TRUNCATION_SLACK` while the next one's is not: by the slack's assumption no
    earlier cut fits either, and the paper's cut-by-cut walk starts there. It stops at the first cut
    that fits, as the paper's does: the tokens and the number of cuts are the same."""
    key, length = params.truncate_field, params.length
    text = fields[key]
    ends = truncation_ends(text, params.truncate_text)

    def encode(cuts: int) -> list:
        return tokenizer.encode(params.format_str.format(**{**fields, key: text[:ends[cuts]]}))

    cuts, tokens = 0, encode(0)
    if len(tokens) > length + TRUNCATION_SLACK:
        upper = len(ends) - 1  # (no cut beyond the empty field)
        while upper - cuts > 1:
            middle = (cuts + upper) // 2
            middle_tokens = encode(middle)
            if len(middle_tokens) > length + TRUNCATION_SLACK:
                cuts, tokens = middle, middle_tokens
            else:
                upper = middle
    while len(tokens) > length:
        if cuts == len(ends) - 1:
            raise FieldError(key, f"became empty during smart truncation, and the query is still "
                                  f"{len(tokens)} tokens > length {params.length}")
        cuts += 1
        tokens = encode(cuts)
    return tokens, cuts


def left_pad(tokens: list, length: int, pad_id: int) -> list:
    return [pad_id] * (length - len(tokens)) + tokens


def right_pad(tokens: list, length: int, pad_id: int, column: str, flag: str) -> list:
    """Right-pads to `length`; a longer sequence is an error (nothing is silently cut)."""
    if len(tokens) > length:
        raise FieldError(column, f"{len(tokens)} tokens > {flag} {length}")
    return tokens + [pad_id] * (length - len(tokens))


def process_query(fields: dict, params: TaskParams, tokenizer) -> dict:
    tokens, cuts = smart_truncate(fields, params, tokenizer)
    return {
        "query_token": left_pad(tokens, params.length, tokenizer.pad_token_id),
        "query": tokenizer.decode(tokens, skip_special_tokens=True).lstrip(),
        "query_token_len": len(tokens),
        "query_truncations": cuts,
    }


def encode_query_response(query: str, response: str, length: int, tokenizer, column: str, flag: str) -> dict:
    """`query.strip() + response` re-encoded (no left padding), right-padded, plus the copy whose
    query positions are set to pad (the response-label mask)."""
    stripped = query.strip()
    tokens = tokenizer.encode(stripped + response)
    query_len = len(tokenizer.encode(stripped))
    padded = right_pad(tokens, length, tokenizer.pad_token_id, column, flag)
    return {
        column: padded,
        f"{column}_response_label": [tokenizer.pad_token_id] * query_len + padded[query_len:],
        f"{column}_len": len(tokens),
    }


def process_sft_row(row: dict, params: TaskParams, tokenizer) -> dict:
    out = process_query(row, params, tokenizer)
    # the upstream summary has no leading space; EOS is appended as text (id of <|endoftext|>)
    reference_response = " " + row["summary"] + tokenizer.eos_token
    # (no BOS: a response follows its query; load_tokenizer)
    response_tokens = tokenizer.encode(reference_response, add_special_tokens=False)
    out["reference_response"] = reference_response
    out["reference_response_token"] = right_pad(
        response_tokens, params.max_sft_response_length, tokenizer.pad_token_id,
        "reference_response_token", "--tldr_params.max_sft_response_length")
    out["reference_response_token_len"] = len(response_tokens)
    out["query_reference_response"] = out["query"].strip() + reference_response
    out.update(encode_query_response(
        out["query"], reference_response, params.max_sft_query_response_length, tokenizer,
        "query_reference_response_token", "--tldr_params.max_sft_query_response_length"))
    return out


def process_preference_row(row: dict, params: TaskParams, params_flag: str, tokenizer) -> dict:
    out = process_query(row["info"], params, tokenizer)
    choice = row["choice"]
    summaries = row["summaries"]
    # upstream summaries already start with a space: only EOS is appended
    for name, summary in (("chosen", summaries[choice]), ("rejected", summaries[1 - choice])):
        response = summary["text"] + tokenizer.eos_token
        tokens = tokenizer.encode(response, add_special_tokens=False)
        out[name] = response
        out[f"{name}_token"] = right_pad(tokens, params.max_rm_response_length, tokenizer.pad_token_id,
                                         f"{name}_token", f"{params_flag}.max_rm_response_length")
        out[f"{name}_token_len"] = len(tokens)
        out[f"query_{name}"] = out["query"].strip() + response
        out.update(encode_query_response(
            out["query"], response, params.max_rm_query_response_length, tokenizer,
            f"query_{name}_token", f"{params_flag}.max_rm_query_response_length"))
        out[f"{name}_policy"] = summary["policy"]
    out["policies"] = "--".join(sorted([summaries[0]["policy"], summaries[1]["policy"]]))
    return out


# ---------------------------------------------------------------------------------------------
# Whole splits
# ---------------------------------------------------------------------------------------------

TOKENS = List(Value("int64"))
INFO = {k: Value("string") for k in ("id", "post", "title", "subreddit", "site", "article")}
SUMMARY = {"text": Value("string"), "policy": Value("string"), "note": Value("string")}
SFT_FEATURES = Features({
    **{k: Value("string") for k in ("id", "subreddit", "title", "post", "summary")},
    "query_token": TOKENS, "query": Value("string"), "query_token_len": Value("int64"),
    "query_truncations": Value("int64"), "reference_response": Value("string"),
    "reference_response_token": TOKENS, "reference_response_token_len": Value("int64"),
    "query_reference_response": Value("string"), "query_reference_response_token": TOKENS,
    "query_reference_response_token_response_label": TOKENS,
    "query_reference_response_token_len": Value("int64"),
})
PREFERENCE_FEATURES = Features({
    "info": INFO, "summaries": List(SUMMARY), "choice": Value("int32"), "worker": Value("string"),
    "batch": Value("string"), "split": Value("string"), "extra": {"confidence": Value("int32")},
    "query_token": TOKENS, "query": Value("string"), "query_token_len": Value("int64"),
    "query_truncations": Value("int64"),
    **{f"{name}{suffix}": feature for name in ("chosen", "rejected") for suffix, feature in (
        ("", Value("string")), ("_token", TOKENS), ("_token_len", Value("int64")),
        ("_policy", Value("string")))},
    **{f"query_{name}{suffix}": feature for name in ("chosen", "rejected") for suffix, feature in (
        ("", Value("string")), ("_token", TOKENS), ("_token_response_label", TOKENS),
        ("_token_len", Value("int64")))},
    "policies": Value("string"),
})


class _RowJob:
    """Validates and processes one row; picklable for multiprocessing."""

    def __init__(self, kind: str, tokenizer, args: Args):
        self.kind, self.tokenizer, self.args = kind, tokenizer, args

    def __call__(self, row) -> dict:
        if self.kind == "sft":
            validate_sft_row(row)
            return row | process_sft_row(row, self.args.tldr_params, self.tokenizer)
        validate_preference_row(row)
        cnndm = row["batch"] in CNNDM_BATCHES
        params = self.args.cnndm_params if cnndm else self.args.tldr_params
        flag = "--cnndm_params" if cnndm else "--tldr_params"
        info = {k: row["info"].get(k) for k in INFO}
        kept = {k: row[k] for k in ("summaries", "choice", "worker", "batch", "split")}
        kept["summaries"] = [{k: s.get(k) for k in SUMMARY} for s in row["summaries"]]
        return kept | {"info": info, "extra": {"confidence": row["extra"]["confidence"]}} | \
            process_preference_row(row, params, flag, self.tokenizer)


def _guarded(job_and_row):
    job, (index, row) = job_and_row
    try:
        return index, job(row), None
    except FieldError as e:
        return index, None, (e.column, str(e))


def process_split(raw: RawSplit, job: _RowJob, num_proc: int, description: str) -> list:
    items = [(job, (i, row)) for i, row in enumerate(raw.rows)]
    if num_proc > 1:
        with Pool(num_proc) as pool:
            results = list(progress(pool.imap(_guarded, items, chunksize=64), len(items), description))
    else:
        results = [_guarded(item) for item in progress(items, len(items), description)]
    out = []
    for index, processed, error in results:
        if error is not None:
            column, message = error
            raise DataError(f"{raw.where(index)}: column '{column}': {message}")
        out.append(processed)
    return out


def build_datasets(args: Args, tokenizer) -> tuple:
    raw_sft = require_rows(load_raw(args.sft_dataset, SFT_SPLITS))
    raw_pref = require_rows(load_raw(args.preference_dataset, PREFERENCE_SOURCE_SPLITS, args.preference_config))
    sft_rows = {split: process_split(raw, _RowJob("sft", tokenizer, args), args.num_proc, f"sft {split}")
                for split, raw in raw_sft.items()}
    pref_rows = {split: process_split(raw, _RowJob("preference", tokenizer, args), args.num_proc,
                                      f"preference {split}")
                 for split, raw in raw_pref.items()}
    # the upstream validation split mixes TL;DR with CNN/DM rows: split them by batch name
    validation = pref_rows.pop("validation")
    pref_rows["validation"] = [r for r in validation if r["batch"] not in CNNDM_BATCHES]
    pref_rows["validation_cnndm"] = [r for r in validation if r["batch"] in CNNDM_BATCHES]
    sft = DatasetDict({s: Dataset.from_list(rows, features=SFT_FEATURES) for s, rows in sft_rows.items()})
    pref = DatasetDict({s: Dataset.from_list(rows, features=PREFERENCE_FEATURES) for s, rows in pref_rows.items()})
    return sft, pref


def column(ds: Dataset, name: str) -> list:
    """A column as a list, read at once: `ds[name]` is a lazy `datasets` Column that decodes row by row
    when iterated (about 15 s of the statistics and plots of hello_world's 6,000 posts and 12,000 pairs)."""
    return ds[name][:]


def data_issues(sft: DatasetDict, pref: DatasetDict) -> dict:
    """What passes the row checks but would mislead a later stage, as counts (0: none): an SFT id in
    two splits (a validation post seen in training inflates validation ROUGE), an SFT id repeated in
    one split, a comparison whose chosen and rejected summaries are the same text (the reward model
    cannot rank it, and it counts as wrong in accuracy), and the same comparison (query and the two
    summaries, in either order) in the preference train split and a validation split."""
    issues = {}
    ids = {split: column(ds, "id") for split, ds in sft.items()}
    for a, b in itertools.combinations(ids, 2):
        issues[f"sft ids in both {a} and {b}"] = len(set(ids[a]) & set(ids[b]))
    for split, split_ids in ids.items():
        issues[f"sft ids repeated within {split}"] = len(split_ids) - len(set(split_ids))

    def comparisons(ds) -> set:
        rows = zip(column(ds, "query"), column(ds, "chosen"), column(ds, "rejected"))
        return {(q, frozenset((c, r))) for q, c, r in rows}

    for split, ds in pref.items():
        issues[f"preference {split} pairs with identical chosen and rejected"] = sum(
            c == r for c, r in zip(column(ds, "chosen"), column(ds, "rejected")))
    train = comparisons(pref["train"])
    for split in (s for s in pref if s != "train"):
        issues[f"preference comparisons in both train and {split}"] = len(train & comparisons(pref[split]))
    return issues


def report_data_issues(issues: dict, strict: bool, console: Console) -> None:
    """Warns with the count of each issue found, or with `strict` refuses the data."""
    found = {name: count for name, count in issues.items() if count}
    if not found:
        return
    listing = "; ".join(f"{name}: {count}" for name, count in found.items())
    if strict:
        raise DataError(f"--strict_data: {listing}")
    console.print(f"[bold yellow]WARNING:[/] the data passes the row checks, but {listing} (counts in stats.json "
                  "under data_issues; --strict_data refuses such data)", highlight=False, soft_wrap=True)


# ---------------------------------------------------------------------------------------------
# Statistics and plots
# ---------------------------------------------------------------------------------------------

SFT_LENGTHS = ("query_token_len", "reference_response_token_len", "query_reference_response_token_len")
PREFERENCE_LENGTHS = ("query_token_len", "chosen_token_len", "rejected_token_len",
                      "query_chosen_token_len", "query_rejected_token_len")


def statistics(sft: DatasetDict, pref: DatasetDict) -> dict:
    stats = {"rows": {}, "max_lengths": {}, "truncated_queries": {}, "labels": {}}
    for name, dd, columns in (("sft", sft, SFT_LENGTHS), ("preference", pref, PREFERENCE_LENGTHS)):
        for split, ds in dd.items():
            key = f"{name}/{split}"
            stats["rows"][key] = len(ds)
            stats["max_lengths"][key] = {c: int(max(column(ds, c), default=0)) for c in columns}
            stats["truncated_queries"][key] = int(sum(1 for n in column(ds, "query_truncations") if n > 0))
    for split, ds in pref.items():
        confidence = Counter(c["confidence"] for c in column(ds, "extra"))
        stats["labels"][split] = {
            "choice_0_fraction": float(np.mean(np.array(column(ds, "choice")) == 0)) if len(ds) else 0.0,
            "confidence": {str(k): v for k, v in sorted(confidence.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))},
            "chosen_policy": dict(sorted(Counter(column(ds, "chosen_policy")).items())),
            "rejected_policy": dict(sorted(Counter(column(ds, "rejected_policy")).items())),
            "batch": dict(sorted(Counter(column(ds, "batch")).items())),
        }
    return stats


def plot_lengths(dd: DatasetDict, columns: tuple, limits: dict, title: str, path: str) -> None:
    ncols = min(3, len(columns))
    nrows = -(-len(columns) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.6 * nrows), squeeze=False)
    for ax in axes.flat[len(columns):]:
        ax.set_visible(False)
    for ax, name in zip(axes.flat, columns):
        for split, ds in dd.items():
            if len(ds):
                ax.hist(column(ds, name), bins=40, histtype="stepfilled", alpha=0.55, label=f"{split} (n={len(ds)})")
        for limit_name, limit in limits.get(name, []):
            ax.axvline(limit, color="black", linestyle="--", linewidth=1)
            ax.annotate(limit_name, (limit, ax.get_ylim()[1] * 0.95), rotation=90, ha="right", va="top", fontsize=7)
        ax.set_xlabel(f"{name} (tokens)")
        ax.set_ylabel("rows")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def plot_labels(pref: DatasetDict, path: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    width = 0.8 / max(1, len(pref))
    confidences = list(range(1, 10))
    for k, (split, ds) in enumerate(pref.items()):
        counts = Counter(c["confidence"] for c in column(ds, "extra"))
        total = max(1, len(ds))
        axes[0].bar(np.arange(9) + k * width, [counts[c] / total for c in confidences], width, label=split)
    axes[0].set_xticks(np.arange(9) + width * (len(pref) - 1) / 2, [str(c) for c in confidences])
    axes[0].set_xlabel("labeller confidence")
    axes[0].set_ylabel("fraction of pairs")
    axes[0].legend(fontsize=8)
    axes[0].set_title("confidence")

    train = pref["train"]
    chosen, rejected = Counter(column(train, "chosen_policy")), Counter(column(train, "rejected_policy"))
    policies = sorted(set(chosen) | set(rejected))
    y = np.arange(len(policies))
    axes[1].barh(y, [chosen[p] for p in policies], label="chosen")
    axes[1].barh(y, [rejected[p] for p in policies], left=[chosen[p] for p in policies], label="rejected")
    axes[1].set_yticks(y, policies, fontsize=7)
    axes[1].set_xlabel("summaries in train pairs")
    axes[1].legend(fontsize=8)
    axes[1].set_title("policies (train)")

    pairs = Counter(column(train, "policies")).most_common(20)
    axes[2].barh(np.arange(len(pairs)), [n for _, n in pairs])
    axes[2].set_yticks(np.arange(len(pairs)), [p for p, _ in pairs], fontsize=6)
    axes[2].invert_yaxis()
    axes[2].set_xlabel("train pairs")
    axes[2].set_title("most common policy pairs (train)")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def write_visuals(args: Args, sft: DatasetDict, pref: DatasetDict, folder: str) -> None:
    os.makedirs(folder)
    t, c = args.tldr_params, args.cnndm_params
    plot_lengths(sft, SFT_LENGTHS, {
        "query_token_len": [("length", t.length)],
        "reference_response_token_len": [("max", t.max_sft_response_length)],
        "query_reference_response_token_len": [("max", t.max_sft_query_response_length)],
    }, "SFT dataset: token lengths (unpadded)", os.path.join(folder, "sft_token_lengths.png"))
    plot_lengths(pref, PREFERENCE_LENGTHS, {
        "query_token_len": [("tldr length", t.length), ("cnndm length", c.length)],
        "chosen_token_len": [("tldr max", t.max_rm_response_length), ("cnndm max", c.max_rm_response_length)],
        "rejected_token_len": [("tldr max", t.max_rm_response_length), ("cnndm max", c.max_rm_response_length)],
        "query_chosen_token_len": [("tldr max", t.max_rm_query_response_length), ("cnndm max", c.max_rm_query_response_length)],
        "query_rejected_token_len": [("tldr max", t.max_rm_query_response_length), ("cnndm max", c.max_rm_query_response_length)],
    }, "preference dataset: token lengths (unpadded)", os.path.join(folder, "preference_token_lengths.png"))
    plot_labels(pref, os.path.join(folder, "label_statistics.png"))


def print_maxima(stats: dict, console: Console) -> None:
    for name in ("sft", "preference"):
        keys = [k for k in stats["max_lengths"] if k.startswith(name + "/")]
        table = Table(title=f"{name}: observed maximum lengths (tokens, unpadded)")
        table.add_column("", no_wrap=True)
        for key in keys:
            table.add_column(key.split("/")[1], justify="right")
        table.add_row("rows", *[str(stats["rows"][k]) for k in keys])
        table.add_row("smart-truncated queries", *[str(stats["truncated_queries"][k]) for k in keys])
        for column in stats["max_lengths"][keys[0]]:
            table.add_row(column.removesuffix("_token_len"), *[str(stats["max_lengths"][k][column]) for k in keys])
        console.print(table)


# ---------------------------------------------------------------------------------------------


def push_datasets_to_hub(args: Args, sft: DatasetDict, pref: DatasetDict, output_dir: str) -> None:
    from huggingface_hub import HfApi

    api = HfApi()
    entity = args.hf_entity or api.whoami()["name"]
    stamp = int(time.time())
    for name, dd in (("summarize_from_feedback_tldr_3_filtered", sft), ("summarize_from_feedback", pref)):
        repo_id = f"{entity}/{name}_oai_preprocessing_{stamp}"
        dd.push_to_hub(repo_id)
        api.upload_folder(repo_id=repo_id, repo_type="dataset", folder_path=os.path.join(output_dir, "dataset_visuals"),
                          path_in_repo="dataset_visuals")
        api.upload_file(repo_id=repo_id, repo_type="dataset", path_or_fileobj=__file__, path_in_repo="create_dataset.py")
        print(f"pushed https://huggingface.co/datasets/{repo_id}")


def run(args: Args, console: Optional[Console] = None) -> dict:
    console = console or Console()
    output_dir = args.output_dir.rstrip("/")
    if os.path.exists(output_dir) and not args.overwrite:
        raise FileExistsError(f"{output_dir} exists; pass --overwrite to replace it")
    tokenizer = load_tokenizer(args.base_model)
    check_architecture(args.base_model)  # (SFT's hours are not spent on a model the reward model refuses)
    sft, pref = build_datasets(args, tokenizer)
    issues = data_issues(sft, pref)
    report_data_issues(issues, args.strict_data, console)
    stats = {**statistics(sft, pref), "data_issues": issues}
    # only what shapes the content, so that reruns anywhere give identical files
    stats["args"] = {k: v for k, v in asdict(args).items()
                     if k in ("base_model", "sft_dataset", "preference_dataset", "tldr_params", "cnndm_params")}
    tmp_dir = f"{output_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    disable_progress_bars()  # saving takes well under a second; our own bars cover the long work
    try:
        record = dataset_tokenizer_record(tokenizer, args.base_model)
        for name, dataset in (("sft", sft), ("preference", pref)):
            dataset.save_to_disk(os.path.join(tmp_dir, name))
            with open(os.path.join(tmp_dir, name, TOKENIZER_RECORD), "w") as f:  # (every stage checks it)
                json.dump(record, f, indent=2)
        write_visuals(args, sft, pref, os.path.join(tmp_dir, "dataset_visuals"))
        with open(os.path.join(tmp_dir, "stats.json"), "w") as f:
            json.dump(stats, f, indent=2)
        old_dir = f"{output_dir}.old-{os.getpid()}"
        if os.path.exists(output_dir):
            os.replace(output_dir, old_dir)
        os.replace(tmp_dir, output_dir)
        shutil.rmtree(old_dir, ignore_errors=True)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    print_maxima(stats, console)
    console.print(f"wrote {output_dir}/sft, {output_dir}/preference, {output_dir}/dataset_visuals/, {output_dir}/stats.json")
    if args.push_to_hub:
        push_datasets_to_hub(args, sft, pref, output_dir)
    return stats


def main(args: Args) -> None:
    quiet_libraries()
    try:
        run(args)
    except (DataError, FileExistsError, ValueError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(tyro.cli(Args))
