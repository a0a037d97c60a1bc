"""The balanced deployment of scripts/deploy_local.sh, end to end on loopback:
a 3+3 Redis Cluster, two `kvblend serve` and HAProxy routing by the first
document. Requests spread and a document set sticks to one server; answers
through the balancer equal each server's own; a server killed and a Redis
primary failed over while clients go on cost no wrong answer and no stored
document."""

import json
import os
import random
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request

import pytest

SOURCE = os.environ.get("KVBLEND_SOURCE_DIR", os.path.join(os.path.dirname(__file__), "..", ".."))
CLI = os.environ.get("KVBLEND_CLI", os.path.join(SOURCE, "build", "bin", "kvblend"))
MODEL = os.environ.get("KVBLEND_TEST_MODEL", os.path.join(SOURCE, "models", "stories260K.gguf"))
SCRIPT = os.path.join(SOURCE, "scripts", "deploy_local.sh")


def free_base():
    """A base port whose next 12 ports, Redis' bus ports (+10000) and a balancer pair are free (checked by binding)."""
    for _ in range(50):
        base = random.randrange(20000, 55000, 200)
        ports = list(range(base, base + 12)) + list(range(base + 10000, base + 10006)) + [base + 100, base + 101]
        socks = []
        try:
            for p in ports:
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def post(url, body, timeout=60, pad=0):
    """(status, parsed body or text) of a JSON POST (pad: that many spaces before the JSON);
    a refused connection is status 0."""
    data = (" " * pad + json.dumps(body)).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, ConnectionError) as e:
        return 0, str(e)


def requests_total(port):
    with urllib.request.urlopen("http://127.0.0.1:%d/metrics" % port, timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvblend_requests_total "):
                return int(float(line.split()[1]))
    return 0


def redis_cli(port, *args):
    out = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args], capture_output=True, text=True)
    return out.stdout.strip()


def chat(docs, question="Once upon a time"):
    return {"messages": [{"role": "user", "content": question}], "documents": docs, "max_tokens": 12,
            "temperature": 0}


def doc(i):
    return {"text": "Document %d: Tom had a red ball and a little dog named Rex number %d." % (i, i)}


@pytest.fixture(scope="module")
def deployment():
    for tool in ("redis-server", "redis-cli", "haproxy"):
        if subprocess.run(["sh", "-c", "command -v " + tool], capture_output=True).returncode != 0:
            pytest.fail(tool + " not found: run scripts/setup.sh")
    state = tempfile.mkdtemp(prefix="kvblend-deploy-test.")
    base = free_base()
    start = subprocess.run(["bash", SCRIPT, "start", "-m", MODEL, "--servers", "2", "--base-port", str(base),
                            "--port", str(base + 100), "--dir", state, "--kvblend", CLI],
                           capture_output=True, text=True, timeout=300)
    assert start.returncode == 0, start.stdout + start.stderr
    d = {"dir": state, "lb": "http://127.0.0.1:%d" % (base + 100), "base": base}
    d["servers"] = [tuple(map(int, l.split())) for l in open(os.path.join(state, "servers"))]
    d["redis"] = [tuple(map(int, l.split())) for l in open(os.path.join(state, "redis"))]
    yield d
    subprocess.run(["bash", SCRIPT, "stop", state], capture_output=True)


def test_requests_spread_and_a_document_set_sticks(deployment):
    ports = [p for p, _ in deployment["servers"]]
    before = [requests_total(p) for p in ports]
    for i in range(16):
        status, r = post(deployment["lb"] + "/v1/chat/completions", chat([doc(i), doc(100)]))
        assert status == 200, r
    spread = [requests_total(p) - b for p, b in zip(ports, before)]
    assert sum(spread) == 16 and min(spread) > 0, spread
    # the same first document: the same server every time
    before = [requests_total(p) for p in ports]
    for q in ("Once upon a time", "The dog", "Tom", "Rex ran"):
        status, r = post(deployment["lb"] + "/v1/chat/completions", chat([doc(7), doc(8)], q))
        assert status == 200, r
    took = sorted(requests_total(p) - b for p, b in zip(ports, before))
    assert took == [0, 4], took


