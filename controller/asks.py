"""What a claim asks for, parsed once per decision, and whether a device or a node's labels match it (pure).

The allocator's module docstring gives the rules ("Nodes", "Devices"); this module holds the
parsing and the matching, so that screening and the set search read one ``Ask``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping, Sequence

from gpualloc.api import constants, leases, models, quantities, taints


def matches_selector(selector: models.LabelSelector | None, labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics; ``None`` and an empty selector match everything.

    ``Gt``/``Lt`` need the label and the single value to parse as integers;
    an unknown operator matches nothing.
    """
    if selector is None:
        return True
    for key, value in selector.match_labels.items():
        if labels.get(key) != value:
            return False
    for req in selector.match_expressions:
        present = req.key in labels
        value = labels.get(req.key, "")
        op = req.operator
        if op == "In":
            ok = present and value in req.values
        elif op == "NotIn":
            ok = not present or value not in req.values
        elif op == "Exists":
            ok = present
        elif op == "DoesNotExist":
            ok = not present
        elif op in ("Gt", "Lt"):
            ok = present and len(req.values) == 1 and _int_compare(value, req.values[0], op)
        else:
            ok = False
        if not ok:
            return False
    return True


def _int_compare(label: str, bound: str, op: str) -> bool:
    try:
        left, right = int(label), int(bound)
    except ValueError:
        return False
    return left > right if op == "Gt" else left < right


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Ask:
    count: int
    exclusivity: str  # Exclusive: whole GPUs; MIG: MIG instances; Shared: slots of shared GPUs
    mig_profiles: tuple[str, ...]  # MIG: the acceptable profiles (empty: any)
    sharing: models.SharingRequest  # Shared: the strategy and most sharers it accepts
    policy: str
    prefer_ids: tuple[int, ...]
    product: str | None
    min_memory_mib: int | None
    min_cc: tuple[int, int] | None
    mode: str
    min_bw: int
    strategy: str
    node_name: str | None
    selector: models.LabelSelector | None
    filters: str  # ' matching product "X", >=N MiB' or ""
    tolerations: tuple[models.Toleration, ...]  # the claim's and the defaults
    # What each replica's pods take of a node (``requests``' units): ``spec.podResources``, or the
    # requests of the claim's pods seen at our gate; always at least one pod slot.
    pod_requests: Mapping[str, int] = dataclasses.field(default_factory=lambda: {quantities.PODS: 1})
    avoid_nodes: frozenset[str] = frozenset()  # status.unplaceableNodes: its pods could not run there
    products: tuple[str, ...] = ()  # spec.devices.products: globs, any of which will do


def parse_compute_capability(text: str) -> tuple[int, int] | None:
    """``"8.6"`` -> ``(8, 6)``; ``"9"`` -> ``(9, 0)``; anything else -> ``None``."""
    parts = text.strip().split(".")
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1]) if len(parts) == 2 else 0


