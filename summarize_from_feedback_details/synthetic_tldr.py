"""Synthetic TL;DR: an offline stand-in for the TL;DR SFT data and the OpenAI comparisons.

The generator writes forum posts with a few key facts hidden among irrelevant filler, a human-like
reference summary per post, and comparison pairs between summaries from "policies" of varying
quality, all in the exact upstream schemas (DESIGN section 5 and 6):

    tldr_sft/{train,validation,test}.jsonl    id, subreddit, title, post, summary
    comparisons/{train,validation}.jsonl      info{...}, summaries[2]{text, policy, note}, choice,
                                              worker, batch, split, extra{confidence}

The gold judge `gold_score(post, summary)` reads only the two texts - the same inputs an LLM judge
gets - and scores coverage of the post's key facts, minus wrong facts, irrelevant details, garbled
words, repetition, unfinished text and excess length. Labels come from a noisy Bradley-Terry model
on the gold scores, so even a perfect reward model cannot reach 100% label accuracy.

    python -m summarize_from_feedback_details.synthetic_tldr --output_dir data/raw
"""

import contextlib
import functools
import json
import math
import os
import random
import re
import shutil
import sys
from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np
import tyro


@dataclass
class Args:
    output_dir: str = "data/raw"
    """folder that receives `tldr_sft/` and `comparisons/` (replaced as a whole)"""
    seed: int = 1
    """seed of the generator: the same seed writes the same files"""
    num_sft_train: int = 6000
    """posts with a reference summary in tldr_sft/train.jsonl"""
    num_sft_validation: int = 2000
    """posts with a reference summary in tldr_sft/validation.jsonl"""
    num_sft_test: int = 500
    """posts with a reference summary in tldr_sft/test.jsonl"""
    num_comparison_train: int = 12000
    """comparison pairs in comparisons/train.jsonl"""
    num_comparison_validation: int = 1200
    """TL;DR comparison pairs in comparisons/validation.jsonl (the news pairs come on top)"""
    num_comparison_validation_cnndm: int = 900
    """out-of-distribution "news" comparisons in the validation split (batch names of CNN/DM)"""
    label_temperature: float = 0.8
    """Bradley-Terry temperature on gold-score margins: P(A preferred) = sigmoid((sA - sB) / T)"""
    long_post_fraction: float = 0.12
    """posts that get long filler paragraphs at the end, so smart truncation has work to do"""
    minimal_pair_fraction: float = 0.5
    """comparison pairs that are minimal pairs (`minimal_pair`: one summary against the same words with
    one fact wrong or left out); the others compare the summaries of two policies (POLICY_WEIGHTS)"""
    omit_vs_wrong_fraction: float = 0.0
    """of the minimal pairs whose edited fact is optional, the share that sets the two edits against each
    other (`minimal_pair`: the fact left out against the fact stated wrong), so that a reward model sees
    that a wrong fact costs more than a missing one; 0 draws nothing for it (the default data unchanged)"""
    optional_fact_focus: float = 0.0
    """of the minimal pairs that state an optional fact, the share whose edit is drawn among the optional
    facts only (the others: among every fact stated), so that a reward model sees more durations,
    feelings and asks made wrong or left out; 0 draws nothing for it (the default data unchanged)"""
    fact_swap_fraction: float = 0.0
    """of the minimal pairs, the share whose edit states one of `fact_swap_slots` wrong (the summary against
    itself with that fact swapped), so that a reward model sees more of the swaps it is blind to; 0 draws
    nothing for it"""
    fact_swap_slots: tuple[str, ...] = ("relation",)
    """the facts `fact_swap_fraction`'s pairs swap, one drawn per pair (of relation, problem, ask, duration,
    feeling)"""
    num_pretrain_posts: int = 0
    """posts of their own random stream in pretrain/train.jsonl, each ending in its author's TL;DR that states
    every fact: text for the base models to pretrain on besides the SFT posts (tiny_models --extra_corpus), as a
    real base model has read posts with TL;DRs; 0 writes none (the other files are the same either way)"""


# ---------------------------------------------------------------------------------------------
# The world: slot values and their surface forms. Every surface form of a value contains one of
# that value's cues; no cue of one value occurs inside a surface form of another value or in any
# filler sentence (checked by `test_lexicon_cues_are_unambiguous`).
# ---------------------------------------------------------------------------------------------

# canonical -> (post form, summary forms, pronoun)
RELATIONS = {
    "boyfriend": ("boyfriend", ["boyfriend", "bf"], "he"),
    "girlfriend": ("girlfriend", ["girlfriend", "gf"], "she"),
    "husband": ("husband", ["husband", "hubby"], "he"),
    "wife": ("wife", ["wife"], "she"),
    "roommate": ("roommate", ["roommate", "roomie"], "they"),
    "boss": ("boss", ["boss", "manager"], "she"),
    "coworker": ("coworker", ["coworker", "colleague"], "he"),
    "sister": ("sister", ["sister", "sis"], "she"),
    "brother": ("brother", ["brother", "bro"], "he"),
    "mom": ("mom", ["mom", "mother"], "she"),
    "dad": ("dad", ["dad", "father"], "he"),
    "best friend": ("best friend", ["best friend", "bff"], "she"),
    "neighbor": ("neighbor", ["neighbor"], "he"),
    "landlord": ("landlord", ["landlord"], "he"),
}
RELATION_KIND = {
    **dict.fromkeys(["boyfriend", "girlfriend", "husband", "wife"], "romantic"),
    **dict.fromkeys(["roommate", "neighbor", "landlord"], "home"),
    **dict.fromkeys(["boss", "coworker"], "work"),
    **dict.fromkeys(["sister", "brother", "mom", "dad", "best friend"], "family"),
}
RELATION_CUES = {rel: forms for rel, (_, forms, _) in RELATIONS.items()}

