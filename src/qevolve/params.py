"""`Params`, the model of params.yaml, and its loading: the shared sections (`qevolve.config`) with every installed
method's own (`qevolve.methods.<name>.config`), found by name and assembled at first use; params.yaml and the profiles
read from YAML (a key given twice refused), overlaid and validated, errors naming the file and each key.

Profiles: `profiles/<name>.yaml` holds only what differs from the checkout's params.yaml (the defaults, ALFWorld's
quickstart). A section of the profile merges into params.yaml's key by key, and so does a section inside a section
(`model.lora`); a value replaces params.yaml's whole, lists and mappings that are values too (`experts.demos`,
`evaluate.splits`): TextCraft's `demos: {planner: 300}` is its only expert, not one more. A workspace records the
resolved file, so DVC's lineage sees every value. `qevolve profile NAME` prints it."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import pkgutil
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from pydantic import BaseModel, ValidationError, create_model, field_validator, model_validator

from qevolve.config import CommonParams, ConfigError, Section
from qevolve.errors import inside


def methods() -> list[str]:
    """The methods this installation has: the packages under `qevolve.methods`, found by name (the one place
    where shared code reaches up to the methods: `qevolve.recipe.load_recipe` and `Params` import them so)."""
    package = importlib.util.find_spec("qevolve.methods")
    return sorted(m.name for m in pkgutil.iter_modules(package.submodule_search_locations) if m.ispkg)


_assembling = False


@cache
def _method_configs() -> list:
    """Each method package's `config` module, where it has one: its own sections (`SECTIONS`) and its
    rules across sections (`check(params)`), imported when `Params` is first used, never while importing."""
    global _assembling

    if _assembling:
        raise ImportError(
            "qevolve.params.Params was used while the method packages were being imported to build it: a method's "
            "package (its __init__ or config) imports a module that uses Params at import time; import it under "
            "TYPE_CHECKING there, or inside the function that needs it"
        )
    _assembling = True
    try:
        names = [f"qevolve.methods.{m}.config" for m in methods()]
        return [importlib.import_module(n) for n in names if importlib.util.find_spec(n) is not None]
    finally:
        _assembling = False


class _WithMethods(CommonParams):
    """The shared sections with the rules that depend on which methods are installed."""

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str) -> str:
        if method not in methods():
            raise ValueError(f"unknown method {method!r}; expected one of {methods()}")
        return method

    @model_validator(mode="after")
    def _methods_rules(self) -> _WithMethods:
        for module in _method_configs():
            if hasattr(module, "check"):
                module.check(self)
        return self


def method_sections() -> dict[str, type[Section]]:
    """Every method's own sections, by key (`critic`, `online`, ...): all are valid in every params file,
    whichever method it picks (a table's rows share one file's sections)."""
    found: dict[str, type[Section]] = {}
    for module in _method_configs():
        for name, cls in module.SECTIONS.items():
            if name in CommonParams.model_fields or found.get(name, cls) is not cls:
                raise TypeError(
                    f"{module.__name__}: section {name!r} is already a section of params.yaml; name it after the method"
                )
            found[name] = cls
    return found


@cache
def params_model() -> type[CommonParams]:
    """`Params`, the model of params.yaml: the shared sections and every method's own, assembled at its first use."""
    return create_model(
        "Params",
        __base__=_WithMethods,
        __doc__="params.yaml: the shared sections and every method's own.",
        **{name: (cls, cls()) for name, cls in method_sections().items()},
    )


if TYPE_CHECKING:
    Params = CommonParams


def __getattr__(name: str):
    if name == "Params":  # `from qevolve.params import Params`: built when first asked for, after every module loaded
        return params_model()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _format_errors(path: Path | str, err: ValidationError) -> str:
    lines = [f"{path}: invalid parameters"]
    for e in err.errors():
        if not e["loc"]:  # a rule across sections: its message names the keys; the whole file is no use as "got"
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
            continue
        key = ".".join(str(p) for p in e["loc"])
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {key}: {msg} (got {e.get('input')!r})")
    return "\n".join(lines)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise ConfigError(
                    f"key {key!r} appears twice in one mapping (lines {seen[key]} and {key_node.start_mark.line + 1}); "
                    "YAML would silently keep the last one"
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def parse_params(raw: dict, source: Path | str = "<params>") -> Params:
    try:
        return params_model().model_validate(raw or {})
    except ValidationError as err:
        raise ConfigError(_format_errors(source, err)) from None


def read_yaml(path: Path | str, empty_ok: bool = False) -> dict:
    """A params file's mapping, unvalidated (a key given twice, bad YAML or no mapping: a `ConfigError` naming the
    file)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: params file not found")
    try:
        raw = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None
    if raw is None and not empty_ok:
        raise ConfigError(f"{path}: the file is empty; expected a mapping of sections (copy params.yaml to start)")
    if not isinstance(raw, dict | None):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    return raw or {}


def load_params(path: Path | str = "params.yaml") -> Params:
    """A params file validated: params.yaml, or a profile over it (`resolve_params`)."""
    return parse_params(resolve_params(path), path)


def find_profile(root: Path, name: str) -> Path:
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
        section = section_model(model, key)
        if section is not None and isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = overlay(out[key], value, section)
        else:
            out[key] = copy.deepcopy(value)
    return out


def section_model(model: type[BaseModel] | None, key: str) -> type[BaseModel] | None:
    """The model of `key` in `model` where that key is a section (a sub-model), else None."""
    field = model.model_fields.get(key) if model is not None else None
    kind = field.annotation if field is not None else None
    return kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None


def resolve_params(path: Path | str) -> dict:
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
