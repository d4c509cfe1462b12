"""`terminaltraj.generate.kind: llm`: a chat model reads a source repository and writes a terminal task
that needs the repository's scripts and code run (the paper's "Docker-aligned" instance generation, its
S3; ../shared/research/terminaltraj.md): an instruction, a pytest validator of the end state, the oracle's
commands and, per command, the mistakes a teacher might make instead.

`sources` is a folder with one sub-folder per repository. A task's working directory is a copy of its
repository (a `setup.sh` at the repository's top runs as the task's setup, as an imported task's); the
model sees the repository's text files, at most `max_source_chars` of them, and is asked `per_source`
times. An answer that is not the JSON asked for is counted as `unusable` and dropped; the sanity gate then
judges the rest exactly as it judges the template families' tasks."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from qevolve.envs.terminal_tasks import Spec, write_task
from qevolve.llm import LLMError, chat, json_content

TEXT = {
    ".md",
    ".rst",
    ".txt",
    ".sh",
    ".py",
    ".toml",
    ".cfg",
    ".ini",
    ".json",
    ".yaml",
    ".yml",
    ".csv",
    ".sql",
    ".js",
    ".ts",
    ".go",
    ".c",
    ".h",
    ".cpp",
    ".hpp",
    ".java",
    ".php",
    ".html",
    ".rb",
    ".rs",
    ".pl",
    ".r",
    ".mk",
}
NAMED = {"Makefile", "Dockerfile", "README", "LICENSE", "requirements.txt"}
SKIP = {".git", "__pycache__", "node_modules", ".venv", "venv"}

SYSTEM = """You write tasks for training terminal agents. Each task asks the agent to do something in a Linux shell that needs the given \
repository's scripts or code run (not only read). The agent's working directory holds the repository's files, the shell has no network \
and nothing can be installed; python3, pytest and the usual command-line tools are there.
Answer with one JSON object, nothing else, with these keys:
- "instruction": the request, as a user would write it; name every file the result must be written to.
- "tests": a pytest file checking only the end state of the working directory (files made, their contents, outputs), never which \
commands ran. It must fail before the task is done and pass after. It runs from the working directory.
- "solution": the shell commands that do the task, one per item, each non-interactive.
- "mistakes": for each solution command, a list of plausible wrong commands an agent might run in its place (may be empty).
- "domain": one or two words, e.g. "data processing", "sql", "build".
- "difficulty": "easy", "medium" or "hard"."""  # noqa: E501 - the prompt's words as the model reads them


class AuthorError(LLMError):
    hint = (
        "terminaltraj.generate.url must be the base of an OpenAI-compatible server (…/v1) that answers "
        "/chat/completions"
    )


def repositories(sources: Path) -> list[Path]:
    if not sources.is_dir():
        raise AuthorError(
            f"terminaltraj.generate.sources = {str(sources)!r}: not a folder (expected one sub-folder per source "
            f"repository)"
        )
    repos = sorted(p for p in sources.iterdir() if p.is_dir() and p.name not in SKIP and not p.name.startswith("."))
    if not repos:
        raise AuthorError(f"terminaltraj.generate.sources = {str(sources)!r}: no repository sub-folders in it")
    return repos


def _files(repo: Path) -> list[Path]:
    """The repository's files, links left out: what a link leads to (a host file) is never read or copied."""
    out = []
    for top, _dirs, files in os.walk(repo):  # links to folders are listed, not entered
        for name in files:
            path = Path(top) / name
            if not path.is_symlink() and path.is_file() and not SKIP & set(path.relative_to(repo).parts):
                out.append(path)
    return sorted(out)


def _text_files(repo: Path) -> Iterator[Path]:
    for path in _files(repo):
        if path.suffix.lower() in TEXT or path.name in NAMED:
            yield path


def context(repo: Path, budget: int) -> str:
    """The repository as the model reads it: its file list, then its text files in order until `budget`
    characters (the last one cut). Links are left out."""
    files = _files(repo)
    parts = [f"Repository {repo.name}, files:\n" + "\n".join(str(p.relative_to(repo)) for p in files)]
    left = budget - len(parts[0])
    for path in _text_files(repo):
        if left <= 0:
            break
        body = path.read_text(errors="replace")[:left]
        parts.append(f"\n--- {path.relative_to(repo)} ---\n{body}")
        left -= len(body)
    return "\n".join(parts)


def _skipped(folder: str, names: list[str]) -> set[str]:
    """What the task's environment does not take from the repository: `SKIP`'s folders, and links."""
    return {n for n in names if n in SKIP or os.path.islink(os.path.join(folder, n))}


def _strings(value, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"{key}: expected a list of non-empty strings")
    return value


def parse(answer: str, repository: str) -> Spec:
    """The task in a model's answer, its family (the task's type) the repository's name and its domain in
    `extra`; ValueError naming the field when it is not the JSON asked for."""
    data = json_content(answer)
    if not isinstance(data, dict):
        raise ValueError("expected a JSON object")
    for key in ("instruction", "tests"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise ValueError(f"{key}: expected non-empty text")
    solution = _strings(data.get("solution"), "solution")
    mistakes = data.get("mistakes") or []
    if not isinstance(mistakes, list) or len(mistakes) > len(solution):
        raise ValueError("mistakes: expected at most one list per solution command")
    mistakes = [_strings(m, "mistakes[]") if m else [] for m in mistakes]
    domain = re.sub(r"[^a-z0-9]+", "-", str(data.get("domain") or "repository").lower()).strip("-") or "repository"
    difficulty = data.get("difficulty") if data.get("difficulty") in ("easy", "medium", "hard") else "medium"
    return Spec(
        repository,
        data["instruction"].strip(),
        {},
        data["tests"],
        solution,
        mistakes,
        difficulty=difficulty,
        extra={"domain": domain},
    )


def author(cfg, repo: Path, text: str, attempt: int, folder: Path) -> str:
    """Ask for a task on `repo` and write it to `folder`: '' when written, 'unusable' when the answer is not
    a task (the folder is then not made). A server that does not answer is an `AuthorError`."""
    user = (
        f"{text}\n\nWrite task number {attempt + 1} for this repository; make it different from an obvious "
        f"first one when the number is above 1."
    )
    answer = chat(
        cfg.url,
        cfg.model,
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        key="terminaltraj.generate.url",
        temperature=cfg.temperature,
        timeout=cfg.timeout_s,
        error=AuthorError,
    )
    try:
        spec = parse(answer, repo.name)
    except ValueError:
        return "unusable"
    write_task(spec, folder)
    shutil.copytree(repo, folder / "environment", dirs_exist_ok=True, ignore=_skipped)
    source = f"\n[source]\nrepository = {json.dumps(repo.name)}\ndomain = {json.dumps(spec.extra['domain'])}\n"
    (folder / "task.toml").write_text((folder / "task.toml").read_text() + source)
    return ""
