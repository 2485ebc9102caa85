"""Django settings for the LLM engine debug server.

Everything a deployment changes comes from the environment:
``DATABASE_URL`` (default: SQLite file under ``var/``), ``REDIS_URL`` (the channel layer and the
fleet's shared state; default: the in-memory channel layer, and a fleet of this server alone),
``FLEET_NAME``, ``FLEET_KEY_TTL_S``, ``SECRET_KEY`` (default: generated once and kept in
``var/secret_key``), ``DEBUG`` and ``ALLOWED_HOSTS`` (comma-separated).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import overload

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from debugsite.cookies import cookie_names
from debugsite.secret_key import kept_secret_key

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("DEBUGSITE_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)


def _env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def _secret_key() -> str:
    """The configured key, else one generated on first start and kept on disk."""
    if os.environ.get("SECRET_KEY"):
        return os.environ["SECRET_KEY"]
    return kept_secret_key(VAR_DIR / "secret_key")


SECRET_KEY = _secret_key()
DEBUG = _env_bool("DEBUG", False)
ALLOWED_HOSTS = [h.strip() for h in os.environ.get("ALLOWED_HOSTS", "127.0.0.1,localhost,[::1]").split(",")
                 if h.strip()]
# Origins other than the server's own whose pages may post forms and open the dashboard's
# websockets (a proxy's https name, say): "https://dash.example.com,https://other.example".
CSRF_TRUSTED_ORIGINS = [o.strip() for o in os.environ.get("CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "engines",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # A 503 page, not a 500, for a view that found the database away (the staff check reads the
    # session and the user there, lazily, in the view): engines/history/middleware.py.
    "engines.history.middleware.HistoryOutageMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "debugsite.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

ASGI_APPLICATION = "debugsite.asgi.application"

DATABASES = {
    "default": dj_database_url.config(
        env="DATABASE_URL",
        default=f"sqlite:///{VAR_DIR / 'db.sqlite3'}",
        # A connection a request: after the database was away, the next request connects afresh.
        conn_max_age=0,
    )
}
# Tests that run a real server in another process need a file-backed test database.
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / "test_db.sqlite3")}
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 30
else:
    DATABASES["default"]["TEST"] = {"NAME": "test_debugsite"}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# The fleet (engines.fleet): servers sharing this Redis see one another; FLEET_NAME partitions it.
REDIS_URL = os.environ.get("REDIS_URL", "")
FLEET_NAME = os.environ.get("FLEET_NAME", "default")
# Seconds the fleet's Redis keys outlive the last beat of its last member (a day).
FLEET_KEY_TTL_S = float(os.environ.get("FLEET_KEY_TTL_S", "86400"))
# The fleet's history in the database: per-minute rollups kept this many hours, hourly ones days.
FLEET_ROLLUP_MINUTES_H = float(os.environ.get("FLEET_ROLLUP_MINUTES_H", "24"))
FLEET_ROLLUP_HOURS_D = float(os.environ.get("FLEET_ROLLUP_HOURS_D", "30"))

if os.environ.get("REDIS_URL"):
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            # redis-py pools hold at most 100 connections by default, and every dashboard socket
            # that opens takes one for its group_add: a burst of viewers would fail past that.
            "CONFIG": {"hosts": [{"address": os.environ["REDIS_URL"], "max_connections": 2000}]},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
# One time format across the product (debugsite/formats/en/formats.py says why it is a module).
FORMAT_MODULE_PATH = ["debugsite.formats"]

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "staticfiles"

LOGIN_URL = "admin:login"
# Named per port (debugsite/cookies.py says why): ``serve`` sets them from --port before it loads
# the ASGI app, whose websocket session middleware reads the name once; a bare Daphne from
# ENGINES_PORT, as engines.server.server_identity names the server.
_PORT = os.environ.get("ENGINES_PORT", "")
SESSION_COOKIE_NAME, CSRF_COOKIE_NAME = cookie_names(int(_PORT) if _PORT.isdigit() else None)

# The test suite's throwaway accounts hash with MD5, as Django advises for tests: PBKDF2's million
# rounds on every login and every superuser made were ~140 of the suite's CPU-seconds. Never set
# this where the accounts are real. PBKDF2 stays listed, to check a hash made without it.
FAST_TEST_PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher",
                              "django.contrib.auth.hashers.PBKDF2PasswordHasher"]
if _env_bool("DEBUGSITE_TEST_FAST_PASSWORD_HASHING", False):
    PASSWORD_HASHERS = FAST_TEST_PASSWORD_HASHERS

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {"engines": {"handlers": ["console"], "level": os.environ.get("ENGINES_LOG_LEVEL", "INFO")}},
}

# Trace history retention (per engine); applied on save and by `manage.py prune_history`.
@overload
def _env_non_negative(name: str, default: str) -> int: ...
@overload
def _env_non_negative(name: str, default: str, kind: type[float]) -> float: ...
def _env_non_negative(name: str, default: str, kind: type[float] = int) -> float:
    """A limit from the environment; a bad one stops start-up with a message, not every save later."""
    raw = os.environ.get(name, default)
    try:
        value = kind(raw)
    except ValueError:
        expected = "an integer" if kind is int else "a number"
        raise ImproperlyConfigured(f"{name} must be {expected}, got {raw!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ImproperlyConfigured(f"{name} must be a finite number >= 0 (0 means no limit), got {raw!r}")
    return value


# 0 means no limit (or, for the snapshot interval, no snapshots).
TRACE_RETENTION_MAX_RECORDS = _env_non_negative("TRACE_RETENTION_MAX_RECORDS", "500")
TRACE_RETENTION_MAX_DAYS = _env_non_negative("TRACE_RETENTION_MAX_DAYS", "30")
# Stored (gzip) trace payload kept per engine, in bytes: 1 GiB by default.
TRACE_RETENTION_MAX_BYTES = _env_non_negative("TRACE_RETENTION_MAX_BYTES", str(1 << 30))
METRICS_SNAPSHOT_INTERVAL_S = _env_non_negative("METRICS_SNAPSHOT_INTERVAL_S", "10", float)
METRICS_RETENTION_MAX_DAYS = _env_non_negative("METRICS_RETENTION_MAX_DAYS", "30")
