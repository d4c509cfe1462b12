"""MLflow bookkeeping of an evolution: its identity across attempts and iterations, and the experiment's kind."""

import mlflow

from qevolve.params import parse_params


def test_raising_iterations_continues_the_evolution_and_the_experiment_opens_as_training(tmp_path, monkeypatch):
    from flows.tracking import start_evolution

    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        runs = []
        for raw in (
            {"evolve": {"iterations": 1}},
            {"evolve": {"iterations": 2}},
            {"evolve": {"iterations": 2}, "bc": {"lr": 0.01}},
            {"evolve": {"iterations": 2}, "bc": {"lr": 0.01}, "model": {"device": "cpu"}},
        ):
            with start_evolution(parse_params(raw), "evolution") as run:
                runs.append(run.info.run_id)
        assert runs[0] == runs[1]  # more iterations: the same evolution, continued
        assert runs[2] != runs[1]  # another learning rate: another evolution
        assert runs[3] == runs[2]  # another device: the same evolution
        continued = mlflow.get_run(runs[0])
        assert continued.data.tags["qevolve.iterations"] == "2" and "evolve.iterations" not in continued.data.params
        experiment = mlflow.get_experiment(continued.info.experiment_id)
        assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    finally:
        mlflow.set_tracking_uri(None)


def test_the_summary_table_gives_each_rate_its_interval_and_count_and_the_critics_separation(tmp_path, monkeypatch):
    import json

    from qevolve.summary import summary_table

    monkeypatch.chdir(tmp_path)
    (tmp_path / "metrics").mkdir()
    split = {
        "episodes": 24,
        "success_rate": 4 / 24,
        "avg_reward": 0.167,
        "avg_steps": 13.2,
        "invalid_rate": 0.0,
        "output_tokens_per_episode": 107.2,
        "prompt_tokens_per_episode": 6001,
        "env_failures": 2,
    }
    (tmp_path / "metrics" / "evaluate@0.json").write_text(json.dumps({"valid_seen": split}))
    (tmp_path / "metrics" / "critic@1.json").write_text(
        json.dumps({"v_mean_won": 0.5, "v_mean_lost": 0.2, "v_std": 0.25})
    )
    table = summary_table([0, 1])
    # 4 of 24, Wilson: z²/n = 0.16006, centre (1/6 + 0.08003) / 1.16006 = 0.21266, half-width
    # 1.96·√(0.005787 + 0.001667) / 1.16006 = 0.14587 -> [6.7%, 35.9%]
    row = next(line for line in table.splitlines() if line.startswith("bc"))
    assert row.split()[2:7] == [
        "16.7%",
        "[6.7%,",
        "35.9%]",
        "4/24",
        "2",
    ]  # and the 2 episodes the environment failed, beside the rate
    assert "critic@1: mean V on won episodes 0.500, on lost 0.200 (separation +0.300; V's std 0.250)" in table


def test_the_machine_record_names_the_variables_that_override_float_kernels(monkeypatch):
    """MKL picks its matrix products' code path by the CPU, whatever torch's `cpu_capability`, and `MKL_CBWR`
    overrides it (on an Intel Xeon the quickstart's BC model changed with `MKL_CBWR=AVX2`: README): a run's record
    must say so."""
    from flows.provenance import KERNEL_ENV, machine, machine_line

    for name in KERNEL_ENV:
        monkeypatch.delenv(name, raising=False)
    plain = machine()
    assert plain["kernel_env"] == {} and f"{plain['cpu_capability']} kernels, " in machine_line(plain)
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    here = machine()
    assert here["kernel_env"] == {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2"}
    assert " kernels ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=AVX2, " in machine_line(here)
