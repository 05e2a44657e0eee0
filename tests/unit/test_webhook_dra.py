"""With ``--dra`` the webhook gives a claim pod its replica's ResourceClaim (recipe.dra_edits)."""

from __future__ import annotations

from typing import Any

from gpualloc.api import constants
from tests import admitting
from tests.unit.test_webhook_admission import (
    all_containers,
    answer,
    env_of,
    lookup,
    make_claim,
    make_pod,
    make_review,
    patch_ops,
    patched,
    uuids,
)
from webhook import admission

DRA = admission.Options(dra=True)
GATE_DRA = admission.Options(dra=True, pending="gate")
USE = {"name": "gpualloc-gpus"}


def pod_claims(pod: dict[str, Any]) -> Any:
    return pod["spec"].get("resourceClaims")


def test_an_allocated_claims_pod_names_its_replicas_resourceclaim_in_every_container_and_keeps_the_env() -> (
    None
):
    pod = make_pod(
        annotations={"gpu.scheduling/replica": "1"},
        containers=[
            {"name": "main", "image": "cuda"},
            {"name": "side", "image": "cuda", "resources": {"limits": {"cpu": "1"}}},
        ],
        init=[{"name": "prep", "image": "cuda", "resources": {"claims": [{"name": "mine"}]}}],
        spec={"resourceClaims": [{"name": "mine", "resourceClaimName": "other"}]},
    )
    out = patched(pod, answer(pod, make_claim(replicas=2, nodes=("n0", "n1")), options=DRA))
    assert pod_claims(out) == [
        {"name": "mine", "resourceClaimName": "other"},
        {"name": "gpualloc-gpus", "resourceClaimName": "train-gpus-1"},
    ]
    init, main, side = all_containers(out)
    assert init["resources"]["claims"] == [{"name": "mine"}, USE]
    assert main["resources"] == {"claims": [USE]}
    assert side["resources"] == {"limits": {"cpu": "1"}, "claims": [USE]}
    assert env_of(main)["CUDA_VISIBLE_DEVICES"] == uuids(1), "the env stays, for clusters without DRA"
    assert out["spec"]["nodeSelector"] == {constants.HOSTNAME_LABEL: "n1"}


def test_without_dra_a_pod_gets_no_resourceclaim() -> None:
    out = patched(make_pod(), answer(make_pod(), make_claim()))
    assert pod_claims(out) is None
    assert all("resources" not in c for c in all_containers(out))


def test_a_gated_pod_gets_its_resourceclaim_at_creation_even_before_the_claim_exists() -> None:
    pod = make_pod(labels={"apps.kubernetes.io/pod-index": "3"})
    response = answer(pod, options=GATE_DRA)
    out = patched(pod, response)
    assert pod_claims(out) == [{"name": "gpualloc-gpus", "resourceClaimName": "train-gpus-3"}]
    assert out["spec"]["containers"][0]["resources"] == {"claims": [USE]}
    pending = make_claim(phase=constants.PHASE_PENDING)
    out = patched(make_pod(), answer(make_pod(), pending, options=GATE_DRA))
    assert pod_claims(out) == [{"name": "gpualloc-gpus", "resourceClaimName": "train-gpus-0"}]


def test_a_pod_naming_another_claim_as_gpualloc_gpus_is_denied_saying_so() -> None:
    for entry in (
        {"name": "gpualloc-gpus", "resourceClaimName": "mine"},
        {"name": "gpualloc-gpus", "resourceClaimTemplateName": "tmpl"},
    ):
        pod = make_pod(spec={"resourceClaims": [entry]})
        for claim, options in ((make_claim(), DRA), (make_claim(phase="Pending"), GATE_DRA)):
            response = answer(pod, claim, options=options)
            assert response["allowed"] is False
            message = response["status"]["message"]
            assert "'gpualloc-gpus'" in message and "train-gpus-0" in message
            assert ("'mine'" in message) or ("'tmpl'" in message)


def test_the_patched_pod_admitted_again_gets_an_empty_patch_reinvocation() -> None:
    for claim, options in ((make_claim(), DRA), (make_claim(phase="Pending"), GATE_DRA)):
        pod = make_pod(init=[{"name": "prep", "image": "cuda"}])
        once = patched(pod, answer(pod, claim, options=options))
        again = admitting.admit(make_review(once), lookup(claim), options)["response"]
        assert again["allowed"] is True
        assert "patch" not in again, again


def test_patch_operations_on_a_pod_with_no_resource_fields_add_them_whole() -> None:
    ops = patch_ops(answer(make_pod(), make_claim(), options=DRA))
    assert {
        "op": "add",
        "path": "/spec/resourceClaims",
        "value": [{"name": "gpualloc-gpus", "resourceClaimName": "train-gpus-0"}],
    } in ops
    assert {"op": "add", "path": "/spec/containers/0/resources", "value": {"claims": [USE]}} in ops
