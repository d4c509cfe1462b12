"""One package per method, each with its `RECIPE` (`qevolve.recipe`): `method: <package>` in params.yaml."""
