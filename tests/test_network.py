"""The network between a job's nodes (jobs/network.py) against an in-memory agent: the interface each node uses (its
route to the master, or its env), the reach check's one-line refusal, the pre-flight's reuse of a recent measurement,
the ranks' env, and the advice's arithmetic. The measurement itself runs on real sshd nodes in
tests/test_network_e2e.py."""

from __future__ import annotations

import io
import ipaddress
from datetime import timedelta

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from cluster.links import AgentRequestError
from cluster.models import Node
from jobs import network
from jobs.launch import rank_env
from jobs.models import Job, NetCheck, Rank
from metrics.models import MetricPoint

pytestmark = pytest.mark.django_db

LOOPBACK_ADDR = "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever\n"


def addr_lines(*items: tuple[str, str]) -> str:
    return LOOPBACK_ADDR + "".join(f"{i + 2}: {dev}    inet {net} brd + scope global {dev}\\\n"
                                   for i, (dev, net) in enumerate(items))  # fmt: skip


class NetNode:
    """One node's answers: its `ip -o -4 addr show`, its route to any address, and which addresses it reaches."""

    def __init__(self, name: str, addrs: str, route: str, reaches: set[str] | None = None) -> None:
        self.name, self.addrs, self.route, self.reaches = name, addrs, route, reaches
        self.interfaces: dict | None = None  # the agent's own reading, asked where `ip` is missing
        self.requests: list[tuple[str, dict]] = []

    def request(self, op: str, timeout: float = 30.0, when_silent: bool = True, **fields) -> dict:
        self.requests.append((op, fields))
        if op == "exec" and fields["argv"][0] == "ip" and self.addrs is None:
            return {"rc": 127, "stdout": "", "stderr": "ip was not found on PATH on this node"}
        if op == "exec" and fields["argv"][:4] == ["ip", "-o", "-4", "addr"]:
            return {"rc": 0, "stdout": self.addrs, "stderr": ""}
        if op == "exec" and fields["argv"][:4] == ["ip", "-o", "route", "get"]:
            return {"rc": 0, "stdout": self.route, "stderr": ""}
        if op == "interfaces" and self.interfaces is not None:
            return self.interfaces
        if op == "listen":
            return {"listening": True, "port": 40000}
        if op == "port_check":
            ok = self.reaches is None or fields["host"] in self.reaches
            return {"ok": ok, "error": None if ok else "Connection refused", "ms": 0.1}
        raise AgentRequestError(f"the test's agent has no op {op!r} {fields.get('argv')}")


@pytest.fixture
def lan(monkeypatch):
    """gpu-master 10.0.0.1 (eth0, and docker0 172.17.0.1), gpu1 10.0.0.2 (eth0, and a VPN wg0 10.8.0.2)."""
    Node.objects.create(name="gpu-master", address="10.0.0.1", role="master", gpu_count=0,
                        torchrun_command="/opt/venv/bin/torchrun")  # fmt: skip
    Node.objects.create(
        name="gpu1", address="10.0.0.2", order=1, gpu_count=0, torchrun_command="/opt/venv/bin/torchrun"
    )
    agents = {
        "gpu-master": NetNode("gpu-master", addr_lines(("eth0", "10.0.0.1/24"), ("docker0", "172.17.0.1/16")),
                              "local 10.0.0.1 dev lo table local src 10.0.0.1 uid 0 \\    cache <local> "),
        "gpu1": NetNode("gpu1", addr_lines(("eth0", "10.0.0.2/24"), ("wg0", "10.8.0.2/24")),
                        "10.0.0.1 dev eth0 src 10.0.0.2 uid 0 \\    cache "),
    }  # fmt: skip
    monkeypatch.setattr(Node, "link", lambda node: agents[node.name])
    return agents


def nodes() -> list[Node]:
    return sorted(Node.objects.all(), key=Node.placement_key)


def test_each_node_takes_the_interface_its_route_to_the_master_leaves_by(lan):
    # when the interfaces are chosen for a CPU job on the two nodes
    choices, problems = network.choose(nodes(), "gloo")
    # then the master takes the interface holding its own address (its route to itself says lo), gpu1 its route's
    assert problems == []
    assert choices["gpu-master"].as_dict() == {
        "interface": "eth0",
        "address": "10.0.0.1",
        "source": "route to 10.0.0.1",
    }
    assert choices["gpu1"].as_dict() == {"interface": "eth0", "address": "10.0.0.2", "source": "route to 10.0.0.1"}
    # and the ranks get both variables, unless the node's env names one
    assert network.socket_env(nodes()[1], choices["gpu1"]) == {
        "NCCL_SOCKET_IFNAME": "eth0",
        "GLOO_SOCKET_IFNAME": "eth0",
    }
    Node.objects.filter(name="gpu1").update(env={"NCCL_SOCKET_IFNAME": "eth0"})
    assert network.socket_env(Node.objects.get(name="gpu1"), choices["gpu1"]) == {"GLOO_SOCKET_IFNAME": "eth0"}


