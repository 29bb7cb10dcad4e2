"""Adaptive batching planner: per-sample lengths in, a per-rank micro-batch plan out.

Pure code: no torch.distributed, no environment reads, no I/O. Every process builds the same plan
from the same (lengths, trainable counts, spec, epoch) and takes its share with `EpochPlan.for_rank`.

One epoch is planned in three stages:
1. A seeded shuffle of all samples, seeded by (seed, epoch).
2. The shuffle is cut into optimizer steps of `samples_per_step` samples; the last partial step is
   kept. With `group_by_length`, the full steps are instead cut from windows of `group_window_steps`
   steps' samples sorted by length, and all full steps are then shuffled (the partial step stays
   last). Neither reads `num_ranks`, so step k holds the same samples on 1 or N GPUs.
3. Inside a step, samples are sorted longest first, grouped into micro-batches and dealt to ranks so
   that every rank gets the same number of micro-batches (no collective can hang) and the loads are
   balanced (greedy longest-processing-time, better than round-robin).
   - sorted-pad: the sorted step is cut into contiguous micro-batches of at most `micro_batch_size`
     samples, each padded only to its own longest sample.
   - packed: samples are first dealt to ranks by load, then each rank packs its samples first-fit
     into micro-batches of at most `token_budget` tokens (no padding); a rank that needs fewer
     micro-batches than another splits its fullest ones, so its micro-batches are lighter, never fewer.

Cost model (`StepPlan.rank_loads`): a sequence of L computed positions costs L + c * L**2: the dense
layers cost ~24*d^2 FLOPs per token and layer, causal attention ~2*d*L, so c = 1/(12*d_model);
the default c = 2**-15 matches d_model ~ 2.7k (between 1.5B and 8B models). Packed: a sample of
length L costs L + c*L^2 (varlen attention never crosses samples). Sorted-pad: a micro-batch of n
samples padded to Lmax costs n*Lmax + c*n*Lmax^2 (padding is computed too).

Edge cases: a step with fewer samples than micro-batch slots (e.g. fewer samples than ranks) gives
some ranks *empty* micro-batches (empty tuples) so counts stay equal; the trainer runs no forward for
them but still joins the all-reduce. In packed mode a sample longer than `token_budget` gets a
micro-batch of its own; that is the only case where the budget is exceeded.
"""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Literal, Sequence

import numpy as np

Mode = Literal["sorted-pad", "packed"]
_MODES = ("sorted-pad", "packed")


def _check_int(name: str, value: object, minimum: int, hint: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} ({hint}); got {value!r}")


