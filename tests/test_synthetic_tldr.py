import collections
import dataclasses
import filecmp
import json
import os
import random

import pytest
import tyro
from conftest import small_synthetic_args, tiny_default_array

from summarize_from_feedback_details import gold_judge
from summarize_from_feedback_details.gold_judge import swap_duration_unit
from summarize_from_feedback_details import synthetic_tldr as st


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_generator_is_deterministic(tmp_path):
    a, b, c = (str(tmp_path / name) for name in "abc")
    st.generate(small_synthetic_args(a, seed=7))
    st.generate(small_synthetic_args(b, seed=7))
    st.generate(small_synthetic_args(c, seed=8))
    files = ["tldr_sft/train.jsonl", "tldr_sft/validation.jsonl", "tldr_sft/test.jsonl",
             "comparisons/train.jsonl", "comparisons/validation.jsonl", "label_stats.json"]
    match, mismatch, errors = filecmp.cmpfiles(a, b, files, shallow=False)
    assert match == files and not mismatch and not errors
    assert not filecmp.cmp(os.path.join(a, files[0]), os.path.join(c, files[0]), shallow=False)
    assert sorted(os.listdir(tmp_path)) == ["a", "b", "c"]  # no temporary folders left behind


def test_files_follow_the_upstream_schemas(raw_dir):
    for split, count in (("train", 300), ("validation", 60), ("test", 60)):
        rows = read_jsonl(os.path.join(raw_dir, "tldr_sft", f"{split}.jsonl"))
        assert len(rows) == count
        for row in rows:
            assert set(row) == {"id", "subreddit", "title", "post", "summary"}
            assert all(isinstance(v, str) and v for v in row.values())
            assert not row["summary"].startswith(" ")  # like upstream: no leading space
        assert len({r["id"] for r in rows}) == count

    train = read_jsonl(os.path.join(raw_dir, "comparisons", "train.jsonl"))
    validation = read_jsonl(os.path.join(raw_dir, "comparisons", "validation.jsonl"))
    assert len(train) == 300 and len(validation) == 200
    for row in train + validation:
        assert set(row) == {"info", "summaries", "choice", "worker", "batch", "split", "extra"}
        assert set(row["info"]) == {"id", "post", "title", "subreddit", "site", "article"}
        assert len(row["summaries"]) == 2
        for summary in row["summaries"]:
            assert set(summary) == {"text", "policy", "note"}
            assert summary["text"].startswith(" ")  # like upstream: summaries start with a space
            # a minimal pair's edited summary says what was changed (upstream notes are free text)
            assert summary["note"] is None or summary["policy"] in ("min_wrong", "min_omit")
        assert row["choice"] in (0, 1)
        assert 1 <= row["extra"]["confidence"] <= 9
    assert {r["split"] for r in train} == {"train"}
    assert {r["split"] for r in validation} == {"valid1", "valid2"}
    assert not any(r["batch"] in st.CNNDM_BATCHES for r in train)
    ood = [r for r in validation if r["batch"] in st.CNNDM_BATCHES]
    assert len(ood) == 40
    assert {r["batch"] for r in ood} <= set(st.CNNDM_BATCHES)
    for row in ood:
        assert row["info"]["post"] is None and row["info"]["subreddit"] is None
        assert row["info"]["article"] and row["info"]["site"] in st.NEWS_SITES
    for row in validation:
        if row["batch"] not in st.CNNDM_BATCHES:
            assert row["info"]["post"] and row["info"]["article"] is None


def test_lexicon_cues_are_unambiguous():
    """Every surface form of a value is read back as exactly that value (and nothing else), and
    no filler sentence mentions any key fact."""
    for rel, (post_form, forms, _) in st.RELATIONS.items():
        for form in [post_form, *forms]:
            facts = st.extract_facts(f"my {form} is here.")
            assert dict(facts["relation"]) == {rel: 1}, form
    for problem, (post_forms, forms) in st.PROBLEMS.items():
        for form in post_forms + forms:
            facts = st.extract_facts(f"she {form}.")
            assert dict(facts["problem"]) == {problem: 1}, form
            assert not facts["relation"] and not facts["ask"] and not facts["feeling"], form
    for ask, (post_forms, forms) in st.ASKS.items():
        for form in post_forms + forms:
            for obj in ("him", "her", "them"):
                facts = st.extract_facts(form.format(obj=obj))
                assert dict(facts["ask"]) == {ask: 1}, form
    for feeling, forms in st.FEELINGS.items():
        for form in forms:
            assert dict(st.extract_facts(f"I am {form}.")["feeling"]) == {feeling: 1}
    rng = random.Random(0)
    for templates in (st.FILLER_SENTENCES, st.NEWS_FILLER_SENTENCES):
        for _ in range(200):
            facts = st.extract_facts(st._filler_sentence(rng, templates))
            assert not any(facts.values())
    for sentence in st.TAIL_SENTENCES:
        assert not any(st.extract_facts(sentence).values())


