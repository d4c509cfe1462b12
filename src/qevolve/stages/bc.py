"""`bc`: behaviour cloning, multi-turn SFT with the loss on action tokens only."""

from __future__ import annotations

import json
import time
from pathlib import Path

from qevolve.algos.losses import masked_nll
from qevolve.data.atomic import atomic_dir
from qevolve.data.store import Trajectory, read_store
from qevolve.environments import ENVIRONMENTS
from qevolve.envs import check_tasks, make_env
from qevolve.models.base import target_logprobs
from qevolve.models.device import model_device, pad_ids
from qevolve.models.policy import load_policy, save_adapters
from qevolve.models.prompt import PROMPT_FILE, PromptBuilder, build_examples
from qevolve.params import Params
from qevolve.training import (
    checkpoint_path,
    full_state,
    input_digest,
    is_sharded,
    last_epoch_mean,
    loading_config,
    local_share,
    packed_rows,
    save_and_report,
    shard,
    train,
)


def one_shot_text(trajs: list[Trajectory]) -> str:
    """A demonstration rendered as plain text, for the optional one-shot prompt."""
    t = min(
        trajs, key=lambda t: (not t.won, len(t.steps), t.task_id)
    )  # a won one (the store may hold corrupted, lost ones)
    lines = [f"Your task is to: {t.instruction}", t.steps[0].observation]
    for s in t.steps:
        lines += [s.output, s.next_observation]
    return "\n".join(lines)


def bc_step(model, micro: list[list[tuple[list[int], list[int]]]], pad_id: int, pack_tokens: int = 0) -> dict:
    """Forward and backward over micro-batches; the loss is the mean over all action tokens of the step.

    `pack_tokens` > 0 packs each micro-batch into rows of that many tokens (see `packed_rows`); the
    loss is the same as with padding, since the first token of a window is never an action token."""
    total = sum(sum(m[1:]) for mb in micro for _, m in mb)
    device = model_device(model)
    loss_sum = 0.0
    for mb, scale in local_share(micro, even=is_sharded(model)):
        if pack_tokens:
            ids, mask, pos = (
                t.to(device) for t in packed_rows([x for x, _ in mb], [m for _, m in mb], pack_tokens, pad_id)
            )
            logp = target_logprobs(model, ids, mask, position_ids=pos)
        else:
            ids, attn = pad_ids([x for x, _ in mb], pad_id, device)
            mask, _ = pad_ids([m for _, m in mb], 0, device)
            logp = target_logprobs(model, ids, mask, attention_mask=attn)
        weight = int(mask[:, 1:].sum()) / max(total, 1)
        loss = masked_nll(logp, mask) * weight * scale
        loss.backward()
        loss_sum += float(loss.detach())
    return {"loss": loss_sum}


def bc(params: Params, base_dir: Path, experts_dir: Path, out: Path, metrics_path: Path, curve_path: Path) -> dict:
    cfg = params.bc
    trajs = read_store(experts_dir)
    if not trajs:
        raise ValueError(f"{experts_dir}: no expert trajectories to clone")
    check_tasks(make_env(params.env), trajs, str(experts_dir))
    model, tok = load_policy(base_dir, loading_config(params.model, params.train), seed=cfg.seed)
    model = shard(model, params.train, params.model.device)
    one_shot = one_shot_text(trajs) if params.prompt.one_shot else ""
    builder = PromptBuilder(
        tok,
        params.model.context_tokens,
        one_shot,
        params.prompt.repeat_task,
        params.prompt.max_observation_tokens,
        ENVIRONMENTS[params.env.name].intro,
        ENVIRONMENTS[params.env.name].keep_case,
    )
    examples = build_examples(builder, trajs)
    pack_tokens = params.model.context_tokens if cfg.pack else 0
    start = time.perf_counter()
    curve = train(
        model,
        examples,
        cfg,
        lambda e: len(e[0]),
        lambda micro: bc_step(model, micro, tok.pad_token_id, pack_tokens),
        "bc",
        checkpoint=checkpoint_path(out),
        inputs=input_digest(experts_dir),
        run=params.train,
    )
    elapsed = time.perf_counter() - start
    state = full_state(model)

    def save() -> None:
        with atomic_dir(out) as tmp:
            save_adapters(model, tmp, state_dict=state)
            (tmp / PROMPT_FILE).write_text(
                json.dumps(
                    {
                        "one_shot": one_shot,
                        "repeat_task": params.prompt.repeat_task,
                        "intro": builder.intro,
                        "keep_case": builder.keep_case,
                    }
                )
                + "\n"
            )

    metrics = {
        "loss": last_epoch_mean(curve, "loss"),
        "first_loss": curve[0]["loss"],
        "examples": len(examples),
        "truncated_observations": len(builder.truncated),
        "trajectories": len(trajs),
        "steps": len(curve),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    return save_and_report(save, metrics, model, curve, elapsed, params.train, out, metrics_path, curve_path)
