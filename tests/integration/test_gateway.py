"""The REST gateway against the real broker and Redis, a real worker, and a real browser.

``fraud-pipeline gateway`` runs as a subprocess in front of a `fraud-pipeline
worker` that accepts only *signed* transactions (``FRAUD_ALLOW_UNSIGNED=false``),
so every 200 here also proves the gateway signs what it produces as the worker
expects. A second gateway, with its own topics and no worker, answers 504s.

The review page is driven in headless Chromium (Debian ``chromium`` and
``chromium-driver``, installed by ``make setup``) through selenium.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pandas as pd
import pytest
import redis
from aiokafka import AIOKafkaConsumer, TopicPartition
from workers import REPO, RULES, Topics, TxFactory, Workers, worker_env

from app.contract import ACTIONS
from app.topics import partitions_of
from pipeline.labels import parse_label
from tests.factories import new_key, stop_process, write_keys
from tools import stack
from tools.materialize import materialize

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PARTITIONS = 2
READY_TIMEOUT_S = 90.0
#: Generous: broker, Redis, worker, gateway, browser and test share 2 cores.
DECISION_TIMEOUT_S = 30.0
#: The gateway without a worker: how long it waits before its 504.
SHORT_TIMEOUT_S = 1.5
#: Per-user bucket of the gateways under test: 3 requests, then one per 20 s.
USER_BURST, USER_RATE = 3, 0.05
#: Per-API-client bucket of the gateway without a worker.
CLIENT_BURST = 2
#: The worker's rules: the defaults, except nothing is declined on score alone,
#: so an amount over 10,000 USD is always a review (the page needs one).
REVIEW_RULES = {**RULES, "version": "rules-gateway-1", "thresholds": {"review": 0.5, "decline": 1.0}}
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


# --- HTTP -------------------------------------------------------------------------------


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


def http(method: str, url: str, body: bytes | dict[str, Any] | None = None, key: str | None = None,
         *, bearer: bool = False, timeout: float = DECISION_TIMEOUT_S + 5) -> Reply:  # fmt: skip
    data = orjson.dumps(body) if isinstance(body, dict) else body
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization" if bearer else "X-API-Key"] = f"Bearer {key}" if bearer else key
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Reply(response.status, dict(response.headers), response.read())
    except urllib.error.HTTPError as err:
        return Reply(err.code, dict(err.headers), err.read())


# --- processes --------------------------------------------------------------------------


class GatewayProc:
    """`fraud-pipeline gateway` as a subprocess, signalled only by its own PID."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = stack.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tools.cli", "gateway", "--port", str(self.port)],
                cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def log(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited ({self.proc.returncode}):\n{self.log()}")
            try:
                if http("GET", f"{self.url}/healthz", timeout=2).status == 200:
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.2)
        raise AssertionError(f"gateway not healthy after {timeout:.0f} s:\n{self.log()}")

    def stop(self) -> None:
        stop_process(self.proc)


@dataclass
class Rig:
    bootstrap: str
    topics: Topics
    gateway: GatewayProc
    idle_gateway: GatewayProc
    """Its own topics and no worker: every transaction times out."""
    api_key: str
    idle_key: str
    analyst_key: str
    make_tx: TxFactory
    workers: Workers
    gateway_env: dict[str, str]
    workdir: Path


