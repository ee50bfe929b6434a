"""'GRPO' on GSM8K, a CPU sequence task or a toy bandit, with a sampler of other numerics than the trainer's.

    python train.py --center                                  # Qwen3-0.6B on GSM8K, score-centred
    python train.py --compare --out runs/gsm8k --plot gsm8k.png   # centring off, then on: same seed and noise
    python train.py --task sequence --compare                 # what drift costs, LLM code path, CPU: a minute
    python train.py --task bandit --baseline none --compare   # the mechanism in seconds, on a CPU

What it is: REINFORCE with a group-mean baseline, whose rollouts come from a copy of the policy that runs with
other numerics (bf16 / int8 / fp8 weights and KV cache, fixed weight noise, staleness), trained with
`score_centering.loss`. How it differs from textbook GRPO, and why:
- no KL penalty to a reference model: it would pull toward the start and hide the drift under study;
- no PPO ratio clipping: one optimizer step per batch, so the only off-policyness is the sampler mismatch;
- a token-mean loss over the whole batch, not a mean of per-sequence means (score_centering.py, step 8);
- advantages are rewards minus the group mean, not divided by the group's std (the paper's recipe);
- plain SGD at a constant learning rate on float32 master weights (the paper's recipe; --optimizer adam).
"""

import argparse, math, os, re, time
from collections import namedtuple
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import harness
import qwen3
import score_centering as sc

TEMPERATURE = 1.0  # the sampler's; the recorded log q is the post-temperature distribution
RECIPE = dict(  # per task, the defaults of the flags that depend on it
    gsm8k=dict(
        steps=100,
        lr=0.01,
        prompts=32,
        max_tokens=512,
        sampler="bf16",
        weight_noise=0.0,
        eval_every=10,
        eval_n=500,
    ),
    sequence=dict(
        steps=150,
        lr=0.1,
        prompts=4,
        max_tokens=16,
        sampler="int8",
        weight_noise=0.1,
        eval_every=10,
        eval_n=256,
    ),
    bandit=dict(
        steps=200, lr=0.5, prompts=32, max_tokens=1, sampler="bf16", weight_noise=0.5, eval_every=10
    ),
)
OPTIMIZERS = dict(sgd=optax.sgd, adam=optax.adam, adamw=optax.adamw)  # adamw: optax's decay 1e-4

# ---------------------------------------------------------------------------------------------------------
# the sampler: a bf16 copy of the trainer's weights with its own numerics (W8A8, noise, a quantised KV cache),
# and jitted KV-cache decoding that records what score_centering.loss needs

INPUT_AXES = dict(
    q=(1,), k=(1,), v=(1,), o=(1, 2), gate=(1,), up=(1,), down=(1,), embed=(1,), lm_head=(1,)
)


def fake_quant(
    x, axes, kind
):  # symmetric, one scale per slice reduced over `axes`: int8 or fp8 (e4m3)
    x32, qmax = x.astype(jnp.float32), 127.0 if kind == "int8" else 448.0
    scale = jnp.maximum(jnp.abs(x32).max(axes, keepdims=True), 1e-12) / qmax
    y = x32 / scale
    y = y.astype(jnp.float8_e4m3fn) if kind == "fp8" else jnp.clip(jnp.round(y), -qmax, qmax)
    return (y.astype(jnp.float32) * scale).astype(x.dtype)


def kv_quant(
    kind,
):  # K, V [B, T, K, H] as a quantised cache keeps them: int8 per token and head; fp8 e4m3
    if kind == "int8":
        return lambda a: fake_quant(a, (3,), "int8")
    if kind == "fp8":  # unit scale, saturating at e4m3's largest value
        return lambda a: (
            jnp.clip(a.astype(jnp.float32), -448, 448).astype(jnp.float8_e4m3fn).astype(a.dtype)
        )


@partial(jax.jit, static_argnums=(1, 2))
def sampler_weights(w, kind, sigma=0.0, key=None):
    """bf16 copy of w ⊙ (1 + σε), ε ~ N(0, 1) from `key`: the same at each refresh, a persistent bias."""
    if sigma:
        leaves, tree = jax.tree.flatten(w)
        keys = jax.random.split(key, len(leaves))
        w = tree.unflatten(
            [x * (1 + sigma * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)]
        )
    if kind != "bf16":  # per output channel, every matmul weight (embeddings too)
        quant = lambda d: {
            k: fake_quant(x, INPUT_AXES[k], kind) if k in INPUT_AXES else x  # noqa: E731
            for k, x in d.items()
        }
        w = dict(quant(w), layers=quant(w["layers"]))
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), w)