def _example(seed=3):
    rng = random.Random(seed)
    facts = st._sample_facts(rng, "relationships")
    _, post = st.make_post(rng, facts, long_post=False)
    return rng, facts, post


def test_gold_judge_known_answers():
    post = ("I (25F) have lived with my roommate (27M) for 3 years. We met at the gym a while ago.\n\n"
            "Lately they has not paid rent in months. I am so angry right now.\n\nShould I just move out?")
    perfect = " my roommate of 3 years has not paid rent, I feel angry. should I move out?"
    assert st.gold_score(post, perfect) == pytest.approx(5.5)
    # missing facts: only relation and problem
    assert st.gold_score(post, " roommate owes rent.") == pytest.approx(2.5)
    # a wrong number costs the duration credit and a wrong-fact penalty
    assert st.gold_score(post, perfect.replace("3 years", "5 years")) == pytest.approx(5.5 - 1.0 - 1.5)
    # an irrelevant detail costs the filler penalty
    assert st.gold_score(post, perfect + " we met at the gym.") == pytest.approx(5.5 - 0.6)
    # an unfinished summary
    assert st.gold_score(post, " my roommate of 3 years has not paid rent, I feel") == pytest.approx(
        1.0 + 1.5 + 1.0 - 0.5)
    # garbled words
    assert st.gold_score(post, perfect.replace("roommate", "roomxate")) == pytest.approx(5.5 - 1.0 - 0.4)
    # the EOS text does not count as a word
    assert st.gold_score(post, perfect + "<|endoftext|>") == pytest.approx(5.5)
    assert st.gold_score(post, "") < 0
    assert st.gold_preference(post, perfect, " roommate owes rent.") == 1.0
    assert st.gold_preference(post, " roommate owes rent.", perfect) == 0.0
    assert st.gold_preference(post, perfect, perfect) == 0.5
    # the judge reads the post out of a formatted query just as well
    query = f"SUBREDDIT: r/roommates\n\nTITLE: help\n\nPOST: {post}\n\nTL;DR:"
    assert st.gold_score(query, perfect) == st.gold_score(post, perfect)


def test_stated_facts_known_answers():
    """What a summary says of each of the post's facts: right, wrong (a value the post does not have, even
    beside the right one) or nothing; the post's ask and feeling read as the gold judge reads them."""
    post = ("SUBREDDIT: r/roommates\n\nTITLE: help\n\nPOST: I (25F) have lived with my roommate (27M) for 3 years."
            "\n\nLately they has not paid rent in months. I am so angry right now.\n\nShould I just move out?\n\nTL;DR:")
    assert gold_judge.stated_facts(post, " my roommate of 3 years has not paid rent, I feel angry. should I move out?") == \
        dict.fromkeys(("relation", "problem", "ask", "duration", "feeling"), "right")
    said = gold_judge.stated_facts(post, " my sister of 5 years has not paid rent.<|endoftext|> I feel angry.")
    assert said == {"relation": "wrong", "problem": "right", "ask": "", "duration": "wrong", "feeling": ""}
    # the right relation beside a wrong one is a wrong statement, as the gold judge charges it
    assert gold_judge.stated_facts(post, " my roommate and my sister have not paid rent.")["relation"] == "wrong"


