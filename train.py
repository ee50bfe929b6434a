"""'GRPO' on GSM8K or a CPU task, with a sampler of other numerics than the trainer's.

    python train.py --center                       # Qwen3-0.6B on GSM8K, score-centred
    python train.py --compare --out runs/gsm8k     # centring off, then on: same seed and noise
    python train.py --task sequence --compare      # what drift costs, on a CPU: 1 to 3 min
    python train.py --task chain --compare         # GSM8K's shape: one reward after a long answer

What it is: REINFORCE with a group-mean baseline, whose rollouts come from a copy of the policy that
runs with other numerics (bf16 / int8 / fp8 weights, int8 / int4 / fp8 KV cache, fixed weight noise,
staleness), trained with `score_centering.loss`. How it differs from textbook GRPO, and why:
- no KL penalty to a reference model: it would pull toward the start and hide the drift under study;
- no PPO clipping unless --correction asks: one step a batch, so only the sampler is off-policy;
- a token mean over the whole batch, not a mean of per-sequence means (score_centering.py, step 8);
- advantages are rewards minus the group mean, not divided by the group's std (the paper's recipe);
- plain SGD at a constant learning rate on float32 master weights (the paper's; Adam: --optimizer).

In order: the sampler and its mismatch, the train step, the GRPO loop, one run, main (the tasks:
lab/tasks.py; flags, logs, resumable state: lab/harness.py). Shapes: P prompts a step, G rollouts
a prompt, B = P·G rows, T positions, T0 prompt length, M completion length, V vocabulary, k the
top-k head size, D model width, L layers, K key/value heads, H head dimension.
"""

import math
import time
from collections import namedtuple
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import score_centering as sc
from lab import compare, harness, hf_checkpoint, lora, plan, rollouts, tasks
from lab.devices import host, shardings
from lab.models import INPUT_AXES, model  # the weights' input axes; the model cfg names

TEMPERATURE = 1.0  # q's and p's (completion_logits divides by it too); log q recorded after it
# the sampler's compute dtype (int8, fp8: bf16 holding fake-quantised values); float32: trainer's
SAMPLER_DTYPES = dict(float32=jnp.float32, bf16=jnp.bfloat16, int8=jnp.bfloat16, fp8=jnp.bfloat16)
STATE_DTYPES = dict(bf16=jnp.bfloat16, fp16=jnp.float16)  # --state-dtype: Qwen3.5's, not float32

# -------------------------------------------------------------------------------------------------
# The sampler: a copy of the weights in its own numerics; KV-cache decoding that records q


QMAX = dict(int8=127.0, int4=7.0, fp8=448.0)  # the symmetric range's top: a scale maps |x| here


def fake_quant(x, axes, kind):  # symmetric, one scale per slice reduced over `axes`
    x32, qmax = x.astype(jnp.float32), QMAX[kind]
    scale = jnp.maximum(jnp.abs(x32).max(axes, keepdims=True), 1e-12) / qmax
    levels = x32 / scale  # in the format's range, then rounded to a value it holds
    levels = levels.astype(jnp.float8_e4m3fn) if kind == "fp8" else jnp.round(levels)
    return (levels.astype(jnp.float32) * scale).astype(x.dtype)


def kv_quant(kind):
    """fn(keys or values [B, T, K, H]) -> them as a quantised cache holds them (int8, int4: a scale
    per token and head; fp8: e4m3 at unit scale, saturating); None: a plain cache."""

    def fp8(a):
        return jnp.clip(a.astype(jnp.float32), -448, 448).astype(jnp.float8_e4m3fn).astype(a.dtype)

    per_head = {k: partial(fake_quant, axes=(3,), kind=k) for k in ("int8", "int4")}
    return dict(per_head, fp8=fp8).get(kind)


