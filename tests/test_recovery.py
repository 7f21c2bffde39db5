"""The recovery helper every after-reconnect step goes through (:mod:`mesh.recovery`): a step
that fails is tried again, with backoff, until it succeeds, and is named as pending meanwhile."""

from __future__ import annotations

import asyncio
import itertools
import time

from mesh.recovery import Recovery, Step
from tests.helpers import eventually


async def test_a_failing_step_is_retried_until_it_succeeds_and_is_pending_meanwhile() -> None:
    recovery = Recovery("test")
    tries = 0
    healed = asyncio.Event()

    async def step() -> None:
        nonlocal tries
        tries += 1
        if not healed.is_set():
            raise TimeoutError("the hub is electing a leader")

    recovery.add("registry watch", step)
    assert recovery.pending == []
    recovery.reconnected()
    # Counted once each failure is handled (a try counted in the step may not be yet).
    await eventually(lambda: _at_least(lambda: recovery.failures, 3), what="three failed tries")
    assert recovery.pending == ["registry watch"]
    assert tries >= 3
    healed.set()
    await eventually(lambda: _true(recovery.pending == []), what="the step restored")
    done = tries
    await asyncio.sleep(0.3)
    assert tries == done, "a restored step is not run again until the next reconnect"
    await recovery.close()


async def test_a_new_reconnect_restarts_a_step_and_undo_removes_it() -> None:
    recovery = Recovery("test")
    started: list[int] = []
    release = asyncio.Event()

    async def step() -> None:
        started.append(len(started))
        await release.wait()

    undo = recovery.add("consumer", step)
    recovery.reconnected()
    await eventually(lambda: _true(len(started) == 1), what="the first run")
    recovery.reconnected()  # the first run is cancelled, a second begins
    await eventually(lambda: _true(len(started) == 2), what="the second run")
    assert recovery.pending == ["consumer"]
    undo()
    assert recovery.pending == []
    recovery.reconnected()
    await asyncio.sleep(0.05)
    assert len(started) == 2
    await recovery.close()


async def _at_least(value: object, n: int) -> bool:
    return bool(value() >= n)  # type: ignore[operator]


async def _true(value: bool) -> bool:
    return value


async def test_again_runs_a_step_now_and_once_more_if_asked_while_it_runs() -> None:
    """State lost under a connected node (a consumer deleted): its step runs now, pending until
    it succeeds. Asked again while it runs (every refused pull says so, or the store it put
    back is deleted after it did), it is not restarted, and runs once more when it succeeds,
    however often it was asked: the run under way may have put things back before the loss.
    Before, that second loss was left alone, and nothing put it back."""
    recovery = Recovery("test")
    runs = {"consumer": 0, "registry": 0}
    release = asyncio.Event()

    def step_for(name: str) -> Step:
        async def step() -> None:
            runs[name] += 1
            await release.wait()

        return step

    recovery.add("consumer", step_for("consumer"))
    recovery.add("registry", step_for("registry"))
    assert recovery.again("consumer", "409 Consumer Deleted")
    await eventually(lambda: _true(runs["consumer"] == 1), what="the consumer's step")
    assert recovery.pending == ["consumer"]
    for _ in range(3):
        assert not recovery.again("consumer", "503")  # still running: left to go on
    release.set()
    await eventually(lambda: _true(runs["consumer"] == 2), what="the step once more")
    await eventually(lambda: _true(recovery.pending == []), what="the step restored")
    assert runs == {"consumer": 2, "registry": 0}
    await recovery.close()


