"""The flow, dvc.yaml and MLflow agree; one end-to-end run of the flow on a tiny subset."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO
from qevolve.params import resolve_params

DVC = str(Path(sys.executable).with_name("dvc"))  # the venv's dvc, whether or not the venv is activated

TINY = {
    "env": {"max_steps": 6},
    "experts": {"demos": {"handcoded": 2, "walkthrough": 3}, "workers": 2},
    "model": {
        "embedded": {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab_size": 400},
        "context_tokens": 256,
        "lora": {"r": 8, "alpha": 16},
    },
    "bc": {"epochs": 2, "batch_size": 4},
    "evaluate": {"splits": {"valid_seen": 2, "valid_unseen": 1}, "batch_size": 3},
    "collect": {"num_tasks": 2, "samples_per_task": 2, "batch_size": 4},
    # Enough epochs that the critic and policy stages each run for a few seconds: the test kills them.
    "critic": {"epochs": 6, "batch_size": 4},
    "policy": {"epochs": 6, "batch_size": 4},
    "evolve": {"iterations": 1},
}


def _dvc_stages(cwd) -> list[str]:
    out = subprocess.run([DVC, "stage", "list", "--name-only"], cwd=cwd, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_flow_and_dvc_yaml_describe_the_same_stages(tmp_path):
    from qevolve import dvcfile
    from qevolve.params import load_params, parse_params
    from qevolve.stages import pipeline, stage_name

    params = load_params(REPO / "params.yaml")
    subprocess.run([DVC, "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    assert (REPO / "dvc.yaml").read_text() == dvcfile.render(params), "run `qevolve dvc-yaml`"
    for n in (params.evolve.iterations, 2):
        p = parse_params({**params.model_dump(), "evolve": {"iterations": n}})
        (tmp_path / "dvc.yaml").write_text(dvcfile.render(p))
        flow = [stage_name(s, k) for s, k in pipeline(p)]
        assert sorted(flow) == sorted(_dvc_stages(tmp_path)) == sorted(dvcfile.stage_names(p))
        assert len(flow) == 4 + 7 * n


def _method_params() -> dict:
    """method -> parameters that use every stage of its recipe (`Recipe.smoke`: Q-Evolve's with reranking,
    Multi²'s with two iterations, its online phase starting at the second)."""
    from qevolve.params import methods, parse_params
    from qevolve.recipe import load_recipe

    return {m: parse_params({"method": m, "evolve": {"iterations": 1}, **load_recipe(m).smoke}) for m in methods()}


def _stage_modules() -> dict[tuple[str, str], str]:
    """(method, stage) -> the module of its function, over every method's recipe."""
    from qevolve.recipe import load_recipe

    return {(m, s.name): s.module for m, p in _method_params().items() for s in load_recipe(m).stages(p)}


def test_stages_do_not_import_orchestration():
    code = (
        "import sys, qevolve.cli, qevolve.dvcfile\n"
        f"for m in {sorted(set(_stage_modules().values()))!r}: __import__(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'mlflow', 'dvc'))\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_module_imports_a_stage():
    """Shared machinery (prompts, training loop, rollouts, advantages) lives outside the stages' modules:
    no module imports a stage's module (the runner reaches them through the recipes, by name)."""
    from qevolve.dvcfile import PACKAGE, _imports

    stages = set(_stage_modules().values())
    assert (
        "qevolve.stages.bc" in stages
        and "qevolve.methods.qevolve.critic" in stages
        and "qevolve.methods.grpo.online" in stages
    )
    for f in sorted(PACKAGE.rglob("*.py")):
        module = "qevolve." + ".".join(f.relative_to(PACKAGE).with_suffix("").parts)
        found = (_imports(f, module_level_only=False) & stages) - {module}
        assert not found, f"{f.relative_to(PACKAGE)} imports {sorted(found)}"


def test_every_module_a_stage_imports_is_one_of_its_dvc_deps():
    """dvc.yaml's code deps are computed from the imports (`dvcfile.code_deps`); this checks them against
    what importing each stage's module (and the CLI that runs it) really loads."""
    from qevolve import dvcfile

    def loaded(code: str) -> set[str]:
        listing = (
            "\nimport sys\nprint('\\n'.join(m.__file__ for n, m in sys.modules.items() if n.startswith('qevolve')))"
        )
        out = subprocess.run([sys.executable, "-c", code + listing], capture_output=True, text=True, check=True).stdout
        return {
            str(Path(f).resolve().relative_to(REPO)) for f in out.split() if Path(f).stat().st_size
        }  # empty __init__ files aside

    # Validating params.yaml builds `Params`, which imports every method's package and config
    # (`params.method_sections`) and what they import; they declare sections and stages this stage never
    # reads or runs (`check_reads` enforces that on every run), so they are no dep unless its own code reaches them.
    assembly = loaded("import qevolve.params; qevolve.params.params_model()") - loaded("import qevolve.params")
    deps = {
        (m, name): set(s.get("do", s)["deps"])
        for m, p in _method_params().items()
        for name, s in dvcfile.spec(p)["stages"].items()
    }
    for stage, module in _stage_modules().items():
        own = f"src/qevolve/methods/{module.split('.')[2]}/" if module.startswith("qevolve.methods.") else None
        excused = {f for f in assembly if not (own and f.startswith(own))}
        found = loaded(f"import qevolve.cli, {module}") - excused
        assert found <= deps[stage], f"{stage}: dvc.yaml misses {sorted(found - deps[stage])}"
    # The gaps of the old hand-kept lists: the prompt builder's and the advantage reader's modules; the recipe.
    assert {
        "src/qevolve/models/prompt.py",
        "src/qevolve/data/advantages.py",
        "src/qevolve/methods/qevolve/__init__.py",
    } <= deps["qevolve", "policy"]
    assert "src/qevolve/models/prompt.py" in deps["qevolve", "collect"]
    assert not any(
        "methods/qevolve" in d for d in deps["qevolve", "bc"]
    )  # a method's recipe is no dep of the shared stages
    # A hierarchical stage depends on the method's section (its defaults) and on the shared hierarchy.
    for method in ("step_hrl", "multi2"):
        assert {
            "src/qevolve/hierarchy/roles.py",
            "src/qevolve/hierarchy/config.py",
            f"src/qevolve/methods/{method}/config.py",
            "src/qevolve/stages/hierarchical/bc.py",
        } <= deps[method, "bc"]
        assert not any(
            f"methods/{other}/" in d
            for other in ("step_hrl", "multi2")
            if other != method
            for d in deps[method, "annotate"]
        )


def test_a_stage_depends_on_its_own_environments_adapter_only():
    """`make_env` imports the adapter by name (`qevolve.environments.adapter`), so dvc.yaml adds the module
    of `env.name` to every stage that can build an environment, and no other environment's module."""
    from qevolve import dvcfile
    from qevolve.params import load_params

    for profile, own in (("alfworld", "alfworld.py"), ("textcraft", "textcraft.py"), ("webshop", "webshop.py")):
        stages = dvcfile.spec(load_params(REPO / "profiles" / f"{profile}.yaml"))["stages"]
        envs = {
            stage: {d.rsplit("/", 1)[1] for d in s.get("do", s)["deps"] if d.startswith("src/qevolve/envs/")}
            for stage, s in stages.items()
        }
        adapters = {f"{name}.py" for name in ("alfworld", "scienceworld", "webshop", "textcraft", "terminal")}
        assert envs["experts"] & adapters == {own} and envs["evaluate"] & adapters == {own}, (profile, envs)
        assert not envs["base"] & adapters  # builds no environment


def test_dvc_params_deps_are_the_keys_the_file_sets():
    """A key the file leaves out is not a DVC params dep (DVC would refuse it as missing); its default
    lives in config.py, which every stage's code deps cover."""
    from qevolve import dvcfile
    from qevolve.params import parse_params

    stages = lambda raw: dvcfile.spec(parse_params({"evolve": {"iterations": 1}, **raw}))["stages"]  # noqa: E731
    assert "prompt.max_observation_tokens" not in stages({})["collect"]["do"]["params"]
    assert (
        "prompt.max_observation_tokens"
        in stages({"prompt": {"max_observation_tokens": 512}})["collect"]["do"]["params"]
    )
    assert "src/qevolve/config.py" in stages({})["collect"]["do"]["deps"]


def _workspace(tmp_path, **extra):
    """A git checkout of the repository's tracked files, with tiny parameters (and `extra` sections)."""
    ws = tmp_path / "ws"
    subprocess.run(["git", "clone", "-q", str(REPO), str(ws)], check=True)
    # Copy tracked files from the working tree too, so the test sees uncommitted edits.
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for rel in tracked:
        if (REPO / rel).is_file():
            shutil.copyfile(REPO / rel, ws / rel)
    params = yaml.safe_load((ws / "params.yaml").read_text())
    for section, values in {**TINY, **extra}.items():
        params.setdefault(section, {}).update(values)
    (ws / "params.yaml").write_text(yaml.safe_dump(params))
    return ws


def _flow(ws, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "flows.evolve"],
        cwd=ws,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ws)},
        **kw,
    )


