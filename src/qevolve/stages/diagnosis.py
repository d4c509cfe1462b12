"""What every method's `diagnose@k` warns of: a critic that does not rank won above lost episodes it never
trained on, and an update that did not move the policy."""

from __future__ import annotations

from qevolve.algos.stats import MIN_CLASS, auc

NO_OP_KL = 1e-4
"""Nats per action token: an update that moved the policy less than this on held-out states did nothing."""


def contrast_warning(ranked: dict, episodes: int, critic: str = "the critic") -> str | None:
    """The warning for `ranked` (`qevolve.algos.stats.auc` of won against lost held-out episodes), if any."""
    if ranked["auc"] is None:
        which = "won" if not ranked["positives"] else "lost"
        return f"no held-out episode was {which} (of {episodes}): {critic}'s contrast cannot be measured"
    seen = f"{ranked['auc']:.2f} (exact p {ranked['p']:.2g}, {ranked['positives']} won, {ranked['negatives']} lost)"
    if ranked["contrast"] is None:
        return (
            f"{critic}'s contrast cannot be told from chance: its AUC for won against lost held-out episodes is "
            f"{seen}, "
            f"and at least {MIN_CLASS} of each are needed"
        )
    if not ranked["contrast"]:
        return (
            f"{critic} carries no contrast: its AUC for won against lost held-out episodes is {seen}, not told "
            f"from chance (0.5)"
        )
    if ranked["auc"] < 0.5:
        return (
            f"{critic} ranks lost above won: its AUC for won against lost held-out episodes is {seen}, below "
            f"chance (0.5)"
        )
    return None


def useless(ranked: dict) -> int:
    """1 where a critic's held-out AUC (`auc`) is no evidence that it ranks won above lost, else 0."""
    return int(not ranked["contrast"] or ranked["auc"] < 0.5)


MATCHED_STEPS = (1, 2, 3)


def credit_aucs(values: list[list[float]], won: list[bool]) -> dict:
    """What a critic knows of the outcome beyond an episode's length and penalties, from each held-out episode's
    V at its states (`values[i][t]`, t = 0 .. its last state before the end):
    - `auc_s0`: the AUC of V(s0), won against lost (every episode starts alike; a V that only learned that long
      or penalised episodes lose cannot rank these), with its exact p;
    - `auc_matched`: V at step t won against lost among the episodes still running at t, for t in
      `MATCHED_STEPS`, pooled over t by pairs (each t's AUC weighted by its won x lost pairs: the stratified
      Mann-Whitney statistic), so an episode is compared only with those at the same step."""
    s0 = auc([v[0] for v, w in zip(values, won) if w], [v[0] for v, w in zip(values, won) if not w])
    weighted, pairs = 0.0, 0
    for t in MATCHED_STEPS:
        at = auc(
            [v[t] for v, w in zip(values, won) if w and len(v) > t],
            [v[t] for v, w in zip(values, won) if not w and len(v) > t],
        )
        if at["auc"] is not None:
            weighted += at["auc"] * at["positives"] * at["negatives"]
            pairs += at["positives"] * at["negatives"]
    return {
        "auc_s0": s0["auc"],
        "auc_s0_p": s0["p"],
        "auc_matched": weighted / pairs if pairs else None,
        "matched_pairs": pairs,
    }


def no_op_warning(kl: float) -> str | None:
    if kl < NO_OP_KL:
        return (
            f"the update is a no-op: KL(previous ‖ new) is {kl:.1e} nats per action token on held-out states (< "
            f"{NO_OP_KL:g})"
        )
    return None
