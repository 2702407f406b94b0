"""The rollout engine: batched sampling of `response_length` tokens from a causal LM.

Its contract: each `SamplingGroup` samples exactly what HF `generate` samples for that group alone,
from the same seed, temperature and suppressed ids, `[PAD]` and every id at or beyond `vocab_end`
(`len(tokenizer)`: embedding rows no token has), tested against HF generate on GPT-NeoX, GPT-2 and
a Qwen3-style model with spare rows, greedy included, with any packing of groups into batches. What
a run samples is decided by the stage: which queries form a group, at which temperature, from which
seed, which ids it suppresses. The engine only makes it fast: a prefill into a preallocated (static)
KV cache, then one token per step through the model's own forward, many groups in one batch, and on
a GPU the step under torch.compile with CUDA graphs (`CompiledStep`). Nothing here changes a result:
the engine changes no sample.
"""

import contextlib
import copy
import functools
import queue
import time
import warnings
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Optional

import torch
import transformers
from transformers import DynamicCache, StaticCache

# transformers 5.24 renamed the forward's `past_key_values=` to `cache=` and removes the old name in
# 5.40: the name this transformers takes (a name a model ignored would decode without its cache)
CACHE_KEYWORD = "cache" if tuple(map(int, transformers.__version__.split(".")[:2])) >= (5, 24) else "past_key_values"


@dataclass
class SamplingGroup:
    """Queries that sample from one generator at one temperature: a rollout chunk or a chunk of the
    update's validation queries. The seed depends on the chunk's place in the global batch only."""
    queries: torch.Tensor
    temperature: float
    seed: int


def derived_seed(*numbers: int) -> int:
    """A seed that depends only on the given integers (no per-rank state, no Python hash salt)."""
    seed = 0
    for n in numbers:
        seed = (seed * 1_000_003 + int(n)) % (2 ** 61 - 1)
    return seed


@dataclass
class RolloutChunks:
    """An update's rollout queries as sampling groups: chunks of `chunk` queries, each sampled `samples`
    times (RLOO's k, online DPO's pair; None: once, PPO), sample j of the chunk at global row r (this
    process's rows start at `first_row`) from a seed of (seed, 0, update, r[, j]): the noise depends on
    the place in the global batch only, so any process count samples the same."""
    temperature: float
    seed: int
    first_row: int
    chunk: int
    samples: Optional[int] = None

    def groups(self, batch: Optional[dict], update: int) -> list:
        """The groups of `batch["query_token"]`, chunk-major, sample-minor; none for no batch (the update
        after the last, which `with_next` pairs with the last)."""
        if batch is None:
            return []
        queries = batch["query_token"]
        return [SamplingGroup(queries[i: i + self.chunk], self.temperature,
                              derived_seed(self.seed, 0, update, self.first_row + i, *([] if self.samples is None
                                                                                       else [sample])))
                for i in range(0, len(queries), self.chunk) for sample in range(self.samples or 1)]


def chunk_batches(groups: list, generated: list, samples: int) -> list:
    """(queries, responses, logprobs) of each rollout chunk's `samples` groups as one batch, rows sample-major:
    a scoring forward holds a query's samples together (packing's shared prefixes: its query once)."""
    return [(torch.cat([group.queries for group in groups[i: i + samples]]),
             *(torch.cat(part) for part in zip(*generated[i: i + samples])))
            for i in range(0, len(groups), samples)]


def with_next(batches: Iterator) -> Iterator[tuple]:
    """(batch, the next batch or None): the overlapped sampler (`--async_worker`) takes the next update's
    queries one update early; the batches and their order are those of `batches`."""
    current = next(batches, None)
    while current is not None:
        following = next(batches, None)
        yield current, following
        current = following


def left_pad_batch(queries: torch.Tensor, width: int, pad_id: int) -> torch.Tensor:
    return torch.nn.functional.pad(queries, (width - queries.shape[1], 0), value=pad_id)