# canonical -> (post forms, summary forms); third person singular, pronoun-free
PROBLEMS = {
    "money": (["keeps borrowing money from me", "keeps borrowing money and never pays me back"],
              ["keeps borrowing money", "borrows money and never pays back"]),
    "birthday": (["forgot my birthday this year", "completely forgot my birthday"],
                 ["forgot my birthday"]),
    "texts": (["reads my texts behind my back", "goes through my phone and reads my texts"],
              ["reads my texts", "snoops through my phone"]),
    "music": (["plays loud music every night", "plays loud music until three in the morning"],
              ["plays loud music", "blasts music at night"]),
    "plans": (["cancels our plans at the last minute", "keeps cancelling our plans"],
              ["cancels our plans", "keeps bailing on plans"]),
    "lying": (["lied to me about a trip", "lied to me about where the trip was"],
              ["lied about a trip", "lied to me about a trip"]),
    "chores": (["never does the dishes", "never does the dishes or any chores"],
               ["never does the dishes", "skips all chores"]),
    "jealous": (["gets jealous when I see my friends", "gets super jealous whenever I go out"],
                ["gets jealous", "is jealous when I go out"]),
    "rent": (["has not paid rent in months", "still has not paid rent for two months"],
             ["has not paid rent", "owes rent"]),
    "yelling": (["yells at me over small things", "yells at me over tiny mistakes"],
                ["yells at me", "keeps yelling at me"]),
    "ignoring": (["ignores my messages for days", "ignores my messages and calls"],
                 ["ignores my messages", "ghosts me for days"]),
    "credit": (["took credit for my work in a meeting", "took credit for my work again"],
               ["took credit for my work", "stole credit for my work"]),
    "smoking": (["smokes inside the apartment", "smokes inside even though I asked not to"],
                ["smokes inside", "smokes in the apartment"]),
    "ex": (["was texting an ex late at night", "has been texting an ex"],
           ["texts an ex", "was texting an ex"]),
}
PROBLEM_CUES = {
    "money": ["borrowing money", "borrows money"],
    "birthday": ["forgot my birthday"],
    "texts": ["reads my texts", "snoops through my phone"],
    "music": ["loud music", "blasts music"],
    "plans": ["our plans", "cancelling our plans", "bailing on plans"],
    "lying": ["about a trip", "where the trip was"],
    "chores": ["the dishes", "all chores"],
    "jealous": ["jealous"],
    "rent": ["paid rent", "owes rent"],
    "yelling": ["yells at me", "yelling at me"],
    "ignoring": ["ignores my messages", "ghosts me"],
    "credit": ["credit for my work"],
    "smoking": ["smokes inside", "smokes in the apartment"],
    "ex": ["an ex"],
}

# canonical -> surface forms (all of them cues)
FEELINGS = {
    "angry": ["angry", "mad", "pissed"],
    "sad": ["sad", "heartbroken"],
    "hurt": ["hurt"],
    "confused": ["confused", "lost"],
    "anxious": ["anxious", "stressed"],
    "annoyed": ["annoyed", "irritated"],
    "exhausted": ["exhausted", "drained"],
}

# canonical -> (post forms, summary forms); `{obj}` is "him" / "her" / "them"
ASKS = {
    "talk": (["Should I talk to {obj} about it?", "Should I confront {obj} about it?"],
             ["should I talk to {obj}?", "confront {obj}?"]),
    "end": (["Should I cut {obj} off for good?", "Is it time to cut {obj} off?"],
            ["should I cut {obj} off?", "cut {obj} off?"]),
    "move": (["Should I just move out?", "Would moving out be the right call?"],
             ["should I move out?", "move out?"]),
    "overreact": (["Am I overreacting here?", "Am I overreacting or is this not okay?"],
                  ["am I overreacting?"]),
    "advice": (["What should I do?", "Any advice on what to do?"],
               ["what should I do?", "any advice?"]),
    "forgive": (["Should I forgive {obj}?", "Is this something I should forgive?"],
                ["should I forgive {obj}?", "forgive {obj}?"]),
}
ASK_CUES = {
    "talk": ["talk to", "confront"],
    "end": ["cut him off", "cut her off", "cut them off"],
    "move": ["move out", "moving out"],
    "overreact": ["overreacting"],
    "advice": ["what should i do", "advice"],
    "forgive": ["forgive"],
}

UNITS = ["years", "months"]
DURATION_RE = re.compile(r"\b(\d+)\s*(year|years|yrs|month|months|mos)\b")

SUBREDDITS = {
    "relationships": ["boyfriend", "girlfriend", "husband", "wife", "best friend"],
    "relationship_advice": ["boyfriend", "girlfriend", "husband", "wife", "ex"],
    "roommates": ["roommate", "landlord", "neighbor"],
    "personalfinance": ["roommate", "brother", "sister", "dad", "mom"],
    "AskWomen": ["boyfriend", "husband", "mom", "sister", "best friend"],
    "work": ["boss", "coworker"],
    "family": ["mom", "dad", "sister", "brother"],
}

# Filler: irrelevant details. Mentioning any of these items in a summary costs points.
FILLER_ITEMS = {
    "place": ["gym", "beach", "mall", "park", "cafe", "library", "concert"],
    "job": ["nurse", "teacher", "cashier", "barista", "plumber"],
    "pet": ["dog", "cat", "hamster"],
    "pet_name": ["max", "luna", "bella", "charlie"],
    "day": ["monday", "tuesday", "friday", "saturday", "sunday"],
    "weather": ["rained", "snowed", "stormed"],
    "meta": ["mobile", "throwaway", "formatting"],
}
FILLER_WORDS = sorted({w for items in FILLER_ITEMS.values() for w in items})
FILLER_SENTENCES = [
    "We met at the {place} a while ago.",
    "I work as a {job} so my hours are long.",
    "We have a {pet} named {pet_name}.",
    "Last {day} we went to the {place} together.",
    "It {weather} all week which did not help.",
    "Sorry for the formatting, I am on mobile.",
    "Using a throwaway for obvious reasons.",
    "My {pet} {pet_name} is the only one who gets me lol.",
    "I usually spend my {day} at the {place}.",
]
NEWS_FILLER_SENTENCES = [
    "Local {job}s said the {place} was busy on {day}.",
    "It {weather} across the region on {day}.",
    "A {pet} named {pet_name} was found near the {place} last week.",
    "The {place} reopened on {day} after repairs.",
]
TAIL_SENTENCES = [
    "Some background: I grew up in a small town and moved here for work.",
    "I know this is long so thank you for reading this far.",
    "The rest of the week was pretty normal and nothing else happened.",
    "I have tried to think about it from every side and I keep going back and forth.",
    "People in my life have different opinions and none of them really agree.",
    "I did not expect to write this much but it feels good to get it out.",
]

