"""Arbitrary bytes, JSON and AdmissionReview shapes thrown at ``POST /mutate``: never a 5xx.

Every 200 is a well-formed AdmissionReview echoing the request's uid, and a
patch it carries applies to the object it was computed from; every 400 is for
a body that has no uid to answer.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import jsonpatch
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpualloc.api import codecs, constants, models
from webhook import admission, cache, server

NS = "ns"

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=12))
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


def maybe(good: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly the well-formed value, sometimes anything at all, sometimes absent (the sentinel)."""
    return st.integers(0, 19).flatmap(
        lambda i: good if i < 17 else json_values if i < 19 else st.just(ABSENT)  # 85%, 10%, 5%
    )


ABSENT = object()


def drop_absent(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not ABSENT}


st_names = st.sampled_from(["train", "wait", "gang", "nope", "other/train", "", "UPPER", "fail"])
st_str_map = st.dictionaries(st.text(max_size=20), st.text(max_size=8), max_size=3)

st_env = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"name": st.sampled_from(["CUDA_VISIBLE_DEVICES", "X"]), "value": st.text(max_size=5)}
        ),
        json_values,
    ),
    max_size=3,
)
st_container = st.one_of(
    st.builds(
        drop_absent,
        st.fixed_dictionaries(
            {
                "name": maybe(st.text(max_size=5)),
                "env": maybe(st_env),
                "resources": maybe(
                    st.fixed_dictionaries(
                        {
                            "limits": maybe(
                                st.dictionaries(st.sampled_from(["nvidia.com/gpu", "cpu"]), scalars)
                            )
                        }
                    ).map(drop_absent)
                ),
            }
        ),
    ),
    json_values,
)
st_annotations = st.builds(
    lambda claim, rest: {**rest, **({} if claim is ABSENT else {constants.ANNOTATION_CLAIM: claim})},
    maybe(st_names),
    st.dictionaries(
        st.sampled_from(
            [
                constants.ANNOTATION_REPLICA,
                constants.ANNOTATION_JOB_COMPLETION_INDEX,
                constants.ANNOTATION_DEVICES,
            ]
        ),
        st.sampled_from(["0", "1", "7", "-1", "x"]),
    ),
)
st_pod = st.builds(
    drop_absent,
    st.fixed_dictionaries(
        {
            "kind": maybe(st.just("Pod")),
            "metadata": maybe(
                st.fixed_dictionaries(
                    {
                        "name": maybe(st.text(max_size=5)),
                        "generateName": maybe(st.text(max_size=5)),
                        "annotations": maybe(st_annotations),
                        "labels": maybe(st_str_map),
                    }
                ).map(drop_absent)
            ),
            "spec": maybe(
                st.fixed_dictionaries(
                    {
                        "containers": maybe(st.lists(st_container, max_size=3)),
                        "initContainers": maybe(st.lists(st_container, max_size=2)),
                        "nodeName": maybe(st.sampled_from(["n0", "n1"])),
                        "nodeSelector": maybe(st_str_map),
                        "schedulingGates": maybe(st.lists(json_values, max_size=2)),
                    }
                ).map(drop_absent)
            ),
        }
    ),
)
st_request = st.builds(
    drop_absent,
    st.fixed_dictionaries(
        {
            "uid": maybe(st.text(min_size=1, max_size=36)),
            "kind": maybe(
                st.fixed_dictionaries(
                    {
                        "group": st.sampled_from(["", "apps"]),
                        "version": st.just("v1"),
                        "kind": st.sampled_from(["Pod", "Deployment"]),
                    }
                )
            ),
            "operation": maybe(st.sampled_from(["CREATE", "UPDATE", "DELETE"])),
            "namespace": maybe(st.sampled_from([NS, "elsewhere", ""])),
            "subResource": maybe(st.sampled_from(["", "status"])),
            "dryRun": maybe(st.booleans()),
            "object": maybe(st_pod),
        }
    ),
)
st_review = st.builds(
    drop_absent,
    st.fixed_dictionaries(
        {
            "apiVersion": maybe(st.just("admission.k8s.io/v1")),
            "kind": maybe(st.just("AdmissionReview")),
            "request": maybe(st_request),
        }
    ),
)


