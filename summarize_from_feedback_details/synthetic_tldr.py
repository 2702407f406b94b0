"""Synthetic TL;DR: an offline stand-in for the TL;DR SFT data and the OpenAI comparisons.

The generator writes forum posts with a few key facts hidden among irrelevant filler, a human-like
reference summary per post, and comparison pairs between summaries from "policies" of varying
quality, all in the exact upstream schemas (DESIGN section 5 and 6):

    tldr_sft/{train,validation,test}.jsonl    id, subreddit, title, post, summary
    comparisons/{train,validation}.jsonl      info{...}, summaries[2]{text, policy, note}, choice,
                                              worker, batch, split, extra{confidence}

The world of the task (the slot values and their surface forms) and the gold judge `gold_score(post,
summary)` live in gold_judge.py; labels come from a noisy Bradley-Terry model on the gold scores, so
even a perfect reward model cannot reach 100% label accuracy.

    python -m summarize_from_feedback_details.synthetic_tldr --output_dir data/raw
"""

import contextlib
import json
import math
import os
import random
import shutil
import sys
from collections import Counter
from dataclasses import asdict, dataclass

import tyro

from summarize_from_feedback_details import gold_judge
from summarize_from_feedback_details.gold_judge import (ASKS, FACT_SWAP_SLOTS, FEELINGS, FILLER_ITEMS, FILLER_SENTENCES,
                                                        NEWS_CITIES, NEWS_FILLER_SENTENCES, PROBLEMS, RELATION_KIND,
                                                        RELATIONS, SUBREDDITS, TAIL_SENTENCES, UNITS, gold_preference,
                                                        gold_score, other_unit)


def __getattr__(name: str):
    """The judge and its world lived in this file until 2026-12-05: their other names still read as
    synthetic_tldr.<name> (synthetic_tldr.extract_facts, .SCORE_WEIGHTS, ...) for scripts written before."""
    try:
        return getattr(gold_judge, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


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
    feeling), each entry equally likely: a fact named twice is swapped twice as often as one named once"""
    wrong_unit_fraction: float = 0.0
    """of the comparisons' wrong durations, the share that states the post's number in the other unit ("5
    months" for 5 years) instead of moving the number, so that a reward model sees wrong units
    (docs/real_pipeline.md, "The duration's unit"); 0 draws nothing for it (the default data unchanged);
    the SFT and pretraining posts are the same either way"""
    num_pretrain_posts: int = 0
    """posts of their own random stream in pretrain/train.jsonl, each ending in its author's TL;DR that states
    every fact: text for the base models to pretrain on besides the SFT posts (tiny_models --extra_corpus), as a
    real base model has read posts with TL;DRs; 0 writes none (the other files are the same either way)"""


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


# ---------------------------------------------------------------------------------------------
# Generator
# ---------------------------------------------------------------------------------------------


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


def wrong_value(rng: random.Random, facts: dict, slot: str, wrong_unit: float = 0.0):
    """Another value of `slot` than the post's: what a summary that gets this fact wrong states. A wrong
    duration moves the number by 1 to 3, or, with probability `wrong_unit`, keeps it in the other unit."""
    if slot == "duration":
        n, unit = facts["duration"]
        # (no draw at 0: the default data stays what it was)
        if wrong_unit > 0 and rng.random() < wrong_unit:
            return (n, other_unit(unit))
        return (n + rng.choice([1, 2, 3]), unit)
    values = {"relation": RELATIONS, "problem": set(PROBLEMS) - {"ex"}, "ask": ASKS, "feeling": FEELINGS}[slot]
    return rng.choice(sorted(set(values) - {facts[slot]}))


def minimal_pair(rng: random.Random, facts: dict, news: bool = False, omit_vs_wrong: float = 0.0,
                 optional_focus: float = 0.0, fact_swap: float = 0.0, swap_slots: tuple = ("relation",),
                 wrong_unit: float = 0.0) -> list:
    """Two summaries in the same words but for one fact: [(policy, text, note)] of a summary and its
    edit, which states one of its facts wrong (`min_wrong`) or leaves an optional one out
    (`min_omit`). Such pairs isolate what a fact is worth, so a reward model can learn to check a
    fact against the post and to value stating it, not only the style of whole policies. With
    `omit_vs_wrong` > 0, that share of the pairs whose fact is optional sets the two edits against
    each other instead: the summary without the fact against the one that states it wrong. With
    `optional_focus` > 0, that share of the pairs that state an optional fact edit one of those. With
    `fact_swap` > 0, that share of the pairs states one of `swap_slots` wrong (stated in both summaries).
    A wrong duration is in the other unit with probability `wrong_unit` (wrong_value)."""
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
        edited_facts[slot] = wrong_value(rng, facts, slot, wrong_unit)
    style = rng.random()
    edited = summarize(random.Random(style), edited_facts, edited_include, news)
    if contrast:
        without = summarize(random.Random(style), facts, include - {slot}, news)
        return [("min_omit", without, f"without {slot}"), ("min_wrong", edited, f"wrong {slot}")]
    text = summarize(random.Random(style), facts, include, news)
    return [("min_base", text, None), ("min_omit" if omit else "min_wrong", edited, f"{'without' if omit else 'wrong'} {slot}")]


def policy_summary(rng: random.Random, policy: str, facts: dict, reference: str, news: bool = False,
                   wrong_unit: float = 0.0) -> str:
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
        wrong[slot] = wrong_value(rng, facts, slot, wrong_unit)
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
                                    args.fact_swap_fraction, args.fact_swap_slots, args.wrong_unit_fraction)
                rng.shuffle(pair)
            else:
                pair = []
                while len(pair) < 2:
                    policy = rng.choices(policies, weights)[0]
                    text_ = policy_summary(rng, policy, facts, reference, news, args.wrong_unit_fraction)
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
