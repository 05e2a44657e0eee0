"""The openb trace's cluster and tasks, and the packing baselines Random, BestFit and FGD (pure).

Baselines for ``trace_replay.py``, not shipped code. Each follows the definition in Weng et al.,
"Beware of Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation Gradient Descent"
(USENIX ATC '23), as its simulator (github.com/hkust-adsl/kubernetes-scheduler-simulator) runs it:

Filter (every policy)
    A node can take a task when its free CPU and memory hold the task's, its GPU model is one the
    task accepts (``gpu_spec``, ``A|B`` alternatives; no spec: any), and its GPUs hold the task: a
    sharing task (one GPU, ``milli < 1000``) needs one GPU with ``milli`` left, a whole-GPU task
    needs ``gpus`` GPUs with nothing taken (a GPU with any share is not free whole). Shares of
    one GPU never add up past 1000. A CPU-only task needs CPU and memory only.

Node choice
    Each policy scores the nodes that pass, as integers, the way the simulator's score plugins do;
    the highest wins, and among equal scores the first node by name (the simulator's
    kube-scheduler fork breaks ties so, for reproducibility, where upstream draws at random).

    * ``random``: a node drawn uniformly among those that pass.
    * ``bestfit``: the least resource left after the placement,
      ``(1 - (cpu_left'/128,000 + gpu_milli_left'/8,000) / 2) * 100`` (the largest node's CPU and
      GPU milli as the scale), truncated.
    * ``fgd``: the node whose GPU fragmentation grows least: ``sigmoid((F(n) - F(n'))/1000) * 100``
      truncated, where ``F`` is the node's fragmentation before and after the placement (for a
      share, after its placement on the node's best GPU for it).

Fragmentation (``Fragmentation``)
    Measured against the *typical tasks*: the most frequent task shapes (milli-CPU, milli-GPU per
    GPU, GPUs, GPU-model constraint) of the whole trace, counted until they cover 95% of its tasks,
    each weighed by its frequency among them. For one node and one typical task, the node's free
    GPU milli is a fragment unless the task fits (model, CPU, and enough GPUs with its milli left),
    in which case only the GPUs with less than the task's milli left are fragments. CPU-only
    typical tasks can use no GPU, so for them every free GPU milli is a fragment. ``F(n)`` is the
    frequency-weighted sum over the typical tasks. The simulator's memo of ``F`` by node state is
    replaced here by computing it for every candidate at once (numpy).

GPU choice within the chosen node
    Whole GPUs: the lowest free indices. A share: ``bestfit`` the GPU with the least milli left
    that holds it, ``random`` one of those drawn uniformly, ``fgd`` the one whose placement scores
    best (the lowest index among equals).

``random`` draws from the ``random.Random`` passed in; nothing here reads a clock or a file.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

MILLI = 1000  # milli-GPU of one GPU
MAX_GPUS = 8  # GPUs per node in the trace, at most
BESTFIT_CPU_SCALE = 128_000  # milli-CPU of the largest node (the simulator's MaxSpecCpu)
BESTFIT_GPU_SCALE = 8_000  # milli-GPU of the largest node (MaxSpecGpu)
TYPICAL_COVERAGE = 0.95  # the typical tasks cover this share of the trace's tasks
MAX_SCORE = 100  # kube-scheduler's MaxNodeScore

IntArray = npt.NDArray[np.int64]
FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Task:
    """One task of the trace: what it asks of one node."""

    name: str
    cpu: int  # milli-CPU
    memory: int  # MiB
    gpus: int  # 0..8
    milli: int  # milli-GPU per GPU: 1000 for whole GPUs, less for a share, 0 for a CPU-only task
    spec: str = ""  # accepted GPU models, "A|B" ("": any)

    @property
    def total_milli(self) -> int:
        return self.gpus * self.milli

    @property
    def sharing(self) -> bool:
        return self.gpus == 1 and 0 < self.milli < MILLI

    @property
    def models(self) -> frozenset[str]:
        return frozenset(m for m in self.spec.split("|") if m)

    @property
    def shape(self) -> tuple[int, int, int, str]:
        """What fragmentation looks at: milli-CPU, milli-GPU per GPU, GPUs, the model constraint."""
        return (self.cpu, self.milli, self.gpus, self.spec)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    name: str
    cpu: int  # milli-CPU
    memory: int  # MiB
    gpus: int
    model: str  # "" for a CPU-only node


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    node: int  # index into ``Cluster.nodes``
    gpus: tuple[int, ...]  # GPU indices on that node (empty for a CPU-only task)


class Cluster:
    """Every node's free CPU, memory and milli-GPU per GPU; changed only by ``place``."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        if any(n.gpus > MAX_GPUS for n in nodes):
            raise ValueError(f"a node has more than {MAX_GPUS} GPUs")
        self.nodes = tuple(sorted(nodes, key=lambda n: n.name))  # index order is name order
        self.index = {n.name: i for i, n in enumerate(self.nodes)}
        self.models = tuple(sorted({n.model for n in self.nodes if n.gpus}))
        ids = {m: i + 1 for i, m in enumerate(self.models)}
        self.model_id: IntArray = np.array([ids[n.model] if n.gpus else 0 for n in self.nodes], np.int64)
        self.cpu: IntArray = np.array([n.cpu for n in self.nodes], np.int64)
        self.memory: IntArray = np.array([n.memory for n in self.nodes], np.int64)
        self.left: IntArray = np.zeros((len(self.nodes), MAX_GPUS), np.int64)
        for i, n in enumerate(self.nodes):
            self.left[i, : n.gpus] = MILLI
        self.capacity_milli = MILLI * sum(n.gpus for n in self.nodes)
        self.allocated_milli = 0
        self.changes: IntArray = np.zeros(len(self.nodes), np.int64)  # placements per node, so far
        self._accepting: dict[str, BoolArray] = {}

    def accepting(self, spec: str) -> BoolArray:
        """The nodes whose GPU model a task with this ``gpu_spec`` accepts (GPU nodes only)."""
        found = self._accepting.get(spec)
        if found is None:
            wanted = frozenset(m for m in spec.split("|") if m)
            ok = [bool(n.gpus) and (not wanted or n.model in wanted) for n in self.nodes]
            found = self._accepting[spec] = np.array(ok, np.bool_)
        return found

    def resources_fit(self, task: Task) -> BoolArray:
        """The nodes with the task's CPU and memory free, and a GPU model it accepts if it asks GPUs."""
        ok = (self.cpu >= task.cpu) & (self.memory >= task.memory)
        return ok & self.accepting(task.spec) if task.gpus else ok

    def feasible(self, task: Task) -> IntArray:
        """The nodes that can take the task (see the module docstring, Filter), by index."""
        ok = self.resources_fit(task)
        if task.sharing:
            ok &= (self.left >= task.milli).any(axis=1)
        elif task.gpus:
            ok &= (self.left == MILLI).sum(axis=1) >= task.gpus
        return np.flatnonzero(ok)

    def whole_gpus(self, node: int, count: int) -> tuple[int, ...]:
        """The ``count`` lowest indices of the node's GPUs with nothing taken."""
        return tuple(int(g) for g in np.flatnonzero(self.left[node] == MILLI)[:count])

    def place(self, task: Task, placement: Placement) -> None:
        """Take the task's CPU, memory and GPU milli on the node; raises if they are not free."""
        n = placement.node
        if self.cpu[n] < task.cpu or self.memory[n] < task.memory:
            raise ValueError(f"{task.name} does not fit {self.nodes[n].name}: CPU or memory")
        if len(placement.gpus) != task.gpus or len(set(placement.gpus)) != task.gpus:
            raise ValueError(f"{task.name} asks {task.gpus} GPUs, was given {placement.gpus}")
        if task.gpus and not self.accepting(task.spec)[n]:
            raise ValueError(f"{task.name} does not accept {self.nodes[n].model}")
        for g in placement.gpus:
            needed = task.milli if task.sharing else MILLI
            if not 0 <= g < self.nodes[n].gpus or self.left[n, g] < needed:
                raise ValueError(f"{task.name}: GPU {g} of {self.nodes[n].name} cannot take {needed}")
        self.cpu[n] -= task.cpu
        self.memory[n] -= task.memory
        for g in placement.gpus:
            self.left[n, g] -= task.milli
        self.allocated_milli += task.total_milli
        self.changes[n] += 1


