"""Forwards that compute real tokens only (sequence packing), and the compiled training forward.

Packing: a batch of [rows, columns] with padding (left padding of the queries, padding after EOS)
goes through the model as ONE row of its real tokens, each sequence's positions restarting at 0
(the padded forwards' `cumsum - 1` picked at the real tokens). Embeddings, layer norms, every
linear layer, the MLPs and the heads then run on real tokens only, and the outputs come back in
the padded layout (zeros at padding) for the stage's own masks. Attention must not mix the
sequences of the packed row: transformers' sdpa attention is registered over by `sdpa_or_packed`,
which is that same function for every call without `packed_rows` (generation, any padded
forward) and, for a packed call, `padded_sdpa_for_packed`: each sequence moves to its own
right-padded row, plain causal SDPA runs there (exact: a real token only sees earlier positions of
its own row, all real) and the outputs move back. Attention then costs what the padded batch's did;
everything else runs on real tokens only. The choice rides on the call's arguments, so gradient
checkpointing's recomputation takes the same path. (A packed call hands the model a 1x1x1x1 mask,
which transformers passes through as "prepared": it would otherwise build a tokens x tokens
block-diagonal mask.) Other attention implementations cannot take packed rows: `--no_packing`.
(Flash attention's varlen kernel could take the packed row as it is, but every stage loads its
models with sdpa: a branch for it would be code that no run reaches.)
The call goes through the model's own forward (and so through DDP, DeepSpeed, peft and accelerate's
autocast exactly as the padded call): logits come from `logits_to_keep` given the packed indices,
per-position scores of a sequence-classification model from a hook on its `score` head.

It changes no result beyond float noise: positions count real tokens only in both layouts and a
padded position never reaches a real one (tests/test_packing.py: packed vs padded logits, values
and rewards equal to 1e-5 in fp32; every stage's invariance tests run packed). The stages turn it
on per model (`enable`) from their `--packing` flag (default on); `--no_packing` runs the padded
forwards unchanged, for comparisons and for models whose attention cannot take packed rows.

Shared prefixes (`enable(..., share_prefixes=True)`: RLOO/GRPO and online DPO, whose forwards hold a
query's k samples together): a token whose row agrees with another row on every column up to it has
that row's hidden states there (attention is causal, positions count real tokens), so the packed row
holds it once and every row that shares it reads its output; attention still gives each sequence its
own row, with the shared tokens' keys and values in each. The same result to float noise again (a
token's linear layers run in a batch of other tokens); the linear layers run on a query's tokens once
instead of k times (tests/test_packing.py: logits, rewards and gradients against the padded ones).

`--compile_train` (`compile_for_training`): the packed forwards of a trained model under
torch.compile with dynamic shapes (a packed row's length changes every batch), backward included;
an error of any compiled call (a first compile, or a recompile for a new shape or after a reset)
gives it up for the run: one warning with the compiler's own message, dynamo reset, eager from then
on (the compiled decode's rule).
"""

import contextlib
import warnings

import torch
import torch.nn.functional as F
from transformers import AttentionInterface


def padded_sdpa_for_packed(module, query, key, value, attention_mask, scaling=None, dropout=0.0, packed_rows=None):
    """Causal attention over a packed row [1, heads, tokens, head_dim]. `packed_rows` (`Packed`): the
    row, position and packed token of every real place of the padded batch, each token's own place, and
    the rows' shape. Each sequence gets its own right-padded row of its tokens' states (a prefix shared
    by several sequences in each of their rows), plain causal SDPA runs there (exact: a real token only
    sees earlier positions of its own row, all real), and each token's output is read at its own
    place. Returns [1, tokens, heads, head_dim], as transformers' attention functions do."""
    row, position, token, home, shape = packed_rows

    def to_rows(states):
        rows = states.new_zeros(shape[0], states.shape[1], shape[1], states.shape[3])
        rows[row, :, position] = states[0].transpose(0, 1)[token]
        return rows

    output = F.scaled_dot_product_attention(to_rows(query), to_rows(key), to_rows(value), dropout_p=dropout,
                                            is_causal=True, scale=scaling, enable_gqa=key.shape[1] != query.shape[1])
    return output[row[home], :, position[home]].unsqueeze(0), None


TRANSFORMERS_SDPA = AttentionInterface._global_mapping["sdpa"]