class CompiledStep:
    """The one-token decode step of `model` under torch.compile (on a GPU with CUDA graphs, where a
    small model's step is mostly kernel launches). The captured graph is specialised to the cache
    tensors it writes, so the static KV cache of each batch shape is kept and reset per decode, and
    every step gets the full-length attention mask: all steps of a shape share one graph (the causal
    mask hides the cache slots not yet written). `decode_in_batches` pads its batches to one shape,
    so a run holds one cache; `report` (a print) says how many bytes when it is allocated. With
    `keep_caches=False` they are freed after each `decode_in_batches` (for the PPO epochs' memory;
    the next rollout allocates new ones, and CUDA graphs record again). The weights are read at each
    call: the optimizer's in-place updates reach the next decode. Any compiled decode that raises (a
    batch shape's first, or one compiled again after a dynamo reset) gives the step up for the run
    (`give_up`; `decode` then runs eagerly)."""

    def __init__(self, model, report=print, keep_caches: bool = True, **compile_options):
        self.forward = torch.compile(model, fullgraph=True, dynamic=False, **compile_options)
        self.report, self.keep_caches = report, keep_caches
        self.caches = {}
        self.shapes_run = set()  # batch shapes whose compiled decode has completed
        self.failure = None  # why the compiled step was given up

    def cache(self, model, rows: int, length: int) -> StaticCache:
        if (rows, length) not in self.caches:
            self.caches[rows, length] = StaticCache(config=model.config, max_cache_len=length)
            size = static_cache_bytes(model.config, rows, length, next(model.parameters()).dtype) / 2 ** 30
            if (rows, length) not in self.shapes_run:  # (once per shape, also where caches are freed each time)
                self.report(f"decode: a static KV cache of {rows} rows x {length} positions, {size:.2f} GiB, "
                            f"{'held for the run' if self.keep_caches else 'freed after each rollout'}")
        cache = self.caches[rows, length]
        cache.reset()
        return cache

    def counters(self) -> dict:
        """decode/ metrics: graphs compiled and CUDA graphs skipped so far (dynamo's process-wide
        counters), batch shapes decoded, and whether the step was given up."""
        from torch._dynamo.utils import counters

        return {"decode/graphs": counters["stats"]["unique_graphs"],
                "decode/cudagraph_skips": counters["inductor"]["cudagraph_skips"],
                "decode/shapes": len(self.shapes_run), "decode/given_up": float(self.failure is not None)}

    def release(self) -> None:
        """Frees the caches (the next decode allocates new ones)."""
        self.caches.clear()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def give_up(self, error: Exception) -> None:
        """After a failed compiled decode (on a GPU node without the C compiler, Python headers or
        libcuda that Triton needs at first use, say): dynamo's state reset (a compiled training
        forward then compiles again, under its own guard), the caches freed, and one warning that
        says why."""
        while getattr(error, "inner_exception", None) or error.__cause__:  # dynamo wraps the compiler's error
            error = getattr(error, "inner_exception", None) or error.__cause__
        message = str(error).strip().splitlines()
        self.failure = f"{type(error).__name__}: {message[0][:300] if message else ''}"
        self.caches.clear()
        torch._dynamo.reset()
        warnings.warn(f"the compiled decode step failed ({self.failure}); decoding eagerly from here on, which "
                      "samples the same tokens, more slowly (dynamo reset: a compiled training forward compiles "
                      "again, under its own guard)", RuntimeWarning, stacklevel=3)


def decode_path(compile_decode: bool, device: torch.device, autocast: bool) -> tuple:
    """(whether the run decodes with a `CompiledStep`, why): printed at start-up."""
    if not compile_decode:
        return False, "eager (--no-compile_decode)"
    if device.type != "cuda":
        return False, "eager (CUDA graphs need a GPU)"
    if autocast:
        return False, ("eager (mixed precision by autocast over fp32 weights: keys and values in two dtypes need "
                       "a growing KV cache, which a CUDA graph cannot hold)")
    return True, ("torch.compile with CUDA graphs, one graph per batch shape (the first update pays the compile; "
                  "a compile error falls back to eager with a warning)")


def compiled_step_for(model, compile_decode: bool, device: torch.device, autocast: bool, report=print,
                      keep_caches: bool = True) -> Optional[CompiledStep]:
    """The run's decode step: a `CompiledStep` of `model` (CUDA graphs, mode reduce-overhead) where
    `decode_path` says one serves, else None (eager); `report` says which and why."""
    use, why = decode_path(compile_decode, device, autocast)
    report(f"decode: {why}")
    return CompiledStep(model, report, keep_caches, mode="reduce-overhead") if use else None