# ------------------------------------------------------------------ fragmentation


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TypicalTask:
    cpu: int
    milli: int
    gpus: int
    spec: str
    weight: float  # its frequency among the typical tasks (they sum to 1)


def typical_tasks(tasks: Iterable[Task], coverage: float = TYPICAL_COVERAGE) -> list[TypicalTask]:
    """The most frequent task shapes, most frequent first, until they cover ``coverage`` of the
    tasks, with their frequencies renormalised over the chosen (the simulator's typical pods).
    Equal counts: the larger shape (CPU, then milli-GPU, GPUs, spec) first."""
    counts = collections.Counter(t.shape for t in tasks)
    total = sum(counts.values())
    ordered = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
    chosen: list[tuple[tuple[int, int, int, str], int]] = []
    covered = 0
    for shape, n in ordered:
        if covered >= coverage * total:
            break
        chosen.append((shape, n))
        covered += n
    return [
        TypicalTask(cpu=cpu, milli=milli, gpus=gpus, spec=spec, weight=n / covered)
        for (cpu, milli, gpus, spec), n in chosen
    ]


class Fragmentation:
    """``F``, a node state's expected GPU fragmentation in milli-GPU against the typical tasks."""

    def __init__(self, typical: Sequence[TypicalTask], cluster: Cluster) -> None:
        gpu_tasks = [t for t in typical if t.gpus and t.milli]
        self.total_weight = sum(t.weight for t in typical)
        self.levels: IntArray = np.array(sorted({t.milli for t in gpu_tasks}) or [MILLI], np.int64)
        level = {int(m): i for i, m in enumerate(self.levels)}
        self.level_of: IntArray = np.array([level[t.milli] for t in gpu_tasks], np.int64)
        self.gpus: IntArray = np.array([t.gpus for t in gpu_tasks], np.int64)
        self.cpu: IntArray = np.array([t.cpu for t in gpu_tasks], np.int64)
        self.weight: FloatArray = np.array([t.weight for t in gpu_tasks], np.float64)
        # accepts[model id, k]: typical task k may run on that model (id 0: no GPUs, never).
        models = ("", *cluster.models)
        self.accepts: BoolArray = np.array(
            [[bool(m) and (not t.spec or m in t.spec.split("|")) for t in gpu_tasks] for m in models],
            np.bool_,
        ).reshape(len(models), len(gpu_tasks))

    def of(self, left: IntArray, cpu: IntArray, model: IntArray) -> FloatArray:
        """``F`` of each state: ``left`` (states x GPUs) milli-GPU free per GPU, ``cpu`` milli-CPU
        free, ``model`` the model id (``Cluster.model_id``)."""
        total = left.sum(axis=1).astype(np.float64)
        at_least = left[:, None, :] >= self.levels[None, :, None]  # states x levels x GPUs
        count = at_least.sum(axis=2)[:, self.level_of]  # GPUs holding each typical task's milli
        below = np.where(at_least, 0, left[:, None, :]).sum(axis=2)[:, self.level_of]
        fits = self.accepts[model] & (count >= self.gpus[None, :]) & (cpu[:, None] >= self.cpu[None, :])
        # Every free milli is a fragment, except, for a typical task that fits, the GPUs holding its milli.
        usable = np.where(fits, total[:, None] - below, 0.0)
        result: FloatArray = total * self.total_weight - usable @ self.weight
        return result