def test_gold_validation_metrics_only_on_synthetic_posts(raw_dir):
    """The online stages' eval/gold/* per update: every generated post is recognised, a real-looking
    post (words outside the generator's) is not, and then nothing is logged."""
    rows = read_jsonl(os.path.join(raw_dir, "tldr_sft", "validation.jsonl"))
    queries = [f"SUBREDDIT: r/{r['subreddit']}\n\nTITLE: {r['title']}\n\nPOST: {r['post']}\n\nTL;DR:" for r in rows]
    assert all(st.is_synthetic_post(q) for q in queries)
    assert not st.is_synthetic_post("I (25F) adopted a kitten from the shelter yesterday and my landlord objects.")
    post = ("I (25F) have lived with my roommate (27M) for 3 years.\n\nLately they has not paid rent in months. "
            "I am so angry right now.\n\nShould I just move out?")
    perfect = " my roommate of 3 years has not paid rent, I feel angry. should I move out?"
    poor = " roommate owes rent."
    table = [{"query": post, "postprocessed_response": perfect, "reference_responses": poor},
             {"query": post, "postprocessed_response": poor, "reference_responses": poor}]
    assert st.gold_validation_metrics(table) == pytest.approx(
        {"eval/gold/score": (5.5 + 2.5) / 2, "eval/gold/win_rate": (1.0 + 0.5) / 2, "eval/gold/reference_score": 2.5})
    real = [{"query": "My landlord objects to the kitten I adopted.", "postprocessed_response": "x",
             "reference_responses": "y"}]
    assert st.gold_validation_metrics(table + real) == {} and st.gold_validation_metrics([]) == {}


def test_reward_gold_agreement_known_answers():
    post = ("I (25F) have lived with my roommate (27M) for 3 years.\n\nLately they has not paid rent in months. "
            "I am so angry right now.\n\nShould I just move out?")
    good = " my roommate of 3 years has not paid rent, I feel angry. should I move out?"
    poor = " roommate owes rent."
    # pairs: the gold judge prefers the first summary of rows 0-2 and ties on row 3
    queries, chosen, rejected = [post] * 4, [good, poor, good, good], [poor, good, poor, good]
    # the model: agrees (1), agrees (1; prefers the rejected `good`), ties (0.5), judge ties (0.5)
    chosen_rewards, rejected_rewards = [2.0, -1.0, 0.3, 5.0], [1.0, 0.5, 0.3, 1.0]
    assert st.reward_gold_agreement(queries, chosen, rejected, chosen_rewards, rejected_rewards) == 3 / 4
    assert st.reward_gold_agreement(queries[:1], chosen[:1], rejected[:1], [0.0], [1.0]) == 0.0
    with pytest.raises(ValueError):  # columns of different lengths are a bug, not a shorter table
        st.reward_gold_agreement(queries, chosen, rejected[:2], chosen_rewards, rejected_rewards)


def test_a_wrong_fact_loses_to_the_reference():
    for seed in range(50):
        rng, facts, post = _example(seed)
        reference = " " + st.reference_summary(rng, facts)
        for slot in ("relation", "problem", "duration"):
            wrong = dict(facts)
            if slot == "relation":
                wrong["relation"] = next(r for r in sorted(st.RELATIONS) if r != facts["relation"])
            elif slot == "problem":
                wrong["problem"] = next(p for p in sorted(st.PROBLEMS) if p != facts["problem"])
            else:
                wrong["duration"] = (facts["duration"][0] + 1, facts["duration"][1])
            # same style as the reference (same rng state) but one fact changed, duration included
            wrong_summary = " " + st.summarize(random.Random(seed), wrong, {"duration"})
            right_summary = " " + st.summarize(random.Random(seed), facts, {"duration"})
            assert st.gold_score(post, wrong_summary) < st.gold_score(post, right_summary)
            assert st.gold_score(post, wrong_summary) < st.gold_score(post, reference), (post, wrong_summary, reference)


def test_a_longer_summary_is_not_automatically_preferred(raw_dir):
    for seed in range(50):
        rng, facts, post = _example(seed)
        reference = " " + st.reference_summary(rng, facts)
        padded = reference + " " + st._filler_sentence(rng).lower()
        assert len(padded) > len(reference)
        assert st.gold_score(post, padded) < st.gold_score(post, reference)
        # the verbose policy's summary is a full one with restated and filler words: they cost
        verbose = " " + st.policy_summary(rng, "sup_verbose", facts, reference)
        full = " " + st.summarize(rng, facts, set(st.OPTIONAL_FACTS))
        assert st.gold_score(post, verbose) < st.gold_score(post, full)
    # over the labelled pairs, the longer summary wins less than half the time
    with open(os.path.join(raw_dir, "label_stats.json")) as f:
        stats = json.load(f)
    for split in ("train", "validation"):
        assert 0.3 < stats[split]["longer_summary_chosen_rate"] < 0.6


