"""Where did PPO move away from SFT? Each token of the PPO policy's summary, coloured by how much
more (red) or less (blue) likely the PPO policy made it than the SFT policy it started from, next
to the SFT summary and the reference summary, each with its reward-model score.

    python visualize_tokens.py                               # hello_world.sh's outputs, interactive
    python visualize_tokens.py --num_samples 2 --force_color | less -R     # print 2 samples and exit
    python visualize_tokens.py --sft_model_path <hub name> --sft_model_revision <run name> \\
        --ppo_model_path <hub name> --ppo_model_revision <run name> \\
        --reward_model_path <hub name> --reward_model_revision <run name> \\
        --query_dataset vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144 \\
        --response_length 53                                 # models pushed by this project's stages

Per query (a row of the SFT dataset's `--split`), both policies answer with the pipeline's eval
generation (`response_length` new tokens at T=0.01, `[PAD]` never sampled, truncated after the
first EOS) from the same per-row seed, so a row always shows the same responses. Then, on the PPO
response's context, both policies score each of its tokens: log p_PPO - log p_SFT (at
`--logprob_temperature`; summed over the response it is the sampled log-ratio whose expectation
is the KL that PPO's penalty estimates) and the token's rank among SFT's candidates (0: SFT's top
choice too). The scores come from the pipeline's own `get_reward`, on the left-padded query and
the EOS-truncated response, read at the last real token (the EOS). The paper's visualize_tokens.py
read it at the first pad instead, which is the wrong token. A response without EOS is flagged:
the score shown is its score at its last token, as in the pipeline's eval tables, while PPO
training gives such a response `penalty_reward_value` instead.

Interactive mode (default) waits after each sample for n (next, also Enter), p (previous), a row
number, or q (quit). `--num_samples N` prints N rows from `--start_index` and exits.
"""

import os
from dataclasses import dataclass
from typing import Optional

import torch
import tyro
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from summarize_from_feedback_details.infra.launch import quiet_libraries
from summarize_from_feedback_details.infra.loading import (check_model_path, load_policy, load_reward_model,
                                                           load_split_dataset, load_tokenizer, looks_local)
from summarize_from_feedback_details.ppo_left_padding import (QUERY_COLUMNS, forward, gather_logprobs, get_reward,
                                                              scaled_logits, truncate_response)
from summarize_from_feedback_details.rollout import SamplingGroup, decode, derived_seed


@dataclass
class Args:
    sft_model_path: str = "models/hello_world/sft"
    """the reference policy (sft.py output): a local folder or a hub name; its tokenizer is used for all three"""
    ppo_model_path: str = "models/hello_world/ppo"
    """the aligned policy (ppo_left_padding.py output): a local folder or a hub name"""
    reward_model_path: str = "models/hello_world/reward_model"
    """the reward model (reward.py output): a local folder or a hub name"""
    sft_model_revision: Optional[str] = None
    """hub revision of --sft_model_path (the stages push to revision = run name)"""
    ppo_model_revision: Optional[str] = None
    reward_model_revision: Optional[str] = None
    query_dataset: str = "data/tldr/sft"
    """the SFT dataset of tldr_dataset.py: a local `save_to_disk` folder or a hub name"""
    split: str = "validation"
    response_length: int = 32
    """new tokens per response before truncation after EOS (hello_world.sh: 32; the paper: 53)"""
    temperature: float = 0.01
    """generation temperature (the pipeline's eval uses 0.01: near greedy)"""
    logprob_temperature: float = 1.0
    """temperature of the logprobs compared per token (1: the models' own distributions; 0.7: what
    PPO's KL penalty compared during training)"""
    seed: int = 1
    """sampling seed; each row draws from its own seed derived from it"""
    start_index: int = 0
    """first row of the split to show"""
    num_samples: Optional[int] = None
    """print this many rows and exit (for scripts and tests); None: interactive"""
    diff_scale: float = 1.0
    """|log p_PPO - log p_SFT| in nats at which a token's colour saturates"""
    token_table: bool = False
    """also print a table with each PPO token's logprobs, difference, SFT rank and SFT's top choice"""
    force_color: bool = False
    """colour (ANSI truecolor codes) even when the output is not a terminal (pipes, tests)"""