def test_a_node_env_interface_wins_and_one_the_others_cannot_reach_is_refused_naming_both_addresses(lan):
    # given gpu1's env names its VPN interface, which gpu-master cannot reach
    Node.objects.filter(name="gpu1").update(env={"GLOO_SOCKET_IFNAME": "wg0"})
    lan["gpu-master"].reaches = {"10.0.0.2"}
    # when checked
    out = network.check(nodes(), reuse=True)
    # then gpu1 is refused in one line naming its address and the master's, and nothing was measured
    assert out.choices["gpu1"].as_dict() == {"interface": "wg0", "address": "10.8.0.2",
                                             "source": "GLOO_SOCKET_IFNAME in its env"}  # fmt: skip
    assert out.problems == [
        "gpu1: its interface wg0 (GLOO_SOCKET_IFNAME in its env) at 10.8.0.2 cannot be reached from "
        "gpu-master (10.0.0.1): Connection refused"
    ]
    assert out.measured is None and not NetCheck.objects.exists()
    assert not any(op == "exec" and "-c" in f["argv"] for op, f in lan["gpu1"].requests)


def test_an_env_interface_without_an_address_is_refused(lan):
    Node.objects.filter(name="gpu1").update(env={"GLOO_SOCKET_IFNAME": "eth9"})
    _, problems = network.choose(nodes(), "gloo")
    assert problems == ["gpu1: interface eth9 (GLOO_SOCKET_IFNAME in its env) has no IPv4 address there"]


def test_an_address_with_a_label_of_its_own_is_found_by_that_label_as_gloo_and_nccl_find_it(lan):
    # given gpu1 holds a second address on eth0 under a label (an alias), and its env names the label
    lan["gpu1"].addrs += "2: eth0    inet 10.0.1.2/24 brd + scope global secondary eth0:lab\\       valid_lft\n"
    assert network.parse_addresses(lan["gpu1"].addrs)["eth0:lab"] == [ipaddress.IPv4Interface("10.0.1.2/24")]
    assert network.parse_addresses(lan["gpu1"].addrs)["eth0"] == [ipaddress.IPv4Interface("10.0.0.2/24")]
    Node.objects.filter(name="gpu1").update(env={"GLOO_SOCKET_IFNAME": "eth0:lab"})
    # when chosen: that label and its own address (not eth0's first), which the others are checked to reach
    choices, problems = network.choose(nodes(), "gloo")
    assert problems == [] and (choices["gpu1"].interface, choices["gpu1"].address) == ("eth0:lab", "10.0.1.2")


def test_a_route_that_leaves_from_a_labelled_address_chooses_that_label(lan):
    # given gpu1 reaches the master from a second address of eth0, held under a label, as its route says
    lan["gpu1"].addrs += "2: eth0    inet 10.0.1.2/24 brd + scope global secondary eth0:lab\\       valid_lft\n"
    lan["gpu1"].route = "10.0.0.1 dev eth0 src 10.0.1.2 uid 0 \\    cache "
    # when chosen: the label, so that gloo binds the address the route leaves from rather than eth0's first
    choices, problems = network.choose(nodes(), "gloo")
    assert problems == [] and (choices["gpu1"].interface, choices["gpu1"].address) == ("eth0:lab", "10.0.1.2")
    # and a route from eth0's own address keeps eth0
    lan["gpu1"].route = "10.0.0.1 dev eth0 src 10.0.0.2 uid 0 \\    cache "
    assert network.choose(nodes(), "gloo")[0]["gpu1"].interface == "eth0"