@dataclass(frozen=True)
class PlanSpec:
    """What to plan: world size, global batch, batching mode and seed. Validated on construction.

    `token_budget` is required in packed mode and ignored in sorted-pad mode; `micro_batch_size` is
    the sorted-pad micro-batch and, in both modes, the batch size of the random-batching reference
    that `PlanStats.random_padding_fraction` is measured against.
    """

    num_ranks: int
    samples_per_step: int
    mode: Mode = "packed"
    micro_batch_size: int = 8
    token_budget: int | None = None
    group_by_length: bool = False
    group_window_steps: int = 64
    seed: int = 0
    attention_coef: float = 2.0**-15

    def __post_init__(self) -> None:
        _check_int("num_ranks", self.num_ranks, 1, "the number of GPUs")
        _check_int("samples_per_step", self.samples_per_step, 1,
                   "the global batch: per_device_train_batch_size x gradient_accumulation_steps x GPUs")
        if self.mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}; got {self.mode!r}")
        _check_int("micro_batch_size", self.micro_batch_size, 1, "samples per sorted-pad micro-batch")
        if self.mode == "packed":
            if self.token_budget is None:
                raise ValueError("packed mode needs token_budget (max tokens per micro-batch), e.g. "
                                 "per_device_train_batch_size * max_seq_length")
            _check_int("token_budget", self.token_budget, 1, "max tokens per packed micro-batch")
        _check_int("group_window_steps", self.group_window_steps, 1, "steps per length-sorted window")
        _check_int("seed", self.seed, 0, "the shuffle seed; numpy seeds must be non-negative")
        if not (math.isfinite(self.attention_coef) and self.attention_coef >= 0):
            raise ValueError(f"attention_coef must be a finite number >= 0; got {self.attention_coef!r}")


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step. `ranks[r][m]` are the sample indices of micro-batch m of rank r (longest
    first); every rank has the same number of micro-batches, some possibly empty. `num_trainable` is
    the step's global trainable-token count (the loss denominator). `rank_loads[r]` is rank r's cost
    under the module's cost model: sum of L + c*L^2 per computed sequence (see the module docstring).
    """

    index: int
    ranks: tuple[tuple[tuple[int, ...], ...], ...]
    num_trainable: int
    real_tokens: int
    computed_tokens: int
    rank_loads: tuple[float, ...]

    @property
    def micro_batches_per_rank(self) -> int:
        return len(self.ranks[0])


@dataclass(frozen=True)
class PlanStats:
    """Totals over the planned steps. Fractions are of computed tokens; imbalance is the mean over
    steps of max rank load / mean rank load; imbalance_bound is the mean over steps of the best any
    assignment can do when one sample (packed) or micro-batch (sorted-pad) outweighs the mean load."""

    num_steps: int
    num_samples: int
    real_tokens: int
    computed_tokens: int
    padding_fraction: float
    random_computed_tokens: int  # the same samples batched randomly, micro_batch_size per batch
    random_padding_fraction: float
    padding_tokens_saved: int  # random padding tokens - planned padding tokens
    padding_reduction: float  # padding_tokens_saved / random batching's padding tokens
    imbalance: float
    max_imbalance: float
    imbalance_bound: float
    micro_batches_per_rank: int  # total over the planned steps; the same on every rank
    min_micro_batches_per_step: int
    max_micro_batches_per_step: int
    empty_micro_batches: int
    oversized_samples: int  # packed: samples longer than token_budget, each in its own micro-batch
    rank_real_tokens: tuple[int, ...]


@dataclass(frozen=True)
class EpochPlan:
    """The plan of one epoch from `start_step` on; `steps[i].index` is the step's index in the epoch."""

    spec: PlanSpec
    epoch: int
    steps: tuple[StepPlan, ...]
    stats: PlanStats = field(repr=False)

    def for_rank(self, rank: int) -> list[list[list[int]]]:
        """`[step][micro-batch] -> sample indices` for one rank."""
        if not 0 <= rank < self.spec.num_ranks:
            raise ValueError(f"rank must be in [0, {self.spec.num_ranks}); got {rank}")
        return [[list(mb) for mb in step.ranks[rank]] for step in self.steps]