def _finish(proc) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return out


def _stages_run(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("stages run:")).split(";")[0]


def _kill_mid_training(ws, stage: str) -> str:
    """Start the flow and SIGKILL it once `stage` has written its first in-stage checkpoint; return the output."""
    proc = _flow(ws)
    checkpoint = ws / "models" / f".{stage}.checkpoint"
    deadline = time.time() + 500
    while time.time() < deadline and proc.poll() is None and not checkpoint.exists():
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    assert not (ws / "metrics" / f"{stage}.json").exists(), f"{stage} finished before the kill"
    return out


def test_flow_end_to_end_resumes_after_kill_and_leaves_dvc_clean(tmp_path, alfworld_data):
    ws = _workspace(tmp_path)
    # 1. Kill the flow in critic@1's training, then in policy@1's; each re-run resumes at the killed
    # stage, and inside it at its last checkpoint.
    _kill_mid_training(ws, "critic@1")
    relabelled = (ws / "metrics" / "relabel@1.json").stat().st_mtime_ns
    out = _kill_mid_training(ws, "policy@1")
    assert "critic: resuming from the checkpoint at step" in out
    assert (ws / "metrics" / "relabel@1.json").stat().st_mtime_ns == relabelled  # not redone
    assert (ws / "models" / "critic@1").is_dir() and not (ws / "models" / ".critic@1.checkpoint").exists()

    # 2. Re-run to the end: only what the kill interrupted, and after it.
    out = _finish(_flow(ws))
    assert "policy: resuming from the checkpoint at step" in out
    assert _stages_run(out) == "stages run: policy@1, diagnose@1, evaluate@1"
    assert "iter 1" in out and "valid_seen" in out
    assert (
        "mlflow ui" in out
        and "runs?workflowType=machine_learning" in out
        and "dvc dag" in out
        and "prefect server start" in out
    )
    status = subprocess.run([DVC, "status"], cwd=ws, capture_output=True, text=True, check=True).stdout
    assert "up to date" in status, status

    # 3. Again, after damaging BC's adapter: no work at all; the flow restores the recorded version from DVC's cache.
    adapter = ws / "models" / "bc" / "adapter_model.safetensors"
    intact = adapter.read_bytes()
    adapter.write_bytes(intact[: len(intact) // 2])
    out = _finish(_flow(ws))
    assert _stages_run(out) == "stages run: none (all up to date)"
    assert "bc: its outputs no longer matched dvc.lock" in out and adapter.read_bytes() == intact

    # MLflow: a parent run per evolution with the setup stages and the success plot, a child per iteration.
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{ws / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["qevolve"], output_format="list")
    # One evolution across the four attempts: the two killed ones' iteration runs are marked KILLED.
    [parent] = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert parent.info.status == "FINISHED"
    assert (parent.data.tags["qevolve.attempts"], parent.data.tags["qevolve.killed_attempts"]) == ("4", "2")
    listing = mlflow.artifacts.load_text(f"{parent.info.artifact_uri}/environment/packages.txt").splitlines()
    assert listing[0].startswith("python==3.") and any(p.startswith("torch==") for p in listing)
    assert parent.data.tags["qevolve.packages_sha256"] == hashlib.sha256("\n".join(listing).encode()).hexdigest()
    here = json.loads(mlflow.artifacts.load_text(f"{parent.info.artifact_uri}/environment/machine.json"))
    assert (
        here["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and here["cpus"] >= 1 and here["gpus"] == []
    )
    assert parent.data.tags["qevolve.machine"].startswith(f"{here['cpu_model']}, {here['cpu_capability']} kernels, ")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.info.status for r in children) == ["FINISHED", "KILLED", "KILLED"]
    child = next(r for r in children if r.info.status == "FINISHED")
    assert {"bc/loss", "evaluate/valid_seen/success_rate", "experts/success_rate"} <= set(parent.data.metrics)
    assert {
        "critic/v_loss",
        "critic/v_mean_won",
        "policy/kl",
        "policy/clip_fraction",
        "collect/cumulative_env_steps",
        "evaluate/valid_seen/success_rate",
        "advantage/raw_std",
    } <= set(child.data.metrics)
    client = mlflow.MlflowClient()
    assert {"bc_adapter", "trajectories", "success_by_iteration.png"} <= {
        a.path for a in client.list_artifacts(parent.info.run_id)
    }
    assert {"critic_adapter", "policy_adapter", "advantage_hist@1.png"} <= {
        a.path for a in client.list_artifacts(child.info.run_id)
    }
    text = mlflow.artifacts.load_text(f"runs:/{parent.info.run_id}/trajectories/evaluate@0.md")
    assert "Action:" in text
    credit = mlflow.artifacts.load_text(f"runs:/{child.info.run_id}/trajectories/credit@1.md")
    assert "| step | action | aux | reason | A |" in credit


def _kill_after(ws, stage: str, previous_output: str) -> None:
    """Start the flow and SIGKILL it a few seconds after the stage before `stage` wrote its output
    (written atomically, and not tracked in git), i.e. while `stage` runs."""
    proc = _flow(ws)
    done = ws / previous_output
    deadline = time.time() + 500
    while time.time() < deadline and proc.poll() is None and not done.exists():
        time.sleep(0.1)
    time.sleep(3)  # inside the stage: loading the policy and resetting environments alone take longer
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert not (ws / "metrics" / f"{stage}.json").exists(), f"{stage} finished before the kill"


TIMES = ("seconds", "tokens_per_s", "compute_s", "wall_s", "overhead")


def _results(ws) -> dict:
    """Every stage's metrics, without wall-clock measurements."""

    def strip(d):
        if isinstance(d, list):
            return [strip(x) for x in d]
        if isinstance(d, dict):
            return {k: strip(v) for k, v in d.items() if not any(t in k for t in TIMES)}
        return d

    return {
        p.name: strip(json.loads(p.read_text()))
        for p in sorted((ws / "metrics").glob("*.json"))
        if "timing" not in p.name
    }


@pytest.mark.slow
def test_kills_during_every_stage_kind_resume_to_the_same_results(tmp_path, alfworld_data):
    """SIGKILL in each stage kind of an iteration: collect@1, critic@1 and policy@1 mid-training, and
    evaluate@1 (after diagnose@1). Rollout stages restart, training stages resume from their checkpoint; the finished
    evolution's metrics (curves included) equal those of an uninterrupted one exactly."""
    # rollout stages long enough (10-20 s) that a kill 3 s after the previous stage lands inside them
    longer = {
        "collect": {**TINY["collect"], "num_tasks": 6},
        "evaluate": {**TINY["evaluate"], "splits": {"valid_seen": 6, "valid_unseen": 4}},
    }
    clean = _workspace(tmp_path / "clean", **longer)
    _finish(_flow(clean))
    ws = _workspace(tmp_path / "killed", **longer)
    _kill_after(ws, "collect@1", "data/evaluate@0")
    _kill_mid_training(ws, "critic@1")
    assert "critic: resuming from the checkpoint" in _kill_mid_training(ws, "policy@1")
    _kill_after(ws, "evaluate@1", "metrics/diagnose@1.json")
    out = _finish(_flow(ws))
    assert _stages_run(out) == "stages run: evaluate@1"
    assert _results(ws) == _results(clean)


def test_a_profile_runs_in_its_own_workspace_and_leaves_the_checkout_alone(tmp_path, monkeypatch):
    import flows.evolve

    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    monkeypatch.setattr(flows.evolve, "ROOT", tmp_path)
    root = flows.evolve.experiment_workspace("webshop")
    assert root == tmp_path / "runs" / "webshop"
    # The workspace records the profile resolved over params.yaml: every key, so DVC's lineage sees each value.
    written = yaml.safe_load((root / "params.yaml").read_text())
    assert written == resolve_params(REPO / "profiles" / "webshop.yaml") and written["env"]["name"] == "webshop"
    assert written["model"] == yaml.safe_load((REPO / "params.yaml").read_text())["model"]
    assert (root / ".dvc").is_dir() and (root / "src" / "qevolve" / "cli.py").exists()
    assert (root / "data" / "webshop-synthetic" / "items_human_ins.json").exists()
    assert (tmp_path / "params.yaml").read_bytes() == (
        REPO / "params.yaml"
    ).read_bytes()  # nothing written outside runs/
    from qevolve.config import ConfigError

    with pytest.raises(ConfigError, match=r"no .*nosuch.yaml; expected one of \['alfworld', "):
        flows.evolve.experiment_workspace("nosuch")
    # From the Prefect UI's form: a profile, iterations and overrides, validated, in a workspace named by them.
    tuned = flows.evolve.experiment_workspace("textcraft", 2, {"bc.lr": 0.0005})
    assert tuned.parent == tmp_path / "runs" and tuned.name.startswith("textcraft-")
    params = yaml.safe_load((tuned / "params.yaml").read_text())
    assert params["bc"]["lr"] == 0.0005 and params["evolve"]["iterations"] == 2
    with pytest.raises(ConfigError, match=r"bc.lr: Input should be greater than 0"):
        flows.evolve.experiment_workspace("textcraft", None, {"bc.lr": -1})
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(
        ["webshop", tuned.name]
    )  # nothing written for the bad one


def test_a_workspace_or_profile_name_cannot_leave_its_folder(tmp_path, monkeypatch):
    """`--workspace ..` (or the Prefect form's `name`) once made `prepare()` delete the checkout's own src/."""
    import flows.evolve
    from qevolve.errors import BadName

    shutil.copytree(REPO / "profiles", tmp_path / "profiles")
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "keep.py").write_text("x = 1\n")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "link").symlink_to(tmp_path)  # a link out of runs/
    monkeypatch.setattr(flows.evolve, "ROOT", tmp_path)
    for name in ("..", "../..", "/tmp/x", ".hidden", "a/b", "link", "x" * 101, "a b"):
        with pytest.raises(BadName, match=r"workspace: .* (is not a plain name|leads outside)"):
            flows.evolve.experiment_workspace("textcraft", name=name)
    for profile in ("../params", "/etc/passwd", "../../x"):
        with pytest.raises(BadName, match="profile: "):
            flows.evolve.experiment_workspace(profile)
    assert (tmp_path / "src" / "keep.py").read_text() == "x = 1\n" and sorted(
        p.name for p in (tmp_path / "runs").iterdir()
    ) == ["link"]
    assert flows.evolve.experiment_workspace("textcraft", name="my-run_1.b") == tmp_path / "runs" / "my-run_1.b"
    assert (
        flows.evolve.main(["--profile", "textcraft", "--workspace", ".."]) == 2
    )  # the command line says why, no traceback


