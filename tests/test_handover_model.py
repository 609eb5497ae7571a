"""The kernels' barrier schedules (the split kernel's score/value hand-over, the wide kernel's ring), checked for races and deadlocks on a CPU."""
from __future__ import annotations

import pytest

from sm120_workbook.kernels.handover_model import ProtocolError, check, check_wide, wide_pair_steps


@pytest.mark.parametrize("stages", [2, 3, 4])       # TileConfig<32>, <16> with STAGES_16=3, <16>
@pytest.mark.parametrize("num_tiles", [1, 2, 3, 4, 5, 9, 17])
def test_kernel_schedule_is_lock_step_and_race_free(num_tiles, stages):
    # The shipped build: every barrier is barrier 0, so the groups must meet the same rounds
    # in the same order (a group entering one round twice raises), and it orders even one P buffer.
    check(num_tiles, stages, schedules=150)
    check(num_tiles, stages, schedules=50, parity=False)


@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("num_tiles", [1, 2, 3, 4, 5, 9, 17])
def test_early_refill_schedule_is_race_free(num_tiles, stages):
    # EARLY_REFILL=1: the stage of tile t refilled right after P.V(t), before the next mid-tile round
    check(num_tiles, stages, schedules=150, early_refill=True)


def test_early_refill_is_a_schedule_of_the_shipped_build():
    with pytest.raises(ValueError, match="early_refill"):
        check(4, 4, schedules=1, early_refill=True, group_barriers=True)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("num_tiles", [1, 2, 3, 4, 5, 9, 17])
def test_group_barriers_schedule_has_no_race_or_deadlock(num_tiles, stages):
    check(num_tiles, stages, schedules=150, group_barriers=True)   # GROUP_BARRIERS=1 (v14)


@pytest.mark.parametrize("num_tiles", [1, 2, 3, 4, 5, 9, 17])
def test_late_refill_schedule_has_no_race_or_deadlock(num_tiles):
    # GROUP_BARRIERS=1 LATE_REFILL=1, 16-key tiles
    check(num_tiles, 4, schedules=150, group_barriers=True, late_refill=True)


def test_late_refill_needs_group_barriers():
    with pytest.raises(ValueError, match="GROUP_BARRIERS=1"):
        check(4, 4, late_refill=True)


def test_checker_catches_groups_that_miss_a_round():
    import random

    from sm120_workbook.kernels.handover_model import run, score_steps, value_steps

    # the value group without its mid-tile rounds: the score group's extra round deadlocks or
    # pairs with the wrong hand-over
    with pytest.raises(ProtocolError):
        for seed in range(20):
            run(score_steps(5, 4), value_steps(5, 4, group_barriers=True), random.Random(seed))


def test_checker_catches_one_buffer_and_barrier_id_for_every_tile():
    # With one P buffer and the group barriers, the score group writes P(t+1) while the
    # value group reads P(t).
    with pytest.raises(ProtocolError, match="race on \\('p'"):
        check(6, 4, parity=False, group_barriers=True)


def test_checker_catches_an_arrival_counted_into_the_wrong_round():
    import random

    from sm120_workbook.kernels.handover_model import run

    rng = random.Random(0)
    for _ in range(20):   # the value group arrives twice; the score group syncs once
        with pytest.raises(ProtocolError, match="twice in one round|unfinished"):
            run([("sync", 2)], [("arrive", 2), ("arrive", 2)], rng)


def test_checker_catches_a_refill_before_the_score_warps_are_done():
    with pytest.raises(ProtocolError, match="race on \\('stage'"):
        check(9, 4, refill_before_handover=True, group_barriers=True)


def test_checker_catches_a_deadlock():
    import random

    from sm120_workbook.kernels.handover_model import run

    with pytest.raises(ProtocolError, match="deadlock"):
        run([("sync", 4), ("arrive", 2)], [("sync", 2), ("arrive", 4)], random.Random(0))


@pytest.mark.parametrize("stages", [3, 4])            # PV_LAG=1 needs a 16-key ring of 3+ stages
@pytest.mark.parametrize("num_tiles", [1, 2, 3, 4, 5, 9, 17])
def test_pv_lag_schedule_is_lock_step_and_race_free(num_tiles, stages):
    check(num_tiles, stages, schedules=150, pv_lag=True)


def test_pv_lag_needs_both_p_buffers():
    # P.V(t-1) reads P(t-1) while the softmax writes P(t): one buffer for both is a race.
    with pytest.raises(ProtocolError, match="race on \\('(p|row_scale)'"):
        check(9, 4, parity=False, pv_lag=True)


def test_checker_catches_a_pv_lag_refill_of_the_stage_being_scored():
    # refilling tile t's stage at the start of round t races with the score warps' QK(t)
    with pytest.raises(ProtocolError, match="race on \\('stage'"):
        check(9, 4, pv_lag=True, refill_distance=0)


def test_pv_lag_is_a_group_barriers_0_schedule():
    with pytest.raises(ValueError, match="GROUP_BARRIERS=0"):
        check(4, 4, pv_lag=True, group_barriers=True)