def parse(claim: models.GpuClaim) -> Ask | str:
    spec = claim.spec
    dev = spec.devices
    if dev.count < 1:
        return f"devices.count must be at least 1 (got {dev.count})"
    if spec.replicas < 1:
        return f"replicas must be at least 1 (got {spec.replicas})"
    if dev.exclusivity not in constants.EXCLUSIVITIES:
        return f"unknown exclusivity {dev.exclusivity!r}; use one of {', '.join(constants.EXCLUSIVITIES)}"
    if dev.exclusivity != "Exclusive" and dev.policy == "preferIds":
        return f"policy preferIds names whole GPUs; a {dev.exclusivity} claim cannot use it"
    sharing = dev.sharing or models.SharingRequest()
    if dev.exclusivity == "Shared" and sharing.strategy not in constants.SHARING_STRATEGIES:
        known = ", ".join(constants.SHARING_STRATEGIES)
        return f"unknown sharing.strategy {sharing.strategy!r}; use one of {known}"
    if dev.exclusivity == "Shared" and sharing.milli is not None:
        if not 1 <= sharing.milli < leases.WHOLE_MILLI:
            return f"sharing.milli must be 1..999 (got {sharing.milli}); ask for a whole GPU with Exclusive"
        if dev.count != 1:
            return f"a sharing.milli share is of one GPU: devices.count must be 1 (got {dev.count})"
        if sharing.max_claims_per_gpu is not None:
            return "sharing.milli and sharing.maxClaimsPerGPU do not go together: milli shares any GPU"
    if dev.policy not in constants.POLICIES:
        return f"unknown devices.policy {dev.policy!r}; use one of {', '.join(constants.POLICIES)}"
    if spec.strategy not in constants.STRATEGIES:
        return f"unknown strategy {spec.strategy!r}; use one of {', '.join(constants.STRATEGIES)}"
    mode = spec.topology.mode
    if mode not in constants.TOPOLOGY_MODES:
        return f"unknown topology.mode {mode!r}; use one of {', '.join(constants.TOPOLOGY_MODES)}"
    min_cc = None
    if dev.min_compute_capability:
        min_cc = parse_compute_capability(dev.min_compute_capability)
        if min_cc is None:
            return f'minComputeCapability "{dev.min_compute_capability}" is not of the form "8.0"'
    prefer_ids: tuple[int, ...] = ()
    if dev.policy == "preferIds":
        prefer_ids = tuple(sorted(set(dev.prefer_ids)))
        if len(prefer_ids) < dev.count:
            return (
                f"policy preferIds lists {len(prefer_ids)} distinct indices but count is {dev.count};"
                " list at least count indices"
            )
    if dev.product and dev.products:
        return "product and products both name accepted products; set one"
    filters = []
    if dev.product:
        filters.append(f'product "{dev.product}"')
    if dev.products:
        filters.append("product " + " or ".join(f'"{p}"' for p in dev.products))
    if dev.min_memory_mib:
        filters.append(f">={dev.min_memory_mib} MiB")
    if min_cc is not None:
        filters.append(f"compute capability >={min_cc[0]}.{min_cc[1]}")
    mig = dev.exclusivity == "MIG"
    if mig and dev.mig_profiles:
        filters.insert(0, f"MIG profile {' or '.join(dev.mig_profiles)}")
    whole = dev.exclusivity == "Exclusive"  # topology ranks sets of whole GPUs only
    return Ask(
        count=dev.count,
        exclusivity=dev.exclusivity,
        mig_profiles=dev.mig_profiles if mig else (),
        sharing=sharing,
        policy=dev.policy,
        prefer_ids=prefer_ids,
        product=dev.product or None,
        products=dev.products,
        min_memory_mib=dev.min_memory_mib or None,
        min_cc=min_cc,
        mode=mode if whole else "Ignore",  # instances and slots are not ranked by links
        min_bw=max(0, spec.topology.min_bandwidth_gbps) if whole else 0,
        strategy=spec.strategy,
        node_name=spec.node_name or None,
        selector=spec.selector,
        filters=(" matching " + ", ".join(filters)) if filters else "",
        tolerations=taints.claim_tolerations(spec),
        pod_requests={quantities.PODS: 1, **spec.pod_resources},
        avoid_nodes=frozenset(claim.status.unplaceable_nodes),
    )


def matches(ask: Ask, device: models.Device) -> bool:
    if ask.product is not None and not fnmatch.fnmatchcase(device.product, ask.product):
        return False
    if ask.products and not any(fnmatch.fnmatchcase(device.product, p) for p in ask.products):
        return False
    if ask.min_memory_mib is not None and device.memory_mib < ask.min_memory_mib:
        return False
    if ask.min_cc is not None:
        cc = parse_compute_capability(device.compute_capability)
        if cc is None or cc < ask.min_cc:
            return False
    return True


# ------------------------------------------------------------------ tolerations the operator allows


