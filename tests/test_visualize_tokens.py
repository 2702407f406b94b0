import builtins
import importlib.util
import math
import os
import re

import pytest
import torch
import tyro
from datasets import load_from_disk
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from summarize_from_feedback_details import reward
from summarize_from_feedback_details.infra import loading
from summarize_from_feedback_details.evaluation import reward_scores

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a script at the repository root, not part of the package: imported from its file
_spec = importlib.util.spec_from_file_location("visualize_tokens", os.path.join(REPO, "visualize_tokens.py"))
vt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vt)

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture
def one_thread():
    """Generation is hundreds of tiny ops: one thread is much faster than a pool on a small shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir):
    """SFT = the tiny base; "PPO" = the same with perturbed weights; reward model = the tiny base
    with a fresh scalar head. Each folder holds its tokenizer, as the stages save them."""
    root = tmp_path_factory.mktemp("visualize")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    ppo = AutoModelForCausalLM.from_pretrained(tokenizer_dir)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in ppo.parameters():
            parameter.add_(0.01 * torch.randn(parameter.shape, generator=generator))
    paths = {"sft": tokenizer_dir, "ppo": str(root / "ppo"), "reward": str(root / "reward_model")}
    ppo.save_pretrained(paths["ppo"])
    reward.reward_model_to_train(tokenizer_dir, loading.load_tokenizer(tokenizer_dir), head_seed=1).save_pretrained(
        paths["reward"])
    for name in ("ppo", "reward"):
        tokenizer.save_pretrained(paths[name])
    return paths


def cli(checkpoints, tiny_datasets, *extra) -> "vt.Args":
    return tyro.cli(vt.Args, args=[
        "--sft_model_path", checkpoints["sft"], "--ppo_model_path", checkpoints["ppo"],
        "--reward_model_path", checkpoints["reward"], "--query_dataset", os.path.join(tiny_datasets[0], "sft"),
        "--response_length", "12", *extra])


def test_prints_two_coloured_samples_with_the_pipelines_scores(checkpoints, tiny_datasets, capsys, one_thread):
    args = cli(checkpoints, tiny_datasets, "--num_samples", "2", "--start_index", "3", "--force_color",
               "--token_table")
    samples = vt.main(args)
    out = capsys.readouterr().out
    plain = ANSI.sub("", out)
    assert [s.row for s in samples] == [3, 4]
    assert "sample 1/2 (validation row 3)" in plain and "sample 2/2 (validation row 4)" in plain
    assert "sample 3/" not in plain
    assert "colour: log p_PPO - log p_SFT" in plain  # the legend

    # every PPO token is printed on the background colour of its logprob difference
    for sample in samples:
        assert len(sample.ppo_tokens) >= 1
        assert any(d != 0 for d in sample.shift["diff"])  # the perturbed policy did move
        for diff in sample.shift["diff"]:
            r, g, b = map(int, re.fullmatch(r"rgb\((\d+),(\d+),(\d+)\)", vt.diff_color(diff, args.diff_scale)).groups())
            assert f"48;2;{r};{g};{b}m" in out

    # the printed scores are the samples' scores ...
    printed = re.findall(r"^(reference|SFT|PPO) +RM score ([+-]\d+\.\d{4})", plain, flags=re.M)
    assert [name for name, _ in printed] == ["reference", "SFT", "PPO"] * 2
    expected = [v for s in samples for v in (s.reference_score, s.sft_score, s.ppo_score)]
    assert [float(score) for _, score in printed] == pytest.approx(expected, abs=6e-5)
    # ... and those equal independent computations: the reward model on the unpadded text (nothing to
    # mask, so plain HF reads the last token), the reference through hello_world_report's text path
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["reward"])
    model = AutoModelForSequenceClassification.from_pretrained(checkpoints["reward"]).eval()
    validation = load_from_disk(os.path.join(tiny_datasets[0], "sft"))["validation"]
    for sample in samples:
        query = [t for t in validation[sample.row]["query_token"] if t != tokenizer.pad_token_id]
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([query + sample.ppo_tokens])).logits[0, 0].item()
        assert sample.ppo_score == pytest.approx(alone, abs=1e-4)
        reference = validation[sample.row]["reference_response"].replace(tokenizer.eos_token, "")
        assert sample.reference == reference
        assert sample.reference_score == pytest.approx(
            float(reward_scores(model, tokenizer, [validation[sample.row]["query"]], [reference], [True])[0]),
            abs=1e-4)
    # a response without EOS is flagged (the reference always has one)
    missing = sum(not s.sft_has_eos for s in samples) + sum(not s.ppo_has_eos for s in samples)
    assert plain.count("NO EOS in 12 tokens") == missing
    for sample in samples:
        assert sample.ppo_has_eos == (tokenizer.eos_token_id in sample.ppo_tokens)
    # the token table lists each PPO token's SFT rank
    assert plain.count("SFT rank") == 2


def test_identical_policies_show_no_shift(checkpoints, tiny_datasets, capsys, one_thread):
    (sample,) = vt.main(cli(dict(checkpoints, ppo=checkpoints["sft"]), tiny_datasets, "--num_samples", "1"))
    capsys.readouterr()
    assert sample.shift["diff"] == [0.0] * len(sample.ppo_tokens)
    # a T=0.01 sample is SFT's top choice, unless two candidates are within ~0.01 nats of each other
    assert all(rank <= 1 for rank in sample.shift["sft_rank"])
    assert sample.ppo_response == sample.sft_response and sample.ppo_score == sample.sft_score


def test_interactive_next_previous_jump_and_end_of_input(checkpoints, tiny_datasets, monkeypatch, capsys, one_thread):
    commands = iter(["n", "p", "7", "x"])  # "x" is not a command: the row stays

    def fake_input(*_):
        try:
            return next(commands)
        except StopIteration:
            raise EOFError

    monkeypatch.setattr(builtins, "input", fake_input)
    samples = vt.main(cli(checkpoints, tiny_datasets))
    out = capsys.readouterr().out
    assert [s.row for s in samples] == [0, 1, 0, 7, 7]
    assert "next (Enter), previous, a row number, quit:" in out
    # each row draws from its own seed: coming back shows the same responses
    assert samples[2] == samples[0] and samples[4] == samples[3]


def test_token_shift_known_answer():
    probs_ppo = torch.tensor([[1 / 3, 1 / 3, 1 / 3], [0.1, 0.2, 0.7], [0.5, 0.3, 0.2]])
    probs_sft = torch.tensor([[0.5, 0.25, 0.25], [0.6, 0.3, 0.1], [0.8, 0.1, 0.1]])
    tokens = torch.tensor([2, 1, 0])
    # logits need not be normalised
    shift = vt.token_shift(probs_ppo.log() + 3.0, probs_sft.log() - 1.0, tokens)
    assert shift["ppo_logprobs"].tolist() == pytest.approx([math.log(1 / 3), math.log(0.2), math.log(0.5)], abs=1e-6)
    assert shift["sft_logprobs"].tolist() == pytest.approx([math.log(0.25), math.log(0.3), math.log(0.8)], abs=1e-6)
    assert shift["diff"].tolist() == pytest.approx([math.log(4 / 3), math.log(2 / 3), math.log(5 / 8)], abs=1e-6)
    # rank = candidates with a strictly higher SFT logit (the tie of tokens 1 and 2 in row 0 does not count)
    assert shift["sft_rank"].tolist() == [1, 1, 0]
    assert shift["sft_top"].tolist() == [0, 0, 0]
    # identical policies, tokens = their top choices: no difference, rank 0
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    same = vt.token_shift(logits, logits.clone(), logits.argmax(-1))
    assert torch.equal(same["diff"], torch.zeros(2, 5))
    assert torch.equal(same["sft_rank"], torch.zeros(2, 5, dtype=torch.long))


def test_colour_scale_and_commands():
    assert vt.diff_color(0.0, 2.0) == "rgb(242,242,242)"
    assert vt.diff_color(2.0, 2.0) == vt.diff_color(9.0, 2.0) == "rgb(200,30,40)"  # saturates
    assert vt.diff_color(-2.0, 2.0) == "rgb(59,76,192)"
    assert vt.diff_color(1.0, 2.0) == "rgb(221,136,141)"  # halfway to red
    assert vt.token_style(-2.0, 2.0, underline=True) == "white on rgb(59,76,192) underline"
    assert vt.token_style(0.5, 2.0) == f"black on {vt.diff_color(0.5, 2.0)}"
    assert [vt.next_index(c, 5, 10) for c in ("n", "", "p", "3", "42", "q", "?")] == [6, 6, 4, 3, 9, None, 5]
    assert vt.next_index("n", 9, 10) == 9 and vt.next_index("p", 0, 10) == 0  # the ends hold
    assert vt.visible(" a\nb") == " a\\nb"


def test_missing_folders_are_named(checkpoints, tiny_datasets, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--ppo_model_path .*nowhere does not exist"):
        vt.main(cli(dict(checkpoints, ppo=str(tmp_path / "nowhere")), tiny_datasets, "--num_samples", "1"))
    args = cli(checkpoints, tiny_datasets, "--num_samples", "1")
    args.query_dataset = str(tmp_path / "no_data")
    with pytest.raises(FileNotFoundError, match=r"--query_dataset .*no_data does not exist"):
        vt.main(args)
    with pytest.raises(ValueError, match="--num_samples 2000"):
        vt.main(cli(checkpoints, tiny_datasets, "--num_samples", "2000"))
