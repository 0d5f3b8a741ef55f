"""The OpenAPI document: FastAPI's, plus the schemas of bodies that routes read by hand.

`POST /documents` parses its body itself (JSON or multipart, capped while streaming), so
FastAPI never sees `DocumentIn`; the route refers to it by `$ref`, and this adds it (with
any models it nests) to `components.schemas` so the document resolves.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from app.schemas.documents import DocumentIn

REF_TEMPLATE = "#/components/schemas/{model}"
HAND_READ_BODIES: tuple[type[BaseModel], ...] = (DocumentIn,)


def install_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` (and `/openapi.json`) include the hand-read body schemas."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, description=app.description,
                                   routes=app.routes)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for model in HAND_READ_BODIES:
                schema = model.model_json_schema(ref_template=REF_TEMPLATE)
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi
