"""eval/sft_rm_scale.py and the run handling of eval/common.py, on fake run folders with known metrics
(and fake wandb runs): SFT ROUGE-L, reward-model accuracy, and DPO's implicit-reward accuracy beside it."""

import json
import os
import sys

import pandas as pd
import pytest
from transformers import AutoModelForCausalLM, GPTNeoXConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eval"))
import common
import sft_rm_scale

PYTHIA_1B, PYTHIA_2B8 = "EleutherAI/pythia-1b-deduped", "EleutherAI/pythia-2.8b-deduped"


def write_run(runs_dir, name, exp_name, base_model, seed, metric_lines, output_dir="no/such/dir", mtime=None):
    folder = os.path.join(runs_dir, name)
    os.makedirs(folder)
    with open(os.path.join(folder, "args.json"), "w") as f:
        json.dump({"exp_name": exp_name, "base_model": base_model, "seed": seed, "run_name": name,
                   "output_dir": output_dir}, f)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step, metrics in enumerate(metric_lines):
            f.write(json.dumps({"step": step, **metrics}) + "\n")
    if mtime is not None:
        os.utime(os.path.join(folder, "args.json"), (mtime, mtime))


def rm_metrics(validation, cnndm, by_confidence):
    metrics = {"eval/rm/validation/accuracy": validation, "eval/rm/validation_cnndm/accuracy": cnndm,
               "eval/rm/validation/accuracy/confidence/None": 0.123}  # pairs without a confidence: not plotted
    metrics.update({f"eval/rm/validation/accuracy/confidence/{c}": v for c, v in by_confidence.items()})
    return metrics


def fake_runs(runs_dir):
    rouge = "validation/sft/rouge/rougeL"
    # 1B: three seeds, the first logged twice (the last value counts); an older duplicate of seed 1
    write_run(runs_dir, "sft__1__200", "sft", PYTHIA_1B, 1, [{rouge: 0.5}, {"train/sft/loss": 1.0}, {rouge: 0.20}])
    write_run(runs_dir, "sft__1__100", "sft", PYTHIA_1B, 1, [{rouge: 0.90}])
    write_run(runs_dir, "sft__2__300", "sft", PYTHIA_1B, 2, [{rouge: 0.22}])
    write_run(runs_dir, "sft__3__300", "sft", PYTHIA_1B, 3, [{rouge: 0.24}])
    write_run(runs_dir, "sft__1__400", "sft", PYTHIA_2B8, 1, [{rouge: 0.30}])  # one seed: no std
    write_run(runs_dir, "sft_no_eval", "sft", PYTHIA_2B8, 2, [{"train/sft/loss": 1.0}])  # left out, warned
    write_run(runs_dir, "ppo_left_padding__1__300", "ppo_left_padding", PYTHIA_1B, 1, [{rouge: 0.99}])  # another stage
    write_run(runs_dir, "reward__1__300", "reward", PYTHIA_1B, 1, [rm_metrics(0.60, 0.55, {1: 0.50, 9: 0.80})])
    write_run(runs_dir, "reward__2__300", "reward", PYTHIA_1B, 2, [rm_metrics(0.70, 0.65, {1: 0.60, 9: 1.00})])
    write_run(runs_dir, "reward__1__500", "reward", PYTHIA_2B8, 1, [rm_metrics(0.75, 0.72, {1: 0.55, 9: 0.90})])
    os.makedirs(os.path.join(runs_dir, "not_a_run"))  # no args.json: skipped


def dpo_metrics(validation, cnndm=None):
    """What dpo.py --run_eval logs: the reward model's names, plus the margin of the implicit rewards,
    and a confidence breakdown that the confidence plot (reward models only) must not pick up."""
    metrics = {"eval/rm/validation/accuracy": validation, "eval/rm/validation/reward_margin": 0.3,
               "eval/rm/validation/accuracy/confidence/1": 0.01, "eval/rm/validation/accuracy/confidence/9": 0.02}
    if cnndm is not None:
        metrics["eval/rm/validation_cnndm/accuracy"] = cnndm
    return metrics


