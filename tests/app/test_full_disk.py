"""A data volume that cannot write (issue #50): uploads are answered truthfully (a write that
committed is answered as committed, one that did not leaves nothing listed and is a 507 that
names the cause), `/readyz` and `/metrics` show the catalog and the index degraded until they
write again, and a start on a full volume serves what it has.

The faults are SQLite's own "database or disk is full" (`catalog_full`), injected write
errors, and a 6 MiB tmpfs the last test mounts and fills (skipped where it cannot mount)."""

from __future__ import annotations

import errno

import pytest
from fastapi.testclient import TestClient

import retrieval.index
from app.catalog import CatalogUnwritable
from app.main import create_app
from app.services import recheck_writes
from retrieval import SourceDocument
from tests.app.conftest import DOCS, LOCAL_CLIENT, start_services
from tests.app.volumes import catalog_full, fill, small_volume

NOTE = SourceDocument(
    "test:note",
    "The Skarra beacon",
    "The Skarra beacon was lit in 1902 by the keeper Ann Voss. It burned oil until 1960, when "
    "it was fitted with a lamp that runs on the island's wind turbine.",
)
NO_SPACE = "No space left on device"
FULL = "database or disk is full (SQLITE_FULL)"


@pytest.fixture
def fresh(tiny_loaded, embedder, tmp_path):
    services = start_services(tiny_loaded, embedder, tmp_path, docs=DOCS[:2])
    yield services
    services.close()


@pytest.fixture
def client(fresh):
    with TestClient(create_app(services=fresh), client=LOCAL_CLIENT) as client:
        yield client


def upload(client, doc=NOTE):
    return client.post("/documents", json={"title": doc.title, "text": doc.text})


def titles(client, state="ready"):
    return [
        d["title"] for d in client.get("/documents", params={"state": state}).json()["documents"]
    ]


