"""What the chart says beside a rule's line: ``presenters.line_needs`` names what else the rule needs before it
acts (its other ``when`` conditions, its evidence). A line drawn like an unconditional stop line read "stops here"
for a rule that stops only with more (the default low_free_with_evidence at usable 10 GiB)."""

from __future__ import annotations

from sparkd.config import RuleConfig
from sparkd.core.rules import compile_rules, stop_lines
from sparkd.face.presenters import line_needs
from sparkd.loop.status import RuleStatus

GiB = 2**30


def _needs(**rule: object) -> dict[str, str | None]:
    (compiled,) = compile_rules([RuleConfig(name="r", **rule)], 16 * GiB)  # type: ignore[arg-type]
    status = RuleStatus.model_validate(compiled.to_json())
    return {line["label"]: line_needs(status, line) for line in stop_lines(compiled.to_json())}


def test_it_says_nothing_for_a_rule_that_acts_on_its_line_alone() -> None:
    assert _needs(when=["usable < 6GiB"]) == {"usable": None}
    # a predictive rule's line is its projected floor and says "projected" itself; its when only arms it
    assert _needs(kind="predictive", when=["usable < 16GiB"], floor="4GiB") == {"usable (projected)": None}


def test_it_names_the_other_conditions_of_a_rule_with_several() -> None:
    # each line names the other condition, not itself
    assert _needs(when=["MemFree < 2GiB", "MemAvailable < 1.5GiB"]) == {
        "MemFree": "MemAvailable < 1.5 GiB",
        "MemAvailable": "MemFree < 2 GiB",
    }


def test_it_names_the_evidence_of_a_rule_with_one_condition() -> None:
    assert _needs(when=["usable < 8GiB"], evidence=["psi_full_avg10 > 20", "nvrm_recent > 0"]) == {
        "usable": "evidence"  # the evidence itself is on the rule's card
    }
