"""Packed forwards (packing.py) against the padded ones: the same logits, values and rewards to 1e-5
in fp32 whatever the padding (left, right, inside a row), through peft, and a compiled training
forward that equals the eager one or falls back to it."""

import pytest
import torch
import torch.nn.functional as F
from conftest import BackendFailingAfterFirst, tiny_llama_config
from peft import LoraConfig, get_peft_model
from transformers import (GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM,
                          GPTNeoXForSequenceClassification, LlamaForCausalLM)

from summarize_from_feedback_details import dpo, packing, reward, sft
from summarize_from_feedback_details.infra import launch
from summarize_from_feedback_details import ppo_left_padding as ppo

PAD, VOCAB = 1, 48


def neox_config(**extra) -> GPTNeoXConfig:
    return GPTNeoXConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, pad_token_id=PAD, eos_token_id=0, **extra)


def causal_lm(kind: str = "gpt_neox"):
    torch.manual_seed(0)
    if kind == "llama":  # RMSNorm, SwiGLU, grouped-query attention, tied embeddings
        return LlamaForCausalLM(tiny_llama_config(VOCAB, pad_token_id=PAD)).eval()
    if kind == "gpt2":  # absolute position embeddings
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                          pad_token_id=PAD)).eval()
    return GPTNeoXForCausalLM(neox_config()).eval()


def score_model():
    torch.manual_seed(1)
    return GPTNeoXForSequenceClassification(neox_config(num_labels=1)).eval()


def padded_batch() -> torch.Tensor:
    """Rows with left padding, padding after an EOS, both, padding inside a row, and none."""
    torch.manual_seed(2)
    ids = torch.randint(2, VOCAB, (5, 14))
    ids[0, :4] = PAD
    ids[1, -5:] = PAD
    ids[2, :2] = PAD
    ids[2, -3:] = PAD
    ids[3, 6] = PAD
    return ids


def real(ids: torch.Tensor) -> torch.Tensor:
    return ids != PAD


@pytest.mark.parametrize("kind", ["gpt_neox", "gpt2", "llama"])
@pytest.mark.parametrize("logits_to_keep", [0, 6])
def test_packed_logits_equal_padded(kind, logits_to_keep):
    model, ids = causal_lm(kind), padded_batch()
    with torch.no_grad():
        padded = sft.forward(model, ids, PAD, logits_to_keep)
        packing.enable(True, model)
        packed = sft.forward(model, ids, PAD, logits_to_keep)
    kept = real(ids)[:, -padded.shape[1]:, None]
    assert packed.shape == padded.shape
    assert ((packed - padded).abs() * kept).max() < 1e-5
    assert (packed.masked_select(~kept) == 0).all()  # nothing computed at padding


def test_packed_values_and_rewards_equal_padded():
    model, ids = score_model(), padded_batch()
    with torch.no_grad():
        values, rewards = ppo.get_values(model, ids, PAD), reward.get_reward(model, ids, PAD)
        packing.enable(True, model)
        packed_values, packed_rewards = ppo.get_values(model, ids, PAD), reward.get_reward(model, ids, PAD)
    assert ((packed_values - values).abs() * real(ids)).max() < 1e-5
    assert (packed_rewards - rewards).abs().max() < 1e-5
    assert rewards.std() > 1e-3  # (rows that differ)


def test_packed_response_logits_and_values_through_peft_equal_padded():
    """The PPO training forward's two heads, with LoRA adapters (non-zero) on every linear layer."""
    policy, critic = causal_lm(), score_model()
    lora = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    policy = get_peft_model(policy, LoraConfig(task_type="CAUSAL_LM", **lora))
    critic = get_peft_model(critic, LoraConfig(task_type="SEQ_CLS", modules_to_save=["score"], **lora))
    queries, responses = padded_batch()[:, :8], torch.randint(2, VOCAB, (5, 6))
    queries[1, :3] = PAD
    wrapper = ppo.PolicyAndValueWrapper(policy, critic, PAD)
    query_responses = torch.cat([queries, responses], 1)
    logits, values = wrapper(query_responses, 6)
    packing.enable(True, policy, critic)
    packed_logits, packed_values = wrapper(query_responses, 6)
    assert (packed_logits - logits).abs().max() < 1e-5 and (packed_values - values).abs().max() < 1e-5
    packed_values.sum().backward()  # gradients reach the trainable head and the adapters
    assert critic.base_model.model.score.modules_to_save["default"].weight.grad.abs().sum() > 0