def fake_dpo_runs(runs_dir):
    # 1B: seeds 1 and 2, and an older duplicate of seed 1; 2.8B: seeds 1 and 3, seed 1 without CNN/DM
    write_run(runs_dir, "dpo__1__100", "dpo", PYTHIA_1B, 1, [dpo_metrics(0.99, 0.99)])
    write_run(runs_dir, "dpo__1__310", "dpo", PYTHIA_1B, 1, [{"train/rm/accuracy": 0.9}, dpo_metrics(0.58, 0.52)])
    write_run(runs_dir, "dpo__2__310", "dpo", PYTHIA_1B, 2, [dpo_metrics(0.62, 0.56)])
    write_run(runs_dir, "dpo__1__510", "dpo", PYTHIA_2B8, 1, [dpo_metrics(0.66)])
    write_run(runs_dir, "dpo__3__510", "dpo", PYTHIA_2B8, 3, [dpo_metrics(0.70, 0.64)])
    write_run(runs_dir, "dpo_ipo__1__310", "dpo_ipo", PYTHIA_1B, 1, [dpo_metrics(0.10, 0.10)])  # another exp_name


# rm_scale_dpo_plot.csv of fake_runs + fake_dpo_runs, row by row in plot order:
# (split, method, base_model, seeds, values, mean, std)
RM_DPO_ROWS = [
    ("validation", "reward model", PYTHIA_1B, "1 2", "0.6 0.7", 0.65, 0.0707107),
    ("validation", "reward model", PYTHIA_2B8, "1", "0.75", 0.75, None),
    ("validation", "DPO", PYTHIA_1B, "1 2", "0.58 0.62", 0.60, 0.0282843),
    ("validation", "DPO", PYTHIA_2B8, "1 3", "0.66 0.7", 0.68, 0.0282843),
    ("validation_cnndm", "reward model", PYTHIA_1B, "1 2", "0.55 0.65", 0.60, 0.0707107),
    ("validation_cnndm", "reward model", PYTHIA_2B8, "1", "0.72", 0.72, None),
    ("validation_cnndm", "DPO", PYTHIA_1B, "1 2", "0.52 0.56", 0.54, 0.0282843),
    ("validation_cnndm", "DPO", PYTHIA_2B8, "3", "0.64", 0.64, None),
]


def check_rows(frame, expected):
    """`frame` (a table of seed_summary rows) is `expected`, row by row: (keys..., seeds, values, mean, std)."""
    assert len(frame) == len(expected)
    for (_, row), (*keys, seeds, values, mean, std) in zip(frame.iterrows(), expected):
        assert [row[c] for c in frame.columns[:len(keys)]] == keys
        assert (row["n_seeds"], row["seeds"], row["values"]) == (len(seeds.split()), seeds, values)
        assert row["mean"] == pytest.approx(mean)
        assert pd.isna(row["std"]) if std is None else row["std"] == pytest.approx(std, abs=1e-6)


def read(out, name):
    return pd.read_csv(os.path.join(out, f"{name}.csv"), dtype={"seeds": str, "values": str})


def choice(out, exp_name, base_model, seed, script="sft_rm_scale"):
    """(run_name, status, why) of each run of a key in runs_used_<script>.csv, newest first."""
    report = pd.read_csv(os.path.join(out, f"runs_used_{script}.csv"))
    rows = report[(report["exp_name"] == exp_name) & (report["base_model"] == base_model) & (report["seed"] == seed)]
    return list(zip(rows["run_name"], rows["status"], rows["why"]))


