"""The rules the webhook and the controller share: the gang replica, and node affinity pins."""

from __future__ import annotations

import pytest

from gpualloc.api import constants, pods


@pytest.mark.parametrize(
    ("metadata", "index", "source"),
    [
        (
            {
                "annotations": {constants.ANNOTATION_REPLICA: "3"},
                "labels": {constants.LABEL_STATEFULSET_POD_INDEX: "1"},
            },
            3,
            "annotation gpu.scheduling/replica",
        ),
        (
            {
                "labels": {
                    constants.LABEL_STATEFULSET_POD_INDEX: "1",
                    constants.LABEL_JOB_COMPLETION_INDEX: "0",
                }
            },
            1,
            "label apps.kubernetes.io/pod-index",
        ),
        (
            {"annotations": {constants.ANNOTATION_JOB_COMPLETION_INDEX: "2"}},
            2,
            "annotation batch.kubernetes.io/job-completion-index",
        ),
        (
            {"labels": {constants.LABEL_JOB_COMPLETION_INDEX: "0"}},
            0,
            "label batch.kubernetes.io/job-completion-index",
        ),
    ],
)
def test_first_present_source_wins(metadata: dict[str, dict[str, str]], index: int, source: str) -> None:
    assert pods.replica_of(metadata) == pods.Replica(index=index, source=source)


def test_no_source_means_no_replica() -> None:
    assert pods.replica_of({}) is None
    assert pods.replica_of({"annotations": {"other": "1"}, "labels": None}) is None


@pytest.mark.parametrize("bad", ["-1", "one", "", "1.0", "1234567890"])
def test_a_malformed_first_source_is_an_error_not_a_fallback(bad: str) -> None:
    metadata = {
        "annotations": {constants.ANNOTATION_REPLICA: bad},
        "labels": {constants.LABEL_STATEFULSET_POD_INDEX: "1"},
    }
    with pytest.raises(
        pods.ReplicaError, match=r"annotation gpu\.scheduling/replica must be a non-negative integer"
    ):
        pods.replica_of(metadata)


# ------------------------------------------------------------------ node affinity


def required(*terms: dict[str, object]) -> dict[str, object]:
    return {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}}
    }


def name_is(operator: str, *values: str, field: bool = False) -> dict[str, object]:
    part = "matchFields" if field else "matchExpressions"
    key = "metadata.name" if field else constants.HOSTNAME_LABEL
    requirement: dict[str, object] = {"key": key, "operator": operator}
    if values:
        requirement["values"] = list(values)
    return {part: [requirement]}


def test_a_daemonset_pods_match_fields_pin_keeps_it_off_every_other_node() -> None:
    affinity = required(name_is("In", "node-a", field=True))
    assert pods.affinity_excludes(affinity, "node-a") is None
    assert pods.affinity_excludes(affinity, "node-b") == "required node affinity (metadata.name In [node-a])"


@pytest.mark.parametrize(
    ("term", "node", "kept_off"),
    [
        (name_is("In", "a", "b"), "b", False),
        (name_is("In", "a", "b"), "c", True),
        (name_is("NotIn", "c"), "c", True),
        (name_is("NotIn", "c"), "a", False),
        (name_is("Exists"), "a", False),
        (name_is("DoesNotExist"), "a", True),
        ({"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]}, "a", False),
        (  # requirements in one term are ANDed: the name requirement decides
            {
                "matchExpressions": [
                    {"key": "zone", "operator": "In", "values": ["z1"]},
                    {"key": constants.HOSTNAME_LABEL, "operator": "In", "values": ["b"]},
                ]
            },
            "a",
            True,
        ),
    ],
)
def test_each_operator_on_the_node_name_rules_the_node_out_or_not(
    term: dict[str, object], node: str, kept_off: bool
) -> None:
    assert (pods.affinity_excludes(required(term), node) is not None) is kept_off


def test_terms_are_ored_so_one_term_that_may_match_lets_the_pod_on() -> None:
    assert pods.affinity_excludes(required(name_is("In", "a"), name_is("In", "b")), "b") is None
    both = pods.affinity_excludes(required(name_is("In", "a"), name_is("In", "b", field=True)), "c")
    assert both == "required node affinity (kubernetes.io/hostname In [a] or metadata.name In [b])"


@pytest.mark.parametrize(
    "affinity",
    [
        None,
        "not an object",
        {"nodeAffinity": None},
        {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": "x"}}},
        required(),
        required("not a term"),  # type: ignore[arg-type]
        required({"matchFields": "x"}),
        required({"matchExpressions": [{"key": constants.HOSTNAME_LABEL, "operator": "In", "values": "a"}]}),
        {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}},
        {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1}]}},
    ],
)
def test_no_or_malformed_affinity_keeps_no_pod_off_a_node_and_never_raises(affinity: object) -> None:
    # Mutating webhooks run before the API server validates the pod: any JSON may arrive.
    assert pods.affinity_excludes(affinity, "a") is None
