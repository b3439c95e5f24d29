"""UGRO settings, read from the environment (see README, "Configuration")."""

from __future__ import annotations

import secrets
import sys
from pathlib import Path

import dj_database_url

from . import localdb
from .env import EnvError, data_dir, env_bool, env_float, env_int, env_list, env_str

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
DEBUG = env_bool("DEBUG", False)
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
if test_db := env_str("UGRO_TEST_DB_NAME", ""):
    DATABASES["default"]["TEST"] = {"NAME": test_db}

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
AXES_FAILURE_LIMIT = env_int("UGRO_LOGIN_FAILURE_LIMIT", 5, minimum=1, maximum=1000)
AXES_COOLOFF_TIME = env_float("UGRO_LOGIN_LOCKOUT_HOURS", 0.25, minimum=0.01, maximum=24 * 30)
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_VERBOSE = False
# Password reset mails a link: offered only when mail is configured (EMAIL_HOST set).
PASSWORD_RESET_ENABLED = bool(env_str("EMAIL_HOST", ""))
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
CELERY_TASK_ALWAYS_EAGER = env_bool("UGRO_TASKS_EAGER", False)
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULE = {
    "schedule-jobs": {"task": "jobs.tasks.schedule_jobs", "schedule": 10.0},
    "follow-jobs": {"task": "jobs.tasks.follow_jobs", "schedule": 5.0},
    "reconcile-jobs": {"task": "jobs.tasks.reconcile_jobs", "schedule": 5.0},
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

# UGRO behaviour.
UGRO = {
    "SYNC_WINDOW_S": env_float("UGRO_SYNC_WINDOW_S", 30.0, minimum=1.0, maximum=3600.0),
    "JOIN_TIMEOUT_S": env_int("UGRO_JOIN_TIMEOUT_S", 30, minimum=1, maximum=3600),
    "CONNECT_TIMEOUT_S": env_float("UGRO_CONNECT_TIMEOUT_S", 5.0, minimum=0.5, maximum=300.0),
    "KILL_GRACE_S": env_float("UGRO_KILL_GRACE_S", 10.0, minimum=0.0, maximum=3600.0),
    # a running rank whose node has not answered for this long is lost (docs/lifecycle.md: the 30 s budget)
    "NODE_LOST_AFTER_S": env_float("UGRO_NODE_LOST_AFTER_S", 15.0, minimum=1.0, maximum=86400.0),
    # how long a job whose failed ranks only saw a peer go away waits for the rank that went away to report
    # its own end (the cause) before it fails on what it knows
    "FAILURE_SETTLE_S": env_float("UGRO_FAILURE_SETTLE_S", 5.0, minimum=0.0, maximum=600.0),
    # how long one follow task follows before it hands its jobs to a fresh one: each hand-over delays the
    # lines of that moment by up to a second, so hand-overs are kept rare
    "FOLLOW_SECONDS": env_float("UGRO_FOLLOW_SECONDS", 600.0, minimum=1.0, maximum=3000.0),
    "FOLLOW_LEASE_S": env_float("UGRO_FOLLOW_LEASE_S", 15.0, minimum=2.0, maximum=3600.0),
    # A round of passes that took lines is followed by the next no sooner than this: lines that come
    # in bursts are taken a round's worth at a time (jobs/follow.py MIN_ROUND).
    "FOLLOW_MIN_ROUND_S": env_float("UGRO_FOLLOW_MIN_ROUND_S", 0.05, minimum=0.0, maximum=5.0),
    # how often the follower folds a job's new metric points into the charts' rollup (metrics/rollup.py)
    "ROLLUP_INTERVAL_S": env_float("UGRO_ROLLUP_INTERVAL_S", 1.0, minimum=0.0, maximum=3600.0),
    # SSH host keys (cluster/links.py): an entry here for a node is honoured as its expected key.
    "KNOWN_HOSTS": env_str("UGRO_KNOWN_HOSTS", "~/.ssh/known_hosts"),
    # a follow task follows at most this many jobs; more jobs, more follow tasks (worker threads)
    "FOLLOW_JOBS_PER_TASK": env_int("UGRO_FOLLOW_JOBS_PER_TASK", 2, minimum=1, maximum=1000),
    # Per-state time limits (docs/lifecycle.md): STARTING may last the sync window plus this (connect,
    # pre-flight); CANCELLING/FAILING are torn down again by the reconciler after the kill grace plus this.
    "STARTING_GRACE_S": env_float("UGRO_STARTING_GRACE_S", 60.0, minimum=1.0, maximum=3600.0),
    "STOPPING_RETRY_S": env_float("UGRO_STOPPING_RETRY_S", 15.0, minimum=1.0, maximum=3600.0),
    # Roles (accounts/policy.py): a launcher's highest priority and most queued jobs; a new account's role.
    "LAUNCHER_MAX_PRIORITY": env_int("UGRO_LAUNCHER_MAX_PRIORITY", 50, minimum=0, maximum=100),
    "LAUNCHER_MAX_QUEUED": env_int("UGRO_LAUNCHER_MAX_QUEUED", 10, minimum=1, maximum=100000),
    "DEFAULT_ROLE": env_str("UGRO_DEFAULT_ROLE", "viewer"),
}
if UGRO["DEFAULT_ROLE"] not in ("viewer", "launcher", "operator", "none"):
    raise EnvError("UGRO_DEFAULT_ROLE must be viewer, launcher, operator or none")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "WARNING")},
    "loggers": {"paramiko": {"level": "WARNING"}},
}