def test_a_node_without_ip_is_chosen_from_its_agents_reading_else_keeps_its_collectives_own_choice(lan):
    # given a node without iproute2 (as on the lent GPU machine), whose agent reads the interfaces itself
    lan["gpu1"].addrs = None
    lan["gpu1"].interfaces = {"addresses": {"lo": ["127.0.0.1/8"], "eth0": ["10.0.0.2/24"], "wg0": ["10.8.0.2/24"]},
                              "dev": "eth0", "local": False}  # fmt: skip
    choices, problems = network.choose(nodes(), "gloo")
    # then the interface its route to the master leaves by is chosen from that reading, and set for the job
    assert problems == [] and (choices["gpu1"].interface, choices["gpu1"].address) == ("eth0", "10.0.0.2")
    assert choices["gpu1"].source == "route to 10.0.0.1 (read by UGRO's agent: no `ip` command there)"
    assert network.socket_env(nodes()[1], choices["gpu1"])["GLOO_SOCKET_IFNAME"] == "eth0"
    assert ("interfaces", {"to": "10.0.0.1"}) in lan["gpu1"].requests

    # given an agent that cannot read them either: the collective keeps its own choice, nothing is refused
    lan["gpu1"].interfaces = None
    choices, problems = network.choose(nodes(), "gloo")
    assert problems == [] and choices["gpu1"].address == "10.0.0.2" and choices["gpu1"].interface == ""
    assert choices["gpu1"].source.startswith("not chosen: no `ip` command on the node")
    assert network.socket_env(nodes()[1], choices["gpu1"]) == {}
    assert network.check_reach(nodes(), choices) == []


def test_the_agents_reading_of_interfaces_and_routes_agrees_with_ip_on_this_machine():
    # given this machine's own `ip` answers (iproute2: .ci/run installs it)
    import subprocess

    from cluster.node import agent

    addresses = network.parse_addresses(subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True,
                                                       text=True, check=True).stdout)  # fmt: skip
    for to in ("127.0.0.1", "127.0.0.5", *(str(nets[0].ip) for nets in addresses.values())):
        dev, local = network.parse_route(subprocess.run(["ip", "-o", "route", "get", to], capture_output=True,
                                                        text=True, check=True).stdout)  # fmt: skip
        # when the agent reads them with the ioctls and a UDP socket
        read = agent.op_interfaces({"to": to})
        # then the same primary addresses, whether the address is local, and for a local one an interface that
        # holds it (`ip` says lo for every local address; pick() takes the interface holding it either way)
        # (every address under the name it is listed by: an address's own label too, as a shaped-link test adds
        # on lo; a second address without one gets its interface's first prefix, so only the first's is compared)
        assert {k: [str(i.ip) for i in v] for k, v in addresses.items()} == {
            k: [a.split("/")[0] for a in v] for k, v in read["addresses"].items()
        }
        assert {k: str(v[0]) for k, v in addresses.items()} == {k: v[0] for k, v in read["addresses"].items()}
        assert read["local"] == local
        assert read["dev"] == dev or (local and any(a.startswith(to + "/") for a in read["addresses"][read["dev"]]))


def test_a_master_named_by_a_name_that_does_not_resolve_leaves_the_choice_to_each_collective(lan):
    Node.objects.filter(name="gpu-master").update(address="gpu-master.invalid")
    choices, problems = network.choose(nodes(), "gloo")
    assert problems == [] and {c.interface for c in choices.values()} == {""}
    assert choices["gpu1"].source == "not chosen: the master's name gpu-master.invalid does not resolve here"


def test_netcheck_refuses_bad_input_in_one_line(lan):
    for argv, message in (
        (["--nodes", "gpu1"], "two nodes or more"),
        (["--nodes", "gpu1,nope"], "unknown node(s): nope"),
        (["--sizes", "0,16"], "sizes: 1 to 4 whole numbers"),
        (["--sizes", "x"], "--sizes: whole"),
    ):
        with pytest.raises(CommandError, match=message.replace("(", r"\(").replace(")", r"\)")):
            call_command("netcheck", *argv, stdout=io.StringIO())
    assert not NetCheck.objects.exists() and all(not a.requests for a in lan.values())


def figures(busbw: float) -> dict:
    return {"latency_us": 100.0, "sizes": [{"bytes": 16 << 20, "seconds": 0.1, "iters": 2, "algbw": busbw,
                                            "busbw": busbw}]}  # fmt: skip