def data_metrics(client) -> dict[str, float]:
    """`kvmosaic_data_*` samples by name and target."""
    out = {}
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("kvmosaic_data_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def refuse(monkeypatch, catalog, method: str) -> None:
    """`catalog.<method>` refuses as a full database does (noted in its health)."""

    def refused(*args, **kwargs):
        catalog.writes.failed(FULL)
        raise CatalogUnwritable(FULL)

    monkeypatch.setattr(catalog, method, refused)


def test_an_upload_the_catalog_refuses_is_a_507_naming_the_cause_and_leaves_nothing(fresh, client):
    before = titles(client)
    with catalog_full(fresh.catalog):
        response = upload(client)
        assert response.status_code == 507, response.text
        error = response.json()["error"]
        assert error["type"] == "insufficient_storage" and error["param"] is None
        assert "database or disk is full" in error["message"]
        assert "the document was not added" in error["message"]
        assert titles(client) == before and titles(client, "ingesting") == []
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json()["ready"] is True  # it serves reads
        assert ready.json()["degraded"] == ["catalog"]
        assert "database or disk is full" in ready.json()["write_errors"]["catalog"]
        metrics = data_metrics(client)
        assert metrics['kvmosaic_data_writable{target="catalog"}'] == 0.0
        assert metrics['kvmosaic_data_write_failures_total{target="catalog"}'] >= 1
        assert metrics['kvmosaic_data_writable{target="index"}'] == 1.0
    response = upload(client)  # space again
    assert response.status_code == 201 and response.json()["created"] is True
    assert titles(client) == [*before, NOTE.title]
    assert client.get("/readyz").json()["degraded"] == []
    assert data_metrics(client)['kvmosaic_data_writable{target="catalog"}'] == 1.0


def test_a_refused_commit_whose_undo_fails_too_is_not_listed_and_the_retry_adds_it_once(
    fresh, client, monkeypatch
):
    """The probe's case: the commit point and then the undo both meet the full catalog. The
    client is told nothing was added; the rows stay unlisted under their ingest row; the
    same text sent again once there is space removes them and adds the document once."""
    before = titles(client)
    refuse(monkeypatch, fresh.catalog, "finish_ingest")
    refuse(monkeypatch, fresh.catalog, "delete_document")
    response = upload(client)
    assert response.status_code == 507 and "not added" in response.json()["error"]["message"]
    assert titles(client) == before and titles(client, "ingesting") == [NOTE.title]
    monkeypatch.undo()  # space freed
    response = upload(client)
    assert response.status_code == 201 and response.json()["created"] is True, response.text
    assert titles(client) == [*before, NOTE.title] and titles(client, "ingesting") == []


def test_a_commit_that_raised_but_went_through_is_answered_as_committed(fresh, client, monkeypatch):
    """A connection lost at COMMIT: the catalog is asked, and it shows the commit."""
    real = fresh.catalog.finish_ingest

    def committed_then_raised(document_id, owner):
        real(document_id, owner)
        raise ConnectionResetError("the connection was lost at COMMIT")

    monkeypatch.setattr(fresh.catalog, "finish_ingest", committed_then_raised)
    response = upload(client)
    assert response.status_code == 201 and response.json()["created"] is True, response.text
    assert NOTE.title in titles(client)
    assert fresh.retriever.search("Who lit the Skarra beacon?", 1)[0].chunk_id in {
        c.id for c in fresh.catalog.chunks_of_document(response.json()["document"]["id"])
    }


def test_an_index_that_cannot_be_saved_after_the_commit_keeps_the_document(
    fresh, client, monkeypatch
):
    """The issue's 500-and-stored: the catalog committed, then the index file could not be
    written (and the catalog could not delete either). The document is committed, so the
    upload is a 201, it is listed and retrieved, and the index shows degraded until a save
    works; no temp file is left."""

    def full_disk(path, data):
        raise OSError(errno.ENOSPC, NO_SPACE)

    monkeypatch.setattr(retrieval.index, "_atomic_write", full_disk)
    refuse(monkeypatch, fresh.catalog, "delete_document")
    response = upload(client)
    assert response.status_code == 201 and response.json()["created"] is True, response.text
    document = response.json()["document"]["id"]
    assert NOTE.title in titles(client)
    chunks = {c.id for c in fresh.catalog.chunks_of_document(document)}
    assert fresh.retriever.search("Who lit the Skarra beacon?", 1)[0].chunk_id in chunks
    ready = client.get("/readyz").json()
    assert ready["ready"] is True and ready["degraded"] == ["index"]
    assert NO_SPACE in ready["write_errors"]["index"]
    assert data_metrics(client)['kvmosaic_data_writable{target="index"}'] == 0.0

    monkeypatch.undo()  # space freed: the daemon's retry saves the index
    recheck_writes(fresh.catalog, fresh.retriever)
    assert client.get("/readyz").json()["degraded"] == []
    assert data_metrics(client)['kvmosaic_data_writable{target="index"}'] == 1.0
    index_dir = fresh.settings.index_dir
    assert not [p.name for p in index_dir.iterdir() if p.name.startswith(".")]
    assert chunks <= set(
        retrieval.index.VectorIndex.load(
            index_dir,
            fresh.retriever.embedder.dim,
            fresh.retriever.embedder.name,
            fresh.retriever.index.ids(),
        ).ids()
    )


def test_a_delete_the_catalog_refuses_changes_nothing(fresh, client, monkeypatch):
    document = fresh.catalog.list_documents(state="ready")[0]
    chunks = {c.id for c in fresh.catalog.chunks_of_document(document.id)}
    refuse(monkeypatch, fresh.catalog, "delete_document")
    response = client.delete(f"/documents/{document.id}")
    assert response.status_code == 507, response.text
    assert "the document was not deleted" in response.json()["error"]["message"]
    assert client.get(f"/documents/{document.id}").status_code == 200
    assert chunks <= set(fresh.retriever.index.ids())  # still retrievable


def test_the_same_text_being_ingested_elsewhere_is_a_503_not_a_document_said_to_be_there(
    fresh, client
):
    """Reporting `created: false` for a document another process has not committed yet
    would acknowledge what its failure loses."""
    from app.catalog import NewChunk
    from app.ingest import content_hash

    peer = fresh.catalog.begin_ingest(
        "peer", NOTE.title, content_hash(NOTE.text), [NewChunk("x", 1, "0" * 64)], "peer", 30.0
    )
    response = upload(client)
    assert response.status_code == 503 and 1 <= int(response.headers["retry-after"]) <= 31
    assert "being ingested" in response.json()["error"]["message"]
    assert NOTE.title not in titles(client)
    fresh.catalog.delete_document(peer.document.id)
    assert upload(client).status_code == 201


@pytest.mark.parametrize("stopped", ["while full", "then filled"])
def test_a_start_on_a_full_volume_serves_what_it_has_and_recovers(
    tiny_loaded, embedder, tmp_path, caplog, stopped
):
    """The probe, on a 6 MiB tmpfs holding the whole data dir: fill it, upload, restart on
    it still full (the index stale, so it is rebuilt and cannot be saved), free space, upload
    again. Stopped while full, SQLite keeps its write-ahead log and opens as usual, and a
    probe write finds it cannot write; stopped cleanly and filled afterwards, it cannot even
    read as usual and opens read-only."""
    with small_volume(tmp_path / "data") as data:
        services = start_services(tiny_loaded, embedder, data, docs=DOCS[:2])
        kept = [d.title for d in services.catalog.list_documents(state="ready")]
        filler = fill(data)
        with TestClient(create_app(services=services), client=LOCAL_CLIENT) as client:
            response = upload(client)
            assert response.status_code == 507, response.text  # not a 500
            assert titles(client) == kept
            ready = client.get("/readyz").json()
            assert "catalog" in ready["degraded"] and "full" in ready["write_errors"]["catalog"]
        if stopped == "then filled":
            filler.unlink()
        services.close()
        for path in services.settings.index_dir.iterdir():  # a stale index: rebuilt at start
            path.unlink()
        fill(data)
        caplog.clear()
        services = start_services(tiny_loaded, embedder, data, docs=[])
        try:
            assert "serving degraded: the catalog cannot write" in caplog.text
            assert "serving degraded: the index cannot write" in caplog.text
            with TestClient(create_app(services=services), client=LOCAL_CLIENT) as client:
                assert titles(client) == kept
                ready = client.get("/readyz").json()
                assert ready["ready"] is True and {"catalog", "index"} <= set(ready["degraded"])
                cause = "opened read-only" if stopped == "then filled" else "full"
                assert cause in ready["write_errors"]["catalog"]
                assert NO_SPACE in ready["write_errors"]["index"]
                answer = client.post("/ask", json={"question": "When was the lighthouse lit?"})
                assert answer.status_code == 200, answer.text
                response = upload(client)
                assert response.status_code == 507 and cause in response.text

                filler.unlink()  # space freed: the daemon's retry finds it
                recheck_writes(services.catalog, services.retriever)
                ready = client.get("/readyz").json()
                assert "catalog" not in ready["degraded"] and "index" not in ready["degraded"]
                assert upload(client).status_code == 201
                assert titles(client) == [*kept, NOTE.title]
            index_dir = services.settings.index_dir
            assert not [p for p in index_dir.iterdir() if p.name.endswith(".tmp")]
        finally:
            services.close()