def test_a_packed_row_whose_attention_mixes_sequences_is_caught(monkeypatch):
    """The check above can fail: causal attention over the whole packed row (no separation)."""
    def leaky(module, query, key, value, attention_mask, scaling=None, *args):
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling).transpose(1, 2), None

    model, ids = causal_lm(), padded_batch()
    with torch.no_grad():
        padded = sft.forward(model, ids, PAD)
        packing.enable(True, model)
        monkeypatch.setattr(packing, "padded_sdpa_for_packed", leaky)
        mixed = sft.forward(model, ids, PAD)
    assert ((mixed - padded).abs() * real(ids)[..., None]).max() > 1e-2


def test_packed_gradients_equal_padded_also_with_gradient_checkpointing():
    """The recomputation in the backward takes the packed attention too (it rides on the arguments)."""
    ids = padded_batch()
    grads = {}
    for packed, checkpointed in ((False, False), (True, False), (True, True)):
        model = causal_lm().train()
        if checkpointed:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        packing.enable(packed, model)
        (sft.forward(model, ids, PAD, 6) * real(ids)[:, -6:, None]).square().sum().backward()
        grads[packed, checkpointed] = [p.grad for p in model.parameters()]
    for key in ((True, False), (True, True)):
        assert max((a - b).abs().max() for a, b in zip(grads[key], grads[False, False])) < 1e-5


def k_samples_batch() -> torch.Tensor:
    """Two left-padded queries, each with three sampled responses (one pair of which also shares its
    first two tokens, and one response padded after its EOS), a row of its own, in a shuffled order."""
    torch.manual_seed(4)
    queries = torch.randint(2, VOCAB, (2, 7))
    queries[1, :3] = PAD
    rows = [torch.cat([queries[q], torch.randint(2, VOCAB, (6,))]) for q in (0, 0, 0, 1, 1, 1)]
    rows[1][7:9] = rows[0][7:9]
    rows[4][-2:] = PAD
    rows.append(torch.randint(2, VOCAB, (13,)))
    return torch.stack(rows)[torch.tensor([3, 0, 6, 4, 1, 5, 2])]


def distinct_prefixes(ids: torch.Tensor) -> int:
    """What a packed row must compute: the distinct (real tokens up to here) of the batch's real places."""
    return len({tuple(row[:c + 1][row[:c + 1] != PAD].tolist()) + (int((row[:c + 1] != PAD).sum()),)
                for row in ids for c in range(len(row)) if row[c] != PAD})


def test_shared_prefix_owner_known_answer():
    ids = torch.tensor([[5, 6, 7], [9, 9, 9], [5, 6, 8], [PAD, 5, 6], [5, 6, 7]])
    mask = ids != PAD
    owner = packing.shared_prefix_owner(ids, mask, (mask.cumsum(1) - 1).clamp(min=0))
    # rows 0, 2 and 4 share [5, 6] (4 also 7); row 3's 5 sits at another column: its own, as row 1's
    assert owner.tolist() == [[0, 0, 0], [1, 1, 1], [0, 0, 2], [3, 3, 3], [0, 0, 0]]


@pytest.mark.parametrize("kind", ["gpt_neox", "llama"])
def test_a_prefix_shared_by_samples_is_computed_once_with_the_same_logits_and_gradients(kind):
    ids = k_samples_batch()
    mask = real(ids)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    assert len(packing.Packed(ids, mask, positions, "sdpa", share_prefixes=True).rows) == distinct_prefixes(ids) \
        == int(mask.sum()) - 2 * 7 - 2 * 4 - 2
    assert len(packing.Packed(ids, mask, positions, "sdpa").rows) == int(mask.sum())  # (unless asked)
    results = {}
    for on in (False, True):
        model = causal_lm(kind).train()
        packing.enable(on, model, share_prefixes=on)
        logits = sft.forward(model, ids, PAD)
        (logits * real(ids)[..., None]).square().sum().backward()
        results[on] = logits.detach(), [p.grad for p in model.parameters()]
    assert ((results[True][0] - results[False][0]).abs() * real(ids)[..., None]).max() < 1e-5
    assert max((a - b).abs().max() for a, b in zip(results[True][1], results[False][1])) < 1e-5


