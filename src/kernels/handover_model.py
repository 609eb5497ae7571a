"""The split kernel's hand-over protocol as a program a CPU can check.

mla_verify_split_kernel's score warps and value warps pass tiles to each other through
barrier 0. Nothing else orders them, so a slip in that schedule is a data race that
tests may never hit. This module states the two groups' steps in the kernel's order
(`score_steps`, `value_steps`) and runs them under many random schedules with vector
clocks, reporting

- a barrier round that one group enters twice before the other has come (the hardware
  would count the extra arrival into the wrong round),
- a deadlock, and
- two accesses to the same shared-memory buffer, one of them a write, that no barrier
  orders (a race).

A barrier step is `sync` (wait for the round) or `arrive` (count in and go on); the kernel
uses only `sync` since v12, and `arrive` stays for testing the checker. A group is one
agent: its four warps keep program order among themselves through the mid-tile barrier-0
round (the shipped GROUP_BARRIERS=0) or through the group's own named barrier (kBarScore,
kBarValue with GROUP_BARRIERS=1), which this model does not need to see. A cp.async copy is
a write at the time it is issued, which is when its slot must be free.

The ring is used outside the loop too, and `check` models the shipped build's use of it: the
value warps copy the first `early_stages` tiles before tile 0's hand-over and the rest after it
(PROLOGUE_EARLY_STAGES); the score warps stage their Q rows in the stages after those, before
that hand-over (SPLIT_Q_SMEM, where they fit); and after the last round the value warps stage
their partial rows in the ring (SPLIT_BF16_PARTIALS). The score warps' last ring read comes
before the last hand-over, so what orders that staging is among the value warps themselves
(the final cta_sync, then kBarValue): one agent here, so outside this model.

    from sm120_workbook.kernels.handover_model import check
    check(num_tiles=9, stages=4)               # raises ProtocolError on a broken schedule
    check(num_tiles=9, stages=4, q_rows=32)    # the shipped build's prologue with 32 rows of Q
    check(num_tiles=9, stages=4, pv_lag=True)  # the PV_LAG=1 build
    check_wide(num_tiles=9, stages=4)          # the wide kernel's ring (mla_verify_wide.cuh)
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

# Barrier ids as in mla_verify.cuh.
HANDOVER = END = 0   # both are cta_sync (barrier 0) in the kernel
SCORE, VALUE = 0, 1


class ProtocolError(AssertionError):
    pass


def q_stages_of(stages: int, early_stages: int, q_rows: int, stage_keys: int = 16) -> tuple[int, ...]:
    """The ring stages the score warps stage Q in (SPLIT_Q_SMEM): from the first stage the
    prologue leaves free, as many as q_rows rows take at stage_keys rows a stage; none where they
    do not fit (the kernel's kQSmem)."""
    need = -(-q_rows // stage_keys)
    return tuple(range(early_stages, early_stages + need)) if early_stages + need <= stages else ()


def score_steps(num_tiles: int, stages: int, parity: bool = True, group_barriers: bool = False,
                split_loads: bool = False, q_stages: tuple[int, ...] = ()):
    """The score warps' steps, in the kernel's order. `parity` False puts P(t) and the row
    scale of every tile in one buffer: a deliberate bug, for testing the checker.
    `group_barriers` is the GROUP_BARRIERS=1 build: the mid-tile round is the group's own.
    `split_loads` is SPLIT_LOADS=1: after the mid-tile round the score warps copy the upper
    part of each key row of tile t-1+stages into tile t-1's stage (the value warps copy the
    lower part, "stage"; the upper part is "stage_hi"). `q_stages`: the stages Q goes through
    before tile 0's hand-over (SPLIT_Q_SMEM; q_stages_of)."""
    if split_loads and group_barriers:
        raise ValueError("split_loads is a schedule of the GROUP_BARRIERS=0 build")
    for s in q_stages:
        yield "write", ("stage", s)                  # Q's rows, then the fragments by ldmatrix
        yield "read", ("stage", s)
    yield "sync", HANDOVER                           # tile 0 has landed
    for t in range(num_tiles):
        par = t & 1 if parity else 0
        yield "read", ("stage", t % stages)          # S = Q.K(t)
        if split_loads:
            yield "read", ("stage_hi", t % stages)
        if not group_barriers:
            yield "sync", HANDOVER                   # the mid-tile round
            if split_loads and t >= 1 and t - 1 + stages < num_tiles:
                yield "write", ("stage_hi", (t - 1) % stages)
        yield "write", ("p", par)                    # softmax(t)
        yield "write", ("row_scale", par)
        yield "sync", HANDOVER                       # P(t) ready; tile t+1 landed
    yield "write", ("row_sums",)
    yield "sync", END


def value_prologue(num_tiles: int, stages: int, early_stages: int | None = None, split_loads: bool = False):
    """The value warps up to and through tile 0's hand-over: the ring's first `early_stages` tiles
    (PROLOGUE_EARLY_STAGES; None: all of them) copied before it, the rest right after it."""
    early = stages if early_stages is None else early_stages

    def copy(first, end):
        for s in range(first, min(end, num_tiles)):
            yield "write", ("stage", s)
            if split_loads:
                yield "write", ("stage_hi", s)

    yield from copy(0, early)
    yield "sync", HANDOVER                           # tile 0 has landed
    yield from copy(early, stages)


def value_epilogue(stages: int, staged_partials: bool):
    """After the last round (END): the row sums, and with SPLIT_BF16_PARTIALS the partial rows
    staged through the ring, which no warp reads as keys any more."""
    yield "read", ("row_sums",)
    if staged_partials:
        for s in range(stages):
            yield "write", ("stage", s)
            yield "read", ("stage", s)


def value_steps_pv_lag(num_tiles: int, stages: int, parity: bool = True, refill_distance: int = 2,
                       early_stages: int | None = None, staged_partials: bool = False):
    """The value warps' steps in the PV_LAG=1 build: round t refills the stage of tile t-2,
    meets the mid-tile round, multiplies tile t-1 beside the softmax(t), then hands over;
    the last tile is multiplied after the last hand-over. `refill_distance` 0 refills the
    stage of tile t while the score warps read it: a deliberate bug, for testing the checker.
    (1, the stage this group multiplies later in the round, is a bug of the group's own
    program order, which this model does not check.)"""
    def multiply(t):
        par = t & 1 if parity else 0
        yield "read", ("row_scale", par)
        yield "read", ("p", par)
        yield "read", ("stage", t % stages)

    yield from value_prologue(num_tiles, stages, early_stages)
    for t in range(num_tiles):
        done = t - refill_distance
        if done >= 0 and done + stages < num_tiles:
            yield "write", ("stage", done % stages)  # refill with tile done + stages
        yield "sync", HANDOVER                       # the mid-tile round
        if t >= 1:
            yield from multiply(t - 1)
        yield "sync", HANDOVER                       # P(t) ready; tile t+1 landed
    if num_tiles:
        yield from multiply(num_tiles - 1)
    yield "sync", END
    yield from value_epilogue(stages, staged_partials)


def value_steps(num_tiles: int, stages: int, parity: bool = True, late_refill: bool = False,
                refill_before_handover: bool = False, group_barriers: bool = False,
                pv_lag: bool = False, refill_distance: int = 2, split_loads: bool = False,
                early_refill: bool = False, early_stages: int | None = None, staged_partials: bool = False):
    """The value warps' steps, in the kernel's order. In the shipped build a barrier-0 round
    opens every tile, then the stage of tile t-1 is refilled. `group_barriers` is the
    GROUP_BARRIERS=1 build: no mid-tile round, the stage of tile t is refilled at the end of
    tile t after the value group's own barrier. `late_refill` is the LATE_REFILL build (it
    needs group_barriers); `refill_before_handover` refills tile t's stage before the
    hand-over that the score warps' last read of it precedes: a deliberate bug, for testing
    the checker (with group_barriers). `early_refill` is EARLY_REFILL=1: the stage of tile t is
    refilled right after P.V(t) instead of after the next mid-tile round. Each value warp then
    writes only the columns it alone reads (and rope, which no value warp reads), so the four
    warps need no round among themselves for it; the model checks it against the score warps.
    `early_stages` and `staged_partials`: the prologue and the epilogue (value_prologue,
    value_epilogue)."""
    if (late_refill or refill_before_handover) and not group_barriers:
        raise ValueError("late_refill and refill_before_handover are GROUP_BARRIERS=1 schedules")
    if split_loads and (group_barriers or late_refill or refill_before_handover or pv_lag):
        raise ValueError("split_loads is a schedule of the GROUP_BARRIERS=0 build (v16)")
    if early_refill and (group_barriers or late_refill or refill_before_handover or pv_lag or split_loads):
        raise ValueError("early_refill is a schedule of the GROUP_BARRIERS=0 build (v16)")
    if pv_lag:
        if group_barriers or late_refill or refill_before_handover:
            raise ValueError("pv_lag is a schedule of the GROUP_BARRIERS=0 build")
        yield from value_steps_pv_lag(num_tiles, stages, parity, refill_distance, early_stages, staged_partials)
        return
    rounds = not group_barriers
    yield from value_prologue(num_tiles, stages, early_stages, split_loads)
    for t in range(num_tiles):
        par = t & 1 if parity else 0
        if rounds:
            yield "sync", HANDOVER                   # the mid-tile round
            if not early_refill and t >= 1 and t - 1 + stages < num_tiles:
                yield "write", ("stage", (t - 1) % stages)
        if refill_before_handover and t + stages < num_tiles:
            yield "write", ("stage", t % stages)
        yield "sync", HANDOVER                       # tile t+1 landed: take P(t)
        if late_refill and t >= 1 and t - 1 + stages < num_tiles:
            yield "write", ("stage", (t - 1) % stages)   # refill with tile t-1+stages
        yield "read", ("row_scale", par)             # O rescale and O += P.V(t)
        yield "read", ("p", par)
        yield "read", ("stage", t % stages)
        if split_loads:
            yield "read", ("stage_hi", t % stages)
        if early_refill and t + stages < num_tiles:
            yield "write", ("stage", t % stages)     # right after P.V(t): refill with tile t + stages
        if not (late_refill or refill_before_handover or rounds) and t + stages < num_tiles:
            yield "write", ("stage", t % stages)     # refill with tile t + stages
    yield "sync", END
    yield from value_epilogue(stages, staged_partials)


@dataclass
class _Round:
    arrived: dict = field(default_factory=dict)      # agent -> its clock at arrival
    waiting: set = field(default_factory=set)        # agents blocked in sync


def run(score, value, rng: random.Random, names=("score", "value")) -> None:
    """One random schedule of the two step streams; raises ProtocolError on a violation."""
    programs = [iter(score), iter(value)]
    clock = [[0, 0], [0, 0]]
    pending = [next(p, None) for p in programs]
    blocked = [False, False]
    rounds: dict[int, _Round] = {}
    accesses: dict[tuple, list] = {}

    def step(a: int) -> None:
        op, arg = pending[a]
        clock[a][a] += 1
        if op in ("read", "write"):
            for b, kind, at in accesses.setdefault(arg, []):
                if b != a and "write" in (kind, op) and at[b] > clock[a][b]:
                    raise ProtocolError(f"race on {arg}: {names[b]} {kind} and "
                                        f"{names[a]} {op} are not ordered by a barrier")
            accesses[arg].append((a, op, list(clock[a])))
        else:
            rnd = rounds.setdefault(arg, _Round())
            if a in rnd.arrived:
                raise ProtocolError(f"{names[a]} entered barrier {arg} twice in one round")
            rnd.arrived[a] = list(clock[a])
            if op == "sync":
                rnd.waiting.add(a)
                blocked[a] = True
            if len(rnd.arrived) == 2:                # round complete: arrivals happen before releases
                joined = [max(c[i] for c in rnd.arrived.values()) for i in range(2)]
                for w in rnd.waiting:
                    clock[w] = [max(x, y) for x, y in zip(clock[w], joined)]
                    blocked[w] = False
                del rounds[arg]
        pending[a] = next(programs[a], None)

    while pending[0] is not None or pending[1] is not None:
        ready = [a for a in (SCORE, VALUE) if pending[a] is not None and not blocked[a]]
        if not ready:
            raise ProtocolError(f"deadlock: both groups wait ({names[0]} at {pending[0]}, {names[1]} at {pending[1]})")
        step(rng.choice(ready))
    if any(blocked) or rounds:
        raise ProtocolError(f"unfinished barrier rounds at exit: {sorted(rounds)}")


def check(num_tiles: int, stages: int, schedules: int = 200, seed: int = 0, early_stages: int = 2,
          q_rows: int = 16, stage_keys: int = 16, staged_partials: bool = True,
          q_stages: tuple[int, ...] | None = None, **variant) -> None:
    """Run the kernel's protocol under `schedules` random interleavings. The defaults are the
    shipped build's prologue and epilogue: PROLOGUE_EARLY_STAGES=2 (0, or not below `stages`:
    every stage first), Q's `q_rows` rows staged where they fit (`q_stages` names other stages,
    () none), and the partials staged through the ring."""
    rng = random.Random(seed)
    parity = variant.pop("parity", True)
    group_barriers = variant.get("group_barriers", False)
    split_loads = variant.get("split_loads", False)
    early = early_stages if 0 < early_stages < stages else stages
    if q_stages is None:
        q_stages = q_stages_of(stages, early, q_rows, stage_keys)
    for _ in range(schedules):
        run(score_steps(num_tiles, stages, parity, group_barriers=group_barriers, split_loads=split_loads,
                        q_stages=q_stages),
            value_steps(num_tiles, stages, parity, early_stages=early, staged_partials=staged_partials, **variant),
            rng)


# The wide kernel (mla_verify_wide.cuh). Its two row pairs share only the cp.async ring: every
# thread copies part of each tile (pair 0 keys 0-7, pair 1 keys 8-15) and every warp reads all of
# it. Their S partials, P and row sums are each pair's own, ordered by the pair's barriers (B, C),
# which this model treats as program order. Across pairs only barrier A (all 256 threads, once a
# round) orders anything.
WIDE_A = 0


def wide_pair_steps(pair: int, num_tiles: int, stages: int, pingpong: bool = False, refill_lag: int | None = None,
                    refill_in_qk: bool = True, fused: bool = False):
    """Row pair `pair`'s accesses to the ring, in the kernel's order: it copies its half of each
    tile's keys (buffer ("stage", slot, pair)) and reads both halves. Round t refills the stage of
    tile t-1-lag with tile t+ahead, past the split's end too (zero-fill), either between QK's
    k-steps (`refill_in_qk`, the default build) or right after barrier A. With ping-pong, pair 1
    multiplies tile t-1 and scores tile t in round t, so round t refills the stage of tile t-2
    (lag 1). `refill_lag` 0 with ping-pong refills tile t-1's stage, which pair 1 still reads:
    a deliberate bug, for testing the checker.
    `fused` (WIDE_FUSED) is the round in which every warp multiplies tile t-1 while it scores
    tile t, in one instruction stream (the refill between QK's k-steps): lag 1 for both pairs,
    whichever order a pair runs its softmax in."""
    lag = 1 if (pingpong or fused) else 0
    if lag and stages < 3:
        raise ValueError("ping-pong and the fused round need 3 or more stages")
    refill_lag = lag if refill_lag is None else refill_lag
    ahead = stages - 1 - refill_lag

    def read(tile):
        for half in (0, 1):
            yield "read", ("stage", tile % stages, half)

    for s in range(min(ahead, num_tiles)):
        yield "write", ("stage", s, pair)            # prologue
    if fused:
        for t in range(num_tiles + 1):
            yield "sync", WIDE_A                     # A(t): tile t landed
            if t < num_tiles:
                yield "write", ("stage", (t + ahead) % stages, pair)   # between QK(t)'s k-steps
                yield from read(t)                   # QK(t)
            if t > 0:
                yield from read(t - 1)               # PV(t-1), in the same stream
        return
    lagging = pingpong and pair == 1
    for t in range(num_tiles + lag):
        yield "sync", WIDE_A                         # A(t): tile t landed
        refill = ("write", ("stage", (t + ahead) % stages, pair))   # my keys of tile t + ahead
        if not refill_in_qk:
            yield refill
        if lagging and t > 0:
            yield from read(t - 1)                   # PV(t-1)
        if t < num_tiles:
            if refill_in_qk:
                yield refill                         # during QK(t)
            yield from read(t)                       # QK(t) (and PV(t) in step)


def check_wide(num_tiles: int, stages: int, schedules: int = 200, seed: int = 0, **variant) -> None:
    """The wide kernel's ring under `schedules` random interleavings of its two row pairs."""
    rng = random.Random(seed)
    for _ in range(schedules):
        run(wide_pair_steps(0, num_tiles, stages, **variant), wide_pair_steps(1, num_tiles, stages, **variant),
            rng, names=("row pair 0", "row pair 1"))
