"""One TCP connection on the event loop: transport bytes ↔ ServerConnection (h11) ↔ App routes.

Flow control, the part that keeps a bad client from hurting anyone else:
- writes go to the transport; above WRITE_HIGH buffered bytes the transport
  pauses us, and a streaming response then waits (`drain`) instead of reading
  more from its generation. The tokens wait in the request's own reader buffer
  (sized for the slot at submit), so the decode thread never notices.
- a connection that stays paused or idle for --timeout seconds, or whose request
  has not arrived whole --timeout seconds after its first byte, is dropped by the
  watchdog calling `check()`.
- EOF or a reset from the client cancels its running request (the slot is free
  within one step).
Requests on one connection are answered in order, one at a time (pipelining).
"""
from __future__ import annotations

import asyncio
import socket
import time

from ..errors import RequestError
from .errors import HttpError, refused
from .http import ProtocolFailure, ServerConnection
from .response import Response, StreamResponse

WRITE_HIGH = 64 << 10       # bytes buffered in the transport before a stream waits
WRITE_LOW = 16 << 10
PIPELINE_LIMIT = 256 << 10  # bytes of pipelined requests buffered before we stop reading
KERNEL_SNDBUF = 64 << 10    # SO_SNDBUF per connection (the kernel doubles it)


class Exchange:
    """One request and its response on a connection: what the log line and the watchdog need."""

    __slots__ = ("conn", "req", "method", "target", "family", "t0", "task", "generation", "failure",
                 "status", "streaming", "cors")

    def __init__(self, conn, req=None, method="-", target="-"):
        self.conn = conn
        self.req = req
        self.method = req.method if req is not None else method
        self.target = req.target if req is not None else target
        self.family = "llama"
        self.t0 = time.monotonic()
        self.task = None
        self.generation = None
        self.failure: HttpError | None = None
        self.status = 0
        self.streaming = False
        self.cors: list = []            # the answer's CORS headers (App.handle: cors.Cors.check)


