"""What every method's `diagnose@k` warns of: a critic that does not rank won above lost episodes it never
trained on, and an update that did not move the policy."""

from __future__ import annotations

NO_OP_KL = 1e-4
"""Nats per action token: an update that moved the policy less than this on held-out states did nothing."""


def contrast_warning(ranked: dict, episodes: int, critic: str = "the critic") -> str | None:
    """The warning for `ranked` (`qevolve.algos.stats.auc` of won against lost held-out episodes), if any."""
    if ranked["auc"] is None:
        which = "won" if not ranked["positives"] else "lost"
        return f"no held-out episode was {which} (of {episodes}): {critic}'s contrast cannot be measured"
    interval = f"{ranked['auc']:.2f} [{ranked['low']:.2f}, {ranked['high']:.2f}]"
    if not ranked["contrast"]:
        return f"{critic} carries no contrast: its AUC for won against lost held-out episodes is {interval}, which holds chance (0.5)"
    if ranked["auc"] < 0.5:
        return f"{critic} ranks lost above won: its AUC for won against lost held-out episodes is {interval}, below chance (0.5)"
    return None


def useless(ranked: dict) -> int:
    """1 where a critic's held-out AUC (`auc`) is no evidence that it ranks won above lost, else 0."""
    return int(not ranked["contrast"] or ranked["auc"] < 0.5)


def no_op_warning(kl: float) -> str | None:
    if kl < NO_OP_KL:
        return f"the update is a no-op: KL(previous ‖ new) is {kl:.1e} nats per action token on held-out states (< {NO_OP_KL:g})"
    return None
