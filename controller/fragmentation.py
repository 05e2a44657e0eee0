"""The ``leastFragmentation`` strategy: the node whose free GPUs the claim fragments least (pure).

After fragmentation gradient descent (Weng et al., "Beware of Fragmentation: Scheduling
GPU-Sharing Workloads with Fragmentation Gradient Descent", USENIX ATC '23), judged against a
*workload*: the shapes of the claims the controller has seen lately, each with its frequency.

Fragmentation of a node, ``F``
    For one shape, the node's free milli-GPU is all fragment when a claim of that shape cannot
    run there (its product does not match the node's GPUs, the node has fewer GPUs with the
    shape's milli left than the shape asks, or less CPU or memory left than its pods ask);
    when it can, only the GPUs with less than the shape's milli left are fragments. ``F`` is
    the sum over the shapes, weighed by their frequencies: the free GPU milli the next claim is
    expected to be unable to use. A node whose allocatable is not known has room for any pods.

Ranking
    A node's key is ``F`` after the claim's placement minus ``F`` before (lower first: the
    placement that wastes least of what the next claims need), then the free GPUs it would
    leave (fewer first: best fit), then its free CPU left (less first); the allocator then
    breaks ties by set quality and the node name. Without a workload (no claim seen yet)
    every delta is 0 and the strategy is best fit.

``F`` depends only on the node's product, the milli left on its GPUs (as a multiset), and
which shapes' CPU and memory its free CPU and memory still hold, so a ``Workload`` memoises it
by those: a cluster of many alike nodes is scored with a dictionary look-up per node.
``Recent`` keeps the last claims' shapes and gives the workload of the most frequent of them;
the controller's allocation of Pending claims passes it. Callers that pass none (``explain``,
moving a claim off a failed GPU, the simulation) rank such claims by best fit alone.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import fnmatch
from collections.abc import Iterable, Mapping, Sequence

from controller.asks import Ask, parse
from controller.screening import Screened
from gpualloc.api import models, quantities

STRATEGY = "leastFragmentation"
MILLI = 1000  # milli-GPU of one GPU
COVERAGE = 0.95  # a workload keeps the most frequent shapes until they cover this share of the claims
WINDOW = 2000  # claims ``Recent`` remembers
REFRESH = 50  # ``Recent`` rebuilds its workload after this many new claims (the memo starts anew)

Key = tuple[float, int, int]


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class Shape:
    """What one replica of a claim asks of one node."""

    gpus: int  # GPUs (0: pods that take no GPU, never part of a workload)
    milli: int = MILLI  # milli-GPU of each (1000: whole GPUs)
    cpu: int = 0  # millicores its pods ask
    memory: int = 0  # bytes its pods ask
    products: tuple[str, ...] = ()  # globs on the product name, any of which will do (empty: any)

    def accepts(self, product: str) -> bool:
        return not self.products or any(fnmatch.fnmatchcase(product, p) for p in self.products)


class Workload:
    """Shapes with their frequencies (normalised to sum to 1), and ``F``'s memo."""

    def __init__(self, weights: Mapping[Shape, float]) -> None:
        positive = {s: w for s, w in weights.items() if w > 0 and s.gpus > 0}
        total = sum(positive.values())
        self.shapes: tuple[Shape, ...] = tuple(sorted(positive))
        self.weights: tuple[float, ...] = tuple(positive[s] / total for s in self.shapes)
        self._cpus = sorted({s.cpu for s in self.shapes})
        self._memories = sorted({s.memory for s in self.shapes})
        self._memo: dict[tuple[str, tuple[int, ...], int, int], float] = {}
        self._accepts: dict[str, tuple[bool, ...]] = {}

    def __len__(self) -> int:
        return len(self.shapes)

    def fragmentation(self, product: str, left: Iterable[int], cpu: int | None, memory: int | None) -> float:
        """``F`` of a node of ``product`` GPUs with ``left`` milli free on each GPU and ``cpu``
        millicores and ``memory`` bytes free (None: not known, room for any pods)."""
        state = tuple(sorted((m for m in left if m > 0), reverse=True))
        cpu_level = len(self._cpus) if cpu is None else bisect.bisect_right(self._cpus, cpu)
        memory_level = len(self._memories) if memory is None else bisect.bisect_right(self._memories, memory)
        key = (product, state, cpu_level, memory_level)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = self._compute(product, state, cpu, memory)
        return found

    def _compute(self, product: str, left: tuple[int, ...], cpu: int | None, memory: int | None) -> float:
        accepts = self._accepts.get(product)
        if accepts is None:
            accepts = self._accepts[product] = tuple(s.accepts(product) for s in self.shapes)
        total = sum(left)
        value = 0.0
        for shape, weight, ok in zip(self.shapes, self.weights, accepts, strict=True):
            fits = (
                ok
                and (cpu is None or shape.cpu <= cpu)
                and (memory is None or shape.memory <= memory)
                and sum(1 for m in left if m >= shape.milli) >= shape.gpus
            )
            value += weight * (sum(m for m in left if m < shape.milli) if fits else total)
        return value

    def key(
        self,
        product: str,
        left: Sequence[int],
        cpu: int | None,
        memory: int | None,
        claim: Shape,
    ) -> Key:
        """The rank of placing ``claim`` on a node (module docstring, Ranking), lower first: the
        claim takes the GPUs whose milli left is the least that holds its milli."""
        after = taking(left, claim)
        cpu_after = None if cpu is None else cpu - claim.cpu
        memory_after = None if memory is None else memory - claim.memory
        delta = self.fragmentation(product, after, cpu_after, memory_after) - self.fragmentation(
            product, left, cpu, memory
        )
        free_after = sum(1 for m in after if m >= MILLI)
        return (round(delta, 6), free_after, cpu_after if cpu_after is not None else 0)