@pytest.fixture(scope="module")
def rig(
    kafka_bootstrap: str, redis_url: str, sim_frame: pd.DataFrame, trained_registry: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Rig]:  # fmt: skip
    workdir = tmp_path_factory.mktemp("gateway")
    client = redis.Redis.from_url(redis_url)
    try:
        materialize(sim_frame, client, progress=False)  # idempotent: no flush
    finally:
        client.close()
    topics, idle_topics = Topics.unique("gw"), Topics.unique("gwidle")
    asyncio.run(topics.create(kafka_bootstrap, PARTITIONS))
    asyncio.run(idle_topics.create(kafka_bootstrap, PARTITIONS))
    producers = write_keys(workdir / "producers.json", gateway=new_key())
    api_key, idle_key, analyst_key = new_key(), new_key(), new_key()
    rules = workdir / "review-rules.json"
    rules.write_text(json.dumps(REVIEW_RULES))
    env = worker_env(
        bootstrap=kafka_bootstrap, redis_url=redis_url, topics=topics, registry=trained_registry,
        workdir=workdir, partitions=PARTITIONS, FRAUD_ALLOW_UNSIGNED="false",
        FRAUD_CLIENT_KEYS_FILE=str(producers), FRAUD_RULES_PATH=str(rules),
    )  # fmt: skip
    gateway_env = {
        **env,
        "FRAUD_GATEWAY_KEYS_FILE": str(write_keys(
            # The slow client's id is fresh: its bucket (in a REDIS_URL that may outlive this run) starts full.
            workdir / "api.json", acme=api_key, **{f"slowpay-{uuid.uuid4().hex[:8]}": idle_key}
        )),
        "FRAUD_GATEWAY_ANALYST_KEYS": f"alice:{analyst_key}",
        "FRAUD_GATEWAY_TIMEOUT_S": str(DECISION_TIMEOUT_S),
        "FRAUD_RATE_USER_BURST": str(USER_BURST),
        "FRAUD_RATE_USER_PER_S": str(USER_RATE),
    }
    idle_env = {
        **gateway_env, **idle_topics.env(),
        "FRAUD_GATEWAY_TIMEOUT_S": str(SHORT_TIMEOUT_S),
        "FRAUD_GATEWAY_BURST": str(CLIENT_BURST),
        "FRAUD_GATEWAY_RATE_PER_S": str(USER_RATE),
    }  # fmt: skip
    workers = Workers(workdir, env)
    gateways: list[GatewayProc] = []
    try:
        worker = workers.start()
        gateways.append(GatewayProc(gateway_env, workdir / "gateway.log"))
        gateways.append(GatewayProc(idle_env, workdir / "gateway-idle.log"))
        for gateway in gateways:
            gateway.wait_ready()
        asyncio.run(worker.wait_for_log("Ready", READY_TIMEOUT_S))
        yield Rig(
            kafka_bootstrap, topics, gateways[0], gateways[1], api_key, idle_key, analyst_key,
            TxFactory(sim_frame, f"t-gw-{topics.transactions[-6:]}"), workers, gateway_env, workdir,
        )  # fmt: skip
    finally:
        for gateway in gateways:
            gateway.stop()
        workers.stop_all()


def decide(rig: Rig, doc: dict[str, Any], *, bearer: bool = False) -> Reply:
    reply = http("POST", f"{rig.gateway.url}/v1/transactions", doc, rig.api_key, bearer=bearer)
    if reply.status not in (200, 400, 401, 429):
        raise AssertionError(f"{reply.status} {reply.body!r}\n{rig.gateway.log()}\n{rig.workers.logs()}")
    return reply


# --- the REST call ----------------------------------------------------------------------


def test_rest_returns_the_decision_end_to_end(rig: Rig) -> None:
    doc = rig.make_tx()
    reply = decide(rig, doc, bearer=True)
    assert reply.status == 200, reply.body
    decision = reply.json()
    assert decision["transaction_id"] == doc["transaction_id"]
    assert decision["user_id"] == doc["user_id"]
    assert decision["action"] in ACTIONS and decision["action"] != "reject", decision
    assert decision["model_version"] is not None and decision["cached"] is False
    # The worker echoed the gateway's correlation id: this is the reply to *this* request.
    assert decision["correlation_id"] == reply.headers["X-Correlation-Id"]

    again = decide(rig, doc)  # the same transaction resent (X-API-Key this time)
    assert again.status == 200, again.body
    cached = again.json()
    assert cached["cached"] is True
    assert (cached["action"], cached["fraud_score"]) == (decision["action"], decision["fraud_score"])
    assert cached["correlation_id"] == again.headers["X-Correlation-Id"] != decision["correlation_id"]


