"""eval/rlhf_scaling_plot.py with the gold judge, on fake run folders (and fake wandb runs) whose eval
tables have known verdicts and known response lengths: SFT and PPO, then DPO beside them."""

import json
import os
import sys

import numpy as np
import pandas as pd
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eval"))
import judges
import rlhf_scaling_plot as rlhf

from summarize_from_feedback_details import win_rates
from summarize_from_feedback_details.synthetic_tldr import gold_score

PYTHIA_1B, PYTHIA_2B8 = "EleutherAI/pythia-1b-deduped", "EleutherAI/pythia-2.8b-deduped"
POST = ("[PAD][PAD]SUBREDDIT: r/roommates\n\nTITLE: help\n\nPOST: I (25F) have lived with my roommate (27M) for 3 years."
        "\n\nLately they has not paid rent in months. I am so angry right now.\n\nShould I just move out?\n\nTL;DR:")
# gold scores GOOD > MID > POOR; lengths 16, 10 and 3 words (the test tokenizer counts words)
GOOD = " my roommate of 3 years has not paid rent, I feel angry. should I move out?"
MID = " my roommate has not paid rent. should I move out?"
POOR = " roommate owes rent."
LENGTH = {GOOD: 16, MID: 10, POOR: 3}

# (response, reference) rows of each run; the comment gives the gold verdicts and the win rate
TABLES = {
    ("sft", PYTHIA_1B, 1): [(MID, GOOD), (MID, POOR), (POOR, GOOD), (MID, MID)],  # L W L T: 1.5/4
    ("sft", PYTHIA_1B, 2): [(MID, GOOD), (MID, POOR), (MID, POOR), (POOR, MID)],  # L W W L: 2/4
    ("ppo_left_padding", PYTHIA_1B, 1): [(GOOD, MID), (GOOD, POOR), (GOOD, GOOD), (POOR, MID)],  # W W T L: 2.5/4
    ("ppo_left_padding", PYTHIA_1B, 2): [(GOOD, MID), (GOOD, MID), (GOOD, MID), (MID, GOOD)],  # W W W L: 3/4
    ("ppo_left_padding", PYTHIA_2B8, 1): [(GOOD, MID)] * 4,  # 4/4
}
# DPO runs, lengths within SFT's and PPO's (3..16) so that the length bins stay where they were
DPO_TABLES = {
    ("dpo", PYTHIA_1B, 1): [(GOOD, MID), (MID, GOOD), (GOOD, POOR), (MID, MID)],  # W L W T: 2.5/4, length 13
    ("dpo", PYTHIA_1B, 2): [(GOOD, MID), (GOOD, MID), (POOR, GOOD), (POOR, MID)],  # W W L L: 2/4, length 9.5
    ("dpo", PYTHIA_2B8, 1): [(GOOD, POOR), (MID, POOR), (MID, POOR), (MID, GOOD)],  # W W W L: 3/4, length 11.5
}


def word_tokenizer(folder):
    """A tokenizer with one token per whitespace-separated word."""
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]").save_pretrained(folder)
    return str(folder)


def table_frame(rows, eos_padded=False):
    # a table decoded with special tokens keeps EOS and pads: the judge and the lengths ignore them
    tail = "<|endoftext|>[PAD][PAD]" if eos_padded else ""
    return pd.DataFrame({"query": [POST] * len(rows), "postprocessed_response": [r + tail for r, _ in rows],
                         "reference_responses": [ref for _, ref in rows], "scores": 0.0, "reference_scores": 0.0})


def write_runs(runs_dir, output_dir, tables=TABLES):
    for (exp_name, base_model, seed), rows in tables.items():
        name = f"{exp_name}__{seed}__{100 + len(base_model)}"
        folder = os.path.join(runs_dir, name)
        os.makedirs(folder)
        with open(os.path.join(folder, "args.json"), "w") as f:
            json.dump({"exp_name": exp_name, "base_model": base_model, "seed": seed, "output_dir": output_dir}, f)
        table_frame(rows, eos_padded=seed == 2).to_csv(os.path.join(folder, "validation_table.csv"), index=False)
    os.makedirs(os.path.join(runs_dir, "ppo_left_padding__3__999"), exist_ok=True)  # crashed before its eval: warned, left out
    with open(os.path.join(runs_dir, "ppo_left_padding__3__999", "args.json"), "w") as f:
        json.dump({"exp_name": "ppo_left_padding", "base_model": PYTHIA_1B, "seed": 3}, f)


