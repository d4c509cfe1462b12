"""Serve the evolution flows so they can be started from the Prefect UI.

- `qevolve-experiment` (the `experiment` flow): a form with a profile, the number of iterations, parameter
  overrides as dotted keys (validated like params.yaml) and a workspace name; each run is an evolution
  in its own workspace under runs/, with its own params.yaml, dvc.lock and MLflow store, so the checkout's
  params.yaml is never rewritten.
- `qevolve-evolve` (the `evolve` flow): this checkout's own workspace, as `make quickstart` runs it.

    prefect server start                                   # terminal 1, UI on http://127.0.0.1:4200
    PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.deploy   # terminal 2
"""

from prefect import serve

from flows.evolve import evolve, experiment

if __name__ == "__main__":
    serve(
        experiment.to_deployment(
            name="qevolve-experiment", description="an evolution of a profile with overrides, in its own workspace"
        ),
        evolve.to_deployment(
            name="qevolve-evolve", description="experts -> base -> bc -> evaluate@0, then evolve.iterations iterations"
        ),
    )