def taking(left: Sequence[int], claim: Shape) -> list[int]:
    """``left`` once ``claim`` took ``claim.gpus`` GPUs, those with the least milli that holds its
    milli (whole GPUs: free ones)."""
    after = sorted(left)
    taken = 0
    for i, m in enumerate(after):
        if taken == claim.gpus:
            break
        if m >= claim.milli:
            after[i] = m - claim.milli
            taken += 1
    return after


def shape_of(ask: Ask) -> Shape:
    """The shape of one replica of a claim of whole GPUs."""
    return Shape(
        gpus=ask.count,
        cpu=ask.pod_requests.get(quantities.CPU, 0),
        memory=ask.pod_requests.get(quantities.MEMORY, 0),
        products=(ask.product,) if ask.product else ask.products,
    )


def pods_key(
    workload: Workload, product: str, left: Sequence[int], cpu: int, memory: int, shape: Shape
) -> Key:
    """The rank of a node for pods that take no GPU (``shape.gpus == 0``), lower first: the
    fragmentation their CPU and memory add to the node's free GPUs (the GPU claims they leave
    no room for), then the node's free GPUs (fewer first: GPUs already in use), then its free
    CPU left (less first). The score a kube-scheduler extender would serve; gpualloc does not
    serve it yet."""
    return workload.key(product, left, cpu, memory, dataclasses.replace(shape, gpus=0, milli=MILLI))


def node_key(node: Screened, ask: Ask, workload: Workload | None) -> Key:
    """The allocator's rank of ``node`` for one replica of ``ask`` (module docstring, Ranking).
    The node's GPUs given whole count as free (1000 milli), the rest as full; claims that are not
    of whole GPUs (slots, MIG instances) are ranked by best fit alone."""
    if ask.exclusivity != "Exclusive":
        return (0.0, node.free - ask.count, 0)
    view = node.view
    known = bool(view.allocatable)
    cpu = view.free.get(quantities.CPU, 0) if known else None
    memory = view.free.get(quantities.MEMORY, 0) if known else None
    product = node.prep.healthy[0].product if node.prep.healthy else ""
    return (workload or EMPTY).key(product, (MILLI,) * node.free, cpu, memory, shape_of(ask))


class Recent:
    """The shapes of the last ``window`` claims seen; ``workload`` is theirs, rebuilt every
    ``refresh`` claims (the most frequent shapes covering ``COVERAGE`` of them)."""

    def __init__(self, window: int = WINDOW, refresh: int = REFRESH) -> None:
        self._seen: collections.deque[Shape] = collections.deque(maxlen=window)
        self._refresh = refresh
        self._since = 0
        self._workload = Workload({})

    def observe_claim(self, claim: models.GpuClaim) -> None:
        """Remember a claim of whole GPUs (one shape, whatever its replicas); others are not
        ranked by this workload."""
        ask = parse(claim)
        if not isinstance(ask, str) and ask.exclusivity == "Exclusive":
            self.observe(shape_of(ask))

    def observe(self, shape: Shape) -> None:
        self._seen.append(shape)
        self._since += 1
        if self._since >= self._refresh or len(self._seen) <= self._refresh:
            self._since = 0
            self._workload = typical(self._seen)

    def workload(self) -> Workload:
        return self._workload


EMPTY = Workload({})


def typical(shapes: Iterable[Shape], coverage: float = COVERAGE) -> Workload:
    """The most frequent shapes (equal counts: the larger shape first) until they cover
    ``coverage`` of ``shapes``, weighed by their counts."""
    counts = collections.Counter(shapes)
    total = sum(counts.values())
    chosen: dict[Shape, float] = {}
    covered = 0
    for shape, n in sorted(counts.items(), key=lambda kv: (kv[1], kv[0]), reverse=True):
        if covered >= coverage * total:
            break
        chosen[shape] = n
        covered += n
    return Workload(chosen)
