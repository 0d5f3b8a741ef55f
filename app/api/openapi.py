"""The OpenAPI document: FastAPI's, plus the schemas of bodies that routes read by hand, plus
the limits that come from this server's settings.

`POST /documents` parses its body itself (JSON or multipart, capped while streaming), so
FastAPI never sees `DocumentIn`; the route refers to it by `$ref`, and this adds it (with
any models it nests) to `components.schemas` so the document resolves.

The request models are static, but what a server accepts is not: its registered modes, its
question length and token budget limits. They are written into the document here, so that
a request valid by the document is one the server answers (schemathesis checks both ways).
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from app.schemas.documents import DocumentIn
from app.settings import Settings
from app.store.config import KNOWN_POLICIES
from engine.config import Fidelity
from engine.planners import base_reader_names, planner_names

REF_TEMPLATE = "#/components/schemas/{model}"
# A JSON object of the document, as FastAPI's `get_openapi` returns it.
JsonObject = dict[str, Any]
HAND_READ_BODIES: tuple[type[BaseModel], ...] = (DocumentIn,)


def _tier_names(app: FastAPI, settings: Settings) -> list[str]:
    """The store's tiers once the services run (gpu is skipped without CUDA), else the setting."""
    services = getattr(app.state, "services", None)
    return (
        list(services.chunk_cache.store.names)
        if services is not None
        else list(settings.store_tiers)
    )


def _has_packets(app: FastAPI, settings: Settings) -> bool:
    """Whether the engine has learned packets once the services run, else whether it is set."""
    services = getattr(app.state, "services", None)
    return services.engine.packets is not None if services is not None else bool(settings.packets)


def install_openapi(app: FastAPI, settings: Settings) -> None:
    """Make `app.openapi()` (and `/openapi.json`) include the hand-read body schemas and `settings`'
    limits."""

    def openapi() -> JsonObject:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for model in HAND_READ_BODIES:
                schema = model.model_json_schema(ref_template=REF_TEMPLATE)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            add_limits(schemas, settings, _tier_names(app, settings))
            add_packet_rule(schemas, settings, _has_packets(app, settings))
            add_conditioned_rule(schemas, settings, settings.conditioning() is not None)
            add_ape_rule(schemas, settings)
            add_upload_limits(document, settings)
            exact_integer_bounds(document)
            app.openapi_schema = document
        return app.openapi_schema

    # Replacing the method is FastAPI's documented hook ("Extending OpenAPI"); its type says method.
    app.openapi = openapi  # type: ignore[method-assign]


# Some non-whitespace, no NUL: what the service checks after stripping (`RagService.query`,
# uploads; `retrieval.text` refuses lone surrogates too, which no pattern can name).
TEXT_WITHOUT_NUL = "^[^\\x00]*[^\\s\\x00][^\\x00]*$"


def add_limits(schemas: JsonObject, settings: Settings, tiers: list[str]) -> None:
    """Write the settings' limits into the request schemas (see the module docstring)."""
    evict = schemas["EvictRequest"]["properties"]
    _narrow(evict["tier"], enum=tiers)
    _narrow(evict["policy"], enum=list(KNOWN_POLICIES))
    modes, budget = planner_names(), settings.max_tokens_limit
    for name in ("AskRequest", "ChatRequest"):
        properties = schemas[name]["properties"]
        _narrow(properties["mode"], enum=modes)
        for field in ("max_tokens", "max_completion_tokens"):
            if field in properties:
                _narrow(properties[field], maximum=budget)
    schemas["AskRequest"]["properties"]["question"].update(
        maxLength=settings.max_question_chars, pattern=TEXT_WITHOUT_NUL
    )
    # The question is the last user message: require one with text the service accepts.
    schemas["ChatRequest"]["properties"]["messages"]["contains"] = {
        "type": "object",
        "required": ["role", "content"],
        "properties": {
            "role": {"const": "user"},
            "content": {
                "type": "string",
                "pattern": TEXT_WITHOUT_NUL,
                "maxLength": settings.max_question_chars,
            },
        },
    }
    # The limit is in UTF-8 bytes: a character takes at least one, so longer text never fits
    # (text of multi-byte characters reaches the limit sooner; the description says so).
    text = schemas["DocumentIn"]["properties"]["text"]
    text.update(
        maxLength=settings.max_upload_bytes,
        pattern=TEXT_WITHOUT_NUL,
        description=f"UTF-8 text or markdown, at most {settings.max_upload_bytes} bytes "
        "(413 beyond)",
    )


