"""Reading one request's answer: a subscription, the stream contract, and repair.

:class:`AnswerReader` takes messages from a subscription, feeds them to an
:class:`protocol.stream.AnswerState`, and returns what may be passed on. When something may be
missing, it asks its *repair* for what was kept and feeds that too:

- a gap (the state holds events past a missing one);
- a reconnect or a slow-consumer drop on its connection (:attr:`Connection.losses` moved):
  whatever was published meanwhile never reached the subscription. The connection says so
  (:meth:`Connection.on_loss`) and the reader repairs at once, also when nothing later comes
  (a lost tail);
- a quiet spell: nothing for a while (1 s, then 2, 4, up to 8 s), in case the tail was lost with
  no later event to reveal the gap;
- its own buffer overflowing (the reader's consumer is slower than the stream).

A repair for a worker's events reads the answer store; for an edge's, it asks the edge to send
again what the reader lacks. A gap the store cannot fill (the event went out as its leader died),
or a repair the store cannot answer (no leader), is asked of the worker generating the answer
(*resend*), where the reader was given a way to.
The reader never passes on a gap; its caller decides, on its own deadlines, when waiting is
over. Repairs and the checks on the generator (*watch*, *resend*) run beside the reading, at
most one of each at a time (they wait on other processes); in-order tokens go on meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import DEFAULT_SUB_PENDING_MSGS_LIMIT, Subscription

from mesh.connection import Connection
from mesh.inline_sub import Inboxes, Listening, subscribe_inline
from mesh.logs import get_logger
from mesh.repair import Passer, Repair, SourceGone, Watch
from mesh.tasks import raise_if_cancelled
from protocol.codec import decode_event, message_token_fields
from protocol.errors import MeshError, UnavailableError
from protocol.messages import Answer, TokenEvent, WireEvent, token_event
from protocol.stream import AnswerState

log = get_logger(__name__)
NO_RESPONDERS = "503"
DEFAULT_PENDING = DEFAULT_SUB_PENDING_MSGS_LIMIT


_QUIET_FIRST_S = 1.0
_QUIET_MAX_S = 8.0
_GAP_RETRY_FIRST_S = 0.2
_UNSERVED_FIRST_S = 0.05
ASK_SOURCE_S = 0.1
"""A store read unanswered this long (its server dying) while events wait behind a gap, or one
that failed: the answer's source is asked for them too (``tests/test_reader_store_down.py``)."""
WATCH_QUIET_S = 0.25
"""After this long with nothing from a started answer, the reader checks on its generator (again
each time as long): a round trip when it lives, a takeover when it died (tokens: ms apart)."""
OFFLINE_LOOK_S = 0.05
"""While the connection is down, how often a reader whose watch is due looks whether it is back
(the watch asks only over a live link; ``tests/test_reader_checks.py``)."""