def test_rest_refuses_missing_and_unknown_keys(rig: Rig) -> None:
    url = f"{rig.gateway.url}/v1/transactions"
    doc = rig.make_tx()
    for key in (None, new_key(), "not-a-key", rig.analyst_key):  # analyst keys are a separate set
        reply = http("POST", url, doc, key)
        assert reply.status == 401, (key, reply.body)
        assert reply.json()["error"]["code"] == "unauthenticated"
        assert reply.headers["WWW-Authenticate"].startswith("Bearer")
    # ... and the other way round: an API key cannot read or label the review queue.
    assert http("GET", f"{rig.gateway.url}/v1/review/decisions", key=rig.api_key).status == 401
    label = http("POST", f"{rig.gateway.url}/v1/review/{doc['transaction_id']}/label", {"label": "fraud"}, rig.api_key)
    assert label.status == 401


@pytest.mark.parametrize(
    ("body", "code", "field"),
    [
        (b"{not json", "bad_json", None),
        (b"[1, 2]", "not_an_object", None),
        ({"drop": "user_id"}, "missing_field", "user_id"),
        ({"amount": "lots"}, "wrong_type", "amount"),
        ({"currency": "XXX"}, "unknown_currency", "currency"),
        ({"timestamp": "2020-01-01T00:00:00Z"}, "timestamp_out_of_window", "timestamp"),
    ],
)
def test_rest_rejects_an_invalid_body_with_its_code(rig: Rig, body: Any, code: str, field: str | None) -> None:
    if isinstance(body, dict):
        doc = rig.make_tx()
        doc.pop(body.pop("drop", ""), None)
        body = {**doc, **body}
    reply = http("POST", f"{rig.gateway.url}/v1/transactions", body, rig.api_key)
    assert reply.status == 400, reply.body
    error = reply.json()["error"]
    assert (error["code"], error["field"]) == (code, field), error
    assert error["reason"]


def test_rest_rate_limits_a_user_burst_with_retry_after(rig: Rig) -> None:
    user = f"u-burst-{uuid.uuid4().hex[:8]}"  # a bucket of its own
    statuses = [decide(rig, rig.make_tx(user_id=user)) for _ in range(USER_BURST + 1)]
    assert [r.status for r in statuses] == [200] * USER_BURST + [429], [r.body for r in statuses]
    refused = statuses[-1]
    assert int(refused.headers["Retry-After"]) >= 1
    assert refused.json()["error"]["code"] == "rate_limited"
    # Another user of the same API client is not held back.
    assert decide(rig, rig.make_tx()).status == 200


def test_rest_times_out_with_504_then_limits_the_client(rig: Rig) -> None:
    """No worker reads the idle gateway's topics: each call waits its timeout and
    gets a 504 that says what to do; past the client's burst it gets 429 at once."""
    url = f"{rig.idle_gateway.url}/v1/transactions"
    for _ in range(CLIENT_BURST):
        doc = rig.make_tx()
        started = time.monotonic()
        reply = http("POST", url, doc, rig.idle_key)
        waited = time.monotonic() - started
        assert reply.status == 504, reply.body
        body = reply.json()
        assert body["error"]["code"] == "decision_timeout"
        assert body["transaction_id"] == doc["transaction_id"] and body["correlation_id"]
        assert "resend" in body["error"]["reason"]
        assert waited >= SHORT_TIMEOUT_S
    refused = http("POST", url, rig.make_tx(), rig.idle_key)
    assert refused.status == 429, refused.body
    assert int(refused.headers["Retry-After"]) >= 1


