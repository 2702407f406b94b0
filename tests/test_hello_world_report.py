import json
import os

import numpy as np
import pandas as pd
import pytest
import torch

from summarize_from_feedback_details import evaluation
from summarize_from_feedback_details import hello_world_report as report
from summarize_from_feedback_details.infra import tracking

POST = ("SUBREDDIT: r/roommates\n\nTITLE: help\n\nPOST: I (25F) have lived with my roommate (27M) for 3 years.\n\n"
        "Lately they has not paid rent in months. I am so angry right now.\n\nShould I just move out?\n\nTL;DR:")
GOOD = " my roommate of 3 years has not paid rent, I feel angry. should I move out?<|endoftext|>"
POOR = " roommate owes rent.<|endoftext|>"


def write_run(folder, metrics_lines, tables):
    os.makedirs(folder)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step, metrics in enumerate(metrics_lines):
            f.write(json.dumps({"step": step, **metrics}) + "\n")
    for name, frame in tables.items():
        frame.to_csv(os.path.join(folder, name), index=False)


def test_report_reads_the_run_folders(tmp_path):
    runs = tmp_path / "runs"
    args = report.Args(runs_dir=str(runs), models_dir=str(tmp_path / "no_models"), plots_dir=str(tmp_path / "no_plots"))
    assert report.collect(args) == []  # nothing has run yet
    write_run(runs / "hello_world_sft", [{"train/sft/loss": 2.0}, {"validation/sft/rouge/rougeL": 0.4567}],
              {"validation_table.csv": pd.DataFrame({"query": [POST, POST], "postprocessed_response": [
                  " one two three", " one two three four five"], "reference_responses": ["x", "y"]})})
    # the model orders pair 0 as the judge does, pair 1 the other way, pair 2 ties: agreement 0.5
    eval_table = pd.DataFrame({"query": [POST] * 3, "chosen": [GOOD, GOOD, POOR], "rejected": [POOR, POOR, GOOD],
                               "chosen_rewards": [1.0, -1.0, 0.0], "rejected_rewards": [0.0, 1.0, 0.0]})
    write_run(runs / "hello_world_reward", [{"eval/rm/validation/accuracy": 0.7, "eval/rm/validation_cnndm/accuracy": 0.65}],
              {"eval_validation_table.csv": eval_table, "eval_validation_cnndm_table.csv": eval_table.iloc[:1]})
    # DPO's implicit rewards in the same table format: pair 0 ordered against the judge -> agreement 0
    write_run(runs / "hello_world_dpo", [{"eval/rm/validation/accuracy": 0.6, "eval/rm/validation_cnndm/accuracy": 0.55}],
              {"eval_validation_table.csv": eval_table.assign(chosen_rewards=[-1.0, -1.0, 0.0]),
               "eval_validation_cnndm_table.csv": eval_table.iloc[:1].assign(chosen_rewards=[-1.0])})
    rows = dict(report.collect(args))
    assert rows["SFT ROUGE-L (validation)"] == "0.457"
    assert rows["RM accuracy, TL;DR validation"] == "0.700 (3 pairs)"
    assert rows["RM agreement with the gold judge, TL;DR validation"] == "0.500"
    assert rows["RM accuracy, OOD (CNN/DM role)"] == "0.650 (1 pairs)"
    assert rows["RM agreement with the gold judge, OOD (CNN/DM role)"] == "1.000"
    assert rows["DPO implicit-reward accuracy, TL;DR validation"] == "0.600 (3 pairs)"
    assert rows["DPO implicit-reward agreement with the gold judge, TL;DR validation"] == "0.167"  # (a tie: half)
    assert rows["DPO implicit-reward accuracy, OOD (CNN/DM role)"] == "0.550 (1 pairs)"
    assert rows["DPO implicit-reward agreement with the gold judge, OOD (CNN/DM role)"] == "0.000"
    # real data: accuracies without the synthetic gold judge
    real = dict(report.collect(report.Args(runs_dir=str(runs), models_dir=args.models_dir, gold_judge=False)))
    assert real["DPO implicit-reward accuracy, TL;DR validation"] == "0.600 (3 pairs)"
    assert not any("gold" in what for what in real)


def test_last_metrics_keeps_the_latest_value(tmp_path):
    write_run(tmp_path / "run", [{"a": 1.0}, {"a": 2.0, "b": 3.0}], {})
    assert tracking.last_metrics(str(tmp_path / "run")) == pytest.approx({"a": 2.0, "b": 3.0})