@partial(jax.jit, static_argnums=(1, 2))
def sampler_weights(w, kind, sigma=0.0, key=None):
    """w ⊙ (1 + σε) in the kind's SAMPLER_DTYPES, ε a standard normal draw from `key` (one key per
    weight): the same at each refresh, a persistent bias; kind int8 or fp8 fake-quantises every
    matmul weight per output channel, the embedding and the output head included (W8A8's W8)."""
    if sigma:
        leaves, tree = jax.tree.flatten(w)
        keys = tree.unflatten(list(jax.random.split(key, len(leaves))))  # a key a weight
        w = jax.tree.map(lambda x, key: x * (1 + sigma * jax.random.normal(key, x.shape)), w, keys)

    def quant(path, x):  # a weight at the top or in a stack of layers, by its name
        name = path[-1].key
        return fake_quant(x, INPUT_AXES[name], kind) if name in INPUT_AXES else x

    if kind in QMAX:
        w = jax.tree_util.tree_map_with_path(quant, w)
    return jax.tree.map(lambda x: x.astype(SAMPLER_DTYPES[kind]), w)


def quant_mm(kind):  # W8A8: the activation is fake-quantised per token (over the contracted axes)
    def mm(spec, x, w):  # spec "btd,dnh->btnh": x's letters, w's, then the output's
        x_axes, out = spec.split(",")[0], spec.split("->")[1]
        # the axes of x the einsum sums over (here d): one scale per (b, t), i.e. per token
        per_token = tuple(i for i, c in enumerate(x_axes) if c not in out)
        return jnp.einsum(spec, fake_quant(x, per_token, kind), w)

    return mm if kind in QMAX else jnp.einsum


# the decode loop's state: step i, the logits predicting token i, KV cache, rows ended, record, key
Decoding = namedtuple("Decoding", "i logits cache done out key")


