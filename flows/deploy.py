"""Serve the evolution flow so it can be started from the Prefect UI.

    prefect server start                                   # terminal 1, UI on http://127.0.0.1:4200
    PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.deploy   # terminal 2
"""

from flows.evolve import evolve

if __name__ == "__main__":
    evolve.serve(name="qevolve-evolve", description="experts -> base -> bc -> evaluate@0, then evolve.iterations Q-Evolve iterations")