def test_policy_rows_score_both_policies_the_same_way(tmp_path, tokenizer_dir, tokenizer):
    from transformers import AutoModelForSequenceClassification

    from summarize_from_feedback_details import reward
    from summarize_from_feedback_details.infra import loading

    models = tmp_path / "models"
    rm_dir = str(models / "reward_model")
    reward.reward_model_to_train(tokenizer_dir, loading.load_tokenizer(tokenizer_dir), head_seed=1).save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    from summarize_from_feedback_details.synthetic_tldr import gold_score

    good, poor = GOOD.replace("<|endoftext|>", ""), POOR.replace("<|endoftext|>", "")
    runs = tmp_path / "runs"
    # SFT: one win (good vs poor reference) and one loss; PPO: two wins
    write_run(runs / "hello_world_sft", [{"validation/sft/rouge/rougeL": 0.5}], {"validation_table.csv": pd.DataFrame(
        {"query": [POST, POST], "postprocessed_response": [good, poor], "reference_responses": [poor, good]})})
    write_run(runs / "hello_world_ppo", [{"objective/kl": k, "ppo/val/explained_variance": 1 - k}
                                         for k in (9.0, 1.0, 2.0, 3.0, 4.0, 5.0)],
              {"validation_table.csv": pd.DataFrame({"query": [POST, POST], "postprocessed_response": [good, good],
                                                     "reference_responses": [poor, poor]})})
    # DPO: two losses
    write_run(runs / "hello_world_dpo", [{"train/rm/loss": 0.6}], {"validation_table.csv": pd.DataFrame(
        {"query": [POST, POST], "postprocessed_response": [poor, poor], "reference_responses": [good, good]})})
    # ALGOS=all: GRPO (one win, one loss; its own KL history) is a policy row of its own
    write_run(runs / "hello_world_grpo", [{"objective/kl": k} for k in (0.5, 1.5)], {"validation_table.csv": pd.DataFrame(
        {"query": [POST, POST], "postprocessed_response": [good, poor], "reference_responses": [poor, good]})})
    (tmp_path / "plots").mkdir()
    for name in ("win_rate.png", "win_rate.pdf", "length.png"):
        (tmp_path / "plots" / name).touch()
    args = report.Args(runs_dir=str(runs), models_dir=str(models), plots_dir=str(tmp_path / "plots"))
    rows = dict(report.collect(args))
    assert rows["models"] == f"{models}/{{reward_model}}"
    assert rows["plots"] == f"{tmp_path / 'plots'} (2 plots: PNG, PDF, CSV, markdown)"
    # each with its 95% Wilson interval over the 2 prompts
    assert rows["SFT gold-judge win rate vs reference (2 prompts)"] == "0.500 [0.095, 0.905]"
    assert rows["PPO gold-judge win rate vs reference (2 prompts)"] == "1.000 [0.342, 1.000]"
    assert rows["DPO gold-judge win rate vs reference (2 prompts)"] == "0.000 [0.000, 0.658]"
    # all losses: the length-controlled rate is ~0 whatever the lengths
    assert rows["DPO length-controlled gold win rate"].startswith("0.000 [0.000, 0.000]")
    assert rows["DPO mean response length (tokens)"] == f"{len(tokenizer(poor)['input_ids']):.1f}"
    assert rows["PPO KL to the SFT policy (nats per response, last 5 updates)"] == "3.00"
    assert rows["GRPO k=4 gold-judge win rate vs reference (2 prompts)"] == "0.500 [0.095, 0.905]"
    assert rows["GRPO k=4 KL to the SFT policy (nats per response, last 5 updates)"] == "1.00"
    # PPO's critic, at its first and last update; GRPO has none
    assert rows["PPO critic explained variance, first / last update"] == "-8.00 / -4.00"
    assert not [what for what in rows if what.startswith("GRPO") and "critic" in what]
    # every table asks POST twice: no pairing by query, said on the headline row; the other rows stay
    assert rows["PPO minus SFT, mean gold (paired)"].startswith(
        "not paired: PPO's validation table: the query 'SUBREDDIT: r/roommates TITLE: help POST: I (25F) have liv...' "
        "appears more than once")
    assert rows["PPO mean gold score"].startswith(f"{gold_score(POST, good):.3f} [")
    assert not any(what.startswith(("RLOO", "online DPO", "DPO KL")) for what in rows)  # no runs, no rows
    lengths = [len(tokenizer(r)["input_ids"]) for r in (good, poor)]
    assert rows["SFT mean response length (tokens)"] == f"{sum(lengths) / 2:.1f}"
    assert rows["PPO mean response length (tokens)"] == f"{lengths[0]:.1f}"
    # the score of [query | response + EOS], read at the EOS, whatever the padding of the batch
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    ids = torch.tensor([tokenizer(POST)["input_ids"] + tokenizer(good)["input_ids"] + [tokenizer.eos_token_id]])
    with torch.no_grad():
        alone = model(input_ids=ids).logits[0, 0].item()
    batched = evaluation.reward_scores(model, tokenizer, [POST, POST], [poor, good], [True, True])
    assert batched[1] == pytest.approx(alone, abs=1e-5) and batched[0] != pytest.approx(alone, abs=1e-3)
    assert rows["PPO mean reward-model score"] == f"{alone:.3f}"
    # real data: no gold judge, the other rows stay
    real = dict(report.collect(report.Args(runs_dir=str(runs), models_dir=str(models), gold_judge=False)))
    assert not any("gold" in what for what in real) and real["PPO mean reward-model score"] == f"{alone:.3f}"