def test_sft_rm_scale_tables(tmp_path, capsys):
    runs_dir, out = str(tmp_path / "runs"), str(tmp_path / "out")
    fake_runs(runs_dir)
    sft_rm_scale.main(sft_rm_scale.Args(runs_dir=runs_dir, out=out))
    err = capsys.readouterr().err
    assert "runs of sft_rm_scale.py from" in err and "7 used, 2 set aside" in err  # the choice, printed
    assert choice(out, "sft", PYTHIA_1B, 1) == [("sft__1__200", "used", "newest"),
                                                ("sft__1__100", "set aside", "older")]
    assert choice(out, "sft", PYTHIA_2B8, 2) == [("sft_no_eval", "set aside", "no validation/sft/rouge/rougeL")]
    assert "warning: no dpo run with eval/rm/*/accuracy: no rm_scale_dpo_plot" in err
    assert not os.path.exists(os.path.join(out, "rm_scale_dpo_plot.csv"))

    rouge = read(out, "rouge_score_plot").set_index("base_model")
    assert list(rouge.index) == [PYTHIA_1B, PYTHIA_2B8]
    assert rouge.loc[PYTHIA_1B, "model_size"] == 1_000_000_000  # from the hub name (no output_dir here)
    assert rouge.loc[PYTHIA_2B8, "model_size"] == 2_800_000_000
    assert rouge.loc[PYTHIA_1B, "seeds"] == "1 2 3" and rouge.loc[PYTHIA_1B, "values"] == "0.2 0.22 0.24"
    assert rouge.loc[PYTHIA_1B, "mean"] == pytest.approx(0.22)
    assert rouge.loc[PYTHIA_1B, "std"] == pytest.approx(0.02)  # sample std, ddof=1
    assert rouge.loc[PYTHIA_2B8, "n_seeds"] == 1 and pd.isna(rouge.loc[PYTHIA_2B8, "std"])  # undefined for one seed
    assert "| EleutherAI/pythia-1b-deduped | 1000000000 | 3 | 1 2 3 | 0.2 0.22 0.24 | 0.2200 | 0.0200 |" in \
        open(os.path.join(out, "rouge_score_plot.md")).read()

    rm = read(out, "rm_scale_plot").set_index(["split", "base_model"])
    assert rm.loc[("validation", PYTHIA_1B), "mean"] == pytest.approx(0.65)
    assert rm.loc[("validation", PYTHIA_1B), "std"] == pytest.approx(0.0707107, abs=1e-6)
    assert rm.loc[("validation_cnndm", PYTHIA_1B), "mean"] == pytest.approx(0.60)
    assert rm.loc[("validation_cnndm", PYTHIA_2B8), "values"] == "0.72"

    conf = read(out, "rm_scale_plot_confidence")
    assert set(conf["confidence"]) == {1, 9}  # "None" has no place on the axis
    row = conf[(conf["base_model"] == PYTHIA_1B) & (conf["confidence"] == 9)].iloc[0]
    assert (row["split"], row["mean"], row["std"]) == ("validation", pytest.approx(0.9), pytest.approx(0.1414214, abs=1e-6))
    for name in ("rouge_score_plot", "rm_scale_plot", "rm_scale_plot_confidence"):
        for ext in ("png", "pdf", "md"):
            assert os.path.getsize(os.path.join(out, f"{name}.{ext}")) > 0