def read(out, name):
    return pd.read_csv(os.path.join(out, f"{name}.csv"), dtype={"seeds": str, "values": str})


def choice(out, exp_name, base_model, seed):
    """(run_name, status, why) of each run of a key in runs_used_rlhf_scaling_plot.csv, newest first."""
    report = pd.read_csv(os.path.join(out, "runs_used_rlhf_scaling_plot.csv"))
    rows = report[(report["exp_name"] == exp_name) & (report["base_model"] == base_model) & (report["seed"] == seed)]
    return list(zip(rows["run_name"], rows["status"], rows["why"]))


def check_outputs(out):
    runs = read(out, "rlhf_scale_plot_runs").set_index(["policy", "base_model", "seed"])
    sft1 = runs.loc[("SFT", PYTHIA_1B, 1)]
    assert (sft1["rows"], sft1["wins"], sft1["ties"], sft1["losses"], sft1["unparsed"]) == (4, 1, 1, 2, 0)
    assert sft1["win_rate"] == pytest.approx(0.375)  # ties count half
    assert sft1["mean_length"] == pytest.approx((10 + 10 + 3 + 10) / 4)
    # the 95% Wilson interval over its 4 prompts; the length-controlled rate from its outcomes and its
    # length differences to the references (MID-GOOD, MID-POOR, POOR-GOOD, MID-MID); gold: no flips
    assert (sft1["ci_low"], sft1["ci_high"]) == pytest.approx(win_rates.wilson_interval(0.375, 4))
    assert sft1["lc_win_rate"] == pytest.approx(win_rates.length_controlled_win_rate([0, 1, 0, 0.5], [-6, 7, -13, 0]))
    assert sft1["lc_ci_low"] <= sft1["lc_win_rate"] <= sft1["lc_ci_high"]
    assert pd.isna(sft1["flips"]) and pd.isna(sft1["flip_rate"])
    assert runs.loc[("SFT", PYTHIA_1B, 2), "mean_length"] == pytest.approx((10 + 10 + 10 + 3) / 4)  # EOS, pads cut
    assert runs.loc[("PPO", PYTHIA_1B, 1), "win_rate"] == pytest.approx(0.625)
    assert runs.loc[("PPO", PYTHIA_2B8, 1), "win_rate"] == pytest.approx(1.0)
    # the mean gold score of each run; every table asks POST four times, so no pairing per prompt
    assert sft1["gold"] == pytest.approx((3 * gold_score(POST, MID) + gold_score(POST, POOR)) / 4)
    assert runs.loc[("PPO", PYTHIA_2B8, 1), "gold"] == pytest.approx(gold_score(POST, GOOD))
    assert runs[list(rlhf.PAIRED_COLUMNS)].isna().all().all()

    summary = read(out, "rlhf_scale_plot").set_index(["policy", "base_model"])
    assert list(summary.index) == [("SFT", PYTHIA_1B), ("PPO", PYTHIA_1B), ("PPO", PYTHIA_2B8)]  # plot order
    assert summary.loc[("SFT", PYTHIA_1B), "values"] == "0.375 0.5"
    assert summary.loc[("SFT", PYTHIA_1B), "mean"] == pytest.approx(0.4375)
    assert summary.loc[("SFT", PYTHIA_1B), "std"] == pytest.approx(0.125 / 2 ** 0.5)  # ddof=1
    assert summary.loc[("PPO", PYTHIA_1B), "mean"] == pytest.approx(0.6875)
    assert summary.loc[("PPO", PYTHIA_2B8), "model_size"] == 2_800_000_000
    assert pd.isna(summary.loc[("PPO", PYTHIA_2B8), "std"])
    # the error bars: the 95% t-interval over seeds, 0.4375 -+ 12.706 x std / sqrt(2); none from one seed
    half = 12.7062 * 0.125 / 2 ** 0.5 / 2 ** 0.5
    assert summary.loc[("SFT", PYTHIA_1B), ["ci_low", "ci_high"]].tolist() == pytest.approx([0.4375 - half, 0.4375 + half],
                                                                                            abs=1e-4)
    assert summary.loc[("PPO", PYTHIA_2B8), ["ci_low", "ci_high"]].isna().all()
    assert summary.loc[("PPO", PYTHIA_1B), "rows"] == 8 and summary.loc[("PPO", PYTHIA_1B), "unparsed"] == 0

    # two equal-width bins over lengths 3..16: [3, 9.5) holds the POOR responses, [9.5, 16] the rest
    bins = read(out, "rlhf_scale_plot_token_length").set_index(["policy", "bin"])
    assert bins.loc[("SFT", 0), ["length_low", "length_high"]].tolist() == [3.0, 9.5]
    assert bins.loc[("SFT", 0), ["rows", "wins", "ties", "losses", "win_rate"]].tolist() == [2, 0, 0, 2, 0.0]
    assert bins.loc[("SFT", 1), ["rows", "wins", "ties", "losses"]].tolist() == [6, 3, 1, 2]
    assert bins.loc[("SFT", 1), "win_rate"] == pytest.approx(3.5 / 6)
    assert bins.loc[("PPO", 1), ["rows", "wins", "ties", "losses"]].tolist() == [11, 9, 1, 1]
    assert bins.loc[("PPO", 1), "win_rate"] == pytest.approx(9.5 / 11)
    # 95% Wilson interval of 0 wins in 2 rows: [0, z^2/2 / (1 + z^2/2)], z = 1.95996 (the 0.975 normal quantile)
    z = win_rates.normal_quantile(0.95)
    assert bins.loc[("SFT", 0), "ci_low"] == pytest.approx(0.0, abs=1e-12)
    assert bins.loc[("SFT", 0), "ci_high"] == pytest.approx(z ** 2 / 2 / (1 + z ** 2 / 2))
    assert bins.loc[("SFT", 0), "ci_high"] == pytest.approx(1.96 ** 2 / 2 / (1 + 1.96 ** 2 / 2), abs=2e-5)

    judged = pd.read_csv(os.path.join(out, "judged", "sft__1__128.csv"), keep_default_na=False)
    assert judged["verdict"].tolist() == ["reference", "policy", "reference", "tie"]
    for name in ("rlhf_scale_plot", "rlhf_scale_plot_token_length"):
        for ext in ("png", "pdf", "md"):
            assert os.path.getsize(os.path.join(out, f"{name}.{ext}")) > 0


