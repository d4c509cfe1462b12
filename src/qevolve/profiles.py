"""Profiles: `profiles/<name>.yaml` holds only what differs from the checkout's params.yaml (the defaults, ALFWorld's
quickstart). A section of the profile merges into params.yaml's key by key, and so does a section inside a section
(`model.lora`); a value replaces params.yaml's whole, lists and mappings that are values too (`experts.demos`,
`evaluate.splits`): TextCraft's `demos: {planner: 300}` is its only expert, not one more. A workspace records the
resolved file, so DVC's lineage sees every value as before. `qevolve profile NAME` prints it."""

from __future__ import annotations

import copy
from pathlib import Path

import yaml
from pydantic import BaseModel

from qevolve.config import ConfigError, params_model, read_yaml
from qevolve.errors import inside


def find(root: Path, name: str) -> Path:
    """`root`'s `profiles/<name>.yaml` (a name that would leave profiles/ is refused)."""
    path = inside(root / "profiles", f"{name}.yaml", "profile")
    if not path.exists():
        known = sorted(p.stem for p in (root / "profiles").glob("*.yaml"))
        raise UnknownProfile(f"profile {name!r}: no {path}; expected one of {known}")
    return path


class UnknownProfile(ConfigError):
    hint = "a new profile is a file in profiles/ that lists only what differs from params.yaml"


def overlay(base: dict, changes: dict, model: type[BaseModel] | None = None) -> dict:
    """`base` with `changes` over it: where `model` (the params schema) says a key is a section, key by key;
    anywhere else the change's value whole. `base` and `changes` are left as they are."""
    model = params_model() if model is None else model
    out = copy.deepcopy(base)
    for key, value in changes.items():
        section = _section(model, key)
        if section is not None and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = overlay(out[key], value, section)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _section(model: type[BaseModel] | None, key: str) -> type[BaseModel] | None:
    field = model.model_fields.get(key) if model is not None else None
    kind = field.annotation if field is not None else None
    return kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None


def resolve(path: Path | str) -> dict:
    """The parameters of a params file: a profile (a file in a `profiles/` folder not named params.yaml) over the
    params.yaml beside that folder; any other file as it is."""
    path = Path(path)
    profile = path.parent.name == "profiles" and path.name != "params.yaml"
    raw = read_yaml(path, empty_ok=profile)
    if not profile:
        return raw
    base = path.parent.parent / "params.yaml"
    if not base.exists():
        raise ConfigError(
            f"{path}: a profile lists what differs from the checkout's params.yaml, and there is no {base}"
        )
    return overlay(read_yaml(base), raw)


def render(raw: dict) -> str:
    return yaml.safe_dump(raw, sort_keys=False)