def test_the_experiment_forms_profile_is_a_menu_of_the_profiles_and_each_field_is_described():
    from prefect.utilities.callables import parameter_schema

    import flows.evolve

    fields = parameter_schema(flows.evolve.experiment).model_dump()["properties"]
    assert fields["profile"]["enum"] == ["", *sorted(p.stem for p in (REPO / "profiles").glob("*.yaml"))]
    assert all(fields[name].get("description") for name in ("profile", "iterations", "overrides", "name"))


def _copied_method(tmp_path, method: str, copy: str, own_section: bool) -> str:
    """Run, with a copy of package `method` named `copy` beside the real ones and nothing else changed, a
    check of its lineage and flow order; print its result. `own_section`: the copy keeps its config module,
    its names changed to its own (a hierarchical method reads the section named after it); otherwise it has
    none and shares `method`'s sections (a section belongs to one package)."""
    shutil.copytree(REPO / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    methods = tmp_path / "src" / "qevolve" / "methods"
    shutil.copytree(methods / method, methods / copy)
    for f in (methods / copy).glob("*.py"):
        if f.name == "config.py" and not own_section:
            f.unlink()
        elif own_section:
            f.write_text(
                f.read_text()
                .replace(f"qevolve.methods.{method}", f"qevolve.methods.{copy}")
                .replace(f'"{method}', f'"{copy}')
            )
        else:
            f.write_text(f.read_text().replace(f'Recipe("{method}"', f'Recipe("{copy}"'))
    code = (
        "from qevolve import dvcfile\n"
        "from qevolve.params import methods, parse_params\n"
        "from qevolve.stages import pipeline\n"
        f"p = parse_params({{'method': '{copy}', 'evolve': {{'iterations': 2}}}})\n"
        "stages = dvcfile.spec(p)['stages']\n"
        "print(methods())\n"
        "print({n: [d for d in s.get('do', s)['deps'] if 'methods/' in d or 'hierarchical/' in d] for n, s in "
        "stages.items()})\n"
        "print(pipeline(p))\n"
    )
    return (
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONPATH": str(tmp_path / "src")},
            capture_output=True,
            text=True,
            check=True,
        )
        .stdout.strip()
        .splitlines()
    )


