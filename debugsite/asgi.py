"""ASGI entry point: HTTP through the API-key gate into Django, websockets through Channels.

``manage.py serve`` fills the engine registry before handing this application
to Daphne. Run under another ASGI server (``daphne debugsite.asgi:application``),
set ``ENGINES_MODELS`` and the engines are built here, at import, from the
``ENGINES_*`` variables (see :func:`engines.registry.configure_from_env`).
"""
import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "debugsite.settings")
# Django must be set up before anything imports models, consumers or routing.
django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402

from engines import registry as engine_registry  # noqa: E402
from engines.auth import APIKeyMiddleware  # noqa: E402

if os.environ.get("ENGINES_MODELS") and not len(engine_registry.registry):
    engine_registry.configure_from_env()

application = ProtocolTypeRouter({"http": APIKeyMiddleware(django_asgi_app)})
