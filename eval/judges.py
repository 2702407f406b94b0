"""Judges that compare a policy's summary of a post with the post's reference summary.

- `gold_verdicts`: the exact judge of the synthetic task (embedded default, offline, instant).
- `ChatJudge`: an LLM judge behind any OpenAI-compatible chat-completions endpoint (OpenAI, vLLM,
  ...), as in the paper (which used gpt-3.5-turbo-0125).

Each judged row gets a verdict: "policy" (the policy's summary is preferred), "reference", "tie"
(gold judge only: equal scores) or "unparsed" (chat judge only: no readable answer after retries).
The win rate is (policy + tie / 2) / (rows - unparsed): an unreadable answer is reported, never
counted for either side (the original picked a random side on a parse failure, and counted
answers such as "A." as losses for the policy).
"""

import asyncio
import hashlib
import json
import os
import random
import re
from dataclasses import dataclass
from typing import Optional

from rich.progress import Progress

from summarize_from_feedback_details.gold_judge import EOS_TEXT, gold_preference

PAD_TEXT = "[PAD]"
VERDICTS = ("policy", "reference", "tie", "unparsed")


def clean_summary(text: str) -> str:
    """A summary as a reader sees it: up to the first EOS, without pad tokens (tables decoded with
    special tokens keep both), without surrounding whitespace."""
    return text.split(EOS_TEXT)[0].replace(PAD_TEXT, "").strip()


def clean_post(query: str) -> str:
    """The post of a TL;DR query (or the article of a CNN/DM one): pad tokens and the trailing
    `TL;DR:` prompt removed."""
    post = query.replace(PAD_TEXT, "").strip()
    return post[: -len("TL;DR:")].rstrip() if post.endswith("TL;DR:") else post


def gold_verdicts(rows: list) -> list:
    """Verdicts of the synthetic task's gold judge for (query, response, reference) rows."""
    labels = {1.0: "policy", 0.0: "reference", 0.5: "tie"}
    return [labels[gold_preference(query, response, reference)] for query, response, reference in rows]


def win_counts(verdicts: list) -> dict:
    """Counts of each verdict and the win rate: ties count half, unparsed rows are left out (NaN
    when nothing was judged)."""
    counts = {v: sum(1 for x in verdicts if x == v) for v in VERDICTS}
    judged = len(verdicts) - counts["unparsed"]
    counts["win_rate"] = (counts["policy"] + 0.5 * counts["tie"]) / judged if judged else float("nan")
    return counts


# ---------------------------------------------------------------------------------------------
# chat judge
# ---------------------------------------------------------------------------------------------


@dataclass
class ChatJudgeConfig:
    model: Optional[str] = None
    """judge model as the server names it (the paper: gpt-3.5-turbo-0125); required with --judge chat"""
    base_url: Optional[str] = None
    """OpenAI-compatible API root, e.g. http://localhost:8000/v1; default $OPENAI_BASE_URL, else OpenAI"""
    api_key: Optional[str] = None
    """default $OPENAI_API_KEY (servers that check none accept any non-empty string)"""
    temperature: Optional[float] = 0.0
    """sampling temperature of the judge; None sends none (for models that only take their default)"""
    max_concurrency: int = 8
    """requests in flight at once"""
    parse_retries: int = 2
    """times an answer without a valid `Preferred:` line is asked again before the row counts as unparsed"""
    api_retries: int = 6
    """times a request that failed with 429, 5xx, a timeout or a connection error is sent again"""
    backoff: float = 2.0
    """seconds before the first resend after an API error; doubled each time, at most 60, with jitter"""
    timeout: float = 120.0
    """seconds one request may take"""
    cache: str = "eval/judge_cache.jsonl"
    """every verdict (unparsed ones too), keyed by a hash of model, temperature and prompt: a rerun asks only for new rows"""
    seed: int = 1
    """seeds the per-row coin that puts the policy's summary in slot A or B (one order only)"""
    both_orders: bool = True
    """ask each pair twice, the policy's summary as A and as B (each order its own cached prompt); two
    verdicts that disagree (the judge followed the position, not the summary) count as a tie, and their
    share is reported as the flip rate. --chat.no_both_orders asks one order, from the seeded coin"""
    paper_parsing: bool = False
    """read verdicts as the paper's oai.py did, to compare with its numbers: one order (the coin), the
    first reply's text after `Preferred:` must be exactly A or B to count for the policy (so "A."
    counts for the reference), and a reply without `Preferred:` goes to a random side. Biased against
    the policy."""


SYSTEM_PROMPT = "You are a careful, impartial judge of text summaries."