# colours of the diverging scale: PPO lowered the token's logprob / left it / raised it
BLUE, WHITE, RED = (59, 76, 192), (242, 242, 242), (200, 30, 40)


# ---------------------------------------------------------------------------------------------
# helpers (pure functions; tests import them)
# ---------------------------------------------------------------------------------------------


def token_shift(ppo_logits: torch.Tensor, sft_logits: torch.Tensor, tokens: torch.Tensor) -> dict:
    """Per token: its logprob under each policy, their difference, its rank among the SFT policy's
    candidates (the number of tokens SFT gave a strictly higher logit, so 0 = SFT's top choice) and
    SFT's top choice. Logits [..., T, V] predict tokens [..., T]."""
    ppo_logprobs = gather_logprobs(ppo_logits, tokens)
    sft_logprobs = gather_logprobs(sft_logits, tokens)
    token_sft_logit = sft_logits.gather(-1, tokens.unsqueeze(-1))
    return {
        "ppo_logprobs": ppo_logprobs,
        "sft_logprobs": sft_logprobs,
        "diff": ppo_logprobs - sft_logprobs,
        "sft_rank": (sft_logits > token_sft_logit).sum(-1),
        "sft_top": sft_logits.argmax(-1),
    }


def diff_color(diff: float, scale: float) -> str:
    """A rich colour on a blue-white-red scale, saturated at +-scale."""
    t = max(-1.0, min(1.0, diff / scale))
    end = RED if t > 0 else BLUE
    r, g, b = (round(w + abs(t) * (e - w)) for w, e in zip(WHITE, end))
    return f"rgb({r},{g},{b})"


def token_style(diff: float, scale: float, underline: bool = False) -> str:
    """The diff's colour as background, with text that stays readable on it."""
    text = "white" if abs(diff) > 0.6 * scale else "black"
    return f"{text} on {diff_color(diff, scale)}" + (" underline" if underline else "")


def next_index(command: str, index: int, num_rows: int) -> Optional[int]:
    """The row to show after an interactive command (None: quit). Unknown input keeps the row."""
    command = command.strip().lower()
    if command in ("q", "quit"):
        return None
    if command in ("", "n"):
        return min(index + 1, num_rows - 1)
    if command == "p":
        return max(index - 1, 0)
    if command.isdigit():
        return min(int(command), num_rows - 1)
    return index


def visible(token_text: str) -> str:
    """Text kept on one line: newlines shown, not executed."""
    return token_text.replace("\n", "\\n")


# ---------------------------------------------------------------------------------------------
# models and samples
# ---------------------------------------------------------------------------------------------


def resolve(path: str, revision: Optional[str], flag: str) -> str:
    """A local folder for `path`: a missing local folder is an error naming the flag; a hub name with
    a revision is downloaded at that revision (plain hub names go to from_pretrained as they are)."""
    if looks_local(path):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"--{flag} {path} does not exist (./hello_world.sh writes the default "
                                    "models; pass another folder or a hub name)")
        check_model_path(path)
        return path
    if revision is None:
        return path
    from huggingface_hub import snapshot_download

    return snapshot_download(path, revision=revision)


@dataclass
class Sample:
    row: int
    query: str
    reference: str
    reference_score: float
    sft_response: str
    sft_score: float
    sft_has_eos: bool
    ppo_tokens: list
    """the PPO response up to and including its EOS (all of it without EOS)"""
    ppo_response: str
    ppo_score: float
    ppo_has_eos: bool
    shift: dict
    """token_shift of the PPO tokens, as lists"""


