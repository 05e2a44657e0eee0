"""``gpualloc controller`` flags: defaults, --leader-elect=false, environment variables."""

from __future__ import annotations

import pytest

from controller import main


def test_defaults() -> None:
    args = main.build_parser().parse_args([])
    assert args.leader_elect is True
    assert args.leader_election_lease_duration == 15.0
    assert args.workers == 4 and args.node_stale_after == 120.0
    assert args.cost_label == "gpu.scheduling/cost-tier"


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("--leader-elect=false", False),
        ("--leader-elect", True),
        ("--leader-elect=true", True),
        ("--leader-elect=0", False),
    ],
)
def test_leader_elect_takes_an_optional_boolean(flag: str, expected: bool) -> None:
    assert main.build_parser().parse_args([flag]).leader_elect is expected


def test_environment_sets_defaults_and_flags_beat_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUALLOC_LEADER_ELECT", "false")
    monkeypatch.setenv("GPUALLOC_WORKERS", "9")
    monkeypatch.setenv("POD_NAMESPACE", "from-downward-api")
    args = main.build_parser().parse_args([])
    assert args.leader_elect is False and args.workers == 9 and args.namespace == "from-downward-api"
    args = main.build_parser().parse_args(["--workers", "2", "--namespace", "flag"])
    assert args.workers == 2 and args.namespace == "flag"


def test_the_namespace_variable_beats_pod_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "pod")
    monkeypatch.setenv("GPUALLOC_NAMESPACE", "explicit")
    assert main.build_parser().parse_args([]).namespace == "explicit"


def test_claim_tolerations_default_to_allowed_and_take_any_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert main.build_parser().parse_args([]).claim_tolerations == "Allowed"
    monkeypatch.setenv("GPUALLOC_CLAIM_TOLERATIONS", "Any")
    assert main.build_parser().parse_args([]).claim_tolerations == "Any"
    assert main.build_parser().parse_args(["--claim-tolerations", "Allowed"]).claim_tolerations == "Allowed"
    with pytest.raises(SystemExit):
        main.build_parser().parse_args(["--claim-tolerations", "All"])
