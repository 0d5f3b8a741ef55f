"""`kvmosaic serve`: run the HTTP server (API, web demo, metrics) with uvicorn."""

from __future__ import annotations

from app.cli.common import add_settings_arguments, settings_from

# uvicorn's exit status when the app could not start (the lifespan failed, the port is taken)
STARTUP_FAILURE = 3


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="run the HTTP server and web demo")
    add_settings_arguments(parser)
    parser.add_argument("--host", default=None, help="overrides KVMOSAIC_HOST (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=None, help="overrides KVMOSAIC_PORT (default 8000)"
    )
    parser.add_argument(
        "--workers", type=int, default=None, help="engine threads (KVMOSAIC_WORKERS)"
    )
    parser.set_defaults(handler=run)


def run(args) -> int:
    import uvicorn

    from app.main import create_app
    from app.server import server_config
    from app.startup import start_services

    settings = settings_from(args, host=args.host, port=args.port, workers=args.workers)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    # started here, not in the app's lifespan, so that a start that fails (StartFailure) is one
    # line from `kvmosaic`, not a traceback from uvicorn
    services = start_services(settings)
    try:
        app = create_app(settings, services, announce=f"http://{host}:{settings.port}/")
        server = uvicorn.Server(server_config(app, settings))
        try:
            server.run()
        except KeyboardInterrupt:
            pass
    finally:
        services.close()
    return 0 if server.started else STARTUP_FAILURE