def test_a_method_is_its_package(tmp_path):
    """docs/adding-a-method.md: a copy of the GRPO package under another name, and no other change, is a
    method that params.yaml can pick, with its stages in dvc.yaml (their code deps its own files) and in
    the flow's order."""
    from qevolve.params import methods

    listed, deps, order = _copied_method(tmp_path, "grpo", "grpo_copy", own_section=False)
    assert listed == str(sorted([*methods(), "grpo_copy"]))
    assert eval(deps)["online"] == [
        "src/qevolve/methods/__init__.py",
        "src/qevolve/methods/grpo/__init__.py",
        "src/qevolve/methods/grpo/config.py",
        "src/qevolve/methods/grpo_copy/__init__.py",
        "src/qevolve/methods/grpo_copy/online.py",
    ]
    assert eval(order)[3:] == [("evaluate", 0), ("online", 1), ("evaluate", 1), ("online", 2), ("evaluate", 2)]


def test_a_hierarchical_method_is_its_package_too(tmp_path):
    """A copy of STEP-HRL under another name, its section renamed after it (the hierarchical stages read
    the running method's section), is a method too: the shared hierarchical stages run for it, reading its
    own section, whose module is their dep; its policy stage is its own file."""
    from qevolve.params import methods

    listed, deps, order = _copied_method(tmp_path, "step_hrl", "hrl_copy", own_section=True)
    deps = eval(deps)
    assert listed == str(sorted([*methods(), "hrl_copy"]))
    assert (
        "src/qevolve/methods/hrl_copy/config.py" in deps["annotate"]
        and "src/qevolve/stages/hierarchical/annotate.py" in deps["annotate"]
    )
    assert not any("methods/step_hrl" in d for stage in deps.values() for d in stage)
    assert {"src/qevolve/methods/hrl_copy/__init__.py", "src/qevolve/methods/hrl_copy/policy.py"} <= set(deps["policy"])
    assert eval(order) == [
        ("experts", None),
        ("base", None),
        ("annotate", None),
        ("bc", None),
        ("evaluate", 0),
        *[(s, k) for k in (1, 2) for s in ("collect", "critic", "policy", "diagnose", "evaluate")],
    ]