@torch.no_grad()
def decode(model, groups: list, pad_id: int, vocab_end: int, response_length: int,
           compiled_step: Optional[CompiledStep] = None) -> list:
    """`sample_batch` with `compiled_step`'s compiled forward where it can serve: not under autocast
    (which needs a growing cache), not after it was given up. Every compiled decode falls back to
    the eager one on any error (`give_up`): compilation happens at a batch shape's first decode and
    again after any dynamo reset."""
    if compiled_step is None or compiled_step.failure is not None or torch.is_autocast_enabled(
            groups[0].queries.device.type):
        return sample_batch(model, groups, pad_id, vocab_end, response_length)
    shape = (sum(len(g.queries) for g in groups), max(g.queries.shape[1] for g in groups) + response_length)
    try:  # (every call: a shape that ran compiles again after a dynamo reset, as compile_train's fallback makes)
        results = sample_batch(model, groups, pad_id, vocab_end, response_length, compiled_step)
    except Exception as error:  # any failure of the compiler or of the toolchain it calls
        compiled_step.give_up(error)
        return sample_batch(model, groups, pad_id, vocab_end, response_length)
    compiled_step.shapes_run.add(shape)
    return results


@torch.no_grad()
def sample_batch(model, groups: list, pad_id: int, vocab_end: int, response_length: int,
                 compiled_step: Optional[CompiledStep] = None) -> list:
    """Samples `response_length` tokens for every group in one batch: a prefill of the left-padded
    queries into a preallocated (static) KV cache, then one token per step through the model's own
    forward (`compiled_step`'s compiled one if given). Returns (responses, logprobs) per group;
    logprobs are those of the sampled tokens under the distribution they were drawn from, fp32
    logits / (T + 1e-7) with `[PAD]` and the ids at or beyond `vocab_end` at -inf: what
    `scaled_logits` computes in the training forward (so the first PPO ratio is 1 up to float noise)
    and exactly HF generate's processed scores with those ids in `suppress_tokens`. Each
    group draws with torch.multinomial from its own generator, as HF generate does from the global
    one: a group samples what HF generate would sample for it alone under torch.manual_seed(seed),
    whatever else shares the batch."""
    device = groups[0].queries.device
    width = max(g.queries.shape[1] for g in groups)
    queries = torch.cat([left_pad_batch(g.queries, width, pad_id) for g in groups])
    sizes = [len(g.queries) for g in groups]
    temperature = torch.tensor([g.temperature for g in groups for _ in range(len(g.queries))], device=device)
    generators = [torch.Generator(device).manual_seed(g.seed) for g in groups]
    query_mask = queries != pad_id
    # the attention mask of the finished sequences: every generated token is real
    attention_mask = torch.cat([query_mask, query_mask.new_ones(len(queries), response_length)], 1)
    positions = (query_mask.cumsum(1) - 1).clamp(min=0)
    step_forward = model
    # preallocated; under autocast over fp32 weights (mixed precision without DeepSpeed) keys and
    # values come out in different dtypes, which only a growing cache takes (torch.cat promotes)
    if torch.is_autocast_enabled(device.type):
        cache = DynamicCache(config=model.config)
    elif compiled_step is not None:
        cache = compiled_step.cache(model, len(queries), width + response_length)
        step_forward = compiled_step.forward
    else:
        cache = StaticCache(config=model.config, max_cache_len=width + response_length)
    last_logits = prefill(model, queries, query_mask, positions, cache)
    filled = int(cache.get_seq_length())  # (a cache the model did not take would leave every step blind)
    if filled != width:
        raise RuntimeError(f"{type(model).__name__} did not fill the KV cache in the prefill ({filled} of {width} "
                           f"positions): this transformers {transformers.__version__} does not take `{CACHE_KEYWORD}=`")
    tokens, logprobs = [], []
    for step in range(response_length):
        # a copy: a CUDA graph's output buffer is overwritten by its next replay
        scores = (last_logits if step == 0 else output.logits[:, -1]).to(torch.float32, copy=True)
        # never sampled: [PAD], and the embedding rows past the tokenizer (Qwen2.5/3: 270 beside the [PAD]
        # the loader adds, Pythia 26), which decode to '' and which RL can make likely (NeMo-RL#237)
        scores[:, pad_id] = float("-inf")
        scores[:, vocab_end:] = float("-inf")
        scores = scores / (temperature[:, None] + 1e-7)
        probs = torch.softmax(scores, -1)
        token = torch.cat([torch.multinomial(rows, 1, generator=generator)
                           for rows, generator in zip(probs.split(sizes), generators)])
        tokens.append(token)
        logprobs.append(scores.gather(1, token) - torch.logsumexp(scores, -1, keepdim=True))
        if step + 1 < response_length:
            # a static cache is read in full, so the full mask serves every step (one shape to compile)
            mask = attention_mask if isinstance(cache, StaticCache) else attention_mask[:, :width + step + 1]
            if step_forward is not model:
                torch.compiler.cudagraph_mark_step_begin()
            output = step_forward(input_ids=token, attention_mask=mask, position_ids=positions[:, -1:] + step + 1,
                                  use_cache=True, **{CACHE_KEYWORD: cache})
    return list(zip(torch.cat(tokens, 1).split(sizes), torch.cat(logprobs, 1).split(sizes)))


