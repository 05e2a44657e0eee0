"""Which workload a ``release: OnOwnerCompleted`` claim follows, and when it has finished."""

from __future__ import annotations

from typing import Any

from controller import owners


def claim_owned_by(*refs: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "c", "ownerReferences": list(refs)}}


JOB = {"apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": "u-job"}
JOBSET = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": "big", "uid": "u-js"}
DEPLOY = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "web", "uid": "u-d", "controller": True}


def workload(uid: str, *conditions: tuple[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"uid": uid},
        "status": {"conditions": [{"type": t, "status": s} for t, s in conditions]},
    }


def test_the_owner_is_the_controller_reference_of_a_job_or_jobset_kind_else_the_first() -> None:
    assert owners.owner_of(claim_owned_by()) is None
    assert owners.owner_of(claim_owned_by(DEPLOY)) is None  # not a kind a claim can follow
    owner = owners.owner_of(claim_owned_by(DEPLOY, JOB, {**JOBSET, "controller": True}))
    assert owner == owners.Owner("jobset.x-k8s.io/v1alpha2", "JobSet", "big", "u-js")
    assert owner.resource == "jobsets"
    first = owners.owner_of(claim_owned_by(JOB, JOBSET))
    assert first is not None and (first.resource, str(first)) == ("jobs", "Job train")


def test_a_workload_has_finished_by_its_own_conditions_or_by_being_gone() -> None:
    job = owners.Owner("batch/v1", "Job", "train", "u-job")
    assert owners.finished(job, workload("u-job")) is None
    assert owners.finished(job, workload("u-job", ("Complete", "False"), ("Suspended", "True"))) is None
    assert owners.finished(job, workload("u-job", ("Complete", "True"))) == "Complete"
    assert owners.finished(job, workload("u-job", ("Failed", "True"))) == "Failed"
    assert owners.finished(job, workload("u-job", ("Completed", "True"))) is None  # a JobSet's word
    assert owners.finished(job, None) == "gone"
    assert owners.finished(job, workload("u-other", ("Complete", "False"))) == "gone"  # a namesake
    jobset = owners.Owner("jobset.x-k8s.io/v1alpha2", "JobSet", "big", "u-js")
    assert owners.finished(jobset, workload("u-js", ("Completed", "True"))) == "Completed"