def add_packet_rule(schemas: JsonObject, settings: Settings, has_packets: bool) -> None:
    """`packets: true` only where the server has packets, and then with fidelity `fast` and a
    mode that reads base variants only (`app.rag.with_packets`)."""
    add_base_reader_rule(schemas, settings, "packets", has_packets)


def add_conditioned_rule(schemas: JsonObject, settings: Settings, has_conditioning: bool) -> None:
    """`conditioned: true` only where the server conditions bases, and then as `packets: true`
    is, and without packets (`app.rag.with_conditioned`)."""
    add_base_reader_rule(schemas, settings, "conditioned", has_conditioning, excludes=("packets",))


def add_ape_rule(schemas: JsonObject, settings: Settings) -> None:
    """`ape: true` as `packets: true` is (every server offers it), and with neither packets nor
    conditioned bases (`app.rag.with_ape`)."""
    add_base_reader_rule(schemas, settings, "ape", True, excludes=("packets", "conditioned"))


def add_base_reader_rule(
    schemas: JsonObject,
    settings: Settings,
    flag: str,
    available: bool,
    excludes: tuple[str, ...] = (),
) -> None:
    """`flag: true` only where the server offers it (`available`), and then with fidelity `fast`,
    a mode that reads base variants only (both named where the server's defaults are not those)
    and `excludes` not true. Each flag's rule is one `if` / `then` of the schema's `allOf`."""
    for name in ("AskRequest", "ChatRequest"):
        schema = schemas[name]
        if not available:
            schema["properties"][flag]["enum"] = [False]
            continue
        readers: list[str | None] = list(base_reader_names())
        fast: list[str | None] = ["fast"]
        # a field left out or null takes the server's default: required only where that fails
        required = []
        if settings.default_mode.name in readers:
            readers.append(None)
        else:
            required.append("mode")
        if settings.fidelity is Fidelity.FAST:
            fast.append(None)
        else:
            required.append("fidelity")
        then: JsonObject = {
            "properties": {"mode": {"enum": readers}, "fidelity": {"enum": fast}},
            "required": required,
        }
        for excluded in excludes:
            then["properties"][excluded] = {"const": False}
        rule = {"if": {"properties": {flag: {"const": True}}, "required": [flag]}, "then": then}
        schema.setdefault("allOf", []).append(rule)


def add_upload_limits(document: JsonObject, settings: Settings) -> None:
    """The multipart upload's file text gets the JSON `text` field's limits (see `add_limits`).

    The body comes from the route's `openapi_extra`, a module constant that FastAPI merges
    without copying: it is copied here, so that apps with other limits do not share it."""
    post = document["paths"]["/documents"]["post"]
    post["requestBody"] = copy.deepcopy(post["requestBody"])
    file = post["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]["file"]
    file.update(maxLength=settings.max_upload_bytes, pattern=TEXT_WITHOUT_NUL)


BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def exact_integer_bounds(node: object) -> None:
    """Write integral bounds as JSON integers, in place.

    FastAPI's schema model stores bounds as floats, so 2**63 comes out as 9.223372036854776e+18:
    equal to it, but a generator working in floats cannot tell 2**63 from 2**63 + 191 that way.
    """
    if isinstance(node, dict):
        for key, value in node.items():
            if key in BOUNDS and isinstance(value, float) and value.is_integer():
                node[key] = int(value)
            else:
                exact_integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            exact_integer_bounds(value)


def _narrow(schema: JsonObject, **limits: object) -> None:
    """Add `limits` to an optional field's non-null branch (or to the field itself)."""
    branches = [b for b in schema.get("anyOf", [schema]) if b.get("type") != "null"]
    for branch in branches:
        branch.update(limits)
