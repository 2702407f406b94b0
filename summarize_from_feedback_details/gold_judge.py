"""The gold judge of the synthetic TL;DR task and the world it knows: the slot values (relations, problems,
feelings, asks, durations) with their surface forms and cues, the filler and template words, and
`gold_score(post, summary)`, which reads only the two texts - the same inputs an LLM judge gets - and scores
coverage of the post's key facts, minus wrong facts, irrelevant details, garbled words, repetition,
unfinished text and excess length. Around it: `gold_preference`, `reward_gold_agreement`, `is_synthetic_post`,
`swap_fact` (the fact-swap probes of hello_world's report) and `gold_validation_metrics` (the online
stages' per-update gold score). synthetic_tldr.py writes posts and summaries from this world and labels
pairs with this judge; evaluation.py, the report and eval/ judge with it without importing the generator.
"""

import functools
import random
import re
from collections import Counter

import numpy as np


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


def stated_facts(post: str, summary: str) -> dict:
    """Per slot (SCORE_WEIGHTS' order), what the summary says of the post's fact: "right" (it states the
    slot and every value it states is the post's), "wrong" (it states a value the post does not have) or ""
    (it does not state the slot). What a policy learned, slot by slot, where gold_score sums it into one
    number: a method that adds the ask and one that gets the relation right score alike."""
    post_facts, said = _post_facts(post), extract_facts(summary.split(EOS_TEXT)[0])
    return {slot: "" if not said[slot] else "right" if all(v in post_facts[slot] for v in said[slot]) else "wrong"
            for slot in SCORE_WEIGHTS}


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


def _stated_duration(post: str, summary: str):
    """The first match of DURATION_RE in `summary` that states the post's duration (number and unit), or None."""
    truth = _post_facts(post)["duration"]
    for match in DURATION_RE.finditer(summary):
        if (int(match.group(1)), "years" if match.group(2).startswith("y") else "months") in truth:
            return match
    return None


def other_unit(unit: str) -> str:
    """The other of UNITS ("years" for "months" and "month", "months" for "years" and "year")."""
    return "months" if unit.startswith("y") else "years"


def swap_duration_unit(post: str, summary: str):
    """`summary` with the post's duration in the other unit and the same number ("5 months" for "5
    years"), or None where it does not state the post's duration. swap_fact's duration moves the number
    only, so a reader blind to the unit passes that check; the gold judge charges either as wrong
    (eval/fact_copy.py reads both; docs/real_pipeline.md, "The duration's unit")."""
    match = _stated_duration(post, summary)
    if match is None:
        return None
    return summary[:match.start(2)] + other_unit(match.group(2)) + summary[match.end(2):]


def swap_fact(rng: random.Random, post: str, summary: str, slot: str):
    """`summary` with its `slot` fact made wrong and nothing else changed: the first form of the post's
    value it states replaced by a form of another value (a duration's number moved by 1 to 3), or None
    where the summary does not state the post's value. A reward model that prefers the summary to its
    swap checks that fact against the post (hello_world_report's fact-swap rows)."""
    if slot == "duration":
        match = _stated_duration(post, summary)
        return None if match is None else (
            f"{summary[:match.start(1)]}{int(match.group(1)) + rng.choice([1, 2, 3])}{summary[match.end(1):]}")
    truth = _post_facts(post)[slot]
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
