"""`/documents`: add by JSON or upload (idempotent), list, show, delete everything a document
owns."""

from __future__ import annotations

TEXT = (
    "# Skarra puffins\n\nAbout four thousand pairs of puffins nest on the western cliffs of "
    "Skarra. "
    "They arrive in April and leave in August. Visitors keep to the marked path because burrows "
    "collapse. "
    "Each pair raises a single chick, called a puffling, which leaves the burrow at night after "
    "six weeks."
)


def test_add_list_show_and_delete(client, services):
    added = client.post("/documents", json={"text": TEXT, "source": "tests"})
    assert added.status_code == 201, added.text
    body = added.json()
    document = body["document"]
    assert body["created"] is True and body["num_tokens"] > 0
    assert document["title"] == "Skarra puffins" and document["num_chunks"] >= 2  # 48-token chunks

    listed = client.get("/documents", params={"limit": 500}).json()
    assert document["id"] in [d["id"] for d in listed["documents"]] and listed["total"] == len(
        listed["documents"]
    )
    detail = client.get(f"/documents/{document['id']}").json()
    assert [c["ordinal"] for c in detail["chunks"]] == list(range(document["num_chunks"]))
    chunk_ids = [c["id"] for c in detail["chunks"]]
    keys = [v.store_key for c in chunk_ids for v in services.catalog.variants_of_chunk(c)]
    assert len(keys) == len(chunk_ids) and all(services.chunk_cache.store.contains(k) for k in keys)
    hits = client.post(
        "/ask", json={"question": "How many puffins nest on Skarra?", "top_k": 1, "max_tokens": 2}
    ).json()["chunks"]
    assert hits[0]["document_id"] == document["id"]

    assert client.delete(f"/documents/{document['id']}").status_code == 204
    assert client.get(f"/documents/{document['id']}").status_code == 404
    assert not set(chunk_ids) & set(services.retriever.index.ids())
    assert not any(services.chunk_cache.store.contains(k) for k in keys)
    hits = client.post(
        "/ask", json={"question": "How many puffins nest on Skarra?", "top_k": 6, "max_tokens": 2}
    ).json()["chunks"]
    assert document["id"] not in [c["document_id"] for c in hits]


def test_same_content_twice_adds_nothing(client):
    first = client.post("/documents", json={"text": "Ellery cake keeps for weeks at sea."})
    second = client.post(
        "/documents", json={"text": "Ellery cake keeps for weeks at sea.", "title": "Other"}
    )
    assert (first.status_code, second.status_code) == (201, 200)
    assert (
        second.json()["created"] is False
        and second.json()["document"]["id"] == first.json()["document"]["id"]
    )


def test_file_upload_takes_title_from_form_or_file_name(client):
    upload = client.post(
        "/documents",
        files={"file": ("tide-notes.md", b"Spring tides follow the full moon.", "text/markdown")},
    )
    assert upload.status_code == 201 and upload.json()["document"]["title"] == "tide notes"
    assert upload.json()["document"]["source"] == "upload:tide-notes.md"
    titled = client.post(
        "/documents",
        data={"title": "Neaps"},
        files={"file": ("n.txt", b"Neap tides come at the quarter moons.", "text/plain")},
    )
    assert titled.json()["document"]["title"] == "Neaps"


def test_kv_lazy_indexes_without_computing_kv_and_bad_kv_is_refused(client, services):
    added = client.post(
        "/documents", json={"text": "The lazy lighthouse keeper counted 41 gulls.", "kv": "lazy"}
    )
    assert added.status_code == 201, added.text
    body = added.json()
    assert body["kv"] == "lazy" and body["kv_tiers"] == {}
    chunks = services.catalog.chunks_of_document(body["document"]["id"])
    assert chunks and all(services.catalog.variants_of_chunk(c.id) == [] for c in chunks)
    form = client.post(
        "/documents",
        files={"file": ("lazy.md", b"# Lazy file\nEleven herons.")},
        data={"kv": "lazy"},
    )
    assert form.status_code == 201 and form.json()["kv"] == "lazy", form.text
    for bad in (
        client.post("/documents", json={"text": "x y z", "kv": "later"}),
        client.post("/documents", files={"file": ("b.md", b"# B\nbad kv")}, data={"kv": "later"}),
    ):
        assert bad.status_code == 422, bad.text
    client.delete(f"/documents/{body['document']['id']}")
    client.delete(f"/documents/{form.json()['document']['id']}")


def test_an_unfinished_ingest_is_not_listed(client, services):
    """A `kvmosaic ingest` killed mid-way leaves its document under a live lease for a while:
    the listing, its total and the detail show finished documents only; `state=ingesting`
    shows the other kind (issue #42)."""
    from app.catalog import NewChunk

    chunks = [NewChunk(f"half-ingested chunk {i}", 4, f"{i:064x}") for i in range(32)]
    crashed = services.catalog.begin_ingest(
        "killed", "Half ingested", "e" * 64, chunks, "killed-ingest", lease_s=3600.0
    )
    try:
        ready = client.get("/documents", params={"limit": 500}).json()
        assert crashed.document.id not in [d["id"] for d in ready["documents"]]
        assert ready["total"] == len(ready["documents"])
        assert client.get(f"/documents/{crashed.document.id}").status_code == 404
        ingesting = client.get("/documents", params={"state": "ingesting"}).json()
        assert [d["id"] for d in ingesting["documents"]] == [crashed.document.id] and ingesting[
            "total"
        ] == 1
        assert client.get("/documents", params={"state": "gone"}).status_code == 422
    finally:
        services.catalog.delete_document(crashed.document.id)