def test_dpo_beside_the_reward_model(tmp_path, capsys):
    """DPO runs add rm_scale_dpo_plot (reward model and DPO per split) and change nothing else."""
    runs_dir, without, out = str(tmp_path / "runs"), str(tmp_path / "without_dpo"), str(tmp_path / "out")
    fake_runs(runs_dir)
    sft_rm_scale.main(sft_rm_scale.Args(runs_dir=runs_dir, out=without))
    fake_dpo_runs(runs_dir)
    capsys.readouterr()
    sft_rm_scale.main(sft_rm_scale.Args(runs_dir=runs_dir, out=out))
    err = capsys.readouterr().err
    assert choice(out, "dpo", PYTHIA_1B, 1) == [("dpo__1__310", "used", "newest"),
                                                ("dpo__1__100", "set aside", "older")]
    assert "run dpo__1__510 has no eval/rm/validation_cnndm/accuracy; left out" in err
    assert "no rm_scale_dpo_plot" not in err

    table = read(out, "rm_scale_dpo_plot")
    assert list(table.columns) == ["split", "method", "base_model", "model_size", "n_seeds", "seeds", "values", "mean",
                                   "std", "ci_low", "ci_high"]
    check_rows(table, RM_DPO_ROWS)  # also the order: split, then reward model before DPO, then size
    assert table["model_size"].tolist() == [1_000_000_000, 2_800_000_000] * 4
    assert "| validation | DPO | EleutherAI/pythia-2.8b-deduped | 2800000000 | 2 | 1 3 | 0.66 0.7 | 0.6800 | 0.0283 |" in \
        open(os.path.join(out, "rm_scale_dpo_plot.md")).read()
    for ext in ("png", "pdf"):
        assert os.path.getsize(os.path.join(out, f"rm_scale_dpo_plot.{ext}")) > 0
    # the other plots, byte for byte as without DPO runs (the confidence plot is the reward model's only)
    for name in ("rouge_score_plot", "rm_scale_plot", "rm_scale_plot_confidence"):
        for ext in ("csv", "md", "png"):
            with open(os.path.join(without, f"{name}.{ext}"), "rb") as f, open(os.path.join(out, f"{name}.{ext}"), "rb") as g:
                assert f.read() == g.read(), f"{name}.{ext}"


def test_dpo_alone_and_its_exp_name(tmp_path, capsys):
    runs_dir, out = str(tmp_path / "runs"), str(tmp_path / "out")
    fake_runs(runs_dir)
    fake_dpo_runs(runs_dir)
    # no reward run: DPO alone, and no reward-model plot
    sft_rm_scale.main(sft_rm_scale.Args(runs_dir=runs_dir, out=out, run_glob="dpo__*"))
    assert "no reward run with eval/rm/*/accuracy: no RM plots" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(out, "rm_scale_plot.csv"))
    check_rows(read(out, "rm_scale_dpo_plot"), [row for row in RM_DPO_ROWS if row[1] == "DPO"])
    # --dpo_exp_name picks another experiment's runs; only the splits DPO has get a panel
    sft_rm_scale.main(sft_rm_scale.Args(runs_dir=runs_dir, out=out, dpo_exp_name="dpo_ipo", run_glob="*__1__*"))
    check_rows(read(out, "rm_scale_dpo_plot"), [
        ("validation", "reward model", PYTHIA_1B, "1", "0.6", 0.6, None),
        ("validation", "reward model", PYTHIA_2B8, "1", "0.75", 0.75, None),
        ("validation", "DPO", PYTHIA_1B, "1", "0.1", 0.1, None),
        ("validation_cnndm", "reward model", PYTHIA_1B, "1", "0.55", 0.55, None),
        ("validation_cnndm", "reward model", PYTHIA_2B8, "1", "0.72", 0.72, None),
        ("validation_cnndm", "DPO", PYTHIA_1B, "1", "0.1", 0.1, None),
    ])
    with pytest.raises(ValueError, match="--reward_exp_name and --dpo_exp_name are both 'reward': each stage needs"):
        sft_rm_scale.main(sft_rm_scale.Args(runs_dir=runs_dir, out=out, dpo_exp_name="reward"))