@torch.no_grad()
def make_sample(args: Args, row: int, data: dict, sft, ppo, reward_model, tokenizer, device) -> Sample:
    """Row `row` of the split (`data`: its query_token and reference_response_token) as the pipeline
    sees it: left-padded query, right-padded reference, responses truncated after EOS."""
    pad_id, eos_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    query = data["query_token"].view(1, -1).to(device)
    reference = data["reference_response_token"].view(1, -1).to(device)
    responses = {}
    for name, policy in (("sft", sft), ("ppo", ppo)):
        # the same seed for both policies: identical policies give identical responses
        group = SamplingGroup(query, args.temperature, derived_seed(args.seed, row))
        ((response, _),) = decode(policy, [group], pad_id, len(tokenizer), args.response_length)
        responses[name] = truncate_response(response, eos_id, pad_id)
    scores = {name: get_reward(reward_model, torch.cat([query, response], 1), pad_id).item()
              for name, response in (*responses.items(), ("reference", reference))}
    # both policies' logits for the PPO response, on the same context
    query_response = torch.cat([query, responses["ppo"]], 1)
    logits = [scaled_logits(forward(policy, query_response, pad_id)[:, query.shape[1] - 1: -1],
                            args.logprob_temperature, pad_id, len(tokenizer))[0] for policy in (ppo, sft)]
    ppo_tokens = responses["ppo"][0]
    ppo_tokens = ppo_tokens[ppo_tokens != pad_id]  # generation never samples [PAD]: only truncation made them
    length = len(ppo_tokens)
    shift = token_shift(logits[0][:length], logits[1][:length], ppo_tokens)

    def text(tokens):
        return tokenizer.decode(tokens[0], skip_special_tokens=True)

    return Sample(
        row=row, query=text(query), reference=text(reference), reference_score=scores["reference"],
        sft_response=text(responses["sft"]), sft_score=scores["sft"],
        sft_has_eos=bool((responses["sft"] == eos_id).any()),
        ppo_tokens=ppo_tokens.tolist(), ppo_response=text(responses["ppo"]), ppo_score=scores["ppo"],
        ppo_has_eos=bool((ppo_tokens == eos_id).any()),
        shift={k: v.tolist() for k, v in shift.items()},
    )


# ---------------------------------------------------------------------------------------------
# display
# ---------------------------------------------------------------------------------------------


def legend(args: Args) -> Text:
    text = Text(f"colour: log p_PPO - log p_SFT of the token (nats, T={args.logprob_temperature:g}) ")
    for value in (-args.diff_scale, -args.diff_scale / 2, 0.0, args.diff_scale / 2, args.diff_scale):
        text.append(f" {value:+g} " if value else " 0 ", style=token_style(value, args.diff_scale))
    text.append("\nred: PPO raised its probability, blue: lowered it; underlined: not SFT's top-1")
    return text


def score_line(name: str, score: float, has_eos: bool, response_length: int) -> Text:
    text = Text(f"{name:<10} RM score {score:+.4f}", style="bold")
    if not has_eos:
        # the score stays the raw one, as in the pipeline's eval tables
        text.append(f"  NO EOS in {response_length} tokens (penalised in PPO training)", style="bold red")
    return text