def test_reference_is_good_but_beatable():
    scores = {"ref": [], "sup_full": [], "sup_terse": []}
    for seed in range(200):
        rng, facts, post = _example(seed)
        reference = st.reference_summary(rng, facts)
        for policy in scores:
            scores[policy].append(st.gold_score(post, " " + st.policy_summary(rng, policy, facts, reference)))
    mean = {p: sum(v) / len(v) for p, v in scores.items()}
    assert mean["sup_terse"] < mean["ref"] < mean["sup_full"]
    assert mean["sup_full"] == pytest.approx(5.5)  # the best summaries reach the maximum score
    assert mean["ref"] > 3.0


def test_label_noise_agreement_on_validation(tmp_path, capsys):
    """Labels come from a noisy Bradley-Terry model: the gold judge agrees with most labels, not all."""
    stats = st.generate(st.Args(output_dir=str(tmp_path / "raw"), num_sft_train=10, num_sft_validation=10,
                                num_sft_test=10, num_comparison_train=10))
    agreement = {split: stats[split]["gold_label_agreement"] for split in ("validation", "validation_cnndm")}
    with capsys.disabled():
        print(f"\ngold-vs-label agreement on validation pairs (default generator): {agreement}")
    assert 0.6 < agreement["validation"] < 0.95
    assert 0.6 < agreement["validation_cnndm"] < 0.95
    # with a near-zero temperature the labels follow the judge (up to ties)
    exact = st.generate(st.Args(output_dir=str(tmp_path / "exact"), num_sft_train=10, num_sft_validation=10,
                                num_sft_test=10, num_comparison_train=10, label_temperature=1e-3))
    assert exact["validation"]["gold_label_agreement"] > 0.97


def test_confidence_grows_with_the_gold_margin(raw_dir):
    rows = read_jsonl(os.path.join(raw_dir, "comparisons", "train.jsonl"))
    low, high = [], []
    for row in rows:
        post = row["info"]["post"]
        margin = abs(st.gold_score(post, row["summaries"][0]["text"]) - st.gold_score(post, row["summaries"][1]["text"]))
        (high if margin > 2 else low).append(row["extra"]["confidence"])
    assert sum(high) / len(high) > sum(low) / len(low) + 1


def test_long_posts_end_in_filler_only():
    rng = random.Random(0)
    for _ in range(100):
        facts = st._sample_facts(rng, "roommates")
        _, post = st.make_post(rng, facts, long_post=True)
        paragraphs = post.split("\n\n")
        full = st.extract_facts(post)
        # cutting any number of trailing filler paragraphs keeps every key fact
        core = next(i for i, p in enumerate(paragraphs) if any(st.extract_facts(p)["ask"]))
        assert {k: set(v) for k, v in st.extract_facts("\n\n".join(paragraphs[: core + 1])).items()} == \
            {k: set(v) for k, v in full.items()}
        assert len(paragraphs) > core + 1


