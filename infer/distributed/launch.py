"""Tensor-parallel ranks: starting them (spawned, or joined under torchrun), and the loop the other ranks run.

Process layout. Rank 0 is the process that builds the engine: it alone runs the scheduler, the
decoder and the sampler. Ranks 1..N-1 are either spawned by the engine itself (`torch.multiprocessing`
spawn; gloo on the CPU, NCCL on GPUs, rank i on cuda:i) or started by `torchrun`: then every process
runs the same program, rank 0 returns from `build_engine` and drives, and the others serve from
inside it until rank 0 closes the engine, then exit (so one engine per torchrun launch).

Every rank builds the same engine (the same models in the same order, the same KV blocks), holding
its shard of each weight and its own paged KV cache. Before every model forward, rank 0 broadcasts
the forward's flat inputs (`StepInputs`: input ids, query and sequence lengths, block tables, logits
rows, as int64 CPU tensors over a gloo group: one broadcast for a small step, two for a large one)
and runs it; the other ranks receive and run the same forward, so the model's collectives pair up
and CUDA graph replays stay in lockstep. Only rank 0's logits are sampled. A step's KV block copies
(copy-on-write, swap) are broadcast the same way. Rank 0's side of this is `infer.distributed.ranks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import pickle
import signal
import threading
import time
import types
from typing import Any, Iterable

import torch

from infer.api.errors import ConfigError, InferError, WorkerError
from infer.common import env
from infer.distributed.ranks import (
    STOP_WAIT_S,
    STOPPED,
    MirroredBlockMover,
    RankGroup,
    error_key,
    stop_processes,
)
from infer.distributed.spawn_guard import (
    MAIN_GUARD_EXIT,
    exit_if_rerunning_main,
    main_guard_message,
    terminal_interrupts_ignored,
)
from infer.distributed.state import ParallelState, check_pipeline_parallel, check_tensor_parallel, torchrun_host
from infer.distributed.step_channel import StepChannel, serve
from infer.distributed.teardown import meet_for_teardown, release_graphs, take_down_groups

COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)  # a model collective waiting longer means a rank is gone
IDLE_TIMEOUT = datetime.timedelta(days=7)  # a rank waits for rank 0's next step as long as the engine idles
START_TIMEOUT_S = 300.0  # spawned ranks: start the interpreter, import torch, connect
JOINED = "infer/joined"


def launch(config: Any, extra_plugins: Iterable[Any], name: str, model_config: Any, device: torch.device) -> Any:
    """The core's `Launch` for --tp N > 1: check the split, start (or join) the ranks, build this rank's
    engine. Rank 0 gets EngineParts whose forwards and block copies reach the others; a torchrun
    rank > 0 serves rank 0 here and then exits the process."""
    from infer.runtime.builder import build_engine

    extra_plugins = list(extra_plugins)
    c = model_config
    check_tensor_parallel(name, c.num_heads, c.num_kv_heads, c.intermediate_size, config.tensor_parallel_size)
    check_pipeline_parallel(name, c.num_layers, config.pipeline_parallel_size)
    parallel, ranks = _start_ranks(config, extra_plugins, device)
    if not parallel.is_driver:
        run_worker(config, extra_plugins, parallel)
        raise SystemExit(0)
    try:  # rank 0's runners get executors that send each forward to the other ranks
        parts = build_engine(config, extra_plugins, parallel=dataclasses.replace(parallel, ranks=ranks))
    except BaseException as exc:
        ranks.broken = True
        error = ranks.diagnose(exc) if isinstance(exc, Exception) else exc
        ranks.close()
        if error is exc:
            raise
        raise error from exc
    parts.block_mover = MirroredBlockMover(parts.block_mover, ranks)
    ranks.runners = parts.runners
    parts.closers = (*parts.closers, ranks.close)
    if parallel.world_size > 1:
        parts.describe["tensor_parallel_size"] = parallel.world_size
    if parallel.num_stages > 1:
        parts.describe["pipeline_parallel_size"] = parallel.num_stages
    return parts


def run_worker(config: Any, extra_plugins: list[Any], parallel: ParallelState) -> None:
    """Ranks 1..N-1: build this rank's engine, then run rank 0's steps until it stops them."""
    from infer.runtime.builder import build_engine

    stopped_cleanly, parts = False, None
    try:
        parts = build_engine(config, extra_plugins, parallel=parallel)
        parts.output.close()  # text is rank 0's business
        serve(StepChannel(parallel), parts.runners, parts.block_mover)
    except BaseException as exc:
        with contextlib.suppress(Exception):
            parallel.store.set(error_key(parallel.process_rank), f"{type(exc).__name__}: {exc}"[:4000])
        raise
    else:  # rank 0 said stop: every rank takes its groups down together
        with contextlib.suppress(Exception):
            release_graphs(parts.runners, parallel.device)
            stopped_cleanly = meet_for_teardown(parallel, STOP_WAIT_S)
    finally:
        take_down_groups(parallel, stopped_cleanly, parts.runners if parts is not None else ())
        with contextlib.suppress(Exception):
            parallel.store.add(STOPPED, 1)


def _start_ranks(config: Any, extra_plugins: list[Any], device: torch.device) -> tuple[ParallelState, RankGroup]:
    import torch.distributed as dist

    world_size = config.world_size
    if not dist.is_available():
        raise ConfigError("this torch build has no torch.distributed: use --tp 1")
    if dist.is_initialized():
        raise ConfigError(
            "this process already has a torch.distributed group (another --tp engine that is still "
            "open?): close that engine first (engine.close(), or `with LLM(...)`)"
        )
    exit_if_rerunning_main()
    torchrun = torchrun_host()  # (ranks on this host, this one's index) under torchrun
    num_local = torchrun[0] if torchrun else world_size
    if device.type == "cuda":
        first, visible = device.index or 0, torch.cuda.device_count()
        if first + num_local > visible:
            raise ConfigError(
                f"{_split(config)} needs {num_local} CUDA devices from cuda:{first} on this machine but "
                f"{visible} are visible: lower it, or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
            )
    if torchrun:
        parallel = _join_torchrun(config, device)
        return parallel, RankGroup(parallel, {})
    return _spawn(config, extra_plugins, device, world_size)


def _split(config: Any) -> str:
    """How the run splits over processes, as the user wrote it (--tp N, --pp N, or both)."""
    parts = [f"--tp {config.tensor_parallel_size}"] if config.tensor_parallel_size > 1 else []
    if config.pipeline_parallel_size > 1:
        parts.append(f"--pp {config.pipeline_parallel_size}")
    return " ".join(parts)


def _join_torchrun(config: Any, device: torch.device) -> ParallelState:
    import torch.distributed as dist

    world_size = config.world_size
    placement = env.torchrun()
    assert placement is not None, "called only under torchrun (_start_ranks saw its variables)"
    rank, launched = placement.rank, placement.world_size
    if launched != world_size:
        raise ConfigError(
            f"torchrun started {launched} processes but {_split(config)} runs {world_size}: make them equal "
            f"(torchrun --nproc-per-node {world_size} ... {_split(config)})"
        )
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT))
    return _init_groups(
        dist.PrefixStore("infer-tp/", store),
        rank,
        world_size,
        _rank_device(device, placement.local_rank),
        config.pipeline_parallel_size,
    )


def _spawn(
    config: Any, extra_plugins: list[Any], device: torch.device, world_size: int
) -> tuple[ParallelState, RankGroup]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    refs = _plugin_refs(extra_plugins)
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=COLLECTIVE_TIMEOUT
    )
    cpu_threads = None
    if device.type == "cpu":  # N ranks share the cores: without this they oversubscribe them N times
        cpu_threads = torch.get_num_threads()
        torch.set_num_threads(_threads_per_rank(world_size))
    context = mp.get_context("spawn")
    processes: dict[int, Any] = {}
    try:
        with terminal_interrupts_ignored():  # Ctrl-C is rank 0's to handle: the ranks are born ignoring it
            for rank in range(1, world_size):
                args = (rank, world_size, store.port, _rank_device(device, rank), config, refs, os.getpid())
                process = context.Process(target=_spawned_rank, args=args, name=f"infer-tp-rank-{rank}", daemon=True)
                process.start()
                processes[rank] = process
        deadline = time.monotonic() + START_TIMEOUT_S
        while store.add(JOINED, 0) < world_size - 1:
            dead = {r: p.exitcode for r, p in processes.items() if p.exitcode is not None}
            if MAIN_GUARD_EXIT in dead.values():
                raise SystemExit(main_guard_message())
            if dead:
                raise WorkerError(
                    f"tensor-parallel rank(s) exited while starting (exit codes {dead}): see their error above"
                )
            if time.monotonic() > deadline:
                raise WorkerError(f"tensor-parallel ranks did not start within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.02)
        parallel = _init_groups(store, 0, world_size, _rank_device(device, 0), config.pipeline_parallel_size)
    except BaseException:
        stop_processes(list(processes.values()), wait_s=0.0)
        if cpu_threads is not None:
            torch.set_num_threads(cpu_threads)
        raise
    return parallel, RankGroup(parallel, processes, cpu_threads)


def _spawned_rank(
    rank: int,
    world_size: int,
    port: int,
    device: torch.device,
    config: Any,
    plugin_refs: list[tuple[str, Any]],
    parent_pid: int,
) -> None:
    """Entry point of a spawned rank, in a fresh interpreter."""
    import sys

    import torch.distributed as dist

    from infer.common.log import configure

    _exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # see spawn_guard: rank 0 alone answers Ctrl-C
    configure(level="warning")
    if device.type == "cpu":
        torch.set_num_threads(_threads_per_rank(world_size))
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    store.add(JOINED, 1)
    parallel = _init_groups(store, rank, world_size, device, config.pipeline_parallel_size)
    try:
        run_worker(config, _load_plugins(plugin_refs), parallel)
    except InferError as exc:  # rank 0 reports the same error to the user; no traceback here
        sys.exit(exc.exit_code)


def _init_groups(store: Any, rank: int, world_size: int, device: torch.device, num_stages: int = 1) -> ParallelState:
    """This process's groups: every process's (the model's collectives at --pp 1, the stages' sends),
    the gloo control group, and under --pp with --tp each stage's own. `rank`, `world_size`: the process's."""
    import torch.distributed as dist

    from infer.distributed.pipeline_link import P2PLink

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    tp = world_size // num_stages
    stage_index, tp_rank = divmod(rank, tp)
    group = dist.group.WORLD
    if num_stages > 1 and tp > 1:  # every process makes every stage's group, in the same order
        stages = [dist.new_group(list(range(s * tp, (s + 1) * tp)), backend=backend) for s in range(num_stages)]
        group = stages[stage_index]
    link = P2PLink(stage_index, num_stages, tp_rank, tp, dist.group.WORLD) if num_stages > 1 else None
    return ParallelState(
        tp_rank, tp, device, group, control, store, num_stages=num_stages, stage_index=stage_index, link=link
    )


def _rank_device(device: torch.device, local_rank: int) -> torch.device:
    return torch.device("cuda", (device.index or 0) + local_rank) if device.type == "cuda" else device


def _threads_per_rank(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // world_size)


def _exit_with_parent(parent_pid: int) -> None:
    """A spawned rank ends when the process that started it is gone (no orphans after a kill -9)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="infer-tp-parent", daemon=True).start()


def _plugin_refs(plugins: list[Any]) -> list[tuple[str, Any]]:
    """Extra plugins as a spawned rank can receive them: modules by name, other objects pickled."""
    refs: list[tuple[str, Any]] = []
    for plugin in plugins:
        if isinstance(plugin, types.ModuleType):
            refs.append(("module", plugin.__name__))
            continue
        try:
            pickle.dumps(plugin)
        except Exception as exc:
            raise ConfigError(
                f"plugin {plugin!r} cannot be sent to the tensor-parallel ranks ({exc}): pass an "
                f"importable module or a picklable object, or use --tp 1"
            ) from exc
        refs.append(("object", plugin))
    return refs


def _load_plugins(refs: list[tuple[str, Any]]) -> list[Any]:
    import importlib

    return [importlib.import_module(value) if kind == "module" else value for kind, value in refs]