def prefill(model, queries: torch.Tensor, query_mask: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
    """The left-padded queries' keys and values into `cache`; returns each row's last logits. A query that several
    rows hold (RLOO's k samples, online DPO's pair) runs once, its keys and values copied into each of its rows."""
    unique, inverse = torch.unique(queries, dim=0, return_inverse=True)
    shared = len(unique) < len(queries)
    if shared:  # (a row of each distinct query: any of its rows, they are equal)
        one_row = inverse.new_empty(len(unique)).scatter_(0, inverse, torch.arange(len(queries), device=inverse.device))
        queries, query_mask, positions = queries[one_row], query_mask[one_row], positions[one_row]
    once = DynamicCache(config=model.config) if shared else cache
    output = model(input_ids=queries.masked_fill(~query_mask, 0), attention_mask=query_mask, position_ids=positions,
                   use_cache=True, logits_to_keep=1, **{CACHE_KEYWORD: once})
    for index, layer in enumerate(once.layers if shared else ()):
        cache.update(layer.keys[inverse], layer.values[inverse], index)
    return output.logits[inverse if shared else slice(None), -1]


def static_cache_bytes(config, rows: int, length: int, dtype: torch.dtype) -> int:
    """Bytes of a static KV cache: keys and values of every layer for `rows` x `length` positions."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * rows * heads * length * head_dim * dtype.itemsize


def decode_in_batches(model, groups: list, pad_id: int, vocab_end: int, response_length: int, batch_size: int,
                      compiled_step: Optional[CompiledStep] = None) -> list:
    """`decode` over consecutive groups packed whole into batches of at most `batch_size` rows (a
    group larger than that alone): a memory knob that changes no sample. With `compiled_step`, a
    smaller batch is filled up to the largest one's rows with copies of its first query (drawn from
    a generator of their own and dropped), so that one batch shape, one graph and one static cache
    serve every batch."""
    batches, batch = [], []
    for group in groups:
        if batch and sum(len(g.queries) for g in batch) + len(group.queries) > batch_size:
            batches.append(batch)
            batch = []
        batch.append(group)
    batches.append(batch)
    rows = max(sum(len(g.queries) for g in batch) for batch in batches)
    results = []
    for batch in batches:
        filler = rows - sum(len(g.queries) for g in batch) if compiled_step is not None else 0
        filled = batch + [SamplingGroup(batch[0].queries[:1].repeat(filler, 1), 1.0, 0)] if filler else batch
        results += decode(model, filled, pad_id, vocab_end, response_length, compiled_step)[:len(batch)]
    if compiled_step is not None and not compiled_step.keep_caches:
        compiled_step.release()
    return results


class StalePolicy:
    """The sampler of an asynchronous run (`--async_steps N`): the rollouts trained on at update t are
    sampled by the policy of update max(1, t - N) (the first N updates sample with the initial policy,
    as a generator that starts with the learner does). It holds the trained parameters at the start of
    the last N + 1 updates (on the CPU, oldest first; a LoRA run's adapters only) and lends the oldest
    to the policy itself for the decode (`weights`), so the decode runs the policy's own modules (and
    compiled step) and the policy gets its own weights back bit for bit. N = 0 holds nothing and
    changes nothing: the synchronous loop. What it holds is part of the checkpoint (`state_dict`).
    With `worker_device`, a `SamplerWorker` samples the rollouts beside the learner (overlapped mode)."""

    def __init__(self, policy, async_steps: int, worker_device: Optional[str] = None, worker_threads: int = 1):
        if async_steps < 0:
            raise ValueError(f"--async_steps {async_steps}: the rollouts' age in updates cannot be negative")
        if worker_device is not None and not async_steps:
            raise ValueError(f"--async_worker {worker_device} needs --async_steps >= 1: at 0 the rollouts of an update "
                             "are sampled by its own policy, which exists only once the previous update has trained")
        self.policy, self.async_steps = policy, async_steps
        self.snapshots = deque()
        self.worker = SamplerWorker(policy, worker_device, worker_threads) if worker_device is not None else None

    def trained(self) -> dict:
        return {name: p for name, p in self.policy.named_parameters() if p.requires_grad}

    def start_update(self) -> None:
        """At the start of an update, before its decode: keeps the policy's weights of this update."""
        if self.async_steps:
            self.snapshots.append({name: p.detach().to("cpu", copy=True) for name, p in self.trained().items()})
            if len(self.snapshots) > self.async_steps + 1:
                self.snapshots.popleft()

    def staleness(self) -> int:
        """How many updates old the sampler's weights are (< N in the first N updates)."""
        return len(self.snapshots) - 1 if self.async_steps else 0

    def next_weights(self) -> dict:
        """During update t, the weights that sample update t + 1's rollouts: those of update max(1, t + 1 - N)."""
        return self.snapshots[max(0, len(self.snapshots) - self.async_steps)]

    @contextlib.contextmanager
    @torch.no_grad()
    def weights(self):
        """Inside the block the policy holds the sampler's weights; after it, its own again."""
        if not self.staleness():
            yield self.policy
            return
        trained = self.trained()
        own = {name: p.detach().to("cpu", copy=True) for name, p in trained.items()}
        for name, p in trained.items():
            p.copy_(self.snapshots[0][name])
        try:
            yield self.policy
        finally:
            for name, p in trained.items():
                p.copy_(own[name])

    def state_dict(self) -> dict:
        return {"async_steps": self.async_steps, "snapshots": list(self.snapshots)}

    def load_state_dict(self, state: dict) -> None:
        self.async_steps, self.snapshots = state["async_steps"], deque(state["snapshots"])


