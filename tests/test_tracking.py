"""MLflow bookkeeping of an evolution: its identity across attempts and iterations, and the experiment's kind."""

import mlflow

from qevolve.config import parse_params


def test_raising_iterations_continues_the_evolution_and_the_experiment_opens_as_training(tmp_path, monkeypatch):
    from flows.tracking import start_evolution

    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    try:
        runs = []
        for raw in ({"evolve": {"iterations": 1}}, {"evolve": {"iterations": 2}}, {"evolve": {"iterations": 2}, "bc": {"lr": 0.01}},
                    {"evolve": {"iterations": 2}, "bc": {"lr": 0.01}, "model": {"device": "cpu"}}):
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
