"""The runtime's tp rules (`autopar.capabilities.TpRules`) as restrictions on the intra-op ILP's
parameter decisions, so that every solution is one the runtime's placement check accepts.

Rules are written against indicators (parameter, placement): 1 when the parameter takes that
placement, 0 where the parameter has no such choice in the unit (e.g. a dim too small to shard).
A unit's decisions are keyed by the parameter names of the instance it is solved on, so rules are
looked up by those names; parameters without a decision in the unit are skipped, and a tied weight
is found under whichever alias the graph kept. Replicating everything satisfies every rule, so the
restricted problem stays feasible.
"""

from __future__ import annotations

from autopar.capabilities import TpRules

Indicator = tuple[str, str]  # (parameter, placement)


def forbidden(rules: TpRules, labels: dict[str, list[str]]) -> list[Indicator]:
    """The choices of the unit's parameters (`labels`: parameter -> its placements) the runtime cannot run."""
    aliases = _aliases(rules)
    result = []
    for name, placements in labels.items():
        allowed = next((rules.allowed[a] for a in aliases.get(name, (name,)) if a in rules.allowed), None)
        if allowed is not None:
            result += [(name, p) for p in placements if p not in allowed]
    return result


def equal(rules: TpRules, labels: dict[str, list[str]]) -> list[tuple[Indicator, Indicator]]:
    """Pairs of indicators that must be equal: a bias S(0) exactly with its weight; within a block,
    each input's S(0) with each output's S(1) (all sharded or all R); tied aliases alike."""
    aliases = _aliases(rules)

    def present(name: str) -> str | None:
        return next((a for a in aliases.get(name, (name,)) if a in labels), None)

    pairs = []
    for bias, weight in rules.bias_follows.items():
        bias, weight = present(bias), present(weight)
        if bias is not None and weight is not None:
            pairs.append(((bias, "S(0)"), (weight, "S(0)")))
    for block in rules.blocks:
        members = [(present(name), "S(0)") for name in block.inputs]
        members = [m for m in members + [(present(name), "S(1)") for name in block.outputs] if m[0] is not None]
        pairs += [(members[0], other) for other in members[1:]]
    for group in rules.tied:
        found = [name for name in group if name in labels]
        pairs += [((found[0], p), (other, p)) for other in found[1:]
                  for p in dict.fromkeys(labels[found[0]] + labels[other])]
    return pairs


def _aliases(rules: TpRules) -> dict[str, tuple[str, ...]]:
    """Each alias of a tied weight -> all its aliases, itself first."""
    return {name: (name, *(a for a in group if a != name)) for group in rules.tied for name in group}