class SamplerWorker:
    """The overlapped mode of `--async_steps` (`--async_worker DEVICE`): a process of its own
    (torch.multiprocessing, spawned) holding a copy of the policy on DEVICE (on a CPU, `threads` threads:
    cores of its own), which samples update t + 1's rollouts while the learner trains update t. Each job
    carries the weights that sample it (CPU tensors, passed in shared memory), the sampling groups and
    the decode options: the worker runs `decode_in_batches` on what the learner would decode, so it
    samples the same tokens wherever the two run the same arithmetic (one thread each on a CPU)."""

    def __init__(self, policy, device: str, threads: int):
        context = torch.multiprocessing.get_context("spawn")
        self.jobs, self.results = context.Queue(), context.Queue()
        self.process = context.Process(target=serve_samples, daemon=True, args=(
            copy.deepcopy(policy).to("cpu"), device, threads, self.jobs, self.results))
        self.process.start()
        weakref.finalize(self, stop_worker, self.jobs, self.process)
        self.pending = None  # (seeds, device) of the submitted job
        self.seconds = self.waited = None  # the last job's decode seconds, and how long the learner waited for it

    def submit(self, weights: dict, groups: Sequence, options: dict, compile_decode: bool) -> None:
        """A job: `groups` sampled with `weights`, `decode_in_batches`' `options`, the learner's autocast
        and (where it serves on the worker's device) a compiled decode step if the learner has one."""
        device = groups[0].queries.device
        autocast = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
        self.jobs.put((weights, [SamplingGroup(g.queries.to("cpu", copy=True), g.temperature, g.seed) for g in groups],
                       options, autocast, compile_decode))
        self.pending = [g.seed for g in groups], device

    def take(self, groups: Sequence) -> Optional[list]:
        """The submitted job's samples on the learner's device (None when none is pending); the job must
        be `groups`' (the seeds say which update and chunk a group is)."""
        self.seconds = self.waited = None
        if self.pending is None:
            return None
        (seeds, device), self.pending = self.pending, None
        if seeds != [g.seed for g in groups]:
            raise RuntimeError("the sampler worker was given other rollout groups than the update trains on")
        start = time.perf_counter()
        while True:
            try:
                answer = self.results.get(timeout=5)
                break
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(f"the sampler worker died (exit code {self.process.exitcode})") from None
        self.waited = time.perf_counter() - start
        if isinstance(answer, BaseException):
            raise RuntimeError("the sampler worker failed") from answer
        samples, self.seconds = answer
        return [(response.to(device), logprob.to(device)) for response, logprob in samples]