async def test_again_asked_at_once_after_each_success_waits_longer_each_time() -> None:
    """A sign of loss that outlives the loss (every pull answered 503 while provisioning works)
    asks for the step again as soon as it ends: it waits 0.1 s, then twice as long each time up
    to 2 s, instead of running back to back (90 runs in 2 s before, in a review's repro)."""
    recovery = Recovery("test")
    runs: list[float] = []

    async def step() -> None:
        runs.append(time.monotonic())

    recovery.add("consumer", step)
    began = time.monotonic()
    while time.monotonic() - began < 2.0:
        if not recovery.pending:
            recovery.again("consumer", "503")
        await asyncio.sleep(0.005)
    pauses = [b - a for a, b in itertools.pairwise(runs)]
    assert 4 <= len(runs) <= 6, pauses  # 0, 0.1, 0.3, 0.7, 1.5 s
    assert all(later > earlier for earlier, later in itertools.pairwise(pauses)), pauses
    await recovery.close()
    assert not recovery.again("consumer", "after the close")  # nothing starts once closed


async def test_settled_waits_for_the_named_step_and_says_whether_it_is_back() -> None:
    """A caller that asked for a step again waits for it (bounded) before retrying its work."""
    recovery = Recovery("test")
    fails = itertools.count()

    async def slow() -> None:
        await asyncio.sleep(0.2)

    async def failing() -> None:
        next(fails)
        raise RuntimeError("not yet")

    recovery.add("slow", slow)
    recovery.add("failing", failing)
    try:
        assert await recovery.settled("slow", 1.0)  # nothing running: settled at once
        recovery.again("slow", "test")
        began = time.monotonic()
        assert await recovery.settled("slow", 5.0)
        assert 0.15 < time.monotonic() - began < 4.0  # it waited for the step, not the bound
        recovery.again("failing", "test")
        assert not await recovery.settled("failing", 0.3)  # still being retried
        assert next(fails) >= 2
    finally:
        await recovery.close()


async def test_a_rerun_after_a_quiet_spell_waits_for_no_pause_left_from_before() -> None:
    """A step asked for again while it runs runs once more, paced as ``again`` paces: a pause
    that grew while an earlier loss flapped counts only within 2 s of the last success. Before,
    the rerun waited that old pause (2 s) on the way to putting a deleted store back."""
    recovery = Recovery("test")
    runs: list[float] = []
    release = asyncio.Event()

    async def step() -> None:
        runs.append(time.monotonic())
        await release.wait()

    recovery.add("store", step)
    recovery._again[0] = (time.monotonic() - 60, 2.0)  # flapped long ago: the pause grew
    assert recovery.again("store", "deleted")
    await eventually(lambda: _true(len(runs) == 1), what="the step")
    assert not recovery.again("store", "deleted again")  # while it runs
    released = time.monotonic()
    release.set()
    await eventually(lambda: _true(len(runs) == 2), what="the step once more")
    assert runs[1] - released < 0.5, runs[1] - released
    await recovery.close()


async def test_a_loss_heard_several_times_before_its_step_runs_counts_once() -> None:
    """One deletion is heard several times (JetStream's advisory, then each open pull request
    ended "Consumer Deleted", then 503s while it is gone). What is heard before the step's run
    begins, that run finds: it runs once, and the pause before the next loss's run doubles once
    per loss. Before, a word heard in the pause (or before the step's first turn) asked for a
    rerun, paced again: the pause doubled per word, and a consumer deleted four times a second
    apart came back 0.05, 0.10, 0.42 and 1.65 s later (review S27a)."""
    recovery = Recovery("test")
    runs: list[float] = []

    async def step() -> None:
        runs.append(time.monotonic())

    recovery.add("consumer", step)
    waits = []
    for loss in range(4):
        began = time.monotonic()
        for word in ("409 Consumer Deleted", "advisory", "503"):
            recovery.again("consumer", word)  # all before the step's first turn
        await eventually(lambda n=loss: _true(len(runs) > n), what="the step")
        waits.append(round(runs[-1] - began, 2))
        await eventually(lambda: _true(recovery.pending == []), what="restored")
        await asyncio.sleep(0.05)  # lost again soon after: a flap, paced
    await asyncio.sleep(0.3)
    assert len(runs) == 4, f"{len(runs)} runs for 4 losses (waits {waits})"  # no reruns
    assert waits[1] < 0.15 and waits[2] < 0.3 and waits[3] < 0.6, waits  # 0.1, 0.2, 0.4 s
    await recovery.close()
