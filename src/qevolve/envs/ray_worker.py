"""Environment workers as Ray actors (`env.worker: ray`): the contract of `EnvWorker`, with Ray placing the
environments, on this machine or across a cluster's nodes.

Each actor holds one environment and reserves `env.ray_cpus` CPUs. Every call waits at most `step_timeout`
seconds (the first `start_timeout`); an actor that dies or hangs is killed and the call raises
`EnvWorkerError`, so `rollout.play` restarts the episode on a fresh actor, as with worker processes. An
error inside the environment passes through as a `RuntimeError`, and the actor lives on.

The stage joins the cluster `RAY_ADDRESS` names (`ray start --head` on one node, `ray start --address=...`
on the others), or starts a local one on loopback with a 256 MB object store. Nothing of Prefect runs in
the actors (they import only the environment), so they need no Prefect server.
"""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING

from qevolve.envs.worker import EnvWorkerError, RemoteEnv

if TYPE_CHECKING:
    from qevolve.config import EnvConfig

OBJECT_STORE_BYTES = 256 * 2**20
"""A local cluster's object store: environment calls move kilobytes (Ray's default takes 30% of RAM)."""


class _EnvActor:
    def __init__(self, cfg: EnvConfig, expert: str | None):
        from qevolve.environments import adapter

        self.env = adapter(cfg.name).create(cfg, expert)

    def pid(self) -> int:
        return os.getpid()

    def call(self, op: str, args: tuple):
        if op == "seed_random":
            return getattr(self.env, "seed_random", random.seed)(*args)
        return getattr(self.env, op)(*args)

    def close(self) -> None:
        self.env.close()


def connect() -> None:
    """Join the cluster at `RAY_ADDRESS`, or start a local one bound to loopback, once per process."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    else:
        ray.init(
            num_cpus=os.cpu_count(),
            include_dashboard=False,
            object_store_memory=OBJECT_STORE_BYTES,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
            runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
        )


class RayEnvWorker(RemoteEnv):
    """A `TextEnv` served by a Ray actor (see the module docstring)."""

    def __init__(self, cfg: EnvConfig, expert: str | None = None):
        import ray

        super().__init__(cfg)
        connect()
        self.actor = ray.remote(num_cpus=cfg.ray_cpus, max_restarts=0)(_EnvActor).remote(cfg, expert)
        self._pid: int | None = None

    @property
    def pid(self) -> int:
        """The actor's process id (on its node)."""
        if self._pid is None:
            self._pid = self._call("pid")
        return self._pid

    def _call(self, op: str, *args):
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        timeout = self._next_timeout()
        ref = self.actor.pid.remote() if op == "pid" else self.actor.call.remote(op, args)
        try:
            return ray.get(ref, timeout=timeout)
        except GetTimeoutError:
            self.kill()
            raise EnvWorkerError(f"environment actor: {op} took longer than {timeout:g} s; killed it") from None
        except RayActorError as err:
            self.kill()
            raise EnvWorkerError(f"environment actor died during {op} ({type(err).__name__})") from None
        except RayTaskError as err:  # raised inside the environment: the caller decides what it means
            raise RuntimeError(f"{type(err.cause).__name__}: {err.cause}") from None

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    def close(self) -> None:
        import ray

        try:
            ray.get(self.actor.close.remote(), timeout=10)
        except Exception:  # noqa: BLE001 - closing a broken actor: kill it instead
            pass
        self.kill()