def test_gold_fixture_is_what_the_comments_say():
    assert gold_score(POST, GOOD) > gold_score(POST, MID) > gold_score(POST, POOR)
    assert judges.gold_verdicts([(POST, MID, GOOD), (POST, GOOD + "<|endoftext|>[PAD]", MID), (POST, MID, MID)]) == \
        ["reference", "policy", "tie"]
    assert judges.win_counts(["policy", "tie", "reference", "unparsed"])["win_rate"] == pytest.approx(0.5)


def test_gold_judge_tables(tmp_path, capsys):
    runs_dir, out = str(tmp_path / "runs"), str(tmp_path / "out")
    tokenizer = word_tokenizer(tmp_path / "tokenizer")
    write_runs(runs_dir, output_dir=tokenizer)  # the runs' output_dir holds their tokenizer
    rlhf.main(rlhf.Args(runs_dir=runs_dir, out=out, length_bins=2))
    assert "runs of rlhf_scaling_plot.py from" in capsys.readouterr().err
    assert choice(out, "ppo_left_padding", PYTHIA_1B, 3) == [
        ("ppo_left_padding__3__999", "set aside", "no validation_table table")]
    check_outputs(out)

    # --num_rows judges the head of each table; --tokenizer overrides the runs' own
    rlhf.main(rlhf.Args(runs_dir=runs_dir, out=out, num_rows=1, tokenizer=tokenizer, run_glob="sft__*"))
    assert read(out, "rlhf_scale_plot_runs")["rows"].tolist() == [1, 1]


