"""One package per method, each with its `RECIPE` (`qevolve.recipe`): `method: <package>` in params.yaml."""

# A method's config module imports qevolve.config, whose `Params` is built from every method's config
# module; importing qevolve.config first, whichever module a program imports first, keeps that order.
import qevolve.config  # noqa: F401
