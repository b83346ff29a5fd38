"""The replay against closed forms (the performance model, docs/performance.md) and hand-worked timelines."""

from __future__ import annotations

import itertools

import pytest

from twobp_autograd.pipeline.actions import B, F, I, W
from twobp_autograd.pipeline.schedules import SCHEDULES, ScheduleError, schedule
from twobp_autograd.pipeline.simulator import StageCosts, fastest_max_pending, simulate

UNIT = StageCosts(forward=1, input_grad=1, weight_grad=1)
# Distinct F, I, W so a formula that swaps two terms fails.
UNEVEN = dict(forward=1.0, input_grad=2.0, weight_grad=3.0)


@pytest.mark.parametrize("num_stages", [2, 3, 4])
@pytest.mark.parametrize("per_stage", [1, 2, 5], ids=lambda n: f"m={n}xp" if n < 5 else "m=5")
@pytest.mark.parametrize("efficiency", [1.0, 0.5], ids=["no-concat-gain", "concat-halves-W"])
def test_gpipe_matches_the_closed_forms(num_stages: int, per_stage: int, efficiency: float) -> None:
    m = per_stage * num_stages if per_stage < 5 else per_stage
    costs = StageCosts(**UNEVEN, concat_efficiency=efficiency)
    f, i, w = UNEVEN.values()
    plain = simulate(schedule("gpipe", num_stages, m, twobp=False), costs)
    twobp = simulate(schedule("gpipe", num_stages, m, twobp=True), costs)
    assert plain.step_time == (m + num_stages - 1) * (f + i + w)
    w_concatenated = m * w * efficiency if m > 1 else w
    assert twobp.step_time == (m + num_stages - 1) * (f + i) + w_concatenated


@pytest.mark.parametrize("name", ["1f1b-1", "1f1b-2"])
@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_1f1b_without_2bp_has_the_gpipe_bubble(name: str, num_stages: int) -> None:
    result = simulate(schedule(name, num_stages, twobp=False), StageCosts(**UNEVEN))
    m = result.num_micro_batches
    assert result.step_time == (m + num_stages - 1) * sum(UNEVEN.values())


def test_two_ranks_unit_costs_gpipe_2bp_is_exactly_one_eighth_faster() -> None:
    plain = simulate(schedule("gpipe", 2, twobp=False), UNIT)
    twobp = simulate(schedule("gpipe", 2, twobp=True), UNIT)
    assert (plain.step_time, twobp.step_time) == (9, 8)
    assert plain.step_time / twobp.step_time == 1.125
    assert twobp.throughput / plain.throughput == 1.125
    assert plain.idle_time == [3, 3] and plain.bubble_ratio == 6 / 18
    assert twobp.idle_time == [2, 2] and twobp.bubble_ratio == 4 / 16


def test_two_ranks_unit_costs_1f1b_1_timeline() -> None:
    plain = simulate(schedule("1f1b-1", 2, twobp=False), UNIT)
    assert [[(e.action, e.start, e.end) for e in events] for events in plain.timelines] == [
        [(F(0), 0, 1), (F(1), 1, 2), (B(0), 4, 6), (B(1), 7, 9)],
        [(F(0), 1, 2), (B(0), 2, 4), (F(1), 4, 5), (B(1), 5, 7)],
    ]
    twobp = simulate(schedule("1f1b-1", 2, twobp=True), UNIT)
    assert [[(e.action, e.start, e.end) for e in events] for events in twobp.timelines] == [
        [(F(0), 0, 1), (F(1), 1, 2), (I(0), 3, 4), (W(0), 4, 5), (I(1), 5, 6), (W(1), 6, 7)],
        [(F(0), 1, 2), (I(0), 2, 3), (F(1), 3, 4), (I(1), 4, 5), (W(0), 5, 6), (W(1), 6, 7)],
    ]
    assert (plain.step_time, twobp.step_time) == (9, 7)
    assert (plain.bubble_ratio, twobp.bubble_ratio) == (6 / 18, 2 / 14)
    assert all(e.rank == rank for rank, events in enumerate(twobp.timelines) for e in events)


