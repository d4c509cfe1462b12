"""Run an environment in its own process, so a crash or a hang costs one episode, never the run.

`EnvWorker` is a `TextEnv` whose calls go over a pipe to a child process that owns the real environment.
Every call waits at most `timeout` seconds (the first one, which starts the simulator, `start_timeout`).
When the child dies (a killed JVM, a segfault) or a call runs past its timeout, the child is killed and
the call raises `EnvWorkerError`; the caller (`rollout.play`, the experts stage) restarts the episode
on a fresh worker. Calls block in the pipe without the GIL, so one thread per worker steps many
environments at once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from qevolve.envs.base import Observation, Step, Task

if TYPE_CHECKING:
    from qevolve.config import EnvConfig


class EnvWorkerError(RuntimeError):
    """The worker process died or did not answer in time; it has been killed."""


def _serve(conn, cfg: EnvConfig, expert: str | None) -> None:
    from qevolve.environments import adapter

    env = adapter(cfg.name).create(cfg, expert)
    while True:
        try:
            op, args = conn.recv()
        except EOFError:  # the parent is gone (killed): leave at once, see below
            os._exit(0)
        if op == "close":
            env.close()
            conn.send((True, None))
            break
        try:
            reply = (
                True,
                getattr(env, "seed_random", random.seed)(*args) if op == "seed_random" else getattr(env, op)(*args),
            )
        except Exception as err:  # noqa: BLE001 - the parent decides what an environment error means
            reply = (False, RuntimeError(f"{type(err).__name__}: {err}"))
        try:
            conn.send(reply)
        except OSError:  # the parent died while we worked. Exit without closing the simulator: a JVM
            os._exit(0)  # exits when our pipe to it closes, and a normal shutdown could wait on it forever


class RemoteEnv(ABC):
    """A `TextEnv` whose calls go to an environment elsewhere through `_call(op, *args)`, which raises
    `EnvWorkerError` when the server died or hung (and kills it)."""

    def __init__(self, cfg: EnvConfig):
        self.timeout = cfg.step_timeout
        self._first_timeout = cfg.start_timeout
        self._tasks: dict[str, list[Task]] = {}

    def _next_timeout(self) -> float:
        """The first call may take `start_timeout` (it starts the simulator), every later one `step_timeout`."""
        timeout, self._first_timeout = self._first_timeout or self.timeout, None
        return timeout

    @abstractmethod
    def _call(self, op: str, *args): ...

    def reset(self, task: Task) -> Observation:
        return self._call("reset", task)

    def step(self, action: str) -> Step:
        return self._call("step", action)

    def tasks(self, split: str) -> list[Task]:
        if split not in self._tasks:
            self._tasks[split] = self._call("tasks", split)
        return self._tasks[split]

    def expert_action(self) -> str | None:
        return self._call("expert_action")

    def seed_random(self, key: str) -> None:
        """Seed the expert's tie-breaks in the worker (its environment's `seed_random`, else the global `random`)."""
        self._call("seed_random", key)


class EnvWorker(RemoteEnv):
    """A `TextEnv` served by a child process (see the module docstring)."""

    def __init__(self, cfg: EnvConfig, expert: str | None = None):
        super().__init__(cfg)
        ctx = mp.get_context("spawn")  # never fork a process that holds torch threads
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, cfg, expert), daemon=True, name=f"env-{cfg.name}")
        self.process.start()
        child.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    def _call(self, op: str, *args):
        if not self.process.is_alive():
            raise EnvWorkerError(
                f"environment worker {self.process.pid} is not running (exit code {self.process.exitcode})"
            )
        timeout = self._next_timeout()
        try:
            self._conn.send((op, args))
            if not self._conn.poll(timeout):
                self.kill()
                raise EnvWorkerError(
                    f"environment worker {self.process.pid}: {op} took longer than {timeout:g} s; killed it"
                )
            ok, value = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self.process.join(1)
            code = self.process.exitcode
            self.kill()
            raise EnvWorkerError(f"environment worker {self.process.pid} died during {op} (exit code {code})") from None
        if not ok:
            raise value
        return value

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._call("close")
                self.process.join(10)  # let it exit on its own; a kill mid-shutdown leaks its semaphores
            except Exception:  # noqa: BLE001 - closing a broken worker: kill it instead
                pass
        self.kill()
        self._conn.close()