def test_a_launch_reuses_a_recent_measurement_and_sets_the_ranks_interface(lan):
    # given these nodes were measured an hour ago through the interfaces they would use now
    job = Job.objects.create(name="j", script="t.py", tag="j-tag")
    ranks = [Rank.objects.create(job=job, node=n, index=i) for i, n in enumerate(nodes())]
    interfaces = {"gpu-master": {"interface": "eth0", "address": "10.0.0.1", "source": "route to 10.0.0.1"},
                  "gpu1": {"interface": "eth0", "address": "10.0.0.2", "source": "route to 10.0.0.1"}}  # fmt: skip
    old = NetCheck.objects.create(time=timezone.now() - timedelta(hours=1), nodes=["gpu-master", "gpu1"],
                                  node_set="gpu-master,gpu1", backend="gloo", interfaces=interfaces,
                                  group=figures(1e8), pairs=[dict(figures(1e8), a="gpu-master", b="gpu1")])  # fmt: skip
    # when the launch's network part runs
    assert network.for_launch(job, ranks) == []
    # then no measurement ran (the test's agent has no torch to run it with) and the ranks carry eth0
    assert NetCheck.objects.get() == old
    assert rank_env(job, ranks[1])["GLOO_SOCKET_IFNAME"] == "eth0"
    # and a measurement past REUSE_S is not reused: the measurement is asked for (and fails here, recorded)
    NetCheck.objects.update(time=timezone.now() - timedelta(seconds=network.REUSE_S + 1))
    assert network.for_launch(job, ranks) == []
    assert NetCheck.objects.count() == 2 and "the test's agent has no op" in NetCheck.objects.first().error


def test_nodes_on_one_machine_are_not_measured_by_a_launch(lan):
    Node.objects.filter(name="gpu-master").update(address="127.0.0.2")
    Node.objects.filter(name="gpu1").update(address="127.0.0.3")
    lo = addr_lines()
    for agent, route in ((lan["gpu-master"], "local 127.0.0.2 dev lo table local src 127.0.0.1"),
                         (lan["gpu1"], "local 127.0.0.2 dev lo table local src 127.0.0.1")):  # fmt: skip
        agent.addrs, agent.route = lo, route
    out = network.check(nodes(), reuse=True)
    assert out.problems == [] and out.measured is None
    assert {c.address for c in out.choices.values()} == {"127.0.0.2", "127.0.0.3"}  # each its own, on lo
    assert out.notes == ["the nodes share one machine: the network between them was not measured"]


def test_estimate_follows_the_ring_all_reduce():
    # 3 nodes, 0.2 s compute, 0.6 s exchange: 2 nodes exchange 3/4 of that, 1 node none
    rates = network.estimate(3, 0.2, 0.6)
    assert rates[3] == pytest.approx(3 / 0.8) and rates[2] == pytest.approx(2 / (0.2 + 0.45))
    assert rates[1] == pytest.approx(1 / 0.2)
    # a faster pair than the group (the third node's link is the slow one) makes 2 nodes' exchange shorter
    assert network.estimate(3, 0.2, 0.6, {3: 1e8, 2: 4e8})[2] == pytest.approx(2 / (0.2 + 0.45 / 4))


def job_with_steps(name: str, per_rank: list[tuple[float, float]], count: int = 2, steps: int = 4) -> Job:
    """A running job on `count` nodes whose ranks logged (compute_s, sync_wait_s) at each of `steps` steps."""
    job = Job.objects.create(name=name, script="t.py", tag=f"{name}-tag", state=Job.State.RUNNING)
    for i, node in enumerate(nodes()[:count]):
        Rank.objects.create(job=job, node=node, index=i)
    now = timezone.now()
    MetricPoint.objects.bulk_create([
        MetricPoint(job=job, rank=r, step=step * 10, name=metric, value=value, time=now + timedelta(seconds=step),
                    attempt=job.attempt)
        for step in range(1, steps + 1) for r, pair in enumerate(per_rank)
        for metric, value in zip(("compute_s", "sync_wait_s"), pair, strict=True)
    ])  # fmt: skip
    return job


def test_advice_says_one_node_would_be_faster_when_the_exchange_dominates(lan):
    # given two nodes that compute 0.1 s and exchange gradients 0.5 s per step, over a measured 0.8 Gbit/s
    job = job_with_steps("slowlink", [(0.1, 0.5), (0.1, 0.52)])
    NetCheck.objects.create(
        time=timezone.now(),
        nodes=["gpu-master", "gpu1"],
        node_set="gpu-master,gpu1",
        backend="gloo",
        group=figures(1e8),
        pairs=[dict(figures(1e8), a="gpu-master", b="gpu1")],
    )
    found = network.advise(job)
    # then communication is most of the step (the least any rank waits is the exchange), and 1 node wins
    assert found.comm_s == pytest.approx(0.5) and found.step_s == pytest.approx(0.62) and found.best == 1
    assert found.speedup == pytest.approx((1 / 0.12) / (2 / 0.62))
    assert network.advice(job) == (
        "communication is 81% of a 0.62 s step (0.5 s exchanging gradients over a measured 0.8 Gbit/s bus "
        "bandwidth, 0.12 s computing, on 2 nodes); 1 node would be faster: about 2.58x the samples/s of 2."
    )


