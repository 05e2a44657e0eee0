"""GPU allocation on Alibaba's openb production trace, measured as the FGD paper measures it.

The trace (``../shared/traces/openb/``, README.md there) and the method are those of Weng et al.,
"Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation Gradient
Descent", USENIX ATC '23, whose simulator (hkust-adsl/kubernetes-scheduler-simulator) this
replay follows:

Workload (``inflate``)
    Per seed, the trace's tasks in a seeded random order, then tasks drawn at random from the
    trace (seeded) and appended while the GPUs asked stay within ``--inflate`` x the cluster's GPUs
    (1.3: 130%); a trace that asks more is cut down by removing tasks at random. Tasks arrive one
    at a time and never leave. Every policy sees the same tasks in the same order.

Nodes (``seeded_names``)
    Per seed, the nodes in name order are renamed ``NNNN-<sn>`` by a seeded permutation, as the
    paper's simulator renames them (``syncClusterResourceList``: ``rand.Perm``, then
    ``fmt.Sprintf("%04d-", idx)``). FGD, and gpualloc, take the first node by name among the
    placements they score alike, so the node that wins a tie is a random one, another each seed.
    In the trace's own order it is not: 23 of its first 60 GPU nodes are 2-GPU P100s (11% of
    all): with the first node by ``sn``, FGD placed 93.85% on gpushare40 at 100% arrived
    workload, 0.11 below the paper's 93.96%; in this order, 93.95% (BENCHMARKS.md).

Measure
    After each task (placed or not): the *GPU allocation ratio*, milli-GPU allocated / the
    cluster's milli-GPU (6,212,000 on the GPU nodes), against the *arrived workload*, milli-GPU
    asked so far / the same. At each whole percent of arrived workload the ratio is the mean over
    the tasks whose arrived workload rounds to it (within one percent when none does), then the
    mean over the seeds. The same for the *fragmentation ratio*: the fragmented free milli-GPU
    (``packing_policies.Fragmentation``) over the free milli-GPU.

Policies (``--policies``)
    ``random``, ``bestfit``, ``fgd``: the paper's baselines (``packing_policies``).
    ``gpualloc``: the controller's own pure allocator, ``controller.allocator.allocate``, as the
    chart installs it by default where Kubernetes serves MutatingAdmissionPolicy (1.36+):
    claims get ``leastFragmentation`` (``packing.defaultStrategy: auto``;
    ``controller.fragmentation``, judged against the tasks seen so far, the GPU tasks as they
    arrive and the CPU-only tasks once placed, kept by ``fragmentation.Recent`` as the controller
    keeps its claims and the pods bound without one) and pods without GPUs are
    steered (``packing.steerPodsWithoutClaim: auto``, below). ``--strategy binpack
    --no-steer-pods``: the chart's defaults where no such policy is served (the CRD's own
    default strategy, no steering). It runs on
    one ``NodeView`` per GPU node (one simulated GPU per trace GPU, the model as its product,
    taken = every GPU with anything on it, the node's CPU and memory as its allocatable and
    free). What the allocator does not do yet is done around it and said in the output
    (``GPUALLOC_NOTES``):

    * node CPU and memory: the task's as the claim's ``podResources``, screened by the allocator
      (issue 41); for speed, only the nodes with enough free GPUs, CPU and memory are offered
      (the controller's ``NodeIndex`` skips nodes short of GPUs too): the decision is the same;
    * GPU models: one accepted model goes in the claim's ``product``, ``A|B`` alternatives in its
      ``products`` (issue 39 part 2);
    * sharing tasks (one GPU, milli < 1000): a claim of ``exclusivity: Shared`` with
      ``sharing.milli`` (issue 39 part 1), each GPU's shares as the view's ``milli_used``;
    * CPU-only tasks are kube-scheduler's, not gpualloc's: a stand-in of its scoring,
      NodeResourcesFit plus BalancedAllocation on CPU and memory, ties at random, with the
      default LeastAllocated (spreading) or, ``--cpu-tasks MostAllocated``, the packing strategy
      an operator can configure. Which one moves gpualloc's figure by about a point; FGD, which
      places CPU-only tasks by fragmentation too, by more (see BENCHMARKS.md). ``--steer-pods``
      (the default; ``--no-steer-pods``: off): the chart's ``packing.steerPodsWithoutClaim``
      on: the preferred node affinity its
      MutatingAdmissionPolicy gives every pod without GPUs (two terms of weight 100: nodes not
      labelled ``gpu.scheduling/free-gpus: "true"``, i.e. with no whole GPU free, and nodes
      labelled neither that nor ``"shares"``, i.e. with no milli-GPU free at all; one of weight
      80: nodes without ``"true"`` and not labelled ``gpu.scheduling/busy: "false"``, i.e. whose
      tasks ask at least 75% of their CPU and memory, averaged), scored as kube-scheduler's
      NodeAffinity plugin does (the weights a node matches, normalised to 100 by the highest,
      plugin weight 2), on the labels as they were before the task. ``--cpu-tasks
      leastFragmentation`` is NOT shipped: the node ``fragmentation.pods_key`` ranks first, as
      kube-scheduler would choose with an extender serving that score, which gpualloc lacks.

Reported: the curves and the 100%/130% points per policy, printed and written to ``--json``
(default ``bench/results/trace_replay_<trace>.json``) with a PNG of the curves beside it. The
published figures for the five given variants are printed beside the replay's.

    .venv/bin/python bench/trace_replay.py --nodes ../shared/traces/openb/openb_node_list_gpu_node.csv \\
        --pods ../shared/traces/openb/openb_pod_list_default.csv --seeds 42-51 --inflate 1.3 \\
        --policies gpualloc,fgd,bestfit,random --workers 2
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import json
import pathlib
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import packing_policies as pp
import procfs

from controller import allocator, fragmentation, nodes
from gpualloc.api import constants, models, quantities

REPO = pathlib.Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
TRACES = REPO.parent / "shared" / "traces" / "openb"
POLICIES = ("gpualloc", "fgd", "bestfit", "random")
MIB = 2**20
PODS = 1_000_000  # pod slots per node: the trace has no limit
# The chart's defaults where Kubernetes serves MutatingAdmissionPolicy (packing.defaultStrategy and
# packing.steerPodsWithoutClaim, both auto); elsewhere binpack (the CRD's default) without steering.
DEFAULT_STRATEGY = fragmentation.STRATEGY
DEFAULT_STEER = True
PERCENTS = range(0, 131)
PROGRESS_EVERY_S = 30.0

# The paper's published GPU allocation ratio (%) at 100% / 130% arrived workload, mean of seeds
# 42-51 (its repository's experiments/analysis/expected_results/analysis_allo_discrete.csv).
PUBLISHED: dict[str, dict[str, tuple[float, float]]] = {
    "default": {"random": (86.3, 87.5), "bestfit": (92.9, 93.1), "fgd": (95.2, 95.4)},
    "gpushare40": {"random": (84.9, 86.0), "bestfit": (91.4, 91.7), "fgd": (94.0, 94.1)},
    "multigpu20": {"random": (86.9, 88.7), "bestfit": (93.7, 93.9), "fgd": (95.5, 95.7)},
    "gpuspec33": {"random": (83.9, 86.5), "bestfit": (80.4, 93.1), "fgd": (87.8, 94.5)},
    "cpu050": {"random": (89.0, 91.2), "bestfit": (93.6, 93.8), "fgd": (95.0, 95.2)},
}

# kube-scheduler's NodeResourcesFit strategies, and leastFragmentation's score for pods without GPUs
# (``fragmentation.pods_key``), which needs a kube-scheduler extender gpualloc does not ship yet.
CPU_SCORINGS = ("LeastAllocated", "MostAllocated", fragmentation.STRATEGY)
GPUALLOC_NOTES = {
    "whole_gpu_tasks": (
        "controller.allocator.allocate, strategy {strategy}, the task's CPU and memory as the claim's "
        "podResources, screened against each node's (issue 41); the workload leastFragmentation judges "
        "by: the GPU tasks seen so far and the CPU-only tasks placed so far (fragmentation.Recent, as the "
        "controller keeps it: its claims, and the pods bound without one); the accepted "
        "GPU model as the claim's product, A|B alternatives as its products"
    ),
    "sharing_tasks": (
        "controller.allocator.allocate, a claim of exclusivity Shared with sharing.milli, strategy "
        "{strategy}, its CPU and memory as the claim's podResources"
    ),
    "cpu_only_tasks": (
        "kube-scheduler's, not gpualloc's: a stand-in of its scoring (NodeResourcesFit {scoring} + "
        "BalancedAllocation on CPU and memory), ties at random"
    ),
}
STEERED = (
    ", plus the chart's packing.steerPodsWithoutClaim: NodeAffinity (weight 2) preferring the nodes "
    'without a whole free GPU (label gpu.scheduling/free-gpus not "true"), and most those without room '
    'for a share either (not "shares"), and among those without a whole free GPU the busy ones '
    '(gpu.scheduling/busy not "false")'
)
CPU_ONLY_NOT_SHIPPED = (
    "NOT SHIPPED: placed by fragmentation.pods_key (the fragmentation their CPU and memory add), as "
    "a kube-scheduler extender serving that score would; gpualloc has no such extender yet"
)


def gpualloc_notes(
    cpu_scoring: str, strategy: str = DEFAULT_STRATEGY, steer: bool = DEFAULT_STEER
) -> dict[str, str]:
    notes = {k: v.format(scoring=cpu_scoring, strategy=strategy) for k, v in GPUALLOC_NOTES.items()}
    if steer:
        notes["cpu_only_tasks"] += STEERED
    if cpu_scoring == fragmentation.STRATEGY:
        notes["cpu_only_tasks"] = CPU_ONLY_NOT_SHIPPED
    return notes


# ------------------------------------------------------------------ the trace


def read_nodes(path: pathlib.Path) -> list[pp.Node]:
    with path.open(newline="") as handle:
        return [
            pp.Node(
                name=row["sn"],
                cpu=int(row["cpu_milli"]),
                memory=int(row["memory_mib"]),
                gpus=int(row["gpu"]),
                model=row.get("model") or "",
            )
            for row in csv.DictReader(handle)
        ]


def read_tasks(path: pathlib.Path) -> list[pp.Task]:
    """The trace's tasks. A task's milli-GPU per GPU is ``gpu_milli`` capped at 1000 (the trace's
    whole-GPU tasks say 1000); a task asking GPUs with no milli is CPU-only, as the simulator
    reads it."""
    tasks = []
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            gpus, milli = int(row["num_gpu"]), min(int(row["gpu_milli"] or 0), pp.MILLI)
            if gpus == 0 or milli <= 0:
                gpus, milli = 0, 0
            tasks.append(
                pp.Task(
                    name=row["name"],
                    cpu=int(row["cpu_milli"]),
                    memory=int(row["memory_mib"]),
                    gpus=gpus,
                    milli=milli,
                    spec=row.get("gpu_spec") or "",
                )
            )
    return tasks


def inflate(tasks: Sequence[pp.Task], capacity_milli: int, ratio: float, seed: int) -> list[pp.Task]:
    """The workload of one seed (module docstring, Workload): every task in a seeded order, then
    tasks drawn at random (seeded) until the next would take the GPUs asked past ``ratio`` x
    ``capacity_milli``; or, when the trace alone asks more, tasks removed at random until it
    does not."""
    rng = random.Random(seed)
    by_name = sorted(tasks, key=lambda t: t.name)
    order = list(by_name)
    rng.shuffle(order)
    target = ratio * capacity_milli
    asked = sum(t.total_milli for t in order)
    while asked > target and order:
        asked -= order.pop(rng.randrange(len(order))).total_milli
    drawn = 0
    while asked < target:
        task = by_name[rng.randrange(len(by_name))]
        if asked + task.total_milli > target:
            break
        order.append(dataclasses.replace(task, name=f"{task.name}-drawn-{drawn}"))
        asked += task.total_milli
        drawn += 1
    return order


def trace_name(pods: pathlib.Path) -> str:
    """``default`` for ``openb_pod_list_default.csv``."""
    return pods.stem.removeprefix("openb_pod_list_")


# ------------------------------------------------------------------ gpualloc


class AllocatorPolicy:
    """The ``gpualloc`` policy (module docstring, Policies)."""

    def __init__(
        self,
        cluster: pp.Cluster,
        rng: random.Random,
        cpu_scoring: str = CPU_SCORINGS[0],
        strategy: str = DEFAULT_STRATEGY,
        steer: bool = DEFAULT_STEER,
    ) -> None:
        self.cluster = cluster
        self.steer = steer
        self.rng = rng
        self.cpu_scoring = cpu_scoring
        self.strategy = strategy
        self.recent = fragmentation.Recent()  # the claims seen, as the controller keeps them
        self.uuids: list[tuple[str, ...]] = [
            tuple(f"GPU-{node.name}-{g}" for g in range(node.gpus)) for node in cluster.nodes
        ]
        # One inventory object per node for the run: the allocator memoises its tables by identity.
        self.inventories = [
            models.NodeInventory(
                devices=tuple(
                    models.Device(index=g, minor=g, uuid=uuid, product=node.model, health=constants.HEALTHY)
                    for g, uuid in enumerate(self.uuids[i])
                ),
                total=node.gpus,
                healthy=node.gpus,
                product=node.model,
            )
            for i, node in enumerate(cluster.nodes)
        ]
        self.allocatable = [
            {quantities.CPU: node.cpu, quantities.MEMORY: node.memory * MIB, quantities.PODS: PODS}
            for node in cluster.nodes
        ]
        self.views: list[allocator.NodeView | None] = [
            self._view(i, frozenset()) if node.gpus else None for i, node in enumerate(cluster.nodes)
        ]
        self.seen: np.ndarray[Any, Any] = np.zeros_like(cluster.changes)  # the changes the views show
        self.stand_in = {"cpu_only_tasks": 0}
        self.by_allocator = 0

    def _view(
        self, i: int, taken: frozenset[str], milli_used: dict[str, int] | None = None
    ) -> allocator.NodeView:
        return allocator.NodeView(
            name=self.cluster.nodes[i].name,
            labels={},
            unschedulable=False,
            node_present=True,
            ready=True,
            inventory=self.inventories[i],
            taken=taken,
            allocatable=self.allocatable[i],
            free={
                quantities.CPU: int(self.cluster.cpu[i]),
                quantities.MEMORY: int(self.cluster.memory[i]) * MIB,
                quantities.PODS: PODS,
            },
            milli_used=milli_used or {},
        )

    def choose(self, task: pp.Task) -> pp.Placement | None:
        if task.gpus:
            shape = fragmentation.Shape(
                gpus=task.gpus,
                milli=task.milli,
                cpu=task.cpu,
                memory=task.memory * MIB,
                products=tuple(sorted(task.models)),
            )
            self.recent.observe(shape)
            return self._allocate(task)
        if self.cpu_scoring == fragmentation.STRATEGY:
            found = least_fragmenting_pods(self.cluster, task, self.recent.workload())
        else:
            found = kube_scheduler(self.cluster, task, self.rng, self.cpu_scoring, steer=self.steer)
        if found is not None:  # bound: the controller's workload counts it (``State.recent``)
            self.stand_in["cpu_only_tasks"] += 1
            self.recent.observe_pod({quantities.CPU: task.cpu, quantities.MEMORY: task.memory * MIB})
        return found

    def _allocate(self, task: pp.Task) -> pp.Placement | None:
        c = self.cluster
        for node in np.flatnonzero(c.changes != self.seen):
            self._refresh(int(node))
        accepted = sorted(task.models)
        # The nodes that could take it (the allocator screens them again): as the controller's
        # NodeIndex never visits nodes short of free GPUs, for speed; the decision is the same.
        if task.sharing:
            could = (c.left >= task.milli).any(axis=1)
        else:
            could = (c.left == pp.MILLI).sum(axis=1) >= task.gpus
        could &= (c.cpu >= task.cpu) & (c.memory >= task.memory)
        views = [v for v in (self.views[int(i)] for i in np.flatnonzero(could)) if v is not None]
        if not views:
            return None
        pods = {quantities.CPU: task.cpu, quantities.MEMORY: task.memory * MIB}
        product, products = (accepted[0], ()) if len(accepted) == 1 else (None, tuple(accepted))
        claim = models.GpuClaim(
            metadata=models.ObjectMeta(name=task.name, namespace="openb"),
            spec=models.GpuClaimSpec(
                devices=models.DeviceRequest(
                    count=task.gpus,
                    product=product,
                    products=products,
                    exclusivity="Shared" if task.sharing else "Exclusive",
                    sharing=models.SharingRequest(milli=task.milli) if task.sharing else None,
                ),
                strategy=self.strategy,
                pod_resources=pods,
            ),
        )
        decision = allocator.allocate(claim, views, workload=self.recent.workload())
        if not decision.ok:
            return None
        (placed,) = decision.allocations
        self.by_allocator += 1
        return pp.Placement(node=c.index[placed.node_name], gpus=tuple(d.index for d in placed.devices))

    def _refresh(self, node: int) -> None:
        """The node's view after tasks landed on it: a GPU with anything on it is taken, and one
        with some milli left holds shares (a GPU with none left is the same, held whole or not)."""
        self.seen[node] = self.cluster.changes[node]
        if self.views[node] is None:
            return
        left = self.cluster.left[node]
        taken = frozenset(uuid for g, uuid in enumerate(self.uuids[node]) if left[g] < pp.MILLI)
        shared = {
            uuid: pp.MILLI - int(left[g]) for g, uuid in enumerate(self.uuids[node]) if 0 < left[g] < pp.MILLI
        }
        self.views[node] = self._view(node, taken, shared)


def least_fragmenting_pods(
    cluster: pp.Cluster, task: pp.Task, workload: fragmentation.Workload
) -> pp.Placement | None:
    """Not shipped (``--cpu-tasks leastFragmentation``): a CPU-only task on the node
    ``fragmentation.pods_key`` ranks first (the lowest node among equals), as kube-scheduler would
    place it with an extender serving that score and weighed above its own."""
    candidates = cluster.feasible(task)
    if not len(candidates):
        return None
    shape = fragmentation.Shape(gpus=0, cpu=task.cpu, memory=task.memory * MIB)
    best: tuple[fragmentation.Key, int] | None = None
    for i in candidates.tolist():
        node = cluster.nodes[i]
        key = fragmentation.pods_key(
            workload,
            node.model,
            cluster.left[i, : node.gpus].tolist(),
            int(cluster.cpu[i]),
            int(cluster.memory[i]) * MIB,
            shape,
        )
        if best is None or key < best[0]:
            best = (key, i)
    assert best is not None
    return pp.Placement(node=best[1], gpus=())


def kube_scheduler(
    cluster: pp.Cluster,
    task: pp.Task,
    rng: random.Random,
    scoring: str = CPU_SCORINGS[0],
    *,
    steer: bool = False,
) -> pp.Placement | None:
    """The stand-in for CPU-only tasks: kube-scheduler's scores on CPU and memory, NodeResourcesFit
    (``LeastAllocated``, its default: the free share after the placement; ``MostAllocated``: the
    used share) plus BalancedAllocation (1 - the spread of the two used shares), and with ``steer``
    the chart's preferred node affinity (module docstring), highest first, ties at random."""
    if scoring not in CPU_SCORINGS[:2]:
        raise ValueError(f"unknown scoring {scoring!r} (known: {', '.join(CPU_SCORINGS)})")
    candidates = cluster.feasible(task)
    if not len(candidates):
        return None
    cpu_cap = np.array([cluster.nodes[i].cpu for i in candidates], np.int64)
    mem_cap = np.array([cluster.nodes[i].memory for i in candidates], np.int64)
    cpu_free = cluster.cpu[candidates] - task.cpu
    mem_free = cluster.memory[candidates] - task.memory
    if scoring == "LeastAllocated":
        fit = ((cpu_free * 100) // cpu_cap + (mem_free * 100) // mem_cap) // 2
    else:
        fit = (((cpu_cap - cpu_free) * 100) // cpu_cap + ((mem_cap - mem_free) * 100) // mem_cap) // 2
    cpu_share, mem_share = 1 - cpu_free / cpu_cap, 1 - mem_free / mem_cap
    balanced = np.trunc((1 - np.abs(cpu_share - mem_share) / 2) * 100).astype(np.int64)
    scores = fit + balanced
    if steer:  # NodeAffinity, weight 2: the weights of the preferred terms a node matches, normalised
        left = cluster.left[candidates]
        no_whole = (left == pp.MILLI).sum(axis=1) == 0  # free-gpus not "true"
        no_room = left.sum(axis=1) == 0  # not "shares" either: no milli-GPU left at all
        # and busy not "false": the node's tasks ask at least BUSY_PERCENT of its CPU and memory,
        # averaged (the labels as before this task: nodes.busy; its hysteresis never applies here,
        # where tasks never leave)
        cpu_used, mem_used = cpu_cap - cluster.cpu[candidates], mem_cap - cluster.memory[candidates]
        requested = 100 * (cpu_used * mem_cap + mem_used * cpu_cap)
        busy = requested >= 2 * nodes.BUSY_PERCENT * cpu_cap * mem_cap
        matched = 100 * no_whole + 100 * no_room + 80 * (no_whole & busy)
        if matched.max() > 0:
            scores = scores + 2 * (matched * 100 // matched.max())
    best = np.flatnonzero(scores == scores.max())
    return pp.Placement(node=int(candidates[best[rng.randrange(len(best))]]), gpus=())


# ------------------------------------------------------------------ the replay


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    policy: str
    seed: int
    nodes: tuple[pp.Node, ...]
    tasks: tuple[pp.Task, ...]
    inflate: float
    cpu_scoring: str = CPU_SCORINGS[0]  # the gpualloc policy's stand-in for CPU-only tasks
    strategy: str = DEFAULT_STRATEGY  # the gpualloc policy's claims'
    steer: bool = DEFAULT_STEER  # the chart's packing.steerPodsWithoutClaim (CPU-only tasks)
    label: str = ""


Chooser = Callable[[pp.Task], pp.Placement | None]


def make_policy(
    name: str,
    cluster: pp.Cluster,
    ledger: pp.FragLedger,
    rng: random.Random,
    cpu_scoring: str = CPU_SCORINGS[0],
    strategy: str = DEFAULT_STRATEGY,
    steer: bool = DEFAULT_STEER,
) -> tuple[Chooser, AllocatorPolicy | None]:
    """The policy's chooser (and the gpualloc policy, for its counts)."""
    if name == "gpualloc":
        policy = AllocatorPolicy(cluster, rng, cpu_scoring, strategy, steer)
        return policy.choose, policy
    if name == "fgd":
        return (lambda t: pp.choose_fgd(cluster, t, ledger)), None
    if name == "bestfit":
        return (lambda t: pp.choose_bestfit(cluster, t)), None
    if name == "random":
        return (lambda t: pp.choose_random(cluster, t, rng)), None
    raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")


def discrete(arrived_pct: np.ndarray[Any, Any], values: np.ndarray[Any, Any]) -> dict[int, float]:
    """The value at each whole percent of arrived workload: the mean over the records whose arrived
    workload rounds to it, else over those within one percent of it (module docstring, Measure)."""
    rounded = np.round(arrived_pct)
    out: dict[int, float] = {}
    for pct in PERCENTS:
        hit = rounded == pct
        if not hit.any():
            hit = (rounded >= pct - 1) & (rounded <= pct + 1)
            if not hit.any():
                continue
        out[pct] = round(float(values[hit].mean()), 2)
    return out


def seeded_names(nodes: Sequence[pp.Node], seed: int) -> list[pp.Node]:
    """``nodes`` renamed ``NNNN-<name>``: the node at position i in name order gets the i-th number of
    a seeded permutation (module docstring, Nodes)."""
    in_order = sorted(nodes, key=lambda n: n.name)
    numbers = list(range(len(in_order)))
    random.Random(f"trace-replay/nodes/{seed}").shuffle(numbers)
    return [dataclasses.replace(n, name=f"{k:04d}-{n.name}") for n, k in zip(in_order, numbers, strict=True)]


def replay(job: Job) -> dict[str, Any]:
    """One policy over one seed's workload: its curves, counts, wall and CPU time."""
    started, cpu_started = time.perf_counter(), time.process_time()
    cluster = pp.Cluster(seeded_names(job.nodes, job.seed))
    workload = inflate(job.tasks, cluster.capacity_milli, job.inflate, job.seed)
    ledger = pp.FragLedger(pp.Fragmentation(pp.typical_tasks(job.tasks), cluster), cluster)
    rng = random.Random(f"trace-replay/{job.policy}/{job.seed}")
    choose, gpualloc = make_policy(job.policy, cluster, ledger, rng, job.cpu_scoring, job.strategy, job.steer)
    n = len(workload)
    arrived = np.zeros(n)
    allocated = np.zeros(n)
    fragmented = np.zeros(n)
    asked = 0
    unplaced = {"cpu_only": 0, "sharing": 0, "whole_gpu": 0}
    last_print = started
    for i, task in enumerate(workload):
        asked += task.total_milli
        found = choose(task)
        if found is None:
            kind = "sharing" if task.sharing else "whole_gpu" if task.gpus else "cpu_only"
            unplaced[kind] += 1
        else:
            cluster.place(task, found)
            ledger.update(found.node)
        arrived[i] = 100.0 * asked / cluster.capacity_milli
        allocated[i] = round(100.0 * cluster.allocated_milli / cluster.capacity_milli, 2)
        fragmented[i] = ledger.ratio_pct()
        now = time.perf_counter()
        if now - last_print > PROGRESS_EVERY_S:
            print(
                f"  {job.label}{job.policy} seed {job.seed}: task {i + 1}/{n}, "
                f"arrived {arrived[i]:.0f}%, allocated {allocated[i]:.1f}% ({now - started:.0f} s)",
                flush=True,
            )
            last_print = now
    result: dict[str, Any] = {
        "policy": job.policy,
        "seed": job.seed,
        "tasks": n,
        "unplaced": unplaced,
        "allocation_pct": discrete(arrived, allocated),
        "fragmentation_pct": discrete(arrived, fragmented),
        "wall_s": round(time.perf_counter() - started, 2),
        "cpu_s": round(
            time.process_time() - cpu_started, 2
        ),  # this process's: what contention does not inflate
    }
    if gpualloc is not None:
        result["gpualloc"] = {"by_allocator": gpualloc.by_allocator, "by_stand_in": gpualloc.stand_in}
    return result


def mean_curves(runs: Sequence[dict[str, Any]], key: str) -> dict[str, float]:
    """The mean over the seeds at each percent (over the seeds that have it)."""
    out: dict[str, float] = {}
    for pct in PERCENTS:
        values = [r[key][pct] for r in runs if pct in r[key]]
        if values:
            out[str(pct)] = round(sum(values) / len(values), 2)
    return out


def parse_seeds(text: str) -> list[int]:
    """``42-51`` or ``42,43,50``."""
    seeds: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        seeds.extend(range(int(low), int(high or low) + 1))
    return seeds


# ------------------------------------------------------------------ output


def table(result: dict[str, Any], trace: str) -> str:
    published = PUBLISHED.get(trace, {})
    lines = [
        "| policy | "
        + " | ".join(f"{p}%" for p in range(10, 131, 10))
        + " | 100% / 130% | published (the paper's, on the GPU nodes) |",
        "|---|" + "---|" * 13 + "---|---|",
    ]
    for name, entry in result["policies"].items():
        curve = entry["allocation_pct"]
        points = " | ".join(f"{curve.get(str(p), float('nan')):.1f}" for p in range(10, 131, 10))
        paper = published.get(name)
        paper_text = f"{paper[0]} / {paper[1]}" if paper else ""
        at = f"**{curve.get('100', float('nan')):.1f} / {curve.get('130', float('nan')):.1f}**"
        lines.append(f"| {name} | {points} | {at} | {paper_text} |")
    return "\n".join(lines)


def plot(result: dict[str, Any], trace: str, out: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (alloc_ax, frag_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours: dict[str, Any] = {}
    for name, entry in result["policies"].items():
        for ax, key in ((alloc_ax, "allocation_pct"), (frag_ax, "fragmentation_pct")):
            curve = entry[key]
            xs = sorted(int(p) for p in curve)
            (line,) = ax.plot(xs, [curve[str(x)] for x in xs], label=name, color=colours.get(name))
            colours[name] = line.get_color()
    for name, (at100, at130) in PUBLISHED.get(trace, {}).items():
        if name in result["policies"]:
            alloc_ax.scatter(
                [100, 130], [at100, at130], marker="x", s=30, color=colours[name], label=f"{name} (published)"
            )
    seeds = result["seeds"]
    seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else f"{len(seeds)} seeds, {seeds[0]}-{seeds[-1]}"
    alloc_ax.set(
        xlabel="arrived workload (% of GPUs)",
        ylabel="GPU allocation ratio (%)",
        title=f"openb {trace}: {seed_text}, mean",
        xlim=(0, 131),
    )
    alloc_ax.set_ylim(bottom=50)
    frag_ax.set(xlabel="arrived workload (% of GPUs)", ylabel="fragmented free GPU (%)", xlim=(0, 131))
    for ax in (alloc_ax, frag_ax):
        ax.grid(alpha=0.3)
    alloc_ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--nodes", type=pathlib.Path, default=TRACES / "openb_node_list_gpu_node.csv")
    parser.add_argument("--pods", type=pathlib.Path, default=TRACES / "openb_pod_list_default.csv")
    parser.add_argument("--seeds", default="42-51", help="42-51 or 42,43 (default 42-51)")
    parser.add_argument("--inflate", type=float, default=1.3, help="GPUs asked / the cluster's (1.3)")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--cpu-tasks",
        choices=CPU_SCORINGS,
        default=CPU_SCORINGS[0],
        help="the gpualloc policy's kube-scheduler stand-in for CPU-only tasks (default LeastAllocated; "
        "leastFragmentation: not shipped, see the docstring)",
    )
    parser.add_argument(
        "--strategy",
        choices=constants.STRATEGIES,
        default=DEFAULT_STRATEGY,
        help=f"the gpualloc policy's claims' spec.strategy (default {DEFAULT_STRATEGY}, the chart's on "
        "Kubernetes 1.36+; binpack: the CRD's own default, the chart's elsewhere)",
    )
    parser.add_argument(
        "--steer-pods",
        action=argparse.BooleanOptionalAction,
        default=DEFAULT_STEER,
        help="the chart's packing.steerPodsWithoutClaim: CPU-only tasks prefer nodes with no whole free GPU, "
        "and among those the busy ones (default on, the chart's on Kubernetes 1.36+)",
    )
    parser.add_argument("--workers", type=int, default=1, help="processes (one job: a policy x a seed)")
    parser.add_argument(
        "--json", type=pathlib.Path, default=None, help="bench/results/trace_replay_<trace>.json"
    )
    args = parser.parse_args(argv)

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in policies:
        if name not in POLICIES:
            parser.error(f"unknown policy {name!r} (known: {', '.join(POLICIES)})")
    seeds = parse_seeds(args.seeds)
    trace = trace_name(args.pods)
    out = args.json or RESULTS / f"trace_replay_{trace}.json"
    nodes = tuple(read_nodes(args.nodes))
    tasks = tuple(read_tasks(args.pods))
    jobs = [
        Job(
            policy=p,
            seed=s,
            nodes=nodes,
            tasks=tasks,
            inflate=args.inflate,
            cpu_scoring=args.cpu_tasks,
            strategy=args.strategy,
            steer=args.steer_pods,
            label=f"{trace}: ",
        )
        for p in policies
        for s in seeds
    ]
    capacity = pp.MILLI * sum(n.gpus for n in nodes)
    print(
        f"openb {trace}: {len(nodes)} nodes, {capacity // pp.MILLI} GPUs, {len(tasks)} tasks; "
        f"seeds {args.seeds}, inflate {args.inflate}; {len(jobs)} runs on {args.workers} worker(s)",
        flush=True,
    )
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []

    def report(run: dict[str, Any]) -> None:
        curve = run["allocation_pct"]
        print(
            f"{run['policy']} seed {run['seed']}: {curve.get(100, float('nan')):.2f}% / "
            f"{curve.get(130, float('nan')):.2f}% at 100% / 130%, unplaced {run['unplaced']}, "
            f"{run['cpu_s']} CPU-s ({run['wall_s']} s wall)",
            flush=True,
        )
        runs.append(run)

    if args.workers > 1:
        with concurrent.futures.ProcessPoolExecutor(max_workers=args.workers) as pool:
            for future in concurrent.futures.as_completed([pool.submit(replay, j) for j in jobs]):
                report(future.result())
    else:
        for job in jobs:
            report(replay(job))
    wall = time.perf_counter() - started

    result: dict[str, Any] = {
        **procfs.run_stamp(),
        "trace": trace,
        "nodes": str(args.nodes),
        "pods": str(args.pods),
        "gpus": capacity // pp.MILLI,
        "seeds": seeds,
        "inflate": args.inflate,
        "workers": args.workers,
        "wall_s": round(wall, 1),
        "policies": {},
        "published": {k: list(v) for k, v in PUBLISHED.get(trace, {}).items()},
    }
    for name in policies:
        mine = sorted((r for r in runs if r["policy"] == name), key=lambda r: r["seed"])
        entry: dict[str, Any] = {
            "allocation_pct": mean_curves(mine, "allocation_pct"),
            "fragmentation_pct": mean_curves(mine, "fragmentation_pct"),
            "per_seed": {
                str(r["seed"]): {
                    "100": r["allocation_pct"].get(100),
                    "130": r["allocation_pct"].get(130),
                    "unplaced": r["unplaced"],
                    "tasks": r["tasks"],
                    "wall_s": r["wall_s"],
                    "cpu_s": r["cpu_s"],
                    **({"gpualloc": r["gpualloc"]} if "gpualloc" in r else {}),
                }
                for r in mine
            },
            "wall_s_per_seed": round(sum(r["wall_s"] for r in mine) / len(mine), 2),
            "cpu_s_per_seed": round(sum(r["cpu_s"] for r in mine) / len(mine), 2),
        }
        if name == "gpualloc":
            entry["notes"] = gpualloc_notes(args.cpu_tasks, args.strategy, args.steer_pods)
        result["policies"][name] = entry

    print()
    print(table(result, trace))
    if "gpualloc" in policies:
        notes = gpualloc_notes(args.cpu_tasks, args.strategy, args.steer_pods).items()
        print("\ngpualloc: " + "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in notes))
    for name, entry in result["policies"].items():
        print(f"{name}: {entry['cpu_s_per_seed']} CPU-s, {entry['wall_s_per_seed']} s wall per seed")
    print(f"all {len(jobs)} runs: {wall:.1f} s on {args.workers} worker(s)")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    png = out.with_suffix(".png")
    plot(result, trace, png)
    print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
