"""A site stream whose byte limit the JetStream store cannot reserve (``mesh.kept.ensure``): it
gets the largest half, quarter... of it that fits, so it stays bounded and drops its oldest
answers. Review S19e wrote these against c13b61b, whose fallback dropped the limit altogether
(the first two failed there). Real nats-server with a small max_file_store."""

from __future__ import annotations

from pathlib import Path

from nats.js.errors import APIError

from mesh import kept
from mesh.config import StreamSettings
from mesh.connection import Connection
from mesh.nats_server import NatsServer
from protocol.subjects import kept_subject
from tests.conftest import make_settings


async def _small_store(tmp_path: Path, size: str) -> NatsServer:
    conf = tmp_path / "small.conf"
    conf.write_text(
        f'listen: 127.0.0.1:-1\njetstream {{ store_dir: "{tmp_path / "js"}"\n'
        f"  max_file_store: {size} }}\n"
    )
    return await NatsServer(config=str(conf), ready_timeout=15).start()


# Before the fix (heal): c13b61b's fallback made MESH_KEPT with max_bytes -1 when the store
# cannot reserve kept_max_bytes. The stream's promise, "the oldest answers go first", then no
# longer holds: discard OLD needs a limit to act, so once the store is full nats-server refuses
# every new answer (503, err 10023 "insufficient resources") and keeps the old ones until
# kept_max_age. The collector hands each new answer back to the hub (site_links._keep) and tries
# again forever: clients of the site get no new kept answer until old ones age out.
# Here: an 8M store, kept_max_bytes 16 MiB, 60 answers of 256 KiB (15 MiB): answer 59 not kept.
async def test_a_site_store_too_small_for_kept_max_bytes_still_drops_oldest_answers(
    tmp_path: Path,
) -> None:
    async with await _small_store(tmp_path, "8M") as server:
        settings = make_settings(server.url)
        async with Connection(settings.nats, "op") as conn:
            jsm, js = conn.jsm(), conn.nc.jetstream()
            await kept.ensure(jsm, kept.kept_config(StreamSettings(kept_max_bytes=16 * 2**20)))
            refused: list[tuple[int, int | None, str | None]] = []
            for i in range(60):
                try:
                    await js.publish(kept_subject(f"r{i}"), b"x" * 256 * 1024, timeout=5)
                except APIError as exc:
                    refused.append((i, exc.err_code, exc.description))
            info = await jsm.stream_info(kept.KEPT_STREAM)
    print(f"max_bytes {info.config.max_bytes}; refused {len(refused)}: {refused[:1]}")
    assert not refused, f"new answers refused by a full store, old ones kept: {refused[:1]}"


# Before the fix (minor): a stream that has a byte limit the store holds (set by an earlier
# version or a smaller setting) loses it altogether when a larger one cannot be reserved: the
# fallback writes max_bytes -1 (unbounded) where keeping the limit it had would stay bounded.
async def test_a_larger_limit_not_reservable_keeps_the_limit_the_stream_had(
    tmp_path: Path,
) -> None:
    async with await _small_store(tmp_path, "8M") as server:
        settings = make_settings(server.url)
        async with Connection(settings.nats, "op") as conn:
            jsm = conn.jsm()
            small = kept.kept_config(StreamSettings(kept_max_bytes=4 * 2**20))
            await kept.ensure(jsm, small)
            await kept.ensure(jsm, kept.kept_config(StreamSettings(kept_max_bytes=64 * 2**20)))
            after = (await jsm.stream_info(kept.KEPT_STREAM)).config.max_bytes
    assert after is not None and after > 0, f"the stream's byte limit went: max_bytes {after}"


# Guard (passed): the fallback's string check matches nats-server's actual refusal of a
# reservation ("insufficient storage resources available", 500/10047), on create and on update;
# the stream then has a limit of its own that fits (it had none after c13b61b).
async def test_a_reservation_refused_on_update_falls_back_and_starts(tmp_path: Path) -> None:
    async with await _small_store(tmp_path, "8M") as server:
        settings = make_settings(server.url)
        async with Connection(settings.nats, "op") as conn:
            jsm = conn.jsm()
            unbounded = kept.kept_config(StreamSettings())
            unbounded.max_bytes = -1
            await jsm.add_stream(unbounded)
            await kept.ensure(jsm, kept.kept_config(StreamSettings(kept_max_bytes=64 * 2**20)))
            config = kept.outbox_config(StreamSettings(outbox_max_bytes=64 * 2**20))
            await kept.ensure(jsm, config)
            got = (await jsm.stream_info(config.name or "")).config.max_bytes
            assert got is not None and 0 < got <= 64 * 2**20, got