def test_run_glob_and_exp_names(tmp_path):
    runs_dir, out = str(tmp_path / "runs"), str(tmp_path / "out")
    fake_runs(runs_dir)
    sft_rm_scale.main(sft_rm_scale.Args(runs_dir=runs_dir, out=out, run_glob="*__3__*", sft_exp_name="sft"))
    assert read(out, "rouge_score_plot")["values"].tolist() == ["0.24"]
    assert not os.path.exists(os.path.join(out, "rm_scale_plot.csv"))  # no reward run matches the glob
    with pytest.raises(SystemExit, match="no sft, reward or dpo run"):
        sft_rm_scale.main(sft_rm_scale.Args(runs_dir=runs_dir, out=out, run_glob="nothing*"))
    with pytest.raises(FileNotFoundError, match="no run folder"):
        sft_rm_scale.main(sft_rm_scale.Args(runs_dir=str(tmp_path / "missing"), out=out))


def test_a_newer_run_without_eval_does_not_displace_a_complete_one(tmp_path, capsys):
    """A quick debug run without --run_eval, the newest of its key (and of its exp_name's only key at
    2.8B), has no ROUGE-L: each key keeps its newest run that has it, and the report says why."""
    runs_dir, out = str(tmp_path / "runs"), str(tmp_path / "out")
    fake_runs(runs_dir)
    write_run(runs_dir, "sft__1__900", "sft", PYTHIA_1B, 1, [{"train/sft/loss": 1.0}])
    write_run(runs_dir, "sft__1__901", "sft", PYTHIA_2B8, 1, [{"train/sft/loss": 1.0}])
    sft_rm_scale.main(sft_rm_scale.Args(runs_dir=runs_dir, out=out))
    assert "sft__1__900" in capsys.readouterr().err

    rouge = read(out, "rouge_score_plot").set_index("base_model")
    assert rouge.loc[PYTHIA_1B, "values"] == "0.2 0.22 0.24" and rouge.loc[PYTHIA_2B8, "values"] == "0.3"
    assert choice(out, "sft", PYTHIA_1B, 1) == [
        ("sft__1__900", "set aside", "newer, but no validation/sft/rouge/rougeL"),
        ("sft__1__200", "used", "newest with what the plots need"),
        ("sft__1__100", "set aside", "older"),
    ]
    assert choice(out, "sft", PYTHIA_2B8, 1)[0] == ("sft__1__901", "set aside",
                                                    "newer, but no validation/sft/rouge/rougeL")
    report = open(os.path.join(out, "runs_used_sft_rm_scale.md")).read()
    assert "| sft | EleutherAI/pythia-1b-deduped | 1 | sft__1__200 | 1970-01-01 00:03:20 UTC | used | newest with" \
        in report
    assert "`--runs reward__1__300 reward__2__300 reward__1__500 sft__1__200 sft__2__300 sft__3__300 sft__1__400`" \
        in report