def test_atomic_output_dir_keeps_the_old_folder_on_failure(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with st.atomic_output_dir(str(target)) as tmp:
            (tmp_path / os.path.basename(tmp) / "half.txt").write_text("half")
            raise RuntimeError("boom")
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(target) == ["old.txt"]
    with st.atomic_output_dir(str(target)) as tmp:
        (tmp_path / os.path.basename(tmp) / "new.txt").write_text("new")
    assert sorted(os.listdir(tmp_path)) == ["out"] and os.listdir(target) == ["new.txt"]


def test_minimal_pairs_differ_in_one_fact():
    """A minimal pair is one summary and the same words with one fact wrong or left out: the gold judge
    sees that fact change and nothing else, and prefers the summary as it was."""
    kinds = set()
    for seed in range(300):
        rng, facts, post = _example(seed)
        (policy, text, note), (edited_policy, edited, edited_note) = st.minimal_pair(rng, facts)
        kind, slot = edited_note.split()
        kinds.add((edited_policy, kind, slot))
        assert policy == "min_base" and note is None
        assert edited_policy == {"wrong": "min_wrong", "without": "min_omit"}[kind]
        said, edited_said = st.extract_facts(text), st.extract_facts(edited)
        assert {s for s in st.SCORE_WEIGHTS if said[s] != edited_said[s]} == {slot}
        assert all(set(values) <= set(st.extract_facts(post)[s]) for s, values in said.items() if s in st.SCORE_WEIGHTS)
        if kind == "without":
            assert not edited_said[slot] and slot in st.OPTIONAL_FACTS
        assert st.gold_score(post, " " + edited) < st.gold_score(post, " " + text)
    # every fact is edited both ways (the required ones only made wrong)
    assert {(kind, slot) for _, kind, slot in kinds} == {("wrong", s) for s in st.SCORE_WEIGHTS} | {
        ("without", s) for s in st.OPTIONAL_FACTS}


def test_summary_wording_does_not_depend_on_the_facts_stated():
    """summarize draws its wording whatever it states: from one rng state, a summary without the ask is
    the one with it cut before the ask, and one without the feeling keeps the same clause and ask."""
    for seed in range(20):
        _, facts, _ = _example(seed)
        full = st.summarize(random.Random(seed), facts, set(st.OPTIONAL_FACTS))
        no_ask = st.summarize(random.Random(seed), facts, {"duration", "feeling"})
        no_feeling = st.summarize(random.Random(seed), facts, {"duration", "ask"})
        assert full.startswith(no_ask) and len(full) > len(no_ask)
        clause, ask = no_feeling.split(". ", 1)
        assert full.startswith(clause) and full.endswith(". " + ask) and len(full) > len(no_feeling)


@pytest.mark.parametrize("flags", ["generator", "hello_world"])
def test_default_task_is_honest(tmp_path, flags):
    """The bounds issue 33 sets on the default generator and on hello_world's data (label_stats.json):
    noisy labels (the gold judge agrees with at most 0.90 of them), length alone no predictor (the longer
    summary chosen at most 0.55 of the time), a reference that is good but beatable."""
    given = tiny_default_array("TINY_DATA_FLAGS") if flags == "hello_world" else []
    args = tyro.cli(st.Args, args=[*given, "--num_pretrain_posts", "0"])
    stats = st.generate(dataclasses.replace(args, output_dir=str(tmp_path / "raw"), num_sft_train=10,
                                            num_sft_validation=400, num_sft_test=10, num_comparison_train=3000))
    for split in ("train", "validation"):
        assert 0.7 < stats[split]["gold_label_agreement"] <= 0.90
        assert 0.35 < stats[split]["longer_summary_chosen_rate"] <= 0.55
    assert 2.5 < stats["sft_reference_mean_gold_score"]["validation"] < 4.0


def test_omit_vs_wrong_pairs_set_a_missing_fact_against_a_wrong_one():
    """--omit_vs_wrong_fraction: a minimal pair whose edited fact is optional may set its two edits against
    each other (the fact left out, the fact stated wrong), in the same words otherwise; the gold judge
    prefers the missing fact. At 0 (the default) there are none."""
    contrasts = set()
    for seed in range(300):
        rng, facts, post = _example(seed)
        (policy, text, note), (edited_policy, edited, edited_note) = st.minimal_pair(rng, facts, omit_vs_wrong=1.0)
        if policy == "min_base":  # a required fact: only made wrong
            assert edited_note.split()[1] not in st.OPTIONAL_FACTS
            continue
        slot = note.split()[1]
        assert (policy, note, edited_policy, edited_note) == ("min_omit", f"without {slot}", "min_wrong", f"wrong {slot}")
        said, edited_said = st.extract_facts(text), st.extract_facts(edited)
        assert not said[slot] and edited_said[slot] and slot in st.OPTIONAL_FACTS
        assert {s for s in st.SCORE_WEIGHTS if said[s] != edited_said[s]} == {slot}
        assert st.gold_score(post, " " + edited) < st.gold_score(post, " " + text)
        contrasts.add(slot)
    assert contrasts == set(st.OPTIONAL_FACTS)
    for seed in range(50):  # the default: every pair keeps its unedited summary
        rng, facts, _ = _example(seed)
        assert st.minimal_pair(rng, facts)[0][0] == "min_base"


def test_optional_fact_focus_edits_the_optional_facts():
    """--optional_fact_focus 1: a minimal pair whose summary states an optional fact edits one of them
    (wrong or left out); by default the required facts are edited in such pairs too."""
    def edited_slots(focus):
        slots = []
        for seed in range(300):
            rng, facts, _ = _example(seed)
            (_, text, _), (_, _, edited_note) = st.minimal_pair(rng, facts, optional_focus=focus)
            said = st.extract_facts(text)
            if any(said[s] for s in st.OPTIONAL_FACTS):
                slots.append(edited_note.split()[1])
        return slots

    focused, default = edited_slots(1.0), edited_slots(0.0)
    assert focused and set(focused) == set(st.OPTIONAL_FACTS)
    assert {"relation", "problem"} <= set(default)


def test_fact_swap_pairs_state_the_named_facts_wrong():
    """--fact_swap_fraction 1: every minimal pair sets a summary against itself with one of
    --fact_swap_slots stated wrong (an optional one stated in both), nothing else changed, and the gold
    judge prefers the right fact by 2.5 or more; at 0 (the default) the pairs are drawn as before."""
    swapped = set()
    for seed in range(200):
        rng, facts, post = _example(seed)
        (policy, text, _), (edited_policy, edited, note) = st.minimal_pair(
            rng, facts, fact_swap=1.0, swap_slots=("relation", "duration"))
        slot = note.split()[1]
        assert (policy, edited_policy, note) == ("min_base", "min_wrong", f"wrong {slot}")
        said, edited_said = st.extract_facts(text), st.extract_facts(edited)
        assert said[slot] and edited_said[slot] and said[slot] != edited_said[slot]
        assert {s for s in st.SCORE_WEIGHTS if said[s] != edited_said[s]} == {slot}
        assert st.gold_score(post, " " + text) - st.gold_score(post, " " + edited) >= 2.5
        swapped.add(slot)
    assert swapped == {"relation", "duration"}
    for seed in range(50):
        draws = [st.minimal_pair(*_example(seed)[:2], **more) for more in ({}, {"fact_swap": 0.0})]
        assert draws[0] == draws[1]


def test_a_fact_named_twice_in_fact_swap_slots_is_swapped_twice_as_often():
    """--fact_swap_slots relation relation problem feeling (hello_world's data): each entry is equally likely,
    so half of the swaps are of the relation and a quarter each of the problem and the feeling; without the
    repeat, a third each."""
    def shares(slots):
        counts = collections.Counter()
        for seed in range(3000):
            rng, facts, _ = _example(seed)
            note = st.minimal_pair(rng, facts, fact_swap=1.0, swap_slots=slots)[1][2]
            counts[note.split()[1]] += 1
        return {slot: count / 3000 for slot, count in counts.items()}

    doubled, once = shares(("relation", "relation", "problem", "feeling")), shares(("relation", "problem", "feeling"))
    assert abs(doubled["relation"] - 1 / 2) < 0.03
    assert abs(doubled["problem"] - 1 / 4) < 0.03 and abs(doubled["feeling"] - 1 / 4) < 0.03
    assert all(abs(share - 1 / 3) < 0.03 for share in once.values()) and len(once) == 3
    flags = tiny_default_array("TINY_DATA_FLAGS")
    start = flags.index("--fact_swap_slots") + 1
    assert flags[start:start + 4] == ["relation", "relation", "problem", "feeling"]


def test_unknown_fact_swap_slot_is_refused_before_anything_is_written(tmp_path):
    args = dataclasses.replace(small_synthetic_args(str(tmp_path / "raw")), fact_swap_fraction=0.5,
                               fact_swap_slots=("relation", "relatoin"))
    with pytest.raises(ValueError, match="relatoin is none of relation, problem, ask, duration, feeling"):
        st.generate(args)
    assert not os.path.exists(tmp_path / "raw")


def test_pretrain_posts_end_in_a_tldr_that_states_every_fact(tmp_path):
    """--num_pretrain_posts writes pretrain/train.jsonl (posts whose author's TL;DR states every fact right)
    from a random stream of its own: every other file is what the generator writes without it."""
    with_posts, without = str(tmp_path / "with"), str(tmp_path / "without")
    st.generate(dataclasses.replace(small_synthetic_args(with_posts), num_pretrain_posts=40))
    st.generate(small_synthetic_args(without))
    files = ["tldr_sft/train.jsonl", "tldr_sft/validation.jsonl", "tldr_sft/test.jsonl",
             "comparisons/train.jsonl", "comparisons/validation.jsonl"]
    match, mismatch, errors = filecmp.cmpfiles(with_posts, without, files, shallow=False)
    assert match == files, (mismatch, errors)
    assert not os.path.exists(os.path.join(without, "pretrain"))
    with open(os.path.join(with_posts, "pretrain", "train.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 40 and len({r["post"] for r in rows}) == 40
    # one stream: the first 25 of 40 are the file of 25 (tiny_models --extra_corpus_rows reads a prefix)
    fewer = str(tmp_path / "fewer")
    st.generate(dataclasses.replace(small_synthetic_args(fewer), num_pretrain_posts=25))
    with open(os.path.join(fewer, "pretrain", "train.jsonl")) as f:
        assert [json.loads(line) for line in f] == rows[:25]
    with open(os.path.join(with_posts, "tldr_sft", "train.jsonl")) as f:
        sft_posts = {json.loads(line)["post"] for line in f}
    for row in rows:
        post, tldr = row["post"].split("\n\nTL;DR: ")
        assert tldr == row["summary"] and post not in sft_posts
        truth, said = st.extract_facts(post), st.extract_facts(tldr)
        for slot in st.SCORE_WEIGHTS:  # every fact stated once, and right
            assert len(said[slot]) == 1 and set(said[slot]) <= set(truth[slot]), (slot, post, tldr)


def test_a_fact_swap_makes_that_fact_wrong_and_changes_nothing_else():
    """swap_fact edits one slot of a summary that states the post's value: that slot now states a wrong
    value, every other slot reads as before, and the gold judge takes 2.5 or more off; a slot the summary
    does not state (or states wrongly already) gives None."""
    rng, swapped = random.Random(3), {slot: 0 for slot in st.FACT_SWAP_SLOTS}
    for _ in range(300):
        facts = st._sample_facts(rng, rng.choice(sorted(st.SUBREDDITS)))
        _, post = st.make_post(rng, facts, False)
        summary = " " + st.summarize(rng, facts, {slot for slot in st.OPTIONAL_FACTS if rng.random() < 0.5})
        truth, stated = st.extract_facts(post), st.extract_facts(summary)
        for slot in st.FACT_SWAP_SLOTS:
            edited = st.swap_fact(rng, post, summary, slot)
            if not stated[slot]:
                assert edited is None
                continue
            swapped[slot] += 1
            after = st.extract_facts(edited)
            assert after[slot] and not set(after[slot]) <= set(truth[slot]), (summary, edited)
            assert all(after[other] == stated[other] for other in st.FACT_SWAP_SLOTS if other != slot), (summary, edited)
            assert st.gold_score(post, summary) - st.gold_score(post, edited) >= 2.5
    assert min(swapped.values()) > 50  # every slot was tried
    wrong = " my landlord plays loud music."  # the post's relation is not a landlord
    post = "POST: my roommate (27M) plays loud music every night."
    assert st.swap_fact(random.Random(0), post, wrong, "relation") is None


def test_a_duration_unit_swap_keeps_the_number_and_costs_the_gold_judge():
    """swap_duration_unit states the post's duration in the other unit: the same number, every other
    slot as before, 2.5 or more off the gold judge; None where the summary does not state the post's
    duration (swap_fact's duration moves the number, so only this swap finds a reader blind to the unit)."""
    rng, swapped = random.Random(3), 0
    for _ in range(300):
        facts = st._sample_facts(rng, rng.choice(sorted(st.SUBREDDITS)))
        _, post = st.make_post(rng, facts, False)
        summary = " " + st.summarize(rng, facts, {slot for slot in st.OPTIONAL_FACTS if rng.random() < 0.5})
        stated, edited = st.extract_facts(summary), swap_duration_unit(post, summary)
        if not stated["duration"]:
            assert edited is None
            continue
        swapped += 1
        after = st.extract_facts(edited)
        ((number, unit),) = stated["duration"]
        assert list(after["duration"]) == [(number, "months" if unit == "years" else "years")], (summary, edited)
        assert all(after[other] == stated[other] for other in st.FACT_SWAP_SLOTS if other != "duration")
        assert st.gold_score(post, summary) - st.gold_score(post, edited) >= 2.5
    assert swapped > 50
    assert swap_duration_unit("POST: my roommate (27M) and I have lived together for 3 years.",
                              " my roommate of 4 years snores.") is None  # (states another duration)


def test_wrong_unit_fraction_states_the_posts_number_in_the_other_unit(tmp_path):
    """--wrong_unit_fraction: of the comparisons' wrong durations, that share states the post's number in the
    other unit (the gold judge charging it as any wrong duration), the rest a moved number in the post's unit;
    at 0 (the default) nothing is drawn for it, so the comparisons are the default's; the SFT and pretraining
    posts are the same at any share."""
    def wrong_durations(share, seeds=range(300)):
        kinds = collections.Counter()
        for seed in seeds:
            rng, facts, post = _example(seed)
            for (_, text, _), (_, edited, note) in [st.minimal_pair(rng, facts, fact_swap=1.0, swap_slots=("duration",),
                                                                    wrong_unit=share)]:
                ((number, unit),), ((wrong_number, wrong_unit),) = (st.extract_facts(text)["duration"],
                                                                    st.extract_facts(edited)["duration"])
                assert note == "wrong duration"
                assert st.gold_score(post, " " + text) - st.gold_score(post, " " + edited) >= 2.5
                assert (wrong_number == number) != (wrong_unit == unit), (text, edited)  # one part wrong, not both
                kinds["unit" if wrong_number == number else "number"] += 1
        return kinds

    assert wrong_durations(1.0) == {"unit": 300} and wrong_durations(0.0) == {"number": 300}
    assert 0.4 < wrong_durations(0.5)["unit"] / 300 < 0.6
    for seed in range(50):  # 0 draws nothing: the pairs of the default, draw for draw
        assert st.minimal_pair(*_example(seed)[:2], fact_swap=0.6) == st.minimal_pair(
            *_example(seed)[:2], fact_swap=0.6, wrong_unit=0.0)
    default, units = str(tmp_path / "default"), str(tmp_path / "units")
    st.generate(dataclasses.replace(small_synthetic_args(default), num_pretrain_posts=20, minimal_pair_fraction=0.6))
    st.generate(dataclasses.replace(small_synthetic_args(units), num_pretrain_posts=20, minimal_pair_fraction=0.6,
                                    wrong_unit_fraction=0.5))
    same = ["tldr_sft/train.jsonl", "tldr_sft/validation.jsonl", "tldr_sft/test.jsonl", "pretrain/train.jsonl"]
    assert filecmp.cmpfiles(default, units, same, shallow=False)[0] == same

    def wrong_units(folder):
        count = 0
        for row in read_jsonl(os.path.join(folder, "comparisons", "train.jsonl")):
            (number, unit), = st.extract_facts(row["info"]["post"])["duration"]
            other = (number, "months" if unit == "years" else "years")
            count += sum(other in st.extract_facts(summary["text"])["duration"] for summary in row["summaries"])
        return count

    assert wrong_units(default) == 0 and wrong_units(units) > 10


def test_data_of_other_arguments_is_named_not_kept(tmp_path):
    """check_recorded_args (hello_world.sh's guard before it skips existing data): silent where the folder
    was generated with the arguments asked for, an exit naming each difference where not; a field the
    folder's record predates counts as its default (what generated it)."""
    raw = str(tmp_path / "raw")
    st.generate(dataclasses.replace(small_synthetic_args(raw), num_sft_train=20, num_comparison_train=20))
    same = ["--output_dir", raw, "--num_sft_train", "20", "--num_comparison_train", "20", "--num_sft_validation",
            "60", "--num_sft_test", "60", "--num_comparison_validation", "160", "--num_comparison_validation_cnndm",
            "40", "--minimal_pair_fraction", "0.0"]
    st.check_recorded_args(same)
    with pytest.raises(SystemExit, match=rf"{raw} was generated with other arguments \(seed: 1 there, 2 now; "
                                         r"fact_swap_fraction: 0.0 there, 0.6 now\): --force regenerates it"):
        st.check_recorded_args(same + ["--seed", "2", "--fact_swap_fraction", "0.6"])
    stats_path = os.path.join(raw, "label_stats.json")
    with open(stats_path) as f:
        stats = json.load(f)
    del stats["args"]["fact_swap_fraction"]  # data written before the flag existed
    with open(stats_path, "w") as f:
        json.dump(stats, f)
    st.check_recorded_args(same)
    with pytest.raises(SystemExit, match="fact_swap_fraction: 0.0 there, 0.6 now"):
        st.check_recorded_args(same + ["--fact_swap_fraction", "0.6"])