def show(console: Console, sample: Sample, position: str, tokenizer, args: Args) -> None:
    console.rule(f"sample {position} ({args.split} row {sample.row})")
    console.print(Text(sample.query, style="dim"))
    console.print(score_line("reference", sample.reference_score, True, args.response_length))
    console.print(Text(visible(sample.reference)))
    console.print(score_line("SFT", sample.sft_score, sample.sft_has_eos, args.response_length))
    console.print(Text(visible(sample.sft_response)))
    console.print(score_line("PPO", sample.ppo_score, sample.ppo_has_eos, args.response_length))
    shift = sample.shift
    tokens = Text()
    for i, token in enumerate(sample.ppo_tokens):
        tokens.append(visible(tokenizer.decode([token])),
                      style=token_style(shift["diff"][i], args.diff_scale, underline=shift["sft_rank"][i] > 0))
    console.print(tokens)
    moved = sum(rank > 0 for rank in shift["sft_rank"])
    console.print(f"response: log p_PPO - log p_SFT = {sum(shift['diff']):+.3f} nats, {len(sample.ppo_tokens)} "
                  f"tokens, {moved} not SFT's top-1")
    if args.token_table:
        table = Table(box=box.SIMPLE_HEAD)
        for column in ("#", "token", "logp PPO", "logp SFT", "diff", "SFT rank", "SFT top-1"):
            table.add_column(column, overflow="fold")  # long tokens wrap instead of losing their end
        for i, token in enumerate(sample.ppo_tokens):
            table.add_row(
                str(i), Text(repr(tokenizer.decode([token])), style=token_style(shift["diff"][i], args.diff_scale)),
                f"{shift['ppo_logprobs'][i]:.3f}", f"{shift['sft_logprobs'][i]:.3f}", f"{shift['diff'][i]:+.3f}",
                str(shift["sft_rank"][i]), repr(tokenizer.decode([shift["sft_top"][i]])))
        console.print(table)
    console.print(legend(args))


def main(args: Args) -> list:
    """Shows the samples; returns them (tests read them)."""
    quiet_libraries()
    paths = {name: resolve(getattr(args, f"{name}_model_path"), getattr(args, f"{name}_model_revision"),
                           f"{name}_model_path") for name in ("sft", "ppo", "reward")}
    if looks_local(args.query_dataset) and not os.path.isdir(args.query_dataset):
        raise FileNotFoundError(f"--query_dataset {args.query_dataset} does not exist (./hello_world.sh --data "
                                "writes the default; or pass the hub name of a tldr_dataset.py SFT dataset)")
    dataset = load_split_dataset(args.query_dataset, QUERY_COLUMNS)
    if args.split not in dataset:
        raise ValueError(f"--split {args.split}: {args.query_dataset} has splits {list(dataset)}")
    rows = dataset[args.split].with_format("torch", columns=list(QUERY_COLUMNS))
    if not 0 <= args.start_index < len(rows):
        raise ValueError(f"--start_index {args.start_index} outside the {len(rows)} rows of {args.split}")
    if args.num_samples is not None and not 1 <= args.num_samples <= len(rows) - args.start_index:
        raise ValueError(f"--num_samples {args.num_samples}: {args.split} has {len(rows) - args.start_index} rows "
                         f"from --start_index {args.start_index}")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(paths["sft"])
    sft = load_policy(paths["sft"], tokenizer).to(device).eval()
    ppo = load_policy(paths["ppo"], tokenizer).to(device).eval()
    reward_model = load_reward_model(paths["reward"], tokenizer).to(device).eval()
    console = Console(force_terminal=args.force_color or None, color_system="truecolor" if args.force_color else "auto",
                      highlight=False)

    def sample(row: int) -> Sample:
        return make_sample(args, row, rows[row], sft, ppo, reward_model, tokenizer, device)

    shown = []
    if args.num_samples is not None:
        for i in range(args.num_samples):
            shown.append(sample(args.start_index + i))
            show(console, shown[-1], f"{i + 1}/{args.num_samples}", tokenizer, args)
        return shown
    index = args.start_index
    while index is not None:
        shown.append(sample(index))
        show(console, shown[-1], f"{index + 1}/{len(rows)}", tokenizer, args)
        try:
            command = console.input("[bold]n[/bold]ext (Enter), [bold]p[/bold]revious, a row number, "
                                    "[bold]q[/bold]uit: ")
        except EOFError:  # stdin closed (Ctrl-D, or a pipe that ran out)
            break
        index = next_index(command, index, len(rows))
    return shown


if __name__ == "__main__":
    main(tyro.cli(Args))