class FragLedger:
    """Every node's ``F`` now, and their sum, kept as tasks land (``update``)."""

    def __init__(self, fragmentation: Fragmentation, cluster: Cluster) -> None:
        self.fragmentation = fragmentation
        self.cluster = cluster
        self.now: FloatArray = fragmentation.of(cluster.left, cluster.cpu, cluster.model_id)
        self.total = float(self.now.sum())

    def update(self, node: int) -> None:
        c, one = self.cluster, slice(node, node + 1)
        value = float(self.fragmentation.of(c.left[one], c.cpu[one], c.model_id[one])[0])
        self.total += value - float(self.now[node])
        self.now[node] = value

    def ratio_pct(self) -> float:
        """Fragmented milli-GPU as a share of the free milli-GPU, in percent (0 when none is free)."""
        free = int(self.cluster.left.sum())
        return 100.0 * self.total / free if free else 0.0


# ------------------------------------------------------------------ the policies


def _pick_highest(scores: IntArray) -> int:
    """The position of the highest score, the first among equals (candidates are in name order)."""
    return int(np.argmax(scores))


def _first_fitting_share(left: IntArray, milli: int) -> int:
    """The GPU with the least milli left that holds ``milli`` (the lowest index among equals)."""
    room = np.where(left >= milli, left, MILLI + 1)
    return int(np.argmin(room))