NEWS_CITIES = ["Denver", "Leeds", "Austin", "Dublin", "Phoenix", "Glasgow", "Omaha"]
NEWS_SITES = ["cnn", "dailymail"]
CNNDM_BATCHES = ["batch0_cnndm", "cnndm0", "cnndm2"]
TLDR_TRAIN_BATCHES = [f"batch{i}" for i in range(3, 11)]
TLDR_VALIDATION_BATCHES = [f"batch{i}" for i in range(11, 14)]
WORKERS = [f"worker{i:02d}" for i in range(24)]

# Policies of the comparison data and how often each is sampled.
POLICY_WEIGHTS = {
    "ref": 3,          # the human reference summary
    "sup_full": 3,     # all key facts, concise (good paraphrase; beats the reference)
    "sup_terse": 2,    # relation and problem only (missing facts)
    "sup_wrong": 6,    # one key fact replaced by a wrong value (frequent: a reward model learns to
                       # catch wrong facts only from many such pairs, and PPO otherwise adds them)
    "sup_filler": 2,   # a reference padded with irrelevant details
    "sup_verbose": 2,  # over-long: all facts, filler and restatements
    "sup_trunc": 2,    # a good summary cut off mid-sentence
    "sup_repeat": 1,   # states the problem twice
}

# How often the human reference states each optional fact (relation and problem: always).
REFERENCE_KEEP = {"ask": 0.45, "duration": 0.2, "feeling": 0.25}
# Of the minimal pairs whose edited fact is optional, the share that leaves it out (the rest state it wrong).
MINIMAL_OMIT_SHARE = 0.5
# Whether a summary names the feeling in the post's own word ("pissed" stays "pissed"), or in any word for it.
FEELING_AS_IN_POST = True

# The duration and the feeling weigh as much as the relation and the ask: stating them then pays a
# policy that copies them right (past 60% right, against a wrong fact's 1.5), which tiny-l's base
# model does and tiny-m's does not (docs/scaling.md: at 0.6 and 0.4 no reward model paid for them).
SCORE_WEIGHTS = {"relation": 1.0, "problem": 1.5, "ask": 1.0, "duration": 1.0, "feeling": 1.0}
WRONG_FACT_PENALTY = 1.5
FILLER_PENALTY = 0.6
GARBLED_PENALTY = 0.4
REPEAT_PENALTY = 0.3
UNFINISHED_PENALTY = 0.5
LENGTH_BUDGET_WORDS = 24
LENGTH_PENALTY_PER_WORD = 0.06


# ---------------------------------------------------------------------------------------------
# Gold judge
# ---------------------------------------------------------------------------------------------

WORD_RE = re.compile(r"[a-z0-9]+")
EOS_TEXT = "<|endoftext|>"


def normalize(text: str) -> str:
    """Lower-case, map punctuation to spaces and collapse white space, padded with one space on
    each side so that cue matching by `" " + cue + " "` respects word boundaries."""
    return " " + " ".join(WORD_RE.findall(text.lower().replace("'", ""))) + " "


def _cue_needles(cues: dict) -> tuple:
    """(needle, value) for every cue of a slot, longest cue first: the order `_find_values` matches
    in. Built once per slot (the judge scores every summary of every eval table twice over)."""
    ordered = sorted(((c, v) for v, cs in cues.items() for c in cs), key=lambda cv: -len(cv[0]))
    return tuple((" " + normalize(cue).strip() + " ", value) for cue, value in ordered)


def _find_values(norm: str, needles: tuple) -> Counter:
    """How often each canonical value's cues occur (longest cue first, each span counted once)."""
    found = Counter()
    spans = []
    for needle, value in needles:
        start = norm.find(needle)
        while start != -1:
            end = start + len(needle)
            if not any(start < e and s < end - 1 for s, e in spans):
                spans.append((start, end - 1))
                found[value] += 1
            start = norm.find(needle, start + 1)
    return found


SLOT_NEEDLES = {"relation": _cue_needles(RELATION_CUES), "problem": _cue_needles(PROBLEM_CUES),
                "ask": _cue_needles(ASK_CUES), "feeling": _cue_needles(FEELINGS)}


def extract_facts(text: str) -> dict:
    """Slot -> Counter of canonical values mentioned in `text` (post or summary)."""
    norm = normalize(text)
    durations = Counter()
    for number, unit in DURATION_RE.findall(norm):
        durations[(int(number), "years" if unit.startswith("y") else "months")] += 1
    facts = {slot: _find_values(norm, needles) for slot, needles in SLOT_NEEDLES.items()}
    return {**facts, "duration": durations}


@functools.lru_cache(maxsize=1 << 14)
def _post_facts(post: str) -> dict:
    """extract_facts of a post, read-only: one eval table's posts are scored once per policy and
    once per reference, so each post's facts are extracted once."""
    return extract_facts(post)


def _known_words() -> frozenset:
    texts = []
    for post_form, forms, _ in RELATIONS.values():
        texts += [post_form, *forms]
    for post_forms, forms in PROBLEMS.values():
        texts += post_forms + forms
    for forms in FEELINGS.values():
        texts += forms
    for post_forms, forms in ASKS.values():
        texts += [f.format(obj=o) for f in post_forms + forms for o in ("him", "her", "them")]
    texts += FILLER_SENTENCES + NEWS_FILLER_SENTENCES + TAIL_SENTENCES + FILLER_WORDS + NEWS_CITIES + UNITS
    texts += list(SUBREDDITS) + _TEMPLATE_TEXT
    return frozenset(w for t in texts for w in WORD_RE.findall(t.lower().replace("'", "")))