def sdpa_or_packed(module, query, key, value, attention_mask, scaling=None, dropout=0.0, packed_rows=None,
                   **kwargs):
    """transformers' sdpa attention, or `padded_sdpa_for_packed` for a packed call."""
    if packed_rows is None:
        return TRANSFORMERS_SDPA(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    return padded_sdpa_for_packed(module, query, key, value, attention_mask, scaling, dropout, packed_rows)


AttentionInterface.register("sdpa", sdpa_or_packed)


def inner(model):
    """The model under a DDP wrapper or a DeepSpeed engine (whose own `config` is its JSON config)."""
    while isinstance(model, torch.nn.parallel.DistributedDataParallel) or type(model).__name__ == "DeepSpeedEngine":
        model = model.module
    return model


def enable(on: bool, *models, share_prefixes: bool = False) -> None:
    """Marks loaded models (plain or peft-wrapped; before or after accelerate's prepare; None is
    skipped: a LoRA run's reference) to run their scoring and training forwards packed, or not; with
    `share_prefixes`, a prefix that rows of one forward share is computed once (`shared_prefix_owner`:
    the online stages' samples of one query)."""
    for model in models:
        if model is not None:
            inner(model).packs_sequences, inner(model).shares_prefixes = on, share_prefixes


def is_on(model) -> bool:
    return bool(getattr(inner(model), "packs_sequences", False))


def shares(model) -> bool:
    return bool(getattr(inner(model), "shares_prefixes", False))


def transformer_body(model):
    """The transformer under the head (GPTNeoXModel for Pythia), also under peft's wrapper."""
    model = inner(model)
    return (model.get_base_model() if hasattr(model, "get_base_model") else model).base_model


def without_shared_padding(query_responses: torch.Tensor, pad_id: int) -> torch.Tensor:
    """The batch without its leading columns that are padding in every row: they are masked out of
    attention and do not count in positions, so computing them changes nothing but the time."""
    first_real_column = (query_responses != pad_id).any(0).int().argmax()
    return query_responses[:, first_real_column:]


def shared_prefix_owner(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        position_ids: torch.Tensor) -> torch.Tensor:
    """owner[i, c]: a row whose columns 0..c equal row i's (tokens, mask and positions), so whose
    hidden states at column c are row i's (attention is causal), the same row for all that share
    them; i itself where no other row does. A query's k samples share
    their query, and often their first sampled tokens. Rows in lexicographic order (stable sorts,
    last column first) put every row beside the one it shares most with."""
    key = torch.where(attention_mask.bool(), input_ids.long() + 1, 0) * (int(position_ids.max()) + 1) + position_ids
    order = torch.arange(len(input_ids), device=input_ids.device)
    for column in reversed(range(input_ids.shape[1])):
        order = order[torch.sort(key[order, column], stable=True).indices]
    ranked = key[order]
    same = torch.zeros_like(ranked, dtype=torch.bool)
    same[1:] = (ranked[1:] == ranked[:-1]).int().cumprod(1).bool()
    # the row that starts each run of equal prefixes (in sorted order) computes the run's states
    starts = torch.where(same, -1, torch.arange(len(order), device=order.device)[:, None]).cummax(0).values
    owner = torch.empty_like(starts)
    owner[order] = order[starts]
    return owner


class Packed:
    """The packing of a padded batch: its real tokens (with `share_prefixes`, a prefix that rows share
    once), where each place of the batch reads its token's output, and the arguments of the packed call."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                 attention: str, share_prefixes: bool = False):
        if attention != "sdpa":
            raise ValueError(f"--packing needs sdpa attention, not {attention!r}: run with --no_packing")
        real = attention_mask.bool()
        rows = torch.arange(len(real), device=real.device)[:, None]
        owner = shared_prefix_owner(input_ids, attention_mask, position_ids) if share_prefixes else rows.expand_as(real)
        columns = torch.arange(real.shape[1], device=real.device).expand_as(real)
        own = real & (owner == rows)
        self.rows, self.columns = own.nonzero(as_tuple=True)
        computed = torch.full(real.shape, -1, dtype=torch.long, device=real.device)
        computed[self.rows, self.columns] = torch.arange(len(self.rows), device=real.device)
        self.index = torch.where(real, computed[owner, columns], -1)
        # attention: every row of the batch as a right-padded row of its real tokens' states; a
        # token's output is read at its own place (its owner row's)
        place_row, place_column = real.nonzero(as_tuple=True)
        place_position = real.cumsum(1)[place_row, place_column] - 1
        place_token = self.index[place_row, place_column]
        place = torch.full(real.shape, -1, dtype=torch.long, device=real.device)
        place[place_row, place_column] = torch.arange(len(place_row), device=real.device)
        home = place[self.rows, self.columns]
        lengths = real.sum(1)
        # (attention_mask: a placeholder that nothing reads; sdpa_or_packed reads packed_rows)
        self.kwargs = dict(position_ids=position_ids[self.rows, self.columns][None],
                           packed_rows=(place_row, place_position, place_token, home,
                                        (len(real), int(lengths.max()))),
                           attention_mask=attention_mask.new_ones(1, 1, 1, 1), use_cache=False, return_dict=True)

    def pack(self, values: torch.Tensor) -> torch.Tensor:
        return values[self.rows, self.columns][None]

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[tokens, ...], one entry per computed token -> [rows, columns, ...], zeros at padding."""
        out = packed.new_zeros(*self.index.shape, *packed.shape[1:])
        real = self.index >= 0
        out[real] = packed[self.index[real]]
        return out


@contextlib.contextmanager
def compiled_body(model):
    """Under --compile_train, the model's body runs compiled for the (packed) call."""
    body = transformer_body(model)
    compiled = getattr(body, "compiled_forward", None)
    if compiled is None:
        yield
        return
    saved = body.__dict__.get("forward")  # (a forward some wrapper set on the instance stays its own)
    body.forward = compiled
    try:
        yield
    finally:
        if saved is None:
            del body.forward  # (the class's own forward again)
        else:
            body.forward = saved


def lm_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
              logits_to_keep: int = 0) -> torch.Tensor:
    """A causal LM's logits [rows, logits_to_keep or columns, vocab] of a packed forward; the LM head
    runs on the kept real positions only; zeros where a kept position is padding."""
    packed = Packed(input_ids, attention_mask, position_ids, inner(model).config._attn_implementation, shares(model))
    kept = slice(-logits_to_keep if logits_to_keep else None, None)
    index = packed.index[:, kept]
    with compiled_body(model):
        logits = model(input_ids=packed.pack(input_ids), logits_to_keep=index[index >= 0], **packed.kwargs).logits[0]
    out = logits.new_zeros(*index.shape, logits.shape[-1])
    out[index >= 0] = logits
    return out