def make_sampler(cfg, max_tokens, topk, eos_ids, numerics=None, greedy=False, group=1):
    """fn(weights, prompt [B, T0], pos [B, T0], key) -> dict of tokens, logq, mask [B, M] and the
    head: head_ids, head_logq [B, M, k], log q after temperature, normalised over all V (topk 0:
    the full [B, M, V] log q, no ids). Prefills once, then decodes a token a step until every row
    has ended its turn, or M. numerics: forward's mm (quant_mm), dtype (SAMPLER_DTYPES), kv_quant,
    and Qwen3.5's state_dtype. group: the rows come in runs of `group` copies of one prompt, each
    run prefilled once. The model (qwen3.py or qwen3_5.py) is the one cfg names."""
    numerics = dict(dtype=SAMPLER_DTYPES["bf16"]) | (numerics or {})
    fwd, eos = partial(model(cfg).forward, cfg, **numerics), jnp.array(eos_ids)

    def sample(w, prompt, pos, key):
        B, T0 = prompt.shape
        M, k = max_tokens, topk or cfg["vocab_size"]

        # prefill: each run's prompt into the KV cache once, then copied to its rows; last=1: the
        # last position's logits alone, [B / group, 1, V], which predict token 0
        cache = model(cfg).init_kv(cfg, B // group, T0 + M, numerics["dtype"])
        logits, cache = fwd(w, prompt[::group], pos[::group], cache, 0, last=1)

        # each cache entry holds its rows on axis 1, after a layer axis; pos [B, S] on axis 0
        cache = {name: jnp.repeat(x, group, 0 if name == "pos" else 1) for name, x in cache.items()}
        logits = jnp.repeat(logits, group, 0)  # [B, 1, V]

        # decode: a token a step, drawn from q and recorded with log q and the head of q
        def body(state):
            i, logits, cache, done, out, key = state  # a Decoding
            key, k_sample = jax.random.split(key)
            logq = jax.nn.log_softmax(logits[:, -1] / TEMPERATURE)  # [B, V]
            y = jnp.argmax(logq, -1) if greedy else rollouts.categorical(k_sample, logq)  # [B]
            logq_y = jnp.take_along_axis(logq, y[:, None], -1)[:, 0]
            rec = dict(tokens=y, logq=logq_y, mask=~done, head_logq=logq)  # mask: EOS included
            if topk:
                rec["head_logq"], rec["head_ids"] = jax.lax.top_k(logq, topk)
            out = {name: x.at[i].set(rec[name]) for name, x in out.items()}
            # token i at the position one past the prompt's last + i, in cache slot T0 + i
            logits, cache = fwd(w, y[:, None].astype(jnp.int32), pos[:, -1:] + 1 + i, cache, T0 + i)
            return Decoding(i + 1, logits, cache, done | jnp.isin(y, eos), out, key)

        def running(state):  # until M tokens, or every row has ended its turn
            return (state.i < M) & ~state.done.all()

        out = dict(  # [M, B, ...]: each step writes one contiguous slab
            tokens=jnp.zeros((M, B), jnp.int32),
            logq=jnp.zeros((M, B)),
            mask=jnp.zeros((M, B), bool),
            head_logq=jnp.zeros((M, B, k)),
        )
        if topk:
            out["head_ids"] = jnp.zeros((M, B, k), jnp.int32)
        start = Decoding(0, logits, cache, jnp.zeros(B, bool), out, key)
        out = jax.lax.while_loop(running, body, start).out
        return {name: x.swapaxes(0, 1) for name, x in out.items()}  # [B, M, ...]

    return jax.jit(sample)


# -------------------------------------------------------------------------------------------------
# The train step: float32 logits, score_centering.loss, FSDP, optionally LoRA adapters


def completion_logits(cfg, w, prompt, pos, tokens, mm=jnp.einsum, group=1):
    """The trainer's float32 logits [B, M, V] at the positions that predict tokens [B, M].
    group: rows come in runs of `group` copies of a prompt (unchecked); a run's first row runs once,
    as the sampler's prefill (taken by a reshape: [::group] hung XLA's CPU collectives), its cache
    (K, V; Qwen3.5 conv window, state) repeated to its rows, repeat's backward summing gradients."""
    (B, T0), M = prompt.shape, tokens.shape[1]
    fwd = partial(model(cfg).forward, cfg, w, mm=mm)
    with jax.default_matmul_precision("highest"):  # a float32 trainer, not TF32 or bf16 passes
        cache = model(cfg).init_kv(cfg, B // group, T0 + M)
        runs = [x.reshape(B // group, group, T0)[:, 0] for x in (prompt, pos)]  # a run's first row
        first, cache = fwd(*runs, cache, 0, last=1)  # predicts token 0
        cache = {name: jnp.repeat(x, group, 0 if name == "pos" else 1) for name, x in cache.items()}
        rest, _ = fwd(tokens, pos[:, -1:] + 1 + jnp.arange(M)[None, :], cache, T0)
    # cache slot T0 - 1 + t predicts token t: `first` for t = 0, then rest[:, t - 1] (not its last)
    return jnp.concatenate([jnp.repeat(first, group, 0), rest[:, :-1]], 1) / TEMPERATURE


def advantage(rewards, group, baseline):  # [..., B] -> [..., B]: minus its group's mean, or raw
    if baseline == "none":
        return rewards
    means = rewards.reshape(*rewards.shape[:-1], -1, group).mean(-1)  # [..., P]
    return rewards - means.repeat(group, -1)


def make_train_step(cfg, opt, micro_batch, mesh, center, correction=None, lora_scale=None, group=1):
    """fn(params, opt_state, batch, base=None) -> (params, opt_state, metrics); params: weights, or
    LoRA adapters on the frozen `base`; batch: the sampler's record, prompt, pos [B, T0], adv [B],
    its rows in runs of `group` copies of a prompt. Gradients accumulate over micro-batches split
    over the devices, the loss a token mean over the batch; weights and optimizer state split as
    `shardings` says (LoRA adapters: whole)."""
    flags = dict(center=center, correction=correction)  # all that --center changes: a keyword
    g = math.gcd(group, micro_batch // mesh.size)  # rows a prefill serves: all on one device

    def token_sum_loss(params, base, b):
        w = params if base is None else lora.attach(params, base)  # LoRA: W and its adapters
        mm = lora.matmul(lora_scale)  # x W + scale · (x lora_a) lora_b, never merged
        logits = completion_logits(cfg, w, b["prompt"], b["pos"], b["tokens"], mm, g)
        head = b["head_logq"], b.get("head_ids")  # the sampler's top-k log q and ids (topk 0: none)
        loss, metrics = sc.loss(logits, b["tokens"], b["mask"], b["adv"], b["logq"], *head, **flags)
        return loss * b["mask"].sum(), (metrics, b["mask"].sum())  # the token mean, back to a sum

    # [B, ...] -> [mb/g, passes, g] -> [passes, mb]: pass j takes run j of g rows from each of mb/g
    # contiguous blocks, so no row changes device (B 8, g 2, mb 4: rows 0, 1, 4, 5; then 2, 3, 6, 7)
    def micro_batches(x):
        x = x.reshape(micro_batch // g, -1, g, *x.shape[1:]).swapaxes(0, 1)
        x = x.reshape(-1, micro_batch, *x.shape[3:])
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, PartitionSpec(None, "data")))

    def step(params, opt_state, batch, base=None):
        def keep(tree):  # FSDP shards (LoRA adapters: whole), outputs as inputs came: one compile
            where = shardings(tree, mesh) if base is None else NamedSharding(mesh, PartitionSpec())
            return jax.lax.with_sharding_constraint(tree, where)

        def accumulate(grads, b):
            loss_grad = jax.value_and_grad(token_sum_loss, has_aux=True)
            (loss, (metrics, tokens)), dg = loss_grad(params, base, b)
            return keep(jax.tree.map(jnp.add, grads, dg)), (loss, metrics, tokens)

        # gradients: token sums over the micro-batches, divided by the batch's trained tokens
        zeros = keep(jax.tree.map(jnp.zeros_like, params))
        parts = jax.tree.map(micro_batches, batch)
        grads, (loss, metrics, tokens) = jax.lax.scan(accumulate, zeros, parts)  # tokens a pass
        n_tokens = jnp.maximum(tokens.sum(), 1)
        grads = jax.tree.map(lambda dg: dg / n_tokens, grads)

        # the optimizer's update, and the metrics' token means over the batch (a _max: the largest)
        updates, new_state = opt.update(grads, opt_state, params)
        new = optax.apply_updates(params, updates)
        metrics = {
            k: x.max() if k.endswith("_max") else (x * tokens).sum() / n_tokens
            for k, x in metrics.items()
        }
        metrics |= dict(loss=loss.sum() / n_tokens, grad_norm=optax.tree.norm(grads))

        # a loss, gradient or weight that is not finite: the update is skipped, the run told
        leaves = jax.tree.leaves((metrics["loss"], grads, new))
        finite = jnp.all(jnp.stack([jnp.isfinite(x).all() for x in leaves]))
        choose = partial(jnp.where, finite)
        new, new_state = jax.tree.map(choose, (new, new_state), (params, opt_state))
        return *keep((new, new_state)), metrics | dict(finite=finite)

    return jax.jit(step, donate_argnums=(0, 1))


# -------------------------------------------------------------------------------------------------
# The GRPO loop: sample, score, advantages, step, measure


def grpo(
    state,
    *,
    start,
    steps,
    staleness,
    eval_every,
    group,
    baseline,
    refresh,
    sample,
    reward,
    train_step,
    evaluate,
    record,
):
    """'GRPO': updates at steps start..steps - 1, `steps` only evaluated; state: the policy's params
    (weights or LoRA adapters), their optimizer state and the sampler's copy (None: made first).
    refresh(params) -> the copy; sample(w_sampler, step) -> the batch (the sampler's record, its
    prompt and pos) and golds; reward(tokens, mask, golds) -> [B]; train_step(params, opt_state,
    batch) -> (params, opt_state, metrics); evaluate(params) -> drift, held-out score; record(row,
    params, opt_state, copy). `run`, below, defines each of them for one run."""
    params, opt_state, w_sampler = state
    for step in range(start, steps + 1):
        row = dict(step=step)
        if step % (staleness + 1) == 0:  # a refresh is due: the old copy goes, its memory freed
            w_sampler = None

        # evaluate: drift from p_0 and the held-out score, every eval_every steps and at the end
        if step % eval_every == 0 or step == steps:
            row |= evaluate(params)
        if step == steps:
            record(row, params, opt_state, w_sampler)
            break

        # sample: G completions of each of the step's P prompts, with log q and its top-k head
        if w_sampler is None:
            w_sampler = refresh(params)
        rollout, golds = sample(w_sampler, step)

        # score, and advantages: each reward minus its group's mean (--baseline none: the reward)
        rewards = np.asarray(reward(rollout["tokens"], rollout["mask"], golds))
        rollout["adv"] = advantage(rewards.astype(np.float32), group, baseline)

        # step: score_centering.loss, its token mean over the batch, one optimizer update
        params, opt_state, metrics = train_step(params, opt_state, rollout)

        # measure; an update that is not finite was skipped, and the run stops at this step
        row |= metrics | dict(reward=rewards.mean(), length=rollout["mask"].sum(-1).mean())
        finite = bool(metrics["finite"])
        if not finite and "drift" not in row:
            row |= evaluate(params)
        record(row, params, opt_state, w_sampler)
        if not finite:
            break
    return params, opt_state


# -------------------------------------------------------------------------------------------------
# One run: its compiled programs, the policy, the drift meter and the held-out score, the data


def token_logp(cfg, w, b):  # the trainer's log p [B, M] of the completion tokens of b
    logp = jax.nn.log_softmax(completion_logits(cfg, w, b["prompt"], b["pos"], b["tokens"]))
    return jnp.take_along_axis(logp, b["tokens"][..., None], -1)[..., 0]


Programs = namedtuple("Programs", "mesh opt policy train_steps samplers greedy prober logp")


def build(args, cfg, eos):
    """The jitted programs, compiled once and shared by the runs of a --compare: one train step per
    arm, one sampler per kind of numerics, the greedy and the probe's (clean bf16) samplers, log p
    for the drift meter, the policy's weights (LoRA: merged)."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    opt = getattr(optax, args.optimizer)(args.lr)  # sgd, adam or adamw (optax's decay: 1e-4)
    scale = args.lora and args.lora_alpha / args.lora  # LoRA's alpha / rank
    flags = dict(correction=harness.correction(args.correction), lora_scale=scale, group=args.group)

    @cache
    def samplers(kind, kv=None, state=None):  # sampler kind, the KV cache's kind, the state's dtype
        numerics = dict(mm=quant_mm(kind), kv_quant=kv_quant(kv), dtype=SAMPLER_DTYPES[kind])
        if state:  # Qwen3.5's recurrent state held at bf16 or fp16 (a dense model has none)
            numerics["state_dtype"] = STATE_DTYPES[state]
        return make_sampler(cfg, args.max_tokens, args.topk, eos, numerics, group=args.group)

    steps = [make_train_step(cfg, opt, args.micro_batch, mesh, c, **flags) for c in (False, True)]
    policy = jax.jit(partial(lora.merge, scale=scale)) if args.lora else lora.merge
    greedy = rollouts.remembered(make_sampler(cfg, args.max_tokens, 1, eos, greedy=True))
    prober = make_sampler(cfg, args.max_tokens, 1, eos)
    logp = jax.jit(partial(token_logp, cfg))
    return Programs(mesh, opt, policy, steps, samplers, greedy, prober, logp)


def run(args, task, fn, center, seed, out, prefix=""):
    """One GRPO run into `out` (resumed from its state when there is one); returns its summary.
    fn: build's programs; prefix: on each line it prints."""
    if summary := harness.finished(out):  # a --resume of a finished run
        return summary
    key, noise_key, probe_key, lora_key = jax.random.split(jax.random.PRNGKey(seed), 4)
    data = NamedSharding(fn.mesh, PartitionSpec("data"))  # rows split over the devices
    replicated = NamedSharding(fn.mesh, PartitionSpec())
    rows = args.prompts * args.group  # B = P·G: a sampler call

    # the policy: FSDP-split float32 weights (copied: the step donates them), or LoRA adapters
    w = jax.tree.map(jnp.copy, jax.device_put(task.weights, shardings(task.weights, fn.mesh)))
    params, base = w, None
    if args.lora:
        adapters = lora.init(w, args.lora, lora_key, INPUT_AXES)
        params, base = jax.device_put(adapters, replicated), w
    where = replicated if args.lora else shardings(jax.eval_shape(fn.opt.init, params), fn.mesh)
    opt_state = jax.jit(fn.opt.init, out_shardings=where)(params)  # made split: never whole

    policy = partial(fn.policy, base=base)  # the weights of params (LoRA: merged into the base)

    def copy(params, kind="bf16", sigma=0.0):  # a sampler's, whole on every device (default: clean)
        return jax.device_put(sampler_weights(policy(params), kind, sigma, noise_key), replicated)

    # the drift meter, on completions drawn once from p_0's clean bf16 copy; the held-out score.
    # rollouts.generate: the prompts left-padded to one length, `rows` a sampler call, the record
    # as arrays. drift(w): the probe tokens' mean log p_0(y) − log p_w(y), about KL(p_0 ‖ p_w)
    say = partial(harness.say, prefix=prefix)  # what runs before and between the steps: its time
    tic = time.perf_counter()
    probe = rollouts.generate(fn.prober, copy(params), task.probe, task.pad, probe_key, data, rows)
    drift = rollouts.drift_meter(fn.logp, probe, policy(params), args.micro_batch, data)
    say(f"probe: {len(task.probe)} completions of p_0, {time.perf_counter() - tic:.0f} s")
    test, golds = [p for p, _ in task.test], [gold for _, gold in task.test]
    # rows a greedy call: the held-out set (one call up to 512), rounded up to a multiple of P·G
    held_out = rows * math.ceil(min(len(test), 512) / rows)

    def evaluate(params):  # greedy, clean bf16: bit-equal weights scored once (fn.greedy remembers)
        say(f"evaluation: {len(test)} held-out prompts, greedy, {held_out} rows a call")
        tic = time.perf_counter()
        out = rollouts.generate(fn.greedy, copy(params), test, task.pad, None, data, held_out, say)
        correct = np.asarray(task.reward(out["tokens"], out["mask"], golds))  # a reward a problem
        say(f"evaluation: score {correct.mean():.3f}, {time.perf_counter() - tic:.0f} s")
        return dict(drift=drift(policy(params)), acc=correct.mean(), correct=correct)

    # the rollouts: P prompts a step, each G times, in an order drawn from the seed
    order = np.random.default_rng(seed).permutation(len(task.train))

    def sample(w_sampler, step):
        first = step * args.prompts
        problems = [task.train[order[(first + i // args.group) % len(order)]] for i in range(rows)]
        prompts, golds = [p for p, _ in problems], [gold for _, gold in problems]
        sampler = fn.samplers(args.sampler, args.kv_quant, args.state_dtype)
        step_key = jax.random.fold_in(key, step)
        return rollouts.generate(sampler, w_sampler, prompts, task.pad, step_key, data, rows), golds

    def train_step(params, opt_state, batch):
        return fn.train_steps[center](params, opt_state, jax.device_put(batch, data), base)

    # the loop, from the saved state if there is one
    template = copy(params, args.sampler) if args.staleness else None  # a saved copy's dtypes
    hist = dict(step=0, acc={}, drift={}, kl_q_p=[], reward=[])
    hist, state = harness.resume(out, hist, params, opt_state, template)  # out's saved, if any
    params, opt_state = grpo(
        state,
        start=hist["step"],
        steps=args.steps,
        staleness=args.staleness,
        eval_every=args.eval_every,
        group=args.group,
        baseline=args.baseline,
        refresh=partial(copy, kind=args.sampler, sigma=args.weight_noise),
        sample=sample,
        reward=task.reward,
        train_step=train_step,
        evaluate=evaluate,
        record=harness.recorder(args, out, hist, prefix),  # prints, appends metrics.jsonl, saves
    )
    if args.save:
        weights = host(policy(params))  # every process takes part; process 0 writes
        if not jax.process_index():
            hf_checkpoint.save(args.save, task.cfg, weights, task.path)
    return harness.finish(out, hist, args.lr, prefix)


# -------------------------------------------------------------------------------------------------
# main: the flags, checked against the model's config.json before any download; --plan, --compare


def main(argv=None):
    args = harness.parse_args(argv, __doc__.split("\n\n")[0].replace("\n", " "))
    harness.start(args)

    def work():
        tic = time.perf_counter()
        task = tasks.load(args, shardings)  # bad input: one line
        harness.say(f"load: {time.perf_counter() - tic:.1f} s")
        if args.plan:  # then `task` is the model's config.json alone, and (0,) stands in for eos
            adapters = partial(lora.init, input_axes=INPUT_AXES)
            return plan.plan(args, dict(task), build(args, task, (0,)), shardings, adapters)
        fn = build(args, task.cfg, task.eos)
        if args.compare:
            return compare.compare(args, task, fn, run)
        return run(args, task, fn, args.center, args.seed, args.out)

    return harness.interruptible(work)


if __name__ == "__main__":
    main()
