from __future__ import annotations

from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        from cluster import config_yaml, power
        from cluster.monitor import set_job_context
        from ugro_site.celery import send_task

        from . import data, envs, retention, scale_probe
        from .node_jobs import node_jobs

        set_job_context(node_jobs)  # cluster's monitor polls the nodes that run a job faster
        power.on_awake(lambda _nodes: send_task("jobs.tasks.schedule_jobs"))  # a woken node takes its job now
        config_yaml.TRAINING_CHECKS["keep"] = retention.check_default  # training.keep: the retention default
        config_yaml.TRAINING_CHECKS["data"] = data.check_cluster_value  # training.data: data every job gets
        config_yaml.PATHS_CHECKS["env_ttl"] = check_env_ttl  # paths.env_ttl: how long an unused environment stays
        config_yaml.TRAINING_CHECKS["packages"] = envs.check_cluster_value  # training.packages: the default lock
        config_yaml.TRAINING_CHECKS["scale_probe"] = scale_probe.check_cluster_value  # training.scale_probe


def check_env_ttl(value) -> None:
    """cluster.yaml paths.env_ttl: a duration (14d, 36h); ValueError in one line."""
    from .limits import parse_duration

    try:
        parse_duration(str(value))
    except ValueError as exc:
        raise ValueError(str(exc).replace("time limit", "env_ttl")) from None