def covers(allowed: models.Toleration, wanted: models.Toleration) -> bool:
    """Does ``allowed`` (an operator's, from a GpuQuota) tolerate every taint that ``wanted`` (a
    claim's) tolerates? Yes when the effect is the same or ``allowed`` has none; the key is the same
    or ``allowed`` has none (with Exists: every key); and ``allowed`` is Exists, or both are Equal
    with the same value. ``tolerationSeconds`` does not count: the allocator ignores it."""
    if allowed.effect and allowed.effect != wanted.effect:
        return False
    if not allowed.key:
        return allowed.operator == "Exists"
    if allowed.key != wanted.key:
        return False
    if allowed.operator == "Exists":
        return True
    return wanted.operator != "Exists" and wanted.value == allowed.value


def allowed_tolerations(
    claim: models.GpuClaim, namespace_quotas: Iterable[models.GpuQuota]
) -> tuple[tuple[models.Toleration, ...], tuple[models.Toleration, ...]]:
    """The claim's tolerations split into those it may use and those it may not: (kept, refused).

    A toleration is kept when ``taints.DEFAULT_TOLERATIONS`` or an allowed toleration of one of
    the namespace's GpuQuotas (``spec.allowedTolerations``) covers it (``covers``). Tolerations
    are the operator's to grant: a tenant writes its claims, and a taint that keeps its team off a
    pool must keep its claims off too."""
    allowed = [
        *taints.DEFAULT_TOLERATIONS,
        *(t for q in namespace_quotas for t in q.spec.allowed_tolerations),
    ]
    kept: list[models.Toleration] = []
    refused: list[models.Toleration] = []
    for wanted in claim.spec.tolerations:
        (kept if any(covers(a, wanted) for a in allowed) else refused).append(wanted)
    return tuple(kept), tuple(refused)


def describe_toleration(toleration: models.Toleration) -> str:
    """``key=value:Effect`` as a taint reads (``key:Effect`` for Exists; ``*`` for any key or effect)."""
    key = toleration.key or "*"
    value = f"={toleration.value}" if toleration.operator != "Exists" and toleration.value else ""
    return f"{key}{value}:{toleration.effect or '*'}"


def refused_note(
    refused: Sequence[models.Toleration],
    kept: Sequence[models.Toleration],
    node_taints: Iterable[Sequence[models.Taint]],
    namespace: str,
) -> str:
    """What to add to the reason of a claim that fits nowhere: the refused tolerations that would
    have let it onto a node (one whose blocking taints they and the kept ones tolerate, and the
    kept ones alone do not), "" when none would have. ``kept`` includes the defaults."""
    if not refused:
        return ""
    mattered: list[models.Toleration] = []
    for node in node_taints:
        if taints.untolerated(node, kept) is None or taints.untolerated(node, (*kept, *refused)) is not None:
            continue
        for toleration in refused:
            if toleration not in mattered and any(taints.tolerates(toleration, t) for t in node):
                mattered.append(toleration)
    if not mattered:
        return ""
    listed = ", ".join(describe_toleration(t) for t in mattered)
    verb = "is" if len(mattered) == 1 else "are"
    noun = "toleration" if len(mattered) == 1 else "tolerations"
    return f"{noun} {listed} {verb} not allowed in namespace {namespace} (GpuQuota allowedTolerations)"


def with_pods_requests(claim: models.GpuClaim, asked: Iterable[Mapping[str, int]]) -> models.GpuClaim:
    """The claim as planned once its pods are seen (at our gate, before they are released): what
    they request counts, not ``spec.podResources``; per resource, the most any of them asks (each
    is one replica's). Unchanged when there are none."""
    most: dict[str, int] = {}
    for one in asked:
        for name, value in one.items():
            most[name] = max(most.get(name, 0), value)
    if not most:
        return claim
    return dataclasses.replace(claim, spec=dataclasses.replace(claim.spec, pod_resources=most))