@pytest.mark.parametrize("stages", [3, 4])
@pytest.mark.parametrize("num_tiles", [1, 2, 3, 4, 5, 9, 17])
def test_split_loads_schedule_is_race_free(num_tiles, stages):
    # SPLIT_LOADS=1: the score warps refill the upper part of tile t-1's stage after mid(t)
    check(num_tiles, stages, schedules=150, split_loads=True)


def test_split_loads_refill_before_the_mid_round_races():
    # the same copies issued before mid(t) overwrite tile t-1's stage while P.V(t-1) reads it
    import random

    from sm120_workbook.kernels.handover_model import run, score_steps, value_steps

    steps = list(score_steps(9, 4, split_loads=True))
    # move every stage_hi write one step earlier, ahead of its mid-tile sync
    for i, st in enumerate(steps):
        if st[0] == "write" and st[1][0] == "stage_hi":
            steps[i - 1], steps[i] = steps[i], steps[i - 1]
    with pytest.raises(ProtocolError, match="race on \\('stage_hi'"):
        for seed in range(50):
            run(steps, value_steps(9, 4, split_loads=True), random.Random(seed))


def test_split_loads_is_a_group_barriers_0_schedule():
    with pytest.raises(ValueError, match="GROUP_BARRIERS=0"):
        check(4, 4, split_loads=True, group_barriers=True)


@pytest.mark.parametrize("num_tiles", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("stages,pingpong", [(4, True), (3, True), (4, False), (3, False), (2, False)])
@pytest.mark.parametrize("refill_in_qk", [True, False])
def test_wide_kernel_ring_is_race_free(num_tiles, stages, pingpong, refill_in_qk):
    check_wide(num_tiles, stages, pingpong=pingpong, refill_in_qk=refill_in_qk)


@pytest.mark.parametrize("refill_in_qk", [True, False])
def test_checker_catches_a_wide_pingpong_refill_of_the_stage_pair_1_still_multiplies(refill_in_qk):
    with pytest.raises(ProtocolError, match="race on"):
        check_wide(9, 4, pingpong=True, refill_lag=0, refill_in_qk=refill_in_qk)


@pytest.mark.parametrize("num_tiles", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("stages", [3, 4])
def test_wide_fused_round_is_race_free(num_tiles, stages):
    check_wide(num_tiles, stages, fused=True)


def test_checker_catches_a_wide_fused_refill_of_the_stage_still_multiplied():
    with pytest.raises(ProtocolError, match="race on"):
        check_wide(9, 4, fused=True, refill_lag=0)


def test_checker_catches_a_wide_in_step_refill_of_the_stage_being_read():
    with pytest.raises(ProtocolError, match="race on"):
        check_wide(9, 4, pingpong=False, refill_lag=-1)


def test_wide_pingpong_needs_three_stages():
    with pytest.raises(ValueError):
        list(wide_pair_steps(0, 4, 2, pingpong=True))


@pytest.mark.parametrize("q_rows", [8, 16, 32])     # decode at 8 rows (rows as N), 16 (one m16 tile), 32 (two)
@pytest.mark.parametrize("stages,early_stages", [(4, 2), (4, 1), (3, 2), (3, 1), (4, 0)])
@pytest.mark.parametrize("num_tiles", [1, 2, 3, 5, 9])
def test_prologue_q_staging_and_staged_partials_are_race_free(num_tiles, stages, early_stages, q_rows):
    # SPLIT_Q_SMEM: Q through the stages PROLOGUE_EARLY_STAGES leaves free until tile 0's hand-over;
    # SPLIT_BF16_PARTIALS: the partial rows through the ring after the last round
    check(num_tiles, stages, schedules=60, early_stages=early_stages, q_rows=q_rows)
    check(num_tiles, stages, schedules=20, early_stages=early_stages, q_rows=q_rows, pv_lag=stages >= 3)


def test_q_stages_are_the_free_ones_where_they_fit():
    from sm120_workbook.kernels.handover_model import q_stages_of

    assert q_stages_of(4, 2, 16) == (2,) and q_stages_of(4, 2, 32) == (2, 3) and q_stages_of(4, 2, 8) == (2,)
    assert q_stages_of(4, 1, 32) == (1, 2) and q_stages_of(3, 2, 16) == (2,)
    assert q_stages_of(3, 2, 32) == () and q_stages_of(4, 4, 16) == ()   # no room: Q in registers
    assert q_stages_of(2, 1, 32, stage_keys=32) == (1,)   # 32-key tiles, PROLOGUE_EARLY_STAGES=1


def test_checker_catches_q_staged_in_a_stage_the_prologue_fills():
    # stage 0 holds tile 0 before the hand-over; stage 2 is free only after it with early_stages=3
    for q_stages, early in (((0,), 2), ((1,), 2), ((2,), 3)):
        with pytest.raises(ProtocolError, match="race on \\('stage'"):
            check(5, 4, schedules=100, early_stages=early, q_stages=q_stages)

