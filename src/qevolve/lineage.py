"""What is lineage and what is not: the keys that say where and how a stage computes (`EXECUTION_PATHS`) are left
out of DVC's params (`qevolve.dvcfile`) and of an evolution's identity (`lineage_dump`); everything else a stage
reads is its lineage (`qevolve.config.recorded_reads`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qevolve.config import Section


EXECUTION_PATHS = (
    "model.device",
    "train",
    "env.worker",
    "env.ray_cpus",
    "policy.backend",
    "policy.compile",
    "policy.gpu_memory",
    "policy.replicas",
    "policy.replica_cpus",
)
"""Where and how a stage computes, not what: left out of DVC's params and of the evolution's identity."""


def _exclusion(paths: tuple[str, ...]) -> dict:
    """Dotted keys as pydantic's `model_dump(exclude=...)` takes them: {"model": {"device"}, "train": True}."""
    out: dict = {}
    for path in paths:
        section, _, key = path.partition(".")
        out[section] = True if not key else out.get(section, set()) | {key}
    return out


EXECUTION_KEYS = _exclusion(EXECUTION_PATHS)


def lineage_dump(params: Section) -> dict:
    """The parameters that decide what the pipeline computes (`EXECUTION_KEYS` left out)."""
    return params.model_dump(exclude=EXECUTION_KEYS)
