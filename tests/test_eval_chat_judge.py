"""The chat judge of eval/judges.py against a stand-in OpenAI-compatible server on 127.0.0.1, through
eval/rlhf_scaling_plot.py: slots map back, bad answers are re-asked then reported, 429 and 500 are
retried, concurrency stays bounded, and a rerun is served from the cache."""

import json
import os
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pandas as pd
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eval"))
import judges
import rlhf_scaling_plot as rlhf
from test_eval_rlhf_scaling_plot import word_tokenizer  # one token per word

SUMMARIES = re.compile(r"Summary A:\n(.*?)\n\nSummary B:\n(.*?)\n\nWrite one sentence", re.DOTALL)
ROW = re.compile(r"row (\d+) (\w+)")


class StandInJudge:
    """POST /v1/chat/completions: prefers the summary that contains GOOD. The row's tag (in its post)
    picks a misbehaviour: GARBLE_ONCE (no verdict line, then a valid one when re-asked),
    GARBLE_ALWAYS, RATE_LIMIT (429 once), SERVER_ERROR (500 once), DOT ("**Preferred:** A.")."""

    def __init__(self):
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = 0
        self.requests = []  # (post, number of messages, status)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def answer(self, body):
        messages = body["messages"]
        prompt = messages[1]["content"]
        post = prompt.split("Post:\n", 1)[1].split("\n\nSummary A:", 1)[0]
        tag = ROW.search(post).group(2)
        with self.lock:
            earlier = sum(1 for p, _, _ in self.requests if p == post)
        if tag == "RATE_LIMIT" and earlier == 0:
            return 429, {"error": {"message": "slow down", "type": "rate_limit_exceeded"}}, post, len(messages)
        if tag == "SERVER_ERROR" and earlier == 0:
            return 500, {"error": {"message": "oops", "type": "server_error"}}, post, len(messages)
        a, b = SUMMARIES.search(prompt).groups()
        slot = "A" if "GOOD" in a else "B"
        assert ("GOOD" in b) == (slot == "B"), "exactly one summary is GOOD"
        text = f"Comparison: Summary {slot} keeps the key points.\nPreferred: {slot}"
        if tag == "GARBLE_ALWAYS" or (tag == "GARBLE_ONCE" and len(messages) == 2):
            text = "Both summaries have merits; it is hard to say. Preferred: A or B"
        elif tag == "DOT":
            text = f"Comparison: {slot} is better.\n**Preferred:** {slot}."
        completion = {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                      "choices": [{"index": 0, "finish_reason": "stop",
                                   "message": {"role": "assistant", "content": text}}],
                      "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        return 200, completion, post, len(messages)

    def _handler(self):
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                assert self.path == "/v1/chat/completions"
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge.lock:
                    judge.in_flight += 1
                    judge.max_in_flight = max(judge.max_in_flight, judge.in_flight)
                try:
                    time.sleep(0.05)  # long enough for requests to overlap
                    status, payload, post, n_messages = judge.answer(body)
                finally:
                    with judge.lock:
                        judge.in_flight -= 1
                with judge.lock:
                    judge.requests.append((post, n_messages, status))
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        return Handler

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


# (tag, policy response, reference) per row; which text is GOOD decides the expected verdict
ROWS = [("PLAIN", "GOOD summary 0", "reference 0"), ("PLAIN", "weak summary 1", "GOOD reference 1"),
        ("PLAIN", "GOOD summary 2", "reference 2"), ("PLAIN", "weak summary 3", "GOOD reference 3"),
        ("PLAIN", "GOOD summary 4", "reference 4"), ("GARBLE_ONCE", "GOOD summary 5", "reference 5"),
        ("DOT", "GOOD summary 6", "reference 6"),
        ("GARBLE_ALWAYS", "GOOD summary 7", "reference 7"), ("RATE_LIMIT", "weak summary 8", "GOOD reference 8"),
        ("SERVER_ERROR", "GOOD summary 9", "reference 9"), ("DOT", "weak summary 10", "GOOD reference 10"),
        ("PLAIN", "GOOD summary 11", "reference 11"), ("PLAIN", "weak summary 12", "GOOD reference 12"),
        ("PLAIN", "GOOD summary 13", "reference 13")]
RUNS = {"sft": ROWS[:7], "ppo_left_padding": ROWS[7:]}


def write_runs(runs_dir):
    for exp_name, rows in RUNS.items():
        folder = os.path.join(runs_dir, f"{exp_name}__1__100")
        os.makedirs(folder)
        with open(os.path.join(folder, "args.json"), "w") as f:
            json.dump({"exp_name": exp_name, "base_model": "EleutherAI/pythia-1b-deduped", "seed": 1}, f)
        start = ROWS.index(rows[0])
        pd.DataFrame({
            "query": [f"SUBREDDIT: r/test\n\nPOST: row {start + i} {tag}\n\nTL;DR:" for i, (tag, _, _) in enumerate(rows)],
            "postprocessed_response": [" " + response for _, response, _ in rows],
            "reference_responses": [" " + reference for _, _, reference in rows],
        }).to_csv(os.path.join(folder, "validation_table.csv"), index=False)


def test_parse_preference():
    for reply, expected in [
        ("Comparison: A is better.\nPreferred: A", "A"), ("Preferred: B.", "B"), ("**Preferred:** A", "A"),
        ("**Preferred: B**", "B"), ("preferred: (b)", "B"), ("Preferred: Summary A", "A"),
        ("Comparison: x\nPreferred: A\n", "A"), ("Preferred: A\nPreferred: A.", "A"),
        ("Preferred: A or B", None), ("Preferred: neither", None), ("Preferred: A, because it is short", None),
        ("A", None), ("The answer is Preferred: A", None), ("Preferred: A\nPreferred: B", None), ("", None), (None, None),
    ]:
        assert judges.parse_preference(reply) == expected, reply


def test_slot_coin_is_seeded_and_fair():
    slots = [judges.policy_slot(1, f"post {i}", "x", "y") for i in range(400)]
    assert slots == [judges.policy_slot(1, f"post {i}", "x", "y") for i in range(400)]  # stable across calls
    assert 160 < slots.count("A") < 240
    assert slots != [judges.policy_slot(2, f"post {i}", "x", "y") for i in range(400)]


def test_chat_judge_needs_model_and_key(monkeypatch, tmp_path):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ValueError, match="--chat.model"):
        judges.ChatJudge(judges.ChatJudgeConfig(api_key="k"))
    with pytest.raises(ValueError, match="OPENAI_API_KEY"):
        judges.ChatJudge(judges.ChatJudgeConfig(model="m", cache=str(tmp_path / "c.jsonl")))


