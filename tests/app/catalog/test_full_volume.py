"""A catalog that cannot write (issue #50): a refused write raises `CatalogUnwritable` and
stores nothing, the catalog reports itself degraded until a write works again, and a SQLite
catalog closed onto a full volume opens read-only instead of failing to start."""

from __future__ import annotations

import sqlite3

import pytest

from app.catalog import Catalog, CatalogConfig, CatalogUnwritable, NewChunk, unwritable_reason
from tests.app.volumes import catalog_full, fill, small_volume


def add(catalog: Catalog, n: int) -> int:
    """One finished document with a chunk big enough to need new pages."""
    chunks = [NewChunk(f"chunk {n} " * 400, 4, f"{n:064x}", embedding=bytes(1536))]
    added = catalog.begin_ingest("test", f"doc {n}", f"{n:064x}", chunks, "me", 30.0)
    catalog.finish_ingest(added.document.id, "me")
    return added.document.id


def test_a_refused_write_stores_nothing_and_degrades_the_catalog_until_a_write_works(tmp_path):
    catalog = Catalog.open(CatalogConfig(data_dir=tmp_path))
    try:
        add(catalog, 1)
        with catalog_full(catalog):
            with pytest.raises(CatalogUnwritable, match="database or disk is full") as refused:
                add(catalog, 2)
            assert "nothing of that write was stored" in str(refused.value)
            assert "SQLITE_FULL" in catalog.write_error and catalog.writes.failures == 1
            assert catalog.count_documents() == 1  # the refused transaction left nothing
            assert catalog.write_error is not None  # a read does not say it can write
        add(catalog, 3)  # space again: the first write that works ends the degraded state
        assert catalog.write_error is None and catalog.count_documents() == 2
    finally:
        catalog.close()


@pytest.mark.parametrize("reopen", ["by the daemon's retry", "by the next transaction"])
def test_a_catalog_closed_onto_a_full_volume_opens_read_only_and_reopens_once_it_can_write(
    tmp_path, monkeypatch, reopen
):
    """SQLite cannot even read a WAL database on a full volume (its shared-memory file
    cannot grow): the catalog serves its documents read-only, refuses writes saying why, and
    goes back to read-write once space is freed: at the daemon's retry (`recheck_writes`) or
    before the next transaction, whichever comes first."""
    with small_volume(tmp_path / "volume") as volume:
        catalog = Catalog.open(CatalogConfig(data_dir=volume))
        first = add(catalog, 1)
        catalog.close()
        filler = fill(volume)
        catalog = Catalog.open(CatalogConfig(data_dir=volume))
        try:
            assert catalog.read_only is not None and "no space left" in catalog.read_only
            assert [d.id for d in catalog.list_documents(state="ready")] == [first]
            assert catalog.write_error == catalog.read_only
            with pytest.raises(CatalogUnwritable, match="opened read-only"):
                add(catalog, 2)
            assert catalog.recheck_writes() is False and catalog.read_only is not None
            filler.unlink()
            if reopen == "by the daemon's retry":
                assert catalog.recheck_writes() is True
            else:  # the next transaction tries first: its volume has more space than last time
                monkeypatch.setattr("app.catalog.repository.REOPEN_EVERY_S", 3600.0)
                catalog.count_documents()
            assert catalog.read_only is None and catalog.write_error is None
            second = add(catalog, 2)
            assert [d.id for d in catalog.list_documents(state="ready")] == [first, second]
        finally:
            catalog.close()


def sqlite_error(code: int, name: str, message: str) -> sqlite3.Error:
    error = sqlite3.OperationalError(message)
    error.sqlite_errorcode, error.sqlite_errorname = code, name
    return error


class PgError(Exception):
    def __init__(self, sqlstate: str, message: str):
        super().__init__(message)
        self.sqlstate = sqlstate


@pytest.mark.parametrize(
    "error,expected",
    [
        (sqlite_error(13, "SQLITE_FULL", "database or disk is full"), "SQLITE_FULL"),
        (sqlite_error(4874, "SQLITE_IOERR_SHMSIZE", "disk I/O error"), "SQLITE_IOERR_SHMSIZE"),
        (sqlite_error(8, "SQLITE_READONLY", "attempt to write a readonly database"), "readonly"),
        (sqlite_error(5, "SQLITE_BUSY", "database is locked"), None),
        (sqlite_error(19, "SQLITE_CONSTRAINT", "UNIQUE constraint failed"), None),
        (PgError("53100", 'could not extend file "base/1/2": No space left on device'), "53100"),
        (PgError("23505", "duplicate key value"), None),
        (ValueError("not a database error"), None),
    ],
)
def test_which_errors_are_a_refused_write(error, expected):
    reason = unwritable_reason(error)
    assert (reason is None) if expected is None else (expected in reason)