def test_decision_signatures_forged_decisions_are_no_answer(rig: Rig) -> None:
    """Whoever can write to ``decisions`` cannot answer for the workers: a forged
    ``approve`` with a real transaction id and the request's correlation id (read
    off ``transactions``) is refused by the gateway; a decision signed with the
    workers' key is the answer. No worker reads these topics: the test plays it."""
    from aiokafka import AIOKafkaProducer

    from pipeline.decision_signing import DecisionSigner
    from tests.factories import decision_key_files

    genuine_signer = DecisionSigner.from_file(decision_key_files()[0])
    topics = Topics.unique("gwsig")
    asyncio.run(topics.create(rig.bootstrap, PARTITIONS))
    client_key = new_key()
    env = {
        **rig.gateway_env, **topics.env(), "FRAUD_GATEWAY_TIMEOUT_S": "6",
        "FRAUD_GATEWAY_KEYS_FILE": str(write_keys(rig.workdir / "sig-api.json",
                                                  **{f"sig-{uuid.uuid4().hex[:8]}": client_key})),
    }  # fmt: skip
    gateway = GatewayProc(env, rig.workdir / "gateway-sig.log")
    try:
        gateway.wait_ready()
        keys = http("GET", f"{gateway.url}/v1/keys").json()["keys"]
        assert genuine_signer.key_id in {k["key_id"] for k in keys}

        async def answer(sign: Any) -> tuple[Reply, dict[str, Any]]:
            """POST a transaction, and answer it on ``decisions`` with ``sign(value)`` headers."""
            doc = rig.make_tx()
            consumer = AIOKafkaConsumer(bootstrap_servers=rig.bootstrap, group_id=None, auto_offset_reset="earliest")
            producer = AIOKafkaProducer(bootstrap_servers=rig.bootstrap)
            await consumer.start()
            await producer.start()
            try:
                consumer.assign([TopicPartition(topics.transactions, p) for p in range(PARTITIONS)])
                call = asyncio.ensure_future(asyncio.to_thread(
                    http, "POST", f"{gateway.url}/v1/transactions", doc, client_key))  # fmt: skip
                correlation = None
                while correlation is None:
                    for records in (await consumer.getmany(timeout_ms=500)).values():
                        for record in records:
                            if orjson.loads(record.value)["transaction_id"] == doc["transaction_id"]:
                                correlation = dict(record.headers)["correlation-id"].decode()
                decision = {
                    "transaction_id": doc["transaction_id"], "user_id": doc["user_id"], "action": "approve",
                    "score": 0.0, "reasons": [], "correlation_id": correlation, "cached": False,
                }  # fmt: skip
                value = orjson.dumps(decision)
                await producer.send_and_wait(
                    topics.decisions, value, key=doc["transaction_id"].encode(), headers=sign(value)
                )
                return await call, decision
            finally:
                await consumer.stop()
                await producer.stop()

        impostor = DecisionSigner.generate()
        forgeries = {
            "unsigned": lambda value: [],
            "unknown key": impostor.headers,
            "forged under the genuine key id": lambda value: [
                ("decision-key-id", genuine_signer.key_id.encode()), impostor.headers(value)[1]],
            "signature of another value": lambda value: genuine_signer.headers(value + b" "),
        }  # fmt: skip
        for name, sign in forgeries.items():
            reply, _ = asyncio.run(answer(sign))
            assert reply.status == 504, f"{name}: {reply.status} {reply.body!r}"
        reply, decision = asyncio.run(answer(genuine_signer.headers))
        assert reply.status == 200, reply.body
        assert reply.json()["transaction_id"] == decision["transaction_id"]
        assert reply.json()["action"] == "approve"
        assert http("GET", f"{gateway.url}/healthz").json()["unverified_decisions"] == len(forgeries)
    finally:
        gateway.stop()