def gold_score(post: str, summary: str) -> float:
    """Exact judge of the synthetic task: how well `summary` captures the key facts of `post`.

    `post` may be the bare post, the formatted query or a news article; only its facts are read.
    The summary is read up to its first EOS text (eval tables keep `<|endoftext|>` and `[PAD]`)."""
    summary = summary.split(EOS_TEXT)[0]
    post_facts = _post_facts(post)
    summary_facts = extract_facts(summary)
    score = 0.0
    for slot, weight in SCORE_WEIGHTS.items():
        truth, said = post_facts[slot], summary_facts[slot]
        if any(v in truth for v in said):
            score += weight
        score -= WRONG_FACT_PENALTY * sum(1 for v in said if v not in truth)
        score -= REPEAT_PENALTY * sum(n - 1 for n in said.values())
    words = WORD_RE.findall(summary.lower().replace("'", ""))
    score -= FILLER_PENALTY * len({w for w in words if w in _FILLER_SET})
    score -= GARBLED_PENALTY * min(5, sum(1 for w in words if w not in KNOWN_WORDS and not w.isdigit()))
    score -= LENGTH_PENALTY_PER_WORD * max(0, len(words) - LENGTH_BUDGET_WORDS)
    stripped = summary.strip()
    if not stripped or stripped[-1] not in ".?!":
        score -= UNFINISHED_PENALTY
    return round(score, 6)


def gold_preference(post: str, summary_a: str, summary_b: str) -> float:
    """1.0 if the judge prefers A, 0.0 if B, 0.5 on a tie."""
    a, b = gold_score(post, summary_a), gold_score(post, summary_b)
    return 1.0 if a > b else 0.0 if b > a else 0.5


def reward_gold_agreement(queries: list, chosen: list, rejected: list, chosen_rewards: list,
                          rejected_rewards: list) -> float:
    """How often a reward model orders a pair as the gold judge does (ties of either count half),
    from the columns of reward.py's eval table. The labels agree with the judge only ~0.84 of the
    time, so this can exceed the model's label accuracy."""
    total = 0.0
    for query, a, b, reward_a, reward_b in zip(queries, chosen, rejected, chosen_rewards, rejected_rewards, strict=True):
        model = 1.0 if reward_a > reward_b else 0.0 if reward_b > reward_a else 0.5
        gold = gold_preference(query, a, b)
        total += 0.5 if 0.5 in (model, gold) else float(model == gold)
    return total / max(1, len(queries))


# ---------------------------------------------------------------------------------------------
# Generator
# ---------------------------------------------------------------------------------------------

_TEMPLATE_TEXT = [
    "SUBREDDIT r TITLE POST TL DR Article EDIT UPDATE",
    "Me {age}{g} with my {rel} of {n} {unit} {problem}",
    "I have been with lived worked close to my and known each other for",
    "Lately {pron} {problem}. The thing is {pron} {problem}. For the past few weeks {pron} {problem}",
    "I feel really {feeling} about it. Honestly it makes me {feeling}. I am so {feeling} right now",
    "and I am feeling of so it just keeps happening again",
    "A {age} year old woman man says her his {rel} {problem} according to a local report",
    "The two have known each other for {n} {unit} The woman man wants to know whether she he feels",
    "Officials did not respond to a request for comment Neighbors described the area as quiet",
    "The story was first reported by a local paper on",
    "basically so yeah I guess that is it also btw the thing is and",
    "says her his",
]
KNOWN_WORDS = _known_words()
_FILLER_SET = frozenset(FILLER_WORDS)
# Every word of a generated post: the judge's vocabulary plus "they" and "need", which only posts use
# (a scan of the default's 7000 posts finds no other), numbers and ages such as "25f". Real posts use
# far more words (this repository's README: 28% of its words are here).
POST_WORDS = KNOWN_WORDS | {"they", "need"}
AGE_OR_NUMBER = re.compile(r"^\d+[mf]?$")


def is_synthetic_post(query: str) -> bool:
    """Whether a post (or a formatted query) could come from this generator: all its words are
    POST_WORDS. The gold judge means something only for such posts."""
    words = WORD_RE.findall(query.lower().replace("'", ""))
    return bool(words) and all(w in POST_WORDS or AGE_OR_NUMBER.match(w) for w in words)


# The slots a fact-swap probe edits, and each value's summary forms: what a swap puts in the place of
# the stated form, so that the swapped summary still reads like one (a relation word for a relation
# word, a problem clause for a problem clause). Asks carry their object pronoun ({obj}).
FACT_SWAP_SLOTS = ("relation", "problem", "ask", "duration", "feeling")
SUMMARY_FORMS = {"relation": {v: forms for v, (_, forms, _) in RELATIONS.items()},
                 "problem": {v: forms for v, (_, forms) in PROBLEMS.items()},
                 "ask": {v: forms for v, (_, forms) in ASKS.items()}, "feeling": FEELINGS}


def swap_fact(rng: random.Random, post: str, summary: str, slot: str):
    """`summary` with its `slot` fact made wrong and nothing else changed: the first form of the post's
    value it states replaced by a form of another value (a duration's number moved by 1 to 3), or None
    where the summary does not state the post's value. A reward model that prefers the summary to its
    swap checks that fact against the post (hello_world_report's fact-swap rows)."""
    truth = _post_facts(post)[slot]
    if slot == "duration":
        for match in DURATION_RE.finditer(summary):
            unit = "years" if match.group(2).startswith("y") else "months"
            if (int(match.group(1)), unit) in truth:
                return f"{summary[:match.start(1)]}{int(match.group(1)) + rng.choice([1, 2, 3])}{summary[match.end(1):]}"
        return None
    forms = SUMMARY_FORMS[slot]
    for value in sorted(truth):
        for obj in ("him", "her", "them") if slot == "ask" else ("",):
            for form in sorted(forms.get(value, []), key=len, reverse=True):
                match = re.search(rf"(?<![a-z]){re.escape(form.format(obj=obj))}(?![a-z])", summary, re.IGNORECASE)
                if match:
                    other = rng.choice(sorted(v for v in forms if v not in truth and v != "ex"))
                    return summary[:match.start()] + rng.choice(forms[other]).format(obj=obj) + summary[match.end():]
    return None


