"""eval/async_table.py (make async's table) on fake run folders with known gold differences, KL,
lengths and timings."""

import json
import os
import sys

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eval"))
import async_table
import compare_table
from test_eval_compare_table import QUERIES, words
from test_eval_rlhf_scaling_plot import GOOD, MID, POOR

from summarize_from_feedback_details.win_rates import t_interval

# (exp_name, async_steps): GOOD summaries on how many of the 4 prompts for seeds 1, 2, 3 (MID on the
# others); SFT writes MID everywhere, so a seed's paired gold difference is wins x (16 - 10) / 4
GOOD_PROMPTS = {("ppo_left_padding", 0): (4, 4, 3), ("ppo_left_padding", 2): (2, 1, 0),
                ("online_dpo", 0): (4, 3, 4), ("online_dpo", 2): (4, 4, 3)}


def write_run(runs_dir, name, config, summaries, tokenizer_dir, kls=(), seconds=()):
    folder = os.path.join(runs_dir, name)
    os.makedirs(folder)
    with open(os.path.join(folder, "args.json"), "w") as f:
        json.dump({"base_model": "models/tiny/pythia-tiny-m", "output_dir": tokenizer_dir, **config}, f)
    pd.DataFrame({"query": QUERIES, "postprocessed_response": summaries,
                  "reference_responses": [GOOD] * 4}).to_csv(os.path.join(folder, "validation_table.csv"), index=False)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for kl, s in zip(kls, seconds):
            f.write(json.dumps({"objective/kl": kl, "time/update": s}) + "\n")


def test_async_table_known_answers(tmp_path, checkpoints, monkeypatch):
    _, tokenizer_dir = checkpoints  # (a folder with a tokenizer: the lengths are its token counts)
    monkeypatch.setattr(compare_table, "gold_score", words)
    runs_dir, out = str(tmp_path / "runs"), str(tmp_path / "out")
    write_run(runs_dir, "hello_world_sft", {"exp_name": "sft", "seed": 1}, [MID] * 4, tokenizer_dir)
    for (exp_name, steps), good in GOOD_PROMPTS.items():
        for seed, wins in zip((1, 2, 3), good):
            write_run(runs_dir, f"async_n{steps}_s{seed}_{exp_name}",
                      {"exp_name": exp_name, "seed": seed, "async_steps": steps},
                      [GOOD] * wins + [MID] * (4 - wins), tokenizer_dir,
                      kls=[9.0, 1.0 + steps, 2.0 + steps], seconds=[1.0, 2.0, 3.0 + seed])
    # not the study's: another method, and another glob
    write_run(runs_dir, "async_n0_s1_rloo_k4", {"exp_name": "rloo_k4", "seed": 1, "async_steps": 0}, [POOR] * 4,
              tokenizer_dir)
    write_run(runs_dir, "other_n0_s1_ppo", {"exp_name": "ppo_left_padding", "seed": 1}, [POOR] * 4, tokenizer_dir)
    async_table.main(async_table.Args(runs_dir=runs_dir, out=out, last_updates=2))

    runs = pd.read_csv(os.path.join(out, "async_runs.csv"))
    assert len(runs) == 12 and set(runs["method"]) == {"PPO", "online DPO"}
    summary = pd.read_csv(os.path.join(out, "async_summary.csv"))
    assert list(summary.columns) == async_table.SUMMARY_COLUMNS
    assert list(zip(summary["method"], summary["async_steps"])) == [("PPO", 0), ("PPO", 2), ("online DPO", 0),
                                                                     ("online DPO", 2)]
    for row in summary.itertuples():
        exp_name = {"PPO": "ppo_left_padding", "online DPO": "online_dpo"}[row.method]
        per_seed = [w * 6 / 4 for w in GOOD_PROMPTS[exp_name, row.async_steps]]
        assert row.seeds == 3
        assert row.gold_minus_sft == pytest.approx(np.mean(per_seed))
        assert (row.gold_minus_sft_low, row.gold_minus_sft_high) == pytest.approx(t_interval(per_seed))
        assert row.kl == pytest.approx(1.5 + row.async_steps)  # the last 2 updates
        assert row.wall_s == pytest.approx(6.0 + 2)  # 1 + 2 + (3 + seed), over seeds 1 2 3
    lengths = dict(zip(runs["run_name"], runs["length_minus_sft"]))
    good_minus_mid = lengths["async_n0_s1_ppo_left_padding"]  # (GOOD on all four prompts, SFT MID)
    assert good_minus_mid > 0
    assert lengths["async_n2_s2_ppo_left_padding"] == pytest.approx(good_minus_mid / 4)  # GOOD on one of four
    for name in ("async_gold_vs_staleness.png", "async_gold_vs_kl.png", "async_summary.md"):
        assert os.path.isfile(os.path.join(out, name))


def test_async_table_needs_its_sft_run(tmp_path):
    os.makedirs(tmp_path / "runs")
    with pytest.raises(FileNotFoundError, match="no SFT run"):
        async_table.main(async_table.Args(runs_dir=str(tmp_path / "runs"), out=str(tmp_path / "out")))


def test_learner_kl_is_the_exact_kl_of_the_first_token(checkpoints):
    """eval/learner_kl.py's estimate on one-token responses against the exact KL of the two next-token
    distributions at the query's end (fp32 logits / T, [PAD] and the ids past the tokenizer excluded):
    within 4 standard errors over 4,000 samples; a policy against itself: 0 exactly."""
    import torch

    import learner_kl
    from summarize_from_feedback_details.infra.loading import load_policy, load_tokenizer
    from summarize_from_feedback_details.online_dpo import scaled_logits

    sft_path, _ = checkpoints
    tokenizer = load_tokenizer(sft_path)
    sft = load_policy(sft_path, tokenizer).eval()
    policy = load_policy(sft_path, tokenizer).eval()
    with torch.no_grad():  # a sharper policy than the SFT
        policy.get_output_embeddings().weight.mul_(2.0)
    query = torch.tensor(tokenizer("SUBREDDIT: r/relationships POST: my sister and I argued TL;DR:")["input_ids"])
    queries, temperature = query.repeat(4000, 1), 0.7
    estimate = learner_kl.learner_kl(policy, sft, queries, tokenizer, temperature, 1, seed=3, batch_size=1000)
    with torch.no_grad():
        logprobs = [torch.log_softmax(scaled_logits(model(input_ids=query[None]).logits[0, -1], temperature,
                                                    tokenizer.pad_token_id, len(tokenizer)), -1)
                    for model in (policy, sft)]
    exact = (logprobs[0].exp() * (logprobs[0] - logprobs[1])).sum().item()
    assert exact > 0.1  # (the two models differ: a test that could not tell them apart would prove nothing)
    assert abs(estimate.mean().item() - exact) < 4 * estimate.std().item() / len(estimate) ** 0.5
    assert torch.equal(learner_kl.learner_kl(sft, sft, queries[:200], tokenizer, temperature, 8, 3, 100),
                       torch.zeros(200))
