"""TerminalTraj's own section of params.yaml, `terminaltraj` (arXiv 2602.01244; ../shared/research/terminaltraj.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from qevolve.config import Section

INSTANCES = "data/instances"
"""Where `generate` writes the task folders, and so what `env.data_dir` is under this method."""
REJECTIONS = ("unusable", "oracle_fails", "noop_passes", "flaky")
"""Why `generate` drops a candidate task: the model's answer is no task, or the sanity gate's reason."""
LABELS = "labels.json"
"""The file in `verify`'s folder: per rollout, the validators' and the judge's verdicts."""


class GenerateConfig(Section):
    """`generate`, from the template families (`templates`: `per_family` tasks of each of `families`, seeds
    0..per_family-1 shifted by `seed`) or by a chat model at `url` reading the repositories in `sources`
    (`llm`: `per_source` tasks of each; `qevolve.methods.terminaltraj.author`). The `held_out` families
    (under `llm`, repositories) go to `test_ood` whole, the other tasks to `test` with probability
    `test_share` (by a hash of the task id) and to `train` otherwise."""

    kind: Literal["templates", "llm"] = "templates"
    families: list[str] = Field(
        default_factory=lambda: ["files", "text", "csv", "json", "archive", "python", "sqlite", "service"], min_length=1
    )
    held_out: list[str] = Field(default_factory=lambda: ["sqlite", "service"])
    per_family: int = Field(25, gt=0)
    test_share: float = Field(0.2, ge=0, lt=1)
    seed: int = 0
    sources: str = ""
    """`llm`: a folder with one sub-folder per source repository (a DVC dep of `generate`); a relative path
    is relative to the workspace (where params.yaml is)."""
    per_source: int = Field(1, gt=0)
    """`llm`: tasks asked for per repository."""
    max_source_chars: int = Field(12000, gt=0)
    """`llm`: how much of a repository's text the model reads."""
    url: str = ""
    """`llm`: the base URL of an OpenAI-compatible server (…/v1)."""
    model: str = ""
    """`llm`: the model name sent to `url`."""
    temperature: float = Field(0.7, ge=0)
    timeout_s: float = Field(120.0, gt=0)
    """`llm`: how long one answer may take."""

    @field_validator("families", "held_out")
    @classmethod
    def _known(cls, v: list[str], info: ValidationInfo) -> list[str]:
        if info.data.get("kind") == "llm":
            return v  # under `llm`, `held_out` names repositories (checked against `sources` when `generate` runs)
        from qevolve.envs.terminal_tasks import FAMILIES

        bad = [f for f in v if f not in FAMILIES]
        if bad:
            raise ValueError(f"unknown task family(ies) {bad}; expected some of {list(FAMILIES)}")
        return v

    @model_validator(mode="after")
    def _sources(self) -> GenerateConfig:
        if self.kind == "llm" and not self.sources:
            raise ValueError("sources: generate `llm` reads source repositories; set the folder that holds them")
        return self


class TeacherConfig(Section):
    """`teacher`: `rollouts` episodes per train task (the paper's "each query sampled several times") by the
    noisy scripted teacher (`scripted`: the oracle with a mistake in place of a command at `p_err`, then a
    look and the right command at `p_fix`; it always submits) or by a chat model at `url` (`llm`: one
    command per turn, sampled at `temperature`, until it submits or `env.max_steps`)."""

    kind: Literal["scripted", "llm"] = "scripted"
    rollouts: int = Field(4, gt=0)
    p_err: float = Field(0.3, ge=0, le=1)
    p_fix: float = Field(0.5, ge=0, le=1)
    seed: int = 0
    url: str = ""
    """`llm`: the base URL of an OpenAI-compatible server (…/v1)."""
    model: str = ""
    """`llm`: the model name sent to `url`."""
    temperature: float = Field(0.7, ge=0)


class JudgeConfig(Section):
    """`verify`'s judge beside the validators, reading the instruction and the transcript only, as the
    paper's: `transcript`, an offline rule standing in for an LLM judge (it accepts a submitted episode
    whose last command exited 0 and whose last `window` outputs show no error; it is not an LLM), or
    `llm`, a chat model at `url` asked for a pass/fail verdict."""

    kind: Literal["transcript", "llm"] = "transcript"
    window: int = Field(3, gt=0)
    url: str = ""
    """`llm`: the base URL of an OpenAI-compatible server (…/v1)."""
    model: str = ""


class FilterConfig(Section):
    """`filter`: the rollouts kept for `bc`: those the validators passed (`validator`, the paper's), those
    the judge accepted (`judge`), or all (`none`); then at most `n` of them, drawn with `seed` (0 = all)."""

    keep: Literal["validator", "judge", "none"] = "validator"
    n: int = Field(0, ge=0)
    seed: int = 0


class TerminalTrajConfig(Section):
    generate: GenerateConfig = GenerateConfig()
    teacher: TeacherConfig = TeacherConfig()
    judge: JudgeConfig = JudgeConfig()
    filter: FilterConfig = FilterConfig()


SECTIONS = {"terminaltraj": TerminalTrajConfig}


def check(params) -> None:
    if params.method != "terminaltraj":
        return
    if params.env.name != "terminal":
        raise ValueError(
            f"env.name: TerminalTraj trains terminal agents; use env.name: terminal, got {params.env.name!r}"
        )
    if params.env.data_dir != INSTANCES:
        raise ValueError(
            f"env.data_dir: under TerminalTraj the tasks are the ones `generate` writes; set env.data_dir: "
            f"{INSTANCES}, "
            f"got {params.env.data_dir!r}"
        )
    for name in ("generate", "teacher", "judge"):
        cfg = getattr(params.terminaltraj, name)
        if cfg.kind == "llm" and not cfg.url.startswith(("http://", "https://")):
            raise ValueError(
                f"terminaltraj.{name}.url: {name} `llm` needs the http(s) URL of an OpenAI-compatible server "
                f"(…/v1), got {cfg.url!r}"
            )