def quant_mm(
    kind,
):  # W8A8: the activation is fake-quantised per token (over the contracted axes) as well
    def mm(spec, x, w):
        x_axes, out = spec.split(",")[0], spec.split("->")[1]
        per_token = tuple(i for i, c in enumerate(x_axes) if c not in out)
        return jnp.einsum(spec, fake_quant(x, per_token, kind), w)

    return jnp.einsum if kind == "bf16" else mm


def categorical(key, logq, block=128):
    """y ~ q [B, V] by inverse CDF, a block of ids then an id in it: two uniforms a row, not V Gumbels."""
    B, V = logq.shape
    p = jnp.pad(jnp.exp(logq), ((0, 0), (0, -V % block))).reshape(
        B, -1, block
    )  # [B, V / block, block]

    def pick(key, w):  # i with probability w_i / Σ w; rounding never reaches past the last w_i > 0
        c = jnp.cumsum(w, -1)
        i = (c <= jax.random.uniform(key, (B, 1)) * c[:, -1:]).sum(-1)
        return jnp.minimum(i, w.shape[-1] - 1 - jnp.argmax(w[:, ::-1] > 0, -1))

    k_block, k_id = jax.random.split(key)
    i = pick(k_block, p.sum(-1))
    return i * block + pick(k_id, jnp.take_along_axis(p, i[:, None, None], 1)[:, 0])


def make_sampler(
    cfg, max_tokens, topk, eos_ids, mm=jnp.einsum, dtype=jnp.bfloat16, greedy=False, kv=None
):
    """fn(weights, prompt [B, T0], pos [B, T0], key) -> dict of tokens, logq, mask [B, M] and the head
    head_ids, head_logq [B, M, K]: log q after temperature, normalised over the full vocabulary (topk = 0:
    the full [B, M, V] log q, no ids). Prefills once, then one token a step until every row ended its turn."""
    fwd, eos = partial(qwen3.forward, cfg, mm=mm, dtype=dtype, kv_quant=kv), jnp.array(eos_ids)

    def sample(w, prompt, pos, key):
        B, T0 = prompt.shape
        logits, kv = fwd(w, prompt, pos, qwen3.init_kv(cfg, B, T0 + max_tokens, dtype), 0, last=1)
        M, K = max_tokens, topk or cfg["vocab_size"]
        out = dict(
            tokens=jnp.zeros((B, M), jnp.int32),
            logq=jnp.zeros((B, M)),
            mask=jnp.zeros((B, M), bool),
            head_logq=jnp.zeros((B, M, K)),
        )
        out |= dict(head_ids=jnp.zeros((B, M, K), jnp.int32)) if topk else {}

        def body(carry):
            i, logits, kv, done, out, key = carry
            key, k_sample = jax.random.split(key)
            logq = jax.nn.log_softmax(logits[:, -1] / TEMPERATURE)  # [B, V]
            y = jnp.argmax(logq, -1) if greedy else categorical(k_sample, logq)  # [B]
            rec = dict(
                tokens=y,
                logq=jnp.take_along_axis(logq, y[:, None], -1)[:, 0],
                mask=~done,
                head_logq=logq,
            )
            rec |= dict(zip(("head_logq", "head_ids"), jax.lax.top_k(logq, topk))) if topk else {}
            out = {name: x.at[:, i].set(rec[name]) for name, x in out.items()}
            logits, kv = fwd(w, y[:, None].astype(jnp.int32), pos[:, -1:] + 1 + i, kv, T0 + i)
            return i + 1, logits, kv, done | jnp.isin(y, eos), out, key

        running = lambda c: (c[0] < max_tokens) & ~c[3].all()  # noqa: E731
        return jax.lax.while_loop(running, body, (0, logits, kv, jnp.zeros(B, bool), out, key))[4]

    return jax.jit(sample)


