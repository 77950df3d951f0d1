"""The HTTP server: ``create_app(ServerConfig(...))`` or ``serve(config, host, port)``.

``app`` builds the routes; ``config`` holds the options and the API key's source; ``guards``
the key check, body limits and safe 422s; ``gate`` admission control; ``metrics`` Prometheus.
"""

from pipeline.server.app import create_app, serve
from pipeline.server.config import ServerConfig, api_key, choose_default

__all__ = ["ServerConfig", "api_key", "choose_default", "create_app", "serve"]
