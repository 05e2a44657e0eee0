"""Three controller processes race over 300 claims on 20 x 8 GPUs; one is SIGKILLed and restarted.

No leader election: the three really compete, and only the Leases keep them
honest. Checked at every observation while they work (safety), and once they
have settled (liveness):

* no two claims list the same GPU, and every GPU a claim's status lists has
  its Lease held by that claim's UID (never by another);
* once settled, every claim holds exactly the Leases of its status (Allocated)
  or none (Pending), and no Pending claim would fit in the GPUs left free;
* after every claim is deleted, the finalizers and the sweep leave no Lease.

``GPUALLOC_RACE_RUNS=5`` repeats the whole scenario five times (different
seeds); ``make test`` runs it once. ``GPUALLOC_RACE_SEED`` shifts the seeds.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient

from gpualloc.api import constants
from gpualloc.kube import resources, transport
from tests.integration.controller_support import (
    RUN_LABEL,
    claim_body,
    create_gpu_node,
    delete_gpu_node,
    device_leases,
    retry_unavailable,
)

RUNS = int(os.environ.get("GPUALLOC_RACE_RUNS", "1"))
BASE_SEED = int(os.environ.get("GPUALLOC_RACE_SEED", "0"))
NODES = 20
GPUS = 8
CLAIMS = 300
SIZES = (1, 2, 4, 8)
CONTROLLERS = 3
SETTLE_WITHIN = 150.0
GPUALLOC = Path(sys.executable).with_name("gpualloc")


class Controllers:
    """The controller processes, their logs in ``tmp_path``."""

    def __init__(self, kubeconfig: str, namespace: str, logs: Path, run: str) -> None:
        self.run = run
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.logs = logs
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.starts = collections.Counter[int]()

    def start(self, slot: int) -> None:
        self.starts[slot] += 1
        log = open(self.logs / f"controller-{slot}-{self.starts[slot]}.log", "wb")  # noqa: SIM115
        self.procs[slot] = subprocess.Popen(
            [
                str(GPUALLOC),
                "controller",
                "--leader-elect=false",
                "--kubeconfig",
                self.kubeconfig,
                "--namespace",
                self.namespace,
                "--health-port",
                "0",
                "--metrics-port",
                "0",
                "--sweep-interval",
                "3",
                "--identity",
                f"racer-{slot}-{self.starts[slot]}",
                "--claim-selector",
                f"{RUN_LABEL}={self.run}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def kill(self, slot: int) -> None:
        proc = self.procs[slot]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)

    def stop_all(self) -> dict[int, int]:
        codes: dict[int, int] = {}
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for slot, proc in self.procs.items():
            try:
                codes[slot] = proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[slot] = proc.wait(10)
        return codes

    def tail(self, lines: int = 15) -> str:
        out = []
        for path in sorted(self.logs.glob("controller-*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)


async def snapshot(api: ApiClient, namespace: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    listing = await retry_unavailable(lambda: resources.CustomResources(api).list_claims(namespace))
    leases = await retry_unavailable(lambda: device_leases(api, namespace))
    return listing["items"], leases


def recorded(claim: dict[str, Any]) -> list[str]:
    return [d["uuid"] for a in (claim.get("status") or {}).get("allocations") or [] for d in a["devices"]]


def check_safety(claims: list[dict[str, Any]], leases: list[dict[str, Any]]) -> None:
    """No GPU is listed by two claims, and each listed GPU's Lease is held by the claim that lists it."""
    holder_of = {lease["metadata"]["name"]: lease["spec"].get("holderIdentity") for lease in leases}
    assert len(holder_of) == len(leases)
    owner: dict[str, str] = {}
    for claim in claims:
        uid = claim["metadata"]["uid"]
        key = f"{claim['metadata']['namespace']}/{claim['metadata']['name']}"
        phase = (claim.get("status") or {}).get("phase")
        uuids = recorded(claim)
        if phase != constants.PHASE_ALLOCATED:
            assert not uuids, f"{key} is {phase} but lists devices {uuids}"
        for gpu in uuids:
            assert gpu not in owner, f"{gpu} listed by {owner.get(gpu)} and {key}"
            owner[gpu] = key
            held = holder_of.get(constants.lease_name(gpu))
            assert held == uid, f"{key} lists {gpu} whose Lease is held by {held!r}, not {uid}"