def test_a_newer_run_without_a_table_does_not_displace_a_complete_one(tmp_path):
    """A debug run without --run_eval, newer than the SFT run of its key, has no validation_table: the
    complete run is judged (the outputs are those without the debug run) and the report names both."""
    runs_dir, out = str(tmp_path / "runs"), str(tmp_path / "out")
    write_runs(runs_dir, output_dir=word_tokenizer(tmp_path / "tokenizer"))
    os.makedirs(os.path.join(runs_dir, "sft__1__999"))
    with open(os.path.join(runs_dir, "sft__1__999", "args.json"), "w") as f:
        json.dump({"exp_name": "sft", "base_model": PYTHIA_1B, "seed": 1}, f)
    rlhf.main(rlhf.Args(runs_dir=runs_dir, out=out, length_bins=2))
    check_outputs(out)
    assert choice(out, "sft", PYTHIA_1B, 1) == [("sft__1__999", "set aside", "newer, but no validation_table table"),
                                                ("sft__1__128", "used", "newest with what the plots need")]
    assert "| sft | EleutherAI/pythia-1b-deduped | 1 | sft__1__999 |" in \
        open(os.path.join(out, "runs_used_rlhf_scaling_plot.md")).read()
    with pytest.raises(SystemExit, match="--runs pins sft__1__999 .* but sft__1__999 has no validation_table table"):
        rlhf.main(rlhf.Args(runs_dir=runs_dir, out=out, length_bins=2, runs=["sft__1__999"]))


def check_dpo_outputs(out):
    runs = read(out, "rlhf_scale_plot_runs")
    assert runs["policy"].tolist() == ["SFT"] * 2 + ["PPO"] * 3 + ["DPO"] * 3  # policy order, then as found
    dpo = runs[runs["policy"] == "DPO"]
    assert dpo["run_name"].tolist() == ["dpo__1__128", "dpo__2__128", "dpo__1__130"]
    assert dpo[["rows", "wins", "ties", "losses", "unparsed"]].values.tolist() == [[4, 2, 1, 1, 0], [4, 2, 0, 2, 0],
                                                                                 [4, 3, 0, 1, 0]]
    assert dpo["win_rate"].tolist() == pytest.approx([0.625, 0.5, 0.75])
    assert dpo["mean_length"].tolist() == pytest.approx([13.0, 9.5, 11.5])  # seed 2: EOS and pads cut
    assert "| DPO | EleutherAI/pythia-1b-deduped | 1000000000 | 1 | dpo__1__128 | 4 | 2 | 1 | 1 | 0 | 0.6250 | " \
        in open(os.path.join(out, "rlhf_scale_plot_runs.md")).read()

    summary = read(out, "rlhf_scale_plot").set_index(["policy", "base_model"])
    assert list(summary.index) == [("SFT", PYTHIA_1B), ("PPO", PYTHIA_1B), ("PPO", PYTHIA_2B8), ("DPO", PYTHIA_1B),
                                   ("DPO", PYTHIA_2B8)]
    assert summary.loc[("DPO", PYTHIA_1B), ["seeds", "values"]].tolist() == ["1 2", "0.625 0.5"]
    assert summary.loc[("DPO", PYTHIA_1B), "mean"] == pytest.approx(0.5625)
    assert summary.loc[("DPO", PYTHIA_1B), "std"] == pytest.approx(0.125 / 2 ** 0.5)  # ddof=1
    assert summary.loc[("DPO", PYTHIA_1B), ["rows", "unparsed"]].tolist() == [8, 0]
    assert summary.loc[("DPO", PYTHIA_2B8), ["n_seeds", "values", "mean"]].tolist() == [1, "0.75", 0.75]
    assert pd.isna(summary.loc[("DPO", PYTHIA_2B8), "std"])

    # the same two bins [3, 9.5), [9.5, 16]: DPO's two POOR responses lose, the other ten W W W T W W W W L L
    bins = read(out, "rlhf_scale_plot_token_length")
    assert bins["policy"].tolist() == ["SFT", "SFT", "PPO", "PPO", "DPO", "DPO"]
    bins = bins.set_index(["policy", "bin"])
    assert bins.loc[("DPO", 0), ["length_low", "length_high", "rows", "wins", "ties", "losses", "win_rate"]].tolist() == \
        [3.0, 9.5, 2, 0, 0, 2, 0.0]
    assert bins.loc[("DPO", 1), ["rows", "wins", "ties", "losses"]].tolist() == [10, 7, 1, 2]
    assert bins.loc[("DPO", 1), "win_rate"] == pytest.approx(0.75)


def without_dpo_rows(out, name):
    frame = read(out, name)
    return frame[frame["policy"] != "DPO"].reset_index(drop=True)