@pytest.mark.parametrize("num_stages,num_micro_batches", [(2, 4), (3, 6), (4, 8), (4, 16), (3, 12)], ids=str)
def test_zb_reaches_the_lower_bound_with_bounded_memory(num_stages: int, num_micro_batches: int) -> None:
    """At F = I = W the last rank starts p − 1 units late and has 3m units of work: zb ends
    then; 1F1B-2 with 2BP gets there too, but holds every micro-batch's weight work until the
    end. zb holds at most 2(p − r) − 1 graphs on rank r (ZB-H2's), p pending W."""
    zb = simulate(schedule("zb", num_stages, num_micro_batches), UNIT)
    paper = simulate(schedule("1f1b-2", num_stages, num_micro_batches), UNIT)
    assert zb.step_time == 3 * num_micro_batches + (num_stages - 1)
    assert zb.step_time <= paper.step_time
    assert max(zb.peak_pending_weight_grads) <= num_stages
    assert zb.peak_graphs == [min(num_micro_batches, 2 * (num_stages - r) - 1) for r in range(num_stages)]
    assert paper.peak_pending_weight_grads[-1] == num_micro_batches


@pytest.mark.parametrize("num_stages,num_micro_batches", [(2, 4), (2, 8), (4, 8)], ids=str)
def test_zb_fills_the_warm_up_wait_that_1f1b_2_leaves(num_stages: int, num_micro_batches: int) -> None:
    """With any message latency, 1F1B's rank 0 waits after its p warm-up forwards for the
    first gradient's round trip; zb runs its next forwards there (and W later), so it ends
    first. The old zb (1F1B's warm-up, W in the gaps) tied 1F1B-2 at p = 2, m = 4 (13.4)."""
    zb = simulate(schedule("zb", num_stages, num_micro_batches), UNIT, p2p_latency=0.1)
    paper = simulate(schedule("1f1b-2", num_stages, num_micro_batches), UNIT, p2p_latency=0.1)
    assert zb.step_time < paper.step_time
    assert zb.idle_time[0] < paper.idle_time[0]
    if (num_stages, num_micro_batches) == (2, 4):
        assert (round(zb.step_time, 6), round(paper.step_time, 6)) == (13.2, 13.4)


def test_memory_proxies() -> None:
    assert simulate(schedule("gpipe", 3, twobp=False), UNIT).peak_graphs == [3, 3, 3]
    one_f_one_b = simulate(schedule("1f1b-2", 3, twobp=False), UNIT)
    assert one_f_one_b.peak_graphs == [3, 2, 1]
    assert one_f_one_b.peak_pending_weight_grads == [0, 0, 0]
    deferred = simulate(schedule("1f1b-2", 3, twobp=True), UNIT)
    # backward-p1 frees the graph as B does; what 2BP adds is the weight work waiting for W.
    assert deferred.peak_graphs == [3, 2, 1]
    assert deferred.peak_pending_weight_grads == [4, 5, 6]


def test_p2p_latency_is_paid_once_per_hop_each_way() -> None:
    m, p, latency = 4, 3, 0.25
    result = simulate(schedule("gpipe", p, m, twobp=False), StageCosts(**UNEVEN), p2p_latency=latency)
    assert result.step_time == (m + p - 1) * sum(UNEVEN.values()) + 2 * (p - 1) * latency


def test_per_stage_costs_and_slow_stage() -> None:
    costs = [StageCosts(1, 0.5, 0.5), StageCosts(2, 1, 1)]
    result = simulate(schedule("gpipe", 2, twobp=False), costs)
    assert [[(e.start, e.end) for e in events] for events in result.timelines] == [
        [(0, 1), (1, 2), (7, 8), (9, 10)],
        [(1, 3), (3, 5), (5, 7), (7, 9)],
    ]
    assert result.step_time == 10
    with pytest.raises(ValueError, match="3 stage costs for 2 ranks"):
        simulate(schedule("gpipe", 2), costs + costs[:1])


def test_measured_w_table_and_explicit_full_backward() -> None:
    measured = StageCosts(1, 1, 1, weight_grad_by_count={1: 1.0, 2: 1.5})
    assert simulate(schedule("gpipe", 2, twobp=True), measured).step_time == 6 + 1.5
    assert simulate(schedule("1f1b-1", 2, twobp=True), measured).step_time == 7  # only single Ws
    with pytest.raises(KeyError, match="3 concatenated"):
        simulate(schedule("gpipe", 3, twobp=True), measured)
    as_function = StageCosts(1, 1, 1, weight_grad_by_count=lambda n: 1 + 0.25 * (n - 1))
    assert simulate(schedule("gpipe", 2, twobp=True), as_function).step_time == 6 + 1.25
    fused = StageCosts(1, 1, 1, full_backward=1.5)  # a fused B can beat I + W
    assert simulate(schedule("gpipe", 2, twobp=False), fused).step_time == 3 * 2.5