def test_rest_answers_502_when_the_worker_dead_letters_the_message(rig: Rig) -> None:
    """A gateway signing with a key the worker does not know: the worker dead-letters
    every message as bad_signature, and the gateway says so at once instead of a 504."""
    wrong = write_keys(rig.workdir / "wrong-producers.json", gateway=new_key())
    gateway = GatewayProc({**rig.gateway_env, "FRAUD_CLIENT_KEYS_FILE": str(wrong)}, rig.workdir / "gateway-wrong.log")
    try:
        gateway.wait_ready()
        doc = rig.make_tx()
        reply = http("POST", f"{gateway.url}/v1/transactions", doc, rig.api_key)
    finally:
        gateway.stop()
    assert reply.status == 502, reply.body
    body = reply.json()
    assert body["error"]["code"] == "dead_lettered" and "bad_signature" in body["error"]["reason"]
    assert body["transaction_id"] == doc["transaction_id"]


def test_openapi_document_and_health(rig: Rig) -> None:
    reply = http("GET", f"{rig.gateway.url}/openapi.json")
    assert reply.status == 200 and reply.headers["Content-Type"].startswith("application/json")
    doc = json.loads(reply.body)
    assert doc["openapi"].startswith("3.1")
    post = doc["paths"]["/v1/transactions"]["post"]
    assert {"200", "400", "401", "429", "504"} <= set(post["responses"])
    schema = doc["components"]["schemas"]["Transaction"]
    assert set(schema["required"]) == {"transaction_id", "user_id", "amount", "merchant_id", "timestamp"}
    health = http("GET", f"{rig.gateway.url}/healthz")
    assert health.status == 200 and health.json()["status"] == "ok"


# --- the review page in a real browser -------------------------------------------------------


async def read_label(bootstrap: str, topic: str, transaction_id: str, timeout: float) -> bytes:
    """The first record on ``topic`` (read from offset 0) labelling ``transaction_id``."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                fetch_max_wait_ms=50, isolation_level="read_committed")  # fmt: skip
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in sorted((await partitions_of(consumer, [topic]))[topic] or ())]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for record in records:
                    if orjson.loads(record.value).get("transaction_id") == transaction_id:
                        return record.value
        raise AssertionError(f"no label for {transaction_id} on {topic} within {timeout:.0f} s")
    finally:
        await consumer.stop()


@pytest.fixture
def browser() -> Iterator[Any]:
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
    if missing:
        pytest.fail(f"{missing} not installed: `make setup` installs Debian's chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def check_png(path: Path) -> None:
    """A real screenshot: a PNG of the window's size that is not one flat colour."""
    from PIL import Image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as image:
        assert image.width >= 800 and image.height >= 600, image.size
        colours = image.convert("RGB").getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 50, f"{len(colours)} colours: blank page?"