class AnswerReader:
    """Reads one subject into a bounded buffer of its own (``next_msg`` costs a task a message):
    beyond ``pending_limit`` it drops messages, as NATS does a slow consumer's, and refetches."""

    def __init__(
        self,
        conn: Connection,
        state: AnswerState,
        repair: Repair | None,
        *,
        what: str,
        pending_limit: int | None = None,
        unserved: Callable[[], Awaitable[None]] | None = None,
        unserved_for: float = 0.0,
        watch: Watch | None = None,
        resend: Watch | None = None,
    ) -> None:
        self.conn = conn
        self.state = state
        self.what = what
        self._repair = repair
        self._limit = pending_limit or DEFAULT_PENDING
        self._buffer: deque[Msg] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0  # the current wait's (see _wait)
        self._sub: Subscription | Listening | None = None
        self._losses, self._drops = conn.losses, 0  # the link's, and ours, as a repair began
        self._unlisten: Callable[[], None] | None = None
        self._repair_at: float | None = None
        self._gap_retry = _GAP_RETRY_FIRST_S
        self._store_down = False  # the last repair failed
        self._quiet = _QUIET_FIRST_S
        self.last_event = time.monotonic()  # when the last message arrived
        self._last_probe = self.last_event
        self.repairs = self.repaired_events = 0
        self.dropped = 0  # messages dropped because the buffer was full (a slow consumer)
        self._unserved = unserved
        self._unserved_until = time.monotonic() + unserved_for
        self._unserved_delay = _UNSERVED_FIRST_S
        self._send_again_at: float | None = None
        self._ended: MeshError | None = None
        self._watch = watch
        self._watched = self.last_event
        self._checks: dict[str, asyncio.Future[None]] = {}
        """The watch and the resend, each running beside the reading at most once: a check
        waits on another process (up to a second when it is moving between servers), and
        tokens that come meanwhile must not wait with it."""
        self._checked = False
        self._resend = resend
        self._passer: Passer | None = None
        self._ready: list[WireEvent] = []  # fed to the state in the callback, for next()
        self.passed = 0
        """Tokens passed on in the subscription's callback (:meth:`pass_tokens`)."""

    def pass_tokens(self, passer: Passer) -> None:
        """Let the subscription's callback pass in-order tokens straight to ``passer`` while
        :meth:`next` waits with nothing buffered: the caller's task is not woken for each token.
        Anything else (a start, an end, a gap, what does not decode) goes through :meth:`next`."""
        self._passer = passer

    async def subscribe(self, subject: str, inboxes: Inboxes | None = None) -> None:
        """Start receiving ``subject`` (one of ``inboxes``, if given) before anything is
        published to it. Raises :class:`UnavailableError` when the connection cannot."""
        try:
            nc, on_msg = self.conn.nc, self._on_msg
            if inboxes is None:
                self._sub = await subscribe_inline(nc, subject, on_msg)
            else:
                self._sub = await inboxes.listen(nc, subject, on_msg)
        except nats.errors.Error as exc:
            raise UnavailableError(
                f"cannot read {self.what}: the NATS connection is {type(exc).__name__}"
            ) from None
        if self._repair is not None:
            self._unlisten = self.conn.on_loss(self._wake)

    async def close(self) -> None:
        """Stop receiving. A closed reader calls nothing back: its owner's callbacks are let go
        here, so that the owner and the reader are freed at once, not as a cycle by the gc."""
        self._watch = self._resend = self._unserved = self._passer = None
        if self._timer is not None:
            self._timer.cancel()  # lets go of its callback (and so of this reader)
            self._timer = None
        unlisten, self._unlisten = self._unlisten, None
        if unlisten is not None:
            unlisten()
        for task in list(self._checks.values()):
            task.cancel()
        self._checks.clear()
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    def _on_msg(self, msg: Msg) -> None:
        """Called in the connection's read loop (:mod:`mesh.inline_sub`) for each message."""
        if len(self._buffer) >= self._limit:
            self.dropped += 1  # a slow consumer: drop it now, fetch it again (_next_check)
        elif self._buffer or not self._passed(msg):
            self._buffer.append(msg)
            self.last_event = time.monotonic()  # not quiet, even before it is read
        else:
            return
        self._wake()
        if self._passer is not None:  # tokens it passed on go out after the woken task's step
            self.conn.write_behind()

    def _wake(self) -> None:
        """End :meth:`next`'s wait: a message came, or the connection says messages may have
        been lost (then the repair is due at once, see :meth:`_next_check`)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _passed(self, msg: Msg) -> bool:
        """Feed a token message to the state here and pass what it releases on, if it is all
        in-order tokens and :meth:`next` waits with nothing pending; False when the message
        must go through the buffer instead (untouched). Synchronous: nothing else runs
        between the feed and the hand-over."""
        passer, waiter = self._passer, self._waiter
        if (
            passer is None
            or waiter is None
            or waiter.done()
            or self._ready
            or msg.headers
            or not msg.data
            or self.state.done
            or not passer.ready()
        ):
            return False
        fields = message_token_fields(msg.data)
        if fields is None:
            return False  # not a plain token: the buffer's way decodes it (or says why not)
        request_id, seq, text, attempt, n = fields
        self.last_event = time.monotonic()
        self._quiet = _QUIET_FIRST_S
        if self.state.take_token(request_id, attempt, seq, text, n):  # the next one: the hot path
            self.passed += 1
            passer.take_token(seq, text, attempt, n)
            return True
        step = self.state.feed(token_event(request_id, seq, text, attempt, n))
        tokens = [e for e in step.out if isinstance(e, TokenEvent)]
        if step.gap or len(tokens) != len(step.out):
            # A gap to repair, or a held end released: next() takes it from here, in order.
            self._ready.extend(step.out)
            if step.gap:
                self._on_gap()
            waiter.set_result(None)
            return True
        if tokens:
            self.passed += len(tokens)
            passer.take(tokens)
        return True

    def end(self, error: MeshError) -> None:
        """End :meth:`next` in ``error`` (its owner closes), whatever comes after."""
        self._ended = error
        self._wake()

    def repair_now(self) -> None:
        """Fetch what was kept before waiting for the next message."""
        self._repair_at = time.monotonic()

    async def next(self, timeout: float) -> list[WireEvent]:
        """Events to pass on, in order, as soon as there are some; an empty list when
        ``timeout`` seconds pass with nothing new (with a passer, also right after it checked
        on the answer's generator). Raises :class:`UnavailableError` when the connection is
        closed or nobody serves the subject, and the error given to :meth:`end` once it was."""
        if self._ended is not None:
            raise self._ended
        deadline = time.monotonic() + max(0.0, timeout)
        while not self.state.done or self._ready:
            if self._buffer and self._nothing_due():  # a message came, nothing else: hot path
                out = self._drain()
                if out:
                    return out
            if self._ready:  # fed in the callback, before anything buffered or repaired
                ready, self._ready = self._ready, []
                return ready
            raise_if_cancelled()
            now = time.monotonic()
            if self._send_again_at is not None and now >= self._send_again_at:
                assert self._unserved is not None
                self._send_again_at = None
                await self._unserved()
                continue
            if self._checked:
                self._checked = False
                if self._passer is not None:
                    # Its caller, not woken by the tokens passed on, last looked up to a tick
                    # ago: it sees what the check found (a worker gone, stalled) now.
                    return []
            if self._watch_due(now):
                assert self._watch is not None
                self._watched = now
                self._check("watch", self._watch)
            if self._repair is not None and self._repair_due(now):
                self._losses, self._drops = self.conn.losses, self.dropped
                self._check("repair", self._repair_beside)
            if self._buffer:
                out = self._drain()
                if out:
                    return out
                continue
            left = deadline - now
            if left <= 0:
                return []
            if self._ended is not None or self.conn.closed:
                raise self._ended or UnavailableError(f"NATS connection closed reading {self.what}")
            await self._wait(deadline)
        return []

    def _nothing_due(self) -> bool:
        """Whether what came can be read at once: nothing fed in the callback waits, no repair,
        resend, loss (the connection's) or ended check calls for a look first. A watch or
        quiet-spell repair due meanwhile is put off by the message (a gap sets a repair)."""
        return (
            not self._ready
            and self._repair_at is None
            and self._send_again_at is None
            and not self._checked
            and self.conn.losses == self._losses
            and self.dropped == self._drops
            and not self.state.done
        )

    def _due_in(self, now: float, deadline: float) -> float:
        """Seconds until :meth:`next` has something to do when no message comes: the caller's
        ``deadline``, a repair, a resend or a watch (0 or less: now)."""
        wait = deadline - now
        if self._repair is not None and "repair" not in self._checks:
            wait = min(wait, self._next_check(now) - now)
        if self._send_again_at is not None:
            wait = min(wait, self._send_again_at - now)
        watch_at = self._watch_at()
        if watch_at is not None:
            due = watch_at - now
            if due <= 0 and not self.conn.connected:
                due = OFFLINE_LOOK_S  # the watch waits for the link (see _watch_due)
            wait = min(wait, due)
        return wait

    async def _wait(self, deadline: float) -> None:
        """Until a message wakes the reader or something is due (:meth:`_due_in`): a future
        and a timer. Tokens passed on in the callback (:meth:`pass_tokens`) move what is due
        later (a watch after a quiet spell): the timer then sets itself again instead of waking
        the task for nothing. It outlives the wait: the next one keeps it when it is due no
        later, so a reader read token by token sets a timer about once per due time."""
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiter = waiter
        self._deadline = deadline
        due_at = loop.time() + max(0.001, self._due_in(time.monotonic(), deadline))
        if self._timer is None or self._timer.when() > due_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = loop.call_at(due_at, self._on_timer)
        try:
            await waiter
        finally:
            self._waiter = None

    def _on_timer(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait sets a timer of its own
        left = self._due_in(time.monotonic(), self._deadline)
        if left > 0.001:  # it moved while tokens went on: nothing to do yet
            self._timer = asyncio.get_running_loop().call_later(left, self._on_timer)
        else:
            waiter.set_result(None)

    def _drain(self) -> list[WireEvent]:
        """Feed every buffered message to the state; the events to pass on."""
        out: list[WireEvent] = []
        self.last_event = time.monotonic()
        self._quiet = _QUIET_FIRST_S
        state = self.state
        while self._buffer and not state.done:
            msg = self._buffer.popleft()
            if msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
                self._on_unserved()
                continue
            if not msg.data:
                continue
            fields = None if msg.headers else message_token_fields(msg.data)
            if fields is not None:  # a plain token: no validation beyond its fields' own
                rid, seq, text, attempt, n = fields
                if state.take_token(rid, attempt, seq, text, n):  # the next one: the hot path
                    out.append(token_event(rid, seq, text, attempt, n))
                    continue
                event: WireEvent | Answer = token_event(rid, seq, text, attempt, n)
            else:
                try:
                    event = decode_event(msg.data, msg.headers)
                except MeshError as exc:
                    log.warning("dropping malformed event", source=self.what, error=str(exc))
                    continue
            if isinstance(event, Answer):
                continue  # a collected answer is not part of a stream
            step = self.state.feed(event)
            if step.gap:
                self._on_gap()
            out.extend(step.out)
        return out

    def _on_unserved(self) -> None:
        """Nobody had subscribed when the request was sent. Within ``unserved_for`` of the start
        (a restarting server takes a moment to subscribe again) it is sent again, with backoff;
        after that, or once anything arrived, it is an error."""
        now = time.monotonic()
        if self._unserved is None or self.state.started or now >= self._unserved_until:
            raise UnavailableError(f"nobody is serving {self.what}")
        self._send_again_at = min(now + self._unserved_delay, self._unserved_until)
        self._unserved_delay *= 2

    def _watch_at(self) -> float | None:
        """When the watch falls due (after a quiet spell of a started answer); None when there
        is none to run, or it runs already."""
        if self._watch is None or "watch" in self._checks or not self.state.started:
            return None
        return max(self.last_event, self._watched) + WATCH_QUIET_S

    def _watch_due(self, now: float) -> bool:
        """The watch asks only over a live link."""
        return (at := self._watch_at()) is not None and now >= at and self.conn.connected

    def _repair_due(self, now: float) -> bool:
        return "repair" not in self._checks and now >= self._next_check(now)

    def _next_check(self, now: float) -> float:
        """When the next repair falls due: now when messages may have been lost since the last
        one began (link, full buffer), else after a quiet spell or at the time a gap set."""
        if self.conn.losses != self._losses or self.dropped != self._drops:
            return now
        quiet_at = max(self.last_event, self._last_probe) + self._quiet
        due = quiet_at if self._repair_at is None else min(quiet_at, self._repair_at)
        return max(now, due)

    async def _repair_beside(self, _state: AnswerState) -> None:
        """A repair beside the reading: what it releases is passed on next, in order (tokens
        that come meanwhile go on when nothing before them is missing)."""
        late = asyncio.get_running_loop().call_later(ASK_SOURCE_S, self._ask_source, True)
        try:
            out = await self._run_repair()
        except (MeshError, nats.errors.Error, asyncio.TimeoutError, OSError) as exc:
            # Tried again soon, later each time in a row: never in a tight loop.
            (log.info if isinstance(exc, MeshError) else log.warning)(
                "repair failed; will retry", source=self.what, error=repr(exc)
            )
            self._last_probe = time.monotonic()
            self._repair_at = self._last_probe + self._gap_retry
            self._gap_retry = min(self._gap_retry * 2, _QUIET_MAX_S)
            self._store_down = True  # an election takes seconds: ask the source now
            self._ask_source()
            return
        finally:
            late.cancel()
        self._store_down = False
        self._ready.extend(out)

    def _on_gap(self) -> None:
        """A gap: repaired at once; while the store cannot be read, asked of the source too."""
        if self._repair_at is None:
            self._repair_at = time.monotonic()
        elif self._store_down:
            self._ask_source()

    def _ask_source(self, held: bool = False) -> None:
        """Ask the source again for what this reader lacks (``held``: only behind a gap)."""
        state = self.state
        if self._resend is None or not state.started or state.done or self._ended is not None:
            return
        if self.conn.connected and (state.held or not held):
            self._check("resend", self._resend)

    async def _run_repair(self) -> list[WireEvent]:
        assert self._repair is not None
        quiet = time.monotonic() - max(self.last_event, self._last_probe) >= self._quiet
        try:
            events = await self._repair(self.state)
        except SourceGone as gone:  # what was lost is gone for good
            log.warning("answer cannot be repaired", source=self.what, error=str(gone))
            return self.state.fail(gone.error).out
        # Another error is no word from the source, not a probe's silence: retried soon.
        self.repairs += 1
        step = self.state.feed_all(events)
        self.repaired_events += len(step.out)
        self._last_probe = time.monotonic()
        if step.out:
            self.last_event = self._last_probe
            self._quiet = _QUIET_FIRST_S
        elif quiet:
            self._quiet = min(self._quiet * 2, _QUIET_MAX_S)
        if self.state.held and not self.state.done:
            # Still missing: the lost events may not be stored yet (a worker republishes after
            # its reconnect), or never will be until the store has a leader again: ask their
            # source for them, and look again soon, then less often.
            self._ask_source()
            self._repair_at = time.monotonic() + self._gap_retry
            self._gap_retry = min(self._gap_retry * 2, _QUIET_MAX_S)
        else:
            self._repair_at = None
            self._gap_retry = _GAP_RETRY_FIRST_S
        if step.out:
            got, positions = len(step.out), self.state.positions
            log.info("answer repaired", source=self.what, events=got, positions=positions)
        return step.out

    def _check(self, name: str, check: Watch) -> None:
        """Run ``check`` beside the reading, unless it runs already; when it ends, the reader's
        wait ends too (see :meth:`next`)."""
        if name in self._checks:
            return
        task = asyncio.ensure_future(check(self.state))
        self._checks[name] = task
        task.add_done_callback(self._check_done)

    def _check_done(self, task: asyncio.Future[None]) -> None:
        for name, running in list(self._checks.items()):
            if running is task:
                del self._checks[name]
        if task.cancelled():
            return
        if (exc := task.exception()) is not None:
            log.warning("a check on the answer failed", source=self.what, error=repr(exc))
        self._checked = True
        self._wake()