def test_dpo_beside_sft_and_ppo(tmp_path):
    """DPO runs are judged and plotted as a third policy, after SFT and PPO, whose rows do not change."""
    runs_dir, without, out = str(tmp_path / "runs"), str(tmp_path / "without_dpo"), str(tmp_path / "out")
    write_runs(runs_dir, output_dir=word_tokenizer(tmp_path / "tokenizer"))
    rlhf.main(rlhf.Args(runs_dir=runs_dir, out=without, length_bins=2))
    write_runs(runs_dir, output_dir=str(tmp_path / "tokenizer"), tables=DPO_TABLES)
    rlhf.main(rlhf.Args(runs_dir=runs_dir, out=out, length_bins=2))
    check_outputs(without)
    check_dpo_outputs(out)
    for name in ("rlhf_scale_plot_runs", "rlhf_scale_plot", "rlhf_scale_plot_token_length"):
        pd.testing.assert_frame_equal(without_dpo_rows(out, name), read(without, name))
    judged = pd.read_csv(os.path.join(out, "judged", "dpo__1__128.csv"), keep_default_na=False)
    assert judged["verdict"].tolist() == ["policy", "reference", "policy", "tie"]
    for ext in ("png", "pdf", "md"):
        assert os.path.getsize(os.path.join(out, f"rlhf_scale_plot_token_length.{ext}")) > 0

    # --dpo_exp_name: another experiment's runs as DPO; exp_names must be pairwise distinct
    rlhf.main(rlhf.Args(runs_dir=runs_dir, out=out, length_bins=2, ppo_exp_name="none", dpo_exp_name="ppo_left_padding"))
    assert read(out, "rlhf_scale_plot")["policy"].tolist() == ["SFT", "DPO", "DPO"]
    with pytest.raises(ValueError, match="--sft_exp_name and --dpo_exp_name are both 'sft': each stage needs"):
        rlhf.main(rlhf.Args(runs_dir=runs_dir, out=out, dpo_exp_name="sft"))
    with pytest.raises(ValueError, match="--sft_exp_name and --ppo_exp_name and --dpo_exp_name are both 'x'"):
        rlhf.main(rlhf.Args(runs_dir=runs_dir, out=out, sft_exp_name="x", ppo_exp_name="x", dpo_exp_name="x"))


# runs of the other methods (hello_world.sh ALGOS=all), by their exp_names
METHOD_TABLES = {
    ("rloo", PYTHIA_1B, 1): [(GOOD, MID)] * 3 + [(POOR, MID)],  # W W W L: 3/4
    ("grpo", PYTHIA_1B, 1): [(MID, GOOD)] * 4,  # 0/4
    ("online_dpo", PYTHIA_1B, 1): [(MID, MID)] * 2 + [(GOOD, MID)] * 2,  # T T W W: 3/4
}


def test_every_method_found_is_plotted_after_sft_ppo_and_dpo(tmp_path):
    """rloo.py and online_dpo.py runs are policies of their own, each labelled (--methods), listed after
    SFT, PPO and DPO in --methods' order (rloo_k4 has no runs: absent), the earlier rows unchanged."""
    runs_dir, without, out = str(tmp_path / "runs"), str(tmp_path / "without"), str(tmp_path / "out")
    write_runs(runs_dir, output_dir=word_tokenizer(tmp_path / "tokenizer"))
    write_runs(runs_dir, output_dir=str(tmp_path / "tokenizer"), tables=DPO_TABLES)
    rlhf.main(rlhf.Args(runs_dir=runs_dir, out=without, length_bins=2))
    write_runs(runs_dir, output_dir=str(tmp_path / "tokenizer"), tables=METHOD_TABLES)
    rlhf.main(rlhf.Args(runs_dir=runs_dir, out=out, length_bins=2))
    runs = read(out, "rlhf_scale_plot_runs")
    assert runs["policy"].tolist() == ["SFT"] * 2 + ["PPO"] * 3 + ["DPO"] * 3 + ["RLOO k=2", "GRPO k=4", "online DPO"]
    assert runs["win_rate"].tolist()[-3:] == [0.75, 0.0, 0.75]
    old = runs[runs["policy"].isin(["SFT", "PPO", "DPO"])].reset_index(drop=True)
    pd.testing.assert_frame_equal(old, read(without, "rlhf_scale_plot_runs"))
    assert read(out, "rlhf_scale_plot")["policy"].tolist()[-3:] == ["RLOO k=2", "GRPO k=4", "online DPO"]
    # --methods relabels and reorders; a method named twice, or without a label, is refused
    rlhf.main(rlhf.Args(runs_dir=runs_dir, out=out, length_bins=2, methods=["online_dpo=OnDPO", "rloo=R"]))
    assert read(out, "rlhf_scale_plot_runs")["policy"].tolist()[-2:] == ["OnDPO", "R"]
    with pytest.raises(ValueError, match="are both 'rloo'"):
        rlhf.main(rlhf.Args(runs_dir=runs_dir, out=out, methods=["rloo=A", "rloo=B"]))
    with pytest.raises(ValueError, match="'rloo' is not EXP_NAME=LABEL"):
        rlhf.main(rlhf.Args(runs_dir=runs_dir, out=out, methods=["rloo"]))
    with pytest.raises(ValueError, match="two policies share a label"):
        rlhf.main(rlhf.Args(runs_dir=runs_dir, out=out, methods=["rloo=PPO"]))