def test_chat_judge_against_stand_in_server(tmp_path, monkeypatch):
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
                 "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    runs_dir, out, cache = str(tmp_path / "runs"), str(tmp_path / "out"), str(tmp_path / "cache.jsonl")
    write_runs(runs_dir)
    tokenizer = word_tokenizer(tmp_path / "tokenizer")
    with StandInJudge() as server:
        monkeypatch.setenv("OPENAI_BASE_URL", server.base_url)  # the base URL from the environment
        # one order per row (the seeded coin); both orders: the test below
        chat = judges.ChatJudgeConfig(model="stand-in", api_key="test-key", max_concurrency=3, parse_retries=2,
                                      backoff=0.01, cache=cache, seed=3, both_orders=False)
        args = rlhf.Args(runs_dir=runs_dir, out=out, judge="chat", chat=chat, tokenizer=tokenizer)
        rlhf.main(args)

        per_post = {}
        for post, n_messages, status in server.requests:
            number, tag = ROW.search(post).groups()
            per_post.setdefault(tag + number, []).append((n_messages, status))
        assert per_post["GARBLE_ONCE5"] == [(2, 200), (4, 200)]  # re-asked with its answer and a reminder
        assert per_post["GARBLE_ALWAYS7"] == [(2, 200), (4, 200), (6, 200)]  # 1 + parse_retries, then unparsed
        assert per_post["RATE_LIMIT8"] == [(2, 429), (2, 200)]
        assert per_post["SERVER_ERROR9"] == [(2, 500), (2, 200)]
        assert len(server.requests) == len(ROWS) + 1 + 2 + 1 + 1
        assert 1 < server.max_in_flight <= 3

        judged = pd.concat([pd.read_csv(os.path.join(out, "judged", f"{exp}__1__100.csv"), keep_default_na=False)
                            for exp in RUNS], ignore_index=True)
        expected = ["unparsed" if tag == "GARBLE_ALWAYS" else "policy" if "GOOD" in response else "reference"
                    for tag, response, _ in ROWS]
        assert judged["verdict"].tolist() == expected
        assert set(judged["policy_slot"]) == {"A", "B"}  # the coin used both slots
        parsed = judged[judged["verdict"] != "unparsed"]
        # the preferred slot is where the GOOD text was put: the policy's slot exactly when it is GOOD
        assert ((parsed["preferred"] == parsed["policy_slot"]) == parsed["response"].str.contains("GOOD")).all()
        assert judged.loc[judged["verdict"] == "unparsed", "reply"].str.contains("A or B").all()

        runs = pd.read_csv(os.path.join(out, "rlhf_scale_plot_runs.csv")).set_index("policy")
        assert runs.loc["SFT", ["rows", "wins", "losses", "unparsed"]].tolist() == [7, 5, 2, 0]
        assert runs.loc["PPO", ["rows", "wins", "losses", "unparsed"]].tolist() == [7, 3, 3, 1]
        assert runs.loc["PPO", "win_rate"] == pytest.approx(3 / 6)  # the unparsed row counts for no side
        assert pd.read_csv(os.path.join(out, "rlhf_scale_plot.csv")).set_index("policy").loc["PPO", "unparsed"] == 1
        first_tables = {name: open(os.path.join(out, name)).read() for name in ("rlhf_scale_plot.csv", "rlhf_scale_plot_runs.csv")}
        with open(cache) as f:
            assert len(f.readlines()) == len(ROWS)

        # a rerun is served from the cache: not one request, the same numbers
        n_requests = len(server.requests)
        rlhf.main(args)
        assert len(server.requests) == n_requests
        for name, text in first_tables.items():
            assert open(os.path.join(out, name)).read() == text

        # --chat.paper_parsing reads the same cached first replies as the paper's oai.py: no new
        # request, and "**Preferred:** A." or an unreadable first reply counts for the reference
        rlhf.main(rlhf.Args(runs_dir=runs_dir, out=out, judge="chat", tokenizer=tokenizer,
                            chat=judges.ChatJudgeConfig(**{**vars(chat), "paper_parsing": True})))
        assert len(server.requests) == n_requests
        judged = pd.concat([pd.read_csv(os.path.join(out, "judged", f"{exp}__1__100.csv"), keep_default_na=False)
                            for exp in RUNS], ignore_index=True)
        paper = ["reference" if tag in ("GARBLE_ONCE", "GARBLE_ALWAYS", "DOT") else verdict
                 for (tag, _, _), verdict in zip(ROWS, expected)]
        assert judged["verdict"].tolist() == paper
        runs = pd.read_csv(os.path.join(out, "rlhf_scale_plot_runs.csv")).set_index("policy")
        assert runs.loc["SFT", ["wins", "unparsed"]].tolist() == [3, 0] and runs.loc["PPO", "win_rate"] == pytest.approx(3 / 7)


