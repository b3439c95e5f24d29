"""UGRO settings, read from the environment (see README, "Configuration")."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

import dj_database_url

from . import localdb
from .env import LOG_LEVELS, EnvError, data_dir, env_choice, env_email_url, env_float, env_int, env_list, env_str

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = data_dir()
DATA_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)  # a looser existing one is warned about (cluster/checks.py)
JOBS_DIR = DATA_DIR / "jobs"


def _secret_key() -> str:
    """SECRET_KEY from the environment, else one generated once and kept in the data dir."""
    key = env_str("SECRET_KEY", "")
    if key:
        return key
    path = DATA_DIR / "secret_key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = _secret_key()
DEBUG = False  # never from the environment: a debug page shows settings and source to whoever fails a request
ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    # daphne only for `manage.py runserver` (its ASGI runserver): CLI commands start faster without it
    *(["daphne"] if "runserver" in sys.argv else []),
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "axes",
    "cluster",
    "jobs",
    "metrics",
    "accounts",
    "serving",
    "rest_framework",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "api",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.auth.middleware.LoginRequiredMiddleware",
    "accounts.middleware.PolicyMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
    "axes.middleware.AxesMiddleware",  # last, as django-axes asks: turns a lockout into its 429 page
]

ROOT_URLCONF = "ugro_site.urls"
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
                "django.template.context_processors.csp",
                "ugro_site.context.controller",
            ],
        },
    },
]

WSGI_APPLICATION = None
ASGI_APPLICATION = "ugro_site.asgi.application"

# One engine, PostgreSQL, in every setup (docs/database.md): a server of yours by DATABASE_URL, else the
# private one bin/start runs in the data directory (ugro_site/localdb.py).
if _url := env_str("DATABASE_URL", ""):
    try:
        DATABASES = {"default": dj_database_url.parse(_url, conn_max_age=0)}
    except ValueError as exc:
        raise EnvError(f"DATABASE_URL is not a usable database URL: {exc}") from None
    if DATABASES["default"]["ENGINE"] != "django.db.backends.postgresql":
        raise EnvError("DATABASE_URL must be a PostgreSQL URL (postgres://...): UGRO runs on PostgreSQL only")
else:
    DATABASES = {"default": localdb.settings_dict(DATA_DIR)}

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator", "OPTIONS": {"min_length": 10}},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]
# Login throttling (django-axes): N failed logins for one user name from one address lock that pair
# out for the cool-off time; a successful login resets the count. `manage.py axes_reset` unlocks.
AUTHENTICATION_BACKENDS = [
    "ugro_site.auth.LoginThrottleBackend",
    "django.contrib.auth.backends.ModelBackend",
]
AXES_FAILURE_LIMIT = 5  # enough for a few typos; a guesser gets 5 tries per quarter hour
AXES_COOLOFF_TIME = 0.25  # hours: short enough that a locked-out user just waits, not calls an operator
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_VERBOSE = False
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = env_str("TIME_ZONE", "UTC")
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "staticfiles"

REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6379/0")
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        # The layer waits up to 5 s for a message; redis-py's own 5 s read timeout would cut that
        # wait and close idle websockets, so reads get more room than the wait.
        "CONFIG": {"hosts": [{"address": REDIS_URL, "socket_timeout": 30}], "capacity": 5000, "expiry": 30},
    }
}

# Celery: Redis is transport only; results are not needed (the DB holds every outcome).
CELERY_BROKER_URL = REDIS_URL
CELERY_BROKER_TRANSPORT = "ugro_site.broker:Transport"  # kombu's Redis transport, Redis restarts survived
CELERY_TASK_IGNORE_RESULT = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# Celery's Django fixup closes every database connection before and after each task unless this is set: the
# worker keeps each thread's connection instead, and lets it go when it is old or broken (ugro_site/celery.py
# keep_db_connections). Never reached: a count of tasks after which the fixup would close one anyway.
CELERY_DB_REUSE_MAX = 10**9
# The orphan scan (jobs/loops/orphans.py) asks every node for its tagged processes: less often than the
# per-job loops, and still soon after a cut-off node answers again.
ORPHAN_SCAN_EVERY_S = 30.0
# Every store (each node's, the controller's) brought under its size limit (jobs/cache.py); deliveries trim too.
TRIM_CACHES_EVERY_S = 600.0
CELERY_BEAT_SCHEDULE = {
    "schedule-jobs": {"task": "jobs.tasks.schedule_jobs", "schedule": 10.0},
    "follow-jobs": {"task": "jobs.tasks.follow_jobs", "schedule": 5.0},
    "reconcile-jobs": {"task": "jobs.tasks.reconcile_jobs", "schedule": 5.0},
    "scan-orphans": {"task": "jobs.tasks.scan_orphans", "schedule": ORPHAN_SCAN_EVERY_S},
    "tend-services": {"task": "serving.tasks.tend_services", "schedule": 5.0},
    "trim-caches": {"task": "jobs.tasks.trim_caches", "schedule": TRIM_CACHES_EVERY_S},
    "sleep-idle-nodes": {"task": "jobs.tasks.sleep_idle_nodes", "schedule": 15.0},  # jobs/power.py
}
CELERY_BEAT_SCHEDULER = "ugro_site.celery:LockedScheduler"  # runs in every worker; one fires (bin/worker)

from django.utils.csp import CSP  # noqa: E402

SECURE_CSP = {
    "default-src": [CSP.SELF],
    "script-src": [CSP.SELF, CSP.NONCE],
    "style-src": [CSP.SELF],
    "img-src": [CSP.SELF, "data:"],
    "connect-src": [CSP.SELF],
    "object-src": [CSP.NONE],
    "base-uri": [CSP.NONE],
    "frame-ancestors": [CSP.NONE],
}

# The REST API (api/): tokens or a logged-in session; the same policy as the pages (accounts/policy.py).
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "accounts.authentication.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["api.permissions.PolicyPermission"],
    # JSON only: people browse the API at /api/docs (DRF's own HTML pages need inline scripts our CSP refuses)
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "api.views.one_line_errors",
    "UNAUTHENTICATED_USER": "django.contrib.auth.models.AnonymousUser",
}
SPECTACULAR_SETTINGS = {
    "TITLE": "UGRO API",
    "DESCRIPTION": "Launch, watch and stop training jobs on the cluster; everything the `ugro` client does.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": ["api.permissions.PolicyPermission"],
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
}

# What a user tunes (README, "Configuration"); every other knob is a constant beside the code that uses it.
UGRO = {
    # how long torchrun waits for every node to join the rendezvous: slow-starting node envs want more
    "JOIN_TIMEOUT_S": env_int("UGRO_JOIN_TIMEOUT_S", 30, minimum=1, maximum=3600),
    # between SIGTERM and SIGKILL on cancel and failure: the script's time to save a last checkpoint
    "KILL_GRACE_S": env_float("UGRO_KILL_GRACE_S", 10.0, minimum=0.0, maximum=3600.0),
    # a running rank whose node has not answered for this long is lost (docs/lifecycle.md: the 30 s budget)
    "NODE_LOST_AFTER_S": env_float("UGRO_NODE_LOST_AFTER_S", 15.0, minimum=1.0, maximum=86400.0),
    # SSH host keys (cluster/links.py): an entry here for a node is honoured as its expected key.
    "KNOWN_HOSTS": env_str("UGRO_KNOWN_HOSTS", "~/.ssh/known_hosts"),
    # a new account's role (accounts/policy.py)
    "DEFAULT_ROLE": env_choice("UGRO_DEFAULT_ROLE", "viewer", ("viewer", "launcher", "operator", "none")),
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    # bin/worker hands the same variable to Celery's --loglevel
    "root": {"handlers": ["console"], "level": env_choice("UGRO_LOG_LEVEL", "warning", LOG_LEVELS).upper()},
    "loggers": {"paramiko": {"level": "WARNING"}},
}

# Health monitor and alerts (cluster/monitor.py, cluster/alerts.py).
# Beat fires the poll every 5 s; each node is probed only when its adaptive interval is due.
CELERY_BEAT_SCHEDULE["poll-health"] = {"task": "cluster.tasks.poll_health", "schedule": 5.0}
CELERY_BEAT_SCHEDULE["prune-samples"] = {"task": "cluster.tasks.prune_samples", "schedule": 600.0}
UGRO_ALERT_EMAILS = env_list("UGRO_ALERT_EMAILS", [])
UGRO_ALERT_WEBHOOK_URL = env_str("UGRO_ALERT_WEBHOOK_URL", "")
UGRO_PROMETHEUS_TOKEN = env_str("UGRO_PROMETHEUS_TOKEN", "")
# Mail (password reset, alerts): one URL, smtp://user:password@host:587?from=ugro@example.org (ugro_site/env.py).
_mail = env_email_url("EMAIL_URL")
MAILERS = {"default": {"BACKEND": _mail.backend, "OPTIONS": _mail.options}}
DEFAULT_FROM_EMAIL = _mail.sender
# Password reset mails a link: offered only when mail is configured.
PASSWORD_RESET_ENABLED = _mail.configured
