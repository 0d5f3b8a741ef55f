"""One router module per resource; `ROUTERS` is what the app factory mounts."""

from app.api.routes import admin, ask, chat, documents, health, web

ROUTERS = [health.router, ask.router, chat.router, documents.router, admin.router, web.router]