def test_w_of_everything_pending_costs_what_it_covers() -> None:
    result = simulate([[F(0), F(1), I(0), I(1), W()]], StageCosts(1, 1, 1, concat_efficiency=0.5))
    assert result.timelines[0][-1].duration == 1.0
    assert result.peak_pending_weight_grads == [2]


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("twobp", [False, True], ids=["plain", "2bp"])
def test_busy_and_idle_add_up(name: str, twobp: bool) -> None:
    result = simulate(schedule(name, 3, twobp=twobp), StageCosts(**UNEVEN), p2p_latency=0.1)
    for rank, events in enumerate(result.timelines):
        assert [e.action for e in events] == schedule(name, 3, twobp=twobp)[rank]
        assert all(a.end <= b.start for a, b in itertools.pairwise(events))
        assert result.busy_time[rank] + result.idle_time[rank] == pytest.approx(result.step_time)
    assert 0 < result.bubble_ratio < 1


def test_deadlock_is_reported() -> None:
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate([[F(0), B(0), F(1), B(1)], [F(0), F(1), B(0), B(1)]], UNIT)


def test_two_stages_per_rank_shrink_the_fill_and_drain() -> None:
    """The model cut into 4 stages of half the work on 2 ranks: each hop of the fill costs half.
    Rank 1 starts one half-unit late and has 24 of work, so 25 is the least possible."""
    half, whole = StageCosts(1, 1, 1), StageCosts(2, 2, 2)
    assert simulate(schedule("zbv", 2, 4), half).step_time == 25
    assert simulate(schedule("interleaved-1f1b", 2, 4), half).step_time == 25
    assert simulate(schedule("1f1b-2", 2, 4), whole).step_time == 26
    assert simulate(schedule("gpipe", 2, 4, twobp=False), whole).step_time == 30
    zbv = simulate(schedule("zbv", 2, 4), half)
    # 1F1B's graphs (p full stages), and each W right after its I but in the cool-down.
    assert zbv.peak_graphs == [4, 4] and zbv.peak_pending_weight_grads == [1, 3]


@pytest.mark.parametrize("num_ranks", [2, 4, 8])
def test_zbv_holds_what_1f1b_holds_and_keeps_its_lead_when_hand_overs_take_time(num_ranks: int) -> None:
    """ZB-V's graphs stay at 2p half stages per rank (1F1B's p full ones) whatever m is, and
    with hand-overs of 0.3 of a half stage it still ends before 1F1B-2 on whole stages."""
    half, whole = StageCosts(1, 1, 1), StageCosts(2, 2, 2)
    m = 4 * num_ranks
    zbv = simulate(schedule("zbv", num_ranks, m), half, p2p_latency=0.3)
    assert zbv.peak_graphs == [2 * num_ranks] * num_ranks
    assert zbv.step_time < simulate(schedule("1f1b-2", num_ranks, m), whole, p2p_latency=0.3).step_time


def test_a_hand_over_inside_a_rank_pays_no_latency() -> None:
    ranks = schedule("zbv", 1, 1)  # both stages on one rank: nothing crosses
    assert simulate(ranks, StageCosts(1, 1, 1), p2p_latency=5.0).step_time == 6
    with pytest.raises(ValueError, match="3 stage costs for 4 stages"):
        simulate(schedule("zbv", 2, 4), [StageCosts(1, 1, 1)] * 3)


@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_the_fastest_bound_keeps_concatenation_where_it_pays(num_stages: int) -> None:
    """With F = I = W, zb's default bound (p) already reaches the least step. Where W over n
    micro-batches costs less than n single Ws (W' = 0.8 W), a W forced before an I runs alone
    and forgoes that: the bound that ends first is 2p, whose last rank keeps its W for one
    concatenated tail, and it beats 1F1B-2, which zb at p pending lost to."""
    m = 2 * num_stages
    assert fastest_max_pending("zb", num_stages, m, UNIT) == num_stages
    costs = StageCosts(forward=1, input_grad=1, weight_grad=1, concat_efficiency=0.8)
    best = fastest_max_pending("zb", num_stages, m, costs)
    assert best == 2 * num_stages
    tuned = simulate(schedule("zb", num_stages, m, max_pending=best), costs).step_time
    default = simulate(schedule("zb", num_stages, m), costs).step_time
    paper = simulate(schedule("1f1b-2", num_stages, m), costs).step_time
    assert tuned < paper < default
    if num_stages == 2:
        assert (round(tuned, 6), round(paper, 6), round(default, 6)) == (12.2, 12.6, 13.0)
    assert fastest_max_pending("zb", num_stages, m, costs, limit=num_stages) == num_stages


def test_the_fastest_bound_takes_a_bound_of_at_least_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        fastest_max_pending("zb", 2, 4, UNIT, limit=0)