def test_advice_keeps_every_node_when_compute_dominates_and_is_silent_for_one_node(lan):
    job = job_with_steps("fastlink", [(1.0, 0.05), (0.9, 0.15)])
    found = network.advise(job)
    assert found.best == 2 and found.comm_s == pytest.approx(0.05)
    assert "(network not measured)" in found.sentence and "fewer nodes would not be faster" in found.sentence
    # 2 nodes computing 0.1 s and exchanging 0.105 s: 1 node's 10 samples/s against 2's 9.76 is not worth a node
    close = network.advise(job_with_steps("close", [(0.1, 0.105), (0.1, 0.105)]))
    assert close.best == 1 and close.speedup == pytest.approx(1.025)
    assert close.sentence.endswith("fewer nodes would be about as fast (1 node: about 1.02x the samples/s).")
    solo = job_with_steps("solo", [(1.0, 0.0)], count=1)
    assert network.advice(solo) == "" and network.advice(job_with_steps("early", [(1, 0.1), (1, 0.1)], steps=1)) == ""


def test_the_api_answers_a_refusal_with_its_line_and_bad_input_in_one_line(lan):
    from django.contrib.auth.models import Group, User
    from django.test import Client

    from accounts.tokens import create_token

    user = User.objects.create_user("carol")
    user.groups.add(Group.objects.get(name="launcher"))
    _, token = create_token(user, "laptop", "launch")
    client, auth = Client(), {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    # given gpu-master cannot reach gpu1's VPN address
    Node.objects.filter(name="gpu1").update(env={"GLOO_SOCKET_IFNAME": "wg0"})
    lan["gpu-master"].reaches = {"10.0.0.2"}
    answer = client.post("/api/v1/netcheck", {"nodes": ["gpu-master", "gpu1"]}, content_type="application/json", **auth)
    assert answer.status_code == 200 and answer.json()["ok"] is False
    assert answer.json()["problems"][0].startswith("gpu1: its interface wg0 (GLOO_SOCKET_IFNAME in its env) at 10.8")
    for body, line in (({"nodes": "gpu1"}, "nodes must be a list"), ({"sizes": [1.5]}, "sizes must be a list"),
                       ({"nodes": ["gpu1"]}, "netcheck needs two nodes or more")):  # fmt: skip
        bad = client.post("/api/v1/netcheck", body, content_type="application/json", **auth)
        assert bad.status_code == 400 and bad.json()["error"].startswith(line)
    assert not NetCheck.objects.exists()


def test_the_job_page_status_and_topology_show_the_figures(lan, admin_client):
    # given a two-node job whose steps are mostly exchange, and a measurement of its nodes
    job = job_with_steps("slowpage", [(0.1, 0.5), (0.1, 0.52)])
    NetCheck.objects.create(
        time=timezone.now(),
        nodes=["gpu-master", "gpu1"],
        node_set="gpu-master,gpu1",
        backend="gloo",
        group=figures(1e8),
        pairs=[dict(figures(1e8), a="gpu-master", b="gpu1")],
    )
    sentence = network.advice(job)
    # then the job page says it, status says it, and the cluster page shows the pair's last figures
    page = admin_client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="network-advice"' in page and "1 node would be faster: about 2.58x the samples/s of 2" in page
    out = io.StringIO()
    call_command("status", "slowpage", stdout=out)
    assert f"  network: {sentence}" in out.getvalue().splitlines()
    detail = admin_client.get("/api/v1/jobs/slowpage/").json()
    assert detail["network_advice"] == sentence and f"  network: {sentence}" in detail["lines"]
    overview = admin_client.get("/").content.decode()
    assert "gpu-master &harr; gpu1" in overview and "0.8 Gbit/s" in overview and "100 &micro;s" in overview


def test_two_nodes_are_measured_once_their_group_being_their_pair(lan, monkeypatch):
    asked = []
    monkeypatch.setattr(network, "_run", lambda nodes, choices, backend, sizes, gpus: asked.append(
        network.pairs_for(len(nodes))) or {"group": figures(2e8), "pairs": []})  # fmt: skip
    choices, _ = network.choose(nodes(), "gloo")
    row = network.measure(nodes(), choices, "gloo", [16])
    assert asked == [[]] and row.pairs == [dict(figures(2e8), a="gpu-master", b="gpu1")]
    assert network.last_pairs()[0]["rate"] == "1.6 Gbit/s" and network.pairs_for(3) == [(0, 1), (0, 2), (1, 2)]
