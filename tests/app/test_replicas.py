"""Two `kvmosaic serve` replicas on loopback ports sharing the machine's real PostgreSQL (a
fresh database) and Redis (a private prefix), as behind a load balancer.

The tests run in order on one pair: both start at once on the empty database; an add on A
is searchable on B; a delete on A is never served by B; A's KV is a Redis hit on B; B
restarts while A ingests (A's ingest survives); B is killed during an ingest (A reclaims it
once the lease expires, and nothing half-ingested is ever retrieved).
"""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest
import redis
from sqlalchemy import text

from app.catalog import create_db_engine
from app.catalog.migrate import current_revision
from tests.app.replicas import (
    REDIS_URL,
    Replica,
    fresh_database,
    redis_prefix,
    replica_env,
    save_tiny_checkpoint,
)

pytestmark = [pytest.mark.postgres, pytest.mark.redis]

LIGHTHOUSE = {
    "title": "Hollin Point Lighthouse",
    "text": "The Hollin Point Lighthouse was first lit on 3 November "
    "1811. Its tower is 31 metres tall and its lamp burned whale oil.",
}
FERRY = {
    "title": "The Guillemot ferry",
    "text": "The Guillemot ferry crosses to Skarra island in about forty "
    "minutes, twice a day from April to October.",
}
A_LEASE_S = "900"  # longer than B's restart on a busy machine: A's ingest lives through it
B_LEASE_S = "3"  # short: when B is killed mid-ingest, A reclaims it quickly


def big_document(tag: str, sentences: int = 300) -> dict:
    """Many chunks, so that its KV phase lasts long enough to be caught mid-way."""
    body = " ".join(
        f"Ledger {tag} entry {i} records {i * 7 % 97} barrels of {tag} salt."
        for i in range(sentences)
    )
    return {"title": f"Salt ledger {tag}", "text": body}


@pytest.fixture(scope="module")
def cluster(smol_tokenizer, tmp_path_factory):
    with fresh_database() as (url, db_reason), redis_prefix() as (prefix, redis_reason):
        if url is None or prefix is None:
            pytest.skip(f"needs PostgreSQL and Redis: {db_reason or redis_reason}")
        root = tmp_path_factory.mktemp("replicas")
        model = save_tiny_checkpoint(smol_tokenizer, root / "model")
        a = Replica(
            "a", replica_env(root / "a", url, prefix, model, KVMOSAIC_INGEST_LEASE_S=A_LEASE_S)
        )
        b = Replica(
            "b", replica_env(root / "b", url, prefix, model, KVMOSAIC_INGEST_LEASE_S=B_LEASE_S)
        )
        started = [r.start() for r in (a, b)]  # at the same moment, on an empty database
        try:
            yield {"a": a, "b": b, "url": url, "prefix": prefix, "root": root, "model": model}
        finally:
            for replica in started:
                replica.stop(signal.SIGKILL)


def sql(url: str, query: str, **params) -> list:
    engine = create_db_engine(url)
    try:
        with engine.connect() as connection:
            return list(connection.execute(text(query), params))
    finally:
        engine.dispose()


def post(replica: Replica, document: dict) -> httpx.Response:
    return httpx.post(f"{replica.url}/documents", json=document, timeout=600)


def retrieved_documents(replica: Replica, question: str, top_k: int = 3) -> set[str]:
    return {c["document"] for c in replica.ask(question, top_k)["chunks"]}