class HttpProtocol(asyncio.Protocol):
    def __init__(self, app):
        self.app = app
        self.http = ServerConnection(app.config.body_limit)
        self.transport = None
        self.exchange: Exchange | None = None
        self.closed = False
        self.peer = "-"
        self.paused_since: float | None = None
        self.t_active = time.monotonic()
        self._drain: asyncio.Future | None = None
        self._reading = True
        self._in_next = False

    # -- asyncio callbacks ---------------------------------------------------------------------

    def connection_made(self, transport):
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if peer:
            self.peer = f"{peer[0]}:{peer[1]}"
        transport.set_write_buffer_limits(high=WRITE_HIGH, low=WRITE_LOW)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:    # a fixed kernel buffer: else Linux grows it to MBs for a client that never reads
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, KERNEL_SNDBUF)
            except OSError:
                pass
        self.app.connections.add(self)
        if self.app.closing:
            self.abort()

    def data_received(self, data):
        if not self.http.in_request:
            # A request starts: it has --timeout to arrive whole. Not reset by every byte, or a
            # client trickling a byte at a time (slowloris) would hold the connection forever.
            self.t_active = time.monotonic()
        self.http.receive(data)
        if self.exchange is None:
            self._next()
        elif self.http.buffered > PIPELINE_LIMIT and self._reading:
            self._reading = False
            self.transport.pause_reading()

    def eof_received(self):
        # HTTP clients do not half-close while they wait for an answer: EOF means gone.
        self._lost("client closed the connection")
        return False

    def connection_lost(self, exc):
        self._lost("client reset the connection" if exc else "client closed the connection")
        self.app.connections.discard(self)
        d, self._drain = self._drain, None
        if d is not None and not d.done():
            d.set_result(None)

    def pause_writing(self):
        self.paused_since = time.monotonic()

    def resume_writing(self):
        self.paused_since = None
        d, self._drain = self._drain, None
        if d is not None and not d.done():
            d.set_result(None)

    # -- requests ------------------------------------------------------------------------------

    def _lost(self, why: str) -> None:
        if self.closed:
            return
        self.closed = True
        ex = self.exchange
        if ex is not None and ex.task is not None and ex.failure is None:
            self.app.metrics.disconnects.inc()
            self.app.fail(ex, HttpError(499, why, "client_closed"))

    def _next(self) -> None:
        """Parse and dispatch requests until one is running, data runs out, or the connection ends."""
        if self._in_next:
            return
        self._in_next = True
        try:
            while self.exchange is None and not self.closed:
                item = self.http.next_request()
                if item is None:
                    cont = self.http.continue_100()
                    if cont:
                        self.transport.write(cont)
                    if not self._reading and self.http.buffered < PIPELINE_LIMIT:
                        self._reading = True
                        self.transport.resume_reading()
                    return
                if isinstance(item, ProtocolFailure):
                    ex = Exchange(self, None, item.method, item.path)
                    self.exchange = ex
                    self._send(ex, self.app.error_response(ex.family, HttpError(item.status, item.message)))
                    self._done(ex)
                    return
                self._dispatch(item)
        finally:
            self._in_next = False

    def _dispatch(self, req) -> None:
        ex = Exchange(self, req)
        self.exchange = ex
        result = self.app.handle(req, ex)
        if isinstance(result, Response):
            self._send(ex, result)
            self._done(ex)
        else:
            ex.task = asyncio.get_running_loop().create_task(self._run(ex, result))

    async def _run(self, ex: Exchange, coro) -> None:
        resp = None
        try:
            try:
                resp = await coro
            except HttpError as err:
                resp = self.app.error_response(ex.family, err)
            except RequestError as exc:
                resp = self.app.error_response(ex.family, refused(exc))
            if isinstance(resp, StreamResponse):
                ex.status = resp.status
                ex.streaming = True
                self._write(self.http.start(resp.status, self.app.headers(ex, resp.content_type, resp.headers)))
                async for chunk in resp.body:
                    self._write(self.http.chunk(chunk))
                    if self.paused_since is not None:
                        await self.drain()
                self._write(self.http.end())
            else:
                self._send(ex, resp)
        except asyncio.CancelledError:
            self._cut(ex, resp, ex.failure or HttpError(503, "the request was cancelled"))
        except HttpError as err:
            self._cut(ex, resp, err)
        except RequestError as exc:     # the engine or tokenizer refused the input
            self._cut(ex, resp, refused(exc))
        except ConnectionError:
            pass
        except Exception as exc:       # a bug: log it, answer 500, keep serving everyone else
            self.app.log_exception(ex, exc)
            self._cut(ex, resp, HttpError(500, f"internal error: {type(exc).__name__}"))
        finally:
            coro.close()                # cancelled before it started: no "never awaited" warning
            if isinstance(resp, StreamResponse):
                try:
                    await resp.body.aclose()
                except BaseException:
                    pass
            if ex.generation is not None:
                ex.generation.close()
            self._done(ex)

    def _cut(self, ex: Exchange, resp, err: HttpError) -> None:
        """End a response early with err: an error response, or the stream's error event and its end."""
        if ex.failure is None:
            ex.failure = err
        if self.closed:
            return
        try:
            if ex.streaming:
                tail = resp.on_error(err) if resp.on_error is not None else b""
                self._write(self.http.chunk(tail) + self.http.end())
            else:
                self._send(ex, self.app.error_response(ex.family, err))
        except Exception:               # h11 refused (state): the connection cannot go on
            self.abort()

    async def drain(self) -> None:
        """Wait until the transport's buffer is below WRITE_LOW (or the connection ends)."""
        while self.paused_since is not None and not self.closed:
            fut = asyncio.get_running_loop().create_future()
            self._drain = fut
            await fut
        if self.closed:
            raise ConnectionError("connection lost")

    def _send(self, ex: Exchange, resp: Response) -> None:
        ex.status = resp.status
        self._write(self.http.respond(resp.status, self.app.headers(ex, resp.content_type, resp.headers), resp.body))

    def _write(self, data: bytes) -> None:
        if not self.closed and data:
            self.transport.write(data)

    def _done(self, ex: Exchange) -> None:
        self.exchange = None
        self.app.finish(ex)
        if self.closed:
            return
        if self.http.next_cycle():
            self.t_active = time.monotonic()
            if self.http.buffered:
                asyncio.get_running_loop().call_soon(self._next)
        else:
            self.closed = True
            self.transport.close()          # flushes what is buffered, then closes

    # -- watchdog --------------------------------------------------------------------------------

    def check(self, now: float, timeout: float) -> None:
        """Drop this connection if it has not read (or sent) anything for `timeout` seconds."""
        if self.transport is None or self.transport.is_closing() and self.paused_since is None:
            return
        if self.paused_since is not None and now - self.paused_since > timeout:
            self.app.metrics.dropped.inc(1, "slow_reader")
            self.app.log.line(f"{self.peer} dropped: the client read nothing for {now - self.paused_since:.1f} s "
                              f"(--timeout {timeout:g} s)")
            ex = self.exchange
            if ex is not None:
                self.app.fail(ex, HttpError(408, f"the client read nothing for {timeout:g} s", "timeout_error"))
            self.abort()
        elif self.exchange is None and not self.closed and now - self.t_active > timeout:
            if self.http.in_request:
                self.app.metrics.dropped.inc(1, "slow_sender")
                ex = Exchange(self, None, "-", "-")
                self.exchange = ex
                self._send(ex, self.app.error_response(ex.family, HttpError(
                    408, f"the request was not received within {timeout:g} s", "timeout_error")))
                self.exchange = None
                self.app.finish(ex)
            else:
                self.app.metrics.dropped.inc(1, "idle")
            self.closed = True
            self.transport.close()

    def abort(self) -> None:
        """Close now, discarding whatever is buffered (the client is not reading it)."""
        was_closed = self.closed
        self._lost("the server dropped the connection")
        self.closed = True
        if self.transport is not None:
            self.transport.abort()
        if was_closed and self.exchange is not None and self.exchange.task is not None:
            self.exchange.task.cancel()
