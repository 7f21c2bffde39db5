"""Timestamps for ``scripts/hop_timeline.py``, in every Python process it starts (this folder goes
first on their ``PYTHONPATH``); inert unless ``MESH_HOP_PROBE_DIR`` names a folder.

Each process writes ``<pid>.txt`` there: its command line, then a line per socket write
(``wr``, with the first bytes written), per socket read (``rd``) and per NATS message nats-py
parses (``got``, with its subject), each with ``time.perf_counter()`` (CLOCK_MONOTONIC, the same
clock in every process) and the thread's CPU time. A development tool, not part of the mesh.
"""

import os

_DIR = os.environ.get("MESH_HOP_PROBE_DIR")
if _DIR:
    import asyncio.selector_events as _se
    import asyncio.transports
    import atexit
    import sys
    import time

    _now, _cpu = time.perf_counter, time.thread_time
    _out = open(os.path.join(_DIR, f"{os.getpid()}.txt"), "w", buffering=1 << 16)  # noqa: SIM115
    _out.write(f"# {' '.join(sys.argv)[:300]}\n")
    atexit.register(_out.flush)
    _count = [0]

    def _line(kind: str, rest: str) -> None:
        _out.write(f"{_now():.7f} {_cpu():.7f} {kind} {rest}\n")
        _count[0] += 1
        if _count[0] % 100 == 0:
            _out.flush()  # a process that is killed loses at most the last lines

    def _head(data: bytes) -> str:
        return bytes(data[:160]).decode("latin-1").replace("\r", " ").replace("\n", " ")

    _T = _se._SelectorSocketTransport
    _write, _writelines, _read = _T.write, _T.writelines, _T._read_ready__data_received

    def _probed_write(self, data):  # type: ignore[no-untyped-def]
        if data:
            _line("wr", f"{self._sock_fd} {_head(data)}")
        return _write(self, data)

    def _probed_writelines(self, chunks):  # type: ignore[no-untyped-def]
        chunks = list(chunks)
        if chunks:
            _line("wr", f"{self._sock_fd} {_head(b''.join(bytes(c[:160]) for c in chunks[:3]))}")
        return _writelines(self, chunks)

    def _probed_read(self):  # type: ignore[no-untyped-def]
        _line("rd", str(self._sock_fd))
        return _read(self)

    _T.write, _T._read_ready__data_received = _probed_write, _probed_read
    if _writelines is not asyncio.transports.WriteTransport.writelines:
        _T.writelines = _probed_writelines  # its own (3.12): not through write
    try:
        import nats.aio.client as _client

        _process_msg = _client.Client._process_msg

        async def _probed_process_msg(self, sid, subject, reply, data, headers):  # type: ignore[no-untyped-def]  # noqa: PLR0917
            text = subject.decode() if isinstance(subject, bytes) else subject
            _line("got", f"{self.options.get('name')} {text}")
            return await _process_msg(self, sid, subject, reply, data, headers)

        _client.Client._process_msg = _probed_process_msg
    except ImportError:
        pass