def settled_problems(
    claims: list[dict[str, Any]], leases: list[dict[str, Any]], nodes: list[str]
) -> list[str]:
    """Why the system has not settled yet (empty once it has)."""
    problems: list[str] = []
    held: dict[str, set[str]] = collections.defaultdict(set)
    for lease in leases:
        held[str(lease["spec"].get("holderIdentity"))].add(lease["metadata"]["name"])
    free = dict.fromkeys(nodes, GPUS)
    for lease in leases:
        node = lease["metadata"]["labels"].get(constants.LABEL_NODE, "")
        if node in free:
            free[node] -= 1
    uids = set()
    for claim in claims:
        uid = claim["metadata"]["uid"]
        uids.add(uid)
        name = claim["metadata"]["name"]
        status = claim.get("status") or {}
        mine = held.get(uid, set())
        want = {constants.lease_name(u) for u in recorded(claim)}
        if mine != want:
            problems.append(f"{name} holds {len(mine)} leases, status lists {len(want)}")
        if not status.get("phase"):
            problems.append(f"{name} has no phase yet")
        elif status["phase"] == constants.PHASE_PENDING:
            count = claim["spec"]["devices"]["count"]
            roomy = [n for n, f in free.items() if f >= count]
            if roomy:
                problems.append(
                    f"{name} ({count} GPUs) is Pending while {roomy[0]} has {free[roomy[0]]} free"
                )
    for holder in held.keys() - uids:
        problems.append(f"leases held by vanished claim {holder}")
    return problems


@pytest.mark.parametrize("run", range(RUNS))
async def test_three_racing_controllers_and_a_sigkill_never_double_book(
    api: ApiClient, kubeconfig: str, namespace: str, tmp_path: Path, run: int
) -> None:
    seed = BASE_SEED + run
    rng = random.Random(seed)
    tag = uuid.uuid4().hex[:8]
    nodes = [f"race-{tag}-{i:02d}" for i in range(NODES)]
    crs = resources.CustomResources(api)
    controllers = Controllers(kubeconfig, namespace, tmp_path, tag)
    report: dict[str, Any] = {"seed": seed}
    started = time.monotonic()
    try:
        await asyncio.gather(
            *(
                create_gpu_node(api, n, labels={RUN_LABEL: tag}, kind="nvswitch" if i % 2 else "pcie")
                for i, n in enumerate(nodes)
            )
        )
        for slot in range(CONTROLLERS):
            controllers.start(slot)

        sizes = [rng.choice(SIZES) for _ in range(CLAIMS)]
        priorities = [rng.choice((0, 0, 0, 10)) for _ in range(CLAIMS)]
        victim = rng.randrange(CONTROLLERS)
        # The kill lands while the controllers allocate: once a seeded number of claims is Allocated
        # (160 GPUs hold 20 claims at the very least, so this happens before they are done).
        kill_at = rng.randint(1, 20)
        limit = asyncio.Semaphore(16)

        async def create(i: int) -> None:
            async with limit:
                body = claim_body(f"c{i:03d}", sizes[i], run=tag, priority=priorities[i])
                await retry_unavailable(lambda: crs.create_claim(namespace, body))

        async def crash() -> None:
            give_up = time.monotonic() + 60
            while time.monotonic() < give_up:
                claims, _ = await snapshot(api, namespace)
                done = sum(
                    1 for c in claims if (c.get("status") or {}).get("phase") == constants.PHASE_ALLOCATED
                )
                if done >= kill_at:
                    break
                await asyncio.sleep(0.05)
            report["allocated_at_kill"] = done
            report["killed_after_s"] = round(time.monotonic() - started, 1)
            await asyncio.to_thread(controllers.kill, victim)
            await asyncio.sleep(rng.uniform(0.2, 2.0))
            controllers.start(victim)

        await asyncio.gather(*(create(i) for i in range(CLAIMS)), crash())
        report["killed"] = victim

        observations = 0
        deadline = time.monotonic() + SETTLE_WITHIN
        while True:
            claims, leases = await snapshot(api, namespace)
            observations += 1
            check_safety(claims, leases)
            problems = settled_problems(claims, leases, nodes)
            if not problems:
                break
            assert time.monotonic() < deadline, (
                f"not settled after {SETTLE_WITHIN:.0f} s ({len(problems)} problems): {problems[:10]}\n"
                + controllers.tail()
            )
            await asyncio.sleep(1.0)
        allocated = [c for c in claims if c["status"]["phase"] == constants.PHASE_ALLOCATED]
        report.update(
            observations=observations,
            allocated=len(allocated),
            pending=len(claims) - len(allocated),
            gpus_held=len(leases),
            settled_s=round(time.monotonic() - started, 1),
        )
        assert len(claims) == CLAIMS and allocated, report
        assert {c["metadata"]["uid"] for c in allocated} >= {
            lease["spec"]["holderIdentity"] for lease in leases
        }

        await transport.request(api, "DELETE", f"/apis/gpu.scheduling/v1/namespaces/{namespace}/gpuclaims")
        deadline = time.monotonic() + 60
        while True:
            claims, leases = await snapshot(api, namespace)
            if not claims and not leases:
                break
            assert time.monotonic() < deadline, (
                f"{len(claims)} claims and {len(leases)} leases left 60 s after deleting every claim\n"
                + controllers.tail()
            )
            await asyncio.sleep(0.5)
        report["released_s"] = round(time.monotonic() - started - report["settled_s"], 1)
        print(f"\nrace run {run}: {report}")
    finally:
        codes = await asyncio.to_thread(controllers.stop_all)
        for node in nodes:
            await delete_gpu_node(api, node)
    assert all(code == 0 for code in codes.values()), (codes, controllers.tail())
