"""Test harness: a scripted HTTP/1.1 server for the benchmarks' streaming client.

A request's JSON body carries the response as a script: `{"script": [[delay_s, text], ...]}`;
the server sleeps each delay and writes each text (UTF-8) as it is, so a test decides the
framing and where the writes split it. `CLOSE` as a text closes the connection. Connections
stay open for further requests (keep-alive); `connections` counts those accepted.
`chunked_sse` builds the script of a chunked SSE response from event payloads.
"""

from __future__ import annotations

import asyncio
import json
import threading

CLOSE = "CLOSE"


def chunked_sse(payloads: list[str], split: int = 0, status: str = "200 OK") -> list:
    """Script of a chunked SSE response with one chunk per `data:` event, then [DONE].
    split > 0 cuts the written bytes into pieces of that many characters."""
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: text/event-stream\r\n"
        "transfer-encoding: chunked\r\n\r\n"
    )
    body = ""
    for payload in [*payloads, "[DONE]"]:
        event = f"data: {payload}\n\n"
        body += f"{len(event.encode()):x}\r\n{event}\r\n"
    text = head + body + "0\r\n\r\n"
    if split <= 0:
        return [[0.0, text]]
    return [[0.0, text[i : i + split]] for i in range(0, len(text), split)]


class ScriptedServer:
    """The server on 127.0.0.1 in a thread of its own; `url` once entered."""

    def __init__(self) -> None:
        self.url = ""
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ScriptedServer:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the scripted server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                script = json.loads(await reader.readexactly(length))["script"]
                for delay, text in script:
                    await asyncio.sleep(delay)
                    if text == CLOSE:
                        writer.close()
                        return
                    writer.write(text.encode())
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