def steps_per_epoch(num_samples: int, samples_per_step: int) -> int:
    """Optimizer steps in one epoch: ceil(num_samples / samples_per_step); the last partial step is kept."""
    if num_samples <= 0:
        raise ValueError(f"empty dataset: num_samples is {num_samples}; build a dataset with samples")
    _check_int("samples_per_step", samples_per_step, 1, "the global batch in samples")
    return -(-num_samples // samples_per_step)


# ---------------------------------------------------------------- step formation (rank-independent)


def _as_counts(name: str, values: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of integers; got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.issubdtype(arr.dtype, np.number) or not np.all(arr == np.round(arr)):
            raise ValueError(f"{name} must hold integers (token counts)")
    return arr.astype(np.int64)


def _validate_inputs(lengths, trainable) -> tuple[np.ndarray, np.ndarray]:
    lens, tr = _as_counts("lengths", lengths), _as_counts("trainable", trainable)
    if lens.size == 0:
        raise ValueError("empty dataset: there are no samples to plan; check the dataset and its filters")
    if tr.shape != lens.shape:
        raise ValueError(f"trainable has {tr.size} entries but lengths has {lens.size}; give one per sample")
    if lens.min() < 1:
        raise ValueError(f"every sample needs length >= 1; sample {int(lens.argmin())} has {int(lens.min())}")
    bad = np.flatnonzero((tr < 0) | (tr > lens))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"trainable must lie in [0, length]; sample {i} has {int(tr[i])} of {int(lens[i])}")
    return lens, tr


def int_column(columns, name: str) -> np.ndarray:
    """Column `name` of a built dataset (or any mapping of columns) as an int64 array, read in one slice.

    A `datasets` column is a lazy `Column` (datasets 4); np.asarray over it reads it row by row: 7.5 s for a
    million rows against 0.05 s for the slice (datasets 4.8, the 2-core CPU machine), on every rank at start."""
    return np.asarray(columns[name][:], dtype=np.int64)


def sample_token_counts(columns, loss_type: str, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(lengths, trainable-token counts) per sample: the planner's two inputs, from a built dataset (or any
    mapping of its `length` and `num_trainable` columns), of `rows` only when given.

    The one place the trainable rule is written: a causal LM never predicts a sample's first token, so a
    loss over every token (`loss_type="all"`) trains length - 1 of them; a response-only loss trains the
    dataset's `num_trainable` column, counted by the same rule when the dataset was built.
    """
    lengths = int_column(columns, "length")
    lengths = lengths if rows is None else lengths[rows]
    if loss_type == "all":
        return lengths, np.maximum(lengths - 1, 0)
    trainable = int_column(columns, "num_trainable")
    return lengths, trainable if rows is None else trainable[rows]


def _epoch_order(lens: np.ndarray, spec: PlanSpec, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(plan order, plain shuffle): step k is order[k*S:(k+1)*S]. Never reads num_ranks."""
    n, S = lens.size, spec.samples_per_step
    perm = np.random.default_rng([spec.seed, epoch]).permutation(n)
    full = (n // S) * S
    if not spec.group_by_length or full == 0:
        return perm, perm
    window = np.arange(full) // (spec.group_window_steps * S)
    # Sort each window by length; ties keep the shuffle order, so the result is still seeded.
    key = window * (int(lens.max()) + 1) + lens[perm[:full]]
    grouped = perm[:full][np.argsort(key, kind="stable")].reshape(-1, S)
    step_keys = np.random.default_rng([spec.seed, epoch, 1]).permutation(grouped.shape[0])
    return np.concatenate([grouped[step_keys].ravel(), perm[full:]]), perm


# ---------------------------------------------------------------- dealing (vectorised over steps)


def _lpt(costs: np.ndarray, num_ranks: int, cap: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Greedy longest-processing-time dealing of items to ranks, each row (a step) independently.

    Items go heaviest first to the least-loaded rank that holds fewer than `cap` items (ties: lowest
    rank). Returns the rank and the slot (order of arrival on its rank) of every item, and the ranks'
    loads. The loop is over item positions; each pass works on all steps at once."""
    K, T = costs.shape
    order = np.argsort(-costs, axis=1, kind="stable")
    ordered = np.take_along_axis(costs, order, 1)
    load = np.zeros((K, num_ranks))
    count = np.zeros((K, num_ranks), dtype=np.int64)
    rank = np.empty((K, T), dtype=np.int64)
    slot = np.empty((K, T), dtype=np.int64)
    base = np.arange(K) * num_ranks  # flat indices into load/count: cheaper than 2-D fancy indexing
    load_flat, count_flat = load.reshape(-1), count.reshape(-1)
    for j in range(T):
        open_load = load if cap is None else np.where(count < cap, load, np.inf)
        flat = base + open_load.argmin(axis=1)
        rank[:, j], slot[:, j] = flat - base, count_flat[flat]
        load_flat[flat] += ordered[:, j]
        count_flat[flat] += 1
    np.put_along_axis(rank, order, rank.copy(), 1)
    np.put_along_axis(slot, order, slot.copy(), 1)
    return rank, slot, load


@dataclass
class _Block:
    """Dealt steps of equal size: item (k, j) is the j-th longest sample of step k."""

    idx: np.ndarray  # (K, s) sample indices
    lens: np.ndarray  # (K, s)
    rank: np.ndarray  # (K, s)
    slot: np.ndarray  # (K, s) micro-batch index on its rank
    per_rank: np.ndarray  # (K,) micro-batches per rank
    computed: np.ndarray  # (K,) computed tokens
    loads: np.ndarray  # (K, R)
    bound: np.ndarray  # (K,) heaviest single item's cost


def _deal_sorted_pad(lens: np.ndarray, spec: PlanSpec) -> tuple:
    K, s = lens.shape
    R, c = spec.num_ranks, spec.attention_coef
    per_rank = -(-(-(-s // spec.micro_batch_size)) // R)
    T = R * per_rank
    # T near-equal contiguous chunks; the longest samples get the smaller chunks (more spread there).
    sizes = s // T + (np.arange(T) >= T - s % T)
    starts = np.cumsum(sizes) - sizes
    maxlen = np.where(sizes > 0, lens[:, np.minimum(starts, s - 1)], 0)
    mb_cost = sizes * maxlen * (1.0 + c * maxlen)
    mb_rank, mb_slot, loads = _lpt(mb_cost, R, per_rank)
    mb_of_item = np.repeat(np.arange(T), sizes)
    computed = (sizes * maxlen).sum(axis=1)
    return (mb_rank[:, mb_of_item], mb_slot[:, mb_of_item], np.full(K, per_rank), computed, loads,
            mb_cost.max(axis=1))


def _first_fit(glen: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """First-fit of each row's items (in order) into bins of `budget`; an item over budget fills a bin
    alone. Returns the bin of every item and the bins used per row."""
    eff = np.minimum(glen, budget)
    # First fit leaves at most one bin half empty or emptier, so bins < 2*sum/budget + 1.
    max_bins = min(glen.shape[1], int(2 * eff.sum(axis=1).max() // budget) + 2)
    cap = np.full((glen.shape[0], max_bins), budget, dtype=np.int64)
    bins = np.zeros(glen.shape, dtype=np.int64)
    rows = np.arange(glen.shape[0])
    for p in range(glen.shape[1]):
        b = (cap >= eff[:, p, None]).argmax(axis=1)
        cap[rows, b] -= eff[:, p]
        bins[:, p] = b
    return bins, (cap < budget).sum(axis=1)


def _equalise(bins: np.ndarray, valid: np.ndarray, nbins: np.ndarray, target: np.ndarray) -> None:
    """Split the most populated bin of every row below `target` bins until it reaches it, moving every
    second item (longest first) to a new bin, so those micro-batches get lighter, not fewer. Rows
    with no bin of two items left keep their deficit: the rest become empty micro-batches."""
    while True:
        rows = np.flatnonzero(nbins < target)
        if rows.size == 0:
            return
        b, v = bins[rows], valid[rows]
        width = max(1, int(nbins[rows].max()))
        counts = ((b[:, :, None] == np.arange(width)) & v[:, :, None]).sum(axis=1)
        fullest = counts.argmax(axis=1)
        splittable = counts[np.arange(rows.size), fullest] >= 2
        if not splittable.any():
            return
        rows, b, v, fullest = rows[splittable], b[splittable], v[splittable], fullest[splittable]
        member = (b == fullest[:, None]) & v
        second = member & (np.cumsum(member, axis=1) % 2 == 0)
        bins[rows] = np.where(second, nbins[rows, None], b)
        nbins[rows] += 1


def _rank_within_group(group: np.ndarray) -> np.ndarray:
    """For each item, how many items of its group come before it (row-major order)."""
    flat = group.ravel()
    order = np.argsort(flat, kind="stable")
    ordered = flat[order]
    first = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    starts = np.repeat(first, np.diff(np.r_[first, flat.size]))
    pos = np.empty_like(flat)
    pos[order] = np.arange(flat.size) - starts
    return pos.reshape(group.shape)


def _deal_packed(lens: np.ndarray, spec: PlanSpec) -> tuple:
    K, s = lens.shape
    R, budget = spec.num_ranks, spec.token_budget
    cost = lens * (1.0 + spec.attention_coef * lens)
    rank, _, loads = _lpt(cost, R, None)
    # Lay every (step, rank) group's items out as one row, longest first, then pack each row.
    group = np.arange(K)[:, None] * R + rank
    pos = _rank_within_group(group)
    width = int(pos.max()) + 1
    glen = np.zeros((K * R, width), dtype=np.int64)
    glen[group, pos] = lens
    bins, nbins = _first_fit(glen, budget)
    per_rank = nbins.reshape(K, R).max(axis=1)
    _equalise(bins, glen > 0, nbins, np.repeat(per_rank, R))
    return rank, bins[group, pos], per_rank, lens.sum(axis=1), loads, cost.max(axis=1)


def _deal_block(idx: np.ndarray, lengths: np.ndarray, spec: PlanSpec, first_step: int) -> _Block:
    lens = lengths[idx]
    order = np.argsort(-lens, axis=1, kind="stable")  # longest first; ties keep the shuffle order
    idx, lens = np.take_along_axis(idx, order, 1), np.take_along_axis(lens, order, 1)
    deal = _deal_sorted_pad if spec.mode == "sorted-pad" else _deal_packed
    block = _Block(idx, lens, *deal(lens, spec))
    # Dealing starts at rank 0, so rank 0 would always get the heaviest item (and the memory peak);
    # rotating by the step index spreads that over the ranks without changing any step's balance.
    shift = (first_step + np.arange(idx.shape[0]))[:, None] % spec.num_ranks
    block.rank = (block.rank + shift) % spec.num_ranks
    block.loads = np.take_along_axis(block.loads, (np.arange(spec.num_ranks) - shift) % spec.num_ranks, 1)
    return block


# ---------------------------------------------------------------- assembly


def _micro_batches(block: _Block, R: int) -> tuple[list[tuple[int, ...]], np.ndarray]:
    """All micro-batches of the block as tuples, step-major then rank then slot; and step offsets."""
    per_step = R * block.per_rank
    offsets = np.cumsum(per_step) - per_step
    total = int(per_step.sum())
    gid = (offsets[:, None] + block.rank * block.per_rank[:, None] + block.slot).ravel()
    order = np.argsort(gid, kind="stable")  # stable: samples stay longest first inside a micro-batch
    ends = np.cumsum(np.bincount(gid, minlength=total)).tolist()
    flat = block.idx.ravel()[order].tolist()
    return [tuple(flat[a:b]) for a, b in zip([0] + ends[:-1], ends)], offsets


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC: building ~10^5 tuples of ints would trigger it many times over (about
    half the planning time for 10^6 samples), yet none of them can be part of a reference cycle."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _steps(block: _Block, trainable: np.ndarray, R: int, first: int) -> list[StepPlan]:
    mbs, offsets = _micro_batches(block, R)
    cols = zip(offsets.tolist(), block.per_rank.tolist(), trainable[block.idx].sum(axis=1).tolist(),
               block.lens.sum(axis=1).tolist(), block.computed.tolist(), block.loads.tolist())
    return [
        StepPlan(first + k, tuple(tuple(mbs[o + r * m: o + (r + 1) * m]) for r in range(R)), nt, real,
                 comp, tuple(load))
        for k, (o, m, nt, real, comp, load) in enumerate(cols)
    ]


def _random_computed(lens: np.ndarray, spec: PlanSpec) -> int:
    """Computed tokens of plain random batching: each step's shuffled samples cut into batches of
    micro_batch_size, each padded to its longest (what an unsorted per-device loader does)."""
    if lens.size == 0:
        return 0
    S, B = spec.samples_per_step, spec.micro_batch_size
    pos = np.arange(lens.size)
    batch = (pos // S) * -(-S // B) + (pos % S) // B
    starts = np.flatnonzero(np.r_[True, batch[1:] != batch[:-1]])
    return int((np.maximum.reduceat(lens, starts) * np.diff(np.r_[starts, lens.size])).sum())


def _imbalance(blocks: list[_Block]) -> tuple[float, float, float]:
    """Mean and max over steps of max/mean rank load, and the mean one-item lower bound of that ratio."""
    if not blocks:
        return 1.0, 1.0, 1.0
    loads = np.concatenate([b.loads for b in blocks])
    mean = loads.mean(axis=1)
    ratio = loads.max(axis=1) / mean
    bound = np.maximum(np.concatenate([b.bound for b in blocks]) / mean, 1.0)
    return float(ratio.mean()), float(ratio.max()), float(bound.mean())


def _stats(blocks: list[_Block], steps: list[StepPlan], spec: PlanSpec, random_computed: int) -> PlanStats:
    real = sum(int(b.lens.sum()) for b in blocks)
    computed = sum(int(b.computed.sum()) for b in blocks)
    per_rank = [st.micro_batches_per_rank for st in steps]
    rank_tokens = np.zeros(spec.num_ranks, dtype=np.int64)
    for b in blocks:
        np.add.at(rank_tokens, b.rank.ravel(), b.lens.ravel())
    pad = 1 - real / computed if computed else 0.0
    random_pad = 1 - real / random_computed if random_computed else 0.0
    imbalance, max_imbalance, bound = _imbalance(blocks)
    return PlanStats(
        num_steps=len(steps), num_samples=sum(b.idx.size for b in blocks), real_tokens=real,
        computed_tokens=computed, padding_fraction=pad, random_computed_tokens=random_computed,
        random_padding_fraction=random_pad, padding_tokens_saved=random_computed - computed,
        padding_reduction=(random_computed - computed) / max(random_computed - real, 1),
        imbalance=imbalance, max_imbalance=max_imbalance, imbalance_bound=bound,
        micro_batches_per_rank=sum(per_rank), min_micro_batches_per_step=min(per_rank, default=0),
        max_micro_batches_per_step=max(per_rank, default=0),
        empty_micro_batches=sum(not mb for st in steps for mbs in st.ranks for mb in mbs),
        oversized_samples=(sum(int((b.lens > spec.token_budget).sum()) for b in blocks)
                           if spec.mode == "packed" else 0),
        rank_real_tokens=tuple(rank_tokens.tolist()),
    )


def adaptive_partition_batches(lengths: Sequence[int] | np.ndarray, trainable: Sequence[int] | np.ndarray,
                               spec: PlanSpec, epoch: int = 0, start_step: int = 0) -> EpochPlan:
    """Plan one epoch: seeded steps of `spec.samples_per_step` samples (independent of the rank count),
    each dealt to `spec.num_ranks` ranks as equal numbers of balanced micro-batches.

    `lengths[i]` / `trainable[i]` are sample i's token count and trainable-token count. Only steps
    >= `start_step` are built (for resuming); they equal the same steps of the full plan, and
    `plan.stats` covers only them. Raises ValueError for an empty dataset or inconsistent inputs.
    """
    lens, tr = _validate_inputs(lengths, trainable)
    _check_int("epoch", epoch, 0, "the epoch index")
    total = steps_per_epoch(lens.size, spec.samples_per_step)
    if not isinstance(start_step, (int, np.integer)) or not 0 <= start_step <= total:
        raise ValueError(f"start_step must be in [0, {total}] (steps in this epoch); got {start_step!r}")
    S = spec.samples_per_step
    order, perm = _epoch_order(lens, spec, epoch)
    order = order[start_step * S:]
    full = (order.size // S) * S
    blocks = [_deal_block(part.reshape(-1, width), lens, spec, start_step + first)
              for part, width, first in ((order[:full], S, 0), (order[full:], order.size - full, full // S))
              if part.size]
    steps: list[StepPlan] = []
    with _gc_paused():
        for block in blocks:
            steps.extend(_steps(block, tr, spec.num_ranks, start_step + len(steps)))
    stats = _stats(blocks, steps, spec, _random_computed(lens[perm[start_step * S:]], spec))
    return EpochPlan(spec=spec, epoch=epoch, steps=tuple(steps), stats=stats)