def test_fact_swap_accuracy_known_answers(monkeypatch):
    """A scorer that is the gold judge prefers every reference to its swaps (1.0 on each slot the
    references state, the duration's unit included); a scorer blind to the facts ties every pair (0.5,
    ties half); a scorer that reads the duration's number and not its unit passes the duration's row and
    ties the unit's; the slots a reference leaves out get no pairs."""
    from summarize_from_feedback_details.synthetic_tldr import gold_score

    table = pd.DataFrame({"query": [POST] * 3, "reference_responses": [GOOD.replace("<|endoftext|>", ""),
                                                                       " my roommate has not paid rent.",
                                                                       " roommate owes rent, I am angry."]})
    gold = lambda model, tokenizer, queries, texts, eos: np.array([gold_score(q, t) for q, t in zip(queries, texts)])
    monkeypatch.setattr(evaluation, "reward_scores", gold)
    accuracy = report.fact_swap_accuracy(None, None, table)
    assert [(slot, entry["pairs"]) for slot, entry in accuracy.items()] == [
        ("relation", 3), ("problem", 3), ("ask", 1), ("duration", 1), ("duration_unit", 1), ("feeling", 2)]
    assert all(entry["accuracy"] == 1.0 and entry["margin"] >= 2.5 for entry in accuracy.values())
    monkeypatch.setattr(evaluation, "reward_scores", lambda model, tokenizer, queries, texts, eos: np.zeros(len(texts)))
    assert {entry["accuracy"] for entry in report.fact_swap_accuracy(None, None, table).values()} == {0.5}
    # "3 years" right, any other number wrong, the unit unread
    number_only = lambda model, tokenizer, queries, texts, eos: np.array(
        [-float(" of 3 " not in t) for t in texts])
    monkeypatch.setattr(evaluation, "reward_scores", number_only)
    accuracy = report.fact_swap_accuracy(None, None, table)
    assert (accuracy["duration"]["accuracy"], accuracy["duration_unit"]["accuracy"]) == (1.0, 0.5)
    rows = dict(row for section in report.sections({"fact_swaps": accuracy, "accuracy": {}, "policies": {}},
                                                    report.Args()) for row in section)
    assert rows["RM fact-swap accuracy, duration number (1 references)"] == "1.000 (margin +1.000)"
    assert rows["RM fact-swap accuracy, duration unit (1 references)"] == "0.500 (margin +0.000)"