def gold_validation_metrics(rows: list) -> dict:
    """The gold judge on an online stage's validation rows (dicts with query, postprocessed_response,
    reference_responses): `eval/gold/score` (mean gold score of the responses), `eval/gold/win_rate`
    (against the references, ties half) and `eval/gold/reference_score`, the over-optimisation curve's
    gold axis beside the reward model's `objective/validation_score` (DESIGN.md section 20). Empty
    unless every post is synthetic: real data has no gold judge."""
    if not rows or not all(is_synthetic_post(row["query"]) for row in rows):
        return {}
    return {
        "eval/gold/score": float(np.mean([gold_score(r["query"], r["postprocessed_response"]) for r in rows])),
        "eval/gold/win_rate": float(np.mean([gold_preference(r["query"], r["postprocessed_response"],
                                                             r["reference_responses"]) for r in rows])),
        "eval/gold/reference_score": float(np.mean([gold_score(r["query"], r["reference_responses"]) for r in rows])),
    }


def _obj(pronoun: str) -> str:
    return {"he": "him", "she": "her", "they": "them"}[pronoun]


def _sample_facts(rng: random.Random, subreddit: str) -> dict:
    relation = rng.choice(SUBREDDITS[subreddit])
    if relation == "ex":  # r/relationship_advice sometimes has a partner texting an ex
        relation = rng.choice(["boyfriend", "girlfriend"])
        problem = "ex"
    else:
        problem = rng.choice(sorted(set(PROBLEMS) - {"ex"}))
    return {
        "relation": relation,
        "problem": problem,
        "ask": rng.choice(sorted(ASKS)),
        "feeling": (feeling := rng.choice(sorted(FEELINGS))),
        "feeling_word": rng.choice(FEELINGS[feeling]),
        "duration": (rng.randint(2, 11), rng.choice(UNITS)),
        "age": rng.randint(18, 45),
        "gender": rng.choice("MF"),
        "other_age": rng.randint(18, 60),
        "other_gender": "M" if RELATIONS[relation][2] == "he" else rng.choice("MF"),
    }


def _filler_sentence(rng: random.Random, templates: list = FILLER_SENTENCES) -> str:
    return rng.choice(templates).format(
        place=rng.choice(FILLER_ITEMS["place"]),
        job=rng.choice(FILLER_ITEMS["job"]),
        pet=rng.choice(FILLER_ITEMS["pet"]),
        pet_name=rng.choice(FILLER_ITEMS["pet_name"]).capitalize(),
        day=rng.choice(FILLER_ITEMS["day"]).capitalize(),
        weather=rng.choice(FILLER_ITEMS["weather"]),
    )


def make_post(rng: random.Random, facts: dict, long_post: bool) -> tuple:
    """(title, post). Key facts sit in the first paragraphs; a long post ends in filler-only
    paragraphs, so smart truncation removes filler, never a key fact."""
    rel, pron = facts["relation"], RELATIONS[facts["relation"]][2]
    n, unit = facts["duration"]
    age, g = facts["age"], facts["gender"]
    problem = rng.choice(PROBLEMS[facts["problem"]][0])
    title = rng.choice([
        f"Me ({age}{g}) with my {rel} ({facts['other_age']}{facts['other_gender']}) of {n} {unit}, {pron} {problem}",
        f"My {rel} {problem} and I do not know what to do",
        f"Need advice about my {rel}",
    ])
    other = f"({facts['other_age']}{facts['other_gender']})"
    intro = rng.choice([f"My {rel} and I have known each other for {n} {unit}.", {
        "romantic": f"I ({age}{g}) have been with my {rel} {other} for {n} {unit}.",
        "home": f"I ({age}{g}) have lived with my {rel} {other} for {n} {unit}.",
        "work": f"I ({age}{g}) have worked with my {rel} {other} for {n} {unit}.",
        "family": f"I ({age}{g}) have been close to my {rel} {other} for {n} {unit}.",
    }[RELATION_KIND[rel]]])
    issue = rng.choice(["Lately", "The thing is", "For the past few weeks"]) + f" {pron} {problem}."
    feeling = rng.choice([
        "I feel really {f} about it.", "Honestly it makes me {f}.", "I am so {f} right now.",
    ]).format(f=facts["feeling_word"])
    ask = rng.choice(ASKS[facts["ask"]][0]).format(obj=_obj(pron))
    fact_sentences = [intro, issue, feeling]
    sentences = []
    for sentence in fact_sentences:
        sentences.append(sentence)
        for _ in range(rng.choice([0, 0, 1, 1, 2])):
            sentences.append(_filler_sentence(rng))
    paragraphs, current = [], []
    for sentence in sentences:
        current.append(sentence)
        if rng.random() < 0.35:
            paragraphs.append(" ".join(current))
            current = []
    current.append(ask)
    paragraphs.append(" ".join(current))
    if long_post:
        for _ in range(rng.randint(2, 4)):
            tail = [rng.choice(TAIL_SENTENCES)] + [_filler_sentence(rng) for _ in range(rng.randint(2, 4))]
            paragraphs.append(rng.choice(["EDIT: ", "UPDATE: ", ""]) + " ".join(tail))
    return title, "\n\n".join(paragraphs)