def test_combine_orders_known_answers():
    assert judges.combine_orders(["policy"]) == ("policy", None)  # one order
    assert judges.combine_orders(["policy", "policy"]) == ("policy", False)
    assert judges.combine_orders(["reference", "reference"]) == ("reference", False)
    assert judges.combine_orders(["policy", "reference"]) == ("tie", True)  # the judge followed the position
    assert judges.combine_orders(["unparsed", "reference"]) == ("reference", None)
    assert judges.combine_orders(["unparsed", "unparsed"]) == ("unparsed", None)


def test_both_orders_turn_a_position_bias_into_ties(tmp_path, monkeypatch):
    """--chat.both_orders (the default): every row asked with the policy's summary as A and as B, both
    cached; a judge that reads the summaries agrees with itself (no flips, the single-order verdicts),
    a judge that always answers A flips every row: flip rate 1, every row a tie, win rate 0.5."""
    for name in ("OPENAI_API_KEY", "OPENAI_BASE_URL", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
                 "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    runs_dir, out = str(tmp_path / "runs"), str(tmp_path / "out")
    write_runs(runs_dir)
    tokenizer = word_tokenizer(tmp_path / "tokenizer")
    plain = [i for i, (tag, _, _) in enumerate(ROWS) if tag == "PLAIN"]
    with StandInJudge() as server:
        chat = judges.ChatJudgeConfig(model="stand-in", api_key="k", base_url=server.base_url, backoff=0.01,
                                      cache=str(tmp_path / "cache.jsonl"))
        assert chat.both_orders
        rlhf.main(rlhf.Args(runs_dir=runs_dir, out=out, judge="chat", chat=chat, tokenizer=tokenizer))
        judged = pd.concat([pd.read_csv(os.path.join(out, "judged", f"{exp}__1__100.csv"), keep_default_na=False)
                            for exp in RUNS], ignore_index=True)
        assert (judged["policy_slot"] == "A,B").all()
        rows = judged.iloc[plain]
        assert rows["verdict"].tolist() == ["policy" if "GOOD" in ROWS[i][1] else "reference" for i in plain]
        assert (rows["flipped"].astype(str) == "False").all()
        with open(chat.cache) as f:  # each order its own cached prompt
            assert len({json.loads(line)["key"] for line in f}) == 2 * len(ROWS)
        runs = pd.read_csv(os.path.join(out, "rlhf_scale_plot_runs.csv")).set_index("policy")
        assert runs.loc["SFT", "flips"] == 0 and runs.loc["SFT", "flip_rate"] == 0.0

        def always_a(body):
            text = "Comparison: A reads better.\nPreferred: A"
            post = body["messages"][1]["content"].split("Post:\n", 1)[1].split("\n\nSummary A:", 1)[0]
            return 200, {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                         "choices": [{"index": 0, "finish_reason": "stop",
                                      "message": {"role": "assistant", "content": text}}]}, post, 2
        server.answer = always_a
        chat = judges.ChatJudgeConfig(**{**vars(chat), "cache": str(tmp_path / "biased.jsonl")})
        rlhf.main(rlhf.Args(runs_dir=runs_dir, out=out, judge="chat", chat=chat, tokenizer=tokenizer))
        runs = pd.read_csv(os.path.join(out, "rlhf_scale_plot_runs.csv")).set_index("policy")
        for policy in ("SFT", "PPO"):
            assert runs.loc[policy, "flip_rate"] == 1.0 and runs.loc[policy, "win_rate"] == 0.5
            assert runs.loc[policy, "ties"] == runs.loc[policy, "rows"] == runs.loc[policy, "flips"]


def test_paper_parsing_known_answers():
    key = "ab" * 32
    assert judges.paper_preference("Comparison: fine.\nPreferred: B", key) == "B"
    assert judges.paper_preference("Comparison: fine.\nPreferred: A.", key) == "A."  # never a slot: a loss
    assert judges.paper_preference("**Preferred:** A", key) == "** A"
    # no field: a coin, fixed by the row's key
    coins = [judges.paper_preference("I cannot decide.", f"{i:064x}") for i in range(200)]
    assert set(coins) == {"A", "B"} and coins == [judges.paper_preference("?", f"{i:064x}") for i in range(200)]


def test_api_errors_give_up_with_a_clear_message(tmp_path, monkeypatch):
    """A server that keeps failing stops the run after api_retries resends, naming the cache."""
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with StandInJudge() as server:
        server.answer = lambda body: (500, {"error": {"message": "down"}}, "row 0 X", len(body["messages"]))
        judge = judges.ChatJudge(judges.ChatJudgeConfig(model="m", api_key="k", base_url=server.base_url,
                                                        api_retries=2, backoff=0.01, cache=str(tmp_path / "c.jsonl"),
                                                        both_orders=False))
        with pytest.raises(RuntimeError, match="failed 3 times.*rerun to go on"):
            judge.judge([("post", "a", "b")])
        assert len(server.requests) == 3
