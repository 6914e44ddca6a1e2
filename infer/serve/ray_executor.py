"""Engine processes placed by Ray (`infer serve --distributed-executor-backend ray`): on a local Ray, or
on a cluster's nodes (`--ray-address`, or RAY_ADDRESS), with one code path from a laptop to a cluster.

Ray only places and supervises the process; the engine runs there exactly as in a child of the server
(`engine_process.serve_engine`), reached over a socket in place of a pipe: the server listens on its
node's address with a one-time key, the Ray actor connects back and serves its engine over that
connection. Each engine (a data-parallel replica) gets a placement group of one bundle (its `--tp`
GPUs and a CPU, packed on one node: tensor parallelism stays inside a node, over NCCL); replicas land
on whichever nodes have room. Ray sets the actor's CUDA_VISIBLE_DEVICES to its bundle's GPUs, and its
`--tp` ranks start there as they would on one host.

The nodes need this package (and the model) installed as on the server's node. `pip install
'infer[ray]'`.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any, Callable

from infer.api.errors import ConfigError, one_line
from infer.common import env
from infer.core.engine import Engine
from infer.serve.engine_child import serve_engine

__all__ = ["RayProcess", "RayStarter"]

EXTRA = "pip install 'infer[ray]'"
PLACEMENT_TIMEOUT_S = 120.0  # a placement group not placed by then: the cluster lacks the resources
CONNECT_TIMEOUT_S = 300.0  # an actor not connected back by then (it imports torch and this package first)


class _EngineActor:
    """The process Ray places: it connects back to the server and serves its engine over the connection."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, address: Any, authkey: bytes, build: Callable[[], Engine]) -> None:
        serve_engine(Client(address, authkey=authkey), build)


class RayProcess:
    """A Ray actor that serves an engine, as `EngineProcess` sees a child process."""

    def __init__(self, ray: Any, actor: Any, done: Any, group: Any, pid: int) -> None:
        self._ray, self._actor, self._done, self._group = ray, actor, done, group
        self.pid = pid  # the actor's process id, on its node
        self._released = False

    def is_alive(self) -> bool:
        ready, _ = self._ray.wait([self._done], timeout=0)
        return not ready

    def join(self, timeout: float | None = None) -> None:
        ready, _ = self._ray.wait([self._done], timeout=timeout)
        if ready:
            self._release()

    def terminate(self) -> None:
        self._ray.kill(self._actor)
        self._release()

    @property
    def exitcode(self) -> int | None:
        """None while it runs; 0 once its engine stopped as asked, 1 once it died (or was killed)."""
        if self.is_alive():
            return None
        try:
            self._ray.get(self._done, timeout=0)
        except Exception:
            return 1
        return 0

    def _release(self) -> None:
        if not self._released:
            self._released = True
            try:
                self._ray.util.remove_placement_group(self._group)
            except Exception:  # the cluster went first
                pass


class RayStarter:
    """Starts each engine process as a Ray actor (an `engine_process.Starter`): `gpus` per engine (its --tp;
    0 on the CPU) and `cpus` in its bundle. Joins the Ray at `address` (None: RAY_ADDRESS, else a local
    one started here), unless this process is connected to one already."""

    def __init__(self, address: str | None = None, gpus: int = 0, cpus: float = 1.0) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ConfigError(f"--distributed-executor-backend ray needs Ray: {EXTRA}") from None
        self._ray = ray
        self._placement_group = placement_group
        self._strategy = PlacementGroupSchedulingStrategy
        if not ray.is_initialized():
            try:
                ray.init(address=address, include_dashboard=False, logging_level="WARNING")
            except Exception as exc:
                where = address or env.ray_address() or "a local Ray"
                raise ConfigError(f"could not join {where}: {one_line(exc)}; check --ray-address") from None
        self.gpus, self.cpus = gpus, cpus
        self.host = ray.util.get_node_ip_address()  # where the actors connect back to
        self._actor_class = ray.remote(_EngineActor)

    def __call__(self, build: Callable[[], Engine], name: str) -> tuple[Connection, RayProcess]:
        ray = self._ray
        bundle = {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {})}
        group = self._placement_group([bundle], strategy="STRICT_PACK")
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            ray.util.remove_placement_group(group)
            raise ConfigError(
                f"Ray could not place an engine needing {bundle} in {PLACEMENT_TIMEOUT_S:.0f} s (the cluster has "
                f"{ray.cluster_resources()}): add nodes, or lower --data-parallel-size or --tp"
            )
        actor = self._actor_class.options(
            name=f"{name}-{secrets.token_hex(4)}",
            num_cpus=self.cpus,
            num_gpus=self.gpus,
            scheduling_strategy=self._strategy(placement_group=group, placement_group_bundle_index=0),
        ).remote()
        authkey = secrets.token_bytes(32)
        with Listener((self.host, 0), authkey=authkey) as listener:
            pid = ray.get(actor.pid.remote())
            done = actor.run.remote(listener.address, authkey, build)
            process = RayProcess(ray, actor, done, group, pid)
            conn = _accept(listener, process)
        return conn, process


def _accept(listener: Listener, process: RayProcess) -> Connection:
    """The actor's connection, or the reason it never came (the actor failed first, or took too long)."""
    got: list[Connection | BaseException] = []

    def accept() -> None:
        try:
            got.append(listener.accept())
        except BaseException as exc:  # the listener closed under it
            got.append(exc)

    thread = threading.Thread(target=accept, name="infer-ray-accept", daemon=True)
    thread.start()
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while not got:
        if not process.is_alive():
            process.join(0)
            try:
                process._ray.get(process._done, timeout=0)
                why = "it ended"
            except Exception as exc:
                why = one_line(exc)
            raise ConfigError(f"the engine's Ray actor stopped before it connected back: {why}")
        if time.monotonic() > deadline:
            process.terminate()
            raise ConfigError(
                f"the engine's Ray actor did not connect back to {listener.address} in {CONNECT_TIMEOUT_S:.0f} s: "
                f"can its node reach this one?"
            )
        thread.join(0.1)
    if isinstance(got[0], BaseException):
        process.terminate()
        raise ConfigError(f"the engine's Ray actor could not connect back: {one_line(got[0])}")
    return got[0]