PROMPT = """Below are a forum post and two summaries of it. Which summary does a better job of capturing \
the most important points of the post, without including unimportant or irrelevant details? \
Consider accuracy (nothing the post does not say), coverage (the key points are all there) and \
coherence (it reads clearly).

Post:
{post}

Summary A:
{summary_a}

Summary B:
{summary_b}

Write one sentence comparing the two summaries, then your choice on a line of its own, exactly in \
this format:
Comparison: <one sentence>
Preferred: <A or B>"""

REASK = """Your answer did not end with a line `Preferred: A` or `Preferred: B`. Answer again in exactly \
this format:
Comparison: <one sentence>
Preferred: <A or B>"""

# The accepted answer line, matched against each whole line of the reply (case-insensitive):
# "Preferred", a colon, optionally "Summary", then the letter A or B, optionally in brackets or
# quotes and optionally followed by one period; markdown emphasis (* _ `) and leading '#' around
# any of it are ignored. So "Preferred: A", "Preferred: A.", "**Preferred:** B", "preferred: (b)"
# and "Preferred: Summary A" are read; "Preferred: A or B", "Preferred: neither", "Preferred: A,
# because ...", a bare "A" and a reply with lines preferring both letters are not.
VERDICT_LINE = re.compile(
    r"^[\s*_`#]*preferred[\s*_`]*:[\s*_`]*(?:summary\s+)?[(\[\"']?\s*([ab])\s*[)\]\"']?\s*\.?[\s*_`]*$",
    re.IGNORECASE,
)


def parse_preference(reply: Optional[str]) -> Optional[str]:
    """"A" or "B" when the reply has verdict lines (see VERDICT_LINE) that all name that letter,
    else None."""
    letters = {m.group(1).upper() for m in map(VERDICT_LINE.match, (reply or "").splitlines()) if m}
    return letters.pop() if len(letters) == 1 else None


def paper_preference(reply: str, key: str) -> str:
    """The paper's oai.py reading of a reply: the text after `Preferred:`, stripped, taken as is
    ("A", "B", or anything else, which never matches the policy's slot); without that field, a coin
    (seeded by the row's cache key, so reruns agree)."""
    if "Preferred:" not in reply:
        return "A" if int(key, 16) % 2 == 0 else "B"
    return reply.split("Preferred:")[-1].strip()


def policy_slot(seed: int, post: str, response: str, reference: str) -> str:
    """The slot ("A" or "B") of the policy's summary: a fair coin against the judge's position
    bias, fixed by the seed and the row's texts so a rerun builds the same prompt (and hits the
    cache) whatever the row order or the other rows."""
    digest = hashlib.sha256(json.dumps([seed, post, response, reference]).encode()).digest()
    return "A" if digest[0] % 2 == 0 else "B"


def combine_orders(verdicts: list) -> tuple:
    """(verdict, flipped) of a row from its verdicts in each order asked: one order gives its own
    (flipped None); two parsed verdicts that agree give theirs, two that disagree a tie (flipped True);
    with one of two unparsed the parsed one stands (flipped None: no pair to compare)."""
    parsed = [v for v in verdicts if v != "unparsed"]
    if len(verdicts) < 2 or len(parsed) < 2:
        return (parsed[0] if parsed else "unparsed"), None
    return (parsed[0], False) if parsed[0] == parsed[1] else ("tie", True)


def build_messages(post: str, summary_a: str, summary_b: str) -> list:
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": PROMPT.format(post=post, summary_a=summary_a, summary_b=summary_b)}]


def cache_key(model: str, temperature: Optional[float], messages: list) -> str:
    return hashlib.sha256(json.dumps([model, temperature, messages]).encode()).hexdigest()


class VerdictCache:
    """Append-only JSONL of {"key", "model", "preferred" (A, B or null), "reply" (the last),
    "first_reply", "asks"}; each verdict is written as soon as it arrives, so an interrupted run
    keeps what it paid for."""

    def __init__(self, path: str):
        self.path = path
        self.entries = {}
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if line.strip():
                        entry = json.loads(line)
                        self.entries[entry["key"]] = entry

    def put(self, entry: dict) -> None:
        self.entries[entry["key"]] = entry
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")