def test_a_response_the_policy_did_not_end_is_scored_at_its_last_token(tmp_path, tokenizer_dir, tokenizer):
    """The report scores each response where the stage scored it: at the EOS of one the policy ended,
    at the last token of one that ran out of tokens (`contain_eos` False), with no EOS appended; a
    table written before that column scores every response with an EOS."""
    from summarize_from_feedback_details import reward
    from summarize_from_feedback_details.infra import loading

    model = reward.reward_model_to_train(tokenizer_dir, loading.load_tokenizer(tokenizer_dir), head_seed=1).eval()
    good = GOOD.replace("<|endoftext|>", "")
    ids = tokenizer(POST)["input_ids"] + tokenizer(good, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        ended, cut = (model(input_ids=torch.tensor([row])).logits[0, 0].item()
                      for row in (ids + [tokenizer.eos_token_id], ids))
    assert abs(ended - cut) > 1e-3  # (the two readings differ, so the check below can fail)
    path = tmp_path / "validation_table.csv"
    pd.DataFrame({"query": [POST, POST], "postprocessed_response": [good, good], "reference_responses": [good, good],
                  "contain_eos": [True, False]}).to_csv(path, index=False)
    table = pd.read_csv(path, keep_default_na=False)  # (as the report reads it)
    assert evaluation.table_reward_scores(model, tokenizer, table) == pytest.approx([ended, cut], abs=1e-5)
    older = table.drop(columns="contain_eos")
    assert evaluation.table_reward_scores(model, tokenizer, older) == pytest.approx([ended, ended], abs=1e-5)


# ---------------------------------------------------------------- the headline: paired against SFT

def words(query, summary):
    """A stand-in gold judge whose numbers can be worked out by hand: the summary's word count."""
    return float(len(summary.split()))


def validation_table(responses: dict) -> pd.DataFrame:
    """{query: response} -> a validation table; every reference has 3 words."""
    return pd.DataFrame({"query": list(responses), "postprocessed_response": list(responses.values()),
                         "reference_responses": ["r r r"] * len(responses)})


# word counts per prompt: SFT 2 3 4 1, PPO 4 3 5 2 (+2 0 +1 +1), DPO 1 1 4 1 (-1 -2 0 0)
SFT_TABLE = validation_table({"q1": "a a", "q2": "a a a", "q3": "a a a a", "q4": "a"})
PPO_TABLE = validation_table({"q3": "a a a a a", "q1": "a a a a", "q4": "a a", "q2": "a a a"})  # rows in another order
DPO_TABLE = validation_table({"q1": "a", "q2": "a", "q3": "a a a a", "q4": "a"})


def headline_runs(runs):
    write_run(runs / "hello_world_sft", [{"validation/sft/rouge/rougeL": 0.5}], {"validation_table.csv": SFT_TABLE})
    write_run(runs / "hello_world_ppo", [{"objective/kl": k} for k in (1.0, 2.0)], {"validation_table.csv": PPO_TABLE})
    write_run(runs / "hello_world_dpo", [{"train/rm/loss": 0.6}], {"validation_table.csv": DPO_TABLE})
    # the control answered other prompts (q4 missing): no paired number, its own numbers stay
    write_run(runs / "hello_world_ppo_control", [{"objective/kl": 0.5}], {"validation_table.csv": SFT_TABLE.iloc[:3]})


def test_paired_gold_rows_known_answers(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "gold_score", words)
    runs = tmp_path / "runs"
    headline_runs(runs)
    args = report.Args(runs_dir=str(runs), models_dir=str(tmp_path / "no_models"), plots_dir=str(tmp_path / "plots"))
    rows = report.collect(args)
    table = dict(rows)
    ci = report.win_rates.bootstrap_interval
    wilson = report.win_rates.wilson_interval
    # PPO - SFT per prompt, joined on the query: q1 +2, q2 0, q3 +1, q4 +1 -> +1.000; W T W W -> 0.875
    low, high = ci(np.array([2.0, 0.0, 1.0, 1.0]))
    assert 0.0 <= low < 1.0 < high <= 2.0
    assert table["PPO minus SFT, mean gold (paired, 4 prompts)"] == f"+1.000 [{low:.3f}, {high:.3f}]"
    assert table["PPO head-to-head vs SFT"] == "0.875 [{:.3f}, {:.3f}]".format(*wilson(0.875, 4))
    assert table["PPO mean gold score"] == "3.500 [{:.3f}, {:.3f}]".format(*ci(np.array([5.0, 4.0, 2.0, 3.0])))
    # DPO: -1 -2 0 0 -> -0.750; L L T T -> 0.250
    low, high = ci(np.array([-1.0, -2.0, 0.0, 0.0]))
    assert table["DPO minus SFT, mean gold (paired, 4 prompts)"] == f"-0.750 [{low:.3f}, {high:.3f}]"
    assert table["DPO head-to-head vs SFT"] == "0.250 [{:.3f}, {:.3f}]".format(*wilson(0.25, 4))
    # SFT: no row against itself; its mean gold 2.5 and its win rate vs the 3-word references L T W L
    assert not any(what.startswith("SFT minus") or what.startswith("SFT head") for what in table)
    assert table["SFT mean gold score"].startswith("2.500 [")
    assert table["SFT gold-judge win rate vs reference (4 prompts)"] == "0.375 [{:.3f}, {:.3f}]".format(*wilson(0.375, 4))
    assert table["control minus SFT, mean gold (paired)"].startswith(
        "not paired: the two tables do not hold the same prompts: 0 only in the policy's, 1 only in the baseline's")
    assert table["control gold-judge win rate vs reference (3 prompts)"].startswith("0.500 [")
    assert table["control KL to the SFT policy (nats per response, last 5 updates)"] == "0.50"
    # the headline leads each policy's rows
    whats = [what for what, _ in rows]
    assert whats[whats.index("SFT ROUGE-L (validation)") + 1] == "SFT mean gold score"
    ppo = [what for what in whats if what.startswith("PPO ")]
    assert ppo == ["PPO minus SFT, mean gold (paired, 4 prompts)", "PPO head-to-head vs SFT", "PPO mean gold score",
                   "PPO gold-judge win rate vs reference (4 prompts)",
                   "PPO KL to the SFT policy (nats per response, last 5 updates)"]

    # the same numbers as JSON beside the plots
    report.main(args)
    with open(tmp_path / "plots" / "hello_world_report.json") as f:
        saved = json.load(f)
    assert saved["sft_rouge_l"] == 0.5 and saved["gold_judge"] is True
    assert list(saved["policies"]) == ["SFT", "PPO", "DPO", "control"]
    ppo = saved["policies"]["PPO"]
    assert list(ppo) == ["prompts", "gold_minus_sft", "head_to_head_vs_sft", "gold_score", "win_rate", "kl"]
    low, high = ci(np.array([2.0, 0.0, 1.0, 1.0]))
    assert ppo["gold_minus_sft"] == {"value": 1.0, "low": low, "high": high, "prompts": 4}
    assert ppo["head_to_head_vs_sft"] == pytest.approx({"value": 0.875, "low": wilson(0.875, 4)[0],
                                                        "high": wilson(0.875, 4)[1]})
    # PPO vs the 3-word references: 5 4 2 3 words, W W L T -> 0.625
    assert ppo["gold_score"]["value"] == 3.5 and ppo["win_rate"]["value"] == 0.625 and ppo["kl"] == 1.5
    assert ppo["prompts"] == 4
    assert saved["policies"]["DPO"]["gold_minus_sft"]["value"] == -0.75
    assert saved["policies"]["control"]["not_paired"].startswith("the two tables do not hold the same prompts")
    assert "gold_minus_sft" not in saved["policies"]["SFT"] and saved["policies"]["SFT"]["gold_score"]["value"] == 2.5

    # real data: no gold judge, no gold numbers, in the table or the JSON
    real = report.Args(runs_dir=str(runs), models_dir=args.models_dir, plots_dir=str(tmp_path / "real"), gold_judge=False)
    assert not any("gold" in what or "SFT" in what and "minus" in what for what, _ in report.collect(real))
    report.main(real)
    with open(tmp_path / "real" / "hello_world_report.json") as f:
        saved = json.load(f)
    assert saved["gold_judge"] is False
    assert saved["policies"] == {"SFT": {"prompts": 4}, "PPO": {"prompts": 4, "kl": 1.5}, "DPO": {"prompts": 4},
                                 "control": {"prompts": 3, "kl": 0.5}}


def test_paired_gold_with_the_gold_judge_only_some_runs(tmp_path):
    """The real gold judge on two posts; only SFT and PPO have run. The head-to-head is gold_preference's."""
    from summarize_from_feedback_details.synthetic_tldr import gold_preference, gold_score

    other = POST.replace("3 years", "5 years")
    good, poor = GOOD.replace("<|endoftext|>", ""), POOR.replace("<|endoftext|>", "")
    sft = {POST: poor, other: good.replace("3 years", "5 years")}
    ppo = {POST: good, other: poor}
    runs = tmp_path / "runs"
    write_run(runs / "hello_world_sft", [{"validation/sft/rouge/rougeL": 0.5}], {"validation_table.csv": pd.DataFrame(
        {"query": list(sft), "postprocessed_response": list(sft.values()), "reference_responses": [good, good]})})
    write_run(runs / "hello_world_ppo", [{"objective/kl": 2.0}], {"validation_table.csv": pd.DataFrame(
        {"query": list(ppo), "postprocessed_response": list(ppo.values()), "reference_responses": [good, good]})})
    rows = dict(report.collect(report.Args(runs_dir=str(runs), models_dir=str(tmp_path / "no"), plots_dir=str(tmp_path))))
    differences = [gold_score(q, ppo[q]) - gold_score(q, sft[q]) for q in sorted(sft)]
    assert differences[sorted(sft).index(POST)] > 0 > differences[sorted(sft).index(other)]
    low, high = report.win_rates.bootstrap_interval(np.array(differences))
    assert rows["PPO minus SFT, mean gold (paired, 2 prompts)"] == \
        f"{np.mean(differences):+.3f} [{low:.3f}, {high:.3f}]"
    h2h = np.mean([gold_preference(q, ppo[q], sft[q]) for q in sft])
    assert h2h == 0.5 and rows["PPO head-to-head vs SFT"].startswith("0.500 [")
    assert not any(what.startswith(("DPO", "RLOO", "GRPO", "online DPO", "control")) for what in rows)
