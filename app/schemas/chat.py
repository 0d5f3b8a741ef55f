"""`POST /v1/chat/completions` in the OpenAI shape, plus kvmosaic's optional extras.

Only what a RAG answer needs is honoured: the last user message is the question (earlier
turns and client system messages are ignored: the system prefix is fixed so its KV is
reused), `max_tokens` / `max_completion_tokens` (both held to the server's limit; with both,
the smaller applies), `temperature`, `top_p`, `seed`, `stream` and
`stream_options.include_usage`; `temperature` defaults to 0 (greedy, the usual choice for
grounded answers) where OpenAI's default is 1. Unknown OpenAI fields are accepted and ignored.
Extras (`extra_body` in the openai client): `mode`, `top_k`, `ratio`, `fidelity`, `packets`,
`conditioned`, `ape`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool

from app.schemas.ask import APE_DOC, CONDITIONED_DOC, FIDELITY_DOC, PACKETS_DOC, Fidelity
from app.schemas.common import (
    WHOLE_FLOAT,
    Ratio,
    Seed,
    Temperature,
    Text,
    TokenBudget,
    TopK,
    TopP,
)

OneChoice = Annotated[int, Strict(), Field(ge=1, le=1), WHOLE_FLOAT]
# The two OpenAI names of the answer's token budget (`app.api.routes.chat.token_budget`).
TOKEN_BUDGET_FIELDS = ("max_tokens", "max_completion_tokens")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: Text | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text or "" for p in self.content if p.type == "text")
        return self.content or ""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: TokenBudget | None = Field(
        default=None, description="the answer's token budget (the smaller of the two if both)"
    )
    max_completion_tokens: TokenBudget | None = Field(
        default=None, description="the answer's token budget (the smaller of the two if both)"
    )
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    n: OneChoice | None = Field(default=None, description="only one choice is supported")
    mode: str | None = None
    top_k: TopK | None = Field(default=None)
    ratio: Ratio | None = None
    fidelity: Fidelity | None = Field(default=None, description=FIDELITY_DOC)
    packets: StrictBool = Field(default=False, description=PACKETS_DOC)
    conditioned: StrictBool = Field(default=False, description=CONDITIONED_DOC)
    ape: StrictBool = Field(default=False, description=APE_DOC)

    def question(self) -> str:
        """The last user message's text ('' if there is none)."""
        for message in reversed(self.messages):
            if message.role == "user":
                return message.text()
        return ""


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str


class ChatUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: ChatUsage
    kvmosaic: dict[str, Any] | None = Field(
        default=None, description="the /ask report (chunks, timings)"
    )


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvmosaic"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