def test_missing_column_is_an_error(tmp_path):
    runs_dir = tmp_path / "runs"
    write_runs(str(runs_dir), output_dir=word_tokenizer(tmp_path / "tokenizer"))
    table = runs_dir / "sft__1__128" / "validation_table.csv"
    pd.read_csv(table).drop(columns=["reference_responses"]).to_csv(table, index=False)
    with pytest.raises(ValueError, match="validation_table.csv: the eval table has no column reference_responses"):
        rlhf.main(rlhf.Args(runs_dir=str(runs_dir), out=str(tmp_path / "out")))


class FakeFile:
    def __init__(self, path, content):
        self.path, self.content = path, content

    def download(self, root=".", replace=False):
        target = os.path.join(root, self.path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            json.dump(self.content, f)


class FakeWandbRun:
    """A finished run as wandb.Api() returns it: the table logged with wandb.log({"validation_table":
    wandb.Table(dataframe=...)}) is a table-file reference in the summary and a file of the run."""

    def __init__(self, exp_name, base_model, seed, rows):
        self.name = self.id = f"{exp_name}_{len(base_model)}_{seed}"
        self.config = {"exp_name": exp_name, "base_model": base_model, "seed": seed, "output_dir": "/not/here"}
        self.created_at = "2024-05-01T12:00:00Z"
        frame = table_frame(rows)
        path = f"media/table/validation_table_30_{self.id}.table.json"
        self.summary_metrics = {"objective/kl": 1.0, "validation_table": {"_type": "table-file", "path": path}}
        self._file = FakeFile(path, {"columns": list(frame.columns), "data": frame.values.tolist()})

    def file(self, path):
        assert path == self._file.path
        return self._file


def test_wandb_tables(tmp_path, monkeypatch):
    import wandb

    runs = [FakeWandbRun(*key, rows) for key, rows in {**TABLES, **DPO_TABLES}.items()]
    debug = FakeWandbRun("sft", PYTHIA_1B, 1, TABLES[("sft", PYTHIA_1B, 1)])  # newer, without --run_eval
    debug.name, debug.created_at = "sft_debug", "2024-06-01T00:00:00Z"
    del debug.summary_metrics["validation_table"]
    runs.append(debug)
    monkeypatch.setattr(wandb, "Api", lambda: type("Api", (), {"runs": lambda self, path, filters: runs})())
    out = str(tmp_path / "out")
    rlhf.main(rlhf.Args(wandb_project="tldr_summarize", out=out, length_bins=2,
                        tokenizer=word_tokenizer(tmp_path / "tokenizer")))
    summary = read(out, "rlhf_scale_plot").set_index(["policy", "base_model"])
    assert summary.loc[("SFT", PYTHIA_1B), "values"] == "0.375 0.5"
    assert summary.loc[("PPO", PYTHIA_1B), "values"] == "0.625 0.75"
    assert summary.loc[("PPO", PYTHIA_2B8), "values"] == "1"
    assert summary.loc[("DPO", PYTHIA_1B), "values"] == "0.625 0.5"
    assert summary.loc[("DPO", PYTHIA_2B8), "values"] == "0.75"
    assert list(summary.index.get_level_values("policy")) == ["SFT", "PPO", "PPO", "DPO", "DPO"]
    assert choice(out, "sft", PYTHIA_1B, 1) == [("sft_debug", "set aside", "newer, but no validation_table table"),
                                                ("sft_28_1", "used", "newest with what the plots need")]


def words(query, summary):
    """A stand-in gold judge whose numbers can be worked out by hand: the summary's word count."""
    return float(len(summary.split()))


def test_gold_paired_with_the_sft_of_the_same_seed(tmp_path, monkeypatch, capsys):
    """Each run's mean gold score, and against the SFT run of its (base_model, seed) the paired mean
    gold difference (bootstrap over prompts) and the head-to-head rate (Wilson), joined on the query."""
    monkeypatch.setattr(rlhf, "gold_score", words)
    queries = [POST.replace("help", f"help {i}") for i in range(4)]

    def rows(*responses):  # one response per query, word counts as given; the reference: MID
        return [(" ".join(["a"] * n), MID) for n in responses]

    tables = {("sft", PYTHIA_1B, 1): rows(2, 3, 4, 1), ("ppo_left_padding", PYTHIA_1B, 1): rows(4, 3, 5, 2),
              ("ppo_left_padding", PYTHIA_1B, 2): rows(1, 1, 1, 1),  # no SFT of seed 2: nothing to pair with
              ("dpo", PYTHIA_1B, 1): rows(1, 1, 4, 1)}
    runs_dir, out = tmp_path / "runs", str(tmp_path / "out")
    tokenizer = word_tokenizer(tmp_path / "tokenizer")
    for (exp_name, base_model, seed), table in tables.items():
        folder = runs_dir / f"{exp_name}__{seed}__1"
        os.makedirs(folder)
        (folder / "args.json").write_text(json.dumps({"exp_name": exp_name, "base_model": base_model, "seed": seed,
                                                      "output_dir": tokenizer}))
        frame = table_frame(table).assign(query=queries)
        if exp_name == "dpo":
            frame = frame.iloc[[2, 0, 3, 1]]  # other row order: paired by query, not by row
        frame.to_csv(folder / "validation_table.csv", index=False)
    # a PPO run of seed 3 that answered only 3 of the prompts, and its SFT: refused, warned, NaN
    for exp_name in ("sft", "ppo_left_padding"):
        folder = runs_dir / f"{exp_name}__3__1"
        os.makedirs(folder)
        (folder / "args.json").write_text(json.dumps({"exp_name": exp_name, "base_model": PYTHIA_1B, "seed": 3,
                                                      "output_dir": tokenizer}))
        frame = table_frame(rows(1, 2, 3, 4)).assign(query=queries)
        (frame if exp_name == "sft" else frame.iloc[:3]).to_csv(folder / "validation_table.csv", index=False)
    rlhf.main(rlhf.Args(runs_dir=str(runs_dir), out=out, length_bins=2))
    assert "ppo_left_padding__3__1 not paired with sft__3__1: the two tables do not hold the same prompts: 0 only " \
        "in the policy's, 1 only in the baseline's" in " ".join(capsys.readouterr().err.split())

    runs = read(out, "rlhf_scale_plot_runs").set_index(["policy", "seed"])
    assert runs["gold"].to_dict() == {("SFT", 1): 2.5, ("SFT", 3): 2.5, ("PPO", 1): 3.5, ("PPO", 2): 1.0,
                                      ("PPO", 3): 2.0, ("DPO", 1): 1.75}
    # PPO seed 1 - SFT seed 1 per prompt: +2 0 +1 +1 -> +1.0, W T W W -> 0.875
    ppo = runs.loc[("PPO", 1)]
    assert ppo["gold_minus_sft"] == 1.0 and ppo["head_to_head_sft"] == 0.875
    assert (ppo["gold_minus_sft_ci_low"], ppo["gold_minus_sft_ci_high"]) == pytest.approx(
        win_rates.bootstrap_interval(np.array([2.0, 0.0, 1.0, 1.0])))
    assert (ppo["head_to_head_sft_ci_low"], ppo["head_to_head_sft_ci_high"]) == pytest.approx(
        win_rates.wilson_interval(0.875, 4))
    # DPO: -1 -2 0 0 -> -0.75, L L T T -> 0.25, whatever the order of its rows
    assert runs.loc[("DPO", 1), ["gold_minus_sft", "head_to_head_sft"]].tolist() == [-0.75, 0.25]
    assert (runs.loc[("DPO", 1), "gold_minus_sft_ci_low"], runs.loc[("DPO", 1), "gold_minus_sft_ci_high"]) == \
        pytest.approx(win_rates.bootstrap_interval(np.array([-1.0, -2.0, 0.0, 0.0])))
    for key in (("SFT", 1), ("PPO", 2), ("PPO", 3)):
        assert runs.loc[key, list(rlhf.PAIRED_COLUMNS)].isna().all()