def test_rewards_of_samples_that_share_a_query_equal_padded():
    model, ids = score_model(), k_samples_batch()
    with torch.no_grad():
        rewards, values = reward.get_reward(model, ids, PAD), ppo.get_values(model, ids, PAD)
        packing.enable(True, model, share_prefixes=True)
        packed_rewards, packed_values = reward.get_reward(model, ids, PAD), ppo.get_values(model, ids, PAD)
    assert (packed_rewards - rewards).abs().max() < 1e-5
    assert ((packed_values - values).abs() * real(ids)).max() < 1e-5


@pytest.mark.parametrize("attention", ["eager", "flash_attention_2"])
def test_packing_refuses_attention_other_than_sdpa(attention):
    """Only sdpa is routed for packed rows (flash attention's varlen path is not wired in)."""
    model = causal_lm()
    model.config._attn_implementation = attention
    packing.enable(True, model)
    with pytest.raises(ValueError, match=rf"--packing needs sdpa attention, not '{attention}': run with --no_packing"):
        sft.forward(model, padded_batch(), PAD)


def test_response_window_known_answers():
    labels = torch.tensor([[PAD, PAD, PAD, 7, 8], [PAD, PAD, PAD, 9, PAD]])
    assert dpo.response_window(labels, PAD) == 3  # the column before the first label, and the labels
    assert dpo.response_window(torch.tensor([[5, 6, PAD]]), PAD) == 3  # a label in column 0: every column
    assert sft.response_window(labels, PAD) == dpo.response_window(labels, PAD)


@pytest.mark.parametrize("packed", [False, True])
def test_dpo_logprobs_from_response_logits_equal_full_logits(packed):
    model = causal_lm()
    packing.enable(packed, model)
    torch.manual_seed(3)
    chosen, rejected = torch.randint(2, VOCAB, (3, 12)), torch.randint(2, VOCAB, (3, 12))
    for rows in (chosen, rejected):
        rows[:, :2] = PAD  # left padding of the queries (7 columns)
        rows[0, -2:] = PAD  # a short response
    chosen_labels, rejected_labels = (rows.clone() for rows in (chosen, rejected))
    chosen_labels[:, :7] = PAD
    rejected_labels[:, :7] = PAD
    with torch.no_grad():
        full = dpo.forward(model, torch.cat([chosen, rejected]), PAD)
        expected = dpo.sequence_logprobs(full, torch.cat([chosen_labels, rejected_labels]), PAD)
        got = dpo.pair_logprobs(model, chosen, rejected, chosen_labels, rejected_labels, PAD)
    assert torch.allclose(torch.cat(got), expected, atol=1e-5)


@pytest.mark.parametrize("response_only", [False, True])
def test_sft_losses_from_the_label_window_equal_full_logits(response_only):
    model = causal_lm()
    packing.enable(True, model)
    ids = padded_batch()
    labels = ids.clone()
    if response_only:
        labels[:, :7] = PAD
    with torch.no_grad():
        expected = sft.sequence_losses(sft.forward(model, ids, PAD), labels, PAD)
        got = sft.label_losses(model, ids, labels, PAD)
    assert torch.allclose(got[0], expected[0], atol=1e-5) and torch.equal(got[1], expected[1])


def test_compiled_training_forward_equals_eager_and_trains():
    """--compile_train's body (aot_eager: dynamo's capture and AOT autograd's joint graph, without the
    C++ toolchain, so the suite stays fast): the same logits and gradients as eager."""
    model, ids = causal_lm(), padded_batch()
    packing.enable(True, model)
    eager = sft.forward(model, ids, PAD, 6)
    eager.square().sum().backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    body = packing.transformer_body(model)
    body.compiled_forward = packing.CompiledForward(body.forward, backend="aot_eager")
    compiled = sft.forward(model, ids, PAD, 6)
    compiled.square().sum().backward()
    assert body.compiled_forward.modes_run == {True} and body.compiled_forward.failure is None
    assert torch.allclose(compiled, eager, atol=1e-5)
    assert all(torch.allclose(p.grad, g, atol=1e-5) for p, g in zip(model.parameters(), eager_grads))
    assert "forward" not in vars(body)  # the eager forward is back after the call
    wrapped = body.forward.__func__.__get__(body)  # a forward some wrapper set on the instance
    body.forward = wrapped
    sft.forward(model, ids, PAD, 6)
    assert vars(body)["forward"] is wrapped  # stays, after the compiled call


