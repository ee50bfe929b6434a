"""The drop-in for train.make_train_step that the runs take: the same update, with gradients summed
over micro-batches split over the devices, the weights and optimizer state split as FSDP (or LoRA
adapters trained on a frozen base), a group's prompt computed once (lab/grouped.py), and an update
whose loss, gradient or weights are not finite skipped and reported. Equal to the reference up to
the order of float32 sums (tests/test_train_step.py)."""

import math
from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

import score_centering as sc
from lab import lora
from lab.devices import shardings
from lab.grouped import completion_logits


def make_train_step(cfg, opt, micro_batch, mesh, center, correction=None, lora_scale=None, group=1):
    """fn(params, opt_state, batch, base=None) -> (params, opt_state, metrics); params: weights, or
    LoRA adapters on the frozen `base`; batch: the sampler's record, prompt, pos [B, T0], adv [B],
    its rows in runs of `group` copies of a prompt. Gradients accumulate over micro-batches split
    over the devices, the loss a token mean over the batch; weights and optimizer state split as
    `shardings` says (LoRA adapters: whole). metrics["finite"]: False if the update was skipped."""
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