def summarize(rng: random.Random, facts: dict, include: set, news: bool = False) -> str:
    """A summary naming the relation and the problem, plus the optional facts in `include`
    (any of ask, duration, feeling); `news` gives the third-person style of the OOD articles.
    Every wording choice is drawn whatever `include` and `facts` hold, so two summaries drawn from
    the same rng state differ only in the facts they state (the minimal pairs)."""
    pron = RELATIONS[facts["relation"]][2]
    draws = [rng.random() for _ in range(6)]

    def pick(options, k):
        return options[int(draws[k] * len(options))]

    rel = pick(RELATIONS[facts["relation"]][1], 0)
    if "duration" in include:
        n, unit = facts["duration"]
        subject = pick([f"my {rel} of {n} {unit}", f"{rel} of {n} {unit}", f"my {rel} ({n} {unit})"], 1)
    else:
        subject = pick([f"my {rel}", rel], 1)
    if news:
        possessive = "her" if facts["gender"] == "F" else "his"
        person = "woman" if facts["gender"] == "F" else "man"
        subject = f"{person} says {possessive} {subject.removeprefix('my ')}"
    clause = subject + " " + pick(PROBLEMS[facts["problem"]][1], 2)
    if "feeling" in include:
        feeling = pick(FEELINGS[facts["feeling"]], 3)
        if FEELING_AS_IN_POST and facts["feeling_word"] in FEELINGS[facts["feeling"]]:
            feeling = facts["feeling_word"]
        clause += pick([f" and I am {feeling}", f", I feel {feeling}", f", feeling {feeling}"], 4)
    summary = clause + "."
    if "ask" in include:
        summary += " " + pick(ASKS[facts["ask"]][1], 5).format(obj=_obj(pron))
    return summary


OPTIONAL_FACTS = ("ask", "duration", "feeling")


def reference_summary(rng: random.Random, facts: dict, news: bool = False) -> str:
    """The human reference: good but beatable (it leaves out each optional fact with the
    probability 1 - REFERENCE_KEEP[fact])."""
    include = {slot for slot in OPTIONAL_FACTS if rng.random() < REFERENCE_KEEP[slot]}
    return summarize(rng, facts, include, news)


def wrong_value(rng: random.Random, facts: dict, slot: str):
    """Another value of `slot` than the post's: what a summary that gets this fact wrong states."""
    if slot == "duration":
        n, unit = facts["duration"]
        return (n + rng.choice([1, 2, 3]), unit)
    values = {"relation": RELATIONS, "problem": set(PROBLEMS) - {"ex"}, "ask": ASKS, "feeling": FEELINGS}[slot]
    return rng.choice(sorted(set(values) - {facts[slot]}))


def minimal_pair(rng: random.Random, facts: dict, news: bool = False, omit_vs_wrong: float = 0.0,
                 optional_focus: float = 0.0, fact_swap: float = 0.0, swap_slots: tuple = ("relation",)) -> list:
    """Two summaries in the same words but for one fact: [(policy, text, note)] of a summary and its
    edit, which states one of its facts wrong (`min_wrong`) or leaves an optional one out
    (`min_omit`). Such pairs isolate what a fact is worth, so a reward model can learn to check a
    fact against the post and to value stating it, not only the style of whole policies. With
    `omit_vs_wrong` > 0, that share of the pairs whose fact is optional sets the two edits against
    each other instead: the summary without the fact against the one that states it wrong. With
    `optional_focus` > 0, that share of the pairs that state an optional fact edit one of those. With
    `fact_swap` > 0, that share of the pairs states one of `swap_slots` wrong (stated in both summaries)."""
    include = {slot for slot in OPTIONAL_FACTS if rng.random() < 0.5}
    # (no draw at 0: the default data stays what it was)
    swap = fact_swap > 0 and rng.random() < fact_swap
    if swap:
        slot = rng.choice(sorted(swap_slots))
        include |= {slot} & set(OPTIONAL_FACTS)
    else:
        stated = ["relation", "problem", *sorted(include)]
        # (no draw at 0 either)
        focus = optional_focus > 0 and bool(include) and rng.random() < optional_focus
        slot = rng.choice(sorted(include) if focus else stated)
    contrast = not swap and omit_vs_wrong > 0 and slot in include and rng.random() < omit_vs_wrong
    omit = not swap and not contrast and slot in include and rng.random() < MINIMAL_OMIT_SHARE
    edited_facts, edited_include = dict(facts), set(include)
    if omit:
        edited_include.discard(slot)
    else:
        edited_facts[slot] = wrong_value(rng, facts, slot)
    style = rng.random()
    edited = summarize(random.Random(style), edited_facts, edited_include, news)
    if contrast:
        without = summarize(random.Random(style), facts, include - {slot}, news)
        return [("min_omit", without, f"without {slot}"), ("min_wrong", edited, f"wrong {slot}")]
    text = summarize(random.Random(style), facts, include, news)
    return [("min_base", text, None), ("min_omit" if omit else "min_wrong", edited, f"{'without' if omit else 'wrong'} {slot}")]