def serve_samples(policy, device: str, threads: int, jobs, results) -> None:
    """The sampler worker's loop: a job (`SamplerWorker.submit`'s) in, (samples, decode seconds) or the
    exception out; None ends it."""
    torch.set_num_threads(threads)
    policy, device = policy.to(device).eval(), torch.device(device)
    parameters, compiled_steps = dict(policy.named_parameters()), {}
    while (job := jobs.get()) is not None:
        weights, groups, options, autocast, compile_decode = job
        try:
            start = time.perf_counter()
            with torch.no_grad():
                for name, value in weights.items():
                    parameters[name].copy_(value)
            if autocast not in compiled_steps:  # (the learner's decode path, built at the first job)
                compiled_steps[autocast] = compiled_step_for(policy, compile_decode, device, autocast is not None,
                                                             report=lambda _: None)
            with torch.autocast(device.type, autocast or torch.float32, enabled=autocast is not None):
                groups = [SamplingGroup(g.queries.to(device), g.temperature, g.seed) for g in groups]
                samples = decode_in_batches(policy, groups, **options, compiled_step=compiled_steps[autocast])
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            results.put(([(r.cpu(), lp.cpu()) for r, lp in samples], time.perf_counter() - start))
        except Exception as error:
            results.put(error)


def stop_worker(jobs, process) -> None:
    if process.is_alive():
        jobs.put(None)
        process.join(timeout=30)
    if process.is_alive():
        process.kill()


def decode_update(policy, stale: StalePolicy, validation_groups: list, rollout_groups: list, pad_id: int,
                  vocab_end: int, response_length: int, batch_size: int,
                  compiled_step: Optional[CompiledStep] = None, next_rollout_groups: Sequence = ()) -> tuple:
    """An update's decodes: (the validation groups' samples, the rollout groups'). The validation
    queries are always sampled by the learner's policy (its score now); the rollouts by `stale`'s
    weights. Synchronously (N = 0) both go through one `decode_in_batches`, as they always did.
    With `stale`'s worker (overlapped), the rollouts are those the worker sampled while the previous
    update trained (decoded here when none is pending: the first update, a resumed run's first), and
    `next_rollout_groups`, the next update's, go to the worker before the validation decode."""
    options = dict(pad_id=pad_id, vocab_end=vocab_end, response_length=response_length, batch_size=batch_size)
    decode_groups = functools.partial(decode_in_batches, **options, compiled_step=compiled_step)
    rollouts = stale.worker.take(rollout_groups) if stale.worker is not None else None
    if stale.worker is not None and next_rollout_groups:
        stale.worker.submit(stale.next_weights(), next_rollout_groups, options, compiled_step is not None)
    if rollouts is None and not stale.staleness():
        generated = decode_groups(policy, validation_groups + rollout_groups)
        return generated[:len(validation_groups)], generated[len(validation_groups):]
    if rollouts is None:
        with stale.weights() as sampler:
            rollouts = decode_groups(sampler, rollout_groups)
    return decode_groups(policy, validation_groups), rollouts


def staleness_metrics(stale: StalePolicy, log_ratios: torch.Tensor, mask: Optional[torch.Tensor] = None,
                      unit: str = "token") -> dict:
    """async/ metrics of an asynchronous run (none in a synchronous one): how many updates old the
    rollouts' sampler was, and the importance ratio learner / sampler that a stale sample carries, of
    each sampled `unit` (token or sequence; `mask`: the real ones, all if None): its mean, spread and
    extremes. Overlapped, where the worker sampled this update's rollouts: its decode seconds, how long
    the learner waited for them and the fraction of the decode hidden behind the learner's work."""
    if not stale.async_steps:
        return {}
    ratios = (log_ratios if mask is None else log_ratios[mask]).double().exp()
    metrics = {"async/staleness": stale.staleness(), f"async/{unit}_ratio_mean": ratios.mean().item(),
               f"async/{unit}_ratio_std": ratios.std().item() if len(ratios) > 1 else 0.0,
               f"async/{unit}_ratio_min": ratios.min().item(), f"async/{unit}_ratio_max": ratios.max().item()}
    worker = stale.worker
    if worker is not None and worker.seconds is not None:  # (rollouts the worker sampled behind the last update)
        metrics |= {"async/worker_generation_seconds": worker.seconds, "async/worker_wait_seconds": worker.waited,
                    "async/worker_hidden_fraction": max(0.0, 1 - worker.waited / worker.seconds)}
    return metrics