def choose_random(cluster: Cluster, task: Task, rng: random.Random) -> Placement | None:
    candidates = cluster.feasible(task)
    if not len(candidates):
        return None
    node = int(candidates[rng.randrange(len(candidates))])
    if task.sharing:
        fitting = np.flatnonzero(cluster.left[node] >= task.milli)
        return Placement(node=node, gpus=(int(fitting[rng.randrange(len(fitting))]),))
    return Placement(node=node, gpus=cluster.whole_gpus(node, task.gpus))


def choose_bestfit(cluster: Cluster, task: Task) -> Placement | None:
    candidates = cluster.feasible(task)
    if not len(candidates):
        return None
    cpu_after = (cluster.cpu[candidates] - task.cpu) / BESTFIT_CPU_SCALE
    gpu_after = (cluster.left[candidates].sum(axis=1) - task.total_milli) / BESTFIT_GPU_SCALE
    left_over = 0.5 * cpu_after + 0.5 * gpu_after
    scores = np.trunc((1.0 - left_over) * MAX_SCORE).astype(np.int64)
    node = int(candidates[_pick_highest(scores)])
    if task.sharing:
        return Placement(node=node, gpus=(_first_fitting_share(cluster.left[node], task.milli),))
    return Placement(node=node, gpus=cluster.whole_gpus(node, task.gpus))


def _fgd_score(before: FloatArray, after: FloatArray) -> IntArray:
    """``sigmoid((F - F') / 1000) * 100``, truncated: a placement that adds little fragmentation
    scores high."""
    delta = np.clip((before - after) / MILLI, -700.0, 700.0)
    return np.trunc(MAX_SCORE / (1.0 + np.exp(-delta))).astype(np.int64)


def choose_fgd(cluster: Cluster, task: Task, ledger: FragLedger) -> Placement | None:
    candidates = cluster.feasible(task)
    if not len(candidates):
        return None
    frag = ledger.fragmentation
    left = cluster.left[candidates]
    cpu_after = cluster.cpu[candidates] - task.cpu
    model = cluster.model_id[candidates]
    before = ledger.now[candidates]
    if not task.sharing:
        after_left = left
        if task.gpus:
            free = left == MILLI
            taken = free & (np.cumsum(free, axis=1) <= task.gpus)
            after_left = np.where(taken, 0, left)
        scores = _fgd_score(before, frag.of(after_left, cpu_after, model))
        node = int(candidates[_pick_highest(scores)])
        return Placement(node=node, gpus=cluster.whole_gpus(node, task.gpus))
    # A share: one option per GPU that holds it, the first of each equal milli-left on a node
    # (equal GPUs give equal states).
    holds = left >= task.milli
    same_earlier = (left[:, :, None] == left[:, None, :]) & np.tri(MAX_GPUS, k=-1, dtype=np.bool_)[None]
    rows, gpus = np.nonzero(holds & ~same_earlier.any(axis=2))
    after_left = left[rows].copy()
    after_left[np.arange(len(rows)), gpus] -= task.milli
    option_scores = _fgd_score(before[rows], frag.of(after_left, cpu_after[rows], model[rows]))
    node_scores = np.full(len(candidates), -1, np.int64)
    np.maximum.at(node_scores, rows, option_scores)
    pick = _pick_highest(node_scores)
    # On the chosen node, the lowest-index GPU among its best options.
    mine = (rows == pick) & (option_scores == node_scores[pick])
    gpu = int(gpus[mine].min())
    return Placement(node=int(candidates[pick]), gpus=(gpu,))
