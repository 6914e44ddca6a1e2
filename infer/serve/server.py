"""`Server`: uvicorn's server, with a shutdown that ends every answer properly and a watch over the engines.

uvicorn's own shutdown closes the listening socket and, `timeout_graceful_shutdown` later, cancels
the responses still being written: a stream stops mid-chunk (its client reads "incomplete chunked
read"), with neither an error event nor `[DONE]`. On SIGTERM or SIGINT this one drains first:

1. new requests get a 503 saying the server is shutting down (`lifecycle`), /health too: the socket
   stays open, so they are answered rather than refused;
2. the requests running may finish, for up to `shutdown_timeout_s` (`--shutdown-timeout`);
3. what is still open then is ended by the front itself (`AsyncEngine.end_all`, a `ShuttingDownError`,
   without waiting on an engine that may be mid-step): each stream gets an error event, then
   `data: [DONE]`; each JSON request a 503; `CUT_GRACE_S` lets them go out;
4. uvicorn's shutdown closes the connections, and the caller closes the engines (their processes exit).

A second signal skips the rest of step 2. The signal is not raised again once the server is done (as
uvicorn's own handler does): the caller still has engines to close and `exit_code` to exit with:
EXIT_OK (0) everything finished in time, EXIT_CUT (4) requests still running at the timeout were ended
with an error, EXIT_ENGINE_DIED (5) an engine died and was not restarted (whatever the drain did).

Every `WATCH_INTERVAL_S` the engines are looked at. When one has died (its process killed, out of
memory), its open streams have already ended with an `EngineDeadError` (an error event and `[DONE]`;
a 503 before a stream starts) and its new requests are 503s; /health is a 503. Then, with
`restart_engines`, it is built again in a fresh process (`AsyncEngine.restart`: /health ok and its
requests served once it is loaded); without, or if the restart fails, the server shuts down as above
with EXIT_ENGINE_DIED, so that an orchestrator restarts the whole server. That shutdown keeps
answering (503s saying the engine stopped, /metrics with `infer_engine_up` 0) for at least
`DIED_LINGER_S` (at most --shutdown-timeout), so a probe or client then gets the reason, not a
refused connection.
"""

from __future__ import annotations

import asyncio
import logging
from types import FrameType
from typing import Any, Mapping

import uvicorn

from infer.api.errors import one_line
from infer.serve.adapters import replay as replay_adapters
from infer.serve.async_engine import AsyncEngine
from infer.serve.engine_thread import ShuttingDownError
from infer.serve.lifecycle import Lifecycle

__all__ = ["EXIT_CUT", "EXIT_ENGINE_DIED", "EXIT_OK", "Server"]

EXIT_OK = 0  # every request finished before the shutdown timeout
EXIT_CUT = 4  # requests still running at the shutdown timeout were ended with an error event / a 503
EXIT_ENGINE_DIED = 5  # an engine's process died (no --restart-engine, or its restart failed)
DIED_LINGER_S = 3.0  # after an engine died: answering 503s for this long before the server exits
CUT_GRACE_S = 5.0  # after the cut, for the error events and 503s to reach their clients
WATCH_INTERVAL_S = 0.2  # how often the engines are looked at
POLL_S = 0.05

logger = logging.getLogger("uvicorn.error")  # beside uvicorn's own lines


