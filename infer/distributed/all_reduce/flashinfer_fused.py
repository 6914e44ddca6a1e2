"""Tensor parallelism's all-reduce through FlashInfer's port of TensorRT-LLM's all-reduce kernels,
with the residual add and RMSNorm that follow a row-parallel layer fused in (`--all-reduce flashinfer`).

Each rank maps the other ranks' buffers (CUDA IPC, set up over the gloo control group) and, for few
tokens, sums in one shot with the Lamport protocol (a buffer reset to -0.0 marks "not written yet",
so no separate barrier), for more tokens in two shots. `kARResidualRMSNorm` then writes
x + residual and RMSNorm(x + residual) in the same kernel, so a tensor-parallel decoder layer's two
(all-reduce, add-and-norm) pairs become two kernels. fp16 and bf16; float32 tensors, and token
counts above the workspace (long prefills), go to NCCL. The choice depends on shape and dtype
only, so every rank takes the same path. `--all-reduce auto` takes it where it can run. The kernels
are compiled by FlashInfer's JIT on first use on a machine (about two minutes), then loaded from its
cache; each rank builds or loads them before the ranks agree to use them.
"""

from __future__ import annotations

import contextlib
import io
import time
from typing import Any

import torch

from infer.common import env
from infer.common.log import get_logger
from infer.distributed.all_reduce import peer_gpus_reason
from infer.kernels import pdl

DTYPES = (torch.float16, torch.bfloat16)
log = get_logger(component="all-reduce")
MAX_TOKENS = 2048  # the workspace's rows: decode batches and chunked prefills up to this use it


class FlashInferAllReduce:
    """The workspace of one engine's tensor-parallel group; `__call__` sums, `add_rms_norm` sums,
    adds the residual and normalises."""

    def __init__(self, parallel: Any, hidden_size: int, dtype: torch.dtype, max_tokens: int = MAX_TOKENS) -> None:
        from flashinfer import comm

        self.comm = comm
        self.rank, self.world_size = parallel.rank, parallel.world_size
        self.hidden_size, self.dtype, self.max_tokens = hidden_size, dtype, max_tokens
        self.group = parallel.control_group
        with contextlib.redirect_stdout(io.StringIO()):  # it prints every buffer pointer
            # collective over the control group (gloo): each rank's IPC handles to every other rank
            self.handles, self.workspace = comm.trtllm_create_ipc_workspace_for_all_reduce_fusion(
                parallel.rank, parallel.world_size, max_tokens, hidden_size, group=parallel.control_group
            )
        # one-token steps: the row-parallel GEMVs push their partial sums (`infer.distributed.all_reduce.lamport`), unless
        # INFER_GEMV_PUSH=0 on any rank (the ranks agree: the set-up is collective)
        self.exchange = None
        if parallel.min(int(env.gemv_push())):
            from infer.distributed.all_reduce.lamport import LamportExchange

            self.exchange = LamportExchange.create(parallel, hidden_size, dtype)

    def close(self) -> None:
        """Free this rank's shared buffers (~128 MB for a 4096-wide model at 2 ranks). Collective over
        the control group: every rank calls it, at the teardown."""
        with contextlib.redirect_stdout(io.StringIO()):
            self.comm.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(self.handles, group=self.group)
        self.handles = []
        if self.exchange is not None:
            self.exchange.close()

    def fits(self, x: torch.Tensor) -> bool:
        """Same answer on every rank: shape and dtype only."""
        return (
            x.dim() == 2
            and x.shape[1] == self.hidden_size
            and 0 < x.shape[0] <= self.max_tokens
            and x.dtype == self.dtype
            and x.is_contiguous()
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        self._run(x, self.comm.AllReduceFusionPattern.kAllReduce, allreduce_out=out)
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(sum_r x_r + residual) * weight, sum_r x_r + residual)."""
        norm_out, residual_out = torch.empty_like(x), torch.empty_like(residual)
        self._run(
            x,
            self.comm.AllReduceFusionPattern.kARResidualRMSNorm,
            residual_in=residual.contiguous(),
            residual_out=residual_out,
            norm_out=norm_out,
            rms_gamma=weight,
            rms_eps=eps,
        )
        return norm_out, residual_out

    def _run(self, x: torch.Tensor, pattern: int, **outputs: Any) -> None:
        args: dict[str, Any] = dict(
            allreduce_out=None, residual_in=None, residual_out=None, norm_out=None, rms_gamma=None, rms_eps=None
        )
        args.update(outputs)
        # with PDL, the kernel lets the next one launch as it starts, not as it ends: the next GEMV's
        # blocks load their first weight tiles during the all-reduce and wait on the GPU for its sum
        # (docs/performance.md, "FlashInfer's fused all-reduce")
        self.comm.trtllm_allreduce_fusion(
            allreduce_in=x,
            world_size=self.world_size,
            world_rank=self.rank,
            token_num=x.shape[0],
            hidden_dim=self.hidden_size,
            workspace_ptrs=self.workspace,
            launch_with_pdl=pdl.enabled(x.device),
            trigger_completion_at_end=False,
            fp32_acc=True,
            pattern_code=pattern,
            use_oneshot=None,
            quant_out=None,
            scale_out=None,
            scale_factor=None,
            layout_code=None,
            **args,
        )


def unavailable_reason(device: torch.device, world_size: int, dtype: torch.dtype, build: bool = True) -> str | None:
    """Why `--all-reduce flashinfer` cannot run in this process (None: it can try). With `build`,
    its kernels are built (or loaded from FlashInfer's cache) here, so a failed build is a reason."""
    if (reason := peer_gpus_reason(device, world_size)) is not None:
        return reason
    if dtype not in DTYPES:
        return f"its kernels sum float16 and bfloat16, not {str(dtype).removeprefix('torch.')}"
    try:
        from flashinfer import comm

        comm.trtllm_allreduce_fusion, comm.trtllm_create_ipc_workspace_for_all_reduce_fusion  # noqa: B018
    except Exception as exc:  # not installed, or a version without the TensorRT-LLM all-reduce
        return f"flashinfer's all-reduce cannot be imported ({type(exc).__name__}: {exc}): pip install 'infer[gpu]'"
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "its kernels need compute capability 8.0 or newer"
    if not build:
        return None
    try:  # built here, on this rank alone, so that a failed build is a reason the ranks agree on
        from flashinfer.comm.trtllm_ar import get_trtllm_comm_module

        started = time.perf_counter()
        get_trtllm_comm_module()
        if (seconds := time.perf_counter() - started) > 5:
            log.info(
                "flashinfer all-reduce kernels built (first use on this machine, cached after)",
                seconds=round(seconds, 1),
            )
    except Exception as exc:  # no CUDA compiler, or it failed
        return f"flashinfer's all-reduce kernels could not be built ({type(exc).__name__}: {exc})"
    return None