def policy_summary(rng: random.Random, policy: str, facts: dict, reference: str, news: bool = False) -> str:
    everything = {"ask", "duration", "feeling"}
    if policy == "ref":
        return reference
    if policy == "sup_full":
        return summarize(rng, facts, everything, news)
    if policy == "sup_terse":
        return summarize(rng, facts, set(), news)
    if policy == "sup_wrong":
        wrong = dict(facts)
        slot = rng.choice(["relation", "problem", "duration", "ask"])
        wrong[slot] = wrong_value(rng, facts, slot)
        return summarize(rng, wrong, everything, news)
    if policy == "sup_filler":
        extra = " ".join(_filler_sentence(rng).lower() for _ in range(rng.randint(1, 2)))
        return f"{reference} {extra}"
    if policy == "sup_verbose":
        pron = RELATIONS[facts["relation"]][2]
        restate = rng.choice(["basically", "so yeah", "the thing is"])
        filler = " ".join(_filler_sentence(rng).lower() for _ in range(rng.randint(2, 3)))
        again = rng.choice(PROBLEMS[facts["problem"]][0])
        return f"{summarize(rng, facts, everything, news)} {restate} {pron} {again} and {filler}"
    if policy == "sup_trunc":
        words = summarize(rng, facts, everything, news).split()
        return " ".join(words[: rng.randint(max(2, len(words) // 3), len(words) - 2)])
    if policy == "sup_repeat":
        text = summarize(rng, facts, {"ask"}, news)
        pron = RELATIONS[facts["relation"]][2]
        return f"{text} {pron} {rng.choice(PROBLEMS[facts['problem']][1])} again."
    raise ValueError(f"unknown policy {policy!r}")


def make_article(rng: random.Random, facts: dict) -> tuple:
    """An out-of-distribution "news" article (the CNN/DM role): same kind of facts, other style."""
    rel, pron = facts["relation"], RELATIONS[facts["relation"]][2]
    n, unit = facts["duration"]
    person = "woman" if facts["gender"] == "F" else "man"
    possessive = "her" if facts["gender"] == "F" else "his"
    city = rng.choice(NEWS_CITIES)
    problem = rng.choice(PROBLEMS[facts["problem"]][0])
    feeling = facts["feeling_word"]
    ask = rng.choice(ASKS[facts["ask"]][0]).format(obj=_obj(pron)).rstrip("?").lower()
    paragraphs = [
        f"{city} ({rng.choice(NEWS_SITES).upper()}) A {facts['age']} year old {person} says {possessive} {rel} {problem}, according to a local report.",
        f"The two have known each other for {n} {unit}. The {person} says {'she' if person == 'woman' else 'he'} feels {feeling}.",
        " ".join(_filler_sentence(rng, NEWS_FILLER_SENTENCES) for _ in range(rng.randint(1, 3))),
        f"The {person} wants to know whether: {ask}?",
        "Officials did not respond to a request for comment. Neighbors described the area as quiet.",
    ]
    for _ in range(rng.randint(0, 3)):
        paragraphs.append(" ".join(_filler_sentence(rng, NEWS_FILLER_SENTENCES) for _ in range(rng.randint(2, 4))))
    title = f"{person.capitalize()} says {possessive} {rel} {problem}"
    return title, "\n\n".join(paragraphs)


def _label(rng: random.Random, score_a: float, score_b: float, temperature: float) -> tuple:
    """Noisy Bradley-Terry label (0 = first summary chosen) and a 1-9 confidence tied to the margin."""
    margin = score_a - score_b
    p_a = 0.5 * (1.0 + math.tanh(margin / (2.0 * temperature)))  # sigmoid(margin / T), overflow-free
    choice = 0 if rng.random() < p_a else 1
    confidence = round(2 + 1.25 * abs(margin) / temperature + rng.gauss(0, 1))
    return choice, min(9, max(1, confidence))


def _draw_post(rng: random.Random, long_post_fraction: float) -> tuple:
    """(subreddit, facts, title, post) of one post, drawn in the order the SFT splits always drew them."""
    subreddit = rng.choice(sorted(SUBREDDITS))
    facts = _sample_facts(rng, subreddit)
    title, post = make_post(rng, facts, rng.random() < long_post_fraction)
    return subreddit, facts, title, post


def generate_sft_split(rng: random.Random, split: str, count: int, long_post_fraction: float) -> list:
    rows = []
    for i in range(count):
        subreddit, facts, title, post = _draw_post(rng, long_post_fraction)
        rows.append({
            "id": f"t3_{split[:2]}{i:06d}",
            "subreddit": subreddit,
            "title": title,
            "post": post,
            "summary": reference_summary(rng, facts),
        })
    return rows


def generate_pretrain_posts(rng: random.Random, count: int, long_post_fraction: float) -> list:
    """Rows in the SFT schema whose post ends in "TL;DR:" and a summary stating every fact. Pretraining on
    them is where a base model can learn to copy a post's facts into a summary before any fine-tuning, and a
    larger model with its larger budget learns more of it (docs/scaling.md: tiny-l does, tiny-m does not)."""
    rows = []
    for i in range(count):
        subreddit, facts, title, post = _draw_post(rng, long_post_fraction)
        summary = summarize(rng, facts, set(OPTIONAL_FACTS))
        rows.append({"id": f"t3_pt{i:06d}", "subreddit": subreddit, "title": title,
                     "post": f"{post}\n\nTL;DR: {summary}", "summary": summary})
    return rows


def generate_comparisons(rng: random.Random, split: str, count: int, news: bool, args: Args) -> list:
    policies, weights = zip(*POLICY_WEIGHTS.items())
    rows = []
    i = 0
    while len(rows) < count:
        subreddit = rng.choice(sorted(SUBREDDITS))
        facts = _sample_facts(rng, subreddit)
        if news:
            title, text = make_article(rng, facts)
            info = {"id": f"dm{split[:2]}{i:06d}", "post": None, "title": title, "subreddit": None,
                    "site": rng.choice(NEWS_SITES), "article": text}
        else:
            title, text = make_post(rng, facts, rng.random() < args.long_post_fraction)
            info = {"id": f"t3_c{split[:2]}{i:06d}", "post": text, "title": title, "subreddit": subreddit,
                    "site": None, "article": None}
        i += 1
        reference = reference_summary(rng, facts, news)
        for _ in range(rng.choice([1, 2, 2, 3])):
            if rng.random() < args.minimal_pair_fraction:
                pair = minimal_pair(rng, facts, news, args.omit_vs_wrong_fraction, args.optional_fact_focus,
                                    args.fact_swap_fraction, args.fact_swap_slots)
                rng.shuffle(pair)
            else:
                pair = []
                while len(pair) < 2:
                    policy = rng.choices(policies, weights)[0]
                    text_ = policy_summary(rng, policy, facts, reference, news)
                    if not pair or (policy != pair[0][0] and text_ != pair[0][1]):
                        pair.append((policy, text_, None))
            # upstream summaries start with a space (DESIGN 5: only EOS is appended later)
            summaries = [{"text": " " + t, "policy": p, "note": note} for p, t, note in pair]
            score_a, score_b = (gold_score(text, s["text"]) for s in summaries)
            choice, confidence = _label(rng, score_a, score_b, args.label_temperature)
            if news:
                batch = rng.choice(CNNDM_BATCHES)
            else:
                batch = rng.choice(TLDR_TRAIN_BATCHES if split == "train" else TLDR_VALIDATION_BATCHES)
            rows.append({
                "info": info,
                "summaries": summaries,
                "choice": choice,
                "worker": rng.choice(WORKERS),
                "batch": batch,
                "split": "train" if split == "train" else rng.choice(["valid1", "valid2"]),
                "extra": {"confidence": confidence},
            })
            if len(rows) == count:
                break
    return rows


def label_statistics(rows: list) -> dict:
    """Gold-vs-label agreement (ties count half), how often the longer summary is chosen, and the
    gold win rate of each policy against the others."""
    agree, longer_chosen, untied_length = 0.0, 0, 0
    wins, games = Counter(), Counter()
    for row in rows:
        post = row["info"]["post"] or row["info"]["article"]
        texts = [s["text"] for s in row["summaries"]]
        gold = gold_preference(post, texts[0], texts[1])
        agree += gold if row["choice"] == 0 else 1.0 - gold
        lengths = [len(t.split()) for t in texts]
        if lengths[0] != lengths[1]:
            untied_length += 1
            longer_chosen += int(lengths[row["choice"]] > lengths[1 - row["choice"]])
        for k, s in enumerate(row["summaries"]):
            games[s["policy"]] += 1
            wins[s["policy"]] += gold if k == 0 else 1.0 - gold
    return {
        "num_pairs": len(rows),
        "gold_label_agreement": agree / max(1, len(rows)),
        "longer_summary_chosen_rate": longer_chosen / max(1, untied_length),
        "policy_gold_win_rate": {p: round(wins[p] / games[p], 4) for p in sorted(games)},
    }


@contextlib.contextmanager
def atomic_output_dir(path: str):
    """Yields an empty sibling folder to fill. When the block succeeds it replaces `path` (the old
    folder is removed only afterwards); when it fails it disappears and `path` is untouched."""
    path = path.rstrip("/")
    tmp, old = f"{path}.tmp-{os.getpid()}", f"{path}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
        if os.path.exists(path):
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_jsonl(path: str, rows: list) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def generate(args: Args) -> dict:
    """Writes the raw files into `args.output_dir` (atomically) and returns the label statistics."""
    unknown = sorted(set(args.fact_swap_slots) - set(FACT_SWAP_SLOTS))
    if unknown:
        raise ValueError(f"--fact_swap_slots: {', '.join(unknown)} is none of {', '.join(FACT_SWAP_SLOTS)}")
    def rng_for(name: str) -> random.Random:
        return random.Random(f"{args.seed}-{name}")

    sft = {
        split: generate_sft_split(rng_for(f"sft-{split}"), split, count, args.long_post_fraction)
        for split, count in (("train", args.num_sft_train), ("validation", args.num_sft_validation),
                             ("test", args.num_sft_test))
    }
    comparisons = {
        "train": generate_comparisons(rng_for("cmp-train"), "train", args.num_comparison_train, False, args),
        "validation": generate_comparisons(rng_for("cmp-validation"), "validation",
                                           args.num_comparison_validation, False, args)
        + generate_comparisons(rng_for("cmp-cnndm"), "validation", args.num_comparison_validation_cnndm, True, args),
    }
    stats = {
        "args": {k: v for k, v in asdict(args).items() if k != "output_dir"},  # identical files wherever written
        "train": label_statistics(comparisons["train"]),
        "validation": label_statistics([r for r in comparisons["validation"] if r["batch"] not in CNNDM_BATCHES]),
        "validation_cnndm": label_statistics([r for r in comparisons["validation"] if r["batch"] in CNNDM_BATCHES]),
        "sft_reference_mean_gold_score": {
            split: round(sum(gold_score(r["post"], " " + r["summary"]) for r in rows) / max(1, len(rows)), 4)
            for split, rows in sft.items()
        },
    }

    with atomic_output_dir(args.output_dir) as tmp_dir:
        os.makedirs(os.path.join(tmp_dir, "tldr_sft"))
        os.makedirs(os.path.join(tmp_dir, "comparisons"))
        for split, rows in sft.items():
            _write_jsonl(os.path.join(tmp_dir, "tldr_sft", f"{split}.jsonl"), rows)
        for split, rows in comparisons.items():
            _write_jsonl(os.path.join(tmp_dir, "comparisons", f"{split}.jsonl"), rows)
        if args.num_pretrain_posts:
            os.makedirs(os.path.join(tmp_dir, "pretrain"))
            _write_jsonl(os.path.join(tmp_dir, "pretrain", "train.jsonl"), generate_pretrain_posts(
                rng_for("pretrain"), args.num_pretrain_posts, args.long_post_fraction))
        with open(os.path.join(tmp_dir, "label_stats.json"), "w") as f:
            json.dump(stats, f, indent=2, sort_keys=True)
    return stats


def check_recorded_args(argv: list) -> None:
    """Exit with a message naming each difference when the folder that `argv` (this module's command
    line) names was generated with other arguments (its label_stats.json records them), so a script
    that skips existing data does not silently keep data of an earlier default."""
    args = tyro.cli(Args, args=argv)
    with open(os.path.join(args.output_dir, "label_stats.json")) as f:
        recorded = json.load(f)["args"]
    # a field added since the folder was written: its default is what generated it
    wanted = {k: v for k, v in json.loads(json.dumps(asdict(args))).items() if k != "output_dir"}
    defaults = json.loads(json.dumps(asdict(Args())))
    differ = [f"{k}: {recorded.get(k, defaults[k])!r} there, {v!r} now" for k, v in wanted.items()
              if recorded.get(k, defaults[k]) != v]
    if differ:
        sys.exit(f"{args.output_dir} was generated with other arguments ({'; '.join(differ)}): --force regenerates "
                 "it and retrains everything from it, or move it aside")


def main(args: Args) -> None:
    stats = generate(args)
    for split in ("train", "validation", "validation_cnndm"):
        s = stats[split]
        print(f"{split:>16}: {s['num_pairs']} pairs, gold-label agreement {s['gold_label_agreement']:.3f}, "
              f"longer summary chosen {s['longer_summary_chosen_rate']:.3f}")
    print("policy gold win rates (validation):", stats["validation"]["policy_gold_win_rate"])
    print("mean gold score of SFT references:", stats["sft_reference_mean_gold_score"])
    pretrain = f" and {args.output_dir}/pretrain" if args.num_pretrain_posts else ""
    print(f"wrote {args.output_dir}/tldr_sft, {args.output_dir}/comparisons{pretrain}", file=sys.stderr)


if __name__ == "__main__":
    main(tyro.cli(Args))