def test_pinned_runs(tmp_path, capsys):
    """--runs pins a run for its key whatever newer runs exist, also outside --run_glob; the report's
    --runs line redraws the same plots after newer runs arrive."""
    runs_dir, out = str(tmp_path / "runs"), str(tmp_path / "out")
    fake_runs(runs_dir)
    sft_rm_scale.main(sft_rm_scale.Args(runs_dir=runs_dir, out=out, runs=["sft__1__100"]))
    assert read(out, "rouge_score_plot")["values"].tolist() == ["0.9 0.22 0.24", "0.3"]
    assert choice(out, "sft", PYTHIA_1B, 1) == [("sft__1__200", "set aside", "not pinned (--runs)"),
                                                ("sft__1__100", "used", "pinned (--runs)")]
    sft_rm_scale.main(sft_rm_scale.Args(runs_dir=runs_dir, out=out, run_glob="*__3__*", runs=["sft__1__100"]))
    assert read(out, "rouge_score_plot")["values"].tolist() == ["0.9 0.24"]

    # a pattern pins every run it matches; a key uses the newest of its pinned runs
    sft_rm_scale.main(sft_rm_scale.Args(runs_dir=runs_dir, out=out, runs=["sft__1__[12]00"]))
    assert choice(out, "sft", PYTHIA_1B, 1) == [("sft__1__200", "used", "pinned (--runs)"),
                                                ("sft__1__100", "set aside", "older")]

    # the runs a report names, pinned: a newer complete run changes nothing
    line = open(os.path.join(out, "runs_used_sft_rm_scale.md")).read().split("`--runs ")[1].split("`")[0]
    before = read(out, "rouge_score_plot")
    write_run(runs_dir, "sft__1__950", "sft", PYTHIA_1B, 1, [{"validation/sft/rouge/rougeL": 0.5}])
    sft_rm_scale.main(sft_rm_scale.Args(runs_dir=runs_dir, out=out, runs=line.split()))
    pd.testing.assert_frame_equal(read(out, "rouge_score_plot"), before)
    assert choice(out, "sft", PYTHIA_1B, 1)[0] == ("sft__1__950", "set aside", "not pinned (--runs)")

    # a pin that matches nothing pins nothing, with a warning; a pinned run without the metric is an error
    capsys.readouterr()
    sft_rm_scale.main(sft_rm_scale.Args(runs_dir=runs_dir, out=out, runs=["sft__1__[7]"]))
    assert "warning: --runs 'sft__1__[7]' matches none of the runs found: it pins nothing" in capsys.readouterr().err
    assert "--runs 'sft__1__[7]' matches none" in open(os.path.join(out, "runs_used_sft_rm_scale.md")).read()
    with pytest.raises(SystemExit, match="--runs pins sft_no_eval for exp_name=sft base_model=EleutherAI/pythia-2.8b-"
                                         "deduped seed=2, but sft_no_eval has no validation/sft/rouge/rougeL: pin a run"):
        sft_rm_scale.main(sft_rm_scale.Args(runs_dir=runs_dir, out=out, runs=["sft_no_eval"]))


def test_newest_run_without_time_in_name(tmp_path):
    """Hand-named runs (hello_world_sft) are ordered by when their args.json was written."""
    runs_dir = str(tmp_path / "runs")
    write_run(runs_dir, "hello_world_sft", "sft", PYTHIA_1B, 1, [], mtime=2_000)
    write_run(runs_dir, "hello_world_sft_all_tokens", "sft", PYTHIA_1B, 1, [], mtime=1_000)
    used, report = common.choose_runs(common.local_runs(runs_dir, ["sft"]), [], lambda run: None)
    assert [r.name for r in used] == ["hello_world_sft"]
    assert report["run_name"].tolist() == ["hello_world_sft", "hello_world_sft_all_tokens"]
    assert report["started"].tolist() == ["1970-01-01 00:33:20 UTC", "1970-01-01 00:16:40 UTC"]


def test_model_sizes(tmp_path):
    assert common.size_from_name("EleutherAI/pythia-1b-deduped") == 1e9
    assert common.size_from_name("EleutherAI/pythia-410m-deduped") == pytest.approx(4.1e8)
    assert common.size_from_name("EleutherAI/pythia-6.9b") == pytest.approx(6.9e9)
    assert common.size_from_name("Qwen/Qwen2.5-0.5B-Instruct") == pytest.approx(5e8)
    assert common.size_from_name("models/tiny/pythia-tiny-m") is None
    assert common.parse_size_overrides(["a/b=1e9", "c=410m", "x=y=2b"]) == {"a/b": 1e9, "c": 4.1e8, "x=y": 2e9}
    with pytest.raises(ValueError, match="BASE_MODEL=PARAMETERS"):
        common.parse_size_overrides(["1e9"])

    # a trained model's config gives the exact count, built on the meta device
    config = GPTNeoXConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32)
    config.save_pretrained(tmp_path / "sft_out")
    expected = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    def run(base_model, output_dir):
        config = {"exp_name": "sft", "base_model": base_model, "seed": 1, "output_dir": output_dir}
        return common.Run(name="r", config=config, created=0.0)

    runs = [run(PYTHIA_1B, str(tmp_path / "sft_out")), run("local/unnamed", str(tmp_path / "gone"))]
    with pytest.raises(ValueError, match="cannot tell the size of 'local/unnamed'"):
        common.model_sizes(runs, {})
    sizes = common.model_sizes(runs, {"local/unnamed": 123.0})
    assert sizes == {PYTHIA_1B: expected, "local/unnamed": 123}
    assert common.format_size(expected) == f"{expected / 1e3:.3g}K"
    assert common.format_size(6.9e9) == "6.9B" and common.format_size(4.05e8) == "405M"