def raw_claim(name: str, phase: str, replicas: int = 1) -> dict[str, Any]:
    body = codecs.claim_body(
        name, models.GpuClaimSpec(devices=models.DeviceRequest(count=1), replicas=replicas), NS
    )
    status: dict[str, Any] = {"phase": phase, "message": f"{name} is waiting"}
    if phase == "Allocated":
        status["allocations"] = [
            {"replica": r, "nodeName": f"n{r}", "devices": [{"index": r, "minor": r, "uuid": f"GPU-{r}"}]}
            for r in range(replicas)
        ]
    body["status"] = status
    return body


CLAIMS = [
    raw_claim("train", "Allocated"),
    raw_claim("wait", "Pending"),
    raw_claim("gang", "Allocated", 2),
    raw_claim("fail", "Failed"),
]


class NoApi:
    """A fetch for the cache: every claim not in the store does not exist."""

    async def __call__(self, namespace: str, name: str) -> dict[str, Any] | None:
        return None


@pytest.fixture(params=["deny", "gate"])
async def client(request: pytest.FixtureRequest, serve: Any) -> Any:
    claims = cache.ClaimCache(cache.StaticStore(CLAIMS), NoApi())
    webhook = server.Webhook(claims, admission.Options(pending=request.param, device_ids="index"))
    return await serve(webhook.handle, max_body=server.MAX_BODY)


def uid_of(body: Any) -> str | None:
    """The uid an AdmissionReview must be answered with, or None when the body has none (a 400)."""
    request = body.get("request") if isinstance(body, dict) else None
    uid = request.get("uid") if isinstance(request, dict) else None
    return uid if isinstance(uid, str) and uid else None


def strict_json(data: bytes) -> Any:
    """The body as standard JSON (UTF-8, no NaN or Infinity), as the API server sends it, else None."""

    def no_constants(name: str) -> Any:
        raise ValueError(name)

    try:
        return json.loads(data.decode("utf-8"), parse_constant=no_constants)
    except ValueError:
        return None


async def check(client: Any, data: bytes, parsed: Any) -> None:
    resp = await client.post("/mutate", data=data, headers={"Content-Type": "application/json"})
    assert resp.status < 500, await resp.text()
    uid = uid_of(parsed)
    event(f"HTTP {resp.status}")
    if uid is None:
        assert resp.status == 400
        return
    assert resp.status == 200
    body = await resp.json()
    assert body["apiVersion"] == "admission.k8s.io/v1"
    assert body["kind"] == "AdmissionReview"
    response = body["response"]
    assert response["uid"] == uid
    assert isinstance(response["allowed"], bool)
    event("patched" if "patch" in response else f"allowed={response['allowed']}")
    if not response["allowed"]:
        assert isinstance(response["status"]["message"], str) and response["status"]["message"]
        assert "patch" not in response
    if "patch" in response:
        assert response["patchType"] == "JSONPatch"
        ops = json.loads(base64.b64decode(response["patch"]))
        assert isinstance(ops, list) and ops
        jsonpatch.apply_patch(parsed["request"]["object"], ops)  # applies cleanly


SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)


@settings(SETTINGS, max_examples=300)
@given(review=st_review)
async def test_admission_review_shapes_never_get_a_5xx(client: Any, review: dict[str, Any]) -> None:
    data = json.dumps(review).encode()
    await check(client, data, strict_json(data))


@SETTINGS
@given(value=json_values)
async def test_arbitrary_json_never_gets_a_5xx(client: Any, value: Any) -> None:
    data = json.dumps(value).encode()
    await check(client, data, strict_json(data))


@SETTINGS
@given(data=st.binary(max_size=64))
async def test_arbitrary_bytes_never_get_a_5xx(client: Any, data: bytes) -> None:
    await check(client, data, strict_json(data))