def test_review_page_labels_a_transaction_in_a_browser(rig: Rig, browser: Any, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    doc = rig.make_tx(amount=15000.0, currency="USD")  # over 10,000 USD: forced review
    decision = decide(rig, doc).json()
    assert decision["action"] == "review", decision
    txid = doc["transaction_id"]
    card_css = f'section.card[data-transaction-id="{txid}"]'

    browser.get(f"{rig.gateway.url}/review")
    browser.find_element(By.ID, "key").send_keys(rig.analyst_key)

    def card_listed(driver: Any) -> Any:
        # The feedback record trails the decision: reload until the page lists it.
        driver.find_element(By.ID, "load").click()
        time.sleep(0.3)
        cards = driver.find_elements(By.CSS_SELECTOR, card_css)
        return cards[0] if cards else False

    card = WebDriverWait(browser, DECISION_TIMEOUT_S, poll_frequency=0.5).until(card_listed)
    text = card.text
    assert f"{decision['fraud_score']:.3f}" in text
    assert any(reason in text for reason in decision["explanation"]), text
    assert "amount_usd" in text  # the served features
    first = browser.find_elements(By.CSS_SELECTOR, "section.card")[0]
    assert first.get_attribute("data-transaction-id") == txid  # newest first
    shown = len(browser.find_elements(By.CSS_SELECTOR, "section.card"))
    assert re.fullmatch(rf"\({shown} of \d+\)", browser.find_element(By.ID, "count").text)  # never a silent cap
    assert card.get_attribute("data-risk") in ("high", "medium", "low", "unknown")
    if decision["fraud_score"] >= 0.5:  # scored: the features behind its reasons are marked
        assert card.find_elements(By.CSS_SELECTOR, ".features .reason")
    shot = tmp_path / "review-page.png"
    browser.save_screenshot(str(shot))
    check_png(shot)
    if os.environ.get("FRAUD_REVIEW_SCREENSHOT"):  # refresh the committed example (docs/review-page.png)
        shutil.copyfile(shot, os.environ["FRAUD_REVIEW_SCREENSHOT"])

    card.find_element(By.CSS_SELECTOR, 'button[data-label="fraud"]').click()
    WebDriverWait(browser, 15).until(lambda d: "labelled fraud" in d.find_element(By.CSS_SELECTOR, card_css).text)

    raw = asyncio.run(read_label(rig.bootstrap, rig.topics.labels, txid, DECISION_TIMEOUT_S))
    label = parse_label(raw)
    assert not isinstance(label, str), label
    assert (label.label, label.source, label.merchant_id) == ("fraud", "analyst", doc["merchant_id"])
    assert abs(label.labeled_at - time.time()) < 120

    # A fresh load shows the label, as read back from the labels topic.
    def shows_label(driver: Any) -> bool:
        driver.find_element(By.ID, "load").click()
        time.sleep(0.3)
        return "labelled fraud" in driver.find_element(By.CSS_SELECTOR, card_css).text

    browser.refresh()
    WebDriverWait(browser, 15, poll_frequency=0.5).until(shows_label)


# --- what a label does to a restarting worker ------------------------------------------------


async def changelog_end(bootstrap: str, topic: str) -> int:
    """Records in ``topic`` so far (highwater of a first fetch: the broker's "latest" is unreliable)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                fetch_max_wait_ms=50, isolation_level="read_committed")  # fmt: skip
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in sorted((await partitions_of(consumer, [topic]))[topic] or ())]
        if not parts:
            return 0
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        await consumer.getmany(timeout_ms=500)
        return sum(consumer.highwater(tp) or 0 for tp in parts)
    finally:
        await consumer.stop()


def test_a_worker_starting_after_an_analyst_label_becomes_ready(rig: Rig) -> None:
    """Every worker holds the whole merchant tally: a worker joining later reads
    it back from the tally's topic before it is ready, and holds the label's
    count. (As a faust GlobalTable, that recovery once failed on every record
    and the worker never became ready.)"""
    doc = rig.make_tx(amount=12000.0, currency="USD")  # a review: its merchant is known to the queue
    assert decide(rig, doc).json()["action"] == "review"
    txid = doc["transaction_id"]
    deadline = time.monotonic() + DECISION_TIMEOUT_S
    while txid not in {i["transaction_id"] for i in http("GET", f"{rig.gateway.url}/v1/review/decisions",
                                                          key=rig.analyst_key).json()["items"]}:  # fmt: skip
        assert time.monotonic() < deadline, f"{txid} never listed for review"
        time.sleep(0.3)
    reply = http("POST", f"{rig.gateway.url}/v1/review/{txid}/label", {"label": "fraud"}, rig.analyst_key)
    assert reply.status == 200 and reply.json()["merchant_id"] == doc["merchant_id"], reply.body
    changelog = f"{rig.workers.base_env['FRAUD_APP_ID']}-merchant-tally"
    deadline = time.monotonic() + DECISION_TIMEOUT_S
    while asyncio.run(changelog_end(rig.bootstrap, changelog)) == 0:  # the running worker tallied it
        assert time.monotonic() < deadline, f"no tally on {changelog}:\n{rig.workers.logs()}"
        time.sleep(0.5)
    joining = rig.workers.start()
    asyncio.run(joining.wait_for_log("Ready", READY_TIMEOUT_S))
    assert re.search(r"merchant tally restored: [1-9]\d* merchants", joining.text()), joining.log()
