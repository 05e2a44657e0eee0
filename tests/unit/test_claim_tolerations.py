"""Which of a claim's tolerations the allocator honours: those an allowed toleration of a GpuQuota
of its namespace covers, and the defaults (controller/asks.py, issue 37)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller import asks
from gpualloc.api import models, taints

T = models.Toleration
TEAM = models.Taint(key="team", value="gpu-pool", effect="NoSchedule")


def claim(*tolerations: models.Toleration, namespace: str = "ns") -> models.GpuClaim:
    spec = models.GpuClaimSpec(devices=models.DeviceRequest(count=1), tolerations=tolerations)
    return models.GpuClaim(metadata=models.ObjectMeta(name="c", namespace=namespace), spec=spec)


def quota(*allowed: models.Toleration, name: str = "q") -> models.GpuQuota:
    spec = models.GpuQuotaSpec(gpus=8, allowed_tolerations=allowed)
    return models.GpuQuota(metadata=models.ObjectMeta(name=name, namespace="ns"), spec=spec)


@pytest.mark.parametrize(
    ("allowed", "wanted", "covered"),
    [
        (T(key="team", value="a", effect="NoSchedule"), T(key="team", value="a", effect="NoSchedule"), True),
        (T(key="team", value="a", effect="NoSchedule"), T(key="team", value="b", effect="NoSchedule"), False),
        (T(key="team", value="a"), T(key="team", value="a", effect="NoExecute"), True),  # any effect
        (T(key="team", value="a", effect="NoSchedule"), T(key="team", value="a"), False),  # every effect
        (T(key="team", operator="Exists"), T(key="team", value="b", effect="NoSchedule"), True),
        (T(key="team", operator="Exists"), T(key="team", operator="Exists"), True),
        (T(key="team", value="a"), T(key="team", operator="Exists"), False),  # wants every value
        (T(key="team", operator="Exists"), T(key="other", operator="Exists"), False),
        (T(key="team", operator="Exists"), T(operator="Exists"), False),  # wants every key
        (T(operator="Exists"), T(operator="Exists"), True),
        (T(operator="Exists", effect="NoSchedule"), T(key="x", value="y", effect="NoSchedule"), True),
        (T(operator="Exists", effect="NoSchedule"), T(key="x", value="y", effect="NoExecute"), False),
    ],
)  # fmt: skip
def test_an_allowed_toleration_covers_a_claims_when_it_tolerates_at_least_as_much(
    allowed: models.Toleration, wanted: models.Toleration, covered: bool
) -> None:
    assert asks.covers(allowed, wanted) is covered


def test_a_claim_keeps_the_tolerations_some_quota_of_its_namespace_allows_and_the_defaults() -> None:
    team = T(key="team", value="gpu-pool", effect="NoSchedule")
    spot = T(key="spot", operator="Exists")
    gpu = T(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")
    wanted = claim(team, spot, gpu)
    assert asks.allowed_tolerations(wanted, []) == ((gpu,), (team, spot))
    assert asks.allowed_tolerations(wanted, [quota(T(key="team", operator="Exists"))]) == (
        (team, gpu),
        (spot,),
    )
    both = [quota(T(key="team", operator="Exists")), quota(spot, name="other")]
    assert asks.allowed_tolerations(wanted, both) == ((team, spot, gpu), ())
    assert asks.allowed_tolerations(claim(), both) == ((), ())


def test_the_note_names_only_the_refused_tolerations_that_would_have_opened_a_node() -> None:
    team = T(key="team", value="gpu-pool", effect="NoSchedule")
    spot = T(key="spot", operator="Exists")
    kept = taints.claim_tolerations(claim().spec)
    spot_taint = models.Taint(key="spot", value="true", effect="NoExecute")
    other = models.Taint(key="other", effect="NoSchedule")
    note = asks.refused_note((team, spot), kept, [(TEAM,), (spot_taint, other), ()], "ns")
    assert (
        note
        == "toleration team=gpu-pool:NoSchedule is not allowed in namespace ns (GpuQuota allowedTolerations)"
    )
    both = asks.refused_note((team, spot), kept, [(TEAM,), (spot_taint,)], "ns")
    assert both.startswith("tolerations team=gpu-pool:NoSchedule, spot:* are not allowed in namespace ns")
    assert asks.refused_note((team,), kept, [(other,), ()], "ns") == ""  # no node it would open
    assert asks.refused_note((), kept, [(TEAM,)], "ns") == ""


KEYS = st.sampled_from(["", "team", "spot"])
VALUES = st.sampled_from(["", "a", "b"])
EFFECTS = st.sampled_from(["", "NoSchedule", "NoExecute"])


@st.composite
def tolerations(draw: st.DrawFn) -> models.Toleration:
    key = draw(KEYS)
    operator = "Exists" if not key else draw(st.sampled_from(["Equal", "Exists"]))
    value = "" if operator == "Exists" else draw(VALUES)
    return T(key=key, operator=operator, value=value, effect=draw(EFFECTS))


TAINTS = st.builds(
    models.Taint,
    key=st.sampled_from(["team", "spot"]),
    value=VALUES,
    effect=st.sampled_from(["NoSchedule", "NoExecute"]),
)


@given(allowed=tolerations(), wanted=tolerations(), taint=TAINTS)
def test_a_covered_toleration_tolerates_no_taint_its_allowed_one_does_not(
    allowed: models.Toleration, wanted: models.Toleration, taint: models.Taint
) -> None:
    if asks.covers(allowed, wanted) and taints.tolerates(wanted, taint):
        assert taints.tolerates(allowed, taint)