def test_a_body_larger_than_the_balancers_buffer_reaches_a_server(deployment):
    body = chat([doc(1), doc(2)])
    _, want = post(deployment["lb"] + "/v1/chat/completions", body)
    # 200 KB of JSON whitespace first: the balancer's buffer (128 KB) sees no
    # document and sends it to the least busy server, which answers it alike
    status, r = post(deployment["lb"] + "/v1/chat/completions", body, pad=200000)
    assert status == 200, r
    assert r["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]


def test_answers_through_the_balancer_equal_each_servers_own(deployment):
    body = chat([doc(3), doc(4), doc(5)])
    _, via_lb = post(deployment["lb"] + "/v1/chat/completions", body)
    for port, _ in deployment["servers"]:
        _, direct = post("http://127.0.0.1:%d/v1/chat/completions" % port, body)
        assert direct["choices"][0]["message"]["content"] == via_lb["choices"][0]["message"]["content"]
        assert direct["usage"] == via_lb["usage"]


def test_a_killed_server_and_a_failed_over_primary_cost_no_wrong_answer(deployment):
    lb = deployment["lb"]
    # documents stored ahead, by id, and the answer each request must get
    status, stored = post(lb + "/v1/documents", {"documents": [doc(200 + i)["text"] for i in range(6)]})
    assert status == 200, stored
    ids = [d["id"] for d in stored["data"]]
    bodies = [chat([doc(i), doc(i + 1)]) for i in range(20, 32)]
    bodies += [chat([{"id": ids[i]}, {"id": ids[(i + 1) % 6]}]) for i in range(6)]
    want = []
    for b in bodies:
        status, r = post(lb + "/v1/chat/completions", b)
        assert status == 200, r
        want.append(r["choices"][0]["message"]["content"])

    answered, refused, wrong = [0], [], []
    lock = threading.Lock()
    stop = threading.Event()

    def client(seed):
        rng = random.Random(seed)
        while not stop.is_set():
            i = rng.randrange(len(bodies))
            status, r = post(lb + "/v1/chat/completions", bodies[i])
            with lock:
                if status == 200:
                    answered[0] += 1
                    if r["choices"][0]["message"]["content"] != want[i]:
                        wrong.append((i, r["choices"][0]["message"]["content"], want[i]))
                else:
                    refused.append((status, str(r)[:200]))

    threads = [threading.Thread(target=client, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.5)
    # one kvblend dies mid-load
    port, pid = deployment["servers"][1]
    os.kill(pid, signal.SIGKILL)
    time.sleep(2)
    # one Redis primary hands over to its replica (a planned failover)
    replica = next(p for p, _ in deployment["redis"] if redis_cli(p, "INFO", "replication").find("role:slave") >= 0)
    assert redis_cli(replica, "CLUSTER", "FAILOVER") == "OK"
    deadline = time.time() + 20
    while "role:master" not in redis_cli(replica, "INFO", "replication") and time.time() < deadline:
        time.sleep(0.1)
    assert "role:master" in redis_cli(replica, "INFO", "replication")
    time.sleep(2)
    stop.set()
    for t in threads:
        t.join(120)

    print("answered %d, refused %d" % (answered[0], len(refused)), refused[:3])
    assert not wrong, wrong[:3]
    assert answered[0] >= 20, (answered[0], refused[:5])
    # a refusal is a clear HTTP error from the balancer or the server, never a hang or a dropped connection
    assert all(s in (502, 503, 504) for s, _ in refused), refused[:5]
    # every stored document is still there, and still answers as before (a
    # server whose store calls failed during the failover waits out its
    # breaker's backoff, a few seconds at most, answering 503 meanwhile)
    for i in range(6):
        deadline = time.time() + 10
        status, r = post(lb + "/v1/chat/completions", bodies[12 + i])
        while status == 503 and time.time() < deadline:
            time.sleep(0.5)
            status, r = post(lb + "/v1/chat/completions", bodies[12 + i])
        assert status == 200, r
        assert r["choices"][0]["message"]["content"] == want[12 + i]