def test_each_method_iterates_in_a_sub_flow_of_its_own_name_described_by_its_algorithm():
    import flows.evolve
    from qevolve.params import parse_params

    grpo = flows.evolve.method_iteration(parse_params({"method": "grpo"}))
    assert grpo.name == "grpo-iteration" and grpo.description.startswith("The online RL baseline: GRPO")
    assert flows.evolve.method_iteration(parse_params({})).description.startswith(
        "Q-Evolve (arXiv 2606.07367), Algorithm 1"
    )


def test_every_source_file_is_a_code_dep_of_some_methods_dvc_yaml():
    """The checkout's dvc.yaml renders one method (params.yaml's); across every method's and every
    profile's dvc.yaml, each non-empty module of the package is some stage's dep, so no code runs outside
    all lineage."""
    from qevolve import dvcfile
    from qevolve.params import load_params

    params = [*_method_params().values(), *(load_params(f) for f in sorted((REPO / "profiles").glob("*.yaml")))]
    deps = {d for p in params for s in dvcfile.spec(p)["stages"].values() for d in s.get("do", s)["deps"]}
    files = {
        f"src/qevolve/{f.relative_to(dvcfile.PACKAGE).as_posix()}"
        for f in dvcfile.PACKAGE.rglob("*.py")
        if f.stat().st_size
    }
    # command-line tools no stage runs: a synthetic WebShop catalogue for tests; `qevolve terminal-import`, which
    # writes task folders that are then an env.data_dir (a DVC-tracked input like any other data); `qevolve summary`,
    # which prints what the stages wrote
    unused = {"src/qevolve/envs/webshop_data.py", "src/qevolve/envs/terminal_import.py", "src/qevolve/summary.py"}
    assert files - deps - unused == set(), sorted(files - deps - unused)