class Server(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        engines: Mapping[str, AsyncEngine],
        lifecycle: Lifecycle,
        shutdown_timeout_s: float,
        restart_engines: bool = False,
    ) -> None:
        """engines: the app's, by served name; lifecycle: the one the app was made with."""
        super().__init__(config)
        self.engines = engines
        self.lifecycle = lifecycle
        self.shutdown_timeout_s = shutdown_timeout_s
        self.restart_engines = restart_engines
        self.exit_code = EXIT_OK
        self._reason = "the server is shutting down: retry the request on another server"
        self._hurry = False  # a second signal: end what is open now
        self._told: dict[str, set[int]] = {}  # per data-parallel model, the dead replicas already said

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # a signal handler: only flags (the main loop sees them within 0.1 s)
        if self.should_exit:
            self._hurry = True
        self.should_exit = True

    async def main_loop(self) -> None:
        watch = asyncio.ensure_future(self._watch())
        try:
            await super().main_loop()
        finally:
            self.should_exit = True  # (the watch ends on it)
            died = self.exit_code == EXIT_ENGINE_DIED
            self.lifecycle.stop_accepting(self._reason, "engine_dead" if died else "server_shutting_down")
            await watch  # within WATCH_INTERVAL_S, or once a restart under way is done (its engine then closes)
        await self._drain()

    async def _watch(self) -> None:
        while not self.should_exit:
            await asyncio.sleep(WATCH_INTERVAL_S)
            for name, engine in self.engines.items():
                if not self.should_exit and engine.is_alive and not engine.closed:
                    await self._replicas(name, engine)
                if self.should_exit or engine.is_alive or engine.closed:
                    continue
                logger.error("the engine of %s stopped%s", name, _exit_code(engine.exitcode))
                if self.restart_engines and await self._restarted(name, engine):
                    continue
                self.exit_code = EXIT_ENGINE_DIED
                self._reason = (
                    f"the engine of {name} stopped and the server is shutting down: retry the request once it "
                    "is back, or on another server"
                )
                self.should_exit = True

    async def _replicas(self, name: str, engine: Any) -> None:
        """A data-parallel model (`ReplicatedEngine`) serves on while one replica lives: its dead replicas are
        built again with `restart_engines`, else said once and left down."""
        dead = [i for i in getattr(engine, "dead", ()) if i not in self._told.setdefault(name, set())]
        if not dead:
            return
        codes = ", ".join(f"replica {i}" + _exit_code(engine.replicas[i].exitcode) for i in dead)
        logger.error("the engine of %s lost %s: its requests go to the other replicas", name, codes)
        if self.restart_engines and not engine.restarting:
            if await self._restarted(name, engine):
                return
        self._told[name].update(dead)

    async def _restarted(self, name: str, engine: AsyncEngine) -> bool:
        logger.info("restarting the engine of %s", name)
        try:
            await engine.restart()
        except Exception as exc:
            logger.error("the engine of %s could not be restarted: %s", name, one_line(exc))
            return False
        models = getattr(getattr(self.config.app, "state", None), "models", None)
        if models is not None:  # the adapters loaded at runtime, served again
            dropped = await replay_adapters(models, engine)
            if dropped:
                logger.error("after the restart of %s, adapters %s could not be read: no longer served", name, dropped)
        logger.info("the engine of %s is serving again (restart %d)", name, engine.num_restarts)
        return True

    async def _drain(self) -> None:
        lifecycle, loop = self.lifecycle, asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout_s
        died = self.exit_code == EXIT_ENGINE_DIED
        linger = loop.time() + min(DIED_LINGER_S, self.shutdown_timeout_s) if died else 0.0
        if lifecycle.num_active:
            logger.info(
                "refusing new requests; waiting up to %g s for %d running",
                self.shutdown_timeout_s,
                lifecycle.num_active,
            )
        while (lifecycle.num_active or loop.time() < linger) and loop.time() < deadline and not self._hurry:
            await asyncio.sleep(POLL_S)
        if not lifecycle.num_active:
            return
        logger.warning("ending the %d requests still running with an error", lifecycle.num_active)
        if self.exit_code == EXIT_OK:
            self.exit_code = EXIT_CUT
        waited = "on a second signal" if self._hurry else f"after --shutdown-timeout {self.shutdown_timeout_s:g} s"
        cut = ShuttingDownError(
            f"the server shut down before this request finished ({waited}): retry it on another server"
        )
        for engine in self.engines.values():
            engine.end_all(cut)
        grace = loop.time() + CUT_GRACE_S
        while lifecycle.num_active and loop.time() < grace:
            await asyncio.sleep(POLL_S)


def _exit_code(code: int | None) -> str:
    """How an engine's process ended, where this process knows (it started it)."""
    return "" if code is None else f" (exit code {code})"
