"""Per-replica request stats (serving/stats.py): latency buckets and percentiles, tokens from usage or chunks,
what two web processes flushed adding up, and where they show: the services page (escaped), the API and
/metrics. The endpoint's own counting on a real daphne is tests/test_serve_proxy.py's; under load with a
replica killed, tests/test_serve.py's."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group, User
from django.test import Client
from django.utils import timezone

from accounts.tokens import create_token
from cluster.models import Node
from jobs.models import Checkpoint, Job
from serving.models import Replica, Service
from serving.stats import KEEP_S, Recorder, TokenCount, bucket, bucket_top, drop_old, percentile, recent

HOSTILE = "<script>alert(1)</script><img src=x onerror=alert(2)>"
TOKEN = "s3cret-token"


def test_a_bucket_holds_its_durations_and_a_percentile_is_at_most_10_percent_high():
    for seconds in (0.0005, 0.001, 0.0011, 0.0042, 0.25, 3.0, 599.0):
        b = bucket(seconds)
        assert (b == 0 or bucket_top(b - 1) < seconds) and seconds <= bucket_top(b) * (1 + 1e-9), seconds
        assert bucket_top(b) <= max(seconds, 0.001) * 1.1 + 1e-12
    # 98 requests at 10 ms, 2 at 1 s: the median is 10 ms, the 99th 1 s (each within its bucket's 10%)
    counts = {bucket(0.010): 98, bucket(1.0): 2}
    assert 0.010 <= percentile(counts, 0.5) <= 0.011
    assert 1.0 <= percentile(counts, 0.99) <= 1.1
    assert percentile({}, 0.5) is None


def test_tokens_come_from_usage_else_from_the_streamed_chunks_even_split_between_reads():
    # a non-streamed answer: its usage
    answer = TokenCount()
    answer.feed(b'{"choices": [{"text": "\\"completion_tokens\\": 99"}], "usage": {"prompt_tokens": 3, ')
    answer.feed(b'"completion_tokens": 7, "total_tokens": 10, "completion_tokens_details": null}}')
    assert answer.tokens == 7  # the model's text naming the field does not count: its quotes are escaped

    # a stream without usage: one token per event, [DONE] not counted, a marker split between reads seen once
    stream = TokenCount()
    for piece in (b'data: {"choices": [{"text": "a"}]}\n\nda', b'ta: {"choices": [{"text": "b"}]}\n\n',
                  b'data: {"choices": [{"text": "c"}]}\n\ndata: [DO', b"NE]\n\n"):  # fmt: skip
        stream.feed(piece)
    assert stream.tokens == 3

    # a stream whose last event carries usage (transformers serve, vLLM with include_usage): the usage
    usage = TokenCount()
    usage.feed(b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [], "usage": {"completion_')
    usage.feed(b'tokens": 12}}\n\ndata: [DONE]\n\n')
    assert usage.tokens == 12


@pytest.fixture
def service(db):
    node = Node.objects.create(name="gpu1", address="10.0.0.2", gpu_count=2)
    job = Job.objects.create(name="trained", script="train.py", state=Job.State.SUCCEEDED)
    ckpt = Checkpoint.objects.create(job=job, node=node, path="/w/checkpoint-10", size=1, mtime=0, step=10,
                                     kind=Checkpoint.Kind.DIR, ready=True)  # fmt: skip
    service = Service.objects.create(name="chat", job=job, checkpoint=ckpt, engine="custom", replicas=2,
                                     command_template="{python} engine.py --port {port}")  # fmt: skip
    Replica.objects.create(service=service, index=0, state=Replica.State.READY, node=node, port=8001,
                           gpu_indices=[0], restarts=1, note=HOSTILE)  # fmt: skip
    Replica.objects.create(service=service, index=1, state=Replica.State.STARTING, node=node, port=8002,
                           gpu_indices=[1])  # fmt: skip
    return service


def two_processes_served(service: Service) -> tuple[Replica, Replica]:
    """Two web processes' counts, flushed: each sent replica 0 thirty requests, 29 answered with 10 tokens
    (one process's in 10 ms, the other's in 200 ms) and one failed; replica 1 none."""
    first, second = service.replica_set.order_by("index")
    for latency in (0.010, 0.200):
        process = Recorder()
        for _ in range(29):
            process.record(first.pk, latency, tokens=10)
        process.record(first.pk, None, error=True)
        assert process.flush() == 1
        assert process.flush() == 0  # nothing new: nothing written
    return first, second


def test_what_two_processes_flushed_adds_up_and_old_rows_are_dropped(service):
    # given two web processes' flushed counts
    first, second = two_processes_served(service)

    # when the last minute is read
    stats = recent([Replica.objects.get(pk=first.pk), Replica.objects.get(pk=second.pk)])

    # then the processes add up: 60 requests a minute, the median at the fast half's 10 ms, the 99th at 200 ms
    s = stats[first.pk]
    assert (s.requests, s.errors, s.tokens) == (60, 2, 580)
    assert s.rps == 1.0 and round(s.tokens_per_s, 2) == 9.67
    assert 10 <= s.p50_ms <= 11 and 200 <= s.p99_ms <= 220  # failed requests have no latency
    assert (s.requests_total, s.errors_total, s.tokens_total) == (60, 2, 580)
    assert stats[second.pk].requests == 0 and stats[second.pk].p50_ms is None

    # and rows past the last minute leave the rates but stay until KEEP_S
    later = timezone.now() + timedelta(seconds=120)
    assert recent([first], now=later)[first.pk].requests == 0
    assert drop_old(now=later) == 0
    assert drop_old(now=timezone.now() + timedelta(seconds=KEEP_S + 60)) == 2
    assert Replica.objects.get(pk=first.pk).requests_total == 60  # the totals stay


def test_counts_for_a_replica_deleted_meanwhile_are_dropped(service):
    process = Recorder()
    first = service.replica_set.get(index=0)
    process.record(first.pk, 0.01)
    process.record(first.pk + 1000, 0.01)  # a replica of a service since stopped and its name taken again
    assert process.flush() == 1


@pytest.fixture
def viewer(db):
    user = User.objects.create_user("bob", password="pw-bob-12345")
    user.groups.add(Group.objects.get(name="viewer"))
    client = Client()
    client.force_login(user)
    return client


def test_the_services_page_lists_each_replica_with_its_stats_escaped(service, viewer, django_assert_max_num_queries):
    two_processes_served(service)

    with django_assert_max_num_queries(12):
        page = viewer.get("/services/")

    assert page.status_code == 200
    html = page.content.decode()
    assert 'href="/services/"' in html and 'data-service="chat"' in html
    assert HOSTILE not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    row = html.split('data-replica="0"', 1)[1].split("</tr>", 1)[0]
    assert 'data-state="ready"' in row and ">gpu1</a>" in row and "<td>0</td>" in row
    assert '<td class="num" data-stat="rps">1.00</td>' in row
    assert '<td class="num" data-stat="tokens">9.7</td>' in row
    assert 'data-stat="errors" title="2 since it was started">2</td>' in row
    assert "ms</td>" in row.split('data-stat="p50"', 1)[1].split("\n", 1)[0]
    idle = html.split('data-replica="1"', 1)[1].split("</tr>", 1)[0]
    assert 'data-state="starting"' in idle and '<td class="num" data-stat="rps">0.00</td>' in idle


def test_the_api_and_prometheus_carry_the_same_stats(service, os_account, settings):
    two_processes_served(service)
    token = create_token(os_account, "tests", "read")[1]

    api = Client().get("/api/v1/services/chat/", headers={"Authorization": f"Bearer {token}"})
    assert api.status_code == 200, api.content
    replicas = api.json()["replicas"]
    assert replicas[0]["gpus"] == [0] and replicas[0]["restarts"] == 1
    stats = replicas[0]["stats"]
    assert (stats["rps"], stats["tokens_per_s"], stats["errors"], stats["requests_total"]) == (1.0, 9.7, 2, 60)
    assert 10 <= stats["p50_ms"] <= 11 and 200 <= stats["p99_ms"] <= 220
    assert replicas[1]["stats"]["p50_ms"] is None
    listed = Client().get("/api/v1/services/", headers={"Authorization": f"Bearer {token}"}).json()["lines"]
    assert "  1.00 req/s  p50 1" in listed[2] and "errors 2" in listed[2]  # ugro serve --list prints these lines
    assert "  0.00 req/s  p50 -  errors 0" in listed[3]

    settings.UGRO_PROMETHEUS_TOKEN = TOKEN
    text = Client().get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).content.decode()
    labels = 'node="gpu1",replica="0",service="chat"'
    for line in (
        f'ugro_replica_state{{{labels},state="ready"}} 1.0',
        f"ugro_replica_restarts_total{{{labels}}} 1.0",
        f"ugro_replica_requests_total{{{labels}}} 60.0",
        f"ugro_replica_errors_total{{{labels}}} 2.0",
        f"ugro_replica_completion_tokens_total{{{labels}}} 580.0",
        f"ugro_replica_requests_per_second{{{labels}}} 1.0",
    ):
        assert line in text, line
    p99 = [x for x in text.splitlines() if x.startswith(f"ugro_replica_latency_p99_seconds{{{labels}}}")]
    assert len(p99) == 1 and 0.2 <= float(p99[0].split()[-1]) <= 0.22
    assert 'ugro_replica_requests_per_second{node="gpu1",replica="1"' in text
    assert 'ugro_replica_latency_p50_seconds{node="gpu1",replica="1"' not in text  # no request: no latency