class ChatJudge:
    def __init__(self, config: ChatJudgeConfig):
        if not config.model:
            raise ValueError("the chat judge needs a model: pass --chat.model (the paper used gpt-3.5-turbo-0125)")
        self.config = config
        self.api_key = config.api_key or os.environ.get("OPENAI_API_KEY")
        if not self.api_key:
            raise ValueError("the chat judge needs an API key: pass --chat.api_key or set OPENAI_API_KEY "
                             "(any non-empty string for a server that checks none)")
        self.base_url = config.base_url or os.environ.get("OPENAI_BASE_URL") or None
        self.cache = VerdictCache(config.cache)

    def judge(self, rows: list) -> list:
        """One dict per (query, response, reference) row: verdict, flipped (both orders disagreed;
        None with one order or an unparsed one), and per order asked (joined by ","; replies by a
        line of dashes): the policy's slot, the judge's preferred slot ("-" when unparsed), its last
        reply and the cache key."""
        both = self.config.both_orders and not self.config.paper_parsing
        prompts = []  # per row: (slot, messages, key) of each order asked
        for query, response, reference in rows:
            post, response, reference = clean_post(query), clean_summary(response), clean_summary(reference)
            slots = ("A", "B") if both else (policy_slot(self.config.seed, post, response, reference),)
            asks = []
            for slot in slots:
                messages = build_messages(post, *((response, reference) if slot == "A" else (reference, response)))
                asks.append((slot, messages, cache_key(self.config.model, self.config.temperature, messages)))
            prompts.append(asks)
        keys = [key for asks in prompts for _, _, key in asks]
        todo = {key: messages for asks in prompts for _, messages, key in asks if key not in self.cache.entries}
        cached = sum(1 for key in keys if key in self.cache.entries)
        print(f"chat judge {self.config.model}: {len(prompts)} rows, {'both orders' if both else 'one order'}, "
              f"{cached} verdicts cached in {self.config.cache}, {len(todo)} prompts to ask")
        if todo:
            asyncio.run(self._ask_all(todo))
        results = []
        for asks in prompts:
            read = [self._read(slot, key) for slot, _, key in asks]
            verdict, flipped = combine_orders([v for v, _, _ in read])
            results.append({"verdict": verdict, "flipped": flipped, "policy_slot": ",".join(s for s, _, _ in asks),
                            "preferred": ",".join(p or "-" for _, p, _ in read),
                            "reply": "\n-----\n".join(r for _, _, r in read), "key": ",".join(k for _, _, k in asks)})
        return results

    def _read(self, slot: str, key: str) -> tuple:
        """(verdict, preferred slot or None, last reply) of one cached prompt whose policy summary sat in `slot`."""
        entry = self.cache.entries[key]
        if self.config.paper_parsing:
            preferred = paper_preference(entry["first_reply"], key)
            return ("policy" if preferred == slot else "reference"), preferred, entry["reply"]
        preferred = entry["preferred"]
        verdict = "unparsed" if preferred is None else "policy" if preferred == slot else "reference"
        return verdict, preferred, entry["reply"]

    async def _ask_all(self, todo: dict) -> None:
        import openai

        # retries are ours (below), so the bound on concurrency and the backoff are the only ones
        client = openai.AsyncOpenAI(api_key=self.api_key, base_url=self.base_url, max_retries=0,
                                    timeout=self.config.timeout)
        semaphore = asyncio.Semaphore(self.config.max_concurrency)
        try:
            with Progress() as progress:
                task = progress.add_task(f"judging with {self.config.model}", total=len(todo))

                async def one(key: str, messages: list) -> None:
                    preferred, replies = await self._verdict(client, semaphore, messages)
                    self.cache.put({"key": key, "model": self.config.model, "preferred": preferred,
                                    "reply": replies[-1], "first_reply": replies[0], "asks": len(replies)})
                    progress.advance(task)

                await asyncio.gather(*(one(key, messages) for key, messages in todo.items()))
        finally:
            await client.close()

    async def _verdict(self, client, semaphore, messages: list) -> tuple:
        """Ask; while the answer has no valid verdict line, show the judge its answer and ask again,
        up to `parse_retries` times. Returns (preferred slot or None, every reply in order)."""
        conversation, replies = list(messages), []
        for _ in range(self.config.parse_retries + 1):
            replies.append(await self._complete(client, semaphore, conversation))
            preferred = parse_preference(replies[-1])
            if preferred is not None:
                break
            conversation += [{"role": "assistant", "content": replies[-1]}, {"role": "user", "content": REASK}]
        return preferred, replies

    async def _complete(self, client, semaphore, messages: list) -> str:
        """One chat completion; 429, 5xx, timeouts and connection errors are resent after an
        exponential backoff (the wait happens outside the semaphore, so other rows go on)."""
        import openai

        retryable = (openai.RateLimitError, openai.InternalServerError, openai.APIConnectionError)
        extra = {} if self.config.temperature is None else {"temperature": self.config.temperature}
        for attempt in range(self.config.api_retries + 1):
            try:
                async with semaphore:
                    completion = await client.chat.completions.create(model=self.config.model, messages=messages, **extra)
                return completion.choices[0].message.content or ""
            except retryable as error:
                if attempt == self.config.api_retries:
                    raise RuntimeError(f"the judge API failed {attempt + 1} times, last with {error!r}; the verdicts "
                                       f"so far are cached in {self.config.cache}, rerun to go on") from error
                await asyncio.sleep(min(self.config.backoff * 2 ** attempt, 60.0) * random.uniform(0.5, 1.0))