def left_pad(prompts, pad_id, multiple=32):
    """Token lists -> tokens, positions [B, T0] left-padded (position -1); T0 rounded up: fewer compiles."""
    T0 = -(-max(map(len, prompts)) // multiple) * multiple
    tokens, pos = (
        np.full((len(prompts), T0), pad_id, np.int32),
        np.full((len(prompts), T0), -1, np.int32),
    )
    for b, p in enumerate(prompts):
        tokens[b, T0 - len(p) :], pos[b, T0 - len(p) :] = p, np.arange(len(p))
    return tokens, pos


def host(
    tree,
):  # numpy copies of (global) arrays: every row, on every process, wherever the rows were made
    return jax.tree.map(
        lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree
    )


def generate(
    sampler, w, prompts, pad_id, key, data, n
):  # every prompt, n rows (one program) a call
    prompt, pos = (
        np.concatenate([x, np.repeat(x[:1], -len(prompts) % n, 0)])  # the last call is padded
        for x in left_pad(prompts, pad_id)
    )  # with copies of the first prompt
    outs = [
        host(
            sampler(
                w,
                *jax.device_put((prompt[i : i + n], pos[i : i + n]), data),
                jax.random.fold_in(key, i),
            )
        )
        for i in range(0, len(prompt), n)
    ]
    return {k: np.concatenate([o[k] for o in outs])[: len(prompts)] for k in outs[0]} | dict(
        prompt=prompt[: len(prompts)], pos=pos[: len(prompts)]
    )


# ---------------------------------------------------------------------------------------------------------
# the trainer: float32 logits on prompt + completion, score_centering.loss, optionally LoRA adapters


def completion_logits(cfg, w, prompt, pos, tokens):
    """The trainer's float32 logits [B, M, V] at the positions that predicted the completion tokens [B, M]."""
    M = tokens.shape[1]
    seq_pos = jnp.concatenate([pos, pos[:, -1:] + 1 + jnp.arange(M)[None, :]], 1)
    with jax.default_matmul_precision(
        "highest"
    ):  # a float32 trainer, not TF32 (GPU) or bf16 passes (TPU)
        logits = qwen3.forward(cfg, w, jnp.concatenate([prompt, tokens], 1), seq_pos, last=M + 1)[0]
    return logits[:, :-1] / TEMPERATURE  # the logits at position t predict token t + 1


def token_logp(cfg, w, b):  # the trainer's log p [B, M] of the completion tokens of b
    logp = jax.nn.log_softmax(completion_logits(cfg, w, b["prompt"], b["pos"], b["tokens"]))
    return jnp.take_along_axis(logp, b["tokens"][..., None], -1)[..., 0]


def lora_init(
    w, rank, key
):  # A ~ N(0, 1/fan-in), B = 0: the merged model starts exactly at the base
    def init(key, x, n_in):  # x [L, in..., out...]
        fan_in = math.prod(x.shape[1 : 1 + n_in])
        return dict(
            a=jax.random.normal(key, (x.shape[0], fan_in, rank)) * fan_in**-0.5,
            b=jnp.zeros((x.shape[0], rank, x[0].size // fan_in)),
        )

    names = ("q", "k", "v", "o", "gate", "up", "down")  # every attention and MLP projection
    return {
        n: init(k, w["layers"][n], len(INPUT_AXES[n]))
        for n, k in zip(names, jax.random.split(key, 7))
    }


def merge(
    params, base, scale
):  # the policy's weights: base + scale · A B per projection (no base: params)
    if base is None:
        return params
    delta = lambda x, ab: scale * jnp.einsum("lir,lro->lio", ab["a"], ab["b"]).reshape(x.shape)  # noqa: E731
    return dict(
        base,
        layers={
            k: x + delta(x, params[k]) if k in params else x for k, x in base["layers"].items()
        },
    )


def advantage(r, args):  # r [P * G] -> [P * G]: minus the mean of its group of G, or raw
    return (
        (r - r.reshape(-1, args.group).mean(1).repeat(args.group))
        if args.baseline == "group"
        else r
    )


def loss_kw(args, center):  # all that --center changes: one keyword of the loss
    return dict(center=center, tis_cap=args.tis_cap, mis=args.mis)


def shardings(tree, mesh=None):
    """FSDP: each matrix of a weight tree (or of its optimizer state: the same names) split over the mesh
    (default: every device) on its largest axis the device count divides, never the stacked layer axis L that
    lax.scan slices; vectors and scalars whole on every device. One device: the replicated layout."""
    mesh = mesh or Mesh(np.array(jax.devices()), ("data",))

    def spec(path, x):
        stacked = any(getattr(k, "key", None) == "layers" for k in path)  # [L, ...]
        axes = [i for i in range(stacked, x.ndim) if x.shape[i] % mesh.size == 0] * (
            x.ndim - stacked > 1
        )
        return NamedSharding(
            mesh, P(*[None] * max(axes, key=lambda i: x.shape[i]), "data") if axes else P()
        )

    return jax.tree_util.tree_map_with_path(spec, tree)


def make_train_step(cfg, opt, loss_kw, micro_batch, mesh, lora_scale=None):
    """fn(params, opt_state, batch, base=None) -> (params, opt_state, metrics); params are the weights, or
    LoRA adapters on the frozen `base`; batch: the sampler's record plus prompt, pos [B, T0] and adv [B].
    Gradients accumulate over micro-batches, each spread over the mesh's data axis, and the loss is the token
    mean over the whole batch: the same numbers as one large batch. Weights, gradients and optimizer state
    stay split as `shardings` says (LoRA: the base; the adapters and their state whole on every device)."""

    def token_sum_loss(params, base, b):
        logits = completion_logits(
            cfg, merge(params, base, lora_scale), b["prompt"], b["pos"], b["tokens"]
        )
        loss, metrics = sc.loss(
            logits,
            b["tokens"],
            b["mask"],
            b["adv"],
            b["logq"],
            b.get("head_ids"),
            b["head_logq"],
            **loss_kw,
        )
        return loss * b["mask"].sum(), (metrics, b["mask"].sum())  # token sums, divided by N below

    def step(params, opt_state, batch, base=None):
        def keep(
            tree,
        ):  # FSDP shards (LoRA adapters: whole), and outputs as inputs came: no second compile
            return jax.lax.with_sharding_constraint(
                tree, shardings(tree, mesh) if base is None else NamedSharding(mesh, P())
            )

        def accumulate(grads, b):
            (loss, (metrics, n)), g = jax.value_and_grad(token_sum_loss, has_aux=True)(
                params, base, b
            )
            return keep(jax.tree.map(jnp.add, grads, g)), (loss, metrics, n)

        split = (
            lambda x: jax.lax.with_sharding_constraint(  # noqa: E731  [B, ...] -> [B / mb, mb, ...]
                x.reshape(micro_batch, -1, *x.shape[1:]).swapaxes(0, 1),
                NamedSharding(mesh, P(None, "data")),
            )
        )
        zeros = keep(jax.tree.map(jnp.zeros_like, params))
        grads, (loss, metrics, n) = jax.lax.scan(accumulate, zeros, jax.tree.map(split, batch))
        N = jnp.maximum(n.sum(), 1)
        grads = jax.tree.map(lambda g: g / N, grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        metrics = dict(
            {k: (v * n).sum() / N for k, v in metrics.items()},
            loss=loss.sum() / N,
            grad_norm=optax.tree.norm(grads),
        )
        return *keep((optax.apply_updates(params, updates), opt_state)), metrics

    return jax.jit(step, donate_argnums=(0, 1))


# ---------------------------------------------------------------------------------------------------------
# one GRPO run: evaluation and the drift meter, rollouts, the train step, a resumable state


def drift_meter(logp, probe, w0, micro_batch, data):
    """fn(w) -> token mean of log p_0(y) - log p_w(y) over the probe completions: KL(p_0 || p_w) estimated."""
    n, pad = (
        len(probe["mask"]),
        -len(probe["mask"]) % micro_batch,
    )  # the last call: copies of row 0, cut
    probe = {k: np.concatenate([x, np.repeat(x[:1], pad, 0)]) for k, x in probe.items()}

    def probe_logp(w):  # [B, M], micro_batch rows a call, split over the devices
        rows = (
            {k: x[i : i + micro_batch] for k, x in probe.items()}
            for i in range(0, n + pad, micro_batch)
        )
        return np.concatenate([host(logp(w, jax.device_put(b, data))) for b in rows])[:n]

    logp0, mask = probe_logp(w0), probe["mask"][:n]
    return lambda w: float(((logp0 - probe_logp(w)) * mask).sum() / max(mask.sum(), 1))


def build(
    args, cfg, eos
):  # the jitted functions, compiled once and shared by every run of a --compare
    mesh = Mesh(np.array(jax.devices()), ("data",))
    opt, scale = OPTIMIZERS[args.optimizer](args.lr), args.lora and args.lora_alpha / args.lora
    return dict(
        mesh=mesh,
        opt=opt,
        scale=scale,
        logp=jax.jit(partial(token_logp, cfg)),
        merge=jax.jit(merge, static_argnums=2) if args.lora else merge,  # each device its part
        steps={
            c: make_train_step(cfg, opt, loss_kw(args, c), args.micro_batch, mesh, scale)
            for c in (False, True)
        },
        sampler=make_sampler(
            cfg, args.max_tokens, args.topk, eos, quant_mm(args.sampler), kv=kv_quant(args.kv_quant)
        ),
        evaluator=make_sampler(cfg, args.max_tokens, 1, eos, greedy=True),
        prober=make_sampler(cfg, args.max_tokens, 1, eos),
    )


def evaluate(
    fn, task, w_bf16, key, data, n
):  # mean reward of greedy completions of the test prompts
    out = generate(fn["evaluator"], w_bf16, [p for p, _ in task.test], task.pad, key, data, n)
    return float(np.mean(task.reward(out["tokens"], out["mask"], [gold for _, gold in task.test])))


def run(args, task, fn, center, seed, out):
    """One GRPO run into `out` (resumed from its state when there is one); returns its summary."""
    if harness.finished(out):  # a --resume of a finished run
        return harness.finished(out)
    n, opt, scale = args.prompts * args.group, fn["opt"], fn["scale"]
    data, replicated = (
        NamedSharding(fn["mesh"], P("data")),
        NamedSharding(fn["mesh"], P()),
    )  # rows split
    key, noise_key, probe_key, lora_key = jax.random.split(jax.random.PRNGKey(seed), 4)
    # FSDP-split weights (LoRA: the frozen base), copied: the step donates them, and device_put may not copy
    w = jax.tree.map(jnp.copy, jax.device_put(task.weights, shardings(task.weights, fn["mesh"])))
    params, base = (
        (jax.device_put(lora_init(w, args.lora, lora_key), replicated), w)
        if args.lora
        else (w, None)
    )
    where = replicated if args.lora else shardings(jax.eval_shape(opt.init, params), fn["mesh"])
    opt_state = jax.jit(opt.init, out_shardings=where)(
        params
    )  # in place: no device holds all of Adam's
    # the sampler's own copy: bf16 and whole on every device, gathered once per refresh, not once per token
    copy = lambda w, *a: jax.device_put(sampler_weights(w, *a), replicated)  # noqa: E731
    # the drift meter: probe completions drawn once from the initial policy, clean bf16, temperature 1
    w0 = fn["merge"](params, base, scale)
    probe = generate(fn["prober"], copy(w0, "bf16"), task.probe, task.pad, probe_key, data, n)
    drift = drift_meter(
        fn["logp"],
        {k: probe[k] for k in ("prompt", "pos", "tokens", "mask")},
        w0,
        args.micro_batch,
        data,
    )
    stale = copy(w0, "bf16") if args.staleness else None  # the template of the sampler's copy
    hist, (params, opt_state, w_sampler) = harness.resume(
        out, dict(step=0, acc={}, drift={}, kl_q_p=[], reward=[]), params, opt_state, stale
    )
    order = np.random.default_rng(seed).permutation(len(task.train))
    for step in range(hist["step"], args.steps + 1):
        harness.at_step(step, out, args.out, hist["step"])
        row, w = {"step": step}, fn["merge"](params, base, scale)
        w_sampler = (
            w_sampler if step % (args.staleness + 1) else None
        )  # refreshed below: one copy at a time
        if step % args.eval_every == 0 or step == args.steps:
            hist["drift"][str(step)] = row["drift"] = drift(w)
            if task.test:
                hist["acc"][str(step)] = row["acc"] = evaluate(
                    fn, task, copy(w, "bf16"), key, data, n
                )
        if step < args.steps:
            t0 = time.perf_counter()
            if step % (args.staleness + 1) == 0:
                w_sampler = copy(w, args.sampler, args.weight_noise, noise_key)
            problems = [
                task.train[order[(step * args.prompts + i // args.group) % len(order)]]
                for i in range(n)
            ]  # each prompt --group times
            batch = generate(
                fn["sampler"],
                w_sampler,
                [p for p, _ in problems],
                task.pad,
                jax.random.fold_in(key, step),
                data,
                n,
            )
            r = np.asarray(
                task.reward(batch["tokens"], batch["mask"], [gold for _, gold in problems])
            )
            t1 = time.perf_counter()
            batch["adv"] = advantage(r.astype(np.float32), args)
            params, opt_state, m = fn["steps"][center](
                params, opt_state, jax.device_put(batch, data), base
            )
            row |= {k: float(v) for k, v in m.items()} | dict(
                reward=float(r.mean()),
                length=float(batch["mask"].sum(1).mean()),
                sample_seconds=t1 - t0,
                train_seconds=time.perf_counter() - t1,
                seconds=time.perf_counter() - t0,
            )
            hist["kl_q_p"].append(row["kl_q_p"])
            hist["reward"].append(row["reward"])
        harness.log_step(
            row, args.steps, [c for c in harness.COLUMNS if c != "acc" or task.test], out
        )
        if out and args.save_every and step < args.steps and (step + 1) % args.save_every == 0:
            hist["step"] = step + 1
            harness.save_state(
                os.path.join(out, "state.npz"),
                hist,
                *host((params, opt_state, w_sampler if args.staleness else None)),
            )
    weights = (
        host(fn["merge"](params, base, scale)) if args.save else None
    )  # every process takes part
    if args.save and not jax.process_index():  # process 0 writes
        harness.save_checkpoint(args.save, task.cfg, weights, task.path)
    return harness.finish(out, hist, args.steps)


# ---------------------------------------------------------------------------------------------------------
# the tasks: a model, training and test prompts (token lists) with their gold, and a batch reward:
# reward(tokens [B, M], mask [B, M], golds) -> [B]

Task = namedtuple("Task", "cfg weights eos pad train test probe reward path")
INSTRUCTION = (
    "\nSolve the problem step by step, then give the final answer as a number on the last line."
)


def normalise(number):  # "$1,234.50" -> "1234.5", "18.0" -> "18"
    s = number.strip().replace(",", "").replace("$", "")
    return s.rstrip("0").rstrip(".") if "." in s else s


def reward(completion, gold):  # 1 when the completion's last number is the gold answer
    numbers = re.findall(r"-?\$?\d[\d,]*(?:\.\d+)?", completion)
    return float(bool(numbers) and normalise(numbers[-1]) == gold)


def gsm8k_task(args):
    train_set, test_set = (
        harness.read_gsm8k(args.data_dir, split, normalise) for split in ("train", "test")
    )
    model = qwen3.load(
        args.model, place=shardings
    )  # each device reads its FSDP shards from the file
    cfg, tok = model.cfg, model.tokenizer
    V, positions = cfg["vocab_size"], cfg.get("max_position_embeddings", math.inf)
    for bad, msg in [
        (tok is None, f"{args.model} has no tokenizer files (vocab.json or tokenizer.json)"),
        (
            args.save and os.path.realpath(args.save) == os.path.realpath(model.path),
            f"--save {args.save} is where --model {args.model} lives: pick another folder",
        ),
        (args.topk > V, f"--topk {args.topk} exceeds the {V} tokens of {args.model}"),
        (args.topk == 0 and V > 4096, f"--topk 0 records q over all {V} tokens: use --topk 128"),
        (
            args.max_tokens >= positions,
            f"--max-tokens {args.max_tokens} reaches past the {positions} positions of the model",
        ),
    ]:
        if bad:
            raise ValueError(msg)
    prompts = lambda problems: [(tok.chat(q + INSTRUCTION), gold) for q, gold in problems]  # noqa: E731
    ids = lambda row: [t for t in row if t not in tok.eos_ids]  # noqa: E731  (the text ends at its EOS)
    return Task(
        cfg,
        model.weights,
        tok.eos_ids,
        tok.pad_id,
        prompts(train_set),
        prompts(test_set[: args.eval_n]),
        [p for p, _ in prompts(test_set[: args.probe_n])],
        lambda tokens, mask, golds: [
            reward(tok.decode(ids(t[m])), g) for t, m, g in zip(tokens, mask, golds)
        ],
        model.path,
    )


SEQUENCE = dict(
    model_type="qwen3",
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=1e4,
    max_position_embeddings=256,
    tie_word_embeddings=True,
)
SHARPEN = (
    6.0  # the final norm's weight: entropy ~1 nat and top-128 mass > 0.99, like a trained LM's
)

TEACHER_TOP = (
    3  # a completion token earns its reward when p_0 ranks it in its top 3 at the policy's prefix
)


def sequence_task(args):
    """A tiny Qwen3 p_0 from the seed; prompts of 8 random tokens: 512 to train on, --eval-n held out, then
    the probe. The reward: the fraction of completion tokens in the lower half of V that p_0 ranks in its
    top 3 at the prefix the policy wrote, a preference to learn while staying fluent by p_0's standard (the
    stand-in for a pretrained LM's competence, which drift erodes); the held-out score is its greedy mean."""
    cfg, rng = dict(SEQUENCE), np.random.default_rng(args.seed)
    V, L, (top, layers) = cfg["vocab_size"], cfg["num_hidden_layers"], qwen3.layout(cfg)
    if args.topk > V:
        raise ValueError(f"--topk {args.topk} exceeds the {V} tokens of the sequence task")
    init = lambda shape, fan_in: rng.standard_normal(shape, np.float32) * fan_in**-0.5  # noqa: E731
    w = {
        k: np.full(s, SHARPEN if k == "norm" else 1, np.float32) if len(s) == 1 else init(s, s[-1])
        for k, (_, _, s) in top.items()
    }
    w["layers"] = {
        k: np.ones((L, *s), np.float32)
        if len(s) == 1
        else init((L, *s), math.prod(s[: len(INPUT_AXES[k])]))
        for k, (_, _, s) in layers.items()
    }
    w, n = jax.tree.map(jnp.asarray, w), 512 + args.eval_n
    prompts = [
        (p, p) for p in rng.integers(0, V, (n + args.probe_n, 8)).tolist()
    ]  # the prompt is its "gold"

    @jax.jit
    def reward(tokens, mask, prompt):  # completions [B, M] of prompts [B, 8] -> [B]
        seq = jnp.concatenate([prompt, tokens], 1)
        with jax.default_matmul_precision(
            "highest"
        ):  # p_0's logits [B, M, V] where each token was chosen
            logits = qwen3.forward(
                cfg,
                w,
                seq,
                jnp.broadcast_to(jnp.arange(seq.shape[1]), seq.shape),
                last=tokens.shape[1] + 1,
            )[0][:, :-1]
        rank = (logits > jnp.take_along_axis(logits, tokens[..., None], -1)).sum(
            -1
        )  # tokens p_0 prefers
        good = (tokens < V // 2) & (rank < TEACHER_TOP) & mask
        return good.sum(1) / jnp.maximum(mask.sum(1), 1)

    return Task(
        cfg,
        w,
        (-1,),
        0,
        prompts[:512],
        prompts[512:n],
        [p for p, _ in prompts[n:]],
        lambda tokens, mask, golds: reward(tokens, mask, np.array(golds, np.int32)),
        None,
    )


# ---------------------------------------------------------------------------------------------------------
# the toy bandit: the policy is a vector of K logits, the sampler's are the trainer's plus a fixed offset


def bandit(args, center, staleness, out=None):
    """One run through the very same loss (T = 1). Returns the drift TV(p_t, p_0) after every step."""
    tv = lambda a, b: float(0.5 * jnp.abs(jax.nn.softmax(a) - jax.nn.softmax(b)).sum())  # noqa: E731  (TV)
    k_success, k_bias, key = jax.random.split(jax.random.PRNGKey(args.seed), 3)
    success = jax.random.uniform(
        k_success, (args.arms,), minval=0.45, maxval=0.55
    )  # a small signal
    bias = args.weight_noise * jax.random.normal(
        k_bias, (args.arms,)
    )  # drawn once: a persistent bias
    B, K = args.prompts * args.group, min(args.topk or args.arms, args.arms)
    opt = OPTIMIZERS[args.optimizer](args.lr)

    @jax.jit
    def step(theta, opt_state, sampler_logits, key):
        k_arm, k_reward = jax.random.split(key)
        logq = jax.nn.log_softmax(sampler_logits)  # [V]
        arms = jax.random.categorical(k_arm, logq, shape=(B, 1))  # [B, T = 1]
        r = jax.random.bernoulli(k_reward, success[arms[:, 0]]).astype(jnp.float32)  # [B]
        head_logq, head_ids = jax.lax.top_k(logq, K)
        head_ids, head_logq = (
            jnp.broadcast_to(x, (B, 1, K)) for x in (head_ids, head_logq)
        )  # [B, 1, K]

        def loss(theta):
            logits = jnp.broadcast_to(theta, (B, 1, args.arms))  # [B, T = 1, V]
            return sc.loss(
                logits,
                arms,
                jnp.ones((B, 1), bool),
                advantage(r, args),
                logq[arms],
                head_ids,
                head_logq,
                **loss_kw(args, center),
            )

        (_, m), g = jax.value_and_grad(loss, has_aux=True)(theta)
        updates, opt_state = opt.update(g, opt_state, theta)
        m = dict(m, reward=r.mean(), grad_norm=optax.tree.norm(g))
        return optax.apply_updates(theta, updates), opt_state, m

    theta0 = jnp.zeros(args.arms)
    theta, opt_state, curve = theta0, opt.init(theta0), []
    for i in range(args.steps):
        if i % (staleness + 1) == 0:
            sampler_logits = theta + bias  # refresh from the trainer
        theta, opt_state, m = step(theta, opt_state, sampler_logits, jax.random.fold_in(key, i))
        curve.append(tv(theta, theta0))
        if out is not None and ((i + 1) % args.eval_every == 0 or i in (0, args.steps - 1)):
            row = dict({k: float(v) for k, v in m.items()}, step=i + 1, drift=curve[-1])
            harness.log_step(row, args.steps, [c for c in harness.COLUMNS if c in row], out)
    return dict(
        drift=curve[-1],
        gap=tv(theta0 + bias, theta0),
        reward=float(jax.nn.softmax(theta) @ success),
        best_arm=float(success.max()),
        curve=curve,
    )


def run_bandit(args):
    if not args.compare:
        res = bandit(args, args.center, args.staleness, args.out or "")
        return harness.write_summary(args.out, {k: v for k, v in res.items() if k != "curve"})
    runs = {
        (s, c): bandit(args, c, st)
        for s, st in (("online", 0), ("frozen", args.steps))
        for c in (0, 1)
    }
    return harness.report_bandit(args, runs)


# ---------------------------------------------------------------------------------------------------------
# --compare: centring off, then on, from the same seed, weights, data, noise and keys; --plan; main


def compare(args, task):
    res, fn, seeds = {}, build(args, task.cfg, task.eos), args.seeds or [args.seed]
    for seed in seeds:
        if args.task == "sequence":  # its model comes from the seed (GSM8K's does not)
            task = sequence_task(argparse.Namespace(**vars(args) | dict(seed=seed)))
        for center in (False, True):
            name = ("centered" if center else "uncentered") + (
                f"_seed{seed}" if len(seeds) > 1 else ""
            )
            print(f"\n---- {name}", flush=True)
            out = args.out and os.path.join(args.out, name)
            os.makedirs(out, exist_ok=True) if out else None
            res[name] = run(args, task, fn, center, seed, out)
    return harness.report(args, task.cfg, res)


def plan(
    args, cfg, T0=256
):  # T0: the prompt tokens planned for (GSM8K's chat prompts take 100 to 250)
    """--plan: the sampler and the train step compiled on shapes and shardings alone; bytes per device."""
    fn, (top, layers), L = build(args, cfg, (0,)), qwen3.layout(cfg), cfg["num_hidden_layers"]
    mesh, B, M, key = fn["mesh"], args.prompts * args.group, args.max_tokens, jax.random.PRNGKey(0)
    every = lambda where: lambda tree: jax.tree.map(lambda _: NamedSharding(mesh, where), tree)  # noqa: E731
    trained = every(P()) if args.lora else partial(shardings, mesh=mesh)  # LoRA adapters: whole

    def abstract(tree, where):  # the shapes and dtypes of tree, placed as where(tree) says
        return jax.tree.map(lambda x, s: x.update(sharding=s), tree, where(tree))

    w = {k: jax.ShapeDtypeStruct(s, jnp.float32) for k, (_, _, s) in top.items()} | dict(
        layers={k: jax.ShapeDtypeStruct((L, *s), jnp.float32) for k, (_, _, s) in layers.items()}
    )
    w16 = abstract(
        jax.tree.map(lambda x: x.update(dtype=jnp.bfloat16), w), every(P())
    )  # the sampler's
    w = abstract(w, partial(shardings, mesh=mesh))
    params = jax.eval_shape(partial(lora_init, rank=args.lora), w, key=key) if args.lora else w
    params, state = (abstract(t, trained) for t in (params, jax.eval_shape(fn["opt"].init, params)))
    prompt = jax.ShapeDtypeStruct(
        (B, T0), jnp.int32, sharding=NamedSharding(mesh, P("data"))
    )  # and pos
    batch = abstract(
        jax.eval_shape(fn["sampler"], w16, prompt, prompt, key)
        | dict(  # and the advantages
            prompt=prompt, pos=prompt, adv=jax.ShapeDtypeStruct((B,), jnp.float32)
        ),
        every(P("data")),
    )
    s, t = (
        f.lower(*a).compile().memory_analysis()
        for f, a in [
            (fn["sampler"], (w16, prompt, prompt, key)),
            (fn["steps"][args.center], (params, state, batch, w if args.lora else None)),
        ]
    )
    size = lambda tree: sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize  # noqa: E731
        for x in jax.tree.leaves(tree)
    )
    kv = (
        2 * L * B // mesh.size * (T0 + M) * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    )  # K, V: bf16
    rows = {
        "weights": size(w),
        "adapters": size(params) * bool(args.lora),
        "gradients": size(params),
        "optimizer state": size(state),
        "sampler weights": size(w16),
        "kv cache": kv,
        "sampler temporaries": s.temp_size_in_bytes,
        "train step arguments": t.argument_size_in_bytes,
        "train step temporaries": t.temp_size_in_bytes,
    }  # the peaks add what is resident meanwhile:
    rows["peak while sampling"] = (
        rows["weights"]
        + rows["adapters"]
        + rows["optimizer state"]
        + (s.argument_size_in_bytes + s.output_size_in_bytes + s.temp_size_in_bytes)
    )
    rows["peak in the train step"] = rows["sampler weights"] + (
        t.argument_size_in_bytes
        + t.output_size_in_bytes
        - t.alias_size_in_bytes
        + t.temp_size_in_bytes
    )
    print(
        f"--plan: {L}-layer Qwen3, {B} rollouts x ({T0} + {M} tokens), micro-batch {args.micro_batch}, "
        f"{args.optimizer}{f', LoRA {args.lora}' * bool(args.lora)}, {mesh.size} devices"
    )
    harness.table(
        "per device", {k: dict(MiB=v / 2**20) for k, v in rows.items()}, dict(MiB="{:10,.1f}")
    )
    return rows


def parse_args(argv=None):
    return harness.parse_args(argv, RECIPE, __doc__.split("\n")[0])


def main(argv=None):
    args = parse_args(argv)
    harness.start(args)

    def work():
        if args.task == "bandit":
            return run_bandit(args)
        try:
            if args.plan:
                return plan(
                    args, dict(SEQUENCE) if args.task == "sequence" else qwen3.config(args.model)[0]
                )
            task = gsm8k_task(args) if args.task == "gsm8k" else sequence_task(args)
        except (ValueError, OSError) as e:  # bad data or checkpoint: one line, no traceback
            raise SystemExit(f"error: {e}") from None
        if args.compare:
            return compare(args, task)
        return run(args, task, build(args, task.cfg, task.eos), args.center, args.seed, args.out)

    return harness.interruptible(work)


if __name__ == "__main__":
    main()