class FakeApi:
    """Stands in for wandb.Api(): runs with config, summary and creation time."""

    def __init__(self, runs):
        self._runs, self.calls = runs, []

    def runs(self, path, filters=None):
        self.calls.append((path, filters))
        return self._runs


class FakeWandbRun:
    def __init__(self, name, config, summary, created_at):
        self.name, self.id, self.config, self.summary_metrics, self.created_at = name, name, config, summary, created_at


def test_wandb_summaries(tmp_path, monkeypatch):
    import wandb

    runs = [
        FakeWandbRun("sft_a", {"exp_name": "sft", "base_model": PYTHIA_1B, "seed": 1}, {"validation/sft/rouge/rougeL": 0.2},
                     "2024-01-01T00:00:00Z"),
        FakeWandbRun("sft_b", {"exp_name": "sft", "base_model": PYTHIA_1B, "seed": 2}, {"validation/sft/rouge/rougeL": 0.3},
                     "2024-01-01T00:00:00"),
        FakeWandbRun("sft_old", {"exp_name": "sft", "base_model": PYTHIA_1B, "seed": 2}, {"validation/sft/rouge/rougeL": 0.9},
                     "2023-01-01T00:00:00"),
        FakeWandbRun("rm", {"exp_name": "reward", "base_model": PYTHIA_1B, "seed": 1}, rm_metrics(0.6, 0.5, {3: 0.7}),
                     "2024-01-01T00:00:00"),
        FakeWandbRun("dpo_a", {"exp_name": "dpo", "base_model": PYTHIA_1B, "seed": 1}, dpo_metrics(0.58, 0.52),
                     "2024-01-01T00:00:00"),
        FakeWandbRun("dpo_b", {"exp_name": "dpo", "base_model": PYTHIA_1B, "seed": 2}, dpo_metrics(0.62),
                     "2024-01-01T00:00:00"),
    ]
    api = FakeApi(runs)
    monkeypatch.setattr(wandb, "Api", lambda: api)
    out = str(tmp_path / "out")
    sft_rm_scale.main(sft_rm_scale.Args(wandb_project="tldr", wandb_entity="me", wandb_tags=["v1"], out=out))
    path, filters = api.calls[0]
    assert path == "me/tldr"
    assert filters == {"$and": [{"config.exp_name": {"$in": ["sft", "reward", "dpo"]}}, {"tags": {"$in": ["v1"]}}]}
    rouge = read(out, "rouge_score_plot").iloc[0]
    assert (rouge["values"], rouge["mean"]) == ("0.2 0.3", pytest.approx(0.25))
    assert read(out, "rm_scale_plot")["mean"].tolist() == pytest.approx([0.6, 0.5])
    assert read(out, "rm_scale_plot_confidence")["confidence"].tolist() == [3]
    assert read(out, "rm_scale_plot_confidence")["values"].tolist() == ["0.7"]  # the reward model's, not DPO's
    check_rows(read(out, "rm_scale_dpo_plot"), [
        ("validation", "reward model", PYTHIA_1B, "1", "0.6", 0.6, None),
        ("validation", "DPO", PYTHIA_1B, "1 2", "0.58 0.62", 0.60, 0.0282843),
        ("validation_cnndm", "reward model", PYTHIA_1B, "1", "0.5", 0.5, None),
        ("validation_cnndm", "DPO", PYTHIA_1B, "1", "0.52", 0.52, None),
    ])