def wait_for_ingest_row(url: str, title: str, timeout: float = 300.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = sql(
            url,
            "SELECT i.document_id FROM ingests i JOIN documents d ON d.id = i.document_id "
            "WHERE d.title = :t",
            t=title,
        )
        if rows:
            return rows[0][0]
        time.sleep(0.05)
    raise AssertionError(f"no ingest of {title!r} seen")


def test_both_start_at_once_on_an_empty_database(cluster):
    for replica in (cluster["a"], cluster["b"]):
        assert replica.wait_ready()["ready"] is True
    assert current_revision(cluster["url"]) == "0003"


def test_an_add_on_a_is_searchable_on_b_within_2_s(cluster):
    a, b = cluster["a"], cluster["b"]
    rows_before = b.ready()["index_rows"]
    response = post(a, LIGHTHOUSE)
    assert response.status_code == 201, response.text
    added_at, chunks = time.monotonic(), response.json()["document"]["num_chunks"]
    while b.ready()["index_rows"] < rows_before + chunks:
        assert time.monotonic() - added_at < 2.0, "B did not follow the catalog within 2 s"
        time.sleep(0.05)
    assert LIGHTHOUSE["title"] in retrieved_documents(
        b, "When was the Hollin Point Lighthouse first lit?"
    )


def test_kv_computed_by_a_is_a_redis_hit_on_b(cluster):
    a, b = cluster["a"], cluster["b"]
    assert post(a, FERRY).json()["kv_tiers"] == {"redis": 1}
    while b.ready()["index_rows"] < 2:
        time.sleep(0.05)
    hits = b.redis_hits()
    report = b.ask("How long does the Guillemot ferry take to cross?", top_k=1)
    assert [(c["document"], c["cached"]) for c in report["chunks"]] == [(FERRY["title"], True)]
    assert b.redis_hits() == hits + 1  # B never computed the ferry's KV: A's, read from Redis


def test_a_delete_on_a_is_never_retrieved_on_b(cluster):
    a, b = cluster["a"], cluster["b"]
    doc_id = post(a, LIGHTHOUSE).json()["document"]["id"]  # already there: 200, same id
    assert httpx.delete(f"{a.url}/documents/{doc_id}", timeout=60).status_code == 204
    deleted_at = time.monotonic()
    while time.monotonic() - deleted_at < 1.5:  # before and after B's follower removes it
        assert LIGHTHOUSE["title"] not in retrieved_documents(
            b, "Hollin Point Lighthouse lamp", top_k=2
        )
    assert b.ready()["index_rows"] == 1  # the ferry's chunk only


def test_restarting_b_while_a_ingests_keeps_a_document(cluster):
    a, b, url = cluster["a"], cluster["b"], cluster["url"]
    doc = big_document("west")
    outcome: dict = {}
    poster = threading.Thread(target=lambda: outcome.update(response=post(a, doc)))
    poster.start()
    document_id = wait_for_ingest_row(url, doc["title"])
    a.process.send_signal(signal.SIGSTOP)  # A stalls mid-ingest (its lease stays live)
    try:
        b.stop()
        b.start().wait_ready()  # B's start-up runs while A's ingest is half done
    finally:
        a.process.send_signal(signal.SIGCONT)
    poster.join(timeout=600)
    assert outcome["response"].status_code == 201, (
        f"{outcome['response'].text}\n{a.log()}\n{b.log()}"
    )
    chunks = sql(
        url,
        "SELECT count(*) FROM chunks WHERE document_id = :d AND embedding_row IS NOT NULL",
        d=document_id,
    )[0][0]
    assert chunks == outcome["response"].json()["document"]["num_chunks"] > 20
    assert sql(url, "SELECT count(*) FROM ingests")[0][0] == 0
    question = "How many barrels of west salt does ledger entry 12 record?"
    for replica in (a, b):
        deadline = time.monotonic() + 30
        while doc["title"] not in retrieved_documents(replica, question):
            assert time.monotonic() < deadline, f"{replica.name} never retrieved the ledger"
            time.sleep(0.2)


def test_a_replica_killed_mid_ingest_is_reclaimed_by_the_other_after_its_lease(cluster):
    """B (a 3 s lease) dies by SIGKILL during an ingest; A deletes the leftover once the lease
    has expired, and the half-ingested document is never retrieved on A meanwhile."""
    a, b, url = cluster["a"], cluster["b"], cluster["url"]
    doc = big_document("east")
    question = "How many barrels of east salt does ledger entry 12 record?"
    threading.Thread(target=lambda: _quietly(post, b, doc), daemon=True).start()
    document_id = wait_for_ingest_row(url, doc["title"])
    b.process.send_signal(signal.SIGKILL)
    b.process.wait(timeout=30)
    keys_written = {
        k
        for (k,) in sql(
            url,
            "SELECT v.store_key FROM variants v JOIN chunks c ON c.id = v.chunk_id "
            "WHERE c.document_id = :d",
            d=document_id,
        )
    }
    deadline = time.monotonic() + 120
    while sql(url, "SELECT 1 FROM documents WHERE id = :d", d=document_id):
        assert doc["title"] not in retrieved_documents(a, question)
        assert time.monotonic() < deadline, f"A never reclaimed the dead ingest:\n{a.log()}"
        time.sleep(0.5)
    assert sql(url, "SELECT count(*) FROM ingests")[0][0] == 0
    assert doc["title"] not in retrieved_documents(a, question)
    client = redis.Redis.from_url(REDIS_URL)
    try:  # the KV its variant rows recorded went with them (unrecorded KV: the orphan sweep)
        assert not any(client.exists(f"{cluster['prefix']}{k}") for k in keys_written)
    finally:
        client.close()


def _quietly(function, *args):
    try:
        function(*args)
    except httpx.HTTPError:  # the server is killed mid-request
        pass
