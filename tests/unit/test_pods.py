"""The gang replica rule that the webhook and the controller share."""

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