# Health monitor, pre-flight and alerts (cluster/monitor.py, jobs/preflight.py, cluster/alerts.py).
# Beat fires the poll every 5 s; each node is probed only when its adaptive interval is due.
CELERY_BEAT_SCHEDULE["poll-health"] = {"task": "cluster.tasks.poll_health", "schedule": 5.0}
CELERY_BEAT_SCHEDULE["prune-samples"] = {"task": "cluster.tasks.prune_samples", "schedule": 600.0}
UGRO.update(
    {
        "PROBE_TIMEOUT_S": env_float("UGRO_PROBE_TIMEOUT_S", 10.0, minimum=1.0),
        # Overrides of cluster.health.Thresholds, e.g. UGRO_HEALTH_GPU_TEMP_CRIT=90.
        "HEALTH_THRESHOLDS": {
            key: env_float(f"UGRO_HEALTH_{key.upper()}", default)
            for key, default in {
                "gpu_temp_warn": 80.0,
                "gpu_temp_crit": 85.0,
                "ram_warn": 90.0,
                "ram_crit": 95.0,
                "disk_warn": 90.0,
                "score_warn": 70.0,
                "score_crit": 50.0,
                "gpu_mem_free_min_mb": 1024.0,
                "cpu_warn": 95.0,
            }.items()
        },
        "PREFLIGHT_VERSION_MISMATCH": env_str("UGRO_PREFLIGHT_VERSION_MISMATCH", "fail"),
        "PREFLIGHT_DISK_FREE_GB": env_float("UGRO_PREFLIGHT_DISK_FREE_GB", 2.0, minimum=0.0),
        "PREFLIGHT_GPU_FREE_MB": env_float("UGRO_PREFLIGHT_GPU_FREE_MB", 1024.0, minimum=0.0),
        "SAMPLES_RAW_HOURS": env_float("UGRO_SAMPLES_RAW_HOURS", 24.0, minimum=1.0),
        "SAMPLES_KEEP_DAYS": env_float("UGRO_SAMPLES_KEEP_DAYS", 30.0, minimum=1.0),
    }
)
# Recovery (docs/recovery.md): checkpoints, the retry policy's cluster default, hang detection.
UGRO.update(
    {
        "CHECKPOINT_SCAN_S": env_float("UGRO_CHECKPOINT_SCAN_S", 30.0, minimum=0.1),
        "CHECKPOINT_COPY_TIMEOUT_S": env_float("UGRO_CHECKPOINT_COPY_TIMEOUT_S", 60.0, minimum=1.0),
        # failure kinds retried when a job names none (e.g. "node-lost,rendezvous"); empty: never
        "RETRY_ON": env_list("UGRO_RETRY_ON", []),
        "MAX_ATTEMPTS": env_int("UGRO_MAX_ATTEMPTS", 3, minimum=1),
        "RETRY_BACKOFF_S": env_float("UGRO_RETRY_BACKOFF_S", 10.0, minimum=0.0),
        "RETRY_BACKOFF_MAX_S": env_float("UGRO_RETRY_BACKOFF_MAX_S", 600.0, minimum=0.0),
        "HANG_MIN_S": env_float("UGRO_HANG_MIN_S", 60.0, minimum=0.1),
        "HANG_FACTOR": env_float("UGRO_HANG_FACTOR", 5.0, minimum=1.0),
        "HANG_STARTUP_S": env_float("UGRO_HANG_STARTUP_S", 600.0, minimum=1.0),  # before an attempt's first line
        "STRAGGLER_RATIO": env_float("UGRO_STRAGGLER_RATIO", 1.33, minimum=1.0),
        "STRAGGLER_WINDOWS": env_int("UGRO_STRAGGLER_WINDOWS", 3, minimum=1),
    }
)
if UGRO["PREFLIGHT_VERSION_MISMATCH"] not in ("fail", "warn"):
    raise EnvError("UGRO_PREFLIGHT_VERSION_MISMATCH must be fail or warn")
UGRO_ALERT_EMAILS = env_list("UGRO_ALERT_EMAILS", [])
UGRO_ALERT_WEBHOOK_URL = env_str("UGRO_ALERT_WEBHOOK_URL", "")
UGRO_PROMETHEUS_TOKEN = env_str("UGRO_PROMETHEUS_TOKEN", "")
MAILERS = {
    "default": {
        "BACKEND": env_str("EMAIL_BACKEND", "django.core.mail.backends.smtp.EmailBackend"),
        "OPTIONS": {
            "host": env_str("EMAIL_HOST", "localhost"),
            "port": env_int("EMAIL_PORT", 25, minimum=1),
            "username": env_str("EMAIL_HOST_USER", ""),
            "password": env_str("EMAIL_HOST_PASSWORD", ""),
            "use_tls": env_bool("EMAIL_USE_TLS", False),
            "timeout": 10,
        },
    }
}
DEFAULT_FROM_EMAIL = env_str("DEFAULT_FROM_EMAIL", "ugro@localhost")
