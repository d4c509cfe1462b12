"""Policy replicas as Ray actors (`policy.replicas: R`, the `ray` extra) for the rollout stages.

Each replica loads the stage's policy (the base and the adapter DVC tracks) and serves it with the backend
`policy.backend` names, reserving one GPU where the stage's `model.device` is a GPU, else
`policy.replica_cpus` CPUs. Episode slot s always goes to replica s % R (sticky routing, as verl's
`AsyncLLMServerManager`), so each slot's KV cache stays warm on its replica; `score` and `generate` send
each replica its share of the batch at once and gather the answers in order. Sampling is seeded per
episode (`qevolve.rollout.episode_seed`), so the episodes a stage collects do not depend on R.

The stage joins the cluster `RAY_ADDRESS` names, or starts a local one on loopback
(`qevolve.envs.ray_worker.connect`). A replica that dies fails the stage with an error naming it; rerun
the evolution to run the stage again. Nothing of Prefect runs in the replicas. `rollout_backend` is what
a rollout stage asks for: the replicas, or without them the policy in the stage's own process.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qevolve.models.backend import RolloutBackend


class _Replica:
    def __init__(self, params, base_dir: str, policy_dir: str, threads: int, slots: int):
        import torch

        from qevolve.models.policy import local_backend

        torch.set_num_threads(threads)
        self.backend = local_backend(params, Path(base_dir), Path(policy_dir), slots)[0]

    def call(self, op: str, **kwargs):
        return getattr(self.backend, op)(**kwargs)


class RayPolicyBackend:
    """`RolloutBackend` over `params.policy.replicas` Ray actors (see the module docstring)."""

    def __init__(self, params, base_dir: Path, policy_dir: Path, slots: int = 0):
        import ray

        from qevolve.envs.ray_worker import connect
        from qevolve.models.device import resolve_device

        connect()
        cpus = params.policy.replica_cpus
        gpu = resolve_device(params.model.device).type == "cuda"
        options = {"num_gpus": 1} if gpu else {"num_cpus": cpus}
        cls = ray.remote(max_restarts=0, **options)(_Replica)
        self.replicas = [
            cls.remote(params, str(base_dir), str(policy_dir), max(1, int(cpus)), slots)
            for _ in range(params.policy.replicas)
        ]
        self._stops: dict[int, tuple] = {}

    def _fan(self, op: str, slots: list[int], columns: dict[str, list], **kwargs) -> list:
        """`op` on each replica for the slots it serves (`columns`: per-slot arguments), answers in `slots` order."""
        import ray
        from ray.exceptions import RayActorError

        groups: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            groups.setdefault(slot % len(self.replicas), []).append(i)
        refs = {
            r: self.replicas[r].call.remote(
                op, slots=[slots[i] for i in rows], **{k: [v[i] for i in rows] for k, v in columns.items()}, **kwargs
            )
            for r, rows in groups.items()
        }
        out: list = [None] * len(slots)
        for r, rows in groups.items():
            try:
                answers = ray.get(refs[r])
            except RayActorError as err:
                raise RuntimeError(
                    f"policy replica {r} of {len(self.replicas)} died during {op} ({type(err).__name__}); "
                    "run the evolution again to rerun the stage"
                ) from None
            for i, answer in zip(rows, answers):
                out[i] = answer
        return out

    def score(self, slots: list[int], prompts: list[list[int]], candidates: list[list[list[int]]]) -> list:
        return self._fan("score", slots, {"prompts": prompts, "candidates": candidates})

    def generate(
        self,
        slots: list[int],
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        stop,
        greedy: bool,
        temperature: float,
        seeds: list[int] | None = None,
    ) -> list[tuple[list[int], float]]:
        import ray

        if id(stop) not in self._stops:  # sent once; the stop rule holds the tokenizer
            self._stops[id(stop)] = (stop, ray.put(stop))
        columns = {"prompts": prompts} if seeds is None else {"prompts": prompts, "seeds": seeds}
        return self._fan(
            "generate",
            slots,
            columns,
            max_new_tokens=max_new_tokens,
            stop=self._stops[id(stop)][1],
            greedy=greedy,
            temperature=temperature,
        )

    def placement(self) -> dict:
        import ray

        return {**ray.get(self.replicas[0].call.remote("placement")), "replicas": len(self.replicas)}


def rollout_backend(params, base_dir: Path, policy_dir: Path, slots: int = 0) -> tuple[RolloutBackend, object]:
    """(backend, tokenizer) for a rollout stage's actor: `local_backend` in this process, or with
    `policy.replicas`, Ray actors that each build one (`RayPolicyBackend`). `slots`: the stage's batch."""
    if params.policy.replicas:
        from qevolve.models.base import load_tokenizer

        return RayPolicyBackend(params, base_dir, policy_dir, slots), load_tokenizer(base_dir)
    from qevolve.models.policy import local_backend

    return local_backend(params, base_dir, policy_dir, slots)