def test_compile_error_falls_back_to_eager_with_one_warning():
    def failing_backend(graph_module, example_inputs):
        raise RuntimeError("no C compiler here")

    model, ids = causal_lm(), padded_batch()
    packing.enable(True, model)
    with torch.no_grad():
        eager = sft.forward(model, ids, PAD)
    body = packing.transformer_body(model)
    body.compiled_forward = packing.CompiledForward(body.forward, backend=failing_backend)
    with pytest.warns(UserWarning, match="no C compiler here"):
        with torch.no_grad():
            first = sft.forward(model, ids, PAD)
    with torch.no_grad():
        second = sft.forward(model, ids, PAD)  # no second warning: given up for the run
    assert "no C compiler here" in body.compiled_forward.failure
    assert torch.equal(first, eager) and torch.equal(second, eager)


def test_a_compile_that_fails_after_a_reset_falls_back_too():
    """Issue 34, case 7: a compile after the first (here after the dynamo reset that the compiled
    decode's fallback makes; likewise a new shape) that fails falls back to eager with its warning,
    where it used to stop the run with BackendCompilerFailed."""
    backend = BackendFailingAfterFirst()

    model, ids = causal_lm(), padded_batch()
    packing.enable(True, model)
    with torch.no_grad():
        eager = sft.forward(model, ids, PAD)
    body = packing.transformer_body(model)
    body.compiled_forward = packing.CompiledForward(body.forward, backend=backend)
    with torch.no_grad():
        first = sft.forward(model, ids, PAD)
        assert body.compiled_forward.modes_run == {False} and body.compiled_forward.failure is None
        torch._dynamo.reset()
        with pytest.warns(UserWarning, match=r"the compiled training forward failed \(RuntimeError: the recompile "
                                             r"failed\); running eagerly .* a compiled decode compiles again"):
            second = sft.forward(model, ids, PAD)
    assert backend.compiles == 2 and torch.allclose(first, eager, atol=1e-5) and torch.equal(second, eager)


def test_a_backward_compile_error_also_falls_back_before_any_gradient():
    """The backward graph is lowered at the first compiled forward, so its errors land there too."""
    from torch._dynamo.backends.common import aot_autograd

    def failing_backward(graph_module, example_inputs):
        raise RuntimeError("backward compiler missing")

    model, ids = causal_lm(), padded_batch()
    packing.enable(True, model)
    eager = sft.forward(model, ids, PAD)
    body = packing.transformer_body(model)
    body.compiled_forward = packing.CompiledForward(
        body.forward, backend=aot_autograd(fw_compiler=lambda graph_module, inputs: graph_module,
                                           bw_compiler=failing_backward))
    with pytest.warns(UserWarning, match="backward compiler missing"):
        logits = sft.forward(model, ids, PAD)
    logits.square().sum().backward()
    assert torch.equal(logits, eager) and all(p.grad is not None for p in model.parameters())


def test_compile_train_needs_packing():
    model = causal_lm()
    with pytest.raises(ValueError, match="needs --packing"):
        packing.compile_for_training(True, print, model)


def test_compile_train_takes_the_fused_optimizer_with_the_same_update():
    model = causal_lm()
    args = ppo.Args(compile_train=True)
    fused = launch.make_optimizer(args, model)
    assert fused.defaults["fused"] and isinstance(fused, torch.optim.AdamW)
    assert not launch.make_optimizer(ppo.Args(), model).defaults["fused"]
    start = [p.detach().clone() for p in model.parameters()]
    updated = []
    for optimizer_args in (ppo.Args(lr=1e-2), ppo.Args(lr=1e-2, compile_train=True)):
        with torch.no_grad():
            for p, p0 in zip(model.parameters(), start):
                p.copy_(p0)
        optimizer = launch.make_optimizer(optimizer_args, model)
        for _ in range(3):
            optimizer.zero_grad()
            sft.forward(model, padded_batch(), PAD).square().mean().backward()
            optimizer.step()
        updated.append([p.detach().clone() for p in model.parameters()])
    assert max((a - b).abs().max() for a, b in zip(*updated)) < 1e-6
    assert max((a - p0).abs().max() for a, p0 in zip(updated[0], start)) > 1e-3  # (it moved)
