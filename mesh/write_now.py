"""A burst of requests leaves in groups, not after its last request is ready.

nats-py writes what a connection publishes from a flusher task. That task runs when the event
loop gets to it, after every callback queued before it. In a burst (an edge that takes 32
requests at once, an SDK that sends 32) the callbacks queued are the other requests' steps. So
every request waited for the last one to be ready, and they all went out in one write. The
processes downstream (nats-server, a worker, its engine) sat idle until then, and then all got
the whole burst at once: one process worked while the others waited, on a machine with cores to
spare.

:func:`write_queued` writes what nats-py holds at once when ``at_least`` messages wait. A request
publish calls it (:mod:`mesh.js_acks`), so a burst leaves in groups of :data:`GROUP`. A burst's
first group reaches a worker while the edge prepares the next. A lone request still goes at the
loop's turn, with whatever else is queued by then.

Measured in one mesh, taking turns with the rule off and on in the same processes, 20 rounds of
32 requests at once through an edge (``docs/performance.md``): time to first token p50 -3.4 ms
(2-token answers) and -4.2 ms (32-token answers). CPU per request, edge and worker: -0.09 and
+0.11 ms at 2 tokens, +0.30 each at 32 (at 128 tokens, two runs: +4% to +15%). That rise is
the burst's streams no longer running in step: 32 answers whose tokens all came in the same
instant were relayed in fewer, larger writes.
The same 32 requests sent 1 ms apart cost more with the rule off (edge 3.28, worker 3.64 ms)
than the burst did with it on (2.83, 3.25), and did not form groups (on: 3.45, 3.67 ms; TTFT the
same). Every request written alone (a group of 1) gained less (-3.0 ms) and cost more (+0.17
and +0.23 ms at 2 tokens).

The SDK's request to an edge (a core NATS publish, its inbox's subscription before it) calls it
too. Measured in one mesh, bursts of 32 via an edge taking turns with it off and on in the same
SDK (40 rounds each, 8-token answers, 50 ms prefill): TTFT p50 -1.2, -1.4 and -2.6 ms in three
runs, the SDK's CPU per request unchanged (0.95 to 0.99 ms either way); with 32-token answers,
80 rounds each, p50 -2.6 ms, p90 -3.2, p99 +1.8 (runs of 40 rounds read the p99 anywhere from
-2 to +24 ms: one run's tail is mostly the machine's). Each request written alone read 0.7 and
2.0 ms worse than groups; groups of 16 messages read as 8 do.

This leans on three private attributes of nats-py's ``Client`` (``_pending``,
``_pending_data_size``, ``_transport``), the ones its own flusher uses.
``tests/test_write_now.py`` checks that a group leaves before the loop's turn with the installed
nats-py. Where they are missing, nothing is written early and the flusher writes as before.
"""

from __future__ import annotations

from nats.aio.client import Client

GROUP = 8
"""A request publish writes the buffer once this many messages wait in it."""


def write_queued(nc: Client, at_least: int = GROUP) -> bool:
    """Write what ``nc`` holds for its socket now, when at least ``at_least`` messages wait
    there and it is connected (while it reconnects, nats-py keeps them for the new
    connection). True when it wrote."""
    pending = getattr(nc, "_pending", None)
    transport = getattr(nc, "_transport", None)
    if not isinstance(pending, list) or len(pending) < at_least or transport is None:
        return False
    if not nc.is_connected:
        return False
    transport.writelines(pending)
    nc._pending = []
    nc._pending_data_size = 0
    return True