def token_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
    """A sequence-classification model's head (`score`) at every position [rows, columns] of a packed
    forward (read by a hook: the model's own output pools one position of the packed row); zeros at
    padding."""
    packed = Packed(input_ids, attention_mask, position_ids, inner(model).config._attn_implementation, shares(model))
    captured = []
    hook = inner(model).score.register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        with compiled_body(model):
            model(input_ids=packed.pack(input_ids), **packed.kwargs)
    finally:
        hook.remove()
    return packed.unpack(captured[0][0, :, 0])


def last_token_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
    """`token_scores` at each row's last real token [rows]: where HF's sequence-classification head
    reads a padded row (its rightmost non-pad token)."""
    last_real = attention_mask.shape[1] - 1 - attention_mask.flip(1).int().argmax(1)
    return token_scores(model, input_ids, attention_mask, position_ids).gather(1, last_real[:, None]).squeeze(1)


class CompiledForward:
    """A transformer body's forward under torch.compile (dynamic shapes), used by the packed calls.
    Every compiled call is guarded, not only the first of each grad mode: dynamo compiles again on
    a shape or mode its graphs do not cover, or after any `torch._dynamo.reset()` (the compiled
    decode's fallback makes one), and such a compile can fail as the first did. A call that raises
    gives the compiled forward up for the run: one warning with the compiler's message, dynamo
    reset (the compiled decode then compiles again, under its own guard), eager from then on."""

    def __init__(self, forward, **compile_options):
        self.eager = forward
        self.compiled = torch.compile(forward, dynamic=True, **compile_options)
        self.modes_run, self.failure = set(), None

    def __call__(self, *args, **kwargs):
        if self.failure is None:
            try:  # (the backward graph lowered with the forward, so that its errors also land here)
                with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
                    output = self.compiled(*args, **kwargs)
            except Exception as error:  # any failure of the compiler or of the toolchain it calls
                self.give_up(error)
            else:
                self.modes_run.add(torch.is_grad_enabled())
                return output
        return self.eager(*args, **kwargs)

    def give_up(self, error: Exception) -> None:
        while getattr(error, "inner_exception", None) or error.__cause__:  # dynamo wraps the compiler's error
            error = getattr(error, "inner_exception", None) or error.__cause__
        self.failure = f"{type(error).__name__}: {error}".splitlines()[0]
        torch._dynamo.reset()
        warnings.warn(f"--compile_train: the compiled training forward failed ({self.failure}); running eagerly "
                      "for the rest of the run (dynamo reset: a compiled decode compiles again, under its own guard)")


def compile_for_training(on: bool, report, *models) -> None:
    """--compile_train: the packed forwards of the trained `models` run their bodies compiled."""
    for model in models if on else ():
        if not is_on(model):
            raise ValueError("--compile_train compiles the packed forwards: it needs --packing")
        body = transformer_body(model)
        body.compiled_forward = CompiledForward(body.forward)
        report(f"compile_train: {type(body).__name__} under torch.compile (dynamic shapes; the first update pays "
               f"the compile; a compile error falls back to eager with a warning)")
