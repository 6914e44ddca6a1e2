"""POST /v1/embeddings in OpenAI's shapes: each input's embedding, from the same engine that generates.

Each input becomes one embedding request (`SamplingParams.pooling`, `infer.api.pooling`), queued beside the
generating ones: pooled by the model's default pooler (a sentence-transformers folder's, else the last
token's), L2-normalized as OpenAI's are, cut to `dimensions` only for a model trained for it (Matryoshka).
`encoding_format: "base64"` sends each vector as its little-endian float32 bytes, as OpenAI does.
"""

from __future__ import annotations

import base64
import uuid
from typing import Annotated, Any, Literal, Union

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from infer.api.pooling import PoolingParams
from infer.api.request import RequestOutput, SamplingParams
from infer.core.stream import CompletionDelta
from infer.serve.errors import APIError
from infer.serve.generation import Generation, OpenAIEvents
from infer.serve.metrics import ServeMetrics
from infer.serve.protocol import WHOLE, Text, TokenIds
from infer.serve.served import ServedModel

MAX_INPUTS = 2048  # inputs per request, at most (OpenAI's limit)


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: input is text, a list of texts, token ids, or a list of token-id lists."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input: Union[
        Text,
        Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)],
        TokenIds,
        Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)],
    ]
    model: StrictStr | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1), WHOLE] | None = None  # Matryoshka models only
    user: StrictStr | None = None  # accepted, unused

    def inputs(self) -> list[str | list[int]]:
        x = self.input
        return [x] if isinstance(x, str) or (x and isinstance(x[0], int)) else list(x)  # type: ignore[list-item]  # checked by its first item: pydantic made them of one kind


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]  # floats, or base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector


class EmbeddingFormat(OpenAIEvents):
    """The answer of an embeddings request (never streamed)."""

    def __init__(self, encoding_format: str) -> None:
        self.encoding_format = encoding_format

    def opening(self, gen: Generation) -> list[dict[str, Any]]:
        return []

    def chunks(self, gen: Generation, index: int, delta: CompletionDelta) -> list[dict[str, Any]]:
        return []

    def closing(self, gen: Generation) -> list[dict[str, Any]]:
        return []

    def response(self, gen: Generation, finals: list[RequestOutput]) -> EmbeddingResponse:
        failed = next((out for out in finals if out.error or out.embedding is None), None)
        if failed is not None:  # it ended without its vector: no room for its prompt, or its pooler failed
            message = failed.error or "the embedding request ended without its vector"
            server = message.startswith("pooler")
            raise APIError(500 if server else 400, message, "server_error" if server else "invalid_request_error")
        order = {stream.request_id: i for i, stream in enumerate(gen.streams)}
        data = [
            EmbeddingData(index=order[out.request_id], embedding=encode(out.embedding or [], self.encoding_format))
            for out in finals
        ]
        data.sort(key=lambda d: d.index)
        usage = EmbeddingUsage(prompt_tokens=gen.prompt_tokens, total_tokens=gen.prompt_tokens)
        return EmbeddingResponse(data=data, model=gen.served.name, usage=usage)


def start(served: ServedModel, metrics: ServeMetrics, req: EmbeddingRequest, prompts: list[list[int]]) -> Generation:
    """Queue one embedding request per prompt (token ids); a refused one aborts those queued before it."""
    gen = Generation(f"embd-{uuid.uuid4().hex}", served, metrics, 1, None, False, False)
    params = SamplingParams(max_tokens=1, temperature=0, pooling=PoolingParams(dimensions=req.dimensions))
    gen.submit(prompts, lambda ids: params)
    return gen
