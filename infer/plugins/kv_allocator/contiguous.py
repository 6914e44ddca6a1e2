"""The `contiguous` KV block allocator: a request's maximum length reserved at its first allocation."""

from __future__ import annotations

from infer.api.hookspecs import hookimpl
from infer.api.request import Request
from infer.plugins.kv_allocator.paged import PagedAllocator


class ContiguousAllocator(PagedAllocator):
    """The pre-paging way: a request's whole maximum length is reserved at its first allocation."""

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        return super().blocks_needed(request, max(num_tokens, self.max_len(request)))

    def allocate_slots(self, request: Request, num_tokens: int) -> list[int] | None:
        return super().allocate_slots(request, max(num_tokens, self.max_len(request)))

    def can_ever_run(self, request: Request, num_tokens: int) -> bool:
        return self.can_ever_fit(max(num_tokens, self.max_len(request)))

    @staticmethod
    def max_len(request: Request) -> int:
        limit = request.num_prompt_tokens + request.params.max_tokens
        return min(limit, request.max_model_len) if request.max_model_len else limit


@hookimpl
def infer_register_kv_allocators(register) -> None:
    register("contiguous", ContiguousAllocator)
